"""A loopback KFP API server for the client tests: a real ``http.server`` on 127.0.0.1.

It speaks the KFP v2beta1 REST paths that ``kfp.Client`` 2.17 (``kfp_server_api``) calls, keeps
pipelines, versions, experiments, runs and recurring runs in memory, and records every request
(method, path, query, headers, JSON body or multipart upload) so tests can assert what was sent.

    with FakeKfp() as kfp_api:
        ...  # KFP_HOST=kfp_api.url
        assert kfp_api.calls("POST", "/apis/v2beta1/runs")[0].body["display_name"] == "nightly"
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from dataclasses import dataclass, field
from email import policy
from email.parser import BytesParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import yaml

API = "/apis/v2beta1"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: dict | None = None
    files: dict[str, bytes] = field(default_factory=dict)


class FakeKfp:
    """In-memory KFP API. ``run_script``: what successive GETs of a run return, as (state, {task: state})."""

    def __init__(self, *, multi_user: bool = False, run_script: list[tuple[str, dict[str, str]]] | None = None):
        self.multi_user = multi_user
        self.run_script = run_script or [
            ("PENDING", {}),
            ("RUNNING", {"stage": "RUNNING"}),
            ("RUNNING", {"stage": "SUCCEEDED", "train": "RUNNING"}),
            ("SUCCEEDED", {"stage": "SUCCEEDED", "train": "SUCCEEDED", "evaluate": "SUCCEEDED"}),
        ]
        self.requests: list[Request] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, dict] = {}
        self.experiments: dict[str, dict] = {}
        self.runs: dict[str, dict] = {}
        self.run_polls: dict[str, int] = {}
        self.recurring: dict[str, dict] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    # --- lifecycle -----------------------------------------------------------------------------------------
    def __enter__(self) -> "FakeKfp":
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):   # keep test output clean
                pass

            def _handle(self):
                fake._dispatch(self)

            do_GET = do_POST = do_DELETE = do_PATCH = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # --- inspection -------------------------------------------------------------------------------------
    def calls(self, method: str | None = None, path: str | None = None) -> list[Request]:
        """Recorded requests, optionally only those with this method and path (query excluded)."""
        return [r for r in self.requests
                if (method is None or r.method == method) and (path is None or r.path == path)]

    # --- seeding ----------------------------------------------------------------------------------------
    def _new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids):04d}"

    def _stamp(self) -> str:
        return f"2026-01-01T00:{len(self.requests) // 60:02d}:{len(self.requests) % 60:02d}Z"

    def add_pipeline(self, name: str, versions: tuple[str, ...] = ("v1",), namespace: str = "") -> str:
        pid = self._new_id("pipeline")
        self.pipelines[pid] = {"pipeline_id": pid, "display_name": name, "namespace": namespace,
                               "created_at": self._stamp()}
        for v in versions:
            self._add_version(pid, v, {"pipelineInfo": {"name": name}})
        return pid

    def _add_version(self, pid: str, name: str, spec: dict) -> dict:
        vid = self._new_id("version")
        self.versions[vid] = {"pipeline_id": pid, "pipeline_version_id": vid, "display_name": name,
                              "created_at": self._stamp(), "pipeline_spec": spec}
        return self.versions[vid]

    # --- request handling --------------------------------------------------------------------------------
    def _dispatch(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        req = Request(h.command, parts.path, query, {k.lower(): v for k, v in h.headers.items()})
        ctype = h.headers.get("Content-Type", "")
        if raw and ctype.startswith("multipart/form-data"):
            msg = BytesParser(policy=policy.default).parsebytes(
                b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw)
            for part in msg.iter_parts():
                req.files[part.get_param("name", header="content-disposition")] = part.get_payload(decode=True)
        elif raw:
            req.body = json.loads(raw)
        with self._lock:
            self.requests.append(req)
            try:
                status, payload = self._route(req)
            except KeyError as e:
                status, payload = 404, {"code": 5, "message": f"not found: {e}"}
        data = json.dumps(payload).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _route(self, r: Request) -> tuple[int, dict]:
        for method, pattern, fn in self._routes():
            m = re.fullmatch(API + pattern, r.path)
            if m and method == r.method:
                return fn(r, *m.groups())
        return 404, {"code": 5, "message": f"no route {r.method} {r.path}"}

    def _routes(self):
        return [
            ("GET", r"/healthz", lambda r: (200, {"multi_user": self.multi_user})),
            ("POST", r"/pipelines/upload", self._upload),
            ("POST", r"/pipelines/upload_version", self._upload_version),
            ("GET", r"/pipelines", lambda r: self._list(r, self.pipelines, "pipelines")),
            ("GET", r"/pipelines/([^/]+)", lambda r, pid: (200, self.pipelines[pid])),
            ("GET", r"/pipelines/([^/]+)/versions", self._list_versions),
            ("GET", r"/pipelines/([^/]+)/versions/([^/]+)", lambda r, pid, vid: (200, self.versions[vid])),
            ("GET", r"/experiments", lambda r: self._list(r, self.experiments, "experiments")),
            ("POST", r"/experiments", self._create_experiment),
            ("GET", r"/experiments/([^/]+)", lambda r, eid: (200, self.experiments[eid])),
            ("POST", r"/runs", self._create_run),
            ("GET", r"/runs", lambda r: self._list(r, self.runs, "runs")),
            ("GET", r"/runs/([^/:]+)", self._get_run),
            ("POST", r"/recurringruns", self._create_recurring),
            # The one list whose JSON key is camelCase in KFP's API (kfp_server_api's attribute_map agrees).
            ("GET", r"/recurringruns", lambda r: self._list(r, self.recurring, "recurringRuns")),
            ("GET", r"/recurringruns/([^/:]+)", lambda r, rid: (200, self.recurring[rid])),
            ("DELETE", r"/recurringruns/([^/:]+)", self._delete_recurring),
            ("POST", r"/recurringruns/([^/:]+):enable", lambda r, rid: self._set_mode(rid, "ENABLED")),
            ("POST", r"/recurringruns/([^/:]+):disable", lambda r, rid: self._set_mode(rid, "DISABLED")),
        ]

    def _list(self, r: Request, table: dict, key: str, rows: list | None = None) -> tuple[int, dict]:
        rows = list(table.values()) if rows is None else rows
        if r.query.get("filter"):
            for p in json.loads(r.query["filter"])["predicates"]:
                assert p["operation"] in ("EQUALS", 1), p      # the only filter the CLI sends
                rows = [x for x in rows if x.get(p["key"]) == p["stringValue"]]
        if r.query.get("namespace") and key in ("pipelines", "experiments"):
            rows = [x for x in rows if x.get("namespace", "") in (r.query["namespace"], "")]
        if r.query.get("experiment_id"):
            rows = [x for x in rows if x.get("experiment_id") == r.query["experiment_id"]]
        if r.query.get("sort_by", "").endswith(" desc"):
            rows = rows[::-1]
        size = int(r.query.get("page_size") or 0)
        rows = rows[:size] if size else rows
        return 200, ({key: rows, "total_size": len(rows)} if rows else {})

    def _upload(self, r: Request) -> tuple[int, dict]:
        name = r.query["name"]
        if any(p["display_name"] == name for p in self.pipelines.values()):
            return 409, {"code": 6, "message": f"pipeline {name} already exists"}
        pid = self._new_id("pipeline")
        self.pipelines[pid] = {"pipeline_id": pid, "display_name": name, "namespace": r.query.get("namespace", ""),
                               "description": r.query.get("description", ""), "created_at": self._stamp()}
        self._add_version(pid, name, self._stored_spec(r.files["uploadfile"]))
        return 200, self.pipelines[pid]

    def _upload_version(self, r: Request) -> tuple[int, dict]:
        pid = r.query["pipelineid"]
        if pid not in self.pipelines:
            return 404, {"code": 5, "message": f"pipeline {pid} not found"}
        if any(v["pipeline_id"] == pid and v["display_name"] == r.query["name"] for v in self.versions.values()):
            return 409, {"code": 6, "message": "version exists"}
        return 200, self._add_version(pid, r.query["name"], self._stored_spec(r.files["uploadfile"]))

    @staticmethod
    def _stored_spec(package: bytes) -> dict:
        """The spec as KFP's API server keeps it: a protobuf Struct (every number a float) of the pipeline spec, or
        of ``{"pipeline_spec", "platform_spec"}`` when the package has a platform spec too."""
        docs = [d for d in yaml.safe_load_all(package) if d]
        spec = docs[0] if len(docs) == 1 else {"pipeline_spec": docs[0], "platform_spec": docs[1]}
        return json.loads(json.dumps(spec), parse_int=float)

    def _list_versions(self, r: Request, pid: str) -> tuple[int, dict]:
        rows = [v for v in self.versions.values() if v["pipeline_id"] == pid]
        return self._list(r, {}, "pipeline_versions", rows)

    def _create_experiment(self, r: Request) -> tuple[int, dict]:
        eid = self._new_id("experiment")
        self.experiments[eid] = {**r.body, "experiment_id": eid, "created_at": self._stamp()}
        return 200, self.experiments[eid]

    def _create_run(self, r: Request) -> tuple[int, dict]:
        rid = self._new_id("run")
        self.runs[rid] = {**r.body, "run_id": rid, "state": "PENDING", "created_at": self._stamp()}
        self.run_polls[rid] = 0
        return 200, self.runs[rid]

    def _get_run(self, r: Request, rid: str) -> tuple[int, dict]:
        run = self.runs[rid]
        i = min(self.run_polls[rid], len(self.run_script) - 1)
        self.run_polls[rid] += 1
        state, tasks = self.run_script[i]
        run.update(state=state, run_details={"task_details": [
            {"run_id": rid, "task_id": f"t-{n}", "display_name": n, "state": s} for n, s in tasks.items()]})
        if state in ("SUCCEEDED", "FAILED", "CANCELED"):
            run["finished_at"] = self._stamp()
        return 200, run

    def _create_recurring(self, r: Request) -> tuple[int, dict]:
        rid = self._new_id("recurring")
        self.recurring[rid] = {**r.body, "recurring_run_id": rid, "created_at": self._stamp(),
                               "status": "ENABLED" if r.body.get("mode") == "ENABLE" else "DISABLED"}
        return 200, self.recurring[rid]

    def _delete_recurring(self, r: Request, rid: str) -> tuple[int, dict]:
        del self.recurring[rid]
        return 200, {}

    def _set_mode(self, rid: str, status: str) -> tuple[int, dict]:
        self.recurring[rid]["status"] = status
        return 200, {}
