"""Straggler detection: what CPU can check. NVRx's ``Detector`` needs CUDA and CUPTI, so here: the hook is
off with a clear reason, and what rank 0 makes of NVRx's own ``Report`` (the ``straggler`` event, the
scores in the metrics). ``bench/gpu_check.py --runs straggler`` checks a slowed GPU on a GPU node."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.test_metrics import free_ports, scrape, value
from trainer import compat, straggler
from trainer.config import MetricsConfig
from trainer.events import EventLog, read_events
from trainer.metrics import STRAGGLER_SERIES, MetricsExporter
from trainer.parallel import Dist

NVRX = compat.import_straggler(compat.installed_release())


def _report(relative: dict, individual: dict, nodes: dict):
    """A gathered report as rank 0 gets it from ``Detector.generate_report`` (NVRx's own class)."""
    return NVRX.Report(gpu_relative_perf_scores=relative, section_relative_perf_scores={},
                       gpu_individual_perf_scores=individual, section_individual_perf_scores={},
                       rank_to_node=nodes, local_section_summaries={}, local_kernel_summaries={},
                       generate_report_elapsed_time=0.01, gather_on_rank0=True, rank=None)


@pytest.fixture
def off_log(caplog):
    straggler._say_off.cache_clear()     # "once per process": this test's process has said nothing yet
    caplog.set_level(logging.WARNING, logger="trainer")
    return lambda: [r.getMessage() for r in caplog.records if "straggler detection" in r.getMessage()]


def test_off_on_cpu_ranks_saying_why_once(tmp_path, off_log):
    cfg, events = MetricsConfig(straggler_report_s=5.0), EventLog(tmp_path / "e", 0)
    metrics = MetricsExporter(MetricsConfig(), rank=0, local_rank=0, world_size=2)
    for rank in (0, 1):
        for _attempt in range(2):
            assert straggler.straggler_hooks(cfg, None, Dist(rank, 2, rank, torch.device("cpu")), events,
                                             metrics) == []
    said = off_log()
    assert said == ["straggler detection (--straggler-report-s) is off: it times CUDA kernels and this rank "
                    "runs on cpu"]
    # Not asked for: off without a word.
    straggler._say_off.cache_clear()
    assert straggler.straggler_hooks(MetricsConfig(), None, Dist(0, 1, 0, torch.device("cuda")), events,
                                     metrics) == []
    assert off_log() == said


def test_off_where_nvrx_cannot_start_its_detector(tmp_path, off_log):
    """A CUDA rank in an image without CUPTI: NVRx's real ``Detector.initialize`` fails (here: no
    libcupti at all), and the trainer goes on without it, saying so."""
    events = EventLog(tmp_path / "e", 0)
    metrics = MetricsExporter(MetricsConfig(), rank=0, local_rank=0, world_size=1)
    hooks = straggler.straggler_hooks(MetricsConfig(straggler_report_s=5.0), object(),
                                      Dist(0, 1, 0, torch.device("cuda")), events, metrics)
    assert hooks == [] and not NVRX.Detector.initialized
    (said,) = off_log()
    assert "NVRx's Detector could not start (ImportError: " in said and "cupti" in said


def test_a_report_becomes_a_straggler_event_and_per_rank_gauges(tmp_path):
    port = free_ports(1)
    metrics = MetricsExporter(MetricsConfig(metrics_port=port, metrics_addr="127.0.0.1"), rank=0, local_rank=0,
                              world_size=4)
    events = EventLog(tmp_path / "events.jsonl", 0)
    nodes = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}
    try:
        # Rank 2 is half as fast as the fastest; rank 3 slowed down against its own past.
        record = straggler.record_stragglers(
            _report({0: 1.0, 1: 0.97, 2: 0.5, 3: 0.9}, {0: 0.99, 1: 0.98, 2: 0.95, 3: 0.6}, nodes), 40, events,
            metrics)
        samples = scrape(port)
        # The next report: everyone healthy again. The gauges follow; no event.
        straggler.record_stragglers(_report({r: 1.0 for r in nodes}, {r: 1.0 for r in nodes}, nodes), 80, events,
                                    metrics)
        healthy = scrape(port)
    finally:
        metrics.close()
    assert record["ranks"] == [2, 3] and record["nodes"] == ["node-b"]
    assert record["relative"] == [{"rank": 2, "node": "node-b", "score": 0.5}]
    assert record["individual"] == [{"rank": 3, "node": "node-b", "score": 0.6}]
    (event,) = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "straggler"]
    assert event["step"] == 40 and event["ranks"] == [2, 3] and event["nodes"] == ["node-b"]
    assert event["scores"]["relative"] == {"0": 1.0, "1": 0.97, "2": 0.5, "3": 0.9}
    assert event["individual"] == record["individual"]
    (series,) = STRAGGLER_SERIES
    assert value(samples, series, rank="2", kind="relative") == 0.5
    assert value(samples, series, rank="3", kind="individual") == 0.6
    assert value(samples, series, rank="0", kind="relative") == 1.0
    assert value(healthy, series, rank="2", kind="relative") == 1.0


def test_the_report_interval_is_validated():
    from trainer.config import parse_config

    with pytest.raises(ValueError, match="--straggler-report-s must be 0"):
        parse_config(["--data", "x", "--straggler-report-s", "-1"])
    assert parse_config(["--data", "x", "--straggler-report-s", "30"]).metrics.straggler_report_s == 30.0
