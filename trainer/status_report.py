"""The run's progress where its launcher and the cluster read it: step, ETA, loss, tokens/s, goodput, restarts
by layer and the last committed step, from global rank 0, every ``--status-every-s`` seconds.

Where the figures go (each ``Sink`` on its own; one that fails never stops the others or the run):

* ``progress.json`` in the run directory, always: the local backend prints its progress line from it
  (``components.train.progress``).
* A TrainJob's ``status.trainerStatus`` (progressPercentage, estimatedRemainingSeconds, metrics) when the pod
  runs under Kubeflow Trainer with the ``TrainJobStatus`` feature gate: the controller injects
  ``KUBEFLOW_TRAINER_SERVER_URL`` (with a CA and a projected token) and the kubeflow SDK's
  ``update_trainjob_status`` posts to it. The SDK drops an update less than 5 s after the last one, so this
  sink never sends more often.
* Otherwise, in a pod (a PyTorchJob's): the annotation ``goodput.dev/progress`` (the figures as JSON) on the
  pod itself, by a JSON merge PATCH with the pod's service account token. The launcher reads it from the pod
  list it makes anyway; the pod's service account needs ``patch`` on ``pods`` in its namespace.

Nothing here runs in the training loop but ``after_step`` (a few assignments under a lock): the figures are
computed and sent by a daemon thread. Each request has a timeout; a sink's first failure is logged, every
failure counted, and a sink that is refused (401, 403, 404) is turned off.

    goodput train --nproc 2 --max-steps 300 --status-every-s 2 --out RUN     # then: cat RUN/progress.json
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .hooks import StepHook, StepReport
from .durable import write_bytes
from .layout import progress_path
from .metrics import RESTART_LAYERS, RunCollector

log = logging.getLogger("trainer")

ANNOTATION = "goodput.dev/progress"
POD_NAME_ENV = "POD_NAME"                         # the pod's name, from the downward API (the job builders)
SERVER_URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"    # injected by Kubeflow Trainer (TrainJobStatus feature gate)
SDK_MIN_INTERVAL_S = 5.0                          # update_trainjob_status drops updates closer than this
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
REQUEST_TIMEOUT_S = 5.0
CLOSE_TIMEOUT_S = 6.0                             # a last report in flight gets one request's timeout
ETA_WINDOW_STEPS = 100


@dataclass
class Figures:
    """What the run reports about itself; the same names in every sink (TrainJob metrics, annotation, file)."""

    step: int
    max_steps: int
    loss: float | None = None
    tokens_per_s: float | None = None
    goodput: float | None = None                  # productive step time / wall time so far (all attempts)
    restarts: dict[str, int] = field(default_factory=dict)    # by layer: inprocess, injob, job
    last_committed_step: int | None = None
    eta_s: int | None = None                      # from the wall time per step over the last steps
    updated: str = ""                             # RFC 3339, UTC

    @property
    def progress_percent(self) -> int:
        return max(0, min(100, int(100 * self.step / self.max_steps))) if self.max_steps > 0 else 0

    def metrics(self) -> dict[str, str]:
        """The TrainJob's ``trainerStatus.metrics`` (name -> value as text); unknown figures are left out."""
        flat = {"step": self.step, "max_steps": self.max_steps, "loss": self.loss, "tokens_per_s": self.tokens_per_s,
                "goodput": self.goodput, "last_committed_step": self.last_committed_step,
                **{f"restarts_{layer}": n for layer, n in self.restarts.items()}}
        return {k: str(v) for k, v in flat.items() if v is not None}

    @classmethod
    def from_metrics(cls, metrics: dict[str, str], eta_s: int | None = None, updated: str = "") -> "Figures":
        """The inverse of ``metrics``; KeyError or ValueError when ``step`` or ``max_steps`` is missing or bad."""
        def num(name, kind):
            return kind(metrics[name]) if metrics.get(name) not in (None, "") else None

        return cls(step=int(metrics["step"]), max_steps=int(metrics["max_steps"]), loss=num("loss", float),
                   tokens_per_s=num("tokens_per_s", float), goodput=num("goodput", float),
                   restarts={k[len("restarts_"):]: int(v) for k, v in metrics.items() if k.startswith("restarts_")},
                   last_committed_step=num("last_committed_step", int), eta_s=eta_s, updated=updated)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Figures":
        d = json.loads(text)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class RefusedError(Exception):
    """The receiver refused the report for good (no permission, no such object): the sink turns off."""


