"""Evaluate and register any model of the protocol, with ``transformers`` as the reference: a ``llama``
run directory laid out as ``goodput train`` leaves it is scored, promoted and registered as a Hugging Face
directory that ``transformers`` loads with our logits; ``--baseline`` scores a ``transformers``-saved Llama
with the loss ``transformers`` itself gives; the gate can require beating the baseline."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from kfp import dsl

from components.evaluate.evaluate import EvaluationError, evaluate_run, load_checkpoint_model, params_sha256
from components.evaluate.evaluate_op import evaluate_op
from components.evaluate.register import registered_model
from components.evaluate.registry_format import RegistrationError
from pipelines.cli import main as cli
from trainer.data import Split, ensure_default_dataset, eval_windows
from trainer.layout import step_dir
from trainer.models import build_local, resolve_model
from trainer.models.hf import INDEX, export_state_dict

from .committed import save_committed

transformers = pytest.importorskip("transformers")
# Checkpoints are written and read in one process, as evaluate and export read them.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SEQ, WINDOWS = 64, 12
SMALL = {"dim": 64, "n_layers": 2, "ffn_dim": 96, "max_seq_len": 128}      # llama debug, smaller still


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    data = ensure_default_dataset(tmp_path_factory.mktemp("fsx"))
    # The dataset's staged tokenizer files (docs/datasets.md: DATA/tokenizer/) travel with a registered model.
    (data / "tokenizer").mkdir(exist_ok=True)
    (data / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": SEQ}))
    return data


def windows(data: Path) -> list:
    return list(eval_windows(Split.open(data, "val"), SEQ, WINDOWS))


def trained_state(spec, data: Path, steps: int) -> dict:
    """The weights of a few real optimizer steps on the training split (0 steps: the initial weights)."""
    model = build_local(spec, seed=0)
    tokens = np.asarray(Split.open(data, "train").tokens[:200_000], dtype=np.int64)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - SEQ - 1, size=8)
        batch = torch.from_numpy(np.stack([tokens[s:s + SEQ + 1] for s in starts]))
        spec.loss(model, batch[:, :-1], batch[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def llama_run(root: Path, name: str, data: Path, states: dict[int, dict]) -> Path:
    """A run directory as `goodput train` lays it out (trainer.checkpoint, trainer.layout): config.json
    naming the model spec, and per step a DCP checkpoint (model + optimizer) with its COMMITTED marker."""
    spec = resolve_model("llama", "debug", SMALL)
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": spec.describe(), "data": {
        "data": str(data), "seq_len": SEQ, "eval_windows": WINDOWS}}))
    for step, state in states.items():
        path = step_dir(run / "checkpoints", step)
        save_committed(path, {"model": state, "optim": {"step": torch.tensor(float(step))}}, step)
    return run


@pytest.fixture(scope="module")
def states(data) -> dict[str, dict]:
    spec = resolve_model("llama", "debug", SMALL)
    return {"init": trained_state(spec, data, 0), "early": trained_state(spec, data, 4),
            "late": trained_state(spec, data, 30)}


def transformers_loss(model, data: Path) -> float:
    """Mean next-token cross entropy of a transformers model on evaluate's windows, by transformers."""
    total = 0.0
    with torch.no_grad():
        for x, y in windows(data):
            logits = model(torch.from_numpy(x)[None]).logits
            total += F.cross_entropy(logits[0].float(), torch.from_numpy(y)).item()
    return total / WINDOWS


@pytest.fixture(scope="module")
def random_hf(tmp_path_factory) -> tuple[Path, float]:
    """(a random Llama saved by transformers, reading bytes; its loss on the windows by transformers)."""
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                      max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("base") / "hf"
    model.save_pretrained(path)
    return path, model


def download(s3, uri: str, dest: Path) -> Path:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    client = s3.client()
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/")["Contents"]:
        dest.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, obj["Key"], str(dest / obj["Key"].rsplit("/", 1)[1]))
    return dest


