"""The launcher's progress line, from the figures the trainer's rank 0 reports (``trainer.status_report``):

    [train] step 4200/10000, goodput 99.1%, ETA 3h12m

The same line for every backend, from wherever the figures are: a TrainJob's ``status.trainerStatus``, the
annotation ``goodput.dev/progress`` on a PyTorchJob's pods (the supervisor has both at hand: it watches the job
and lists its pods), or ``progress.json`` in the run directory (the local backend, ``follow_file``).
"""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Callable, Iterator

from trainer.layout import progress_path
from trainer.status_report import ANNOTATION, Figures


def format_duration(seconds: float) -> str:
    """``3h12m``, ``4m05s``, ``42s``."""
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def progress_line(f: Figures, prefix: str = "[train]") -> str:
    parts = [f"step {f.step}/{f.max_steps}"]
    if f.goodput is not None:
        parts.append(f"goodput {100 * f.goodput:.1f}%")
    if f.eta_s is not None and f.step < f.max_steps:
        parts.append(f"ETA {format_duration(f.eta_s)}")
    restarts = ", ".join(f"{layer} {n}" for layer, n in f.restarts.items() if n)
    if restarts:
        parts.append(f"restarts: {restarts}")
    return f"{prefix} " + ", ".join(parts)


def from_trainjob(job: dict) -> Figures | None:
    """The figures in a TrainJob's ``status.trainerStatus`` (None when it has none, or not ours)."""
    ts = (job.get("status") or {}).get("trainerStatus") or {}
    metrics = {m.get("name"): m.get("value") for m in ts.get("metrics") or [] if isinstance(m, dict)}
    try:
        return Figures.from_metrics(metrics, eta_s=ts.get("estimatedRemainingSeconds"),
                                    updated=str(ts.get("lastUpdatedTime") or ""))
    except (KeyError, ValueError, TypeError):
        return None


def from_pods(pods: list[dict]) -> Figures | None:
    """The newest figures among the pods' ``goodput.dev/progress`` annotations (rank 0 may be on any pod; a
    replaced pod's annotation is older)."""
    found = []
    for pod in pods:
        text = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
        if text:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                found.append(Figures.from_json(text))
    return max(found, key=lambda f: f.updated, default=None)


def from_file(run_dir: Path) -> Figures | None:
    try:
        return Figures.from_json(progress_path(run_dir).read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


class ProgressLog:
    """Logs the progress line whenever it changed."""

    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.last = ""

    def observe(self, figures: Figures | None) -> None:
        line = progress_line(figures) if figures is not None else self.last
        if line != self.last:
            self.last = line
            self.log(line)

    def observe_job(self, job: dict | None = None, pods: list[dict] | None = None) -> None:
        """The supervisor's hook: a TrainJob's status, else its pods' annotations."""
        self.observe((from_trainjob(job) if job else None) or (from_pods(pods) if pods else None))


@contextlib.contextmanager
def follow_file(run_dir: Path, log: Callable[[str], None], every_s: float = 1.0) -> Iterator[ProgressLog]:
    """While the block runs, log the progress line of ``run_dir/progress.json`` each time it changes (the
    local backend: its ranks write it)."""
    progress, done = ProgressLog(log), threading.Event()

    def follow():
        while not done.wait(every_s):
            progress.observe(from_file(run_dir))

    thread = threading.Thread(target=follow, name="goodput-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        done.set()
        thread.join(every_s + 5)
        progress.observe(from_file(run_dir))      # the last figures, written as the ranks ended


__all__ = ["ProgressLog", "follow_file", "format_duration", "from_file", "from_pods", "from_trainjob",
           "progress_line"]
