"""This rank's in-memory replica of the training state, in node-local shared memory, so that it outlives
the rank.

Between checkpoints the loop copies its state here every ``--memory-snapshot-every-s``. The copy lives
in files under ``--memory-snapshot-dir`` (``/dev/shm``: memory, not disk), mapped into the process: an
in-process restart reads it from the same mapping, and an in-job restart, after a rank was killed or a
hung rank was killed by its monitor, reads it from the files, since the node and its memory are still
there. Either way a restart redoes about a second of work instead of everything since the last committed
checkpoint.

Two slots per rank: a copy goes into the slot that does not hold the newest complete snapshot, and the
marker that names the complete one (its step, its slot, the state's non-tensor values, the tensor layout)
is replaced atomically once the copy is done. A rank killed mid-copy leaves the previous snapshot whole.
The marker it replaces is kept (``previous``) until a copy into its slot begins: a restore that needs a step
every rank has can take the one before the newest (another node's copy held by a peer lags by its transfer).
A slot whose copy is a checkpoint owed to a writer still booting is kept until the checkpoint is written:
the copies meanwhile go into the other slot, each over the newest, whose marker gives way to the kept
one's while it is overwritten.

Only the state's local tensors are stored (a DTensor's shard, with its mesh and placements taken from the
live state when it is read back), so reading a replica needs the live state of the same structure, which
the restart has just built.

``MemorySnapshots`` is what the checkpoint manager uses: which slot the next copy goes to, which holds the
newest complete snapshot (and of which run), and reading it back after a restart.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import compat
from ..durable import move, write_bytes
from ..layout import replica_marker, replica_previous, replica_slot
from .integrity import ChecksumMismatch, state_tensors, verify_state
from .staging import staged_into

log = logging.getLogger(__name__)

_ALIGN = 64


class _Leaf:
    """Stands for the i-th tensor of a snapshot in the marker."""

    def __init__(self, index: int):
        self.index = index


def encode_values(value: Any) -> Any:
    """A snapshot's structure and non-tensor values (tensors: ``_Leaf``) as plain JSON data: the marker is read
    by the node's peer daemon and sent to another node, so it must never need unpickling. Tuples, and dicts
    whose keys are not all strings, are tagged to come back as they were."""
    if isinstance(value, _Leaf):
        return {"__tensor__": value.index}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: encode_values(v) for k, v in value.items()}}
        return {"__items__": [[encode_values(k), encode_values(v)] for k, v in value.items()]}
    if isinstance(value, (list, tuple)):
        return {"__tuple__" if isinstance(value, tuple) else "__list__": [encode_values(v) for v in value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a memory snapshot holds only tensors and plain values: {type(value).__name__} is neither")


def decode_values(data: Any) -> Any:
    """``encode_values`` undone (tensors: ``_Leaf``). Raises ValueError on anything it did not write."""
    if not isinstance(data, dict):
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        raise ValueError(f"not an encoded value: {type(data).__name__}")
    (tag, inner), = data.items()
    if tag == "__tensor__":
        return _Leaf(int(inner))
    if tag == "__dict__":
        return {k: decode_values(v) for k, v in inner.items()}
    if tag == "__items__":
        return {decode_values(k): decode_values(v) for k, v in inner}
    if tag in ("__tuple__", "__list__"):
        values = [decode_values(v) for v in inner]
        return tuple(values) if tag == "__tuple__" else values
    raise ValueError(f"not an encoded value: {tag!r}")


def read_marker_file(path: Path) -> dict | None:
    """A replica marker (plain JSON: step, slot, run, layout, checksums, values), or None when there is none or
    it is not one."""
    try:
        marker = json.loads(path.read_bytes())
        int(marker["step"]), int(marker["slot"])
        return marker
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _specs(state: Any) -> list[tuple[torch.dtype, torch.Size]]:
    """(dtype, shape) of the local part of each tensor of ``state``: what a slot stores."""
    return [(compat.local_tensor(t).dtype, compat.local_tensor(t).shape) for t in state_tensors(state)]


def _layout(state: Any) -> list[tuple[str, tuple]]:
    """``_specs`` as the marker records them."""
    return [(str(dtype), tuple(shape)) for dtype, shape in _specs(state)]


def _rebuild(template: Any, live: Any, views: list[torch.Tensor], counter: list[int]) -> Any:
    """``template``'s structure and non-tensor values, with the next view for each tensor; a DTensor view
    gets the mesh and placements of the tensor at the same place in ``live``."""
    if isinstance(template, (torch.Tensor, _Leaf)):
        view = views[counter[0]]
        counter[0] += 1
        # A host-memory shard with the live DTensor's spec (as torch's _create_cpu_state_dict makes them;
        # DTensor.from_local would move it to the mesh's device).
        return compat.dtensor_like(view, live) if isinstance(live, DTensor) else view
    if isinstance(template, dict):
        return {k: _rebuild(v, live[k], views, counter) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_rebuild(v, lv, views, counter) for v, lv in zip(template, live))
    return template


def _strip(state: Any, counter: list[int]) -> Any:
    """``state`` with every tensor replaced by a ``_Leaf`` (for the marker)."""
    if isinstance(state, torch.Tensor):
        counter[0] += 1
        return _Leaf(counter[0] - 1)
    if isinstance(state, dict):
        return {k: _strip(v, counter) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_strip(v, counter) for v in state)
    return state


def _allocate(fd: int, size: int) -> None:
    """Allocate the first ``size`` bytes of the file ``fd`` unless they are: on tmpfs ``posix_fallocate`` walks
    every page even then (23 ms per 100 MB here, as long as a first allocation)."""
    if os.fstat(fd).st_blocks * 512 < size:
        os.posix_fallocate(fd, 0, size)


def _offsets(specs: list[tuple[torch.dtype, torch.Size]]) -> tuple[list[int], int]:
    """Where each tensor of ``specs`` starts in a slot, and the slot's size (never 0: an empty file cannot be
    mapped)."""
    offsets, size = [], 0
    for dtype, shape in specs:
        offsets.append(size)
        size += -(-shape.numel() * dtype.itemsize // _ALIGN) * _ALIGN    # aligned for every dtype's view
    return offsets, max(size, _ALIGN)


def _cut(flat: torch.Tensor, offsets: list[int], specs: list[tuple[torch.dtype, torch.Size]]) -> list[torch.Tensor]:
    """One view of the slot ``flat`` per tensor of ``specs``, at its offset."""
    return [flat[o:].view(dtype)[:shape.numel()].view(shape) for o, (dtype, shape) in zip(offsets, specs)]


def tensor_spans(marker: dict) -> list[tuple[int, int]]:
    """(offset, bytes) of each tensor in the slot of a replica ``marker`` (what its checksums cover)."""
    specs = [(getattr(torch, dtype.removeprefix("torch.")), torch.Size(shape)) for dtype, shape in marker["layout"]]
    offsets, _ = _offsets(specs)
    return [(o, shape.numel() * dtype.itemsize) for o, (dtype, shape) in zip(offsets, specs)]


class NodeReplica:
    """This rank's two replica slots and their marker, in ``directory``."""

    def __init__(self, directory: Path, rank: int, *, pin: bool = False):
        """``pin``: page-lock the slots for device-to-host copies (the state lives on a GPU)."""
        self.dir, self.rank, self.pin = directory, rank, pin
        self.marker_path = replica_marker(directory, rank)
        self.previous_path = replica_previous(directory, rank)
        self.persistent = True    # False once the files could not be created: slots in private memory
        # Each slot's layout as the marker records it, computed when the slot is mapped: the structure is
        # fixed for as long as a buffer is reused, so a copy does not walk the state again for it.
        self.layouts: list[list | None] = [None, None]
        self.pinned: list[torch.Tensor | None] = [None, None]   # each slot's page-locked mapping, if any
        # Both slots mapped ahead by ``reserve``, on a thread (its future), then slot -> (specs, views) of that
        # mapping, used by whatever reads or copies into the slot until it is mapped anew.
        self.ahead: Future | None = None
        self.ready: dict[int, tuple[list, list[torch.Tensor]]] = {}
        # The slot the previous snapshot's marker names (None: there is none). Only ``mark`` creates that marker,
        # so it is read once, here (an earlier process may have left it): a copy's start, on the loop, reads none.
        previous = self.marked(previous=True)
        self.previous_slot: int | None = None if previous is None else previous["slot"]

    def _slot_path(self, slot: int) -> Path:
        return replica_slot(self.dir, self.rank, slot)

    def marked(self, previous: bool = False) -> dict | None:
        """The marker of the newest complete snapshot (``previous``: of the one before it, while its slot is
        untouched): step, slot, run, layout, checksums, values; None if there is none."""
        return read_marker_file(self.previous_path if previous else self.marker_path)

    def overwriting(self, slot: int) -> None:
        """A copy into ``slot`` begins: the previous snapshot's marker, which names it, goes first."""
        if self.previous_slot == slot:
            self.previous_path.unlink(missing_ok=True)
            self.previous_slot = None

    def demote(self) -> None:
        """A copy into the newest snapshot's slot begins (the other slot is kept): the one before it, if
        marked, is the newest complete snapshot until this copy is marked."""
        if self.persistent:
            try:
                move(self.previous_path, self.marker_path)
            except FileNotFoundError:
                self.marker_path.unlink(missing_ok=True)
            self.previous_slot = None

    def buffer(self, state: dict, slot: int) -> dict:
        """A buffer shaped like ``state`` (tensors: views of slot ``slot``, sized to ``state``)."""
        return _rebuild(state, state, self._views(state, slot, pin=self.pin), [0])

    @staticmethod
    def slot_size(state: dict) -> int:
        """The bytes of a slot that holds ``state``'s tensors."""
        return _offsets(_specs(state))[1]

    def reserve(self, state: dict) -> None:
        """Allocate and map both slots for ``state`` (a restore) on a thread, as the first copy into each would,
        leaving what they hold: that copy takes its slot's views from there. On the loop, the first copy into a
        slot held it while the slot was allocated (about 12 ms per 100 MB here), mapped, cut into views and, on a
        GPU, page-locked (0.92 s for 1.83 GB on an H200)."""
        self.settle()
        if not self.persistent:
            return
        specs = _specs(state)
        # The thread page-locks for this rank's device, not the default one (a context of its own on GPU 0).
        device = torch.cuda.current_device() if self.pin else None
        pool = ThreadPoolExecutor(1, thread_name_prefix="replica-map")
        self.ahead = pool.submit(self._map_ahead, specs, device)
        pool.shutdown(wait=False)

    def _map_ahead(self, specs: list, device: int | None) -> dict[int, tuple[list, list[torch.Tensor]]]:
        """Thread: each slot mapped (and page-locked) as ``_map`` would, and cut into views for ``specs``; one that
        cannot be is left to the first copy into it, which says why."""
        offsets, size = _offsets(specs)
        ready = {}
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            for slot in (0, 1):
                self._unpin(slot)
                with contextlib.suppress(OSError):
                    flat = self._map_file(slot, size)
                    ready[slot] = specs, _cut(self._pinned(slot, flat) if self.pin else flat, offsets, specs)
        return ready

    def settle(self) -> None:
        """Wait for the mapping ahead, if any (nothing maps or deletes a slot meanwhile)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self.ready = ahead.result()

    def _views(self, state: dict, slot: int, *, pin: bool) -> list[torch.Tensor]:
        """Slot ``slot`` mapped and sized for ``state``'s tensors: one view per tensor, in traversal order."""
        specs = _specs(state)
        self.layouts[slot] = _layout(state)
        self.settle()
        ahead = self.ready.get(slot)
        if ahead is not None and ahead[0] == specs:
            return ahead[1]
        offsets, size = _offsets(specs)
        return _cut(self._map(slot, size, pin), offsets, specs)

    def _map(self, slot: int, size: int, pin: bool) -> torch.Tensor:
        self._unpin(slot)
        self.ready.pop(slot, None)
        if self.persistent:
            try:
                flat = self._map_file(slot, size)
                return self._pinned(slot, flat) if pin else flat
            except OSError as e:
                log.warning("memory snapshots stay in process memory (an in-job restart cannot use them): "
                            "cannot map %s: %s", self._slot_path(slot), e)
                self.persistent = False
                self.discard()
        return torch.empty(size, dtype=torch.uint8, pin_memory=pin)

    def _map_file(self, slot: int, size: int) -> torch.Tensor:
        """Slot ``slot``'s file, ``size`` bytes, allocated and mapped shared."""
        path = self._slot_path(slot)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)   # this node's ranks only
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, size)
            _allocate(fd, size)   # now: a full /dev/shm would otherwise surface as SIGBUS mid-copy
        finally:
            os.close(fd)
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def _pinned(self, slot: int, flat: torch.Tensor) -> torch.Tensor:
        """Page-lock a mapped slot, so the device-to-host copy into it runs by DMA at full speed: into
        pageable memory the driver copies through a bounce buffer, several times slower."""
        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0))
            self.pinned[slot] = flat   # kept mapped until unregistered (_unpin)
        except RuntimeError as e:   # torch.cuda.CudaError: e.g. the locked-memory limit
            log.warning("memory snapshot slot %d stays pageable (slower copies): %s", slot, e)
        return flat

    def _unpin(self, slot: int) -> None:
        flat, self.pinned[slot] = self.pinned[slot], None
        if flat is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(flat.data_ptr()))

    def mark(self, step: int, slot: int, snapshot: dict, run: str | None, checksums: list[str]) -> None:
        """Record ``snapshot`` (copied into slot ``slot`` by run ``run``, its tensors' ``checksums``) as the newest
        complete one."""
        if self.persistent:
            # The snapshot this one supersedes stays usable until a copy into its slot begins: a restore that
            # needs a step some other rank also has (a peer copy lags by its transfer) may find it there.
            old = read_marker_file(self.marker_path)
            if old is not None and old["slot"] != slot:
                self.previous_slot = old["slot"]
                with contextlib.suppress(OSError):
                    write_bytes(self.previous_path, self.marker_path.read_bytes())
            write_bytes(self.marker_path, json.dumps({"step": step, "slot": slot, "run": run,
                                                      "layout": self.layouts[slot], "checksums": checksums,
                                                      "values": encode_values(_strip(snapshot, [0]))}).encode())

    def load(self, state: dict, previous: bool = False) -> tuple[int, int, dict] | None:
        """(step, slot, snapshot) of the marked snapshot (``previous``: the one before it), read from its slot
        and arranged like the live ``state``; None if there is none or its layout is not ``state``'s. Raises
        ``ChecksumMismatch`` when the slot does not hold the bytes the marker's checksums were taken of."""
        marker = self.marked(previous)
        if marker is None or [[d, list(s)] for d, s in _layout(state)] != marker["layout"]:
            return None
        # Read once, host to device, on the restart's critical path: page-locking it first would cost more
        # (about 0.5 s per GB) than the pageable copy saves.
        views = self._views(state, marker["slot"], pin=False)
        try:
            values = decode_values(marker["values"])
        except (ValueError, TypeError) as e:
            raise ChecksumMismatch(f"the marker of step {marker['step']} does not decode: {e}") from e
        verify_state(views, marker.get("checksums"),
                     f"memory snapshot of step {marker['step']} (slot {marker['slot']})")
        return marker["step"], marker["slot"], _rebuild(values, state, views, [0])

    def discard(self) -> None:
        """Delete this rank's marker (first: the slots are then never read) and slots."""
        self.settle()
        self.ready = {}
        for slot in (0, 1):
            self._unpin(slot)
        for path in (self.marker_path, self.previous_path, self._slot_path(0), self._slot_path(1)):
            path.unlink(missing_ok=True)


