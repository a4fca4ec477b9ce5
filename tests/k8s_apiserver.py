"""A real kube-apiserver + etcd for the launcher's tests, and the parts of a cluster a test plays itself.

``../shared/k8s/apiserver.sh`` (beside this repository, as CI clones it) builds kube-apiserver once; this
module starts a private instance of it for the test session (own ports, own etcd, ``MIN_REQUEST_TIMEOUT``
of a few seconds so that server-side watch closes happen within a test, restartable without disturbing
anyone else's server) and stops it at the end. A built binary is reused; without one the script builds it
(15-25 minutes on 2 cores; ``.ci/run`` does that first).

What the tests play, as the real components would:
  * ``Operator``: the Training Operator (job ``status`` subresource, pods with the operator's labels and
    owner reference, their ``status``, events) and the garbage collector (foreground deletion).
  * ``Kubelet``: the kubelet's ``/containerLogs`` endpoint over TLS, reached through the API server's pod
    log proxy; it requires the client certificate the API server presents (``run/kubelet-client.crt``).
  * ``Audit``: the server's audit log, to see each request the launcher made and RBAC's answer.

Each test gets a namespace with the pipeline's service account bound by ``deploy/rbac.yaml`` and a
TokenRequest token for it: the launcher talks to the server as that account, so RBAC is enforced.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

REPO = Path(__file__).resolve().parents[1]
# CI clones shared/ beside the repository; GOODPUT_SHARED points elsewhere (a worktree, a dev checkout).
SHARED = Path(os.environ.get("GOODPUT_SHARED") or REPO.parent / "shared")
SCRIPT = SHARED / "k8s" / "apiserver.sh"
SCHEMAS = SHARED / "schemas"
GROUP, VERSION, PLURAL = "kubeflow.org", "v1", "pytorchjobs"
JOB_NAME = "training.kubeflow.org/job-name"
NODE = "goodput-node-a"
MIN_REQUEST_TIMEOUT = 4          # seconds: a watch without timeoutSeconds is closed after 4-8 s
LAUNCHER_SA = "pipeline-runner"  # deploy/rbac.yaml's subject (standalone KFP)


def now_rfc3339(t: float | None = None) -> str:
    t = time.time() if t is None else t
    base = datetime.fromtimestamp(int(t), tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{base}.{int((t % 1) * 1e9):09d}Z"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition",
               every: float = 0.05):
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


# The server -------------------------------------------------------------------------------------

class ApiServer:
    """A private kube-apiserver + etcd started with ``apiserver.sh`` under its own ``K8S_HOME``."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="goodput-k8s-"))
        self.run = self.home / "run"
        self.env = {**os.environ, "K8S_HOME": str(self.home), "API_PORT": str(_free_port()),
                    "ETCD_PORT": str(_free_port()), "ETCD_PEER_PORT": str(_free_port()),
                    "MIN_REQUEST_TIMEOUT": str(MIN_REQUEST_TIMEOUT),
                    # The API server verifies the kubelet's serving certificate against the system roots
                    # (no --kubelet-certificate-authority): Go reads them from SSL_CERT_FILE, so the test
                    # kubelet serves a certificate of this instance's CA. Read on first use, after certs exist.
                    "SSL_CERT_FILE": str(self.home / "run" / "ca.crt")}
        self.url = f"https://127.0.0.1:{self.env['API_PORT']}"
        self.kubeconfig = self.run / "admin.kubeconfig"
        self.ca = self.run / "ca.crt"
        self.audit = Audit(self.run / "audit.log")

    def _script(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"apiserver.sh {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc.stdout

    def start(self) -> "ApiServer":
        built_home = Path(os.environ.get("K8S_HOME") or f"{os.environ.get('TMPDIR') or '/tmp'}/goodput-kube-apiserver")
        binary = built_home / "bin" / "kube-apiserver"
        if not os.access(binary, os.X_OK):
            # Build (and start) the shared instance once: the build is what takes long.
            subprocess.run(["bash", str(SCRIPT), "start"], check=True, timeout=3600,
                           env={**os.environ, "K8S_HOME": str(built_home)}, stdout=subprocess.DEVNULL)
        (self.home / "bin").mkdir(parents=True, exist_ok=True)
        (self.home / "bin" / "kube-apiserver").symlink_to(binary)
        self._script("start")
        self.admin = k8s_config.new_client_from_config(config_file=str(self.kubeconfig))
        self._install_crds()
        return self

    def _install_crds(self) -> None:
        # 1.20 predates x-kubernetes-validations (CEL): kubectl would refuse the CRD, server-side apply too;
        # a plain create drops the field.
        self.kubectl("create", "--validate=false", "-f", str(SCHEMAS / "kubeflow.org_pytorchjobs.yaml"))
        ext = k8s.ApiextensionsV1Api(self.admin)

        def established():
            crd = ext.read_custom_resource_definition("pytorchjobs.kubeflow.org")
            return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])
        wait_until(established, 60, "the PyTorchJob CRD to be established", every=0.2)
        # The discovery of a new CRD reaches the handlers a moment after Established.
        co = k8s.CustomObjectsApi(self.admin)
        wait_until(lambda: _ok(lambda: co.list_namespaced_custom_object(GROUP, VERSION, "default", PLURAL)),
                   60, "pytorchjobs to be served", every=0.2)

    def restart_apiserver(self) -> None:
        """Stop and start kube-apiserver only: every open watch drops; etcd keeps the data."""
        self._script("restart-apiserver")

    def kubectl(self, *args: str, kubeconfig: Path | None = None, check: bool = True,
                input: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig or self.kubeconfig), *args],
                              capture_output=True, text=True, input=input, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._script("stop", timeout=60)
        shutil.rmtree(self.home, ignore_errors=True)


