"""The launcher (components/train/supervise.py, components/train/launch.py's cluster backends) against a real
kube-apiserver.

The launcher authenticates as the pipeline's service account with a TokenRequest token, bound only by
``deploy/rbac.yaml`` (TrainJobs: ``deploy/trainer-v2/rbac.yaml``), so RBAC answers every call; the test plays
the job's controller (the Training Operator; for TrainJobs the Trainer with the JobSet and Job controllers), the
garbage collector and the kubelet's log endpoint (``tests/k8s_apiserver.py``), and reads the server's audit log
to see what the launcher asked for. The server closes a watch without ``timeoutSeconds`` after 4-8 s.

The scenarios that take a ``kind`` run the same code for both kinds (``kube`` fixture); the log follower's and
the per-replica restart scenarios are the supervisor's shared code and run for PyTorchJob only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from components.train.cleanup import cleanup_run_jobs
from components.train.job_kinds import KINDS
from components.train.pytorchjob import JobSpec, job_manifest
from components.train.supervise import JobCancelled, JobFailed, JobTimeout, NotAdmitted, SuperviseConfig, run_job
from components.train.launch import train
from components.train.trainjob import RuntimeSpec, runtime_manifest, trainjob_manifest

try:
    from tests.k8s_apiserver import PYTORCHJOB, REPO, TRAINJOB, Operator, apiserver, make_namespace, wait_until
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from k8s_apiserver import PYTORCHJOB, REPO, TRAINJOB, Operator, apiserver, make_namespace, wait_until

FAST = SuperviseConfig(timeout_s=60, watch_timeout_s=5, pods_every_s=1, request_timeout_s=5, backoff_s=0.1,
                       backoff_max_s=1, delete_wait_s=5, log_poll_s=0.1, log_idle_s=4, log_drain_s=3)


# A runtime for pods without GPUs or EFA (a TrainJob cannot remove what its runtime requests).
CPU_RUNTIME = {"gpus_per_node": 0, "efa_per_node": 0, "scheduler": ""}


def _cluster(ctl, tmp_path):
    ns = make_namespace(apiserver(), "gp", rbac_file=ctl.rbac_file, tmp=tmp_path)
    op = Operator(ns, ctl)
    yield ns, op
    op.close()


@pytest.fixture
def cluster(tmp_path):
    """(namespace with the launcher's identity, the test's Training Operator) on the session's API server."""
    yield from _cluster(PYTORCHJOB, tmp_path)


@pytest.fixture
def tj_cluster(tmp_path):
    """``cluster`` for TrainJobs."""
    yield from _cluster(TRAINJOB, tmp_path)


@pytest.fixture(params=[PYTORCHJOB, TRAINJOB], ids=["pytorchjob", "trainjob"])
def kube(request, tmp_path):
    """``cluster`` for each job kind: the launcher's Role and the controller the test plays are the kind's."""
    yield from _cluster(request.param, tmp_path)


def manifest(name: str = "gp-train-1", run_id: str = "run-1", nodes: int = 2, kind: str = "PyTorchJob",
             **settings) -> dict:
    spec = JobSpec(name=name, image="img", nodes=nodes, gpus_per_node=0, efa_per_node=0, run_id=run_id,
                   task_name="train", **settings)
    if kind == "TrainJob":
        return trainjob_manifest(spec, RuntimeSpec.from_dict({"name": "goodput-nvrx-cpu", **CPU_RUNTIME}))
    return job_manifest(spec)


def what(op: Operator, verb: str) -> tuple[str, str, str]:
    """The audit log's (apiGroup, resource, verb) of ``verb`` on the kind's jobs."""
    return op.ctl.group, op.ctl.plural, verb


