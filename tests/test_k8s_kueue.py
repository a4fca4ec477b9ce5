"""Kueue and the per-job peer secret, on a real kube-apiserver, for both job kinds.

The launcher runs as the pipeline's service account bound only by the kind's Role (``deploy/rbac.yaml``,
``deploy/trainer-v2/rbac.yaml``); the test plays Kueue (``tests/k8s_apiserver.py``'s ``Kueue``: the job's
Workload, owned by the job; its conditions; admission, which unsuspends the job), the job's controller and the
garbage collector (foreground deletion removes what the job owns: its Workload, once Kueue dropped its finalizer,
and its peer secret).
"""

from __future__ import annotations

import base64
import signal
import time

import pytest

from components.train.kueue import QUEUE_LABEL
from components.train.pytorchjob import JobSpec, job_manifest
from components.train.supervise import JobTimeout, NotAdmitted
from components.train.trainjob import RuntimeSpec, trainjob_manifest

from tests.k8s_apiserver import PYTORCHJOB, TRAINJOB, wait_until
from tests.test_k8s_supervise import (CPU_RUNTIME, FAST, Launcher, _cluster, no_denials, start, subprocess_launcher,
                                      succeed, what)

QUEUE = "goodput"
NO_QUOTA = ("couldn't assign flavors to pod set main: insufficient quota for nvidia.com/gpu in flavor p5.48xlarge, "
            "request > maximum capacity (16 > 8)")


@pytest.fixture(params=[PYTORCHJOB, TRAINJOB], ids=["pytorchjob", "trainjob"])
def kube(request, tmp_path):
    yield from _cluster(request.param, tmp_path)


def queued(kind: str, name: str = "gp-train-1", run_id: str = "run-1") -> dict:
    spec = JobSpec(name=name, image="img", nodes=2, gpus_per_node=0, efa_per_node=0, run_id=run_id, task_name="train",
                   scheduler="kueue", queue=QUEUE)
    if kind == "TrainJob":
        return trainjob_manifest(spec, RuntimeSpec.from_dict({"name": "goodput-nvrx-cpu", **CPU_RUNTIME}))
    return job_manifest(spec)


def secret(ns, name: str = "gp-train-1-peer") -> dict | None:
    from kubernetes import client as k8s

    try:
        return k8s.CoreV1Api(ns.server.admin).read_namespaced_secret(name, ns.name).to_dict()
    except k8s.ApiException as e:
        if e.status == 404:
            return None
        raise


def test_a_queued_job_says_why_it_waits_and_its_timeout_starts_at_admission(kube):
    ns, op = kube
    timeout_s = 6.0
    seen: dict = {}

    def scenario(op, name):
        job = op.job(name)
        seen["job"] = job
        seen["secret"] = secret(ns)
        wl = op.kueue.workload(name)
        seen["workload"] = wl
        op.kueue.pending(name, NO_QUOTA)
        wait_until(lambda: launcher.printed(f"waiting for admission in queue {QUEUE}: Pending: {NO_QUOTA}"), 30,
                   "the launcher to say why the job waits")
        op.stop.wait(timeout_s + 1)       # queued longer than the train timeout, which must not run yet
        assert not launcher.printed(f"{op.ctl.kind} {ns.name}/{name}: Running")
        op.kueue.admit(name)
        wait_until(lambda: launcher.printed("admitted by Kueue in queue goodput"), 30, "the admission line")
        master, workers = start(op, name)
        op.log(master, "step 1")
        wait_until(lambda: launcher.printed(f"{op.ctl.prefix} step 1"), 30, "the log")
        succeed(op, name, [master, *workers])

    launcher = Launcher(ns, queued(op.ctl.kind), timeout_s=timeout_s, admission_timeout_s=60)
    op.play(scenario)
    out = launcher.result(90)
    op.join()
    assert out.phase == "Succeeded" and out.queued_s >= timeout_s
    job = seen["job"]
    # Created as Kueue expects: labelled with its LocalQueue (the job, not its pods), suspended.
    assert job["metadata"]["labels"][QUEUE_LABEL] == QUEUE
    assert (job["spec"]["runPolicy"] if op.ctl is PYTORCHJOB else job["spec"])["suspend"] is True
    # The peer secret existed before the job's pods, owned by the job, 32 random bytes in hex.
    sec = seen["secret"]
    assert sec is not None, "the peer secret was not there when the job was"
    value = base64.b64decode(sec["data"]["secret"]).decode()
    assert len(value) == 64 and int(value, 16) >= 0
    text = "\n".join(launcher.lines)
    assert value not in text, "the secret's value was logged"
    owners = secret(ns)["metadata"]["owner_references"]
    assert [(o["kind"], o["name"], o["uid"]) for o in owners] == [(op.ctl.kind, "gp-train-1", job["metadata"]["uid"])]
    # The order of the lines: waiting (with Kueue's reason), admitted, then running.
    order = [text.index(f"waiting for admission in queue {QUEUE}"), text.index("admitted by Kueue"),
             text.index(f"{op.ctl.kind} {ns.name}/gp-train-1: Running")]
    assert order == sorted(order), text
    assert any(e.what == ("kueue.x-k8s.io", "workloads", "list") and e.code == 200 for e in ns.launcher_requests())
    no_denials(ns)


