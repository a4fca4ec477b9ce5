"""``goodput run --local``: the whole pipeline on this machine, under ``kfp.local``.

    goodput run --local                                  # stage -> train -> evaluate -> register
    goodput run --local --inject-fault kill@50:1         # rank 1 dies at step 50; ft_launcher restarts it
    goodput run --local -p max_steps=200 --fsx-root /tmp/fsx

The pipeline is compiled as for a cluster, with the train backend ``local`` compiled in
(``pipelines.pipeline.build_pipeline("local")``: the same wiring, plus ``local_nproc`` and ``local_nodes``
parameters), and the compiled YAML runs on ``kfp.local.SubprocessRunner(use_venv=False)``: every step is a
subprocess of this Python, the train step runs ft_launcher ranks on this machine, a local directory stands in for FSx
(datasets/, runs/, models/), and the kfp-kubernetes settings (PVC mounts, placement, secrets) are
ignored, as kfp.local does. The default dataset is this Python's standard library (its top-level
modules, copied once into ``<fsx>/sources/``, then staged like any other source directory), so
nothing is downloaded.

kfp.local 2.17 runs every construct of the pipeline, so the local variant differs only in its backend: the
exit handler and the condition on ``promoted`` (``kfp/local/pipeline_orchestrator.py``
switches to its DAG orchestrator for them). Two limits shaped the wiring or need a shim: kfp.local
cannot take a ``dsl.OneOf`` of artifacts (the train step follows the staging branches with ``.after()``
and reads the dataset from FSx, which the cluster does too), and it cannot resolve a condition on a
named output (``kfp_compat.named_outputs_in_conditions``, active only while a local run lasts).

The console shows goodput's own progress (each step as it starts and ends, with its time), what the steps
say that matters (the trainer's step lines, real errors) and the summary; kfp.local's log lines, the
executors' preambles and the launchers' banners go only to the run's log file.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from pipelines import kfp_compat
from trainer import layout
from trainer.durable import staging_dir
from trainer.events import Event, read_events
from trainer.signals import KILLED_GONE_S, handlers, marked, reap

# Pipeline arguments of the local demo, sized for 2 CPU cores: training, three committed checkpoints, their
# evaluation and the promotion. What goodput counts as lost is mostly fixed per run (the ranks' startup, the
# final save) or per step (the rank monitor's sections, the hooks), not per sequence: steps of 128 sequences
# (about 3.6x the CPU of 32) need fewer of them, and so less of that, for the same training time (README: the
# measured wall time and goodput); -p overrides any. The model is a small ByteGPT; -p model=llama trains
# llama's default flavor (debug, sized for 2 CPU cores).
DEMO_ARGUMENTS = {
    "local_nproc": 2,
    "local_nodes": 1,
    "model": "bytegpt",
    "model_flavor": "",
    "seq_len": 64,
    "batch_size": 128,
    "max_steps": 150,
    "ckpt_every": "50",
}
DEMO_BYTEGPT = '{"n_layer": 2, "n_head": 2, "n_embd": 64}'
"""The demo ByteGPT's size, unless -p model_config (or another model) is given."""


@dataclass
class LocalRun:
    """What a local pipeline run produced, read from the steps' outputs."""

    ok: bool
    wall_s: float
    run_root: Path | None = None            # <pipeline root>/<pipeline>-<time>: the steps' outputs
    log_path: Path | None = None
    error: str = ""
    interrupted: int | None = None                   # the signal that stopped the run (SIGINT, SIGTERM)
    train: dict = field(default_factory=dict)        # Model metadata + Metrics of the train step
    evaluate: dict = field(default_factory=dict)     # outputs of the evaluate step
    register: dict = field(default_factory=dict)     # Model metadata of the register step (if promoted)
    summary: dict = field(default_factory=dict)      # the trainer's summary.json
    evaluation: dict = field(default_factory=dict)   # evaluation.json


def default_source(fsx_root: Path) -> Path:
    """The default dataset's source directory: this Python's top-level stdlib modules, copied once.

    Staging the standard library directory itself would also take its site-packages and tests.
    """
    from trainer.data import DEFAULT_DATASET_NAME, default_dataset_version, default_source_files

    dest = layout.sources_dir(fsx_root, DEFAULT_DATASET_NAME, default_dataset_version())
    files = default_source_files()
    if dest.is_dir() and len(list(dest.iterdir())) == len(files):
        return dest
    with staging_dir(dest) as tmp:
        for f in files:
            shutil.copyfile(f, tmp / f.name)
    return dest


