"""Goodput: when to checkpoint, what a run's time went to, and what a cluster would get.

- ``IntervalPolicy``: the checkpoint interval (steps, seconds, or ``auto`` = Young-Daly).
- ``account``: from ``events.jsonl``, the faults, restarts by layer, redone steps and where the wall
  time went; ``goodput`` = time of the steps that were kept / wall time.
- ``project``: goodput for G GPUs at a per-GPU failure rate, ours (node losses recovered from a peer's
  memory copy, or from the checkpoint) vs. job-level restart vs. restart from scratch
  (``python -m trainer.goodput --gpus 16384`` prints the table).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from .config import CheckpointConfig
from .events import Event, EventLog, read_events

DEFAULT_MTBF_S = 24 * 3600.0
# Meta, "The Llama 3 Herd of Models" (2024): 419 unexpected interruptions in 54 days on 16,384 H100s.
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# The same report: about 78% of them were confirmed or suspected hardware issues (GPUs, their memory, host
# components), after which the host is taken out of the job: a node loss.
LLAMA3_NODE_LOSS_SHARE = 0.78


def young_daly_interval_s(ckpt_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: checkpoint every sqrt(2 * cost * MTBF) seconds."""
    return math.sqrt(2.0 * ckpt_cost_s * mtbf_s)


class IntervalPolicy:
    """Decides on rank 0 when the next checkpoint is due (the decision is shared by the step all-reduce).

    ``auto`` starts with a checkpoint after ``first_auto_step`` steps to measure its cost, then uses the
    Young-Daly interval from that cost, the median step time and the MTBF of the failures a checkpoint is
    for: ``--mtbf-s``, else the restarts in this run's event log that had to load a committed checkpoint,
    else 24 h. A restart that resumed from a copy in memory (``resumed`` with source ``memory``: in-process, or
    in-job on the same nodes; or ``peer``: a replacement node from the copy another node kept of its snapshot)
    lost at most ``--memory-snapshot-every-s`` of work whatever the checkpoint interval, so it does not count.
    A checkpoint's cost is the loop's median blocking time plus what its background write took from
    training: the mean extra time of the steps that ran alongside a write (next to nothing where the
    writers have host cores of their own, as on GPU nodes; on a host whose cores all train, it can be most
    of the cost; the mean, not the median, because a write slows a few steps a lot more than the rest).
    """

    first_auto_step = 10
    window = 500   # steps kept for the step-time statistics, with and without a write alongside

    def __init__(self, cfg: CheckpointConfig, events_path: Path, start_step: int = 0, events: EventLog | None = None):
        """``events``: where a chosen ``auto`` interval is recorded (``ckpt_interval``; rank 0, which decides).
        After a restart the policy goes on with the last one recorded: measuring the cost again would cost
        one more checkpoint per restart."""
        self.cfg, self.events_path, self.events = cfg, events_path, events
        self.auto = cfg.ckpt_every == "auto"
        chosen = ([e["steps"] for e in read_events(events_path) if e["event"] == Event.CKPT_INTERVAL]
                  if self.auto else [])
        self.chosen: int | None = chosen[-1] if chosen else None
        self.every = (self.chosen or self.first_auto_step) if self.auto else int(cfg.ckpt_every)
        self.last_step, self.last_time = start_step, time.monotonic()
        self.last_memory_time = self.last_time
        self.step_s: deque[float] = deque(maxlen=self.window)
        self.block_s: list[float] = []
        # Recent step times with and without a checkpoint write running alongside; steps seen with one.
        self.writing_step_s: deque[float] = deque(maxlen=self.window)
        self.quiet_step_s: deque[float] = deque(maxlen=self.window)
        self.writing_steps = 0

    def observe_step(self, step_s: float, writing: bool = False) -> None:
        """A step's duration; ``writing``: a checkpoint write was running when it started."""
        self.step_s.append(step_s)
        if writing:
            self.writing_step_s.append(step_s)
            self.writing_steps += 1
        else:
            self.quiet_step_s.append(step_s)

    def observe_checkpoint(self, block_s: float) -> None:
        self.block_s.append(block_s)
        self.last_time = self.last_memory_time = time.monotonic()   # a save's snapshot is in memory too
        if self.auto:
            self.every = self.auto_interval_steps()

    def mtbf_s(self) -> float:
        if self.cfg.mtbf_s > 0:
            return self.cfg.mtbf_s
        events = read_events(self.events_path)
        starts = [e["t"] for e in events if e["event"] == Event.RUN_START]
        from_disk = sum(e["event"] == Event.RESUMED and e.get("source") == "checkpoint" for e in events)
        if from_disk and starts:
            return max(1.0, (events[-1]["t"] - starts[0]) / from_disk)
        return DEFAULT_MTBF_S

    def write_interference_s(self) -> float:
        """Training time lost per checkpoint to its background write (slower steps while it ran)."""
        if not (self.writing_step_s and self.quiet_step_s and self.block_s):
            return 0.0
        slower = max(0.0, statistics.fmean(self.writing_step_s) - statistics.fmean(self.quiet_step_s))
        return slower * self.writing_steps / len(self.block_s)

    def auto_interval_steps(self) -> int:
        # The first save pays for allocating the staging copy; later ones are the steady-state cost.
        block = statistics.median(self.block_s[1:] or self.block_s)
        interference = self.write_interference_s()
        cost = block + interference
        step = statistics.median(self.step_s) if self.step_s else 1.0
        mtbf = self.mtbf_s()
        steps = max(1, round(young_daly_interval_s(cost, mtbf) / max(step, 1e-6)))
        if steps != self.chosen:
            logging.getLogger("trainer").info(
                "ckpt-every auto: %d steps (Young-Daly: cost %.4fs = blocking %.4fs + write interference %.4fs, "
                "MTBF %.0fs, step %.3fs)", steps, cost, block, interference, mtbf, step)
            if self.events is not None:
                self.events.emit(Event.CKPT_INTERVAL, steps=steps, block_s=round(block, 4),
                                 interference_s=round(interference, 4), mtbf_s=round(mtbf, 1), step_s=round(step, 5))
            self.chosen = steps
        return steps

    def memory_due(self, step: int, max_steps: int, copy_s: float) -> bool:
        """Whether to copy the state to memory after ``step`` (``--memory-snapshot-every-s``), given how long
        the last such copy took: copies stay at least 20x their duration apart (at most 5% of the copy
        bandwidth, whatever the state's size)."""
        if self.cfg.memory_every_s <= 0 or step >= max_steps:
            return False
        now = time.monotonic()
        if now - self.last_memory_time < max(self.cfg.memory_every_s, 20 * copy_s):
            return False
        self.last_memory_time = now
        return True

    def due(self, step: int, max_steps: int, writers_busy: bool = False) -> bool:
        """Whether to checkpoint after ``step``. ``writers_busy``: a rank's previous write is still running.

        A fixed step interval is kept exactly (that save waits for the writers). An ``auto`` or time-based
        save is postponed while the writers are busy, so it never blocks on them: Young-Daly with a tiny
        blocking cost can ask for saves more often than the writers can write them.
        """
        if step >= max_steps:
            return False  # the final checkpoint is written by the teardown
        if self.auto:
            by_steps = step - self.last_step >= self.every
        else:
            by_steps = self.every > 0 and step % self.every == 0
        by_time = self.cfg.ckpt_every_s > 0 and time.monotonic() - self.last_time >= self.cfg.ckpt_every_s
        exact = by_steps and not self.auto
        if exact or ((by_steps or by_time) and not writers_busy):
            self.last_step = step
            return True
        return False


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
