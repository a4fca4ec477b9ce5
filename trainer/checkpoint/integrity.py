"""Checksums of the training state as it was staged, and their verification before a restore uses a copy.

Every copy of the state carries the checksums of its bytes as they were staged, taken once the copy into
the staging buffer (a checkpoint) or the replica slot (a memory snapshot) is whole, on a thread of their
own while the loop trains on:

- a checkpoint: one checksum per DCP write item (a tensor shard, or a pickled value), keyed by its fully
  qualified name and offset; each rank writes its own next to its write results, and the commit records all
  of them in ``COMMITTED`` (``checksums``), so they travel with the checkpoint to the S3 mirror and back;
- a memory snapshot: one per tensor, in the replica's marker, which the peer copy carries along.

A restore verifies before it uses anything: a checkpoint's items are read back from its files and hashed
(``verify_files``: every rank a share of the files; ``evaluate`` and ``export`` all of them), a memory or
peer snapshot's tensors where they lie. A copy whose bytes are not the staged bytes raises
``ChecksumMismatch``; the restore records it (a ``checksum_mismatch`` event, counted in the metrics) and
takes the next source. A checkpoint that records no checksums is not verified, so it is not used either.

The hash is xxHash's XXH3 (64 bits; ``xxhash``), the fastest of those at hand: on this machine 20 GB/s on one
core, against 11.7 GB/s for CRC32C (``google_crc32c``) and 4.1 GB/s for ``zlib.crc32``, on 64 MB buffers.
It is not a cryptographic hash: it detects corruption, not forgery (peer messages are authenticated
separately, ``trainer.peer``).
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterable

import torch
import xxhash

from .. import compat
from ..errors import ChecksumMismatch

ALGORITHM = "xxh3_64"

BENCH_NO_CHECKSUMS_ENV = "GOODPUT_BENCH_NO_CHECKSUMS"
"""Internal hook, not a setting: ``bench/checkpoint_stall.py`` sets it to ``1`` in the environment of its
"without checksums" run, to measure what the checksums cost. Saves then record none, so every checkpoint such a
run commits is refused by every restore, evaluate and export ("records no checksums")."""

log = logging.getLogger(__name__)


def digest(data) -> str:
    """The checksum of a bytes-like object."""
    return xxhash.xxh3_64_hexdigest(data)


def tensor_digest(t: torch.Tensor) -> str:
    """The checksum of a tensor's bytes (a DTensor's local shard), in its logical order."""
    t = compat.local_tensor(t).detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return digest(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def item_key(fqn: str, offset: Iterable[int] | None) -> str:
    """How a DCP write item is named in the checksums: its fully qualified name, and its chunk's offset."""
    return fqn if offset is None else f"{fqn}@{','.join(str(o) for o in offset)}"


def planned_digests(planner) -> dict[str, str]:
    """Checksums of every item a save planned (``planner``: the staging's ``StagingPlanner``, or the planner a
    synchronous ``dcp.save`` used), read from what the save writes: the staging copy, or the live state."""
    out = {}
    for item in planner.plan.items:
        data = planner.resolve_data(item)
        out[item_key(item.index.fqn, item.index.offset)] = (
            tensor_digest(data) if isinstance(data, torch.Tensor) else digest(data.getbuffer()))
    return out


def staged_digests(planner) -> dict[str, str]:
    """What a save records of the items it planned: their ``planned_digests``; none under ``BENCH_NO_CHECKSUMS_ENV``."""
    return {} if _bench_no_checksums() else planned_digests(planner)


@functools.cache
def _bench_no_checksums() -> bool:
    off = os.environ.get(BENCH_NO_CHECKSUMS_ENV) == "1"
    if off:
        log.warning("%s=1: checkpoints are saved without checksums, and no restore will load them (a benchmark's "
                    "hook)", BENCH_NO_CHECKSUMS_ENV)
    return off


def marker_fields(checksums: dict[str, str]) -> dict:
    """What ``COMMITTED`` records of a checkpoint's checksums (``planned_digests`` of every rank, merged)."""
    return {"checksum": ALGORITHM, "checksums": checksums}