def local_arguments(fsx_root: Path, overrides: dict, *, with_source: bool = True) -> dict:
    """The demo's arguments for a local directory standing in for FSx, then ``overrides``.

    ``with_source`` fills in the default dataset source, copying it under ``fsx_root`` the first time.
    """
    from trainer.data import DEFAULT_DATASET_NAME, default_dataset_version

    fsx_root = Path(fsx_root).resolve()
    args = {**DEMO_ARGUMENTS, "fsx_root": str(fsx_root), "registry": str(layout.models_dir(fsx_root)),
            "dataset_name": DEFAULT_DATASET_NAME, "dataset_version": default_dataset_version()}
    args.update(overrides)
    if args["model"] == "bytegpt" and "model_config" not in overrides:
        args["model_config"] = DEMO_BYTEGPT
    if with_source and "dataset_source" not in overrides:
        args["dataset_source"] = str(default_source(fsx_root))
    return args


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# The last line of a traceback (``pkg.mod.SomeError: message``): what a failed step says about why.
_REASON = re.compile(r"^\s*(?:[\w.]+\.)?(?P<type>\w*(?:Error|Exception|Exit|Interrupt)\w*)(?::\s*(?P<msg>.*))?$")
# Errors that come back the same on every attempt (settings, data format, a path): a retry only delays them.
_DETERMINISTIC = {"ValueError", "LaunchError", "ParamError", "UsageError", "BadParameter", "TypeError", "KeyError",
                  "FileNotFoundError", "NotADirectoryError", "IsADirectoryError", "PermissionError"}


