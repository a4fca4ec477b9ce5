"""Straggler detection on the GPU path (``--straggler-report-s``): NVRx's ``Detector`` times every rank's CUDA
kernels in the training step and scores each rank against the fastest one (relative) and against its own
best (individual); rank 0 writes the ranks below NVRx's thresholds as a ``straggler`` event to
``events.jsonl`` and every rank's scores as ``goodput_straggler_score`` gauges to its metrics.

It needs CUDA: ``Detector.initialize`` loads NVRx's CUPTI extension and ``generate_report`` synchronizes the
device. Where it cannot run (CPU ranks, a release or image without it) it is off, and rank 0 says why once.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from . import compat
from .config import MetricsConfig
from .events import Event, EventLog
from .hooks import StepHook, StepReport
from .metrics import MetricsExporter
from .parallel import Dist

log = logging.getLogger("trainer")

KINDS = ("relative", "individual")   # of the Report's GPU scores (``gpu_<kind>_perf_scores``)


def straggler_record(report: Any) -> dict:
    """What rank 0 records of an NVRx ``Report`` (gathered on rank 0): every rank's GPU scores by kind, and
    the stragglers ``Report.identify_stragglers`` finds with NVRx's default thresholds, with their nodes."""
    found = report.identify_stragglers()
    scores = {kind: {int(r): round(float(v), 4) for r, v in getattr(report, f"gpu_{kind}_perf_scores").items()}
              for kind in KINDS}
    slow = {kind: [{"rank": i.rank, "node": i.node, "score": scores[kind][i.rank]}
                   for i in sorted(found[f"straggler_gpus_{kind}"], key=lambda i: i.rank)] for kind in KINDS}
    every = [s for kind in KINDS for s in slow[kind]]
    return {"ranks": sorted({s["rank"] for s in every}), "nodes": sorted({s["node"] for s in every}), **slow,
            "scores": scores}


class StragglerDetection(StepHook):
    """NVRx's ``Detector`` for one attempt: initialized with the attempt's process group (its size is read
    at ``initialize``), the step's compute (``trainer.train_step``: forward, backward, optimizer) in a
    detection section, a report every ``interval_s`` on every rank (collectives: call ``after_step`` on all).

    Args:
        detector: NVRx's ``Detector`` class (a process-wide singleton); callable_id: its ``CallableId``.
        interval_s: seconds between reports (NVRx synchronizes the interval across ranks).
        trainer: the object whose ``train_step`` is timed.
        d, events, metrics: this rank's distributed context, the run's event log and the rank's metrics.
    """

    def __init__(self, detector: Any, callable_id: type, interval_s: float, trainer: Any, d: Dist,
                 events: EventLog, metrics: MetricsExporter):
        self.detector, self.d, self.events, self.metrics = detector, d, events, metrics
        if detector.initialized:   # a failed attempt's, sized for its process group (in-process restart)
            detector.shutdown()
        detector.initialize(scores_to_compute="all", gather_on_rank0=True, report_time_interval=interval_s)
        detector.wrap_callables([callable_id(trainer, "train_step")], profile_cuda=True)

    def after_step(self, report: StepReport) -> None:
        gathered = self.detector.generate_report_if_interval_elapsed()
        if gathered is not None and self.d.is_main:
            record_stragglers(gathered, report.step, self.events, self.metrics)


def record_stragglers(report: Any, step: int, events: EventLog, metrics: MetricsExporter) -> dict:
    """Rank 0, at each report: every rank's scores to the metrics; a ``straggler`` event (and a warning)
    when a rank is below the thresholds. Returns the record."""
    record = straggler_record(report)
    metrics.observe_straggler_scores(record["scores"])
    if record["ranks"]:
        log.warning("straggler: rank(s) %s on %s below NVRx's thresholds (GPU scores %s)", record["ranks"],
                    record["nodes"], record["scores"])
        events.emit(Event.STRAGGLER, step=step, **record)
    return record


def straggler_hooks(cfg: MetricsConfig, trainer: Any, d: Dist, events: EventLog,
                    metrics: MetricsExporter) -> list[StepHook]:
    """The attempt's straggler detection, as a list of hooks: empty where it is off (the reason logged once
    per process on rank 0). Call once per attempt, after the process group exists."""
    if cfg.straggler_report_s <= 0:
        return []
    if d.device.type != "cuda":
        return _off(d, f"it times CUDA kernels and this rank runs on {d.device.type}")
    try:
        straggler = compat.import_straggler(compat.installed_release())
        return [StragglerDetection(straggler.Detector, straggler.CallableId, cfg.straggler_report_s, trainer, d,
                                   events, metrics)]
    except (ImportError, OSError, RuntimeError) as e:   # no CUPTI library or extension in this image
        return _off(d, f"NVRx's Detector could not start ({type(e).__name__}: {e})")


def _off(d: Dist, why: str) -> list[StepHook]:
    if d.is_main:
        _say_off(why)
    return []


@functools.cache   # once per process and reason: every attempt asks again
def _say_off(why: str) -> None:
    log.warning("straggler detection (--straggler-report-s) is off: %s", why)
