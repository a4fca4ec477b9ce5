"""Recovery on a device mesh (llama debug, gloo): an exception under tensor parallelism is recovered by the
in-process layer from the ranks' memory snapshots (DTensor shards) and ends with the fault-free run's weights."""

from __future__ import annotations

import pytest

from trainer.events import read_events

from tests.test_parallel_runs import _run


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


@pytest.mark.timeout(600)   # two runs of 2 ranks
def test_a_killed_rank_under_tensor_parallelism_is_recovered_in_job(tmp_path, dataset):
    """tp=2 on 2 ranks, rank 1 killed at step 5: ft_launcher restarts the worker group, which reloads both ranks'
    shards (the node's memory snapshot, or the checkpoint) and ends with the fault-free run's weights."""
    run = ("--tp", "2", "--max-steps", "6", "--ckpt-every", "2")
    clean = _run(dataset, tmp_path / "clean", *run, nproc=2)
    faulted = _run(dataset, tmp_path / "faulted", *run, "--inject-fault", "kill@5:1", "--restart-layers", "injob",
                   nproc=2, max_restarts=1)
    assert faulted["mesh"] == {"dp_replicate": 1, "dp_shard": 1, "tp": 2}
    assert [(f["kind"], f["layer"]) for f in faulted["faults"]] == [("kill", "injob")]
    assert (faulted["restarts_inprocess"], faulted["restarts_injob"]) == (0, 1)
    loaded = {e["rank"] for e in read_events(tmp_path / "faulted" / "events.jsonl") if e["event"] == "ckpt_loaded"}
    assert loaded == {0, 1}
    assert faulted["steps"] == 6 and faulted["params_sha256"] == clean["params_sha256"]
