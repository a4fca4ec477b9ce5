"""SIGTERM (spot reclaim, pod eviction, launcher shutdown) as a flag the loop checks once per step.

The handler only sets a flag: the loop finishes its step, all ranks agree through the per-step
all-reduce, and a final checkpoint is committed before a clean exit.
"""

from __future__ import annotations

import signal
import threading


class SigtermFlag:
    def __init__(self) -> None:
        self._event = threading.Event()

    @classmethod
    def install(cls) -> "SigtermFlag":
        flag = cls()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda signum, frame: flag._event.set())
        return flag

    @property
    def is_set(self) -> bool:
        return self._event.is_set()
