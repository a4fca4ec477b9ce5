"""The settings check: typed pipeline parameters -> the trainer's settings and the job settings, and the
run's model: its name, flavor, config and the init_from weights (a directory, S3, the production model)."""

import json
import uuid

import pytest

from components.train.settings import build_train_config, check_run_parameters
from tests.llama_dirs import save_small_llama


def test_arguments_and_job_settings():
    args, job, run_dir, *_ = build_train_config(
        fsx_root="/fsx/", dataset_name="corpus", dataset_version="v3", run_id="abc-123", max_steps=500,
        ckpt_every=100, inject_fault="kill@40:1, hang@90", max_restarts=5, backoff_limit=2,
        instance_type="p5.48xlarge", fsx_pvc="fsx", trainer_service_account="trainer", trainer_image="ecr/trainer:1",
        nodes=2, gpus_per_node=8, spot=True, trainer_config={"optim": {"lr": 0.001}})
    assert run_dir == "/fsx/runs/abc-123"
    assert args["data"]["data"] == "/fsx/datasets/corpus/v3" and args["run"]["out"] == "/fsx/runs/abc-123"
    assert args["run"]["max_steps"] == 500 and args["checkpoint"]["ckpt_every"] == "100"
    assert args["faults"]["inject_fault"] == ["kill@40:1", "hang@90"]
    assert args["optim"] == {"lr": 0.001}
    assert job == {"launch": {"max_restarts": 5}, "backoff_limit": 2, "pvc": "fsx", "fsx_mount": "/fsx",
                   "instance_type": "p5.48xlarge", "service_account": "trainer", "gpus_per_node": 8,
                   "gpu_resource": "nvidia.com/gpu", "efa_per_node": -1, "cpu": "", "memory": "", "shm_size": "",
                   "node_group": "", "scheduler": "", "queue": "", "nvrx_release": "", "hot_spares": 0,
                   "node_health_check_endpoint": ""}


def test_numbers_arrive_as_integers_whatever_kfp_made_of_them():
    args, job, *_ = build_train_config(fsx_root="fsx", dataset_name="d", dataset_version="1", run_id="r",
                                       max_steps=60.0, max_restarts=3.0, backend="local")
    assert args["run"]["max_steps"] == 60 and isinstance(args["run"]["max_steps"], int)
    assert job["launch"]["max_restarts"] == 3 and isinstance(job["launch"]["max_restarts"], int)


@pytest.mark.parametrize("kw, message", [
    ({"inject_fault": "boom@3"}, "bad fault 'boom@3'"),
    ({"parallel": "zero3"}, "zero3"),
    ({"nodes": 0}, "nodes must be at least 1"),
    ({"nodes": 0, "backend": "local"}, "nodes must be at least 1"),
    ({"nodes": -2, "backend": "trainjob"}, "nodes must be at least 1"),
    ({"gpus_per_node": -2}, "gpus_per_node must be at least -1"),
    ({"train_timeout_s": 0.0}, "train_timeout_s must be above 0"),
    ({"stage_parallelism": 0}, "stage_parallelism must be at least 1"),
    # the model: name, flavor, config, vocabulary, checked by the trainer's own registry
    ({"model": "gpt5"}, "expected a built-in"),
    ({"model": "llama", "model_flavor": "llama3-7b"}, "llama has the flavors debug"),
    ({"model": "bytegpt", "model_flavor": "llama3-1b"}, "bytegpt has the flavors"),
    ({"model": "llama", "model_config": '{"n_layers": 2,}'}, "model_config is not valid JSON"),
    ({"model": "llama", "model_config": '{"n_layerz": 2}'}, "llama has no field"),
    ({"model": "llama", "model_config": '[2]'}, "model_config must be a JSON object"),
    ({"model": "llama", "model_config": '{"vocab_size": 256}', "tokenizer": "bpe:8192"},
     "tokenizer 'bpe:8192': the dataset's tokenizer .* has a vocabulary of 8192 tokens but the model's vocab_size "
     "is 256"),
    ({"model": "nosuchpkg.models:build"}, "cannot import 'nosuchpkg.models'"),
    ({"init_from": "/nonexistent/llama"}, "no config.json there"),
    ({"init_from": "hf://meta-llama/Llama-3.2-1B"}, "give a Hugging Face model directory"),
    ({"evaluate_gpu_resource": "nvidia.com/mig-big"}, "evaluate_gpu_resource"),
    # evaluation's settings, which would otherwise fail only after training
    ({"require_beat_baseline": True}, "require_beat_baseline needs a baseline"),
    ({"baseline": "init_from"}, "baseline=init_from needs init_from"),
    ({"baseline": "/nonexistent/base"}, "baseline '/nonexistent/base': no config.json"),
    ({"trainer_image": ""}, "an image is required"),
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
    ({"trainer_image": "Bad Image"}, "not an image reference"),
    ({"run_id": "{{$.pipeline_job_uuid}}"}, "must be set"),
    # faults that could never fire: 1 node x 8 GPUs is ranks 0..7, and max_steps is 200
    ({"inject_fault": "kill@40:16"}, "rank 16 does not exist in a run of 16 rank"),       # 2 nodes x 8 GPUs
    ({"inject_fault": "hang@500:0"}, "step 500 comes after the last step"),
])
def test_bad_settings_fail_before_anything_runs(kw, message):
    settings = {"fsx_root": "/fsx", "dataset_name": "d", "dataset_version": "1", "run_id": "r",
                "trainer_image": "x/y:1", **kw}
    with pytest.raises(ValueError, match=message):
        build_train_config(**settings)


