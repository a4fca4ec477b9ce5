"""The compiled pipeline: steps, DAG edges, conditions, exit handler, platform spec, determinism, no secrets."""

import hashlib
import os
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

from pipelines.cli import main

FSX = "/fsx"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    res = CliRunner().invoke(main, ["compile", "-o", str(path)], catch_exceptions=False)
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
    assert {"check settings", "stage (latest)", "stage (pinned)", "train", "evaluate", "register"} <= shown
    executors = {c.get("executorLabel") for c in spec["components"].values()} - {None}
    assert executors == {"exec-train-config-op", "exec-stage-op", "exec-stage-op-2", "exec-train-op",
                         "exec-evaluate-op", "exec-register-op", "exec-cleanup-op"}


def test_dag_edges_stage_train_evaluate_register(compiled):
    _, spec, _ = compiled
    handler = dag(spec, "comp-exit-handler-1")
    comp, train = find(spec, "train")
    assert comp == "comp-exit-handler-1"
    branches = [n for n in handler if n.startswith("condition-branches")]
    assert len(branches) == 1
    # train follows whichever stage branch ran, and takes its arguments from the settings check
    assert sorted(train["dependentTasks"]) == sorted([branches[0], "train-config-op"])
    assert train["inputs"]["parameters"]["trainer_args"]["taskOutputParameter"] == {
        "outputParameterKey": "trainer_args", "producerTask": "train-config-op"}
    assert handler[branches[0]]["dependentTasks"] == ["train-config-op"]     # staging starts after the check
    _, evaluate = find(spec, "evaluate")
    assert sorted(evaluate["dependentTasks"]) == ["train-config-op", "train-op"]
    assert evaluate["inputs"]["parameters"]["run_dir"]["taskOutputParameter"]["producerTask"] == "train-config-op"
    comp, register = find(spec, "register")
    gate = handler[comp.removeprefix("comp-")]
    assert gate["dependentTasks"] == ["evaluate-op"]
    promoted = "inputs.parameter_values['pipelinechannel--evaluate-op-promoted'] == true"
    assert gate["triggerPolicy"]["condition"] == promoted
    model_uri = register["inputs"]["parameters"]["model_uri"]["componentInputParameter"]
    assert model_uri == "pipelinechannel--evaluate-op-model_uri"


def test_stage_is_cached_only_for_a_pinned_version(compiled):
    _, spec, _ = compiled
    latest_comp, latest = find(spec, "stage (latest)")
    pinned_comp, pinned = find(spec, "stage (pinned)")
    branches = next(c for n, c in spec["components"].items() if n.startswith("comp-condition-branches"))["dag"]["tasks"]
    conditions = {n.removeprefix("comp-"): t["triggerPolicy"]["condition"] for n, t in
                  [(f"comp-{k}", v) for k, v in branches.items()]}
    cond = "inputs.parameter_values['pipelinechannel--dataset_version'] == 'latest'"
    assert conditions[latest_comp.removeprefix("comp-")] == cond
    assert conditions[pinned_comp.removeprefix("comp-")] == f"!({cond})"
    assert latest["cachingOptions"].get("enableCache", False) is False
    assert pinned["cachingOptions"]["enableCache"] is True
    for other in ("check settings", "train", "evaluate", "register", "cleanup"):
        assert find(spec, other)[1]["cachingOptions"].get("enableCache", False) is False, other


def test_retries_on_the_retry_safe_steps(compiled):
    _, spec, _ = compiled
    retries = {name: find(spec, name)[1].get("retryPolicy", {}).get("maxRetryCount", 0)
               for name in ("check settings", "stage (latest)", "stage (pinned)", "train", "evaluate", "register",
                            "cleanup")}
    assert retries == {"check settings": 0, "stage (latest)": 3, "stage (pinned)": 3, "train": 2, "evaluate": 2,
                       "register": 2, "cleanup": 2}


def test_platform_spec_mounts_places_and_uses_secrets(compiled):
    _, _, executors = compiled
    for name in ("exec-stage-op", "exec-stage-op-2", "exec-evaluate-op", "exec-register-op"):
        ex = executors[name]
        (mount,) = ex["pvcMount"]
        assert mount["mountPath"] == FSX
        assert mount["pvcNameParameter"]["componentInputParameter"] == "pipelinechannel--fsx_pvc"
        (secret,) = ex["secretAsEnv"]
        assert secret["optional"] is True
        assert secret["secretNameParameter"]["componentInputParameter"] == "pipelinechannel--s3_secret"
        assert {k["envVar"] for k in secret["keyToEnv"]} == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    for name in ("exec-stage-op", "exec-stage-op-2", "exec-evaluate-op", "exec-register-op", "exec-train-config-op",
                 "exec-cleanup-op"):
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
    assert defaults["backend"] == "cluster" and defaults["nodes"] == 2 and defaults["gpus_per_node"] == 8
    assert defaults["spot"] is False and defaults["instance_type"] == "p5.48xlarge"
    assert {"max_restarts", "backoff_limit", "ckpt_every", "promotion_threshold", "trainer_image",
            "inject_fault", "step_tolerations", "step_node_selector", "s3_secret"} <= set(params)


def compile_in_subprocess(out, **env) -> bytes:
    code = f"from pipelines.compile import compile_pipeline; compile_pipeline({str(out)!r})"
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
