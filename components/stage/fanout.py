"""Stage a large source in parallel pods: plan, then one worker per partition, then a merge.

    plan = plan_stage(source, fsx_root, name, version, stage_parallelism=8, tokenizer="bpe:32000")
    for p in plan.partitions:          # in the pipeline: dsl.ParallelFor, one pod each
        stage_partition(fsx_root, name, version, p)
    merge_stage(fsx_root, name, version)

``plan_stage`` lists the source once (include/exclude, unsafe keys under ``refused_key_policy``), removes
files that left the source, sets the old manifest aside (the directory is incomplete from here until the
merge), stages the tokenizer (for ``bpe:`` it fetches the sample files and trains it), cuts the listing
into packs (``components.stage.tokens``) and the packs into ``stage_parallelism`` contiguous partitions,
and writes ``.stage/plan.json``. Each worker fetches its partition's objects into ``raw/`` (its own journal
and temp files under ``.stage/part-<i>/``, so reruns resume), tokenizes its packs on every core of its
pod into their shards, and records them in ``.stage/parts/<i>.json``. The merge checks every partition
is there and writes ``manifest.json`` atomically. Packs do not depend on the partitioning, so the dataset
is byte for byte the one a single ``stage_dataset`` builds.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from components.stage.dataset import (
    JOURNAL, PREVIOUS_MANIFEST, STAGE_DIR, DatasetBuilder, DatasetSettings, Source, StagedObject, StageError,
    StageLock, StageRefused, StageResult, assemble_manifest, check_keys, dataset_dir, log_refused, manifest_extra,
    parse_source, read_previous_manifest, refused_message, remove_stale_files, remove_unlisted_shards,
    retire_manifest, size_on_disk, split_globs, split_plan, summarise, sync_raw, tokenize_objects, unique_refused)
from components.stage.splits import DATASET_INFOS, README, SplitPlan
from components.stage.tokens import BATCH_BYTES, PACK_BYTES, partitions, plan_packs, worker_allocator
from components.stage.tokenizer import TokenizerInfo, check_tokenizer_source
from trainer.data import read_manifest
from trainer.durable import write_bytes
from trainer.layout import MANIFEST

PLAN = "plan.json"
PARTS = "parts"
MB = 1024 * 1024


def _read_plan(dest: Path) -> dict:
    path = dest / STAGE_DIR / PLAN
    if not path.is_file():
        raise StageError(f"{path} not found: run the plan step (plan_stage) for this dataset first")
    return json.loads(path.read_text())


def _source(plan: dict, endpoint_url: str | None, max_concurrency: int) -> Source:
    bucket, prefix = parse_source(plan["source"])
    return Source(bucket, prefix, endpoint_url, "standard", 10, max_concurrency, 16 * MB, 16 * MB, True)


def _objects(plan: dict) -> list[StagedObject]:
    return [StagedObject(*o) for o in plan["objects"]]


def _split_plan(plan: dict) -> SplitPlan:
    return SplitPlan(plan["split_rules"], plan["split_source"])


def plan_stage(
    source: str,
    fsx_root: str | Path,
    name: str,
    version: str,
    endpoint_url: str | None = None,
    *,
    stage_parallelism: int = 4,
    tokenizer: str = "bytes",
    data_format: str = "auto",
    text_field: str = "text",
    text_column: str = "text",
    include: str | list[str] | tuple[str, ...] = (),
    exclude: str | list[str] | tuple[str, ...] = (),
    val_percent: int = 5,
    train_glob: str | list[str] | tuple[str, ...] = (),
    val_glob: str | list[str] | tuple[str, ...] = (),
    bad_record_policy: str = "skip",
    refused_key_policy: str = "fail",
    bpe_sample_bytes: int = 256 * MB,
    pack_bytes: int = PACK_BYTES,
    batch_bytes: int = BATCH_BYTES,
    val_tokens: int = 0,
    partition_min_bytes: int = 1024 * MB,
    max_concurrency: int = 32,
) -> list[int]:
    """List the source and write the plan; return the partition numbers (the ParallelFor items).

    Arguments as ``components.stage.dataset.stage_dataset``; ``stage_parallelism`` is the most workers: a source
    gets one per ``partition_min_bytes`` (a small one is staged by one worker) and at most one per pack.
    When nothing that goes into the dataset changed since its manifest was written, the plan says so and
    the worker and the merge keep the dataset as it is. Raises ValueError (bad arguments) or StageRefused
    before anything is written.
    """
    t0 = time.monotonic()
    settings = DatasetSettings(tokenizer, data_format, text_field, text_column, split_globs(include),
                               split_globs(exclude), val_percent, bad_record_policy, bpe_sample_bytes, pack_bytes,
                               split_globs(train_glob), split_globs(val_glob), batch_bytes, val_tokens)
    spec = settings.check()
    if stage_parallelism < 1 or partition_min_bytes < 1:
        raise ValueError(f"stage_parallelism and partition_min_bytes must be at least 1, got {stage_parallelism} "
                         f"and {partition_min_bytes}")
    if refused_key_policy not in ("skip", "fail"):
        raise ValueError(f"refused_key_policy must be skip or fail, got {refused_key_policy!r}")
    check_tokenizer_source(spec, endpoint_url)
    bucket, prefix = parse_source(source)
    dest = dataset_dir(fsx_root, name, version)
    uri = f"s3://{bucket}/{prefix}" if bucket else prefix
    result = StageResult(source=uri, dataset_dir=str(dest))
    src = Source(bucket, prefix, endpoint_url, "standard", 10, max_concurrency, 16 * MB, 16 * MB, True)
    try:
        listed = [o for page in src.pages(settings, result) for o in page]
    except src.list_errors as e:
        raise StageError(f"cannot list {uri}: {e}") from e
    objects, refused = check_keys(listed, dest / "raw", src.key_prefix())
    refused = unique_refused(src.refused + refused)
    log_refused(refused)
    if refused and refused_key_policy == "fail":
        result.refused = refused
        raise StageRefused(refused_message(refused, uri), result)
    if not objects:
        raise StageError(f"nothing to stage under {uri} ({len(refused)} keys refused, {result.excluded} excluded "
                         f"by include/exclude)", result)
    result.refused = refused
    objects = sorted(objects)

    state = dest / STAGE_DIR
    state.mkdir(parents=True, exist_ok=True)
    with StageLock(state / "lock"):
        build = DatasetBuilder(dest, uri, settings, spec, endpoint_url, None, result)
        if _unchanged(dest, uri, objects, settings, refused, build):
            write_bytes(state / PLAN, json.dumps({"source": uri, "unchanged": True, "partitions": [[]]}).encode())
            shutil.rmtree(state / PARTS, ignore_errors=True)
            return [0]
        retire_manifest(dest)
        (dest / "raw").mkdir(exist_ok=True)
        result.removed = remove_stale_files(dest / "raw", {o.rel for o in objects})
        shutil.rmtree(state / PARTS, ignore_errors=True)
        # The dataset card (or dataset_infos.json) decides the splits, and a bpe: tokenizer learns from the sample
        # files: fetch those first (the workers will skip them).
        first = [o for o in objects if o.rel in (README, DATASET_INFOS)]
        if spec.kind == "bpe":
            first += [o for o in build.bpe_sample(objects) if o not in first]
        if first:
            sync_raw(src, iter([[(o.key, o.size, o.etag) for o in first]]), dest / "raw", state / "plan", dest,
                     result, None, remove_stale=False, t_start=t0)
        splits = split_plan(dest, objects, settings)
        if settings.val_tokens and splits.source["by"] == "document":
            # The budget's sample of tokens per byte (stage_budget) is read here too.
            from components.stage.budget import sample_files

            sample = [o for o in sample_files(splits, objects) if o not in first]
            sync_raw(src, iter([[(o.key, o.size, o.etag) for o in sample]]), dest / "raw", state / "plan", dest,
                     result, None, remove_stale=False, t_start=t0)
        info = build.tokenizer(objects, splits)
        splits = build.budgeted(splits, objects, info)
        packs = plan_packs([(o.rel, o.size) for o in objects], pack_bytes)
        total = sum(o.size for o in objects)
        parts = partitions(len(packs), min(stage_parallelism, -(-total // partition_min_bytes)))
        plan = {"source": uri, "settings": settings.to_dict(), "tokenizer": info.to_dict(),
                "objects": [list(o) for o in objects], "split_rules": splits.rules, "split_source": splits.source,
                "refused": refused, "excluded": result.excluded,
                "removed": result.removed, "partitions": parts}
        write_bytes(state / PLAN, json.dumps(plan).encode())
    return list(range(len(parts)))


def _unchanged(dest: Path, uri: str, objects: list[StagedObject], settings: DatasetSettings, refused: list[dict],
               build: DatasetBuilder) -> bool:
    """The dataset's manifest already describes these objects, settings and tokenizer, and raw/ holds them."""
    previous = read_previous_manifest(dest) if (dest / MANIFEST).exists() else None
    extra = manifest_extra(objects, settings, refused)
    if previous is None or previous.get("source") != uri or any(previous.get(k) != v for k, v in extra.items()):
        return False
    if any(size_on_disk(str(dest / "raw" / o.rel)) != o.size for o in objects):
        return False
    # A tokenizer file may have changed where it came from (for bpe: the data decides, and it is unchanged).
    return build.spec.kind != "file" or build.tokenizer(objects, split_plan(dest, objects, settings)).sha256 \
        == previous["tokenizer"]["sha256"]


