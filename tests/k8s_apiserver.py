"""A real kube-apiserver + etcd for the launcher's tests, and the parts of a cluster a test plays itself.

``../shared/k8s/apiserver.sh`` (beside this repository, as CI clones it) builds kube-apiserver once; this
module starts a private instance of it for the test session (own ports, own etcd, ``MIN_REQUEST_TIMEOUT``
of a few seconds so that server-side watch closes happen within a test, restartable without disturbing
anyone else's server) and stops it at the end. A built binary is reused; without one the script builds it
(15-25 minutes on 2 cores; ``.ci/run`` does that first).

The server has the CRDs of both job kinds the launcher supervises: the Training Operator's PyTorchJob, and
Kubeflow Trainer v2's TrainJob and ClusterTrainingRuntime with the JobSet a TrainJob becomes, and Kueue's
(``../shared/schemas``, adapted to what a 1.20 server takes: ``for_kube_1_20``).

What the tests play, as the real components would:
  * ``Operator``: the job's controller (``PYTORCHJOB``: the Training Operator; ``TRAINJOB``: the Trainer with
    the JobSet and Job controllers): the job's ``status`` subresource, pods with the controller's labels, their
    ``status``, events; and the garbage collector (foreground deletion).
  * ``Kueue``: a queued job's Workload (owned by the job, as Kueue makes it), its conditions, and admission
    (unsuspending the job); on the job's deletion it drops the Workload's finalizer, as Kueue does.
  * ``Kubelet``: the kubelet's ``/containerLogs`` endpoint over TLS, reached through the API server's pod
    log proxy; it requires the client certificate the API server presents (``run/kubelet-client.crt``).
  * ``Audit``: the server's audit log, to see each request the launcher made and RBAC's answer.

Each test gets a namespace with the pipeline's service account bound by ``deploy/rbac.yaml`` (TrainJobs:
``deploy/trainer-v2/rbac.yaml``) and a TokenRequest token for it: the launcher talks to the server as that
account, so RBAC is enforced.
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
CRDS = ("kubeflow.org_pytorchjobs.yaml", "trainer.kubeflow.org_trainjobs.yaml",
        "trainer.kubeflow.org_clustertrainingruntimes.yaml", "jobset.x-k8s.io_jobsets.yaml",
        "kueue.x-k8s.io_workloads.yaml", "kueue.x-k8s.io_localqueues.yaml", "kueue.x-k8s.io_clusterqueues.yaml",
        "kueue.x-k8s.io_resourceflavors.yaml")
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
        install_crds(self.admin)

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


def for_kube_1_20(node):
    """A CRD as the 1.20 server takes it. It predates CEL, so ``x-kubernetes-validations`` go (a plain create
    would drop them anyway); it reads ``default: ""`` as null and refuses the CRD, so empty-string defaults go
    (they only ever add a field; nothing here relies on them), and a list-map key that had one becomes
    required, which 1.20 demands of such keys instead. ``selectableFields`` (1.30+, Kueue's Workload) go too."""
    if isinstance(node, list):
        return [for_kube_1_20(n) for n in node]
    if not isinstance(node, dict):
        return node
    items = node.get("items")
    if node.get("x-kubernetes-list-map-keys") and isinstance(items, dict):
        blank = [k for k in node["x-kubernetes-list-map-keys"] if items.get("properties", {}).get(k, {}).get(
            "default") == ""]
        node = {**node, "items": {**items, "required": sorted({*items.get("required", []), *blank})}}
    return {k: for_kube_1_20(v) for k, v in node.items()
            if not (k == "default" and v == "") and k not in ("x-kubernetes-validations", "selectableFields")}


def install_crds(admin: k8s.ApiClient) -> None:
    """Create ``CRDS`` (adapted by ``for_kube_1_20``) unless they exist, and wait until each is served."""
    ext, co = k8s.ApiextensionsV1Api(admin), k8s.CustomObjectsApi(admin)
    for file in CRDS:
        crd = for_kube_1_20(yaml.safe_load((SCHEMAS / file).read_text()))
        name = crd["metadata"]["name"]
        try:
            ext.create_custom_resource_definition(crd)
        except ApiException as e:
            if e.status != 409:        # installed already (another session on this server)
                raise

        def established():
            got = ext.read_custom_resource_definition(name)
            return any(c.type == "Established" and c.status == "True" for c in got.status.conditions or [])
        wait_until(established, 60, f"the CRD {name} to be established", every=0.2)
        group, plural = crd["spec"]["group"], crd["spec"]["names"]["plural"]
        version = next(v["name"] for v in crd["spec"]["versions"] if v.get("storage"))
        # The discovery of a new CRD reaches the handlers a moment after Established.
        if crd["spec"]["scope"] == "Namespaced":
            served = lambda: co.list_namespaced_custom_object(group, version, "default", plural)  # noqa: E731
        else:
            served = lambda: co.list_cluster_custom_object(group, version, plural)  # noqa: E731
        wait_until(lambda: _ok(served), 60, f"{plural} to be served", every=0.2)


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
                   rbac_file: str = "deploy/rbac.yaml", tmp: Path) -> Namespace:
    """A fresh namespace; ``sa`` bound by ``rbac_file`` (its subject moved into this namespace) or by
    the documents in ``rbac`` (YAML text, applied as given; "" = none), and a TokenRequest token for ``sa``."""
    core = k8s.CoreV1Api(server.admin)
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    # No controller-manager here: the service accounts a cluster would create are created by the test
    # (pods need "default" to pass the ServiceAccount admission plugin).
    for account in {"default", sa}:
        core.create_namespaced_service_account(name, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=account)))
    if rbac is None:
        docs = list(yaml.safe_load_all((REPO / rbac_file).read_text()))
        for d in docs:
            if d["kind"] in ("RoleBinding", "ClusterRoleBinding"):
                d["subjects"] = [{**s, "namespace": name} if s.get("name") == sa else s for s in d["subjects"]]
            if d["kind"] == "ClusterRoleBinding":      # one per namespace: the others' stay bound
                d["metadata"]["name"] += f"-{name}"
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

    def log(self, ns: str, pod: str, *lines: str, same_stamp: bool = False) -> None:
        """The container writes ``lines``; ``same_stamp``: all read at once, under one timestamp (a coarse
        clock). Otherwise each line is stamped after the one before (time.time() repeats within ~0.24 us)."""
        with self.cond:
            inst = self.logs[(ns, pod)][-1]
            now = max(time.time(), inst.lines[-1][0] + 1e-6) if inst.lines else time.time()
            for i, text in enumerate(lines):
                inst.lines.append((now if same_stamp else now + i * 1e-6, text))
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
                sent = len(lines)      # read with the lines: one logged after them is streamed below
            if "sinceSeconds" in q:
                cutoff = time.time() - int(q["sinceSeconds"])
                lines = [ln for ln in lines if ln[0] >= cutoff]
            if "tailLines" in q:
                lines = lines[-int(q["tailLines"]):] if int(q["tailLines"]) else []
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


