"""Sharded DCP checkpoints written in the background by NVRx, with an atomic commit protocol.

Layout under ``<out>/checkpoints/``::

    step_000000100/   __<rank>_<i>.distcp   shards (written and fsynced by each rank's NVRx worker)
                      .rank<r>.done          rank r's write results, written when its worker finished
                      .metadata              DCP metadata (rank 0, once every rank is done)
                      COMMITTED              JSON marker, written last through a rename

A directory is a checkpoint only once ``COMMITTED`` exists. Anything else (a crash mid-write, a rank
that died) is torn: never loaded, and deleted at the next start.

An async save, in the order the training loop sees it:
  1. ``save``: DCP planning runs on a shared-memory staging copy of the state, and a background thread
     starts copying the state's tensors into it (on GPU: device-to-host on a side stream). The staging
     tensors are the same objects at every save, so the plan made at the first saves is reused for as
     long as the state's structure (keys, shapes, dtypes) is unchanged; a changed structure gets new
     staging and is planned afresh.
  2. The loop runs the next step's forward and backward passes while the copy runs: they only read the
     parameters. ``finish_snapshot``, called before the optimizer step changes the state, waits for the
     copy (usually done by then) and hands the write to NVRx's persistent worker process through
     ``AsyncCallsQueue``. The loop is blocked only for planning and for whatever of the copy is left.
  3. ``maybe_finalize`` (top of every step): finalizes this rank's finished writes without blocking
     and without collectives (``no_dist=True``) by writing ``.rank<r>.done``. Rank 0 commits a step
     once all ranks' done files exist: ``.metadata``, then ``COMMITTED``.
  4. ``wait`` (exit, SIGTERM): blocking finalize on every rank, barrier, commit.

Commit needs no collective, so ranks never stall on each other's disks and a dead rank simply leaves
a torn directory behind.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import pickle
import shutil
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from . import compat
from .config import CheckpointConfig
from .events import EventLog
from .layout import COMMITTED, committed_steps, fsync_dir, read_marker, replica_dir, step_dir, step_of, write_atomic
from .mirror import CheckpointMirror, maybe_fetch_from_mirror
from .parallel import Dist
from .replica import NodeReplica
from .signals import STOP_SIGNALS, die_with_parent
from .warmstart import STOPPED_S

log = logging.getLogger(__name__)

StateSource = dict | Callable[[], dict]   # a state dict, or a function that builds one


@contextlib.contextmanager
def _stop_signals_ignored():
    """What is started inside ignores SIGTERM and SIGINT (inherited dispositions): see ``start_writer``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


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
    # It ignores SIGTERM, as the writers do (see start_writer).
    with _stop_signals_ignored():
        before = _children()
        compat.set_write_results_queue(_results_queue("fork"))
        _forked_managers.extend(_children() - before)


def delete_checkpoint(path: Path) -> None:
    """Un-commit first (marker gone, fsynced), then delete: a half-deleted directory is never valid."""
    try:
        (path / COMMITTED).unlink()
        fsync_dir(path)
    except FileNotFoundError:
        pass
    shutil.rmtree(path, ignore_errors=True)


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


class HelperHung(RuntimeError):
    """A helper process of this rank (its rank monitor) is gone or stopped answering.

    Restarting the training function in the same process would meet the same helper, so the in-process
    layer passes it on to the in-job one, which starts the rank and its helpers afresh."""


class _StructureChanged(Exception):
    pass


def _staged(live: Any, staged: Any, pairs: list) -> Any:
    """``live``'s structure with the tensors of ``staged`` (the staging copy) and ``live``'s other values.

    Appends each (live, staging) pair of local tensors to ``pairs`` for one batched copy. Raises
    ``_StructureChanged`` unless both have the same keys, and tensors the same type, shape and dtype.
    """
    if isinstance(live, torch.Tensor):
        if (not isinstance(staged, torch.Tensor) or isinstance(staged, DTensor) != isinstance(live, DTensor)
                or staged.shape != live.shape or staged.dtype != live.dtype):
            raise _StructureChanged
        if not isinstance(live, DTensor):
            pairs.append((live, staged))
        elif compat.local_tensor(staged).shape == compat.local_tensor(live).shape:
            pairs.append((compat.local_tensor(live), compat.local_tensor(staged)))
        else:   # the same global shape, sharded differently
            raise _StructureChanged
        return staged
    if isinstance(live, dict):
        if not isinstance(staged, dict) or staged.keys() != live.keys():
            raise _StructureChanged
        return {k: _staged(v, staged[k], pairs) for k, v in live.items()}
    if isinstance(live, (list, tuple)):
        if type(staged) is not type(live) or len(staged) != len(live):
            raise _StructureChanged
        return type(live)(_staged(v, s, pairs) for v, s in zip(live, staged))
    return live


