"""The settings check: typed pipeline parameters -> the trainer's command line and the job settings."""

import pytest

from components.train_config import build_train_config


def test_arguments_and_job_settings():
    args, job, run_dir = build_train_config(
        fsx_root="/fsx/", dataset_name="corpus", dataset_version="v3", run_id="abc-123", max_steps=500,
        ckpt_every=100, inject_fault="kill@40:1, hang@90", max_restarts=5, backoff_limit=2,
        instance_type="p5.48xlarge", fsx_pvc="fsx", service_account="trainer", image="ecr/trainer:1", nodes=2,
        gpus_per_node=8, spot=True, extra_trainer_args=["--lr", "0.001"])
    assert run_dir == "/fsx/runs/abc-123"
    assert args[:4] == ["--data", "/fsx/datasets/corpus/v3", "--out", "/fsx/runs/abc-123"]
    assert args[args.index("--max-steps") + 1] == "500"
    assert [args[i + 1] for i, a in enumerate(args) if a == "--inject-fault"] == ["kill@40:1", "hang@90"]
    assert args[-2:] == ["--lr", "0.001"]
    assert job == {"launch": {"max_restarts": 5}, "backoff_limit": 2, "pvc": "fsx", "fsx_mount": "/fsx",
                   "node_selector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                   "service_account": "trainer"}


def test_numbers_arrive_as_integers_whatever_kfp_made_of_them():
    args, job, _ = build_train_config(fsx_root="fsx", dataset_name="d", dataset_version="1", run_id="r",
                                      max_steps=60.0, max_restarts=3.0, backend="local")
    assert args[args.index("--max-steps") + 1] == "60"
    assert job["launch"]["max_restarts"] == 3 and isinstance(job["launch"]["max_restarts"], int)


@pytest.mark.parametrize("kw, message", [
    ({"inject_fault": "boom@3"}, "bad fault 'boom@3'"),
    ({"parallel": "zero3"}, "zero3"),
    ({"nodes": 0}, "nodes must be at least 1"),
    ({"image": ""}, "an image is required"),
    ({"backend": "laptop"}, "backend must be cluster or local"),
    ({"run_id": "{{$.pipeline_job_uuid}}"}, "must be set"),
])
def test_bad_settings_fail_before_anything_runs(kw, message):
    settings = {"fsx_root": "/fsx", "dataset_name": "d", "dataset_version": "1", "run_id": "r", "image": "x/y:1",
                **kw}
    with pytest.raises(ValueError, match=message):
        build_train_config(**settings)