def _ok(fn) -> bool:
    try:
        fn()
        return True
    except Exception:  # noqa: BLE001 - polled again
        return False


_SERVER: ApiServer | None = None
_KUBELET: "Kubelet | None" = None


def apiserver() -> ApiServer:
    """The session's API server (started on first use, stopped at exit); skips if the script is absent."""
    global _SERVER, _KUBELET
    if _SERVER is None:
        if not SCRIPT.is_file():
            if os.environ.get("GOODPUT_REQUIRE_APISERVER"):
                raise RuntimeError(f"{SCRIPT} is missing: clone the shared/ directory beside the repository")
            pytest.skip(f"no {SCRIPT} (CI clones shared/ beside the repository; or set GOODPUT_SHARED)")
        if shutil.which("kubectl") is None and not os.environ.get("GOODPUT_REQUIRE_APISERVER"):
            pytest.skip("kubectl is not installed")
        server = ApiServer()
        atexit.register(server.stop)
        server.start()
        _KUBELET = Kubelet(server)
        _KUBELET.register_node()
        _SERVER = server
    return _SERVER


def kubelet() -> "Kubelet":
    apiserver()
    assert _KUBELET is not None
    return _KUBELET


# A namespace with the launcher's identity ----------------------------------------------------------

@dataclass
class Namespace:
    server: ApiServer
    name: str
    sa: str
    token: str
    kubeconfig: Path
    created_at: float = field(default_factory=time.time)

    @property
    def user(self) -> str:
        return f"system:serviceaccount:{self.name}:{self.sa}"

    def launcher_client(self) -> k8s.ApiClient:
        """A client authenticated with the service account's bearer token (RBAC applies)."""
        cfg = k8s.Configuration(host=self.server.url, api_key={"authorization": self.token},
                                api_key_prefix={"authorization": "Bearer"})
        cfg.ssl_ca_cert = str(self.server.ca)
        return k8s.ApiClient(cfg)

    def launcher_requests(self, since: float | None = None) -> list["AuditEvent"]:
        return [e for e in self.server.audit.events() if e.user == self.user
                and e.received >= (self.created_at if since is None else since)]


