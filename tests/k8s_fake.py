"""A tiny Kubernetes API server on 127.0.0.1 for supervising tests: the real client talks real HTTP to it.

It speaks the paths the launcher uses, with the semantics that matter to it:

    POST   /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs            201, or 409 AlreadyExists
    GET    /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{name}     200 or 404
    GET    /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs?watch=1    chunked JSON lines from resourceVersion,
                                                                        ended after timeoutSeconds; 410 if compacted
    DELETE /apis/kubeflow.org/v1/namespaces/{ns}/pytorchjobs/{name}     removes the job and its pods
    GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...
    GET    /api/v1/namespaces/{ns}/pods/{pod}/log?follow=&timestamps=&sinceSeconds=&tailLines=
    GET    /api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name=...

A scenario is a function ``(kube, namespace, name)`` started in a thread when a job is created; it
plays the Training Operator and the kubelet through the helpers (``set_phase``, ``add_pod``,
``log``, ``restart_container``, ...). ``fail`` injects API errors, ``drop_streams`` cuts the open
watch and log streams (the client sees a broken connection), ``compact`` makes old resource
versions answer 410 Gone.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable
from urllib.parse import parse_qs, urlparse

JOBS = re.compile(r"^/apis/kubeflow\.org/v1/namespaces/([^/]+)/pytorchjobs(?:/([^/]+))?$")
PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods$")
LOG = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$")
EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
SECRETS = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?$")
JOB_NAME = "training.kubeflow.org/job-name"


def now_rfc3339(nanos: bool = False) -> str:
    t = time.time()
    base = datetime.fromtimestamp(int(t), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{int((t % 1) * 1e9):09d}Z" if nanos else base + "Z"


@dataclass
class Request:
    method: str
    path: str
    query: dict
    status: int = 0


@dataclass
class Fault:
    method: str
    path: str          # substring of the request path
    status: int
    times: int
    only_watch: bool = False


class FakeKube:
    def __init__(self, scenario: Callable | None = None) -> None:
        self.cond = threading.Condition()
        self.rv = 1000
        self.jobs: dict[tuple[str, str], dict] = {}
        self.history: list[tuple[int, str, str, str, dict]] = []     # (rv, ns, name, type, object)
        self.compacted = 0
        self.pods: dict[tuple[str, str], dict] = {}
        self.logs: dict[tuple[str, str, int], list[tuple[str, str]]] = {}   # (ns, pod, restart) -> lines
        self.events: list[dict] = []
        self.secrets: dict[tuple[str, str], dict] = {}     # the jobs' peer secrets
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self.created = 0
        self.drop_gen = 0
        self.watching = 0      # watch streams open
        self.closing = False
        self.scenario = scenario
        self.threads: list[threading.Thread] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    # Lifecycle ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeKube":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        for t in self.threads:
            t.join(5)

    # What the tests look at -----------------------------------------------------------------

    def calls(self, method: str, pattern: str = "", *, watch: bool | None = None) -> list[Request]:
        out = [r for r in self.requests if r.method == method and re.search(pattern, r.path)]
        if watch is not None:
            out = [r for r in out if _truthy(r.query.get("watch")) == watch]
        return out

    def job(self, ns: str, name: str) -> dict | None:
        with self.cond:
            j = self.jobs.get((ns, name))
            return copy.deepcopy(j) if j else None

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return True
            time.sleep(0.02)
        return False

    # Controls -------------------------------------------------------------------------------

    def fail(self, method: str, path: str, status: int, times: int = 1, only_watch: bool = False) -> None:
        """The next ``times`` requests matching method and path substring get ``status``."""
        with self.cond:
            self.faults.append(Fault(method, path, status, times, only_watch))

    def drop_streams(self, timeout: float = 30.0) -> None:
        """Cut every open watch and log stream without its final chunk (a broken connection); first wait until a
        watch is open (between two watches a drop would cut none)."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.watching or self.closing, timeout), "no watch to drop"
            self.drop_gen += 1
            self.cond.notify_all()

    def compact(self) -> None:
        """Resource versions up to now are gone: watching from them answers 410 Gone."""
        with self.cond:
            self.compacted = self.rv

    def put_job(self, manifest: dict, namespace: str) -> dict:
        """A job that already exists, as if created earlier (no scenario is started)."""
        with self.cond:
            return self._store_job(copy.deepcopy(manifest), namespace)

    # The operator's and kubelet's side, for scenarios ----------------------------------------

    def alive(self, ns: str, name: str) -> bool:
        with self.cond:
            return (ns, name) in self.jobs and not self.closing

    def step(self, ns: str, name: str, seconds: float) -> bool:
        """Sleep; False once the job was deleted (the scenario should stop)."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self.alive(ns, name):
                return False
            time.sleep(min(0.02, max(0.0, end - time.monotonic())))
        return self.alive(ns, name)

    def set_phase(self, ns: str, name: str, phase: str, reason: str = "", message: str = "",
                  replicas: dict | None = None) -> None:
        """Add condition ``phase`` (status True); Running/Restarting clear each other."""
        with self.cond:
            job = self.jobs.get((ns, name))
            if job is None:
                return
            status = job.setdefault("status", {})
            conds = status.setdefault("conditions", [])
            for c in conds:
                if c["type"] in ("Running", "Restarting"):     # the newest phase replaces these
                    c["status"] = "False"
            conds[:] = [c for c in conds if c["type"] != phase]
            conds.append({"type": phase, "status": "True", "reason": reason or f"PyTorchJob{phase}",
                          "message": message or f"PyTorchJob {name} is {phase.lower()}.",
                          "lastTransitionTime": now_rfc3339(), "lastUpdateTime": now_rfc3339()})
            if replicas is not None:
                status["replicaStatuses"] = replicas
            self._modified(ns, name)

    def add_pod(self, ns: str, job: str, rtype: str, index: int, *, running: bool = True) -> str:
        name = f"{job}-{rtype.lower()}-{index}"
        with self.cond:
            state = {"running": {"startedAt": now_rfc3339()}} if running else \
                {"waiting": {"reason": "ContainerCreating"}}
            self.pods[(ns, name)] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()),
                             "labels": {JOB_NAME: job, "training.kubeflow.org/replica-type": rtype.lower(),
                                        "training.kubeflow.org/replica-index": str(index)}},
                "status": {"phase": "Running" if running else "Pending",
                           "containerStatuses": [{"name": "pytorch", "image": "img", "imageID": "", "ready": running,
                                                  "restartCount": 0, "state": state}]},
            }
            self.logs[(ns, name, 0)] = []
            self.cond.notify_all()
        return name

    def log(self, ns: str, pod: str, *lines: str) -> None:
        with self.cond:
            p = self.pods.get((ns, pod))
            if p is None:
                return
            restart = p["status"]["containerStatuses"][0]["restartCount"]
            self.logs.setdefault((ns, pod, restart), []).extend((now_rfc3339(nanos=True), ln) for ln in lines)
            self.cond.notify_all()

    def terminate(self, ns: str, pod: str, exit_code: int = 0, reason: str = "Completed", message: str = "") -> None:
        with self.cond:
            p = self.pods.get((ns, pod))
            if p is None:
                return
            c = p["status"]["containerStatuses"][0]
            c["state"] = {"terminated": {"exitCode": exit_code, "reason": reason, "message": message,
                                         "finishedAt": now_rfc3339()}}
            c["ready"] = False
            p["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
            self.cond.notify_all()

    def restart_container(self, ns: str, pod: str, exit_code: int = 137, reason: str = "Error") -> None:
        """The kubelet restarts the container in place (restartPolicy OnFailure)."""
        with self.cond:
            p = self.pods.get((ns, pod))
            if p is None:
                return
            c = p["status"]["containerStatuses"][0]
            c["lastState"] = {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now_rfc3339()}}
            c["restartCount"] += 1
            c["state"] = {"running": {"startedAt": now_rfc3339()}}
            self.logs[(ns, pod, c["restartCount"])] = []
            self.cond.notify_all()

    def replace_pod(self, ns: str, pod: str) -> None:
        """The operator deletes the pod and creates it again (a new uid, e.g. after a spot reclaim)."""
        with self.cond:
            p = self.pods.get((ns, pod))
            if p is None:
                return
            labels = p["metadata"]["labels"]
            self.pods.pop((ns, pod))
            self.cond.notify_all()
        self.add_pod(ns, labels[JOB_NAME], labels["training.kubeflow.org/replica-type"],
                     int(labels["training.kubeflow.org/replica-index"]))

    def set_pod_waiting(self, ns: str, pod: str, reason: str, message: str = "") -> None:
        with self.cond:
            p = self.pods.get((ns, pod))
            if p is None:
                return
            p["status"]["phase"] = "Pending"
            p["status"]["containerStatuses"][0]["state"] = {"waiting": {"reason": reason, "message": message}}
            self.cond.notify_all()

    def add_event(self, ns: str, kind: str, name: str, reason: str, message: str, type: str = "Warning") -> None:
        with self.cond:
            self.events.append({
                "apiVersion": "v1", "kind": "Event",
                "metadata": {"name": f"{name}.{uuid.uuid4().hex[:8]}", "namespace": ns},
                "involvedObject": {"kind": kind, "name": name, "namespace": ns},
                "reason": reason, "message": message, "type": type, "count": 1,
                "firstTimestamp": now_rfc3339(), "lastTimestamp": now_rfc3339()})

    # Internals ------------------------------------------------------------------------------

    def _store_job(self, obj: dict, ns: str) -> dict:
        self.rv += 1
        meta = obj.setdefault("metadata", {})
        meta.update(namespace=ns, uid=str(uuid.uuid4()), resourceVersion=str(self.rv),
                    creationTimestamp=now_rfc3339(), generation=1)
        obj.setdefault("status", {})
        self.jobs[(ns, meta["name"])] = obj
        self.history.append((self.rv, ns, meta["name"], "ADDED", copy.deepcopy(obj)))
        self.cond.notify_all()
        return obj

    def _modified(self, ns: str, name: str) -> None:
        self.rv += 1
        job = self.jobs[(ns, name)]
        job["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, ns, name, "MODIFIED", copy.deepcopy(job)))
        self.cond.notify_all()

    def _delete_job(self, ns: str, name: str) -> None:
        job = self.jobs.pop((ns, name))
        self.rv += 1
        job["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, ns, name, "DELETED", copy.deepcopy(job)))
        for key in [k for k, p in self.pods.items() if k[0] == ns and p["metadata"]["labels"].get(JOB_NAME) == name]:
            self.pods.pop(key)
        self.cond.notify_all()

    def _take_fault(self, method: str, path: str, watch: bool) -> Fault | None:
        with self.cond:
            for f in self.faults:
                if f.times > 0 and f.method == method and f.path in path and (watch or not f.only_watch):
                    f.times -= 1
                    return f
        return None

    def _start_scenario(self, ns: str, name: str) -> None:
        if self.scenario is None:
            return

        def play():
            try:
                self.scenario(self, ns, name)
            except Exception as e:  # noqa: BLE001 - shown in the test's output
                print(f"scenario failed: {e!r}")

        t = threading.Thread(target=play, daemon=True)
        self.threads.append(t)
        t.start()


def _truthy(v) -> bool:
    return str(v).lower() in ("true", "1")


def _selector(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (text or "").split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = v.lstrip("=").strip()
    return out


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


def _handler(kube: FakeKube):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:      # quiet
            pass

        # Plumbing -----------------------------------------------------------------------------

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.req.status = code     # before the reply: a client that has it may be checked at once
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def _start_stream(self, content_type: str) -> None:
            self.req.status = 200
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _end_stream(self) -> None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _cut(self) -> None:
            # A broken connection: no final chunk, the socket just closes.
            self.wfile.flush()
            self.connection.close()

        def _route(self, method: str) -> None:
            url = urlparse(self.path)
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            self.req = Request(method, url.path, q)
            kube.requests.append(self.req)
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            fault = kube._take_fault(method, url.path, _truthy(q.get("watch")))
            if fault:
                return self._send(fault.status, _status(fault.status, "Injected", f"injected {fault.status}"))
            for pattern, fn in ((JOBS, self._jobs), (LOG, self._log), (PODS, self._pods), (EVENTS, self._events),
                                (SECRETS, self._secrets)):
                m = pattern.match(url.path)
                if m:
                    return fn(method, *m.groups(), q=q, body=body)
            self._send(404, _status(404, "NotFound", f"no route {url.path}"))

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def do_DELETE(self):
            self._route("DELETE")

        def do_PATCH(self):  # noqa: N802 - http.server's name
            self._route("PATCH")

        # Resources ----------------------------------------------------------------------------

        def _jobs(self, method, ns, name, *, q, body):
            if method == "POST":
                with kube.cond:
                    key = (ns, body.get("metadata", {}).get("name"))
                    if key in kube.jobs:
                        return self._send(409, _status(409, "AlreadyExists",
                                                       f'pytorchjobs.kubeflow.org "{key[1]}" already exists'))
                    obj = kube._store_job(copy.deepcopy(body), ns)
                    kube.created += 1
                    out = copy.deepcopy(obj)
                kube._start_scenario(ns, key[1])
                return self._send(201, out)
            if method == "DELETE":
                with kube.cond:
                    if (ns, name) not in kube.jobs:
                        return self._send(404, _status(404, "NotFound", f'pytorchjobs "{name}" not found'))
                    kube._delete_job(ns, name)
                return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success",
                                        "details": {"name": name, "propagationPolicy": body.get("propagationPolicy")}})
            if name:
                job = kube.job(ns, name)
                return self._send(200, job) if job else self._send(
                    404, _status(404, "NotFound", f'pytorchjobs.kubeflow.org "{name}" not found'))
            if _truthy(q.get("watch")):
                return self._watch(ns, q)
            with kube.cond:
                items = [copy.deepcopy(j) for (n, _), j in kube.jobs.items() if n == ns]
                rv = str(kube.rv)
            return self._send(200, {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJobList", "items": items,
                                    "metadata": {"resourceVersion": rv}})

        def _watch(self, ns, q):
            name = _selector(q.get("fieldSelector", "")).get("metadata.name")
            timeout = float(q.get("timeoutSeconds") or 30)
            since = q.get("resourceVersion")
            self._start_stream("application/json")
            deadline = time.monotonic() + timeout
            with kube.cond:
                gen = kube.drop_gen
                if since and int(since) <= kube.compacted:
                    self._chunk(json.dumps({"type": "ERROR", "object": _status(
                        410, "Expired", f"too old resource version: {since} ({kube.compacted})")}).encode() + b"\n")
                    return self._end_stream()
                if since:
                    cursor = int(since)
                    pending = []
                else:      # no version: the current state first
                    cursor = kube.rv
                    pending = [("ADDED", copy.deepcopy(j)) for (n, jn), j in kube.jobs.items()
                               if n == ns and name in (None, jn)]
                kube.watching += 1
                kube.cond.notify_all()
            while True:
                try:
                    for kind, obj in pending:
                        self._chunk(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                except OSError:
                    with kube.cond:
                        kube.watching -= 1
                    raise
                with kube.cond:
                    while True:
                        # Uncounted in the lock that decides the end: a drop_streams after it waits for the next.
                        if kube.drop_gen != gen:
                            kube.watching -= 1
                            return self._cut()
                        if kube.closing or time.monotonic() >= deadline:
                            kube.watching -= 1
                            return self._end_stream()
                        new = [h for h in kube.history if h[0] > cursor and h[1] == ns and name in (None, h[2])]
                        if new:
                            break
                        kube.cond.wait(max(0.0, min(0.2, deadline - time.monotonic())))
                    cursor = new[-1][0]
                    pending = [(h[3], h[4]) for h in new]

        def _pods(self, method, ns, *, q, body):
            want = _selector(q.get("labelSelector", ""))
            with kube.cond:
                items = [copy.deepcopy(p) for (n, _), p in kube.pods.items()
                         if n == ns and all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]
            self._send(200, {"apiVersion": "v1", "kind": "PodList", "items": items, "metadata": {}})

        def _secrets(self, method, ns, name, *, q, body):
            with kube.cond:
                if method == "POST":
                    key = (ns, body["metadata"]["name"])
                    if key in kube.secrets:
                        return self._send(409, _status(409, "AlreadyExists", f'secrets "{key[1]}" already exists'))
                    kube.secrets[key] = copy.deepcopy(body)
                    return self._send(201, body)
                if (ns, name) not in kube.secrets:
                    return self._send(404, _status(404, "NotFound", f'secrets "{name}" not found'))
                if method == "DELETE":
                    del kube.secrets[(ns, name)]
                    return self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                if method == "PATCH":
                    kube.secrets[(ns, name)]["metadata"].update(body.get("metadata") or {})
                return self._send(200, kube.secrets[(ns, name)])

        def _events(self, method, ns, *, q, body):
            want = _selector(q.get("fieldSelector", ""))
            with kube.cond:
                items = [e for e in kube.events if e["metadata"]["namespace"] == ns and all(
                    e["involvedObject"].get(k.split(".", 1)[1]) == v for k, v in want.items())]
            self._send(200, {"apiVersion": "v1", "kind": "EventList", "items": items, "metadata": {}})

        def _log(self, method, ns, pod, *, q, body):
            with kube.cond:
                p = kube.pods.get((ns, pod))
                if p is None:
                    return self._send(404, _status(404, "NotFound", f'pods "{pod}" not found'))
                c = p["status"]["containerStatuses"][0]
                if "waiting" in c["state"]:
                    return self._send(400, _status(400, "BadRequest",
                                                   f'container "pytorch" in pod "{pod}" is waiting to start'))
                uid, restart = p["metadata"]["uid"], c["restartCount"]
                lines = list(kube.logs.get((ns, pod, restart), []))
                sent = len(lines)      # read with the lines: one logged after them is streamed below
                gen = kube.drop_gen
            stamps = _truthy(q.get("timestamps"))
            if q.get("sinceSeconds"):
                cutoff = time.time() - int(q["sinceSeconds"])
                lines = [ln for ln in lines if _epoch(ln[0]) >= cutoff]
            if q.get("tailLines"):
                lines = lines[-int(q["tailLines"]):]
            self._start_stream("text/plain")

            def write(batch):
                for ts, text in batch:
                    self._chunk(((ts + " ") if stamps else "").encode() + text.encode() + b"\n")

            write(lines)
            if not _truthy(q.get("follow")):
                return self._end_stream()
            while True:
                with kube.cond:
                    while True:
                        p = kube.pods.get((ns, pod))
                        all_lines = kube.logs.get((ns, pod, restart), [])
                        if len(all_lines) > sent:
                            batch, sent = all_lines[sent:], len(all_lines)
                            break
                        c = p["status"]["containerStatuses"][0] if p else None
                        over = (p is None or p["metadata"]["uid"] != uid or c["restartCount"] != restart
                                or "terminated" in c["state"])
                        if kube.drop_gen != gen:
                            return self._cut()
                        if over or kube.closing:
                            return self._end_stream()
                        kube.cond.wait(0.2)
                write(batch)

    return Handler


def _epoch(stamp: str) -> float:
    base, _, frac = stamp.rstrip("Z").partition(".")
    return datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() + float("0." + frac)
