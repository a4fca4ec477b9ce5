"""What ``goodput stage`` shows (issue 18): each refused key once, long keys shortened to the line, one summary
line; progress that never passes its total; an expected error as one line with exit 2 and nothing created.

S3 is moto's real HTTP server on loopback; the CLI runs as a real ``goodput`` process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from components.stage.dataset import check_keys, stage_dataset

ROOT = Path(__file__).resolve().parent.parent
WIDTH = 100
LONG = "data/" + "L" * 180 + "-the-end/" + "x" * 300 + ".txt"        # a component over 255 bytes
REFUSED = ["data/../escape.txt", "data/sub/../../escape2.txt", "data//abs.txt", "data/nul\x00.txt", LONG,
           "data/col"]                                               # data/col is also a directory


def seeded_bucket(s3, objects: dict[str, bytes]) -> str:
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    name = f"data-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    for key, data in objects.items():
        s3_backends[DEFAULT_ACCOUNT_ID]["global"].put_object(name, key, data)
    return name


def corpus(n: int) -> dict[str, bytes]:
    return {f"data/ok/f{i:03d}.txt": f"document {i}: the quick brown fox\n".encode() * 20 for i in range(n)}


def goodput(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("goodput", path=str(Path(sys.executable).parent)) or shutil.which("goodput")
    assert exe, "the goodput console script is not installed (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS=str(WIDTH), HOME=str(cwd))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_each_refused_key_is_printed_once_shortened_with_one_summary_line(s3, tmp_path, policy):
    # data/col is the directory of 30 keys: the collision is seen once per key below it.
    objects = {**corpus(40), **{f"data/col/k{i:02d}.txt": b"inner\n" * 50 for i in range(30)},
               **{k: b"pwned\n" for k in REFUSED}}
    bucket = seeded_bucket(s3, objects)
    proc = goodput("stage", f"s3://{bucket}/data", "--fsx-root", "fsx", "--name", "d", "--version", "1",
                   "--endpoint-url", s3.url, "--val-percent", "20", "--on-refused", policy, "-q", cwd=tmp_path)
    assert proc.returncode == (0 if policy == "skip" else 1), proc.stderr
    lines = proc.stderr.splitlines()
    refused_lines = [line for line in lines if line.startswith("refused ")]
    assert len(refused_lines) == len(REFUSED), proc.stderr
    for key in REFUSED:
        shown = repr(key)
        head, tail = shown[:20], shown[-12:]
        assert sum(1 for line in refused_lines if line.startswith(f"refused {head}") and tail in line) == 1, key
    assert all(len(line) <= WIDTH for line in refused_lines), refused_lines
    long_line = next(line for line in refused_lines if "LLLL" in line)
    assert "…" in long_line and "longer than 255 bytes" in long_line
    # One summary line at the end with the counts by reason.
    summary = lines[-1]
    assert f"{len(REFUSED)} keys" in summary and "2 '..' component" in summary, proc.stderr
    assert "Traceback" not in proc.stderr and "LLLL" * 60 not in proc.stderr


def test_a_key_listed_many_times_is_refused_once():
    listed = [("data/../up.txt", 5, "e"), ("data/a", 5, "e"), ("data/a/b.txt", 5, "e")] * 50
    objects, refused = check_keys(listed, Path("/fsx/raw"), "data/")
    assert [r["key"] for r in refused] == ["data/../up.txt", "data/a"]
    assert [o.rel for o in objects] == ["a/b.txt"]


class Recorder:
    """A ``components.stage.dataset.StageProgress`` that checks, at every call, that no count passes its total."""

    def __init__(self):
        self.lock = threading.Lock()
        self.phase, self.total_files, self.total_bytes = "list", None, None
        self.files = self.bytes = 0
        self.violations: list[str] = []
        self.finals: dict[str, tuple] = {}

    def start(self, files, nbytes):
        with self.lock:
            self.total_files, self.total_bytes = files, nbytes
            if files is not None:
                self.phase = "transfer"
                self._check()

    def tokenizing(self, files):
        with self.lock:
            self.finals["transfer"] = (self.files, self.total_files, self.bytes, self.total_bytes)
            self.phase, self.total_files, self.files = "tokenize", files, 0

    def advance(self, files=0, nbytes=0):
        with self.lock:
            self.files += files
            self.bytes += nbytes
            self._check()

    def _check(self):
        if self.total_files is not None and self.files > self.total_files:
            self.violations.append(f"{self.phase}: files {self.files}/{self.total_files}")
        if self.total_bytes is not None and self.phase == "transfer" and self.bytes > self.total_bytes:
            self.violations.append(f"{self.phase}: bytes {self.bytes}/{self.total_bytes}")


def test_progress_never_passes_its_total(s3, tmp_path):
    # Keys that are refused only once the whole listing is known (data/col, data/deep/x) were already being
    # downloaded while it went on; a rerun skips the unchanged ones.
    objects = {**corpus(30), "data/col": b"c" * 700, "data/col/inner.txt": b"i" * 300,
               "data/deep/x": b"x" * 900, "data/deep/x/y.txt": b"y" * 100}
    bucket = seeded_bucket(s3, objects)
    for run in range(2):
        if run:
            s3.client().put_object(Bucket=bucket, Key="data/ok/new.txt", Body=b"new document\n" * 30)
        rec = Recorder()
        r = stage_dataset(f"s3://{bucket}/data", tmp_path, "p", "1", s3.url, val_percent=20,
                          refused_key_policy="skip", progress=rec)
        assert {x["key"] for x in r.refused} == {"data/col", "data/deep/x"}
        assert rec.violations == [], rec.violations
        files, total_files, nbytes, total_bytes = rec.finals["transfer"]
        assert (files, nbytes) == (total_files, total_bytes)      # the bar ends full, not short
        # Every download counts, the refused ones too (fetched before the listing ended, then dropped).
        assert total_files == (34, 3)[run]
        assert (rec.files, rec.total_files) == (r.objects, r.objects)      # every staged file tokenized


@pytest.mark.parametrize("args, message", [
    (["./no-such-dir"], "source directory './no-such-dir' does not exist"),
    (["s3://"], "no bucket name"),
    (["gs://bucket/x"], "unsupported source"),
    (["src", "--tokenizer", "bpe:many"], "bpe:"),
    (["src", "--val-percent", "90"], "val_percent must be between 0 and 50"),
])
def test_a_bad_source_or_setting_is_one_line_exit_2_and_nothing_created(tmp_path, args, message):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("a document\n")
    proc = goodput("stage", *args, "--fsx-root", "fsx", "--name", "d", "--version", "1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr and "Usage:" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and message in lines[0], proc.stderr
    assert proc.stderr.strip() == proc.stderr.rstrip("\n") == lines[0]          # not even a blank line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]                  # nothing created
