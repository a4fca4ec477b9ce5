"""Stage a Hugging Face model directory from S3 onto FSx, for ``--init-from``: the pipeline's ``init_from``.

    <fsx_root>/pretrained/<bucket>/<prefix>/   config.json, *.safetensors, tokenizer files, as in the bucket

The copy is the dataset stage's (``components.stage.dataset.sync_raw``: listing, s3transfer, size and MD5 checks,
a journal that lets an interrupted copy resume) into a work directory beside the destination, renamed into
place only once every object is there; a ``.staged.json`` written last records the listing. A rerun with an
unchanged prefix lists it, finds the record equal, and copies nothing; a changed one is copied again and
swapped in. So the directory the trainer is given is either absent or complete, never half-copied.

    from components.stage.model import stage_model
    stage_model("s3://models/llama3-1b", "/fsx/pretrained/models/llama3-1b")

The check-settings step (``components.train.settings``) decides the source and the destination before anything
is written (``staged_model_dir``); the KFP component is ``components.stage.model_op.stage_model_op``.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Callable

from trainer.durable import publish_dir
from trainer.layout import pretrained_dir
from trainer.s3url import parse_s3_url

STAGED_FILE = ".staged.json"
HF_CONFIG = "config.json"


def staged_model_dir(fsx_root: str, source: str) -> str:
    """Where ``s3://bucket/prefix`` is staged under ``fsx_root``: the bucket and prefix as directories."""
    from components.stage.dataset import unsafe_reason

    url = parse_s3_url(source, "init_from")
    base = pretrained_dir(fsx_root)
    reason = unsafe_reason(f"{url.bucket}/{url.prefix}".rstrip("/"), base)
    if reason or not url.prefix:
        raise ValueError(f"init_from {source!r}: cannot be a directory under {base} "
                         f"({reason or 'give the prefix of a model directory, not a whole bucket'})")
    return str(pretrained_dir(fsx_root, url.bucket, url.prefix))


def stage_model(source: str, dest: str, endpoint_url: str | None = None, *, max_concurrency: int = 16,
                log: Callable[[str], None] = print) -> dict:
    """Make ``dest`` a complete copy of the model directory at ``source`` (``s3://bucket/prefix``).

    Args:
        source: the S3 prefix of a Hugging Face model directory; empty: nothing to do.
        dest: its directory on FSx (``staged_model_dir``).
        endpoint_url: S3-compatible endpoint; None for AWS S3.
        max_concurrency: parallel GETs (and as many again for the parts of large files).
        log: where the progress line goes.

    Returns:
        source, dest, objects, bytes, transferred (objects copied by this call; 0 when it was up to date).

    Raises:
        ValueError: the prefix holds no ``config.json`` (not a model directory).
        components.stage.dataset.StageError: objects failed to copy (the verified ones are kept for a rerun).
    """
    from components.stage.dataset import (
        MB, STAGE_DIR, DatasetSettings, Source, StageLock, StageResult, parse_source, sync_raw)

    if not source:
        log("init_from needs no staging")
        return {"source": "", "dest": dest, "objects": 0, "bytes": 0, "transferred": 0}
    t0 = time.monotonic()
    bucket, prefix = parse_source(source)
    dest_path = Path(dest)
    dest_path.parent.mkdir(parents=True, exist_ok=True)
    src = Source(bucket, prefix, endpoint_url, "standard", 10, max_concurrency, 64 * MB, 64 * MB, True)
    result = StageResult(source=source, dataset_dir=dest)
    listing = [o for page in src.pages(DatasetSettings(), result) for o in page]
    if not any(key[len(prefix):] == HF_CONFIG for key, _, _ in listing):
        raise ValueError(f"init_from {source!r} holds no {HF_CONFIG}: not a Hugging Face model directory")
    record = {"source": source, "objects": sorted([key[len(prefix):], size, etag] for key, size, etag in listing)}
    if _read_record(dest_path) == record:
        log(f"{dest} is up to date with {source} ({len(listing)} files)")
        return _summary(record, dest, 0)
    work = dest_path.parent / f".{dest_path.name}.staging"
    work.mkdir(exist_ok=True)
    with StageLock(dest_path.parent / f".{dest_path.name}.lock"):
        files = work / "files"
        sync_raw(src, iter([listing]), files, work / STAGE_DIR, work, result, None, remove_stale=True, t_start=t0)
        (files / STAGED_FILE).write_text(json.dumps(record, indent=1))      # last: the copy is complete
        publish_dir(files, dest_path)     # dest is at every moment absent or complete
    shutil.rmtree(work, ignore_errors=True)
    log(f"staged {source} -> {dest}: {result.transferred} of {len(listing)} files copied "
        f"({result.transferred_bytes / MB:.1f} MiB) in {time.monotonic() - t0:.1f} s")
    return _summary(record, dest, result.transferred)


def _read_record(dest: Path) -> dict | None:
    try:
        return json.loads((dest / STAGED_FILE).read_text())
    except (OSError, ValueError):
        return None


def _summary(record: dict, dest: str, transferred: int) -> dict:
    return {"source": record["source"], "dest": dest, "objects": len(record["objects"]),
            "bytes": sum(size for _, size, _ in record["objects"]), "transferred": transferred}
