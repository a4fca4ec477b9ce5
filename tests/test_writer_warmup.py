"""A save while the checkpoint writer still boots (the first after every start and in-job restart) is held
by the trainer and handed to NVRx's worker once, when the worker is warm; nothing is lost at exit. (A save
still being planned on the copy thread is held the same way: the last test.)

On NVRx 0.6/0.7 handing a request over blocks until the worker has run it (its preload function), so a
request given to a booting worker blocked the loop for the boot, and the writer holds it
(``holds_while_booting``, from the release). These tests run on the installed release (0.4.1 here), whose
queue would take it at once and where the writer hands requests over at once as before: they turn the
holding on to check it, the same code 0.6/0.7 run. The worker is stopped (SIGSTOP) to keep it booting for
as long as a test needs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import until
from trainer import compat
from trainer.checkpoint import CheckpointManager, committed_steps, step_dir
from trainer.checkpoint import writer as writer_module
from trainer.checkpoint.integrity import verify_files
from trainer.config import CheckpointConfig
from trainer.events import EventLog, read_events


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(32, 32, generator=g)}, "train": {"step": seed}}


def _saved(root, step: int) -> dict:
    loaded = {"model": {"w": torch.zeros(32, 32)}, "train": {"step": -1}}
    dcp.load(loaded, checkpoint_id=str(step_dir(root, step)))
    return loaded


@contextlib.contextmanager
def _booting_writer(tmp_path, process_group, monkeypatch):
    """A manager whose writer was started and is held in its boot (stopped) until the block's ``resume()``."""
    # The watch ends a rank whose writer stays stopped for STOPPED_S while a write is in flight: here the
    # stop is the test's own.
    monkeypatch.setattr(writer_module, "STOPPED_S", 600.0)
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    mgr.writer.holds_while_booting = True   # what 0.6+ set (see the module's docstring)
    mgr.start_writer()
    (worker,) = mgr.writer.writers
    os.kill(worker, signal.SIGSTOP)
    try:
        yield mgr, lambda: os.kill(worker, signal.SIGCONT)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
        mgr.close()


def _save_and_step(mgr: CheckpointManager, step: int) -> dict:
    """An interval save as the loop makes it: save, finish before the optimizer step, which then changes
    the live state (the checkpoint must hold the snapshot)."""
    live = _state(step)
    mgr.save(step, live)
    mgr.finish_snapshot()
    live["model"]["w"].add_(100.0)
    return live


def test_a_save_during_the_boot_is_handed_over_once_when_the_writer_is_warm(tmp_path, process_group, monkeypatch):
    with _booting_writer(tmp_path, process_group, monkeypatch) as (mgr, resume):
        _save_and_step(mgr, 4)
        queue = mgr.writer.queue
        # Held back: NVRx has only the warm-up request, and the save counts as in flight (its staging copy
        # is held, and the loop knows its writer is busy and cold).
        assert queue.get_num_unfinalized_calls() == 1 and mgr.writes_in_flight == 1 and mgr.writer.writes_done == 0
        mgr.maybe_finalize()                       # the top of a step while the worker still boots
        assert queue.get_num_unfinalized_calls() == 1 and not list(step_dir(mgr.root, 4).glob("*.distcp"))
        resume()
        # The top of every step: the first one after the warm-up finished hands the write over.
        assert until(lambda: (mgr.maybe_finalize(), mgr.writer.warm)[1], timeout=180)
        assert until(lambda: queue.call_idx == 1, timeout=60)   # the warm-up's 0, the write's 1: once
        assert mgr.writer.deferred == []
        assert until(lambda: (mgr.maybe_finalize(), mgr.writes_in_flight == 0)[1], timeout=120)
        mgr.wait()
        assert queue.call_idx == 1 and mgr.writer.writes_done == 1
        assert committed_steps(mgr.root) == [4]
        assert torch.equal(_saved(mgr.root, 4)["model"]["w"], _state(4)["model"]["w"])
        verify_files(step_dir(mgr.root, 4))   # every item holds the bytes staged when the save was taken
    handed = [e for e in read_events(tmp_path / "e") if e["event"] == "ckpt_handed_over"]
    assert len(handed) == 1 and handed[0]["booted"] and handed[0]["deferred_s"] > 0


def test_up_to_0_5_a_save_during_the_boot_is_queued_at_once(tmp_path, process_group, monkeypatch):
    """Where NVRx queues a request without waiting (0.4.1, 0.5), the writer hands it over at once."""
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        if mgr.writer.holds_while_booting:
            pytest.skip("the installed NVRx blocks on a booting worker: the writer holds saves there")
        mgr.start_writer()
        _save_and_step(mgr, 4)
        assert not mgr.writer.warm
        assert until(lambda: mgr.writer.queue.call_idx == 1, timeout=60)   # NVRx has it: warm-up 0, write 1
        mgr.wait()
        assert torch.equal(_saved(mgr.root, 4)["model"]["w"], _state(4)["model"]["w"])
    finally:
        mgr.close()


