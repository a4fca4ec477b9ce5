"""The checkpoint manager in one process (gloo, world size 1): NVRx async round trip, commit protocol,
retention, torn directories, in-memory restore. The multi-rank crash cases are in test_resume.py."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import COMMITTED, CheckpointManager, committed_steps, delete_checkpoint, step_dir
from trainer.config import CheckpointConfig
from trainer.events import EventLog, read_events


def _state(seed: float) -> dict:
    g = torch.Generator().manual_seed(int(seed))
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)},
            "train": {"step": int(seed)}, "scalar": torch.tensor(float(seed))}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(64, 64), "b": torch.zeros(64)}, "train": {"step": -1},
            "scalar": torch.tensor(0.0)}


@pytest.mark.parametrize("sync", [False, True])
def test_round_trip_commit_retention_and_torn_cleanup(tmp_path, process_group, sync):
    events = EventLog(tmp_path / "events.jsonl", 0)
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(keep=2, sync=sync), process_group, events)
    try:
        live = _state(1)
        for step in (1, 2, 3):
            live = _state(step)
            mgr.save(step, live)
            mgr.finish_snapshot()                  # what the loop calls before its optimizer step,
            for t in live["model"].values():       # which mutates the state:
                t.add_(100.0)                      # the checkpoint must hold the snapshot, not this
            mgr.maybe_finalize()
        mgr.wait()
        mgr.commits.join_purge()
        assert committed_steps(tmp_path / "ckpt") == [2, 3]           # retention: keep=2
        # A torn directory (no marker) is ignored and deleted by the next restore.
        torn = step_dir(tmp_path / "ckpt", 4)
        torn.mkdir()
        (torn / "__0_0.distcp").write_bytes(b"partial")
        fresh = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(keep=2, sync=sync), process_group, events)
        try:
            step, source, restored = fresh.restore(_zeros())
        finally:
            fresh.close()
        assert (step, source) == (3, "checkpoint") and not torn.exists()
        expected = _state(3)
        assert torch.equal(restored["model"]["w"], expected["model"]["w"])
        assert restored["train"]["step"] == 3 and float(restored["scalar"]) == 3.0
        log = read_events(tmp_path / "events.jsonl")
        kinds = [e["event"] for e in log]
        assert kinds.count("ckpt_committed") == 3 and "ckpt_torn_deleted" in kinds
        snapshots = [e for e in log if e["event"] == "ckpt_snapshot"]
        assert [e["step"] for e in snapshots] == [1, 2, 3] and all(e["block_s"] >= 0 for e in snapshots)
        if not sync:   # the blocking time counts the wait for the background copy, and says what of it went to
            # waiting for a core
            assert all(e["block_s"] >= e["copy_wait_s"] for e in snapshots)
            assert all(0 <= e["core_wait_s"] <= e["block_s"] for e in snapshots), snapshots
    finally:
        mgr.close()


def test_a_thread_that_shares_its_core_counts_its_wait_for_it():
    """``core_wait_s``, what the saves' phases report as the loop's wait for a core, grows while a busy process
    shares the thread's one core (the thread is runnable and not run about half of the time)."""
    from trainer.checkpoint.staging import core_wait_s

    cpu = min(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpu})
        deadline = time.monotonic() + 60
        while psutil.Process(busy.pid).cpu_times().user < 0.1:      # it runs, on that core
            assert time.monotonic() < deadline, "the busy process never ran"
            time.sleep(0.05)
        before, t0 = core_wait_s(), time.monotonic()
        while time.monotonic() - t0 < 0.5:
            pass
        waited = core_wait_s() - before
    finally:
        os.sched_setaffinity(0, mine)
        busy.kill()
        busy.wait()
    assert waited > 0.1, f"waited {waited:.3f} s for a core in 0.5 s beside a busy process on it"


