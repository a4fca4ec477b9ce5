"""Helpers shared by the benchmarks: run ``goodput train``'s launcher on this machine and read results."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainer import layout
from trainer.data import ensure_default_dataset
from trainer.events import read_events
from trainer.launch import LaunchConfig, local_launcher_command


def dataset(root: Path) -> Path:
    return ensure_default_dataset(root / "fsx")


def train(out: Path, args: list[str], launch: LaunchConfig | None = None, launcher: list[str] | None = None,
          timeout: float = 1800) -> tuple[int, float]:
    """Run one training to completion (ft_launcher by default, or the given launcher argv prefix);
    return (exit code, wall seconds). Output goes to ``<out>.log``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = (local_launcher_command(launch or LaunchConfig(), args) if launcher is None
           else [*launcher, "-m", "trainer", *args])
    t0 = time.monotonic()
    with open(f"{out}.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            code = proc.wait(timeout)
        finally:
            wall = time.monotonic() - t0
            # What a killed rank leaves behind (with torchrun or --no-warm-start, its checkpoint writer
            # processes outlive it) would take CPU from the runs measured after this one.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return code, wall


def summary(out: Path) -> dict:
    return json.loads(layout.summary_path(out).read_text())


def events(out: Path) -> list[dict]:
    return read_events(layout.events_path(out))


def torchrun(nproc: int, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1"]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])
