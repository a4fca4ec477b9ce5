"""A loopback EC2 instance metadata service speaking IMDSv2, for the spot watcher's tests.

    with ImdsServer() as imds:                 # http://127.0.0.1:<free port>
        imds.set_notice("terminate")           # spot/instance-action answers 200 from now on
        ...  # --spot-metadata-url imds.url

Protocol (as EC2's): ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` (1..21600)
returns a token; every ``GET`` must carry it in ``X-aws-ec2-metadata-token`` or gets 401 (also once the
token expired or was revoked with ``expire_tokens``). ``GET /latest/meta-data/spot/instance-action`` is 404
until a notice is set, then ``{"action": ..., "time": ...}``.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler

from tests.loopback import LoopbackServer

ACTION_PATH = "/latest/meta-data/spot/instance-action"


class ImdsServer(LoopbackServer):
    def __init__(self):
        self.lock = threading.Lock()
        self.tokens: dict[str, float] = {}      # token -> expiry (monotonic)
        self.notice: dict | None = None
        self.notice_set_at: float | None = None  # wall clock
        self.log: list[tuple[str, str, int]] = []   # (method, path, status)
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: bytes = b"", ctype: str = "text/plain") -> None:
                with imds.lock:
                    imds.log.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                if self.path != "/latest/api/token":
                    return self._reply(404)
                try:
                    ttl = int(self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", ""))
                except ValueError:
                    return self._reply(400)
                if not 1 <= ttl <= 21600:
                    return self._reply(400)
                token = secrets.token_urlsafe(24)
                with imds.lock:
                    imds.tokens[token] = time.monotonic() + ttl
                self._reply(200, token.encode())

            def do_GET(self):
                token = self.headers.get("X-aws-ec2-metadata-token")
                with imds.lock:
                    valid = token is not None and imds.tokens.get(token, 0) > time.monotonic()
                    notice = imds.notice
                if not valid:
                    return self._reply(401)
                if self.path != ACTION_PATH or notice is None:
                    return self._reply(404)
                self._reply(200, json.dumps(notice).encode(), "application/json")

        self.serve(Handler)

    def set_notice(self, action: str = "terminate", in_s: float = 120.0) -> None:
        """Announce an interruption ``in_s`` seconds from now (EC2 gives two minutes)."""
        when = datetime.now(timezone.utc) + timedelta(seconds=in_s)
        with self.lock:
            self.notice = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}
            self.notice_set_at = time.time()

    def expire_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    def statuses(self, method: str) -> list[int]:
        with self.lock:
            return [s for m, _, s in self.log if m == method]
