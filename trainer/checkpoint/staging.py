"""The copy of the training state that a save writes from: shared-memory staging tensors reused at every
save, the DCP planner kept with them, and the background copy into them.

The staging tensors are the same objects at every save, so the plan made at the first saves is reused for
as long as the state's structure (keys, shapes, dtypes) is unchanged; a changed structure gets new staging
and is planned afresh. The copy runs on a thread (on GPU: device-to-host on a side stream), and the planning
of a reused plan after it (it needs no collective), while the loop runs the next forward and backward passes,
which only read the state.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from .. import compat

log = logging.getLogger(__name__)


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
            return staged
        live_local, staged_local = compat.local_tensor(live), compat.local_tensor(staged)
        if staged_local.shape != live_local.shape:   # the same global shape, sharded differently
            raise _StructureChanged
        pairs.append((live_local, staged_local))
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


def staged_into(state: dict, buffer: dict | None, allocate: Callable[[dict], dict]) -> tuple[dict, dict, list]:
    """(buffer, snapshot, pairs): ``state`` laid onto ``buffer``'s tensors, or onto a new buffer from
    ``allocate(state)`` when there is none yet or the state's structure changed. Copies nothing: ``pairs``
    are the (live, buffer) tensors to copy."""
    if buffer is not None:
        try:
            pairs: list = []
            return buffer, _staged(state, buffer, pairs), pairs
        except _StructureChanged:
            pass
    buffer, pairs = allocate(state), []
    return buffer, _staged(state, buffer, pairs), pairs


class StagingPlanner(DefaultSavePlanner):
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


class Staging:
    """The shared-memory staging copy that checkpoints are written from, with its planner and plan cache."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffer: dict | None = None
        # Planning state of the current staging copy (see StagingPlanner), replaced with it.
        self.plan_cache = self.planner = None
        self.planned = False   # the current staging copy's first, full planning is done

    def allocate(self, state: dict) -> dict:
        """New staging copy shaped like ``state``, with a new planner: its first saves plan from scratch
        (collectives: every rank must allocate at the same save, as they do when the structure changes)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import CheckpointMetadataCache

        # Shared memory: NVRx's persistent worker receives the tensors without another copy.
        self.buffer = compat.shared_cpu_state_dict(state, pin=self.pin)
        # NVRx reuses the global save plan once it is stable: later saves plan without collectives.
        self.plan_cache, self.planner = CheckpointMetadataCache(), StagingPlanner()
        self.planned = False
        return self.buffer

    def plan(self, snapshot: dict, writer) -> Any:
        """Plan the write of ``snapshot`` (laid onto this staging copy) by ``writer`` (a
        ``FileSystemWriterAsync``); return DCP's global metadata (rank 0). The first planning of a staging
        copy is collective (every rank's plan gathered); later ones reuse it and are local."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan

        writer, metadata, _ = save_state_dict_async_plan(snapshot, writer, planner=self.planner, enable_cache=True,
                                                         metadata_cache=self.plan_cache)
        # NVRx trusts a plan once a second full planning (with a gather) produced the same one. That it
        # stays valid is what ``stage`` checks at every save, so it is trusted from the first.
        compat.trust_save_plan(self.plan_cache, metadata)
        self.planned = True
        return metadata

    def plan_ahead(self) -> None:
        """The staging copy's first, full planning, now (collective: call on every rank) rather than in the
        loop at its first save, where the gather of every rank's plan made that save the slowest by far.
        Plans into a directory of its own, removed at once: only the plan is kept."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

        if self.buffer is None or self.planned:
            return
        with tempfile.TemporaryDirectory(prefix="goodput-plan-ahead-") as path:
            self.plan(self.buffer, FileSystemWriterAsync(path))

    def stage(self, state: dict) -> tuple[dict, list]:
        """The snapshot of ``state`` (staging tensors, and the state's other values) and the (live, staging)
        tensor pairs to copy; new staging if the structure changed. Copies nothing."""
        self.buffer, snapshot, pairs = staged_into(state, self.buffer, self.allocate)
        return snapshot, pairs

    def drop(self) -> None:
        self.buffer = None


def _nice_thread(nice: int) -> None:
    """Give the calling thread (alone: Linux keeps a niceness per thread) at least niceness ``nice``."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    except OSError as e:
        log.warning("checkpoint thread %s keeps the rank's CPU priority: %s", threading.current_thread().name, e)


def core_wait_s() -> float:
    """Seconds the calling thread has waited for a core since it started: runnable, and not run (Linux schedstat;
    0 elsewhere)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Copier:
    """Copies (live, staging) tensor pairs on a background thread; on CUDA through a side stream. Checksums
    the copies on another thread once they are whole.

    Both threads run at niceness ``nice`` (``--ckpt-copy-nice``): the copy has the next step's forward and
    backward passes to finish in, while the loop's thread is what every rank waits for.
    """

    def __init__(self, device: torch.device, nice: int):
        self.device = device
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-copy", initializer=_nice_thread,
                                       initargs=(nice,))
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-checksum", initializer=_nice_thread,
                                         initargs=(nice,))
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def start(self, pairs: list) -> Future:
        """Start the copy of ``pairs``; the future's result is the seconds it took."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record()   # on the loop's stream: the state as the last optimizer step left it
        return self.pool.submit(self.copy, pairs, ready)

    def then(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the copy thread once the copies started so far are done (one thread: in order)."""
        return self.pool.submit(fn)

    def copy(self, pairs: list, ready: torch.cuda.Event | None) -> float:
        """Background thread: copy the live tensors into the staging copy; return the seconds it ran, not counting
        its waits for a core (at ``--ckpt-copy-nice`` it lets training go first: memory snapshots are spaced by
        what a copy costs, not by how long it waited).

        One batched copy: per-tensor copies cost ~10% more for the few hundred tensors of a model. It
        releases the GIL, so the loop's forward and backward passes run meanwhile.
        """
        t0, queued = time.monotonic(), core_wait_s()
        staging, live = [s for _, s in pairs], [t for t, _ in pairs]
        if self.stream is None:
            compat.foreach_copy(staging, live)
        else:
            # Device-to-host into pinned memory on a side stream, ordered after the optimizer step that
            # produced the state; the next step's kernels run on the default stream meanwhile.
            with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                self.stream.wait_event(ready)
                compat.foreach_copy(staging, live, non_blocking=True)
            self.stream.synchronize()
        return time.monotonic() - t0 - (core_wait_s() - queued)

    def checksum(self, copy: Future, of: Callable[[], Any]) -> Future:
        """``of()`` (the copy's checksums) once ``copy`` (or what ran on the copy thread after it) is done, on the
        checksum thread: nothing can change the copy before then, and the copy thread is free meanwhile."""
        def run() -> Any:
            copy.result()
            return of()

        return self.hasher.submit(run)

    def after_checksums(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the checksum thread once the checksums started so far are taken (one thread: in order),
        beside the copy thread."""
        return self.hasher.submit(fn)

    def close(self) -> None:
        self.pool.shutdown()
        self.hasher.shutdown()
