"""Prometheus metrics of every training process, and the data-starvation warning.

Each rank serves ``http://<addr>:<--metrics-port + LOCAL_RANK>/metrics`` (prometheus-client, a daemon
thread), so the eight ranks of a p5 pod answer on eight ports; the PyTorchJob builder declares them as
container ports ``metrics-<local rank>`` and ``deploy/observability/podmonitor.yaml`` scrapes them::

    goodput train --nproc 2 --max-steps 300 --metrics-port 9500     # then: curl 127.0.0.1:9500/metrics

Per process (every rank): ``goodput_step`` (last completed optimizer step), ``goodput_steps_total``,
``goodput_step_seconds`` (histogram) and ``goodput_step_last_seconds``, ``goodput_tokens_per_second`` (the
job's, from this rank's step time), ``goodput_mfu_ratio`` (model FLOPs utilisation of this rank's device over
the last step; absent on CPU and GPUs of unknown peak), ``goodput_checkpoint_blocking_seconds`` (histogram) and
``..._last_seconds``, ``goodput_data_wait_seconds_total``, ``goodput_data_wait_ratio`` and
``goodput_data_starved_windows_total``; on global rank 0 with straggler detection (GPU,
``trainer.straggler``): ``goodput_straggler_score{rank,kind}`` (each rank's NVRx GPU score at the last
report, 0..1, ``kind`` relative or individual). Per run (global rank 0, from ``events.jsonl`` at scrape time, so the
numbers span every attempt and survive restarts of the process): ``goodput_ratio`` (productive step time /
wall time so far, ``trainer.goodput.account``), ``goodput_restarts{layer}``, ``goodput_lost_steps``,
``goodput_last_committed_step``, ``goodput_integrity_refusals{kind}`` (copies of the state that failed their
checksums, peer messages refused) and, with an S3 mirror, ``goodput_mirror_errors{phase}`` (its failures so far:
client, thread, upload, retention, download; ``trainer.mirror``).

Data starvation (the seed lesson: GPU utilisation swinging between 100% and 5%): the loop's batch source
is timed; when waiting for batches takes ``--data-wait-warn`` or more of the step time over a window of
``--data-wait-window`` steps, the rank logs one warning for that window, emits a ``data_starved`` event and
counts it. This works with the endpoint off too.

prometheus-client is imported only when the endpoint is on; the hot path adds two clock reads per batch and
a few float updates per step.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from pathlib import Path

from .config import MetricsConfig
from .events import Event
from .hooks import StepHook, StepReport

log = logging.getLogger("trainer")

STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CKPT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
RESTART_LAYERS = ("inprocess", "injob", "job")

# Names of every series this module exports (the Grafana dashboard test checks its queries against them).
PROCESS_SERIES = ("goodput_step", "goodput_steps_total", "goodput_step_seconds", "goodput_step_last_seconds",
                  "goodput_tokens_per_second", "goodput_mfu_ratio", "goodput_checkpoint_blocking_seconds",
                  "goodput_checkpoint_blocking_last_seconds", "goodput_data_wait_seconds_total",
                  "goodput_data_wait_ratio", "goodput_data_starved_windows_total", "goodput_rank_info")
STRAGGLER_SERIES = ("goodput_straggler_score",)   # rank 0, once a straggler report came (GPU only)
RUN_SERIES = ("goodput_ratio", "goodput_restarts", "goodput_lost_steps", "goodput_last_committed_step",
              "goodput_integrity_refusals", "goodput_mirror_errors")
# Events of copies of the state or peer messages that were refused (trainer.checkpoint.integrity, trainer.peer).
INTEGRITY_EVENTS = (Event.CHECKSUM_MISMATCH, Event.PEER_REFUSED)


class DataWaitMonitor:
    """Share of step time spent waiting for batches, per window of ``window`` steps.

    ``observe`` returns the window's ratio when a window closes with at least ``warn_ratio`` of its time spent
    waiting (the caller warns once for it), else None. ``warn_ratio`` 0 turns the warning off.
    """

    def __init__(self, window: int, warn_ratio: float):
        self.window, self.warn_ratio = window, warn_ratio
        self.steps, self.wait_s, self.step_s = 0, 0.0, 0.0
        self.last_ratio: float | None = None
        self.starved_windows = 0

    def observe(self, step_s: float, wait_s: float) -> float | None:
        self.steps += 1
        self.wait_s += wait_s
        self.step_s += step_s
        if self.steps < self.window:
            return None
        ratio = min(1.0, self.wait_s / self.step_s) if self.step_s > 0 else 0.0
        self.steps, self.wait_s, self.step_s = 0, 0.0, 0.0
        self.last_ratio = ratio
        if self.warn_ratio > 0 and ratio >= self.warn_ratio:
            self.starved_windows += 1
            return ratio
        return None


class RunCollector:
    """Run-wide numbers from ``events.jsonl`` at scrape time (global rank 0 only), read incrementally and
    recomputed at most every ``refresh_s`` seconds, so a scrape never parses the whole log twice in a row."""

    def __init__(self, events_path: Path, refresh_s: float = 10.0):
        self.events_path, self.refresh_s = Path(events_path), refresh_s
        self._events: list[dict] = []
        self._offset = 0
        self._partial = b""
        self._line = 1                       # line number of the first line of _partial
        self._at = -float("inf")
        self._values: dict = {}

    def _read_new(self) -> None:
        from .events import parse_lines

        try:
            with open(self.events_path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, tail = (self._partial + data).split(b"\n")
        events, used = parse_lines(lines, self.events_path, self._line)
        self._events += events
        self._line += used
        # Left for the next read: an unfinished last line, or a malformed one whose seal may follow.
        self._partial = b"".join(line + b"\n" for line in lines[used:]) + tail

    def values(self) -> dict:
        if time.monotonic() - self._at < self.refresh_s:
            return self._values
        from .goodput import account
        from .mirror import mirror_stats

        self._read_new()
        acc = account(self._events)
        committed = [e["step"] for e in self._events if e.get("event") == Event.CKPT_COMMITTED]
        self._values = {} if not acc else {
            "goodput_ratio": acc["goodput"],
            "goodput_restarts": {layer: acc[f"restarts_{layer}"] for layer in RESTART_LAYERS},
            "goodput_lost_steps": acc["lost_steps"],
            "goodput_last_committed_step": max(committed) if committed else -1,
            "goodput_integrity_refusals": {kind: sum(e.get("event") == kind for e in self._events)
                                           for kind in INTEGRITY_EVENTS},
        }
        mirror = mirror_stats(self._events)
        if self._values and mirror is not None:
            self._values["goodput_mirror_errors"] = mirror["errors_by_phase"]
        self._at = time.monotonic()
        return self._values

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        v = self.values()
        if not v:
            return
        yield GaugeMetricFamily("goodput_ratio", "productive step time / wall time of the run so far (all "
                                "attempts, from events.jsonl)", value=v["goodput_ratio"])
        restarts = GaugeMetricFamily("goodput_restarts", "restarts of the run so far, by recovery layer",
                                     labels=["layer"])
        for layer, n in v["goodput_restarts"].items():
            restarts.add_metric([layer], n)
        yield restarts
        yield GaugeMetricFamily("goodput_lost_steps", "steps computed twice because of restarts",
                                value=v["goodput_lost_steps"])
        yield GaugeMetricFamily("goodput_last_committed_step", "step of the newest committed checkpoint "
                                "(-1 = none yet)", value=v["goodput_last_committed_step"])
        refusals = GaugeMetricFamily("goodput_integrity_refusals", "copies of the state that failed their "
                                     "checksums (checksum_mismatch) and peer messages refused (peer_refused), so far",
                                     labels=["kind"])
        for kind, n in v["goodput_integrity_refusals"].items():
            refusals.add_metric([kind], n)
        yield refusals
        if "goodput_mirror_errors" in v:
            from .mirror import ERROR_PHASES

            errors = GaugeMetricFamily("goodput_mirror_errors", "failures of the S3 checkpoint mirror so far, by "
                                       "phase (client, thread, upload, retention, download)", labels=["phase"])
            for phase in ERROR_PHASES:
                errors.add_metric([phase], v["goodput_mirror_errors"].get(phase, 0))
            yield errors


class MetricsExporter(StepHook):
    """The metrics of one training process. Built once per process (``Session``), it outlives in-process
    restarts; ``enabled`` says whether the HTTP endpoint is up. Every ``observe_*`` is cheap and safe to call
    with the endpoint off (the data-starvation warning still works)."""

    def __init__(self, cfg: MetricsConfig, *, rank: int, local_rank: int, world_size: int,
                 events=None, events_path: Path | None = None):
        self.cfg, self.rank, self.local_rank = cfg, rank, local_rank
        self.events = events
        self.data_wait = DataWaitMonitor(cfg.data_wait_window, cfg.data_wait_warn)
        self.port: int | None = None
        self._server = self._thread = None
        if cfg.metrics_port > 0:
            self._start(world_size, events_path)

    @property
    def enabled(self) -> bool:
        return self._server is not None

    def _start(self, world_size: int, events_path: Path | None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
        except ImportError as e:
            raise RuntimeError("--metrics-port needs prometheus-client (pip install prometheus-client)") from e
        r = self.registry = CollectorRegistry()
        self.step = Gauge("goodput_step", "optimizer step this process last completed", registry=r)
        self.steps = Counter("goodput_steps", "optimizer steps completed by this process", registry=r)
        self.step_seconds = Histogram("goodput_step_seconds", "wall time of one optimizer step, seconds",
                                      buckets=STEP_BUCKETS_S, registry=r)
        self.step_last = Gauge("goodput_step_last_seconds", "wall time of the last step, seconds", registry=r)
        self.tokens_per_s = Gauge("goodput_tokens_per_second", "tokens of the whole job per second, over the "
                                  "last step", registry=r)
        self.mfu = None   # goodput_mfu_ratio: registered at the first known MFU, so CPU runs export no fake 0
        self.straggler = None   # goodput_straggler_score: registered at the first straggler report
        self.ckpt_block = Histogram("goodput_checkpoint_blocking_seconds", "time a checkpoint blocked training, "
                                    "seconds", buckets=CKPT_BUCKETS_S, registry=r)
        self.ckpt_block_last = Gauge("goodput_checkpoint_blocking_last_seconds", "blocking time of the last "
                                     "checkpoint, seconds", registry=r)
        self.data_wait_s = Counter("goodput_data_wait_seconds", "seconds spent waiting for training batches",
                                   registry=r)
        self.data_wait_ratio = Gauge("goodput_data_wait_ratio", "share of step time spent waiting for batches "
                                     "over the last window of --data-wait-window steps", registry=r)
        self.starved = Counter("goodput_data_starved_windows", "windows in which waiting for batches took at "
                               "least --data-wait-warn of the step time", registry=r)
        Gauge("goodput_rank_info", "this process's place in the job", ["rank", "local_rank", "world_size"],
              registry=r).labels(str(self.rank), str(self.local_rank), str(world_size)).set(1)
        if self.rank == 0 and events_path is not None:
            r.register(RunCollector(events_path, self.cfg.run_refresh_s))
        port = self.cfg.metrics_port + self.local_rank
        try:
            self._server, self._thread = start_http_server(port, addr=self.cfg.metrics_addr, registry=r)
        except OSError as e:
            # Metrics must never stop training: a taken port costs the endpoint, not the run.
            log.warning("metrics endpoint on %s:%d not started: %s", self.cfg.metrics_addr, port, e)
            return
        self.port = port
        # A fork (NVRx's monitor process, data loader workers) would inherit the listening socket and keep the
        # port after this process dies, so its successor could not bind it: the child closes its copy.
        os.register_at_fork(after_in_child=_forget_server_in_child(weakref.ref(self)))
        log.info("metrics: http://%s:%d/metrics", self.cfg.metrics_addr or "0.0.0.0", port)

    def after_step(self, report: StepReport) -> None:
        self.observe_step(report.step, report.step_s, report.tokens, mfu=report.mfu, data_wait_s=report.data_wait_s)

    def observe_step(self, step: int, step_s: float, tokens_per_step: int, mfu: float | None = None,
                     data_wait_s: float = 0.0) -> None:
        """``data_wait_s``: of ``step_s``, what the step waited for its batches (measured by the loop)."""
        wait_s = data_wait_s
        starved = self.data_wait.observe(step_s, wait_s)
        if starved is not None:
            log.warning("rank %d: data loading starves the step: %.0f%% of the last %d steps' time was spent "
                        "waiting for batches (GPU utilisation will swing between busy and idle); read ahead "
                        "or stage the data closer", self.rank, 100 * starved, self.data_wait.window)
            if self.events is not None:
                self.events.emit(Event.DATA_STARVED, step=step, ratio=round(starved, 4),
                                 window_steps=self.data_wait.window)
        if self._server is None:
            return
        self.step.set(step)
        self.steps.inc()
        self.step_seconds.observe(step_s)
        self.step_last.set(step_s)
        if step_s > 0:
            self.tokens_per_s.set(tokens_per_step / step_s)
        if mfu is not None:
            if self.mfu is None:
                from prometheus_client import Gauge

                self.mfu = Gauge("goodput_mfu_ratio", "model FLOPs utilisation of this device over the last step "
                                 "(achieved over its dense bf16 peak FLOP/s)", registry=self.registry)
            self.mfu.set(mfu)
        self.data_wait_s.inc(wait_s)
        if self.data_wait.last_ratio is not None:
            self.data_wait_ratio.set(self.data_wait.last_ratio)
        if starved is not None:
            self.starved.inc()

    def observe_checkpoint(self, block_s: float) -> None:
        if self._server is None:
            return
        self.ckpt_block.observe(block_s)
        self.ckpt_block_last.set(block_s)

    def observe_straggler_scores(self, scores: dict[str, dict[int, float]]) -> None:
        """Rank 0, at every straggler report: ``scores[kind][rank]`` (``trainer.straggler.straggler_record``)."""
        if self._server is None:
            return
        if self.straggler is None:
            from prometheus_client import Gauge

            self.straggler = Gauge("goodput_straggler_score", "GPU performance score of each rank at the last "
                                   "straggler report (NVRx: 1 = as fast as the fastest rank (relative) or as its "
                                   "own best (individual))", ["rank", "kind"], registry=self.registry)
        for kind, by_rank in scores.items():
            for rank, score in by_rank.items():
                self.straggler.labels(str(rank), kind).set(score)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None


def _forget_server_in_child(exporter_ref):
    def forget() -> None:
        exporter = exporter_ref()
        if exporter is not None and exporter._server is not None:
            exporter._server.socket.close()     # the child's copy only; the parent keeps serving
            exporter._server = exporter._thread = None

    return forget


def build_metrics(cfg: MetricsConfig, *, rank: int, world_size: int, events=None,
                  events_path: Path | None = None) -> MetricsExporter:
    """The process's exporter; its port is ``--metrics-port`` + LOCAL_RANK."""
    return MetricsExporter(cfg, rank=rank, local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                           world_size=world_size, events=events, events_path=events_path)
