"""Helpers shared by the benchmarks: run ``goodput train``'s launcher on this machine and read results."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from trainer import layout
from trainer.data import ensure_default_dataset
from trainer.events import read_events
from trainer.launch import LaunchConfig, local_launcher_command


def import_from_repo() -> None:
    """Let a bench, run as a script (``python bench/X.py``), import what the package does not install: the
    repository's test stand-ins (``tests.s3_stand_in``)."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)


WORKDIR_HELP = "where the runs go, kept (default: a temporary directory, removed unless the bench fails)"


@contextlib.contextmanager
def workdir(given: Path | None, prefix: str) -> Iterator[Path]:
    """Where a bench's runs go: ``given``, kept; else a new temporary directory, removed once the bench ends well
    (its runs' checkpoints are gigabytes) and kept, with a line saying where, when it fails: its logs say why."""
    if given is not None:
        yield given
        return
    root = Path(tempfile.mkdtemp(prefix=prefix))
    failed = True
    try:
        yield root
        failed = False
    except SystemExit as e:
        failed = e.code not in (None, 0)
        raise
    finally:
        if failed:
            print(f"the runs are kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


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
