"""Recovery on a device mesh (llama debug, gloo): an exception under tensor parallelism is recovered by the
in-process layer from the ranks' memory snapshots (DTensor shards), and a node lost under HSDP is replaced and
restored from the copy of its snapshots its peer node keeps; both end with the fault-free run's weights."""

from __future__ import annotations

import os
import signal
import time

import pytest

from trainer.events import read_events

from tests.conftest import until
from tests.multinode import events, logs, summary, wait_for
from tests.test_parallel_runs import LLAMA, _run
from tests.test_peer_restore import committed, held, newest_snapshot


@pytest.mark.timeout(600)   # two runs of 2 ranks
def test_an_exception_under_tensor_parallelism_is_recovered_in_process(tmp_path, dataset):
    """tp=2 on 2 ranks, rank 1 raises at step 5: the in-process layer restores both ranks' shards from memory."""
    run = ("--tp", "2", "--max-steps", "6", "--ckpt-every", "2")
    clean = _run(dataset, tmp_path / "clean", *run, nproc=2)
    faulted = _run(dataset, tmp_path / "faulted", *run, "--inject-fault", "exception@5:1", "--restart-layers", "both",
                   nproc=2)
    assert clean["mesh"] == faulted["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert [(f["kind"], f["layer"]) for f in faulted["faults"]] == [("exception", "inprocess")]
    assert (faulted["restarts_inprocess"], faulted["restarts_injob"]) == (1, 0)
    loaded = [(e["rank"], e["source"]) for e in read_events(tmp_path / "faulted" / "events.jsonl")
              if e["event"] == "ckpt_loaded"]
    assert sorted(loaded) == [(0, "memory"), (1, "memory")]
    assert faulted["steps"] == 6 and faulted["params_sha256"] == clean["params_sha256"]


# HSDP on 2 nodes x 2 ranks: node 0's ranks are replica 0, node 1's replica 1. A memory snapshot every 0.3 s;
# synchronous checkpoints, committed at their step, so that the loss falls between two of them.
HSDP = ("--dp-replicate", "2", "--dp-shard", "2")
MAX_STEPS = 40
RUN = ("--max-steps", str(MAX_STEPS), "--ckpt-every", "10", "--ckpt-sync", "--memory-snapshot-every-s", "0.3", *HSDP)
NODE_1_RANKS = (2, 3)


@pytest.mark.timeout(600)   # a fault-free run of 4 ranks, and 2 nodes x 2 with node 1 replaced
def test_a_node_lost_under_hsdp_is_restored_from_its_peer_copy(tmp_path, dataset, cluster):
    fault_free = _run(dataset, tmp_path / "fault-free", *RUN, nproc=4)
    c = cluster(*RUN, nproc=2, model=LLAMA)
    pids = {r: wait_for(c, lambda e, r=r: e["event"] == "worker_start" and e["rank"] == r)["pid"]
            for r in NODE_1_RANKS}
    # Node 1 frozen once both its ranks' newest snapshots are past the newest checkpoint and node 0 holds
    # them (its ranks then wait for node 1's within a step), then lost: killed, its memory wiped, replaced.
    assert until(lambda: all((newest_snapshot(c, 1, r) or 0) > committed(c) >= 10 for r in NODE_1_RANKS), 180), logs(c)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    assert until(lambda: all(max(held(c, 1, r), default=None) == newest_snapshot(c, 1, r) for r in NODE_1_RANKS),
                 10), {r: (held(c, 1, r), newest_snapshot(c, 1, r)) for r in NODE_1_RANKS}
    kept = {r: held(c, 1, r) for r in NODE_1_RANKS}
    newest_commit, lost_at = committed(c), time.time()
    c.kill(1)
    c.start(1)
    assert c.supervise(timeout=300) == 0, logs(c)

    s = summary(c)
    assert s["mesh"] == fault_free["mesh"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}
    assert s["params_sha256"] == fault_free["params_sha256"]
    loaded = {e["rank"]: e for e in events(c) if e["event"] == "ckpt_loaded" and e["t"] > lost_at}
    # The replacement's ranks fetched their state from node 0's copies, node 0's ranks read their own memory.
    assert {r: (e["source"], e.get("fetched")) for r, e in loaded.items()} == {
        0: ("peer", False), 1: ("peer", False), 2: ("peer", True), 3: ("peer", True)}
    # All at one step between the checkpoints, which node 0 kept for both of node 1's ranks.
    (step,) = {e["step"] for e in loaded.values()}
    assert step > newest_commit and all(step in kept[r] for r in NODE_1_RANKS), (step, kept, newest_commit)