def test_the_writer_is_started_at_the_configured_niceness(tmp_path, process_group):
    """NVRx's worker runs at --ckpt-writer-nice from its start (its boot imports torch), not once it has
    booted; the rank itself keeps its priority."""
    mine = psutil.Process().nice()
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(writer_nice=7), process_group,
                            EventLog(tmp_path / "e", 0))
    try:
        before = {p.pid for p in psutil.Process().children()}
        mgr.start_writer()
        started = [p for p in psutil.Process().children() if p.pid not in before]
        # The worker at 7; the write-results queue's manager, which only relays results, at the rank's.
        assert sorted(p.nice() for p in started)[-1] == max(mine, 7)
        assert psutil.Process().nice() == mine
        mgr.save(1, _state(1))
        mgr.wait()     # and it still writes
        assert committed_steps(tmp_path / "ckpt") == [1]
    finally:
        mgr.close()


def test_the_copy_and_its_checksums_run_on_threads_at_the_configured_niceness(tmp_path, process_group):
    """A save's copy and its checksums run on two threads at --ckpt-copy-nice (the loop's thread gets the core
    first); the loop's thread keeps the rank's priority, and the checkpoint is written whole."""
    def nice(tid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, tid)

    mine = nice(threading.get_native_id())
    want = min(19, mine + 7)
    before = {t.id for t in psutil.Process().threads()}
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(copy_nice=want), process_group,
                            EventLog(tmp_path / "e", 0))
    try:
        mgr.save(1, _state(1))
        mgr.wait()
        assert committed_steps(tmp_path / "ckpt") == [1]
        started = [t.id for t in psutil.Process().threads() if t.id not in before]
        assert sorted(nice(t) for t in started if nice(t) != mine) == [want, want]
        assert nice(threading.get_native_id()) == mine
        restored = _state(0)
        step, _, restored = mgr.restore(restored)
        assert step == 1 and torch.equal(restored["model"]["w"], _state(1)["model"]["w"])
    finally:
        mgr.close()


_KILLED_RANK = """
import os, signal, sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig
from trainer.events import EventLog
from trainer.parallel import Dist

dist.init_process_group("gloo")
out = Path(sys.argv[1])
mgr = CheckpointManager(out / "ckpt", CheckpointConfig(), Dist(0, 1, 0, torch.device("cpu")), EventLog(out / "e", 0))
before = {p.pid for p in psutil.Process().children()}
mgr.start_writer()
mgr.writer.queue.maybe_finalize_async_calls(blocking=True, no_dist=True)   # booted: its warm-up request ran
print(" ".join(str(p.pid) for p in psutil.Process().children() if p.pid not in before), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_writer_does_not_outlive_a_killed_rank(tmp_path):
    """A rank killed with SIGKILL takes its checkpoint writer with it (no warm-start zygote to end it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # Output to a file: the processes under test would hold a pipe open after the rank died.
    with open(tmp_path / "out", "w+") as out:
        code = subprocess.run([sys.executable, "-c", _KILLED_RANK, str(tmp_path)], env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=120).returncode
        out.seek(0)
        printed = out.read()
    assert code == -signal.SIGKILL, printed
    # The pid line; the resource tracker may warn after it, once the rank is gone.
    pids = [int(pid) for pid in next(line for line in printed.splitlines() if line.replace(" ", "").isdigit()).split()]
    assert len(pids) >= 2    # the writer and the results-queue manager
    left = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            left.append(psutil.Process(pid))
    gone, alive = psutil.wait_procs(left, timeout=10)
    for p in alive:
        p.kill()
    assert not alive, f"writer processes outlived their rank: {alive}"


def test_in_memory_restore_after_an_in_process_restart(tmp_path, process_group):
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        mgr.save(5, _state(5))
        # A fault before the loop's finish_snapshot: what the restarted training function does first.
        step, source, restored = mgr.restore(_zeros())
        assert (step, source) == (5, "memory")
        assert torch.equal(restored["model"]["b"], _state(5)["model"]["b"])
        mgr.wait()
        assert (step_dir(tmp_path / "ckpt", 5) / COMMITTED).exists()  # the write still completed and committed
    finally:
        mgr.close()


@pytest.mark.parametrize("sync", [False, True])
def test_restore_takes_the_newest_of_the_last_save_and_the_memory_copy(tmp_path, process_group, sync):
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(sync=sync, memory_dir=str(tmp_path / "shm")),
                            process_group, EventLog(tmp_path / "e", 0))
    try:
        mgr.save(5, _state(5))
        mgr.finish_snapshot()
        live = _state(8)
        mgr.snapshot_to_memory(8, lambda: live)
        assert mgr.writes_in_flight <= 1 and not (step_dir(tmp_path / "ckpt", 8)).exists()   # nothing written
        mgr.finish_snapshot()
        live["model"]["w"].add_(1.0)                                  # the optimizer step after it
        step, source, restored = mgr.restore(_zeros())
        assert (step, source) == (8, "memory") and restored["train"]["step"] == 8
        assert torch.equal(restored["model"]["w"], _state(8)["model"]["w"])
        # A second restart before the next snapshot reads the replica back from its slot on the node
        # (the first restore dropped this attempt's mappings): the snapshot, not the live state after it.
        mgr.wait()
        step, source, restored = mgr.restore(_zeros())
        assert (step, source) == (8, "memory") and torch.equal(restored["model"]["w"], _state(8)["model"]["w"])
    finally:
        mgr.close()


