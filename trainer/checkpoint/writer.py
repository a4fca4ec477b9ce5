"""This rank's NVRx checkpoint writer: a persistent worker process fed through ``AsyncCallsQueue``, the
write-results queue's manager process, and the watch that ends the rank when either hangs.

Both helpers ignore SIGTERM and SIGINT (the launcher signals a rank's whole process group, and they must
live on to write the final checkpoint the rank saves after it), and both die with their rank
(``PR_SET_PDEATHSIG``, ``_end_with``): a SIGKILLed rank cannot close them.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, ContextManager

import psutil

from .. import compat
from ..config import CheckpointConfig
from ..events import Event, EventLog
from ..signals import STOP_SIGNALS, STOPPED_S, StoppedFor, die_with_parent, handlers, is_gone

log = logging.getLogger(__name__)


def _stop_signals_ignored():
    """What is started inside ignores SIGTERM and SIGINT (inherited dispositions): see ``Writer.start``."""
    return handlers(dict.fromkeys(STOP_SIGNALS, signal.SIG_IGN))


_forked_managers: list[int] = []   # the write-results manager forked with a warm rank (fork_write_results_queue)


def _results_queue(context: str):
    """NVRx's write-results queue, its manager started in the ``context`` start method, dying with the rank
    (``PR_SET_PDEATHSIG``: a SIGKILLed rank cannot close it, and it never notices on its own)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context(context))
    manager.start(initializer=die_with_parent)
    return manager.Queue()    # the proxy keeps its manager alive


def fork_write_results_queue() -> None:
    """Create NVRx's write-results queue now, its manager forked from this process. Call only while the
    process runs a single thread and has imported torch: a rank forked from the warm-start zygote.

    NVRx otherwise spawns the manager when the writer starts: the rank blocks about 0.3 s for it, and the
    fresh interpreter imports torch (seconds of CPU, on the rank's cores) the first time it unpickles a
    write result. That is after every in-job restart, and where no save came between the restart and the
    end of training, the final, blocking save waited those seconds. A fork has torch already.
    """
    # It ignores SIGTERM, as the writers do (see Writer.start).
    with _stop_signals_ignored():
        before = _children()
        compat.set_write_results_queue(_results_queue("fork"))
        _forked_managers.extend(_children() - before)


def _children() -> set[int]:
    """PIDs of this process's children."""
    return {p.pid for p in psutil.Process().children()}


def _prepare_writer(module: str, rank_pid: int, companions: list[int]) -> None:
    """Runs in NVRx's persistent worker, once: tie its life to its rank's, and import the writer's module
    before the first write needs it."""
    compat.writer_ignores_sigterm()
    die_with_parent(parent=rank_pid)
    threading.Thread(target=_end_with, args=(rank_pid, companions), name="end-with-rank", daemon=True).start()
    importlib.import_module(module)


def _end_with(rank_pid: int, companions: list[int]) -> None:
    """In the worker: once its rank is gone, end the ``companions`` (the write-results queue's manager) and
    this process.

    A rank ended by SIGKILL cannot close its queue, and the worker would wait on it forever, holding the
    staging copy's shared memory. Under the warm start the zygote ends the rank's process group anyway;
    with ``--no-warm-start`` (or torchrun) every in-job restart would leave them behind.
    """
    while os.getppid() == rank_pid:
        time.sleep(0.5)
    for pid in companions:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(1)


