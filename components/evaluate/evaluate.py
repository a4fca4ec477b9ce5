"""Evaluate a run's committed checkpoints on the validation split, report, and gate promotion.

    goodput evaluate --run fsx/runs/demo --data fsx/datasets/pystdlib/3.11
    goodput evaluate --run RUN --data DATA --registry s3://models-bucket/registry --threshold 2.5
    goodput evaluate --run RUN --baseline fsx/models/llama-3.2-1b --require-beat-baseline

Any model the trainer trains is evaluated the same way: the run's ``config.json`` names its spec
(``trainer.models.spec_from_run_config``: ``bytegpt``, ``llama``, ``package.module:function``), the model
is built whole on the CPU (``build_local``) and each committed checkpoint (``<run>/checkpoints/step_<N>/``
with ``COMMITTED``) is loaded into it with ``torch.distributed.checkpoint.load(..., no_dist=True)``: only
the ``model.*`` entries are read, no process group is needed, and a run trained with FSDP2 or DDP on any
number of ranks loads the same way. Scoring runs on the pod's GPU when it has one (the pipeline's
``evaluate_gpu_resource``: a whole GPU or a MIG slice), else on the CPU. Validation loss is the spec's loss
(mean cross entropy, nats per token) over the same deterministic windows the trainer uses for
``final_val_loss`` (``trainer.data.eval_windows``); bits per byte = loss / ln 2 / bytes per token, where
bytes per token is the validation split's text bytes over its tokens (the manifest's ``splits.val``; 1 for the byte
vocabulary, where a token is a byte), so runs on datasets of different tokenizers compare. A checkpoint
that is not whole on disk (``CheckpointIncomplete``: a torn marker, a missing or truncated file) or gives a
non-finite loss is reported in ``skipped`` and the others are still evaluated; one that is whole but cannot be
loaded (unreadable or corrupt data, a bug in the loader) fails the evaluation, naming it and the error, so
that an older checkpoint is never promoted in its place.

A baseline (``--baseline DIR``: a Hugging Face model directory, e.g. the one the run was initialised from)
is scored on the same windows (``trainer.models.hf``: ``spec_for_hf_dir`` + ``load_hf_weights``); it must
read the dataset's token ids (the same tokenizer) for the comparison to mean anything.

Promotion gate: the best checkpoint is promoted when its loss is below ``threshold``, not worse than the
current production model's loss on the same windows by more than ``tolerance``, and, with
``require_beat_baseline``, below the baseline's loss. The production model is re-evaluated here rather
than trusting a number recorded on other data.

A promoted model is published to the registry by ``components.evaluate.register.publish_model``: a Hugging Face
directory (``config.json``, safetensors, the dataset's tokenizer files) that ``transformers`` and vLLM load
as it lands, or ``model.pt`` for a model without a Hugging Face adapter (bytegpt); then ``metadata.json``,
then ``production.json``. ``version`` is ``<run name>-step<N>``. Outputs in ``out_dir`` (default
``<run>/evaluation``): ``evaluation.json`` and ``report.html`` (the run's story: ``components.evaluate.report``).
``eval_tasks`` adds lm-evaluation-harness scores per checkpoint and ``promote_on=task:<task>/<metric>`` gates on
one (``components.evaluate.tasks``); ``registry=mlflow://HOST:PORT`` registers in MLflow
(``components.evaluate.mlflow_registry``).
This module imports torch only inside functions; the KFP component is ``components.evaluate.evaluate_op.evaluate_op``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
import time
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from components.evaluate.tasks import TaskError, check_task_settings, gate_on_task, parse_eval_tasks, parse_promote_on
from components.evaluate.register import (
    METADATA_FILE, PRODUCTION_FILE, Registry, load_registered_model, open_registry, publish_model)
from components.evaluate.report import render_report
from trainer import layout
from trainer.digests import params_sha256
from trainer.durable import write_text

log = logging.getLogger(__name__)

UNIFORM_LOSS = math.log(256)      # nats per byte of a uniform guess over bytes


class EvaluationError(RuntimeError):
    """The run cannot be evaluated at all (no config, no checkpoints, none loadable, one that fails to load)."""


class CheckpointIncomplete(Exception):
    """A committed checkpoint that is not whole on disk, the only load failure that skips a checkpoint.

    Exactly one of the subclasses, found before torch DCP reads any tensor (``_check_whole``)."""


class TornMarker(CheckpointIncomplete):
    """Its ``COMMITTED`` marker is not a JSON object listing the checkpoint's files."""