def stage_partition(fsx_root: str | Path, name: str, version: str, partition: int, endpoint_url: str | None = None,
                    *, max_concurrency: int = 32, workers: int | None = None) -> StageResult:
    """Fetch and tokenize one partition of the plan into its shards; record them for the merge."""
    t0 = time.monotonic()
    dest = dataset_dir(fsx_root, name, version)
    plan = _read_plan(dest)
    if not 0 <= partition < len(plan["partitions"]):
        raise ValueError(f"partition {partition} is not in the plan ({len(plan['partitions'])} partitions)")
    if plan.get("unchanged"):
        return StageResult(source=plan["source"], dataset_dir=str(dest))
    worker_allocator()                   # a bad GOODPUT_TOKENIZE_MALLOC fails before the downloads
    settings = DatasetSettings.from_dict(plan["settings"])
    objects = _objects(plan)
    packs = plan["partitions"][partition]
    layout = plan_packs([(o.rel, o.size) for o in objects], settings.pack_bytes)
    mine = {rel for i in packs for rel in layout[i]}
    result = StageResult(source=plan["source"], dataset_dir=str(dest))
    state = dest / STAGE_DIR / f"part-{partition:05d}"
    state.mkdir(parents=True, exist_ok=True)
    with StageLock(state / "lock"):
        sync_raw(_source(plan, endpoint_url, max_concurrency), iter([[(o.key, o.size, o.etag) for o in objects
                                                                      if o.rel in mine]]),
                 dest / "raw", state, dest, result, None, remove_stale=False, t_start=t0)
        info = TokenizerInfo(**plan["tokenizer"])
        dtype, entries, shards = tokenize_objects(dest, objects, settings, _split_plan(plan), info, state / "tok",
                                                  workers, result, packs=packs)
        (dest / STAGE_DIR / PARTS).mkdir(exist_ok=True)
        write_bytes(dest / STAGE_DIR / PARTS / f"{partition:05d}.json",
                    json.dumps({"dtype": dtype, "entries": entries, "shards": shards}).encode())
    result.files = len(entries)
    result.wall_s = round(time.monotonic() - t0, 3)
    return result