def test_an_in_job_restart_resumes_from_the_replica_left_in_node_memory(tmp_path, process_group):
    """A rank killed mid-copy: the restarted process finds the previous replica whole; a newer committed
    checkpoint wins over it."""
    root, events = tmp_path / "ckpt", EventLog(tmp_path / "e", 0)
    cfg = CheckpointConfig(memory_dir=str(tmp_path / "shm"))
    dead = CheckpointManager(root, cfg, process_group, events, run_id="run")
    restarted = newer = None
    try:
        dead.save(3, _state(3))
        dead.wait()
        dead.snapshot_to_memory(5, _state(5))
        dead.finish_snapshot()
        dead.snapshot_to_memory(7, _state(7))                   # the rank dies once this copy is under way
        dead.copying.copy.result()
        dead.copying = None                                     # ...and never marks it
        restarted = CheckpointManager(root, cfg, process_group, events, run_id="run")
        step, source, restored = restarted.restore(_zeros())
        assert (step, source) == (5, "memory") and restored["train"]["step"] == 5
        assert torch.equal(restored["model"]["w"], _state(5)["model"]["w"])
        restarted.save(9, _state(9))
        restarted.wait()
        newer = CheckpointManager(root, cfg, process_group, events, run_id="run")
        assert newer.restore(_zeros())[:2] == (9, "checkpoint")
    finally:
        for mgr in (dead, restarted, newer):
            if mgr is not None:
                mgr.close()


def _node(tmp_path, process_group):
    """Checkpoint managers of one run whose memory snapshots share a node directory: each new one is a process
    (re)started on that node."""
    root, events = tmp_path / "ckpt", EventLog(tmp_path / "e", 0)
    cfg = CheckpointConfig(memory_dir=str(tmp_path / "shm"))
    return lambda: CheckpointManager(root, cfg, process_group, events, run_id="run")


