"""A threaded HTTP server on 127.0.0.1 for the stand-ins of remote services (S3 proxy, IMDS, FSx API)."""

from __future__ import annotations

import threading
from http.server import ThreadingHTTPServer


class LoopbackServer:
    """Serve ``handler`` on a free loopback port (``self.url``) while used as a context manager."""

    def serve(self, handler) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
