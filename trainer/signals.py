"""SIGTERM (spot reclaim, pod eviction, launcher shutdown) as a flag the loop checks once per step.

While the training loop runs, the handler only sets a flag: the loop finishes its step, all ranks agree
through the per-step all-reduce, and a final checkpoint is committed before a clean exit. Outside the
loop (setup, or an in-process restart under way) there is nothing new to save, so the process exits at
once: a launcher restarting the worker group should not wait for it.
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_SIGTERM = 128 + signal.SIGTERM


class SigtermFlag:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.in_loop = False
        self.on_exit = None

    @classmethod
    def install(cls, on_exit=None) -> "SigtermFlag":
        """Install the handler; ``on_exit()`` runs before an immediate exit outside the loop."""
        flag = cls()
        flag.on_exit = on_exit
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, flag._handle)
        return flag

    def _handle(self, signum, frame) -> None:
        self._event.set()
        if not self.in_loop:
            if self.on_exit is not None:
                self.on_exit()
            os._exit(EXIT_SIGTERM)

    @property
    def is_set(self) -> bool:
        return self._event.is_set()
