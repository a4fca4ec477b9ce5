"""``goodput evaluate``: score a run's committed checkpoints, write the report, gate promotion."""

from __future__ import annotations

import math
from pathlib import Path

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_dir", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Run directory of `goodput train` (its --out).")
@click.option("--data", "data_dir", default=None, type=click.Path(path_type=Path, file_okay=False),
              help="Dataset directory whose validation split is scored (default: the run's --data).")
@click.option("--out", "out_dir", default=None, type=click.Path(path_type=Path, file_okay=False),
              help="Where evaluation.json and report.html go (default: RUN/evaluation).")
@click.option("--last", "last_n", default=0, show_default=True,
              help="Only the newest N committed checkpoints (0: all).")
@click.option("--threshold", default=math.log(256), show_default=True,
              help="Promote only if the best validation loss (nats/token) is below this (default: ln 256, "
                   "chance over bytes).")
@click.option("--tolerance", default=0.0, show_default=True,
              help="Promote only if the best loss is at most the production model's loss plus this.")
@click.option("--registry", default=None,
              help="Model registry: a directory, s3://BUCKET/PREFIX, or an MLflow server (mlflow://HOST:PORT, "
                   "mlflow+https://HOST; token in MLFLOW_TRACKING_TOKEN); the promoted model is written there and "
                   "the current production model is read from there. Without it nothing is written.")
@click.option("--model-name", default="",
              help="The model's name in the registry [default: the run's model: bytegpt, llama, or the last part "
                   "of your module's name].")
@click.option("--endpoint-url", default=None, help="S3-compatible endpoint for an s3:// registry.")
@click.option("--windows", "max_windows", default=None, type=int,
              help="Validation windows (default: the run's --eval-windows).")
@click.option("--seq-len", default=None, type=click.IntRange(min=1),
              help="Tokens per validation window (default: the run's training sequence length).")
@click.option("--baseline", default=None, type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="A Hugging Face model directory (config.json + *.safetensors, e.g. the run's --init-from) "
                   "scored on the same windows; it must use the dataset's tokenizer.")
@click.option("--require-beat-baseline", is_flag=True,
              help="Promote only if the best checkpoint's loss is below the baseline's (needs --baseline).")
@click.option("--tasks", "eval_tasks", default="",
              help="lm-evaluation-harness tasks scored on each checkpoint, comma-separated: harness task names "
                   "(arc_easy), task files (.yaml) of your own, or s3://BUCKET/PREFIX/FILE.yaml.")
@click.option("--limit", "eval_limit", default=0, show_default=True, type=click.IntRange(min=0),
              help="Examples per task (0: all).")
@click.option("--promote-on", default="val_loss", show_default=True,
              help="What picks the best checkpoint and gates it: val_loss, or task:TASK/METRIC (higher is better, "
                   "compared with the production model's recorded score), e.g. task:arc_easy/acc_norm.")
def evaluate(run_dir: Path, data_dir: Path | None, out_dir: Path | None, last_n: int, threshold: float,
             tolerance: float, registry: str | None, model_name: str, endpoint_url: str | None,
             max_windows: int | None, seq_len: int | None, baseline: Path | None,
             require_beat_baseline: bool, eval_tasks: str, eval_limit: int, promote_on: str) -> None:
    """Evaluate every committed checkpoint of RUN (or the last N), pick the best, gate promotion.

    Any model the run trained (bytegpt, llama, your package.module:function) is rebuilt from RUN/config.json.
    Writes evaluation.json (per-checkpoint loss and bits per byte, best, baseline, promoted) and report.html.
    A corrupt or partial checkpoint is reported and skipped. Exit status 1 when nothing could be evaluated.
    A promoted model is registered as a Hugging Face directory that transformers and vLLM load (model.pt
    for a model without a Hugging Face layout, such as bytegpt).

    \b
    Example:
      goodput evaluate --run fsx/runs/demo --data fsx/datasets/pystdlib/3.11 --registry fsx/models
      goodput evaluate --run fsx/runs/ft --baseline fsx/models/base --require-beat-baseline
      goodput evaluate --run fsx/runs/demo --tasks evals/mc.yaml --limit 50 --promote-on task:mc/acc \
        --registry mlflow://127.0.0.1:5000
    """
    if require_beat_baseline and baseline is None:
        raise click.UsageError("--require-beat-baseline needs --baseline DIR")
    from rich.console import Console
    from rich.table import Table

    from components.evaluate.evaluate import evaluate_run
    from components.evaluate.report import task_metrics

    # A bad argument (exit 2) and an EvaluationError (exit 1) are reported by the `goodput` group, as one line.
    result = evaluate_run(run_dir, data_dir, out_dir, last_n=last_n or None, threshold=threshold,
                          tolerance=tolerance, registry=registry, endpoint_url=endpoint_url,
                          model_name=model_name, max_windows=max_windows, seq_len=seq_len, baseline=baseline,
                          require_beat_baseline=require_beat_baseline, eval_tasks=eval_tasks,
                          eval_limit=eval_limit or None, promote_on=promote_on)
    table = Table(title=f"evaluation of {run_dir}")
    for col in ("step", "val loss", "bits/byte", ""):
        table.add_column(col, justify="right")
    for c in result.checkpoints:
        table.add_row(str(c["step"]), f"{c['val_loss']:.4f}", f"{c['bpb']:.4f}",
                      "best" if c["step"] == result.best["step"] else "")
    for s in result.skipped:
        table.add_row(str(s["step"]), "-", "-", f"skipped: {s['reason']}")
    if result.baseline:
        table.add_row("baseline", f"{result.baseline['val_loss']:.4f}", f"{result.baseline['bpb']:.4f}",
                      str(result.baseline["dir"]))
    Console().print(table)
    metrics = task_metrics(result.to_dict())
    if metrics:
        tasks = Table(title="benchmark tasks (lm-evaluation-harness)")
        for col in ["step", *(f"{t} {m}" for t, ms in metrics.items() for m in ms)]:
            tasks.add_column(col, justify="right")
        for c in result.checkpoints:
            values = [c["tasks"].get(t, {}).get(m) for t, ms in metrics.items() for m in ms]
            tasks.add_row(str(c["step"]), *("-" if v is None else f"{v:.4f}" for v in values))
        Console().print(tasks)
    click.echo(("PROMOTED" if result.promoted else "not promoted") + f": {result.gate['reason']}")
    if result.registered:
        click.echo(f"registered {result.registered['model_uri']}")
    click.echo(f"wrote {result.evaluation_path} and {result.report_path}")
