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


def test_sampler_resumed_on_another_world_size_goes_on_from_the_checkpointed_batch(tmp_path):
    """An elastic resume, 2 ranks -> 1: the one rank reads its new slice (the whole split) at the checkpointed
    position, as a 1-rank run would there (so a later resume of it is exact), and replays no old rank's batch."""
    build_dataset(_texts(tmp_path / "raw"), tmp_path / "ds", val_percent=10)
    split = Split.open(tmp_path / "ds", "train")
    make = lambda rank, world: BatchSampler(split, rank=rank, world_size=world, batch_size=4, seq_len=32,  # noqa
                                            seed=3)
    old = [make(r, 2) for r in (0, 1)]
    before = [[s.next_batch()[0] for _ in range(4)] for s in old]
    resumed = make(0, 1)
    resumed.batches_read = old[0].batches_read           # the checkpointed position, the same on both old ranks
    assert (resumed.lo, resumed.hi) == (0, len(split))
    x = resumed.next_batch()[0]
    fresh = make(0, 1)
    assert np.array_equal(x, [fresh.next_batch()[0] for _ in range(5)][4]) and resumed.batches_read == 5
    assert not any(np.array_equal(x, b) for batches in before for b in batches)


def test_eval_windows_are_fixed(tmp_path):
    build_dataset(_texts(tmp_path / "raw"), tmp_path / "ds", val_percent=10)
    split = Split.open(tmp_path / "ds", "val")
    w1, w2 = list(eval_windows(split, 16, 5)), list(eval_windows(split, 16, 5))
    assert len(w1) == 5 and all(np.array_equal(a[0], b[0]) for a, b in zip(w1, w2))


def _token_dataset(out, dtype: str, vocab: int, n: int = 5000, fmt: str = "goodput-dataset/2"):
    """A dataset of random ids below ``vocab`` in ``dtype`` shards, written the way the stage writes them."""
    from trainer.data import ShardFile

    out.mkdir(parents=True)
    rng = np.random.default_rng(0)
    splits = {}
    for split, k in (("train", 2), ("val", 1)):
        shards = []
        for i in range(k):
            w = ShardFile(out, f"{split}_{i:05d}.bin", dtype)
            w.write(rng.integers(0, vocab, size=n, dtype=np.int64).astype(dtype).tobytes())
            shards.append(w.close())
        splits[split] = {"tokens": n * k, "bytes": 3 * n * k, "shards": shards}
    (out / "manifest.json").write_text(json.dumps({"format": fmt, "token_dtype": dtype, "vocab_size": vocab,
                                                   "splits": splits, "bytes_per_token": 3.0}))
    return out


@pytest.mark.parametrize("dtype,vocab", [("uint16", 50_000), ("uint32", 100_000)])
def test_wide_token_shards_read_exactly_and_resume_exactly(tmp_path, dtype, vocab):
    from trainer.data import bytes_per_token

    ds = _token_dataset(tmp_path / "ds", dtype, vocab)
    split = Split.open(ds, "train")
    assert split.tokens.dtype == np.dtype(dtype) and len(split) == 10_000
    raw = np.frombuffer(b"".join((ds / f"train_{i:05d}.bin").read_bytes() for i in range(2)), dtype=dtype)
    whole = split.tokens[:]
    assert whole.dtype == np.dtype(dtype) and np.array_equal(whole, raw)
    assert whole.max() >= 1 << 15                                 # ids above uint8 and int16 survive
    for lo, hi in ((0, 7), (4990, 5010), (5000, 5001), (4999, 10_000), (9990, 20_000), (30, 30)):
        assert np.array_equal(split.tokens[lo:hi], raw[lo:hi]), (lo, hi)   # windows across the shard boundary
    make = lambda: BatchSampler(split, rank=1, world_size=2, batch_size=3, seq_len=16, seed=5)  # noqa: E731
    a = make()
    first = [a.next_batch() for _ in range(4)]
    resumed = make()
    resumed.batches_read = 2
    x, y = resumed.next_batch()
    assert np.array_equal(x, first[2][0]) and x.dtype == np.int64 and x.max() < vocab
    assert bytes_per_token(read_manifest(ds)) == 3.0


def test_vocabulary_check_and_torn_shards_fail_clearly(tmp_path):
    from trainer.data import check_vocab

    ds = _token_dataset(tmp_path / "ds", "uint16", 8000)
    check_vocab(ds, 8000)
    with pytest.raises(ValueError, match="vocabulary of 8000 tokens but the model's vocab_size is 256"):
        check_vocab(ds, 256)
    byte_ds = build_dataset(_texts(tmp_path / "raw"), tmp_path / "bytes", val_percent=10)
    assert byte_ds["token_dtype"] == "uint8" and check_vocab(tmp_path / "bytes", 256)["vocab_size"] == 256
    with open(ds / "train_00001.bin", "ab") as f:                   # a shard longer than its manifest entry
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="train_00001.bin has 10002 bytes, the manifest says 5000 uint16"):
        Split.open(ds, "train")
    # A dataset of the first format (no token_dtype) still reads, as bytes.
    old = build_dataset(_texts(tmp_path / "raw"), tmp_path / "old", val_percent=10)
    old = {k: v for k, v in old.items() if k not in ("token_dtype", "vocab_size")}
    (tmp_path / "old" / "manifest.json").write_text(json.dumps({**old, "format": "goodput-dataset/1"}))
    assert Split.open(tmp_path / "old", "train").tokens.dtype == np.uint8
