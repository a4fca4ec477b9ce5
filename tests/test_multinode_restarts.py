"""Which layer restarted, and a peer lost for good, across nodes (trainer/session.py, trainer/restart.py): 2 nodes
x 1 rank on this machine (``LocalCluster``), each its own ft_launcher agent.

Each agent counts only its own restarts (``TORCHELASTIC_RESTART_COUNT``), so the layer that restarted is decided
from every node's agent; a peer lost for good under the in-process layer is left to the in-job one, whose elastic
rendezvous goes on with the nodes left.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from trainer.events import read_events

from tests.multinode import events, logs, wait_for


@pytest.mark.timeout(300)
def test_rank_0s_node_replaced_is_an_in_job_restart_not_a_new_job(cluster):
    """Node 1 started first is group rank 0 (rank 0) without hosting the rendezvous store, so its loss leaves the
    job running. Its replacement's agent is new (restart count 0, a new attempt); node 0's rank waits in the
    in-process layer's restart, so its agent restarts the workers for the membership change when the
    replacement arrives: it keeps its attempt. One job, restarted in-job.

    (Node 0's agent then completes the rendezvous round and keeps each node's rank: the replacement gets rank 0.
    With the in-job layer alone node 0's agent would count a restart and wait first; the replacement completing
    the round would order the nodes by launcher pid, most often giving rank 0 to node 0.)"""
    c = cluster("--max-steps", "14", "--ckpt-every", "4", "--restart-layers", "both", order=(1, 0))
    wait_for(c, lambda e: e["event"] == "ckpt_committed" and e["step"] == 4)
    rank0 = wait_for(c, lambda e: e["event"] == "worker_start" and e["rank"] == 0)["pid"]
    assert rank0 in c.pids(1), "node 1 (started first) does not hold rank 0"
    c.kill(1)
    lost_at = time.time()
    c.start(1)
    assert c.supervise(timeout=200) == 0, logs(c)
    starts = [e for e in events(c) if e["event"] == "run_start"]
    restarts = [e for e in events(c) if e["event"] == "restart" and e["t"] > lost_at]
    assert [(e["layer"], e.get("membership_change")) for e in restarts] == [("injob", True)], restarts
    # Rank 0 was on the replacement (a new agent at count 0), node 0's agent the same as before.
    assert starts[-1]["t"] > lost_at and starts[-1]["restart_count"] == 0
    assert starts[-1]["agent_attempts"]["0"] not in starts[0]["agent_attempts"].values()
    assert starts[-1]["agent_attempts"]["1"] == starts[0]["agent_attempts"]["1"]
    s = json.loads((c.out / "summary.json").read_text())
    assert s["steps"] == 14 and s["restarts_job"] == 0 and s["restarts_injob"] == 1


@pytest.mark.timeout(300)
def test_a_peer_lost_for_good_under_both_layers_is_an_in_job_restart_and_the_job_finishes_on_one_node(cluster):
    """Node 1 killed and not replaced under ``--nodes 1:2 --restart-layers both``: node 0's rank waits in the
    in-process restart until the Wrapper finds rank 1 silent (``--inprocess-heartbeat-timeout-s``), then leaves it
    to the in-job layer (not a ``fatal`` error that stops the node); node 0 finishes alone from the resharded
    checkpoint."""
    c = cluster("--max-steps", "20", "--ckpt-every", "4", "--restart-layers", "both",
                "--inprocess-heartbeat-timeout-s", "10", min_nodes=1, last_call_timeout_s=1.0)
    wait_for(c, lambda e: e["event"] == "ckpt_committed" and e["step"] == 4)
    c.kill(1)
    lost_at = time.time()
    assert c.supervise(timeout=200) == 0, logs(c)
    assert not [e for e in events(c) if e["event"] == "fatal"], logs(c)
    after = [e for e in events(c) if e["t"] > lost_at]
    (start,) = [e for e in after if e["event"] == "run_start"]
    assert start["world_size"] == 1
    assert [(e["layer"], e["restart_count"]) for e in after if e["event"] == "restart"] == [("injob", 1)]
    (resharded,) = [e for e in after if e["event"] == "resharded"]
    assert (resharded["from_world_size"], resharded["to_world_size"]) == (2, 1)
    s = json.loads((c.out / "summary.json").read_text())
    assert s["steps"] == 20 and s["restarts_job"] == 0


def test_a_rank_found_dead_does_not_break_the_wrappers_exit(monkeypatch):
    """NVRx 0.4.1's sibling monitor enters a rank it found dead into the termination barrier with the ranks its
    store returns (bytes); every later exit through that barrier (the survivor's) must still parse it. The
    Wrapper's own store class, as ``build_wrapper`` configures it, on a store of one rank hosted here."""
    from trainer import restart
    from trainer.config import RestartConfig
    from trainer.parallel import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    restart._launcher_store.cache_clear()
    try:
        wrapper = restart.build_wrapper(RestartConfig(), cuda=False)
        store = wrapper.store_factory(**wrapper.store_kwargs)
        store.set_initial_rank(1, 1)
        dead = store.get_initial_ranks([1])                       # what the sibling monitor enters
        store.termination_barrier(ranks=dead, rendezvous_count=2, timeout=timedelta(0))
        store.termination_barrier(ranks=[0], rendezvous_count=2, timeout=timedelta(0))   # the survivor's exit
        assert store.get(f"{store.BARRIER_PREFIX}:reentrant_barrier:{store.TERMINATION_BARRIER}:arrived") == b"1,0,"
    finally:
        restart._launcher_store.cache_clear()


def test_the_layer_is_decided_from_every_nodes_agent(tmp_path, dataset):
    """Rank 0's own agent is new (its node replaced) in every start after the first: the other node's agent
    decides. It counted a restart (its rank failed on the lost peer), or kept its attempt (a membership change),
    or is new too (a new job)."""
    from trainer.config import parse_config
    from trainer.events import EventLog
    from trainer.session import Session

    def start(agents: dict[int, tuple[int, str]]) -> list[dict]:
        s = Session.__new__(Session)
        s.cfg, s.out = parse_config(["--data", str(dataset), "--out", str(tmp_path / "run")]), tmp_path / "run"
        s.out.mkdir(exist_ok=True)
        s.spec, s.events_path = s.cfg.model.spec(s.cfg.data.data), s.out / "events.jsonl"
        s.world_size, s.events = 2, EventLog(s.events_path, 0)
        s._record_start(agents)
        s.events.close()
        return [e for e in read_events(s.events_path) if e["event"] == "restart"][-1:]

    assert start({0: (0, "a0"), 1: (0, "b0")}) == []
    assert [(e["layer"], e["restart_count"]) for e in start({0: (0, "a1"), 1: (1, "b1")})] == [("injob", 1)]
    (change,) = start({0: (0, "a2"), 1: (0, "b1")})
    assert (change["layer"], change["membership_change"]) == ("injob", True)
    assert [e["layer"] for e in start({0: (0, "a3"), 1: (0, "b3")})] == ["job"]