class MemorySnapshots:
    """This rank's replica as the checkpoint manager sees it: the newest complete snapshot and the next slot.

    Args:
        directory: the rank's replica directory (``layout.replica_dir``).
        rank: this process's rank.
        pin: page-lock the slots (the state lives on a GPU).
    """

    def __init__(self, directory: Path, rank: int, *, pin: bool):
        self.node = NodeReplica(directory, rank, pin=pin)
        self.buffers: list[dict | None] = [None, None]   # the slots' buffers, as mapped by this attempt
        self.snapshot: dict | None = None                # the newest complete snapshot, once read
        marker = self.node.marked()
        self.step: int | None = marker["step"] if marker else None
        self.slot: int = marker["slot"] if marker else 1
        # A replica left by an earlier process may be another run's (the same output directory started
        # afresh): it is used only by the run that made it.
        self.run: str | None = marker.get("run") if marker else None
        self.copy_s = 0.0   # how long the last copy took (the interval policy spaces them)
        self.checksums: list[str] | None = None   # of this process's newest snapshot (``completed``)
        # Slots whose copy is a checkpoint owed to a busy writer (``stage(keep=True)``), until ``release``:
        # slot -> (step, snapshot, run, checksums), the step, run and checksums once the copy is complete.
        self.kept: dict[int, tuple[int | None, dict, str | None, list[str] | None]] = {}
        # (step, why) of snapshots on the node whose bytes failed their checksums: not offered (the manager
        # reports them).
        self.rejected: list[tuple[int, str]] = []

    def stage(self, state: dict, *, keep: bool = False) -> tuple[int, dict, list]:
        """(slot, snapshot, pairs) for a copy of ``state`` into the slot that does not hold the newest snapshot,
        or, when that one is kept, into the newest's (the kept one is then the newest complete snapshot until
        this copy is marked). ``keep``: no copy goes into this one's slot until ``release``."""
        slot = 1 - self.slot
        if slot in self.kept:
            if self.slot in self.kept:
                raise RuntimeError("both memory snapshot slots hold owed checkpoints: none is free for a copy")
            slot = self.slot
            self.node.demote()
            self.step, self.snapshot, self.run, self.checksums = self.kept[1 - slot]
            self.slot = 1 - slot
        self.node.overwriting(slot)
        self.buffers[slot], snapshot, pairs = staged_into(state, self.buffers[slot],
                                                          lambda s: self.node.buffer(s, slot))
        if keep:
            self.kept[slot] = (None, snapshot, None, None)
        return slot, snapshot, pairs

    def kept_checksums(self, snapshot: dict) -> tuple[int, list[str]]:
        """(step, checksums) of a kept copy (a checkpoint owed to a busy writer), as it was copied: it must still
        hold those bytes when it is written (nothing may have copied into its slot since)."""
        step, _, _, checksums = next(k for k in self.kept.values() if k[1] is snapshot)
        return step, checksums

    def release(self, snapshot: dict) -> None:
        """``snapshot``'s slot is no longer kept (its checkpoint was written or superseded)."""
        self.kept = {slot: k for slot, k in self.kept.items() if k[1] is not snapshot}

    def completed(self, step: int, slot: int, snapshot: dict, run: str | None, copy_s: float,
                  checksums: list[str]) -> None:
        """The copy into ``slot`` is whole (its tensors' ``checksums``): it is now the newest snapshot (marked on
        the node)."""
        self.node.mark(step, slot, snapshot, run, checksums)
        self.snapshot, self.step, self.slot, self.run, self.copy_s = snapshot, step, slot, run, copy_s
        self.checksums = checksums
        if slot in self.kept:
            self.kept[slot] = (step, snapshot, run, checksums)

    def offers(self, state: dict) -> list[tuple[int, str | None]]:
        """(step, run) of the snapshots on the node that a restore of ``state`` could read back: the newest
        (once ``read_back``), and the one before it."""
        offers = [(self.step, self.run)] if self.step is not None else []
        if offers and self.read_previous(state) is not None:
            previous = self.node.marked(previous=True)
            offers.append((previous["step"], previous.get("run")))
        return offers

    def read_previous(self, state: dict) -> dict | None:
        """The snapshot before the newest, read back against the live ``state``'s structure and verified (None:
        gone, or its bytes failed their checksums)."""
        try:
            loaded = self.node.load(state, previous=True)
        except ChecksumMismatch as e:
            self.rejected.append((self.node.marked(previous=True)["step"], str(e)))
            self.node.previous_path.unlink(missing_ok=True)
            return None
        return loaded[2] if loaded else None

    def read_back(self, state: dict) -> None:
        """A snapshot left by an earlier process or attempt: read it back against the live ``state``'s structure,
        and verified: one whose bytes failed their checksums is forgotten (``rejected``)."""
        while self.step is not None:
            try:
                if self.snapshot is None:
                    loaded = self.node.load(state)
                    self.step, self.slot, self.snapshot = loaded or (None, self.slot, None)
                else:   # this process's own (an in-process restart): verified where it lies
                    verify_state(self.snapshot, self.checksums, f"memory snapshot of step {self.step}")
                return
            except ChecksumMismatch as e:
                self.rejected.append((self.step, str(e)))
                # The one before it, if any, is the newest now: read back in turn.
                self.node.demote()
                marker = self.node.marked()
                self.step, self.snapshot = (marker["step"], None) if marker else (None, None)
                self.run = marker.get("run") if marker else None

    def unmap(self) -> None:
        """Forget this attempt's mappings (a new process group needs new ones); the marker still names the
        newest slot, which the next copy leaves alone. A new attempt owes no checkpoints: no slot is kept."""
        self.buffers, self.snapshot, self.kept = [None, None], None, {}

    def reserve(self, state: dict) -> None:
        """Allocate and map both slots for ``state`` on the node, on a thread (see ``NodeReplica.reserve``)."""
        self.node.reserve(state)

    def drop(self) -> None:
        """Forget the snapshot and free its memory on the node (a committed checkpoint supersedes it)."""
        self.node.discard()
        self.buffers, self.snapshot, self.step, self.kept = [None, None], None, None, {}