class _Progress(io.TextIOBase):
    """stdout while kfp.local runs: everything into the log file, the readable part to the terminal.

    kfp.local's own log lines become goodput's progress lines: "Executing task 'train-op'" is ``[train] started``
    and "Task 'train-op' finished with status SUCCESS" is ``[train] done in 42.1 s`` (``names``: the steps'
    display names by task name); its other lines (the pipeline's status, the outputs' listing) are left out.
    Left out on the terminal too unless ``verbose`` (all of it stays in the log): kfp's executor preamble (the
    executor input as JSON, "Looking for component", ...), the listing of each task's outputs (the summary
    shows what matters), ft_launcher's and the rank monitors' banners and INFO lines, NVRx's own log lines,
    and what a CPU-only machine says over and over: gloo's socket polls, the pynvml deprecation warning,
    NVRx's NVML/InfiniBand health-check tracebacks, asyncio tracebacks of rank monitors whose rank went away,
    multiprocessing's leaked-semaphore warnings. Colours only on a terminal.
    """

    _DROP = re.compile(
        r"\[KFP Executor [^\]]*\]: (Looking for component|Loading KFP component|Wrote executor output file)"
        r"|socket\.cpp:\d+\] \[c10d\] waitForInput"
        r"|The pynvml package is deprecated|^\s*import pynvml"
        r"|GPU Health checks disabled|Health checks are disabled|gpu_ib_map|gpu_pci_map|/sys/class/infiniband"
        r"|NIC health|Failed to shut down NVML"
        r"|Streamed logs:$|^-{20,}$"
        # ft_launcher and its rank monitors (their errors stay), NVRx's loggers
        r"|\] \[(INFO|WARNING|ALWAYS|DEBUG)\] \[(ft_launcher|RankMonServer)"
        r"|^\s*\*{10,}\s*$|^\s*Rendezvous info:|^\s*--rdzv-backend=|^\s*Setting OMP_NUM_THREADS"
        r"|^\s*(entrypoint|min_nodes|max_nodes|nproc_per_node|run_id|rdzv_backend|rdzv_endpoint|rdzv_configs"
        r"|max_restarts|restart_policy|monitor_interval|log_dir|metrics_cfg)\s+: "
        r"|\[nvidia_resiliency_ext[\w.]*\]|Exception while read_obj_from_ipc_socket"
        r"|resource_tracker: There appear to be \d+ leaked|^\s*warnings\.warn\(")
    _BLOCKS = (  # (first line, last line) of multi-line noise
        (re.compile(r"Got executor_input"), re.compile(r"^    }$")),
        (re.compile(r"NVML Error: NVML Shared Library Not Found"), re.compile(r"NVMLError_LibraryNotFound")),
    )
    _TRACEBACK = re.compile(r"^\s*Traceback \(most recent call last\):")
    _NOISE_TRACEBACK = re.compile(r"pynvml|NVML|asyncio|CancelledError|read_obj_from_ipc")
    _OUTPUTS = re.compile(r"Task .* (outputs:|has no outputs)")
    _KFP_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d+ - ")
    _KFP_TASK = re.compile(r"^\d\d:\d\d:\d\d\.\d+ - \w+ - (?:Executing task '(?P<started>[^']+)'"
                           r"|Task '(?P<ended>[^']+)' finished with status (?P<status>\w+))")

    def __init__(self, out, log, verbose: bool = False, names: dict[str, str] | None = None):
        self.out, self.log, self.verbose, self.buf = out, log, verbose, ""
        self.names = names or {}
        self.started: dict[str, float] = {}
        self.colour = bool(getattr(out, "isatty", lambda: False)())
        self.block_end: re.Pattern | None = None
        self.in_outputs = False
        self.traceback: list[str] | None = None   # a traceback being read: shown whole or dropped whole
        self.traceback_indent = 0
        self.reason = ""       # the last exception line a step printed: why it failed

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.log.write(s)
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            for shown in self.lines(line):
                self.out.write((shown if self.colour else _ANSI.sub("", shown)) + "\n")
        self.out.flush()
        return len(s)

    def say(self, line: str) -> None:
        """A line of goodput's own, on the terminal and in the log."""
        self.log.write(line + "\n")
        self.out.write(line + "\n")
        self.out.flush()

    def flush(self) -> None:
        self.log.flush()
        self.out.flush()

    def lines(self, line: str) -> list[str]:
        """What of ``line`` goes to the terminal (a traceback comes out whole, at its end, or not at all)."""
        plain = _ANSI.sub("", line).rstrip()
        m = _REASON.match(plain)
        if m and not plain.startswith(" " * 8):
            self.reason = f"{m['type']}: {m['msg']}" if m["msg"] else m["type"]
        if self.verbose:
            return [line]
        indent = len(plain) - len(plain.lstrip())
        if self.block_end is not None:    # inside known noise, tracebacks included
            return [line] if self.show(plain) else []
        if self.traceback is not None:
            self.traceback.append(line)
            if not plain or indent > self.traceback_indent:
                return []
            # Back at the traceback's own indentation: its last line, the exception.
            block, self.traceback = self.traceback, None
            return [] if self._NOISE_TRACEBACK.search("\n".join(block)) else block
        if self._TRACEBACK.match(plain):
            self.traceback, self.traceback_indent = [line], indent
            return []
        if not self.show(plain):
            return []
        task = self._KFP_TASK.match(plain)
        if task:
            return [self.task_progress(task)]
        return [] if self._KFP_LINE.match(plain) else [line]

    def task_progress(self, m: re.Match) -> str:
        """goodput's line for a step that kfp.local starts or finishes."""
        task = m["started"] or m["ended"]
        name = self.names.get(task, task)
        if m["started"]:
            self.started[task] = time.monotonic()
            return f"[{name}] started"
        took = f" in {time.monotonic() - self.started[task]:.1f} s" if task in self.started else ""
        return f"[{name}] done{took}" if m["status"] == "SUCCESS" else f"[{name}] {m['status'].lower()}{took}"

    def show(self, plain: str) -> bool:
        if self.block_end is not None:
            if self.block_end.search(plain):
                self.block_end = None
            return False
        for start, end in self._BLOCKS:
            if start.search(plain):
                self.block_end = end
                return False
        if self.in_outputs:
            if not self._KFP_LINE.match(plain) and not plain.startswith("-----"):
                return False
            self.in_outputs = False
        if self._OUTPUTS.search(plain):
            self.in_outputs = True
            return False
        return bool(plain) and not self._DROP.search(plain)


