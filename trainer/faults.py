"""Fault injection in the ranks: ``FaultInjector`` fires this rank's faults (``trainer.fault_spec`` says what each
kind does), and ``Corruption`` flips the bytes of the ``corrupt-*`` kinds.

Each fault fires once per run: before firing, the rank records it in ``events.jsonl`` (the log spans
restarts), and a restarted rank skips every fault already recorded there.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .config import CheckpointConfig
from .durable import fsync_file
from .events import Event, EventLog, read_events
from .fault_spec import CORRUPT_KINDS, Fault, chaos_schedule
from .hooks import StepHook
from .layout import (COMMITTED, checkpoints_dir, committed_steps, peer_file, replica_dir, replica_marker,
                     replica_previous, replica_ranks, replica_slot, step_dir)
from .signals import NODE_ENV

# How long a corrupt-peer fault waits for the holder to keep the copy of the snapshot just marked (its daemon
# ships it at once; a loaded machine delays it).
PEER_WAIT_S = 60.0


class InjectedFault(RuntimeError):
    """The exception raised by an injected ``exception`` fault."""


# The source a restore names in its checksum_mismatch event when it refuses the copy a corrupt-* fault flipped.
REFUSED_AS = {"corrupt-snapshot": "memory", "corrupt-ckpt": "checkpoint", "corrupt-mirror": "mirror",
              "corrupt-peer": "peer"}


def corruption_outcome(events: list[dict]) -> dict:
    """What a run with one ``corrupt-*`` fault did (from its ``events.jsonl``): the flipped copy (``target``, its
    ``step``), whether a restore refused it (``detected``), every copy refused after the flip (``refused``:
    (source, step)), the restore that followed (``resumed``: (source, step), None if none) and whether that took
    another copy (``fell_back``: an older step; for a memory snapshot, also the same step from another source)."""
    [fault] = [e for e in events if e["event"] == Event.FAULT_INJECTED]
    after = [e for e in events if e["t"] >= fault["t"]]
    step = int(re.search(r"step (\d+)", fault["target"])[1])
    refused = [(e["source"], e["step"]) for e in after if e["event"] == Event.CHECKSUM_MISMATCH]
    resumed = [(e["source"], e["step"]) for e in after if e["event"] == Event.RESUMED]
    source, resumed = REFUSED_AS[fault["kind"]], resumed[0] if resumed else None
    fell_back = resumed is not None and (resumed != (source, step) if source == "memory" else resumed[1] < step)
    return {"kind": fault["kind"], "target": fault["target"], "step": step, "refused": refused,
            "detected": (source, step) in refused, "resumed": resumed, "fell_back": fell_back}


class FaultInjector(StepHook):
    """Fires this rank's configured faults at the right moment, once per run."""

    def __init__(self, specs: list[str], rank: int, world_size: int, events: EventLog, events_path: Path,
                 chaos_seed: int | None = None, fault_every_s: float = 0.0, ckpt: CheckpointConfig | None = None):
        self.rank, self.events = rank, events
        self.corruption = Corruption(checkpoints_dir(events_path.parent), ckpt or CheckpointConfig())
        past = read_events(events_path)
        self.fired = {e["fault"] for e in past if e["event"] == Event.FAULT_INJECTED}
        self.faults = [f for f in map(Fault.parse, specs) if f.rank == rank and f.id not in self.fired]
        for f in self.faults:
            if f.kind == "corrupt-peer" and NODE_ENV not in os.environ:
                raise ValueError(f"--inject-fault {f.id}: corrupt-peer flips the holder node's copy on this machine, "
                                 f"so it runs on the nodes of a LocalCluster only ({NODE_ENV} is unset)")
        # Waits until the newest memory snapshot is marked on the node (its checksums and marker come after the
        # loop's wait for the copy): the checkpoint manager's, once the session has built it.
        self.snapshots_marked: Callable[[], None] = lambda: None
        self.chaos: list[tuple[float, str, str]] = []
        if chaos_seed is not None and fault_every_s > 0:
            starts = [e["t"] for e in past if e["event"] == Event.RUN_START]
            t0, now = (starts[0] if starts else time.time()), time.time()
            # Faults whose moment passed while the run was down (restarting) are skipped, not stacked.
            self.chaos = [(t0 + t, kind, f"chaos:{chaos_seed}:{i}:{kind}")
                          for i, (t, kind, r) in enumerate(chaos_schedule(chaos_seed, fault_every_s, world_size))
                          if r == rank and t0 + t >= now and f"chaos:{chaos_seed}:{i}:{kind}" not in self.fired]
        self.pending_ckpt_crash: Fault | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.faults or self.chaos)

    def before_optimizer_step(self, step: int) -> None:
        """Mid-step (after backward, before the optimizer step): fire this rank's faults due at ``step``."""
        if any(f.step <= step for f in self.faults if f.id not in self.fired):
            # Once the copies the loop waited for are marked (checksums and marks run behind it): a fault then
            # finds what the steps before it left, whatever the threads' timing.
            self.snapshots_marked()
        for f in self.faults:
            if f.id in self.fired:
                continue
            if f.kind in CORRUPT_KINDS:
                if f.step <= step:      # at the first step its copy is there
                    self._maybe_corrupt(f, step)
            elif f.kind == "hang-after-snapshot":
                if f.step <= step and self._snapshot_past_checkpoint():
                    self._fire(f.kind, f.id, step)
            elif f.step == step:
                if f.kind == "ckpt-crash":
                    self.pending_ckpt_crash = f
                else:
                    self._fire(f.kind, f.id, step)
        while self.chaos and self.chaos[0][0] <= time.time():
            _, kind, fid = self.chaos.pop(0)
            self._fire(kind, fid, step)

    def on_checkpoint_write_started(self, step: int) -> None:
        """Called by the checkpoint manager once this rank's write is handed to the writer."""
        f = self.pending_ckpt_crash
        if f is not None and step >= f.step:
            self._fire("ckpt-crash", f.id, step)

    def _snapshot_past_checkpoint(self) -> bool:
        """Whether this rank's newest memory snapshot marked on the node is of a step past
        the newest committed checkpoint."""
        from .checkpoint.replica import read_marker_file

        marker = read_marker_file(replica_marker(self.corruption.replicas, self.rank))
        return marker is not None and marker["step"] > max(committed_steps(self.corruption.root), default=0)

    def _maybe_corrupt(self, f: Fault, step: int) -> None:
        flip = self.corruption.plan(f.kind, self.rank, random.Random(f.seed or 0))
        if flip is not None:
            self._fire(f.kind, f.id, step, flip)

    def _fire(self, kind: str, fault_id: str, step: int, flip: "Flip | None" = None) -> None:
        self.fired.add(fault_id)
        # Recorded before it fires: a killed rank cannot write afterwards, and the restart must skip it.
        self.events.emit(Event.FAULT_INJECTED, fault=fault_id, kind=kind, step=step,
                         **({"target": flip.target} if flip is not None else {}))
        if flip is not None:
            flip.apply()
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "exception":
            raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")
        if kind in ("kill", "ckpt-crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if kind in ("hang", "hang-after-snapshot"):
            # Stuck inside one native call, like a kernel or I/O that never returns: no Python runs, no
            # exit. Only a watchdog (the rank monitor, the Wrapper's hard timeout) ends it.
            time.sleep(10 ** 7)


@dataclass
class Flip:
    """One byte to flip (``apply``), and what is lost with it: ``target`` names both."""

    target: str
    apply: Callable[[], None]


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    fsync_file(path)


class Corruption:
    """Plans the ``corrupt-*`` faults: which byte of which copy, once the copy is there.

    Args:
        root: the run's ``checkpoints`` directory.
        cfg: its checkpoint section (where memory snapshots live, the S3 mirror).
    """

    def __init__(self, root: Path, cfg: CheckpointConfig):
        self.root, self.cfg = root, cfg
        self.replicas = replica_dir(Path(cfg.memory_dir), root)
        self._s3 = None     # (layout, client) of the mirror, built on first use

    def plan(self, kind: str, rank: int, rng: random.Random) -> Flip | None:
        """The flip of ``kind`` on ``rank``, or None while the copy (and an older one) is not there yet."""
        if kind == "corrupt-snapshot":
            return self._snapshot(rank, rng)
        if kind == "corrupt-ckpt":
            return self._checkpoint(rng)
        if kind == "corrupt-peer":
            return self._peer_copy(rank, rng)
        return self._mirror(rng)

    def _snapshot(self, rank: int, rng: random.Random) -> Flip | None:
        from .checkpoint.replica import read_marker_file, tensor_spans

        markers = (("newest", replica_marker(self.replicas, rank)), ("previous", replica_previous(self.replicas, rank)))
        marked = [(which, m) for which, path in markers if (m := read_marker_file(path)) is not None]
        if not marked:
            return None
        which, marker = rng.choice(marked)
        index, (start, size) = rng.choice([(i, s) for i, s in enumerate(tensor_spans(marker)) if s[1] > 0])
        offset = start + rng.randrange(size)
        path = replica_slot(self.replicas, rank, marker["slot"])
        return Flip(f"{which} memory snapshot of step {marker['step']}: {path.name} byte {offset} (tensor {index})",
                    lambda: _flip_byte(path, offset))

    def _peer_copy(self, rank: int, rng: random.Random) -> Flip | None:
        from .checkpoint.replica import read_marker_file, tensor_spans

        marker = read_marker_file(replica_marker(self.replicas, rank))
        steps = committed_steps(self.root)
        # No ring (one node, peer snapshots off): nothing is shipped, nothing to wait for.
        if marker is None or not steps or marker["step"] <= steps[-1] or not peer_file(self.replicas).is_file():
            return None
        held = self._held_copy(rank, marker)
        if held is None:
            return None
        path, kept = held
        index, (start, size) = rng.choice([(i, s) for i, s in enumerate(tensor_spans(kept)) if s[1] > 0])
        offset = start + rng.randrange(size)

        def apply() -> None:
            self._forget_memory()
            _flip_byte(path, offset)

        return Flip(f"holder's copy of the memory snapshot of step {marker['step']}: "
                    f"{path.relative_to(self.replicas.parent.parent)} byte {offset} (tensor {index}); this node's "
                    f"memory snapshots lost", apply)

    def _held_copy(self, rank: int, marker: dict) -> tuple[Path, dict] | None:
        """(slot file, marker) of the copy of ``marker``'s snapshot that the holder keeps for ``rank``, once it is
        kept (the node's daemon ships it when the rank marks it); None if it is not within ``PEER_WAIT_S``. The
        holder's store is found in the node directories beside this node's (a ``LocalCluster``'s)."""
        from .peer import STORE_DIR, _Slots

        deadline = time.monotonic() + PEER_WAIT_S
        while True:
            for index in self.replicas.parent.parent.glob(f"*/{self.replicas.name}/{STORE_DIR}/node*/rank{rank}.index"):
                slots = _Slots(index.parent, rank)
                for slot, e in slots.index().items():
                    kept = json.loads(bytes.fromhex(e["marker"]))
                    if (kept["step"], kept.get("run")) == (marker["step"], marker.get("run")):
                        return slots.path(slot), kept
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def _checkpoint(self, rng: random.Random) -> Flip | None:
        steps = committed_steps(self.root)
        if len(steps) < 2:
            return None
        path = step_dir(self.root, steps[-1])
        name, offset = _tensor_byte(path, rng)

        def apply() -> None:
            self._forget_memory()
            _flip_byte(path / name, offset)

        return Flip(f"checkpoint step {steps[-1]}: {name} byte {offset}; memory snapshots forgotten", apply)

    def _mirror(self, rng: random.Random) -> Flip | None:
        if self._s3 is None:
            from .mirror import MirrorLayout, s3_client

            self._s3 = MirrorLayout(self.cfg.mirror), s3_client(self.cfg)
        lay, client = self._s3
        marked = sorted(s for s, m in lay.list_steps(client).items() if m)
        if len(marked) < 2:
            return None
        step = marked[-1]
        name = rng.choice(sorted(n for n in lay.read_marker(client, step)["files"] if n != COMMITTED))
        key = lay.key(step, name)
        data = bytearray(client.get_object(Bucket=lay.bucket, Key=key)["Body"].read())
        offset = rng.randrange(len(data))

        def apply() -> None:
            data[offset] ^= 0xFF
            client.put_object(Bucket=lay.bucket, Key=key, Body=bytes(data))
            for local in committed_steps(self.root):     # FSx lost: nothing committed there any more
                (step_dir(self.root, local) / COMMITTED).unlink(missing_ok=True)
            self._forget_memory()

        return Flip(f"mirror step {step}: {name} byte {offset}; FSx checkpoints and memory snapshots lost", apply)

    def _forget_memory(self) -> None:
        """The node's memory snapshots are gone, as with the node: their markers (the slots are then never read)."""
        for rank in replica_ranks(self.replicas):
            replica_marker(self.replicas, rank).unlink(missing_ok=True)
            replica_previous(self.replicas, rank).unlink(missing_ok=True)


def _tensor_byte(path: Path, rng: random.Random) -> tuple[str, int]:
    """(shard file, offset) of a random byte of a random tensor's data in the checkpoint at ``path``: bytes a load
    reads, not the serialisation around them."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    items = sorted(((index.fqn, tuple(index.offset or ())), info) for index, info in meta.storage_data.items()
                   if isinstance(meta.state_dict_metadata.get(index.fqn), TensorStorageMetadata))
    while items:
        _, info = items.pop(rng.randrange(len(items)))
        with open(path / info.relative_path, "rb") as fh:
            fh.seek(info.offset)
            raw = fh.read(info.length)
        data = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        tensor = data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        at = raw.find(tensor)
        if len(tensor) >= 64 and at >= 0:     # small tensors could match bytes of their header
            return info.relative_path, info.offset + at + rng.randrange(len(tensor))
    raise ValueError(f"{path}: no tensor of at least 64 bytes to corrupt")