class Sink:
    name = ""
    min_interval_s = 0.0

    def send(self, figures: Figures) -> None:
        """Deliver ``figures`` or raise; ``RefusedError`` when retrying cannot help."""
        raise NotImplementedError


class FileSink(Sink):
    name = "file"

    def __init__(self, out: Path):
        self.path = progress_path(out)

    def send(self, figures: Figures) -> None:
        write_bytes(self.path, figures.to_json().encode())


class TrainJobStatusSink(Sink):
    """Kubeflow Trainer's status endpoint, through the kubeflow SDK (``pip install kubeflow``)."""

    name = "trainjob-status"
    min_interval_s = SDK_MIN_INTERVAL_S

    def __init__(self):
        self._update = None

    def send(self, figures: Figures) -> None:
        if self._update is None:
            # Imported here, in the reporter's thread: the SDK brings the Kubernetes client (about a second).
            try:
                from kubeflow.trainer import update_trainjob_status
            except ImportError as e:
                raise RefusedError(f"{SERVER_URL_ENV} is set but the kubeflow SDK is not installed "
                                   f"(pip install 'kubeflow>=0.5'): {e}") from None
            self._update = update_trainjob_status
            self._sdk_log = logging.getLogger(update_trainjob_status.__module__)
        # The SDK logs its own reason for a failure and returns False; it never raises.
        if not self._update(progress_percent=figures.progress_percent, estimated_remaining_seconds=figures.eta_s,
                            metrics=figures.metrics()):
            # Its warning said why once; failures after it are only counted (the reporter logs the first).
            self._sdk_log.setLevel(logging.ERROR)
            raise RuntimeError("update_trainjob_status returned False (the kubeflow SDK's warning says why)")


class PodAnnotationSink(Sink):
    """The annotation ``goodput.dev/progress`` on this pod, patched through the API server."""

    name = "pod-annotation"

    def __init__(self, api_url: str, namespace: str, pod: str, token_path: Path, ca_path: Path | None):
        self.url = f"{api_url.rstrip('/')}/api/v1/namespaces/{namespace}/pods/{pod}"
        self.token_path = token_path
        self.context = ssl.create_default_context(cafile=str(ca_path) if ca_path else None)

    @classmethod
    def from_pod(cls, env=os.environ, sa_dir: Path = SA_DIR) -> "PodAnnotationSink | None":
        """In a pod with a service account token: the sink for that pod (``POD_NAME`` or the hostname, which
        is the pod's name unless its spec sets another); None elsewhere."""
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
        token, namespace = sa_dir / "token", sa_dir / "namespace"
        pod = env.get(POD_NAME_ENV) or env.get("HOSTNAME")
        if not host or not pod or not token.is_file() or not namespace.is_file():
            return None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", namespace.read_text().strip(), pod, token,
                   sa_dir / "ca.crt" if (sa_dir / "ca.crt").is_file() else None)

    def send(self, figures: Figures) -> None:
        # Read each time: the kubelet rotates a projected token before it expires.
        token = self.token_path.read_text().strip()
        body = json.dumps({"metadata": {"annotations": {ANNOTATION: figures.to_json()}}}).encode()
        req = urllib.request.Request(self.url, data=body, method="PATCH", headers={
            "Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json",
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S, context=self.context) as resp:
                resp.read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403, 404):
                raise RefusedError(f"PATCH {self.url}: {e.code} {e.reason} (the pod's service account needs "
                                   "patch on pods: deploy/rbac.yaml)") from None
            raise


def build_sinks(out: Path, env=os.environ) -> list[Sink]:
    """The sinks of this process: the file always; the TrainJob's status when the runtime serves it, else this
    pod's annotation when in a pod."""
    sinks: list[Sink] = [FileSink(out)]
    if env.get(SERVER_URL_ENV):
        sinks.append(TrainJobStatusSink())
    else:
        pod = PodAnnotationSink.from_pod(env)
        if pod is not None:
            sinks.append(pod)
    return sinks


