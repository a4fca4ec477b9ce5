"""``summary.json``: the run's outcome, derived from ``events.jsonl`` (all attempts) and the final values."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from . import layout
from .durable import write_json
from .events import Event
from .goodput import account
from .mirror import mirror_stats


def summarize(events: list[dict], *, steps: int, tokens: int, final_val_loss: float, params_sha256: str,
              n_params: int, mesh: dict | None = None) -> dict:
    """``mesh``: the run's (last) device mesh, which its throughput and MFU were measured on."""
    starts = [e for e in events if e["event"] == Event.RUN_START]
    step_events = [e for e in events if e["event"] == Event.STEP]
    # Every save the loop waited for, the final (synchronous) one and those after SIGTERM included.
    blocks = sorted(e["block_s"] for e in events if e["event"] == Event.CKPT_SNAPSHOT)
    t_end = max(e["t"] for e in events)
    return {
        "steps": steps,
        "tokens": tokens,
        "n_params": n_params,
        "final_train_loss": step_events[-1]["loss"] if step_events else None,
        "final_val_loss": final_val_loss,
        # Throughput of the steps (every attempt's): medians, so a restart's first slow step does not skew them.
        "tokens_per_s_p50": _median(e.get("tokens_per_s") for e in step_events),
        "mfu_p50": _median(e.get("mfu") for e in step_events),   # None on CPU: no device peak to divide by
        "mesh": mesh,
        "checkpoints_committed": sum(e["event"] == Event.CKPT_COMMITTED for e in events),
        "ckpt_saves": len(blocks),
        # A save's own figure (the lower middle one of an even count), not the mean of two.
        "ckpt_block_s_p50": statistics.median_low(blocks) if blocks else 0.0,
        "ckpt_block_s_max": blocks[-1] if blocks else 0.0,
        "restarts": max(0, len(starts) - 1),
        "wall_s": round(t_end - starts[0]["t"], 3) if starts else 0.0,
        "ended_t": t_end,
        "params_sha256": params_sha256,
        "mirror": mirror_stats(events),
        **account(events),
    }


def _median(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def read_summary(out: Path, since: float) -> dict | None:
    """The run directory's summary if a run that ended after ``since`` (wall clock) wrote it, else None: a summary
    an earlier launch left is not this one's."""
    path = layout.summary_path(out)
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return summary if summary.get("ended_t", 0) >= since else None


def write_summary(path: Path, summary: dict) -> None:
    write_json(path, summary, indent=1)
