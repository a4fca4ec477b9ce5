"""``Checkpointer``: the façade the Trainer uses. It decides, at every step, what of the state to save and
where (a committed checkpoint, a copy in node memory, or a checkpoint owed until the writers are warm),
and runs the saves of a stop and of the end of training. ``CheckpointManager`` below it does the saving.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Callable, Protocol

from ..config import CheckpointConfig
from ..events import EventLog
from ..goodput import IntervalPolicy
from ..hooks import StepHook, StepReport
from ..layout import COMMITTED, step_dir
from ..parallel import Dist
from ..spot import SpotWatcher
from .manager import CheckpointManager

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """What a checkpoint holds: the Trainer's state, as a dict, and back."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Guard(Protocol):
    """The recovery layers' guards around a save (``trainer.recovery.Recovery``)."""

    def atomic(self) -> contextlib.AbstractContextManager: ...

    def saving(self) -> contextlib.AbstractContextManager: ...


class Checkpointer(StepHook):
    """Restore, the per-step save decisions, and the final saves, for one attempt.

    Args:
        manager: the process's ``CheckpointManager`` (its writer, staging and replica outlive attempts).
        cfg: checkpoint section of the config.
        d: this process's distributed context.
        app: the state to save and restore.
        guard: the recovery layers' guards around saves.
        spot: the spot interruption watcher (a notice makes a checkpoint due).
        max_steps: the run's last step.
        events, events_path: the run's event log (rank 0 records the interval policy's choices).
        on_blocking: called with the blocking seconds of every interval save (metrics).
    """

    def __init__(self, manager: CheckpointManager, cfg: CheckpointConfig, d: Dist, app: Stateful, guard: Guard,
                 spot: SpotWatcher, max_steps: int, events: EventLog, events_path: Path,
                 on_blocking: Callable[[float], None]):
        self.manager, self.cfg, self.d, self.app, self.guard, self.spot = manager, cfg, d, app, guard, spot
        self.max_steps, self.events, self.events_path, self.on_blocking = max_steps, events, events_path, on_blocking
        self.policy: IntervalPolicy | None = None
        self.first_step = 1
        self.staging_wait_s = 0.0   # this step's wait for a checkpoint's copy (blocking time, not step time)
        # Agreed by every rank at the last step (``agree``): what to save, and the writers' state.
        self.due = self.to_memory = False
        self.writers_busy = False   # any rank's checkpoint write was running at the start of the last step
        self.writers_cold = False   # and some rank's first write since its writer started was still running
        self.owed: list = []        # (step, copy in node memory) of checkpoints due while the writers were cold

    # ----------------------------------------------------------------------------------------- restore
    def restore(self) -> tuple[int | None, str]:
        """Load the newest state every rank can get into ``app``; return (its step or None, its source).

        The newest memory snapshot every rank holds (after an in-process restart, or on the same nodes after
        an in-job one), else the newest committed checkpoint, else nothing (a fresh start). Collective.
        """
        step, source, loaded = self.manager.restore(self.app.state_dict())
        if step is not None:
            self.app.load_state_dict(loaded)
        start = step or 0
        self.first_step = start + 1
        self.policy = IntervalPolicy(self.cfg, events_path=self.events_path, start_step=start,
                                     events=self.events if self.d.is_main else None)
        self.manager.on_snapshot = self._observe_blocking
        return step, source

    def _observe_blocking(self, block_s: float) -> None:
        self.policy.observe_checkpoint(block_s)
        self.on_blocking(block_s)

    # ----------------------------------------------------------------------------------------- a step
    def maybe_finalize(self) -> None:
        """Top of every step: finished writes are recorded, complete checkpoints committed (no waiting)."""
        self.staging_wait_s = 0.0
        self.manager.maybe_finalize()

    def before_optimizer_step(self, step: int) -> None:
        # A checkpoint's copy of the state ran alongside this step's forward and backward passes; it must be
        # whole before the optimizer writes to the state.
        with self.guard.atomic():
            self.staging_wait_s = self.manager.finish_snapshot()

    def votes(self, step: int) -> list[bool]:
        """This rank's say on what step ``step`` saves, for the step's all-reduce (summed over ranks).

        Rank 0 decides the interval checkpoint and the memory snapshot; a spot notice on any rank's node
        makes a checkpoint due; every rank reports its writers.
        """
        m = self.manager
        due = self.d.is_main and self.policy.due(step, self.max_steps, self.writers_busy or m.writing)
        due = self.spot.maybe_due(step, self.max_steps) or due
        # Between checkpoints, a copy in memory bounds what a restart redoes; an owed checkpoint keeps one
        # of the replica's two slots, two keep both.
        to_memory = self.d.is_main and not due and len(self.owed) < 2 and self.policy.memory_due(
            step, self.max_steps, m.replica_copy_s)
        return [due, m.writing, to_memory, m.cold and m.writes_in_flight > 0]

    def agree(self, sums: list[float]) -> None:
        """The votes of every rank, summed: from here every rank takes the same decisions."""
        self.due, self.writers_busy, self.to_memory, self.writers_cold = (v > 0 for v in sums)

    def after_step(self, report: StepReport) -> None:
        self.policy.observe_step(report.step_s, writing=self.writers_busy)

    def maybe_save(self, step: int) -> None:
        """Save what the ranks agreed on for ``step`` (call on every rank, after ``agree``)."""
        m, app = self.manager, self.app.state_dict
        if self.due and self.writers_busy and self.writers_cold and len(self.owed) < 2:
            # The save would wait for the previous write, which runs on a writer that has not finished one
            # yet: it may still be booting (seconds, after every start and in-job restart). The state is
            # copied to node memory now (one of its two slots) and that copy written once the writer is
            # warm: the checkpoint is this step's, and the loop waits for no boot. Memory snapshots go on in
            # the other slot.
            with self.guard.atomic():
                self.owed.append((step, m.snapshot_to_memory(step, app, keep=True)))
        elif self.due:
            with self.guard.saving():
                if self.owed:
                    # This checkpoint supersedes the owed ones, which would only be written after it. Their
                    # copies hold the replica's two slots: the copy below must not overwrite one still owed.
                    log.info("checkpoints of steps %s, owed to a cold writer, superseded by step %d",
                             [s for s, _ in self.owed], step)
                    self._release_owed()
                if self.writers_busy:
                    # The save will wait for the previous write (on every rank: the flag was all-reduced).
                    # Copied to node memory first, this step is what a restart meanwhile resumes from.
                    m.snapshot_to_memory(step, app)
                m.save(step, app)
        elif self.owed and not (self.writers_busy and self.writers_cold):
            owed_step, copy = self.owed[0]
            with self.guard.saving():
                m.save_owed(owed_step, copy)
            self._release_owed(1)
        elif self.to_memory:
            with self.guard.atomic():
                m.snapshot_to_memory(step, app)
        if step == self.first_step:
            m.start_writer()   # not before: see Writer.start

    def _release_owed(self, count: int | None = None) -> None:
        """The first ``count`` owed checkpoints (all: None) are written or superseded: their slots are free."""
        count = len(self.owed) if count is None else count
        for _, copy in self.owed[:count]:
            self.manager.release(copy)
        del self.owed[:count]

    # ----------------------------------------------------------------------------------------- the end
    def _save_owed(self, guard: Callable[[], contextlib.AbstractContextManager]) -> None:
        for step, copy in self.owed:   # due before the end: taken from their copies in memory
            with guard():
                if self.manager.save_owed(step, copy):
                    self.manager.finish_snapshot()
        self._release_owed()

    def save_on_stop(self, step: int) -> None:
        """Every rank saw the stop flag at ``step``: commit what is owed and a final checkpoint of ``step``."""
        self._save_owed(self.guard.saving)
        with self.guard.saving():
            self.manager.save(step, self.app.state_dict, blocking=True)
        self.manager.drop_replica()   # older than the checkpoint just committed

    def finish(self, step: int) -> None:
        """The end of training (inside the caller's ``checkpoint`` section): every checkpoint committed,
        ``step`` among them."""
        self.manager.maybe_finalize()
        self._save_owed(self.guard.atomic)
        if not (step_dir(self.manager.root, step) / COMMITTED).exists():
            with self.guard.atomic():
                self.manager.save(step, self.app.state_dict, blocking=True)
        self.manager.wait()
        self.manager.drop_replica()   # older than the final checkpoint

    def maybe_drain_mirror(self) -> None:
        self.manager.maybe_drain_mirror()
