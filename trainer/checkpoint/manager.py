"""``CheckpointManager``: saves, memory snapshots and restore of the training state (how; the
``Checkpointer`` decides when).

An async save, in the order the training loop sees it:
  1. ``save``: a background thread starts copying the state's tensors into the staging copy (``staging``),
     and DCP's planning of the write follows on that thread (a staging copy's first planning, collective,
     runs on the loop's).
  2. The loop runs the next step's forward and backward passes while the copy runs: they only read the
     parameters. ``finish_snapshot``, called before the optimizer step changes the state, waits for the
     copy (usually done by then) and gives the write to the ``writer``, which hands it to NVRx's persistent
     worker once it is planned. The loop is blocked only for whatever of the copy is left.
  3. ``maybe_finalize`` (top of every step): hands planned writes over, finalizes this rank's finished
     writes without blocking and without collectives by writing its done file; rank 0 commits complete
     steps (``commit``).
  4. ``wait`` (exit, SIGTERM): blocking finalize on every rank, barrier, commit.

``snapshot_to_memory`` copies the state into node memory instead (``replica``): no disk, no writer, no
collective. ``restore`` takes the newest state every rank can get: memory, else the newest committed
checkpoint (fetched from the S3 mirror first when FSx has none); between the two, in a job of several
nodes, the copies of a lost node's snapshots that another node keeps (``trainer/peer.py``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from .. import compat
from ..config import CheckpointConfig
from ..events import Event, EventLog
from ..durable import write_bytes
from ..layout import peer_file, read_marker, replica_dir, step_dir
from ..mirror import CheckpointMirror, maybe_fetch_from_mirror
from ..parallel import Dist
from ..peer import ENV as PEER_ENV
from ..peer import PeerRefused, holder_of, parse_address, peer_steps, restore_from_peer
from ..peer import wake as wake_peer_daemon
from .commit import Commits, Pending, delete_checkpoint
from .integrity import ChecksumMismatch, staged_digests, state_digests, verify_files, verify_planned, verify_state
from .replica import MemorySnapshots
from .staging import Copier, Staging, core_wait_s
from .writer import Writer

log = logging.getLogger(__name__)


def _node_index() -> int:
    """This rank's node in the job (its agent's group rank, set by the rendezvous; a replacement node takes the
    lost one's)."""
    return int(os.environ.get("GROUP_RANK", "0"))


StateSource = dict | Callable[[], dict]   # a state dict, or a function that builds one


@dataclass
class _Write:
    """The write of a snapshot to its checkpoint, planned behind the copy."""

    writer: Any             # NVRx's FileSystemWriterAsync for the step's directory
    plan: Future            # its planning; the result is DCP's global metadata (rank 0)
    finalize: Callable[[], None]   # run on this rank once the worker wrote its part
    started: float          # when the save was called (monotonic)
    verified: Future | None = None   # an owed copy's check: the write is handed over only if every rank passed


@dataclass
class _Snapshot:
    """A copy of the state that is running: between ``save`` (or ``snapshot_to_memory``) and
    ``finish_snapshot``."""

    step: int
    state: dict | None      # the snapshot: the copy's tensors and the state's other values
    copy: Future            # the background copy; its result is the seconds it took
    write: _Write | None    # None: kept in memory only
    blocked_s: float        # how long the call that started it held the caller
    phases: dict
    slot: int = 0           # a memory snapshot's replica slot
    sums: Future | None = None   # the checksums of the copy, taken once it is whole (integrity)