def test_an_owed_checkpoints_copy_is_kept_while_memory_snapshots_go_on_in_the_other_slot(tmp_path, process_group):
    """A checkpoint owed to a busy writer keeps its slot: snapshots take turns in the other, each over the newest,
    so a rank killed while one is copied resumes from the owed copy; the owed checkpoint has its own step's
    values when it is written."""
    root, manager = tmp_path / "ckpt", _node(tmp_path, process_group)
    mgr = manager()
    restarted = []
    try:
        mgr.restore(_zeros())
        owed = mgr.snapshot_to_memory(4, _state(4), keep=True)
        for step in (5, 6):
            mgr.snapshot_to_memory(step, _state(step))
            mgr.finish_snapshot()
        mgr.wait_for_mark()
        restarted.append(manager())
        step, source, restored = restarted[-1].restore(_zeros())
        assert (step, source) == (6, "memory") and torch.equal(restored["model"]["w"], _state(6)["model"]["w"])
        mgr.snapshot_to_memory(7, _state(7))                    # into step 6's slot: the rank dies meanwhile
        mgr.copying.copy.result()
        restarted.append(manager())
        step, source, restored = restarted[-1].restore(_zeros())
        assert (step, source) == (4, "memory") and torch.equal(restored["model"]["w"], _state(4)["model"]["w"])
        mgr.finish_snapshot()
        mgr.save(4, owed)                                       # the writer is warm: the owed checkpoint
        mgr.release(owed)
        mgr.wait()
        loaded = _zeros()
        dcp.load(loaded, checkpoint_id=str(step_dir(root, 4)))
        assert torch.equal(loaded["model"]["w"], _state(4)["model"]["w"]) and loaded["train"]["step"] == 4
        mgr.snapshot_to_memory(8, _state(8))                    # released: the next copy may take its slot
        mgr.finish_snapshot()
        mgr.wait_for_mark()
        assert mgr.replica.slot == 1 - restarted[0].replica.slot
    finally:
        for m in (mgr, *restarted):
            m.close()


def test_the_loop_waits_for_neither_a_memory_snapshots_checksums_nor_its_mark(tmp_path, process_group, monkeypatch):
    """A memory snapshot holds the loop only for its copy: its checksums and its mark on the node come after, on
    the checksum thread. Until it is marked, a restarted rank finds the snapshot before it, whose slot the next
    copy waits for the mark to leave alone."""
    from trainer.checkpoint import manager as manager_module

    held, taken, released = threading.Event(), threading.Event(), threading.Event()
    digests = manager_module.state_digests

    def held_digests(snapshot):
        if held.is_set():
            released.wait(10)   # bounded: a loop that waits for the checksums returns after this, and fails below
        sums = digests(snapshot)
        taken.set()
        return sums

    monkeypatch.setattr(manager_module, "state_digests", held_digests)
    manager = _node(tmp_path, process_group)
    mgr = manager()
    others = []
    try:
        mgr.restore(_zeros())
        mgr.snapshot_to_memory(4, _state(4))
        mgr.finish_snapshot()
        mgr.wait_for_mark()
        held.set()
        taken.clear()
        mgr.snapshot_to_memory(5, _state(5))
        mgr.finish_snapshot()
        assert not taken.is_set(), "the loop waited for the memory snapshot's checksums"
        assert [e["step"] for e in read_events(tmp_path / "e") if e["event"] == "memory_snapshot"] == [4]
        others.append(manager())
        step, source, restored = others[-1].restore(_zeros())   # a rank killed now: step 5 is not marked
        assert (step, source) == (4, "memory") and torch.equal(restored["model"]["w"], _state(4)["model"]["w"])
        released.set()
        mgr.wait_for_mark()
        assert [e["step"] for e in read_events(tmp_path / "e") if e["event"] == "memory_snapshot"] == [4, 5]
        others.append(manager())
        step, source, restored = others[-1].restore(_zeros())
        assert (step, source) == (5, "memory") and torch.equal(restored["model"]["w"], _state(5)["model"]["w"])
    finally:
        released.set()
        for m in (mgr, *others):
            m.close()


