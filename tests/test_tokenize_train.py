"""A 2-rank training run on a BPE-tokenized dataset, and its evaluation in bits per byte.

The model's vocabulary follows the dataset's manifest (``ModelConfig.spec``): bytegpt is built with the
BPE's 512 ids, which a byte-sized embedding could not hold.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from components.evaluate.evaluate import evaluate_run
from components.stage.dataset import stage_dataset
from trainer.data import default_source_files, read_manifest

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8"]


def test_two_ranks_train_on_a_bpe_dataset_and_evaluate_in_bits_per_byte(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for f in default_source_files()[:40]:
        shutil.copyfile(f, src / f.name)
    stage_dataset(str(src), tmp_path / "fsx", "bpe", "1", tokenizer="bpe:512", val_percent=10)
    data = tmp_path / "fsx" / "datasets" / "bpe" / "1"
    manifest = read_manifest(data)
    assert manifest["vocab_size"] == 512 and manifest["token_dtype"] == "uint16"
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", "from pipelines.cli import main; main()", "train", "--nproc", "2", "--restart",
           "injob", "--max-restarts", "0", "--max-steps", "40", "--ckpt-every", "20", "--data", str(data),
           "--out", str(run), "--fsx-root", str(tmp_path / "fsx"), *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    steps = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in steps if e.get("event") == "step" and "loss" in e]
    assert losses[-1] < losses[0] - 0.5                               # it learns
    result = evaluate_run(run, data, tmp_path / "eval")
    best = result.best
    assert result.bytes_per_token == pytest.approx(manifest["splits"]["val"]["bytes"]
                                                   / manifest["splits"]["val"]["tokens"])
    assert best["bpb"] == pytest.approx(best["val_loss"] / math.log(2) / result.bytes_per_token)
    assert best["bpb"] < math.log2(512) / result.bytes_per_token     # better than a uniform guess over the vocab
