"""``components.evaluate.evaluate`` on the checkpoints of a real 2-rank ``goodput train`` run (FSDP2, gloo)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from components.evaluate.evaluate import (
    EvaluationError, evaluate_run, load_checkpoint_model, params_sha256, read_run_config, run_spec, validation_loss)
from pipelines.cli import main as cli
from trainer.checkpoint import COMMITTED, step_dir
from trainer.config import ModelConfig
from trainer.data import ensure_default_dataset
from trainer.models.bytegpt import ByteGPT

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8"]
STEPS = [10, 20, 30]


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(run dir, dataset dir) of one real run: 2 ranks, checkpoints committed at steps 10, 20 and 30."""
    root = tmp_path_factory.mktemp("eval")
    data = ensure_default_dataset(root / "fsx")
    run = root / "runs" / "r1"
    cmd = [sys.executable, "-c", "from pipelines.cli import main; main()", "train", "--nproc", "2",
           "--max-steps", "30", "--ckpt-every", "10", "--ckpt-keep", "10", "--data", str(data), "--out", str(run),
           "--fsx-root", str(root / "fsx"), *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*") if (p / COMMITTED).exists()) == STEPS
    return run, data


def copy_run(run: Path, dest: Path, keep: list[int] = STEPS) -> Path:
    shutil.copytree(run, dest, ignore=shutil.ignore_patterns("evaluation"))
    for p in (dest / "checkpoints").glob("step_*"):
        if int(p.name[5:]) not in keep:
            shutil.rmtree(p)
    return dest


def test_metrics_best_and_report_from_a_real_run(trained, tmp_path):
    run, data = trained
    summary = json.loads((run / "summary.json").read_text())
    r = evaluate_run(run, data, tmp_path / "out")
    assert [c["step"] for c in r.checkpoints] == STEPS and r.skipped == []
    for c in r.checkpoints:
        assert math.isfinite(c["val_loss"]) and 0 < c["val_loss"] < math.log(256) + 1
        assert c["bpb"] == pytest.approx(c["val_loss"] / math.log(2))
        assert c["windows"] > 0 and c["tokens"] == c["windows"] * 64
    # The last checkpoint holds the final weights: our single-process score reproduces the trainer's own
    # distributed validation, and the loaded weights are bit-identical to what the run trained.
    last = r.checkpoints[-1]
    assert last["val_loss"] == pytest.approx(summary["final_val_loss"], rel=1e-5)
    final = load_checkpoint_model(step_dir(run / "checkpoints", 30), run_spec(read_run_config(run)))
    assert params_sha256(final.state_dict()) == summary["params_sha256"]
    best = min(r.checkpoints, key=lambda c: c["val_loss"])
    assert r.best["step"] == best["step"] and r.best["val_loss"] == best["val_loss"]
    assert r.promoted and r.registered is None and "no registry given" in r.gate["reason"]

    saved = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    assert saved["checkpoints"] == r.checkpoints and saved["best"] == r.best and saved["promoted"] is True
    report = (tmp_path / "out" / "report.html").read_text()
    assert report.count("<svg") == 3                                           # timeline, goodput bar, loss
    assert report.count('r="5" fill="#d1382f"') == len(STEPS)                 # one point per checkpoint
    assert f"step {best['step']}: validation loss {best['val_loss']:.4f}" in report
    for label in ("restarts", "goodput", "Faults and recovery", "final weights (sha256)"):
        assert label in report
    assert summary["params_sha256"][:16] in report


def test_incomplete_and_torn_checkpoints_are_reported_and_skipped(trained, tmp_path):
    run, data = trained
    bad = copy_run(run, tmp_path / "bad")
    ckpts = bad / "checkpoints"
    shard = sorted(step_dir(ckpts, 10).glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])                     # truncated shard
    sorted(step_dir(ckpts, 20).glob("*.distcp"))[0].unlink()         # a shard listed in COMMITTED is gone
    for step in (40, 50):
        shutil.copytree(step_dir(ckpts, 30), step_dir(ckpts, step))
    (step_dir(ckpts, 40) / COMMITTED).unlink()                       # torn: never committed
    marker = step_dir(ckpts, 50) / COMMITTED
    marker.write_bytes(marker.read_bytes()[:20])                     # torn marker
    r = evaluate_run(bad, data, tmp_path / "out")
    assert [c["step"] for c in r.checkpoints] == [30] and r.best["step"] == 30
    reasons = {s["step"]: s["reason"] for s in r.skipped}
    assert set(reasons) == {10, 20, 40, 50}
    assert reasons[10].startswith(f"truncated checkpoint file(s): {shard.name} (1000 of ")
    assert reasons[20].startswith("missing checkpoint file") and ".distcp" in reasons[20]
    assert reasons[40].startswith("not committed")
    assert reasons[50].startswith("torn COMMITTED marker")
    assert json.loads((tmp_path / "out" / "evaluation.json").read_text())["skipped"] == r.skipped

    # Only the newest N.
    r = evaluate_run(run, data, tmp_path / "out2", last_n=2)
    assert [c["step"] for c in r.checkpoints] == [20, 30]

    # Nothing whole: a clear error, exit status 1, and the report still says why.
    (step_dir(ckpts, 30) / ".metadata").unlink()
    with pytest.raises(EvaluationError, match="none of the 4 committed checkpoints"):
        evaluate_run(bad, data, tmp_path / "out3")
    assert len(json.loads((tmp_path / "out3" / "evaluation.json").read_text())["skipped"]) == 5
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(bad), "--data", str(data), "--out", str(tmp_path / "o4")])
    assert res.exit_code == 1 and "could be evaluated" in res.output


