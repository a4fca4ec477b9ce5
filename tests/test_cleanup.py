"""The exit handler's cleanup against a loopback Kubernetes API (tests/k8s_fake.py): the real client, real HTTP."""

import pytest
from kubernetes import client as k8s

from components.train.cleanup import cleanup_run_jobs
from components.train.cleanup_op import cleanup_op
from components.train.pytorchjob import RUN_ID_LABEL, label_value

try:                                  # tests/ is a package when run from the repository root
    from tests.k8s_fake import FakeKube
except ImportError:                   # pragma: no cover - tests/ on sys.path
    from k8s_fake import FakeKube

RUN = "9f1c2d3e-0000-4a5b-8c7d-112233445566"


def job(name: str, run_id: str) -> dict:
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "labels": {RUN_ID_LABEL: label_value(run_id)}}, "spec": {}}


@pytest.fixture
def kube():
    with FakeKube() as fake:
        yield fake


def client(kube: FakeKube) -> k8s.ApiClient:
    return k8s.ApiClient(k8s.Configuration(host=kube.url))


def test_deletes_only_this_runs_unfinished_jobs(kube):
    kube.put_job(job("gp-train-running", RUN), "team-a")
    kube.put_job(job("gp-train-done", RUN), "team-a")
    kube.set_phase("team-a", "gp-train-done", "Succeeded")
    kube.put_job(job("gp-train-other-run", "another-run"), "team-a")
    kube.put_job(job("gp-train-other-ns", RUN), "team-b")
    lines = []
    deleted = cleanup_run_jobs(RUN, "team-a", client=client(kube), wait_s=2, log=lines.append)
    assert deleted == ["gp-train-running"]
    assert kube.job("team-a", "gp-train-running") is None
    assert kube.job("team-a", "gp-train-done") is not None          # finished: kept for its TTL
    assert kube.job("team-a", "gp-train-other-run") is not None
    assert kube.job("team-b", "gp-train-other-ns") is not None
    listing = kube.calls("GET", r"/namespaces/team-a/pytorchjobs$")[0]
    assert listing.query["labelSelector"] == f"{RUN_ID_LABEL}={label_value(RUN)}"
    assert any("deleting PyTorchJob team-a/gp-train-running" in ln for ln in lines)


def test_nothing_left_behind_is_a_no_op(kube):
    lines = []
    assert cleanup_run_jobs(RUN, "team-a", client=client(kube), log=lines.append) == []
    assert kube.calls("DELETE") == []
    assert "no unfinished PyTorchJob" in lines[0]


def test_a_job_that_cannot_be_deleted_fails_loudly(kube):
    kube.put_job(job("gp-train-running", RUN), "team-a")
    kube.fail("DELETE", "/pytorchjobs/gp-train-running", 403)
    with pytest.raises(RuntimeError, match="could not be deleted.*delete pytorchjob -n team-a gp-train-running"):
        cleanup_run_jobs(RUN, "team-a", client=client(kube), wait_s=0.2, log=lambda _: None)


def test_component_on_the_local_backend_touches_no_cluster(capsys):
    cleanup_op.python_func(run_id=RUN, backend="local")
    assert "no job to clean up" in capsys.readouterr().out


def test_a_kind_that_is_not_installed_is_skipped_unless_it_is_the_runs_backend(kube):
    """Only the Training Operator is installed here: the TrainJob list is 404."""
    from kubernetes.client.rest import ApiException

    from components.train.job_kinds import TRAINJOB

    kube.put_job(job("gp-train-running", RUN), "team-a")
    lines = []
    assert cleanup_run_jobs(RUN, "team-a", client=client(kube), wait_s=2, log=lines.append) == ["gp-train-running"]
    assert "trainjobs not installed in team-a: none of them to clean up" in lines
    with pytest.raises(ApiException) as err:
        cleanup_run_jobs(RUN, "team-a", client=client(kube), required=[TRAINJOB], log=lines.append)
    assert err.value.status == 404


def test_component_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of pytorchjob, trainjob, local"):
        cleanup_op.python_func(run_id=RUN, backend="slurm")