# The job's controller and the garbage collector -----------------------------------------------------

@dataclass(frozen=True)
class Controller:
    """What differs between the controllers a test plays: where the job lives, its pods' names and labels,
    how its status says a phase. The scenarios (``Operator``'s methods) are the same for every kind."""

    kind: str
    group: str
    version: str
    plural: str
    container: str        # the trainer container
    prefix: str           # the launcher's prefix of the master's log lines
    rbac_file: str        # the launcher's Role, relative to the repository

    def pod(self, op: "Operator", job: str, rtype: str, index: int) -> tuple[str, dict, list]:
        raise NotImplementedError

    def pod_selector(self, job: str) -> str:
        raise NotImplementedError

    def status(self, op: "Operator", name: str, phase: str, reason: str, message: str,
               replicas: dict | None) -> None:
        raise NotImplementedError

    def collect(self, op: "Operator", name: str) -> None:
        """What foreground deletion removes besides the pods."""

    def suspend_patch(self, suspend: bool) -> dict:
        """The spec patch that suspends or resumes the job (what Kueue writes)."""
        raise NotImplementedError

    def podsets(self, job: dict) -> list[tuple[str, int]]:
        """(name, pod count) of the pod sets Kueue makes of the job."""
        raise NotImplementedError


def _condition(conds: list[dict], kind: str, reason: str, message: str) -> None:
    conds[:] = [c for c in conds if c["type"] != kind]
    stamp = now_rfc3339()[:19] + "Z"
    conds.append({"type": kind, "status": "True", "reason": reason, "message": message,
                  "lastTransitionTime": stamp, "lastUpdateTime": stamp})