class Launcher:
    """``run_job`` in a thread, as the launcher's service account; its log lines collected."""

    def __init__(self, ns, m: dict, **cfg) -> None:
        self.prefix = KIND_PREFIX[m["kind"]]
        self.lines: list[str] = []
        self.outcome = self.error = None
        c = SuperviseConfig(**{**FAST.__dict__, **cfg})

        def go():
            try:
                self.outcome = run_job(m, namespace=ns.name, client=ns.launcher_client(), cfg=c, log=self.lines.append)
            except BaseException as e:  # noqa: BLE001 - re-raised by result()
                self.error = e
        self.thread = threading.Thread(target=go, daemon=True)
        self.thread.start()

    def result(self, timeout: float = 60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the launcher did not return:\n" + "\n".join(self.lines[-30:])
        if self.error is not None:
            raise self.error
        return self.outcome

    def printed(self, text: str) -> bool:
        return any(text in ln for ln in list(self.lines))

    def master_lines(self) -> list[str]:
        return [ln[len(self.prefix) + 1:] for ln in list(self.lines) if ln.startswith(self.prefix + " ")]


KIND_PREFIX = {c.kind: c.prefix for c in (PYTORCHJOB, TRAINJOB)}


def start(op: Operator, name: str, workers: int = 1) -> tuple[str, list[str]]:
    """Created -> pods -> Running, as the operator reports it."""
    op.set_phase(name, "Created")
    master = op.add_pod(name, "Master", 0)
    ws = [op.add_pod(name, "Worker", i) for i in range(workers)]
    op.set_phase(name, "Running", replicas={"Master": {"active": 1}, "Worker": {"active": workers}})
    return master, ws


def succeed(op: Operator, name: str, pods: list[str]) -> None:
    for p in pods:
        op.terminate(p)
    op.set_phase(name, "Succeeded", replicas={"Master": {"succeeded": 1}, "Worker": {"succeeded": len(pods) - 1}})


def no_denials(ns) -> None:
    denied = [(e.what, e.code) for e in ns.launcher_requests() if e.code in (401, 403)]
    assert not denied, f"RBAC refused the launcher: {denied}"


# Create, succeed, fail ----------------------------------------------------------------------------

def test_success_streams_the_master_log_and_reports_phases(kube):
    ns, op = kube

    def scenario(op, name):
        master, workers = start(op, name)
        for i in range(5):
            op.log(master, f"step {i} loss {2.0 - i / 10:.2f}")
        wait_until(lambda: launcher.printed(f"{op.ctl.prefix} step 4"), what="the log streamed")
        op.log(master, "training done")
        wait_until(lambda: launcher.printed("training done"), what="the last line")
        wait_until(lambda: any(e.verb == "watch" for e in ns.launcher_requests()), what="the launcher's watch")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest(kind=op.ctl.kind))
    op.play(scenario)
    out = launcher.result()
    op.join()
    assert (out.phase, out.created, out.namespace, out.kind) == ("Succeeded", True, ns.name, op.ctl.kind)
    assert out.restarts == ({"Master": 0, "Worker": 0} if op.ctl is PYTORCHJOB else {"Node": 0})
    assert launcher.master_lines() == [f"step {i} loss {2.0 - i / 10:.2f}" for i in range(5)] + ["training done"]
    text = "\n".join(launcher.lines)
    for phase in ("Running", "Succeeded"):
        assert f"{op.ctl.kind} {ns.name}/gp-train-1: {phase}" in text
    creates = [e for e in ns.launcher_requests() if e.what == what(op, "create")]
    assert [e.code for e in creates] == [201]
    reqs = ns.launcher_requests()
    assert any(e.what == what(op, "watch") for e in reqs), [e.what for e in reqs]
    no_denials(ns)


def test_failure_surfaces_the_reason(kube):
    ns, op = kube
    pods = []

    def scenario(op, name):
        master, workers = start(op, name)
        pods.append(master)
        op.log(master, "step 10 loss 1.9", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
        wait_until(lambda: launcher.printed("CUDA out of memory"), what="the log streamed")
        if op.ctl is PYTORCHJOB:
            op.terminate(master, exit_code=137, reason="OOMKilled", message="memory limit 1600Gi exceeded")
            op.add_event("Pod", master, "BackOff", "Back-off restarting failed container pytorch")
            op.add_event("PyTorchJob", name, "PyTorchJobFailed", "1 Master replica(s) failed.")
            op.set_phase(name, "Failed", reason="PyTorchJobFailed", message=f"PyTorchJob {name} is failed because "
                         "1 Master replica(s) failed.", replicas={"Master": {"failed": 1}, "Worker": {"active": 1}})
            return
        # Trainer v2: the pod exits 2 (a usage error), the node Job's pod failure policy fails the Job naming
        # the rule, the JobSet's rule for it fails the JobSet, and the Trainer marks the TrainJob Failed.
        op.terminate(master, exit_code=2, reason="Error", message="trainer: error: unrecognized arguments: --nope")
        op.add_event("Pod", master, "BackOff", "Back-off restarting failed container node")
        op.ctl.node_job_failed(op, name, "PodFailurePolicy", f"Container node for pod {ns.name}/{master} failed "
                               "with exit code 2 matching FailJob rule at index 1")
        op.set_phase(name, "Failed", reason="FailJobSetAction",
                     message=f"applying FailJobSet failure policy action (first failed job: {name}-node-0)",
                     replicas={"Node": {"failed": 1, "active": 1}})

    launcher = Launcher(ns, manifest(kind=op.ctl.kind))
    op.play(scenario)
    with pytest.raises(JobFailed) as err:
        launcher.result()
    op.join()
    msg = str(err.value)
    (master,) = pods
    if op.ctl is PYTORCHJOB:
        assert "condition Failed: PyTorchJobFailed: PyTorchJob gp-train-1 is failed because 1 Master" in msg
        assert "pod gp-train-1-master-0: container pytorch terminated: OOMKilled (exit code 137)" in msg
        assert "memory limit 1600Gi exceeded" in msg
    else:
        assert "condition Failed: FailJobSetAction: applying FailJobSet failure policy action" in msg
        assert "JobSet condition Failed: FailJobSetAction" in msg
        assert f"pod {master}: container node terminated: Error (exit code 2): trainer: error: unrecognized" in msg
        assert "job gp-train-1-node-0 failed: PodFailurePolicy: Container node" in msg
        assert "pod failure policy: ProgramIsWrong -> JobSet FailJobSet: the program or its settings are wrong" in msg
    assert f"BackOff pod/{master}: Back-off restarting failed container" in msg
    assert "CUDA out of memory" in msg, "the log's tail is in the message"
    assert op.job("gp-train-1") is not None, "a failed job is kept for inspection"
    no_denials(ns)


def test_restarts_are_counted_per_replica(cluster):
    ns, op = cluster

    def scenario(op, name):
        master, workers = start(op, name, workers=2)
        op.log(master, "attempt 0")
        wait_until(lambda: launcher.printed("attempt 0"), what="attempt 0")
        for attempt in (1, 2):                      # in place (restartPolicy OnFailure), status at once
            op.restart_in_kubelet(master)
            op.report_restart(master)
            op.log(master, f"attempt {attempt}")
            wait_until(lambda: launcher.printed(f"attempt {attempt}"), what=f"attempt {attempt}")
        op.replace_pod(workers[1], name, "Worker", 1)   # spot reclaim: a new pod, same name
        op.set_phase(name, "Running")
        wait_until(lambda: launcher.printed("Worker=1"), what="the worker restart counted")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest(nodes=3))
    op.play(scenario)
    out = launcher.result()
    op.join()
    assert out.restarts == {"Master": 2, "Worker": 1}
    assert launcher.master_lines() == ["attempt 0", "attempt 1", "attempt 2"]


