"""The command that starts the trainer's processes: NVRx ``ft_launcher`` running ``python -m trainer``.

One builder serves both faces: ``goodput train`` runs it on this machine (``--standalone``), and the
PyTorchJob builder puts it into every pod (c10d rendezvous on the master service). Only flags that
nvidia-resiliency-ext 0.4.1 and later releases all accept are used (no ``--ft-param-*``, no
``--ft-restart-policy=min-healthy``). This module imports no torch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import parse_config
from .data import default_dataset_dir, ensure_default_dataset


@dataclass
class LaunchConfig:
    """How the worker group is started and when ft_launcher restarts it."""

    nproc_per_node: int = field(default=2, metadata={"help": "worker processes per node (GPUs per node)"})
    nnodes: int = field(default=1, metadata={"help": "nodes in the job"})
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
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise ValueError(f"need at least one node and one process per node, got nnodes={self.nnodes} "
                             f"nproc_per_node={self.nproc_per_node}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must not be negative, got {self.max_restarts}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("a multi-node job needs rdzv_endpoint (host:port of the rendezvous)")
        return self


def launcher_command(launch: LaunchConfig, trainer_args: list[str], *, executable: str | None = None) -> list[str]:
    """ft_launcher argv that runs ``python -m trainer <trainer_args>`` on one node (behind
    ``python -m trainer.warmstart`` unless ``launch.warm_start`` is off).

    Args:
        launch: worker group and fault-tolerance settings.
        trainer_args: arguments of ``python -m trainer``.
        executable: Python interpreter for a local run (the launcher module runs under it); None means
            the ``ft_launcher`` entry point on PATH, as in the trainer image.
    """
    launch.validate()
    head = [executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher"] if executable else ["ft_launcher"]
    if launch.warm_start:
        head = [executable or "python", "-m", "trainer.warmstart", *head]
    rdzv = (["--standalone"] if not launch.rdzv_endpoint else
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id])
    sections = (f"setup:{launch.setup_timeout_s:g},step:{launch.step_timeout_s:g},"
                f"checkpoint:{launch.checkpoint_timeout_s:g}")
    return [
        *head,
        "--nnodes", str(launch.nnodes),
        "--nproc-per-node", str(launch.nproc_per_node),
        *rdzv,
        "--max-restarts", str(launch.max_restarts),
        "--monitor-interval", f"{launch.monitor_interval_s:g}",
        "--term-timeout", f"{launch.term_timeout_s:g}",
        "--workers-stop-timeout", f"{launch.workers_stop_timeout_s:g}",
        "--ft-workload-check-interval", f"{launch.workload_check_interval_s:g}",
        "--ft-rank-section-timeouts", sections,
        "--ft-rank-out-of-section-timeout", f"{launch.out_of_section_timeout_s:g}",
        "-m", "trainer",
        *trainer_args,
    ]


def local_launcher_command(launch: LaunchConfig, trainer_args: list[str]) -> list[str]:
    """The same command for this machine: the launcher runs under this interpreter."""
    return launcher_command(launch, trainer_args, executable=sys.executable)


def run_local_training(trainer_args: list[str], launch: LaunchConfig, fsx_root: Path) -> tuple[int, dict | None]:
    """Validate, build the default dataset if needed, launch, wait; return (exit code, summary or None).

    The core of ``goodput train`` without click, used by the local training backend too.
    """
    args = list(trainer_args)
    default_data = "--data" not in args
    if default_data:
        args += ["--data", str(default_dataset_dir(fsx_root))]
    cfg = parse_config(args)          # a bad flag fails here, before anything is written or started
    launch.validate()
    if default_data:
        ensure_default_dataset(fsx_root)
    proc = subprocess.Popen(local_launcher_command(launch, args))

    def forward(signum, _frame):
        # The launcher forwards to its workers, which commit a checkpoint and exit.
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    summary_path = Path(cfg.run.out) / "summary.json"
    summary = json.loads(summary_path.read_text()) if code == 0 and summary_path.exists() else None
    return code, summary
