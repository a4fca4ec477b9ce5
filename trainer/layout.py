"""The run directory's checkpoint layout, readable without torch (the launcher and evaluate use it).

``<out>/checkpoints/step_<N, 9 digits>/`` is a checkpoint once its ``COMMITTED`` marker exists.
"""

from __future__ import annotations

import json
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
