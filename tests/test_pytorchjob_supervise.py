"""Supervising a PyTorchJob against a loopback Kubernetes API server (``k8s_fake``), with the real client.

Each test plays one scenario as the Training Operator and kubelet would: success, failure, restarts,
a restarted launcher, cancellation, dropped watches and API errors, timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from components.train.pytorchjob import JobSpec, job_manifest
from components.train.supervise import JobCancelled, JobFailed, JobTimeout, SuperviseConfig, api_client, run_job

try:
    from tests.k8s_fake import FakeKube
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from k8s_fake import FakeKube

NS = "team-a"
REPO = Path(__file__).resolve().parents[1]
FAST = SuperviseConfig(timeout_s=30, watch_timeout_s=1, request_timeout_s=5, backoff_s=0.05, backoff_max_s=0.2,
                       delete_wait_s=3, log_poll_s=0.05, log_idle_s=3, log_drain_s=3)


def manifest(name: str = "gp-train-1", run_id: str = "run-1") -> dict:
    return job_manifest(JobSpec(name=name, image="img", nodes=2, run_id=run_id, task_name="train"))


def start(k: FakeKube, ns: str, name: str, workers: int = 1) -> tuple[str, list[str]]:
    """Created -> pods -> Running, as the operator reports it."""
    k.step(ns, name, 0.05)
    k.set_phase(ns, name, "Created")
    master = k.add_pod(ns, name, "Master", 0)
    ws = [k.add_pod(ns, name, "Worker", i) for i in range(workers)]
    k.set_phase(ns, name, "Running", replicas={"Master": {"active": 1}, "Worker": {"active": workers}})
    return master, ws


def succeed(k: FakeKube, ns: str, name: str, pods: list[str]) -> None:
    for p in pods:
        k.terminate(ns, p)
    k.set_phase(ns, name, "Succeeded", replicas={"Master": {"succeeded": 1}, "Worker": {"succeeded": len(pods) - 1}})


def supervise(k: FakeKube, m: dict, lines: list[str] | None = None, **cfg):
    c = SuperviseConfig(**{**FAST.__dict__, **cfg})
    return run_job(m, namespace=NS, client=api_client(k.url), cfg=c,
                   log=(lines.append if lines is not None else lambda s: None))


def master_lines(lines: list[str]) -> list[str]:
    return [ln[len("[master-0] "):] for ln in lines if ln.startswith("[master-0] ")]


# Success and failure --------------------------------------------------------------------------

def test_success_reports_phases_and_streams_the_master_log():
    def scenario(k, ns, name):
        master, workers = start(k, ns, name)
        for i in range(6):
            k.log(ns, master, f"step {i} loss {2.0 - i / 10:.2f}")
            k.step(ns, name, 0.05)
        k.log(ns, master, "training done")
        k.step(ns, name, 0.2)
        succeed(k, ns, name, [master, *workers])

    lines: list[str] = []
    with FakeKube(scenario) as k:
        out = supervise(k, manifest(), lines)
        assert len(k.calls("POST", "pytorchjobs$")) == 1 and k.created == 1
        assert not k.calls("DELETE")
        assert k.calls("GET", "pytorchjobs$", watch=True), "waited with a watch"
    assert (out.phase, out.created, out.name, out.namespace) == ("Succeeded", True, "gp-train-1", NS)
    assert out.restarts == {"Master": 0, "Worker": 0}
    assert master_lines(lines) == [f"step {i} loss {2.0 - i / 10:.2f}" for i in range(6)] + ["training done"]
    text = "\n".join(lines)
    for phase in ("Created", "Running", "Succeeded"):
        assert f"PyTorchJob {NS}/gp-train-1: {phase}" in text
    assert "replicas: Master active=1, Worker active=1" in text


def test_failure_raises_with_conditions_pod_reasons_events_and_log_tail():
    def scenario(k, ns, name):
        master, workers = start(k, ns, name)
        k.log(ns, master, "step 10 loss 1.9", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        k.step(ns, name, 0.3)
        k.terminate(ns, master, exit_code=137, reason="OOMKilled", message="memory limit 1600Gi exceeded")
        k.add_event(ns, "Pod", master, "BackOff", "Back-off restarting failed container pytorch")
        k.add_event(ns, "PyTorchJob", name, "PyTorchJobFailed", "PyTorchJob gp-train-1 is failed because 1 Master "
                    "replica(s) failed.")
        k.set_phase(ns, name, "Failed", reason="PyTorchJobFailed",
                    message="PyTorchJob gp-train-1 is failed because 1 Master replica(s) failed.",
                    replicas={"Master": {"failed": 1}, "Worker": {"active": 1}})

    with FakeKube(scenario) as k:
        with pytest.raises(JobFailed) as err:
            supervise(k, manifest())
        assert not k.calls("DELETE"), "a failed job is kept for inspection"
    msg = str(err.value)
    assert "condition Failed: PyTorchJobFailed: PyTorchJob gp-train-1 is failed because 1 Master replica(s)" in msg
    assert "pod gp-train-1-master-0: container pytorch terminated: OOMKilled (exit code 137)" in msg
    assert "memory limit 1600Gi exceeded" in msg
    assert "BackOff pod/gp-train-1-master-0: Back-off restarting failed container" in msg
    assert "CUDA out of memory" in msg, "the log's tail is in the message"


def test_restarts_are_counted_per_replica_and_each_container_log_streamed_once():
    def scenario(k, ns, name):
        def shown(text):
            # The kubelet keeps only the current container's log for follow=true: restart a container
            # only once the launcher has shown its log, as it would have in a run longer than this test.
            assert k.wait_for(lambda: f"[master-0] {text}" in lines, 30), f"{text!r} never shown"

        master, workers = start(k, ns, name, workers=2)
        k.log(ns, master, "attempt 0")
        shown("attempt 0")
        k.restart_container(ns, master)             # in place (restartPolicy OnFailure)
        k.set_phase(ns, name, "Restarting", reason="PyTorchJobRestarting")
        k.log(ns, master, "attempt 1")
        shown("attempt 1")
        k.restart_container(ns, master)
        k.log(ns, master, "attempt 2")
        k.replace_pod(ns, workers[1])               # spot reclaim: a new pod, same name
        k.set_phase(ns, name, "Running")
        k.step(ns, name, 1.5)                       # a watch cycle: restarts are seen between watches too
        succeed(k, ns, name, [master, *workers])

    lines: list[str] = []
    with FakeKube(scenario) as k:
        out = supervise(k, manifest(), lines)
    assert out.restarts == {"Master": 2, "Worker": 1}
    assert master_lines(lines) == ["attempt 0", "attempt 1", "attempt 2"]
    assert any(ln.startswith("restarts: Master=2, Worker=1") for ln in lines)
    assert any("Restarting" in ln for ln in lines)


# Launcher restarts, cancellation, timeout ------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, sys
    from components.train.supervise import SuperviseConfig, api_client, run_job
    cfg = SuperviseConfig(timeout_s=60, watch_timeout_s=1, backoff_s=0.05, backoff_max_s=0.2, delete_wait_s=3,
                          log_poll_s=0.05, log_idle_s=3)
    run_job(json.load(open(sys.argv[1])), namespace=sys.argv[3], client=api_client(sys.argv[2]), cfg=cfg)
""")


