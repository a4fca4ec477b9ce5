"""Spot or on-demand: the expected time and cost of a training job on each, and a recommendation.

The rule: **on-demand when the expected cost of interruptions and retries exceeds the spot discount**.

    goodput advise --gpus 16 --hours 19 --ckpt-block-s 45 --recovery-s 900 \\
        --interruption-rate 0.05 --on-demand-price 98.32 --spot-price 40

The model (first order, the one ``trainer.goodput.project`` uses for cluster-scale goodput):

- The job runs on ``n = ceil(gpus / gpus_per_instance)`` instances and stops whenever any of them is
  interrupted, so its interruptions arrive at ``n * rate`` per hour: mean time between them ``M``.
- It checkpoints every ``tau = sqrt(2 * C * M)`` seconds (Young-Daly, ``trainer.goodput.young_daly_interval_s``),
  each checkpoint blocking training for ``C`` seconds.
- Each interruption costs the recovery ``R`` (new node, restart, reload) plus, on average, half an interval
  of redone work.
- Goodput ``g = (1 - (R + tau/2) / M) / (1 + C / tau)``; ``W`` hours of work take ``W / g`` hours, paid for
  ``n`` instances. ``g <= 0`` means the job is expected never to finish there.

Spot instances are interrupted at ``interruption_rate + failure_rate`` per instance-hour, on-demand ones only
fail at ``failure_rate`` (0 by default: then on-demand takes exactly ``W`` hours and never checkpoints for
safety). The spot discount is ``W * n * (on_demand_price - spot_price)``; the cost of interruptions and retries
is what spot's extra hours cost beyond on-demand's: ``(T_spot - W) * n * spot_price - (T_od - W) * n *
on_demand_price``. The comparison is the same as comparing the two total costs. It assumes no warning before
an interruption (no checkpoint on the two-minute notice), so it is conservative about spot.

Pure arithmetic: no torch, no AWS calls.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainer.goodput import young_daly_interval_s

__all__ = ["Advice", "Option", "advise", "GPUS_PER_INSTANCE"]

# GPUs per instance of the types this project targets (the job's GPUs are rounded up to whole instances).
GPUS_PER_INSTANCE = {"p5.48xlarge": 8, "p5e.48xlarge": 8, "p5en.48xlarge": 8, "p4d.24xlarge": 8,
                     "p4de.24xlarge": 8, "p6-b200.48xlarge": 8, "g6e.48xlarge": 8, "g5.48xlarge": 8}


@dataclass
class Option:
    """Expected outcome of running the job on one capacity type."""

    capacity: str
    failures_per_hour: float          # interruptions of the whole job per hour
    mtbf_s: float                     # mean time between them (inf = none)
    checkpoint_interval_s: float      # Young-Daly interval (inf = no checkpoints needed for safety)
    goodput: float                    # work hours per wall hour
    expected_hours: float             # wall time to finish (inf = not expected to finish)
    expected_interruptions: float
    instance_hours: float
    price_per_instance_hour: float
    expected_cost: float


@dataclass
class Advice:
    work_hours: float
    instances: int
    spot: Option
    on_demand: Option
    spot_discount: float              # what spot saves on the work itself
    interruption_cost: float          # what spot's interruptions and retries cost beyond on-demand's
    recommendation: str               # "spot" or "on-demand"
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


def _option(capacity: str, work_h: float, instances: int, rate_per_instance_h: float, ckpt_block_s: float,
            recovery_s: float, price: float) -> Option:
    lam = instances * rate_per_instance_h
    if lam <= 0:
        return Option(capacity, 0.0, math.inf, math.inf, 1.0, work_h, 0.0, work_h * instances, price,
                      work_h * instances * price)
    mtbf_s = 3600.0 / lam
    tau = young_daly_interval_s(ckpt_block_s, mtbf_s) if ckpt_block_s > 0 else 0.0
    # With free checkpoints (C = 0) the interval shrinks to nothing: no redone work, no blocking.
    goodput = (1 - (recovery_s + tau / 2) / mtbf_s) / (1 + (ckpt_block_s / tau if tau > 0 else 0.0))
    if goodput <= 0:
        return Option(capacity, lam, mtbf_s, tau, 0.0, math.inf, math.inf, math.inf, price, math.inf)
    hours = work_h / goodput
    return Option(capacity, lam, mtbf_s, tau, goodput, hours, hours * lam, hours * instances, price,
                  hours * instances * price)


def advise(*, work_hours: float, gpus: int, gpus_per_instance: int = 8, ckpt_block_s: float,
           recovery_s: float, interruption_rate: float, on_demand_price: float, spot_price: float,
           failure_rate: float = 0.0) -> Advice:
    """Expected time and cost of ``work_hours`` of training on ``gpus`` GPUs, on spot and on-demand.

    Args:
        work_hours: wall hours the job needs without any interruption (GPU-hours / gpus).
        gpus: GPUs in the job.
        gpus_per_instance: GPUs of one instance (8 for p5.48xlarge and p4d.24xlarge).
        ckpt_block_s: seconds one checkpoint blocks training (``ckpt_block_s_p50`` of a run's summary.json).
        recovery_s: seconds from an interruption to training again: replacement node, pod start, reload.
        interruption_rate: spot interruptions per instance-hour.
        on_demand_price, spot_price: price of one instance-hour.
        failure_rate: other failures per instance-hour, on either capacity type.

    Raises:
        ValueError: a negative or missing quantity, or a spot price above the on-demand price.
    """
    problems = []
    for name, v in (("work_hours", work_hours), ("ckpt_block_s", ckpt_block_s), ("recovery_s", recovery_s),
                    ("interruption_rate", interruption_rate), ("failure_rate", failure_rate),
                    ("on_demand_price", on_demand_price), ("spot_price", spot_price)):
        if not math.isfinite(v) or v < 0:
            problems.append(f"{name} must be a finite number >= 0, got {v}")
    if work_hours <= 0:
        problems.append("work_hours must be positive")
    if gpus < 1 or gpus_per_instance < 1:
        problems.append(f"gpus ({gpus}) and gpus_per_instance ({gpus_per_instance}) must be at least 1")
    if spot_price > on_demand_price:
        problems.append(f"spot price {spot_price} is above the on-demand price {on_demand_price}")
    if problems:
        raise ValueError("invalid advisor inputs:\n  " + "\n  ".join(problems))

    n = math.ceil(gpus / gpus_per_instance)
    spot = _option("spot", work_hours, n, interruption_rate + failure_rate, ckpt_block_s, recovery_s, spot_price)
    od = _option("on-demand", work_hours, n, failure_rate, ckpt_block_s, recovery_s, on_demand_price)
    discount = work_hours * n * (on_demand_price - spot_price)
    retries = ((spot.expected_hours - work_hours) * n * spot_price
               - (od.expected_hours - work_hours) * n * on_demand_price)
    if not math.isfinite(od.expected_hours):
        choice = "on-demand"
        reason = ("neither capacity type is expected to finish: failures come faster than recovery plus half a "
                  "checkpoint interval; cut the recovery time or the checkpoint cost, or use fewer instances")
        retries = math.inf
    elif not math.isfinite(spot.expected_hours):
        choice = "on-demand"
        reason = (f"on spot the job is interrupted every {spot.mtbf_s / 60:.1f} min on average, less than one "
                  f"recovery ({recovery_s:.0f} s) plus half a checkpoint interval: it is not expected to finish")
    elif retries > discount:
        choice = "on-demand"
        reason = (f"interruptions and retries on spot are expected to cost {retries:,.2f}, more than the spot "
                  f"discount of {discount:,.2f}")
    else:
        choice = "spot"
        reason = (f"the spot discount of {discount:,.2f} exceeds the expected cost of interruptions and retries "
                  f"({retries:,.2f}); spot saves {od.expected_cost - spot.expected_cost:,.2f} and takes "
                  f"{spot.expected_hours - od.expected_hours:.2f} h longer")
    return Advice(work_hours, n, spot, od, discount, retries, choice, reason)
