"""Real datasets: JSONL (plain, gzip, zstd) and Parquet from S3 (moto's HTTP server) and directories, bad
records under both policies, include/exclude globs, Hugging Face tokenizers (a tokenizer.json made here, a
model directory, ``bpe:``), and byte-identical restages."""

from __future__ import annotations

import gzip
import hashlib
import json
import uuid
from pathlib import Path

import numpy as np
import pytest

from components.stage.dataset import StageError, StageRefused, stage_dataset
from components.stage.splits import document_split, val_threshold
from trainer.data import Split, check_vocab, read_manifest

WORDS = "the quick brown fox jumps over a lazy dog while café naïve 東京 tokens drift past every shard".split()


def doc(i: int, n: int = 40) -> str:
    """A distinct document (with non-ASCII text) for record i."""
    return " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n)) + f" #{i}"


def jsonl_bytes(records: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def compress(name: str, data: bytes) -> bytes:
    if name.endswith(".gz"):
        return gzip.compress(data, mtime=0)
    if name.endswith(".zst"):
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


def parquet_bytes(table: dict, compression: str = "snappy") -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table(table), buf, compression=compression, row_group_size=7)
    return buf.getvalue()


def corpus(ext: str, n_files: int = 12, per_file: int = 9) -> tuple[dict[str, bytes], dict[str, list[str]]]:
    """Files of one format (``jsonl``, ``jsonl.gz``, ``jsonl.zst``, ``parquet``, ``parquet-none``) and their
    documents by path."""
    files, docs = {}, {}
    for f in range(n_files):
        texts = [doc(f * 100 + i) for i in range(per_file)]
        if ext.startswith("parquet"):
            rel = f"data/train-{f:05d}.parquet"
            files[rel] = parquet_bytes({"text": texts, "id": list(range(per_file))},
                                       "none" if ext == "parquet-none" else "snappy")
        else:
            rel = f"shard-{f:03d}.{ext}"
            files[rel] = compress(rel, jsonl_bytes([{"text": t, "meta": {"n": i}} for i, t in enumerate(texts)]))
        docs[rel] = texts
    return files, docs