def launcher(tmp_path: Path, k: FakeKube, m: dict) -> tuple[subprocess.Popen, Path]:
    """The launcher as its own process (a KFP step's pod), logging to a file."""
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    (tmp_path / "child.py").write_text(CHILD)
    out = tmp_path / "launcher.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(out, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "manifest.json"), k.url,
                                 NS], stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc, out


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"launcher never printed {text!r}; its log:\n{path.read_text(errors='replace')}")


def long_run(k, ns, name):
    """Runs until deleted (or told to finish through k.finish)."""
    master, workers = start(k, ns, name)
    i = 0
    while k.alive(ns, name) and not getattr(k, "finish", False):
        k.log(ns, master, f"step {i}")
        i += 1
        k.step(ns, name, 0.1)
    if k.alive(ns, name):
        succeed(k, ns, name, [master, *workers])


def test_restarted_launcher_reattaches_instead_of_creating_a_duplicate(tmp_path):
    m = manifest()
    with FakeKube(long_run) as k:
        proc, log = launcher(tmp_path, k, m)
        try:
            wait_for_text(log, "[master-0] step 2", proc)
        finally:
            proc.kill()                            # the launcher pod dies hard: no cleanup runs
            proc.wait()
        assert k.job(NS, m["metadata"]["name"]) is not None, "the job outlives its launcher"

        lines: list[str] = []
        threading_finish = __import__("threading").Timer(1.0, lambda: setattr(k, "finish", True))
        threading_finish.start()
        out = supervise(k, m, lines)               # the launcher's next attempt
        threading_finish.join()
        assert k.created == 1, "exactly one create"
        assert [r.status for r in k.calls("POST", "pytorchjobs$")] == [201, 409]
        assert not k.calls("DELETE")
    assert out.phase == "Succeeded" and out.created is False
    assert any("re-attached to existing PyTorchJob" in ln for ln in lines)
    assert master_lines(lines), "the log is streamed after re-attaching too"


