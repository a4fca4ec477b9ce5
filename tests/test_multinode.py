"""Many nodes on this machine (trainer/launch.py ``LocalCluster``, ``goodput train --nodes``): 2 nodes x 1 rank,
each node its own process tree (launch wrapper and zygote, ft_launcher, rank monitor, rank, checkpoint
writers) and memory-snapshot directory, joined by c10d rendezvous on loopback.

A rank's failure on one node restarts the worker group on both; the ranks' stores are keyed by the launch round
(trainer/restart.py), not by the agents' restart counts, which ft_launcher keeps per node. A node lost for good
under ``--nodes MIN:MAX`` leaves a job that resumes from a resharded checkpoint on fewer ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid

import pytest

from trainer.events import read_events
from trainer.launch import LaunchConfig, LocalCluster
from trainer.layout import committed_steps

from tests.conftest import GOODPUT, MARK, STEPS, TINY, copy_due_after_checkpoint, marked, until
from tests.multinode import events, logs, summary, wait_for
from tests.trainer_flags import flags


@pytest.fixture(scope="session")
def two_node_sha(tmp_path_factory, dataset) -> str:
    """params_sha256 of a fault-free ``goodput train --nodes 2 --nproc 1`` run of STEPS, computed once."""
    tmp = tmp_path_factory.mktemp("two-nodes")
    out, mark = tmp / "run", uuid.uuid4().hex
    with open(tmp / "run.log", "w+") as log:
        proc = subprocess.Popen([*GOODPUT, "train", "--nodes", "2", "--nproc", "1", "--data", str(dataset),
                                 "--out", str(out), *TINY, *STEPS], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, MARK: mark})
        try:
            assert proc.wait(300) == 0, log.seek(0) or log.read()[-4000:]
        finally:
            with contextlib.suppress(ProcessLookupError):    # its session's leftovers, if it failed
                os.killpg(proc.pid, signal.SIGKILL)
        # Every process of both node trees is gone, and so are their memory-snapshot directories.
        assert until(lambda: not marked(mark), 15), marked(mark)
    s = json.loads((out / "summary.json").read_text())
    starts = [e for e in read_events(out / "events.jsonl") if e["event"] == "run_start"]
    assert s["steps"] == 14 and s["restarts"] == 0 and [e["world_size"] for e in starts] == [2]
    return s["params_sha256"]


def test_two_nodes_of_one_rank_train_as_one_node_of_two(two_node_sha, clean_sha):
    """The same ranks, data and arithmetic: only who starts the processes differs."""
    assert two_node_sha == clean_sha("fsdp")


def test_each_node_is_a_tree_of_its_own_with_its_own_snapshot_directory(cluster):
    c = cluster("--max-steps", "100000", "--memory-snapshot-every-s", "0.2")
    wait_for(c, lambda e: e["event"] == "memory_snapshot")
    markers = lambda: [sorted(p.name for p in n.memory_dir.glob("goodput-*/rank*.marker")) for n in c.nodes]  # noqa
    assert until(lambda: markers() == [["rank0.marker"], ["rank1.marker"]], 30), markers()
    trees = [set(c.pids(i)) for i in (0, 1)]
    ranks = {e["rank"]: e["pid"] for e in events(c) if e["event"] == "worker_start"}
    # Node i's tree holds rank i (group ranks follow the start order), its launcher, zygote and writers.
    assert ranks[0] in trees[0] and ranks[1] in trees[1] and not trees[0] & trees[1]
    assert all(len(t) >= 5 for t in trees), trees
    c.kill(1)        # a node loss: every process of the node at once, its memory wiped
    assert not c.pids(1) and c.pids(0) and not c.nodes[1].memory_dir.exists()


def test_a_node_that_never_joins_fails_the_run_within_the_join_timeout(tmp_path, dataset, monkeypatch, capfd):
    """Node 1's pod never comes: node 0 gives up after --join-timeout-s, and goodput train says why."""
    from trainer import launch

    start = launch.LocalCluster.start
    monkeypatch.setattr(launch.LocalCluster, "start", lambda self, i=None: start(self, 0))
    t0 = time.monotonic()
    code, result = launch.run_local_training(flags("--data", str(dataset), *TINY, "--out", str(tmp_path / "run")),
                                             LaunchConfig(nnodes=2, nproc_per_node=1, join_timeout_s=5),
                                             tmp_path / "fsx")
    waited = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code != 0 and result is None and waited < 60, (code, waited)
    assert "RendezvousTimeoutError" in err and "not all 2 nodes joined the rendezvous" in err
    assert not read_events(tmp_path / "run" / "events.jsonl")     # no rank ever started