@pytest.mark.parametrize("kind", ["directory", "s3"])
def test_a_llama_run_is_scored_promoted_and_registered_as_a_directory_transformers_loads(
        data, states, tmp_path, kind, request):
    run = llama_run(tmp_path, "llama-run", data, {10: states["early"], 20: states["late"]})
    s3, registry, url = None, str(tmp_path / "registry"), None
    if kind == "s3":
        s3, base = request.getfixturevalue("s3_registry")
        registry, url = f"{base}-{uuid.uuid4().hex[:6]}", s3.url
    r = evaluate_run(run, out_dir=tmp_path / "out", registry=registry, endpoint_url=url, model_name="llama",
                     max_shard_bytes=200_000)
    assert r.model["name"] == "llama" and r.seq_len == SEQ and r.skipped == []
    assert [c["step"] for c in r.checkpoints] == [10, 20] and r.best["step"] == 20
    assert r.checkpoints[1]["val_loss"] < r.checkpoints[0]["val_loss"] < math.log(256)
    assert r.best["params_sha256"] == params_sha256(states["late"])
    assert r.promoted and r.registered["format"] == "huggingface"
    assert r.registered["model_uri"] == f"{registry}/llama/llama-run-step000000020"     # a directory

    hf_dir = Path(r.registered["model_uri"]) if s3 is None else download(s3, r.registered["model_uri"], tmp_path / "dl")
    assert (hf_dir / INDEX).is_file() and len(list(hf_dir.glob("model-*-of-*.safetensors"))) > 1
    assert not (hf_dir / "model.pt").exists()
    assert json.loads((hf_dir / "tokenizer_config.json").read_text()) == {"model_max_length": SEQ}
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    ours = load_checkpoint_model(step_dir(run / "checkpoints", 20), resolve_model("llama", "debug", SMALL))
    tokens = torch.from_numpy(windows(data)[0][0])[None]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=0, atol=1e-5)

    # The register step reads the record back: every file metadata.json lists is there.
    record = registered_model(r.registered["model_uri"], registry, "llama", url)
    assert record["production"] and record["format"] == "huggingface" and record["step"] == 20
    assert record["params_sha256"] == r.best["params_sha256"]
    meta = json.loads((hf_dir / "metadata.json").read_text())
    assert meta["model"] == r.model and "config.json" in meta["files"] and INDEX in meta["files"]

    # Evaluated again, the production model is read back from the Hugging Face directory and re-scored.
    again = evaluate_run(run, out_dir=tmp_path / "out2", registry=registry, endpoint_url=url, model_name="llama")
    assert again.gate["production"]["val_loss"] == pytest.approx(r.best["val_loss"], rel=1e-6)
    # Promoted again (a retried step does the same): the version is pointed at, not rewritten.
    assert again.promoted and again.registered == r.registered
    listed = hf_dir if s3 is None else download(s3, r.registered["model_uri"], tmp_path / "dl2")
    assert sorted(p.name for p in listed.iterdir()) == sorted([*meta["files"], "metadata.json"])
    # Other weights under a registered version's name are refused; production is left as it was.
    clash = llama_run(tmp_path / "elsewhere", "llama-run", data, {20: states["early"]})
    with pytest.raises(RegistrationError, match="already holds other weights"):
        evaluate_run(clash, out_dir=tmp_path / "out3", registry=registry, endpoint_url=url, model_name="llama",
                     tolerance=10.0)
    assert registered_model(r.registered["model_uri"], registry, "llama", url)["production"]

    # A registered directory that lost a shard is refused by the register step.
    gone = sorted(meta["files"])[1]
    if s3 is None:
        (hf_dir / gone).unlink()
    else:
        bucket, _, prefix = registry[len("s3://"):].partition("/")
        s3.client().delete_object(Bucket=bucket, Key=f"{prefix}/llama/llama-run-step000000020/{gone}")
    with pytest.raises(RegistrationError, match=f"{gone} is missing"):
        registered_model(r.registered["model_uri"], registry, "llama", url)