def test_a_jobset_restart_is_one_restart_and_the_new_node_0_is_followed(tj_cluster):
    """Trainer v2 restarts a TrainJob by recreating every node's pod (a JobSet restart): one restart however
    many pods, counted from the JobSet, and the log of the new node 0 (a pod of another name) is streamed."""
    ns, op = tj_cluster

    def scenario(op, name):
        master, workers = start(op, name, workers=2)
        op.log(master, "attempt 0")
        wait_until(lambda: launcher.printed("attempt 0"), what="attempt 0")
        op.terminate(master, exit_code=137, reason="Error")
        op.set_phase(name, "Restarting")
        master = op.replace_pod(master, name, "Master", 0)
        workers = [op.replace_pod(w, name, "Worker", i) for i, w in enumerate(workers)]
        op.log(master, "attempt 1")
        wait_until(lambda: launcher.printed("attempt 1"), what="attempt 1 from the new node 0")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest(nodes=3, kind="TrainJob"))
    op.play(scenario)
    out = launcher.result()
    op.join()
    assert out.restarts == {"Node": 1}
    assert launcher.master_lines() == ["attempt 0", "attempt 1"]


def test_a_restarted_containers_log_is_printed_once_when_its_status_comes_late(cluster):
    """Defect 3: the kubelet restarts the container, the follower reconnects to the new one, and only
    then does the pod's status say restartCount=1; the new container's log was printed a second time."""
    ns, op = cluster

    def scenario(op, name):
        master, workers = start(op, name)
        op.log(master, "old 1", "old 2")
        wait_until(lambda: launcher.printed("old 2"), what="the first container's log")
        op.restart_in_kubelet(master)               # the status update is late
        op.log(master, "new 1", "new 2")
        wait_until(lambda: launcher.printed("new 2"), what="the follower on the new container")
        op.report_restart(master)
        op.log(master, "new 3")
        wait_until(lambda: launcher.printed("new 3"), what="new 3")
        # Let the follower see the status (restart count 1) and settle before the end.
        wait_until(lambda: launcher.printed("restarts: Master=1"), what="the restart counted")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest())
    op.play(scenario)
    out = launcher.result()
    op.join()
    assert launcher.master_lines() == ["old 1", "old 2", "new 1", "new 2", "new 3"]
    assert out.restarts["Master"] == 1


# Launcher restarts, cancellation, timeout, cleanup -------------------------------------------------

