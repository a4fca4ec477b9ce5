"""The project's identities computed from content: a set of weights (``params_sha256``, which the trainer
writes to ``summary.json`` and evaluate and register compare) and the names derived from a path.

Torch-free at import time (the components import it); ``params_sha256`` imports torch when called.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

__all__ = ["params_sha256", "path_digest"]


def params_sha256(state_dict: dict) -> str:
    """SHA-256 over full (unsharded) tensors in name order: each tensor's name, dtype, shape and bytes."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def path_digest(path: Path) -> str:
    """16 hex digits naming the resolved ``path``: a short, stable name for what belongs to that directory
    (a run's memory snapshots, a node's wake-up socket) wherever the path is long or shared."""
    return hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