def test_an_owed_checkpoints_hold_includes_the_wait_for_its_copys_mark(tmp_path, process_group, monkeypatch):
    """Writing an owed checkpoint first waits for its memory copy's mark (its checksums): the loop waits, so the
    save's recorded hold (``ckpt_snapshot``'s ``block_s``, what the bench and the interval policy read) counts it."""
    from trainer.checkpoint import manager as manager_module

    released = threading.Event()
    digests = manager_module.state_digests

    def held_digests(snapshot):
        released.wait(10)
        return digests(snapshot)

    mgr = _node(tmp_path, process_group)()
    try:
        mgr.restore(_zeros())
        mgr.snapshot_to_memory(4, _state(4))
        mgr.finish_snapshot()
        mgr.wait_for_mark()
        monkeypatch.setattr(manager_module, "state_digests", held_digests)
        owed = mgr.snapshot_to_memory(5, _state(5), keep=True)
        mgr.finish_snapshot()                                   # copied; its checksums and mark wait
        release = threading.Timer(0.3, released.set)
        t0 = time.monotonic()
        release.start()
        mgr.save_owed(5, owed)                                  # waits for the mark, then stages the copy
        mgr.finish_snapshot()
        waited = time.monotonic() - t0
        held = [e["block_s"] for e in read_events(tmp_path / "e") if e["event"] == "ckpt_snapshot" and e["step"] == 5]
        assert waited >= 0.3 and held and held[0] >= 0.3, f"the hold {held} left out the wait for the mark"
        mgr.release(owed)
        mgr.wait()
    finally:
        released.set()
        mgr.close()


