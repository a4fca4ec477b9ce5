"""SIGTERM (spot reclaim, pod eviction, launcher shutdown) as a flag the loop checks once per step.

While the training loop runs, the handler only sets a flag: the loop finishes its step, all ranks agree
through the per-step all-reduce, and a final checkpoint is committed before a clean exit. Outside the
loop (setup, or an in-process restart under way) there is nothing new to save, so SIGTERM has its
default action and the kernel ends the process at once: a launcher restarting the worker group should
not wait for it. A Python handler would not do: it runs only between bytecodes, and a rank that lost a
peer often waits inside a C++ call (the in-process restart's store barrier) until the launcher's
SIGKILL, which comes only after its stop timeout.
"""

from __future__ import annotations

import signal
import threading


class SigtermFlag:
    def __init__(self, installed: bool) -> None:
        self._event = threading.Event()
        self._installed = installed   # signal dispositions can only be changed from the main thread
        self._in_loop = False

    @classmethod
    def install(cls) -> "SigtermFlag":
        """A flag that takes over SIGTERM while ``in_loop`` is set (only when called from the main thread)."""
        return cls(installed=threading.current_thread() is threading.main_thread())

    @property
    def in_loop(self) -> bool:
        return self._in_loop

    @in_loop.setter
    def in_loop(self, value: bool) -> None:
        self._in_loop = value
        if self._installed:
            signal.signal(signal.SIGTERM, self._handle if value else signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:
        self._event.set()

    @property
    def is_set(self) -> bool:
        return self._event.is_set()