class MissingFile(CheckpointIncomplete):
    """A file the marker lists, or one the DCP ``.metadata`` puts data in, does not exist."""


class TruncatedFile(CheckpointIncomplete):
    """A shard is shorter than the data its ``.metadata`` puts in it."""


@dataclass
class EvaluationResult:
    """Per-checkpoint metrics, the best one, and the promotion decision."""

    run_dir: str
    data_dir: str
    out_dir: str
    model: dict = field(default_factory=dict)               # the run's model: name, flavor, config
    seq_len: int = 0                                         # tokens per validation window
    checkpoints: list[dict] = field(default_factory=list)   # step, val_loss, bpb, windows, tokens, load_s, eval_s
    bytes_per_token: float = 1.0                             # of the validation split: bpb = val_loss/ln 2/this
    skipped: list[dict] = field(default_factory=list)       # step, path, reason
    best: dict | None = None
    baseline: dict | None = None                             # dir, model, val_loss, bpb, windows, tokens, eval_s
    gate: dict = field(default_factory=dict)                 # threshold, tolerance, production, baseline, reason
    promoted: bool = False
    registered: dict | None = None                           # version, model_uri, metadata_uri, format
    summary: dict | None = None                              # the run's summary.json
    evaluation_path: str = ""
    report_path: str = ""
    best_state: Any = field(default=None, repr=False)       # the best checkpoint's weights (not serialised)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "best_state"}


# ------------------------------------------------------------------------------------- model I/O
def read_run_config(run_dir: Path) -> dict:
    """The run's saved ``config.json`` (a dict: its sections as the trainer wrote them)."""
    path = layout.config_path(run_dir)
    if not path.is_file():
        raise EvaluationError(f"{path} not found: {run_dir} is not a run directory of `goodput train`")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EvaluationError(f"{path} is not valid JSON: {e}") from None


def run_spec(run_config: dict):
    """The ``ModelSpec`` a run trained, from its ``config.json`` (runs from before plug-ins: bytegpt)."""
    from trainer.models import ModelError, spec_from_run_config

    try:
        return spec_from_run_config(run_config)
    except ModelError as e:
        raise EvaluationError(f"the run's config.json names a model that cannot be built: {e}") from e


def training_seq_len(run_config: dict, spec) -> int:
    """Tokens per window the run trained and validated on: ``data.seq_len`` or ``model.seq_len`` of its
    config (bytegpt keeps it among its model fields), else the model's ``max_seq_len``."""
    model = run_config.get("model", {})
    for value in (run_config.get("data", {}).get("seq_len"), model.get("seq_len"),
                  (model.get("config") or {}).get("seq_len")):
        if value:
            return int(value)
    return spec.max_seq_len


def _check_whole(path: Path) -> None:
    """Raise a ``CheckpointIncomplete`` if the checkpoint at ``path`` is not whole; reads the marker and the
    DCP ``.metadata``, and only the sizes of the shards. Any other error reading them is raised as is."""
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.compat import dcp_file_extents
    from trainer.layout import read_marker

    try:
        marker = read_marker(path)
    except FileNotFoundError:
        raise MissingFile("COMMITTED marker is gone") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TornMarker(f"torn COMMITTED marker ({type(e).__name__}: {e})") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), list):
        raise TornMarker("torn COMMITTED marker (no list of files)")
    missing = [f for f in marker["files"] if not (path / f).is_file()]
    if missing:
        raise MissingFile(f"missing checkpoint file(s): {', '.join(missing)}")
    # The commit renames .metadata into place before it writes the marker: unreadable, it is corrupt, not torn.
    metadata = FileSystemReader(str(path)).read_metadata()
    short = []
    for name, needed in sorted(dcp_file_extents(metadata).items()):
        if not (path / name).is_file():
            raise MissingFile(f"missing checkpoint file(s): {name} (.metadata puts data in it)")
        size = (path / name).stat().st_size
        if size < needed:
            short.append(f"{name} ({size} of {needed} bytes)")
    if short:
        raise TruncatedFile(f"truncated checkpoint file(s): {', '.join(short)}")