def merge_stage(fsx_root: str | Path, name: str, version: str) -> StageResult:
    """Write the manifest from every partition's record (atomically, last); StageError if one is missing."""
    t0 = time.monotonic()
    dest = dataset_dir(fsx_root, name, version)
    plan = _read_plan(dest)
    if plan.get("unchanged"):
        result = StageResult(source=plan["source"], dataset_dir=str(dest))
        summarise(read_manifest(dest), result)
        result.wall_s = round(time.monotonic() - t0, 3)
        return result
    result = StageResult(source=plan["source"], dataset_dir=str(dest), refused=plan["refused"],
                         excluded=plan["excluded"], removed=plan["removed"])
    settings = DatasetSettings.from_dict(plan["settings"])
    parts_dir = dest / STAGE_DIR / PARTS
    missing = [i for i in range(len(plan["partitions"])) if not (parts_dir / f"{i:05d}.json").is_file()]
    if missing:
        raise StageError(f"partitions {missing} of {dest} have not finished; rerun their workers, then the merge",
                         result)
    entries, shards, dtypes = [], {}, set()
    for i in range(len(plan["partitions"])):
        part = json.loads((parts_dir / f"{i:05d}.json").read_text())
        entries += part["entries"]
        shards.update({int(k): v for k, v in part["shards"].items()})
        dtypes.add(part["dtype"])
    objects = _objects(plan)
    result.objects = len(objects)
    info = TokenizerInfo(**plan["tokenizer"])
    manifest = assemble_manifest(plan["source"], settings, _split_plan(plan), info, dtypes.pop(), entries, shards,
                                 manifest_extra(objects, settings, plan["refused"]), result)
    write_bytes(dest / MANIFEST, json.dumps(manifest, indent=1).encode())
    remove_unlisted_shards(dest, manifest)
    state = dest / STAGE_DIR
    for journal in [state / JOURNAL, *state.glob(f"*/{JOURNAL}")]:
        journal.unlink(missing_ok=True)           # the manifest now records every object
    (state / PREVIOUS_MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(parts_dir, ignore_errors=True)
    result.rebuilt = True
    summarise(manifest, result)
    result.wall_s = round(time.monotonic() - t0, 3)
    return result
