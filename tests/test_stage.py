"""``components.stage.dataset``: S3 (moto's real HTTP server on loopback) or a directory -> FSx dataset.

Objects are seeded straight into moto's backend (fast); the stage under test talks to moto only over
HTTP, mostly through ``FaultProxy`` so that the object GETs it makes can be counted.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from components.stage.dataset import StageError, StageRefused, stage_dataset
from pipelines.cli import main as cli
from trainer.data import Split, read_manifest

try:                                  # tests/ is a package when run from the repository root
    from tests.s3_stand_in import CREDENTIALS, FaultProxy
except ImportError:                   # pragma: no cover - tests/ on sys.path
    from s3_stand_in import CREDENTIALS, FaultProxy


@pytest.fixture
def bucket(s3) -> str:
    name = f"data-{uuid.uuid4().hex[:12]}"
    s3.client().create_bucket(Bucket=name)
    return name


def text(i: int, n: int = 600) -> bytes:
    """Distinct text of about n bytes for object i."""
    line = f"object {i}: the quick brown fox jumps over the lazy dog {i * 7919 % 104729}\n".encode()
    return (line * (n // len(line) + 1))[:n]


def seed(bucket: str, objects: dict[str, bytes]) -> None:
    """Put objects into moto's backend directly (the stage reads them over HTTP)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT_ID]["global"]
    for key, data in objects.items():
        backend.put_object(bucket, key, data)


def corpus(n: int, prefix: str = "corpus/") -> dict[str, bytes]:
    return {f"{prefix}d{i % 17:02d}/f{i:05d}.txt": text(i) for i in range(n)}


def check_dataset(dest: Path, objects: dict[str, bytes], prefix: str = "corpus/") -> dict:
    """The dataset at dest holds exactly ``objects`` (raw files, manifest, shards) in the trainer's format."""
    manifest = read_manifest(dest)
    want = {k[len(prefix):]: v for k, v in objects.items()}
    assert {f["path"] for f in manifest["files"]} == set(want)
    for f in manifest["files"]:
        data = want[f["path"]]
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
        assert (dest / "raw" / f["path"]).read_bytes() == data
    assert manifest["objects"] == {rel: {"key": prefix + rel, "etag": hashlib.md5(data).hexdigest(),
                                         "size": len(data)} for rel, data in want.items()}
    assert sorted(str(p.relative_to(dest / "raw")) for p in (dest / "raw").rglob("*") if p.is_file()) == sorted(want)
    total = manifest["splits"]["train"]["tokens"] + manifest["splits"]["val"]["tokens"]
    assert total == sum(len(v) for v in want.values())
    assert len(Split.open(dest, "train")) == manifest["splits"]["train"]["tokens"]
    assert len(Split.open(dest, "val")) == manifest["splits"]["val"]["tokens"] > 0
    assert not (dest / ".stage" / "tmp").exists() and not (dest / ".stage" / "journal.jsonl").exists()
    return manifest


def test_thousands_of_objects_then_unchanged_restage_transfers_nothing(s3, bucket, tmp_path):
    objects = corpus(2000)
    seed(bucket, objects)
    with FaultProxy(s3.url) as proxy:
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url, max_concurrency=16)
        assert (r.transferred, r.skipped_unchanged, r.objects, r.refused, r.rebuilt) == (2000, 0, 2000, [], True)
        assert set(proxy.object_gets) == {f"{bucket}/{k}" for k in objects}
        assert set(proxy.object_gets.values()) == {1}        # one GET per object, no HEADs needed
        dest = tmp_path / "datasets" / "c" / "1"
        check_dataset(dest, objects)
        manifest_bytes = (dest / "manifest.json").read_bytes()

        # Unchanged prefix: nothing transferred, the manifest is kept as it is.
        gets = sum(proxy.object_gets.values())
        r = stage_dataset(f"s3://{bucket}/corpus/", tmp_path, "c", "1", proxy.url)
        assert (r.transferred, r.skipped_unchanged, r.rebuilt) == (0, 2000, False)
        assert sum(proxy.object_gets.values()) == gets
        assert (dest / "manifest.json").read_bytes() == manifest_bytes

        # One object changed, one added, one deleted: exactly two GETs, one removal.
        changed, added, deleted = "corpus/d03/f00003.txt", "corpus/new/extra.txt", "corpus/d05/f00005.txt"
        objects[changed] = b"changed content\n" * 40
        objects[added] = text(99999)
        del objects[deleted]
        seed(bucket, {changed: objects[changed], added: objects[added]})
        s3.client().delete_object(Bucket=bucket, Key=deleted)
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url)
        assert (r.transferred, r.removed, r.skipped_unchanged, r.rebuilt) == (2, 1, 1998, True)
        assert sum(proxy.object_gets.values()) == gets + 2
        assert proxy.object_gets[f"{bucket}/{changed}"] == 2 and proxy.object_gets[f"{bucket}/{added}"] == 1
        check_dataset(dest, objects)


