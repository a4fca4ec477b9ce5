"""In-job fault tolerance: this rank's link to its NVRx rank monitor (started by ``ft_launcher``).

The trainer opens three sections: ``setup`` (init, build, resume, and the first step after them, which
pays for lazy initialisation), ``step`` (one steady-state training step) and
``checkpoint`` (blocking saves, teardown). A rank that stays in a section longer than its timeout, or
out of every section longer than the out-of-section timeout, is killed by its monitor and ft_launcher
restarts the worker group. The launcher's flags carry safe upper bounds; after ``calc_after_steps``
steps the ``step`` timeout is tightened to NVRx's safety factor x the longest step seen, but never
below ``min_step_timeout_s`` (a timeout learned from a few fast steps would kill a healthy run during
a slow one) and never above the launcher's flag. The learned timeouts travel in every checkpoint
(``RankMonitorClient.state_dict``), so a restarted rank is protected from its first step.

Disabled (every call a no-op) when the process was not started by ft_launcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import struct

from . import compat
from .errors import HelperHung

log = logging.getLogger(__name__)


class FTManager:
    def __init__(self, calc_after_steps: int, min_step_timeout_s: float, ipc_timeout_s: float = 30.0):
        self.calc_after_steps, self.min_step_timeout_s = calc_after_steps, min_step_timeout_s
        self.client = None
        self.open_sections: set[str] = set()
        self.steps_seen = 0
        self.calculated = False
        if not compat.under_ft_launcher():
            return
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()
        # NVRx's IPC waits for each reply without a limit: a stopped or stuck monitor would hang the rank in
        # every section change, with nothing left to notice. Bounded, it is a HelperHung (see section).
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(ipc_timeout_s)
        try:
            self.client.init_workload_monitoring()
        except Exception as e:
            self._abandon(kill=isinstance(e, TimeoutError) or isinstance(e.__context__, TimeoutError))
            raise HelperHung(f"the rank monitor of rank {os.environ.get('RANK')} did not answer its "
                             f"connection within {ipc_timeout_s:g}s (--ft-ipc-timeout-s): {e}") from e
        finally:
            socket.setdefaulttimeout(previous)
        compat.rank_monitor_socket(self.client).settimeout(ipc_timeout_s)
        self.ipc_timeout_s = ipc_timeout_s
        self.safety_factor = self.client.cfg.safety_factor

    @property
    def enabled(self) -> bool:
        return self.client is not None

    @contextlib.contextmanager
    def section(self, name: str):
        if self.client is None:
            yield
            return
        self._call(self.client.start_section, name)
        self.open_sections.add(name)
        yield
        self._call(self.client.end_section, name)
        self.open_sections.discard(name)

    def _call(self, fn, *args, **kwargs):
        """A call to the rank monitor; ``HelperHung`` if it is gone or does not answer in time (the rank then
        restarts in-job, and the launcher reports the monitor)."""
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClientError

        try:
            return fn(*args, **kwargs)
        except RankMonitorClientError as e:
            self._abandon(kill=isinstance(e.__context__, TimeoutError))
            raise HelperHung(f"the rank monitor of rank {os.environ.get('RANK')} stopped answering "
                             f"(--ft-ipc-timeout-s {self.ipc_timeout_s:g}): {e}") from e

    def _abandon(self, kill: bool) -> None:
        """Never use the client again; with ``kill`` (it did not answer in time) SIGKILL its monitor: stopped or
        stuck, it would hold up the launcher's shutdown (which joins it) and watches nothing; dead, the
        launcher's next rounds fail to connect and the run ends with this rank's message. A closed connection
        is no hang: the launcher closes it when it restarts the group."""
        sock, self.client = compat.rank_monitor_socket(self.client), None
        if not kill:
            return
        with contextlib.suppress(OSError, AttributeError, TypeError):
            pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            if pid > 0:
                os.kill(pid, signal.SIGKILL)

    def reset(self) -> None:
        """After an in-process restart: close whatever the failed attempt left open, each by name (from NVRx
        0.5 ``end_all_sections()`` sends nothing)."""
        if self.client is not None:
            try:
                for name in sorted(self.open_sections):
                    self.client.end_section(name)
                self.open_sections.clear()
            except Exception as e:  # the monitor may already be gone (the launcher is restarting the group)
                log.warning("rank monitor unreachable while closing sections: %s", e)

    def observe_step(self) -> float | None:
        """Count a steady step; once enough were seen, tighten the step timeout (collective) and return it.

        NVRx measures the ``step`` sections itself; this decides when to use them and bounds the result.
        """
        if self.client is None or self.calculated:
            return None
        self.steps_seen += 1
        if self.steps_seen < self.calc_after_steps:
            return
        self.calculated = True
        configured = self.client.section_timeouts.section.get("step") or float("inf")
        # Collective (NVRx synchronizes the measured times across ranks), so every rank sets the same value.
        if not self._call(self.client.calculate_and_set_section_timeouts, selected_sections=["step"],
                          calc_out_of_section=False, skip_if_not_ready=True):
            return None
        learned = self.client.section_timeouts.section["step"]
        # Tightening: never under the floor, never looser than the launcher's flag.
        timeout = min(configured, max(learned, self.min_step_timeout_s))
        if timeout != learned:
            self._call(compat.set_section_timeout, self.client, "step", timeout)
        log.info("rank monitor: step timeout set to %.1fs (%.1fx the longest of %d steps is %.1fs; floor %gs)",
                 timeout, self.safety_factor, self.steps_seen, learned, self.min_step_timeout_s)
        return timeout

    def state_json(self) -> str:
        """The monitor's learned timeouts, saved in every checkpoint (the same on every rank)."""
        return json.dumps(self.client.state_dict() if self.client is not None else {})

    def load_state_json(self, state: str) -> None:
        if self.client is not None and state:
            loaded = json.loads(state)
            self._call(self.client.load_state_dict, loaded)
            self.calculated = self.calculated or compat.has_calculated_timeouts(loaded)

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None
