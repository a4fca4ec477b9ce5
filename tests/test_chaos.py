"""Stop (SIGSTOP) or kill (SIGKILL) one process of a local run's tree at a random moment: every kind of
process the run has (the launch wrapper, the launcher, the warm-start zygote, a rank's proxy, a rank, its
rank monitor, its checkpoint writer, its write-results manager). Each run either ends with the fault-free
run's weights or fails with a line that names what hung or died, within a bound; none waits forever, and
none leaves a process behind. A run that ends before its fault (even by crashing), or that has no process of
the kind, fails the test: it would prove nothing.

The sweep here is one signal per kind (alternating with the seed); ``GOODPUT_CHAOS_SEEDS=0,1,2,...`` runs
more seeds (each seed flips which kinds are stopped and which killed, and moves the moments).
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from .conftest import STEPS, marked, until

KINDS = ("wrapper", "launcher", "zygote", "proxy", "rank", "rank monitor", "writer", "manager")
SEEDS = [int(s) for s in os.environ.get("GOODPUT_CHAOS_SEEDS", "0").split(",")]
BOUND_S = 240            # from the fault to the end of the run, whatever happened
# What a run that cannot recover says about it (one of these lines names the process).
REASONS = ("was stopped for", "is gone", "did not answer", "stopped answering", "died of", "did not report",
           "killed it")


def _processes(mark: str) -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of the run's processes."""
    found = {}
    for pid in marked(mark):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            found[pid] = (ppid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, IndexError, ValueError):
            continue
    return found


def _of_kind(kind: str, procs: dict[int, tuple[int, str]], ranks: set[int]) -> list[int]:
    forks = {p for p, (ppid, _) in procs.items() if ppid in ranks}   # a warm rank's forked manager
    launchers = [p for p, (ppid, cmd) in procs.items()
                 if "fault_tolerance.launcher" in cmd and "trainer.warmstart" in procs.get(ppid, (0, ""))[1]]
    pick = {
        "wrapper": lambda p, cmd: "trainer.warmstart" in cmd,
        "launcher": lambda p, cmd: p in launchers,
        "rank monitor": lambda p, cmd: procs[p][0] in launchers and cmd == procs[procs[p][0]][1],
        "zygote": lambda p, cmd: "trainer.zygote" in cmd and p not in ranks and p not in forks,
        "proxy": lambda p, cmd: procs[p][0] in launchers and "-m trainer " in cmd + " " and p not in ranks,
        "rank": lambda p, cmd: p in ranks,
        "writer": lambda p, cmd: procs[p][0] in ranks and "multiprocessing" in cmd and "resource_tracker" not in cmd,
        # .get: a rank that just ended is no longer listed, while its manager still is.
        "manager": lambda p, cmd: procs[p][0] in ranks and cmd == procs.get(procs[p][0], (0, ""))[1],
    }[kind]
    return sorted(p for p, (_, cmd) in procs.items() if pick(p, cmd))


@pytest.mark.timeout(BOUND_S + 200)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_stopped_or_killed_process_is_recovered_or_named(train, clean_sha, kind, seed):
    rng = random.Random(f"{kind}/{seed}")
    sig = (signal.SIGSTOP, signal.SIGKILL)[(KINDS.index(kind) + seed) % 2]
    run = train(*STEPS, "--memory-snapshot-every-s", "0.3", "--ft-ipc-timeout-s", "5",
                "--max-restarts", "3", "--step-timeout-s", "6", "--workload-check-interval-s", "0.5")
    at_step = rng.randint(2, 10)
    assert until(lambda: any(e["event"] == "step" and e["step"] >= at_step for e in run.events())
                 or run.proc.poll() is not None, 180), f"the run did not reach step {at_step}\n{run.output()}"
    victims: list[int] = []

    def find_victims() -> bool:
        ranks = {e["pid"] for e in run.events() if e["event"] == "worker_start"}
        victims[:] = _of_kind(kind, _processes(run.mark), ranks)
        return bool(victims) or run.proc.poll() is not None

    # A run that ended before its fault, or one without this kind of process, proves nothing: it fails.
    assert until(find_victims, 60) and run.proc.poll() is None, \
        f"no {kind} to signal at step {at_step}: the run " + \
        (f"ended (exit {run.proc.returncode}) before its fault" if run.proc.poll() is not None else
         f"has none after 60 s; its processes: {_processes(run.mark)}") + f"\n{run.output()}"
    victim = rng.choice(victims)
    os.kill(victim, sig)
    t0 = time.monotonic()
    assert until(lambda: run.proc.poll() is not None, BOUND_S), \
        f"{sig.name} of the {kind} (pid {victim}): the run did not end within {BOUND_S}s\n{run.output()}"
    took = time.monotonic() - t0
    if run.proc.returncode == 0:
        assert run.summary_sha() == clean_sha("fsdp"), run.output()
    else:
        # The reason is said once, where the first rank failed: the restarts that fail after it follow it.
        assert any(r in run.output(tail=None) for r in REASONS) or run.proc.returncode == -signal.SIGKILL and \
            kind == "wrapper", f"{sig.name} of the {kind}: exit {run.proc.returncode} with no reason\n{run.output()}"
    if sig == signal.SIGSTOP:
        os.kill(victim, signal.SIGCONT) if victim in marked(run.mark) else None
    assert until(lambda: not marked(run.mark), 30), _processes(run.mark)
    print(f"{sig.name} {kind} at step {at_step}: exit {run.proc.returncode} after {took:.1f}s")
