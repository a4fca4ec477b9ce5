"""Exact resume on 2 CPU ranks: kill -9, torn checkpoints and SIGTERM never change the final weights."""

from __future__ import annotations

import os
import signal

import pytest

from trainer.checkpoint import COMMITTED, committed_steps, step_dir

from tests.conftest import STEPS


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_kill_9_of_a_rank_then_rerun_ends_bitwise_identical(tmp_path, start_run, clean_sha, mode):
    out = tmp_path / "run"
    args = [*STEPS, "--parallel", mode]
    run = start_run(out, *args)
    run.wait_for(lambda e: e["event"] == "ckpt_committed" and e["step"] >= 4, what="a committed checkpoint")
    run.wait_for(lambda e: e["event"] == "step" and e["step"] >= 6, what="step 6")
    os.kill(run.worker_pid(1), signal.SIGKILL)
    assert run.wait() != 0, "the launcher (no restarts allowed) must fail when a rank dies"
    assert not (out / "summary.json").exists()
    before = committed_steps(out / "checkpoints")
    assert before, "a committed checkpoint existed before the kill"

    rerun = start_run(out, *args)
    assert rerun.wait() == 0, rerun.tail()
    events = rerun.events()
    resumed = [e for e in events if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] >= before[-1]
    summary = rerun.summary()
    assert summary["restarts"] == 1
    assert summary["params_sha256"] == clean_sha(mode)


def test_torn_checkpoint_is_never_used_and_is_cleaned_up(tmp_path, start_run, clean_sha):
    out = tmp_path / "run"
    # Rank 1 dies right after handing its part of the step-8 checkpoint to the writer.
    args = [*STEPS, "--inject-fault", "ckpt-crash@8:1"]
    run = start_run(out, *args)
    assert run.wait() != 0
    torn = step_dir(out / "checkpoints", 8)
    assert not (torn / COMMITTED).exists(), "a checkpoint missing a rank's shard must never be committed"
    assert committed_steps(out / "checkpoints") == [4]

    rerun = start_run(out, *args)   # the same command: the fault already fired, it does not fire again
    assert rerun.wait() == 0, rerun.tail()
    events = rerun.events()
    # It resumes from the step-4 checkpoint, or from a whole copy in the node's memory (of step 8 itself
    # when that save had to wait for the previous write, or a newer one when it was written from such a
    # copy later); never from the torn step-8 directory.
    loaded = [(e["source"], e["step"]) for e in events if e["event"] == "ckpt_loaded"]
    assert loaded[-1] == ("checkpoint", 4) or (loaded[-1][0] == "memory" and loaded[-1][1] >= 4), loaded
    assert any(e["event"] == "ckpt_torn_deleted" and e["step"] == 8 for e in events)
    assert rerun.summary()["params_sha256"] == clean_sha("fsdp")


def test_sigterm_commits_a_checkpoint_and_exits_cleanly(tmp_path, start_run, clean_sha):
    out = tmp_path / "run"
    run = start_run(out, *STEPS)
    run.wait_for(lambda e: e["event"] == "step" and e["step"] >= 5, what="step 5")
    run.proc.send_signal(signal.SIGTERM)          # what the kubelet sends the pod's launcher
    assert run.wait() == 0, run.tail()
    events = run.events()
    exits = [e for e in events if e["event"] == "exit"]
    assert exits and exits[-1]["reason"] == "sigterm"
    stopped_at = exits[-1]["step"]
    assert stopped_at < 14
    assert committed_steps(out / "checkpoints")[-1] == stopped_at
    assert not (out / "summary.json").exists()

    rerun = start_run(out, *STEPS)
    assert rerun.wait() == 0, rerun.tail()
    assert [e["step"] for e in rerun.events() if e["event"] == "resumed"][-1] == stopped_at
    assert rerun.summary()["params_sha256"] == clean_sha("fsdp")


@pytest.mark.parametrize("same_agent", [True, False])
def test_a_membership_change_restart_is_not_a_job_restart(tmp_path, monkeypatch, dataset, same_agent):
    """A membership change (a node joins or leaves an elastic job): the agent restarts its workers without
    counting a restart, so the count alone would call it a new job; its attempt's error file says otherwise."""
    from trainer.config import parse_config
    from trainer.events import EventLog, read_events
    from trainer.session import Session

    def start(agent_dir: str) -> list[dict]:
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / agent_dir / "attempt_0" / "0" / "error.json"))
        s = Session.__new__(Session)
        s.cfg, s.out = parse_config(["--data", str(dataset), "--out", str(tmp_path / "run")]), tmp_path / "run"
        s.out.mkdir(exist_ok=True)
        s.spec, s.events_path = s.cfg.model.spec(s.cfg.data.data), s.out / "events.jsonl"
        s.world_size, s.events = 1, EventLog(s.events_path, 0)
        s._record_start()
        s.events.close()
        return [e for e in read_events(s.events_path) if e["event"] == "restart"]

    assert start("agent_a") == []
    (restart,) = start("agent_a" if same_agent else "agent_b")
    assert restart["layer"] == ("injob" if same_agent else "job")
    assert restart.get("membership_change", False) == same_agent


def test_a_replica_of_another_world_size_is_never_used(tmp_path, process_group):
    """An elastic job re-formed with fewer ranks: rank 0's replica of the two-rank run has the layout of the
    one-rank state (replicated, as with DDP) and the same run, yet the resume is from the committed checkpoint."""
    import dataclasses

    import torch

    from trainer.checkpoint import CheckpointManager
    from trainer.config import CheckpointConfig
    from trainer.events import EventLog

    def state(step: int) -> dict:
        return {"model": {"w": torch.full((8, 8), float(step))}, "train": {"step": step}}

    root, events = tmp_path / "ckpt", EventLog(tmp_path / "e", 0)
    cfg = CheckpointConfig(memory_dir=str(tmp_path / "shm"))
    one = CheckpointManager(root, cfg, process_group, events, run_id="run")
    one.save(3, state(3), blocking=True)
    one.close()
    two = CheckpointManager(root, cfg, dataclasses.replace(process_group, world_size=2), events, run_id="run")
    two.snapshot_to_memory(5, state(5))      # no collective: rank 0's copy as the two-rank run made it
    two.finish_snapshot()
    two.close()
    again = CheckpointManager(root, cfg, process_group, events, run_id="run")
    try:
        step, source, restored = again.restore(state(-1))
        assert (step, source) == (3, "checkpoint") and restored["train"]["step"] == 3
        assert torch.equal(restored["model"]["w"], state(3)["model"]["w"])
    finally:
        again.close()