class _TrainingOperator(Controller):
    def suspend_patch(self, suspend):
        return {"spec": {"runPolicy": {"suspend": suspend}}}

    def podsets(self, job):
        return [(rtype.lower(), int(r.get("replicas", 1)))
                for rtype, r in job["spec"]["pytorchReplicaSpecs"].items()]

    def pod(self, op, job, rtype, index):
        owner = op.job(job)
        labels = {JOB_NAME: job, "training.kubeflow.org/operator-name": "pytorchjob-controller",
                  "training.kubeflow.org/replica-type": rtype.lower(),
                  "training.kubeflow.org/replica-index": str(index),
                  **({"training.kubeflow.org/job-role": "master"} if rtype == "Master" else {})}
        refs = [{"apiVersion": f"{self.group}/{self.version}", "kind": self.kind, "name": job,
                 "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
        return f"{job}-{rtype.lower()}-{index}", labels, refs

    def pod_selector(self, job):
        return f"{JOB_NAME}={job}"

    def status(self, op, name, phase, reason, message, replicas):
        """Add condition ``phase`` (True) through the status subresource; Running/Restarting turn False."""
        status = copy.deepcopy(op.job(name).get("status") or {})
        conds = status.setdefault("conditions", [])
        for c in conds:
            if c["type"] in ("Running", "Restarting"):
                c["status"] = "False"
        _condition(conds, phase, reason or f"PyTorchJob{phase}", message or f"PyTorchJob {name} is {phase.lower()}.")
        if replicas is not None:
            status["replicaStatuses"] = replicas
        op.co.patch_namespaced_custom_object_status(self.group, self.version, op.ns, self.plural, name,
                                                    {"status": status})


JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"


class _Trainer(Controller):
    """Kubeflow Trainer v2 with the JobSet and Job controllers: a TrainJob becomes a JobSet of the same name,
    whose one replicated job ``node`` runs one pod per node (``<job>-node-0-<index>-<random>``)."""

    def suspend_patch(self, suspend):
        return {"spec": {"suspend": suspend}}

    def podsets(self, job):
        return [("node", int(job["spec"]["trainer"].get("numNodes", 1)))]

    def pod(self, op, job, rtype, index):
        self.jobset(op, job)
        node = 0 if rtype == "Master" else index + 1
        labels = {JOBSET_NAME: job, "jobset.sigs.k8s.io/replicatedjob-name": "node",
                  "jobset.sigs.k8s.io/job-index": "0", "batch.kubernetes.io/job-completion-index": str(node),
                  "job-name": f"{job}-node-0", "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
        return f"{job}-node-0-{node}-{uuid.uuid4().hex[:5]}", labels, []

    def pod_selector(self, job):
        return f"{JOBSET_NAME}={job}"

    def jobset(self, op: "Operator", name: str) -> dict:
        """The JobSet the Trainer makes of TrainJob ``name`` (created on first use)."""
        try:
            return op.co.get_namespaced_custom_object(*JOBSET[:2], op.ns, JOBSET[2], name)
        except ApiException as e:
            if e.status != 404:
                raise
        owner = op.job(name)
        return op.co.create_namespaced_custom_object(*JOBSET[:2], op.ns, JOBSET[2], {
            "apiVersion": "/".join(JOBSET[:2]), "kind": "JobSet",
            "metadata": {"name": name, "ownerReferences": [{
                "apiVersion": f"{self.group}/{self.version}", "kind": self.kind, "name": name,
                "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": {"template": {
                "spec": {"restartPolicy": "Never", "containers": [{"name": "node", "image": "img"}]}}}}}]}})

    def status(self, op, name, phase, reason, message, replicas):
        jobset = self.jobset(op, name)
        job_status = copy.deepcopy(op.job(name).get("status") or {})
        set_status = copy.deepcopy(jobset.get("status") or {})
        conds, set_conds = job_status.setdefault("conditions", []), set_status.setdefault("conditions", [])
        if replicas is not None or phase == "Created":
            total = {k: sum(int(r.get(k, 0)) for r in (replicas or {}).values())
                     for k in ("active", "succeeded", "failed")}
            job_status["jobsStatus"] = [{"name": "node", "ready": total["active"], "suspended": 0, **total}]
            set_status["replicatedJobsStatus"] = [{"name": "node", "ready": total["active"], "suspended": 0, **total}]
        if phase == "Restarting":           # the JobSet recreated its pods: a restart counted against the budget
            set_status["restarts"] = int(set_status.get("restarts") or 0) + 1
            set_status["restartsCountTowardsMax"] = int(set_status.get("restartsCountTowardsMax") or 0) + 1
        elif phase == "Succeeded":
            _condition(set_conds, "Completed", "AllJobsCompleted", "jobset completed successfully")
            _condition(conds, "Complete", reason or "JobSetCompleted", message or "jobset completed successfully")
        elif phase == "Failed":
            _condition(set_conds, "Failed", reason or "FailedJobs", message or "jobset failed")
            _condition(conds, "Failed", reason or "JobSetFailed", message or "jobset failed")
        elif phase == "Suspended":
            _condition(conds, "Suspended", reason or "Suspended", message or "TrainJob is suspended")
        op.co.patch_namespaced_custom_object_status(*JOBSET[:2], op.ns, JOBSET[2], name, {"status": set_status})
        op.co.patch_namespaced_custom_object_status(self.group, self.version, op.ns, self.plural, name,
                                                    {"status": job_status})

    def node_job_failed(self, op: "Operator", name: str, reason: str, message: str) -> None:
        """The JobSet's node Job (``<job>-node-0``) failed, as the Job controller reports it."""
        batch = k8s.BatchV1Api(op.admin)
        job = f"{name}-node-0"
        batch.create_namespaced_job(op.ns, {
            "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": job, "labels": {
                JOBSET_NAME: name, "jobset.sigs.k8s.io/replicatedjob-name": "node"}},
            "spec": {"suspend": True, "template": {"metadata": {"labels": {JOBSET_NAME: name}}, "spec": {
                "restartPolicy": "Never", "containers": [{"name": "node", "image": "img"}]}}}})
        stamp = now_rfc3339()[:19] + "Z"
        batch.patch_namespaced_job_status(job, op.ns, {"status": {"conditions": [{
            "type": "Failed", "status": "True", "reason": reason, "message": message,
            "lastProbeTime": stamp, "lastTransitionTime": stamp}]}})

    def collect(self, op, name):
        with contextlib.suppress(ApiException):
            op.co.delete_namespaced_custom_object(*JOBSET[:2], op.ns, JOBSET[2], name)
        batch = k8s.BatchV1Api(op.admin)
        for job in batch.list_namespaced_job(op.ns, label_selector=f"{JOBSET_NAME}={name}").items:
            with contextlib.suppress(ApiException):
                batch.delete_namespaced_job(job.metadata.name, op.ns, propagation_policy="Background")


PYTORCHJOB = _TrainingOperator("PyTorchJob", GROUP, VERSION, PLURAL, "pytorch", "[master-0]", "deploy/rbac.yaml")
TRAINJOB = _Trainer("TrainJob", "trainer.kubeflow.org", "v1alpha1", "trainjobs", "node", "[node-0]",
                    "deploy/trainer-v2/rbac.yaml")


class Operator:
    """What the job's controller (and kube-controller-manager's garbage collector) would do, as admin."""

    def __init__(self, ns: Namespace, controller: Controller = PYTORCHJOB) -> None:
        self.ns = ns.name
        self.namespace = ns
        self.ctl = controller
        self.gvp = (controller.group, controller.version, ns.name, controller.plural)
        self.admin = ns.server.admin
        self.co = k8s.CustomObjectsApi(self.admin)
        self.core = k8s.CoreV1Api(self.admin)
        self.kubelet = kubelet()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()
        self.kueue = Kueue(self)
        self.deleted_with: dict[str, list[str]] = {}    # job -> its finalizers when its deletion was first seen
        self._gc = threading.Thread(target=self._collect_garbage, daemon=True, name=f"gc-{self.ns}")
        self._gc.start()

    # Jobs.
    def job(self, name: str) -> dict | None:
        try:
            return self.co.get_namespaced_custom_object(*self.gvp, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def jobs(self) -> list[dict]:
        return self.co.list_namespaced_custom_object(*self.gvp)["items"]

    def create_job(self, manifest: dict) -> dict:
        return self.co.create_namespaced_custom_object(*self.gvp, manifest)

    def alive(self, name: str) -> bool:
        job = self.job(name)
        return job is not None and not job["metadata"].get("deletionTimestamp")

    def set_phase(self, name: str, phase: str, reason: str = "", message: str = "",
                  replicas: dict | None = None) -> None:
        """Report ``phase`` (Created, Running, Restarting, Succeeded, Failed) as the kind's controller does;
        ``replicas``: counts by replica type ({"Master": {"active": 1}, ...}; a TrainJob sums them)."""
        self.ctl.status(self, name, phase, reason, message, replicas)

    # Pods.
    def add_pod(self, job: str, rtype: str, index: int) -> str:
        """The pod of replica ``rtype`` ``index`` (Master 0 is node 0; Worker i is node i + 1), running."""
        name, labels, owners = self.ctl.pod(self, job, rtype, index)
        c = self.ctl.container
        self.core.create_namespaced_pod(self.ns, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels, **({"ownerReferences": owners} if owners else {})},
            "spec": {"nodeName": NODE, "automountServiceAccountToken": False, "restartPolicy": "OnFailure",
                     "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": c, "image": "img"}]}})
        self.kubelet.start_container(self.ns, name)
        self._pod_status(name, {"phase": "Running", "podIP": "127.0.0.1", "containerStatuses": [
            {"name": c, "image": "img", "imageID": "", "ready": True, "restartCount": 0,
             "state": {"running": {"startedAt": now_rfc3339()[:19] + "Z"}}}]})
        return name

    def _pod_status(self, pod: str, status: dict) -> None:
        self.core.patch_namespaced_pod_status(pod, self.ns, {"status": status})

    def _container(self, pod: str) -> dict:
        return self.core.read_namespaced_pod(pod, self.ns).to_dict()["status"]["container_statuses"][0]

    def log(self, pod: str, *lines: str, same_stamp: bool = False) -> None:
        self.kubelet.log(self.ns, pod, *lines, same_stamp=same_stamp)

    def terminate(self, pod: str, exit_code: int = 0, reason: str = "Completed", message: str = "") -> None:
        self.kubelet.end_container(self.ns, pod)
        c = self._container(pod)
        self._pod_status(pod, {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [
            {"name": self.ctl.container, "image": "img", "imageID": "", "ready": False,
             "restartCount": c["restart_count"],
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
            {"name": self.ctl.container, "image": "img", "imageID": "", "ready": True,
             "restartCount": c["restart_count"] + 1,
             "lastState": {"terminated": {"exitCode": exit_code, "reason": reason, "startedAt": stamp,
                                          "finishedAt": stamp}},
             "state": {"running": {"startedAt": stamp}}}]})

    def replace_pod(self, pod: str, job: str, rtype: str, index: int) -> str:
        """A spot reclaim (a JobSet restart): the pod is gone and the controller makes a new one for the
        same replica (a new uid; a PyTorchJob's has the same name)."""
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
            "source": {"component": f"{self.ctl.kind.lower()}-controller"}})

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
        """Foreground deletion: delete the job's pods (and what else it owns), then drop its finalizer."""
        while not self.stop.is_set():
            try:
                for job in self.jobs():
                    meta = job["metadata"]
                    if not meta.get("deletionTimestamp"):
                        continue
                    self.deleted_with.setdefault(meta["name"], list(meta.get("finalizers") or []))
                    self._collect_owned(meta["uid"])
                    pods = self.core.list_namespaced_pod(self.ns, label_selector=self.ctl.pod_selector(meta["name"]))
                    for pod in pods.items:
                        self.kubelet.end_container(self.ns, pod.metadata.name)
                        with contextlib.suppress(ApiException):
                            self.core.delete_namespaced_pod(pod.metadata.name, self.ns, grace_period_seconds=0)
                    self.ctl.collect(self, meta["name"])
                    with contextlib.suppress(ApiException):
                        self.co.patch_namespaced_custom_object(*self.gvp, meta["name"],
                                                               {"metadata": {"finalizers": None}})
            except Exception:  # noqa: BLE001 - e.g. during an API server restart: try again
                pass
            self.stop.wait(0.2)

    def _collect_owned(self, uid: str) -> None:
        """Kueue drops its finalizer from the job's Workloads; the garbage collector deletes them and the job's
        other dependents (its peer secret), found by their ownerReferences."""
        def owned(items) -> list[str]:
            return [i["metadata"]["name"] for i in items
                    if any(o.get("uid") == uid for o in i["metadata"].get("ownerReferences") or [])]

        wl_api = (*KUEUE_WORKLOAD[:2], self.ns, KUEUE_WORKLOAD[2])
        for wl in owned(self.co.list_namespaced_custom_object(*wl_api)["items"]):
            with contextlib.suppress(ApiException):
                self.co.patch_namespaced_custom_object(*wl_api, wl, {"metadata": {"finalizers": None}})
                self.co.delete_namespaced_custom_object(*wl_api, wl)
        secrets = json.loads(self.core.list_namespaced_secret(self.ns, _preload_content=False).data)["items"]
        for name in owned(secrets):
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_secret(name, self.ns)


