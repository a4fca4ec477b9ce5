"""The dataset builder and the per-rank reader."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data import BatchSampler, Split, build_dataset, eval_windows, read_manifest, split_of


def _texts(root, n=40, size=3000):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i:03d}.txt").write_bytes(bytes((i * 7 + j) % 96 + 32 for j in range(size)))
    return root


def test_build_writes_shards_and_a_manifest_that_describes_them(tmp_path):
    raw = _texts(tmp_path / "raw")
    (raw / "blob.bin").write_bytes(b"\x00\x01binary")           # binary files are skipped
    m = build_dataset(raw, tmp_path / "ds", val_percent=10, shard_bytes=20_000)
    assert m == read_manifest(tmp_path / "ds")
    assert {f["path"] for f in m["files"]} == {f"f{i:03d}.txt" for i in range(40)}
    total = sum(f["bytes"] for f in m["files"])
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == total
    assert len(m["splits"]["train"]["shards"]) > 1                 # shard_bytes respected
    for split in ("train", "val"):
        joined = b"".join((tmp_path / "ds" / s["path"]).read_bytes() for s in m["splits"][split]["shards"])
        expected = b"".join((raw / f["path"]).read_bytes() for f in m["files"] if f["split"] == split)
        assert joined == expected
        assert len(Split.open(tmp_path / "ds", split)) == len(expected)


def test_split_is_stable_when_files_are_added(tmp_path):
    raw = _texts(tmp_path / "raw", n=30)
    before = {f["path"]: f["split"] for f in build_dataset(raw, tmp_path / "a", val_percent=20)["files"]}
    _texts(tmp_path / "raw", n=60)
    after = {f["path"]: f["split"] for f in build_dataset(raw, tmp_path / "b", val_percent=20)["files"]}
    assert all(after[p] == s for p, s in before.items())
    assert split_of("x/y.py", 0) == "train"


def test_bad_inputs_fail_clearly(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        build_dataset(tmp_path / "empty", tmp_path / "out")
    with pytest.raises(ValueError, match="val_percent"):
        build_dataset(tmp_path / "empty", tmp_path / "out", val_percent=90)
    with pytest.raises(FileNotFoundError, match="not a dataset directory"):
        read_manifest(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({"format": "other/9"}))
    with pytest.raises(ValueError, match="unsupported dataset format"):
        read_manifest(tmp_path / "bad")


def test_sampler_is_deterministic_resumable_and_disjoint_across_ranks(tmp_path):
    build_dataset(_texts(tmp_path / "raw"), tmp_path / "ds", val_percent=10)
    split = Split.open(tmp_path / "ds", "train")
    make = lambda rank: BatchSampler(split, rank=rank, world_size=2, batch_size=4, seq_len=32, seed=3)  # noqa: E731
    a, b = make(0), make(0)
    first = [a.next_batch() for _ in range(5)]
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(first, [b.next_batch() for _ in range(5)]))
    resumed = make(0)
    resumed.batches_read = 3                                   # the checkpointed data position
    assert np.array_equal(resumed.next_batch()[0], first[3][0])
    r0, r1 = make(0), make(1)
    assert r0.hi <= r1.lo                                      # disjoint slices
    x, y = r0.next_batch()
    assert x.shape == (4, 32) and np.array_equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="fewer than one sequence"):
        BatchSampler(split, rank=0, world_size=2, batch_size=1, seq_len=len(split), seed=0)


def test_eval_windows_are_fixed(tmp_path):
    build_dataset(_texts(tmp_path / "raw"), tmp_path / "ds", val_percent=10)
    split = Split.open(tmp_path / "ds", "val")
    w1, w2 = list(eval_windows(split, 16, 5)), list(eval_windows(split, 16, 5))
    assert len(w1) == 5 and all(np.array_equal(a[0], b[0]) for a, b in zip(w1, w2))