def _dcp_error(e: BaseException) -> str:
    # DCP wraps per-rank failures in CheckpointException (a BaseException) whose text is a traceback.
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        e = getattr(inner, "exception", inner)
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def load_checkpoint_model(path: Path, spec):
    """The spec's model, whole on the CPU, with the weights of one committed checkpoint (no process group)."""
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.integrity import verify_files
    from trainer.models import build_local

    # Nothing unverified is scored: bytes other than those staged raise ChecksumMismatch (the step fails).
    verify_files(Path(path))
    # build_local also fills what a checkpoint does not hold (non-persistent buffers such as RoPE tables).
    model = build_local(spec)
    state = {"model": model.state_dict()}
    # Only model.* is requested: the default load planner reads that subset and leaves optimizer state,
    # RNG and counters on disk.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")   # no_dist is the intent
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def load_baseline_model(hf_dir: Path, name: str = "llama"):
    """(spec, model) of a Hugging Face model directory, on the CPU, as ``--baseline`` scores it."""
    from trainer.models import build_local
    from trainer.models.hf import load_hf_weights, spec_for_hf_dir

    spec = spec_for_hf_dir(name, hf_dir)
    model = build_local(spec)
    load_hf_weights(model, spec, hf_dir)
    return spec, model.eval()


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    """Bits per byte of text from a loss in nats per token: comparable across tokenizers."""
    return loss / math.log(2) / bytes_per_token