def test_interrupted_stage_resumes(s3, bucket, tmp_path):
    objects = corpus(400)
    seed(bucket, objects)
    dest = tmp_path / "datasets" / "c" / "1"
    journal = dest / ".stage" / "journal.jsonl"
    env = {**os.environ, **CREDENTIALS}
    with FaultProxy(s3.url, get_delay_s=0.05) as proxy:
        cmd = [sys.executable, "-c", "from pipelines.cli import main; main()", "stage", f"s3://{bucket}/corpus",
               "--fsx-root", str(tmp_path), "--name", "c", "--version", "1", "--endpoint-url", proxy.url,
               "--concurrency", "4", "--quiet"]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (journal.exists() and journal.read_text().count("\n") >= 60):
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "the stage made no progress"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)      # no clean-up of any kind
        proc.wait()
        done = {json.loads(line)["key"] for line in journal.read_text().splitlines() if line.endswith("}")}
        assert 60 <= len(done) < 400 and not (dest / "manifest.json").exists()
        leftovers = list((dest / ".stage" / "tmp").iterdir())   # downloads in flight when it was killed

        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url)
        assert r.skipped_unchanged >= len(done)
        assert r.transferred == 400 - r.skipped_unchanged
        assert all(proxy.object_gets[f"{bucket}/{k}"] == 1 for k in done)      # never fetched twice
        assert all(proxy.object_gets[f"{bucket}/{k}"] >= 1 for k in objects)
    check_dataset(dest, objects)
    assert not any(p.exists() for p in leftovers)


def test_throttling_and_server_errors_are_survived(s3, bucket, tmp_path):
    objects = corpus(150)
    seed(bucket, objects)
    # The default (standard) retry mode: a third of the requests fail until 60 errors were injected.
    with FaultProxy(s3.url, fail_every=3, max_failures=60, statuses=(503, 500)) as proxy:
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url, max_attempts=10)
        assert r.transferred == 150 and not r.failed
        assert proxy.injected == {503: 30, 500: 30}
    check_dataset(tmp_path / "datasets" / "c" / "1", objects)
    # Adaptive mode (client-side rate limiting after SlowDown) gets through too.
    with FaultProxy(s3.url, fail_every=40, max_failures=3, statuses=(503,)) as proxy:
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "3", proxy.url, retry_mode="adaptive")
        assert r.transferred == 150 and proxy.injected == {503: 3}
    check_dataset(tmp_path / "datasets" / "c" / "3", objects)

    # Without the SDK's retries the same faults fail the stage: no manifest, only verified files kept...
    with FaultProxy(s3.url, fail_every=3, max_failures=60, statuses=(503, 500)) as proxy:
        with pytest.raises(StageError, match="objects failed") as err:
            stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "2", proxy.url, max_attempts=1)
    failed = err.value.result.failed
    errors = " ".join(f["error"] for f in failed)
    assert "SlowDown" in errors and "InternalError" in errors
    dest = tmp_path / "datasets" / "c" / "2"
    assert not (dest / "manifest.json").exists()
    assert not any((dest / "raw" / f["key"][len("corpus/"):]).exists() for f in failed)
    # ... and a rerun fetches just the failed ones.
    with FaultProxy(s3.url) as proxy:
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "2", proxy.url)
        assert r.transferred == len(failed) == sum(proxy.object_gets.values())
    check_dataset(dest, objects)