def subprocess_launcher(ns, m: dict, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """The launcher as its own process (a KFP step's pod), with the service account's kubeconfig."""
    path = tmp / "manifest.yaml"
    path.write_text(yaml.safe_dump(m))
    log = tmp / "launcher.log"
    env = {**os.environ, "KUBECONFIG": str(ns.kubeconfig),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "components.train.supervise", str(path), ns.name],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return proc, log


def long_run(op: Operator, name: str) -> None:
    """A job that logs a step every 0.1 s until it is deleted."""
    master, _ = start(op, name)
    i = 0
    while op.alive(name) and not op.stop.is_set():
        op.log(master, f"step {i}")
        i += 1
        op.stop.wait(0.1)


def test_a_restarted_launcher_reattaches_to_exactly_one_job(kube, tmp_path):
    ns, op = kube
    m = manifest(kind=op.ctl.kind)
    finish = threading.Event()

    def scenario(op, name):
        master, workers = start(op, name)
        i = 0
        while not finish.is_set():
            op.log(master, f"step {i}")
            i += 1
            finish.wait(0.1)
        succeed(op, name, [master, *workers])

    op.play(scenario)
    proc, log = subprocess_launcher(ns, m, tmp_path)
    try:
        wait_until(lambda: f"{op.ctl.prefix} step 2" in log.read_text(errors="replace") or proc.poll() is not None,
                   60, "the first launcher's log")
    finally:
        proc.kill()                                 # the launcher pod dies hard: no cleanup runs
        proc.wait()
    assert f"{op.ctl.prefix} step 2" in log.read_text(), log.read_text()
    assert op.alive("gp-train-1"), "the job outlives its launcher"

    launcher = Launcher(ns, m)                      # the step's retry
    wait_until(lambda: launcher.printed("re-attached"), what="the re-attach")
    wait_until(lambda: launcher.master_lines(), what="the log after re-attaching")
    finish.set()
    out = launcher.result()
    op.join()
    assert out.phase == "Succeeded" and out.created is False
    assert len(op.jobs()) == 1
    creates = [e.code for e in ns.launcher_requests() if e.what == what(op, "create")]
    assert creates == [201, 409], "exactly one job: the second launcher's create met the first one's job"
    assert not [e for e in ns.launcher_requests() if e.verb == "delete"]


def test_sigterm_to_the_launcher_deletes_the_job(kube, tmp_path):
    ns, op = kube
    op.play(long_run)
    proc, log = subprocess_launcher(ns, manifest(kind=op.ctl.kind), tmp_path)
    try:
        wait_until(lambda: f"{op.ctl.prefix} step 1" in log.read_text(errors="replace") or proc.poll() is not None,
                   60, "the launcher's log")
        proc.send_signal(signal.SIGTERM)           # the KFP run was cancelled
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code != 0 and "JobCancelled" in text and "is gone" in text, text
    deletes = [e for e in ns.launcher_requests() if e.what == what(op, "delete")]
    assert [e.code for e in deletes] == [200]
    assert op.job("gp-train-1") is None
    from kubernetes import client as k8s

    assert not k8s.CoreV1Api(ns.server.admin).list_namespaced_pod(ns.name).items, "its pods went with it"
    op.join()


def test_the_overall_timeout_deletes_the_job(kube):
    ns, op = kube
    launcher = Launcher(ns, manifest(kind=op.ctl.kind), timeout_s=4)
    op.play(long_run)
    with pytest.raises(JobTimeout, match=r"did not finish within 4 s(.|\n)*was deleted"):
        launcher.result(30)
    op.join()
    assert op.job("gp-train-1") is None
    assert [e.code for e in ns.launcher_requests() if e.what == what(op, "delete")] == [200]
    # The job's peer secret is deleted with it (by the launcher; the garbage collector would have too).
    assert [e.code for e in ns.launcher_requests() if e.what == ("", "secrets", "delete")] in ([200], [404])


def test_keyboard_interrupt_deletes_the_job_too(cluster):
    """Ctrl-C on a local ``run_job`` goes the cancel path."""
    ns, op = cluster

    def scenario(op, name):
        start(op, name)
        wait_until(lambda: [e for e in ns.launcher_requests() if e.verb == "watch"], what="the watch")
        os.kill(os.getpid(), signal.SIGINT)

    op.play(scenario)
    with pytest.raises(JobCancelled):
        run_job(manifest(), namespace=ns.name, client=ns.launcher_client(), cfg=FAST, log=lambda s: None)
    op.join()
    assert op.job("gp-train-1") is None


def test_the_cleanup_op_deletes_only_this_runs_unfinished_jobs(kube):
    ns, op = kube
    for name, run_id in (("gp-running", "run-9"), ("gp-done", "run-9"), ("gp-other", "run-8")):
        op.create_job(manifest(name=name, run_id=run_id, kind=op.ctl.kind))
    op.set_phase("gp-done", "Succeeded")
    lines: list[str] = []
    kind = KINDS[op.ctl.kind]
    deleted = cleanup_run_jobs("run-9", ns.name, client=ns.launcher_client(), kinds=[kind], required=[kind],
                               wait_s=5, log=lines.append)
    assert deleted == ["gp-running"]
    assert {j["metadata"]["name"] for j in op.jobs()} == {"gp-done", "gp-other"}
    assert any("is gone" in ln for ln in lines)
    no_denials(ns)


def test_the_cleanup_op_looks_at_both_kinds_and_skips_one_it_may_not_list(kube):
    """The exit handler deletes a run's jobs of either kind; the other kind's Role need not be bound."""
    ns, op = kube
    op.create_job(manifest(name="gp-left", run_id="run-9", kind=op.ctl.kind))
    lines: list[str] = []
    assert cleanup_run_jobs("run-9", ns.name, client=ns.launcher_client(), required=[KINDS[op.ctl.kind]],
                            wait_s=5, log=lines.append) == ["gp-left"]
    other = TRAINJOB if op.ctl is PYTORCHJOB else PYTORCHJOB
    assert any(f"{other.plural} not listable by this step (403)" in ln for ln in lines), lines
    assert op.job("gp-left") is None
    with pytest.raises(Exception, match="403|Forbidden"):
        cleanup_run_jobs("run-9", ns.name, client=ns.launcher_client(), required=[KINDS[other.kind]],
                         wait_s=5, log=lines.append)


# A server that closes watches, restarts, and kubelets that misbehave --------------------------------

def job_requests(ns, since: float, plural: str = "pytorchjobs") -> Counter:
    return Counter(e.verb for e in ns.launcher_requests(since) if e.resource == plural)


def test_a_watch_closed_by_the_server_is_resumed(cluster):
    """Without timeoutSeconds the server ends each watch after MIN_REQUEST_TIMEOUT (4-8 s here); the
    launcher watches on from where it was, and sees what changed in between."""
    ns, op = cluster
    closed = threading.Event()

    def scenario(op, name):
        master, workers = start(op, name)
        wait_until(lambda: job_requests(ns, 0)["watch"] >= 2, 30, "a second watch (the first was closed)")
        closed.set()
        op.set_phase(name, "Restarting", reason="PyTorchJobRestarting")
        wait_until(lambda: launcher.printed(": Restarting"), what="the change after the close")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest(), watch_timeout_s=0)
    op.play(scenario)
    out = launcher.result()
    op.join()
    assert closed.is_set() and out.phase == "Succeeded"
    assert not launcher.printed("410"), "a resumed watch is not expired"


