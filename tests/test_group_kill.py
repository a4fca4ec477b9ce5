"""SIGKILL of ``goodput train``'s process group (a job runner's kill, a closed terminal's last resort): nothing of
the run outlives it by more than 2 s, not even what lives in a process group or session of its own (the launch
wrapper, the zygote, ft_launcher's workers and the ranks forked for them, the ranks' checkpoint writers), and
nothing it kept outside its run directory is left (its memory snapshots, the wrapper's socket)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from trainer.signals import alive
from trainer.warmstart import ENV as WARMSTART_SOCKET_ENV

from .conftest import until

GONE_WITHIN_S = 2.0


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} pgid={os.getpgid(p.pid)} ppid={p.ppid()} {' '.join(p.cmdline())[:160]}")
        except (psutil.Error, OSError):
            out.append(f"{p.pid} (gone meanwhile)")
    return out


def _env(p: psutil.Process, name: str) -> str | None:
    with contextlib.suppress(psutil.Error):
        return p.environ().get(name)
    return None


@pytest.mark.timeout(300)
def test_nothing_of_the_run_is_alive_2_s_after_a_group_sigkill(train):
    run = train("--nproc", "2", "--max-steps", "100000", "--ckpt-every", "3", "--memory-snapshot-every-s", "0.5")
    # Training runs and each rank's checkpoint writer has taken a checkpoint (so it exists), with a memory
    # snapshot beside it.
    run.wait_for("ckpt_committed")
    run.wait_for("memory_snapshot")
    tree: list[psutil.Process] = []
    seen: dict[int, tuple[str, int]] = {}     # pid -> (command line, process group) of each process of the run

    def record() -> bool:
        """The whole tree, once each rank's checkpoint writer is in it (rank 1's may start a step later)."""
        tree[:] = psutil.Process(run.proc.pid).children(recursive=True)
        seen.clear()
        for p in tree:
            with contextlib.suppress(psutil.Error, OSError):    # a short-lived helper may be gone already
                seen[p.pid] = (" ".join(p.cmdline()), os.getpgid(p.pid))
        return sum("multiprocessing.spawn" in c for c, _ in seen.values()) >= 2

    assert until(record, 60), seen
    assert any("trainer.zygote" in c for c, _ in seen.values()), seen
    sockets = {_env(p, WARMSTART_SOCKET_ENV) for p in tree} - {None}     # what the launcher's children were given
    assert len(sockets) == 1, sockets
    socket_dir = Path(sockets.pop()).parent
    assert socket_dir.is_dir() and run.replica().is_dir()
    # Most of the run is outside the group the kill reaches: only their ties to their parents end them.
    assert sum(pgid != run.proc.pid for _, pgid in seen.values()) > 1, seen

    os.killpg(run.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert run.proc.wait(timeout=10) == -signal.SIGKILL
    left = alive(tree)
    while left and time.monotonic() - killed < GONE_WITHIN_S:
        time.sleep(0.05)     # a bounded poll: the kernel tears the processes down meanwhile
        left = alive(left)
    assert not left, f"{len(left)} of {len(tree)} processes alive {GONE_WITHIN_S:g} s after the kill: " \
                     f"{_describe(left)}"
    # The zygote removes them once the wrapper is gone (the pipe it holds from it closes).
    assert until(lambda: not socket_dir.exists() and not run.replica().exists(), 10), \
        f"left behind: {[d for d in (socket_dir, run.replica()) if d.exists()]}"
