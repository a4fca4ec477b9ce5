"""A committed checkpoint as the trainer's commit leaves it, for tests that need one without a training run."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from trainer.checkpoint.integrity import marker_fields, planned_digests
from trainer.layout import COMMITTED


def save_committed(path: Path, state: dict, step: int) -> None:
    """``state`` saved with torch DCP at ``path``, then its COMMITTED marker with the items' checksums."""
    planner = DefaultSavePlanner()
    dcp.save(state, checkpoint_id=str(path), no_dist=True, planner=planner)
    (path / COMMITTED).write_text(json.dumps({"step": step, "world_size": 1,
                                              "files": sorted(f.name for f in Path(path).iterdir()),
                                              **marker_fields(planned_digests(planner))}))