def test_an_api_server_restart_mid_run_costs_a_few_requests_not_a_storm(kube):
    """Defect 1: after a restart the new watch cache has no resourceVersion older than its start; the old
    launcher re-read the job and watched again from the job's own (old) version: 410, forever."""
    ns, op = kube
    server = ns.server
    finish = threading.Event()

    def scenario(op, name):
        master, workers = start(op, name)
        wait_until(lambda: launcher.printed("Running"), what="the launcher watching")
        finish.wait(120)
        op.log(master, "after the restart")
        succeed(op, name, [master, *workers])

    # The test counts requests: a server slow to come back (a loaded machine) must not time the job out first.
    launcher = Launcher(ns, manifest(kind=op.ctl.kind), timeout_s=300)
    op.play(scenario)
    wait_until(lambda: launcher.printed(": Running"), what="Running")
    from kubernetes import client as k8s

    # Other writes move the cluster's resourceVersion past the one the launcher holds (on EKS, everything
    # else does), so the restarted server's watch cache starts after it.
    for i in range(3):
        k8s.CoreV1Api(server.admin).create_namespaced_config_map(ns.name, {"metadata": {"name": f"bump-{i}"}})
    server.restart_apiserver()
    restarted = time.time()
    quiet = 10.0
    wait_until(lambda: time.time() - restarted > quiet, quiet + 5, "the quiet period", every=0.5)
    after = job_requests(ns, restarted, op.ctl.plural)
    finish.set()
    out = launcher.result()
    op.join()
    assert out.phase == "Succeeded"
    assert "after the restart" in launcher.master_lines()
    # A re-list and a new watch (and a few retries while the server comes up), not hundreds.
    print(f"job requests in the {quiet:g} s after the API server restart: {dict(after)}")
    assert sum(after.values()) <= 8, after