def test_a_whole_checkpoint_that_fails_to_load_fails_the_evaluation(trained, tmp_path, monkeypatch):
    """Skipping it would promote an older checkpoint in its place: the step fails, naming it and the error."""
    run, data = trained
    bad = copy_run(run, tmp_path / "bad")
    newest = step_dir(bad / "checkpoints", 30)
    metadata = newest / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:200])                # the commit renames it whole: corrupt
    with pytest.raises(EvaluationError, match=rf"checkpoint {newest} is whole on disk but cannot be loaded: "
                                              r"UnpicklingError"):
        evaluate_run(bad, data, tmp_path / "out")
    assert not (tmp_path / "out" / "evaluation.json").exists()
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(bad), "--data", str(data), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and f"checkpoint {newest} is whole on disk" in res.output

    # A bug in our own loader fails the same way.
    import components.evaluate.evaluate as evaluate

    def buggy(path, spec):
        raise TypeError("load_state_dict() got an unexpected keyword argument 'strict_'")

    monkeypatch.setattr(evaluate, "load_checkpoint_model", buggy)
    with pytest.raises(EvaluationError, match=rf"checkpoint {step_dir(run / 'checkpoints', 10)} is whole on disk but "
                                              r"cannot be loaded: TypeError: load_state_dict"):
        evaluate_run(run, data, tmp_path / "out2")


def _read(registry: str, rel: str, s3) -> bytes | None:
    if registry.startswith("s3://"):
        bucket, _, prefix = registry[5:].partition("/")
        client = s3.client()
        try:
            return client.get_object(Bucket=bucket, Key=f"{prefix}/{rel}")["Body"].read()
        except client.exceptions.NoSuchKey:
            return None
    path = Path(registry) / rel
    return path.read_bytes() if path.exists() else None


@pytest.mark.parametrize("kind", ["directory", "s3"])
def test_promotion_gate_both_ways(trained, tmp_path, kind, request):
    run, data = trained
    s3, registry, url = None, str(tmp_path / "registry"), None
    if kind == "s3":
        s3, base = request.getfixturevalue("s3_registry")
        registry, url = f"{base}-{uuid.uuid4().hex[:6]}", s3.url

    # Above the threshold: not promoted, nothing written.
    r = evaluate_run(run, data, tmp_path / "o1", threshold=0.5, registry=registry, endpoint_url=url)
    assert not r.promoted and "not below the threshold" in r.gate["reason"] and r.registered is None
    assert _read(registry, "bytegpt/production.json", s3) is None

    # Under the threshold, no production model yet: promoted and registered.
    r = evaluate_run(run, data, tmp_path / "o2", registry=registry, endpoint_url=url)
    best = r.best
    assert r.promoted and r.registered["version"] == f"r1-step{best['step']:09d}"
    production = json.loads(_read(registry, "bytegpt/production.json", s3))
    assert production["version"] == r.registered["version"] and production["model_uri"] == r.registered["model_uri"]
    meta = json.loads(_read(registry, f"bytegpt/{production['version']}/metadata.json", s3))
    assert (meta["step"], meta["metrics"]["val_loss"], meta["params_sha256"]) == \
        (best["step"], best["val_loss"], best["params_sha256"])
    assert meta["source_run"] == str(run.resolve()) and meta["model"]["config"]["n_embd"] == 64
    # bytegpt has no Hugging Face adapter: one model.pt (and its model card), and the metadata says so.
    assert meta["format"] == "torch.save(state_dict)" and meta["files"] == ["README.md", "model.pt"]
    card = _read(registry, f"bytegpt/{production['version']}/README.md", s3).decode()
    assert f"checkpoint of step {best['step']}" in card and "load_state_dict" in card
    assert "no Hugging Face adapter" in meta["format_note"] and production["model_uri"].endswith("/model.pt")
    model_file = tmp_path / "model.pt"
    model_file.write_bytes(_read(registry, f"bytegpt/{production['version']}/model.pt", s3))
    model = ByteGPT(ModelConfig(**meta["model"]["config"]))
    model.load_state_dict(torch.load(model_file, weights_only=True))      # one self-contained file
    assert params_sha256(model.state_dict()) == best["params_sha256"]

    # An earlier, worse checkpoint against that production model: refused within a small tolerance...
    early = copy_run(run, tmp_path / "early", keep=[10])
    r = evaluate_run(early, data, tmp_path / "o3", registry=registry, endpoint_url=url, tolerance=0.01)
    prod_loss = r.gate["production"]["val_loss"]
    assert prod_loss == pytest.approx(best["val_loss"], rel=1e-6)        # production re-scored on these windows
    assert not r.promoted and "worse than production" in r.gate["reason"]
    assert json.loads(_read(registry, "bytegpt/production.json", s3)) == production
    # ... and promoted when the tolerance covers the gap.
    gap = r.best["val_loss"] - prod_loss
    assert gap > 0.01
    r = evaluate_run(early, data, tmp_path / "o4", registry=registry, endpoint_url=url, tolerance=gap + 0.01)
    assert r.promoted and r.registered["version"] == "early-step000000010"
    assert json.loads(_read(registry, "bytegpt/production.json", s3))["version"] == "early-step000000010"