def _staged_into(state: dict, buffer: dict | None, allocate: Callable[[dict], dict]) -> tuple[dict, dict, list]:
    """(buffer, snapshot, pairs): ``_staged`` into ``buffer``, or into a new one from ``allocate(state)``
    when there is none yet or the state's structure changed."""
    if buffer is not None:
        try:
            pairs: list = []
            return buffer, _staged(state, buffer, pairs), pairs
        except _StructureChanged:
            pass
    buffer, pairs = allocate(state), []
    return buffer, _staged(state, buffer, pairs), pairs


class _StagingPlanner(DefaultSavePlanner):
    """DCP's default save planner, kept for the life of one staging copy.

    Every save into that copy has the same tensors, so flattening the state and resolving the tensor
    behind each write item are done once; later saves only refresh the non-tensor values (the loop
    counters, scheduler and ft state). Those are serialized again only when their pickle changed:
    ``torch.save`` costs ~0.1 ms per value, and most (optimizer hyperparameters) never change.
    """

    def __init__(self):
        super().__init__()
        self._values: list[str] | None = None     # flattened keys of the non-tensor values, once set up
        self._tensors: dict = {}                  # write item index -> resolved tensor
        self._bytes: dict = {}                    # write item index -> (pickle of the value, serialized value)

    def set_up_planner(self, state_dict, *args, **kwargs) -> None:
        if self._values is None:
            super().set_up_planner(state_dict, *args, **kwargs)
            self._values = [k for k, v in self.state_dict.items() if not isinstance(v, torch.Tensor)]
            return
        for key in self._values:
            value = state_dict
            for part in self.mappings[key]:
                value = value[part]
            self.state_dict[key] = value

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            key = pickle.dumps(self.lookup_object(write_item.index))
            cached = self._bytes.get(write_item.index)
            if cached is None or cached[0] != key:
                cached = self._bytes[write_item.index] = (key, super().resolve_data(write_item))
            return cached[1]
        tensor = self._tensors.get(write_item.index)
        if tensor is None:
            tensor = self._tensors[write_item.index] = super().resolve_data(write_item)
        return tensor


@dataclass
class _Pending:
    step: int
    started: float
    writer: Any = None      # rank 0: the NVRx FileSystemWriterAsync, needed to write .metadata
    metadata: Any = None    # rank 0: the global DCP metadata from planning


@dataclass
class _Snapshot:
    """A copy of the state that is running: between ``save`` (or ``snapshot_to_memory``) and
    ``finish_snapshot``."""

    step: int
    state: dict | None      # the snapshot: the copy's tensors and the state's other values
    copy: Future            # the background copy; its result is the seconds it took
    request: Any            # the NVRx AsyncRequest that writes the snapshot (None: kept in memory only)
    pending: _Pending | None
    blocked_s: float        # how long the call that started it held the caller
    phases: dict
    slot: int = 0           # a memory snapshot's replica slot