def test_an_instance_type_sizes_the_job_to_its_node():
    job = build_train_config(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r",
                             instance_type="g6e.12xlarge", trainer_image="x/y:1").job_options
    assert job["gpus_per_node"] == 4 and job["instance_type"] == "g6e.12xlarge"
    job = build_train_config(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r",
                             trainer_image="x/y:1").job_options
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


def test_the_trainer_images_nvrx_release_reaches_the_job_and_gates_what_it_offers():
    """Hot spares exist from NVRx 0.6: asked of a 0.5 image they are refused before submitting; for a 0.7 image
    they reach the job's settings, which the PyTorchJob builder reads."""
    from trainer import compat

    good = {"fsx_root": "/fsx", "dataset_name": "corpus", "dataset_version": "latest", "nodes": 2,
            "trainer_image": "ecr.example/goodput-trainer:0.1.0", "instance_type": "p5.48xlarge"}
    with pytest.raises(ValueError, match="0.5.0"):
        check_run_parameters({**good, "hot_spares": 1, "nvrx_release": "0.5.0"})
    if compat.image_release().hot_spares:          # the default image's release (compat.IMAGE_RELEASE)
        check_run_parameters({**good, "hot_spares": 1})
    check_run_parameters({**good, "hot_spares": 1, "nvrx_release": "0.7.0"})
    with pytest.raises(ValueError, match="nvrx_release"):
        check_run_parameters({**good, "nvrx_release": "9.9"})
    _, job, *_ = build_train_config(**{**SETTINGS, "trainer_image": good["trainer_image"]}, nodes=2, hot_spares=1,
                                    nvrx_release="0.7.0", instance_type="p5.48xlarge")
    assert (job["nvrx_release"], job["hot_spares"]) == ("0.7.0", 1)


@pytest.mark.parametrize("backend", ["pytorchjob", "cluster", "trainjob"])
def test_the_pipelines_defaults_pass_for_every_cluster_backend(backend):
    """What the KFP form starts with is a valid job for each backend (``cluster``: pytorchjob's old name)."""
    import inspect

    from pipelines.pipeline import goodput_pipeline

    defaults = {k: p.default for k, p in inspect.signature(goodput_pipeline.pipeline_func).parameters.items()
                if p.default is not inspect.Parameter.empty}
    params = {**defaults, "dataset_source": "s3://bucket/corpus", "backend": backend}
    assert "backend" not in defaults and "local_nproc" not in defaults, "the cluster form has no backend settings"
    check_run_parameters(params)


SETTINGS = {"fsx_root": "/fsx", "dataset_name": "d", "dataset_version": "1", "run_id": "r", "trainer_image": "x/y:1"}


def test_the_model_reaches_the_trainer():
    s = build_train_config(**SETTINGS, model="llama", model_flavor="debug", model_config='{"n_layers": 2}')
    model = s.trainer_config["model"]
    assert model["name"] == "llama" and model["flavor"] == "debug"
    assert json.loads(model["config"]) == {"n_layers": 2}
    assert "init_from" not in model and s.init_from_source == "" and s.init_from_dir == ""
    assert s.model_name == "llama", "the registry name defaults to the model's"
    assert build_train_config(**SETTINGS, model="llama", model_name="chat").model_name == "chat"
    assert (s.evaluate_accelerator, s.evaluate_gpus) == ("nvidia.com/gpu", 0), "evaluate on a CPU pod by default"
    s = build_train_config(**SETTINGS, evaluate_gpu_resource="nvidia.com/mig-3g.40gb")
    assert (s.evaluate_accelerator, s.evaluate_gpus) == ("nvidia.com/mig-3g.40gb", 1)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_small_llama(tmp_path_factory.mktemp("hf") / "llama")


