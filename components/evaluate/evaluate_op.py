"""KFP component: evaluate a run's checkpoints and gate promotion (``components.evaluate.evaluate.evaluate_run``)."""

import os
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Metrics, Output

# The image the component runs in: evaluation loads checkpoints with torch, so it is the trainer image
# (images/trainer.Dockerfile), not the light component image. Override it, and PACKAGES, at compile time.
BASE_IMAGE = os.environ.get("GOODPUT_EVALUATE_IMAGE", "ghcr.io/goodput-pipelines/trainer:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def evaluate_op(
    run_dir: str,
    data_dir: str = "",
    out_dir: str = "",
    last_n: int = 0,
    threshold: float = 5.545177444479562,
    tolerance: float = 0.0,
    model_name: str = "",
    registry: str = "",
    endpoint_url: str = "",
    baseline: str = "",
    require_beat_baseline: bool = False,
    eval_tasks: str = "",
    eval_limit: int = 0,
    promote_on: str = "val_loss",
    *,
    dataset: Input[Dataset] = None,
    metrics: Output[Metrics],
    report: Output[HTML],
) -> NamedTuple("Outputs", [("promoted", bool), ("best_step", int), ("best_val_loss", float), ("model_uri", str)]):
    """Evaluate the committed checkpoints of a training run, report them, and gate promotion.

    Scores on the pod's GPU when the pipeline gives it one (``evaluate_gpu_resource``: ``nvidia.com/gpu`` or a
    MIG slice such as ``nvidia.com/mig-3g.40gb``, set with ``set_accelerator_type``), else on its CPUs.

    Args:
        run_dir: the run directory on FSx (``checkpoints/``, ``config.json``, ``summary.json``).
        data_dir: dataset directory whose validation split is scored; empty: the ``dataset`` input's URI,
            else the run's own ``--data``.
        out_dir: where ``evaluation.json`` and ``report.html`` are also written; empty: ``<run_dir>/evaluation``.
        last_n: evaluate only the newest N committed checkpoints; 0: all.
        threshold: promote only if the best validation loss (nats per token) is below this (default ln 256,
            a uniform guess over bytes).
        tolerance: promote only if the best loss is at most the production model's loss plus this.
        model_name: the model's name in the registry; empty: the run's own model's (bytegpt, llama, ...).
        registry: model registry, a directory, ``s3://bucket/prefix`` or an MLflow server (``mlflow://HOST:PORT``,
            ``mlflow+https://HOST``); empty: decide, write nothing.
        endpoint_url: S3-compatible endpoint for an ``s3://`` registry; empty for AWS (IRSA credentials).
        baseline: a Hugging Face model directory on FSx (e.g. the run's init_from) scored on the same
            validation windows; empty: none.
        require_beat_baseline: promote only if the best loss is below the baseline's (needs ``baseline``).
        eval_tasks: lm-evaluation-harness tasks scored on each checkpoint's Hugging Face export, comma-separated:
            harness task names, task files (.yaml) on FSx, or s3://.../FILE.yaml; empty: none.
        eval_limit: examples per task; 0: all.
        promote_on: val_loss, or task:<task>/<metric> (higher is better, e.g. task:arc_easy/acc_norm).
        dataset: optional, the stage component's output; its URI is the dataset directory.
        metrics: output; validation loss (nats per token) and bits per byte of each checkpoint, of the best
            and of the baseline, and the dataset's bytes per token (bits per byte compare across tokenizers);
            each task metric of each checkpoint (``step_<N>_<task>_<metric>``) and of the best
            (``best_<task>_<metric>``).
        report: output; the HTML report (loss against step, the run's goodput and faults, the gate).

    Returns:
        promoted (the gate passed), best_step, best_val_loss, model_uri (empty unless registered: the
        registered Hugging Face directory, or its model.pt for a model without a Hugging Face layout).
    """
    import shutil
    from collections import namedtuple

    from components.evaluate.evaluate import evaluate_run

    data = data_dir or (dataset.uri if dataset is not None else "") or None
    result = evaluate_run(run_dir, data, out_dir or None, last_n=last_n or None, threshold=threshold,
                          tolerance=tolerance, registry=registry or None, endpoint_url=endpoint_url or None,
                          model_name=model_name, baseline=baseline or None,
                          require_beat_baseline=require_beat_baseline, eval_tasks=eval_tasks,
                          eval_limit=eval_limit or None, promote_on=promote_on or "val_loss")

    def log_tasks(prefix: str, entry: dict) -> None:
        for task, values in (entry.get("tasks") or {}).items():
            for name, value in values.items():
                metrics.log_metric(f"{prefix}_{task}_{name}".replace(",", "_").replace("/", "_"), value)

    for c in result.checkpoints:
        metrics.log_metric(f"step_{c['step']}_val_loss", c["val_loss"])
        metrics.log_metric(f"step_{c['step']}_bpb", c["bpb"])
        log_tasks(f"step_{c['step']}", c)
    log_tasks("best", result.best)
    metrics.log_metric("best_step", result.best["step"])
    metrics.log_metric("best_val_loss", result.best["val_loss"])
    metrics.log_metric("best_bpb", result.best["bpb"])
    if result.baseline:
        metrics.log_metric("baseline_val_loss", result.baseline["val_loss"])
        metrics.log_metric("baseline_bpb", result.baseline["bpb"])
    metrics.log_metric("bytes_per_token", result.bytes_per_token)
    metrics.log_metric("checkpoints_skipped", len(result.skipped))
    metrics.log_metric("promoted", 1.0 if result.promoted else 0.0)
    shutil.copyfile(result.report_path, report.path)
    outputs = namedtuple("Outputs", ["promoted", "best_step", "best_val_loss", "model_uri"])
    return outputs(result.promoted, result.best["step"], result.best["val_loss"],
                   result.registered["model_uri"] if result.registered else "")
