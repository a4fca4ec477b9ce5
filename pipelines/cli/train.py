"""``goodput train``: run the trainer on this machine under NVRx ft_launcher."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import click

from trainer.config import ParallelConfig, describe_flags, parse_config
from trainer.mesh import check_launch
from trainer.launch import LaunchConfig, last_stop, run_local_training


def launch_options(fn):
    """One option per ft_launcher setting of ``LaunchConfig`` (the rendezvous is local here)."""
    for f in reversed(dataclasses.fields(LaunchConfig)):
        if f.name in ("nproc_per_node", "nnodes", "rdzv_endpoint", "rdzv_id"):
            continue
        name = "--" + f.name.replace("_", "-")
        flag = f"{name}/--no-{name[2:]}" if isinstance(f.default, bool) else name
        fn = click.option(flag, default=f.default, show_default=True, type=type(f.default),
                          help=f.metadata["help"][:1].upper() + f.metadata["help"][1:] + ".")(fn)
    return fn


def parse_nodes(value: str) -> tuple[int, int]:
    """``N`` (a fixed size: (0, N)) or ``MIN:MAX`` (elastic: (MIN, MAX), 1 <= MIN < MAX)."""
    try:
        low, _, high = value.partition(":")
        nodes = (int(low), int(high)) if high else (0, int(low))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not N or MIN:MAX") from None
    if nodes[1] < 1 or (nodes[0] and not 1 <= nodes[0] < nodes[1]):
        raise click.BadParameter(f"{value!r}: need N >= 1, or 1 <= MIN < MAX")
    return nodes


def check_mesh(p: ParallelConfig, nproc: int, nodes: range) -> None:
    """--dp-replicate x --dp-shard x --tp against every node count of the job x --nproc, before any rank starts."""
    try:
        check_launch(p.parallel, p.dp_replicate, p.dp_shard, p.tp, nproc, nodes)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


# \b keeps click from re-wrapping each section of the trainer's flags.
TRAINER_HELP = "\n\n".join(
    "\b\n" + f"{section}:\n" + "\n".join(f"  {flag:<22} {text}" for flag, text in rows)
    for section, rows in describe_flags())


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": ["-h", "--help"]},
               epilog="Trainer options (passed through to `python -m trainer`):\n\n" + TRAINER_HELP)
@click.option("--nproc", default=2, show_default=True,
              help="Worker processes per node (GPUs, or CPU ranks with gloo).")
@click.option("--nodes", default="1", show_default=True, callback=lambda _c, _p, v: parse_nodes(v),
              help="Nodes, each its own process tree on this machine (launcher, warm-start zygote, rank monitors, "
                   "checkpoint writers, memory-snapshot directory) joined by c10d rendezvous on loopback, as the "
                   "PyTorchJob's pods are; MIN:MAX is elastic: a node lost lets the run go on with at least MIN "
                   "(from a resharded checkpoint, not bitwise).")
@click.option("--fsx-root", default="fsx", show_default=True, type=click.Path(path_type=Path),
              help="Local stand-in for the FSx mount; the default dataset is built under it.")
@launch_options
@click.pass_context
def train(ctx: click.Context, nproc: int, nodes: tuple[int, int], fsx_root: Path, **launch: float) -> None:
    """Train on this machine: NVRx ft_launcher starts NPROC ranks of `python -m trainer` on each of NODES.

    Without --data the default dataset (this Python's standard library, no download) is built under
    FSX_ROOT. Rerun the same command to resume from the newest committed checkpoint in --out.

    \b
    Examples:
      goodput train --nproc 2 --max-steps 100 --ckpt-every 20 --out fsx/runs/demo
      goodput train --nodes 2 --nproc 1 --max-steps 100 --out fsx/runs/two-nodes
    """
    from rich.console import Console
    from rich.table import Table

    started = time.time()
    # A LaunchError (a ValueError) is the CLI's one-line error, exit 2: nothing was created or started.
    min_nodes, max_nodes = nodes
    cfg = parse_config(ctx.args, validate=False, prog="goodput train")
    check_mesh(cfg.parallel, nproc, range(min_nodes or max_nodes, max_nodes + 1))
    code, summary = run_local_training(cfg, LaunchConfig(nproc_per_node=nproc, nnodes=max_nodes, **launch), fsx_root,
                                       min_nodes=min_nodes)
    if summary is None:
        if code in (130, 143):
            stop = last_stop(Path(cfg.run.out), since=started)
            click.echo(f"interrupted ({'SIGINT' if code == 130 else 'SIGTERM'}): "
                       + (f"the ranks committed a checkpoint at step {stop} - rerun the same command to resume"
                          if stop is not None else "no checkpoint was due (the ranks were not training yet)"),
                       err=True)
        elif code == 0:
            click.echo("stopped before the last step (SIGTERM); the last checkpoint is committed - "
                       "rerun the same command to resume")
        sys.exit(code)
    table = Table(title="training summary", show_header=False)
    for key in ("steps", "tokens", "mesh", "tokens_per_s_p50", "mfu_p50", "final_train_loss", "final_val_loss",
                "checkpoints_committed", "ckpt_block_s_p50", "ckpt_block_s_max", "restarts", "restarts_inprocess",
                "restarts_injob", "lost_steps", "goodput", "wall_s", "params_sha256"):
        table.add_row(key, str(summary.get(key)))
    for f in summary.get("faults", []):
        table.add_row(f"fault {f['kind']}@{f['step']}:{f['rank']}",
                      f"recovered in {f['recovered_s']}s by {f['layer']}")
    Console().print(table)
