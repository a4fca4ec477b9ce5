"""``goodput advise``: spot or on-demand for a training job, with expected time and cost (``pipelines.advisor``)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--hours", type=float, help="Wall hours the job needs without interruptions (or --gpu-hours).")
@click.option("--gpu-hours", type=float, help="GPU-hours of work; divided by --gpus for the wall hours.")
@click.option("--gpus", type=int, required=True, help="GPUs in the job.")
@click.option("--instance-type", default="p5.48xlarge", show_default=True,
              help="Instance type; sets --gpus-per-instance for known types.")
@click.option("--gpus-per-instance", type=int, help="GPUs per instance (default: from --instance-type, else 8).")
@click.option("--ckpt-block-s", type=float, help="Seconds a checkpoint blocks training (default: from --summary).")
@click.option("--recovery-s", type=float, help="Seconds from an interruption to training again: new node, pod "
              "start, checkpoint load (default: from --summary).")
@click.option("--summary", "summary_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A run's summary.json: its ckpt_block_s_p50 and median fault recovery time.")
@click.option("--interruption-rate", type=float, required=True,
              help="Spot interruptions per instance-hour (e.g. 0.05 = one per 20 instance-hours).")
@click.option("--failure-rate", type=float, default=0.0, show_default=True,
              help="Other failures per instance-hour, on spot and on-demand alike.")
@click.option("--on-demand-price", type=float, required=True, help="Price of one on-demand instance-hour.")
@click.option("--spot-price", type=float, required=True, help="Price of one spot instance-hour.")
@click.option("--json", "as_json", is_flag=True, help="Print the advice as JSON.")
def advise(hours, gpu_hours, gpus, instance_type, gpus_per_instance, ckpt_block_s, recovery_s, summary_path,
           interruption_rate, failure_rate, on_demand_price, spot_price, as_json) -> None:
    """Expected time and cost of a job on spot vs on-demand, and which to use.

    On-demand when the expected cost of interruptions and retries exceeds the spot discount.
    Checkpoints follow the Young-Daly interval; every interruption costs the recovery time plus half an
    interval of redone work.

    \b
    Example:
      goodput advise --gpus 16 --hours 19 --ckpt-block-s 45 --recovery-s 900 \\
          --interruption-rate 0.05 --on-demand-price 98.32 --spot-price 40
    """
    from pipelines.advisor import GPUS_PER_INSTANCE, advise as advise_fn

    if (hours is None) == (gpu_hours is None):
        raise click.UsageError("give exactly one of --hours and --gpu-hours")
    if summary_path is not None:
        try:
            s = json.loads(summary_path.read_text())
        except ValueError as e:
            raise click.BadParameter(f"{summary_path} is not a run's summary.json ({e})", param_hint="--summary")
        recovered = [f["recovered_s"] for f in s.get("faults", []) if f.get("recovered_s") is not None]
        ckpt_block_s = s.get("ckpt_block_s_p50") if ckpt_block_s is None else ckpt_block_s
        if recovery_s is None and recovered:
            recovery_s = statistics.median(recovered)
    if ckpt_block_s is None or recovery_s is None:
        raise click.UsageError("--ckpt-block-s and --recovery-s are required (or a --summary with faults)")
    per_instance = gpus_per_instance or GPUS_PER_INSTANCE.get(instance_type, 8)
    work_hours = hours if hours is not None else gpu_hours / max(gpus, 1)
    a = advise_fn(work_hours=work_hours, gpus=gpus, gpus_per_instance=per_instance, ckpt_block_s=ckpt_block_s,
                  recovery_s=recovery_s, interruption_rate=interruption_rate, failure_rate=failure_rate,
                  on_demand_price=on_demand_price, spot_price=spot_price)
    if as_json:
        # inf is not JSON: a job that is not expected to finish has null hours and cost.
        click.echo(json.dumps(_finite(a.to_dict()), indent=1))
        return

    from rich.console import Console
    from rich.table import Table

    def fmt(v: float, spec: str) -> str:
        return format(v, spec) if math.isfinite(v) else "never"

    t = Table(title=f"{work_hours:g} h of work on {a.instances} x {instance_type} ({gpus} GPUs)")
    for col in ("", "spot", "on-demand"):
        t.add_column(col, justify="right" if col else "left")
    rows = (("interruptions / hour", "failures_per_hour", ".3f"),
            ("checkpoint every (s)", "checkpoint_interval_s", ",.0f"),
            ("goodput", "goodput", ".3f"),
            ("expected hours", "expected_hours", ",.2f"),
            ("expected interruptions", "expected_interruptions", ",.2f"),
            ("expected cost", "expected_cost", ",.2f"))
    for label, key, spec in rows:
        t.add_row(label, fmt(getattr(a.spot, key), spec), fmt(getattr(a.on_demand, key), spec))
    console = Console()
    console.print(t)
    console.print(f"spot discount {fmt(a.spot_discount, ',.2f')}, cost of interruptions and retries "
                  f"{fmt(a.interruption_cost, ',.2f')}")
    console.print(f"[bold]use {a.recommendation}[/bold]: {a.reason}")


def _finite(obj):
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
