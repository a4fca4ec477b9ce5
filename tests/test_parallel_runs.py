"""Whole runs on a device mesh (``goodput train`` and ft_launcher, 4 gloo ranks): a checkpoint written on one
mesh resumes on another and exports the same Hugging Face weights; HSDP x TP on 2 local nodes x 2 recovers a
rank killed on node 1 to the fault-free weights."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from trainer.events import read_events
from trainer.launch import LaunchConfig
from trainer.models import build_local, resolve_model
from trainer.models.hf import export_run, load_hf_weights
from trainer.train import params_sha256

from tests.conftest import GOODPUT, Run

# A llama small enough for 4 ranks on 2 shared cores: heads, MLP, vocabulary and sequence split 2 ways.
LLAMA_CONFIG = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128}
LLAMA = ["--model", "llama", "--model-config", json.dumps(LLAMA_CONFIG), "--seq-len", "32", "--batch-size", "2",
         "--eval-windows", "8", "--log-every", "1"]


def _run(dataset: Path, out: Path, *args: str, nproc: int = 4, failed: bool = False,
         max_restarts: int = 0) -> dict | None:
    run = Run(out, ["--data", str(dataset), "--out", str(out), *LLAMA, *args],
              LaunchConfig(nproc_per_node=nproc, max_restarts=max_restarts))
    try:
        assert (run.wait(timeout=600) != 0) == failed, run.tail()
    finally:
        run.kill()
    return None if failed else run.summary()


def _loaded(out: Path) -> set[tuple[str, int]]:
    """(source, step) of the last restore (every rank's)."""
    events = read_events(out / "events.jsonl")
    start = max(i for i, e in enumerate(events) if e["event"] == "run_start")
    return {(e["source"], e["step"]) for e in events[start:] if e["event"] == "ckpt_loaded"}


def _exported_sha(run_dir: Path, step: int, out: Path) -> str:
    """params_sha256 of the weights ``goodput export`` writes for ``step``, loaded into a whole model."""
    export_run(run_dir, out, step=step, dtype="float32")
    spec = resolve_model("llama", "debug", {**LLAMA_CONFIG, "vocab_size": 256})
    model = build_local(spec)
    load_hf_weights(model, spec, out)
    return params_sha256(model)


@pytest.mark.timeout(1200)   # three runs of 4 ranks
def test_a_checkpoint_moves_between_fsdp_and_tensor_parallel_meshes_and_exports_the_same(
        tmp_path, dataset, process_group):
    """dp=4 to step 4; resumed at dp=2 x tp=2 (DCP reshards the DTensors) to step 6; resumed at dp=4 again. Each
    checkpoint, written on either mesh, exports the weights its run ended with, and the checkpoint written at
    tp=2 loads at dp=4 to bitwise the same weights."""
    out = tmp_path / "run"
    fsdp = _run(dataset, out, "--max-steps", "4", "--ckpt-every", "2")
    assert fsdp["mesh"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1}
    assert _exported_sha(out, 4, tmp_path / "hf4") == fsdp["params_sha256"]

    tp = _run(dataset, out, "--tp", "2", "--max-steps", "6", "--ckpt-every", "2")
    assert _loaded(out) == {("checkpoint", 4)}
    assert tp["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2} and tp["steps"] == 6
    assert _exported_sha(out, 6, tmp_path / "hf6") == tp["params_sha256"]

    back = _run(dataset, out, "--max-steps", "6")
    assert _loaded(out) == {("checkpoint", 6)}
    assert back["mesh"] == fsdp["mesh"] and back["params_sha256"] == tp["params_sha256"]


@pytest.mark.timeout(1500)   # two runs of 2 nodes x 2 ranks, one of them restarted
@pytest.mark.parametrize("mesh", [["--dp-replicate", "2", "--tp", "2"]])
def test_hsdp_x_tp_on_two_nodes_recovers_a_rank_killed_on_node_1(tmp_path, dataset, mesh):
    """2 nodes x 2 ranks as 2 replicas x 2 tensor-parallel ranks: rank 3 (node 1) killed at step 5; both nodes
    restart and the run ends with the fault-free run's weights."""
    def train(name: str, *extra: str) -> dict:
        out = tmp_path / name
        proc = subprocess.run([*GOODPUT, "train", "--nodes", "2", "--nproc", "2", "--data", str(dataset),
                               "--out", str(out), *LLAMA, *mesh, "--max-steps", "6", "--ckpt-every", "2", *extra],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        logs[name] = proc.stdout + proc.stderr
        return json.loads((out / "summary.json").read_text())

    logs = {}
    clean, faulted = train("clean"), train("kill", "--inject-fault", "kill@5:3")
    assert clean["mesh"] == faulted["mesh"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 2}
    assert [f["kind"] for f in faulted["faults"]] == ["kill"] and clean["faults"] == []
    assert faulted["params_sha256"] == clean["params_sha256"]
    starts = [e for e in read_events(tmp_path / "kill" / "events.jsonl") if e["event"] == "worker_start"]
    assert sorted(e["rank"] for e in starts) == [0, 0, 1, 1, 2, 2, 3, 3], logs["kill"][-6000:]
