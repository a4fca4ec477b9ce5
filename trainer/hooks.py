"""What the training loop tells the objects that watch it (metrics, fault injection, the recovery layers), at
two fixed points of every step. Each overrides what it needs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepReport:
    """One finished optimizer step, as every rank saw it (``loss`` is the mean over ranks)."""

    step: int
    loss: float
    step_s: float           # wall time of the step, without the wait for a checkpoint's copy
    data_wait_s: float      # of which this rank waited for its batches
    tokens: int             # tokens of the whole job in this step
    tokens_seen: int        # and in every step so far
    lr: float
    mfu: float | None       # model FLOPs utilisation of this device (None: no known peak, e.g. CPU)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0


class StepHook:
    """Called by the loop on every rank: ``before_optimizer_step`` between backward and the optimizer step
    (the state is about to change), ``after_step`` once the step's results were agreed on."""

    def before_optimizer_step(self, step: int) -> None:
        pass

    def after_step(self, report: StepReport) -> None:
        pass