@pytest.mark.timeout(300)
def test_sigterm_stops_every_node_with_a_committed_checkpoint(tmp_path, dataset):
    out, mark = tmp_path / "run", uuid.uuid4().hex
    with open(tmp_path / "run.log", "w+") as log:
        proc = subprocess.Popen([*GOODPUT, "train", "--nodes", "2", "--nproc", "1", "--data", str(dataset),
                                 "--out", str(out), *TINY, "--max-steps", "100000", "--ckpt-every", "0",
                                 "--memory-snapshot-every-s", "0.5"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, MARK: mark})
        try:
            assert until(lambda: any(e["event"] == "memory_snapshot" for e in read_events(out / "events.jsonl")), 120)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 143, log.seek(0) or log.read()[-4000:]
        finally:
            with contextlib.suppress(ProcessLookupError):    # its session's leftovers, if it failed
                os.killpg(proc.pid, signal.SIGKILL)
    (stop,) = [e for e in read_events(out / "events.jsonl") if e["event"] == "exit"]
    # The ranks agreed on the step (rank 1's node too: that step is committed, so its shard was written).
    assert stop["reason"] == "sigterm" and committed_steps(out / "checkpoints") == [stop["step"]]
    assert max(e["step"] for e in read_events(out / "events.jsonl") if e["event"] == "step") == stop["step"]
    assert until(lambda: not marked(mark), 15), marked(mark)


def test_a_rank_killed_on_node_1_restarts_both_nodes(cluster, two_node_sha):
    c = cluster(*STEPS, "--inject-fault", "kill@7:1", "--memory-snapshot-every-s", "0.001")
    assert c.supervise(timeout=90) == 0, logs(c)
    s = summary(c)
    assert s["params_sha256"] == two_node_sha and [f["kind"] for f in s["faults"]] == ["kill"]
    starts = [e for e in events(c) if e["event"] == "worker_start"]
    assert sorted(e["rank"] for e in starts) == [0, 0, 1, 1] and all(e["warm"] for e in starts)
    # Both nodes restarted from their own memory: the newest copy before the fault, not the step-4 checkpoint
    # (a copy at step 5 or 6, unless the copies' spacing skipped both).
    ev = events(c)
    loaded = [(e["source"], e["step"]) for e in ev if e["event"] == "ckpt_loaded"]
    assert len(loaded) == 2 and loaded[0] == loaded[1] and loaded[0][0] == "memory"
    before = ev[:next(i for i, e in enumerate(ev) if e["event"] == "ckpt_loaded")]
    assert loaded[0][1] >= 5 or not copy_due_after_checkpoint(before, 4), loaded


