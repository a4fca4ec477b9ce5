"""Evaluate a run's committed checkpoints on the validation split, report, and gate promotion.

    goodput evaluate --run fsx/runs/demo --data fsx/datasets/pystdlib/3.11
    goodput evaluate --run RUN --data DATA --registry s3://models-bucket/registry --threshold 2.5

Each committed checkpoint (``<run>/checkpoints/step_<N>/`` with ``COMMITTED``) is loaded into one
``ByteGPT`` on the CPU (or one GPU) with ``torch.distributed.checkpoint.load(..., no_dist=True)``: only
the ``model.*`` entries are read, no process group is needed, and a run trained with FSDP2 or DDP on
any number of ranks loads the same way. Validation loss is the mean cross entropy (nats per token) over
the same deterministic windows the trainer uses for ``final_val_loss`` (``trainer.data.eval_windows``);
bits per byte = loss / ln 2 / bytes per token, where bytes per token is the validation split's text bytes
over its tokens (the manifest's ``splits.val``; 1 for the byte vocabulary, where a token is a byte), so runs
on datasets of different tokenizers compare. A checkpoint that is torn, misses a shard, cannot
be read or gives a non-finite loss is reported in ``skipped`` and the others are still evaluated.

Promotion gate: the best checkpoint is promoted when its loss is below ``threshold`` and not worse than
the current production model's loss on the same windows by more than ``tolerance`` (both in nats per
byte). The production model is re-evaluated here rather than trusting a number recorded on other data.

Model registry (a directory or ``s3://bucket/prefix``)::

    <registry>/<model_name>/<version>/model.pt        torch.save of the full state dict (one file)
    <registry>/<model_name>/<version>/metadata.json   source run, step, metrics, model config, params_sha256
    <registry>/<model_name>/production.json           the current production version (written last)

``version`` is ``<run name>-step<N>``. Outputs in ``out_dir`` (default ``<run>/evaluation``):
``evaluation.json`` and ``report.html`` (the run's story: ``components.report``). This module imports
torch only inside functions; the KFP component is ``components.evaluate_op.evaluate_op``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from components.report import render_report

log = logging.getLogger(__name__)

UNIFORM_LOSS = math.log(256)      # nats per byte of a uniform guess over bytes
MODEL_FILE = "model.pt"
METADATA_FILE = "metadata.json"
PRODUCTION_FILE = "production.json"


class EvaluationError(RuntimeError):
    """The run cannot be evaluated at all (no config, no checkpoints, none loadable)."""


@dataclass
class EvaluationResult:
    """Per-checkpoint metrics, the best one, and the promotion decision."""

    run_dir: str
    data_dir: str
    out_dir: str
    checkpoints: list[dict] = field(default_factory=list)   # step, val_loss, bpb, windows, tokens, load_s, eval_s
    bytes_per_token: float = 1.0                             # of the validation split: bpb = val_loss/ln 2/this
    skipped: list[dict] = field(default_factory=list)       # step, path, reason
    best: dict | None = None
    gate: dict = field(default_factory=dict)                 # threshold, tolerance, production, passed, reason
    promoted: bool = False
    registered: dict | None = None                           # version, model_uri, metadata_uri
    summary: dict | None = None                              # the run's summary.json
    evaluation_path: str = ""
    report_path: str = ""
    best_state: Any = field(default=None, repr=False)       # the best checkpoint's weights (not serialised)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "best_state"}


# ------------------------------------------------------------------------------------- model I/O
def _model_config(run_dir: Path):
    from trainer.config import config_from_dict

    path = run_dir / "config.json"
    if not path.is_file():
        raise EvaluationError(f"{path} not found: {run_dir} is not a run directory of `goodput train`")
    return config_from_dict(json.loads(path.read_text()))


def params_sha256(state_dict: dict) -> str:
    """The identity of a set of weights, computed as the trainer's ``summary.json`` ``params_sha256``."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _checkpoint_problem(path: Path) -> str | None:
    """Cheap checks before DCP reads anything: the marker parses and every file it lists is there."""
    from trainer.checkpoint import read_marker

    try:
        marker = read_marker(path)
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable COMMITTED marker ({type(e).__name__}: {e})"
    missing = [f for f in marker.get("files", []) if not (path / f).is_file()]
    if missing:
        return f"missing checkpoint file(s): {', '.join(missing)}"
    return None


