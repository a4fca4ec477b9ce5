"""The Checkpointer's per-step decisions, over a manager that records what it is asked to do.

Which save a step makes once the ranks agreed (interval checkpoint, memory snapshot, a checkpoint owed while
the writers are cold, spot notice), and the saves of a stop. The saving itself is tested against real
DCP, NVRx and shared memory in test_checkpoint.py; the whole loop in test_resume.py and test_recovery.py.
"""

from __future__ import annotations

import contextlib

import torch

from trainer.checkpoint import Checkpointer
from trainer.config import CheckpointConfig, SpotConfig
from trainer.events import EventLog
from trainer.parallel import Dist
from trainer.spot import SpotWatcher


class RecordingManager:
    """Stands in for CheckpointManager: records calls; its writers' state is set by the test."""

    def __init__(self, root):
        self.root, self.calls = root, []
        self.writing = self.cold = False
        self.writes_in_flight, self.replica_copy_s, self.on_snapshot = 0, 0.0, None

    def restore(self, state):
        return None, "checkpoint", state

    def snapshot_to_memory(self, step, state, keep=False):
        self.calls.append(("memory", step, "kept") if keep else ("memory", step))
        return {"copy of step": step}

    def release(self, copy):
        self.calls.append(("release", copy["copy of step"]))

    def save(self, step, state, blocking=False):
        source = state if isinstance(state, dict) else "live"
        self.calls.append(("save", step, source, blocking))

    def save_owed(self, step, copy):
        self.save(step, copy)   # its copy verified (tests/test_corruption.py checks the refusal)
        return True

    def finish_snapshot(self, report=True):
        return 0.0

    def start_writer(self):
        self.calls.append(("start_writer",))

    def drop_replica(self):
        self.calls.append(("drop_replica",))

    def maybe_finalize(self):
        pass

    def wait(self):
        pass


class App:
    def state_dict(self):
        return {"w": torch.zeros(2)}

    def load_state_dict(self, state):
        raise AssertionError("a fresh start loads nothing")


class Guard:
    def __init__(self):
        self.saving_depth = 0

    def atomic(self):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def saving(self):
        self.saving_depth += 1
        yield
        self.saving_depth -= 1


def _checkpointer(tmp_path, max_steps=100, **cfg):
    manager = RecordingManager(tmp_path / "ckpt")
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    ckpt = Checkpointer(manager, CheckpointConfig(**cfg), Dist(0, 1, 0, torch.device("cpu")), App(), Guard(),
                        SpotWatcher(SpotConfig(), events, enabled=False), max_steps, events,
                        tmp_path / "events.jsonl", on_blocking=lambda s: None)
    assert ckpt.restore() == (None, "checkpoint")
    return ckpt, manager


def _step(ckpt, step, *, due=False, busy=False, memory=False, cold=False):
    """What the ranks agreed on at ``step``, then its save."""
    ckpt.agree([float(due), float(busy), float(memory), float(cold)])
    ckpt.maybe_save(step)