class StatusReporter(StepHook):
    """Rank 0's progress reports (a no-op elsewhere or with ``every_s`` 0). ``after_step`` records the step;
    a daemon thread sends the figures every ``every_s`` seconds (each sink at most every ``min_interval_s``),
    and once more at ``close``."""

    def __init__(self, sinks: list[Sink], *, max_steps: int, events_path: Path, every_s: float,
                 close_timeout_s: float = CLOSE_TIMEOUT_S, clock=time.monotonic):
        self.clock = clock            # of the steps, for the ETA
        self.sinks, self.max_steps, self.every_s = list(sinks), max_steps, every_s
        self.close_timeout_s = close_timeout_s
        # Read anew at every report (incrementally), so the last one has the run's final goodput.
        self.run = RunCollector(events_path, refresh_s=0)
        self.sent = {s.name: 0 for s in self.sinks}
        self.failed = {s.name: 0 for s in self.sinks}
        self._last_sent = {s.name: -float("inf") for s in self.sinks}
        self._lock = threading.Lock()
        self._latest: StepReport | None = None
        self._times: deque[tuple[float, int]] = deque(maxlen=ETA_WINDOW_STEPS)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.sinks and every_s > 0:
            self._thread = threading.Thread(target=self._loop, name="goodput-status", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None

    def after_step(self, report: StepReport) -> None:
        if self._thread is None:
            return
        with self._lock:
            if self._times and report.step <= self._times[-1][1]:
                self._times.clear()          # a restart went back: the rate before it says nothing now
            self._times.append((self.clock(), report.step))
            self._latest = report

    def figures(self) -> Figures | None:
        """The figures now (None before the first step)."""
        with self._lock:
            latest, times = self._latest, list(self._times)
        if latest is None:
            return None
        eta = None
        if len(times) >= 2 and times[-1][1] > times[0][1]:
            per_step = (times[-1][0] - times[0][0]) / (times[-1][1] - times[0][1])
            eta = round(max(0, self.max_steps - latest.step) * per_step)
        run = self.run.values()
        return Figures(step=latest.step, max_steps=self.max_steps, loss=round(latest.loss, 6),
                       tokens_per_s=round(latest.tokens_per_s, 1), goodput=run.get("goodput_ratio"),
                       restarts={layer: run["goodput_restarts"][layer] for layer in RESTART_LAYERS} if run else {},
                       last_committed_step=run.get("goodput_last_committed_step") if run else None, eta_s=eta,
                       updated=datetime.now(timezone.utc).isoformat(timespec="seconds"))

    def _loop(self) -> None:
        sent_step = None
        while not self._stop.wait(self.every_s):
            sent_step = self._send(sent_step)
        self._send(sent_step, final=True)

    def _send(self, sent_step: int | None, final: bool = False) -> int | None:
        try:
            figures = self.figures()
        except Exception as e:  # noqa: BLE001 - the reports must never stop the run
            log.warning("progress report not built: %s", e)
            return sent_step
        if figures is None or (figures.step == sent_step and not final):
            return sent_step
        for sink in list(self.sinks):
            if time.monotonic() - self._last_sent[sink.name] < sink.min_interval_s:
                continue
            try:
                sink.send(figures)
            except RefusedError as e:
                self.failed[sink.name] += 1
                self.sinks.remove(sink)
                log.warning("progress reports to %s off: %s", sink.name, e)
                continue
            except Exception as e:  # noqa: BLE001 - any failure is counted; the next interval tries again
                self.failed[sink.name] += 1
                if self.failed[sink.name] == 1:
                    log.warning("progress report to %s failed (%s: %s); retrying every %.0f s, failures counted "
                                "at the end", sink.name, type(e).__name__, e, self.every_s)
                continue
            self.sent[sink.name] += 1
            self._last_sent[sink.name] = time.monotonic()
        return figures.step

    def close(self) -> None:
        """Send the last figures (each sink that may send now) and stop, waiting at most ``close_timeout_s``."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.warning("progress report still in flight after %.0f s; not waited for", self.close_timeout_s)
        if any(self.failed.values()):
            log.info("progress reports: sent %s, failed %s", self.sent, self.failed)
        self._thread = None


def build_status_reporter(*, rank: int, out: Path, events_path: Path, max_steps: int,
                          every_s: float) -> StatusReporter:
    """Rank 0's reporter with this process's sinks; on other ranks, or with ``every_s`` 0, one that does
    nothing."""
    sinks = build_sinks(out) if rank == 0 and every_s > 0 else []
    return StatusReporter(sinks, max_steps=max_steps, events_path=events_path, every_s=every_s)
