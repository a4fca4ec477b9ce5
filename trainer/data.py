"""Token datasets: build byte-level ones from text files, read any of them during training.

A dataset directory holds ``manifest.json`` and token shards of ``token_dtype`` (uint8 for the byte-level
vocabulary of 256, uint16 or uint32 for a subword tokenizer's; ``components.stage.dataset`` builds those):

    manifest.json          format, source, token_dtype, vocab_size, eos_id, tokenizer, bytes_per_token,
                           files (path, bytes, sha256, split), splits (shards, tokens, bytes)
    train_00000.bin ...    the training files' tokens, in path order
    val_00000.bin ...      the validation files' tokens

The manifest is written last, through a rename, so a directory with a manifest is always complete.
Files are split between train and validation by a hash of their path, so adding files never moves an
existing file to the other split. ``docs/datasets.md`` lists every manifest field.

Build the default dataset (the Python standard library's top-level sources, present on every machine):

    python -m trainer.data --out fsx/datasets/pystdlib/3.11
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from .durable import publish_file, temp_name, write_bytes
from .layout import MANIFEST, dataset_dir

FORMAT = "goodput-dataset/2"
# /1 had no token_dtype other than uint8 and no tokenizer fields; it reads as a byte-level dataset.
READABLE_FORMATS = ("goodput-dataset/1", FORMAT)
TOKEN_DTYPES = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
BYTE_VOCAB = 256
SHARD_BYTES = 64 * 1024 * 1024
DEFAULT_DATASET_NAME = "pystdlib"


def default_dataset_version() -> str:
    """The default dataset's version: the Python version whose standard library it is built from."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def default_source_dir() -> Path:
    """Text present on every machine with no download: this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def default_source_files() -> list[Path]:
    """The standard library's top-level modules (about 5 MB), not its tests or packages."""
    return sorted(default_source_dir().glob("*.py"))


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def split_of(rel_path: str, val_percent: int) -> str:
    """Deterministic split by path: stable when files are added or removed."""
    bucket = int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") % 100
    return "val" if bucket < val_percent else "train"


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of a vocabulary (uint8 only for the byte vocabulary)."""
    if vocab_size <= BYTE_VOCAB:
        return "uint8"
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(8192)
    return b"\x00" not in head


def build_dataset(
    raw_dir: Path,
    out_dir: Path,
    *,
    files: Iterable[Path] | None = None,
    source: str = "",
    val_percent: int = 5,
    shard_bytes: int = SHARD_BYTES,
    extra: dict | None = None,
) -> dict:
    """Turn text files into token shards and a manifest.

    Args:
        raw_dir: directory the files' manifest paths are relative to.
        out_dir: dataset directory; shards and ``manifest.json`` are written here.
        files: files to include (default: every file under ``raw_dir``); binary files are skipped.
        source: where the files came from (an S3 URI, a directory), recorded in the manifest.
        val_percent: share of files, by path hash, that go to the validation split (0-50).
        shard_bytes: maximum size of one shard file in bytes.
        extra: additional top-level manifest entries (the stage component records object ETags here).

    Returns:
        The manifest that was written.
    """
    if not 0 <= val_percent <= 50:
        raise ValueError(f"val_percent must be between 0 and 50, got {val_percent}")
    raw_dir, out_dir = Path(raw_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = sorted(Path(p) for p in files) if files is not None else sorted(
        p for p in raw_dir.rglob("*") if p.is_file())
    paths = [p for p in paths if _is_text(p)]
    if not paths:
        raise ValueError(f"no text files to build a dataset from under {raw_dir}")

    entries = []
    writers: dict[str, _ShardWriter] = {s: _ShardWriter(out_dir, s, shard_bytes) for s in ("train", "val")}
    for path in paths:
        rel = path.relative_to(raw_dir).as_posix()
        data = path.read_bytes()
        split = split_of(rel, val_percent)
        writers[split].write(data)
        entries.append({"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                        "split": split})
    # A dataset must have both splits; with few files the hash can put all of them on one side.
    if val_percent and writers["val"].tokens == 0:
        last = entries[-1]
        raise ValueError(f"the validation split is empty ({len(entries)} files); add files or raise "
                         f"val_percent (file {last['path']!r} went to train)")
    splits = {s: w.close() for s, w in writers.items()}
    for split in splits.values():
        split["bytes"] = split["tokens"]
    manifest = {
        "format": FORMAT,
        "source": source or str(raw_dir),
        "token_dtype": "uint8",
        "vocab_size": BYTE_VOCAB,
        "eos_id": None,
        "tokenizer": {"kind": "bytes"},
        "bytes_per_token": 1.0,
        "files": entries,
        "splits": splits,
        **(extra or {}),
    }
    write_bytes(out_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


class _ShardWriter:
    def __init__(self, out_dir: Path, split: str, shard_bytes: int):
        self.out_dir, self.split, self.shard_bytes = out_dir, split, shard_bytes
        self.shards: list[dict] = []
        self.buf = bytearray()
        self.tokens = 0

    def write(self, data: bytes) -> None:
        self.buf += data
        self.tokens += len(data)
        while len(self.buf) >= self.shard_bytes:
            self._flush(bytes(self.buf[: self.shard_bytes]))
            del self.buf[: self.shard_bytes]

    def _flush(self, data: bytes) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        write_bytes(self.out_dir / name, data)
        self.shards.append({"path": name, "tokens": len(data), "sha256": hashlib.sha256(data).hexdigest()})

    def close(self) -> dict:
        if self.buf:
            self._flush(bytes(self.buf))
        return {"tokens": self.tokens, "shards": self.shards}


class ShardFile:
    """One token shard written as it streams in: a temporary name, fsync, then the rename (a crash never
    leaves a shard that looks whole). ``close`` returns its manifest entry (path, tokens, sha256)."""

    def __init__(self, out_dir: Path, name: str, dtype: str):
        self.path, self.dtype = Path(out_dir) / name, np.dtype(TOKEN_DTYPES[dtype])
        self.tmp = temp_name(self.path)
        self.f = open(self.tmp, "wb")
        self.sha = hashlib.sha256()
        self.tokens = 0

    def write(self, data: bytes) -> None:
        """Append tokens already in this shard's dtype (bytes of a native-endian array)."""
        if len(data) % self.dtype.itemsize:
            raise ValueError(f"{len(data)} bytes is not a whole number of {self.dtype.name} tokens")
        self.f.write(data)
        self.sha.update(data)
        self.tokens += len(data) // self.dtype.itemsize

    def close(self) -> dict:
        self.f.close()
        publish_file(self.tmp, self.path)
        return {"path": self.path.name, "tokens": self.tokens, "sha256": self.sha.hexdigest()}

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def read_manifest(data_dir: Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {data_dir} is not a dataset directory "
                                f"(build one with `python -m trainer.data` or `goodput stage`)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") not in READABLE_FORMATS:
        raise ValueError(f"{path}: unsupported dataset format {manifest.get('format')!r}, expected one of "
                         f"{', '.join(READABLE_FORMATS)}")
    dtype = manifest.setdefault("token_dtype", "uint8")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"{path}: unsupported token_dtype {dtype!r}, expected one of {', '.join(TOKEN_DTYPES)}")
    manifest.setdefault("vocab_size", BYTE_VOCAB)
    return manifest


