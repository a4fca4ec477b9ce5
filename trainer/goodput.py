"""Goodput: the optimal checkpoint interval, what a run's time went to, and what a cluster would get.

- ``young_daly_interval_s``: the checkpoint interval that loses the least to checkpoints and failures
  (``trainer.checkpoint.policy`` applies it).
- ``account``: from ``events.jsonl``, the faults, restarts by layer, redone steps and where the wall
  time went; ``goodput`` = time of the steps that were kept / wall time.
- ``project``: goodput for G GPUs at a per-GPU failure rate, ours (node losses recovered from a peer's
  memory copy, or from the checkpoint) vs. job-level restart vs. restart from scratch
  (``python -m trainer.goodput --gpus 16384`` prints the table).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from .events import Event

DEFAULT_MTBF_S = 24 * 3600.0
# Meta, "The Llama 3 Herd of Models" (2024): 419 unexpected interruptions in 54 days on 16,384 H100s.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# The same report: about 78% of them were confirmed or suspected hardware issues (GPUs, their memory, host
# components), after which the host is taken out of the job: a node loss.
LLAMA3_NODE_LOSS_SHARE = 0.78


def young_daly_interval_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: checkpoint every sqrt(2 * cost * MTBF) seconds."""
    return math.sqrt(2.0 * ckpt_cost_s * mtbf_s)


@dataclass
class FaultRecord:
    kind: str
    rank: int
    step: int
    detected_s: float | None
    recovered_s: float | None
    layer: str | None


def account(events: list[dict]) -> dict:
    """Faults, restarts, redone work and the wall-time breakdown of a run, from its event log."""
    starts = [e for e in events if e["event"] == Event.RUN_START]
    if not starts:
        return {}
    t0, t_end = starts[0]["t"], max(e["t"] for e in events)
    steps = [e for e in events if e["event"] == Event.STEP]
    restarts = [e for e in events if e["event"] == Event.RESTART]
    injected = [e for e in events if e["event"] == Event.FAULT_INJECTED]

    faults = []
    for f in injected:
        restart = next((r for r in restarts if r["t"] >= f["t"]), None)
        # A SIGTERM ends the job cleanly; the next start is its recovery, whichever layer starts it.
        first_step = next((s for s in steps if restart is not None and s["t"] > restart["t"]), None)
        faults.append(FaultRecord(
            kind=f["kind"], rank=f["rank"], step=f["step"],
            detected_s=round(restart["t"] - f["t"], 3) if restart else None,
            recovered_s=round(first_step["t"] - f["t"], 3) if first_step else None,
            layer=restart["layer"] if restart else None).__dict__)

    # The last time each step number completed is the one that was kept; earlier ones were redone.
    kept: dict[int, dict] = {}
    for s in steps:
        kept[s["step"]] = s
    redone = [s for s in steps if kept[s["step"]] is not s]
    productive_s = sum(s["step_s"] for s in kept.values())
    redone_s = sum(s["step_s"] for s in redone)
    block_s = sum(e["block_s"] for e in events if e["event"] in (Event.CKPT_SNAPSHOT, Event.MEMORY_SNAPSHOT))
    startup_s = (steps[0]["t"] - steps[0]["step_s"] - t0) if steps else 0.0
    # Restart cost: from each fault (or restart, for uninjected ones) to the next completed step.
    restart_s = 0.0
    for r in restarts:
        fault_t = max((f["t"] for f in injected if f["t"] <= r["t"]), default=r["t"])
        nxt = next((s for s in steps if s["t"] > r["t"]), None)
        if nxt is not None:
            restart_s += (nxt["t"] - nxt["step_s"]) - fault_t
    wall = t_end - t0
    layers = [r["layer"] for r in restarts]
    return {
        "faults": faults,
        "restarts_inprocess": layers.count("inprocess"),
        "restarts_injob": layers.count("injob"),
        "restarts_job": layers.count("job"),
        "lost_steps": len(redone),
        "ckpt_block_s_total": round(block_s, 4),
        "goodput": round(productive_s / wall, 4) if wall > 0 else 0.0,
        "goodput_breakdown": {
            "productive_s": round(productive_s, 3),
            "restart_s": round(restart_s, 3),
            "redone_s": round(redone_s, 3),
            "ckpt_block_s": round(block_s, 3),
            "startup_s": round(startup_s, 3),
            "other_s": round(wall - productive_s - restart_s - redone_s - block_s - startup_s, 3),
            "wall_s": round(wall, 3),
        },
    }


def _goodput(ckpt_block_s: float, failures: list[tuple[float, float, float | None]]) -> tuple[float, float | None]:
    """(goodput, checkpoint interval) with Young-Daly checkpoints, for failures given as (rate per second,
    recovery s, redone work s): each costs its recovery and the work redone; ``None`` is redone from the last
    checkpoint, on average half an interval, the interval being Young-Daly's for the failures of that kind
    (the others do not need it: no interval, and no checkpoint cost, where none does). Each interval costs
    one checkpoint's blocking time."""
    failures = [f for f in failures if f[0] > 0]
    ckpt_rate = sum(rate for rate, _, redone in failures if redone is None)
    tau = young_daly_interval_s(ckpt_block_s, 1.0 / ckpt_rate) if ckpt_rate > 0 else None
    lost = sum(rate * (recovery + (tau / 2 if redone is None else redone)) for rate, recovery, redone in failures)
    return max(0.0, (1 - lost) / (1 + (ckpt_block_s / tau if tau else 0.0))), tau


