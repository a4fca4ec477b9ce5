"""Long documents and large files stream: a stage's memory is bounded by ``batch_bytes``, whatever a file's size
or a document's length (issue 35). The 2 GB file and the 200 MB document are measured by
``python bench/stage.py --memory``; here a 24 MB document and a 64 MB file, generated in tmp, with a cap."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from components.stage.dataset import stage_dataset
from components.stage.formats import read_documents
from trainer.data import Split, read_manifest

MB = 1024 * 1024
BATCH = 256 * 1024       # batch_bytes of the stages measured here
CAP_MB = 128             # how much a stage may grow with it
BLOCK = ("the stage reads a long document in pieces cut at spaces, so a tokenizer sees whole words: "
         "café naïve 東京 \"quoted\" back\\slash\ttab ")


def long_text(nbytes: int) -> str:
    """About nbytes of UTF-8 text (escapes, non-ASCII), written fast as a repeated block."""
    n = nbytes // len(BLOCK.encode()) + 1
    return (BLOCK * n)[: nbytes]


def write_jsonl(path: Path, docs: list[str]) -> None:
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d}) + "\n")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> Path:
    """A small byte-level BPE (GPT-2 pre-tokenizer), as ``bpe:`` trains them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([BLOCK * 20], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                              show_progress=False))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


PEAK = r"""
import json, re, sys
from components.stage.dataset import stage_dataset
def peak_mb():
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent (pytest) across fork and exec.
    return int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) / 1024
import tokenizers, numpy, pyarrow.parquet  # everything the stage imports, before the baseline
before = peak_mb()
src, fsx, tok, batch = sys.argv[1:5]
r = stage_dataset(src, fsx, "m", "1", tokenizer=tok, workers=1, batch_bytes=int(batch), val_percent=0)
print(json.dumps({"before_mb": before, "after_mb": peak_mb(), "train_tokens": r.train_tokens,
                  "val_tokens": r.val_tokens}))
"""