def test_a_log_stream_that_ends_at_once_is_not_reopened_in_a_loop(cluster):
    """Defect 2: the kubelet ends each follow stream at once while the pod says running; the follower
    reconnected without a pause (~50 requests a second)."""
    ns, op = cluster
    ended = threading.Event()

    def scenario(op, name):
        master, workers = start(op, name)
        op.log(master, "step 1")
        op.kubelet.mode(ns.name, master, "end")
        wait_until(lambda: launcher.printed("step 1"), what="the first line")
        t0 = time.time()
        wait_until(lambda: time.time() - t0 > 4, 10, "4 s of ended streams", every=0.2)
        op.kubelet.mode(ns.name, master, "")
        op.log(master, "step 2")
        wait_until(lambda: launcher.printed("step 2"), 30, what="the log after the kubelet recovered")
        ended.set()
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest(), log_poll_s=0.2)
    op.play(scenario)
    launcher.result()
    op.join()
    assert ended.is_set()
    logs = [e for e in ns.launcher_requests() if e.subresource == "log"]
    span = logs[-1].received - logs[0].received
    print(f"log streams that end at once: {len(logs)} log requests in {span:.1f} s")
    assert len(logs) <= 12, f"{len(logs)} log requests in {span:.1f} s"
    assert launcher.master_lines() == ["step 1", "step 2"]


def test_lines_that_share_a_timestamp_are_each_shown_once_across_resumed_streams(cluster):
    """A runtime may stamp several lines alike (a coarse clock): none is dropped as already shown, and the
    streams the follower resumes (each ends at once here) show none of them twice."""
    ns, op = cluster

    def scenario(op, name):
        master, workers = start(op, name)
        op.kubelet.mode(ns.name, master, "end")
        op.log(master, "loss 1", "loss 2", "loss 3", same_stamp=True)
        wait_until(lambda: launcher.printed("loss 3"), 30, what="the lines stamped alike")
        op.log(master, "loss 4", "loss 5", same_stamp=True)
        wait_until(lambda: launcher.printed("loss 5"), 30, what="the next lines, in a resumed stream")

        def streams():
            return sum(e.subresource == "log" for e in ns.launcher_requests())
        n = streams()
        wait_until(lambda: streams() > n + 2, 30, what="more resumed streams")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, manifest(), log_poll_s=0.2)
    op.play(scenario)
    launcher.result()
    op.join()
    assert launcher.master_lines() == [f"loss {i}" for i in range(1, 6)]


@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_pod_logs_that_fail_or_never_answer_do_not_stop_the_job_or_the_launcher(cluster, mode):
    ns, op = cluster

    def scenario(op, name):
        master, workers = start(op, name)
        op.kubelet.mode(ns.name, master, mode)
        op.log(master, "unseen")
        t0 = time.time()
        wait_until(lambda: time.time() - t0 > 5, 10, "5 s of a broken log endpoint", every=0.2)
        succeed(op, name, [master, *workers])

    op.play(scenario)
    t0 = time.monotonic()
    launcher = Launcher(ns, manifest(), log_idle_s=2, log_drain_s=2)
    out = launcher.result()
    took = time.monotonic() - t0
    op.join()
    assert out.phase == "Succeeded"
    assert took < 20, f"the launcher took {took:.1f} s to return"
    logs = [e for e in ns.launcher_requests() if e.subresource == "log"]
    assert 1 <= len(logs) <= 8, f"{len(logs)} log requests in ~5 s"


def _revoke(ns, op, group: str, resource: str, verb: str) -> None:
    """The launcher's Role without its rule for ``resource`` (a platform's own RBAC), once the server refuses
    ``verb`` on it to the launcher."""
    from kubernetes import client as k8s

    docs = list(yaml.safe_load_all((REPO / op.ctl.rbac_file).read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role"]
    role["rules"] = [r for r in role["rules"] if r["resources"] != [resource]]
    ns.server.kubectl("apply", "-n", ns.name, "-f", "-", input=yaml.safe_dump(role))
    review = k8s.AuthorizationV1Api(ns.server.admin)
    body = k8s.V1SubjectAccessReview(spec=k8s.V1SubjectAccessReviewSpec(
        user=f"system:serviceaccount:{ns.name}:{ns.sa}", groups=["system:serviceaccounts"],
        resource_attributes=k8s.V1ResourceAttributes(namespace=ns.name, group=group, verb=verb, resource=resource)))
    wait_until(lambda: not review.create_subject_access_review(body).status.allowed, what="the Role's change")


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "fails"])
def test_pods_the_launcher_may_not_read_are_said_once_and_the_job_is_followed_to_its_end(cluster, fails):
    """A Role without ``list`` on pods (a platform's own RBAC): the launcher says once what its report lacks for
    each use of the pods, follows the job to its end, and a failure's diagnosis says that the pods were unread."""
    ns, op = cluster
    _revoke(ns, op, "", "pods", "list")

    def scenario(op, name):
        master, workers = start(op, name)
        wait_until(lambda: launcher.printed("may lack the master's log"), what="the log follower's pod read")
        if fails:
            op.terminate(master, exit_code=1, reason="Error")
            op.set_phase(name, "Failed")
        else:
            succeed(op, name, [master, *workers])

    op.play(scenario)
    launcher = Launcher(ns, manifest())
    if fails:
        with pytest.raises(JobFailed, match=r"\n  its pods cannot be read \(403 Forbidden\)(\n|$)"):
            launcher.result()
    else:
        assert launcher.result().phase == "Succeeded"
    op.join()
    said = [ln for ln in launcher.lines if ln.startswith("cannot read its pods")]
    assert sorted(said) == [f"cannot read its pods of PyTorchJob {ns.name}/gp-train-1 (403 Forbidden): this report "
                            f"may lack {lacking}; the job itself is followed as before"
                            for lacking in ("its restarts and pod states", "the master's log")], launcher.lines