def test_sigterm_to_the_launcher_deletes_the_job(tmp_path):
    m = manifest()
    name = m["metadata"]["name"]
    with FakeKube(long_run) as k:
        proc, log = launcher(tmp_path, k, m)
        try:
            wait_for_text(log, "[master-0] step 1", proc)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)       # the KFP run was cancelled
            code = proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
        took = time.monotonic() - t0
        deletes = k.calls("DELETE", f"pytorchjobs/{name}$")
        assert [d.status for d in deletes] == [200]
        assert k.job(NS, name) is None
    text = log.read_text()
    assert code != 0, text
    assert "JobCancelled" in text and "deleting PyTorchJob" in text, text
    assert took < 10


def test_timeout_deletes_the_job():
    m = manifest()
    with FakeKube(long_run) as k:
        t0 = time.monotonic()
        with pytest.raises(JobTimeout, match=r"did not finish within 2 s(.|\n)*was deleted"):
            supervise(k, m, timeout_s=2)
        took = time.monotonic() - t0
        assert [d.status for d in k.calls("DELETE", "pytorchjobs")] == [200]
        assert [d.status for d in k.calls("DELETE", "secrets")] == [200] and not k.secrets
        assert k.job(NS, m["metadata"]["name"]) is None
    assert took < 8


def test_keyboard_interrupt_path_is_the_cancel_path():
    """Ctrl-C on a local `run_job` (the SIGINT twin of the SIGTERM test) deletes the job too."""
    m = manifest()

    def scenario(k, ns, name):
        start(k, ns, name)
        # Only while run_job is waiting on its watch, so the interrupt lands inside it.
        if k.wait_for(lambda: k.calls("GET", "pytorchjobs$", watch=True)):
            k.step(ns, name, 0.2)
            os.kill(os.getpid(), signal.SIGINT)
        k.step(ns, name, 30)

    with FakeKube(scenario) as k:
        with pytest.raises(JobCancelled):
            supervise(k, m)
        assert [d.status for d in k.calls("DELETE", "pytorchjobs")] == [200]


# A flaky API ------------------------------------------------------------------------------------

def test_dropped_watches_expired_versions_and_api_errors_are_resynced():
    def scenario(k, ns, name):
        master, workers = start(k, ns, name)
        for i in range(12):
            k.log(ns, master, f"step {i}")
            k.step(ns, name, 0.1)
            if i == 3:
                k.drop_streams()                   # connection reset mid-stream (watch and log)
            if i == 6:
                k.fail("GET", "pytorchjobs", 503, times=2)   # the re-list (or the watch) fails twice
                k.drop_streams()
            if i == 9:
                k.compact()                        # the next watch's resourceVersion is too old: 410
                # The open watch ends (timeout) and is renewed.
                assert k.wait_for(lambda: any("watch expired (410)" in ln for ln in list(lines)), 30)
                k.fail("GET", "pytorchjobs", 500, times=1, only_watch=True)
                assert k.wait_for(lambda: any(r.status == 500 for r in k.calls("GET", "pytorchjobs$")), 30)
        succeed(k, ns, name, [master, *workers])

    lines: list[str] = []
    with FakeKube(scenario) as k:
        out = supervise(k, manifest(), lines)
        watches = k.calls("GET", "pytorchjobs$", watch=True)
        assert len(watches) >= 4      # two cut, one expired, one refused (renewals in between vary with timing)
        assert sum(r.status == 503 for r in k.calls("GET", "pytorchjobs$")) == 2
        assert sum(r.status == 500 for r in watches) == 1
    assert out.phase == "Succeeded"
    text = "\n".join(lines)
    assert text.count("dropped (ProtocolError); resyncing") == 2
    assert "503 Service Unavailable; resyncing" in text and "500 Internal Server Error; resyncing" in text
    assert "watch expired (410)" in text
    # Every log line exactly once, in order, despite the cut log streams.
    assert master_lines(lines) == [f"step {i}" for i in range(12)]


def test_transient_create_errors_are_retried_and_forbidden_is_explained():
    def scenario(k, ns, name):
        master, workers = start(k, ns, name)
        succeed(k, ns, name, [master, *workers])

    with FakeKube(scenario) as k:
        k.fail("POST", "pytorchjobs", 503, times=2)
        assert supervise(k, manifest()).phase == "Succeeded"
        assert [r.status for r in k.calls("POST", "pytorchjobs")] == [503, 503, 201]
        # The peer secret was made once (the retries found it) and the job owns it.
        assert [r.status for r in k.calls("POST", "secrets")] == [201, 409, 409]
        (secret,) = k.secrets.values()
        assert [o["name"] for o in secret["metadata"]["ownerReferences"]] == ["gp-train-1"]
    with FakeKube(scenario) as k:
        k.fail("POST", "pytorchjobs", 403, times=1)
        with pytest.raises(PermissionError, match="deploy/rbac.yaml"):
            supervise(k, manifest())
        assert len(k.calls("POST", "pytorchjobs")) == 1, "no retry loop on 403"


