"""The command that starts the trainer's processes: NVRx ``ft_launcher`` running ``python -m trainer``.

One builder serves both faces: ``goodput train`` runs it on this machine (``--standalone``), and the
PyTorchJob and TrainJob builders put it into every pod (c10d rendezvous on the master service). The
launcher's options are ``compat.launcher_args``: only flags the target NVRx release accepts, with their
meaning on it. This module imports no torch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import compat
from .config import parse_config
from .data import default_dataset_dir, ensure_default_dataset
from .signals import STOP_SIGNALS, parent_death_preexec
from .warmstart import wait_unless_stopped


@dataclass
class LaunchConfig:
    """How the worker group is started and when ft_launcher restarts it."""

    # Either may be a $(VAR) placeholder that the pod's environment fills in (a TrainJob's PET_NNODES).
    nproc_per_node: int | str = field(default=2, metadata={"help": "worker processes per node (GPUs per node)"})
    nnodes: int | str = field(default=1, metadata={"help": "nodes in the job"})
    max_restarts: int = field(default=3, metadata={"help": "in-job restarts of the worker group before failing"})
    rdzv_endpoint: str = field(default="", metadata={
        "help": "host:port of the c10d rendezvous; empty = --standalone (one node, local store)"})
    rdzv_id: str = field(default="goodput", metadata={"help": "rendezvous id shared by the job's nodes"})
    # Rank-monitor timeouts (seconds). Sections are opened by the trainer; each timeout is a safe upper
    # bound for its phase, and the trainer tightens ``step`` from measured step times at run time.
    setup_timeout_s: float = field(default=600.0, metadata={"help": "init, data, resume (section 'setup')"})
    step_timeout_s: float = field(default=300.0, metadata={"help": "one training step (section 'step')"})
    checkpoint_timeout_s: float = field(default=900.0, metadata={
        "help": "a blocking checkpoint (section 'checkpoint')"})
    out_of_section_timeout_s: float = field(default=600.0, metadata={"help": "code outside any section"})
    workload_check_interval_s: float = field(default=1.0, metadata={
        "help": "how often the rank monitor checks its rank (bounds hang detection latency)"})
    monitor_interval_s: float = field(default=0.5, metadata={
        "help": "how often the launcher polls its workers (bounds dead-process detection latency)"})
    term_timeout_s: float = field(default=60.0, metadata={
        "help": "SIGTERM to SIGKILL grace when the launcher is stopped (covers the SIGTERM checkpoint)"})
    # Survivors of a restarting group have nothing to finish (the memory snapshot and the commit protocol
    # survive SIGKILL), and a hung rank cannot honour SIGTERM: the grace only delays the restart.
    workers_stop_timeout_s: float = field(default=1.0, metadata={
        "help": "SIGTERM to SIGKILL grace for surviving workers when the group is restarted"})
    warm_start: bool = field(default=True, metadata={
        "help": "fork ranks from a process that imported torch once (trainer.warmstart), so a restarted "
                "group skips the imports"})

    def validate(self) -> "LaunchConfig":
        counts = {"nnodes": self.nnodes, "nproc_per_node": self.nproc_per_node}
        known = {k: compat.count(v, k) for k, v in counts.items() if not compat.is_placeholder(v)}
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must not be negative, got {self.max_restarts}")
        if known.get("nnodes", 2) > 1 and not self.rdzv_endpoint:   # a placeholder may be many nodes
            raise ValueError("a multi-node job needs rdzv_endpoint (host:port of the rendezvous)")
        return self


def launcher_command(launch: LaunchConfig, trainer_args: list[str], *, executable: str | None = None,
                     release: compat.Release | None = None,
                     extras: compat.LauncherExtras = compat.LauncherExtras()) -> list[str]:
    """ft_launcher argv that runs ``python -m trainer <trainer_args>`` on one node (behind
    ``python -m trainer.warmstart`` unless ``launch.warm_start`` is off).

    Args:
        launch: worker group and fault-tolerance settings.
        trainer_args: arguments of ``python -m trainer``.
        executable: Python interpreter for a local run (the launcher module runs under it); None means
            the ``ft_launcher`` entry point on PATH, as in the trainer image.
        release: the NVRx release the command is for (the trainer image's pin); None means
            ``compat.target_release()``: ``$GOODPUT_NVRX_VERSION``, else the installed one.
        extras: launcher features only some releases have (hot spares, health checks); one the release
            lacks is a ``ValueError``.
    """
    launch.validate()
    head = [executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"] if executable else ["ft_launcher"]
    # Cold too, the wrapper's zygote is the node's janitor: it ends what a killed launcher leaves behind.
    head = [executable or "python", "-m", "trainer.warmstart", *([] if launch.warm_start else ["--cold"]), *head]
    return [
        *head,
        *compat.launcher_args(launch, compat.target_release() if release is None else release, extras),
        "-m", "trainer",
        *trainer_args,
    ]


def local_launcher_command(launch: LaunchConfig, trainer_args: list[str]) -> list[str]:
    """The same command for this machine: the launcher runs under this interpreter."""
    return launcher_command(launch, trainer_args, executable=sys.executable)


class LaunchError(ValueError):
    """A run that cannot work as asked (settings, data, output directory): found before any process starts.

    It would fail the same way every time, so no layer retries it."""


def _check_writable(path: Path, what: str) -> None:
    """``path`` is, or can be created as, a writable directory (nothing is created here)."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise LaunchError(f"{what} {path} cannot be created: {existing} is not a directory")
    try:   # a probe, removed at once: permissions alone do not tell (root, read-only mounts, /proc)
        tempfile.TemporaryDirectory(dir=existing, prefix=".goodput-probe-").cleanup()
    except OSError as e:
        raise LaunchError(f"{what} {path} is not writable: cannot create anything in {existing} "
                          f"({e.strerror})") from None


def _check_dataset(data: Path, cfg) -> None:
    """The manifest exists, parses, has the format and splits the trainer reads, and each rank gets a window."""
    from .data import Split

    try:
        splits = [Split.open(data, split) for split in ("train", "val")]
    except json.JSONDecodeError as e:
        raise LaunchError(f"dataset {data}: manifest.json is not valid JSON ({e}); rebuild it with "
                          "`python -m trainer.data` or `goodput stage`") from None
    except (OSError, ValueError) as e:
        raise LaunchError(f"dataset {data}: {e}") from None
    except (KeyError, TypeError) as e:
        raise LaunchError(f"dataset {data}: manifest.json lacks {e} (is it a goodput dataset?)") from None
    if len(splits[0]) < cfg.model.seq_len + 2:
        raise LaunchError(f"dataset {data}: the train split holds {len(splits[0])} tokens, fewer than one "
                          f"sequence of {cfg.model.seq_len + 1}")


def check_faults(specs: list[str], world_size: int, max_steps: int) -> None:
    """Refuse an injected fault that could never fire: a rank the run does not have, a step after the last."""
    from .faults import Fault

    for f in map(Fault.parse, specs):
        if f.rank >= world_size:
            raise LaunchError(f"--inject-fault {f.id}: rank {f.rank} does not exist in a run of {world_size} "
                              f"rank(s) (ranks are 0..{world_size - 1})")
        if f.step > max_steps:
            raise LaunchError(f"--inject-fault {f.id}: step {f.step} comes after the last step ({max_steps})")


def validate_launch(trainer_args: list[str], launch: LaunchConfig, fsx_root: Path) -> tuple[list[str], object]:
    """Everything about a local run that can be checked before any process starts or anything is written.

    Returns the trainer arguments (with the default dataset's ``--data`` added when there is none) and the
    parsed config; raises ``LaunchError`` with one line that says what to fix.
    """
    args = list(trainer_args)
    default_data = "--data" not in args
    if default_data:
        args += ["--data", str(default_dataset_dir(fsx_root))]
    try:
        cfg = parse_config(args)
        launch.validate()
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if compat.is_placeholder(launch.nproc_per_node) or compat.is_placeholder(launch.nnodes):
        raise LaunchError(f"a local run needs node and process counts, got nnodes={launch.nnodes} "
                          f"nproc_per_node={launch.nproc_per_node}")
    check_faults(cfg.faults.inject_fault, int(launch.nproc_per_node) * int(launch.nnodes), cfg.run.max_steps)
    _check_writable(Path(cfg.run.out), "--out")
    if default_data:
        if not (default_dataset_dir(fsx_root) / "manifest.json").is_file():   # to be built
            _check_writable(default_dataset_dir(fsx_root), "--fsx-root: the default dataset directory")
    else:
        _check_dataset(Path(cfg.data.data), cfg)
    return args, cfg


def run_local_training(trainer_args: list[str], launch: LaunchConfig, fsx_root: Path) -> tuple[int, dict | None]:
    """Validate, build the default dataset if needed, launch, wait; return (exit code, summary or None).

    The core of ``goodput train`` without click, used by the local training backend too. ``LaunchError``
    before anything starts. SIGINT and SIGTERM stop the run: the ranks commit a checkpoint and exit, and the
    exit code is 130 or 143 (128 + the signal) with no summary.
    """
    args, cfg = validate_launch(trainer_args, launch, fsx_root)
    if "--data" not in trainer_args:
        try:
            ensure_default_dataset(fsx_root)
        except OSError as e:
            raise LaunchError(f"cannot build the default dataset under {fsx_root}: {e}") from None
        _check_dataset(Path(cfg.data.data), cfg)
    # Its own session: a terminal's Ctrl-C reaches this process only, which stops the run once, with SIGTERM
    # (ft_launcher would pass SIGINT on to every process group of its workers, where NVRx's helpers die of
    # it). The launcher's tree dies with this process, whatever ends it: SIGTERM, so the ranks checkpoint.
    proc = subprocess.Popen(local_launcher_command(launch, args), start_new_session=True,
                            preexec_fn=parent_death_preexec(signal.SIGTERM))
    stopped_by: list[int] = []

    def stop(signum, _frame):
        if not stopped_by:
            stopped_by.append(signum)
            proc.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        code = wait_unless_stopped(proc, "goodput train: the launch wrapper")
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if stopped_by:
        return 128 + stopped_by[0], None
    if code < 0:
        print(f"goodput train: the launch wrapper (pid {proc.pid}) died of {signal.Signals(-code).name}",
              file=sys.stderr)
        code = 128 - code
    summary_path = Path(cfg.run.out) / "summary.json"
    summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else None
    return code, summary


def last_stop(trainer_args: list[str], since: float) -> int | None:
    """The step of the checkpoint the ranks committed when a stop signal ended their run after ``since``
    (wall clock), from ``--out``'s events; None if they were stopped before they trained."""
    from .events import read_events

    try:
        out = Path(parse_config(trainer_args + (["--data", "-"] if "--data" not in trainer_args else [])).run.out)
    except ValueError:
        return None
    exits = [e for e in read_events(out / "events.jsonl") if e["event"] == "exit" and e["t"] >= since]
    return exits[-1]["step"] if exits else None
