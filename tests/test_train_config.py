"""The settings check: typed pipeline parameters -> the trainer's command line and the job settings."""

import pytest

from components.train_config import build_train_config, check_run_parameters


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
                   "instance_type": "p5.48xlarge", "service_account": "trainer", "gpus_per_node": 8,
                   "gpu_resource": "nvidia.com/gpu", "efa_per_node": -1, "cpu": "", "memory": "", "shm_size": "",
                   "node_group": "", "scheduler": "", "queue": ""}


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
    ({"backend": "laptop"}, "backend must be one of pytorchjob, trainjob, local"),
    # A TrainJob's settings that are its runtime's in Trainer v2 (goodput-nvrx: backoff limit 3, Volcano).
    ({"backend": "trainjob", "backoff_limit": 5}, "backoff_limit=5 differs from ClusterTrainingRuntime goodput-nvrx"),
    ({"backend": "trainjob", "scheduler": "yunikorn"}, "gang scheduling and priority are the runtime's"),
    ({"instance_type": "g5.xlarge", "gpus_per_node": 8}, "g5.xlarge has 1 GPUs"),
    ({"instance_type": "p4d.24xlarge", "cpu": "160"}, "cpu 160 exceeds what p4d.24xlarge has"),
    ({"instance_type": "p4d.24xlarge", "efa_per_node": 32}, "p4d.24xlarge has 4 EFA"),
    ({"memory": "-1Gi"}, "not a Kubernetes quantity above 0"),
    ({"gpu_resource": "nvidia.com/mig-big"}, "gpu_resource"),
    ({"scheduler": "yunikorn", "queue": "training"}, "not a YuniKorn queue path"),
    ({"image": "Bad Image"}, "not an image reference"),
    ({"run_id": "{{$.pipeline_job_uuid}}"}, "must be set"),
    # faults that could never fire: 1 node x 8 GPUs is ranks 0..7, and max_steps is 200
    ({"inject_fault": "kill@40:8"}, "rank 8 does not exist in a run of 8 rank"),
    ({"inject_fault": "hang@500:0"}, "step 500 comes after the last step"),
])
def test_bad_settings_fail_before_anything_runs(kw, message):
    settings = {"fsx_root": "/fsx", "dataset_name": "d", "dataset_version": "1", "run_id": "r", "image": "x/y:1",
                **kw}
    with pytest.raises(ValueError, match=message):
        build_train_config(**settings)


def test_an_instance_type_sizes_the_job_to_its_node():
    _, job, _ = build_train_config(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r",
                                   instance_type="g6e.12xlarge", image="x/y:1")
    assert job["gpus_per_node"] == 4 and job["instance_type"] == "g6e.12xlarge"
    _, job, _ = build_train_config(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r",
                                   image="x/y:1")
    assert job["gpus_per_node"] == 8, "no instance type: a p5-sized default"


def test_run_parameters_are_checked_before_submitting():
    """What ``goodput run`` checks with the pipeline's defaults filled in (names as the pipeline has them)."""
    good = {"fsx_root": "/fsx", "dataset_name": "corpus", "dataset_version": "latest", "nodes": 2,
            "trainer_image": "ecr.example/goodput-trainer:0.1.0", "instance_type": "p5.48xlarge",
            "dataset_source": "s3://b/p", "promotion_threshold": 5.5}
    check_run_parameters(good)
    with pytest.raises(ValueError, match="nodes must be at least 1"):
        check_run_parameters({**good, "nodes": 0})
    with pytest.raises(ValueError, match="an image is required"):
        check_run_parameters({**good, "trainer_image": ""})


@pytest.mark.parametrize("backend", ["pytorchjob", "cluster", "trainjob"])
def test_the_pipelines_defaults_pass_for_every_cluster_backend(backend):
    """What the KFP form starts with is a valid job for each backend (``cluster``: pytorchjob's old name)."""
    import inspect

    from pipelines.pipeline import goodput_pipeline

    defaults = {k: p.default for k, p in inspect.signature(goodput_pipeline.pipeline_func).parameters.items()
                if p.default is not inspect.Parameter.empty}
    params = {**defaults, "dataset_source": "s3://bucket/corpus", "backend": backend}
    check_run_parameters(params)