def test_node_jobs_the_launcher_may_not_read_are_named_in_a_trainjobs_failure(tj_cluster):
    """A Role without ``list`` on the JobSet's node Jobs: the failure's diagnosis keeps the JobSet's part and says
    that the node Jobs, which name the pod failure policy rule, were unread."""
    ns, op = tj_cluster
    _revoke(ns, op, "batch", "jobs", "list")

    def scenario(op, name):
        master, _ = start(op, name)
        op.terminate(master, exit_code=2, reason="Error", message="trainer: error: unrecognized arguments: --nope")
        op.ctl.node_job_failed(op, name, "PodFailurePolicy", f"Container node for pod {ns.name}/{master} failed "
                               "with exit code 2 matching FailJob rule at index 1")
        op.set_phase(name, "Failed", reason="FailJobSetAction",
                     message=f"applying FailJobSet failure policy action (first failed job: {name}-node-0)",
                     replicas={"Node": {"failed": 1, "active": 1}})

    op.play(scenario)
    with pytest.raises(JobFailed) as err:
        Launcher(ns, manifest(kind=op.ctl.kind)).result()
    op.join()
    msg = str(err.value)
    assert "JobSet condition Failed: FailJobSetAction" in msg
    assert re.search(r"\n  its node Jobs cannot be read \(403 Forbidden\): which pod failure policy rule failed them "
                     r"is unknown(\n|$)", msg), msg
    assert "pod failure policy:" not in msg


def test_a_healthy_quiet_job_costs_a_few_requests_a_minute(kube):
    """Beyond its open watch and log stream, the launcher asks at most a few things a minute, even while
    the server closes its watches every few seconds (a short MIN_REQUEST_TIMEOUT) and the job says nothing."""
    ns, op = kube
    finish = threading.Event()

    def scenario(op, name):
        master, workers = start(op, name)
        op.log(master, "started")
        finish.wait(120)
        succeed(op, name, [master, *workers])

    op.play(scenario)
    # Production intervals: 30 s between pod reads, reconnect a log stream silent for 60 s; no
    # timeoutSeconds, so the server decides when each watch ends (here after 4-8 s).
    launcher = Launcher(ns, manifest(kind=op.ctl.kind), watch_timeout_s=0, pods_every_s=30, log_idle_s=60,
                        log_poll_s=2)
    wait_until(lambda: launcher.printed(f"{op.ctl.prefix} started"), what="the log stream")
    since = time.time()
    window = 20.0
    wait_until(lambda: time.time() - since > window, window + 5, "the quiet window", every=0.5)
    reqs = ns.launcher_requests(since)
    finish.set()
    launcher.result()
    op.join()
    streams = [e for e in reqs if e.verb == "watch" or e.subresource == "log"]
    others = [e for e in reqs if e not in streams]
    per_minute = len(others) * 60 / window
    print(f"quiet job, {window:g} s: {len(others)} requests besides {len(streams)} watch/log streams "
          f"({per_minute:.1f}/min): {Counter(e.what for e in others)}")
    assert per_minute <= 6, f"{len(others)} requests in {window:g} s: {[e.what for e in others]}"
    assert len([e for e in streams if e.verb == "watch"]) <= window / 4 + 1, "one watch per server close"


# The train step's cluster path -------------------------------------------------------------------

@pytest.fixture
def cpu_runtime(kube):
    """For TrainJobs: a ClusterTrainingRuntime without GPUs installed (cluster-scoped: a name of its own)."""
    from kubernetes import client as k8s

    ns, _ = kube
    rt = RuntimeSpec.from_dict({"name": f"goodput-nvrx-cpu-{ns.name}", **CPU_RUNTIME})
    co = k8s.CustomObjectsApi(ns.server.admin)
    co.create_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", runtime_manifest(rt))
    yield {"name": rt.name, **CPU_RUNTIME}
    co.delete_cluster_custom_object("trainer.kubeflow.org", "v1alpha1", "clustertrainingruntimes", rt.name)