def check_vocab(data_dir: Path, model_vocab_size: int) -> dict:
    """Refuse a model whose vocabulary cannot represent every token id of the dataset; return the manifest.

    Call it before any rank starts: an id past the embedding table is an index error deep in the first
    forward pass on every rank (or, on a GPU, a device-side assert).
    """
    manifest = read_manifest(data_dir)
    need = int(manifest["vocab_size"])
    if model_vocab_size < need:
        tok = manifest.get("tokenizer") or {"kind": "bytes"}
        raise ValueError(f"{Path(data_dir) / MANIFEST}: the dataset's tokenizer ({tok.get('spec') or tok['kind']}) "
                         f"has a vocabulary of {need} tokens but the model's vocab_size is {model_vocab_size}; "
                         f"build the model with vocab_size >= {need}, or stage the data with a tokenizer whose "
                         f"vocabulary fits the model")
    return manifest


def bytes_per_token(manifest: dict, split: str = "val") -> float:
    """Text bytes one token stands for in ``split`` (1.0 for the byte vocabulary): bits per byte =
    loss in nats per token / ln 2 / bytes_per_token."""
    s = manifest["splits"].get(split) or {}
    if s.get("tokens") and s.get("bytes"):
        return s["bytes"] / s["tokens"]
    return float(manifest.get("bytes_per_token") or 1.0)


def default_dataset_dir(fsx_root: Path) -> Path:
    return dataset_dir(fsx_root, DEFAULT_DATASET_NAME, default_dataset_version())


def ensure_default_dataset(fsx_root: Path) -> Path:
    """Build the default dataset under ``fsx_root`` once; return its directory."""
    out = default_dataset_dir(fsx_root)
    if not (out / MANIFEST).is_file():
        build_dataset(default_source_dir(), out, files=default_source_files(), source="python-stdlib")
    return out


