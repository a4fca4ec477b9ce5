"""Datasets as users have them (issue 35): a few JSONL files split by document, Hugging Face layouts with
their own splits, globs over both, byte-identical restages, and splits that hold when files are added."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from components.stage.dataset import StageError, stage_dataset
from pipelines.cli import main as cli
from trainer.data import Split, default_source_files, read_manifest

try:                                  # tests/ is a package when run from the repository root
    from tests.test_stage_formats import compress, jsonl_bytes, parquet_bytes, write_dir
except ImportError:                   # pragma: no cover - tests/ on sys.path
    from test_stage_formats import compress, jsonl_bytes, parquet_bytes, write_dir

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8"]


def marked(name: str, body: str = "") -> str:
    """A document whose text names it: ``<<name>>`` finds it in a split's bytes (the bytes tokenizer)."""
    return f"<<{name}>> {body}"


def names_in(dest: Path, split: str) -> set[str]:
    return set(re.findall(r"<<([^>]+)>>", Split.open(dest, split).tokens[:].tobytes().decode()))


def six_jsonl_files(root: Path) -> Path:
    """Six JSONL files of 20 documents each, about 3.4 MB: a small but ordinary corpus."""
    text = "".join(p.read_text(errors="replace") for p in default_source_files()[:200])
    size = 28_000
    for f in range(6):
        docs = [{"text": text[(f * 20 + d) * size:(f * 20 + d + 1) * size]} for d in range(20)]
        (root / f"part-{f}.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (root / f"part-{f}.jsonl").write_bytes(jsonl_bytes(docs))
    return root


def test_six_jsonl_files_get_a_document_level_validation_split_and_train(tmp_path):
    src = six_jsonl_files(tmp_path / "src")
    assert 3.3e6 < sum(p.stat().st_size for p in src.iterdir()) < 3.6e6
    res = CliRunner().invoke(cli, ["stage", str(src), "--fsx-root", str(tmp_path / "fsx"), "--name", "six",
                                   "--version", "1", "--tokenizer", "bpe:2048", "-q"])
    assert res.exit_code == 0, res.output
    assert "splits by document, 5% for validation" in res.output
    data = tmp_path / "fsx" / "datasets" / "six" / "1"
    m = read_manifest(data)
    assert m["split_source"]["by"] == "document" and m["vocab_size"] == 2048
    val, train = m["splits"]["val"], m["splits"]["train"]
    assert val["documents"] > 0 and train["documents"] > 0 and val["documents"] + train["documents"] == 120
    assert val["tokens"] > 0 and len(Split.open(data, "val")) == val["tokens"]
    # Validation documents come from files that also train: the split is by document, not by file.
    assert any(f["splits"]["val"]["documents"] and f["splits"]["train"]["documents"] for f in m["files"])
    run = tmp_path / "run"
    cmd = [sys.executable, "-c", "from pipelines.cli import main; main()", "train", "--nproc", "1", "--max-steps",
           "10", "--ckpt-every", "10", "--data", str(data), "--out", str(run), "--fsx-root", str(tmp_path / "fsx"),
           *TINY]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 10 and summary["final_val_loss"] is not None


def records(prefix: str, n: int, with_id: bool) -> bytes:
    return jsonl_bytes([{"text": marked(f"{prefix}-{i}", "some words of the document " * 3),
                         **({"id": f"{prefix}/{i}"} if with_id else {})} for i in range(n)])


def test_restaging_is_byte_identical_and_added_files_move_no_document(tmp_path):
    files = {"a.jsonl": records("a", 60, with_id=True), "b.jsonl": records("b", 60, with_id=False),
             "c.parquet": parquet_bytes({"text": [marked(f"c-{i}", "words " * 5) for i in range(60)]})}
    src = write_dir(tmp_path / "src", files)
    for version in ("1", "2"):
        stage_dataset(str(src), tmp_path / "fsx", "ds", version, val_percent=20, workers=2, pack_bytes=4000)
    one, two = (tmp_path / "fsx" / "datasets" / "ds" / v for v in ("1", "2"))
    listing = sorted(p.relative_to(one).as_posix() for p in one.rglob("*") if p.is_file() and ".stage" not in p.parts)
    assert [p for p in listing if p.endswith(".bin")] and "manifest.json" in listing
    assert listing == sorted(p.relative_to(two).as_posix() for p in two.rglob("*")
                             if p.is_file() and ".stage" not in p.parts)
    for rel in listing:
        assert (one / rel).read_bytes() == (two / rel).read_bytes(), rel
    val, train = names_in(one, "val"), names_in(one, "train")
    assert not val & train and len(val | train) == 180
    assert 0.1 < len(val) / 180 < 0.3                      # about val_percent of the documents
    assert {n[0] for n in val} == {"a", "b", "c"}           # every file gives validation documents
    # Files added before, between and after the old ones: no old document changes sides.
    write_dir(src, {"0.jsonl": records("n0", 40, with_id=True), "bb.jsonl": records("n1", 40, with_id=False),
                    "d.parquet": parquet_bytes({"text": [marked(f"n2-{i}") for i in range(40)]})})
    stage_dataset(str(src), tmp_path / "fsx", "ds", "3", val_percent=20, workers=2, pack_bytes=4000)
    three = tmp_path / "fsx" / "datasets" / "ds" / "3"
    val3, train3 = names_in(three, "val"), names_in(three, "train")
    assert {n for n in val3 if not n.startswith("n")} == val
    assert {n for n in train3 if not n.startswith("n")} == train
    assert any(n.startswith("n") for n in val3) and len(val3 | train3) == 300


def hf_parquet_repo(root: Path, card: str | None = None) -> dict[str, list[str]]:
    """A Hugging Face dataset repository: four Parquet shards (three train, one validation), a test shard and
    a dataset card; returns the documents by split."""
    docs = {split: [] for split in ("train", "validation", "test")}
    files = {}
    for rel, split in [("data/train-00000-of-00003.parquet", "train"), ("data/train-00001-of-00003.parquet", "train"),
                       ("data/train-00002-of-00003.parquet", "train"),
                       ("data/validation-00000-of-00001.parquet", "validation"),
                       ("data/test-00000-of-00001.parquet", "test")]:
        texts = [marked(f"{rel.split('/')[1].split('-of')[0]}-{i}", "a few words") for i in range(25)]
        docs[split] += texts
        files[rel] = parquet_bytes({"text": texts, "id": [f"{rel}/{i}" for i in range(25)]})
    files["README.md"] = (card or "---\nlicense: mit\n---\n# A dataset card\n").encode()
    write_dir(root, files)
    return docs


def names(texts: list[str]) -> set[str]:
    return {re.match(r"<<([^>]+)>>", t).group(1) for t in texts}


def test_a_hugging_face_layout_uses_its_validation_shard(tmp_path):
    docs = hf_parquet_repo(tmp_path / "src")
    r = stage_dataset(str(tmp_path / "src"), tmp_path / "fsx", "hf", "1", val_percent=5, workers=1)
    dest = tmp_path / "fsx" / "datasets" / "hf" / "1"
    assert names_in(dest, "val") == names(docs["validation"])
    assert names_in(dest, "train") == names(docs["train"])
    m = read_manifest(dest)
    assert m["split_source"] == {"by": "layout", "val_from": "validation", "left_out_files": 2,
                                 "left_out": ["README.md", "data/test-00000-of-00001.parquet"]}
    assert r.split_source == m["split_source"]
    assert {f["path"]: f["split"] for f in m["files"]} == {
        **{f"data/train-0000{i}-of-00003.parquet": "train" for i in range(3)},
        "data/validation-00000-of-00001.parquet": "val"}
    # Split names in directories; test stands in for a validation split the source does not have.
    write_dir(tmp_path / "dirs", {"train/a.jsonl": records("tr", 10, False), "test/b.jsonl": records("te", 10, False)})
    stage_dataset(str(tmp_path / "dirs"), tmp_path / "fsx", "hf", "2", workers=1)
    dest2 = tmp_path / "fsx" / "datasets" / "hf" / "2"
    assert names_in(dest2, "val") == {f"te-{i}" for i in range(10)} and read_manifest(dest2)["split_source"][
        "val_from"] == "test"


def test_a_dataset_card_names_the_splits(tmp_path):
    card = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path:\n"
            "    - data/train-0000[01]-*\n  - split: validation\n    path: data/train-00002-*\n---\n# card\n")
    docs = hf_parquet_repo(tmp_path / "src", card)
    stage_dataset(str(tmp_path / "src"), tmp_path / "fsx", "card", "1", workers=1)
    dest = tmp_path / "fsx" / "datasets" / "card" / "1"
    shard2 = {n for n in names(docs["train"]) if n.startswith("train-00002")}
    assert names_in(dest, "val") == shard2
    assert names_in(dest, "train") == names(docs["train"]) - shard2
    src = read_manifest(dest)["split_source"]
    assert (src["by"], src["config"], src["left_out_files"]) == ("readme", "default", 3)


