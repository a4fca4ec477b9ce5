"""``goodput train``: run the trainer on this machine under NVRx ft_launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from trainer.config import describe_flags
from trainer.launch import LaunchConfig, run_local_training

# \b keeps click from re-wrapping each section of the trainer's flags.
TRAINER_HELP = "\n\n".join(
    "\b\n" + f"{section}:\n" + "\n".join(f"  {flag:<22} {text}" for flag, text in rows)
    for section, rows in describe_flags())


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": ["-h", "--help"]},
               epilog="Trainer options (passed through to `python -m trainer`):\n\n" + TRAINER_HELP)
@click.option("--nproc", default=2, show_default=True, help="Worker processes (GPUs, or CPU ranks with gloo).")
@click.option("--max-restarts", default=3, show_default=True,
              help="In-job restarts of the worker group by ft_launcher before the run fails.")
@click.option("--fsx-root", default="fsx", show_default=True, type=click.Path(path_type=Path),
              help="Local stand-in for the FSx mount; the default dataset is built under it.")
@click.pass_context
def train(ctx: click.Context, nproc: int, max_restarts: int, fsx_root: Path) -> None:
    """Train on this machine: NVRx ft_launcher starts NPROC ranks of `python -m trainer`.

    Without --data the default dataset (this Python's standard library, no download) is built under
    FSX_ROOT. Rerun the same command to resume from the newest committed checkpoint in --out.

    \b
    Example:
      goodput train --nproc 2 --max-steps 100 --ckpt-every 20 --out fsx/runs/demo
    """
    from rich.console import Console
    from rich.table import Table

    try:
        code, summary = run_local_training(ctx.args, LaunchConfig(nproc_per_node=nproc, max_restarts=max_restarts),
                                           fsx_root)
    except (ValueError, FileNotFoundError) as e:
        raise click.UsageError(str(e)) from None
    if summary is None:
        if code == 0:
            click.echo("stopped before the last step (SIGTERM); the last checkpoint is committed - "
                       "rerun the same command to resume")
        sys.exit(code)
    table = Table(title="training summary", show_header=False)
    for key in ("steps", "tokens", "final_train_loss", "final_val_loss", "checkpoints_committed",
                "ckpt_block_s_p50", "ckpt_block_s_max", "restarts", "wall_s", "params_sha256"):
        table.add_row(key, str(summary.get(key)))
    Console().print(table)
