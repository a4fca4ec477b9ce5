"""The train step: a real 2-process local training through the component under kfp.local, and the cluster
backend end to end against the loopback Kubernetes API (``k8s_fake``) with a stand-in trainer on "FSx"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kfp import local
from kfp.dsl import Metrics, Model, TaskConfig

from components.train.launch import TRAINER_IMAGE, flat_metrics, job_settings_from_task_config, train, train_op
from tests.trainer_flags import settings
from trainer.config import parse_config

try:
    from tests.k8s_fake import FakeKube
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from k8s_fake import FakeKube

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--eval-windows", "16", "--max-steps", "6", "--ckpt-every", "3"]
NS = "team-a"


# The step's base image is ours; the subprocess runner uses this environment, which has the package.
@pytest.mark.filterwarnings("ignore:You may be attemping to run a task that uses custom:RuntimeWarning")
def test_local_backend_trains_for_real_under_the_kfp_subprocess_runner(tmp_path, fsx_root, dataset):
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "pipeline-root"))
    task = train_op(backend="local", trainer_config=settings(*TINY, "--data", str(dataset)), fsx_root=str(fsx_root),
                    local_nproc=2)
    model, metrics = task.outputs["model"], task.outputs["metrics"]
    ckpt = Path(model.uri)
    assert ckpt.parent.parent == fsx_root / "runs" and ckpt.name == "checkpoints"
    assert (ckpt / "step_000000006" / "COMMITTED").is_file()
    summary = json.loads((ckpt.parent / "summary.json").read_text())
    assert model.metadata["latest_step"] == 6 and model.metadata["backend"] == "local"
    assert model.metadata["latest_checkpoint"] == str(ckpt / "step_000000006")
    assert model.metadata["params_sha256"] == summary["params_sha256"]
    assert metrics.metadata["steps"] == 6 == summary["steps"]
    assert metrics.metadata["final_val_loss"] == pytest.approx(summary["final_val_loss"])
    assert metrics.metadata["restarts"] == 0 and metrics.metadata["checkpoints_committed"] >= 2


def trainer_on_fsx(fsx: Path, summary: dict):
    """A scenario: the job's pods 'train' by writing the run directory the real trainer writes."""
    def scenario(k, ns, name):
        k.step(ns, name, 0.05)
        k.set_phase(ns, name, "Created")
        master, worker = k.add_pod(ns, name, "Master", 0), k.add_pod(ns, name, "Worker", 0)
        k.set_phase(ns, name, "Running")
        out = fsx / "runs" / name
        for step in (5, 10):
            d = out / "checkpoints" / f"step_{step:09d}"
            d.mkdir(parents=True)
            (d / "COMMITTED").write_text("{}")
            k.log(ns, master, f"step {step} committed")
        (out / "checkpoints" / "step_000000015").mkdir()          # torn: never committed
        (out / "summary.json").write_text(json.dumps(summary))
        k.restart_container(ns, worker)
        k.step(ns, name, 0.2)
        k.terminate(ns, master)
        k.terminate(ns, worker)
        k.set_phase(ns, name, "Succeeded")
    return scenario


SUMMARY = {"steps": 10, "tokens": 40960, "final_train_loss": 2.5, "final_val_loss": 2.6, "checkpoints_committed": 2,
           "ckpt_block_s_p50": 0.01, "ckpt_block_s_max": 0.02, "restarts": 1, "wall_s": 12.5,
           "params_sha256": "ab" * 32,
           "goodput": {"fraction": 0.93, "lost_s": {"restart": 1.5}}, "note": "text is not a metric", "flag": True}


def test_cluster_backend_creates_supervises_and_reports_from_fsx(tmp_path):
    fsx = tmp_path / "fsx"
    fsx.mkdir()
    model, metrics = Model(name="model", uri=str(tmp_path / "model")), Metrics(name="metrics", uri=str(tmp_path / "m"))
    with FakeKube(trainer_on_fsx(fsx, SUMMARY)) as k:
        train_op.python_func(backend="cluster", trainer_config={"run": {"max_steps": 10}}, image="img:1", nodes=2,
                             gpus_per_node=8, spot=True,
                             job_options={"node_group": "p5", "launch": {"max_restarts": 5}},
                             namespace=NS, timeout_s=60.0, fsx_root=str(fsx), local_nproc=2, kube_api=k.url,
                             run_id="run-7", task_name="train", model=model, metrics=metrics,
                             task_config=TaskConfig(resources={"limits": {"nvidia.com/gpu": "4", "memory": "900Gi"},
                                                               "requests": {"cpu": "90"}},
                                                    env=[{"name": "NCCL_DEBUG", "value": "INFO"}]))
        (post,) = k.calls("POST", "/pytorchjobs")
        assert post.status == 201
        (secret,) = k.calls("POST", "/secrets")     # the job's peer secret, made before the job
        assert secret.status == 201 and k.requests.index(secret) < k.requests.index(post)
        (job,) = [j for (ns, _), j in k.jobs.items() if ns == NS]
    name = job["metadata"]["name"]
    assert name.startswith("gp-train-") and job["metadata"]["labels"]["goodput.dev/kfp-run-id"] == "run-7"
    pod = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--max-restarts") + 1] == "5"
    assert parse_config(cmd[cmd.index("trainer") + 1:], validate=False).run.out == f"/fsx/runs/{name}"
    assert pod["nodeSelector"] == {"eks.amazonaws.com/nodegroup": "p5"} and pod["containers"][0]["image"] == "img:1"
    # The task's pod settings went to the job's pods.
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == "4" and res["limits"]["memory"] == "900Gi"
    assert res["requests"]["cpu"] == "90" and job["spec"]["nprocPerNode"] == "4"
    assert {"name": "NCCL_DEBUG", "value": "INFO"} in pod["containers"][0]["env"]
    assert model.uri == str(fsx / "runs" / name / "checkpoints")
    assert model.metadata["latest_step"] == 10 and model.metadata["job_name"] == name
    assert model.metadata["namespace"] == NS and model.metadata["params_sha256"] == "ab" * 32
    assert metrics.metadata["steps"] == 10 and metrics.metadata["final_val_loss"] == 2.6
    assert metrics.metadata["goodput_fraction"] == 0.93 and metrics.metadata["goodput_lost_s_restart"] == 1.5
    assert metrics.metadata["job_restarts_worker"] == 1 and metrics.metadata["job_restarts_master"] == 0
    assert "note" not in metrics.metadata and "flag" not in metrics.metadata


