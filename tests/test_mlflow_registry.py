"""An MLflow model registry (``registry=mlflow://HOST:PORT``) against a real ``mlflow server`` (SQLite backend,
local artifact store, on 127.0.0.1) started once for the module: a promoted llama run becomes a registered
model version whose artifacts ``transformers`` loads, with the evaluation's metrics and the run's tags and
report; the alias ``production`` moves only on promotion; an unreachable server or a failure mid-way leaves
nothing registered and nothing promoted."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from components.evaluate.evaluate import evaluate_run, load_checkpoint_model
from components.evaluate.mlflow_registry import MlflowRegistryError
from components.evaluate.register import registered_model
from components.evaluate.register_op import register_op
from tests.eval_task_files import MC_TASK, write_task_files
from tests.test_evaluate_models import SMALL, llama_run, trained_state, windows
from trainer.data import ensure_default_dataset
from trainer.layout import step_dir
from trainer.models import resolve_model

mlflow = pytest.importorskip("mlflow")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
MODEL = "llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``mlflow server`` on a free port of 127.0.0.1; yields its registry URI once /health answers."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = open(root / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180          # a first start migrates the SQLite schema: slow on a busy machine
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            log.seek(0)
            pytest.fail(f"mlflow server did not answer on port {port}:\n{log.read()[-3000:]}")
        time.sleep(0.5)         # polling an external server's readiness; there is no event to wait on
    yield f"mlflow://127.0.0.1:{port}"
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)        # its uvicorn child goes at once; the parent can linger for 30 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


@pytest.fixture(scope="module")
def client(server):
    url = server.replace("mlflow://", "http://")
    return mlflow.MlflowClient(tracking_uri=url, registry_uri=url)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return ensure_default_dataset(tmp_path_factory.mktemp("fsx"))


@pytest.fixture(scope="module")
def states(data) -> dict[str, dict]:
    spec = resolve_model("llama", "debug", SMALL)
    return {"early": trained_state(spec, data, 0), "late": trained_state(spec, data, 10)}


@pytest.fixture
def fail_fast(monkeypatch):
    # MLflow's client retries a failed request with backoff for minutes by default.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def test_a_promoted_run_is_a_version_transformers_loads_and_the_alias_moves_only_on_promotion(
        server, client, data, states, tmp_path):
    mc, _ = write_task_files(tmp_path / "evals")
    run = llama_run(tmp_path, "mlflow-run", data, {10: states["early"], 20: states["late"]})
    (run / "summary.json").write_text(json.dumps({"goodput": 0.97, "steps": 20}))
    r = evaluate_run(run, out_dir=tmp_path / "out", registry=server, model_name=MODEL, eval_tasks=str(mc),
                     eval_limit=2)
    assert r.promoted and r.registered["model_uri"] == f"models:/{MODEL}/1"
    mv = client.get_model_version_by_alias(MODEL, "production")
    assert mv.version == "1"

    # The version's artifacts are the Hugging Face directory of the best checkpoint, with its model card.
    hf_dir = Path(mlflow.artifacts.download_artifacts(artifact_uri=client.get_model_version_download_uri(MODEL, "1"),
                                                      dst_path=str(tmp_path / "dl"),
                                                      tracking_uri=server.replace("mlflow://", "http://")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ours = load_checkpoint_model(step_dir(run / "checkpoints", 20), resolve_model("llama", "debug", SMALL))
    tokens = torch.from_numpy(windows(data)[0][0])[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-5)
    text = "import os\n"
    assert transformers.AutoTokenizer.from_pretrained(hf_dir)(text).input_ids == list(text.encode())
    card = (hf_dir / "README.md").read_text()
    assert "mlflow-run" in card and "goodput: 97.0%" in card and f"| {MC_TASK} | acc_norm |" in card

    # Metrics (the best's, each checkpoint's at its step, the tasks'), tags and the report are there.
    metrics = client.get_run(mv.run_id).data.metrics
    assert metrics["val_loss"] == pytest.approx(r.best["val_loss"]) and metrics["bpb"] == pytest.approx(r.best["bpb"])
    assert metrics[f"tasks/{MC_TASK}/acc_norm"] == r.best["tasks"][MC_TASK]["acc_norm"]
    history = client.get_metric_history(mv.run_id, "checkpoint_val_loss")
    assert sorted(m.step for m in history) == [10, 20]
    expected = {"goodput.run_id": "mlflow-run", "goodput.params_sha256": r.best["params_sha256"],
                "goodput.tokenizer": "bytes", "goodput.goodput": "0.97", "goodput.step": "20",
                "goodput.version": "mlflow-run-step000000020"}
    assert expected.items() <= mv.tags.items()
    assert len(mv.tags["goodput.dataset_manifest_sha256"]) == 64 and mv.tags["goodput.nvrx_release"]
    names = {a.path for a in client.list_artifacts(mv.run_id)}
    assert {"report.html", "evaluation.json", "model"} <= names

    # The register step reads the version back.
    record = registered_model(r.registered["model_uri"], server, MODEL)
    assert record["production"] and record["step"] == 20 and record["params_sha256"] == r.best["params_sha256"]
    from kfp import dsl

    model = dsl.Model(name="model", uri=str(tmp_path / "model.json"))
    model.path = str(tmp_path / "model.json")
    register_op.python_func(model_uri=r.registered["model_uri"], registry=server, model_name=MODEL, model=model)
    assert model.metadata["version"] == "mlflow-run-step000000020" and model.metadata["production"]

    # A worse run (production re-scored from its MLflow artifacts) is refused: no version, the alias stays.
    worse = llama_run(tmp_path, "worse-run", data, {30: states["early"]})
    refused = evaluate_run(worse, out_dir=tmp_path / "worse", registry=server, model_name=MODEL, threshold=10.0)
    assert not refused.promoted and "worse than production" in refused.gate["reason"]
    assert refused.gate["production"]["val_loss"] == pytest.approx(r.best["val_loss"], rel=1e-6)
    assert client.get_model_version_by_alias(MODEL, "production").version == "1"
    assert [v.version for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]

    # As good a run is promoted: a new version, and the alias moves to it.
    again = llama_run(tmp_path / "b", "again-run", data, {40: states["late"]})
    moved = evaluate_run(again, out_dir=tmp_path / "again", registry=server, model_name=MODEL)
    assert moved.promoted and moved.registered["model_uri"] == f"models:/{MODEL}/2"
    assert client.get_model_version_by_alias(MODEL, "production").version == "2"
    assert not registered_model(f"models:/{MODEL}/1", server, MODEL, log=lambda _: None)["production"]


def test_an_unreachable_server_fails_before_anything_is_scored_or_promoted(data, states, tmp_path, fail_fast):
    run = llama_run(tmp_path, "run", data, {10: states["late"]})
    dead = f"mlflow://127.0.0.1:{free_port()}"
    with pytest.raises(MlflowRegistryError, match=f"registry {dead} .* cannot be reached"):
        evaluate_run(run, out_dir=tmp_path / "out", registry=dead, model_name=MODEL)
    assert not (tmp_path / "out" / "evaluation.json").exists()


def test_a_failure_mid_registration_leaves_no_version_and_no_run(
        server, client, data, states, tmp_path, monkeypatch, fail_fast):
    name = "half-registered"
    run = llama_run(tmp_path, "run", data, {10: states["late"]})

    def refuse(*args, **kwargs):
        raise mlflow.exceptions.MlflowException("the registry refused the version")

    # The run and its artifacts are written; the server then refuses the version.
    monkeypatch.setattr(mlflow.MlflowClient, "create_model_version", refuse)
    with pytest.raises(MlflowRegistryError, match="nothing was left registered: .*refused the version"):
        evaluate_run(run, out_dir=tmp_path / "out", registry=server, model_name=name)
    assert client.search_model_versions(f"name='{name}'") == []
    experiment = client.get_experiment_by_name(f"goodput/{name}")
    assert client.search_runs([experiment.experiment_id]) == []       # deleted runs are not listed
    with pytest.raises(mlflow.exceptions.MlflowException):
        client.get_model_version_by_alias(name, "production")


def test_registries_of_schemes_we_do_not_serve_are_refused_at_check_settings():
    from components.train.settings import build_train_config

    kwargs = dict(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r", model="llama",
                  model_flavor="debug", reachable=False, backend="local")
    for bad in ("ftp://host/models", "mlflow://", "gs://bucket/models"):
        with pytest.raises(ValueError, match="registry"):
            build_train_config(registry=bad, **kwargs)
    build_train_config(registry="mlflow://127.0.0.1:5000", **kwargs)
    build_train_config(registry="mlflow+https://mlflow.example.com/team", **kwargs)


def test_an_mlflow_registry_that_cannot_be_reached_fails_check_settings_before_anything_is_recorded(tmp_path):
    """A wrong address was found only by the evaluate step, after training."""
    import socket

    from components.train.settings import build_train_config
    from trainer.layout import settings_path

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kw = dict(fsx_root=str(tmp_path), dataset_name="d", dataset_version="1", run_id="r", backend="local")
    with pytest.raises(ValueError, match=f"^registry mlflow://127.0.0.1:{port}: the MLflow server cannot be reached"):
        build_train_config(registry=f"mlflow://127.0.0.1:{port}", **kw)
    assert not settings_path(tmp_path / "runs" / "r").exists(), "refused before the run is recorded"
    build_train_config(registry=f"mlflow://127.0.0.1:{port}", reachable=False, **kw)   # before submitting: the step's