def make_namespace(server: ApiServer, prefix: str, *, sa: str = LAUNCHER_SA, rbac: str | None = None,
                   tmp: Path) -> Namespace:
    """A fresh namespace; ``sa`` bound by deploy/rbac.yaml (its subject moved into this namespace) or by
    the documents in ``rbac`` (YAML text, applied as given; "" = none), and a TokenRequest token for ``sa``."""
    core = k8s.CoreV1Api(server.admin)
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    # No controller-manager here: the service accounts a cluster would create are created by the test
    # (pods need "default" to pass the ServiceAccount admission plugin).
    for account in {"default", sa}:
        core.create_namespaced_service_account(name, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=account)))
    if rbac is None:
        docs = list(yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()))
        for d in docs:
            if d["kind"] == "RoleBinding":
                d["subjects"] = [{**s, "namespace": name} if s.get("name") == sa else s for s in d["subjects"]]
        rbac = yaml.safe_dump_all(docs)
    if rbac:
        server.kubectl("apply", "-n", name, "-f", "-", input=rbac)
    token = core.create_namespaced_service_account_token(
        sa, name, k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(
            audiences=["https://kubernetes.default.svc.cluster.local"], expiration_seconds=3600))).status.token
    kubeconfig = tmp / f"{name}.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server.url, "certificate-authority": str(server.ca)}}],
        "users": [{"name": sa, "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": sa, "namespace": name}}],
        "current-context": "test"}))
    return Namespace(server, name, sa, token, kubeconfig)


# The audit log ------------------------------------------------------------------------------------

@dataclass
class AuditEvent:
    user: str
    verb: str
    group: str
    resource: str
    subresource: str
    name: str
    namespace: str
    code: int
    received: float
    uri: str

    @property
    def what(self) -> tuple[str, str, str]:
        """(apiGroup, resource[/subresource], verb): what RBAC checked."""
        return self.group, self.resource + (f"/{self.subresource}" if self.subresource else ""), self.verb


class Audit:
    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self) -> list[AuditEvent]:
        """One entry per request (its last stage), in the order received."""
        by_id: dict[str, dict] = {}
        for p in sorted(self.path.parent.glob(self.path.name + "*"), key=lambda q: q.stat().st_mtime):
            for line in p.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    e = json.loads(line)
                    by_id[e["auditID"]] = e
        out = []
        for e in by_id.values():
            ref = e.get("objectRef") or {}
            out.append(AuditEvent(
                user=(e.get("user") or {}).get("username", ""), verb=e.get("verb", ""),
                group=ref.get("apiGroup", ""), resource=ref.get("resource", ""),
                subresource=ref.get("subresource", ""), name=ref.get("name", ""),
                namespace=ref.get("namespace", ""), code=(e.get("responseStatus") or {}).get("code", 0),
                received=_epoch(e["requestReceivedTimestamp"]), uri=e.get("requestURI", "")))
        return sorted(out, key=lambda a: a.received)


