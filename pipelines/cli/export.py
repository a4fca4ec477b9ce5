"""``goodput export``: a run's committed checkpoint as a Hugging Face model directory."""

from __future__ import annotations

from pathlib import Path

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_dir", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Run directory of `goodput train` (its --out).")
@click.option("--step", default=None, type=int, help="The committed checkpoint to export (default: the newest).")
@click.option("--out", "out_dir", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="The Hugging Face directory to write; it must not exist or be empty (see --overwrite).")
@click.option("--dtype", default=None, type=click.Choice(["float32", "bfloat16", "float16"]),
              help="Cast the weights (default: as trained, float32). bfloat16 halves the size for serving.")
@click.option("--max-shard-size", "max_shard_gb", default=5.0, show_default=True,
              help="GB per safetensors file; a bigger model is split, with model.safetensors.index.json.")
@click.option("--tokenizer", "tokenizer_dir", default=None,
              type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="Copy the tokenizer files of this directory (default: the run's dataset's, if it has them).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out (the old one goes once the new is in).")
def export(run_dir: Path, step: int | None, out_dir: Path, dtype: str | None, max_shard_gb: float,
           tokenizer_dir: Path | None, overwrite: bool) -> None:
    """Write a committed checkpoint of RUN as a Hugging Face directory (config.json + safetensors) that
    transformers loads and vLLM serves. Needs no GPU and no process group: any world size, FSDP2 or DDP.

    \b
    Example:
      goodput export --run fsx/runs/llama-demo --out fsx/exports/llama-demo --dtype bfloat16
    """
    from trainer.models import ModelError
    from trainer.models.hf import HFError, export_run

    if max_shard_gb <= 0:
        raise click.BadParameter("must be positive", param_hint="--max-shard-size")
    try:
        out = export_run(run_dir, out_dir, step=step, dtype=dtype, max_shard_bytes=int(max_shard_gb * 1e9),
                         tokenizer_dir=tokenizer_dir, overwrite=overwrite, progress=click.echo)
    except (HFError, ModelError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {out}")