def _dcp_error(e: BaseException) -> str:
    # DCP wraps per-rank failures in CheckpointException (a BaseException) whose text is a traceback.
    failures = getattr(e, "failures", None)
    if failures:
        inner = next(iter(failures.values()))
        e = getattr(inner, "exception", inner)
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def load_checkpoint_model(path: Path, model_cfg):
    """A ``ByteGPT`` with the weights of one committed checkpoint, loaded without a process group."""
    import torch.distributed.checkpoint as dcp

    from trainer.model import ByteGPT

    model = ByteGPT(model_cfg)
    state = {"model": model.state_dict()}
    # Only model.* is requested: the default load planner reads that subset and leaves optimizer state,
    # RNG and counters on disk.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")   # no_dist is the intent
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])
    return model.eval()


def bits_per_byte(loss: float, bytes_per_token: float) -> float:
    """Bits per byte of text from a loss in nats per token: comparable across tokenizers."""
    return loss / math.log(2) / bytes_per_token


def validation_loss(model, windows: list, batch_size: int = 32) -> tuple[float, int]:
    """(mean cross entropy in nats per token, tokens) over the given (x, y) windows."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    total, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch_size):
            chunk = windows[i:i + batch_size]
            x = torch.from_numpy(np.stack([w[0] for w in chunk]))
            y = torch.from_numpy(np.stack([w[1] for w in chunk]))
            logits, _ = model(x)
            total += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1),
                                     reduction="sum").item()
            tokens += y.numel()
    return total / tokens, tokens


# -------------------------------------------------------------------------------------- registry
class Registry:
    """A model registry location: a directory or ``s3://bucket/prefix`` (boto3, standard credentials)."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/")
        self.s3 = self.uri.startswith("s3://")
        if self.s3:
            from components.stage import s3_client

            self.bucket, _, self.prefix = self.uri[len("s3://"):].partition("/")
            if not self.bucket:
                raise ValueError(f"registry {uri!r}: no bucket name; expected s3://BUCKET[/PREFIX]")
            self.client = s3_client(endpoint_url, retry_mode="standard", max_attempts=5)

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def location(self, rel: str) -> str:
        return f"{self.uri}/{rel}"

    def read_json(self, rel: str) -> dict | None:
        if self.s3:
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"].read()
            except self.client.exceptions.NoSuchKey:
                return None
            return json.loads(body)
        path = Path(self.uri) / rel
        return json.loads(path.read_text()) if path.is_file() else None

    def fetch(self, rel: str, dest: Path) -> Path:
        if self.s3:
            self.client.download_file(self.bucket, self._key(rel), str(dest))
            return dest
        return Path(self.uri) / rel

    def put_file(self, src: Path, rel: str) -> str:
        if self.s3:
            self.client.upload_file(str(src), self.bucket, self._key(rel))
        else:
            dest = Path(self.uri) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        return self.location(rel)

    def put_json(self, obj: dict, rel: str) -> str:
        data = json.dumps(obj, indent=1).encode()
        if self.s3:
            self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=data,
                                   ContentType="application/json")
        else:
            dest = Path(self.uri) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f".{dest.name}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)
        return self.location(rel)