def _epoch(stamp: str) -> float:
    main, _, frac = stamp.rstrip("Z").partition(".")
    t = datetime.strptime(main, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    return t + (float("0." + frac) if frac else 0.0)


# The kubelet's log endpoint ---------------------------------------------------------------------

@dataclass
class _Instance:
    lines: list[tuple[float, str]] = field(default_factory=list)
    done: bool = False


class Kubelet:
    """``GET /containerLogs/{ns}/{pod}/{container}`` as the kubelet serves it, behind the API server's proxy.

    A pod's log is a list of container instances (one per restart); a follow stream serves the current one
    and ends when it ends. ``mode(ns, pod, m)`` makes the endpoint misbehave: ``fail`` (500), ``hang``
    (never answers), ``end`` (a follow stream ends at once, though the container runs).
    """

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.cond = threading.Condition()
        self.logs: dict[tuple[str, str], list[_Instance]] = {}
        self.modes: dict[tuple[str, str], str] = {}
        self.requests: list[tuple[float, str, str, dict]] = []      # (time, ns, pod, query)
        self.closing = threading.Event()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(server.run / "apiserver.crt", server.run / "apiserver.key")
        ctx.load_verify_locations(server.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED       # only the API server (its kubelet client certificate)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _kubelet_handler(self))
        self.httpd.daemon_threads = True
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="kubelet").start()
        atexit.register(self.close)

    def close(self) -> None:
        self.closing.set()
        with self.cond:
            self.cond.notify_all()
        self.httpd.shutdown()

    def register_node(self) -> None:
        k8s.CoreV1Api(self.server.admin).create_node({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
            "status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                       "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}}}})

    # What the "container" does.
    def start_container(self, ns: str, pod: str) -> None:
        with self.cond:
            self.logs.setdefault((ns, pod), []).append(_Instance())
            self.cond.notify_all()

    def log(self, ns: str, pod: str, *lines: str) -> None:
        with self.cond:
            inst = self.logs[(ns, pod)][-1]
            for text in lines:
                inst.lines.append((time.time(), text))
            self.cond.notify_all()

    def end_container(self, ns: str, pod: str) -> None:
        with self.cond:
            for inst in self.logs.get((ns, pod), []):
                inst.done = True
            self.cond.notify_all()

    def mode(self, ns: str, pod: str, mode: str) -> None:
        with self.cond:
            self.modes[(ns, pod)] = mode
            self.cond.notify_all()

    def calls(self, ns: str, pod: str | None = None) -> list[tuple[float, str, str, dict]]:
        with self.cond:
            return [r for r in self.requests if r[1] == ns and (pod is None or r[2] == pod)]


def _kubelet_handler(kubelet: Kubelet):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:      # quiet
            pass

        def do_GET(self):  # noqa: N802 - http.server's name
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            q = {k: v[-1] for k, v in parse_qs(url.query).items()}
            if len(parts) != 4 or parts[0] != "containerLogs":
                self.send_error(404)
                return
            _, ns, pod, _container = parts
            with kubelet.cond:
                kubelet.requests.append((time.time(), ns, pod, q))
                mode = kubelet.modes.get((ns, pod), "")
            if mode == "fail":
                body = b"failed to get container log: rpc error: code = Unavailable"
                self.send_response(500)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if mode == "hang":
                kubelet.closing.wait(120)
                self.close_connection = True
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                self._serve(ns, pod, q, follow=q.get("follow") == "true" and mode != "end")
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError, ssl.SSLError, OSError):
                self.close_connection = True

        def _serve(self, ns: str, pod: str, q: dict, follow: bool) -> None:
            with kubelet.cond:
                instances = kubelet.logs.get((ns, pod)) or [_Instance(done=True)]
                inst = instances[-1]
                lines = list(inst.lines)
            if "sinceSeconds" in q:
                cutoff = time.time() - int(q["sinceSeconds"])
                lines = [ln for ln in lines if ln[0] >= cutoff]
            if "tailLines" in q:
                lines = lines[-int(q["tailLines"]):] if int(q["tailLines"]) else []
            sent = len(inst.lines) if not lines else inst.lines.index(lines[0]) + len(lines)
            stamps = q.get("timestamps") == "true"

            def write(batch):
                data = "".join(f"{now_rfc3339(t) + ' ' if stamps else ''}{text}\n" for t, text in batch).encode()
                if data:
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

            write(lines)
            while follow:
                with kubelet.cond:
                    while len(inst.lines) == sent and not inst.done and not kubelet.closing.is_set():
                        kubelet.cond.wait(1.0)
                    batch = inst.lines[sent:]
                    sent = len(inst.lines)
                    finished = inst.done or kubelet.closing.is_set()
                write(batch)
                if finished:
                    return
    return Handler


