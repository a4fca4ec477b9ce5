"""Stopping ``goodput train`` from outside: Ctrl-C (SIGINT to its process group, as a terminal sends it) and
SIGTERM stop the run within seconds with a committed checkpoint and exit 130 / 143; SIGKILL of its process
group leaves no process of the run and no memory snapshot in /dev/shm."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from trainer.layout import committed_steps

from .conftest import marked, until


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_commits_a_checkpoint_and_exits_128_plus_the_signal(train, sig, code):
    run = train("--max-steps", "100000", "--ckpt-every", "0", "--memory-snapshot-every-s", "0.5")
    run.wait_for("memory_snapshot")
    assert run.replica().is_dir()
    t0 = time.monotonic()
    if sig == signal.SIGINT:
        os.killpg(run.proc.pid, sig)      # what a terminal's Ctrl-C does
    else:
        run.proc.send_signal(sig)
    assert run.proc.wait(timeout=60) == code, run.output()
    stopped_s = time.monotonic() - t0
    (stop,) = [e for e in run.events() if e["event"] == "exit"]
    # Every rank stopped at the same step and that step is committed; no step ran after it.
    assert stop["reason"] == "sigterm" and committed_steps(run.out / "checkpoints") == [stop["step"]]
    assert max(e["step"] for e in run.events() if e["event"] == "step") == stop["step"]
    assert not (run.out / "summary.json").exists()
    assert f"interrupted ({sig.name})" in run.output()
    assert f"committed a checkpoint at step {stop['step']}" in run.output()
    assert until(lambda: not marked(run.mark), 15), marked(run.mark)
    assert not run.replica().exists()
    assert stopped_s < 30, stopped_s


@pytest.mark.timeout(300)
def test_sigkill_of_the_process_group_leaves_no_process_and_no_memory_snapshot(train):
    run = train("--max-steps", "100000", "--ckpt-every", "5", "--memory-snapshot-every-s", "0.5")
    run.wait_for("memory_snapshot")
    assert until(lambda: len(marked(run.mark)) > 8, 30)    # launcher, zygote, proxies, ranks, helpers
    os.killpg(run.proc.pid, signal.SIGKILL)
    assert run.proc.wait(timeout=10) == -signal.SIGKILL
    # The launcher's tree is in a session of its own; it dies with its parent all the same.
    assert until(lambda: not marked(run.mark), 30), [Path(f"/proc/{p}/cmdline").read_bytes()[:200]
                                                     for p in marked(run.mark)]
    assert not run.replica().exists()