def project(gpus: int, failures_per_gpu_hour: float, *, ckpt_block_s: float, recovery_s: float,
            job_ckpt_block_s: float, job_recovery_s: float, job_hours: float, node_loss_share: float = 0.0,
            snapshot_every_s: float | None = None, node_recovery_s: float | None = None) -> dict:
    """Expected goodput at ``gpus`` GPUs for three strategies.

    Args:
        gpus: GPUs in the job; the job fails at ``gpus * failures_per_gpu_hour`` per hour.
        ckpt_block_s, recovery_s: ours (async checkpoint blocking; fault to first step after recovery).
        job_ckpt_block_s, job_recovery_s: a job-level-restart baseline (synchronous checkpoints; new pods,
            image pull, init and load after every failure).
        job_hours: work in the job, for the restart-from-scratch baseline.
        node_loss_share: the share of failures that lose a node (its memory snapshots with it); ours recovers
            them in ``node_recovery_s`` (default ``recovery_s``: a replacement node) and redoes, with peer copies
            (``snapshot_every_s``: the memory-snapshot interval), half that interval on average (at most all of
            it); without (``None``), half a checkpoint interval, as every other failure here.

    The other failures are charged the checkpoint's half interval too: an upper bound (a rank's crash or hang
    is recovered from its node's own memory). With peer copies ``ours_without_peer`` is the same job without them.
    """
    if not 0.0 <= node_loss_share <= 1.0:
        raise ValueError(f"node_loss_share must be between 0 and 1, got {node_loss_share}")
    if snapshot_every_s is not None and snapshot_every_s <= 0:
        raise ValueError(f"snapshot_every_s must be positive (None: no peer copies), got {snapshot_every_s}")
    rate = gpus * failures_per_gpu_hour / 3600.0
    mtbf_s = 1.0 / rate
    node_recovery_s = recovery_s if node_recovery_s is None else node_recovery_s

    def ours(peer: bool) -> dict:
        node_redone = snapshot_every_s / 2 if peer else None
        g, tau = _goodput(ckpt_block_s, [(rate * (1 - node_loss_share), recovery_s, None),
                                         (rate * node_loss_share, node_recovery_s, node_redone)])
        return {"goodput": round(g, 5), "interval_s": round(tau, 1) if tau else None,
                "node_losses_from": "peer" if peer else "checkpoint"}

    job, job_tau = _goodput(job_ckpt_block_s, [(rate, job_recovery_s, None)])
    # No checkpoints: every failure restarts the whole job; expected time to finish W of work with
    # failure rate l and restart cost R is (exp(l*W) - 1) * (1/l + R).
    lam, work = rate, job_hours * 3600.0
    scratch = work / ((math.expm1(min(lam * work, 700.0))) * (1 / lam + job_recovery_s))
    peer = snapshot_every_s is not None
    return {"gpus": gpus, "mtbf_s": round(mtbf_s, 1), "node_loss_share": node_loss_share,
            "ours": ours(peer), **({"ours_without_peer": ours(False)} if peer else {}),
            "job_restart": {"goodput": round(job, 5), "interval_s": round(job_tau, 1)},
            "restart_from_scratch": {"goodput": round(min(1.0, scratch), 5)}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Project goodput at cluster scale from measured costs.")
    p.add_argument("--gpus", type=int, default=16384)
    p.add_argument("--failures-per-gpu-hour", type=float, default=LLAMA3_FAILURES_PER_GPU_HOUR,
                   help="default: Llama 3's 419 interruptions in 54 days on 16,384 GPUs")
    p.add_argument("--summary", type=Path, help="a run's summary.json to take our blocking/recovery costs from")
    p.add_argument("--ckpt-block-s", type=float, default=0.05)
    p.add_argument("--recovery-s", type=float, default=10.0)
    p.add_argument("--job-ckpt-block-s", type=float, default=60.0)
    p.add_argument("--job-recovery-s", type=float, default=600.0)
    p.add_argument("--job-hours", type=float, default=24.0)
    p.add_argument("--node-loss-share", type=float, default=LLAMA3_NODE_LOSS_SHARE,
                   help="share of failures that lose a node (default: Llama 3's 78%% hardware interruptions)")
    p.add_argument("--memory-snapshot-every-s", type=float, default=1.0,
                   help="memory-snapshot interval: a node loss redoes half of it on average with peer copies "
                        "(the trainer's default); 0: no peer copies, node losses go back to the checkpoint")
    p.add_argument("--node-recovery-s", type=float, default=None,
                   help="node loss to first step: a replacement node joining (bench/node_loss.py measures it); "
                        "default: --recovery-s")
    a = p.parse_args(argv)
    if not 0.0 <= a.node_loss_share <= 1.0 or a.memory_snapshot_every_s < 0:
        p.error("--node-loss-share must be between 0 and 1 and --memory-snapshot-every-s not negative")
    block, recovery = a.ckpt_block_s, a.recovery_s
    if a.summary:
        s = json.loads(a.summary.read_text())
        block = s["ckpt_block_s_p50"]
        rec = [f["recovered_s"] for f in s.get("faults", []) if f.get("recovered_s") is not None]
        recovery = statistics.median(rec) if rec else recovery
    print(json.dumps(project(a.gpus, a.failures_per_gpu_hour, ckpt_block_s=block, recovery_s=recovery,
                             job_ckpt_block_s=a.job_ckpt_block_s, job_recovery_s=a.job_recovery_s,
                             job_hours=a.job_hours, node_loss_share=a.node_loss_share,
                             snapshot_every_s=a.memory_snapshot_every_s or None, node_recovery_s=a.node_recovery_s),
                     indent=1))


if __name__ == "__main__":
    main()
