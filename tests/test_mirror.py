"""Checkpoints mirrored to S3 and resumed from it; the spot interruption notice acted on early.

S3 is moto's server on loopback (``tests/s3_stand_in.py``), with a fault-injecting proxy in front where
errors are wanted; the instance metadata service is a loopback IMDSv2 server (``tests/imds_stand_in.py``).
The first tests drive ``CheckpointMirror`` and ``SpotWatcher`` directly (seconds); the last three are real
2-rank trainings under ft_launcher (~20-40 s each).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from tests.trainer_flags import settings
from trainer.checkpoint import COMMITTED, committed_steps, step_dir
from trainer.config import CheckpointConfig, SpotConfig, parse_config
from trainer.events import Event, EventLog, read_events
from trainer.errors import MirrorFailed
from trainer.metrics import RunCollector
from trainer.mirror import CRC32_KEY, CheckpointMirror, MirrorLayout, fetch_newest, file_crc32, mirror_stats
from trainer.spot import ACTION_PATH, ImdsClient, SpotWatcher

from tests.conftest import STEPS, TINY, until
from tests.imds_stand_in import ImdsServer
from tests.s3_stand_in import CREDENTIALS, FaultProxy, MotoS3, free_port

BUCKET = "ckpt"
# Notice set on the IMDS -> checkpoint committed on FSx and in the mirror, with --spot-poll-s 0.25 and
# --ckpt-sync on this shared 2-core machine: poll (<= 0.25 s) + the rest of one step + the synchronous write and
# commit + the upload of ~2 MB. In production: --spot-poll-s + one step + the checkpoint's write (async: the
# background write) + its upload; it must stay well inside the 120 s notice.
SPOT_BOUND_S = 15.0


@pytest.fixture
def s3(monkeypatch):
    """moto on loopback with bucket ``ckpt``; credentials for boto3 in this process and in the trainers."""
    for k, v in {**CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    with MotoS3() as server:
        server.client().create_bucket(Bucket=BUCKET)
        yield server


class RecordingProxy(FaultProxy):
    """The fault proxy, also recording the order in which requests arrive."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.arrivals: list[tuple[str, str]] = []

    def _handle(self, h):
        with self.lock:
            self.arrivals.append((h.command, h.path.partition("?")[0]))
        super()._handle(h)


def _cfg(url: str, endpoint: str, **kw) -> CheckpointConfig:
    return replace(CheckpointConfig(), mirror=url, mirror_endpoint_url=endpoint, **{"mirror_retry_s": 0.2, **kw})


