"""``trainer.signals``' process helpers on real processes: handlers swapped in and back, a stopped process told
from a running one, and the reaper's SIGTERM-then-SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from trainer.signals import StoppedFor, alive, handlers, is_gone, is_stopped, marked, reap

# Ignores SIGTERM (as NVRx's checkpoint helpers do), says so, then waits.
STUBBORN = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); " \
           "time.sleep(600)"


def _start(code: str, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, **kw)
    assert proc.stdout.readline() == b"1\n"      # its handlers are in place
    return proc


def _until(condition, timeout: float = 30.0) -> bool:
    """Poll ``condition`` (what the kernel does asynchronously) for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_handlers_are_swapped_in_for_the_block_and_restored_even_on_error():
    def mine(*_):
        pass

    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    try:
        with handlers({signal.SIGUSR1: mine, signal.SIGUSR2: signal.SIG_IGN}) as installed:
            assert installed and signal.getsignal(signal.SIGUSR1) is mine
            raise KeyError
    except KeyError:
        pass
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before


def test_handlers_outside_the_main_thread_change_nothing():
    seen = []

    def body():
        with handlers({signal.SIGUSR1: signal.SIG_IGN}) as installed:
            seen.append((installed, signal.getsignal(signal.SIGUSR1)))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [(False, signal.SIG_DFL)]


def test_a_stopped_process_is_hung_only_after_the_limit_and_not_once_continued():
    proc = _start(STUBBORN)
    try:
        hung = StoppedFor(limit_s=0.0)
        assert not is_stopped(proc.pid) and not hung(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        assert _until(lambda: is_stopped(proc.pid))
        assert not StoppedFor(limit_s=600.0)(proc.pid)
        hung(proc.pid)                        # the first sighting starts the clock
        assert hung(proc.pid)
        os.kill(proc.pid, signal.SIGCONT)
        assert _until(lambda: not is_stopped(proc.pid)) and not hung(proc.pid)
        assert not is_gone(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert is_gone(proc.pid)


def test_reap_kills_what_ignores_sigterm_after_the_grace_and_finds_marked_processes():
    env = {**os.environ, "GOODPUT_TEST_REAP": str(os.getpid())}
    procs = [_start(STUBBORN, env=env) for _ in range(2)]
    try:
        found = marked("GOODPUT_TEST_REAP", str(os.getpid()))
        assert sorted(p.pid for p in found) == sorted(p.pid for p in procs)
        sent = []
        left = reap(found, grace_s=0.2, on_signal=lambda p, s: sent.append(s))
        assert left == [] and alive(found) == []
        assert sent == [signal.SIGTERM] * 2 + [signal.SIGKILL] * 2   # SIGTERM alone did not end them
    finally:
        for p in procs:
            p.kill()
            p.wait()


# One attempt of a rank's loop (``trainer.recovery``) that fails, as when a peer is lost, once the parent has
# had its say: SIGTERM (argv[2] == "term") or nothing.
FAILING_LOOP = """
import sys, time
from trainer.events import EventLog
from trainer.ft import FTManager
from trainer.recovery import Recovery
from trainer.signals import SigtermFlag

recovery = Recovery(FTManager(1, 1.0), SigtermFlag.install(), call_wrapper=object(),
                    events=EventLog(sys.argv[1], rank=0), is_main=True)
try:
    with recovery.loop(first_step=1):
        print(1, flush=True)
        sys.stdin.readline()                  # the parent has signalled, or not
        while sys.argv[2] == "term" and not recovery.stop_requested:
            time.sleep(0.001)                 # the handler runs between bytecodes
        raise RuntimeError("a peer was lost")
except RuntimeError:
    print("restarting", flush=True)
"""


@pytest.mark.parametrize("term", [True, False])
def test_a_stop_signal_the_loop_did_not_act_on_ends_the_rank_when_it_fails_over(tmp_path, term):
    proc = subprocess.Popen([sys.executable, "-c", FAILING_LOOP, str(tmp_path / "events.jsonl"),
                             "term" if term else "none"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"1\n"       # in the loop, its handler in place
        if term:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(b"\n", timeout=60)
    finally:
        proc.kill()
        proc.wait()
    # Stopped by its launcher, the rank does not wait in a restart for peers that are stopping too.
    assert (proc.returncode, out) == ((-signal.SIGTERM, b"") if term else (0, b"restarting\n"))