def test_two_nodes_of_two_ranks_recover_a_rank_killed_on_node_1(tmp_path, dataset):
    """2 x 2: node 1's second rank (rank 3) killed at step 7; both nodes' agents restart their two ranks and the
    run ends with the fault-free 2 x 2 run's weights."""
    def train(name: str, *extra: str) -> dict:
        out = tmp_path / name
        proc = subprocess.run([*GOODPUT, "train", "--nodes", "2", "--nproc", "2", "--data", str(dataset),
                               "--out", str(out), *TINY, *STEPS, *extra], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return json.loads((out / "summary.json").read_text())

    clean, faulted = train("clean"), train("kill", "--inject-fault", "kill@7:3")
    assert [f["kind"] for f in faulted["faults"]] == ["kill"] and clean["faults"] == []
    assert faulted["params_sha256"] == clean["params_sha256"]
    starts = [e for e in read_events(tmp_path / "kill" / "events.jsonl") if e["event"] == "worker_start"]
    assert sorted(e["rank"] for e in starts) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_a_hang_on_node_0_is_caught_and_both_nodes_restart(cluster, two_node_sha):
    c = cluster(*STEPS, "--inject-fault", "hang@6:0", "--ft-calc-after-steps", "3", "--ft-min-step-timeout-s", "3",
                step_timeout_s=300.0)
    assert c.supervise(timeout=120) == 0, logs(c)
    s = summary(c)
    assert s["params_sha256"] == two_node_sha and [f["kind"] for f in s["faults"]] == ["hang"]
    assert sorted(e["rank"] for e in events(c) if e["event"] == "worker_start") == [0, 0, 1, 1]


def test_node_1_lost_and_replaced_resumes_from_the_checkpoint_with_the_fault_free_weights(cluster, two_node_sha):
    """Peer copies off (tests/test_peer_restore.py has them on): node 1's snapshots go with the node."""
    c = cluster(*STEPS, "--memory-snapshot-every-s", "0.001", "--no-peer-snapshots")
    wait_for(c, lambda e: e["event"] == "ckpt_committed" and e["step"] == 4)
    wait_for(c, lambda e: e["event"] == "step" and e["step"] >= 6)
    c.kill(1)
    lost_at = time.time()
    c.start(1)                        # what the PyTorchJob's restart policy does: a new pod, empty /dev/shm
    assert c.supervise(timeout=120) == 0, logs(c)
    assert summary(c)["params_sha256"] == two_node_sha
    after = [e for e in events(c) if e["t"] > lost_at]
    # Node 0 still had its copy in memory, node 1's went with it: the newest step both have is on FSx.
    assert [(e["source"], e["rank"]) for e in after if e["event"] == "ckpt_loaded"] in (
        [("checkpoint", 0), ("checkpoint", 1)], [("checkpoint", 1), ("checkpoint", 0)])
    # ...the newest one committed before the loss.
    resumed_at = min(e["t"] for e in after if e["event"] == "ckpt_loaded")
    committed = [e["step"] for e in events(c) if e["event"] == "ckpt_committed" and e["t"] <= resumed_at]
    assert {e["step"] for e in after if e["event"] == "ckpt_loaded"} == {max(committed)}


def test_node_1_lost_and_replaced_by_a_warm_standby_ends_with_the_fault_free_weights(cluster, two_node_sha):
    """The standby's tree (wrapper, zygote, launcher with NVRx imported) is up before the loss and waits at its
    gate without joining the rendezvous; promoted, that same launcher joins, takes group rank 1, and its rank
    is forked from its zygote: no process of the replacement starts after the loss."""
    c = cluster(*STEPS, "--memory-snapshot-every-s", "0.001", standby=1)
    standby = c.standbys[0]
    wait_for(c, lambda e: e["event"] == "ckpt_committed" and e["step"] == 4)
    assert until(c.standby_ready, 60), logs(c)
    launcher = [p.pid for p in c._processes(standby) if p.cmdline()[1:3] == ["-m", "trainer.launch"]]
    wait_for(c, lambda e: e["event"] == "step" and e["step"] >= 6)
    assert "attempts to join" not in standby.log.read_text()        # waiting at the gate, not in the round
    assert {e["rank"] for e in events(c) if e["event"] == "worker_start"} == {0, 1}
    c.kill(1)
    lost_at = time.time()
    c.promote(1)
    assert c.nodes[1] is standby and not c.standbys
    assert c.supervise(timeout=120) == 0, logs(c)
    assert summary(c)["params_sha256"] == two_node_sha
    # The launcher that waited joined the round after the loss, as group rank 1...
    joined = [line for line in standby.log.read_text().splitlines() if "has joined round" in line]
    assert len(launcher) == 1 and len(joined) == 1 and f"ft_launcher{launcher[0]}@" in joined[0], (launcher, joined)
    assert "as rank 1 in a world of size 2" in joined[0]
    # ...and its rank came from its warm zygote.
    (started,) = [e for e in events(c) if e["event"] == "worker_start" and e["rank"] == 1 and e["t"] > lost_at]
    assert started["warm"]


def test_promote_needs_a_standby_and_a_lost_node(tmp_path):
    args = ["--out", str(tmp_path / "out"), "--memory-snapshot-dir", str(tmp_path / "shm")]
    with pytest.raises(RuntimeError, match="no standby"):
        LocalCluster(LaunchConfig(nnodes=2, nproc_per_node=1), args).promote(1)
    with pytest.raises(RuntimeError, match="standby0 is not running"):      # never started
        LocalCluster(LaunchConfig(nnodes=2, nproc_per_node=1), args, standby=1).promote(1)
    with pytest.raises(ValueError, match="standby must be a number of nodes"):
        LocalCluster(LaunchConfig(nnodes=2, nproc_per_node=1), args, standby=-1)


def test_a_node_lost_without_replacement_under_min_max_finishes_on_fewer_nodes(cluster):
    """In-job layer only (with the in-process layer too, a peer lost for good first costs its heartbeat timeout:
    tests/test_multinode_restarts.py)."""
    c = cluster("--max-steps", "20", "--ckpt-every", "4", "--restart-layers", "injob", min_nodes=1,
                last_call_timeout_s=1.0)
    wait_for(c, lambda e: e["event"] == "ckpt_committed" and e["step"] == 4)
    c.kill(1)
    assert c.supervise(timeout=120) == 0, logs(c)
    s = summary(c)
    assert s["steps"] == 20
    assert [e["world_size"] for e in events(c) if e["event"] == "run_start"][-1] == 1
    # One job throughout: node 0's agent restarted its worker for every membership change (node 1 joining
    # after node 0 started alone, node 1 lost), never a new job's start.
    assert not [e for e in events(c) if e["event"] == "restart" and e["layer"] == "job"]
    # The one-rank run resumed from a committed two-rank checkpoint, resharded, and said so...
    (resharded,) = [e for e in events(c) if e["event"] == "resharded"]
    assert (resharded["from_world_size"], resharded["to_world_size"]) == (2, 1)
    resumed = [e["step"] for e in events(c) if e["event"] == "resumed"]
    assert resharded["step"] >= 4 and resumed[-1] == resharded["step"]
    # ...and the loss curve goes on from where it was: the first step after the resume is near the loss at the
    # resumed step (a fresh model would start near ln(256) = 5.5 with the byte vocabulary), not back at the start.
    resumed_at = next(e["t"] for e in events(c) if e["event"] == "resharded")
    losses = [e for e in events(c) if e["event"] == "step"]
    before = next(e["loss"] for e in reversed(losses) if e["step"] == resharded["step"] and e["t"] < resumed_at)
    first = next(e for e in losses if e["t"] > resumed_at)
    initial = next(e["loss"] for e in losses if e["step"] == 1)
    assert first["step"] == resharded["step"] + 1
    assert abs(first["loss"] - before) < 0.5 * (initial - before), (initial, before, first["loss"])
