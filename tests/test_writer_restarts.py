"""An in-process restart interrupts a rank's main thread wherever it is: the Wrapper's monitor thread takes the
Wrapper's atomic lock and raises the restart's exception into it. Landing inside the checkpoint writer's
bookkeeping with NVRx's queue (a completion taken and its call not finalized, a call popped and its finalize
functions not run), it left a write that never finished: the rank waited for it until the write timeout
(300 s) ended it, and checkpointed nothing meanwhile. The writer keeps the loop's bookkeeping inside the
attempt's ``atomic()``, so the restart lands before or after it; writes are handed to the worker on a thread of
the writer's own, which a restart never interrupts (the fault comes while it is in NVRx's queue: ``handed
over``).

Real NVRx queue and worker on the installed release; the Wrapper's part is played by ``_Wrapper``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from nvidia_resiliency_ext.checkpointing.async_ckpt import core

from tests.conftest import until
from trainer.checkpoint import CheckpointManager, committed_steps, step_dir
from trainer.checkpoint import writer as writer_module
from trainer.checkpoint.integrity import verify_files
from trainer.config import CheckpointConfig
from trainer.events import EventLog


class _Restart(Exception):
    """The in-process restart's exception (NVRx's RankShouldRestart)."""


class _Wrapper:
    """The in-process Wrapper around one fault: its atomic() (a re-entrant lock) and its monitor thread, which
    raises the restart's exception into the main thread once it holds that lock. Played without the thread: the
    exception is raised where the fault comes unless the main thread is inside atomic(), else at the top of the
    first step after it left it (``deliver``), where the monitor's would have landed by then."""

    def __init__(self):
        self.lock = threading.RLock()
        self.pending = False

    @contextlib.contextmanager
    def atomic(self):
        with self.lock:
            yield

    def fault(self) -> None:
        """Another rank failed now: the exception is for the main thread (the writer's hand-over thread may be
        where the fault comes)."""
        if self.lock._is_owned() or threading.current_thread() is not threading.main_thread():
            self.pending = True
        else:
            raise _Restart

    def deliver(self) -> None:
        if self.pending:
            self.pending = False
            raise _Restart


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g)}, "train": {"step": seed}}


def _saved(root, step: int) -> torch.Tensor:
    loaded = {"model": {"w": torch.zeros(64, 64)}, "train": {"step": -1}}
    dcp.load(loaded, checkpoint_id=str(step_dir(root, step)))
    return loaded["model"]["w"]


def _is_write(request) -> bool:
    return getattr(request.async_fn, "__name__", "") != "_prepare_writer"


def _fault_once(monkeypatch, wrapper: _Wrapper, where: str) -> threading.Event:
    """Make the fault come at ``where`` in NVRx's queue, once a write gets there; the event is set then."""
    fired = threading.Event()

    def fault():
        if not fired.is_set():
            fired.set()
            wrapper.fault()

    if where == "completion taken":
        done = core.PersistentAsyncCaller.is_current_async_call_done

        def checked(caller, *args, **kwargs):
            result = done(caller, *args, **kwargs)
            if result:   # the warm-up was finalized before: a write's
                fault()
            return result

        monkeypatch.setattr(core.PersistentAsyncCaller, "is_current_async_call_done", checked)
    elif where == "finalize functions not run":
        run = core.AsyncRequest.execute_finalize_fns

        def finalizing(request, *args, **kwargs):
            if _is_write(request):
                fault()
            return run(request, *args, **kwargs)

        monkeypatch.setattr(core.AsyncRequest, "execute_finalize_fns", finalizing)
    else:   # "handed over"
        schedule = core.PersistentAsyncCaller.schedule_async_call

        def scheduled(caller, request):
            schedule(caller, request)
            if _is_write(request):
                fault()

        monkeypatch.setattr(core.PersistentAsyncCaller, "schedule_async_call", scheduled)
    return fired


def _steps_until_restarted_and_written(mgr: CheckpointManager, wrapper: _Wrapper, fired: threading.Event) -> None:
    """The tops of the loop's steps (``maybe_finalize``), restarted by the fault wherever it lands in them, until
    the restart came and no write is in flight."""
    restarts, deadline = 0, time.monotonic() + 60
    while not (restarts and mgr.writes_in_flight == 0):
        try:
            assert time.monotonic() < deadline, (
                f"fault {'came' if fired.is_set() else 'did not come'}, {restarts} restart(s), "
                f"{mgr.writes_in_flight} write(s) in flight, NVRx's queue "
                f"{[c.idx for c in mgr.writer.queue.async_calls]}")
            wrapper.deliver()
            mgr.maybe_finalize()
            time.sleep(0.01)
        except _Restart:
            restarts += 1
    assert restarts == 1


@pytest.mark.parametrize("where", ["completion taken", "finalize functions not run", "handed over"])
def test_a_restart_landing_in_the_writers_bookkeeping_leaves_no_write_unfinished(
        tmp_path, process_group, monkeypatch, where):
    monkeypatch.setattr(writer_module, "STOPPED_S", 600.0)   # the test stops the worker itself (held saves)
    # No write timeout: a write left unfinished fails the test, it must not end the test's process. Not niced:
    # on cores busy with other work the worker's boot would wait for them.
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(write_timeout_s=1e6, writer_nice=0), process_group,
                            EventLog(tmp_path / "e", 0))
    wrapper = _Wrapper()
    mgr.guard_writer(wrapper.atomic)
    held = where == "handed over"
    mgr.writer.holds_while_booting = held   # 0.6+ hold a save while the worker boots: hand-overs at a step's top
    worker = None
    try:
        mgr.start_writer()
        (worker,) = mgr.writer.writers
        if held:
            os.kill(worker, signal.SIGSTOP)   # booting until the save below is held
        else:
            assert until(lambda: (mgr.maybe_finalize(), mgr.writer.warm)[1], timeout=180)
        fired = _fault_once(monkeypatch, wrapper, where)
        live = _state(4)
        with wrapper.atomic():   # the Checkpointer's save and the wait before the optimizer step
            mgr.save(4, live)
            mgr.finish_snapshot()
        live["model"]["w"].add_(100.0)
        if held:
            assert mgr.writer.deferred
            os.kill(worker, signal.SIGCONT)
        _steps_until_restarted_and_written(mgr, wrapper, fired)
        # The restart resumes from the staging copy (the step-4 state), and the loop goes on.
        live = _state(4)
        mgr.restore(live)
        live = _state(8)
        with wrapper.atomic():
            mgr.save(8, live)
            mgr.finish_snapshot()
        mgr.wait()
        assert committed_steps(mgr.root) == [4, 8]
        for step in (4, 8):
            assert torch.equal(_saved(mgr.root, step), _state(step)["model"]["w"])
            verify_files(step_dir(mgr.root, step))
    finally:
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        if mgr.writes_in_flight:   # one never finishes (the failure): end the worker rather than wait for it
            mgr.writer.helpers = []   # first end the watch, which would end this process
            for watch in [t for t in threading.enumerate() if t.name == "ckpt-writer-watch"]:
                watch.join()
            caller = mgr.writer.queue.persistent_caller   # NVRx's close() would wait for the worker forever
            caller.process.kill()
            caller.process.join()
            caller.process = None
        else:
            mgr.close()
