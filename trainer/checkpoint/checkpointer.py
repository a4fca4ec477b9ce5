"""``Checkpointer``: the façade the Trainer uses, after torchtitan's ``CheckpointManager``::

    resumed_from, source = checkpointer.load()           # own memory, a peer's copy, FSx, the S3 mirror
    while step < max_steps:                               # every step, on every rank:
        ... forward, backward
        wait_s = checkpointer.maybe_wait_for_staging()    # a save's copy is whole before the state changes
        ... optimizer step
        mine = checkpointer.signals(step, stop=...)       # this rank's say, summed by the step's all-reduce
        decision = checkpointer.step(report, agreed)      # saves what is due (the final one at the last
        if decision.stop: ...                             # step); on a stop, the final checkpoint
    checkpointer.close(step)                              # after the last collective: the mirror drained

When a checkpoint or a memory snapshot is due is ``IntervalPolicy``'s decision (``policy``), taken on rank 0
and agreed by every rank through the step's all-reduce; ``CheckpointManager`` below does the saving.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from ..config import CheckpointConfig
from ..events import Event, EventLog
from ..hooks import StepReport
from ..layout import COMMITTED, step_dir
from ..parallel import Dist
from ..spot import SpotWatcher
from .manager import CheckpointManager
from .policy import IntervalPolicy

log = logging.getLogger(__name__)


class Stateful(Protocol):
    """What a checkpoint holds: the Trainer's state, as a dict, and back."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Guard(Protocol):
    """The recovery layers' guards around a save (``trainer.recovery.Recovery``)."""

    def atomic(self) -> contextlib.AbstractContextManager: ...

    def saving(self) -> contextlib.AbstractContextManager: ...

    def section(self, name: str) -> contextlib.AbstractContextManager: ...

    @property
    def stop_signal(self) -> str: ...


@dataclass(frozen=True)
class StepSignals:
    """What one rank says about the step it just took. The step's all-reduce sums them over the ranks field
    by field (``as_tensor``, ``agreed``): a field is set once any rank set it, so every rank decides the same."""

    stop: bool = False          # a stop signal (SIGTERM, SIGINT) reached this rank
    ckpt_due: bool = False      # rank 0's interval policy, or a spot notice for this rank's node
    memory_due: bool = False    # rank 0: a memory snapshot is due (and no checkpoint)
    writing: bool = False       # a checkpoint write of this rank was running at the start of the step
    marking: bool = False       # this rank's last memory snapshot is not marked on the node yet

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor([float(getattr(self, f.name)) for f in fields(self)], dtype=torch.float32,
                            device=device)

    @classmethod
    def agreed(cls, sums: Sequence[float]) -> StepSignals:
        """Every rank's signals, from their sums in the order of ``as_tensor``."""
        return cls(*(s > 0 for s in sums))


class Saved(enum.Enum):
    """What ``Checkpointer.step`` saved at a step."""

    CHECKPOINT = "checkpoint"       # this step's checkpoint: copied now, written in the background
    OWED = "owed"                   # due while a write runs: copied to node memory, written once none does
    OWED_WRITTEN = "owed_written"   # no write runs: an earlier step's owed checkpoint is written
    MEMORY = "memory"               # a copy of this step's state in node memory (no checkpoint)
    FINAL = "final"                 # this step's checkpoint, committed: the last step's, or a stop's


@dataclass(frozen=True)
class Decision:
    """What ``Checkpointer.step`` did at a step, and what the loop does next."""

    saved: Saved | None = None
    stop: bool = False   # every rank saw a stop signal, and the final checkpoint is committed: leave the loop