def test_the_fan_out_reads_the_card_first_and_builds_the_single_stage_dataset(tmp_path):
    from components.stage.fanout import merge_stage, plan_stage, stage_partition

    # Not what the file names say: a plan that did not read the card would take the validation shard.
    card = ("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-0000[01]-*\n"
            "  - split: test\n    path: data/train-00002-*\n---\n")
    hf_parquet_repo(tmp_path / "src", card)
    stage_dataset(str(tmp_path / "src"), tmp_path / "fsx", "f", "single", workers=1, pack_bytes=3000)
    parts = plan_stage(str(tmp_path / "src"), tmp_path / "fsx", "f", "fan", stage_parallelism=3,
                       partition_min_bytes=1, pack_bytes=3000)
    assert len(parts) == 3
    for i in parts:
        stage_partition(tmp_path / "fsx", "f", "fan", i, workers=1)
    merge_stage(tmp_path / "fsx", "f", "fan")
    single, fan = (tmp_path / "fsx" / "datasets" / "f" / v for v in ("single", "fan"))
    files = sorted(p.relative_to(single).as_posix() for p in single.rglob("*") if ".stage" not in p.parts)
    assert files == sorted(p.relative_to(fan).as_posix() for p in fan.rglob("*") if ".stage" not in p.parts)
    assert all((single / f).read_bytes() == (fan / f).read_bytes() for f in files if (single / f).is_file())
    assert read_manifest(fan)["split_source"]["by"] == "readme"
    assert {n.rsplit("-", 1)[0] for n in names_in(fan, "val")} == {"train-00002"}