class _Stop(threading.Event):
    """Set by the first SIGINT or SIGTERM of ``goodput run --local``: no step starts or is retried after it."""

    signum: int | None = None


@contextlib.contextmanager
def _stopped_by_signals(stop: _Stop):
    """SIGINT (Ctrl-C) and SIGTERM stop the run: the step that runs is sent SIGTERM (the train step's ranks
    commit a checkpoint first) and ends; nothing after it runs (see ``_told_retries``). A second signal stops
    at once. Main thread only."""
    import psutil

    def handle(signum, _frame):
        if stop.is_set():
            raise KeyboardInterrupt(f"signal {signum}")
        stop.signum = signum
        stop.set()
        # The steps kfp.local runs (a Ctrl-C reached them already): each is a shell running the step's Python,
        # which a SIGTERM to the shell alone would leave running (and kfp.local waiting for it). The shell
        # itself only where it has not started the step yet.
        for shell in psutil.Process().children():
            with contextlib.suppress(psutil.NoSuchProcess):
                for proc in shell.children() or [shell]:
                    proc.send_signal(signal.SIGTERM)

    with handlers({signal.SIGINT: handle, signal.SIGTERM: handle}):
        yield


class _NotRetried(RuntimeError):
    """A step failed with an error that would come back on every attempt."""


@contextlib.contextmanager
def _told_retries(progress: _Progress, stop: _Stop):
    """kfp.local honours each task's retry policy, silently: say "retrying <step> in N s (attempt k/n):
    <reason>"; retry nothing after an interrupt (its backoff ends with it); and never retry an error that
    comes back the same every time (``_DETERMINISTIC``). Through kfp.local's task executor while the run lasts
    (``kfp_compat.task_attempts``); under a kfp without it, retries stay as kfp.local does them. Yields whether
    the hooks are in place."""

    def around(attempt, args, kwargs):
        if stop.is_set():
            raise KeyboardInterrupt
        progress.reason = ""
        outputs, state = attempt(*args, **kwargs)
        if stop.is_set():
            raise KeyboardInterrupt      # an interrupted step is not retried, and nothing runs after it
        if not kfp_compat.succeeded(state) and progress.reason.split(":")[0] in _DETERMINISTIC:
            name = kwargs.get("component_name") or "a step"
            raise _NotRetried(f"{name} failed with {progress.reason} (not retried: it would fail the same way)")
        return outputs, state

    def on_retry(retry: kfp_compat.Retry) -> None:
        progress.say(f"retrying {retry.task} in {retry.delay_s:g} s (attempt {retry.attempt}/{retry.attempts}): "
                     f"{progress.reason or 'it failed'}")

    def sleep(seconds: float) -> None:
        if stop.wait(seconds):
            raise KeyboardInterrupt

    with kfp_compat.task_attempts(around, on_retry, sleep) as hooked:
        yield hooked