def test_the_train_step_runs_the_job_and_reads_its_summary_from_fsx(kube, cpu_runtime, tmp_path, monkeypatch):
    ns, op = kube
    fsx = tmp_path / "fsx"
    summary = {"steps": 10, "final_val_loss": 2.6, "params_sha256": "ab" * 32}

    def scenario(op, name):
        master, workers = start(op, name)
        ckpt = fsx / "runs" / name / "checkpoints" / "step_000000010"
        ckpt.mkdir(parents=True)
        (ckpt / "COMMITTED").write_text("{}")
        (fsx / "runs" / name / "summary.json").write_text(json.dumps(summary))
        op.log(master, "step 10 committed")
        wait_until(lambda: any("step 10 committed" in ln for ln in lines), what="the log")
        succeed(op, name, [master, *workers])

    # In the step's pod the client comes from the pod's service account; here from its kubeconfig.
    monkeypatch.setenv("KUBECONFIG", str(ns.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    op.play(scenario)
    lines: list[str] = []
    trainjob = op.ctl is TRAINJOB
    result = train("trainjob" if trainjob else "cluster", {"run": {"max_steps": 10}}, run_id="run-7",
                   task_name="train", fsx_root=fsx,
                   job={"image": "img:1", "nodes": 2, "gpus_per_node": 0, "efa_per_node": 0,
                        **({"runtime": cpu_runtime} if trainjob else {})},
                   namespace=ns.name, supervise=FAST, log=lines.append)
    op.join()
    assert result.summary == summary and result.latest_step == 10 and result.namespace == ns.name
    assert result.backend == ("trainjob" if trainjob else "pytorchjob")
    (job,) = op.jobs()
    assert job["metadata"]["labels"]["goodput.dev/kfp-run-id"] == "run-7"
    if trainjob:
        assert job["spec"]["runtimeRef"]["name"] == cpu_runtime["name"]
        assert ("trainer.kubeflow.org", "clustertrainingruntimes", "get") in {e.what for e in ns.launcher_requests()}
    no_denials(ns)


def test_a_trainjob_whose_runtime_is_not_installed_is_refused_before_it_is_created(tj_cluster, tmp_path,
                                                                                   monkeypatch):
    ns, op = tj_cluster
    monkeypatch.setenv("KUBECONFIG", str(ns.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="ClusterTrainingRuntime 'goodput-nvrx-missing' is not installed(.|\n)*"
                                         "kubectl apply --server-side -k deploy/trainer-v2/runtime"):
        train("trainjob", {}, run_id="run-7", task_name="train", fsx_root=tmp_path, namespace=ns.name,
              job={"image": "img:1", "gpus_per_node": 0, "efa_per_node": 0,
                   "runtime": {"name": "goodput-nvrx-missing", **CPU_RUNTIME}}, supervise=FAST)
    assert not [e for e in ns.launcher_requests() if e.verb == "create"], "nothing was created"
    assert not op.jobs()


# Least privilege -----------------------------------------------------------------------------------

def test_the_launcher_uses_exactly_what_deploy_rbac_grants(kube):
    """Every verb the kind's Role grants is one the launcher uses (audit log), and nothing else is granted: the job,
    its pods, log and events (TrainJob: its JobSet and Jobs), its peer secret, its Kueue Workload."""
    ns, op = kube
    kind = op.ctl.kind

    def failing(op, name):
        master, _ = start(op, name)
        op.terminate(master, exit_code=1, reason="Error")
        op.add_event("Pod", master, "BackOff", "Back-off")
        op.set_phase(name, "Failed")

    op.play(failing, name="gp-fail")
    with pytest.raises(JobFailed):                 # create, watch, pods, log, events (TrainJob: JobSet, Jobs)
        Launcher(ns, manifest(name="gp-fail", kind=kind)).result()
    op.play(long_run, name="gp-slow")
    op.create_job(manifest(name="gp-slow", kind=kind))
    with pytest.raises(JobTimeout):                # re-attach (get) and delete
        Launcher(ns, manifest(name="gp-slow", kind=kind), timeout_s=3).result()
    op.play(lambda op, name: op.kueue.pending(name, "insufficient quota"), name="gp-queued")
    with pytest.raises(NotAdmitted):               # Kueue: its Workload says why it waits
        Launcher(ns, manifest(name="gp-queued", kind=kind, scheduler="kueue", queue="goodput"),
                 admission_timeout_s=3).result()
    # The exit handler of this kind's run (it would look at the other kind too: 403 here, skipped).
    cleanup_run_jobs("run-1", ns.name, client=ns.launcher_client(), kinds=[KINDS[kind]], wait_s=2,
                     log=lambda s: None)
    op.join()
    used = {e.what for e in ns.launcher_requests()}
    docs = list(yaml.safe_load_all((REPO / op.ctl.rbac_file).read_text()))
    (role,) = [d for d in docs if d["kind"] == "Role"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    assert used == granted, f"granted but unused: {granted - used}; used but not granted: {used - granted}"
    no_denials(ns)
