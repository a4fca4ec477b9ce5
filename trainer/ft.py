"""In-job fault tolerance: this rank's link to its NVRx rank monitor (started by ``ft_launcher``).

The trainer opens three sections: ``setup`` (init, build, resume, and the first step after them, which
pays for lazy initialisation), ``step`` (one steady-state training step) and
``checkpoint`` (blocking saves, teardown). A rank that stays in a section longer than its timeout, or
out of every section longer than the out-of-section timeout, is killed by its monitor and ft_launcher
restarts the worker group. The launcher's flags carry safe upper bounds; after ``calc_after_steps``
steps the ``step`` timeout is tightened to NVRx's safety factor x the longest step seen, but never
below ``min_step_timeout_s`` (a timeout learned from a few fast steps would kill a healthy run during a
slow one). The learned timeouts travel in every checkpoint (``RankMonitorClient.state_dict``), so a
restarted rank is protected from its first step.

Disabled (every call a no-op) when the process was not started by ft_launcher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

log = logging.getLogger(__name__)


class FTManager:
    def __init__(self, calc_after_steps: int, min_step_timeout_s: float):
        self.calc_after_steps, self.min_step_timeout_s = calc_after_steps, min_step_timeout_s
        self.client = None
        self.max_step_s = 0.0
        self.steps_seen = 0
        self.calculated = False
        from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR

        if os.environ.get(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR) is None:
            return  # not under ft_launcher
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()
        self.safety_factor = self.client.cfg.safety_factor

    @property
    def enabled(self) -> bool:
        return self.client is not None

    @contextlib.contextmanager
    def section(self, name: str):
        if self.client is None:
            yield
            return
        self.client.start_section(name)
        yield
        self.client.end_section(name)

    def reset(self) -> None:
        """After an in-process restart: close whatever the failed attempt left open."""
        if self.client is not None:
            try:
                self.client.end_all_sections()
            except Exception as e:  # the monitor may already be gone (the launcher is restarting the group)
                log.warning("rank monitor unreachable while closing sections: %s", e)

    def observe_step(self, step_s: float) -> None:
        """Feed a step's duration; tighten the step timeout once enough steps were seen (collective)."""
        if self.client is None or self.calculated:
            return
        self.steps_seen += 1
        self.max_step_s = max(self.max_step_s, step_s)
        if self.steps_seen < self.calc_after_steps:
            return
        self.calculated = True
        # Every rank takes the same branch: the decision uses only the config and the step count, and
        # NVRx's calculation synchronizes the measured times across ranks.
        if self.safety_factor * self.max_step_s >= self.min_step_timeout_s:
            self.client.calculate_and_set_section_timeouts(selected_sections=["step"], calc_out_of_section=False,
                                                           skip_if_not_ready=True)
            log.info("rank monitor: step timeout set to %.1fs", self.client.section_timeouts.section["step"])
        else:
            log.info("rank monitor: steps are fast (max %.2fs); keeping the configured step timeout, as %.1fx "
                     "would be under the %.0fs floor", self.max_step_s, self.safety_factor, self.min_step_timeout_s)

    def state_json(self) -> str:
        """The monitor's learned timeouts, saved in every checkpoint (the same on every rank)."""
        return json.dumps(self.client.state_dict() if self.client is not None else {})

    def load_state_json(self, state: str) -> None:
        if self.client is not None and state:
            loaded = json.loads(state)
            self.client.load_state_dict(loaded)
            self.calculated = self.calculated or bool(loaded.get(self.client.CURRENT_TIMEOUTS_STATE_KEY))

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None