def test_globs_override_the_source_layout_and_the_document_split(tmp_path):
    docs = hf_parquet_repo(tmp_path / "hf")
    runner = CliRunner()
    res = runner.invoke(cli, ["stage", str(tmp_path / "hf"), "--fsx-root", str(tmp_path / "fsx"), "--name", "g",
                              "--version", "1", "--train-glob", "data/train-*", "--val-glob", "test-*", "-q"])
    assert res.exit_code == 0, res.output
    dest = tmp_path / "fsx" / "datasets" / "g" / "1"
    assert names_in(dest, "val") == names(docs["test"]) and names_in(dest, "train") == names(docs["train"])
    src = read_manifest(dest)["split_source"]
    assert (src["by"], src["train_glob"], src["val_glob"]) == ("globs", ["data/train-*"], ["test-*"])
    assert src["left_out"] == ["README.md", "data/validation-00000-of-00001.parquet"]
    # On JSONL that would be split by document: one file is the validation split, whole.
    write_dir(tmp_path / "j", {f"part-{i}.jsonl": records(f"p{i}", 10, False) for i in range(4)})
    stage_dataset(str(tmp_path / "j"), tmp_path / "fsx", "g", "2", val_glob="part-3.jsonl", workers=1)
    dest2 = tmp_path / "fsx" / "datasets" / "g" / "2"
    assert names_in(dest2, "val") == {f"p3-{i}" for i in range(10)}
    assert len(names_in(dest2, "train")) == 30
    # A val glob that matches nothing is a clear error, and no manifest is written.
    with pytest.raises(StageError, match=r"val_glob \['nothing-\*'\] matched none"):
        stage_dataset(str(tmp_path / "j"), tmp_path / "fsx", "g", "3", val_glob="nothing-*", workers=1)
    assert not (tmp_path / "fsx" / "datasets" / "g" / "3" / "manifest.json").exists()


