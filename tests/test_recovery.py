"""Each fault kind, through the layer that should catch it: the run finishes with the fault-free run's
weights, the restart counters say which layer recovered it, and no committed checkpoint is lost."""

from __future__ import annotations

import pytest

from trainer.checkpoint import committed_steps

from tests.conftest import STEPS, copy_due_after_checkpoint

# Rank-monitor timeouts tight enough to catch a hang within seconds on this tiny workload.
FAST_FT = {"step_timeout_s": 4.0, "workload_check_interval_s": 0.5}


def _check_finished_like_clean(run, clean_sha) -> dict:
    summary = run.summary()
    assert summary["steps"] == 14
    assert summary["params_sha256"] == clean_sha("fsdp")
    kept = committed_steps(run.out / "checkpoints")
    # A rank killed between a commit's marker and its event leaves a commit the events do not name.
    committed_ever = sorted({e["step"] for e in run.events() if e["event"] == "ckpt_committed"} | set(kept))
    # Retention keeps the newest 3; every one of them is intact (marker present, loadable later).
    assert kept == committed_ever[-3:]
    return summary


# The hang is caught by the step timeout the rank monitor learns (from 3 steady steps, raised to a 6 s
# floor); the launcher's flag stays at its 300 s default, so only the tightened timeout can catch it.
# (6 s: 5x the longest first step stays under it up to 1.2 s steps; first steps of 0.5 s are seen under load.)
LEARNED_FT = ["--ft-calc-after-steps", "3", "--ft-min-step-timeout-s", "6"]


@pytest.mark.parametrize("fault,restart,layer", [
    ("exception@6:1", "both", "inprocess"),
    ("exception@6:1", "injob", "injob"),
    ("hang@6:0", "both", "injob"),        # kill: test_a_restart_resumes_from_the_newest_memory_snapshot
    ("ckpt-crash@8:0", "both", "injob"),
])
def test_fault_is_recovered_by_the_right_layer(tmp_path, start_run, clean_sha, fault, restart, layer):
    hang = fault.startswith("hang")
    run = start_run(tmp_path / "run", *STEPS, "--inject-fault", fault, "--restart-layers", restart,
                    *(LEARNED_FT if hang else []), max_restarts=2,
                    **(dict(FAST_FT, step_timeout_s=300.0) if hang else FAST_FT))
    assert run.wait() == 0, run.tail()
    summary = _check_finished_like_clean(run, clean_sha)
    kind = fault.split("@")[0]
    assert [(f["kind"], f["layer"]) for f in summary["faults"]] == [(kind, layer)]
    assert summary["restarts_inprocess"] == (layer == "inprocess")
    assert summary["restarts_injob"] == (layer == "injob")
    assert summary["lost_steps"] >= 0 and summary["faults"][0]["recovered_s"] > 0
    if layer == "injob":
        _assert_restarted_warm(run)
    if layer == "inprocess":
        # Restored from the in-memory snapshot: no disk read.
        assert any(e["event"] == "ckpt_loaded" and e["source"] == "memory" for e in run.events())
    if hang:
        # Tightened to the floor (5x these ~0.1 s steps is under it), not left at the flag's 300 s.
        assert [e["timeout_s"] for e in run.events() if e["event"] == "ft_step_timeout"][:1] == [6.0]
    if kind == "ckpt-crash":
        # The torn step-8 checkpoint is never used: the restart loads the step-4 one, or a newer copy in
        # the node's memory taken before the crash (of step 8 itself when its save had to wait for the
        # previous write: that copy is whole, only the directory is torn).
        # (A save due while the first write ran on a booting writer is written later from a copy in memory:
        # that copy, and a newer one, are whole too; the weights at the end say the restart was exact.)
        last = [(e["source"], e["step"]) for e in run.events() if e["event"] == "ckpt_loaded"][-1]
        assert last == ("checkpoint", 4) or (last[0] == "memory" and last[1] >= 4), last


