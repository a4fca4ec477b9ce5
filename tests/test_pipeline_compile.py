"""The compiled pipeline: steps, DAG edges, conditions, exit handler, platform spec, determinism, no secrets."""

import hashlib
import os
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from pipelines.cli import main

try:
    from tests.deploy_checks import fits, quantity
except ImportError:          # tests/ is not a package: pytest put it on sys.path
    from deploy_checks import fits, quantity

FSX = "/fsx"
COMPONENT_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/goodput-components:0.1.0"
TRAINER_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/goodput-trainer:0.1.0"
IMAGES = ["--component-image", COMPONENT_IMAGE, "--trainer-image", TRAINER_IMAGE]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    res = CliRunner().invoke(main, ["compile", *IMAGES, "-o", str(path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()[:12]}" in res.output
    spec, platform = yaml.safe_load_all(path.read_text())
    return path, spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def dag(spec: dict, component: str) -> dict:
    return spec["components"][component]["dag"]["tasks"]


def find(spec: dict, display: str) -> tuple[str, dict]:
    """(component holding it, task spec) of the task shown as ``display``."""
    for comp, body in [("root", spec["root"]), *spec["components"].items()]:
        for name, task in body.get("dag", {}).get("tasks", {}).items():
            if task["taskInfo"]["name"] == display:
                return comp, {**task, "_name": name}
    raise AssertionError(f"no task {display!r}")


def test_steps_and_exit_handler(compiled):
    _, spec, _ = compiled
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"cleanup-op", "exit-handler-1"}
    cleanup = root["cleanup-op"]
    assert cleanup["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"     # runs whatever happened
    assert cleanup["dependentTasks"] == ["exit-handler-1"]
    assert cleanup["inputs"]["parameters"]["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    shown = {t["taskInfo"]["name"] for c in spec["components"].values() for t in c.get("dag", {}).get("tasks", {})
             .values()}
    assert {"check settings", "stage", "stage: plan", "stage: partition", "stage: merge", "stage init_from", "train",
            "evaluate", "register"} <= shown
    executors = {c.get("executorLabel") for c in spec["components"].values()} - {None}
    assert executors == {"exec-train-config-op", "exec-stage-plan-op", "exec-stage-partition-op",
                         "exec-stage-merge-op", "exec-stage-model-op", "exec-train-op", "exec-evaluate-op",
                         "exec-register-op", "exec-cleanup-op"}


def test_dag_edges_stage_train_evaluate_register(compiled):
    _, spec, _ = compiled
    handler = dag(spec, "comp-exit-handler-1")
    comp, train = find(spec, "train")
    assert comp == "comp-exit-handler-1"
    stage_comp, stage = find(spec, "stage")
    assert stage_comp == "comp-exit-handler-1"
    # train follows the stage sub-pipeline and the init_from stage, and takes its arguments from the settings check
    assert sorted(train["dependentTasks"]) == sorted([stage["_name"], "stage-model-op", "train-config-op"])
    assert train["inputs"]["parameters"]["trainer_config"]["taskOutputParameter"] == {
        "outputParameterKey": "trainer_config", "producerTask": "train-config-op"}
    assert stage["dependentTasks"] == ["train-config-op"]     # staging starts after the check
    _, stage_model = find(spec, "stage init_from")
    assert stage_model["dependentTasks"] == ["train-config-op"]
    assert {k: v["taskOutputParameter"] for k, v in stage_model["inputs"]["parameters"].items()
            if "taskOutputParameter" in v} == {
        "source": {"outputParameterKey": "init_from_source", "producerTask": "train-config-op"},
        "dest": {"outputParameterKey": "init_from_dir", "producerTask": "train-config-op"}}
    # inside it: plan, then the partitions in parallel, then the merge
    plan_comp, _ = find(spec, "stage: plan")
    _, merge = find(spec, "stage: merge")
    loop = next(n for n in dag(spec, plan_comp) if n.startswith("for-loop"))
    assert dag(spec, plan_comp)[loop]["dependentTasks"] == ["stage-plan-op"] and merge["dependentTasks"] == [loop]
    _, evaluate = find(spec, "evaluate")
    assert sorted(evaluate["dependentTasks"]) == ["train-config-op", "train-op"]
    assert evaluate["inputs"]["parameters"]["run_dir"]["taskOutputParameter"]["producerTask"] == "train-config-op"
    comp, register = find(spec, "register")
    gate = handler[comp.removeprefix("comp-")]
    assert sorted(gate["dependentTasks"]) == ["evaluate-op", "train-config-op"]
    promoted = "inputs.parameter_values['pipelinechannel--evaluate-op-promoted'] == true"
    assert gate["triggerPolicy"]["condition"] == promoted
    model_uri = register["inputs"]["parameters"]["model_uri"]["componentInputParameter"]
    assert model_uri == "pipelinechannel--evaluate-op-model_uri"
    # evaluate and register use the registry name the check resolved (model_name empty: the model's)
    assert evaluate["inputs"]["parameters"]["model_name"]["taskOutputParameter"] == {
        "outputParameterKey": "model_name", "producerTask": "train-config-op"}
    assert evaluate["inputs"]["parameters"]["baseline"]["taskOutputParameter"] == {
        "outputParameterKey": "baseline_dir", "producerTask": "train-config-op"}


def test_no_step_is_taken_from_the_cache(compiled):
    # Staging an unchanged source only lists and compares, so it is never cached: a changed source is seen.
    _, spec, _ = compiled
    for other in ("check settings", "stage", "stage: plan", "stage: partition", "stage: merge", "stage init_from",
                  "train", "evaluate", "register", "cleanup"):
        assert find(spec, other)[1]["cachingOptions"].get("enableCache", False) is False, other


def test_retries_on_the_retry_safe_steps(compiled):
    _, spec, _ = compiled
    retries = {name: find(spec, name)[1].get("retryPolicy", {}).get("maxRetryCount", 0)
               for name in ("check settings", "stage: plan", "stage: partition", "stage: merge", "stage init_from",
                            "train", "evaluate", "register", "cleanup")}
    # The plan is not retried: what fails it (refused keys, a bad tokenizer) fails again.
    assert retries == {"check settings": 0, "stage: plan": 0, "stage: partition": 3, "stage: merge": 2,
                       "stage init_from": 3, "train": 2, "evaluate": 2, "register": 2, "cleanup": 2}


def test_platform_spec_mounts_places_and_uses_secrets(compiled):
    _, _, executors = compiled
    # check settings reads init_from and the registry's production model on FSx or S3
    for name in ("exec-stage-plan-op", "exec-stage-partition-op", "exec-stage-merge-op", "exec-evaluate-op",
                 "exec-register-op", "exec-train-config-op", "exec-stage-model-op"):
        ex = executors[name]
        (mount,) = ex["pvcMount"]
        assert mount["mountPath"] == FSX
        # the pipeline's parameter, or the stage sub-pipeline's input it is passed to
        assert mount["pvcNameParameter"]["componentInputParameter"] in ("pipelinechannel--fsx_pvc", "fsx_pvc")
        secrets = {s["secretNameParameter"]["componentInputParameter"].removeprefix("pipelinechannel--"): s
                   for s in ex["secretAsEnv"]}
        # evaluate and register also read an MLflow registry's tracking token
        assert set(secrets) == ({"s3_secret", "mlflow_secret"} if name in ("exec-evaluate-op", "exec-register-op")
                                else {"s3_secret"})
        secret = secrets["s3_secret"]
        assert secret["optional"] is True
        assert {k["envVar"] for k in secret["keyToEnv"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
        if "mlflow_secret" in secrets:
            assert secrets["mlflow_secret"]["optional"] is True
            assert [k["envVar"] for k in secrets["mlflow_secret"]["keyToEnv"]] == ["MLFLOW_TRACKING_TOKEN"]
    for name in ("exec-stage-plan-op", "exec-stage-partition-op", "exec-stage-merge-op", "exec-evaluate-op",
                 "exec-register-op", "exec-train-config-op", "exec-cleanup-op"):
        ex = executors[name]
        assert ex["tolerations"][0]["tolerationJson"]["componentInputParameter"].endswith("step_tolerations")
        assert ex["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith("step_node_selector")
    # Placement on the train task would reach the job's pods (task_config passthroughs); job_options place them.
    assert "tolerations" not in executors.get("exec-train-op", {})


def test_parameters_and_defaults(compiled):
    _, spec, _ = compiled
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert "defaultValue" not in params["dataset_source"]          # no bucket is a sensible default
    defaults = {k: v.get("defaultValue") for k, v in params.items()}
    assert defaults["dataset_version"] == "latest"
    assert defaults["fsx_root"] == FSX and defaults["registry"] == f"{FSX}/models"
    assert defaults["nodes"] == 2 and defaults["gpus_per_node"] == -1
    # The Create-run form shows what a cluster user sets: the backend is compiled in, the model is picked.
    assert not {"backend", "local_nproc", "n_layer", "n_head", "n_embd"} & set(params)
    # The trainer's settings have the trainer's defaults (tests/test_settings_contract.py checks every one).
    assert (defaults["model"], defaults["model_flavor"], defaults["model_config"], defaults["init_from"]) == (
        "bytegpt", "", "", "")
    assert defaults["model_name"] == "" and defaults["evaluate_gpu_resource"] == ""
    assert "package.module:function" in params["model"]["description"]
    assert all(p.get("description") for p in params.values()), "every parameter of the form is described"
    assert "production" in params["init_from"]["description"]
    from pipelines.pipeline import goodput_pipeline

    doc = goodput_pipeline.pipeline_func.__doc__
    assert doc.startswith("Train a model (llama, bytegpt or your own)") and "byte-level GPT" not in doc
    assert "model_config:" in doc and "{{" not in doc and "{train}" not in doc
    assert defaults["spot"] is False and defaults["instance_type"] == "p5.48xlarge"
    assert {"max_restarts", "backoff_limit", "ckpt_every", "promotion_threshold", "trainer_image",
            "inject_fault", "step_tolerations", "step_node_selector", "s3_secret"} <= set(params)
    # What deploy/README.md tells a user to set, by name.
    assert {"efa_per_node", "cpu", "memory", "shm_size", "node_group", "scheduler", "queue", "gpu_resource",
            "instance_type"} <= set(params)
    assert defaults["dataset_name"] == "corpus", "no demo dataset name on a cluster"
    assert defaults["trainer_image"] == TRAINER_IMAGE


def test_backend_trainjob_compiles_to_the_same_steps_with_the_backend_compiled_in(compiled, tmp_path):
    """``goodput compile --backend trainjob`` runs the same steps in the same DAG, with the same form; only
    the backend the check-settings, train and cleanup steps are compiled with differs."""
    path, spec, _ = compiled
    tj_path = tmp_path / "trainjob.yaml"
    res = CliRunner().invoke(main, ["compile", "--backend", "trainjob", *IMAGES, "-o", str(tj_path)])
    assert res.exit_code == 0 and "backend trainjob" in res.output, res.output
    tj, _ = yaml.safe_load_all(tj_path.read_text())

    def steps(s: dict) -> dict:
        return {comp: {name: (t["taskInfo"]["name"], sorted(t.get("dependentTasks", [])))
                       for name, t in body.get("dag", {}).get("tasks", {}).items()}
                for comp, body in [("root", s["root"]), *s["components"].items()]}

    assert steps(tj) == steps(spec)
    assert tj["root"]["inputDefinitions"] == spec["root"]["inputDefinitions"]
    assert "TrainJob" in tj["pipelineInfo"]["description"] and "PyTorchJob" in spec["pipelineInfo"]["description"]
    for s, backend in ((spec, "pytorchjob"), (tj, "trainjob")):
        for display in ("check settings", "train"):
            _, task = find(s, display)
            assert task["inputs"]["parameters"]["backend"]["runtimeValue"]["constant"] == backend
        cleanup = s["root"]["dag"]["tasks"]["cleanup-op"]
        assert cleanup["inputs"]["parameters"]["backend"]["runtimeValue"]["constant"] == backend
    res = CliRunner().invoke(main, ["compile", "--backend", "local", *IMAGES, "-o", str(tmp_path / "l.yaml")])
    assert res.exit_code == 2 and "'local' is not one of 'pytorchjob', 'trainjob'" in res.output


def test_the_local_variant_adds_only_local_nproc_and_local_nodes(compiled, tmp_path):
    """``goodput run --local`` compiles the same wiring with the local backend and a rank count."""
    from pipelines.compile import compile_pipeline

    _, spec, _ = compiled
    local, _ = yaml.safe_load_all(compile_pipeline(tmp_path / "local.yaml", backend="local").read_text())
    params = local["root"]["inputDefinitions"]["parameters"]
    assert set(params) - set(spec["root"]["inputDefinitions"]["parameters"]) == {"local_nproc", "local_nodes"}
    assert all(p.get("description") for p in params.values()), "every parameter of the form is described"
    assert "ranks" in params["local_nproc"]["description"]
    _, train = find(local, "train")
    assert train["inputs"]["parameters"]["backend"]["runtimeValue"]["constant"] == "local"
    assert train["inputs"]["parameters"]["local_nproc"]["componentInputParameter"] == "pipelinechannel--local_nproc"
    _, cluster_train = find(spec, "train")
    assert "local_nproc" not in cluster_train["inputs"]["parameters"]


def test_evaluate_gets_a_gpu_only_when_evaluate_gpu_resource_names_one(compiled):
    """The evaluate pod's accelerator and its count come from the settings check: 0 (a CPU pod) by default,
    one nvidia.com/gpu or MIG slice when ``evaluate_gpu_resource`` names it."""
    _, spec, _ = compiled
    accelerator = spec["deploymentSpec"]["executors"]["exec-evaluate-op"]["container"]["resources"]["accelerator"]
    assert accelerator == {
        "resourceType": "{{$.inputs.parameters['pipelinechannel--train-config-op-evaluate_accelerator']}}",
        "resourceCount": "{{$.inputs.parameters['pipelinechannel--train-config-op-evaluate_gpus']}}"}
    _, evaluate = find(spec, "evaluate")
    for output in ("evaluate_accelerator", "evaluate_gpus"):
        assert evaluate["inputs"]["parameters"][f"pipelinechannel--train-config-op-{output}"] == {
            "taskOutputParameter": {"outputParameterKey": output, "producerTask": "train-config-op"}}
    _, config = find(spec, "check settings")
    assert config["inputs"]["parameters"]["evaluate_gpu_resource"]["componentInputParameter"] == \
        "pipelinechannel--evaluate_gpu_resource"


def test_every_pod_runs_the_images_given(compiled):
    path, spec, _ = compiled
    images = {name: ex["container"]["image"] for name, ex in spec["deploymentSpec"]["executors"].items()}
    assert images.pop("exec-evaluate-op") == TRAINER_IMAGE, "evaluate loads checkpoints with torch"
    assert images.pop("exec-train-config-op") == TRAINER_IMAGE, "check settings builds the model with torch"
    assert set(images.values()) == {COMPONENT_IMAGE}
    # The defaults a reader of the YAML (or the KFP UI) sees, too; only the functions' source keeps its literal.
    assert "ghcr.io/goodput-pipelines" not in path.read_text().split("deploymentSpec")[0]


def test_compile_takes_images_from_the_environment_and_refuses_bad_ones(tmp_path):
    env = {"GOODPUT_COMPONENT_IMAGE": COMPONENT_IMAGE, "GOODPUT_TRAINER_IMAGE": TRAINER_IMAGE}
    out = tmp_path / "p.yaml"
    res = CliRunner().invoke(main, ["compile", "-o", str(out)], env=env)
    assert res.exit_code == 0 and COMPONENT_IMAGE in out.read_text(), res.output
    for bad, why in (("Goodput:1", "not an image reference"), ("ecr.example/goodput", "no tag or digest"),
                     ("a b:1", "not an image reference")):
        res = CliRunner().invoke(main, ["compile", "--component-image", bad, "--trainer-image", TRAINER_IMAGE,
                                        "-o", str(tmp_path / "x.yaml")])
        assert res.exit_code == 2 and why in res.output, res.output
        assert not (tmp_path / "x.yaml").exists()
    res = CliRunner().invoke(main, ["compile", "-o", str(out)], env={"GOODPUT_COMPONENT_IMAGE": "",
                                                                     "GOODPUT_TRAINER_IMAGE": ""})
    assert res.exit_code == 2 and "--component-image" in res.output


@pytest.mark.parametrize("instance_type", __import__("components.train.pytorchjob").train.pytorchjob.INSTANCE_TYPES)
def test_each_documented_instance_type_gives_pods_that_fit_it(compiled, instance_type):
    """The compiled defaults plus instance_type, through the check-settings step and the train step's
    builder: each pod's requests fit the node's allocatable (EKS reserve, DaemonSets) and its devices."""
    from components.train.pytorchjob import INSTANCE_TYPES, JobSpec, job_manifest, node_allocatable
    from components.train.settings import build_train_config

    _, spec, _ = compiled
    p = {k: v.get("defaultValue") for k, v in spec["root"]["inputDefinitions"]["parameters"].items()}
    args, job, *_ = build_train_config(
        fsx_root=p["fsx_root"], dataset_name=p["dataset_name"], dataset_version="1", run_id="r",
        instance_type=instance_type, trainer_image=p["trainer_image"], nodes=p["nodes"],
        gpus_per_node=p["gpus_per_node"], efa_per_node=p["efa_per_node"], cpu=p["cpu"], memory=p["memory"],
        shm_size=p["shm_size"])
    m = job_manifest(JobSpec.from_dict({**job, "image": p["trainer_image"], "nodes": p["nodes"], "name": "j",
                                        "trainer": args}))
    shape = INSTANCE_TYPES[instance_type]
    cpu_m, mem_mib = node_allocatable(shape)
    node = {"labels": {"node.kubernetes.io/instance-type": instance_type},
            "taints": [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}],
            "allocatable": {"cpu": f"{cpu_m}m", "memory": f"{mem_mib}Mi", "nvidia.com/gpu": str(shape.gpus),
                            "vpc.amazonaws.com/efa": str(shape.efa)}}
    for replica in m["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        assert fits(pod, node) == []
        res = pod["containers"][0]["resources"]
        assert res["requests"]["nvidia.com/gpu"] == str(shape.gpus), "all of the node's GPUs"
        assert res["requests"].get("vpc.amazonaws.com/efa", "0") == str(shape.efa)
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        assert quantity(shm) <= quantity(res["limits"]["memory"])


def compile_in_subprocess(out, **env) -> bytes:
    code = (f"from pipelines.compile import compile_pipeline; compile_pipeline({str(out)!r}, "
            f"component_image={COMPONENT_IMAGE!r}, trainer_image={TRAINER_IMAGE!r})")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env}, cwd=out.parent)
    return out.read_bytes()


def test_compile_is_deterministic_and_holds_no_credential(tmp_path):
    # Two processes with different hash seeds (no set or dict ordering may leak into the output), one
    # of them with credentials in its environment: the bytes are the same, and none of them is there.
    secrets = {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLEKEY12345", "AWS_SECRET_ACCESS_KEY": "wJalrEXAMPLESECRET",
               "KFP_TOKEN": "tok-EXAMPLE", "KFP_COOKIE": "authservice_session=EXAMPLE"}
    first = compile_in_subprocess(tmp_path / "a.yaml", PYTHONHASHSEED="1", **secrets)
    second = compile_in_subprocess(tmp_path / "b.yaml", PYTHONHASHSEED="2")
    assert hashlib.sha256(first).hexdigest() == hashlib.sha256(second).hexdigest()
    for value in secrets.values():
        assert value.encode() not in first


def test_the_parameters_the_docs_name_are_the_pipelines(compiled):
    """deploy/README.md's and docs/cli.md's lists of pipeline parameters name parameters that exist."""
    import re
    from pathlib import Path

    _, spec, _ = compiled
    params = set(spec["root"]["inputDefinitions"]["parameters"])
    root = Path(__file__).resolve().parents[1]
    deploy = (root / "deploy" / "README.md").read_text()
    table = deploy[deploy.index("| pipeline parameters | node groups |"):]
    named = set(re.findall(r"`(\w+)=", table[:table.index("\n\n")]))
    listed = deploy[deploy.index("The pipeline parameters that shape the trainer pods"):]
    named |= set(re.findall(r"`(\w+)`", listed[:listed.index("The train backend")]))
    cli = (root / "docs" / "cli.md").read_text()
    main = cli[cli.index("Main parameters"):]
    named |= set(re.findall(r"`(\w+)`", main[:main.index("The backend is not")]))
    values = {"llama", "bytegpt", "debug"}           # the model parameters' values, named in the same list
    assert named - values - params == set()
    assert {"model", "model_flavor", "model_config", "init_from", "evaluate_gpu_resource", "node_group",
            "efa_per_node", "shm_size", "scheduler", "queue"} <= named