def test_body_cut_off_mid_stream_is_fetched_again_by_s3transfer(s3, bucket, tmp_path, monkeypatch):
    # The SDK's retry mode covers a request up to its headers, not a body that breaks off afterwards:
    # such an object is handed to s3transfer, whose download retries the read.
    from botocore.exceptions import ResponseStreamingError
    from botocore.response import StreamingBody

    objects = corpus(50)
    seed(bucket, objects)
    read, cut = StreamingBody.read, []

    def read_once_cut(self, amt=None):
        if not cut:
            cut.append(self)
            raise ResponseStreamingError(error="connection reset mid-body")
        return read(self, amt)

    monkeypatch.setattr(StreamingBody, "read", read_once_cut)
    with FaultProxy(s3.url) as proxy:
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url, val_percent=20)
        assert (r.transferred, r.failed) == (50, []) and len(cut) == 1
        assert sorted(proxy.object_gets.values()) == [1] * 49 + [2]
    check_dataset(tmp_path / "datasets" / "c" / "1", objects)


def test_object_replaced_after_listing_never_lands(s3, bucket, tmp_path, monkeypatch):
    # Each GET carries the listed ETag as If-Match: a newer version fails (412) and nothing is written.
    import components.stage.dataset as stage

    objects = corpus(20)
    seed(bucket, objects)
    replaced = "corpus/d02/f00002.txt"
    pages = stage._pages_s3

    def listed_before_replacement(*args):
        for page in pages(*args):
            yield [(k, size, "0" * 32 if k == replaced else etag) for k, size, etag in page]

    monkeypatch.setattr(stage, "_pages_s3", listed_before_replacement)
    with pytest.raises(StageError, match="1 of 20 objects failed") as err:
        stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", s3.url, val_percent=20)
    assert err.value.result.failed[0]["key"] == replaced and "PreconditionFailed" in err.value.result.failed[0]["error"]
    assert not (tmp_path / "datasets" / "c" / "1" / "raw" / replaced[len("corpus/"):]).exists()


def test_corruption_in_transit_is_caught_and_never_lands(s3, bucket, tmp_path):
    objects = corpus(40)
    seed(bucket, objects)
    bad = "corpus/d01/f00001.txt"
    dest = tmp_path / "datasets" / "c" / "1"
    with FaultProxy(s3.url, corrupt=(f"{bucket}/{bad}",)) as proxy:
        with pytest.raises(StageError, match="1 of 40 objects failed") as err:
            stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url, val_percent=20)
        assert err.value.result.failed[0]["key"] == bad
        assert not (dest / "raw" / bad[len("corpus/"):]).exists() and not (dest / "manifest.json").exists()
        r = stage_dataset(f"s3://{bucket}/corpus", tmp_path, "c", "1", proxy.url, val_percent=20)
        assert (r.transferred, r.skipped_unchanged) == (1, 39)
    check_dataset(dest, objects)


ADVERSARIAL = {
    "data/../escape.txt": "'..' component",
    "data/a/../../escape2.txt": "'..' component",
    "data/sub/../../../escape3.txt": "'..' component",
    "data//abs.txt": "absolute path",
    "data/nul\x00.txt": "NUL byte",
    "data/" + "x" * 300 + ".txt": "longer than 255 bytes",
    "data/./dot.txt": "'.' path component",
    "data/col": "directory of other keys",
}