class CheckpointManager:
    """Saves and loads the training state; owns the commit protocol and retention.

    Args:
        root: ``<out>/checkpoints``.
        cfg: checkpoint section of the config.
        d: this process's distributed context.
        events: the run's event log (rank 0 records checkpoint phases).
        on_write_started: test and fault-injection hook, called on every rank after a save was handed
            to the writer and before the loop continues.
        run_id: names the run across its restarts (rank 0's counts; the others learn it in ``restore``).
    """

    def __init__(self, root: Path, cfg: CheckpointConfig, d: Dist, events: EventLog,
                 on_write_started: Callable[[int], None] | None = None, run_id: str | None = None):
        self.root, self.cfg, self.d, self.events, self.run_id = root, cfg, d, events, run_id
        self.root.mkdir(parents=True, exist_ok=True)
        self.on_write_started = on_write_started
        self.pending: deque[_Pending] = deque()
        # The shared-memory copy of the last snapshot (reused by every save), and that snapshot's step.
        self.staging: dict | None = None
        self.snapshot: dict | None = None
        self.snapshot_step: int | None = None
        # The in-memory replica (snapshot_to_memory): two slots in node-local shared memory, which a rank
        # started by an in-job restart finds again (trainer/replica.py).
        self.node = NodeReplica(replica_dir(Path(cfg.memory_dir), root), d.rank, pin=d.device.type == "cuda")
        self.replicas: list[dict | None] = [None, None]   # the slots' buffers, as mapped by this attempt
        self.replica_snapshot: dict | None = None         # the newest complete replica, once read
        marker = self.node.marked()
        self.replica_step: int | None = marker["step"] if marker else None
        self.replica_slot: int = marker["slot"] if marker else 1
        # A replica left by an earlier process may be another run's (the same output directory started
        # afresh): it is used only by the run that made it.
        self.replica_run: str | None = marker.get("run") if marker else None
        self.replica_copy_s = 0.0   # how long the last copy into the replica took (the policy spaces them)
        # Planning state of the current staging copy (see _StagingPlanner), replaced with it.
        self.plan_cache = self.planner = None
        self.writes_in_flight = 0   # handed to the worker and not finalized: they read the staging copy
        self.writes_done = 0        # finished by this process's worker (none yet: it may still be booting)
        self.writers: list[int] = []    # the worker's pid, once started
        self.helpers: list[int] = []    # the worker's and the write-results manager's
        self.write_started = 0.0        # when the oldest write in flight was handed over
        self.copying: _Snapshot | None = None
        # Called with the blocking seconds of every interval save (the interval policy, the metrics).
        self.on_snapshot: Callable[[float], None] | None = None
        self.queue = self.copy_stream = None
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy")
        if d.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(d.device)
        self._purger: threading.Thread | None = None
        # Rank 0 commits, so rank 0 mirrors (--ckpt-mirror): a background uploader fed by _commit.
        self.mirror = CheckpointMirror(root, cfg, events) if cfg.mirror and d.is_main else None

    def start_writer(self) -> None:
        """Start NVRx's persistent worker process and its results-queue manager, if not running yet.

        Called by the loop once the first step after a (re)start is done, not here in the constructor:
        the worker is a spawned process that imports torch and the writer's module (seconds of CPU), and
        on a restart that CPU would be taken from the ranks while they restore. No checkpoint needs the
        writer before then (a blocking save before it writes synchronously). The warm-up request imports
        the writer's module; saves never wait for it (it does not read the staging copy).
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
            self.queue = AsyncCallsQueue(**compat.async_calls_queue_kwargs(rel, self.cfg.writer_nice))
            self.queue.schedule_async_request(
                AsyncRequest(_prepare_writer, (FileSystemWriterAsync.__module__, os.getpid(), sorted(manager)), []))
        # The worker's niceness is set as it is born, not once it runs: its boot (importing torch, seconds
        # of CPU) would otherwise slow the steps after every restart wherever it shares cores with training.
        # Its write processes inherit it. Never lowered: that needs a privilege pods do not have.
        self.writers = sorted(_children() - started - manager)
        # A write ends once its results reach the manager: a stopped or dead manager hangs it as well.
        self.helpers = [*self.writers, *sorted(manager), *_forked_managers]
        threading.Thread(target=self._watch_writer, name="ckpt-writer-watch", daemon=True).start()
        for pid in self.writers:
            with contextlib.suppress(psutil.NoSuchProcess):
                child = psutil.Process(pid)
                child.nice(max(child.nice(), self.cfg.writer_nice))

    def _watch_writer(self) -> None:
        """Thread: end this rank if a write is running on a helper (the writer, the write-results manager)
        that is gone or stopped (SIGSTOP) for ``STOPPED_S``, or on a write slower than
        ``--ckpt-write-timeout-s``: the write would never finish, and the loop would wait for it in NVRx's
        finalize (a blocking read of its results), at the next save or at the end of training. Ended like
        a dead rank (SIGKILL, after a ``helper_hung`` event), the in-job layer restarts it with new helpers."""
        stopped_since = None
        while self.helpers:
            time.sleep(0.5)
            if not self.writes_in_flight:
                stopped_since = None
                continue
            now, why, stopped = time.monotonic(), None, False
            for pid in list(self.helpers):
                try:
                    status = psutil.Process(pid).status()
                except psutil.NoSuchProcess:
                    status = psutil.STATUS_DEAD
                if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                    why = f"the checkpoint {self._helper(pid)} of rank {self.d.rank} (pid {pid}) is gone"
                elif status == psutil.STATUS_STOPPED:
                    stopped, stopped_since = True, stopped_since or now
                    if now - stopped_since > STOPPED_S:
                        why = (f"the checkpoint {self._helper(pid)} of rank {self.d.rank} (pid {pid}) was stopped "
                               f"for {STOPPED_S:g}s")
            stopped_since = stopped_since if stopped else None
            if why is None and now - self.write_started > self.cfg.write_timeout_s:
                why = (f"a checkpoint write of rank {self.d.rank} took more than {self.cfg.write_timeout_s:g}s "
                       f"(--ckpt-write-timeout-s)")
            if why is not None:
                log.error("%s: ending this rank so that the in-job layer restarts it with new helpers", why)
                self.events.emit("helper_hung", reason=why)
                for pid in self.helpers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)

    def _helper(self, pid: int) -> str:
        return "writer" if pid in self.writers else "write-results manager"

    # ----------------------------------------------------------------------------------------- load
    def restore(self, state: dict) -> tuple[int | None, str, dict]:
        """Restore the newest state into ``state``; return (step or None, source, the restored dict).

        Every rank may hold snapshots in memory: after an in-process restart, the staging copy of its last
        save; and the replica of its last ``snapshot_to_memory``, which also survives an in-job restart on
        the same node. The newest step that every rank holds, if no committed checkpoint is newer, is
        copied back (``memory``: no disk read). Otherwise the newest committed checkpoint is loaded
        (``checkpoint``). Collective: call on every rank.
        """
        self.finish_snapshot()   # a fault can come while a snapshot is copied: the copy still completes
        if self.replica_step is not None and self.replica_snapshot is None:
            # Left by an earlier process or attempt: read back against the live state's structure.
            loaded = self.node.load(state)
            self.replica_step, self.replica_slot, self.replica_snapshot = loaded or (None, self.replica_slot, None)
        steps = committed_steps(self.root) if self.d.is_main else []
        held = [None] * self.d.world_size
        # Sync point: which snapshot steps each rank holds in memory (the replica's with the run that made
        # it), and rank 0's run and newest committed step.
        dist.all_gather_object(held, (self.snapshot_step, self.replica_step, self.replica_run, self.run_id,
                                      steps[-1] if steps else None))
        self.run_id, committed = held[0][3], held[0][4]
        everywhere = set.intersection(*({h[0], h[1] if h[2] == self.run_id else None} - {None} for h in held))
        usable = {s for s in everywhere if committed is None or s >= committed}
        if usable:
            step, source = max(usable), "memory"
            copy_state_dict, _ = compat.cpu_state_dict_helpers()
            restored = copy_state_dict(self.snapshot if step == self.snapshot_step else self.replica_snapshot, state)
            self.events.emit("ckpt_loaded", step=step, source=source)
        else:
            step, source, restored = self._load_committed(state), "checkpoint", state
            if step is None:   # a fresh start: whatever replica is left belongs to no run
                self.drop_replica()
        # The new process group gets fresh staging buffers and plans: the old ones describe DTensors of the
        # previous group's device mesh. A write still in flight keeps its own mapping of the old buffers.
        # Allocating them now keeps that cost out of the first save's blocking time. (Not on the copier
        # thread: the caller goes on to load ``restored`` into the model and optimizer, which mutates it.)
        # The replica's marker still names its newest slot, which the next copy leaves alone.
        self.snapshot = self.snapshot_step = None
        self.staging = None
        self.replicas, self.replica_snapshot = [None, None], None
        if not self.cfg.sync:
            self._allocate_staging(restored)
        return step, source, restored

    def _allocate_staging(self, state: dict) -> dict:
        """New staging copy shaped like ``state``, with a new planner: its first saves plan from scratch
        (collectives: every rank must allocate at the same save, as they do when the structure changes)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import CheckpointMetadataCache

        # Shared memory: NVRx's persistent worker receives the tensors without another copy.
        _, create_cpu_state_dict = compat.cpu_state_dict_helpers()
        self.staging = create_cpu_state_dict(state, share_memory=True, pin_memory=self.d.device.type == "cuda")
        # NVRx reuses the global save plan once it is stable: later saves plan without collectives.
        self.plan_cache, self.planner = CheckpointMetadataCache(), _StagingPlanner()
        return self.staging

    def _stage(self, state: dict) -> tuple[dict, list]:
        """The snapshot of ``state`` (staging tensors, and the state's other values) and the (live, staging)
        tensor pairs to copy; new staging if the structure changed. Copies nothing."""
        self.staging, snapshot, pairs = _staged_into(state, self.staging, self._allocate_staging)
        return snapshot, pairs

    def _start_copy(self, pairs: list) -> Future:
        """Start the copy of ``pairs`` on the copier thread."""
        ready = None
        if self.copy_stream is not None:
            ready = torch.cuda.Event()
            ready.record()   # on the loop's stream: the state as the last optimizer step left it
        return self.copier.submit(self._copy, pairs, ready)

    def _copy(self, pairs: list, ready: torch.cuda.Event | None) -> float:
        """Background thread: copy the live tensors into the staging copy; return the seconds it took.

        One batched copy: per-tensor copies cost ~10% more for the few hundred tensors of a model. It
        releases the GIL, so the loop's forward and backward passes run meanwhile.
        """
        t0 = time.monotonic()
        staging, live = [s for _, s in pairs], [t for t, _ in pairs]
        if self.copy_stream is None:
            compat.foreach_copy(staging, live)
        else:
            # Device-to-host into pinned memory on a side stream, ordered after the optimizer step that
            # produced the state; the next step's kernels run on the default stream meanwhile.
            with torch.cuda.device(self.d.device), torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(ready)
                compat.foreach_copy(staging, live, non_blocking=True)
            self.copy_stream.synchronize()
        return time.monotonic() - t0

    def _load_committed(self, state: dict) -> int | None:
        """Load the newest committed checkpoint into ``state`` in place; return its step or None.

        Rank 0 picks the step and deletes torn directories first; the choice is broadcast so every rank
        loads the same checkpoint.
        """
        if self.cfg.mirror:
            # Collective: with no committed checkpoint on FSx, rank 0 first fetches the newest mirrored one.
            maybe_fetch_from_mirror(self.root, self.cfg, self.d, self.events)
        choice = [None]
        if self.d.is_main:
            steps = committed_steps(self.root)
            choice[0] = steps[-1] if steps else None
            self._delete_torn(older_than=None if not self.pending else self.pending[0].step)
        # Sync point: every rank waits for rank 0's choice (and its clean-up of torn directories).
        dist.broadcast_object_list(choice, src=0)
        step = choice[0]
        if step is None:
            return None
        path = step_dir(self.root, step)
        marker = read_marker(path)
        if marker["world_size"] != self.d.world_size:
            raise RuntimeError(f"{path} was written by {marker['world_size']} ranks but this run has "
                               f"{self.d.world_size}; exact resume needs the same number of ranks")
        t0 = time.monotonic()
        dcp.load(state, checkpoint_id=str(path))
        self.events.emit("ckpt_loaded", step=step, source="checkpoint", load_s=round(time.monotonic() - t0, 4))
        return step

    # ----------------------------------------------------------------------------------------- save
    def save(self, step: int, state: StateSource, *, blocking: bool = False) -> None:
        """Checkpoint ``state`` as step ``step``. Must be called on every rank with the same step.

        ``state``: the state dict, or a function that builds it (then building it counts as blocking time).

        Async (the default), it returns once the copy of ``state`` has started: the caller may run forward
        and backward passes, but must call ``finish_snapshot`` before it changes the state. With ``blocking``
        (SIGTERM, end of training), and with ``--ckpt-sync``, it returns once the checkpoint is committed.
        """
        t0 = time.monotonic()
        state = state() if callable(state) else state
        path = step_dir(self.root, step)
        if self.d.is_main:
            self.events.emit("ckpt_start", step=step)
        if self.cfg.sync or (blocking and self._writer_cold()):
            dcp.save(state, checkpoint_id=str(path))
            if self.on_write_started:
                self.on_write_started(step)
            # Sync point: every rank's shards are on disk before rank 0 commits.
            dist.barrier()
            if self.d.is_main:
                self._commit(_Pending(step, t0), results=None)
            self._snapshot_taken(step, time.monotonic() - t0, sync=True, interval=not blocking)
            return
        self._save_async(step, state, path, t0)
        if blocking:
            self.finish_snapshot(report=False)
            self.wait()
            self._snapshot_taken(step, time.monotonic() - t0, sync=True, interval=False)

    def _writer_cold(self) -> bool:
        """Whether some rank's writer is not started, or still booting with no write queued (collective).

        A blocking save then writes synchronously (SIGTERM or the end of training soon after a start):
        faster than waiting for the writer to boot.
        """
        cold = self.queue is None
        if not cold:
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            cold = self.writes_in_flight == 0 and self.queue.get_num_unfinalized_calls() > 0
        flag = torch.tensor([float(cold)], device=self.d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)   # sync point: every rank takes the same path
        return flag.item() > 0

    def _save_async(self, step: int, state: dict, path: Path, t0: float) -> None:
        """Plan the write and start the copy; ``self.copying`` records where the blocking time went (wait,
        commit, stage, plan, start)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan

        self.start_writer()
        # The staging copy is reused, so the previous snapshot must be whole and its write finished before
        # it is overwritten.
        self.finish_snapshot()
        self._finalize(writes_only=True)
        t_wait = time.monotonic()
        if self.snapshot_step is not None:
            # Sync point: every rank has recorded the previous write, so rank 0 commits it now; otherwise a
            # crash during this save would lose a checkpoint that was already whole on disk. The condition must
            # be the same on every rank: ``pending`` is not (a non-zero rank drops a step once its own part is
            # written, rank 0 only once every part is), and a barrier on rank 0 alone deadlocks the loop.
            dist.barrier()
            self._maybe_commit()
        t_commit = time.monotonic()
        snapshot, pairs = self._stage(state)
        # The staging copy is about to be overwritten: it no longer holds the previous snapshot.
        self.snapshot = self.snapshot_step = None
        t_stage = time.monotonic()
        rel = compat.installed_release()
        # Up to 0.6 planning reads the staging tensors' metadata only, so it runs before the copy, which runs on
        # behind the loop's next forward and backward. From 0.7 planning clones every CPU tensor: planned before
        # the copy is complete, the checkpoint would hold what the staging copy held, the previous save's state.
        copy = self._start_copy(pairs) if rel.plan_copies_cpu_tensors else None
        if copy is not None:
            copy.result()
        t_copy = time.monotonic()
        writer = FileSystemWriterAsync(str(path), thread_count=self.cfg.write_threads)
        writer, metadata, _ = save_state_dict_async_plan(snapshot, writer, planner=self.planner, enable_cache=True,
                                                         metadata_cache=self.plan_cache)
        # NVRx trusts a plan once a second full planning (with a gather) produced the same one. That it
        # stays valid is what _stage checks at every save, so it is trusted from the first.
        compat.trust_save_plan(self.plan_cache, metadata)
        t_plan = time.monotonic()

        def finalize() -> None:
            # Runs on this rank once its worker finished: record the write results durably.
            results = writer.retrieve_write_results()
            write_atomic(path / f".rank{self.d.rank}.done", pickle.dumps(results))
            self.writes_in_flight -= 1
            self.writes_done += 1
            self.write_started = time.monotonic()   # the next one in flight, if any, has been running since

        request = compat.save_request(writer, [finalize], rel)
        copy = copy or self._start_copy(pairs)
        now = time.monotonic()
        phases = {"wait_s": t_wait - t0, "commit_s": t_commit - t_wait, "stage_s": t_stage - t_commit,
                  "plan_s": t_plan - t_copy, "start_s": now - t_plan}
        if rel.plan_copies_cpu_tensors:
            phases["copy_before_plan_s"] = t_copy - t_stage
        self.copying = _Snapshot(step, snapshot, copy, request,
                                 _Pending(step, t0, writer if self.d.is_main else None, metadata), now - t0, phases)

    def finish_snapshot(self, *, report: bool = True) -> float:
        """Wait for the copy ``save`` started and hand the write to NVRx's worker; return the seconds waited.

        Call before the state changes (the optimizer step). Returns at once when no copy is running.
        ``report``: record the save's blocking time (an interval save's; a blocking save records its own).
        """
        s, self.copying = self.copying, None
        if s is None:
            return 0.0
        t0 = time.monotonic()
        copy_s = s.copy.result()
        if s.request is None:   # kept in memory only
            waited = time.monotonic() - t0
            self.node.mark(s.step, s.slot, s.state, self.run_id)
            self.replica_snapshot, self.replica_step, self.replica_slot = s.state, s.step, s.slot
            self.replica_copy_s, self.replica_run = copy_s, self.run_id
            if self.d.is_main:
                self.events.emit("memory_snapshot", step=s.step, block_s=round(s.blocked_s + waited, 4),
                                 copy_s=round(copy_s, 4))
            return waited
        self.snapshot, self.snapshot_step = s.state, s.step
        self.queue.schedule_async_request(s.request)
        if not self.writes_in_flight:
            self.write_started = time.monotonic()
        self.writes_in_flight += 1
        self.pending.append(s.pending)
        waited = time.monotonic() - t0
        if report:
            self._snapshot_taken(s.step, s.blocked_s + waited, sync=False,
                                 phases={**s.phases, "copy_wait_s": waited, "copy_s": copy_s})
        if self.on_write_started:
            self.on_write_started(s.step)
        return waited

    def snapshot_to_memory(self, step: int, state: StateSource) -> dict:
        """Copy ``state`` into the in-memory replica (node-local shared memory; nothing is written to disk).

        Like ``save``: the copy runs on the copier thread, and ``finish_snapshot`` must be called before
        the state changes. It costs no disk, no writer and no collective, so it can be taken far more often
        than checkpoints: a restart in the same process or on the same node then redoes only the steps
        since the last one. Returns the copy (``save`` can write it later, as this step's checkpoint).
        """
        t0 = time.monotonic()
        self.finish_snapshot()
        state = state() if callable(state) else state
        slot = 1 - self.replica_slot    # never the slot of the newest complete replica
        self.replicas[slot], snapshot, pairs = _staged_into(state, self.replicas[slot],
                                                            lambda s: self.node.buffer(s, slot))
        copy = self._start_copy(pairs)
        self.copying = _Snapshot(step, snapshot, copy, None, None, time.monotonic() - t0, {}, slot)
        return snapshot   # whole once finish_snapshot returned; kept until the next copy but one

    def drop_replica(self) -> None:
        """Forget the replica and free its memory on the node (a committed checkpoint supersedes it)."""
        self.node.discard()
        self.replicas, self.replica_snapshot, self.replica_step = [None, None], None, None

    def _snapshot_taken(self, step: int, block_s: float, *, sync: bool, phases: dict | None = None,
                        interval: bool = True) -> None:
        if self.d.is_main:
            self.events.emit("ckpt_snapshot", step=step, block_s=round(block_s, 4), sync=sync,
                             **{k: round(v, 4) for k, v in (phases or {}).items()})
        if interval and self.on_snapshot is not None:
            self.on_snapshot(block_s)

    def _finalize(self, writes_only: bool = False) -> None:
        """Finalize NVRx requests until none is left (with ``writes_only``: until no write is left).

        Polls every 5 ms: NVRx's own blocking finalize sleeps 100 ms between checks, which the loop
        would pay whenever a save waits for the previous write.
        """
        while True:
            self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if not (self.writes_in_flight if writes_only else self.queue.get_num_unfinalized_calls()):
                return
            time.sleep(0.005)

    @property
    def cold(self) -> bool:
        """No write has finished since this process started its writer: one in flight may still wait for the
        writer's boot (a spawned interpreter importing torch), and a save after it would wait for that too."""
        return not self.cfg.sync and self.writes_done == 0

    @property
    def writing(self) -> bool:
        """A snapshot is being copied or written (as of the last finalize)."""
        return self.copying is not None or self.writes_in_flight > 0

    def maybe_finalize(self) -> None:
        """Top of every step: finalize finished writes without blocking; rank 0 commits complete steps."""
        if self.queue is None:
            return
        self.queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        self._maybe_commit()

    def wait(self) -> None:
        """Block until every scheduled checkpoint is committed (call on all ranks)."""
        self.finish_snapshot()
        if self.queue is not None:
            self._finalize(writes_only=True)   # not the writer's warm-up: it may still be booting
        # Sync point: all ranks' done files exist before rank 0 commits the rest.
        dist.barrier()
        self._maybe_commit()
        if self.d.is_main and self.pending:
            raise RuntimeError(f"checkpoint at step {self.pending[0].step} could not be committed: "
                               f"a rank's write results are missing")

    def maybe_drain_mirror(self) -> None:
        """Rank 0: wait, at most --ckpt-mirror-drain-s, until every committed checkpoint is mirrored."""
        if self.mirror is not None:
            self.mirror.drain(self.cfg.mirror_drain_s)
            # Local retention skipped steps the mirror still needed; those it has released go now.
            if self._purger is not None:
                self._purger.join()
            steps = committed_steps(self.root)
            if steps:
                self._purge(steps[-1])

    def close(self) -> None:
        self.finish_snapshot()
        self.copier.shutdown()
        self.helpers = []   # ends the watch: the writers exit now
        if self.queue is not None:
            # Rank-local finalize first: NVRx's own close() would synchronize ranks through CUDA.
            self._finalize()
            self.queue.close()
            self.queue = None
        if self._purger is not None:
            self._purger.join()
        if self.mirror is not None:
            self.mirror.close(self.cfg.mirror_drain_s)

    # --------------------------------------------------------------------------------------- commit
    def _maybe_commit(self) -> None:
        if not self.d.is_main:
            # Non-zero ranks are done with a step once their own results are on disk.
            while self.pending and (step_dir(self.root, self.pending[0].step)
                                    / f".rank{self.d.rank}.done").exists():
                self.pending.popleft()
            return
        while self.pending:
            p = self.pending[0]
            path = step_dir(self.root, p.step)
            done = [path / f".rank{r}.done" for r in range(self.d.world_size)]
            if not all(f.exists() for f in done):
                return
            self.pending.popleft()
            self._commit(p, results=[pickle.loads(f.read_bytes()) for f in done])

    def _commit(self, p: _Pending, results: list | None) -> None:
        path = step_dir(self.root, p.step)
        if results is not None:
            p.writer.finish(p.metadata, results)   # writes .metadata (tmp + rename, fsynced)
        marker = {"step": p.step, "world_size": self.d.world_size, "committed_at": time.time(),
                  "files": sorted(f.name for f in path.iterdir() if not f.name.startswith(".rank"))}
        write_atomic(path / COMMITTED, json.dumps(marker).encode())
        self.events.emit("ckpt_committed", step=p.step, commit_s=round(time.monotonic() - p.started, 4))
        if self.mirror is not None:
            self.mirror.enqueue(p.step, marker["committed_at"])
        self._start_purge(p.step)

    # ------------------------------------------------------------------------------------ retention
    def _start_purge(self, newest: int) -> None:
        # A daemon thread, so a slow delete on a network file system never blocks the loop and a failed
        # delete never kills training (torchtitan's purge thread).
        if self._purger is not None and self._purger.is_alive():
            return
        self._purger = threading.Thread(target=self._purge, args=(newest,), daemon=True, name="ckpt-purge")
        self._purger.start()

    def _purge(self, newest: int) -> None:
        try:
            for step in committed_steps(self.root)[:-self.cfg.keep]:
                if self.mirror is not None and self.mirror.holds(step):
                    continue    # not in the mirror yet: deleted by a later purge
                delete_checkpoint(step_dir(self.root, step))
            self._delete_torn(older_than=newest)
        except OSError as e:  # pragma: no cover - depends on the file system
            log.warning("checkpoint purge failed: %s", e)

    def _delete_torn(self, older_than: int | None = None) -> None:
        """Delete uncommitted step directories (all at start; during a run only those older than the
        newest commit, since newer ones may still be in flight)."""
        for p in self.root.iterdir():
            step = step_of(p)
            if step is None or (p / COMMITTED).exists():
                continue
            if older_than is not None and step >= older_than:
                continue
            self.events.emit("ckpt_torn_deleted", step=step)
            shutil.rmtree(p, ignore_errors=True)