def test_a_restore_maps_both_memory_snapshot_slots_off_the_loop_leaving_what_they_hold(
        tmp_path, process_group, monkeypatch):
    """The first copy into each slot after a restore maps nothing on the loop's thread (on a GPU that mapping
    page-locks the slot: about a second per slot): the restore maps both on a thread. What the slots hold stays
    readable: a rank restarted before any copy finds the newest snapshot and the one before it."""
    manager = _node(tmp_path, process_group)
    first = manager()
    others = []
    try:
        first.restore(_zeros())
        for step in (4, 5):
            first.snapshot_to_memory(step, _state(step))
            first.finish_snapshot()
        first.wait_for_mark()
        mapped_on_loop = []
        from_file = torch.from_file

        def recorded(path, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                mapped_on_loop.append(path)
            return from_file(path, *args, **kwargs)

        others.append(manager())
        assert others[-1].restore(_zeros())[:2] == (5, "memory")
        monkeypatch.setattr(torch, "from_file", recorded)
        others.append(manager())                                # restarted again before any copy
        step, source, restored = others[-1].restore(_zeros())
        assert (step, source) == (5, "memory") and torch.equal(restored["model"]["w"], _state(5)["model"]["w"])
        before = others[-1].replica.read_previous(_zeros())
        assert before is not None and torch.equal(before["model"]["w"], _state(4)["model"]["w"])
        mapped_on_loop.clear()                                  # the restore's reads: on its path, as they must be
        for step in (6, 7):                                     # one copy into each slot
            others[-1].snapshot_to_memory(step, _state(step))
            others[-1].finish_snapshot()
        others[-1].wait_for_mark()
        assert mapped_on_loop == [], f"the loop mapped {mapped_on_loop}"
        assert manager().restore(_zeros())[:2] == (7, "memory")
    finally:
        for m in (first, *others):
            m.close()


def test_a_replica_is_used_only_by_the_run_that_made_it(tmp_path, process_group):
    """Killed before its first checkpoint, a run resumes from its replica; the same output directory
    started afresh (a new run) must not, and deletes it."""
    root, events = tmp_path / "ckpt", EventLog(tmp_path / "e", 0)
    cfg = CheckpointConfig(memory_dir=str(tmp_path / "shm"))
    earlier = CheckpointManager(root, cfg, process_group, events, run_id="run-a")
    earlier.restore(_zeros())
    earlier.snapshot_to_memory(4, _state(4))
    earlier.finish_snapshot()
    earlier.close()
    # Both slots: the restore allocated them.
    left = sorted(p.name for p in (tmp_path / "shm").rglob("rank0.*"))
    assert left == ["rank0.marker", "rank0.slot0", "rank0.slot1"]
    same = CheckpointManager(root, cfg, process_group, events, run_id="run-a")
    try:
        assert same.restore(_zeros())[:2] == (4, "memory")
    finally:
        same.close()
    fresh = CheckpointManager(root, cfg, process_group, events, run_id="run-b")
    try:
        assert fresh.restore(_zeros())[0] is None
    finally:
        fresh.close()
    # The earlier run's snapshot is gone: no marker names it (the slots are this run's, allocated anew).
    assert sorted(p.name for p in (tmp_path / "shm").rglob("rank0.*")) == ["rank0.slot0", "rank0.slot1"]


def test_save_returns_while_the_copy_runs_and_the_write_waits_for_it(tmp_path, process_group):
    """The loop's forward and backward passes overlap the copy and the planning behind it; the writer only ever
    sees a whole snapshot."""
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    release, copy = threading.Event(), mgr.copier.copy
    mgr.copier.copy = lambda *a: (release.wait(60), copy(*a))[1]
    try:
        mgr.restore(_zeros())
        mgr.start_writer()                                    # as the loop does: the staging copy planned ahead
        live = _state(7)
        mgr.save(7, live)                                     # returns with the copy held back
        assert mgr.copying is not None and not mgr.copying.copy.done()
        assert mgr.writes_in_flight == 0 and mgr.snapshot_step is None   # nothing written from a partial copy
        threading.Timer(0.5, release.set).start()           # 0.5: a stall before the next line leaves > 0.1
        assert mgr.finish_snapshot() > 0.1                    # the optimizer step waits for the copy
        for t in live["model"].values():
            t.add_(100.0)
        mgr.wait()
    finally:
        mgr.close()
    target = _zeros()
    dcp.load(target, checkpoint_id=str(step_dir(tmp_path / "ckpt", 7)))
    assert torch.equal(target["model"]["w"], _state(7)["model"]["w"]) and target["train"]["step"] == 7


def test_every_staging_tensor_is_shared_from_the_start_so_handing_it_to_the_worker_moves_nothing():
    """A 0-d tensor (the test's scalar; AdamW's per-parameter step) is staged in shared memory like the others:
    one in private memory would be moved there when the write is pickled to NVRx's worker, on the queue's
    feeder thread, its storage swapped under the checksum thread reading it (a checkpoint refused at its restore
    for a checksum of freed memory)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (torch's reductions: a tensor pickles as shared memory)
    from trainer.checkpoint.staging import Staging

    buffer = Staging(pin=False).allocate(_state(3))
    tensors = [buffer["model"]["w"], buffer["model"]["b"], buffer["scalar"]]
    assert [t.is_shared() for t in tensors] == [True] * 3
    where = [t.data_ptr() for t in tensors]
    ForkingPickler.dumps(buffer)   # what the feeder thread does with a write handed to the worker
    assert [t.data_ptr() for t in tensors] == where


def test_a_save_whose_state_changed_structure_is_planned_afresh(tmp_path, process_group):
    """Saves reuse the staging copy and its plan; new keys or shapes must not be written with the old plan."""
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
        changed = _state(4)
        changed["model"]["w"] = torch.randn(32, 64)          # a new shape
        changed["model"]["extra"] = torch.arange(5.0)        # a new key
        expected = changed["model"]["w"].clone()
        mgr.save(4, changed)
        mgr.finish_snapshot()
        changed["model"]["w"].add_(1.0)                       # the snapshot, not the live state, is written
        mgr.save(5, _state(5))                                # and back
        mgr.wait()
    finally:
        mgr.close()
    target = _zeros()
    target["model"].update(w=torch.zeros(32, 64), extra=torch.zeros(5))
    dcp.load(target, checkpoint_id=str(step_dir(tmp_path / "ckpt", 4)))
    assert torch.equal(target["model"]["w"], expected)
    assert torch.equal(target["model"]["extra"], torch.arange(5.0)) and target["train"]["step"] == 4
    target = _zeros()
    dcp.load(target, checkpoint_id=str(step_dir(tmp_path / "ckpt", 5)))
    assert torch.equal(target["model"]["w"], _state(5)["model"]["w"]) and target["train"]["step"] == 5


def test_a_dtensor_is_staged_onto_its_local_shard_and_another_sharding_gets_new_staging(process_group):
    """The copy pairs a DTensor's local shards. A buffer whose DTensor has the same global shape but another local
    one (the state of another world size) is not reused: copying into it would write the shard out of place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from trainer.checkpoint.staging import staged_into

    mesh = init_device_mesh("cpu", (1,))
    live = {"w": DTensor.from_local(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])}
    same = {"w": DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)])}
    # Half the rows on this rank, as if sharded over two: the same global shape, 4 x 4.
    halved = {"w": DTensor.from_local(torch.zeros(2, 4), mesh, [Shard(0)], run_check=False, shape=(4, 4),
                                      stride=(4, 1))}
    new = {"w": DTensor.from_local(torch.zeros(4, 4), mesh, [Shard(0)])}

    buffer, snapshot, pairs = staged_into(live, same, lambda s: new)
    assert buffer is same and snapshot["w"] is same["w"]
    assert [(a.data_ptr(), b.data_ptr()) for a, b in pairs] == [(live["w"].to_local().data_ptr(),
                                                                 same["w"].to_local().data_ptr())]
    buffer, snapshot, pairs = staged_into(live, halved, lambda s: new)
    assert buffer is new and snapshot["w"] is new["w"]
    assert [b.shape for _, b in pairs] == [torch.Size([4, 4])]


