"""Stop signals as a flag the loop checks once per step, and processes that die with their parent.

SIGTERM (spot reclaim, pod eviction, launcher shutdown) and SIGINT (Ctrl-C reaching a rank run by
hand): while the training loop runs, the handler only records the signal: the loop finishes its step,
all ranks agree through the per-step all-reduce, and a final checkpoint is committed before a clean
exit. Outside the loop (setup, or an in-process restart under way) there is nothing new to save, so
they have their default action and the kernel ends the process at once: a launcher restarting the
worker group should not wait for it. A Python handler would not do: it runs only between bytecodes,
and a rank that lost a peer often waits inside a C++ call (the in-process restart's store barrier)
until the launcher's SIGKILL, which comes only after its stop timeout.

``die_with_parent``: the kernel signals a process when its parent exits (``PR_SET_PDEATHSIG``), however
the parent ended, SIGKILL included. Every process of a local run's tree that is not in its starter's
process group sets it, so none outlives the run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A helper stopped (SIGSTOP) this long counts as hung (environment, seconds): nothing waits on it forever.
STOPPED_S = float(os.environ.get("GOODPUT_STOPPED_S", "3"))
_PR_SET_PDEATHSIG = 1


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