def _fake_checkpoint(root: Path, step: int, sizes: dict[str, int], world_size: int = 2) -> Path:
    """A committed step directory as CheckpointManager leaves it (shards, .metadata, .rank*.done, marker)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    for i, (name, size) in enumerate(sizes.items()):
        (path / name).write_bytes(bytes([(step + i) % 251]) * size)
    for r in range(world_size):
        (path / f".rank{r}.done").write_bytes(b"results")
    marker = {"step": step, "world_size": world_size, "committed_at": time.time(), "files": sorted(sizes)}
    (path / COMMITTED).write_text(json.dumps(marker))
    return path


def _objects(server: MotoS3, prefix: str = "") -> dict[str, int]:
    client = server.client()
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
    return out


def _mirrored_steps(server: MotoS3, run_prefix: str) -> dict[int, bool]:
    return MirrorLayout(f"s3://{BUCKET}/{run_prefix}").list_steps(server.client())


# --------------------------------------------------------------------------------------------- unit
def test_mirror_uploads_files_then_marker_multipart_and_applies_retention(tmp_path, s3):
    root, events_path = tmp_path / "checkpoints", tmp_path / "events.jsonl"
    mib = 1024 * 1024
    with RecordingProxy(s3.url) as proxy:
        mirror = CheckpointMirror(root, _cfg(f"s3://{BUCKET}/runs/a", proxy.url, mirror_keep=2, mirror_part_mib=5),
                                  EventLog(events_path, 0))
        for step in (1, 2, 3):
            _fake_checkpoint(root, step, {"__0_0.distcp": 11 * mib, "__1_0.distcp": 1000, ".metadata": 300})
            mirror.enqueue(step, time.time())
            assert mirror.drain(60), "uploads did not finish"
        mirror.close(5)
    keys = _objects(s3, "runs/a/")
    assert sorted(keys) == sorted(f"runs/a/checkpoints/step_{s:09d}/{n}" for s in (2, 3)
                                  for n in ("__0_0.distcp", "__1_0.distcp", ".metadata", COMMITTED))
    assert keys["runs/a/checkpoints/step_000000003/__0_0.distcp"] == 11 * mib
    # 11 MiB in 5 MiB parts: a 3-part multipart upload.
    head = s3.client().head_object(Bucket=BUCKET, Key="runs/a/checkpoints/step_000000003/__0_0.distcp")
    assert head["ETag"].strip('"').endswith("-3")
    # The marker arrived only after every data request of its step.
    for step in (1, 2, 3):
        prefix = f"/{BUCKET}/runs/a/checkpoints/step_{step:09d}/"
        mine = [(m, p) for m, p in proxy.arrivals if p.startswith(prefix) and m in ("PUT", "POST")]
        assert mine[-1] == ("PUT", prefix + COMMITTED) and (("PUT", prefix + COMMITTED) not in mine[:-1])
    marker = json.loads(s3.client().get_object(Bucket=BUCKET, Key="runs/a/checkpoints/step_000000003/COMMITTED")
                        ["Body"].read())
    assert marker["step"] == 3 and marker["world_size"] == 2 and marker["sizes"]["__0_0.distcp"] == 11 * mib
    events = read_events(events_path)
    assert [e["step"] for e in events if e["event"] == "mirror_committed"] == [1, 2, 3]
    assert [e["step"] for e in events if e["event"] == "mirror_deleted"] == [1]
    stats = mirror_stats(events)
    assert stats["checkpoints_mirrored"] == 3 and stats["last_mirrored_step"] == 3 and stats["lag_s_max"] > 0


def test_failed_upload_is_retried_later_and_a_half_upload_is_never_used(tmp_path, s3):
    root, events_path = tmp_path / "checkpoints", tmp_path / "events.jsonl"
    url = f"s3://{BUCKET}/runs/b"
    files = {"__0_0.distcp": 4000, "__1_0.distcp": 3000, "__0_1.distcp": 2000, ".metadata": 300}
    # 1) Every request fails 3 times, then none: with 2 attempts per request (SDK retries), the first
    #    attempt at step 1 fails for good, is logged, and the upload is tried again after the backoff.
    with FaultProxy(s3.url, fail_every=1, max_failures=3) as proxy:
        mirror = CheckpointMirror(root, _cfg(url, proxy.url, mirror_max_attempts=2), EventLog(events_path, 0))
        _fake_checkpoint(root, 1, files)
        mirror.enqueue(1, time.time())
        assert mirror.drain(60)
        mirror.close(5)
    events = read_events(events_path)
    errors = [e for e in events if e["event"] == "mirror_error"]
    assert errors and errors[0]["step"] == 1 and errors[0]["retry_in_s"] > 0
    assert [(e["step"], e["attempt"]) for e in events if e["event"] == "mirror_committed"] == [(1, 2)]
    assert proxy.injected[503] + proxy.injected[500] == 3

    # 2) Step 2's upload is cut off half-way (every 2nd request fails, no SDK retry, and the run ends before
    #    the outer retry): some shards land, its marker never does.
    with FaultProxy(s3.url, fail_every=2, max_failures=100) as proxy:
        cfg = _cfg(url, proxy.url, mirror_max_attempts=1, mirror_concurrency=1, mirror_retry_s=300)
        mirror = CheckpointMirror(root, cfg, EventLog(events_path, 0))
        _fake_checkpoint(root, 2, files)
        mirror.enqueue(2, time.time())
        assert not mirror.drain(3)
        mirror.close(0)
    half = _objects(s3, "runs/b/checkpoints/step_000000002/")
    assert half and not any(k.endswith(COMMITTED) for k in half), "expected a half-uploaded step without marker"
    assert _mirrored_steps(s3, "runs/b") == {1: True, 2: False}

    # 3) A new machine with an empty FSx takes step 1, never the half-uploaded step 2.
    fresh = tmp_path / "new-fsx" / "checkpoints"
    fetch_events = tmp_path / "fetch.jsonl"
    assert fetch_newest(fresh, _cfg(url, s3.url), EventLog(fetch_events, 0)) == 1
    assert committed_steps(fresh) == [1]
    for name in files:
        assert (step_dir(fresh, 1) / name).read_bytes() == (step_dir(root, 1) / name).read_bytes()
    assert not (step_dir(fresh, 2)).exists() and not list(fresh.glob(".*download*"))
    [resumed] = [e for e in read_events(fetch_events) if e["event"] == "resumed_from_mirror"]
    assert resumed["step"] == 1 and resumed["ignored_unmarked"] == [2]


def test_unreachable_s3_never_pins_more_than_keep_checkpoints_on_fsx(tmp_path, s3):
    root = tmp_path / "checkpoints"
    nobody = f"http://127.0.0.1:{free_port()}"       # connection refused
    mirror = CheckpointMirror(root, _cfg(f"s3://{BUCKET}/runs/c", nobody, mirror_keep=2, mirror_max_attempts=1,
                                         mirror_retry_s=0.1), EventLog(tmp_path / "events.jsonl", 0))
    try:
        for step in range(1, 6):
            _fake_checkpoint(root, step, {"__0_0.distcp": 100, ".metadata": 10})
            mirror.enqueue(step, time.time())
        deadline = time.monotonic() + 20
        while any(mirror.holds(s) for s in (1, 2, 3)):
            assert time.monotonic() < deadline, "old checkpoints stay pinned on FSx while S3 is down"
            time.sleep(0.05)
        assert mirror.holds(4) and mirror.holds(5)   # the newest --ckpt-mirror-keep wait for S3
    finally:
        mirror.close(0)
    events = read_events(tmp_path / "events.jsonl")
    assert any(e["event"] == "mirror_error" for e in events)
    assert {e["step"] for e in events if e["event"] == "mirror_skipped"} == {1, 2, 3}


def _mirror_errors(events_path: Path) -> list[dict]:
    return [e for e in read_events(events_path) if e["event"] == "mirror_error"]


def test_uploads_carry_s3_checksums_and_a_tampered_or_corrupted_download_is_refused(tmp_path, s3):
    root, url = tmp_path / "checkpoints", f"s3://{BUCKET}/runs/sum"
    mib = 1024 * 1024
    mirror = CheckpointMirror(root, _cfg(url, s3.url, mirror_part_mib=5), EventLog(tmp_path / "events.jsonl", 0))
    for step in (1, 2, 3):
        _fake_checkpoint(root, step, {"__0_0.distcp": 11 * mib, "__1_0.distcp": 1000, ".metadata": 300})
        mirror.enqueue(step, time.time())
        assert mirror.drain(60)
    mirror.close(5)
    client, lay = s3.client(), MirrorLayout(url)
    marker = lay.read_marker(client, 3)
    names = ("__0_0.distcp", "__1_0.distcp", ".metadata")
    assert marker[CRC32_KEY] == {n: file_crc32(step_dir(root, 3) / n) for n in names}
    # S3 holds a full-object CRC32 of each file, the multipart one (3 parts) too.
    head = client.head_object(Bucket=BUCKET, Key=lay.key(3, "__0_0.distcp"), ChecksumMode="ENABLED")
    assert head["ChecksumCRC32"] == marker[CRC32_KEY]["__0_0.distcp"] and head["ETag"].strip('"').endswith("-3")

    # Step 3's small shard is replaced in S3 by other bytes of the same size (S3's own checksum is then
    # consistent: only the one recorded at upload tells); step 2's multipart shard is corrupted in transit.
    client.put_object(Bucket=BUCKET, Key=lay.key(3, "__1_0.distcp"), Body=b"\0" * 1000)
    with FaultProxy(s3.url, corrupt=(f"{BUCKET}/{lay.key(2, '__0_0.distcp')}",)) as proxy:
        fetch_events = tmp_path / "fetch.jsonl"
        assert fetch_newest(tmp_path / "fsx" / "checkpoints", _cfg(url, proxy.url, mirror_part_mib=5),
                            EventLog(fetch_events, 0)) == 1
    refused = {e["step"]: e["error"] for e in _mirror_errors(fetch_events)}
    assert set(refused) == {2, 3} and refused[3].startswith("ChecksumMismatch: __1_0.distcp: CRC32 ")
    assert "checksum" in refused[2].lower()       # the SDK's check of the GET (ChecksumMode), or ours
    assert committed_steps(tmp_path / "fsx" / "checkpoints") == [1]
    local = json.loads((step_dir(tmp_path / "fsx" / "checkpoints", 1) / COMMITTED).read_text())
    assert CRC32_KEY not in local and "fetched_from" in local
    assert mirror_stats(read_events(fetch_events))["errors_by_phase"] == {"download": 2}

    # Every mirrored step corrupt: the run stops rather than start over next to them (with --require-mirror too).
    for step in (1, 2):
        client.put_object(Bucket=BUCKET, Key=lay.key(step, ".metadata"), Body=b"\0" * 300)
    with pytest.raises(RuntimeError, match=r"steps \[3, 2, 1\] failed their checksums; refusing to start over"):
        fetch_newest(tmp_path / "fsx2", _cfg(url, s3.url), EventLog(tmp_path / "f2.jsonl", 0))
    with pytest.raises(MirrorFailed, match="none of the 3 mirrored checkpoints .* could be downloaded"):
        fetch_newest(tmp_path / "fsx3", _cfg(url, s3.url, require_mirror=True), EventLog(tmp_path / "f3.jsonl", 0))


def test_a_mirror_that_cannot_build_its_client_or_whose_thread_fails_says_so(tmp_path, s3, monkeypatch, caplog):
    import trainer.mirror as mirror_module

    root, url = tmp_path / "checkpoints", f"s3://{BUCKET}/runs/off"

    def no_client(cfg):
        raise ValueError("Invalid endpoint: nowhere")

    events_path = tmp_path / "client.jsonl"
    with monkeypatch.context() as m:
        m.setattr(mirror_module, "s3_client", no_client)
        mirror = CheckpointMirror(root, _cfg(url, s3.url), EventLog(events_path, 0))
        assert until(lambda: _mirror_errors(events_path), 30)
        mirror.enqueue(1, time.time())           # training goes on, without the mirror
        assert mirror.drain(1)
        mirror.close(0)
        with pytest.raises(MirrorFailed, match=r"s3://ckpt/runs/off failed \(client: ValueError: Invalid endpoint"):
            CheckpointMirror(root, _cfg(url, s3.url, require_mirror=True), EventLog(tmp_path / "req.jsonl", 0))
    [error] = _mirror_errors(events_path)
    assert error["phase"] == "client" and error["error"] == "ValueError: Invalid endpoint: nowhere"
    assert "WARNING: the S3 mirror s3://ckpt/runs/off failed (client): ValueError: Invalid endpoint: nowhere; the " \
           "mirror is off for the rest of this run" in caplog.text
    stats = mirror_stats(read_events(events_path))
    assert stats["disabled"] and stats["errors_by_phase"] == {"client": 1}
    assert stats["last_error"] == "client: ValueError: Invalid endpoint: nowhere"

    events_path = tmp_path / "thread.jsonl"
    with monkeypatch.context() as m:
        m.setattr(CheckpointMirror, "_mirror", lambda self, item: 1 / 0)
        mirror = CheckpointMirror(root, _cfg(url, s3.url), EventLog(events_path, 0))
        _fake_checkpoint(root, 1, {"__0_0.distcp": 100, ".metadata": 10})
        mirror.enqueue(1, time.time())
        assert until(lambda: _mirror_errors(events_path), 30)
        mirror.close(0)
    [error] = _mirror_errors(events_path)
    assert error["phase"] == "thread" and error["error"].startswith("ZeroDivisionError")
    # The run's metrics (rank 0 reads events.jsonl) count it by phase.
    log = EventLog(events_path, 0)
    log.emit(Event.RUN_START, world_size=1, restart_count=0, run_id="r", agent_attempts={}, agent_restart_counts={})
    log.close()
    assert RunCollector(events_path, refresh_s=0).values()["goodput_mirror_errors"] == {"thread": 1}


def test_with_require_mirror_a_failed_upload_fails_the_next_commit_and_the_drain(tmp_path, s3):
    root, url, events_path = tmp_path / "checkpoints", f"s3://{BUCKET}/runs/req", tmp_path / "events.jsonl"
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(MirrorFailed, match="and --require-mirror is set"):    # unreachable: at setup
        CheckpointMirror(root, _cfg(url, nobody, mirror_max_attempts=1, require_mirror=True), EventLog(events_path, 0))
    with FaultProxy(s3.url) as proxy:
        mirror = CheckpointMirror(root, _cfg(url, proxy.url, mirror_max_attempts=1, require_mirror=True),
                                  EventLog(events_path, 0))
        with proxy.lock:
            proxy.fail_every, proxy.max_failures = 1, 1000
        _fake_checkpoint(root, 1, {"__0_0.distcp": 100, ".metadata": 10})
        mirror.enqueue(1, time.time())
        assert until(lambda: any(e["phase"] == "upload" for e in _mirror_errors(events_path)), 30)
        _fake_checkpoint(root, 2, {"__0_0.distcp": 100, ".metadata": 10})
        with pytest.raises(MirrorFailed, match=r"failed \(upload of step 1: ClientError"):
            mirror.enqueue(2, time.time())
        with pytest.raises(MirrorFailed, match=r"failed \(upload of step 1"):
            mirror.drain(30)
        mirror.close(0)


def test_spot_watcher_speaks_imdsv2_and_asks_for_one_checkpoint_per_notice(tmp_path):
    events_path = tmp_path / "events.jsonl"
    with ImdsServer() as imds:
        client = ImdsClient(imds.url)
        assert client.instance_action() is None                 # token, then 404: no notice yet
        imds.expire_tokens()
        assert client.instance_action() is None                 # 401: a new token, then 404
        assert imds.statuses("PUT") == [200, 200] and imds.statuses("GET") == [404, 401, 404]
        with pytest.raises(urllib.error.HTTPError, match="401"):   # the server insists on IMDSv2
            urllib.request.urlopen(imds.url + ACTION_PATH, timeout=5)

        watcher = SpotWatcher(SpotConfig(watch=True, metadata_url=imds.url, poll_s=0.05), EventLog(events_path, 0),
                              enabled=True)
        try:
            time.sleep(0.3)
            assert not watcher.maybe_due(5, 100)
            imds.set_notice("stop", in_s=120)
            deadline = time.monotonic() + 10
            while not watcher.maybe_due(6, 100):
                assert time.monotonic() < deadline, "the notice was not seen"
                time.sleep(0.02)
            assert not watcher.maybe_due(7, 100), "one checkpoint per notice"
        finally:
            watcher.close()
        assert not watcher._thread.is_alive()
    events = read_events(events_path)
    [notice] = [e for e in events if e["event"] == "spot_notice"]
    assert notice["action"] == "stop" and 100 < notice["seconds_left"] <= 121
    [taken] = [e for e in events if e["event"] == "spot_checkpoint"]
    assert taken["step"] == 6 and taken["since_notice_s"] < 1


def test_config_validation_and_the_job_builder_budget():
    base = ["--data", "d"]
    cfg = parse_config(base + ["--ckpt-mirror", "s3://b/p", "--ckpt-mirror-keep", "2", "--spot-watch",
                               "--spot-poll-s", "0.5"])
    assert cfg.checkpoint.mirror_keep == 2 and cfg.spot.watch and cfg.spot.poll_s == 0.5
    for bad, msg in ((["--ckpt-mirror", "bucket/p"], "s3://BUCKET"), (["--ckpt-mirror-keep", "0"], "at least 1"),
                     (["--ckpt-mirror-part-mib", "1"], "at least 5"), (["--spot-poll-s", "0"], "--spot-poll-s")):
        with pytest.raises(ValueError, match=msg):
            parse_config(base + bad)
    assert parse_config(base + ["--ckpt-mirror", "s3://b/p", "--require-mirror"]).checkpoint.require_mirror
    with pytest.raises(ValueError, match="--require-mirror needs a mirror: --ckpt-mirror s3://BUCKET/PREFIX"):
        parse_config(base + ["--require-mirror"])
    from components.train.pytorchjob import JobSpec, build_pytorchjob

    args = ["--data", "/fsx/d", "--out", "/fsx/runs/r", "--ckpt-mirror", "s3://b/p"]
    build_pytorchjob(JobSpec(image="img:1", trainer=settings(*args)))   # defaults: 30 s + 30 s fit in 60 s
    with pytest.raises(ValueError, match="--ckpt-mirror-drain-s"):
        build_pytorchjob(JobSpec(image="img:1", trainer=settings(*args, "--ckpt-mirror-drain-s", "45")))


def test_the_pipeline_passes_ckpt_mirror_and_require_mirror_to_the_trainer(tmp_path):
    import yaml
    from kfp import compiler

    from components.train.settings import build_train_config
    from pipelines.pipeline import build_pipeline

    kw = dict(fsx_root="fsx", dataset_name="c", dataset_version="1", run_id="r", backend="local", reachable=False)
    args = build_train_config(**kw, ckpt_mirror="s3://b/p", require_mirror=True, s3_endpoint_url="http://s3:9000")
    assert args.trainer_config["checkpoint"] == {"mirror": "s3://b/p", "mirror_endpoint_url": "http://s3:9000",
                                                 "require_mirror": True}
    assert "checkpoint" not in build_train_config(**kw).trainer_config, "no mirror, no endpoint"
    with pytest.raises(ValueError, match="--require-mirror needs a mirror"):        # refused at check settings
        build_train_config(**kw, require_mirror=True)
    path = tmp_path / "pipeline.yaml"
    compiler.Compiler().compile(build_pipeline("pytorchjob"), str(path))
    spec = yaml.safe_load_all(path.read_text()).__next__()
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["require_mirror"]["defaultValue"] is False and params["ckpt_mirror"]["defaultValue"] == ""
    [check] = [t for t in spec["components"]["comp-exit-handler-1"]["dag"]["tasks"].values()
               if t["taskInfo"]["name"] == "check settings"]
    for name in ("ckpt_mirror", "require_mirror"):
        assert check["inputs"]["parameters"][name]["componentInputParameter"] == f"pipelinechannel--{name}"


# -------------------------------------------------------------------------------- real trainings
def _mirror_args(s3_url: str, run_prefix: str, *extra: str) -> list[str]:
    return ["--ckpt-mirror", f"s3://{BUCKET}/{run_prefix}", "--ckpt-mirror-endpoint-url", s3_url, *extra]


def _assert_mirrored_like_local(server: MotoS3, run_prefix: str, local_root: Path, step: int) -> None:
    """The mirrored step holds exactly the local shards and .metadata, byte for byte, and its marker."""
    local = step_dir(local_root, step)
    marker = json.loads((local / COMMITTED).read_text())
    prefix = f"{run_prefix}/checkpoints/{local.name}/"
    keys = _objects(server, prefix)
    assert sorted(k[len(prefix):] for k in keys) == sorted([*marker["files"], COMMITTED])
    client = server.client()
    for name in marker["files"]:
        assert client.get_object(Bucket=BUCKET, Key=prefix + name)["Body"].read() == (local / name).read_bytes()


def test_checkpoints_are_mirrored_through_s3_errors_and_training_never_stops(tmp_path, s3, start_run, clean_sha):
    out = tmp_path / "run"
    with FaultProxy(s3.url) as proxy:
        run = start_run(out, *STEPS, *_mirror_args(proxy.url, "runs/async", "--ckpt-mirror-keep", "2",
                                                   "--ckpt-mirror-max-attempts", "2", "--ckpt-mirror-retry-s", "0.5"))
        run.wait_for(lambda e: e["event"] == "fresh_start", what="the fresh start")
        # From now on the first 3 S3 requests fail (one request fails both SDK attempts: an outer retry),
        # then every 3rd until 6 more were injected (absorbed by the SDK's retries).
        with proxy.lock:
            proxy.fail_every, proxy.max_failures = 1, 3
        run.wait_for(lambda e: e["event"] == "mirror_error", what="a mirror error")
        with proxy.lock:
            proxy.requests, proxy.fail_every, proxy.max_failures = 0, 3, 9
        assert run.wait() == 0, run.tail()
        injected = sum(proxy.injected.values())
    assert injected >= 4
    summary = run.summary()
    assert summary["steps"] == 14 and summary["params_sha256"] == clean_sha("fsdp")
    events = run.events()
    mirrored = [e["step"] for e in events if e["event"] == "mirror_committed"]
    errors = [e for e in events if e["event"] == "mirror_error"]
    skipped = [e["step"] for e in events if e["event"] == "mirror_skipped"]
    # Every checkpoint whose upload failed was uploaded later, unless newer ones made it obsolete.
    assert errors and all(e["step"] in mirrored + skipped for e in errors if e["step"] is not None)
    assert 14 in mirrored
    # Retention: the newest 2 in the mirror, the newest 3 (--ckpt-keep default) on FSx.
    assert _mirrored_steps(s3, "runs/async") == {12: True, 14: True}
    assert committed_steps(out / "checkpoints") == [8, 12, 14]
    for step in (12, 14):
        _assert_mirrored_like_local(s3, "runs/async", out / "checkpoints", step)
    m = summary["mirror"]
    assert m["last_mirrored_step"] == 14 and m["checkpoints_mirrored"] >= 2 and m["errors"] == len(errors)
    assert 0 < m["lag_s_last"] <= m["lag_s_max"]


def test_wiped_fsx_resumes_from_the_mirror_never_from_a_half_upload(tmp_path, s3, start_run, clean_sha):
    out = tmp_path / "run"
    args = [*STEPS, *_mirror_args(s3.url, "runs/wiped"), "--inject-fault", "sigterm@10:1"]
    run = start_run(out, *args)
    assert run.wait() == 0, run.tail()       # SIGTERM at step 10: committed, mirrored at exit
    assert [e["step"] for e in run.events() if e["event"] == "mirror_committed"][-1] == 10
    assert _mirrored_steps(s3, "runs/wiped") == {4: True, 8: True, 10: True}

    # A newer step whose upload was cut off half-way (shards in the mirror, no marker).
    fake_root = tmp_path / "other" / "checkpoints"
    shutil.copytree(step_dir(out / "checkpoints", 10), step_dir(fake_root, 12))
    marker = json.loads((step_dir(fake_root, 12) / COMMITTED).read_text())
    (step_dir(fake_root, 12) / COMMITTED).write_text(json.dumps({**marker, "step": 12}))
    with FaultProxy(s3.url, fail_every=2, max_failures=100) as proxy:
        cfg = _cfg("s3://ckpt/runs/wiped", proxy.url, mirror_max_attempts=1, mirror_concurrency=1, mirror_retry_s=300)
        mirror = CheckpointMirror(fake_root, cfg, EventLog(tmp_path / "other.jsonl", 0))
        mirror.enqueue(12, time.time())
        mirror.drain(3)
        mirror.close(0)
    assert _mirrored_steps(s3, "runs/wiped")[12] is False

    shutil.rmtree(out / "checkpoints")       # FSx lost: new cluster, new AZ, wiped volume
    rerun = start_run(out, *args)
    assert rerun.wait() == 0, rerun.tail()
    events = rerun.events()
    [fetched] = [e for e in events if e["event"] == "resumed_from_mirror"]
    assert fetched["step"] == 10 and fetched["ignored_unmarked"] == [12]
    assert [e["step"] for e in events if e["event"] == "resumed"][-1] == 10
    summary = rerun.summary()
    assert summary["params_sha256"] == clean_sha("fsdp")
    assert summary["mirror"]["resumed_from_mirror_step"] == 10
    # The rerun mirrored its own step 12 over the half upload; retention (3) keeps 10, 12, 14.
    assert _mirrored_steps(s3, "runs/wiped") == {10: True, 12: True, 14: True}
    _assert_mirrored_like_local(s3, "runs/wiped", out / "checkpoints", 12)


def test_spot_notice_checkpoints_every_rank_at_once_mirrors_it_and_training_goes_on(tmp_path, s3, start_run):
    """With --ckpt-sync (the mirror hooks the commit of both modes): the bound then does not depend on how fast
    NVRx's background writer gets CPU on this shared machine."""
    import torch.distributed.checkpoint as dcp

    out = tmp_path / "run"
    with ImdsServer() as imds:
        run = start_run(out, "--ckpt-sync", "--max-steps", "1000", "--ckpt-every", "0", "--spot-watch",
                        "--spot-metadata-url",
                        imds.url, "--spot-poll-s", "0.25", *_mirror_args(s3.url, "runs/spot"))
        run.wait_for(lambda e: e["event"] == "step" and e["step"] >= 5, what="step 5")
        imds.set_notice("terminate", in_s=120)
        t_notice = imds.notice_set_at
        taken = run.wait_for(lambda e: e["event"] == "spot_checkpoint", what="the spot checkpoint")
        spot_step = taken["step"]
        mirrored = run.wait_for(lambda e: e["event"] == "mirror_committed" and e["step"] == spot_step,
                                timeout=SPOT_BOUND_S + 5, what="the spot checkpoint in the mirror")
        notice_to_mirrored = mirrored["t"] - t_notice
        print(f"notice -> committed and mirrored: {notice_to_mirrored:.2f}s (step {spot_step})")
        assert notice_to_mirrored < SPOT_BOUND_S
        # Training goes on through the notice period...
        run.wait_for(lambda e: e["event"] == "step" and e["step"] >= spot_step + 10, what="steps after the notice")
        # ...until the kubelet's SIGTERM: a final checkpoint, mirrored before exit.
        run.proc.send_signal(signal.SIGTERM)
        assert run.wait() == 0, run.tail()
    events = run.events()
    [notice] = [e for e in events if e["event"] == "spot_notice"]
    assert notice["action"] == "terminate" and notice["seconds_left"] > 100
    exits = [e for e in events if e["event"] == "exit"]
    assert exits[-1]["reason"] == "sigterm" and exits[-1]["step"] > spot_step + 10
    # Only the spot and the SIGTERM checkpoints exist (--ckpt-every 0), both committed and mirrored.
    assert sorted({e["step"] for e in events if e["event"] == "ckpt_committed"}) == [spot_step, exits[-1]["step"]]
    assert [e["step"] for e in events if e["event"] == "mirror_committed"] == [spot_step, exits[-1]["step"]]
    # Both ranks wrote their part of the same step: each rank's shard file and each rank's RNG state are in
    # the one checkpoint of step spot_step, whose train state says spot_step.
    path = step_dir(out / "checkpoints", spot_step)
    files = json.loads((path / COMMITTED).read_text())["files"]
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    _assert_mirrored_like_local(s3, "runs/spot", out / "checkpoints", spot_step)
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    assert any(k.startswith("rng_rank0") for k in keys) and any(k.startswith("rng_rank1") for k in keys)
    state = {"train": {"step": 0, "batches_read": 0, "tokens": 0}}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    assert state["train"]["step"] == spot_step