def test_cluster_backend_errors_come_before_any_request(tmp_path):
    with FakeKube() as k:
        with pytest.raises(ValueError, match="an image is required"):
            train("cluster", {}, run_id="r", task_name="t", fsx_root=tmp_path, job={"image": ""}, kube_api=k.url)
        with pytest.raises(ValueError, match="unknown job settings"):
            train("cluster", {}, run_id="r", task_name="t", fsx_root=tmp_path, job={"gpu": 1}, kube_api=k.url)
        with pytest.raises(ValueError, match="'nope' is neither a section"):
            train("cluster", {"nope": 1}, run_id="r", task_name="t", fsx_root=tmp_path, job={"image": "i"},
                  kube_api=k.url)
        with pytest.raises(ValueError, match="PIPELINE_JOB_ID_PLACEHOLDER"):
            train("cluster", {}, run_id="{{$.pipeline_job_uuid}}", task_name="t", fsx_root=tmp_path, kube_api=k.url)
        with pytest.raises(ValueError, match="backend must be one of pytorchjob, trainjob, local"):
            train("slurm", {}, run_id="r", task_name="t", fsx_root=tmp_path)
        # A TrainJob is checked against its runtime, before the runtime is read or the job created.
        with pytest.raises(ValueError, match="min_nodes=1: Kubeflow Trainer v2.3 has no elastic training"):
            train("trainjob", {}, run_id="r", task_name="t", fsx_root=tmp_path, kube_api=k.url,
                  job={"image": "i", "nodes": 2, "min_nodes": 1})
        with pytest.raises(ValueError, match="'runtime' .* is for backend=trainjob"):
            train("pytorchjob", {}, run_id="r", task_name="t", fsx_root=tmp_path, kube_api=k.url,
                  job={"image": "i", "runtime": "goodput-nvrx"})
        assert k.requests == []


def test_cluster_backend_says_when_fsx_is_not_mounted_in_the_launcher(tmp_path):
    def scenario(k, ns, name):       # the job succeeds, but nothing reaches this "FSx"
        k.set_phase(ns, name, "Succeeded")

    from components.train.supervise import SuperviseConfig

    with FakeKube(scenario) as k:
        with pytest.raises(RuntimeError, match="summary.json is missing: is the FSx claim 'fsx-claim' mounted"):
            train("cluster", {}, run_id="r", task_name="t", fsx_root=tmp_path, job={"image": "i"}, namespace=NS,
                  kube_api=k.url, supervise=SuperviseConfig(log_poll_s=0.05), log=lambda s: None)


def test_flat_metrics_keeps_finite_numbers_only():
    assert flat_metrics({"a": 1, "b": {"c": 2.5, "d": "x"}, "e": None, "f": float("nan"), "g": False}) == \
        {"a": 1.0, "b_c": 2.5}


def test_component_interface():
    inputs = train_op.component_spec.inputs
    assert inputs["image"].default == TRAINER_IMAGE and inputs["backend"].default == "pytorchjob"
    assert inputs["run_id"].default == "{{$.pipeline_job_uuid}}"
    assert inputs["task_name"].default == "{{$.pipeline_task_name}}"
    assert set(train_op.component_spec.outputs) == {"model", "metrics"}
    doc = train_op.python_func.__doc__
    assert all(f"{name}:" in doc for name in [*inputs, "model", "metrics"]), "every argument documented"


def test_task_config_fills_in_what_job_options_leave_open():
    tc = TaskConfig(resources={"limits": {"nvidia.com/gpu": 2}}, node_selector={"a": "1", "b": "2"},
                    tolerations=[{"key": "t", "operator": "Exists", "effect": "NoSchedule"}],
                    env=[{"name": "X", "value": "task"}, {"name": "Y", "valueFrom": {"secretKeyRef": {}}}])
    job = job_settings_from_task_config(tc, {"node_selector": {"b": "job"}, "env": {"X": "job"}, "cpu": "8"})
    assert job["gpus_per_node"] == 2 and job["cpu"] == "8"
    assert job["node_selector"] == {"a": "1", "b": "job"} and job["env"] == {"X": "job"}
    assert job["tolerations"] == [{"key": "t", "operator": "Exists", "effect": "NoSchedule"}]
    assert job_settings_from_task_config(TaskConfig(), {"nodes": 2}) == {"nodes": 2}