@pytest.mark.parametrize("then", ["wait", "blocking save"])
def test_a_save_held_during_the_boot_is_written_at_exit(tmp_path, process_group, monkeypatch, then):
    """The end of training (``wait``) and a stop (a blocking save, whose staging copy is the held one's)
    hand the held write over and wait for it: both checkpoints hold their own step's state."""
    with _booting_writer(tmp_path, process_group, monkeypatch) as (mgr, resume):
        _save_and_step(mgr, 4)
        assert mgr.writer.deferred and not mgr.writer.warm
        resume()
        if then == "wait":
            mgr.wait()
            assert committed_steps(mgr.root) == [4]
        else:
            mgr.save(6, _state(6), blocking=True)
            assert committed_steps(mgr.root) == [4, 6]
            assert torch.equal(_saved(mgr.root, 6)["model"]["w"], _state(6)["model"]["w"])
        assert torch.equal(_saved(mgr.root, 4)["model"]["w"], _state(4)["model"]["w"])
        for step in committed_steps(mgr.root):
            verify_files(step_dir(mgr.root, step))
        assert mgr.writer.queue.call_idx == (1 if then == "wait" else 2) and mgr.writes_in_flight == 0


def test_the_next_save_overwrites_the_staging_copy_only_after_the_held_write(tmp_path, process_group, monkeypatch):
    """The interleaving of the wrong-values write once seen on 0.4.1 (docs/nvrx.md): a save held while the
    worker boots, the live state changed in place by the steps after it, and the next save (the final, blocking
    one) handing the held write over while the worker still boots. That save must wait for the held write
    before it copies its own state into the staging copy the held write reads: otherwise the held checkpoint
    is committed with the later state's values (its checksums, taken when the copy was whole, would not match).
    The worker is let go only once the write was handed over, so the hand-over finds it booting every time."""
    with _booting_writer(tmp_path, process_group, monkeypatch) as (mgr, resume):
        live = _save_and_step(mgr, 12)           # held: the worker is stopped in its boot
        live["model"]["w"].add_(1.0)             # the next step changes the live state in place again
        handed_over = threading.Event()
        queue = mgr.writer.queue
        monkeypatch.setattr(queue, "schedule_async_request", _then(
            queue.schedule_async_request, lambda: mgr.writer.deferred or handed_over.set()))
        letting_go = threading.Thread(target=lambda: handed_over.wait(300) and resume(), daemon=True)
        letting_go.start()
        mgr.save(14, live, blocking=True)
        letting_go.join(300)
        assert handed_over.is_set() and committed_steps(mgr.root) == [12, 14]
        assert torch.equal(_saved(mgr.root, 12)["model"]["w"], _state(12)["model"]["w"])
        assert torch.equal(_saved(mgr.root, 14)["model"]["w"], live["model"]["w"])
        for step in (12, 14):
            verify_files(step_dir(mgr.root, step))
    handed = [e for e in read_events(tmp_path / "e") if e["event"] == "ckpt_handed_over"]
    # Step 12's handed over while the worker still booted; step 14's too if it was still being planned then.
    assert [e["booted"] for e in handed] in ([False], [False, True])


def test_a_write_nvrx_has_and_the_writer_did_not_count_keeps_the_staging_copy(tmp_path, process_group, monkeypatch):
    """The wrong-values write's two symptoms (docs/nvrx.md) are what one write too many in NVRx's queue gives,
    which the writer's own count does not know of: the next save overwrites the staging copy that write reads
    (the held checkpoint gets the later step's values), and the save's wait, one finalize behind, returns before
    its own results exist (its commit fails). Played here with the step-12 write given to NVRx a second time
    behind the writer's back, the worker stopped until the final save either overwrote the staging copy (and
    handed its write over) or waits for NVRx's write."""
    monkeypatch.setattr(writer_module, "STOPPED_S", 600.0)   # the test stops the worker itself
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(writer_nice=0), process_group,
                            EventLog(tmp_path / "e", 0))
    worker = None
    try:
        mgr.start_writer()
        (worker,) = mgr.writer.writers
        assert until(lambda: (mgr.maybe_finalize(), mgr.writer.warm)[1], timeout=180)
        requests = []     # the NVRx requests the writer built
        monkeypatch.setattr(mgr.writer, "_built", _kept(mgr.writer._built, requests))
        live = _save_and_step(mgr, 12)
        assert until(lambda: (mgr.maybe_finalize(), mgr.writes_in_flight == 0)[1], timeout=120)
        os.kill(worker, signal.SIGSTOP)
        mgr.writer.queue.schedule_async_request(requests[0])   # uncounted: the writer's count says 0
        resume = _once(lambda: os.kill(worker, signal.SIGCONT))
        # Let the worker go once the save handed its own write over (the staging copy overwritten) or said the
        # counts disagree (it waits for NVRx's write first).
        monkeypatch.setattr(mgr.writer, "schedule", _then(mgr.writer.schedule, resume))
        monkeypatch.setattr(mgr.writer, "_out_of_step", _then(mgr.writer._out_of_step, resume))
        mgr.save(14, live, blocking=True)
        assert committed_steps(mgr.root) == [12, 14]
        assert torch.equal(_saved(mgr.root, 12)["model"]["w"], _state(12)["model"]["w"])
        assert torch.equal(_saved(mgr.root, 14)["model"]["w"], live["model"]["w"])
        for step in (12, 14):
            verify_files(step_dir(mgr.root, step))
        assert mgr.writes_in_flight == 0 and mgr.writer.queue.get_num_unfinalized_calls() == 0
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        mgr.close()
    said = [e["what"] for e in read_events(tmp_path / "e") if e["event"] == "writes_miscounted"]
    assert said == ["NVRx's queue has a write that was not counted", "a write finished that was not counted"]