class _RunProcesses:
    """The processes of one local run, found by a marker in their environment, and kept from lingering.

    Every process the run starts inherits ``GOODPUT_LOCAL_RUN=<id>``, including those a killed rank
    orphans. Two kinds of cleanup use it:

    * While the run goes: a rank killed by a fault (``--inject-fault kill@...``) orphans the
      ``multiprocessing`` workers it spawned (NVRx's persistent checkpoint writer). They keep the
      step's stdout pipe open, and kfp.local reads that pipe to its end before it looks at the step's
      exit code, so the run would hang after training finished. NVRx's launcher removes such
      leftovers itself with SIGTERM (``terminate_mp_processes``), which they can outlast. Every
      second, a ``multiprocessing`` worker of this run whose parent is no longer part of the run is
      killed. Resource trackers are left to exit on their own once their clients are gone (they clean
      up shared memory on the way). On a cluster the pod's end takes all of them with it.
    * When the run ends: whatever of it is still alive is stopped, with SIGTERM and a grace period if
      the run was interrupted (the trainer then commits a checkpoint), else at once.
    """

    MARKER = "GOODPUT_LOCAL_RUN"

    def __init__(self, interval_s: float = 1.0, log=None):
        self.interval_s, self.log = interval_s, log
        self.run_id = uuid.uuid4().hex
        self.killed: list[int] = []
        self._saved = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="run-processes", daemon=True)
        self.enabled = Path("/proc/self/environ").exists()

    def __enter__(self) -> "_RunProcesses":
        self._saved = os.environ.get(self.MARKER)
        os.environ[self.MARKER] = self.run_id
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._saved is None:
            os.environ.pop(self.MARKER, None)
        else:
            os.environ[self.MARKER] = self._saved
        if not self.enabled:
            return
        self._stop.set()
        self._thread.join()
        self.stop_all(grace_s=10.0 if exc_type is not None else 0.0)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.kill_orphaned_workers()

    def processes(self) -> dict[int, tuple[int, str]]:
        """pid -> (parent pid, command line) of this run's live processes."""
        import psutil

        found = {}
        for p in marked(self.MARKER, self.run_id):
            with contextlib.suppress(psutil.Error):
                found[p.pid] = (p.ppid(), " ".join(p.cmdline()))
        return found

    def _kill(self, pid: int, cmd: str, sig=signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            self.killed.append(pid)
            if self.log:
                self.log.write(f"[goodput run --local] sent {signal.Signals(sig).name} to {pid}: {cmd[:160]}\n")

    def _signalled(self, proc, sig: int) -> None:
        import psutil

        self.killed.append(proc.pid)
        if self.log:
            with contextlib.suppress(psutil.Error):
                self.log.write(f"[goodput run --local] sent {signal.Signals(sig).name} to {proc.pid}: "
                               f"{' '.join(proc.cmdline())[:160]}\n")

    def kill_orphaned_workers(self) -> None:
        procs = self.processes()
        for pid, (ppid, cmd) in procs.items():
            if "multiprocessing.spawn" in cmd and ppid not in procs:
                self._kill(pid, cmd)

    def stop_all(self, grace_s: float) -> None:
        # A killed process lives on until the kernel has torn it down: the run is over only when it is gone.
        left = reap(marked(self.MARKER, self.run_id), grace_s=grace_s, on_signal=self._signalled)
        if left and self.log:
            self.log.write(f"[goodput run --local] still dying {KILLED_GONE_S:.0f} s after SIGKILL: "
                           f"{sorted(p.pid for p in left)}\n")


def _outputs(task_dir: Path) -> dict:
    """Parameters and artifact metadata a task wrote (``executor_output.json``)."""
    path = task_dir / "executor_output.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    out = dict(data.get("parameterValues") or {})
    for name, arts in (data.get("artifacts") or {}).items():
        for a in arts.get("artifacts") or []:
            out[name] = {"uri": a.get("uri"), **(a.get("metadata") or {})}
    return out


def _collect(run: LocalRun) -> None:
    if run.run_root is None:
        return
    tasks = {p.name: _outputs(p) for p in run.run_root.iterdir() if p.is_dir()}
    run.train = tasks.get("train-op", {})
    run.evaluate = tasks.get("evaluate-op", {})
    run.register = tasks.get("register-op", {})
    run_dir = (run.train.get("model") or {}).get("run_dir")
    if run_dir and layout.summary_path(run_dir).is_file():
        run.summary = json.loads(layout.summary_path(run_dir).read_text())
        ev = layout.evaluation_dir(run_dir) / layout.EVALUATION_FILE
        if ev.is_file():
            run.evaluation = json.loads(ev.read_text())


def _display_names(package: Path) -> dict[str, str]:
    """Task name -> display name (``set_display_name``) of every task in a compiled pipeline."""
    import yaml

    with open(package) as f:
        spec = next(yaml.safe_load_all(f))
    dags = [spec.get("root", {}), *spec.get("components", {}).values()]
    return {name: task.get("taskInfo", {}).get("name", name)
            for dag in dags for name, task in dag.get("dag", {}).get("tasks", {}).items()}


def run_local(arguments: dict, *, pipeline_root: Path, package: Path | None = None, out=None,
              verbose: bool = False) -> LocalRun:
    """Compile the pipeline (unless ``package``), run it on kfp.local, and collect what it produced.

    Progress goes to ``out`` (default stdout; all of the steps' output with ``verbose``); everything
    kfp.local prints is also kept in ``<pipeline_root>/<pipeline>-<time>.log``. SIGINT and SIGTERM stop it
    (``LocalRun.interrupted``).
    """
    from kfp import components, local

    from pipelines import PIPELINE_NAME
    from pipelines.compile import compile_pipeline

    pipeline_root = Path(pipeline_root).resolve()
    pipeline_root.mkdir(parents=True, exist_ok=True)
    out = out or sys.stdout
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="goodput-local-") as tmp:
        pkg = package or compile_pipeline(Path(tmp) / "pipeline.yaml", backend="local")
        pipeline = components.load_component_from_file(str(pkg))
        before = set(pipeline_root.iterdir())
        log_path = pipeline_root / f"{PIPELINE_NAME}-{time.strftime('%Y%m%d-%H%M%S')}.log"
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(pipeline_root),
                   raise_on_error=True)
        error = ""
        stop = _Stop()
        with open(log_path, "w") as log, _stopped_by_signals(stop):
            progress = _Progress(out, log, verbose=verbose, names=_display_names(pkg))
            saved = sys.stdout
            sys.stdout = progress     # kfp.local prints the steps' logs and creates its log handler on stdout
            try:
                with warnings.catch_warnings(), _RunProcesses(log=log), \
                        kfp_compat.named_outputs_in_conditions() as conditions, _told_retries(progress, stop) as told:
                    if not (conditions and told):
                        progress.say(f"warning: {kfp_compat.missing()}: a step that fails is retried without a word "
                                     "and the register step may be skipped although evaluate promoted the model")
                    # Expected here: display names, caching and images have no local effect.
                    warnings.filterwarnings("ignore", message=r".*(have no effect in the current local runner|"
                                                              r"custom or non-Python base image)")
                    pipeline(**arguments)
            except RuntimeError as e:  # kfp.local: "Pipeline ... finished with status FAILURE ..."; _NotRetried
                error = _ANSI.sub("", str(e))
            except KeyboardInterrupt:
                error = "interrupted"
            finally:
                sys.stdout = saved
                progress.flush()
    new = sorted((p for p in set(pipeline_root.iterdir()) - before if p.is_dir()), key=lambda p: p.stat().st_mtime)
    interrupted = stop.signum or (signal.SIGINT if error == "interrupted" else None)
    run = LocalRun(ok=not error, wall_s=round(time.monotonic() - t0, 1), run_root=new[-1] if new else None,
                   log_path=log_path, error=error, interrupted=interrupted)
    _collect(run)
    return run


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def render_summary(run: LocalRun, console) -> None:
    """The summary table: steps, losses, faults and recovery, goodput, the gate, where things are."""
    from rich.table import Table

    s, ev, reg = run.summary, run.evaluation, run.register.get("model") or {}
    table = Table(title="goodput run --local", show_header=False, title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")               # paths are printed whole, never cut short
    if run.interrupted:
        stopped = _stopped_at(run)
        result = (f"[yellow]interrupted[/] ({signal.Signals(run.interrupted).name}): "
                  + (f"the ranks committed a checkpoint at step {stopped}, " if stopped is not None else "")
                  + "no step was retried, nothing was registered")
    else:
        result = "[green]succeeded[/]" if run.ok else f"[red]failed[/]: {run.error}"
    table.add_row("result", result)
    table.add_row("steps", _fmt(s.get("steps")))
    table.add_row("train loss (final)", _fmt(s.get("final_train_loss")))
    table.add_row("val loss (final)", _fmt(s.get("final_val_loss")))
    faults = s.get("faults") if isinstance(s.get("faults"), list) else []
    table.add_row("faults", "; ".join(
        f"{f.get('kind')}@{f.get('step')}:{f.get('rank')} -> recovered by the {f.get('layer')} layer in "
        f"{_fmt(f.get('recovered_s'), 1)} s" for f in faults) or ("none" if s else "-"))
    restarts = [f"{k.replace('restarts_', '').replace('restarts', 'total')} {s[k]}"
                for k in ("restarts", "restarts_inprocess", "restarts_injob") if k in s]
    table.add_row("restarts", ", ".join(restarts) or "-")
    table.add_row("lost steps", _fmt(s.get("lost_steps")))
    goodput, parts = s.get("goodput"), s.get("goodput_breakdown") or {}
    table.add_row("goodput", (f"{goodput:.1%}" if isinstance(goodput, (int, float)) else _fmt(goodput)) + (
        f" of {parts['wall_s']:.1f} s: " + ", ".join(f"{label} {parts[key]:.1f} s" for key, label in (
            ("productive_s", "steps kept"), ("startup_s", "startup"), ("ckpt_block_s", "checkpoint blocking"),
            ("restart_s", "restarts"), ("redone_s", "redone steps"), ("other_s", "other")))
        if "wall_s" in parts else ""))
    table.add_row("checkpoints", f"{_fmt(s.get('checkpoints_committed'))} committed; {_fmt(s.get('ckpt_saves'))} "
                                 f"saves blocked the loop {_fmt(s.get('ckpt_block_s_p50'), 3)} s each (median, "
                                 f"max {_fmt(s.get('ckpt_block_s_max'), 3)} s, final save included)")
    best = ev.get("best") or {}
    table.add_row("best checkpoint", f"step {best.get('step')}, val loss {_fmt(best.get('val_loss'))}" if best else "-")
    promoted = run.evaluate.get("promoted")
    gate = ev.get("gate") or {}
    decision = "-" if promoted is None else ("[green]yes[/]" if promoted else "[yellow]no[/]")
    if gate.get("reason"):
        decision += f" ({gate['reason']})"
    table.add_row("promoted?", decision)
    if reg:
        table.add_row("registered", f"{reg.get('version')} -> {reg.get('model_uri')}")
    table.add_row("wall time", f"{run.wall_s:.0f} s")
    table.add_row("run directory", _fmt((run.train.get("model") or {}).get("run_dir")))
    table.add_row("report", _fmt(ev.get("report_path") or (run.evaluate.get("report") or {}).get("uri")))
    table.add_row("log", _fmt(run.log_path))
    console.print(table)
    report = ev.get("report_path") or (run.evaluate.get("report") or {}).get("uri")
    if report:
        console.print(f"report: {report}", soft_wrap=True)


def _stopped_at(run: LocalRun) -> int | None:
    """The step the ranks committed when an interrupt stopped training (the train step wrote no outputs)."""
    runs = layout.runs_dir(Path(run.run_root).parent.parent) if run.run_root else None
    ends = []
    for events in (map(layout.events_path, runs.iterdir()) if runs and runs.is_dir() else []):
        ends += [e for e in read_events(events) if e["event"] == Event.EXIT and e["t"] >= time.time() - run.wall_s]
    return max(ends, key=lambda e: e["t"])["step"] if ends else None


def run_local_cli(*, params, params_file, inject_faults, fsx_root: Path, package: Path | None,
                  verbose: bool = False) -> int:
    """``goodput run --local``: arguments checked before anything runs, the run, its summary; exit code."""
    from rich.console import Console

    from pipelines.compile import compile_pipeline
    from pipelines.params import check_arguments, check_settings, load_pipeline_spec, merge_values

    console = Console()
    with tempfile.TemporaryDirectory(prefix="goodput-local-") as tmp:
        # Everything is checked before anything is created: a bad value is one line (ParamError), exit 2.
        given = merge_values(params, params_file)
        if inject_faults:
            given["inject_fault"] = ",".join(inject_faults)
        pkg = package or compile_pipeline(Path(tmp) / "pipeline.yaml", backend="local")
        spec = load_pipeline_spec(pkg)
        # dataset_source is required on a cluster; here the default source fills it in.
        checked = check_arguments(spec, given, require=False)
        check_settings(spec, local_arguments(fsx_root, checked, with_source=False), reachable=True)
        arguments = local_arguments(fsx_root, checked)
        console.print(f"[bold]goodput run --local[/]: FSx stand-in {arguments['fsx_root']}, dataset "
                      f"{arguments['dataset_name']}/{arguments['dataset_version']} from {arguments['dataset_source']}"
                      + (f", faults {arguments['inject_fault']}" if arguments.get("inject_fault") else ""))
        run = run_local(arguments, pipeline_root=Path(arguments["fsx_root"]) / "pipeline-root", package=pkg,
                        verbose=verbose)
    render_summary(run, console)
    if run.interrupted:
        return 128 + run.interrupted
    return 0 if run.ok else 1
