"""The fan-out stage (plan -> ParallelFor partitions -> merge) under kfp.local builds, byte for byte, the
dataset a single stage builds; a merge before every partition finished writes nothing."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from components.stage.dataset import StageError, stage_dataset
from components.stage.fanout import merge_stage, plan_stage, stage_partition
from trainer.data import read_manifest

try:                                  # tests/ is a package when run from the repository root
    from tests.test_stage_formats import check_tokens, doc, jsonl_bytes, put_bucket
except ImportError:                   # pragma: no cover - tests/ on sys.path
    from test_stage_formats import check_tokens, doc, jsonl_bytes, put_bucket

PACK = 600                           # source bytes per pack: a few files each, so many packs


def corpus(n: int = 24) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    docs = {f"part/{i:03d}.jsonl.gz": [doc(i * 10 + j) for j in range(5)] for i in range(n)}
    files = {rel: gzip.compress(jsonl_bytes([{"text": t} for t in texts]), mtime=0) for rel, texts in docs.items()}
    files["part/bad.jsonl.gz"] = gzip.compress(jsonl_bytes([b"{not json", {"text": "kept"}]), mtime=0)
    docs["part/bad.jsonl.gz"] = ["kept"]
    return files, docs


def dataset_files(dest: Path) -> dict[str, bytes]:
    """Everything a dataset consists of (raw files, shards, tokenizer, manifest), by path."""
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted(dest.rglob("*"))
            if p.is_file() and ".stage" not in p.relative_to(dest).parts}


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")   # the image name has no "python"
def test_fan_out_under_kfp_local_builds_the_single_stage_dataset(s3, tmp_path):
    import kfp.local

    from pipelines.stage_pipeline import stage_pipeline

    files, docs = corpus()
    bucket = put_bucket(s3, files)
    source = f"s3://{bucket}/corpus"
    fsx = tmp_path / "fsx"
    single = stage_dataset(source, fsx, "ds", "single", s3.url, tokenizer="bpe:320", val_percent=20,
                           pack_bytes=PACK, bpe_sample_bytes=8000)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
                   raise_on_error=True)
    task = stage_pipeline(source=source, fsx_root=str(fsx), name="ds", version="fanout", endpoint_url=s3.url,
                          stage_parallelism=3, tokenizer="bpe:320", val_percent=20, pack_bytes=PACK,
                          bpe_sample_bytes=8000, partition_min_bytes=1)
    fan = fsx / "datasets" / "ds" / "fanout"
    assert task.output.uri == str(fan)
    assert task.output.metadata["bad_records"] == 1 and task.output.metadata["train_tokens"] == single.train_tokens
    plan_runs = [p for p in (tmp_path / "root").rglob("executor_output.json") if "partition" in str(p)]
    assert len(plan_runs) == 3                                   # three partition tasks ran
    a, b = dataset_files(fsx / "datasets" / "ds" / "single"), dataset_files(fan)
    assert sorted(a) == sorted(b) and len([k for k in a if k.endswith(".bin")]) > 6
    assert [k for k in a if a[k] != b[k]] == []                  # byte-identical, manifest included
    manifest = read_manifest(fan)
    assert manifest["bad_records"]["by_kind"] == {"malformed_json": 1}
    manifest["bad_records"]["total"] = 0
    (tmp_path / "check").mkdir()
    for rel, data in b.items():              # raw/ too: the documents' keys are read from it
        (tmp_path / "check" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "check" / rel).write_bytes(data)
    (tmp_path / "check" / "manifest.json").write_text(json.dumps(manifest))
    check_tokens(tmp_path / "check", docs)
    assert not (fan / ".stage" / "parts").exists() and not list((fan / ".stage").rglob("journal.jsonl"))


def test_merge_waits_for_every_partition_and_the_old_manifest_is_set_aside(tmp_path):
    files, _ = corpus(12)
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    fsx = tmp_path / "fsx"
    dest = fsx / "datasets" / "ds" / "1"
    stage_dataset(str(src), fsx, "ds", "1", val_percent=20, pack_bytes=PACK)       # an existing dataset
    before = (dest / "manifest.json").read_bytes()
    # Nothing changed: one no-op partition, and the merge keeps the manifest.
    assert plan_stage(str(src), fsx, "ds", "1", stage_parallelism=4, val_percent=20, pack_bytes=PACK,
                      partition_min_bytes=1) == [0]
    assert stage_partition(fsx, "ds", "1", 0).files == 0
    r = merge_stage(fsx, "ds", "1")
    assert not r.rebuilt and r.files == 13 and (dest / "manifest.json").read_bytes() == before
    # A source below the size threshold is one partition whatever the parallelism.
    assert plan_stage(str(src), fsx, "ds", "small", stage_parallelism=4, val_percent=20, pack_bytes=PACK) == [0]
    # A setting changed: four partitions, and the dataset is incomplete from the plan until the merge.
    parts = plan_stage(str(src), fsx, "ds", "1", stage_parallelism=4, val_percent=25, pack_bytes=PACK,
                       partition_min_bytes=1)
    assert parts == [0, 1, 2, 3]
    assert not (dest / "manifest.json").exists()          # incomplete from the plan until the merge
    for p in parts[:-1]:
        stage_partition(fsx, "ds", "1", p, workers=1)
    with pytest.raises(StageError, match=r"partitions \[3\] .* have not finished"):
        merge_stage(fsx, "ds", "1")
    assert not (dest / "manifest.json").exists()
    stage_partition(fsx, "ds", "1", 3, workers=1)
    r = merge_stage(fsx, "ds", "1")
    assert r.rebuilt and r.files == 13 and read_manifest(dest)["stage"]["settings"]["val_percent"] == 25
    with pytest.raises(ValueError, match="stage_parallelism"):
        plan_stage(str(src), fsx, "ds", "2", stage_parallelism=0)
