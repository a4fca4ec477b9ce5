"""Goodput arithmetic, the checkpoint-interval policy and the fault schedule, against hand-computed cases and the
event logs of real runs."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal

import pytest

from trainer.events import Event, EventLog, EventLogError, read_events
from trainer.fault_spec import Fault, chaos_schedule
from trainer.checkpoint.policy import AUTO, IntervalPolicy
from trainer.goodput import DEFAULT_MTBF_S, account, project, young_daly_interval_s
from trainer.metrics import RunCollector
from trainer.summary import summarize

from tests.conftest import until


def test_young_daly():
    # sqrt(2 * 0.5 s * 3600 s) = sqrt(3600) = 60 s
    assert young_daly_interval_s(0.5, 3600) == pytest.approx(60.0)


def test_projection_against_hand_computed_values():
    # 1000 GPUs at 1e-4 failures/GPU-hour: 0.1 failures/hour, MTBF 36,000 s.
    p = project(1000, 1e-4, ckpt_block_s=0.02, recovery_s=10.0, job_ckpt_block_s=20.0, job_recovery_s=600.0,
                job_hours=1.0)
    assert p["mtbf_s"] == 36000.0
    # ours: tau = sqrt(2*0.02*36000) = 37.947 s; goodput = (1 - (10 + 18.974)/36000) / (1 + 0.02/37.947)
    tau = math.sqrt(2 * 0.02 * 36000)
    assert p["ours"]["interval_s"] == pytest.approx(tau, abs=0.05)
    assert p["ours"]["goodput"] == pytest.approx((1 - (10 + tau / 2) / 36000) / (1 + 0.02 / tau), abs=1e-5)
    # job restart: tau = sqrt(2*20*36000) = 1200 s; goodput = (1 - (600 + 600)/36000) / (1 + 20/1200)
    assert p["job_restart"]["goodput"] == pytest.approx((1 - 1200 / 36000) / (1 + 20 / 1200), abs=1e-5)
    # scratch: W = 3600 s, l = 1/36000: T = (e^0.1 - 1) * (36000 + 600) = 3849.3 s; goodput = 3600 / 3849.3
    assert p["restart_from_scratch"]["goodput"] == pytest.approx(3600 / (math.expm1(0.1) * 36600), abs=1e-5)
    assert p["ours"]["goodput"] > p["job_restart"]["goodput"] > p["restart_from_scratch"]["goodput"]


def test_projection_node_losses_recovered_from_a_peer_copy():
    """Half of the failures (rate 1/36,000 s) lose a node: 30 s to recover and, from the peer's copy of its
    2 s memory snapshots, 1 s redone on average; the other half need the checkpoint, whose Young-Daly interval
    is for their rate only."""
    kw = dict(ckpt_block_s=0.02, recovery_s=10.0, job_ckpt_block_s=20.0, job_recovery_s=600.0, job_hours=1.0,
              node_loss_share=0.5, node_recovery_s=30.0)
    p = project(1000, 1e-4, snapshot_every_s=2.0, **kw)
    tau = math.sqrt(2 * 0.02 * 72000)                                  # 53.67 s: MTBF 72,000 s of those needing it
    lost = 0.5 / 36000 * (10 + tau / 2) + 0.5 / 36000 * (30 + 1)
    assert p["ours"] == {"goodput": pytest.approx((1 - lost) / (1 + 0.02 / tau), abs=1e-5),
                         "interval_s": pytest.approx(tau, abs=0.05), "node_losses_from": "peer"}
    # Without peer copies a node loss goes back to the checkpoint, and the interval is for every failure.
    tau_all = math.sqrt(2 * 0.02 * 36000)
    lost_all = 0.5 / 36000 * (10 + tau_all / 2) + 0.5 / 36000 * (30 + tau_all / 2)
    assert p["ours_without_peer"]["goodput"] == pytest.approx((1 - lost_all) / (1 + 0.02 / tau_all), abs=1e-5)
    assert project(1000, 1e-4, snapshot_every_s=None, **kw)["ours"] == p["ours_without_peer"]
    assert p["ours"]["goodput"] > p["ours_without_peer"]["goodput"]
    # Every failure a node loss with peer copies: none needs a checkpoint.
    only = project(1000, 1e-4, snapshot_every_s=2.0, **{**kw, "node_loss_share": 1.0})["ours"]
    assert only["interval_s"] is None and only["goodput"] == pytest.approx(1 - 31 / 36000, abs=1e-5)
    for bad in (dict(node_loss_share=1.5), dict(snapshot_every_s=0.0)):
        with pytest.raises(ValueError):
            project(1000, 1e-4, **{**kw, "snapshot_every_s": 2.0, **bad})


def _ev(t, event, **kw):
    return {"t": t, "rank": kw.pop("rank", 0), "event": event, **kw}


def test_account_attributes_faults_redone_steps_and_time():
    events = [
        _ev(0.0, "run_start"),
        *[_ev(10.0 + s, "step", step=s, step_s=1.0) for s in range(1, 5)],          # steps 1-4 at t=11..14
        _ev(14.5, "ckpt_snapshot", step=4, block_s=0.25),
        _ev(15.2, "fault_injected", kind="kill", step=6, rank=1, fault="kill@6:1"),  # dies during step 5
        _ev(20.0, "run_start"), _ev(20.0, "restart", layer="injob"),
        *[_ev(22.0 + i, "step", step=s, step_s=1.0) for i, s in enumerate(range(5, 9))],  # 5-8 at t=22..25
    ]
    a = account(events)
    assert a["faults"] == [{"kind": "kill", "rank": 1, "step": 6, "detected_s": 4.8, "recovered_s": 6.8,
                            "layer": "injob"}]
    assert (a["restarts_injob"], a["restarts_inprocess"], a["lost_steps"]) == (1, 0, 0)
    b = a["goodput_breakdown"]
    assert b["productive_s"] == 8.0 and b["wall_s"] == 25.0 and b["startup_s"] == 10.0
    assert b["restart_s"] == pytest.approx(21.0 - 15.2)          # fault -> start of the first step after
    assert a["goodput"] == round(8 / 25, 4)
    redo = account(events + [_ev(26.0, "step", step=8, step_s=1.0)])
    assert redo["lost_steps"] == 1 and redo["goodput_breakdown"]["redone_s"] == 1.0


def test_interval_policy_by_steps_and_auto(tmp_path):
    fixed = IntervalPolicy(5, tmp_path / "events.jsonl")
    assert [s for s in range(1, 21) if fixed.due(s, 20)] == [5, 10, 15]       # the final one is the teardown's
    auto = IntervalPolicy(AUTO, tmp_path / "events.jsonl", mtbf_s=5000.0)
    assert [s for s in range(1, 12) if auto.due(s, 100)] == [10]              # first save measures the cost
    for _ in range(5):
        auto.observe_step(0.1)
    auto.observe_checkpoint(0.9)        # first save: staging allocation, ignored once there is a second
    auto.observe_checkpoint(0.4)
    # sqrt(2 * 0.4 * 5000) = 63.2 s / 0.1 s per step = 632 steps
    assert auto.every == 632
    # While a rank's previous write runs, an auto save is postponed (it would block on the writer); a fixed
    # interval is kept exactly.
    assert not auto.due(10 + 632, 10_000, writers_busy=True) and auto.due(10 + 633, 10_000)
    assert fixed.due(5, 20, writers_busy=True)


def test_memory_snapshots_are_spaced_by_time_and_by_their_own_cost(tmp_path, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("trainer.checkpoint.policy.time.monotonic", lambda: clock[0])
    policy = IntervalPolicy(50, tmp_path / "events.jsonl", memory_every_s=2.0)
    clock[0] += 1.0
    assert not policy.memory_due(1, 100, copy_s=0.01)                # 1 s < 2 s
    clock[0] += 1.5
    assert policy.memory_due(2, 100, copy_s=0.01) and not policy.memory_due(3, 100, copy_s=0.01)
    clock[0] += 2.5
    assert not policy.memory_due(4, 100, copy_s=0.2)                 # a 0.2 s copy: at least 4 s apart
    clock[0] += 2.0
    assert policy.memory_due(5, 100, copy_s=0.2)
    policy.observe_checkpoint(0.01)                                   # a save's snapshot resets the clock
    clock[0] += 2.5
    assert not policy.memory_due(6, 100, copy_s=0.2) and not policy.memory_due(100, 100, copy_s=0.0)
    off = IntervalPolicy(50, tmp_path / "events.jsonl", memory_every_s=0.0)
    clock[0] += 100
    assert not off.memory_due(7, 100, copy_s=0.0)


def test_auto_interval_counts_what_background_writes_take_from_training(tmp_path):
    auto = IntervalPolicy(AUTO, tmp_path / "events.jsonl", mtbf_s=5000.0)
    for _ in range(10):
        auto.observe_step(0.1)
    auto.observe_checkpoint(0.4)
    assert auto.every == 632                           # quiet steps only: the cost is the blocking time
    for i in range(20):                                # two checkpoints' writes, each slowing 10 steps by 0.05 s
        auto.observe_step(0.15, writing=True)
        if i % 10 == 9:
            auto.observe_checkpoint(0.4)
    # cost = 0.4 s + 0.05 s x 20 steps / 3 checkpoints = 0.733 s; sqrt(2 x 0.733 x 5000) = 85.6 s; the median
    # step is 0.15 s (20 of the 30 steps seen) -> 571 steps
    assert auto.write_interference_s() == pytest.approx(0.05 * 20 / 3)
    assert auto.every == 571


def test_write_interference_is_the_mean_extra_time_so_a_few_slow_steps_count(tmp_path):
    auto = IntervalPolicy(AUTO, tmp_path / "events.jsonl", mtbf_s=5000.0)
    for _ in range(10):
        auto.observe_step(0.1)
    auto.observe_checkpoint(0.4)
    for i in range(20):                  # two writes; each left 9 of its 10 steps alone and slowed one by 0.5 s
        auto.observe_step(0.6 if i % 10 == 0 else 0.1, writing=True)
        if i % 10 == 9:
            auto.observe_checkpoint(0.4)
    # the median step alongside a write is 0.1 s, as without one; the mean is 0.15 s: 1 s over 3 checkpoints
    assert auto.write_interference_s() == pytest.approx(0.05 * 20 / 3)


def test_the_interval_is_for_the_failures_that_need_a_checkpoint(tmp_path):
    """Observed MTBF: only restarts that loaded a committed checkpoint count; one that resumed from a copy
    in memory (its own node's, or a replacement node's from the peer's copy) lost at most the memory-snapshot
    interval, whatever the checkpoint interval. (Real runs: the test below.)"""
    path = tmp_path / "events.jsonl"

    def policy_after(*events):
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        return IntervalPolicy(AUTO, path).mtbf_s()

    start = [_ev(0.0, "run_start"), _ev(1.0, "fresh_start", step=0, source="checkpoint")]
    from_memory = [_ev(100.0, "restart", layer="injob"), _ev(101.0, "resumed", step=900, source="memory"),
                   _ev(200.0, "restart", layer="inprocess"), _ev(200.5, "resumed", step=1900, source="memory"),
                   _ev(250.0, "run_start"), _ev(250.0, "restart", layer="injob"),     # a node lost and replaced
                   _ev(251.0, "resumed", step=2400, source="peer")]
    assert policy_after(*start, *from_memory, _ev(300.0, "step", step=2900)) == DEFAULT_MTBF_S
    from_disk = [_ev(400.0, "run_start"), _ev(401.0, "restart", layer="job"),
                 _ev(402.0, "resumed", step=2500, source="checkpoint")]
    assert policy_after(*start, *from_memory, *from_disk, _ev(600.0, "step", step=4500)) == 600.0
    assert IntervalPolicy(AUTO, path, mtbf_s=50.0).mtbf_s() == 50.0


@pytest.mark.parametrize("lost", ["rank", "node"])
def test_the_interval_learns_from_a_real_runs_restarts(tmp_path, start_run, lost):
    """Once a checkpoint is committed, a rank is killed (its launcher restarts it from the node's memory: no
    failure a checkpoint is for, the default MTBF stays) or the node is lost (every process and its memory
    snapshots; the job started again resumes from the checkpoint: one failure in the run so far)."""
    shm = tmp_path / "shm"
    args = ["--max-steps", "100000", "--ckpt-every", "4", "--restart-layers", "injob", "--memory-snapshot-dir",
            str(shm), "--memory-snapshot-every-s", "0.001"]
    launch = dict(max_restarts=1, step_timeout_s=4.0, workload_check_interval_s=0.5)
    run = start_run(tmp_path / "run", *args, **launch)
    run.wait_for(lambda e: e["event"] == "ckpt_committed", timeout=180, what="a committed checkpoint")
    if lost == "rank":
        os.kill(run.worker_pid(1), signal.SIGKILL)
    else:
        run.kill()
        # The node's memory goes with it (its janitor may still be removing the snapshots it knew of).
        assert until(lambda: shutil.rmtree(shm, ignore_errors=True) or not shm.exists(), 30)
        run = start_run(tmp_path / "run", *args, **launch)
    resumed = run.wait_for(lambda e: e["event"] == "resumed", timeout=180, what="the restart")
    assert resumed["source"] == ("memory" if lost == "rank" else "checkpoint")
    # One copy of the log for both: the run goes on appending, and the MTBF runs to its last event.
    log = tmp_path / "events-now.jsonl"
    shutil.copyfile(run.out / "events.jsonl", log)
    events = read_events(log)
    mtbf = IntervalPolicy(AUTO, log).mtbf_s()
    t0 = next(e["t"] for e in events if e["event"] == "run_start")
    assert mtbf == (DEFAULT_MTBF_S if lost == "rank" else pytest.approx(events[-1]["t"] - t0))


def test_after_a_restart_auto_goes_on_with_the_interval_it_chose(tmp_path):
    path = tmp_path / "events.jsonl"
    first = IntervalPolicy(AUTO, path, mtbf_s=5000.0, events=EventLog(path, rank=0))
    for _ in range(5):
        first.observe_step(0.1)
    first.observe_checkpoint(0.4)                                   # sqrt(2 x 0.4 x 5000) / 0.1 = 632 steps
    [chosen] = [e for e in read_events(path) if e["event"] == "ckpt_interval"]
    assert chosen["steps"] == 632 and chosen["block_s"] == 0.4 and chosen["mtbf_s"] == 5000.0
    # A restarted rank 0 at step 700: no save after 10 steps to measure the cost again.
    again = IntervalPolicy(AUTO, path, mtbf_s=5000.0, start_step=700)
    assert [s for s in range(701, 1400) if again.due(s, 10_000)] == [1332]


def test_fault_specs_and_chaos_schedule():
    assert Fault.parse("kill@12:1") == Fault("kill", 12, 1)
    assert Fault.parse("hang@3").rank == 0
    for bad in ("kill", "kill@x", "nap@3", "kill@3:r"):
        with pytest.raises(ValueError):
            Fault.parse(bad)
    a = chaos_schedule(7, 60.0, 4, horizon_s=3600)
    assert a == chaos_schedule(7, 60.0, 4, horizon_s=3600) != chaos_schedule(8, 60.0, 4, horizon_s=3600)
    assert 30 < len(a) < 100 and all(0 <= r < 4 for _, _, r in a)              # ~60 expected in an hour
    assert {k for _, k, _ in a} == {"exception", "kill", "hang"}


def _events_file(path, *lines: str):
    path.write_bytes("".join(lines).encode())
    return path


def test_the_events_reader_skips_a_torn_last_line_only(tmp_path):
    good = [json.dumps({"t": float(i), "rank": 0, "event": "step", "step": i}) + "\n" for i in (1, 2)]
    path = _events_file(tmp_path / "events.jsonl", *good, '{"t": 3.0, "rank": 0, "ev')
    assert [e["step"] for e in read_events(path)] == [1, 2]
    # A last line cut inside a multi-byte character is torn too.
    path.write_bytes("".join(good).encode() + '{"t": 3.0, "note": "é'.encode()[:-1])
    assert [e["step"] for e in read_events(path)] == [1, 2]
    for bad in ('{"t": 1.5, "rank": 0, "ev\n', "not json\n", "[1, 2]\n", '{"t": 1.5}\n', "\n"):
        _events_file(path, good[0], bad, good[1])
        with pytest.raises(EventLogError, match=rf"^{path}:2: not an event"):
            read_events(path)
    assert read_events(tmp_path / "none.jsonl") == []


def test_a_torn_line_is_sealed_by_the_next_writer_and_then_skipped(tmp_path):
    path = _events_file(tmp_path / "events.jsonl", json.dumps({"t": 1.0, "rank": 0, "event": "run_start"}) + "\n",
                        '{"t": 2.0, "rank": 1, "event": "st')           # the writer died mid-line
    # The next attempt's ranks open the log; the first seals the line, the second finds it sealed.
    logs = [EventLog(path, rank=r) for r in (0, 1)]
    for log in logs:
        log.emit(Event.RUN_START, world_size=2, restart_count=0, run_id="r", agent_attempts={}, agent_restart_counts={})
        log.close()
    events = read_events(path)
    assert [e["event"] for e in events] == ["run_start", Event.TORN_LINE, "run_start", "run_start"]
    assert path.read_bytes().count(b"\n") == 5
    # The summary (its goodput accounting included) takes the seal as an event like any other.
    assert summarize(events, steps=0, tokens=0, final_val_loss=0.0, params_sha256="", n_params=0)["restarts"] == 2
    # The run's metrics read the log in pieces, cut anywhere: the same events, and a malformed line still fails.
    data = path.read_bytes()
    for cut in range(len(data) + 1):
        collector = RunCollector(path, refresh_s=0)
        parts = tmp_path / "parts.jsonl"
        parts.write_bytes(data[:cut])
        collector.events_path = parts
        collector._read_new()
        parts.write_bytes(data)
        collector._read_new()
        assert collector._events == events, cut
    lines = data.split(b"\n")
    (tmp_path / "bad.jsonl").write_bytes(b"\n".join(lines[:1] + [b"oops"] + lines[1:]))
    with pytest.raises(EventLogError, match=r"bad.jsonl:2: not an event"):
        RunCollector(tmp_path / "bad.jsonl", refresh_s=0)._read_new()