def _production_loss(registry: Registry, model_name: str, windows_for, tmp: Path,
                     bytes_per_token: float) -> tuple[dict | None, str]:
    """(production record with its loss on these windows, or None; a note for the report)."""
    import torch

    from trainer.config import ModelConfig
    from trainer.model import ByteGPT

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
        path = registry.fetch(f"{model_name}/{version}/{MODEL_FILE}", tmp / "production.pt")
        model = ByteGPT(ModelConfig(**meta["model_config"]))
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        loss, _ = validation_loss(model.eval(), windows_for(model.cfg.seq_len))
    except Exception as e:
        # Promoting over a production model that cannot be checked would be a blind promotion.
        raise EvaluationError(f"the production model {version!r} named by {pointer} cannot be evaluated "
                              f"({type(e).__name__}: {e}); repair the registry or remove {PRODUCTION_FILE}") from e
    return {"version": version, "val_loss": loss, "bpb": bits_per_byte(loss, bytes_per_token),
            "source_run": meta.get("source_run"), "step": meta.get("step")}, f"production is {version}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    model_name: str = "bytegpt",
    max_windows: int | None = None,
    batch_size: int = 32,
) -> EvaluationResult:
    """Evaluate the committed checkpoints of a ``goodput train`` run and gate the best one.

    Args:
        run_dir: the run directory (``--out`` of ``goodput train``).
        data_dir: dataset directory whose validation split is used (default: the run's ``--data``).
        out_dir: where ``evaluation.json`` and ``report.html`` go (default ``<run_dir>/evaluation``).
        last_n: evaluate only the newest N committed checkpoints (None or 0: all).
        threshold: promote only if the best loss (nats per byte) is below this; the default is the loss of
            a uniform guess over bytes, ln 256.
        tolerance: promote only if the best loss is at most the production model's loss plus this.
        registry: model registry, a directory or ``s3://bucket/prefix``; None: the gate is decided and
            reported, nothing is written and there is no production model to compare with.
        endpoint_url: S3-compatible endpoint for an ``s3://`` registry.
        model_name: the model's name in the registry.
        max_windows: validation windows of ``seq_len`` bytes (default: the run's ``eval_windows``, so the
            final checkpoint reproduces the run's ``final_val_loss``).
        batch_size: windows per forward pass.

    Returns:
        The evaluation; ``evaluation.json`` and ``report.html`` are written to ``out_dir``.

    Raises:
        EvaluationError: no config, no committed checkpoint, or none of them could be evaluated.
    """
    from trainer.checkpoint import committed_steps, step_dir
    from trainer.data import Split, bytes_per_token, eval_windows, read_manifest

    run_dir = Path(run_dir)
    cfg = _model_config(run_dir)
    data_dir = Path(data_dir or cfg.data.data)
    out_dir = Path(out_dir) if out_dir else run_dir / "evaluation"
    if tolerance < 0:
        raise ValueError(f"tolerance must not be negative, got {tolerance}")
    reg = Registry(registry, endpoint_url) if registry else None
    val = Split.open(data_dir, "val")       # a bad dataset fails here, before any work
    bpt = bytes_per_token(read_manifest(data_dir), "val")
    n_windows = max_windows or cfg.data.eval_windows
    cache: dict[int, list] = {}

    def windows_for(seq_len: int) -> list:
        if seq_len not in cache:
            cache[seq_len] = list(eval_windows(val, seq_len, n_windows))
            if not cache[seq_len]:
                raise EvaluationError(f"{data_dir}: the validation split ({len(val)} bytes) is shorter than one "
                                      f"window of {seq_len + 1} bytes")
        return cache[seq_len]

    windows = windows_for(cfg.model.seq_len)
    root = run_dir / "checkpoints"
    committed = committed_steps(root)
    steps = committed[-last_n:] if last_n else committed
    result = EvaluationResult(run_dir=str(run_dir), data_dir=str(data_dir), out_dir=str(out_dir),
                              bytes_per_token=bpt)
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        try:
            result.summary = json.loads(summary_path.read_text())
        except json.JSONDecodeError as e:
            log.warning("%s is unreadable: %s", summary_path, e)
    if root.is_dir():
        for p in sorted(root.glob("step_*")):
            step = p.name[len("step_"):]
            if p.is_dir() and step.isdigit() and int(step) not in committed:
                result.skipped.append({"step": int(step), "path": str(p),
                                       "reason": "not committed (torn or in progress)"})
    if not steps:
        raise EvaluationError(f"no committed checkpoint under {root}")
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = Path(tmp_dir.name)
    try:
        # The production model first: a registry that cannot be read fails before any checkpoint is scored.
        production, note = (None, "no registry given") if reg is None else \
            _production_loss(reg, model_name, windows_for, tmp, bpt)
        _score(result, root, steps, cfg, windows, batch_size, step_dir)
        if not result.checkpoints:
            _finish(result, run_dir, out_dir)
            reasons = "; ".join(f"step {s['step']}: {s['reason']}" for s in result.skipped)
            raise EvaluationError(f"none of the {len(steps)} committed checkpoints under {root} could be "
                                  f"evaluated: {reasons}")
        _gate(result, threshold, tolerance, production, note)
        if result.promoted and reg is not None:
            result.registered = _register(reg, model_name, run_dir, data_dir, cfg, result, tmp)
    finally:
        tmp_dir.cleanup()
    _finish(result, run_dir, out_dir)
    return result


