"""A real S3 endpoint for the tests: moto's server on loopback, and a fault-injecting proxy in front of it.

    with MotoS3() as s3:                               # ThreadedMotoServer on 127.0.0.1:<free port>
        s3.client().create_bucket(Bucket="data")
        with FaultProxy(s3.url, fail_every=4, max_failures=40) as proxy:
            ...  # endpoint_url=proxy.url: every 4th request answers 503 SlowDown or 500, 40 times, then none

All traffic stays on 127.0.0.1. The proxy forwards requests unchanged (moto does not check signatures)
and records what it forwarded, so tests can count the object GETs a stage made.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlsplit

from tests.loopback import LoopbackServer

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}

_ERRORS = {
    503: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
         b"<Message>Please reduce your request rate.</Message></Error>",
    500: b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code>"
         b"<Message>We encountered an internal error. Please try again.</Message></Error>",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoS3:
    """moto's S3 server in a thread of this process, on a free loopback port."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)   # one line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    def __enter__(self) -> "MotoS3":
        self.server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.stop()

    def client(self, url: str | None = None):
        import boto3
        from botocore.config import Config

        return boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",
                                     region_name="us-east-1").client(
            "s3", endpoint_url=url or self.url,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=32))

    def reset(self) -> None:
        """Drop every bucket (moto's reset endpoint)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        conn.request("POST", "/moto-api/reset")
        conn.getresponse().read()
        conn.close()


class FaultProxy(LoopbackServer):
    """Loopback HTTP proxy in front of an S3 endpoint that injects failures, delays and corruption.

    Args:
        upstream: the real endpoint's URL (http://127.0.0.1:PORT).
        fail_every: answer every N-th request with an injected error (0 = never).
        max_failures: stop injecting after this many errors (so a retrying client always gets through).
        statuses: HTTP statuses to inject, in turn: 503 (SlowDown, throttling) and/or 500 (InternalError).
        get_delay_s: sleep before forwarding each object GET (to make a stage slow enough to interrupt).
        corrupt: object keys (bucket/key) whose first GET response body gets one byte flipped.
    """

    def __init__(self, upstream: str, *, fail_every: int = 0, max_failures: int = 0,
                 statuses: tuple[int, ...] = (503, 500), get_delay_s: float = 0.0, corrupt: tuple[str, ...] = ()):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        assert parts.hostname == "127.0.0.1", "S3 traffic in tests stays on loopback"
        self.fail_every, self.max_failures, self.get_delay_s = fail_every, max_failures, get_delay_s
        self.statuses = itertools.cycle(statuses)
        self.corrupt = set(corrupt)
        self.lock = threading.Lock()
        self.requests = 0
        self.injected: Counter = Counter()      # status -> count
        self.object_gets: Counter = Counter()   # "bucket/key" -> successful (forwarded) GETs
        self.local = threading.local()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _handle(self):
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        self.serve(Handler)

    def _inject(self) -> int | None:
        with self.lock:
            self.requests += 1
            if (self.fail_every and self.requests % self.fail_every == 0
                    and sum(self.injected.values()) < self.max_failures):
                status = next(self.statuses)
                self.injected[status] += 1
                return status
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        status = self._inject()
        if status is not None:
            payload = _ERRORS[status]
            h.send_response(status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(payload)))
            h.end_headers()
            if h.command != "HEAD":
                h.wfile.write(payload)
            return
        path, _, query = h.path.partition("?")
        object_get = h.command == "GET" and path.count("/") >= 2 and not query.startswith("list-type") \
            and "list-type" not in query
        if object_get and self.get_delay_s:
            time.sleep(self.get_delay_s)
        headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "keep-alive")}
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        conn.request(h.command, h.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        name = unquote(path.lstrip("/"))
        if object_get and resp.status in (200, 206):
            with self.lock:
                self.object_gets[name] += 1
                flip = name in self.corrupt and data
                if flip:
                    self.corrupt.discard(name)
            if flip:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
        h.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length", "server",
                                 "date"):
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
