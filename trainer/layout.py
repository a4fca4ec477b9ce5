"""The run directory's checkpoint layout, readable without torch (the launcher and evaluate use it),
and the durable file writes that every writer of the run directory and of datasets uses.

``<out>/checkpoints/step_<N, 9 digits>/`` is a checkpoint once its ``COMMITTED`` marker exists.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

COMMITTED = "COMMITTED"
_STEP_PREFIX = "step_"


def step_dir(root: Path, step: int) -> Path:
    # Zero-padded so that lexical order is step order (NVRx convention).
    return root / f"{_STEP_PREFIX}{step:09d}"


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(_STEP_PREFIX) or not name[len(_STEP_PREFIX):].isdigit():
        return None
    return int(name[len(_STEP_PREFIX):])


def committed_steps(root: Path) -> list[int]:
    """Steps of the committed checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    steps = [step_of(p) for p in root.iterdir() if (p / COMMITTED).is_file()]
    return sorted(s for s in steps if s is not None)


def read_marker(path: Path) -> dict:
    return json.loads((path / COMMITTED).read_text())


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves the old file or the whole new one: a temporary
    name, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replica_dir(root: Path, out: Path) -> Path:
    """A run's memory-snapshot directory under ``root`` (``trainer/checkpoint/replica.py``), named after its
    checkpoint directory ``out`` (several runs share a node)."""
    return root / f"goodput-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}"


# A rank's memory snapshot in its replica directory (``trainer/checkpoint/replica.py`` writes them,
# ``trainer/peer.py`` ships them without torch): two slots, the marker naming the complete one, and the
# marker of the one before it.

def replica_marker(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank}.marker"


def replica_previous(directory: Path, rank: int) -> Path:
    """The marker of the snapshot before the marked one, while its slot is untouched."""
    return directory / f"rank{rank}.previous"


def replica_slot(directory: Path, rank: int, slot: int) -> Path:
    return directory / f"rank{rank}.slot{slot}"


def replica_ranks(directory: Path) -> list[int]:
    """The ranks with a marker in ``directory``."""
    return sorted(int(p.name[4:-7]) for p in directory.glob("rank*.marker"))


def peer_file(directory: Path) -> Path:
    """Where a node's ranks tell its janitor's peer sender (``trainer/peer.py``) which node it is and where
    that node's holder listens: learnt at each restore, after the rendezvous."""
    return directory / "peer.json"