def test_baseline_is_scored_on_the_same_windows_as_transformers_scores_it(data, states, random_hf, tmp_path):
    path, model = random_hf
    reference = transformers_loss(model, data)
    run = llama_run(tmp_path, "r", data, {20: states["late"]})
    r = evaluate_run(run, out_dir=tmp_path / "out", baseline=path)
    assert r.baseline["val_loss"] == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert r.baseline["windows"] == WINDOWS and r.baseline["tokens"] == WINDOWS * SEQ
    assert r.baseline["bpb"] == pytest.approx(reference / math.log(2), rel=1e-5)
    saved = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert saved["baseline"]["val_loss"] == r.baseline["val_loss"] and saved["gate"]["baseline"]["dir"] == str(path)

    # The component logs it with the checkpoints' metrics; the CLI shows it.
    metrics = dsl.Metrics(name="metrics", uri=str(tmp_path / "m"))
    report = dsl.HTML(name="report", uri=str(tmp_path / "report.html"))
    report.path = str(tmp_path / "report.html")
    out = evaluate_op.python_func(run_dir=str(run), out_dir=str(tmp_path / "op"), baseline=str(path),
                                  metrics=metrics, report=report)
    assert out.promoted and metrics.metadata["baseline_val_loss"] == pytest.approx(reference, rel=1e-5)
    assert metrics.metadata["baseline_bpb"] == pytest.approx(r.baseline["bpb"])
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(run), "--out", str(tmp_path / "cli"),
                                   "--baseline", str(path)])
    assert res.exit_code == 0, res.output
    assert "baseline" in res.output and f"{reference:.4f}" in res.output


def test_the_gate_can_require_beating_the_baseline(data, states, random_hf, tmp_path):
    spec = resolve_model("llama", "debug", SMALL)
    better = export_state_dict(states["late"], spec, tmp_path / "better-base")    # the trained weights, HF layout
    worse = llama_run(tmp_path, "worse", data, {4: states["early"]})
    registry = tmp_path / "registry"

    r = evaluate_run(worse, out_dir=tmp_path / "o1", baseline=better, require_beat_baseline=True,
                     registry=str(registry), model_name="llama")
    assert r.best["val_loss"] > r.baseline["val_loss"]
    assert not r.promoted and "does not beat the baseline" in r.gate["reason"] and r.registered is None
    assert not (registry / "llama" / "production.json").exists()
    # The same run without the requirement passes the threshold: the refusal was the baseline's.
    assert evaluate_run(worse, out_dir=tmp_path / "o2", baseline=better).promoted

    # A run better than its baseline (here a random transformers Llama) is promoted under the requirement.
    good = llama_run(tmp_path, "good", data, {20: states["late"]})
    r = evaluate_run(good, out_dir=tmp_path / "o3", baseline=random_hf[0], require_beat_baseline=True)
    assert r.promoted and r.best["val_loss"] < r.baseline["val_loss"] and "baseline" in r.gate["reason"]

    with pytest.raises(ValueError, match="needs a baseline"):
        evaluate_run(good, out_dir=tmp_path / "o4", require_beat_baseline=True)
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(good), "--require-beat-baseline"])
    assert res.exit_code == 2 and "--require-beat-baseline needs --baseline" in res.output


def test_a_run_is_gated_and_registered_under_its_own_model_unless_named(data, states, tmp_path):
    """`goodput evaluate` without --model-name files a llama run under llama, not under bytegpt (whose
    production model, here a better one, it would otherwise be gated against)."""
    registry = tmp_path / "registry"
    (registry / "bytegpt").mkdir(parents=True)
    (registry / "bytegpt" / "production.json").write_text(json.dumps({"version": "v1", "val_loss": 0.01}))
    run = llama_run(tmp_path, "run", data, {20: states["late"]})
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(run), "--registry", str(registry)])
    assert res.exit_code == 0, res.output
    assert "PROMOTED" in res.output
    assert json.loads((registry / "llama" / "production.json").read_text())["version"]
    assert [p.name for p in (registry / "bytegpt").iterdir()] == ["production.json"]
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(run), "--model-name", "bad name"])
    assert res.exit_code == 2 and "model_name 'bad name' must be" in res.output, res.output


def test_a_baseline_that_cannot_read_the_dataset_is_refused_before_any_checkpoint(data, states, tmp_path):
    spec = resolve_model("llama", "debug", {**SMALL, "vocab_size": 100})
    small_vocab = export_state_dict(build_local(spec).state_dict(), spec, tmp_path / "v100")
    run = llama_run(tmp_path, "r", data, {20: states["late"]})
    with pytest.raises(EvaluationError, match="vocab_size is 100"):
        evaluate_run(run, out_dir=tmp_path / "out", baseline=small_vocab)
    assert not (tmp_path / "out" / "evaluation.json").exists()