KUEUE_WORKLOAD = ("kueue.x-k8s.io", "v1beta2", "workloads")


class Kueue:
    """What Kueue does with a job labelled with a LocalQueue (v0.19): a Workload named and labelled as Kueue names
    it, owned by the job (a controller reference that blocks the owner's deletion) with Kueue's finalizer; its
    QuotaReserved/Admitted conditions; admission unsuspends the job."""

    def __init__(self, op: "Operator") -> None:
        self.op = op

    def _name(self, job: dict) -> str:
        return f"{job['kind'].lower()}-{job['metadata']['name']}-{job['metadata']['uid'][:5]}"

    def workload(self, name: str) -> dict:
        """The job's Workload (made on first use)."""
        op, job = self.op, self.op.job(name)
        wl_name = self._name(job)
        with contextlib.suppress(ApiException):
            return op.co.get_namespaced_custom_object(*KUEUE_WORKLOAD[:2], op.ns, KUEUE_WORKLOAD[2], wl_name)
        meta = job["metadata"]
        return op.co.create_namespaced_custom_object(*KUEUE_WORKLOAD[:2], op.ns, KUEUE_WORKLOAD[2], {
            "apiVersion": "/".join(KUEUE_WORKLOAD[:2]), "kind": "Workload",
            "metadata": {"name": wl_name, "labels": {"kueue.x-k8s.io/job-uid": meta["uid"]},
                         "finalizers": ["kueue.x-k8s.io/resource-in-use"],
                         "ownerReferences": [{"apiVersion": job["apiVersion"], "kind": job["kind"],
                                              "name": meta["name"], "uid": meta["uid"], "controller": True,
                                              "blockOwnerDeletion": True}]},
            "spec": {"queueName": meta["labels"]["kueue.x-k8s.io/queue-name"], "podSets": [
                {"name": ps, "count": count, "template": {"spec": {"containers": [{"name": op.ctl.container,
                                                                                   "image": "img"}]}}}
                for ps, count in op.ctl.podsets(job)]}})

    def workloads(self) -> list[dict]:
        return self.op.co.list_namespaced_custom_object(*KUEUE_WORKLOAD[:2], self.op.ns, KUEUE_WORKLOAD[2])["items"]

    def _status(self, name: str, status: dict) -> None:
        wl = self.workload(name)
        self.op.co.patch_namespaced_custom_object_status(*KUEUE_WORKLOAD[:2], self.op.ns, KUEUE_WORKLOAD[2],
                                                         wl["metadata"]["name"], {"status": status})

    def pending(self, name: str, message: str, reason: str = "Pending") -> None:
        """No quota for it (yet): QuotaReserved False with Kueue's reason."""
        conds: list[dict] = []
        _condition(conds, "QuotaReserved", reason, message)
        conds[0].update(status="False")
        conds[0].pop("lastUpdateTime")
        self._status(name, {"conditions": conds})

    def admit(self, name: str, cluster_queue: str = "goodput-gpu", flavor: str = "p5.48xlarge") -> None:
        """Quota reserved and admitted in ``cluster_queue``; then the job is unsuspended."""
        job = self.op.job(name)
        conds: list[dict] = []
        for kind, message in (("QuotaReserved", f"Quota reserved in ClusterQueue {cluster_queue}"),
                              ("Admitted", "The workload is admitted")):
            reason = kind
            _condition(conds, kind, reason, message)
        for c in conds:
            c.pop("lastUpdateTime")
        assignments = [{"name": ps, "count": count, "flavors": {"nvidia.com/gpu": flavor}}
                       for ps, count in self.op.ctl.podsets(job)]
        self._status(name, {"conditions": conds, "admission": {"clusterQueue": cluster_queue,
                                                               "podSetAssignments": assignments}})
        self.op.co.patch_namespaced_custom_object(*self.op.gvp, name, self.op.ctl.suspend_patch(False))


__all__ = ["ApiServer", "Audit", "AuditEvent", "Controller", "Kubelet", "Kueue", "Namespace", "Operator", "PYTORCHJOB",
           "TRAINJOB", "apiserver", "for_kube_1_20", "install_crds", "kubelet", "make_namespace", "wait_until",
           "now_rfc3339"]