class Checkpointer:
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
        self.owed: list = []        # (step, copy in node memory) of checkpoints due while a write ran
        self.agreed = StepSignals()   # the last step's signals, as every rank agreed on them
        manager.guard_writer(guard.atomic)

    # ----------------------------------------------------------------------------------------- load
    def load(self) -> tuple[int | None, str]:
        """Load the newest state every rank can get into ``app``; return (its step or None, its source).

        The newest memory snapshot every rank holds (after an in-process restart, or on the same nodes after
        an in-job one), else the newest committed checkpoint, else nothing (a fresh start). Collective.
        """
        step, source, loaded = self.manager.restore(self.app.state_dict())
        if step is not None:
            self.app.load_state_dict(loaded)
        # The writer boots while the first steps run, and the first save's plan is made now: that save waits
        # for neither (after the load: the boot's CPU is not taken from it).
        self.manager.start_writer()
        start = step or 0
        self.first_step = start + 1
        self.policy = IntervalPolicy.for_config(self.cfg, self.events_path, start_step=start,
                                                events=self.events if self.d.is_main else None)
        self.manager.on_snapshot = self._observe_blocking
        self.manager.maybe_finalize()   # the first step's: earlier attempts' finished writes committed
        return step, source

    def _observe_blocking(self, block_s: float) -> None:
        self.policy.observe_checkpoint(block_s)
        self.on_blocking(block_s)

    # ----------------------------------------------------------------------------------------- a step
    def maybe_wait_for_staging(self) -> float:
        """Before the optimizer step: wait for a checkpoint's copy of the state, which ran alongside this step's
        forward and backward passes, to be whole; return the seconds waited (blocking time, not step time)."""
        with self.guard.atomic():
            return self.manager.finish_snapshot()

    def signals(self, step: int, stop: bool) -> StepSignals:
        """This rank's signals for the step ``step`` just taken, for the step's all-reduce. ``stop``: a stop
        signal reached this rank.

        Rank 0 decides the interval checkpoint and the memory snapshot; a spot notice on any rank's node
        makes a checkpoint due; every rank reports its writers.
        """
        m = self.manager
        due = self.d.is_main and self.policy.due(step, self.max_steps, self.agreed.writing or m.writing)
        due = self.spot.maybe_due(step, self.max_steps) or due
        # Between checkpoints, a copy in memory bounds what a restart redoes; an owed checkpoint keeps one
        # of the replica's two slots, two keep both.
        memory_due = self.d.is_main and not due and len(self.owed) < 2 and self.policy.memory_due(
            step, self.max_steps, m.replica_copy_s)
        return StepSignals(stop=stop, ckpt_due=due, memory_due=memory_due, writing=m.writing, marking=m.mark_pending)

    def step(self, report: StepReport, agreed: StepSignals) -> Decision:
        """Act on the step every rank agreed on (call on every rank, with the all-reduced ``agreed``).

        A stop: what is owed and a final checkpoint of this step, committed. The last step: every checkpoint
        committed, this one among them. Otherwise what the policy found due: a checkpoint, a memory snapshot,
        or a checkpoint owed until the writers are warm.
        """
        step, self.agreed = report.step, agreed
        self.policy.observe_step(report.step_s, writing=agreed.writing)
        if agreed.stop:
            self._save_on_stop(step)
            return Decision(Saved.FINAL, stop=True)
        saved = self._maybe_save(step, agreed)
        if step >= self.max_steps:
            with self.guard.section("checkpoint"):
                self._save_final(step)
            return Decision(Saved.FINAL)
        self.manager.maybe_finalize()   # the next step's: finished writes recorded, complete ones committed
        return Decision(saved)

    def _maybe_save(self, step: int, agreed: StepSignals) -> Saved | None:
        m, app, saved = self.manager, self.app.state_dict, None
        if agreed.ckpt_due and agreed.writing:
            # The save would wait for the previous write: its writer may still be booting (seconds, after every
            # start and in-job restart), or the disk be slower than the interval. The state is copied to node
            # memory now (one of its two slots) and that copy written once no write runs: the checkpoint is this
            # step's, and the loop waits for no write. Memory snapshots go on in the other slot; with both slots
            # owed, the older owed checkpoint gives way to this one.
            with self.guard.atomic():
                if len(self.owed) == 2:
                    log.info("checkpoint of step %d, owed to a busy writer, superseded by step %d",
                             self.owed[0][0], step)
                    self._release_owed(1)
                self.owed.append((step, m.snapshot_to_memory(step, app, keep=True)))
            saved = Saved.OWED
        elif agreed.ckpt_due:
            with self.guard.saving():
                if self.owed:
                    # This checkpoint supersedes the owed ones, which would only be written after it. Their
                    # copies hold the replica's two slots: the copy below must not overwrite one still owed.
                    log.info("checkpoints of steps %s, owed to a busy writer, superseded by step %d",
                             [s for s, _ in self.owed], step)
                    self._release_owed()
                m.save(step, app, writers_idle=True)
            saved = Saved.CHECKPOINT
        elif self.owed and not agreed.writing:
            # Once no write runs (on any rank): behind another one, it would wait for it.
            owed_step, copy = self.owed[0]
            with self.guard.saving():
                m.save_owed(owed_step, copy, writers_idle=True)
            self._release_owed(1)
            saved = Saved.OWED_WRITTEN
        elif agreed.memory_due and agreed.marking:
            # A rank still marks its last copy: the next would overwrite the copy before it on the ranks that
            # have marked theirs, and a restart now would find no step that every rank holds. Next step.
            self.policy.memory_postponed()
        elif agreed.memory_due:
            with self.guard.atomic():
                m.snapshot_to_memory(step, app)
            saved = Saved.MEMORY
        return saved

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
                self.manager.save_owed(step, copy)
                self.manager.finish_snapshot()
        self._release_owed()

    def _save_on_stop(self, step: int) -> None:
        """Every rank saw the stop flag at ``step``: commit what is owed and a final checkpoint of ``step``
        (recorded with the time it took, against the pod's grace period)."""
        grace_s = self.cfg.sigterm_grace_s
        self.events.emit(Event.SIGTERM, step=step, signal=self.guard.stop_signal)
        t0 = time.monotonic()
        self._save_owed(self.guard.saving)
        with self.guard.saving():
            self.manager.save(step, self.app.state_dict, blocking=True)
        self.manager.drop_replica()   # older than the checkpoint just committed
        took = time.monotonic() - t0
        if self.d.is_main:
            if took > grace_s:
                log.warning("final checkpoint took %.1fs, over the %.0fs grace period", took, grace_s)
            self.events.emit(Event.EXIT, reason=self.guard.stop_signal, step=step, ckpt_s=round(took, 4))

    def _save_final(self, step: int) -> None:
        """The end of training: every checkpoint committed, ``step`` among them."""
        self.manager.maybe_finalize()
        self._save_owed(self.guard.atomic)
        if not (step_dir(self.manager.root, step) / COMMITTED).exists():
            with self.guard.atomic():
                self.manager.save(step, self.app.state_dict, blocking=True)
        self.manager.wait()
        self.manager.drop_replica()   # older than the final checkpoint

    def close(self, step: int) -> None:
        """After training (inside the caller's ``checkpoint`` section, after its last collective but this
        one): the final checkpoint of ``step`` if the loop did not run to make it (a run resumed at its last
        step), then, on rank 0, the S3 mirror drained, so the run's summary sees every checkpoint mirrored."""
        if step < self.first_step:
            self._save_final(step)
        if self.d.is_main:
            self.manager.maybe_drain_mirror()