def write_dir(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def put_bucket(s3, files: dict[str, bytes], prefix: str = "corpus/") -> str:
    bucket = f"data-{uuid.uuid4().hex[:12]}"
    client = s3.client()
    client.create_bucket(Bucket=bucket)
    for rel, data in files.items():
        client.put_object(Bucket=bucket, Key=prefix + rel, Body=data)
    return bucket


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A Hugging Face model directory: tokenizer.json (a WordPiece-free BPE made by ``tokenizers`` here) and
    tokenizer_config.json naming ``</s>`` as its EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([doc(i) for i in range(200)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                show_progress=False))
    model_dir = tmp_path_factory.mktemp("hf-model")
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    return model_dir


def vocab_of(model_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()


def expected_ids(tok, texts: list[str], eos: int) -> list[int]:
    return [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids + [eos]]


def doc_keys(raw: Path, rel: str, field: str = "text") -> dict[str, str]:
    """text -> the key its split is drawn from, read here from the staged file: its ``id``, else its file's
    path and position (the JSONL line, the Parquet row)."""
    if rel.endswith(".parquet"):
        import pyarrow.parquet as pq

        table = pq.read_table(raw / rel).to_pylist()
        return {r.get(field): f"id:{r['id']}" if r.get("id") is not None else f"{rel}#{i}"
                for i, r in enumerate(table)}
    opener = gzip.open if rel.endswith(".gz") else open
    if rel.endswith(".zst"):
        import zstandard

        data = zstandard.ZstdDecompressor().decompressobj().decompress((raw / rel).read_bytes())
    else:
        with opener(raw / rel, "rb") as f:
            data = f.read()
    keys = {}
    for i, line in enumerate(data.splitlines()):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and isinstance(r.get(field), str):
            keys[r[field]] = f"id:{r['id']}" if isinstance(r.get("id"), (str, int)) else f"{rel}#{i}"
    return keys


def doc_splits(dest: Path, docs: dict[str, list[str]]) -> dict[str, list[str]]:
    """The split of each document, from its file's rule in the manifest and (split by document) its key."""
    manifest = read_manifest(dest)
    threshold = val_threshold(manifest["split_source"].get("val_percent", 0))
    rules = {f["path"]: f["split"] for f in manifest["files"]}
    out = {}
    for rel, texts in docs.items():
        if rules[rel] == "documents" and texts:
            keys = doc_keys(dest / "raw", rel, manifest["documents"]["text_field"])
            out[rel] = [document_split(keys[t], threshold) for t in texts]
        else:
            out[rel] = [rules[rel]] * len(texts)
    return out


def check_tokens(dest: Path, docs: dict[str, list[str]], tokenizer_file: Path | None = None) -> dict:
    """Every split holds exactly its documents, in path and file order, each encoded and followed by the EOS."""
    from tokenizers import Tokenizer

    manifest = read_manifest(dest)
    tok = Tokenizer.from_file(str(tokenizer_file or dest / "tokenizer" / "tokenizer.json"))
    eos = manifest["eos_id"]
    assert tok.id_to_token(eos) == manifest["tokenizer"]["eos_token"]
    assert {f["path"] for f in manifest["files"]} == set(docs)
    splits = doc_splits(dest, docs)
    for split in ("train", "val"):
        texts = [t for rel in sorted(docs) for t, s in zip(docs[rel], splits[rel]) if s == split]
        got = Split.open(dest, split).tokens[:]
        assert got.dtype == np.uint16 and got.tolist() == expected_ids(tok, texts, eos), split
        assert manifest["splits"][split]["bytes"] == sum(len(t.encode()) for t in texts)
        assert manifest["splits"][split]["documents"] == len(texts)
    assert manifest["bad_records"]["total"] == 0
    return manifest


FORMATS = ["jsonl", "jsonl.gz", "jsonl.zst", "parquet", "parquet-none"]


@pytest.mark.parametrize("ext", FORMATS)
def test_each_format_from_a_directory_and_from_s3(s3, hf_tokenizer, tmp_path, ext):
    files, docs = corpus(ext)
    src = write_dir(tmp_path / "src", files)
    bucket = put_bucket(s3, files)
    for where, source in (("dir", str(src)), ("s3", f"s3://{bucket}/corpus")):
        r = stage_dataset(source, tmp_path / "fsx", "ds", where, s3.url, tokenizer=str(hf_tokenizer),
                          val_percent=20, workers=1)
        dest = tmp_path / "fsx" / "datasets" / "ds" / where
        manifest = check_tokens(dest, docs)
        fmt = "parquet" if ext.startswith("parquet") else "jsonl"
        assert {f["format"] for f in manifest["files"]} == {fmt}
        assert manifest["documents"] == {"data_format": "auto", "text_field": "text", "text_column": "text"}
        assert manifest["tokenizer"]["sha256"] == hashlib.sha256(
            (hf_tokenizer / "tokenizer.json").read_bytes()).hexdigest()
        assert (dest / "tokenizer" / "tokenizer.json").read_bytes() == (hf_tokenizer / "tokenizer.json").read_bytes()
        assert manifest["token_dtype"] == "uint16" and manifest["vocab_size"] == vocab_of(hf_tokenizer)
        assert r.train_tokens == manifest["splits"]["train"]["tokens"] and r.bad_records["total"] == 0
    # The same files staged from S3 and from a directory make the same shards.
    a, b = (read_manifest(tmp_path / "fsx" / "datasets" / "ds" / w) for w in ("dir", "s3"))
    assert a["splits"] == b["splits"]


def test_plain_text_keeps_the_byte_dataset_and_takes_a_text_field_elsewhere(tmp_path):
    # bytes (the default) on text files: today's dataset, one token per byte, no separator.
    texts = {f"t{i:02d}.txt": doc(i).encode() for i in range(20)}
    src = write_dir(tmp_path / "src", texts)
    stage_dataset(str(src), tmp_path / "fsx", "b", "1", val_percent=20)
    dest = tmp_path / "fsx" / "datasets" / "b" / "1"
    m = read_manifest(dest)
    assert (m["token_dtype"], m["vocab_size"], m["eos_id"], m["bytes_per_token"]) == ("uint8", 256, None, 1.0)
    for split in ("train", "val"):
        want = b"".join(texts[f["path"]] for f in m["files"] if f["split"] == split)
        assert Split.open(dest, split).tokens[:].tobytes() == want
    # JSONL under another field name, read with text_field; bytes of the documents, no separator.
    records = {f"r{i}.jsonl": jsonl_bytes([{"body": doc(i * 10 + j)} for j in range(3)]) for i in range(20)}
    src2 = write_dir(tmp_path / "src2", records)
    stage_dataset(str(src2), tmp_path / "fsx", "b", "2", val_percent=20, text_field="body")
    m2 = read_manifest(tmp_path / "fsx" / "datasets" / "b" / "2")
    assert m2["documents"]["text_field"] == "body" and m2["bad_records"]["total"] == 0
    dest2 = tmp_path / "fsx" / "datasets" / "b" / "2"
    texts = {f"r{i}.jsonl": [doc(i * 10 + j) for j in range(3)] for i in range(20)}
    placed = doc_splits(dest2, texts)
    train = [t for rel in sorted(texts) for t, split in zip(texts[rel], placed[rel]) if split == "train"]
    assert Split.open(dest2, "train").tokens[:].tobytes() == "".join(train).encode()


def test_include_exclude_find_a_hugging_face_layout(s3, hf_tokenizer, tmp_path):
    files, docs = corpus("parquet", n_files=6)
    extra = {"README.md": b"# a dataset card\n", "data/test-00000.parquet": files["data/train-00000.parquet"],
             "other/train-00009.parquet": b"not parquet"}
    bucket = put_bucket(s3, {**files, **extra})
    r = stage_dataset(f"s3://{bucket}/corpus", tmp_path / "fsx", "hf", "1", s3.url, tokenizer=str(hf_tokenizer),
                      include="data/*.parquet", exclude="test-*", val_percent=20, workers=1)
    assert r.excluded == 3 and r.objects == 6
    dest = tmp_path / "fsx" / "datasets" / "hf" / "1"
    check_tokens(dest, docs)
    assert sorted(p.relative_to(dest / "raw").as_posix() for p in (dest / "raw").rglob("*") if p.is_file()) \
        == sorted(files)                                             # excluded objects were never downloaded
    assert read_manifest(dest)["stage"]["settings"]["include"] == ["data/*.parquet"]
    # Globs that match nothing: a clear error, and nothing written.
    with pytest.raises(StageError, match=r"is empty \(9 objects excluded by include/exclude\)"):
        stage_dataset(f"s3://{bucket}/corpus", tmp_path / "fsx", "hf", "2", s3.url, include="*.jsonl")
    assert not (tmp_path / "fsx" / "datasets" / "hf" / "2").exists()


def bad_corpus() -> tuple[dict[str, bytes], dict[str, dict], dict[str, list[str]]]:
    """Good files, and one file per bad-record kind: (files, expected bad counts by path, good documents)."""
    good = {f"good-{i}.jsonl": jsonl_bytes([{"text": doc(i * 10 + j)} for j in range(4)]) for i in range(10)}
    docs = {rel: [doc(i * 10 + j) for j in range(4)] for i, rel in enumerate(good)}
    bad = {
        "bad-json.jsonl": (jsonl_bytes([{"text": "kept one"}, b'{"text": "torn', b"[1, 2", {"text": "kept two"}]),
                           {"malformed_json": 2}, ["kept one", "kept two"]),
        "bad-field.jsonl.gz": (gzip.compress(jsonl_bytes([{"txt": "x"}, {"text": 5}, ["a"], {"text": "kept"}])),
                               {"missing_field": 3}, ["kept"]),
        "bad-utf8.jsonl": (jsonl_bytes([b'{"text": "caf\xe9"}', {"text": "ok"}]), {"not_utf8": 1}, ["ok"]),
        "bad-empty.jsonl": (jsonl_bytes([{"text": ""}, {"text": "ok"}]), {"empty": 1}, ["ok"]),
        "bad-latin1.txt": ("caf\xe9 au lait".encode("latin-1"), {"not_utf8": 1}, []),
        "bad-empty.txt": (b"", {"empty": 1}, []),
        "bad-binary.txt": (b"ELF\x00\x01\x02", {"binary": 1}, []),
        "bad-schema.parquet": (parquet_bytes({"content": ["no text column"]}), {"wrong_schema": 1}, []),
        "bad-type.parquet": (parquet_bytes({"text": [1, 2, 3]}), {"wrong_schema": 1}, []),
        "bad-null.parquet": (parquet_bytes({"text": ["kept", None, ""]}), {"missing_field": 1, "empty": 1}, ["kept"]),
        "bad-corrupt.jsonl.zst": (b"\x28\xb5\x2f\xfd garbage", {"unreadable": 1}, []),
        "bad-torn.jsonl.gz": (gzip.compress(jsonl_bytes([{"text": "lost"}] * 50))[:-12], {"unreadable": 1}, []),
        "bad-notparquet.parquet": (b"PAR1 not really", {"unreadable": 1}, []),
    }
    files = {**good, **{k: v[0] for k, v in bad.items()}}
    for k, v in bad.items():
        docs[k] = v[2]
    return files, {k: v[1] for k, v in bad.items()}, docs


def test_bad_records_are_counted_per_file_and_skipped(hf_tokenizer, tmp_path):
    files, want_bad, docs = bad_corpus()
    src = write_dir(tmp_path / "src", files)
    r = stage_dataset(str(src), tmp_path / "fsx", "bad", "1", tokenizer=str(hf_tokenizer), val_percent=20,
                      bad_record_policy="skip", workers=2)
    dest = tmp_path / "fsx" / "datasets" / "bad" / "1"
    m = read_manifest(dest)
    got = {f["path"]: f["bad"] for f in m["files"] if f["bad"]}
    assert got == want_bad
    totals: dict = {}
    for counts in want_bad.values():
        for k, n in counts.items():
            totals[k] = totals.get(k, 0) + n
    assert m["bad_records"]["by_kind"] == dict(sorted(totals.items())) == r.bad_records["by_kind"]
    assert m["bad_records"]["total"] == sum(totals.values()) and m["bad_records"]["files"] == len(want_bad)
    refused = {e["path"]: e["refused"] for e in m["bad_records"]["examples"] if "refused" in e}
    assert set(refused) == {k for k, v in want_bad.items() if docs[k] == [] and "empty" not in v}
    # Exactly the good records are in the shards: nothing bad, nothing good dropped.
    m["bad_records"]["total"] = 0
    (dest / "manifest.json").write_text(json.dumps(m))
    check_tokens(dest, docs)
    assert not r.ok


@pytest.mark.parametrize("kind", ["malformed_json", "missing_field", "not_utf8", "empty", "binary", "wrong_schema",
                                  "unreadable"])
def test_bad_record_policy_fail_stops_before_a_manifest(hf_tokenizer, tmp_path, kind):
    files, want_bad, _ = bad_corpus()
    culprit = sorted(k for k, v in want_bad.items() if kind in v)[0]
    keep = {k: v for k, v in files.items() if k.startswith("good-") or k == culprit}
    src = write_dir(tmp_path / "src", keep)
    before = set(tmp_path.rglob("*"))
    with pytest.raises(StageRefused, match=f"{culprit}: .*{kind}.*bad_record_policy=fail"):
        stage_dataset(str(src), tmp_path / "fsx", "bad", "1", tokenizer=str(hf_tokenizer), val_percent=20,
                      bad_record_policy="fail", workers=1)
    dest = tmp_path / "fsx" / "datasets" / "bad" / "1"
    assert not (dest / "manifest.json").exists() and not list(dest.glob("*.bin"))
    assert all(p.is_relative_to(dest) or dest.is_relative_to(p) for p in set(tmp_path.rglob("*")) - before)


def test_bpe_tokenizer_is_trained_and_restages_byte_identical(tmp_path):
    files, docs = corpus("jsonl.zst", n_files=16)
    src = write_dir(tmp_path / "src", files)
    for version in ("1", "2"):
        r = stage_dataset(str(src), tmp_path / "fsx", "bpe", version, tokenizer="bpe:400", val_percent=20,
                          workers=2, pack_bytes=1500)
    a, b = (tmp_path / "fsx" / "datasets" / "bpe" / v for v in ("1", "2"))
    manifest = check_tokens(a, docs)
    assert manifest["vocab_size"] == 400 and manifest["tokenizer"]["kind"] == "bpe"
    assert manifest["eos_id"] == 0 and manifest["tokenizer"]["eos_token"] == "<|endoftext|>"
    assert len(manifest["splits"]["train"]["shards"]) > 2                  # several packs
    assert manifest["bytes_per_token"] > 1.5                               # subwords, not bytes
    listing = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file() and ".stage" not in p.parts)
    assert listing == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()
                             and ".stage" not in p.parts)
    for rel in listing:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel
    # Unchanged source: the manifest is kept; another tokenizer rebuilds and drops the old shards.
    r = stage_dataset(str(src), tmp_path / "fsx", "bpe", "1", tokenizer="bpe:400", val_percent=20, workers=2,
                      pack_bytes=1500)
    assert not r.rebuilt and (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    r = stage_dataset(str(src), tmp_path / "fsx", "bpe", "1", tokenizer="bpe:300", val_percent=20, workers=1)
    m = read_manifest(a)
    assert r.rebuilt and m["vocab_size"] == 300 and len(m["splits"]["train"]["shards"]) == 1
    assert sorted(p.name for p in a.glob("*.bin")) == ["train_00000.bin", "val_00000.bin"]


def test_tokenizer_from_s3_and_the_vocabulary_check(s3, hf_tokenizer, tmp_path):
    files, docs = corpus("jsonl", n_files=8)
    bucket = put_bucket(s3, files)
    client = s3.client()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        client.upload_file(str(hf_tokenizer / name), bucket, f"models/tiny/{name}")
    stage_dataset(f"s3://{bucket}/corpus", tmp_path / "fsx", "s3tok", "1", s3.url,
                  tokenizer=f"s3://{bucket}/models/tiny", val_percent=25, workers=1)
    dest = tmp_path / "fsx" / "datasets" / "s3tok" / "1"
    check_tokens(dest, docs, hf_tokenizer / "tokenizer.json")
    vocab = vocab_of(hf_tokenizer)
    assert check_vocab(dest, vocab)["vocab_size"] == vocab and vocab > 256
    with pytest.raises(ValueError, match=rf"vocabulary of {vocab} tokens but the model.s vocab_size is 256"):
        check_vocab(dest, 256)
    check_vocab(dest, 50_000)          # a larger embedding table is fine
    # A tokenizer that is not there, or not a tokenizer, fails before anything is staged.
    for bad, message in ((str(tmp_path / "nope"), "not found"), ("bpe:12", "at least"), ("gs://x/t.json", "use bytes"),
                         (f"s3://{bucket}/models/missing", "cannot fetch")):
        with pytest.raises(ValueError, match=message):
            stage_dataset(f"s3://{bucket}/corpus", tmp_path / "fsx", "s3tok", "2", s3.url, tokenizer=bad)
    assert not (tmp_path / "fsx" / "datasets" / "s3tok" / "2").exists()


def test_cli_reports_bad_records_and_fails_under_the_fail_policy(tmp_path):
    from click.testing import CliRunner

    from pipelines.cli import main as cli

    files = {f"d{i}.jsonl": jsonl_bytes([{"text": doc(i)}, b"{oops"]) for i in range(12)}
    src = write_dir(tmp_path / "src", files)
    args = ["stage", str(src), "--fsx-root", str(tmp_path / "fsx"), "--name", "cli", "--val-percent", "20", "-q",
            "--tokenizer", "bpe:300", "--workers", "1"]
    res = CliRunner().invoke(cli, [*args, "--version", "1"])
    assert res.exit_code == 0, res.output
    assert "12 bad records in 12 files were left out (12 malformed_json)" in res.output
    assert "uint16 tokens (vocabulary 300; splits by document, 20% for validation)" in res.output
    res = CliRunner().invoke(cli, [*args, "--version", "2", "--bad-records", "fail"])
    assert res.exit_code == 1 and "d0.jsonl: 1 malformed_json" in res.output, res.output
    assert not (tmp_path / "fsx" / "datasets" / "cli" / "2" / "manifest.json").exists()
    res = CliRunner().invoke(cli, [*args, "--version", "3", "--tokenizer", "bpe:x"])
    assert res.exit_code == 2 and "expected bpe:VOCAB" in res.output


def test_a_tokenizer_process_that_dies_fails_the_stage_instead_of_hanging(hf_tokenizer, tmp_path, monkeypatch):
    import os
    import signal
    import threading

    from tests.conftest import until

    # The spawned tokenizer workers load tests/_stage_worker_site first: each announces itself in ``held`` once
    # it has a file to tokenize, and waits there (mid-file) until the test kills one.
    held = tmp_path / "held"
    held.mkdir()
    site = str(Path(__file__).parent / "_stage_worker_site")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("GOODPUT_TEST_HOLD_TOKENIZER", str(held))
    files = {f"big-{i:02d}.jsonl": jsonl_bytes([{"text": doc(i * 1000 + j, 200)} for j in range(40)])
             for i in range(4)}
    src = write_dir(tmp_path / "src", files)
    outcome: list = []

    def stage() -> None:
        try:
            stage_dataset(str(src), tmp_path / "fsx", "die", "1", tokenizer=str(hf_tokenizer), val_percent=20,
                          workers=2)
            outcome.append(None)
        except StageError as e:
            outcome.append(e)

    t = threading.Thread(target=stage)
    t.start()
    assert until(lambda: any(held.iterdir()) or not t.is_alive(), timeout=120), "no tokenizer process started"
    assert t.is_alive(), f"the stage ended before a tokenizer process held its file: {outcome}"
    victim = int(next(held.iterdir()).name)
    os.kill(victim, signal.SIGKILL)                       # mid-file, as the kernel's OOM killer would
    t.join(60)
    assert not t.is_alive(), "the stage hung after a tokenizer process died"
    assert isinstance(outcome[0], StageError) and "tokenizing the staged files failed" in str(outcome[0])
    assert not (tmp_path / "fsx" / "datasets" / "die" / "1" / "manifest.json").exists()


def test_the_workers_preload_the_fast_malloc_and_their_tokens_do_not_change(hf_tokenizer, tmp_path, monkeypatch):
    import os
    import threading
    import time

    import psutil

    from components.stage.tokens import MALLOC_ENV, worker_allocator

    preload = os.environ.get("LD_PRELOAD")

    # A malloc named but not installed is refused before anything is written.
    monkeypatch.setenv(MALLOC_ENV, "no-such-malloc")
    with pytest.raises(ValueError, match=f"{MALLOC_ENV}=no-such-malloc: no such malloc library"):
        stage_dataset(str(tmp_path), tmp_path / "fsx", "m", "0", tokenizer=str(hf_tokenizer))
    assert not (tmp_path / "fsx").exists()
    monkeypatch.setenv(MALLOC_ENV, "auto")
    library = worker_allocator()
    if library is None:
        pytest.skip("no mimalloc, tcmalloc or jemalloc installed (Debian: apt-get install libmimalloc2.0)")

    files = {f"big-{i:02d}.jsonl.gz": gzip.compress(jsonl_bytes([{"text": doc(i * 1000 + j, 200)}
                                                                 for j in range(300)]), mtime=0) for i in range(12)}
    src = write_dir(tmp_path / "src", files)
    started = time.time()
    staged: list = []
    t = threading.Thread(target=lambda: staged.append(stage_dataset(
        str(src), tmp_path / "fsx", "m", "fast", tokenizer=str(hf_tokenizer), val_percent=20, workers=2,
        pack_bytes=8_000)))
    t.start()
    mapped: set[str] = set()
    while t.is_alive() and len(mapped) < 2:
        for p in psutil.Process().children():
            try:
                if p.create_time() >= started - 1 and "spawn_main" in " ".join(p.cmdline()):
                    # libmimalloc.so.2 is a link to libmimalloc.so.2.0: the mapped file is the target
                    if any(Path(m.path).name.startswith(Path(library).name) for m in p.memory_maps()):
                        mapped.add(str(p.pid))
            except psutil.Error:             # a worker gone meanwhile, or a zombie
                continue
        time.sleep(0.01)
    t.join(120)
    assert staged and len(mapped) == 2, f"the tokenizer processes did not preload {library}"
    assert os.environ.get("LD_PRELOAD") == preload, "the stage left its workers' LD_PRELOAD in its own environment"
    # glibc's malloc gives the same shards and manifest, byte for byte.
    monkeypatch.setenv(MALLOC_ENV, "system")
    stage_dataset(str(src), tmp_path / "fsx", "m", "glibc", tokenizer=str(hf_tokenizer), val_percent=20, workers=2,
                  pack_bytes=8_000)
    a, b = (tmp_path / "fsx" / "datasets" / "m" / v for v in ("fast", "glibc"))
    shards = sorted(p.name for p in a.glob("*.bin"))
    assert len(shards) > 4 and shards == sorted(p.name for p in b.glob("*.bin"))
    for name in [*shards, "manifest.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