def _done(value: Any) -> Future:
    """A future that already holds ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


class CheckpointManager:
    """Saves and loads the training state through the commit protocol.

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
        self.on_write_started = on_write_started
        # Rank 0 commits, so rank 0 mirrors (--ckpt-mirror): a background uploader fed by each commit.
        self.mirror = CheckpointMirror(root, cfg, events) if cfg.mirror and d.is_main else None
        self.commits = Commits(root, d, events, cfg.keep, self.mirror)
        self.writer = Writer(cfg, d.rank, events)
        self.staging = Staging(pin=d.device.type == "cuda")
        self.copier = Copier(d.device, cfg.copy_nice)
        # The in-memory replica (snapshot_to_memory): two slots in node-local shared memory, which a rank
        # started by an in-job restart finds again.
        self.replica = MemorySnapshots(replica_dir(Path(cfg.memory_dir), root), d.rank, pin=d.device.type == "cuda")
        self.peer_ring = False   # the node's peer daemon ships each snapshot to another node (set at restore)
        # The staging copy's snapshot, while it holds the last save's state (in-process restarts resume from it).
        self.snapshot: dict | None = None
        self.snapshot_step: int | None = None
        self.snapshot_sums: Future | None = None   # its checksums (planned_digests)
        self.copying: _Snapshot | None = None
        # The last memory snapshot's mark on the node, on the checksum thread (``_mark``): the replica is read
        # or changed only once it is done (``wait_for_mark``).
        self.marking: Future | None = None
        # Called with the blocking seconds of every interval save (the interval policy, the metrics).
        self.on_snapshot: Callable[[float], None] | None = None

    # ------------------------------------------------------------------------------------ status
    @property
    def writing(self) -> bool:
        """A snapshot is being copied or written (as of the last finalize)."""
        return self.copying is not None or self.writer.writes_in_flight > 0

    @property
    def mark_pending(self) -> bool:
        """This rank's last memory snapshot is copied and not yet marked on the node (its checksums run)."""
        return self.marking is not None and not self.marking.done()

    @property
    def writes_in_flight(self) -> int:
        return self.writer.writes_in_flight

    @property
    def replica_copy_s(self) -> float:
        return self.replica.copy_s

    def guard_writer(self, atomic: Callable[[], contextlib.AbstractContextManager]) -> None:
        """Run the writer's bookkeeping inside ``atomic()``, the current attempt's (the in-process Wrapper's):
        a restart never lands in the middle of it (``Writer.atomic``)."""
        self.writer.atomic = atomic

    def start_writer(self) -> None:
        """Start the writer (it boots in the background) and plan the staging copy's first save now, so that
        the first save neither waits for the boot nor gathers every rank's plan. Collective."""
        self.writer.start()
        self.staging.plan_ahead()

    @property
    def _replica_run(self) -> str | None:
        """What a replica is tagged with: the run and its world size. A snapshot of another world size (an
        elastic job that lost or gained nodes) holds another sharding and other ranks' data positions, and
        its layout can still match (replicated DDP state): it is never used, the resharded checkpoint is."""
        return None if self.run_id is None else f"{self.run_id}@{self.d.world_size}"

    # ----------------------------------------------------------------------------------------- load
    def restore(self, state: dict) -> tuple[int | None, str, dict]:
        """Restore the newest state into ``state``; return (step or None, source, the restored dict).

        The order: own memory, peer memory, FSx checkpoint, S3 mirror. Every rank may hold snapshots in
        memory: after an in-process restart, the staging copy of its last save; and the replica of its last
        ``snapshot_to_memory`` (and of the one before it), which also survives an in-job restart on the same
        node. The newest step that every rank holds, if no committed checkpoint is newer, is copied back
        (``memory``: no disk read). Else, in a job of several nodes, the ranks that lack it ask their node's
        holder (``trainer/peer.py``) for its copies: the newest step every rank can get from its own memory or
        the holder's, if not older than the newest committed checkpoint, is fetched into the replica of each
        rank that lacks it and read from there (``peer``). Otherwise the newest committed checkpoint is
        loaded (``checkpoint``), fetched from the S3 mirror first when FSx has none. Collective: call on
        every rank.
        """
        self.finish_snapshot(after_fault=True)   # a fault can come while a snapshot is copied: it still completes
        self._verify_staging_snapshot()
        self.replica.read_back(state)
        newest = self.commits.newest() if self.d.is_main else None
        held = [None] * self.d.world_size
        # Sync point: which snapshot steps each rank holds in memory (the replica's with the run that made
        # them), its node and that node's peer store, and rank 0's run and newest committed step.
        dist.all_gather_object(held, (self.snapshot_step, self.replica.offers(state), self.run_id, newest,
                                      _node_index(), os.environ.get(PEER_ENV)))
        self._report_rejected()   # the newest snapshot's read-back, and the one before it when offered
        self.run_id, committed = held[0][2], held[0][3]
        tag = self._replica_run
        own = [({h[0]} | {s for s, run in h[1] if run == tag}) - {None} for h in held]
        holder = self._holder([(h[4], h[5]) for h in held])
        self.peer_ring = holder is not None
        step, source, offered = self._choose(own, committed, holder, tag)
        if source == "peer" and not self._fetch_from_peer(step, own[self.d.rank], holder, tag, state):
            step, source = None, "checkpoint"
        if self.d.is_main:
            log.info("restore: in every rank's memory %s; with peer copies %s; newest committed checkpoint %s "
                     "-> %s", sorted(set.intersection(*own)), offered, committed,
                     f"{source} step {step}" if source != "checkpoint" else
                     "the newest committed checkpoint, if any (FSx, else the S3 mirror)")
        if step is not None:
            copy_state_dict, _ = compat.cpu_state_dict_helpers()
            restored = copy_state_dict(self._memory_snapshot(step, state), state)
            self.events.emit(Event.CKPT_LOADED, step=step, source=source,
                             **({"fetched": step not in own[self.d.rank]} if source == "peer" else {}))
        else:
            step, source, restored = self._load_committed(state), "checkpoint", state
            if step is None:   # a fresh start: whatever replica is left belongs to no run
                self.replica.drop()
        # The new process group gets fresh staging buffers and plans: the old ones describe DTensors of the
        # previous group's device mesh. A write still in flight keeps its own mapping of the old buffers.
        # Allocating them now keeps that cost out of the first save's blocking time. (Not on the copier
        # thread: the caller goes on to load ``restored`` into the model and optimizer, which mutates it.)
        self.snapshot = self.snapshot_step = None
        self.staging.drop()
        self.replica.unmap()
        if not self.cfg.sync:
            self.staging.allocate(restored)
        if self.cfg.memory_every_s > 0:   # and both memory snapshot slots, mapped on a thread
            self.replica.reserve(restored)
        return step, source, restored

    def _choose(self, own: list[set[int]], committed: int | None, holder: tuple[str, int] | None,
                tag: str | None) -> tuple[int | None, str, list | str]:
        """(step, source, what the peer copies offered) of the newest state in memory every rank can get, or
        (None, "checkpoint", ...). Collective when the peer copies are asked (the same on every rank)."""
        def usable(offers: list[set[int]]) -> set[int]:
            return {s for s in set.intersection(*offers) if committed is None or s >= committed}

        if usable(own):
            return max(usable(own)), "memory", "not asked"
        wanted = usable([set().union(*own)])     # steps some rank has: of use if the others can get them
        if holder is None or tag is None or not wanted:
            return None, "checkpoint", "none" if holder is None else "not asked"
        mine, node = own[self.d.rank], _node_index()
        copies: set[int] = set()
        if wanted - mine:
            try:
                copies = set(peer_steps(holder, node, run=tag).get(self.d.rank, ())) & wanted
            except PeerRefused as e:
                self.peer_refused(holder, str(e))
            except (OSError, ValueError, KeyError) as e:   # a holder gone or silent: no copies, not a hang
                log.warning("rank %d: the holder of node %d's memory snapshots (%s:%d) did not answer: %s",
                            self.d.rank, node, *holder, e)
        offers = [None] * self.d.world_size
        # Sync point: each rank's steps from its own memory or its holder's copies.
        dist.all_gather_object(offers, mine | copies)
        steps = usable(offers)
        return (max(steps), "peer", sorted(steps)) if steps else (None, "checkpoint", [])

    def _holder(self, nodes: list[tuple[int, str | None]]) -> tuple[str, int] | None:
        """The address of the peer store that keeps this node's snapshots (the next node in the ring), from
        (node, store address) of every rank; None where there is no ring (one node, peer snapshots off, some
        node without a store). Local rank 0 of each node tells its peer daemon which node it is and where its
        holder listens (``layout.peer_file``)."""
        ring = {node: address for node, address in nodes}
        if not self.cfg.peer_snapshots or len(ring) < 2 or None in ring.values() or set(ring) != set(range(len(ring))):
            return None
        node = _node_index()
        holder = parse_address(ring[holder_of(node, len(ring))])
        if self.d.local_rank == 0:
            path = peer_file(self.replica.node.dir)
            try:
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_bytes(path, json.dumps({"node": node, "holder": holder}).encode())
            except OSError as e:    # no snapshot directory on the node: nothing to ship, copies still usable
                log.warning("node %d's peer daemon is not told where to send (%s): %s", node, path, e)
        return holder

    def _fetch_from_peer(self, step: int, mine: set[int], holder: tuple[str, int], tag: str, state: dict) -> bool:
        """Fetch this rank's copy of ``step`` from its node's holder into its replica, unless its own memory
        has it; return whether every rank has it now (collective)."""
        ok = True
        if step not in mine:
            try:
                got = restore_from_peer(holder, _node_index(), [self.d.rank], self.replica.node.dir,
                                        among={step}, run=tag)
            except PeerRefused as e:
                self.peer_refused(holder, str(e))
                got = None
            except ChecksumMismatch as e:
                self.checksum_mismatch("peer", step, str(e))
                got = None
            self.replica = MemorySnapshots(self.replica.node.dir, self.d.rank, pin=self.replica.node.pin)
            self.replica.read_back(state)
            self._report_rejected(source="peer")
            ok = got == step and self.replica.step == step and self.replica.run == tag
        flags = [None] * self.d.world_size
        # Sync point: whether every rank could read the chosen step (else all fall back to the checkpoint).
        dist.all_gather_object(flags, ok)
        if not all(flags) and self.d.is_main:
            log.warning("restore: ranks %s could not fetch step %d from their holder; falling back to the "
                        "newest committed checkpoint", [r for r, f in enumerate(flags) if not f], step)
        return all(flags)

    def _verify_staging_snapshot(self) -> None:
        """The staging copy's snapshot (an in-process restart resumes from it) is used only if it still holds
        the bytes its save staged."""
        if self.snapshot_step is None:
            return
        try:
            verify_planned(self.staging.planner, self.snapshot_sums.result())
        except ChecksumMismatch as e:
            self.checksum_mismatch("staging", self.snapshot_step, str(e))
            self.snapshot = self.snapshot_step = self.snapshot_sums = None

    def _report_rejected(self, source: str = "memory") -> None:
        for step, why in self.replica.rejected:
            self.checksum_mismatch(source, step, why)
        self.replica.rejected = []

    def peer_refused(self, holder: tuple[str, int], why: str) -> None:
        """A reply from the holder was not authentic: nothing of it is used."""
        log.error("rank %d: refused a reply of the peer holder %s:%d: %s", self.d.rank, *holder, why)
        self.events.emit(Event.PEER_REFUSED, role="rank", peer=f"{holder[0]}:{holder[1]}", reason=why[:400])

    def checksum_mismatch(self, source: str, step: int, why: str) -> None:
        """A copy of ``step`` in ``source`` does not hold the bytes that were staged: it is not used."""
        log.error("rank %d: the %s copy of step %d is not used: %s", self.d.rank, source, step, why)
        self.events.emit(Event.CHECKSUM_MISMATCH, source=source, step=step, rank=self.d.rank, reason=why[:400])

    def _memory_snapshot(self, step: int, state: dict) -> dict:
        """This rank's snapshot of ``step`` in memory: the staging copy's, the replica's, or the one before."""
        if step == self.snapshot_step:
            return self.snapshot
        if step == self.replica.step:
            return self.replica.snapshot
        return self.replica.read_previous(state)

    def _load_committed(self, state: dict) -> int | None:
        """Load the newest committed checkpoint into ``state`` in place; return its step or None.

        Rank 0 picks the step and deletes torn directories first; the choice is broadcast so every rank
        loads the same checkpoint.
        """
        rejected = []
        while True:
            step = self._newest_committed()
            if step is None:
                if rejected:
                    raise RuntimeError(f"no committed checkpoint holds the bytes that were staged (steps {rejected} "
                                       f"failed their checksums; see the checksum_mismatch events): refusing to "
                                       f"start over from scratch")
                return None
            path = step_dir(self.root, step)
            if self._verified(path, step):
                break
            if step in rejected:   # its FSx copy, then the S3 mirror's (verified at download): not trusted
                raise RuntimeError(f"step {step} failed its checksums twice (see the checksum_mismatch events): "
                                   f"refusing to load or start over")
            rejected.append(step)
            if self.d.is_main:
                # Un-committed, then deleted: the next round takes the next older one (or the S3 mirror's copy,
                # fetched when FSx has none left).
                delete_checkpoint(path)
            dist.barrier()   # sync point: every rank sees it gone before the next choice
        written_by = read_marker(path)["world_size"]
        if written_by != self.d.world_size:
            self._reshard(state, path, step, written_by)
        t0 = time.monotonic()
        dcp.load(state, checkpoint_id=str(path))
        self.events.emit(Event.CKPT_LOADED, step=step, source="checkpoint", load_s=round(time.monotonic() - t0, 4))
        return step

    def _newest_committed(self) -> int | None:
        """Rank 0's newest committed checkpoint (fetched from the S3 mirror first when FSx has none), the same on
        every rank. Collective."""
        if self.cfg.mirror:
            # Collective: with no committed checkpoint on FSx, rank 0 first fetches the newest mirrored one.
            maybe_fetch_from_mirror(self.root, self.cfg, self.d, self.events)
        choice = [None]
        if self.d.is_main:
            choice[0] = self.commits.newest()
            pending = self.commits.pending
            self.commits.delete_torn(older_than=None if not pending else pending[0].step)
        # Sync point: every rank waits for rank 0's choice (and its clean-up of torn directories).
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _verified(self, path: Path, step: int) -> bool:
        """Whether every item of the checkpoint at ``path`` holds the bytes that were staged: each rank reads back
        and hashes its share of the shard files (the loads that follow read them from the page cache). Collective."""
        t0 = time.monotonic()
        try:
            verify_files(path, share=(self.d.rank, self.d.world_size))
            ok = True
        except ChecksumMismatch as e:
            self.checksum_mismatch("checkpoint", step, str(e))
            ok = False
        flags = [None] * self.d.world_size
        dist.all_gather_object(flags, ok)   # sync point: the checkpoint is used only if every share verified
        if self.d.is_main and all(flags):
            self.events.emit(Event.CKPT_VERIFIED, step=step, verify_s=round(time.monotonic() - t0, 4))
        return all(flags)

    def _reshard(self, state: dict, path: Path, step: int, written_by: int) -> None:
        """A checkpoint of another world size (an elastic job re-formed with fewer or more nodes): DCP
        reshards the model's and optimizer's DTensors on load. Entries the checkpoint has no key for (a rank's
        own RNG state where that rank did not exist) are dropped from ``state``, for the app to start afresh."""
        saved = {fqn.split(".", 1)[0] for fqn in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}
        for key in [k for k in state if k not in saved]:
            del state[key]
        if self.d.is_main:
            log.warning("resuming from step %d written by %d ranks on %d: resharded, not a bitwise resume",
                        step, written_by, self.d.world_size)
            self.events.emit(Event.RESHARDED, from_world_size=written_by, to_world_size=self.d.world_size, step=step)

    # ----------------------------------------------------------------------------------------- save
    def save(self, step: int, state: StateSource, *, blocking: bool = False, writers_idle: bool = False) -> None:
        """Checkpoint ``state`` as step ``step``. Must be called on every rank with the same step.

        ``state``: the state dict, or a function that builds it (then building it counts as blocking time).
        ``writers_idle``: every rank had finalized its previous write when the step's signals were all-reduced
        (``StepSignals.writing`` false): the save needs no sync point first, and the ``maybe_finalize`` that
        ends the step commits that write.

        Async (the default), it returns once the copy of ``state`` has started: the caller may run forward
        and backward passes, but must call ``finish_snapshot`` before it changes the state. With ``blocking``
        (SIGTERM, end of training), and with ``--ckpt-sync``, it returns once the checkpoint is committed.
        """
        self._save(step, state, time.monotonic(), blocking=blocking, writers_idle=writers_idle, verified=None)

    def _save(self, step: int, state: StateSource, t0: float, *, blocking: bool, writers_idle: bool,
              verified: Future | None) -> None:
        """``save`` (called at ``t0``); ``verified``: the check of an owed copy, which every rank must pass for it
        to be written."""
        # What the loop's thread waited for a core in the hold: where a slow hold went on shared cores.
        waited_for_core = core_wait_s()
        state = state() if callable(state) else state
        path = step_dir(self.root, step)
        if self.d.is_main:
            self.events.emit(Event.CKPT_START, step=step)
        if self.cfg.sync or (blocking and self._writer_cold()):
            if verified is not None and not self._verified_everywhere(verified, step):
                return
            planner = DefaultSavePlanner()
            dcp.save(state, checkpoint_id=str(path), planner=planner)
            # The state has not changed since: the checksums are of the bytes written (before the barrier, for
            # the commit).
            self.commits.record_checksums(step, staged_digests(planner))
            if self.on_write_started:
                self.on_write_started(step)
            # Sync point: every rank's shards are on disk before rank 0 commits.
            dist.barrier()
            if self.d.is_main:
                self.commits.commit(Pending(step, t0), results=None)
            self._snapshot_taken(step, time.monotonic() - t0, sync=True, interval=not blocking)
            return
        self._save_async(step, state, path, t0, writers_idle, verified, waited_for_core)
        if blocking:
            self.finish_snapshot(report=False)
            self.wait()
            self._snapshot_taken(step, time.monotonic() - t0, sync=True, interval=False)

    def save_owed(self, step: int, copy: dict, *, writers_idle: bool = False) -> None:
        """Checkpoint ``copy`` (a memory copy kept for it by ``snapshot_to_memory(keep=True)``) as step ``step``,
        if every rank's copy still holds the bytes it was copied with; else write nothing (a ``checksum_mismatch``
        event on the rank whose copy changed). The copy is verified on the checksum thread while it is staged,
        and the ranks agree before the write is handed over (in ``finish_snapshot``). Collective."""
        t0 = time.monotonic()   # the save holds the loop from here: the wait for its copy's mark included
        self.wait_for_mark()
        kept_step, checksums = self.replica.kept_checksums(copy)
        verified = self.copier.after_checksums(
            lambda: verify_state(copy, checksums, f"the memory copy of step {kept_step} owed to the writer"))
        self._save(step, copy, t0, blocking=False, writers_idle=writers_idle, verified=verified)

    def _verified_everywhere(self, verified: Future, step: int) -> bool:
        """Whether every rank's owed copy held its bytes (``verified`` raised nothing). Collective."""
        try:
            verified.result()
            ok = 1.0
        except ChecksumMismatch as e:
            self.checksum_mismatch("owed copy", step, str(e))
            ok = 0.0
        flag = torch.tensor([ok], device=self.d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)   # sync point: every rank writes it, or none
        return flag.item() > 0

    def _writer_cold(self) -> bool:
        """Whether some rank's writer is not started, or still booting with no write queued (collective).

        A blocking save then writes synchronously (SIGTERM or the end of training soon after a start):
        faster than waiting for the writer to boot.
        """
        flag = torch.tensor([float(self.writer.booting)], device=self.d.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)   # sync point: every rank takes the same path
        return flag.item() > 0

    def _save_async(self, step: int, state: dict, path: Path, t0: float, writers_idle: bool,
                    verified: Future | None, waited_for_core: float) -> None:
        """Start the copy and the planning of the write behind it; ``self.copying`` records where the blocking
        time went (wait, commit, stage, start; plan, where the staging copy's first planning gathers every
        rank's plan)."""
        from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

        self.writer.start()
        # The staging copy is reused, so the previous snapshot must be whole and its write finished before
        # it is overwritten.
        self.finish_snapshot()
        self.writer.finalize(writes_only=True)
        t_wait = time.monotonic()
        if self.snapshot_step is not None and not writers_idle:
            # Sync point: every rank has recorded the previous write, so rank 0 commits it now; otherwise a
            # crash during this save would lose a checkpoint that was already whole on disk. The condition must
            # be the same on every rank: ``pending`` is not, and a barrier on rank 0 alone deadlocks the loop.
            # (With ``writers_idle`` the step's all-reduce said so already, and the ``maybe_finalize`` that
            # ends the step commits it, outside the loop's hold: the committer thread's Python takes the GIL.)
            dist.barrier()
            self.commits.maybe_commit_behind()
        t_commit = time.monotonic()
        snapshot, pairs = self.staging.stage(state)
        # The staging copy is about to be overwritten: it no longer holds the previous snapshot.
        self.snapshot = self.snapshot_step = self.snapshot_sums = None
        t_stage = time.monotonic()
        writer = FileSystemWriterAsync(str(path), thread_count=self.cfg.write_threads)
        copy = self.copier.start(pairs)
        # Planning follows the copy: from NVRx 0.7 it clones every CPU tensor, so planned earlier the checkpoint
        # would hold the staging copy's previous state. A staging copy planned before reuses its plan, which
        # needs no collective: it runs on the copy thread, behind the loop's next forward and backward.
        phases = {"wait_s": t_wait - t0, "commit_s": t_commit - t_wait, "stage_s": t_stage - t_commit}
        if self.staging.planned:
            plan = self.copier.then(lambda: self.staging.plan(snapshot, writer))
        else:
            copy.result()
            t_copy = time.monotonic()
            plan = _done(self.staging.plan(snapshot, writer))   # collective: on this thread, on every rank
            phases.update(copy_before_plan_s=t_copy - t_stage, plan_s=time.monotonic() - t_copy)
        planner = self.staging.planner
        sums = self.copier.checksum(plan, lambda: staged_digests(planner))

        def finalize() -> None:
            # Runs on this rank once its worker finished: record the checksums and write results durably.
            self.commits.record_done(step, writer.retrieve_write_results(), sums.result())
            self.writer.written()

        now = time.monotonic()
        phases["start_s"] = now - t_stage - phases.get("copy_before_plan_s", 0.0) - phases.get("plan_s", 0.0)
        phases["core_wait_s"] = core_wait_s() - waited_for_core
        self.copying = _Snapshot(step, snapshot, copy, _Write(writer, plan, finalize, t0, verified), now - t0,
                                 phases, sums=sums)

    def finish_snapshot(self, *, report: bool = True, after_fault: bool = False) -> float:
        """Wait for the copy ``save`` started and hand the write to the writer; return the seconds waited.

        Call before the state changes (the optimizer step). Returns at once when no copy is running. The write
        goes to NVRx's worker once its planning (behind the copy, on the copy thread) is done: the loop does
        not wait for it.
        ``report``: record the save's blocking time (an interval save's; a blocking save records its own).
        ``after_fault``: the restore after a restart, or the teardown. A fault may have come on some ranks
        before this save's finish and on others after it, so the ranks cannot agree on an owed copy (a
        collective); its copy completes and its write is dropped (it was owed, never committed). Writes whose
        planning failed (it ran after the fault) are dropped too.
        """
        waited = self._finish_copy(report, after_fault)
        if after_fault:
            self.writer.drop_unplanned()
            self.wait_for_mark()
        return waited

    def _finish_copy(self, report: bool, after_fault: bool) -> float:
        s, self.copying = self.copying, None
        if s is None:
            return 0.0
        t0, waited_for_core = time.monotonic(), core_wait_s()
        copy_s = s.copy.result()
        s.phases["core_wait_s"] += core_wait_s() - waited_for_core
        if s.write is None:   # kept in memory only
            waited = time.monotonic() - t0
            self.marking = self.copier.after_checksums(functools.partial(self._mark, s, copy_s, waited, self.replica))
            return waited
        w = s.write
        if w.verified is not None and (after_fault or not self._verified_everywhere(w.verified, s.step)):
            return time.monotonic() - t0   # nothing written: the staging copy holds no snapshot either
        self.snapshot, self.snapshot_step, self.snapshot_sums = s.state, s.step, s.sums
        self.writer.schedule(functools.partial(self._write_request, s.step, w), w.plan, s.step)
        waited = time.monotonic() - t0
        if report:
            self._snapshot_taken(s.step, s.blocked_s + waited, sync=False,
                                 phases={**s.phases, "copy_wait_s": waited, "copy_s": copy_s})
        if self.on_write_started:
            self.on_write_started(s.step)
        return waited

    def _mark(self, s: _Snapshot, copy_s: float, copy_wait_s: float, replica: MemorySnapshots) -> None:
        """Checksum thread, once the memory copy's checksums are taken: the copy becomes the newest snapshot,
        marked on the node with them. Until then the one before it stays the newest, its slot untouched: the
        next copy waits for this mark (``wait_for_mark``), so the loop waits for neither the checksums nor
        the marker's write."""
        t0 = time.monotonic()
        replica.completed(s.step, s.slot, s.state, self._replica_run, copy_s, s.sums.result())
        if self.peer_ring:
            wake_peer_daemon(replica.node.dir)
        if self.d.is_main:
            self.events.emit(Event.MEMORY_SNAPSHOT, step=s.step, block_s=round(s.blocked_s + copy_wait_s, 4),
                             copy_s=round(copy_s, 4), start_s=round(s.blocked_s, 4), copy_wait_s=round(copy_wait_s, 4),
                             mark_s=round(time.monotonic() - t0, 4), core_wait_s=round(s.phases["core_wait_s"], 4),
                             **({"owed": True} if s.slot in replica.kept else {}))

    def wait_for_mark(self) -> None:
        """Wait until the last memory snapshot is marked on the node (``_mark``: a restart finds it from then on),
        and raise the mark's error. Kept while unfinished: a restart's exception that lands in the wait leaves
        it to the restore's wait."""
        marking = self.marking
        if marking is None:
            return
        try:
            marking.result()
        finally:
            if marking.done():
                self.marking = None

    def _write_request(self, step: int, w: _Write) -> Any:
        """The write's NVRx request, once its planning is done; the step is then in flight, to be committed (not
        before its request exists: a step that is never written would stay pending)."""
        metadata = w.plan.result()
        request = compat.save_request(w.writer, [w.finalize], compat.installed_release())
        self.commits.add(Pending(step, w.started, w.writer if self.d.is_main else None, metadata))
        return request

    def snapshot_to_memory(self, step: int, state: StateSource, *, keep: bool = False) -> dict:
        """Copy ``state`` into the in-memory replica (node-local shared memory; nothing is written to disk).

        Like ``save``: the copy runs on the copier thread, and ``finish_snapshot`` must be called before
        the state changes. It costs no disk, no writer and no collective, so it can be taken far more often
        than checkpoints: a restart in the same process or on the same node then redoes only the steps
        since the last one. Returns the copy (``save`` can write it later, as this step's checkpoint).
        ``keep``: it will be (a checkpoint owed to a busy writer): no copy overwrites it until ``release``.
        """
        t0, waited_for_core = time.monotonic(), core_wait_s()
        self.finish_snapshot()
        self.wait_for_mark()   # the copy goes into the slot of the snapshot before the last one
        state = state() if callable(state) else state
        slot, snapshot, pairs = self.replica.stage(state, keep=keep)   # never a slot a restart may read
        copy = self.copier.start(pairs)
        sums = self.copier.checksum(copy, lambda: state_digests(snapshot))
        self.copying = _Snapshot(step, snapshot, copy, None, time.monotonic() - t0,
                                 {"core_wait_s": core_wait_s() - waited_for_core}, slot, sums)
        return snapshot   # whole once finish_snapshot returned; kept until the next copy but one, or released

    def release(self, copy: dict) -> None:
        """A copy kept by ``snapshot_to_memory(keep=True)`` is no longer needed (its save has started: the
        next copy waits for the save's copy of it first)."""
        self.wait_for_mark()
        self.replica.release(copy)

    def drop_replica(self) -> None:
        """Forget the replica and free its memory on the node (a committed checkpoint supersedes it)."""
        self.wait_for_mark()
        self.replica.drop()

    def _snapshot_taken(self, step: int, block_s: float, *, sync: bool, phases: dict | None = None,
                        interval: bool = True) -> None:
        if self.d.is_main:
            self.events.emit(Event.CKPT_SNAPSHOT, step=step, block_s=round(block_s, 4), sync=sync,
                             **{k: round(v, 4) for k, v in (phases or {}).items()})
        if interval and self.on_snapshot is not None:
            self.on_snapshot(block_s)

    def maybe_finalize(self) -> None:
        """Top of every step: finalize finished writes without blocking; rank 0 commits complete steps."""
        if not self.writer.started:
            return
        self.writer.maybe_finalize()
        self.commits.maybe_commit_behind()

    def wait(self) -> None:
        """Block until every scheduled checkpoint is committed (call on all ranks)."""
        self.finish_snapshot()
        self.writer.finalize(writes_only=True)   # not the writer's warm-up: it may still be booting
        # Sync point: all ranks' done files exist before rank 0 commits the rest.
        dist.barrier()
        self.commits.maybe_commit()
        self.commits.check_all_committed()

    def maybe_drain_mirror(self) -> None:
        """Rank 0: wait, at most --ckpt-mirror-drain-s, until every committed checkpoint is mirrored."""
        if self.mirror is not None:
            self.mirror.drain(self.cfg.mirror_drain_s)
            # Local retention skipped steps the mirror still needed; those it has released go now.
            self.commits.join_purge()
            newest = self.commits.newest()
            if newest is not None:
                self.commits.purge(newest)

    def close(self) -> None:
        self.finish_snapshot(after_fault=True)   # at the end nothing is left; after a failure, no collective
        self.copier.close()
        self.replica.node.settle()   # the restore's mapping of the slots, if it still runs
        self.writer.close()
        self.commits.join_purge()
        if self.mirror is not None:
            self.mirror.close(self.cfg.mirror_drain_s)
