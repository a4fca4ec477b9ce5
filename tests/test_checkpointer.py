"""The Checkpointer's interface and per-step decisions, over a manager that records what it is asked to do.

The decision ``step`` returns for each interval (fixed steps, ``auto``, seconds) and a stop signal; which save a
step makes once the ranks agreed (interval checkpoint, memory snapshot, a checkpoint owed while a write runs,
spot notice); the final saves. The saving itself is tested against real DCP, NVRx and shared memory in
test_checkpoint.py; the whole loop in test_resume.py and test_recovery.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from trainer.checkpoint import Checkpointer, Decision, Saved, StepSignals
from trainer.config import CheckpointConfig, SpotConfig
from trainer.events import EventLog, read_events
from trainer.hooks import StepReport
from trainer.parallel import Dist
from trainer.spot import SpotWatcher


class RecordingManager:
    """Stands in for CheckpointManager: records calls; its writers' state is set by the test. An interval
    save reports ``block_s`` of blocking time, as the real one does once its copy is whole."""

    def __init__(self, root):
        self.root, self.calls = root, []
        self.writing = self.mark_pending = False
        self.replica_copy_s, self.on_snapshot = 0.0, None
        self.block_s = 0.01

    def guard_writer(self, atomic):
        self.atomic = atomic   # the attempt's, for the writer's bookkeeping

    def restore(self, state):
        return None, "checkpoint", state

    def snapshot_to_memory(self, step, state, keep=False):
        self.calls.append(("memory", step, "kept") if keep else ("memory", step))
        return {"copy of step": step}

    def release(self, copy):
        self.calls.append(("release", copy["copy of step"]))

    def save(self, step, state, blocking=False, writers_idle=False):
        source = state if isinstance(state, dict) else "live"
        self.calls.append(("save", step, source, blocking) + (("idle",) if writers_idle else ()))
        if not blocking:
            self.on_snapshot(self.block_s)

    def save_owed(self, step, copy, writers_idle=False):
        self.save(step, copy, writers_idle=writers_idle)   # its copy verified (test_corruption.py: the refusal)

    def finish_snapshot(self, report=True):
        return 0.0

    def start_writer(self):
        self.calls.append(("start_writer",))

    def drop_replica(self):
        self.calls.append(("drop_replica",))

    def maybe_finalize(self):
        pass

    def wait(self):
        self.calls.append(("wait",))

    def maybe_drain_mirror(self):
        self.calls.append(("drain_mirror",))


class App:
    def state_dict(self):
        return {"w": torch.zeros(2)}

    def load_state_dict(self, state):
        raise AssertionError("a fresh start loads nothing")


class Guard:
    stop_signal = "sigterm"

    def __init__(self):
        self.saving_depth = 0
        self.sections = []

    def atomic(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def saving(self):
        self.saving_depth += 1
        yield
        self.saving_depth -= 1

    @contextlib.contextmanager
    def section(self, name):
        self.sections.append(name)
        yield


def _checkpointer(tmp_path, max_steps=100, **cfg):
    manager = RecordingManager(tmp_path / "ckpt")
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    ckpt = Checkpointer(manager, CheckpointConfig(**cfg), Dist(0, 1, 0, torch.device("cpu")), App(), Guard(),
                        SpotWatcher(SpotConfig(), events, enabled=False), max_steps, events,
                        tmp_path / "events.jsonl", on_blocking=lambda s: None)
    # The writer's bookkeeping runs inside this attempt's atomic(): a restart never lands in it.
    assert manager.atomic == ckpt.guard.atomic
    assert ckpt.load() == (None, "checkpoint")
    assert manager.calls == [("start_writer",)], "the writer boots from the load on, ready for the first save"
    manager.calls.clear()
    return ckpt, manager


def _report(step, step_s=0.1):
    return StepReport(step=step, loss=1.0, step_s=step_s, data_wait_s=0.0, tokens=1, tokens_seen=step, lr=1.0,
                      mfu=None)


def _step(ckpt, step, *, due=False, busy=False, memory=False):
    """What the ranks agreed on at ``step``, then its save."""
    return ckpt.step(_report(step), StepSignals(ckpt_due=due, memory_due=memory, writing=busy))


def _run(ckpt, steps, stop_at=None):
    """The loop, on one rank: this rank's signals are every rank's. Returns the steps that saved, by kind."""
    saved = {}
    for step in steps:
        decision = ckpt.step(_report(step), ckpt.signals(step, stop=step == stop_at))
        if decision.saved is not None:
            saved[step] = decision.saved
        if decision.stop:
            break
    return saved


# ------------------------------------------------------------------------------ the per-step decision
def test_a_fixed_interval_saves_every_n_steps_and_the_last_step_is_final(tmp_path):
    ckpt, m = _checkpointer(tmp_path, max_steps=12, ckpt_every="5", memory_every_s=0.0)
    assert _run(ckpt, range(1, 13)) == {5: Saved.CHECKPOINT, 10: Saved.CHECKPOINT, 12: Saved.FINAL}
    assert [c for c in m.calls if c[0] == "save"] == [("save", 5, "live", False, "idle"),
                                                      ("save", 10, "live", False, "idle"), ("save", 12, "live", True)]
    assert ckpt.guard.sections == ["checkpoint"]   # the final save is timed as a checkpoint by the rank monitor


def test_auto_measures_the_first_checkpoint_then_saves_at_the_young_daly_interval(tmp_path):
    ckpt, m = _checkpointer(tmp_path, max_steps=25, ckpt_every="auto", mtbf_s=100.0, memory_every_s=0.0)
    m.block_s = 0.002
    # First after 10 steps, to measure its cost; then sqrt(2 x 0.002 s x 100 s) = 0.632 s / 0.1 s per step = 6.
    assert _run(ckpt, range(1, 26)) == {10: Saved.CHECKPOINT, 16: Saved.CHECKPOINT, 22: Saved.CHECKPOINT,
                                        25: Saved.FINAL}
    [chosen] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "ckpt_interval"]
    assert chosen["steps"] == 6


def test_a_time_interval_saves_every_s_seconds_and_waits_for_busy_writers(tmp_path, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("trainer.checkpoint.policy.time.monotonic", lambda: clock[0])
    ckpt, m = _checkpointer(tmp_path, max_steps=10, ckpt_every="0", ckpt_every_s=30.0, memory_every_s=0.0)
    saved = {}
    for step in range(1, 11):
        clock[0] += 10.0                      # a 10 s step
        m.writing = step == 6                 # a write runs when step 6 would save
        saved.update(_run(ckpt, [step]))
    # Postponed until no rank's write ran at the start of the step, nor of the one before (step 8).
    assert saved == {3: Saved.CHECKPOINT, 8: Saved.CHECKPOINT, 10: Saved.FINAL}


def test_a_stop_signal_commits_what_is_owed_and_a_final_checkpoint_then_stops(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    _step(ckpt, 2, due=True, busy=True)                     # owed: copied to memory while a write runs
    m.calls.clear()
    assert ckpt.step(_report(3), ckpt.signals(3, stop=True)) == Decision(Saved.FINAL, stop=True)
    assert m.calls == [("save", 2, {"copy of step": 2}, False), ("release", 2), ("save", 3, "live", True),
                       ("drop_replica",)]
    events = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] in ("sigterm", "exit")]
    assert [(e["event"], e["step"]) for e in events] == [("sigterm", 3), ("exit", 3)]


def test_any_ranks_signal_is_every_ranks_after_the_all_reduce():
    sums = (StepSignals(stop=True).as_tensor(torch.device("cpu"))
            + StepSignals(ckpt_due=True, writing=True).as_tensor(torch.device("cpu")))
    assert StepSignals.agreed(sums.tolist()) == StepSignals(stop=True, ckpt_due=True, writing=True)


# ------------------------------------------------------------------------------ which save, once agreed
def test_a_checkpoint_due_while_a_write_runs_is_copied_now_and_written_once_none_does(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    assert _step(ckpt, 1) == Decision(None)
    assert _step(ckpt, 4, due=True, busy=True) == Decision(Saved.OWED)   # a booting writer, or a slow disk
    assert m.calls == [("memory", 4, "kept")]   # the loop waits for no write
    _step(ckpt, 5, busy=True)                   # still writing: nothing is written yet
    _step(ckpt, 6, busy=True)
    assert m.calls[1:] == []
    assert _step(ckpt, 7) == Decision(Saved.OWED_WRITTEN)   # idle: step 4's copy, written as step 4
    assert m.calls[1:] == [("save", 4, {"copy of step": 4}, False, "idle"), ("release", 4)]


def test_a_checkpoint_due_while_no_write_runs_is_saved_without_another_sync_point(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    assert _step(ckpt, 3, due=True) == Decision(Saved.CHECKPOINT)
    _step(ckpt, 4, memory=True)
    assert m.calls == [("save", 3, "live", False, "idle"), ("memory", 4)]
    assert ckpt.guard.saving_depth == 0


def test_memory_snapshots_go_on_while_one_checkpoint_is_owed_and_stop_while_two_are(tmp_path):
    ckpt, m = _checkpointer(tmp_path, ckpt_every="5", memory_every_s=0.0)
    _step(ckpt, 2, due=True, busy=True)
    ckpt.policy.memory_every_s, ckpt.policy.last_memory_time = 1.0, 0.0    # a memory snapshot is overdue
    assert ckpt.signals(3, stop=False).memory_due, "one owed checkpoint keeps one slot: the other takes snapshots"
    assert _step(ckpt, 3, busy=True, memory=True) == Decision(Saved.MEMORY)
    _step(ckpt, 4, due=True, busy=True)
    ckpt.policy.last_memory_time = 0.0
    assert not ckpt.signals(5, stop=False).memory_due, "two owed checkpoints keep both slots"
    assert m.calls == [("memory", 2, "kept"), ("memory", 3), ("memory", 4, "kept")]
    m.calls.clear()
    _step(ckpt, 5, due=True)                               # idle: supersedes both, frees their slots
    assert m.calls == [("release", 2), ("release", 4), ("save", 5, "live", False, "idle")]


def test_a_third_checkpoint_due_while_a_write_runs_is_owed_in_place_of_the_oldest(tmp_path):
    ckpt, m = _checkpointer(tmp_path, max_steps=7)
    for step in (2, 3):
        _step(ckpt, step, due=True, busy=True)
    m.calls.clear()
    # The third does not wait for the write either: step 2's copy gives way (released before step 4 is copied
    # into its slot, never written later from a slot now holding step 4's state).
    assert _step(ckpt, 4, due=True, busy=True) == Decision(Saved.OWED)
    assert m.calls == [("release", 2), ("memory", 4, "kept")]
    assert _step(ckpt, 5) == Decision(Saved.OWED_WRITTEN)   # idle: the owed ones, oldest first
    assert _step(ckpt, 6) == Decision(Saved.OWED_WRITTEN)
    assert _step(ckpt, 7) == Decision(Saved.FINAL)
    assert [c[1] for c in m.calls if c[0] == "save"] == [3, 4, 7]


def test_signals_rank_0_decides_the_interval_and_reports_its_writers(tmp_path):
    ckpt, m = _checkpointer(tmp_path, ckpt_every="5", memory_every_s=0.0)
    assert ckpt.signals(4, stop=False) == StepSignals()
    m.writing = True
    assert ckpt.signals(5, stop=True) == StepSignals(stop=True, ckpt_due=True, writing=True)
    m.writing = False
    ckpt.policy.memory_every_s, ckpt.policy.last_memory_time = 1.0, 0.0    # a memory snapshot is overdue
    assert ckpt.signals(6, stop=False) == StepSignals(memory_due=True)


def test_a_memory_snapshot_waits_until_every_rank_marked_the_last_one(tmp_path):
    """A memory snapshot due while a rank still marks its last copy is taken a step later. The copy overwrites
    the one before the last: the ranks that marked the last would hold only it, the one still marking only the
    one before, and a restart in between would find no step that every rank holds in memory."""
    ckpt, m = _checkpointer(tmp_path, memory_every_s=1.0)
    ckpt.policy.last_memory_time = 0.0    # a memory snapshot is overdue
    m.mark_pending = True
    agreed = ckpt.signals(3, stop=False)
    assert agreed == StepSignals(memory_due=True, marking=True)
    assert ckpt.step(_report(3), agreed) == Decision(None) and ("memory", 3) not in m.calls
    m.mark_pending = False
    agreed = ckpt.signals(4, stop=False)
    assert agreed == StepSignals(memory_due=True), "due again at the next step, not a whole interval later"
    assert ckpt.step(_report(4), agreed) == Decision(Saved.MEMORY) and ("memory", 4) in m.calls


@pytest.mark.parametrize("resumed_at_last_step", [True, False])
def test_close_saves_the_last_step_only_where_the_loop_did_not_then_drains_the_mirror(tmp_path, resumed_at_last_step):
    ckpt, m = _checkpointer(tmp_path, max_steps=3)
    if not resumed_at_last_step:
        _run(ckpt, [1, 2, 3])
    else:
        ckpt.first_step = 4                  # resumed from a state of step 3: the loop has nothing to do
    m.calls.clear()
    ckpt.close(3)
    assert m.calls == ([("save", 3, "live", True), ("wait",), ("drop_replica",)] if resumed_at_last_step else []) \
        + [("drain_mirror",)]