class ReadOnlyS3(FaultProxy):
    """The fault proxy refusing every write (PUT, POST: 503 SlowDown) and forwarding every read."""

    def _handle(self, h):
        self.local.write = h.command in ("PUT", "POST")
        super()._handle(h)

    def _inject(self) -> int | None:
        if not self.local.write:
            return None
        with self.lock:
            self.injected[503] += 1
        return 503


def test_a_failed_mirror_shows_in_events_metrics_the_step_log_and_the_summary(tmp_path, s3, dataset, capfd):
    """The local backend of the train step: its ranks write into the step's own stdout and stderr (the KFP step
    log). S3 can be read (resume looks there first) but refuses every upload; training ends as usual."""
    from components.train.launch import train
    from trainer.config import MetricsConfig
    from trainer.metrics import MetricsExporter

    out = tmp_path / "run"
    with ReadOnlyS3(s3.url) as proxy:
        args = ["--data", str(dataset), *TINY, "--out", str(out), *STEPS,
                *_mirror_args(proxy.url, "runs/down", "--ckpt-mirror-max-attempts", "1", "--ckpt-mirror-drain-s", "1")]
        result = train("local", settings(*args), run_id="r1", task_name="train", fsx_root=tmp_path / "fsx",
                       local_nproc=2)
    step_log = capfd.readouterr()
    step_log = step_log.out + step_log.err
    assert result.summary["steps"] == 14
    # 1) The event log.
    errors = _mirror_errors(out / "events.jsonl")
    assert errors and {e["phase"] for e in errors} == {"upload"} and errors[0]["step"] == 4
    # 2) The summary (written at the end of training: the retries of teardown come after it).
    mirror = json.loads((out / "summary.json").read_text())["mirror"]
    n = mirror["errors"]
    assert 1 <= n <= len(errors) and mirror["errors_by_phase"] == {"upload": n} and not mirror["disabled"]
    assert mirror["checkpoints_mirrored"] == 0 and mirror["last_error"].startswith("upload of step ")
    # 3) The step's log: the trainer's warning as it happens, and a last line from the summary.
    assert f"WARNING: the S3 mirror s3://{BUCKET}/runs/down failed (upload of step 4): " in step_log
    assert step_log.rstrip().splitlines()[-1] == (
        f"WARNING: the S3 checkpoint mirror failed {n} time(s) in this run (upload {n}; last: {mirror['last_error']}); "
        f"no checkpoint was mirrored (events.jsonl: mirror_error)")
    # 4) Rank 0's metrics endpoint, which reads the same events.jsonl.
    exporter = MetricsExporter(MetricsConfig(metrics_port=free_port(), metrics_addr="127.0.0.1"), rank=0,
                               local_rank=0, world_size=2, events_path=out / "events.jsonl")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=30).read().decode()
    finally:
        exporter.close()
    assert f'goodput_mirror_errors{{phase="upload"}} {float(len(errors))}' in text
    assert 'goodput_mirror_errors{phase="client"} 0.0' in text


