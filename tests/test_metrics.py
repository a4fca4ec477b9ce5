"""The trainer's Prometheus endpoint and the data-starvation warning.

One real 2-rank run is scraped twice while it trains (the series must move); the rest drive the same
``MetricsExporter`` in this process over real HTTP on loopback.
"""

from __future__ import annotations

import logging
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainer.config import MetricsConfig
from trainer.data import BatchSampler, Split
from trainer.events import Event, EventLog, read_events
from trainer.goodput import account
from trainer.metrics import PROCESS_SERIES, RUN_SERIES, DataWaitMonitor, MetricsExporter


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (rank r serves on first + r)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", first + i))
            return first
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no run of free ports")


def scrape(port: int) -> dict[tuple, float]:
    """``{(sample name, sorted labels): value}`` from ``/metrics``, parsed by prometheus-client's parser."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def scrape_until(port: int, predicate, run=None, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = scrape(port)
            if predicate(last):
                return last
        except (urllib.error.URLError, ConnectionError, KeyError):
            pass
        if run is not None and run.proc.poll() is not None:
            raise AssertionError(f"run exited ({run.proc.returncode}) first; log:\n{run.tail()}")
        time.sleep(0.5)
    raise AssertionError(f"timed out; last scrape: {last}" + (f"\nlog:\n{run.tail()}" if run else ""))


# A real run -----------------------------------------------------------------------------------------

def test_metrics_of_a_real_training_run_move_while_it_trains(tmp_path, start_run):
    port = free_ports(2)
    # A tiny warning threshold: every window of this run counts as starved, which proves the batch timer is
    # wired into the real loop (the threshold logic itself is tested below with hand-made numbers).
    # Synchronous checkpoints commit at once, so the second scrape need not wait for background writers.
    # Enough steps that the run is still going when the second scrape's condition is met.
    run = start_run(tmp_path / "run", "--max-steps", "60", "--ckpt-every", "5", "--ckpt-sync",
                    "--metrics-port", str(port),
                    "--metrics-addr", "127.0.0.1", "--metrics-refresh-s", "0", "--data-wait-window", "5",
                    "--data-wait-warn", "0.000001",
                    # No in-process Wrapper: its store binds MASTER_PORT+1 unchecked, and a busy machine's
                    # TIME_WAIT sockets (this test's scrapes among them) can hold that port.
                    "--restart-layers", "injob")
    first = scrape_until(port, lambda s: value(s, "goodput_step") >= 2, run)
    # Later: the loop has moved on and a checkpoint has been committed.
    second = scrape_until(port, lambda s: value(s, "goodput_step") >= value(first, "goodput_step") + 3
                          and value(s, "goodput_last_committed_step") >= 5, run)

    for name in ("goodput_step", "goodput_steps_total", "goodput_step_seconds_count", "goodput_step_seconds_sum",
                 "goodput_data_wait_seconds_total"):
        assert value(second, name) > value(first, name) > 0, name
    assert value(second, "goodput_step_last_seconds") > 0 and value(second, "goodput_tokens_per_second") > 0
    # Histogram buckets are cumulative and end in +Inf = count.
    assert value(second, "goodput_step_seconds_bucket", le="+Inf") == value(second, "goodput_step_seconds_count")
    # Checkpoints at steps 5, 10, ...: blocking time observed, the commit seen in the event log.
    assert value(second, "goodput_checkpoint_blocking_seconds_count") >= 1
    assert value(second, "goodput_checkpoint_blocking_last_seconds") > 0
    assert value(second, "goodput_last_committed_step") % 5 == 0
    assert 0 < value(second, "goodput_ratio") <= 1
    assert {value(second, "goodput_restarts", layer=layer) for layer in ("inprocess", "injob", "job")} == {0}
    assert value(second, "goodput_data_starved_windows_total") >= 1
    assert 0 < value(second, "goodput_data_wait_ratio") < 1
    assert value(second, "goodput_rank_info", rank="0", local_rank="0", world_size="2") == 1

    # Rank 1 serves on the next port: its own step series, and no run-wide ones (rank 0 owns those).
    other = scrape(port + 1)
    assert value(other, "goodput_rank_info", rank="1", local_rank="1", world_size="2") == 1
    assert value(other, "goodput_step") >= 1
    assert not any(name.startswith(RUN_SERIES) for name, _ in other)

    assert run.wait() == 0, run.tail()
    assert "data loading starves the step" in run.log.read_text()
    starved = [e for e in run.events() if e["event"] == "data_starved"]
    assert {e["rank"] for e in starved} == {0, 1} and all(e["window_steps"] == 5 for e in starved)


# The same exporter in this process ------------------------------------------------------------------

def test_data_wait_monitor_warns_once_per_starved_window():
    m = DataWaitMonitor(window=4, warn_ratio=0.5)
    # Window 1: 4 steps of 1.0 s with 0.6 s waiting each -> 2.4 / 4.0 = 0.6 >= 0.5: starved, reported once,
    # on the step that closes the window.
    assert [m.observe(1.0, 0.6) for _ in range(4)] == [None, None, None, pytest.approx(0.6)]
    # Window 2: 0.1 s of 1.0 s -> 0.1: fine, but the ratio is still recorded.
    assert [m.observe(1.0, 0.1) for _ in range(4)] == [None] * 4
    assert m.last_ratio == pytest.approx(0.1)
    # Window 3: one long stall of 3.0 s in 1.0 + 1.0 + 1.0 + 4.0 = 7.0 s -> 3/7 = 0.43 < 0.5: not starved.
    assert [m.observe(s, w) for s, w in ((1.0, 0.0), (1.0, 0.0), (1.0, 0.0), (4.0, 3.0))] == [None] * 4
    assert m.starved_windows == 1
    # Off: never warns, whatever the ratio.
    off = DataWaitMonitor(window=1, warn_ratio=0.0)
    assert off.observe(1.0, 1.0) is None and off.last_ratio == 1.0


class SlowSplit:
    """A real dataset split whose reads cost ``delay_s``: a data loader that cannot keep up."""

    def __init__(self, split: Split, delay_s: float):
        self.split, self.delay_s = split, delay_s

    @property
    def tokens(self):
        time.sleep(self.delay_s)
        return self.split.tokens

    def __len__(self):
        return len(self.split)


def test_slow_batches_are_measured_warned_about_and_counted(dataset, tmp_path, caplog):
    port = free_ports(1)
    events = EventLog(tmp_path / "events.jsonl", rank=0)
    cfg = MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1", data_wait_window=3, data_wait_warn=0.5)
    exporter = MetricsExporter(cfg, rank=3, local_rank=0, world_size=4, events=events)
    try:
        # 4 sequences per batch, each read costs 0.02 s -> at least 0.08 s waiting per batch.
        sampler = BatchSampler(SlowSplit(Split.open(dataset, "train"), 0.02), rank=0, world_size=1, batch_size=4,
                               seq_len=32, seed=0)
        with caplog.at_level(logging.WARNING, logger="trainer"):
            for step in range(1, 7):
                t0 = time.perf_counter()
                x, y = sampler.next_batch()       # as the trainer's step measures its wait for batches
                wait_s = time.perf_counter() - t0
                assert x.shape == (4, 32)
                time.sleep(0.002)                 # "compute": far shorter than the wait
                exporter.observe_step(step, time.perf_counter() - t0, tokens_per_step=128, data_wait_s=wait_s)
        s = scrape(port)
    finally:
        exporter.close()
        events.close()
    warnings = [r for r in caplog.records if "data loading starves the step" in r.getMessage()]
    assert len(warnings) == 2                  # once per window (steps 3 and 6), not once per step
    assert value(s, "goodput_data_starved_windows_total") == 2
    assert value(s, "goodput_data_wait_ratio") >= 0.5
    assert value(s, "goodput_data_wait_seconds_total") >= 6 * 0.08
    assert value(s, "goodput_steps_total") == 6 and value(s, "goodput_step") == 6
    assert [e["step"] for e in read_events(tmp_path / "events.jsonl") if e["event"] == "data_starved"] == [3, 6]
    with pytest.raises(urllib.error.URLError):
        scrape(port)                           # closed with the exporter


def test_run_wide_series_follow_the_event_log_across_restarts(tmp_path):
    path = tmp_path / "events.jsonl"
    log0, log1 = EventLog(path, 0), EventLog(path, 1)
    log0.emit(Event.RUN_START, world_size=2, restart_count=0, run_id="r", agent_attempts={}, agent_restart_counts={})
    for step in (1, 2, 3):
        log0.emit(Event.STEP, step=step, loss=1.0, step_s=0.1, lr=1e-3, tokens=step * 64, tokens_per_s=640.0)
    log0.emit(Event.CKPT_COMMITTED, step=2, commit_s=0.1)
    log1.emit(Event.FAULT_INJECTED, fault="f1", kind="exception", step=3)
    log0.emit(Event.RESTART, layer="inprocess", iteration=1)
    log0.emit(Event.STEP, step=3, loss=1.0, step_s=0.1, lr=1e-3, tokens=192, tokens_per_s=640.0)
    port = free_ports(1)
    cfg = MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1", run_refresh_s=0.0)
    exporter = MetricsExporter(cfg, rank=0, local_rank=0, world_size=2, events_path=path)
    try:
        s = scrape(port)
        acc = account(read_events(path))
        assert value(s, "goodput_ratio") == pytest.approx(acc["goodput"])
        assert value(s, "goodput_restarts", layer="inprocess") == 1 == acc["restarts_inprocess"]
        assert value(s, "goodput_restarts", layer="injob") == 0
        assert value(s, "goodput_lost_steps") == 1 == acc["lost_steps"]      # step 3 was computed twice
        assert value(s, "goodput_last_committed_step") == 2

        # A new attempt appends; half a line (a writer caught mid-write) is not read until it is whole.
        log0.emit(Event.RUN_START, world_size=2, restart_count=1, run_id="r", agent_attempts={},
                  agent_restart_counts={})
        log0.emit(Event.RESTART, layer="injob", restart_count=1)
        with open(path, "ab") as fh:
            fh.write(b'{"t": 1e10, "rank": 0, "event": "ckpt_committed", "st')
        s = scrape(port)
        assert value(s, "goodput_restarts", layer="injob") == 1
        assert value(s, "goodput_last_committed_step") == 2
        with open(path, "ab") as fh:
            fh.write(b'ep": 4, "commit_s": 0.1}\n')
        assert value(scrape(port), "goodput_last_committed_step") == 4
    finally:
        exporter.close()
        log0.close()
        log1.close()


def test_a_taken_port_costs_the_endpoint_not_the_run(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="trainer"):
            exporter = MetricsExporter(MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1"), rank=0,
                                       local_rank=0, world_size=1)
        assert not exporter.enabled
        exporter.observe_step(1, 0.1, 100)     # still safe to call
        exporter.observe_checkpoint(0.01)
        exporter.close()
    assert any("not started" in r.getMessage() for r in caplog.records)


def test_off_by_default_and_series_names_are_what_the_module_declares(tmp_path):
    off = MetricsExporter(MetricsConfig(), rank=0, local_rank=0, world_size=1)
    assert not off.enabled and off.port is None
    port = free_ports(1)
    on = MetricsExporter(MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1"), rank=0, local_rank=0,
                         world_size=1, events_path=tmp_path / "events.jsonl")
    try:
        on.observe_step(1, 0.2, 100)
        # No device peak (CPU): no MFU series at all, rather than a 0 a dashboard would average in.
        assert not any(name == "goodput_mfu_ratio" for name, _ in scrape(port))
        on.observe_step(2, 0.2, 100, mfu=0.41)
        on.observe_checkpoint(0.05)
        samples = scrape(port)
        names = {name for name, _ in samples}
    finally:
        on.close()
    assert value(samples, "goodput_mfu_ratio") == pytest.approx(0.41)
    families = {n.removesuffix(sfx) for n in names for sfx in ("_bucket", "_count", "_sum", "_created", "")
                if n.endswith(sfx)}
    missing = [n for n in PROCESS_SERIES if n not in families | names]
    assert not missing, missing


def test_metrics_flags_are_validated():
    from trainer.config import parse_config

    for bad in (["--metrics-port", "70000"], ["--data-wait-warn", "1.5"], ["--data-wait-window", "0"]):
        with pytest.raises(ValueError, match="metrics-port|data-wait"):
            parse_config(["--data", str(Path("x")), *bad])


def _child_reports(exporter, conn, go):
    conn.send(exporter.enabled)
    go.wait(30)                                # stay alive while the parent checks the port


def test_a_forked_child_does_not_keep_the_port():
    """NVRx forks a monitor process from each rank: it must not inherit the endpoint's listening socket, or
    the port stays taken after the rank dies and its restarted successor cannot serve metrics."""
    import multiprocessing

    port = free_ports(1)
    exporter = MetricsExporter(MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1"), rank=0, local_rank=0,
                               world_size=1)
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    go = ctx.Event()
    child = ctx.Process(target=_child_reports, args=(exporter, child_end, go))
    child.start()
    try:
        assert parent_end.recv() is False       # the child's copy of the exporter serves nothing
        assert value(scrape(port), "goodput_rank_info", rank="0", local_rank="0", world_size="1") == 1
        exporter.close()
        with socket.socket() as s:              # free again although the child still lives
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen()
        assert child.is_alive()
    finally:
        go.set()
        child.join(10)
        exporter.close()
