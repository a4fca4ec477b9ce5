"""The trainer's progress reaches the launcher's progress line through the real API server, for both job kinds:

* PyTorchJob: rank 0 patches the annotation ``goodput.dev/progress`` on its own pod as the pod's service account
  (``trainer.status_report.PodAnnotationSink``); the launcher reads it from the pods it lists.
* TrainJob: the real kubeflow SDK posts to the Trainer's status endpoint, played here by a receiver that writes
  ``status.trainerStatus`` as the controller does; the launcher reads it from the job it watches.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from kubernetes import client as k8s

from trainer.hooks import StepReport
from trainer.status_report import ANNOTATION, SERVER_URL_ENV, PodAnnotationSink, StatusReporter, TrainJobStatusSink

try:
    from tests.k8s_apiserver import PYTORCHJOB, TRAINJOB, Operator, apiserver, make_namespace, wait_until
    from tests.test_k8s_supervise import Launcher, manifest, start, succeed
    from tests.test_status_report import Receiver
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from k8s_apiserver import PYTORCHJOB, TRAINJOB, Operator, apiserver, make_namespace, wait_until
    from test_k8s_supervise import Launcher, manifest, start, succeed
    from test_status_report import Receiver

TRAINER_SA = "goodput-trainer"
# What the trainer's service account needs for its progress annotation, as deploy/rbac-trainer.yaml grants it.
TRAINER_ROLE = yaml.safe_load((Path(__file__).resolve().parents[1] / "deploy" / "rbac-trainer.yaml").read_text())


def trainer_identity(ns, tmp: Path, *, role: bool = True) -> Path:
    """The trainer pods' service account in ``ns`` (bound to ``TRAINER_ROLE`` unless not ``role``) and the
    directory a pod mounts its token in (token, namespace, ca.crt)."""
    server = ns.server
    core = k8s.CoreV1Api(server.admin)
    core.create_namespaced_service_account(ns.name, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name=TRAINER_SA)))
    if role:
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "goodput-trainer-progress"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                               "name": "goodput-trainer-progress"},
                   "subjects": [{"kind": "ServiceAccount", "name": TRAINER_SA, "namespace": ns.name}]}
        server.kubectl("apply", "-n", ns.name, "-f", "-", input=yaml.safe_dump_all([TRAINER_ROLE, binding]))
    token = core.create_namespaced_service_account_token(TRAINER_SA, ns.name, k8s.AuthenticationV1TokenRequest(
        spec=k8s.V1TokenRequestSpec(audiences=["https://kubernetes.default.svc.cluster.local"],
                                    expiration_seconds=3600))).status.token
    sa_dir = tmp / "serviceaccount"
    sa_dir.mkdir()
    (sa_dir / "token").write_text(token)
    (sa_dir / "namespace").write_text(ns.name)
    (sa_dir / "ca.crt").write_bytes(Path(server.ca).read_bytes())
    return sa_dir


def pod_env(server, pod: str) -> dict:
    url = urlparse(server.url)
    return {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port), "HOSTNAME": pod}


def report(step: int) -> StepReport:
    return StepReport(step=step, loss=1.5, step_s=0.01, data_wait_s=0.0, tokens=512, tokens_seen=512 * step,
                      lr=1e-3, mfu=None)


def trainer_requests(ns) -> list:
    user = f"system:serviceaccount:{ns.name}:{TRAINER_SA}"
    return [e for e in ns.server.audit.events() if e.user == user]


@pytest.fixture
def cluster_for(tmp_path):
    made = []

    def make(ctl):
        ns = make_namespace(apiserver(), "gp", rbac_file=ctl.rbac_file, tmp=tmp_path)
        op = Operator(ns, ctl)
        made.append(op)
        return ns, op
    yield make
    for op in made:
        op.close()


def test_a_pytorchjobs_progress_goes_through_its_pods_annotation_to_the_launchers_line(cluster_for, tmp_path):
    ns, op = cluster_for(PYTORCHJOB)
    sa_dir = trainer_identity(ns, tmp_path)
    launcher = Launcher(ns, manifest())
    reported = threading.Event()

    def scenario(op, name):
        master, workers = start(op, name)
        sink = PodAnnotationSink.from_pod(pod_env(ns.server, master), sa_dir=sa_dir)
        rep = StatusReporter([sink], max_steps=100, events_path=tmp_path / "events.jsonl", every_s=0.2)
        for step in range(1, 43):
            rep.after_step(report(step))
        rep.close()
        assert rep.sent == {"pod-annotation": 1} and rep.failed == {"pod-annotation": 0}, (rep.sent, rep.failed)
        reported.set()
        wait_until(lambda: launcher.printed("[train] step 42/100"), what="the launcher's progress line")
        succeed(op, name, [master, *workers])

    op.play(scenario)
    launcher.result()
    op.join()
    assert reported.is_set()
    master = k8s.CoreV1Api(ns.server.admin).read_namespaced_pod(f"{manifest()['metadata']['name']}-master-0", ns.name)
    assert '"step":42' in master.metadata.annotations[ANNOTATION]
    line = next(ln for ln in launcher.lines if ln.startswith("[train] "))
    assert line.startswith("[train] step 42/100") and "ETA " in line
    # Exactly what RBAC must allow the trainer: a PATCH of its own pod.
    reqs = trainer_requests(ns)
    assert {(e.what, e.name, e.code) for e in reqs} == {(("", "pods", "patch"), master.metadata.name, 200)}


def test_without_the_role_the_annotation_sink_turns_off_with_one_line(cluster_for, tmp_path, caplog):
    ns, op = cluster_for(PYTORCHJOB)
    sa_dir = trainer_identity(ns, tmp_path, role=False)
    op.create_job(manifest())
    pod = op.add_pod(manifest()["metadata"]["name"], "Master", 0)
    sink = PodAnnotationSink.from_pod(pod_env(ns.server, pod), sa_dir=sa_dir)
    rep = StatusReporter([sink], max_steps=100, events_path=tmp_path / "events.jsonl", every_s=0.05)
    caplog.set_level(logging.WARNING)
    rep.after_step(report(1))
    wait_until(lambda: not rep.sinks, timeout=30, what="the refused sink to turn off", every=0.05)
    for step in range(2, 50):
        rep.after_step(report(step))
    rep.close()
    assert rep.failed == {"pod-annotation": 1} and rep.sent == {"pod-annotation": 0}
    warned = [r.message for r in caplog.records if "pod-annotation" in r.message]
    assert len(warned) == 1 and "403" in warned[0] and "patch on pods" in warned[0]
    assert [(e.what, e.code) for e in trainer_requests(ns)] == [(("", "pods", "patch"), 403)]


def test_a_trainjobs_progress_goes_through_the_sdk_and_its_status_to_the_launchers_line(
        cluster_for, tmp_path, monkeypatch):
    sdk = pytest.importorskip("kubeflow.trainer.backends.kubernetes.utils")
    ns, op = cluster_for(TRAINJOB)
    name = manifest()["metadata"]["name"]
    receiver = Receiver("ok")
    posted = threading.Condition()

    # The Trainer's status endpoint: what the SDK posts becomes the TrainJob's status.trainerStatus.
    def write_status():
        done = 0
        while not op.stop.is_set():
            with receiver.got:
                receiver.got.wait_for(lambda: len(receiver.requests) > done or op.stop.is_set(), 1)
                new = receiver.requests[done:]
            for _, _, _, body in new:
                op.co.patch_namespaced_custom_object_status(TRAINJOB.group, TRAINJOB.version, ns.name,
                                                            TRAINJOB.plural, name, {"status": body})
                done += 1
                with posted:
                    posted.notify_all()
    threading.Thread(target=write_status, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("trainer-audience-token")
    monkeypatch.setenv(SERVER_URL_ENV, receiver.url)
    monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
    monkeypatch.setattr(sdk, "_last_update_time", 0.0)
    monkeypatch.setattr(sdk, "_cached_token", None)
    launcher = Launcher(ns, manifest(kind="TrainJob"))

    def scenario(op, name):
        node0, others = start(op, name)
        rep = StatusReporter([TrainJobStatusSink()], max_steps=200, events_path=tmp_path / "events.jsonl",
                             every_s=30)
        for step in range(1, 151):
            rep.after_step(report(step))
        rep.close()
        wait_until(lambda: launcher.printed("[train] step 150/200"), what="the launcher's progress line")
        succeed(op, name, [node0, *others])

    try:
        op.play(scenario)
        launcher.result()
        op.join()
    finally:
        receiver.close()
    status = op.job(name)["status"]["trainerStatus"]
    assert status["progressPercentage"] == 75
    assert {m["name"]: m["value"] for m in status["metrics"]}["step"] == "150"
    assert any(ln.startswith("[train] step 150/200") for ln in launcher.lines)
