"""Warm start (``python -m trainer.warmstart``): ranks forked from a zygote behave, to whoever started them,
exactly like ranks started cold: exit status and death by signal pass through, signals reach the rank,
a rank never outlives the process its launcher supervises, and without a zygote the rank starts cold.

One rank, no launcher (the launcher-driven paths run in test_recovery.py and test_resume.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from trainer import warmstart
from trainer.events import read_events
from trainer.layout import checkpoints_dir, committed_steps, replica_dir
from trainer.signals import in_process_group, is_gone
from trainer.warmstart import ENV

from .conftest import TINY


def _trainer(dataset: Path, out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "--data", str(dataset), *TINY, "--out", str(out),
            "--restart-layers", "injob", *args]


def _warm(dataset: Path, out: Path, *args: str) -> subprocess.Popen:
    log = open(out.parent / "log", "ab")
    return subprocess.Popen([sys.executable, "-m", "trainer.warmstart", *_trainer(dataset, out, *args)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(out: Path, proc: subprocess.Popen, predicate, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for e in read_events(out / "events.jsonl"):
            if predicate(e):
                return e
        assert proc.poll() is None, (out.parent / "log").read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"timed out; log:\n{(out.parent / 'log').read_text()[-3000:]}")


def _group(pgid: int) -> list[str]:
    """Command lines of the processes in process group ``pgid``, multiprocessing's resource tracker aside."""
    found = []
    for p in in_process_group(pgid):
        with contextlib.suppress(psutil.Error):
            found.append(" ".join(p.cmdline()))
    return [cmd for cmd in found if "resource_tracker" not in cmd]


def _until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _gone(pid: int, timeout: float) -> bool:
    """The process ended (a zombie counts: once the zygote is gone, only init may reap it)."""
    return _until(lambda: is_gone(pid), timeout)


def _training(dataset: Path, out: Path, cleanup) -> tuple[subprocess.Popen, dict]:
    """A long warm-started run, once it has done 2 steps; returns it and its worker_start event."""
    proc = _warm(dataset, out, "--max-steps", "100000", "--ckpt-every", "0")
    cleanup(proc)
    start = _wait_for(out, proc, lambda e: e["event"] == "worker_start")
    _wait_for(out, proc, lambda e: e["event"] == "step" and e["step"] >= 2)
    return proc, start