def test_split_names_declared_by_dataset_info_are_honoured(tmp_path):
    # GLUE's MNLI as the Hub has it: by file names alone, validation_mismatched would be validation too.
    splits = ["train", "validation_matched", "validation_mismatched", "test_matched"]
    files = {f"{s}-00000-of-00001.parquet": parquet_bytes({"text": [marked(f"{s}-{i}", "words") for i in range(12)]})
             for s in splits}
    info = "".join(f"  - name: {s}\n    num_bytes: 100\n    num_examples: 12\n" for s in splits)
    files["README.md"] = (f"---\ndataset_info:\n- config_name: other\n  splits:\n  - name: train\n"
                          f"- config_name: default\n  splits:\n{info}---\n# MNLI\n").encode()
    src = write_dir(tmp_path / "mnli", files)
    res = CliRunner().invoke(cli, ["stage", str(src), "--fsx-root", str(tmp_path / "fsx"), "--name", "mnli",
                                   "--version", "1", "-q"])
    assert res.exit_code == 0, res.output
    assert "from the source's dataset_info (README.md): validation_matched files for validation" in res.output
    dest = tmp_path / "fsx" / "datasets" / "mnli" / "1"
    assert names_in(dest, "val") == {f"validation_matched-{i}" for i in range(12)}
    assert names_in(dest, "train") == {f"train-{i}" for i in range(12)}
    m = read_manifest(dest)
    assert m["split_source"] == {
        "by": "dataset_info", "val_from": "validation_matched", "declared_in": "README.md", "config": "default",
        "declared": {s: 12 for s in splits}, "left_out_files": 3,
        "left_out": ["README.md", "test_matched-00000-of-00001.parquet",
                     "validation_mismatched-00000-of-00001.parquet"]}
    assert m["splits"]["val"]["documents"] == m["split_source"]["declared"]["validation_matched"]
    # dataset_infos.json (the older place) and a split in a directory; the card's configs still come first.
    infos = {"default": {"splits": {"train": {"name": "train", "num_examples": 10},
                                    "dev_clean": {"name": "dev_clean", "num_examples": 10}}}}
    write_dir(tmp_path / "infos", {"dataset_infos.json": json.dumps(infos).encode(),
                                   "train/part-0.jsonl": records("tr", 10, False),
                                   "dev_clean/part-0.jsonl": records("dc", 10, False)})
    stage_dataset(str(tmp_path / "infos"), tmp_path / "fsx", "mnli", "2", workers=1)
    dest2 = tmp_path / "fsx" / "datasets" / "mnli" / "2"
    assert names_in(dest2, "val") == {f"dc-{i}" for i in range(10)}
    src2 = read_manifest(dest2)["split_source"]
    assert (src2["by"], src2["declared_in"], src2["val_from"], src2["left_out"]) == (
        "dataset_info", "dataset_infos.json", "dev_clean", ["dataset_infos.json"])


def budget_source(root: Path, files: dict[str, int]) -> Path:
    """JSONL (with and without ids), Parquet and plain text files of ~100-byte documents, ``files``: name -> count."""
    out = {}
    for name, n in files.items():
        stem = name.split(".")[0]
        if name.endswith(".parquet"):
            out[name] = parquet_bytes({"text": [marked(f"{stem}-{i}", "words of a row " * 6) for i in range(n)]})
        elif name.endswith(".txt"):
            out[name] = marked(stem, "a plain text file " * 6).encode()
        else:
            out[name] = records(stem, n, with_id=stem.startswith("i"))
    return write_dir(root, out)