def test_a_watch_refused_by_a_server_that_allowed_it_before_is_retried_a_few_times():
    """A restarting API server answers 403 until its authorizer has loaded RBAC: a few such answers to the watch
    are retried (re-list, watch); more in a row are an RBAC error."""
    def scenario(k, ns, name):
        master, workers = start(k, ns, name)
        k.fail("GET", "pytorchjobs", 403, times=2, only_watch=True)
        # The open watch ends; the next two are refused.
        assert k.wait_for(lambda: sum(r.status == 403 for r in k.calls("GET", "pytorchjobs$")) == 2, 30)
        succeed(k, ns, name, [master, *workers])

    lines: list[str] = []
    with FakeKube(scenario) as k:
        assert supervise(k, manifest(), lines).phase == "Succeeded"
        assert sum(r.status == 403 for r in k.calls("GET", "pytorchjobs$", watch=True)) == 2
    assert sum("403 Forbidden from a server that allowed it before" in ln for ln in lines) == 2

    def refused(k, ns, name):
        start(k, ns, name)
        k.fail("GET", "pytorchjobs", 403, times=100, only_watch=True)

    with FakeKube(refused) as k:
        with pytest.raises(PermissionError, match="deploy/rbac.yaml"):
            supervise(k, manifest(), denied_retries=3)
        assert sum(r.status == 403 for r in k.calls("GET", "pytorchjobs$", watch=True)) == 4


def test_a_job_of_another_run_is_not_adopted_and_a_failed_one_is_recreated():
    m = manifest(run_id="run-1")
    with FakeKube() as k:
        k.put_job(manifest(run_id="run-0"), NS)
        with pytest.raises(RuntimeError, match="belongs to run run-0"):
            supervise(k, m)
        assert not k.calls("DELETE", "pytorchjobs")
        assert not k.secrets, "the secret made for a job it did not create is not left behind"

    def scenario(k, ns, name):
        master, workers = start(k, ns, name)
        succeed(k, ns, name, [master, *workers])

    with FakeKube(scenario) as k:                  # a KFP retry after the job failed
        k.put_job(m, NS)
        k.set_phase(NS, m["metadata"]["name"], "Failed", message="1 Master replica(s) failed.")
        lines: list[str] = []
        out = supervise(k, m, lines)
        assert out.phase == "Succeeded" and out.created is True
        assert [r.status for r in k.calls("POST", "pytorchjobs")] == [409, 201]
        assert len(k.calls("DELETE", "pytorchjobs")) == 1
        # The failed job's secret went with it; the new job has a new one.
        assert [r.status for r in k.calls("POST", "secrets")] == [201, 201] and len(k.secrets) == 1
    assert any("creating it again" in ln for ln in lines)


# RBAC -----------------------------------------------------------------------------------------

def _rbac_needs(r) -> tuple[str, str, str]:
    """(apiGroup, resource, verb) a request needs, as the API server's authorizer sees it."""
    parts = r.path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2:]
    resource = rest[0] + ("/" + rest[2] if len(rest) > 2 else "")
    named = len(rest) > 1
    verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch"}.get(r.method) or (
        "watch" if str(r.query.get("watch")).lower() in ("true", "1") else "get" if named else "list")
    return group, resource, verb


def test_deploy_rbac_allows_every_call_the_launcher_makes():
    import yaml

    docs = list(yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    allowed = {(g, res, v) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for v in rule["verbs"]}
    assert not any("*" in x for a in allowed for x in a), "least privilege: no wildcards"

    def failing(k, ns, name):
        master, _ = start(k, ns, name)
        k.step(ns, name, 0.2)
        k.terminate(ns, master, exit_code=1, reason="Error")
        k.add_event(ns, "Pod", master, "BackOff", "Back-off")
        k.set_phase(ns, name, "Failed")

    needed = set()
    with FakeKube(failing) as k:                   # create, watch, pods, log, events
        with pytest.raises(JobFailed):
            supervise(k, manifest())
        needed |= {_rbac_needs(r) for r in k.requests}
    with FakeKube(long_run) as k:                  # re-attach (get) and delete
        k.put_job(manifest(), NS)
        with pytest.raises(JobTimeout):
            supervise(k, manifest(), timeout_s=1)
        needed |= {_rbac_needs(r) for r in k.requests}
    assert {("kubeflow.org", "pytorchjobs", v) for v in ("create", "get", "watch", "delete")} <= needed
    assert {("", "pods", "list"), ("", "pods/log", "get"), ("", "events", "list")} <= needed
    assert {("", "secrets", v) for v in ("create", "patch", "delete")} <= needed       # the job's peer secret
    assert needed <= allowed, needed - allowed