# The Training Operator and the garbage collector --------------------------------------------------

class Operator:
    """What the Training Operator (and kube-controller-manager's garbage collector) would do, as admin."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns.name
        self.namespace = ns
        self.admin = ns.server.admin
        self.co = k8s.CustomObjectsApi(self.admin)
        self.core = k8s.CoreV1Api(self.admin)
        self.kubelet = kubelet()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self._gc = threading.Thread(target=self._collect_garbage, daemon=True, name=f"gc-{self.ns}")
        self._gc.start()

    # Jobs.
    def job(self, name: str) -> dict | None:
        try:
            return self.co.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def jobs(self) -> list[dict]:
        return self.co.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]

    def alive(self, name: str) -> bool:
        job = self.job(name)
        return job is not None and not job["metadata"].get("deletionTimestamp")

    def set_phase(self, name: str, phase: str, reason: str = "", message: str = "",
                  replicas: dict | None = None) -> None:
        """Add condition ``phase`` (True) through the status subresource; Running/Restarting turn False."""
        job = self.job(name)
        status = copy.deepcopy(job.get("status") or {})
        conds = status.setdefault("conditions", [])
        for c in conds:
            if c["type"] in ("Running", "Restarting"):
                c["status"] = "False"
        conds[:] = [c for c in conds if c["type"] != phase]
        stamp = now_rfc3339()[:19] + "Z"
        conds.append({"type": phase, "status": "True", "reason": reason or f"PyTorchJob{phase}",
                      "message": message or f"PyTorchJob {name} is {phase.lower()}.",
                      "lastTransitionTime": stamp, "lastUpdateTime": stamp})
        if replicas is not None:
            status["replicaStatuses"] = replicas
        self.co.patch_namespaced_custom_object_status(GROUP, VERSION, self.ns, PLURAL, name, {"status": status})

    # Pods.
    def add_pod(self, job: str, rtype: str, index: int) -> str:
        owner = self.job(job)
        name = f"{job}-{rtype.lower()}-{index}"
        self.core.create_namespaced_pod(self.ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {
                JOB_NAME: job, "training.kubeflow.org/operator-name": "pytorchjob-controller",
                "training.kubeflow.org/replica-type": rtype.lower(), "training.kubeflow.org/replica-index": str(index),
                **({"training.kubeflow.org/job-role": "master"} if rtype == "Master" else {})},
                "ownerReferences": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "PyTorchJob", "name": job,
                                     "uid": owner["metadata"]["uid"], "controller": True,
                                     "blockOwnerDeletion": True}]},
            "spec": {"nodeName": NODE, "automountServiceAccountToken": False, "restartPolicy": "OnFailure",
                     "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "pytorch", "image": "img"}]}})
        self.kubelet.start_container(self.ns, name)
        self._pod_status(name, {"phase": "Running", "podIP": "127.0.0.1", "containerStatuses": [
            {"name": "pytorch", "image": "img", "imageID": "", "ready": True, "restartCount": 0,
             "state": {"running": {"startedAt": now_rfc3339()[:19] + "Z"}}}]})
        return name

    def _pod_status(self, pod: str, status: dict) -> None:
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def _container(self, pod: str) -> dict:
        return self.core.read_namespaced_pod(pod, self.ns).to_dict()["status"]["container_statuses"][0]

    def log(self, pod: str, *lines: str) -> None:
        self.kubelet.log(self.ns, pod, *lines)

    def terminate(self, pod: str, exit_code: int = 0, reason: str = "Completed", message: str = "") -> None:
        self.kubelet.end_container(self.ns, pod)
        c = self._container(pod)
        self._pod_status(pod, {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [
            {"name": "pytorch", "image": "img", "imageID": "", "ready": False, "restartCount": c["restart_count"],
             "state": {"terminated": {"exitCode": exit_code, "reason": reason, "message": message,
                                      "startedAt": now_rfc3339()[:19] + "Z",
                                      "finishedAt": now_rfc3339()[:19] + "Z"}}}]})

    def restart_in_kubelet(self, pod: str) -> None:
        """The container exits and the kubelet starts it again: its log is a new instance."""
        self.kubelet.end_container(self.ns, pod)
        self.kubelet.start_container(self.ns, pod)

    def report_restart(self, pod: str, exit_code: int = 137, reason: str = "Error") -> None:
        """The kubelet's status update for a restart: restartCount + 1, the last state terminated."""
        c = self._container(pod)
        stamp = now_rfc3339()[:19] + "Z"
        self._pod_status(pod, {"containerStatuses": [
            {"name": "pytorch", "image": "img", "imageID": "", "ready": True, "restartCount": c["restart_count"] + 1,
             "lastState": {"terminated": {"exitCode": exit_code, "reason": reason, "startedAt": stamp,
                                          "finishedAt": stamp}},
             "state": {"running": {"startedAt": stamp}}}]})

    def replace_pod(self, pod: str, job: str, rtype: str, index: int) -> str:
        """A spot reclaim: the pod is gone and the operator makes a new one of the same name (a new uid)."""
        self.kubelet.end_container(self.ns, pod)
        self.core.delete_namespaced_pod(pod, self.ns, grace_period_seconds=0)
        wait_until(lambda: not _ok(lambda: self.core.read_namespaced_pod(pod, self.ns)), 10, f"{pod} to go")
        return self.add_pod(job, rtype, index)

    def add_event(self, kind: str, name: str, reason: str, message: str, type: str = "Warning") -> None:
        stamp = now_rfc3339()[:19] + "Z"
        self.core.create_namespaced_event(self.ns, {
            "apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{name}.{uuid.uuid4().hex[:10]}"},
            "involvedObject": {"kind": kind, "name": name, "namespace": self.ns}, "reason": reason,
            "message": message, "type": type, "count": 1, "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": "pytorchjob-controller"}})

    # Scenarios.
    def play(self, scenario: Callable[["Operator", str], None], name: str | None = None) -> None:
        """Run ``scenario(op, job name)`` in a thread once a job (``name`` or the first) exists."""
        def run():
            try:
                found = wait_until(lambda: (self.job(name) and name) if name else
                                   next((j["metadata"]["name"] for j in self.jobs()), None), 60, "the job")
                scenario(self, found)
            except BaseException as e:  # noqa: BLE001 - re-raised in the test by join()
                self.errors.append(e)
        t = threading.Thread(target=run, daemon=True, name=f"operator-{self.ns}")
        t.start()
        self.threads.append(t)

    def join(self, timeout: float = 30) -> None:
        for t in self.threads:
            t.join(timeout)
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)
        self._gc.join(5)

    def _collect_garbage(self) -> None:
        """Foreground deletion: delete the job's pods, then drop its foregroundDeletion finalizer."""
        while not self.stop.is_set():
            try:
                for job in self.co.list_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL)["items"]:
                    meta = job["metadata"]
                    if not meta.get("deletionTimestamp"):
                        continue
                    pods = self.core.list_namespaced_pod(self.ns, label_selector=f"{JOB_NAME}={meta['name']}")
                    for pod in pods.items:
                        self.kubelet.end_container(self.ns, pod.metadata.name)
                        with contextlib.suppress(ApiException):
                            self.core.delete_namespaced_pod(pod.metadata.name, self.ns, grace_period_seconds=0)
                    with contextlib.suppress(ApiException):
                        self.co.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, meta["name"],
                                                               {"metadata": {"finalizers": None}})
            except Exception:  # noqa: BLE001 - e.g. during an API server restart: try again
                pass
            self.stop.wait(0.2)


__all__ = ["ApiServer", "Audit", "AuditEvent", "Kubelet", "Namespace", "Operator", "apiserver", "kubelet",
           "make_namespace", "wait_until", "now_rfc3339"]
