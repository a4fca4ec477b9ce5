"""Benchmark tasks in evaluate: EleutherAI's lm-evaluation-harness on each checkpoint's Hugging Face export.

    goodput evaluate --run RUN --tasks arc_easy,hellaswag --limit 200 --promote-on task:arc_easy/acc_norm
    goodput evaluate --run RUN --tasks /fsx/evals/python-mc.yaml --limit 50

``eval_tasks`` is comma-separated; each item is one of

    arc_easy                          a task (or group) of the harness; its dataset comes from the Hugging Face Hub,
                                      so the evaluate pod must reach it
    /fsx/evals/mc.yaml                a task file of one's own (the harness's YAML task format); its ``data_files``
                                      are absolute paths or relative to the file's directory (air-gapped clusters)
    s3://bucket/evals/mc.yaml         the same from S3: every object under ``s3://bucket/evals/`` is copied to a
                                      scratch directory first, so relative ``data_files`` travel with the file

Each scored checkpoint is written as a Hugging Face directory (``trainer.models.hf.export_checkpoint``, what
``goodput export`` writes) and scored by the harness's ``HFLM`` on the pod's GPU when it has one, at most
``eval_limit`` examples per task. Every task is loaded once before any checkpoint is scored: a task whose
dataset cannot be read fails the step with the task's name. A dataset of the byte vocabulary has no tokenizer
files; the harness gets a byte-level one (``byte_tokenizer``: id = byte value, byte 0 as EOS and padding).

``promote_on``: ``val_loss`` (the default: lowest validation loss wins) or ``task:<task>/<metric>`` (highest
wins, e.g. ``task:arc_easy/acc_norm``): the best checkpoint is the one with the best such score, and the gate
compares it with the production model's recorded score. This module imports the harness only when tasks run.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.s3url import is_s3_url, parse_s3_url

log = logging.getLogger(__name__)

VAL_LOSS = "val_loss"
TASK_PREFIX = "task:"
TASK_FILE_SUFFIXES = (".yaml", ".yml")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class TaskError(ValueError):
    """A task that cannot be loaded or scored, or a promote_on the tasks do not give."""


@dataclass(frozen=True)
class PromoteOn:
    """What picks the best checkpoint and gates it: validation loss, or one task's metric (higher is better)."""

    task: str = ""
    metric: str = ""

    @property
    def on_task(self) -> bool:
        return bool(self.task)

    def __str__(self) -> str:
        return f"{TASK_PREFIX}{self.task}/{self.metric}" if self.task else VAL_LOSS


def parse_promote_on(value: str | None) -> PromoteOn:
    """``val_loss`` (or empty) or ``task:<task>/<metric>``."""
    value = (value or VAL_LOSS).strip()
    if value == VAL_LOSS:
        return PromoteOn()
    task, _, metric = value[len(TASK_PREFIX):].partition("/") if value.startswith(TASK_PREFIX) else ("", "", "")
    if not (_NAME.match(task) and metric and "/" not in metric):
        raise TaskError(f"promote_on {value!r}: expected val_loss or task:<task>/<metric>, e.g. "
                        f"task:arc_easy/acc_norm")
    return PromoteOn(task, metric)


def parse_eval_tasks(value: str | list | tuple | None) -> list[str]:
    """The items of ``eval_tasks``: harness task names, task files (.yaml) on a file system or S3."""
    items = value.split(",") if isinstance(value, str) else list(value or [])
    out = []
    for item in (str(i).strip() for i in items):
        if not item:
            continue
        is_file = item.endswith(TASK_FILE_SUFFIXES)
        if "://" in item and not (is_s3_url(item) and is_file):
            raise TaskError(f"eval task {item!r}: give a harness task name, a task file (.yaml) or s3://BUCKET/"
                            f"PREFIX/FILE.yaml")
        if is_s3_url(item) and not parse_s3_url(item, "eval task").key:
            raise TaskError(f"eval task {item!r}: name the task file, s3://BUCKET/PREFIX/FILE.yaml")
        if not is_file and not _NAME.match(item):
            raise TaskError(f"eval task {item!r}: not a harness task name (letters, digits, '_', '-', '.') nor a "
                            f"task file (.yaml)")
        out.append(item)
    return out


def check_task_settings(eval_tasks: str, eval_limit: int, promote_on: str) -> None:
    """What can be checked before anything runs (the check-settings step, ``goodput run``)."""
    tasks = parse_eval_tasks(eval_tasks)
    promote = parse_promote_on(promote_on)
    if int(eval_limit) < 0:
        raise TaskError(f"eval_limit must be 0 (every example) or more, got {eval_limit}")
    if promote.on_task and not tasks:
        raise TaskError(f"promote_on {promote} needs eval_tasks (the task {promote.task!r} is not evaluated)")


def harness_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return ""