def test_an_exception_under_ddp_is_recovered_in_process(tmp_path, start_run, clean_sha):
    """DDP's reducer keeps the failed attempt's gloo group alive past its destruction: the next attempt
    must not wait for the collective the failed rank never joined (the Wrapper's hard timeout, then an
    in-job restart, before the fix)."""
    run = start_run(tmp_path / "run", *STEPS, "--parallel", "ddp", "--inject-fault", "exception@6:1",
                    max_restarts=2, **FAST_FT)
    assert run.wait() == 0, run.tail()
    summary = run.summary()
    assert summary["params_sha256"] == clean_sha("ddp")
    assert [(f["kind"], f["layer"]) for f in summary["faults"]] == [("exception", "inprocess")]
    assert (summary["restarts_inprocess"], summary["restarts_injob"]) == (1, 0)


def _assert_restarted_warm(run) -> None:
    """The restarted ranks were forked from the warm-start zygote, not started cold."""
    starts = [e for e in run.events() if e["event"] == "worker_start"]
    assert len(starts) == 4 and all(e["warm"] for e in starts)


def test_sigterm_fault_is_recovered_by_a_job_restart(tmp_path, start_run, clean_sha):
    out = tmp_path / "run"
    args = [*STEPS, "--inject-fault", "sigterm@6:1"]
    run = start_run(out, *args)
    assert run.wait() == 0, run.tail()          # a clean exit after the SIGTERM checkpoint
    assert not (out / "summary.json").exists()
    rerun = start_run(out, *args)               # what the Training Operator does with the job's pods
    assert rerun.wait() == 0, rerun.tail()
    summary = _check_finished_like_clean(rerun, clean_sha)
    assert [(f["kind"], f["layer"]) for f in summary["faults"]] == [("sigterm", "job")]
    assert summary["restarts_job"] == 1 and summary["lost_steps"] == 0


@pytest.mark.parametrize("fault,restart,layer", [
    ("exception@7:1", "both", "inprocess"),
    ("kill@7:1", "both", "injob"),        # new processes on the same node find the copy in its memory
])
def test_a_restart_resumes_from_the_newest_memory_snapshot(tmp_path, start_run, clean_sha, fault, restart, layer):
    """Between checkpoints the state is copied to node memory; the restart redoes only the steps since the copy."""
    run = start_run(tmp_path / "run", *STEPS, "--inject-fault", fault, "--restart-layers", restart,
                    "--memory-snapshot-every-s", "0.001", max_restarts=int(layer == "injob"), **FAST_FT)
    assert run.wait() == 0, run.tail()
    summary = _check_finished_like_clean(run, clean_sha)
    events = run.events()
    # The copies made before the restart loaded one (rank 0 records a copy before the restore's all-gather,
    # which its peers' ckpt_loaded follow): the steps the restart redid are copied again.
    restored_at = next(i for i, e in enumerate(events) if e["event"] == "ckpt_loaded")
    before = events[:restored_at]
    # What the fault left: the copies in node memory; in-process also the staging copy of a checkpoint (the
    # step-4 one, when the spacing skipped steps 5 and 6), which a killed process takes with it; the checkpoints
    # committed before it.
    memory = [e["step"] for e in before if e["event"] == "memory_snapshot"
              or (e["event"] == "ckpt_snapshot" and layer == "inprocess")]
    committed = [e["step"] for e in before if e["event"] == "ckpt_committed"]
    loaded = [(e["source"], e["step"]) for e in events if e["event"] == "ckpt_loaded"]
    # Both loaded the newest of them; 6 if the fault interrupted rank 0 between marking its step-6 copy and
    # recording it.
    step = loaded[0][1]
    assert memory and step in (max(memory + committed), 6), (memory, committed, loaded)
    assert loaded == [("checkpoint" if step in committed and step not in memory else "memory", step)] * 2, loaded
    assert summary[f"restarts_{layer}"] == 1 and summary["lost_steps"] == 6 - step
    # A copy at step 5 or 6 follows the step-4 checkpoint, unless the copies' spacing skipped both.
    assert step >= 5 or not copy_due_after_checkpoint(before, 4), memory
    assert [(f["kind"], f["layer"]) for f in summary["faults"]] == [(fault.split("@")[0], layer)]
    if layer == "injob":
        _assert_restarted_warm(run)