def staged_peak(src: Path, fsx: Path, tokenizer: str, batch_bytes: int) -> dict:
    """Stage ``src`` in a fresh process (one tokenizer process: the stage's own), and its peak memory."""
    proc = subprocess.run([sys.executable, "-c", PEAK, str(src), str(fsx), tokenizer, str(batch_bytes)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_24_mb_document_is_tokenized_in_bounded_memory(tmp_path, tokenizer_json):
    src = tmp_path / "src"
    src.mkdir()
    doc = long_text(24 * MB)
    write_jsonl(src / "long.jsonl", ["a short one", doc, "another short one"])
    (src / "long.txt").write_text(doc)                   # a plain text file is one document too
    out = staged_peak(src, tmp_path / "fsx", str(tokenizer_json), BATCH)
    # Read and encoded whole, these documents took the stage to 2.9 GB (tokenizers' encoding holds a few hundred
    # bytes per token); in 256 kB pieces it grows by about 45 MB.
    assert out["after_mb"] - out["before_mb"] < CAP_MB, out
    m = read_manifest(tmp_path / "fsx" / "datasets" / "m" / "1")
    text_bytes = sum(s["bytes"] for s in m["splits"].values())
    assert text_bytes == 2 * len(doc.encode()) + len("a short one") + len("another short one")
    assert sum(s["documents"] for s in m["splits"].values()) == 4


def test_a_large_file_is_read_in_bounded_memory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    line = json.dumps({"text": long_text(4000)}) + "\n"
    with open(src / "big.jsonl", "w") as f:
        block = line * 256
        for _ in range(64 * MB // len(block)):
            f.write(block)
    out = staged_peak(src, tmp_path / "fsx", "bytes", BATCH)
    assert out["after_mb"] - out["before_mb"] < CAP_MB, out
    assert out["train_tokens"] + out["val_tokens"] == (64 * MB // len(block)) * 256 * len(long_text(4000).encode())


def test_pieces_cut_at_spaces_give_the_tokens_of_the_whole_document(tmp_path, tokenizer_json):
    from tokenizers import Tokenizer

    doc = long_text(200_000) + " " + "x" * 30_000 + " end"     # a long run without a space is cut too
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "a.jsonl", [doc])
    pieces = list(read_documents(src / "a.jsonl", "jsonl", rel="a.jsonl", bad=Counter(), piece_bytes=4096))
    assert len(pieces) > 40 and "".join(p.text for p in pieces) == doc
    stage_dataset(str(src), tmp_path / "fsx", "p", "1", tokenizer=str(tokenizer_json), val_percent=0,
                  batch_bytes=4096, workers=1)
    tok = Tokenizer.from_file(str(tokenizer_json))
    whole = tok.encode(doc, add_special_tokens=False).ids
    got = Split.open(tmp_path / "fsx" / "datasets" / "p" / "1", "train").tokens[:].tolist()
    eos = tok.token_to_id("<|endoftext|>")
    head = long_text(200_000).rsplit(" ", 1)[0]           # up to the run without a space: the same tokens
    n = len(tok.encode(head, add_special_tokens=False).ids)
    assert got[:n] == whole[:n] and got[-1] == eos
    assert tok.decode(got[:-1]) == doc


def test_a_long_record_that_turns_out_bad_is_taken_back_whole(tmp_path, tokenizer_json):
    from tokenizers import Tokenizer

    src = tmp_path / "src"
    src.mkdir()
    good = [long_text(30_000), "short and fine", long_text(9_000)]
    lines = [json.dumps({"text": good[0]}),
             '{"text": "' + "word " * 3000 + '\\q"}',                 # a bad escape after pieces went out
             json.dumps({"text": good[1]}),
             '{"text": "' + "word " * 1000 + 'torn',                  # the line ends inside the string
             '{"text": "' + "x" * 5000 + '", }',                       # bad JSON after the text
             json.dumps({"text": good[2]})]
    (src / "a.jsonl").write_text("\n".join(lines) + "\n")
    stage_dataset(str(src), tmp_path / "fsx", "b", "1", tokenizer=str(tokenizer_json), val_percent=0,
                  batch_bytes=4096, workers=1)
    m = read_manifest(tmp_path / "fsx" / "datasets" / "b" / "1")
    assert m["bad_records"]["by_kind"] == {"malformed_json": 3}
    assert m["splits"]["train"]["documents"] == 3
    tok = Tokenizer.from_file(str(tokenizer_json))
    got = Split.open(tmp_path / "fsx" / "datasets" / "b" / "1", "train").tokens[:].tolist()
    eos = tok.token_to_id("<|endoftext|>")
    docs, cur = [], []
    for t in got:
        if t == eos:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert docs == good


def write_parquet(path: Path, docs: list[str]) -> None:
    """Uncompressed, in one row group (the reader gets no help from small row groups or compression), in pages
    of about a value (a writer checks its page size bound every write_batch_size values)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": docs}), path, compression="none", row_group_size=len(docs), write_batch_size=1)


def test_a_large_parquet_file_is_read_in_record_batches_of_batch_bytes(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    docs = [f"{i} {long_text(512 * 1024)}" for i in range(128)] + [long_text(16 * MB)]   # 64 MB, then 16 MB
    write_parquet(src / "big.parquet", docs)
    out = staged_peak(src, tmp_path / "fsx", "bytes", BATCH)
    # Read in batches of 1024 rows (the whole file here) and converted to Python strings whole, this file took the
    # stage about 420 MB above its start; in batches of about batch_bytes, about 90 MB (the 16 MB value is read
    # whole: Parquet holds it in one page, and Arrow the page and the value).
    assert out["after_mb"] - out["before_mb"] < CAP_MB, out
    assert out["train_tokens"] == sum(len(d.encode()) for d in docs)


def test_a_long_parquet_value_comes_out_in_pieces_that_make_the_whole(tmp_path):
    doc = long_text(200_000) + " " + "x" * 30_000 + " end"
    write_parquet(tmp_path / "a.parquet", ["short", doc, "also short"])
    pieces = list(read_documents(tmp_path / "a.parquet", "parquet", rel="a.parquet", bad=Counter(), piece_bytes=4096))
    assert [p.text for p in pieces[:1]] == ["short"] and pieces[-1] == ("a.parquet#2", "also short", True)
    long = pieces[1:-1]
    assert len(long) > 40 and all(len(p.text.encode()) <= 4096 for p in long)
    assert "".join(p.text for p in long) == doc and [p.last for p in long] == [False] * (len(long) - 1) + [True]
    assert {p.key for p in long} == {"a.parquet#1"}
