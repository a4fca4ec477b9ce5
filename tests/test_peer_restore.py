"""Peer memory snapshots in the trainer (trainer/peer.py, CheckpointManager.restore): 2 nodes x 1 rank
(``LocalCluster``), node 1 lost between checkpoints (its whole tree killed, its snapshot directory wiped)
and replaced at once. The replacement's rank resumes from the copy of its node's snapshot that node 0 keeps,
node 0's from its own memory; without that copy (holder gone, or ``--no-peer-snapshots``) both go back to
the committed checkpoint. Either way the run ends with the fault-free run's weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import psutil
import pytest

from trainer.launch import LaunchConfig, LocalCluster

from tests.conftest import FT, TINY, until
from tests.multinode import committed, events, held, logs, newest_snapshot, summary, wait_for

# A memory snapshot every 0.3 s is every few steps. Synchronous checkpoints: committed at their step, not
# whenever a writer that boots after every start gets to it, so that the loss is between two checkpoints
# (and memory snapshots are not held back while a checkpoint waits for a booting writer).
MAX_STEPS = 80
RUN = ("--max-steps", str(MAX_STEPS), "--ckpt-every", "25", "--ckpt-sync", "--memory-snapshot-every-s", "0.3")


@pytest.fixture(scope="module")
def fault_free_sha(tmp_path_factory, dataset) -> str:
    """params_sha256 of the same 2-node run without a fault."""
    tmp = tmp_path_factory.mktemp("peer-fault-free")
    with LocalCluster(LaunchConfig(nnodes=2, nproc_per_node=1, **FT),
                      ["--data", str(dataset), *TINY, "--out", str(tmp / "run"), *RUN], workdir=tmp) as c:
        c.start()
        assert c.supervise(timeout=300) == 0
    s = json.loads((tmp / "run" / "summary.json").read_text())
    assert s["steps"] == MAX_STEPS and s["restarts"] == 0
    return s["params_sha256"]


def peer_daemons(c, i: int) -> list[int]:
    """Node ``i``'s peer daemons (``python -m trainer.peer``)."""
    found = []
    for pid in c.pids(i):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).cmdline()[1:3] == ["-m", "trainer.peer"]:
                found.append(pid)
    return found


def lose_node_1(c) -> tuple[float, list[int], int]:
    """Node 1 lost between checkpoints (node 0's memory well past the newest commit, before the end, so a
    copy of node 1's snapshot would be worth having): its tree killed, its memory
    wiped, and its replacement started at once (what the PyTorchJob's restart policy does: a new pod, empty
    /dev/shm). Returns when it was lost, the steps of node 1's copies node 0 kept, and the newest commit."""
    assert until(lambda: (newest_snapshot(c, 0, 0) or 0) >= committed(c) + 12 > 12, 120), logs(c)
    c.kill(1)
    lost = time.time(), held(c, 1, 1), committed(c)
    c.start(1)
    assert max(e["step"] for e in events(c) if e["event"] == "step") < MAX_STEPS
    return lost


def loaded_after(c, t: float) -> dict[int, dict]:
    return {e["rank"]: e for e in events(c) if e["event"] == "ckpt_loaded" and e["t"] > t}


def test_a_lost_node_resumes_from_its_peer_copy_and_redoes_at_most_the_snapshot_interval(cluster, fault_free_sha):
    c = cluster(*RUN)
    # The moment of the loss, chosen: node 1's rank frozen (node 0's waits for it within a step) once its
    # newest snapshot is well past the newest checkpoint, and node 0 keeps a copy of it.
    rank1 = wait_for(c, lambda e: e["event"] == "worker_start" and e["rank"] == 1)["pid"]
    assert until(lambda: (newest_snapshot(c, 1, 1) or 0) >= committed(c) + 12 > 12, 120), logs(c)
    os.kill(rank1, signal.SIGSTOP)
    assert until(lambda: max(held(c, 1, 1), default=None) == newest_snapshot(c, 1, 1), 30), held(c, 1, 1)
    lost_at, kept, newest_commit = lose_node_1(c)
    assert c.supervise(timeout=120) == 0, logs(c)
    s = summary(c)
    assert s["params_sha256"] == fault_free_sha
    loaded = loaded_after(c, lost_at)
    # Node 1's replacement fetched its rank's state from node 0's copy, node 0's rank read its own memory.
    assert {r: (e["source"], e.get("fetched")) for r, e in loaded.items()} == {0: ("peer", False), 1: ("peer", True)}
    step = loaded[0]["step"]
    assert loaded[1]["step"] == step == max(kept) and step > newest_commit
    assert [e["source"] for e in events(c) if e["event"] == "resumed" and e["t"] > lost_at] == ["peer"]
    # Redone: the steps from the resumed one to the last done before the loss, at most a snapshot interval
    # (the largest gap between two snapshots before the loss, in steps), and fewer than the checkpoint would
    # have cost (all since the newest commit). Snapshots are timed, so the interval in steps varies with load.
    ev = events(c)
    done = max(e["step"] for e in ev if e["event"] == "step" and e["t"] <= lost_at)
    snaps = sorted({e["step"] for e in ev if e["event"] == "memory_snapshot" and e["t"] <= lost_at})
    interval = max(b - a for a, b in zip(snaps, snaps[1:]))
    assert s["lost_steps"] == done - step <= interval, (done, step, snaps)
    assert s["lost_steps"] < done - newest_commit, (done, step, newest_commit)


def assert_resumed_from_the_newest_checkpoint(c, lost_at: float, fault_free_sha: str) -> None:
    """The run finished with the fault-free weights, both ranks resumed from the newest checkpoint committed."""
    assert c.supervise(timeout=120) == 0, logs(c)
    assert summary(c)["params_sha256"] == fault_free_sha
    loaded = loaded_after(c, lost_at)
    assert {r: e["source"] for r, e in loaded.items()} == {0: "checkpoint", 1: "checkpoint"}
    assert {e["step"] for e in loaded.values()} == {committed(c, before=min(e["t"] for e in loaded.values()))}


def test_with_the_holder_gone_before_the_restore_the_run_falls_back_to_the_checkpoint(cluster, fault_free_sha):
    c = cluster(*RUN)
    (daemon,) = peer_daemons(c, 0)
    assert until(lambda: held(c, 1, 1), 120), logs(c)     # it did keep node 1's copies: now it is gone
    psutil.Process(daemon).kill()
    lost_at, _, _ = lose_node_1(c)
    assert_resumed_from_the_newest_checkpoint(c, lost_at, fault_free_sha)
    # The replacement's rank did ask: node 0's rank had newer steps in memory than the checkpoint.
    assert "the holder of node 1's memory snapshots" in c.nodes[1].log.read_text(errors="replace"), logs(c)


def test_without_peer_snapshots_a_lost_node_resumes_from_the_checkpoint(cluster, fault_free_sha):
    c = cluster(*RUN, "--no-peer-snapshots")
    wait_for(c, lambda e: e["event"] == "memory_snapshot")
    assert not peer_daemons(c, 0) and not peer_daemons(c, 1)
    lost_at, _, _ = lose_node_1(c)
    assert_resumed_from_the_newest_checkpoint(c, lost_at, fault_free_sha)