def _score(result: EvaluationResult, root: Path, steps: list[int], cfg, windows: list, batch_size: int,
           step_dir) -> None:
    """Load and score each checkpoint; a bad one is reported in ``skipped`` and the rest go on. Sets
    ``result.best`` and ``result.best_state`` (only the best weights are kept in memory)."""
    best_state = None
    for step in steps:
        path = step_dir(root, step)
        problem = _checkpoint_problem(path)
        model = None
        t0 = time.monotonic()
        if problem is None:
            try:
                model = load_checkpoint_model(path, cfg.model)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: B036 - DCP's CheckpointException derives from BaseException
                problem = f"cannot be loaded: {_dcp_error(e)}"
        load_s, t1 = time.monotonic() - t0, time.monotonic()
        if model is not None:
            loss, tokens = validation_loss(model, windows, batch_size)
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
          note: str) -> None:
    best = result.best
    gate: dict[str, Any] = {"threshold": threshold, "tolerance": tolerance, "production": production}
    if not best["val_loss"] < threshold:
        gate["passed"], gate["reason"] = False, (f"best loss {best['val_loss']:.4f} is not below the threshold "
                                                 f"{threshold:.4f}")
    elif production is not None and best["val_loss"] > production["val_loss"] + tolerance:
        gate["passed"], gate["reason"] = False, (
            f"best loss {best['val_loss']:.4f} is worse than production {production['version']} "
            f"({production['val_loss']:.4f}) by more than the tolerance {tolerance:.4f}")
    else:
        gate["passed"], gate["reason"] = True, (
            f"best loss {best['val_loss']:.4f} < threshold {threshold:.4f}; "
            + (f"production {production['version']} has {production['val_loss']:.4f} (tolerance {tolerance:.4f})"
               if production else note))
    result.gate = gate
    result.promoted = bool(gate["passed"])


def _register(reg: Registry, model_name: str, run_dir: Path, data_dir: Path, cfg, result: EvaluationResult,
              tmp: Path) -> dict:
    """Write the consolidated model and its metadata, then point production.json at it (last)."""
    import torch

    best = result.best
    version = f"{run_dir.name}-step{best['step']:09d}"
    model_path = tmp / MODEL_FILE
    torch.save(result.best_state, model_path)
    manifest_sha = None
    if (data_dir / "manifest.json").is_file():
        manifest_sha = hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest()
    metadata = {
        "model_name": model_name,
        "version": version,
        "format": "torch.save(state_dict) of trainer.model.ByteGPT",
        "source_run": str(run_dir.resolve()),
        "step": best["step"],
        "metrics": {"val_loss": best["val_loss"], "bpb": best["bpb"], "windows": best["windows"]},
        "model_config": asdict(cfg.model),
        "params_sha256": best["params_sha256"],
        "data": {"dir": str(data_dir), "manifest_sha256": manifest_sha},
        "run_summary": result.summary,
        "gate": {k: v for k, v in result.gate.items() if k != "passed"},
        "created_at": time.time(),
        "torch_version": torch.__version__,
    }
    model_uri = reg.put_file(model_path, f"{model_name}/{version}/{MODEL_FILE}")
    metadata_uri = reg.put_json(metadata, f"{model_name}/{version}/{METADATA_FILE}")
    reg.put_json({"version": version, "model_uri": model_uri, "metadata_uri": metadata_uri,
                  "val_loss": best["val_loss"], "promoted_at": time.time()}, f"{model_name}/{PRODUCTION_FILE}")
    return {"version": version, "model_uri": model_uri, "metadata_uri": metadata_uri}


def _finish(result: EvaluationResult, run_dir: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    result.evaluation_path = str(out_dir / "evaluation.json")
    result.report_path = str(out_dir / "report.html")
    _write_atomic(out_dir / "report.html", render_report(result.to_dict(), run_dir))
    _write_atomic(out_dir / "evaluation.json", json.dumps(result.to_dict(), indent=1))