def eval_device():
    """Where scoring runs: the pod's GPU (or MIG slice) when it has one (``evaluate_gpu_resource``), else the CPU."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def validation_loss(spec, model, windows: list, batch_size: int = 32) -> tuple[float, int]:
    """(mean of the spec's loss in nats per token, tokens) over the given (x, y) windows, on ``eval_device()``;
    the model is back on the CPU afterwards (its weights are hashed and registered from there)."""
    import numpy as np
    import torch

    device = eval_device()
    total, tokens = 0.0, 0
    model.to(device)
    try:
        with torch.no_grad():
            for i in range(0, len(windows), batch_size):
                chunk = windows[i:i + batch_size]
                x = torch.from_numpy(np.stack([w[0] for w in chunk])).to(device)
                y = torch.from_numpy(np.stack([w[1] for w in chunk])).to(device)
                # The spec's loss is a batch mean: weighted by the batch's tokens, batches of any size add up.
                total += spec.loss(model, x, y).double().item() * y.numel()
                tokens += y.numel()
    finally:
        model.to("cpu")
    return total / tokens, tokens


def _check_reads(spec, data_dir: Path, seq_len: int, what: str) -> None:
    """A model that cannot read the dataset's ids or the windows' length fails before any work."""
    from trainer.data import check_vocab

    try:
        check_vocab(data_dir, spec.vocab.size)
    except ValueError as e:
        raise EvaluationError(f"{what}: {e}") from None
    if seq_len > spec.max_seq_len:
        raise EvaluationError(f"{what} reads at most {spec.max_seq_len} tokens, the validation windows have "
                              f"{seq_len}; evaluate with a shorter seq_len")


def _production_loss(registry: Registry, model_name: str, windows_for, seq_len: int, tmp: Path,
                     bytes_per_token: float) -> tuple[dict | None, str]:
    """(production record with its loss on these windows, or None; a note for the report)."""
    if not isinstance(registry, Registry):
        return _production_loss_mlflow(registry, model_name, windows_for, seq_len, tmp, bytes_per_token)
    pointer = registry.location(f"{model_name}/{PRODUCTION_FILE}")
    try:
        record = registry.read_json(f"{model_name}/{PRODUCTION_FILE}")
    except Exception as e:
        raise EvaluationError(f"cannot read {pointer} ({type(e).__name__}: {e})") from e
    if record is None:
        return None, f"no production model at {pointer}"
    version = record.get("version", "?")
    try:
        meta = registry.read_json(f"{model_name}/{version}/{METADATA_FILE}")
        if meta is None:
            raise FileNotFoundError(f"{registry.location(f'{model_name}/{version}/{METADATA_FILE}')} not found")
        spec, model = load_registered_model(registry, model_name, version, meta, tmp)
        # The run's windows, cut to what the production model reads (bytegpt's context is its size).
        loss, _ = validation_loss(spec, model, windows_for(min(seq_len, spec.max_seq_len)))
    except Exception as e:
        # Promoting over a production model that cannot be checked would be a blind promotion.
        raise EvaluationError(f"the production model {version!r} named by {pointer} cannot be evaluated "
                              f"({type(e).__name__}: {e}); repair the registry or remove {PRODUCTION_FILE}") from e
    return {"version": version, "val_loss": loss, "bpb": bits_per_byte(loss, bytes_per_token),
            "source_run": meta.get("source_run"), "step": meta.get("step"),
            "tasks": record.get("tasks") or (meta.get("metrics") or {}).get("tasks")}, f"production is {version}"


def _production_loss_mlflow(registry, model_name: str, windows_for, seq_len: int, tmp: Path,
                            bytes_per_token: float) -> tuple[dict | None, str]:
    """``_production_loss`` for an MLflow registry: the version the alias ``production`` names, re-scored from
    its artifacts; its recorded task scores are its run's metrics. An unreachable server fails here."""
    registry.check_reachable()
    record = registry.production(model_name)
    if record is None:
        return None, f"no production alias on {registry.location(model_name)}"
    where = registry.location(model_name, record["mlflow_version"])
    try:
        hf_dir = registry.download(model_name, record["mlflow_version"], tmp / "production")
        spec, model = load_baseline_model(hf_dir, (record.get("model") or {}).get("name", "llama"))
        loss, _ = validation_loss(spec, model, windows_for(min(seq_len, spec.max_seq_len)))
    except Exception as e:
        raise EvaluationError(f"the production model {where} cannot be evaluated ({type(e).__name__}: {e}); "
                              f"repair it or remove its alias production") from e
    return dict(record, val_loss=loss, bpb=bits_per_byte(loss, bytes_per_token),
                recorded_val_loss=record["val_loss"]), f"production is {where}"


def _load_tasks(items: list[str], limit: int | None, promote, tmp: Path, endpoint_url: str | None):
    """The tasks, loaded once before any checkpoint is scored (``components.evaluate.tasks.load_tasks``)."""
    from components.evaluate.tasks import load_tasks

    try:
        suite = load_tasks(items, limit, tmp, endpoint_url)
        suite.check_promote_on(promote)
    except TaskError as e:
        raise EvaluationError(str(e)) from e
    return suite


def _score_tasks(result: EvaluationResult, suite, promote, spec, root: Path, data_dir: Path, tmp: Path) -> None:
    """Each scored checkpoint's task metrics (``components.evaluate.tasks``); with ``promote_on`` a task, the best
    checkpoint is the one with the highest score, and its weights are the ones kept for registering."""
    from components.evaluate.tasks import best_on_task, score_checkpoints
    from trainer.data import read_manifest
    from trainer.layout import step_dir
    from trainer.models.hf import dataset_tokenizer

    byte_vocab = (read_manifest(data_dir).get("tokenizer") or {"kind": "bytes"}).get("kind") == "bytes"
    try:
        score_checkpoints(suite, result, spec, root, tmp, tokenizer_dir=dataset_tokenizer(data_dir),
                          byte_vocab=byte_vocab, device=eval_device().type)
        best = best_on_task(result, promote) if promote.on_task else \
            next(c for c in result.checkpoints if c["step"] == result.best["step"])
    except TaskError as e:
        raise EvaluationError(str(e)) from e
    if best["step"] != result.best["step"]:
        result.best_state = load_checkpoint_model(step_dir(root, best["step"]), spec).state_dict()
    result.best = dict(best, params_sha256=params_sha256(result.best_state))


def _score_baseline(hf_dir: Path, run_spec_, data_dir: Path, windows: list, seq_len: int, batch_size: int,
                    bytes_per_token: float) -> dict:
    """The baseline directory's loss on the run's windows (the run's model name reads it, else llama)."""
    from trainer.models.hf import HFError

    t0 = time.monotonic()
    try:
        spec, model = load_baseline_model(hf_dir, run_spec_.name if run_spec_.hf is not None else "llama")
    except (HFError, ValueError, OSError) as e:
        raise EvaluationError(f"--baseline {hf_dir} cannot be loaded: {e}") from e
    _check_reads(spec, data_dir, seq_len, f"--baseline {hf_dir}")
    loss, tokens = validation_loss(spec, model, windows, batch_size)
    if not math.isfinite(loss):
        raise EvaluationError(f"--baseline {hf_dir} gives a non-finite validation loss ({loss})")
    return {"dir": str(hf_dir), "model": spec.describe(), "val_loss": loss,
            "bpb": bits_per_byte(loss, bytes_per_token), "windows": len(windows), "tokens": tokens,
            "eval_s": round(time.monotonic() - t0, 3)}


# ------------------------------------------------------------------------------------------- core
def evaluate_run(
    run_dir: str | Path,
    data_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    last_n: int | None = None,
    threshold: float = UNIFORM_LOSS,
    tolerance: float = 0.0,
    registry: str | None = None,
    endpoint_url: str | None = None,
    *,
    model_name: str = "",
    max_windows: int | None = None,
    batch_size: int = 32,
    seq_len: int | None = None,
    baseline: str | Path | None = None,
    require_beat_baseline: bool = False,
    max_shard_bytes: int | None = None,
    eval_tasks: str | list[str] = "",
    eval_limit: int | None = None,
    promote_on: str = "val_loss",
) -> EvaluationResult:
    """Evaluate the committed checkpoints of a ``goodput train`` run and gate the best one.

    Args:
        run_dir: the run directory (``--out`` of ``goodput train``).
        data_dir: dataset directory whose validation split is used (default: the run's ``--data``).
        out_dir: where ``evaluation.json`` and ``report.html`` go (default ``<run_dir>/evaluation``).
        last_n: evaluate only the newest N committed checkpoints (None or 0: all).
        threshold: promote only if the best loss (nats per token) is below this; the default is the loss of
            a uniform guess over bytes, ln 256.
        tolerance: promote only if the best loss is at most the production model's loss plus this.
        registry: model registry, a directory or ``s3://bucket/prefix``; None: the gate is decided and
            reported, nothing is written and there is no production model to compare with.
        endpoint_url: S3-compatible endpoint for an ``s3://`` registry.
        model_name: the model's name in the registry; empty: the run's own model's (``bytegpt``, ``llama``, the
            last part of a user module's name), as the pipeline names it.
        max_windows: validation windows (default: the run's ``eval_windows``, so the final checkpoint
            reproduces the run's ``final_val_loss``).
        batch_size: windows per forward pass.
        seq_len: tokens per window (default: the run's training sequence length).
        baseline: a Hugging Face model directory scored on the same windows (e.g. the run's ``--init-from``).
        require_beat_baseline: promote only if the best loss is below the baseline's.
        max_shard_bytes: a registered Hugging Face directory is sharded above this (default 5 GB).
        eval_tasks: lm-evaluation-harness tasks scored on each checkpoint, comma-separated: task names and task
            files (``components.evaluate.tasks``); empty: none.
        eval_limit: examples per task (None or 0: all).
        promote_on: ``val_loss``, or ``task:<task>/<metric>`` (higher is better): picks the best checkpoint
            and is compared with the production model's recorded score.

    Returns:
        The evaluation; ``evaluation.json`` and ``report.html`` are written to ``out_dir``.

    Raises:
        EvaluationError: no config, no committed checkpoint, none of them could be evaluated, one whole on
            disk that cannot be loaded, or a model (the run's, the baseline, production) that cannot read the
            dataset.
    """
    from components.evaluate.register import registry_name
    from trainer.data import Split, bytes_per_token, eval_windows, read_manifest
    from trainer.layout import committed_steps, step_dir
    from trainer.models.hf import dataset_tokenizer

    run_dir = Path(run_dir)
    run_config = read_run_config(run_dir)
    # A run from before model plug-ins names no model: it trained bytegpt (``run_spec``).
    model_name = registry_name(run_config.get("model", {}).get("name", "bytegpt"), model_name)
    if tolerance < 0:
        raise ValueError(f"tolerance must not be negative, got {tolerance}")
    if require_beat_baseline and not baseline:
        raise ValueError("require_beat_baseline needs a baseline model directory (--baseline DIR)")
    check_task_settings(eval_tasks if isinstance(eval_tasks, str) else ",".join(eval_tasks), eval_limit or 0,
                        promote_on)
    task_items, promote = parse_eval_tasks(eval_tasks), parse_promote_on(promote_on)
    if baseline and not Path(baseline).is_dir():
        raise ValueError(f"--baseline {baseline}: no such directory (give a Hugging Face model directory)")
    spec = run_spec(run_config)
    data = run_config.get("data", {})
    data_dir = Path(data_dir or data.get("data") or "")
    if not str(data_dir) or data_dir == Path("."):
        raise EvaluationError(f"{run_dir}/config.json names no dataset; give the dataset directory (--data)")
    out_dir = Path(out_dir) if out_dir else layout.evaluation_dir(run_dir)
    reg = open_registry(registry, endpoint_url) if registry else None
    val = Split.open(data_dir, "val")       # a bad dataset fails here, before any work
    bpt = bytes_per_token(read_manifest(data_dir), "val")
    seq_len = seq_len or training_seq_len(run_config, spec)
    _check_reads(spec, data_dir, seq_len, f"the run's model ({spec.name})")
    n_windows = max_windows or data.get("eval_windows") or 64
    cache: dict[int, list] = {}

    def windows_for(length: int) -> list:
        if length not in cache:
            cache[length] = list(eval_windows(val, length, n_windows))
            if not cache[length]:
                raise EvaluationError(f"{data_dir}: the validation split ({len(val)} tokens) is shorter than one "
                                      f"window of {length + 1} tokens")
        return cache[length]

    windows = windows_for(seq_len)
    root = layout.checkpoints_dir(run_dir)
    committed = committed_steps(root)
    steps = committed[-last_n:] if last_n else committed
    result = EvaluationResult(run_dir=str(run_dir), data_dir=str(data_dir), out_dir=str(out_dir),
                              model=spec.describe(), seq_len=seq_len, bytes_per_token=bpt)
    summary_path = layout.summary_path(run_dir)
    if summary_path.is_file():
        try:
            result.summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            log.warning("%s is unreadable: %s", summary_path, e)
    if root.is_dir():
        for p in sorted(root.iterdir()):
            step = layout.step_of(p)
            if p.is_dir() and step is not None and step not in committed:
                result.skipped.append({"step": step, "path": str(p),
                                       "reason": "not committed (torn or in progress)"})
    if not steps:
        raise EvaluationError(f"no committed checkpoint under {root}")
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = Path(tmp_dir.name)
    try:
        # The references first: a baseline or registry that cannot be read fails before any checkpoint is scored.
        if baseline:
            result.baseline = _score_baseline(Path(baseline), spec, data_dir, windows, seq_len, batch_size, bpt)
        production, note = (None, "no registry given") if reg is None else \
            _production_loss(reg, model_name, windows_for, seq_len, tmp, bpt)
        suite = _load_tasks(task_items, eval_limit, promote, tmp, endpoint_url) if task_items else None
        _score(result, spec, root, steps, windows, batch_size, step_dir)
        if not result.checkpoints:
            _finish(result, run_dir, out_dir)
            reasons = "; ".join(f"step {s['step']}: {s['reason']}" for s in result.skipped)
            raise EvaluationError(f"none of the {len(steps)} committed checkpoints under {root} could be "
                                  f"evaluated: {reasons}")
        if suite is not None and result.checkpoints:
            _score_tasks(result, suite, promote, spec, root, data_dir, tmp)
        _gate(result, threshold, tolerance, None if promote.on_task else production, note, require_beat_baseline)
        if promote.on_task:
            gate_on_task(result.gate, result.best, promote, production, tolerance)
            result.gate["production"], result.promoted = production, bool(result.gate["passed"])
        result.gate["promote_on"] = str(promote)
        if result.promoted and reg is not None:
            result.registered = _register(reg, model_name, run_dir, data_dir, spec, result, tmp,
                                          dataset_tokenizer(data_dir), max_shard_bytes)
    finally:
        tmp_dir.cleanup()
    _finish(result, run_dir, out_dir)
    return result


def _score(result: EvaluationResult, spec, root: Path, steps: list[int], windows: list, batch_size: int,
           step_dir) -> None:
    """Load and score each checkpoint; an incomplete one is reported in ``skipped`` and the rest go on (one
    that is whole but fails to load raises ``EvaluationError``). Sets
    ``result.best`` and ``result.best_state`` (only the best weights are kept in memory)."""
    best_state = None
    for step in steps:
        path = step_dir(root, step)
        problem = model = None
        t0 = time.monotonic()
        try:
            _check_whole(path)
            model = load_checkpoint_model(path, spec)
        except CheckpointIncomplete as e:
            problem = str(e)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: B036 - DCP's CheckpointException derives from BaseException
            # Whole on disk yet not loadable: skipping it could promote an older checkpoint in its place.
            raise EvaluationError(f"checkpoint {path} is whole on disk but cannot be loaded: {_dcp_error(e)}") from e
        load_s, t1 = time.monotonic() - t0, time.monotonic()
        if model is not None:
            loss, tokens = validation_loss(spec, model, windows, batch_size)
            if not math.isfinite(loss):
                problem = f"non-finite validation loss ({loss})"
        if problem is not None:
            log.warning("checkpoint step %d skipped: %s", step, problem)
            result.skipped.append({"step": step, "path": str(path), "reason": problem})
            continue
        entry = {"step": step, "val_loss": loss, "bpb": bits_per_byte(loss, result.bytes_per_token),
                 "windows": len(windows),
                 "tokens": tokens, "load_s": round(load_s, 3), "eval_s": round(time.monotonic() - t1, 3)}
        result.checkpoints.append(entry)
        # Lowest loss wins; on a tie the later step (more training for the same loss).
        if result.best is None or (loss, -step) < (result.best["val_loss"], -result.best["step"]):
            best_state = model.state_dict()
            result.best = dict(entry, params_sha256=params_sha256(best_state))
    result.skipped.sort(key=lambda s: s["step"])
    result.best_state = best_state


def _gate(result: EvaluationResult, threshold: float, tolerance: float, production: dict | None,
          note: str, require_beat_baseline: bool = False) -> None:
    best, base = result.best, result.baseline
    gate: dict[str, Any] = {"threshold": threshold, "tolerance": tolerance, "production": production,
                            "require_beat_baseline": require_beat_baseline,
                            "baseline": None if base is None else {k: base[k] for k in ("dir", "val_loss", "bpb")}}
    if not best["val_loss"] < threshold:
        gate["passed"], gate["reason"] = False, (f"best loss {best['val_loss']:.4f} is not below the threshold "
                                                 f"{threshold:.4f}")
    elif production is not None and best["val_loss"] > production["val_loss"] + tolerance:
        gate["passed"], gate["reason"] = False, (
            f"best loss {best['val_loss']:.4f} is worse than production {production['version']} "
            f"({production['val_loss']:.4f}) by more than the tolerance {tolerance:.4f}")
    elif require_beat_baseline and not best["val_loss"] < base["val_loss"]:
        gate["passed"], gate["reason"] = False, (
            f"best loss {best['val_loss']:.4f} does not beat the baseline {base['dir']} ({base['val_loss']:.4f})")
    else:
        gate["passed"], gate["reason"] = True, (
            f"best loss {best['val_loss']:.4f} < threshold {threshold:.4f}; "
            + (f"production {production['version']} has {production['val_loss']:.4f} (tolerance {tolerance:.4f})"
               if production else note)
            + (f"; baseline {base['dir']} has {base['val_loss']:.4f}" if base else ""))
    result.gate = gate
    result.promoted = bool(gate["passed"])


def _register(reg: Registry, model_name: str, run_dir: Path, data_dir: Path, spec, result: EvaluationResult,
              tmp: Path, tokenizer_dir: Path | None, max_shard_bytes: int | None) -> dict:
    """Publish the best weights (a Hugging Face directory, or model.pt without an adapter) and point
    production.json at them (``components.evaluate.register.publish_model``)."""
    import torch

    from components.evaluate.tasks import byte_tokenizer_dir, has_transformers
    from components.evaluate.register import publish_model_mlflow
    from trainer.data import read_manifest

    best = result.best
    version = f"{run_dir.name}-step{best['step']:09d}"
    tokenizer = read_manifest(data_dir).get("tokenizer") or {"kind": "bytes"}
    tokenizer_spec = tokenizer.get("spec") or tokenizer["kind"]
    if tokenizer_dir is None and tokenizer["kind"] == "bytes" and spec.hf is not None and has_transformers():
        tokenizer_dir = byte_tokenizer_dir(tmp)     # so the registered directory loads with AutoTokenizer too
    manifest_sha = None
    if (data_dir / layout.MANIFEST).is_file():
        manifest_sha = hashlib.sha256((data_dir / layout.MANIFEST).read_bytes()).hexdigest()
    metadata = {
        "model_name": model_name,
        "version": version,
        "model": spec.describe(),
        "source_run": str(run_dir.resolve()),
        "step": best["step"],
        "metrics": {"val_loss": best["val_loss"], "bpb": best["bpb"], "windows": best["windows"],
                    "seq_len": result.seq_len, "tasks": best.get("tasks")},
        "baseline": result.gate.get("baseline"),
        "params_sha256": best["params_sha256"],
        "data": {"dir": str(data_dir), "manifest_sha256": manifest_sha,
                 "tokenizer": str(tokenizer_dir) if tokenizer_dir else None, "tokenizer_spec": tokenizer_spec},
        "promote_on": result.gate.get("promote_on"),
        "run_summary": result.summary,
        "gate": {k: v for k, v in result.gate.items() if k != "passed"},
        "created_at": time.time(),
        "torch_version": torch.__version__,
    }
    if spec.name == "bytegpt":
        metadata["model_config"] = spec.describe()["config"]      # what registries before plug-ins read
    if not isinstance(reg, Registry):
        report = render_report(dict(result.to_dict(), promoted=True), run_dir)
        return publish_model_mlflow(reg, model_name, version, spec, result.best_state, metadata, tmp,
                                    tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes,
                                    checkpoints=result.checkpoints,
                                    files={layout.REPORT_FILE: report,
                                           layout.EVALUATION_FILE: json.dumps(result.to_dict(), indent=1)})
    return publish_model(reg, model_name, version, spec, result.best_state, metadata, tmp,
                         tokenizer_dir=tokenizer_dir, max_shard_bytes=max_shard_bytes,
                         production_extra={"val_loss": best["val_loss"], "tasks": best.get("tasks")})


def _finish(result: EvaluationResult, run_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    result.evaluation_path = str(out_dir / layout.EVALUATION_FILE)
    result.report_path = str(out_dir / layout.REPORT_FILE)
    write_text(out_dir / layout.REPORT_FILE, render_report(result.to_dict(), run_dir))
    write_text(out_dir / layout.EVALUATION_FILE, json.dumps(result.to_dict(), indent=1))