def _proxy(wrapper: subprocess.Popen) -> int:
    """The process the launcher started (here the wrapper, standing for it): the forked rank's proxy."""
    children = map(int, Path(f"/proc/{wrapper.pid}/task/{wrapper.pid}/children").read_text().split())
    (proxy,) = [c for c in children if b"trainer.zygote" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    return proxy


@pytest.fixture
def cleanup():
    procs: list[subprocess.Popen] = []
    yield procs.append
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_a_forked_rank_that_dies_of_sigkill_ends_the_command_the_same_way(tmp_path, dataset, cleanup):
    out = tmp_path / "run"
    proc = _warm(dataset, out, "--max-steps", "6", "--ckpt-every", "2", "--inject-fault", "kill@3:0")
    cleanup(proc)
    assert proc.wait(timeout=300) == -signal.SIGKILL
    events = read_events(out / "events.jsonl")
    (start,) = [e for e in events if e["event"] == "worker_start"]
    assert start["warm"] is True and start["pid"] != proc.pid
    assert [e["kind"] for e in events if e["event"] == "fault_injected"] == ["kill"]
    assert _gone(start["pid"], 5)
    # NVRx's checkpoint helpers (they ignore SIGTERM and outlive a killed parent) went with the rank.
    assert _until(lambda: not _group(start["pid"]), 5), _group(start["pid"])


def test_sigterm_reaches_the_forked_rank_which_checkpoints_and_exits_0(tmp_path, dataset, cleanup):
    out = tmp_path / "run"
    proc, start = _training(dataset, out, cleanup)
    proc.send_signal(signal.SIGTERM)          # wrapper -> proxy -> forked rank
    assert proc.wait(timeout=120) == 0
    (stop,) = [e for e in read_events(out / "events.jsonl") if e["event"] == "exit"]
    assert stop["reason"] == "sigterm" and committed_steps(out / "checkpoints") == [stop["step"]]
    assert start["warm"] is True and _gone(start["pid"], 5)


def test_a_forked_rank_dies_with_its_proxy(tmp_path, dataset, cleanup):
    """The launcher SIGKILLs the process it started (its proxy); the rank must not live on."""
    out = tmp_path / "run"
    proc, start = _training(dataset, out, cleanup)
    proxy = _proxy(proc)
    assert proxy != start["pid"]
    os.kill(proxy, signal.SIGKILL)
    assert _gone(start["pid"], 10), "the forked rank outlived its proxy"
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert _until(lambda: not _group(start["pid"]), 5), _group(start["pid"])   # nor did its NVRx helpers


def test_the_proxy_hands_the_rank_over_without_importing_torch(tmp_path, dataset, cleanup):
    """What a warm start saves is each rank's import of torch (seconds): the proxy hands its arguments over
    before parsing them (their check builds the model spec, which imports torch); the fork parses them."""
    out = tmp_path / "run"
    proc, start = _training(dataset, out, cleanup)
    maps = Path(f"/proc/{_proxy(proc)}/maps").read_text()
    assert "libtorch" not in maps and start["warm"] is True


def test_bad_arguments_fail_in_the_fork_as_they_would_cold(tmp_path, dataset, cleanup):
    out = tmp_path / "run"
    proc = _warm(dataset, out, "--max-steps", "-3")
    cleanup(proc)
    assert proc.wait(timeout=120) == 2
    assert "error: " in (tmp_path / "log").read_text() and not (out / "events.jsonl").exists()


def test_the_write_results_manager_is_forked_with_the_rank_and_ignores_sigterm(tmp_path, dataset, cleanup):
    """NVRx would spawn the manager of its write-results queue: a fresh interpreter that imports torch when
    the first write result reaches it, seconds of CPU after every in-job restart (and a final save waiting
    for them). A warm rank forks it, everything imported. Like the writers it ignores SIGTERM, which the
    launcher sends to the whole group, so a final checkpoint written after SIGTERM can still report."""
    out = tmp_path / "run"
    _, start = _training(dataset, out, cleanup)
    rank = start["pid"]

    def cmdline(pid: int) -> bytes:
        return Path(f"/proc/{pid}/cmdline").read_bytes()

    children = [int(c) for c in Path(f"/proc/{rank}/task/{rank}/children").read_text().split()]
    spawned = [c for c in children if b"spawn_main" in cmdline(c)]
    (manager,) = [c for c in children if cmdline(c) == cmdline(rank)]
    assert len(spawned) == 1, [cmdline(c) for c in children]     # the writer only
    ignored = int(next(line for line in Path(f"/proc/{manager}/status").read_text().splitlines()
                       if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGTERM - 1))


def test_a_forked_rank_is_in_its_own_process_group_before_the_zygote_goes_on(monkeypatch):
    """The zygote ends a run by ending its ranks' process groups. A child that the scheduler had not yet run
    to its own ``setpgid`` was still in the zygote's group: not found, it lived on, and so did the manager it
    forked, re-parented to init. Here the child is held before that call while the zygote looks."""
    real_setpgid, zygote = os.setpgid, os.getpid()
    held_r, held_w = os.pipe()

    def held_in_the_child(pid: int, pgrp: int) -> None:
        if os.getpid() != zygote:
            os.read(held_r, 1)
            os._exit(0)
        real_setpgid(pid, pgrp)

    monkeypatch.setattr(os, "setpgid", held_in_the_child)
    monkeypatch.setattr(warmstart, "_fork_unsafe", lambda: None)   # pytest's own threads
    proxy, conn = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    socket.send_fds(proxy, [json.dumps({"proxy": os.getpid()}).encode()], [0, 1, 2])
    pid = warmstart._fork_child(conn, warmstart.ChildRun(lambda: None, lambda argv: 0), close_in_child=())
    try:
        assert pid is not None and os.getpgid(pid) == pid
    finally:
        os.write(held_w, b"x")
        os.waitpid(pid, 0)
        for s in (proxy, conn):
            s.close()


def test_without_a_zygote_the_rank_starts_cold(tmp_path, dataset):
    out = tmp_path / "run"
    r = subprocess.run(_trainer(dataset, out, "--max-steps", "2", "--ckpt-every", "0"), capture_output=True,
                       text=True, timeout=300, env={**os.environ, ENV: str(tmp_path / "no-zygote.sock")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warm start: no zygote answered; starting cold" in r.stderr
    (start,) = [e for e in read_events(out / "events.jsonl") if e["event"] == "worker_start"]
    assert start["warm"] is False


# The node's place in the job: the wrapper's own options, never read from the launcher's command ------------

_SHOW_PEER_ENV = "import os; print(os.environ.get('GOODPUT_PEER_JOB'), os.environ.get('GOODPUT_PEER_STORE'))"


def _wrapped(tmp_path: Path, wrapper_options: list[str], launcher_flags: list[str], env: dict):
    """``python -m trainer.warmstart --cold OPTIONS`` running a stand-in launcher with ``launcher_flags`` (it
    prints the peer daemon's job and address it was given, and exits), for a trainer with memory snapshots."""
    command = [sys.executable, "-c", _SHOW_PEER_ENV, *launcher_flags, "-m", "trainer", "--out", str(tmp_path / "run"),
               "--memory-snapshot-dir", str(tmp_path / "shm")]
    return subprocess.run([sys.executable, "-m", "trainer.warmstart", "--cold", *wrapper_options, *command],
                          capture_output=True, text=True, timeout=120, env=env)


def test_the_wrapper_takes_the_nodes_place_from_its_options_not_from_the_launchers_flags(tmp_path):
    """The launcher's flags here say otherwise than the wrapper's options: a scan of the command would run no peer
    daemon (one node), or one for the wrong job on the wrong interface."""
    from trainer.peer import JOB_ENV, SECRET_ENV

    env = {k: v for k, v in os.environ.items() if k not in (JOB_ENV, SECRET_ENV)}
    scanned = ["--nnodes", "1", "--rdzv-endpoint", "10.9.9.9:29500", "--rdzv-id", "scanned"]
    given = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "given"]
    # Two nodes: no peer snapshots without the job's secret (refused before anything starts).
    refused = _wrapped(tmp_path, given, scanned, env)
    assert refused.returncode == 2 and "GOODPUT_PEER_SECRET" in refused.stderr, refused.stderr
    # With it: the peer daemon serves the given job, on loopback (the given rendezvous is).
    ran = _wrapped(tmp_path, given, scanned, {**env, SECRET_ENV: "ab" * 32})
    assert ran.returncode == 0, ran.stderr
    job, store = ran.stdout.split()
    assert job == "given" and store.startswith("127.0.0.1:")
    # The defaults are one node: no peer daemon, whatever the launcher's flags say. The node's memory snapshots
    # go with the run (the zygote is told where they are).
    snapshots = replica_dir(tmp_path / "shm", checkpoints_dir(tmp_path / "run"))
    snapshots.mkdir(parents=True)
    (snapshots / "rank0").write_bytes(b"state")
    alone = _wrapped(tmp_path, [], given, env)
    assert alone.returncode == 0 and alone.stdout.split() == ["None", "None"], alone.stderr
    assert not snapshots.exists()