def test_adversarial_keys_are_refused_and_nothing_escapes(s3, bucket, tmp_path):
    good = {f"data/ok/f{i:03d}.txt": text(i) for i in range(40)}
    good["data/col/inner.txt"] = text(1000)
    seed(bucket, {**good, **{k: b"pwned\n" for k in ADVERSARIAL}})
    fsx = tmp_path / "fsx"
    args = ["stage", f"s3://{bucket}/data", "--fsx-root", str(fsx), "--name", "adv", "--version", "1",
            "--endpoint-url", s3.url, "--val-percent", "20", "-q"]
    # The default policy (fail): every refused key is named, and nothing at all is written.
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("refused ")]
    for key, reason in ADVERSARIAL.items():       # each once; the long one cut in the middle to fit the line
        head, tail = repr(key)[:12], repr(key)[-8:]
        assert [reason in line for line in lines if line.startswith(f"refused {head}") and tail in line] == [True]
    assert f"{len(ADVERSARIAL)} keys under" in res.output and "not retryable" in res.output
    assert not fsx.exists()

    # skip: the stage succeeds without them and says so.
    before = set(tmp_path.rglob("*"))
    res = CliRunner().invoke(cli, [*args, "--on-refused", "skip"])
    assert res.exit_code == 0, res.output
    assert f"{len(ADVERSARIAL)} keys were refused and not staged" in res.output
    dest = fsx / "datasets" / "adv" / "1"
    # Everything written is inside the dataset directory, and no refused object was written anywhere.
    new = set(tmp_path.rglob("*")) - before
    assert new and all(p == fsx or dest.is_relative_to(p) or p.is_relative_to(dest) for p in new), new
    assert not any(p.is_file() and p.read_bytes() == b"pwned\n" for p in tmp_path.rglob("*"))
    manifest = check_dataset(dest, good, prefix="data/")
    assert {r["key"] for r in manifest["stage"]["refused"]} == set(ADVERSARIAL)


def test_local_directory_source(tmp_path):
    src = tmp_path / "src"
    files = {f"a/f{i}.txt": text(i) for i in range(30)}
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    (tmp_path / "secret.txt").write_bytes(b"outside the source\n")
    (src / "a" / "link.txt").symlink_to(tmp_path / "secret.txt")
    with pytest.raises(StageRefused, match="a/link.txt"):
        stage_dataset(str(src), tmp_path / "fsx", "loc", "1", val_percent=20)
    assert not (tmp_path / "fsx").exists()
    r = stage_dataset(str(src), tmp_path / "fsx", "loc", "1", val_percent=20, refused_key_policy="skip")
    assert r.transferred == 30 and [x["key"] for x in r.refused] == ["a/link.txt"]
    dest = tmp_path / "fsx" / "datasets" / "loc" / "1"
    assert sorted(f["path"] for f in read_manifest(dest)["files"]) == sorted(files)
    r = stage_dataset(str(src), tmp_path / "fsx", "loc", "1", val_percent=20, refused_key_policy="skip")
    assert (r.transferred, r.skipped_unchanged, r.rebuilt) == (0, 30, False)
    (src / "a" / "f3.txt").write_bytes(b"edited\n" * 10)
    os.utime(src / "a" / "f3.txt", ns=(1, 1))
    r = stage_dataset(str(src), tmp_path / "fsx", "loc", "1", val_percent=20, refused_key_policy="skip")
    assert (r.transferred, r.rebuilt) == (1, True)
    assert (dest / "raw" / "a" / "f3.txt").read_bytes() == b"edited\n" * 10


def test_bad_arguments_fail_before_any_side_effect(s3, tmp_path):
    fsx = tmp_path / "fsx"
    runner = CliRunner()
    for args, code, message in (
        (["s3://some-bucket/x", "--name", "../up", "--version", "1"], 2, "dataset name"),
        (["s3://some-bucket/x", "--name", "ok", "--version", "a/b"], 2, "dataset version"),
        (["gs://bucket/x", "--name", "ok", "--version", "1"], 2, "unsupported source"),
        (["s3://no-such-bucket/x", "--name", "ok", "--version", "1"], 1, "NoSuchBucket"),
        ([str(tmp_path / "missing"), "--name", "ok", "--version", "1"], 2, "does not exist"),
    ):
        res = runner.invoke(cli, ["stage", *args, "--fsx-root", str(fsx), "--endpoint-url", s3.url, "-q",
                                  "--max-attempts", "1"])
        assert res.exit_code == code and message in res.output, (args, res.output)
    assert not fsx.exists()