def _once(call):
    """``call`` the first time only."""
    done = []

    def first(*args):
        if not done:
            done.append(call())
    return first


def _then(call, after):
    """``call``, then ``after()``."""
    def both(*args, **kwargs):
        result = call(*args, **kwargs)
        after()
        return result
    return both


def _kept(call, results: list):
    """``call``, its results appended to ``results``."""
    def keeping(*args, **kwargs):
        results.append(call(*args, **kwargs))
        return results[-1]
    return keeping


def test_the_loop_waits_for_a_saves_copy_not_for_its_planning(tmp_path, process_group, monkeypatch):
    """From NVRx 0.7 planning a write clones every tensor of the staging copy: a second copy of the shard. It
    runs on the copy thread behind the copy, and the write is handed over at the top of the first step after
    it, the loop having waited for the copy only; the checkpoint holds the step's state."""
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        mgr.start_writer()
        _save_and_step(mgr, 2)
        mgr.wait()                                  # planned: the next planning runs on the copy thread
        planning = threading.Event()
        plan = mgr.staging.plan
        # Bounded, so that a loop that waits for the planning fails the assertions below instead of hanging.
        monkeypatch.setattr(mgr.staging, "plan", lambda *args: (planning.wait(20), plan(*args))[1])
        _save_and_step(mgr, 4)
        mgr.maybe_finalize()                        # the next step's top: still planning
        assert mgr.writer.deferred and mgr.writes_in_flight == 1
        planning.set()
        assert until(lambda: (mgr.maybe_finalize(), not mgr.writer.deferred)[1], timeout=60)
        mgr.wait()
        assert committed_steps(mgr.root) == [2, 4]
        assert torch.equal(_saved(mgr.root, 4)["model"]["w"], _state(4)["model"]["w"])
        verify_files(step_dir(mgr.root, 4))
    finally:
        mgr.close()


def test_the_loop_never_waits_for_a_hand_over(tmp_path, process_group, monkeypatch):
    """From NVRx 0.6 giving a write to the worker returns once the worker has received its tensors (on 0.7 a
    hundred milliseconds and more per save): the writer's own thread does it. Here NVRx's hand-over is held
    until the loop has finished the save and reached the next step's top: a loop that waited for it fails
    (the hold gives up after 10 s). The checkpoint holds the step's state."""
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        mgr.start_writer()
        assert until(lambda: (mgr.maybe_finalize(), mgr.writer.warm)[1], timeout=180)
        in_nvrx, loop_went_on = threading.Event(), threading.Event()
        queue = mgr.writer.queue
        schedule = queue.schedule_async_request

        def held(request):
            in_nvrx.set()
            assert loop_went_on.wait(10), "the loop waited for the hand-over"
            return schedule(request)

        monkeypatch.setattr(queue, "schedule_async_request", held)
        _save_and_step(mgr, 4)
        assert in_nvrx.wait(60)                     # the hand-over thread is in NVRx's queue
        mgr.maybe_finalize()                        # the next step's top
        loop_went_on.set()
        mgr.wait()
        assert committed_steps(mgr.root) == [4]
        assert torch.equal(_saved(mgr.root, 4)["model"]["w"], _state(4)["model"]["w"])
        verify_files(step_dir(mgr.root, 4))
    finally:
        mgr.close()


def test_a_write_that_cannot_be_handed_over_fails_the_loop_and_is_no_longer_in_flight(
        tmp_path, process_group, monkeypatch):
    """The hand-over runs on the writer's thread: what it fails with is raised at the loop's next step top (the
    attempt fails and the restart reports it), and the write, never given to NVRx, no longer holds the staging
    copy: the next save is written."""
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        mgr.start_writer()
        assert until(lambda: (mgr.maybe_finalize(), mgr.writer.warm)[1], timeout=180)
        save_request = compat.save_request

        def refused(*args):
            raise RuntimeError("no request for this write")

        monkeypatch.setattr(compat, "save_request", refused)
        _save_and_step(mgr, 4)
        raised = []

        def step_top() -> bool:
            try:
                mgr.maybe_finalize()
            except RuntimeError as e:
                raised.append(e)
            return bool(raised)

        assert until(step_top, timeout=60)
        assert str(raised[0]) == "no request for this write" and mgr.writes_in_flight == 0
        monkeypatch.setattr(compat, "save_request", save_request)
        _save_and_step(mgr, 8)
        mgr.wait()
        assert committed_steps(mgr.root) == [8]
        assert torch.equal(_saved(mgr.root, 8)["model"]["w"], _state(8)["model"]["w"])
    finally:
        mgr.close()