class JoinedShards:
    """Memory-mapped shards read as one sequence of tokens, by slices (a window may span two shards).

    Nothing is copied but the slices asked for: the pages stay the file system's cache, shared by every rank
    on a node, however large the split (``np.concatenate`` would read all of it into each rank's memory).
    """

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays, self.dtype = arrays, arrays[0].dtype
        self.starts = np.cumsum([0] + [len(a) for a in arrays])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError(f"shards are read by slices (a window), not by {type(key).__name__}")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("shards are read by contiguous slices")
        parts = []
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            lo = start - int(self.starts[i])
            hi = min(len(self.arrays[i]), stop - int(self.starts[i]))
            parts.append(self.arrays[i][lo:hi])
            start += hi - lo
            i += 1
        if not parts:
            return np.empty(0, self.dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


@dataclass
class Split:
    """One split as a single read-only token sequence over its memory-mapped shards (sliced, never copied whole)."""

    tokens: np.ndarray | JoinedShards

    @classmethod
    def open(cls, data_dir: Path, split: str) -> "Split":
        manifest = read_manifest(data_dir)
        shards = manifest["splits"][split]["shards"]
        if not shards:
            raise ValueError(f"{data_dir}: split {split!r} has no tokens")
        dtype = np.dtype(TOKEN_DTYPES[manifest["token_dtype"]])
        for s in shards:
            size = (Path(data_dir) / s["path"]).stat().st_size
            if size != s["tokens"] * dtype.itemsize:
                raise ValueError(f"{data_dir}: shard {s['path']} has {size} bytes, the manifest says {s['tokens']} "
                                 f"{dtype.name} tokens ({s['tokens'] * dtype.itemsize} bytes); stage it again")
        arrays = [np.memmap(Path(data_dir) / s["path"], dtype=dtype, mode="r") for s in shards]
        return cls(arrays[0] if len(arrays) == 1 else JoinedShards(arrays))

    def __len__(self) -> int:
        return len(self.tokens)


class BatchSampler:
    """Deterministic random windows from this rank's disjoint slice of a split.

    Rank r owns tokens ``[r*n/W, (r+1)*n/W)``. Batch number k draws its window offsets from a
    generator seeded by (seed, rank, k), so the only state to checkpoint is k (``batches_read``).

    A resume on another world size (an elastic job re-formed with fewer or more nodes) keeps k: it counts
    one rank's batches, the same on every rank (steps x grad_accum), so the run goes on at the batch after
    the checkpoint's. Each rank's slice is recomputed from the new world size, so batch k is no old rank's
    batch k: windows are random draws, so none is replayed and no position is skipped, but the batches are
    not those of a run that kept its size, and the global batch is the new world size's.
    """

    def __init__(self, split: Split, *, rank: int, world_size: int, batch_size: int, seq_len: int,
                 seed: int):
        n = len(split)
        self.lo, self.hi = rank * n // world_size, (rank + 1) * n // world_size
        if self.hi - self.lo < seq_len + 2:
            raise ValueError(f"each rank's slice of the data holds {self.hi - self.lo} tokens, fewer than "
                             f"one sequence of {seq_len + 1}; use more data, fewer ranks or a shorter context")
        self.split, self.rank, self.batch_size, self.seq_len, self.seed = split, rank, batch_size, seq_len, seed
        self.batches_read = 0

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.rank, self.batches_read])
        self.batches_read += 1
        starts = rng.integers(self.lo, self.hi - self.seq_len - 1, size=self.batch_size)
        window = np.stack([self.split.tokens[s: s + self.seq_len + 1] for s in starts]).astype(np.int64)
        return window[:, :-1], window[:, 1:]


def eval_windows(split: Split, seq_len: int, max_windows: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
    """Consecutive non-overlapping windows from the start of a split: the same on every call."""
    count = min(max_windows, (len(split) - 1) // seq_len)
    for i in range(count):
        w = np.asarray(split.tokens[i * seq_len: i * seq_len + seq_len + 1], dtype=np.int64)
        yield w[:-1], w[1:]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build a byte-level token dataset from a directory of text files.")
    p.add_argument("--src", type=Path, default=None,
                   help="directory of text files (default: the Python standard library's top-level modules)")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    p.add_argument("--val-percent", type=int, default=5, help="share of files for validation (default 5)")
    args = p.parse_args(argv)
    if args.src is None:
        m = build_dataset(default_source_dir(), args.out, files=default_source_files(), source="python-stdlib",
                          val_percent=args.val_percent)
    else:
        m = build_dataset(args.src, args.out, val_percent=args.val_percent)
    print(f"{args.out}: {len(m['files'])} files, train {m['splits']['train']['tokens']:,} tokens, "
          f"val {m['splits']['val']['tokens']:,} tokens")


if __name__ == "__main__":
    main()