def _import_harness():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise TaskError(f"eval_tasks needs EleutherAI's lm-evaluation-harness in the evaluate image "
                        f"(pip install 'goodput-pipelines[tasks]', lm-eval[hf] 0.4.x): {e}") from None
    return lm_eval, HFLM, TaskManager


def byte_tokenizer():
    """A ``transformers`` tokenizer for the byte vocabulary: token id = byte value, as the byte datasets hold
    them; byte 0 (absent from text) stands in for EOS and padding, which the harness needs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()          # the byte-level pre-tokenizer's byte -> character table
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[0], pad_token=chars[0])


@contextlib.contextmanager
def _cwd(path: Path | None):
    # The harness hands a task file's data_files to `datasets`, which resolves relative paths against the
    # working directory: the file's own directory, so a task and its data can be copied around together.
    if path is None:
        yield
        return
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


def _copy_s3_task_dir(uri: str, dest: Path, endpoint_url: str | None) -> Path:
    """Every object under the task file's S3 "directory" into ``dest``; returns the local task file."""
    from components.s3 import s3_client
    from components.stage.dataset import unsafe_reason

    url = parse_s3_url(uri, "eval task")
    bucket, key = url.bucket, url.key
    prefix = key.rpartition("/")[0] + "/" if "/" in key else ""
    client = s3_client(endpoint_url, retry_mode="standard", max_attempts=5)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if not rel or rel.endswith("/"):
                continue
            why = unsafe_reason(rel, dest)
            if why:
                raise TaskError(f"eval task {uri!r}: s3://{bucket}/{obj['Key']} cannot be copied ({why})")
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, obj["Key"], str(dest / rel))
    local = dest / key[len(prefix):]
    if not local.is_file():
        raise TaskError(f"eval task {uri!r}: no such object")
    return local


@dataclass
class TaskSuite:
    """The tasks of ``eval_tasks``, loaded (datasets read) once, ready to score any number of models."""

    items: list[str]
    limit: int | None
    manager: Any = None
    loaded: list[tuple[str, Path | None, dict]] = field(default_factory=list)   # (item, its directory, name: Task)
    names: list[str] = field(default_factory=list)                                # leaf task names

    def check_promote_on(self, promote: PromoteOn) -> None:
        if promote.on_task and promote.task not in self.names:
            raise TaskError(f"promote_on {promote}: the task {promote.task!r} is not among the evaluated tasks "
                            f"({', '.join(self.names)})")


def load_tasks(items: list[str], limit: int | None, scratch: Path, endpoint_url: str | None = None) -> TaskSuite:
    """Load every task (and read its dataset) once; a task that cannot be loaded fails here, by name.

    Raises:
        TaskError: the harness is not installed, a task name is unknown, a task file is missing or invalid, or
            a task's dataset cannot be read.
    """
    _, _, TaskManager = _import_harness()
    named = [i for i in items if not i.endswith(TASK_FILE_SUFFIXES)]
    # The harness's own task index (thousands of files) is scanned only when a task is named from it.
    manager = TaskManager(include_defaults=bool(named))
    suite = TaskSuite(items, limit or None, manager)
    for n, item in enumerate(items):
        path, where = None, None
        if item.endswith(TASK_FILE_SUFFIXES):
            if is_s3_url(item):
                dest = scratch / f"task-{n}"
                dest.mkdir(parents=True, exist_ok=True)
                path = _copy_s3_task_dir(item, dest, endpoint_url)
            else:
                path = Path(item).resolve()
                if not path.is_file():
                    raise TaskError(f"eval task file {item!r} does not exist")
            where = path.parent
        t0 = time.monotonic()
        try:
            with _cwd(where):
                loaded = manager.load([str(path) if path else item])["tasks"]     # a group: its tasks
        except Exception as e:
            why = " ".join(str(e).split())[:300]
            raise TaskError(f"eval task {item!r} cannot be loaded ({type(e).__name__}: {why})") from e
        log.info("eval task %s loaded in %.1f s: %s", item, time.monotonic() - t0, ", ".join(loaded))
        suite.loaded.append((item, where, loaded))
        suite.names += [name for name in loaded if name not in suite.names]
    return suite


def _metrics(results: dict) -> dict[str, dict[str, float]]:
    """task -> metric -> value of the harness's ``results`` (``acc,none`` -> ``acc``; no stderr, aliases)."""
    out: dict[str, dict[str, float]] = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            out.setdefault(task, {})[metric if filt == "none" else f"{metric},{filt}"] = float(value)
    return out


