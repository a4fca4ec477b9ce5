"""``IntervalPolicy``: when the next checkpoint and the next memory snapshot are due (rank 0 decides; the
step's all-reduce shares the decision)."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Literal

from ..config import CheckpointConfig
from ..events import Event, EventLog, read_events
from ..goodput import DEFAULT_MTBF_S, young_daly_interval_s

AUTO = "auto"
"""``--ckpt-every auto``: the Young-Daly interval, from the measured checkpoint cost and the MTBF."""

log = logging.getLogger("trainer")


class IntervalPolicy:
    """Decides on rank 0 when the next checkpoint is due (the decision is shared by the step all-reduce).

    ``auto`` starts with a checkpoint after ``first_auto_step`` steps to measure its cost, then uses the
    Young-Daly interval from that cost, the median step time and the MTBF of the failures a checkpoint is
    for: ``mtbf_s``, else the restarts in this run's event log that had to load a committed checkpoint,
    else 24 h. A restart that resumed from a copy in memory (``resumed`` with source ``memory``: in-process, or
    in-job on the same nodes; or ``peer``: a replacement node from the copy another node kept of its snapshot)
    lost at most ``memory_every_s`` of work whatever the checkpoint interval, so it does not count.
    A checkpoint's cost is the loop's median blocking time plus what its background write took from
    training: the mean extra time of the steps that ran alongside a write (next to nothing where the
    writers have host cores of their own, as on GPU nodes; on a host whose cores all train, it can be most
    of the cost; the mean, not the median, because a write slows a few steps a lot more than the rest).

    Args:
        every: checkpoint every this many steps (0: only the final one), or ``AUTO``.
        events_path: the run's event log (the restarts ``auto`` learns the MTBF from, its earlier choices).
        every_s: also checkpoint once this many seconds passed since the last one (0: off).
        memory_every_s: between checkpoints, copy the state to node memory this often (0: off).
        mtbf_s: with ``AUTO``, the mean time between failures that need a checkpoint (0: learned, see above).
        start_step: the step the attempt resumed from.
        events: where a chosen ``auto`` interval is recorded (``ckpt_interval``; rank 0, which decides).
            After a restart the policy goes on with the last one recorded: measuring the cost again would cost
            one more checkpoint per restart.
    """

    first_auto_step = 10
    window = 500   # steps kept for the step-time statistics, with and without a write alongside

    def __init__(self, every: int | Literal["auto"], events_path: Path, *, every_s: float = 0.0,
                 memory_every_s: float = 0.0, mtbf_s: float = 0.0, start_step: int = 0,
                 events: EventLog | None = None):
        self.events_path, self.events = events_path, events
        self.every_s, self.memory_every_s, self.configured_mtbf_s = every_s, memory_every_s, mtbf_s
        self.auto = every == AUTO
        chosen = ([e["steps"] for e in read_events(events_path) if e["event"] == Event.CKPT_INTERVAL]
                  if self.auto else [])
        self.chosen: int | None = chosen[-1] if chosen else None
        self.every: int = (self.chosen or self.first_auto_step) if self.auto else every
        self.last_step, self.last_time = start_step, time.monotonic()
        self.last_memory_time = self.last_time
        self.step_s: deque[float] = deque(maxlen=self.window)
        self.block_s: list[float] = []
        # Recent step times with and without a checkpoint write running alongside; steps seen with one.
        self.writing_step_s: deque[float] = deque(maxlen=self.window)
        self.quiet_step_s: deque[float] = deque(maxlen=self.window)
        self.writing_steps = 0

    @classmethod
    def for_config(cls, cfg: CheckpointConfig, events_path: Path, *, start_step: int = 0,
                   events: EventLog | None = None) -> "IntervalPolicy":
        """The policy of the run's checkpoint settings: the interval as ``cfg.every_steps`` parsed it."""
        return cls(AUTO if cfg.every_steps is None else cfg.every_steps, events_path, every_s=cfg.ckpt_every_s,
                   memory_every_s=cfg.memory_every_s, mtbf_s=cfg.mtbf_s, start_step=start_step, events=events)

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
        if self.configured_mtbf_s > 0:
            return self.configured_mtbf_s
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
            log.info("ckpt-every auto: %d steps (Young-Daly: cost %.4fs = blocking %.4fs + write interference "
                     "%.4fs, MTBF %.0fs, step %.3fs)", steps, cost, block, interference, mtbf, step)
            if self.events is not None:
                self.events.emit(Event.CKPT_INTERVAL, steps=steps, block_s=round(block, 4),
                                 interference_s=round(interference, 4), mtbf_s=round(mtbf, 1), step_s=round(step, 5))
            self.chosen = steps
        return steps

    def memory_due(self, step: int, max_steps: int, copy_s: float) -> bool:
        """Whether to copy the state to memory after ``step`` (``memory_every_s``), given how long the last
        such copy took: copies stay at least 20x their duration apart (at most 5% of the copy bandwidth,
        whatever the state's size)."""
        if self.memory_every_s <= 0 or step >= max_steps:
            return False
        now = time.monotonic()
        if now - self.last_memory_time < max(self.memory_every_s, 20 * copy_s):
            return False
        self.last_memory_time = now
        return True

    def memory_postponed(self) -> None:
        """The memory snapshot found due was not taken: it is due again at the next step."""
        self.last_memory_time = float("-inf")

    def due(self, step: int, max_steps: int, writers_busy: bool = False) -> bool:
        """Whether to checkpoint after ``step``. ``writers_busy``: a rank's previous write is still running.

        A fixed step interval is kept exactly (a save due while a write runs is owed: ``Checkpointer``). An
        ``auto`` or time-based save is postponed while the writers are busy: Young-Daly with a tiny blocking
        cost can ask for saves more often than the writers can write them.
        """
        if step >= max_steps:
            return False  # the final checkpoint is the last step's, whatever the interval
        if self.auto:
            by_steps = step - self.last_step >= self.every
        else:
            by_steps = self.every > 0 and step % self.every == 0
        by_time = self.every_s > 0 and time.monotonic() - self.last_time >= self.every_s
        exact = by_steps and not self.auto
        if exact or ((by_steps or by_time) and not writers_busy):
            self.last_step = step
            return True
        return False