def test_a_job_never_admitted_fails_in_time_naming_the_queue_and_the_reason(kube):
    ns, op = kube

    def scenario(op, name):
        op.kueue.workload(name)
        op.kueue.pending(name, NO_QUOTA)

    op.play(scenario)
    began = time.monotonic()
    launcher = Launcher(ns, queued(op.ctl.kind), timeout_s=600, admission_timeout_s=5)
    with pytest.raises(NotAdmitted, match=rf"not admitted by Kueue within 5 s in queue {QUEUE}: Pending: "
                                          r"couldn't assign flavors(.|\n)*the job was deleted") as err:
        launcher.result(60)
    assert isinstance(err.value, JobTimeout)
    assert time.monotonic() - began < 40, "the admission timeout was not kept"
    op.join()
    # Deleted, and with it its Workload and its secret.
    wait_until(lambda: op.job("gp-train-1") is None and not op.kueue.workloads() and secret(ns) is None, 20,
               "the job, its Workload and its secret to go")
    no_denials(ns)


def test_cancel_while_queued_leaves_nothing(kube, tmp_path):
    """SIGTERM (the run cancelled) while the job waits for admission: the job is deleted in the foreground, so the
    garbage collector takes its Workload (owned by the job, deletion-blocking) and its secret before the job goes;
    the launcher also deletes the secret itself."""
    ns, op = kube

    def scenario(op, name):
        wl = op.kueue.workload(name)
        owner = wl["metadata"]["ownerReferences"][0]
        assert owner["uid"] == op.job(name)["metadata"]["uid"] and owner["controller"] and owner["blockOwnerDeletion"]
        op.kueue.pending(name, NO_QUOTA)

    op.play(scenario)
    proc, log = subprocess_launcher(ns, queued(op.ctl.kind), tmp_path)
    try:
        wait_until(lambda: "waiting for admission in queue goodput: " in log.read_text(errors="replace")
                   or proc.poll() is not None, 60, "the launcher to wait for admission")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    op.join()
    text = log.read_text()
    assert code != 0 and "JobCancelled" in text and "is gone" in text, text
    assert "foregroundDeletion" in op.deleted_with["gp-train-1"], "not deleted in the foreground"
    assert op.job("gp-train-1") is None and not op.kueue.workloads() and secret(ns) is None
    assert [e.code for e in ns.launcher_requests() if e.what == what(op, "delete")] == [200]
    assert [e.code for e in ns.launcher_requests() if e.what == ("", "secrets", "delete")] in ([200], [404])
    no_denials(ns)


def test_admission_timeout_is_a_job_option_only_with_kueue(tmp_path):
    from components.train.launch import train

    for job, message in (({"admission_timeout_s": 60}, "admission_timeout_s is how long Kueue may keep the job"),
                         ({"scheduler": "kueue", "queue": QUEUE, "admission_timeout_s": 0},
                          "admission_timeout_s must be a number of seconds above 0")):
        with pytest.raises(ValueError, match=message):
            train("pytorchjob", {}, run_id="r", task_name="t", fsx_root=tmp_path, kube_api="http://127.0.0.1:9",
                  job={"image": "img:1", "gpus_per_node": 0, "efa_per_node": 0, **job}, supervise=FAST)
