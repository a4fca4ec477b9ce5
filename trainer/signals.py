"""Process lifecycle: stop signals as a flag the loop checks once per step, processes that die with their
parent, and what every supervisor uses to swap signal handlers, spot a stopped process and end a run's processes.

SIGTERM (spot reclaim, pod eviction, launcher shutdown) and SIGINT (Ctrl-C reaching a rank run by
hand): while the training loop runs, the handler only records the signal: the loop finishes its step,
all ranks agree through the per-step all-reduce, and a final checkpoint is committed before a clean
exit. Outside the loop (setup, or an in-process restart under way) there is nothing new to save, so
they have their default action and the kernel ends the process at once: a launcher restarting the
worker group should not wait for it; a signal the loop received but had not acted on when it failed ends the
process as it fails over. A Python handler would not do: it runs only between bytecodes,
and a rank that lost a peer often waits inside a C++ call (the in-process restart's store barrier)
until the launcher's SIGKILL, which comes only after its stop timeout.

``die_with_parent``: the kernel signals a process when its parent exits (``PR_SET_PDEATHSIG``), however
the parent ended, SIGKILL included. Every process of a local run's tree that is not in its starter's
process group sets it, so none outlives the run.

``handlers`` swaps signal handlers in for a block; ``is_stopped`` and ``StoppedFor`` tell a process stopped
(SIGSTOP) from a busy one; ``marked`` and ``in_process_group`` find a run's processes, wherever they were
re-parented to, and ``reap`` ends them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from typing import Callable, Iterable, Iterator, Union

import psutil

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A helper stopped (SIGSTOP) this long counts as hung (environment, seconds): nothing waits on it forever.
STOPPED_S = float(os.environ.get("GOODPUT_STOPPED_S", "3"))
# How long a SIGKILLed process may take to disappear (seconds): the kernel frees its memory first.
KILLED_GONE_S = 5.0
# Carried by every process of a local node's tree (``trainer.launch.LocalCluster``): what a node loss kills
# (``marked``), and how a process knows it runs on such a node.
NODE_ENV = "GOODPUT_LOCAL_NODE"
_PR_SET_PDEATHSIG = 1
Handler = Union[Callable, int, None]


@contextlib.contextmanager
def handlers(table: dict[int, Handler]) -> Iterator[bool]:
    """Install ``table`` (signal -> handler, ``SIG_IGN`` or ``SIG_DFL``) while the block runs, then put back
    what was there. Only the main thread can change dispositions: elsewhere nothing changes; the block is
    told which (``with handlers(...) as installed``)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {}
    try:
        for s, h in table.items():
            previous[s] = signal.signal(s, h)
        yield True
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


class SigtermFlag:
    def __init__(self, installed: bool) -> None:
        self._event = threading.Event()
        self._installed = installed   # signal dispositions can only be changed from the main thread
        self._in_loop = False
        self.signum: int | None = None   # the first stop signal received in the loop

    @classmethod
    def install(cls) -> "SigtermFlag":
        """A flag that takes over SIGTERM and SIGINT while ``in_loop`` is set (only from the main thread)."""
        return cls(installed=threading.current_thread() is threading.main_thread())

    @property
    def in_loop(self) -> bool:
        return self._in_loop

    @in_loop.setter
    def in_loop(self, value: bool) -> None:
        self._in_loop = value
        if self._installed:
            for s in STOP_SIGNALS:
                signal.signal(s, self._handle if value else signal.SIG_DFL)

    def fail_over(self) -> None:
        """The loop failed and the rank goes to a restart: stop signals end the process from now on, and one the
        loop received but did not act on ends it now. The launcher that sent it is stopping every rank: the
        restart would wait for peers that are gone, until the launcher's SIGKILL after its stop timeout."""
        self.in_loop = False
        if self.signum is not None:
            os.kill(os.getpid(), self.signum)

    def _handle(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def name(self) -> str:
        """``sigterm`` or ``sigint``: what stopped the loop (``sigterm`` when another rank's signal did)."""
        return signal.Signals(self.signum).name.lower() if self.signum else "sigterm"


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; a no-op elsewhere).

    ``parent``: the pid the parent had when this process was created (as a ``preexec_fn``, the caller of
    ``Popen``); if it already exited, the signal is sent now. Kept across ``exec``, not across ``fork``.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return
    if prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def parent_death_preexec(sig: int = signal.SIGKILL):
    """A ``Popen(preexec_fn=...)`` that makes the child die with the calling process."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP): it runs no code until a SIGCONT."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:
        return False


def is_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (no such process, or a zombie not reaped yet)."""
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return True


class StoppedFor:
    """``hung(pid)``: whether ``pid`` has stayed stopped for ``limit_s`` (``STOPPED_S``) since the calls began to
    see it stopped. A stopped process cannot answer or exit, so whoever waits on it treats it as hung."""

    def __init__(self, limit_s: float | None = None) -> None:
        self.limit_s = STOPPED_S if limit_s is None else limit_s
        self._since: dict[int, float] = {}

    def __call__(self, pid: int) -> bool:
        if not is_stopped(pid):
            self._since.pop(pid, None)
            return False
        now = time.monotonic()
        return now - self._since.setdefault(pid, now) > self.limit_s


def alive(procs: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those of ``procs`` still running (a zombie has exited: only its exit status is left)."""
    left = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
    return left


def marked(name: str, value: str) -> list[psutil.Process]:
    """This user's live processes (this one excluded) whose environment holds ``name=value``: what a run
    started, wherever it was re-parented to."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid != os.getpid() and p.environ().get(name) == value and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def in_process_group(pgid: int) -> list[psutil.Process]:
    """The live processes of process group ``pgid`` (this one excluded)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if p.pid != os.getpid() and os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
    return found


def reap(procs: Iterable[psutil.Process], grace_s: float = 0.0, gone_s: float = KILLED_GONE_S,
         on_signal: Callable[[psutil.Process, int], None] | None = None) -> list[psutil.Process]:
    """End ``procs``: SIGTERM and up to ``grace_s`` to exit (none: SIGKILL at once), then SIGKILL and up to
    ``gone_s`` to disappear. Returns those still alive after that. ``on_signal(proc, signal)`` is told each
    signal sent."""
    left = alive(procs)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, gone_s)):
        if not left or (sig == signal.SIGTERM and grace_s <= 0):
            continue
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
                if on_signal is not None:
                    on_signal(p, sig)
        deadline = time.monotonic() + wait_s
        while (left := alive(left)) and time.monotonic() < deadline:
            psutil.wait_procs(left, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
    return left
