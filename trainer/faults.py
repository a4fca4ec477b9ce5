"""Fault injection, for tests, benchmarks and users validating a cluster.

``--inject-fault KIND@STEP[:RANK]`` (repeatable; RANK defaults to 0) fires KIND on RANK during step
STEP, after the backward pass and before the optimizer step:

    exception    raise an exception (in-process restart catches it)
    kill         SIGKILL this rank (ft_launcher restarts the worker group)
    hang         stop making progress without exiting (the rank monitor / watchdog notices)
    sigterm      send SIGTERM to this rank (checkpoint, clean exit; the job is restarted)
    ckpt-crash   SIGKILL this rank right after its part of the first checkpoint at or after STEP was
                 handed to the writer (the checkpoint is torn and must never be used)

``--chaos-seed S --fault-every SECONDS``: random kinds and ranks, one fault every SECONDS of the run's
wall time (on average, exponential gaps), reproducible from the seed.

Each fault fires once per run: before firing, the rank records it in ``events.jsonl`` (the log spans
restarts), and a restarted rank skips every fault already recorded there.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from .events import Event, EventLog, read_events
from .hooks import StepHook

KINDS = ("exception", "kill", "hang", "sigterm", "ckpt-crash")
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<step>\d+)(?::(?P<rank>\d+))?$")


class InjectedFault(RuntimeError):
    """The exception raised by an injected ``exception`` fault."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0

    @property
    def id(self) -> str:
        return f"{self.kind}@{self.step}:{self.rank}"

    @classmethod
    def parse(cls, spec: str) -> "Fault":
        m = _SPEC.match(spec.strip())
        if not m or m["kind"] not in KINDS:
            raise ValueError(f"bad fault {spec!r}: expected KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)}")
        return cls(m["kind"], int(m["step"]), int(m["rank"] or 0))


def chaos_schedule(seed: int, every_s: float, world_size: int, horizon_s: float = 7 * 24 * 3600.0,
                   kinds: tuple[str, ...] = ("exception", "kill", "hang")) -> list[tuple[float, str, int]]:
    """(seconds into the run, kind, rank) of random faults, reproducible from ``seed``."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / every_s)
        if t > horizon_s:
            return out
        out.append((t, rng.choice(kinds), rng.randrange(world_size)))


class FaultInjector(StepHook):
    """Fires this rank's configured faults at the right moment, once per run."""

    def __init__(self, specs: list[str], rank: int, world_size: int, events: EventLog, events_path: Path,
                 chaos_seed: int | None = None, fault_every_s: float = 0.0):
        self.rank, self.events = rank, events
        past = read_events(events_path)
        self.fired = {e["fault"] for e in past if e["event"] == Event.FAULT_INJECTED}
        self.faults = [f for f in map(Fault.parse, specs) if f.rank == rank and f.id not in self.fired]
        self.chaos: list[tuple[float, str, str]] = []
        if chaos_seed is not None and fault_every_s > 0:
            starts = [e["t"] for e in past if e["event"] == Event.RUN_START]
            t0, now = (starts[0] if starts else time.time()), time.time()
            # Faults whose moment passed while the run was down (restarting) are skipped, not stacked.
            self.chaos = [(t0 + t, kind, f"chaos:{chaos_seed}:{i}:{kind}")
                          for i, (t, kind, r) in enumerate(chaos_schedule(chaos_seed, fault_every_s, world_size))
                          if r == rank and t0 + t >= now and f"chaos:{chaos_seed}:{i}:{kind}" not in self.fired]
        self.pending_ckpt_crash: Fault | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.faults or self.chaos)

    def before_optimizer_step(self, step: int) -> None:
        """Mid-step (after backward, before the optimizer step): fire this rank's faults due at ``step``."""
        for f in self.faults:
            if f.step == step and f.id not in self.fired:
                if f.kind == "ckpt-crash":
                    self.pending_ckpt_crash = f
                else:
                    self._fire(f.kind, f.id, step)
        while self.chaos and self.chaos[0][0] <= time.time():
            _, kind, fid = self.chaos.pop(0)
            self._fire(kind, fid, step)

    def on_checkpoint_write_started(self, step: int) -> None:
        """Called by the checkpoint manager once this rank's write is handed to the writer."""
        f = self.pending_ckpt_crash
        if f is not None and step >= f.step:
            self._fire("ckpt-crash", f.id, step)

    def _fire(self, kind: str, fault_id: str, step: int) -> None:
        self.fired.add(fault_id)
        # Recorded before it fires: a killed rank cannot write afterwards, and the restart must skip it.
        self.events.emit(Event.FAULT_INJECTED, fault=fault_id, kind=kind, step=step)
        if kind == "exception":
            raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")
        if kind in ("kill", "ckpt-crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if kind == "hang":
            # Stuck inside one native call, like a kernel or I/O that never returns: no Python runs, no
            # exit. Only a watchdog (the rank monitor, the Wrapper's hard timeout) ends it.
            time.sleep(10 ** 7)