def test_init_from_a_directory_is_passed_as_it_is_and_its_architecture_checked(llama_dir, tmp_path):
    s = build_train_config(**SETTINGS, model="llama", model_flavor="llama3-1b", init_from=str(llama_dir))
    assert s.trainer_config["model"]["init_from"] == str(llama_dir) and s.init_from_source == ""
    assert "flavor" not in s.trainer_config["model"], "the directory's config.json is the architecture"
    assert s.baseline_dir == ""
    s = build_train_config(**SETTINGS, model="llama", init_from=str(llama_dir), baseline="init_from",
                           require_beat_baseline=True)
    assert s.baseline_dir == str(llama_dir), "the baseline is the model the run starts from"
    with pytest.raises(ValueError, match="--seq-len 512 is longer"):       # the directory's config decides
        build_train_config(**SETTINGS, model="llama", init_from=str(llama_dir), seq_len=512)
    with pytest.raises(ValueError, match="bytegpt has no Hugging Face layout"):
        build_train_config(**SETTINGS, model="bytegpt", init_from=str(llama_dir))
    small = save_small_llama(tmp_path / "vocab100", vocab_size=100)
    with pytest.raises(ValueError, match="vocabulary of 256 tokens but the model's vocab_size is 100"):
        build_train_config(**SETTINGS, model="llama", init_from=str(small))          # bytes need 256 ids


def _production(registry, model_name: str, model_uri: str, fmt: str = "huggingface") -> None:
    from components.evaluate.register import PRODUCTION_FILE

    (registry / model_name).mkdir(parents=True)
    (registry / model_name / PRODUCTION_FILE).write_text(json.dumps({"version": "v1", "model_uri": model_uri,
                                                                     "format": fmt}))


def test_init_from_production_continues_from_the_registrys_production_model(llama_dir, tmp_path):
    registry = tmp_path / "models"
    with pytest.raises(ValueError, match="no production model 'llama' to continue from yet"):
        build_train_config(**SETTINGS, model="llama", init_from="production", registry=str(registry))
    _production(registry, "llama", str(llama_dir))
    s = build_train_config(**SETTINGS, model="llama", init_from="production", registry=str(registry))
    assert s.trainer_config["model"]["init_from"] == str(llama_dir) and s.init_from_source == ""
    _production(registry, "bytegpt", str(registry / "bytegpt" / "v1" / "model.pt"), fmt="torch.save(state_dict)")
    with pytest.raises(ValueError, match="not a Hugging Face directory"):
        build_train_config(**SETTINGS, init_from="production", registry=str(registry))
    # Before submitting to a cluster, FSx is not here: the step looks it up.
    unreachable = build_train_config(**SETTINGS, model="llama", init_from="production",
                                     registry=str(tmp_path / "elsewhere"), reachable=False)
    assert "init_from" not in unreachable.trainer_config["model"]


@pytest.fixture(scope="module")
def s3_llama(s3, llama_dir):
    """The small Llama under s3://<bucket>/llama/ (and a prefix with no model) on the moto S3 server."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for f in llama_dir.iterdir():
        client.upload_file(str(f), bucket, f"llama/{f.name}")
    client.put_object(Bucket=bucket, Key="empty/README", Body=b"no model here")
    return s3, bucket


def test_init_from_s3_is_staged_to_fsx_and_checked_before(s3_llama, tmp_path):
    server, bucket = s3_llama
    fsx = tmp_path / "fsx"
    s = build_train_config(**{**SETTINGS, "fsx_root": str(fsx)}, model="llama", init_from=f"s3://{bucket}/llama",
                           s3_endpoint_url=server.url, baseline="init_from")
    assert s.init_from_source == f"s3://{bucket}/llama"
    assert s.init_from_dir == str(fsx / "pretrained" / bucket / "llama")
    assert s.trainer_config["model"]["init_from"] == s.init_from_dir == s.baseline_dir
    assert not fsx.exists(), "checking writes nothing"
    with pytest.raises(ValueError, match="cannot read .*empty/config.json"):
        build_train_config(**SETTINGS, model="llama", init_from=f"s3://{bucket}/empty", s3_endpoint_url=server.url)
    with pytest.raises(ValueError, match="not a whole bucket"):
        build_train_config(**SETTINGS, model="llama", init_from=f"s3://{bucket}", s3_endpoint_url=server.url)