def test_planning_follows_the_copy_on_the_copy_thread_once_the_plan_is_reused(tmp_path, process_group, monkeypatch):
    """NVRx 0.7 clones every CPU tensor while planning: the staging copy must already hold this save's state
    (else the checkpoint is the previous save's). A staging copy's first planning gathers every rank's plan, on
    the loop's thread; later ones reuse it, with no collective, on the copy thread behind the copy, so the loop
    does not wait for them."""
    import threading

    from nvidia_resiliency_ext.checkpointing.async_ckpt import state_dict_saver

    plan, seen = state_dict_saver.save_state_dict_async_plan, []

    def planning(snapshot, *args, **kwargs):
        seen.append((threading.current_thread().name.split("_")[0], snapshot["model"]["w"].clone()))
        return plan(snapshot, *args, **kwargs)

    monkeypatch.setattr(state_dict_saver, "save_state_dict_async_plan", planning)
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
            mgr.finish_snapshot()
        mgr.wait()
    finally:
        mgr.close()
    assert [thread for thread, _ in seen] == ["MainThread", "ckpt-copy", "ckpt-copy"]
    assert all(torch.equal(w, _state(step)["model"]["w"]) for step, (_, w) in zip((1, 2, 3), seen))
    for step in (2, 3):
        target = _zeros()
        dcp.load(target, checkpoint_id=str(step_dir(tmp_path / "ckpt", step)))
        assert torch.equal(target["model"]["w"], _state(step)["model"]["w"])


def test_delete_uncommits_before_removing(tmp_path):
    d = tmp_path / "step_000000001"
    d.mkdir()
    (d / COMMITTED).write_text("{}")
    (d / "x.distcp").write_bytes(b"1")
    os.chmod(d / "x.distcp", 0o444)
    delete_checkpoint(d)
    assert not d.exists() and committed_steps(tmp_path) == []


def _save_and_step(mgr: CheckpointManager, step: int) -> None:
    """An interval save as the loop makes it: the optimizer step after it changes the live state."""
    live = _state(step)
    mgr.save(step, live)
    mgr.finish_snapshot()
    for t in live["model"].values():
        t.add_(100.0)


def _assert_holds(root, step: int) -> None:
    target = _zeros()
    dcp.load(target, checkpoint_id=str(step_dir(root, step)))
    assert torch.equal(target["model"]["w"], _state(step)["model"]["w"]) and target["train"]["step"] == step