def test_a_checkpoint_due_while_the_writers_are_cold_is_copied_now_and_written_when_they_are_warm(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    _step(ckpt, 1)
    _step(ckpt, 4, due=True, busy=True, cold=True)        # the first write still runs on a booting writer
    assert m.calls == [("start_writer",), ("memory", 4, "kept")]   # the loop waits for no boot
    _step(ckpt, 5, busy=True, cold=True)                   # still cold: nothing is written yet
    assert m.calls[2:] == []
    _step(ckpt, 6, busy=True)                              # warm: step 4's copy is written, as step 4
    assert m.calls[2:] == [("save", 4, {"copy of step": 4}, False), ("release", 4)]


def test_memory_snapshots_go_on_while_one_checkpoint_is_owed_and_stop_while_two_are(tmp_path):
    ckpt, m = _checkpointer(tmp_path, ckpt_every="5", memory_every_s=0.0)
    _step(ckpt, 2, due=True, busy=True, cold=True)
    ckpt.cfg.memory_every_s, ckpt.policy.last_memory_time = 1.0, 0.0    # a memory snapshot is overdue
    assert ckpt.votes(3)[2], "one owed checkpoint keeps one slot: the other takes memory snapshots"
    _step(ckpt, 3, busy=True, cold=True, memory=True)
    _step(ckpt, 4, due=True, busy=True, cold=True)
    ckpt.policy.last_memory_time = 0.0
    assert not ckpt.votes(5)[2], "two owed checkpoints keep both slots"
    assert m.calls == [("memory", 2, "kept"), ("memory", 3), ("memory", 4, "kept")]
    m.calls.clear()
    _step(ckpt, 5, due=True, busy=True)                    # warm and busy: supersedes both, frees their slots
    assert m.calls == [("release", 2), ("release", 4), ("memory", 5), ("save", 5, "live", False)]


def test_at_most_two_checkpoints_are_owed_then_a_due_save_waits_and_supersedes_them(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    for step in (2, 3):
        _step(ckpt, step, due=True, busy=True, cold=True)
    m.calls.clear()
    _step(ckpt, 4, due=True, busy=True, cold=True)
    # The third waits for the writer, with this step copied to node memory first (a restart resumes from it).
    # That copy takes a slot of the owed copies: they are dropped, not written later from a slot now holding
    # step 4 (a "step 2" checkpoint with step 4's state), nor after step 4 commits.
    assert m.calls == [("release", 2), ("release", 3), ("memory", 4), ("save", 4, "live", False)]
    _step(ckpt, 5)
    _step(ckpt, 6, busy=True)
    ckpt.finish(6)
    assert [c for c in m.calls if c[0] == "save" and c[1] in (2, 3)] == []


def test_an_owed_checkpoint_is_superseded_by_a_due_save_behind_a_warm_busy_writer(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    _step(ckpt, 2, due=True, busy=True, cold=True)          # owed: its copy is the replica's newest slot
    _step(ckpt, 4, due=True, busy=True)                     # warm and busy: copied to the other slot, saved
    _step(ckpt, 6, due=True, busy=True)                     # the next copy reuses step 2's slot
    _step(ckpt, 7)
    assert m.calls == [("memory", 2, "kept"), ("release", 2), ("memory", 4), ("save", 4, "live", False),
                       ("memory", 6), ("save", 6, "live", False)]


def test_a_due_save_behind_a_busy_warm_writer_copies_to_memory_first(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    _step(ckpt, 3, due=True)
    _step(ckpt, 6, due=True, busy=True)
    _step(ckpt, 7, memory=True)
    assert m.calls == [("save", 3, "live", False), ("memory", 6), ("save", 6, "live", False), ("memory", 7)]
    assert ckpt.guard.saving_depth == 0


def test_a_stop_writes_what_is_owed_then_a_final_blocking_checkpoint(tmp_path):
    ckpt, m = _checkpointer(tmp_path)
    _step(ckpt, 2, due=True, busy=True, cold=True)
    m.calls.clear()
    ckpt.save_on_stop(3)
    assert m.calls == [("save", 2, {"copy of step": 2}, False), ("release", 2), ("save", 3, "live", True),
                       ("drop_replica",)]


def test_votes_rank_0_decides_the_interval_and_reports_its_writers(tmp_path):
    ckpt, m = _checkpointer(tmp_path, ckpt_every="5", memory_every_s=0.0)
    assert ckpt.votes(4) == [False, False, False, False]
    m.writing, m.cold, m.writes_in_flight = True, True, 1
    assert ckpt.votes(5) == [True, True, False, True]
    m.writing, m.cold, m.writes_in_flight = False, False, 0
    ckpt.cfg.memory_every_s, ckpt.policy.last_memory_time = 1.0, 0.0    # a memory snapshot is overdue
    assert ckpt.votes(6) == [False, False, True, False]