class Writer:
    """The rank's writer process, what it has in flight, and the thread that hands writes to it.

    Args:
        cfg: checkpoint section of the config (``--ckpt-writer-nice``, ``--ckpt-write-timeout-s``).
        rank: this process's rank (for messages).
        events: the run's event log (``helper_hung``).
    """

    def __init__(self, cfg: CheckpointConfig, rank: int, events: EventLog):
        self.cfg, self.rank, self.events = cfg, rank, events
        self.queue = None
        self.writes_in_flight = 0   # scheduled and not finalized: they read the staging copy
        self.writes_done = 0        # finished by this process's worker (none yet: it may still be booting)
        self.warm = False           # the worker's warm-up request finished: it has booted
        self.deferred: list = []    # (request, planned, when scheduled, step, held for the boot): not handed over yet
        # NVRx blocks in schedule_async_request on a booting worker where requests carry preload_fn (0.6+);
        # up to 0.5 it queues them.
        self.holds_while_booting = compat.installed_release().preload_builds_buckets
        self.writers: list[int] = []    # the worker's pid, once started
        self.helpers: list[int] = []    # the worker's and the write-results manager's
        self.write_started = 0.0        # when the oldest write in flight was scheduled
        # The attempt's atomic() (the in-process Wrapper's): every change the loop makes to what is in flight,
        # here and in NVRx's queue, runs inside it. A restart's asynchronous exception landing between two of
        # its steps (a completion taken, its call not finalized) would leave a write that never finishes: the
        # rank would wait for it until the write timeout ended it, its checkpoints owed meanwhile.
        self.atomic: Callable[[], ContextManager] = contextlib.nullcontext
        # The hand-over thread and the loop share NVRx's queue (``_nvrx``: the loop never waits for it) and the
        # held writes and counts (``_held``, held briefly; it wakes the thread).
        self._nvrx = threading.Lock()
        self._held = threading.Condition()
        self._rush = False      # a caller waits for every held write: hand them to a booting worker too
        self._closing = False
        self._failed: BaseException | None = None   # what a hand-over failed with, raised on the loop

    @property
    def started(self) -> bool:
        return self.queue is not None

    def start(self) -> None:
        """Start NVRx's persistent worker process, its results-queue manager and the hand-over thread, if not
        running yet.

        Called once the state is restored (``Checkpointer.load``), before the first step: the worker is a
        spawned process that imports torch and the writer's module (seconds of CPU, niced), which then
        boots while the first steps run rather than while the ranks restore, and is warm as early as it can
        be for the first save. The warm-up request imports the writer's module; saves never wait for it
        (a write is held until it finished, a checkpoint due behind any write is owed, and a blocking save
        before it writes synchronously).
        """
        if self.cfg.sync or self.queue is not None:
            return
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue, AsyncRequest
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

        rel = compat.installed_release()

        # They ignore SIGTERM and SIGINT (inherited through spawn): the launcher signals the rank's whole
        # process group, and the writers must live on to finish the final checkpoint the rank writes after
        # it. They end when the rank closes the queue, or dies (_end_with, PR_SET_PDEATHSIG), or by SIGKILL.
        with _stop_signals_ignored():
            started = _children()
            if compat.write_results_queue() is None:   # not forked with the rank (a cold start)
                compat.set_write_results_queue(_results_queue("spawn"))
            compat.start_write_results_queue(rel)
            manager = _children() - started
            queue = AsyncCallsQueue(**compat.async_calls_queue_kwargs(rel, self.cfg.writer_nice))
            with self.atomic():
                self.queue, self.warm, self._closing = queue, False, False
                queue.schedule_async_request(
                    AsyncRequest(_prepare_writer, (FileSystemWriterAsync.__module__, os.getpid(), sorted(manager)),
                                 [self._warmed]))
        # The worker's niceness is set as it is born, not once it runs: its boot (importing torch, seconds
        # of CPU) would otherwise slow the steps after every restart wherever it shares cores with training.
        # Its write processes inherit it. Never lowered: that needs a privilege pods do not have.
        self.writers = sorted(_children() - started - manager)
        # A write ends once its results reach the manager: a stopped or dead manager hangs it as well.
        self.helpers = [*self.writers, *sorted(manager), *_forked_managers]
        threading.Thread(target=self._watch, name="ckpt-writer-watch", daemon=True).start()
        threading.Thread(target=self._hand_overs, name="ckpt-hand-over", daemon=True).start()
        for pid in self.writers:
            with contextlib.suppress(psutil.NoSuchProcess):
                child = psutil.Process(pid)
                child.nice(max(child.nice(), self.cfg.writer_nice))

    def schedule(self, request: Callable[[], Any], planned: Future, step: int) -> None:
        """Have step ``step``'s write handed to the worker: ``request()`` builds its NVRx ``AsyncRequest`` once
        ``planned`` (its planning, on the copy thread) is done.

        The hand-over thread does it, oldest write first, never the loop: from 0.6 NVRx's
        ``schedule_async_request`` returns only once the worker has run the request's preload function
        (``preload_q.join()``), which on 0.7 means receiving every tensor of the write through a
        multiprocessing queue (a copy into shared memory each) and building its buckets: a hundred
        milliseconds and more per save. The loop does not wait for the planning either (from 0.7 it clones
        every tensor of the staging copy). While the worker boots (a spawned interpreter importing torch),
        0.6+ would block the hand-over for the rest of the boot (``holds_while_booting``): the write waits
        for the warm-up request, unless a caller waits for it anyway (``finalize``). It is in flight from now:
        the staging copy it reads stays held (the next save finalizes it first) and the watch times it.
        """
        with self.atomic(), self._held:
            if not self.writes_in_flight:
                self.write_started = time.monotonic()
            self.writes_in_flight += 1
            self.deferred.append((request, planned, time.monotonic(), step, not self._takes_writes))
        planned.add_done_callback(lambda _: self._wake())
        self._wake()

    @property
    def _takes_writes(self) -> bool:
        """Whether the worker is handed writes now: it has booted, or NVRx queues them while it boots."""
        return self.warm or not self.holds_while_booting

    def _wake(self) -> None:
        with self._held:
            self._held.notify_all()

    def _next_ready(self) -> bool:
        """The oldest held write may go: planned (a failed planning is the loop's to raise), and the worker
        takes writes or a caller waits for them (``_rush``). Under ``_held``."""
        if not self.deferred:
            return False
        planned = self.deferred[0][1]
        return planned.done() and planned.exception() is None and (self._rush or self._takes_writes)

    def _hand_overs(self) -> None:
        """Thread: hand the held writes to NVRx's worker, oldest first, each once it may go."""
        while True:
            with self._held:
                self._held.wait_for(lambda: self._closing or self._next_ready())
                if self._closing:
                    return
                request, _, since, step, held_for_boot = self.deferred.pop(0)
                booted = self.warm
            with self._nvrx:
                t0 = time.monotonic()
                try:
                    self.queue.schedule_async_request(self._built(request))
                except BaseException as e:   # the loop raises it: the attempt fails, the restart reports it
                    with self._held:
                        self._failed = e
                    continue
                hand_over_s = time.monotonic() - t0
            if self.rank == 0:   # how long it was held, and how long the hand-over took (off the loop)
                self.events.emit(Event.CKPT_HANDED_OVER, step=step, deferred_s=round(t0 - since, 4),
                                 hand_over_s=round(hand_over_s, 4), booted=booted,
                                 **({"held_for_boot": True} if held_for_boot else {}))

    def _built(self, request: Callable[[], Any]) -> Any:
        """``request()``: a write whose request cannot be built is no longer in flight."""
        try:
            return request()
        except BaseException:
            with self._held:
                self.writes_in_flight -= 1
            raise

    def _raise_failed(self) -> None:
        """On the loop: raise what the oldest held write's planning, or a hand-over, failed with."""
        with self.atomic(), self._held:
            error, self._failed = self._failed, None
            if error is None and self.deferred:
                planned = self.deferred[0][1]
                if planned.done() and planned.exception() is not None:
                    error = planned.exception()
                    self.deferred.pop(0)
                    self.writes_in_flight -= 1
        if error is not None:
            raise error

    def drop_unplanned(self) -> None:
        """After a fault: drop the held writes whose planning failed (it ran on the copy thread after the fault,
        its process group gone, say): there is nothing to write, and the fault is what the rank reports."""
        for held in list(self.deferred):
            error = held[1].exception()   # waits for the planning
            if error is not None:
                with self.atomic(), self._held:
                    self.deferred.remove(held)
                    self.writes_in_flight -= 1
                log.info("checkpoint write of rank %d dropped: its planning failed after the fault (%s)", self.rank,
                         error)
        with self._held:
            self._failed = None   # a hand-over after the fault: the fault is what is reported

    def _warmed(self) -> None:
        """The warm-up request's finalize function (run on this rank): the worker has booted."""
        self.warm = True
        self._wake()

    def written(self) -> None:
        """Called on this rank (in its finalize) once the worker finished the oldest write in flight."""
        if self.writes_in_flight == 0:
            self._out_of_step("a write finished that was not counted")
        with self._held:
            self.writes_in_flight = max(0, self.writes_in_flight - 1)
            self.writes_done += 1
            self.write_started = time.monotonic()   # the next one in flight, if any, has been running since

    def _in_nvrx(self) -> int:
        """The writes NVRx's queue has not finalized: its unfinalized calls, less the warm-up while unfinished."""
        return self.queue.get_num_unfinalized_calls() - (0 if self.warm else 1) if self.queue is not None else 0

    def _out_of_step(self, what: str) -> None:
        """The writes counted here and those NVRx has disagree: said, once each time (the count follows NVRx's)."""
        counted, in_nvrx = self.writes_in_flight, self._in_nvrx()
        log.error("checkpoint writer of rank %d: %s (%d counted, %d in NVRx's queue)", self.rank, what, counted,
                  in_nvrx)
        self.events.emit(Event.WRITES_MISCOUNTED, rank=self.rank, what=what, counted=counted, in_nvrx=in_nvrx)

    @property
    def booting(self) -> bool:
        """Not started, or still booting with no write scheduled (its warm-up request is unfinished)."""
        if self.queue is None:
            return True
        self._finalize_finished()
        return self.writes_in_flight == 0 and not self.warm

    def maybe_finalize(self) -> None:
        """Top of a step: finalize finished writes (the warm-up's too), without blocking and without
        collectives; raise what a held write failed with."""
        if self.queue is not None:
            self._raise_failed()
            self._finalize_finished()

    def finalize(self, writes_only: bool = False) -> None:
        """Hand every held write over and finalize NVRx requests until none is left (with ``writes_only``:
        until no write is left).

        A write is left while it is counted here or NVRx's queue has it: the staging copy it reads is free
        only once both say so, so a count out of step with NVRx's can delay the next save but never let it
        overwrite the copy under a write. Polls every 5 ms: NVRx's own blocking finalize sleeps 100 ms
        between checks, which the loop would pay whenever a save waits for the previous write.
        """
        if self.queue is None:
            return
        with self._held:
            self._rush = True
            self._held.notify_all()
        try:
            said = False
            while True:
                self._raise_failed()
                self._finalize_finished()
                left = max(self.writes_in_flight, self._in_nvrx())
                if left and not self.writes_in_flight and not said:
                    said = True
                    self._out_of_step("NVRx's queue has a write that was not counted")
                if not (left or not writes_only and not self.warm):
                    return
                time.sleep(0.005)
        finally:
            with self._held:
                self._rush = False

    def _finalize_finished(self) -> None:
        """Run the finalize functions of the requests NVRx's worker finished, oldest first; no collectives.
        Not while the hand-over thread is in NVRx's queue: the loop never waits for a hand-over."""
        with self.atomic():
            if not self._nvrx.acquire(blocking=False):
                return
            try:
                self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            finally:
                self._nvrx.release()

    def close(self) -> None:
        # Rank-local finalize first (held writes too, still watched): NVRx's own close() would
        # synchronize ranks through CUDA.
        self.finalize()
        with self._held:
            self._closing = True   # ends the hand-over thread
            self._held.notify_all()
        self.helpers = []   # ends the watch: the writers exit now
        if self.queue is not None:
            self.queue.close()
            self.queue = None

    def _watch(self) -> None:
        """Thread: end this rank if a write is running on a helper (the writer, the write-results manager)
        that is gone or stopped (SIGSTOP) for ``STOPPED_S``, or on a write slower than
        ``--ckpt-write-timeout-s``: the write would never finish, and the loop would wait for it in NVRx's
        finalize (a blocking read of its results), at the next save or at the end of training. Ended like
        a dead rank (SIGKILL, after a ``helper_hung`` event), the in-job layer restarts it with new helpers."""
        hung = StoppedFor(STOPPED_S)
        while self.helpers:
            time.sleep(0.5)
            if not self.writes_in_flight:
                hung = StoppedFor(STOPPED_S)    # a stop counts only while a write waits on it
                continue
            now, why = time.monotonic(), None
            for pid in list(self.helpers):
                if is_gone(pid):
                    why = f"the checkpoint {self._helper(pid)} of rank {self.rank} (pid {pid}) is gone"
                elif hung(pid):
                    why = (f"the checkpoint {self._helper(pid)} of rank {self.rank} (pid {pid}) was stopped "
                           f"for {STOPPED_S:g}s")
            if why is None and now - self.write_started > self.cfg.write_timeout_s:
                why = (f"a checkpoint write of rank {self.rank} took more than {self.cfg.write_timeout_s:g}s "
                       f"(--ckpt-write-timeout-s)")
            if why is not None:
                log.error("%s: ending this rank so that the in-job layer restarts it with new helpers", why)
                self.events.emit(Event.HELPER_HUNG, reason=why)
                for pid in self.helpers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    def _helper(self, pid: int) -> str:
        return "writer" if pid in self.writers else "write-results manager"