def test_cli_writes_evaluation_and_report_into_the_run(trained, tmp_path):
    run, data = trained
    run = copy_run(run, tmp_path / "r1")
    res = CliRunner().invoke(cli, ["evaluate", "--run", str(run), "--data", str(data)])
    assert res.exit_code == 0, res.output
    ev = json.loads((run / "evaluation" / "evaluation.json").read_text())
    assert [c["step"] for c in ev["checkpoints"]] == STEPS and ev["best"]["step"] in STEPS
    assert ev["promoted"] is True and "PROMOTED" in res.output
    assert (run / "evaluation" / "report.html").read_text().startswith("<!doctype html>")


def test_validation_loss_matches_a_direct_computation(trained):
    run, data = trained
    spec = run_spec(read_run_config(run))
    assert spec.name == "bytegpt"                    # a config.json from before plug-ins names no model
    model = load_checkpoint_model(step_dir(run / "checkpoints", 20), spec)
    from trainer.data import Split, eval_windows

    windows = list(eval_windows(Split.open(data, "val"), 64, 5))
    batched, tokens = validation_loss(spec, model, windows, batch_size=2)
    with torch.no_grad():
        one_by_one = [model(torch.from_numpy(x)[None], torch.from_numpy(y)[None])[1].item() for x, y in windows]
    assert tokens == 5 * 64 and batched == pytest.approx(sum(one_by_one) / 5, rel=1e-5)


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")   # the image name has no "python"
def test_evaluate_component_runs_in_kfp_local(trained, tmp_path):
    import kfp.local

    from components.evaluate.evaluate_op import evaluate_op

    run, data = trained
    run = copy_run(run, tmp_path / "kr")
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    task = evaluate_op(run_dir=str(run), data_dir=str(data), registry=str(tmp_path / "registry"))
    assert task.outputs["promoted"] is True and task.outputs["best_step"] in STEPS
    assert task.outputs["model_uri"] == str(tmp_path / "registry" / "bytegpt" /
                                            f"kr-step{task.outputs['best_step']:09d}" / "model.pt")
    assert Path(task.outputs["model_uri"]).is_file()
    metrics = task.outputs["metrics"].metadata
    assert {f"step_{s}_val_loss" for s in STEPS} <= set(metrics) and metrics["promoted"] == 1.0
    assert metrics["best_val_loss"] == pytest.approx(task.outputs["best_val_loss"])
    report = Path(task.outputs["report"].path).read_text()
    assert "<svg" in report and "PROMOTED" in report


def test_bits_per_byte_follow_the_datasets_bytes_per_token(trained, tmp_path):
    # The same tokens, as a subword tokenizer's dataset would describe them (3 bytes of text per token):
    # the loss per token is unchanged, bits per byte are a third, so runs of different tokenizers compare.
    run, data = trained
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["val"]["bytes"] = 3 * manifest["splits"]["val"]["tokens"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    plain = evaluate_run(run, data, tmp_path / "plain", last_n=1)
    wide = evaluate_run(run, copy, tmp_path / "wide", last_n=1)
    assert plain.bytes_per_token == 1.0 and wide.bytes_per_token == 3.0
    (p,), (w,) = plain.checkpoints, wide.checkpoints
    assert w["val_loss"] == p["val_loss"] and p["bpb"] == pytest.approx(p["val_loss"] / math.log(2))
    assert w["bpb"] == pytest.approx(p["bpb"] / 3)
    assert json.loads((tmp_path / "wide" / "evaluation.json").read_text())["bytes_per_token"] == 3.0
