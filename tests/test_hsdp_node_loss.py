"""A node lost under HSDP (llama, gloo, 2 local nodes x 2 ranks, ``LocalCluster``): node 0's ranks are replica 0,
node 1's replica 1. Node 1 is lost between two checkpoints and replaced; the surviving replica resumes from its
own memory snapshots, the replacement from the copies of node 1's that node 0 keeps (or, with peer copies off,
every rank from the checkpoint). Each run ends with the fault-free run's ``params_sha256``.

The moment of the loss is fixed by the run, not by the test's polling: rank 2 (node 1) hangs
(``hang-after-snapshot``) at the first step from step 9 on at which its newest memory snapshot is past the
newest checkpoint, and every rank stops there with it (at its next collective). From then on no step, snapshot
or checkpoint is taken, whatever the speed of the steps: the test waits for the copies still under way, then
kills node 1.
"""

from __future__ import annotations

import contextlib
import json
import time
import types

import pytest

from trainer import faults
from trainer.config import CheckpointConfig
from trainer.events import EventLog, read_events
from trainer.faults import FaultInjector
from trainer.launch import LaunchConfig, LocalCluster
from trainer.layout import COMMITTED, checkpoints_dir, replica_dir, replica_marker, step_dir

from tests.conftest import until
from tests.multinode import committed, events, held, logs, newest_snapshot, summary, wait_for
from tests.test_parallel_runs import LLAMA, _run

# Synchronous checkpoints every 8 steps, committed at their step (none in flight commits after the hang). Memory
# snapshots as often as their own spacing allows (20x a copy's duration): several between two checkpoints at
# any speed, since the copy and the steps speed up and slow down together.
MAX_STEPS, CKPT_EVERY = 24, 8
RUN = ("--max-steps", str(MAX_STEPS), "--ckpt-every", str(CKPT_EVERY), "--ckpt-sync",
       "--memory-snapshot-every-s", "0.01")
HANG = ("--inject-fault", f"hang-after-snapshot@{CKPT_EVERY + 1}:2")
HSDP = ("--dp-replicate", "2", "--dp-shard", "2")
HSDP_TP = ("--dp-replicate", "2", "--tp", "2")
NODE_0_RANKS, NODE_1_RANKS = (0, 1), (2, 3)
# While rank 2 hangs, no watchdog may restart the job before the test loses node 1 (the node loss is then seen by
# the closed connections): the rank monitors' step timeout stays at 300 s (not tightened after 20 steps), and the
# in-process layer's no-progress timeouts are 300 s and more.
PATIENT = ("--ft-min-step-timeout-s", "300", "--inprocess-soft-timeout-s", "300",
           "--inprocess-hard-timeout-s", "330", "--inprocess-barrier-timeout-s", "360")
# Heartbeats every 2 s: at LocalCluster's 0.5 s a node's rendezvous join, a read-modify-write of the shared state
# that takes about a second on a loaded 2-core machine, loses every compare-and-set to the other node's heartbeat.
LAUNCH = dict(max_restarts=2, workload_check_interval_s=0.5, join_timeout_s=120.0, keep_alive_interval_s=2.0,
              keep_alive_max_attempts=3)


def test_hang_after_snapshot_fires_at_the_first_step_from_its_own_with_a_snapshot_past_the_newest_checkpoint(
        tmp_path, monkeypatch):
    out, cfg = tmp_path / "run", CheckpointConfig(memory_dir=str(tmp_path / "shm"))
    log = out / "events.jsonl"
    injector = FaultInjector(["hang-after-snapshot@3:1"], 1, 2, EventLog(log, 1), log, ckpt=cfg)
    hung: list[float] = []
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(sleep=hung.append, time=time.time))
    marker = replica_marker(replica_dir(tmp_path / "shm", checkpoints_dir(out)), 1)
    marker.parent.mkdir(parents=True)

    def at(step: int, snapshot: int | None = None, commit: int | None = None) -> bool:
        if snapshot is not None:
            marker.write_text(json.dumps({"step": snapshot, "slot": 0}))
        if commit is not None:
            step_dir(checkpoints_dir(out), commit).mkdir(parents=True)
            (step_dir(checkpoints_dir(out), commit) / COMMITTED).touch()
        injector.before_optimizer_step(step)
        return bool(hung)

    assert not at(2, snapshot=1)                 # before its step
    assert not at(4, snapshot=2, commit=2)       # the snapshot is the checkpoint's step
    assert at(5, snapshot=4)
    assert [(e["kind"], e["step"]) for e in read_events(log) if e["event"] == "fault_injected"] == [
        ("hang-after-snapshot", 5)]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, dataset):
    """``fault_free(mesh)``: the summary of the run (``RUN``) on ``mesh`` without a fault, on one node of 4 ranks
    (the same mesh and ranks); each mesh's run once per module."""
    done: dict[tuple[str, ...], dict] = {}

    def of(mesh: tuple[str, ...]) -> dict:
        if mesh not in done:
            done[mesh] = _run(dataset, tmp_path_factory.mktemp("fault-free") / "run", *RUN, *mesh)
            assert done[mesh]["steps"] == MAX_STEPS and done[mesh]["restarts"] == 0
        return done[mesh]
    return of