def test_a_val_tokens_budget_is_met_stable_and_the_same_fanned_out(tmp_path):
    from components.stage.fanout import merge_stage, plan_stage, stage_partition

    files = {"id-a.jsonl": 300, "id-b.jsonl": 300, "pos-c.jsonl": 300, "rows-d.parquet": 300,
             **{f"t{i}.txt": 1 for i in range(20)}}
    src = budget_source(tmp_path / "src", files)
    fsx = tmp_path / "fsx"
    res = CliRunner().invoke(cli, ["stage", str(src), "--fsx-root", str(fsx), "--name", "b", "--version", "1",
                                   "--val-tokens", "12000", "-q"])
    assert res.exit_code == 0, res.output
    one = fsx / "datasets" / "b" / "1"
    m = read_manifest(one)
    src1 = m["split_source"]
    assert src1["by"] == "document" and src1["val_tokens"] == 12000 and "val_percent" not in src1
    total = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    assert src1["estimated_tokens"] == total              # the sample is the whole source: the estimate is exact
    assert 0.8 * 12000 < m["splits"]["val"]["tokens"] < 1.3 * 12000, (src1, m["splits"]["val"])
    assert f"of about {src1['estimated_tokens']:,}" in res.output
    val, train = names_in(one, "val"), names_in(one, "train")
    assert not val & train and len(val | train) == 1220 and {n.split("-")[0] for n in val} >= {"id", "pos", "rows"}
    # The same source again, in one stage and fanned out: byte-identical.
    stage_dataset(str(src), fsx, "b", "2", val_tokens=12000, workers=2)
    parts = plan_stage(str(src), fsx, "b", "fan", stage_parallelism=3, partition_min_bytes=1, pack_bytes=20_000,
                       val_tokens=12000)
    for i in parts:
        stage_partition(fsx, "b", "fan", i, workers=1)
    merge_stage(fsx, "b", "fan")
    stage_dataset(str(src), fsx, "b", "packs", val_tokens=12000, workers=1, pack_bytes=20_000)
    for a, b in (("1", "2"), ("packs", "fan")):
        da, db = fsx / "datasets" / "b" / a, fsx / "datasets" / "b" / b
        listing = sorted(p.relative_to(da).as_posix() for p in da.iterdir() if p.is_file())
        assert listing == sorted(p.relative_to(db).as_posix() for p in db.iterdir() if p.is_file())
        assert all((da / f).read_bytes() == (db / f).read_bytes() for f in listing), (a, b)
    assert read_manifest(fsx / "datasets" / "b" / "fan")["split_source"] == src1
    # Files added (5% more, before and after the others in path order): the threshold holds, no document moves.
    budget_source(src, {"a-new.jsonl": 30, "z-new.jsonl": 30})
    stage_dataset(str(src), fsx, "b", "3", val_tokens=12000, workers=2)
    three = fsx / "datasets" / "b" / "3"
    assert read_manifest(three)["split_source"]["threshold"] == src1["threshold"]
    val3, train3 = names_in(three, "val"), names_in(three, "train")
    assert {n for n in val3 if "new" not in n} == val and {n for n in train3 if "new" not in n} == train
    assert any("new" in n for n in val3)


def test_a_val_tokens_budget_that_cannot_apply_is_refused(tmp_path):
    hf_parquet_repo(tmp_path / "hf")
    with pytest.raises(StageError, match=r"val_tokens=100 applies to a source split by document, but this one's "
                                         r"splits come from its layout"):
        stage_dataset(str(tmp_path / "hf"), tmp_path / "fsx", "r", "1", val_tokens=100, workers=1)
    src = budget_source(tmp_path / "src", {"a.jsonl": 20})
    with pytest.raises(StageError, match=r"val_tokens=2,000 is more than half of the source's estimated \d"):
        stage_dataset(str(src), tmp_path / "fsx", "r", "2", val_tokens=2000, workers=1)
    with pytest.raises(ValueError, match="val_tokens must be 0"):
        stage_dataset(str(src), tmp_path / "fsx", "r", "3", val_tokens=-1)
    for version in ("1", "2"):
        assert not (tmp_path / "fsx" / "datasets" / "r" / version / "manifest.json").exists()
    res = CliRunner().invoke(cli, ["stage", str(src), "--fsx-root", str(tmp_path / "fsx"), "--name", "r",
                                   "--version", "4", "--val-percent", "5", "--val-tokens", "100"])
    assert res.exit_code == 2 and "--val-percent and --val-tokens both size the validation split; give one" in \
        res.output
    assert not (tmp_path / "fsx" / "datasets" / "r" / "4").exists()


def test_a_val_tokens_estimate_from_part_of_a_large_file(tmp_path, monkeypatch):
    import components.stage.budget as budget

    monkeypatch.setattr(budget, "SAMPLE_BYTES", 20_000)    # the sample ends inside the first file
    src = write_dir(tmp_path / "src", {f"{p}.jsonl.gz": compress(".gz", records(p, 700, with_id=False))
                                       for p in "abc"})
    stage_dataset(str(src), tmp_path / "fsx", "e", "1", val_tokens=20_000, workers=1)
    m = read_manifest(tmp_path / "fsx" / "datasets" / "e" / "1")
    total = m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]
    # gzip's size says how much JSON the file holds, not how much of it is text: the estimate counts the JSON.
    assert 1.0 <= m["split_source"]["estimated_tokens"] / total < 1.4, (m["split_source"], total)
    assert 0.7 * 20_000 < m["splits"]["val"]["tokens"] < 1.3 * 20_000, m["splits"]["val"]