FAKE_LFS = '''#!{python}
"""A stand-in for the Lustre client's `lfs` HSM commands: files start released; hsm_restore queues them,
and each later hsm_state call finishes what was queued (restores take time)."""
import hashlib, json, os, sys
state = os.environ["FAKE_LFS_STATE"]
cmd, paths = sys.argv[1], sys.argv[2:]
with open(os.path.join(state, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"cmd": cmd, "paths": paths}}) + "\\n")
def mark(p, what):
    return os.path.join(state, what + "-" + hashlib.sha1(p.encode()).hexdigest())
for p in paths:
    if cmd == "hsm_restore":
        open(mark(p, "queued"), "w").close()
    elif cmd == "hsm_state":
        done = os.path.exists(mark(p, "restored"))
        if not done and os.path.exists(mark(p, "queued")):
            os.replace(mark(p, "queued"), mark(p, "restored"))
        flags = "(0x00000009) exists archived" if done else "(0x0000000d) released exists archived"
        print(p + ": " + flags + ", archive_id:1")
    else:
        sys.exit("unsupported lfs command " + cmd)
'''


def test_fsx_data_repository_association_mode(tmp_path, monkeypatch):
    dest = tmp_path / "fsx" / "datasets" / "dra" / "1"
    files = {f"part/f{i:02d}.txt": text(i) for i in range(23)}
    for rel, data in files.items():        # what the association's import makes visible
        (dest / "raw" / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / "raw" / rel).write_bytes(data)

    # Without the Lustre client the mode says so, before anything is built.
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    with pytest.raises(StageError, match="`lfs`.*not found"):
        stage_dataset("s3://linked-bucket/corpus", tmp_path / "fsx", "dra", "1", fsx_dra=True)
    assert not (dest / "manifest.json").exists()

    bin_dir, state = tmp_path / "bin", tmp_path / "lfs-state"
    bin_dir.mkdir()
    state.mkdir()
    (bin_dir / "lfs").write_text(FAKE_LFS.format(python=sys.executable))
    (bin_dir / "lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("FAKE_LFS_STATE", str(state))
    r = stage_dataset("s3://linked-bucket/corpus", tmp_path / "fsx", "dra", "1", fsx_dra=True, hsm_batch_size=5,
                      hsm_poll_s=0.01, val_percent=20)
    assert (r.restored, r.objects, r.transferred) == (23, 23, 0)
    calls = [json.loads(line) for line in (state / "calls.jsonl").read_text().splitlines()]
    restores = [c["paths"] for c in calls if c["cmd"] == "hsm_restore"]
    assert max(len(b) for b in restores) <= 5 and len(restores) == 5
    assert sorted(p for b in restores for p in b) == sorted(str(dest / "raw" / rel) for rel in files)
    # Each batch was waited for before the next was requested.
    order = [c["cmd"] for c in calls]
    assert all(order[i + 1] == "hsm_state" for i, c in enumerate(order) if c == "hsm_restore")
    assert sorted(f["path"] for f in read_manifest(dest)["files"]) == sorted(files)


@pytest.mark.filterwarnings("ignore:You may be attemping:RuntimeWarning")   # the image name has no "python"
def test_stage_component_runs_in_kfp_local(s3, bucket, tmp_path):
    import kfp.local

    from components.stage.dataset_op import stage_op

    objects = corpus(60)
    seed(bucket, objects)
    kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    task = stage_op(source=f"s3://{bucket}/corpus", fsx_root=str(tmp_path / "fsx"), name="kfp", version="1",
                    endpoint_url=s3.url, val_percent=20)
    dataset = task.outputs["dataset"]
    dest = tmp_path / "fsx" / "datasets" / "kfp" / "1"
    assert dataset.uri == str(dest)
    assert dataset.metadata["transferred"] == 60 and dataset.metadata["refused"] == 0
    manifest = check_dataset(dest, objects)
    assert dataset.metadata["train_tokens"] == manifest["splits"]["train"]["tokens"]
    metrics = task.outputs["metrics"].metadata                   # what the KFP UI shows of the step
    assert (metrics["refused"], metrics["bad_records"], metrics["vocab_size"]) == (0, 0, 256)
    assert metrics["train_tokens"] == manifest["splits"]["train"]["tokens"]