def test_with_require_mirror_a_failing_mirror_fails_the_run(tmp_path, s3, start_run):
    out = tmp_path / "run"
    with FaultProxy(s3.url) as proxy:
        run = start_run(out, *STEPS, *_mirror_args(proxy.url, "runs/required", "--require-mirror",
                                                   "--ckpt-mirror-max-attempts", "1"))
        run.wait_for(lambda e: e["event"] == "fresh_start", what="the fresh start")     # the mirror was listed
        with proxy.lock:
            proxy.fail_every, proxy.max_failures = 1, 10_000
        assert run.wait() == 2, run.tail()
    events = run.events()
    assert [e["phase"] for e in events if e["event"] == "mirror_error"][:1] == ["upload"]
    [reason] = {e["reason"] for e in events if e["event"] == "fatal"}
    assert reason.startswith(f"MirrorFailed: the S3 mirror s3://{BUCKET}/runs/required failed (upload of step 4: ")
    assert reason.endswith("and --require-mirror is set")
    assert "no layer retries an error that would come back" in run.tail(200) and not (out / "summary.json").exists()
    assert len([e for e in events if e["event"] == "worker_start"]) == 2      # one attempt: no layer retried it
    assert "forcefully exiting via 9" not in run.log.read_text(errors="replace"), "a rank outlived its SIGTERM"