@pytest.fixture
def hsdp_cluster(tmp_path, dataset):
    """``hsdp_cluster(*args)``: a started LocalCluster of 2 nodes x 2 ranks training llama (``RUN``, ``HANG``,
    then ``args``)."""
    with contextlib.ExitStack() as stack:
        def start(*args: str) -> LocalCluster:
            out = tmp_path / "run"
            c = stack.enter_context(LocalCluster(
                LaunchConfig(nnodes=2, nproc_per_node=2, **LAUNCH),
                ["--data", str(dataset), *LLAMA, "--out", str(out), *RUN, *HANG, *PATIENT, *args], workdir=tmp_path))
            c.out = out
            c.start()
            return c
        yield start


def in_memory(c: LocalCluster, node: int, ranks: tuple[int, ...]) -> set[int | None]:
    """The steps of ``ranks``' newest memory snapshots on node ``node``."""
    return {newest_snapshot(c, node, r) for r in ranks}


def lose_node_1_at_the_hang(c: LocalCluster, copied: bool) -> tuple[float, int, int]:
    """Once rank 2 hangs, and every rank's newest snapshot (of the step ``S`` the hang waited for) is marked, and,
    if ``copied``, node 0 keeps copies of node 1's: node 1 killed, its memory wiped, and replaced. Returns when,
    ``S`` and the newest checkpoint then (neither changes while rank 2 hangs)."""
    hang = wait_for(c, lambda e: e["event"] in ("fault_injected", "run_end"), timeout=300)
    assert hang["event"] == "fault_injected" and hang["kind"] == "hang-after-snapshot" and hang["rank"] == 2, hang
    snapshot, newest_commit = newest_snapshot(c, 1, 2), committed(c)
    assert snapshot is not None and CKPT_EVERY <= newest_commit < snapshot < hang["step"], (snapshot, newest_commit)

    def ready() -> bool:
        mine = in_memory(c, 0, NODE_0_RANKS) == in_memory(c, 1, NODE_1_RANKS) == {snapshot}
        return mine and (not copied or all(snapshot in held(c, 1, r) for r in NODE_1_RANKS))
    # The copies take seconds (niced, on a loaded machine: tens of seconds); the watchdogs wait 300 s.
    assert until(ready, 180), (in_memory(c, 0, NODE_0_RANKS), [held(c, 1, r) for r in NODE_1_RANKS], logs(c))
    assert committed(c) == newest_commit
    lost_at = time.time()
    c.kill(1)
    c.start(1)
    return lost_at, snapshot, newest_commit


def restores_after(c: LocalCluster, t: float) -> dict[int, dict]:
    """Each rank's first restore after time ``t``."""
    first: dict[int, dict] = {}
    for e in events(c):
        if e["event"] == "ckpt_loaded" and e["t"] > t:
            first.setdefault(e["rank"], e)
    return first


@pytest.mark.timeout(900)   # 2 nodes x 2 with node 1 replaced (and the fault-free run, if not yet done)
@pytest.mark.parametrize("mesh,shape", [(HSDP_TP, {"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
                                        (HSDP, {"dp_replicate": 2, "dp_shard": 2, "tp": 1})], ids=["hsdp-x-tp", "hsdp"])
def test_a_node_lost_under_hsdp_is_restored_from_its_peer_copy(fault_free, hsdp_cluster, mesh, shape):
    """Node 1 lost past the newest checkpoint: node 0's ranks (the surviving replica) resume from their own memory,
    the replacement's from the copies of node 1's snapshots that node 0 keeps, all at that snapshot's step."""
    c = hsdp_cluster(*mesh)
    lost_at, snapshot, newest_commit = lose_node_1_at_the_hang(c, copied=True)
    assert c.supervise(timeout=600) == 0, logs(c)

    s = summary(c)
    assert s["mesh"] == fault_free(mesh)["mesh"] == shape
    assert s["params_sha256"] == fault_free(mesh)["params_sha256"]
    loaded = restores_after(c, lost_at)
    assert {r: (e["source"], e.get("fetched"), e["step"]) for r, e in loaded.items()} == {
        0: ("peer", False, snapshot), 1: ("peer", False, snapshot),
        2: ("peer", True, snapshot), 3: ("peer", True, snapshot)}, (loaded, newest_commit)


@pytest.mark.timeout(900)   # 2 nodes x 2 with node 1 replaced (and the fault-free run, if not yet done)
def test_a_node_lost_under_hsdp_without_peer_copies_is_restored_from_the_checkpoint(fault_free, hsdp_cluster):
    """Peer copies off: node 0's memory is newer than the checkpoint, but node 1's replacement has nothing of
    it, so every rank goes back to the newest committed checkpoint."""
    c = hsdp_cluster(*HSDP, "--no-peer-snapshots")
    lost_at, _, newest_commit = lose_node_1_at_the_hang(c, copied=False)
    assert c.supervise(timeout=600) == 0, logs(c)

    assert summary(c)["params_sha256"] == fault_free(HSDP)["params_sha256"]
    loaded = restores_after(c, lost_at)
    assert {r: (e["source"], e["step"]) for r, e in loaded.items()} == {
        r: ("checkpoint", newest_commit) for r in (*NODE_0_RANKS, *NODE_1_RANKS)}