def verify_planned(planner, digests: dict[str, str]) -> None:
    """The staging copy (as ``planner`` resolves it) still holds the bytes ``digests`` were taken of."""
    _compare(planned_digests(planner), digests, "the staging copy")


def state_tensors(state: Any, out: list | None = None) -> list:
    """The tensors of ``state`` (nested dicts, lists and tuples) in traversal order: the order a memory snapshot
    (``replica``) lays them out in, and its checksums are listed in."""
    out = [] if out is None else out
    if isinstance(state, torch.Tensor):
        out.append(state)
    elif isinstance(state, dict):
        for v in state.values():
            state_tensors(v, out)
    elif isinstance(state, (list, tuple)):
        for v in state:
            state_tensors(v, out)
    return out


def state_digests(state: Any) -> list[str]:
    """Checksums of ``state``'s tensors (local shards), in the order ``replica`` lays them out."""
    return [tensor_digest(t) for t in state_tensors(state)]


def verify_state(state: Any, digests: list[str] | None, what: str) -> None:
    """``state``'s tensors hold the bytes ``digests`` were taken of (a memory or peer snapshot)."""
    if not digests:
        raise ChecksumMismatch(f"{what} records no checksums")
    got = state_digests(state)
    if len(got) != len(digests):
        raise ChecksumMismatch(f"{what}: {len(got)} tensors, {len(digests)} checksums")
    bad = [i for i, (g, w) in enumerate(zip(got, digests)) if g != w]
    if bad:
        raise ChecksumMismatch(f"{what}: {len(bad)} of {len(got)} tensors differ from the bytes staged "
                               f"(tensors {bad[:5]})")


def _compare(got: dict[str, str], want: dict[str, str], what: str) -> None:
    bad = sorted(k for k in got if want.get(k) != got[k])
    if bad:
        raise ChecksumMismatch(f"{what}: {len(bad)} of {len(got)} items differ from the bytes staged "
                               f"({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")


def _read_item(path: Path, info, is_bytes: bool) -> str:
    with open(path / info.relative_path, "rb") as f:
        f.seek(info.offset)
        raw = f.read(info.length)
    if len(raw) != info.length:
        raise ChecksumMismatch(f"{info.relative_path}: {len(raw)} of {info.length} bytes at {info.offset}")
    if is_bytes:
        return digest(raw)
    try:
        return tensor_digest(torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True))
    except Exception as e:   # bytes that do not even parse as a tensor: corrupt as well
        raise ChecksumMismatch(f"{info.relative_path}: an item at {info.offset} does not load "
                               f"({type(e).__name__}: {e})") from e


def verify_files(path: Path, share: tuple[int, int] = (0, 1)) -> None:
    """The committed checkpoint at ``path`` holds the bytes that were staged: every item in its share of the
    shard files (``share``: (index, count), the files whose sorted position modulo count is index; (0, 1): all)
    is read back and hashed against ``COMMITTED``'s checksums. Raises ``ChecksumMismatch``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    path = Path(path)
    try:
        marker = json.loads((path / "COMMITTED").read_text())
    except (OSError, ValueError) as e:
        raise ChecksumMismatch(f"{path}: unreadable COMMITTED marker ({e})") from e
    want = marker.get("checksums")
    if not want or marker.get("checksum") != ALGORITHM:
        raise ChecksumMismatch(f"{path} records no {ALGORITHM} checksums (written before they were recorded, or "
                               f"with {BENCH_NO_CHECKSUMS_ENV}=1): not loaded")
    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as e:
        raise ChecksumMismatch(f"{path}: unreadable .metadata ({type(e).__name__}: {e})") from e
    files = sorted({info.relative_path for info in meta.storage_data.values()})
    mine = {f for i, f in enumerate(files) if i % share[1] == share[0]}
    got = {}
    for index, info in meta.storage_data.items():
        if info.relative_path in mine:
            is_bytes = isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
            got[item_key(index.fqn, index.offset)] = _read_item(path, info, is_bytes)
    missing = sorted(set(got) - set(want))
    if missing:
        raise ChecksumMismatch(f"{path}: no checksum for {', '.join(missing[:4])}")
    _compare(got, want, str(path))
