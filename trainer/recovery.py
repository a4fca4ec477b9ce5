"""What the training loop does for the recovery layers, behind one object.

The layers (``docs/training.md``): NVRx's in-process Wrapper (``trainer.restart``), which calls the
training function again after a fault and must never cut a save in half (``atomic``); NVRx's rank monitor
under ft_launcher (``trainer.ft``), which times the loop's sections; the stop signals (``trainer.signals``),
which the loop turns into a final checkpoint while it runs and leaves to their default action otherwise.
``Recovery`` is one attempt's view of them: the Trainer opens its sections through it, saves inside
``saving()``, runs its loop inside ``loop()`` and agrees with its peers through ``all_reduce``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

from . import compat, warmstart
from .config import TrainConfig
from .errors import recurring_cause
from .events import Event, EventLog
from .ft import FTManager
from .hooks import StepHook, StepReport
from .layout import events_path
from .restart import abort_process_group, run_with_inprocess_restart
from .signals import SigtermFlag

log = logging.getLogger(__name__)

FATAL_WAIT_S = 30.0   # how long a rank with an error that would recur waits for the launch wrapper to stop the run


class Recovery(StepHook):
    """One attempt's link to the recovery layers.

    Args:
        ft: the rank monitor's client (disabled outside ft_launcher); lives as long as the process.
        sigterm: the stop-signal flag; lives as long as the process.
        call_wrapper: the in-process Wrapper's, when that layer is on; None otherwise.
        events: the run's event log.
        is_main: rank 0 (which records the learned step timeout).
    """

    def __init__(self, ft: FTManager, sigterm: SigtermFlag, call_wrapper, events: EventLog, is_main: bool):
        self.ft, self.sigterm, self.call_wrapper, self.events, self.is_main = ft, sigterm, call_wrapper, events, is_main
        self.first_step = 1
        # A new attempt: SIGTERM has nothing to save until the loop runs, and nothing of a failed attempt's
        # sections stays open.
        self.sigterm.in_loop = False
        self.ft.reset()

    @property
    def iteration(self) -> int:
        """The in-process restart count (0: the first attempt of this process)."""
        return self.call_wrapper.iteration if self.call_wrapper is not None else 0

    def section(self, name: str):
        """A rank monitor section (``setup``, ``step``, ``checkpoint``)."""
        return self.ft.section(name)

    def step_section(self, step: int):
        """The section of the step that ends at ``step``.

        The first step after a (re)start pays for lazy initialisation (FSDP, optimizer state, the backend's
        first collectives: NCCL communicators at scale take seconds), so what the step timeout learns covers
        steady-state steps only. The rank monitor times that first step as setup, unless the run already
        learned its step timeout (restored with the state; it is never under --ft-min-step-timeout-s): a
        hang there must not wait for the setup timeout.
        """
        return self.ft.section("step" if step > self.first_step or self.ft.calculated else "setup")

    def atomic(self):
        """The Wrapper's ``atomic()``: a save is never cut in half by a restart in progress."""
        return self.call_wrapper.atomic() if self.call_wrapper is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def saving(self):
        """A blocking checkpoint: timed by the rank monitor as one, and never cut in half."""
        with self.ft.section("checkpoint"), self.atomic():
            yield

    @contextlib.contextmanager
    def loop(self, first_step: int):
        """The training loop: stop signals are a flag checked once per step; a failure fails over."""
        self.first_step = first_step
        self.sigterm.in_loop = True
        try:
            yield
        except BaseException:
            # Failing over to a restart: from here a SIGTERM has nothing to save and ends the process at once,
            # and the rank monitor must not time the in-process restart against the step timeout.
            self.sigterm.fail_over()
            self.ft.reset()
            if self.call_wrapper is None:
                # No in-process layer: the launcher restarts every rank, so peers blocked in a collective with
                # this one should fail now, not at the rank monitor's step timeout or the collective timeout.
                abort_process_group()
            raise

    @property
    def stop_requested(self) -> bool:
        """This rank received SIGTERM or SIGINT in the loop (every rank learns it through the step's all-reduce)."""
        return self.sigterm.is_set

    @property
    def stop_signal(self) -> str:
        return self.sigterm.name

    @staticmethod
    def all_reduce(tensor: torch.Tensor) -> None:
        """All-reduce (sum) that waits in Python rather than inside the backend.

        When another rank fails, NVRx's Wrapper interrupts this thread with an asynchronous exception; it
        is delivered within one poll here, whereas a wait inside gloo would last until the collective
        timeout.
        """
        work = dist.all_reduce(tensor, async_op=True)
        while not work.is_completed():
            time.sleep(0.0005)
        work.wait()

    def after_step(self, report: StepReport) -> None:
        """Steady steps teach the rank monitor its step timeout."""
        if report.step <= self.first_step:
            return
        timeout_s = self.ft.observe_step()
        if timeout_s is not None and self.is_main:
            self.events.emit(Event.FT_STEP_TIMEOUT, step=report.step, timeout_s=round(timeout_s, 3))

    def state_dict(self) -> str:
        """Saved in every checkpoint: the rank monitor's learned timeouts."""
        return self.ft.state_json()

    def load_state_dict(self, state: str) -> None:
        self.ft.load_state_json(state)


def run_under_layers(cfg: TrainConfig, attempt: Callable[[object], dict | None]) -> dict | None:
    """Call ``attempt(call_wrapper)`` under the configured recovery layers (``--restart-layers``): again after
    every in-process restart with ``inprocess``/``both``, once (``call_wrapper`` None) otherwise."""
    layers = compat.resolve_restart_layers(cfg.restart.restart, compat.installed_release())
    if layers in ("inprocess", "both"):
        return run_with_inprocess_restart(attempt, cfg.restart, cuda=torch.cuda.is_available())
    return attempt(None)


def exit_if_recurring(cfg: TrainConfig, e: BaseException) -> None:
    """Return if ``e`` is an error a restart may cure; else say so once and exit with status 2.

    Settings or data that no restart changes: said once, as a ``fatal`` event the launch wrapper stops the
    launcher on (it would restart the group for nothing), and exit status 2.
    """
    recurring = recurring_cause(e)
    if recurring is None:
        return
    reason = f"{type(recurring).__name__}: {recurring}"
    rank = int(os.environ.get("RANK", "0"))
    with contextlib.suppress(OSError):
        log_ = EventLog(events_path(cfg.run.out), rank)
        log_.emit(Event.FATAL, reason=reason)
        log_.close()
    print(f"error: rank {rank}: {reason} (not retried: it would fail the same way)", file=sys.stderr)
    if warmstart.ZYGOTE_PID_ENV in os.environ:
        # Under the launch wrapper, which stops the launcher on that event within a second: exiting now
        # would have the launcher restart the group first. SIGTERM (its default action) ends the wait.
        time.sleep(FATAL_WAIT_S)
    raise SystemExit(2) from None