def test_the_first_save_after_the_load_gathers_no_plan(tmp_path, process_group, monkeypatch):
    """The staging copy's first, collective planning is made when the writer is started at the load: in the
    loop, the first save plans locally like every later one (it used to be the slowest save by far)."""
    import torch.distributed as dist

    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        assert mgr.restore(_zeros())[0] is None      # a fresh start: the staging copy is allocated
        mgr.start_writer()

        def gathered(*args, **kwargs):
            raise AssertionError("a save in the loop gathered every rank's plan")

        with monkeypatch.context() as patched:
            patched.setattr(dist, "gather_object", gathered)   # how DCP's planning gathers and scatters plans
            patched.setattr(dist, "scatter_object_list", gathered)
            for step in (1, 2):
                _save_and_step(mgr, step)
        mgr.wait()
    finally:
        mgr.close()
    for step in (1, 2):
        _assert_holds(tmp_path / "ckpt", step)


def test_a_save_does_not_wait_for_the_commit_of_the_step_before(tmp_path, process_group, monkeypatch):
    """Rank 0 commits the previous step (``.metadata``, the marker, their fsyncs) on a thread of its own."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

    gate, finish = threading.Event(), FileSystemWriterAsync.finish
    # Held until the test opens it; 120 s: a save that waited for the commit fails the assertion below.
    monkeypatch.setattr(FileSystemWriterAsync, "finish", lambda self, *a: (gate.wait(120), finish(self, *a))[1])
    root = tmp_path / "ckpt"
    mgr = CheckpointManager(root, CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        _save_and_step(mgr, 1)
        _save_and_step(mgr, 2)     # finishes step 1's write, hands its commit over, and returns
        assert committed_steps(root) == [], "the save waited for the commit of step 1"
        gate.set()
        mgr.wait()
    finally:
        gate.set()
        mgr.close()
    assert committed_steps(root) == [1, 2]
    for step in (1, 2):
        _assert_holds(root, step)


def test_a_commit_that_failed_behind_the_loop_fails_the_loop(tmp_path, process_group, monkeypatch):
    """Step 1's commit, on rank 0's commit thread, fails; step 2's succeeds: the loop is told at its end."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync

    finish, calls, failed = FileSystemWriterAsync.finish, [], threading.Event()

    def full_once(self, *args):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            failed.set()
            raise OSError(28, "No space left on device")
        return finish(self, *args)

    monkeypatch.setattr(FileSystemWriterAsync, "finish", full_once)
    mgr = CheckpointManager(tmp_path / "ckpt", CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
    try:
        _save_and_step(mgr, 1)
        _save_and_step(mgr, 2)
        assert failed.wait(120)
        with pytest.raises(OSError, match="No space left"):
            mgr.wait()
    finally:
        mgr.close()
    assert calls == ["ckpt-commit", "MainThread"] and committed_steps(tmp_path / "ckpt") == [2]


def test_checkpoints_saved_under_the_benchmarks_no_checksums_hook_are_never_loaded(tmp_path, process_group,
                                                                                   monkeypatch):
    """``bench/checkpoint_stall.py``'s hook: saves record no checksums, and a restore refuses what they wrote."""
    import json

    from trainer.checkpoint import integrity

    monkeypatch.setenv(integrity.BENCH_NO_CHECKSUMS_ENV, "1")
    integrity._bench_no_checksums.cache_clear()
    root = tmp_path / "ckpt"
    try:
        mgr = CheckpointManager(root, CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
        try:
            _save_and_step(mgr, 1)
            mgr.wait()
        finally:
            mgr.close()
        assert json.loads((step_dir(root, 1) / COMMITTED).read_text())["checksums"] == {}
        fresh = CheckpointManager(root, CheckpointConfig(), process_group, EventLog(tmp_path / "e", 0))
        try:
            with pytest.raises(RuntimeError, match=r"steps \[1\] failed their checksums"):
                fresh.restore(_zeros())
        finally:
            fresh.close()
    finally:
        integrity._bench_no_checksums.cache_clear()