def score_model(suite: TaskSuite, hf_dir: Path, *, tokenizer=None, device: str = "cpu",
                batch_size: int = 16) -> dict[str, dict[str, float]]:
    """task -> metric -> value for the Hugging Face directory ``hf_dir`` (``tokenizer``: None = its own)."""
    lm_eval, HFLM, _ = _import_harness()
    lm = HFLM(pretrained=str(hf_dir), tokenizer=tokenizer, device=device, batch_size=batch_size)
    scores: dict[str, dict[str, float]] = {}
    for item, where, loaded in suite.loaded:
        try:
            with _cwd(where):
                out = lm_eval.simple_evaluate(model=lm, tasks=list(loaded.values()),
                                              task_manager=suite.manager, limit=suite.limit, bootstrap_iters=0,
                                              log_samples=False)
        except Exception as e:
            raise TaskError(f"eval task {item!r} failed on {hf_dir} ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:300]})") from e
        scores.update(_metrics(out["results"]))
    return scores


def score_checkpoints(suite: TaskSuite, result, spec, root: Path, scratch: Path, *, tokenizer_dir: Path | None,
                      byte_vocab: bool, device: str) -> None:
    """Add ``tasks`` (task -> metric -> value) and ``tasks_s`` to each scored checkpoint of ``result``: each is
    exported as a Hugging Face directory (as ``goodput export`` writes it) and scored by the harness."""
    import shutil

    from trainer.layout import step_dir
    from trainer.models.hf import export_checkpoint

    if spec.hf is None:
        raise TaskError(f"eval_tasks need a Hugging Face layout of the model; {spec.name} has none (its spec sets "
                        f"no `hf` adapter)")
    tokenizer = byte_tokenizer() if tokenizer_dir is None and byte_vocab else None
    if tokenizer_dir is None and not byte_vocab:
        raise TaskError("eval_tasks need the dataset's tokenizer files (DATA/tokenizer/), and the dataset has none")
    for entry in result.checkpoints:
        t0 = time.monotonic()
        hf_dir = scratch / f"tasks-step-{entry['step']}"
        export_checkpoint(step_dir(root, entry["step"]), spec, hf_dir, tokenizer_dir=tokenizer_dir,
                          overwrite=True)
        try:
            entry["tasks"] = score_model(suite, hf_dir, tokenizer=tokenizer, device=device)
        finally:
            shutil.rmtree(hf_dir, ignore_errors=True)
        entry["tasks_s"] = round(time.monotonic() - t0, 3)
        log.info("step %d: tasks %s in %.1f s", entry["step"], entry["tasks"], entry["tasks_s"])


def task_score(entry: dict | None, promote: PromoteOn) -> float | None:
    """The ``promote_on`` metric of a checkpoint (or production) record, if it has one."""
    value = ((entry or {}).get("tasks") or {}).get(promote.task, {}).get(promote.metric)
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def best_on_task(result, promote: PromoteOn) -> dict:
    """The checkpoint with the highest ``promote_on`` metric (on a tie the later step).

    Raises:
        TaskError: the task gives no such metric (the metrics it gives are named).
    """
    scored = [(task_score(c, promote), c["step"], c) for c in result.checkpoints]
    if any(score is None for score, _, _ in scored):
        given = sorted(((result.checkpoints[0].get("tasks") or {}).get(promote.task) or {}))
        raise TaskError(f"promote_on {promote}: the task gives no {promote.metric!r} metric; it gives "
                        f"{', '.join(given) or 'none'}")
    return max(scored, key=lambda s: (s[0], s[1]))[2]


def gate_on_task(gate: dict, best: dict, promote: PromoteOn, production: dict | None, tolerance: float) -> None:
    """Decide ``gate`` on the task metric once the loss threshold has passed: the best checkpoint's score must
    be at least the production model's recorded score less ``tolerance``."""
    score = task_score(best, promote)
    gate["promote_on"] = str(promote)
    if not gate.get("passed"):
        return
    recorded = task_score(production, promote)
    gate["production_score"] = recorded
    if production is None:
        gate["reason"] = f"{promote} {score:.4f} at step {best['step']}; {gate['reason']}"
    elif recorded is None:
        gate["reason"] = (f"{promote} {score:.4f} at step {best['step']}; production {production['version']} has no "
                          f"recorded {promote}, so it is not compared; {gate['reason']}")
    elif score < recorded - tolerance:
        gate["passed"], gate["reason"] = False, (
            f"{promote} {score:.4f} at step {best['step']} is below production {production['version']} "
            f"({recorded:.4f}) by more than the tolerance {tolerance:.4f}")
    else:
        gate["reason"] = (f"{promote} {score:.4f} at step {best['step']} >= production {production['version']} "
                          f"({recorded:.4f}) - tolerance {tolerance:.4f}; {gate['reason']}")


def has_transformers() -> bool:
    """``byte_tokenizer`` needs transformers (lm-eval[hf] brings it; the plain install has no need of it)."""
    import importlib.util

    return importlib.util.find_spec("transformers") is not None


def byte_tokenizer_dir(scratch: Path) -> Path:
    """``byte_tokenizer`` saved as tokenizer files (for a registered model of a byte dataset)."""
    out = scratch / "byte-tokenizer"
    byte_tokenizer().save_pretrained(out)
    return out
