"""A run directory belongs to one run, and what a user sets is what runs.

``goodput train`` once lost ``--data=DIR`` (it trained on the default dataset) and ``--restart-layers`` (its own
default was appended after the user's flags); a run pointed at another run's directory resumed that run's
checkpoints with other settings; a summary an earlier launch left was reported as this one's; a second job
started in a directory where a job still trained took itself for that job's restart (its run id, its memory
snapshots, the same checkpoints committed twice).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from click.testing import CliRunner

from components.train.settings import build_train_config
from pipelines.cli import main
from trainer.config import RunMismatch, check_run_directory, record_settings
from trainer.layout import jobs_dir, settings_path
from trainer.runlock import JobLock, RunInUse, in_use_by
from trainer.summary import read_summary

from tests.conftest import TINY, until
from tests.trainer_flags import flags


def _train(fsx, out, *extra):
    return CliRunner().invoke(main, ["train", "--nproc", "1", "--fsx-root", str(fsx), "--out", str(out), *TINY,
                                     "--max-steps", "2", "--ckpt-every", "2", *extra])


@pytest.mark.timeout(600)
def test_flags_reach_the_trainer_and_another_run_is_refused_its_directory(tmp_path, dataset):
    data = tmp_path / "my-data"
    shutil.copytree(dataset, data)
    out = tmp_path / "run"
    r = _train(tmp_path / "fsx", out, f"--data={data}", "--restart-layers", "injob")
    assert r.exit_code == 0, r.output
    recorded = json.loads(settings_path(out).read_text())
    assert recorded["data"]["data"] == str(data), "--data=DIR is the dataset trained on"
    assert recorded["restart"]["restart"] == "injob", "--restart-layers is the user's"
    assert not (tmp_path / "fsx").exists(), "no default dataset was built"

    # Another run in the same directory: refused before anything starts, with what differs.
    before = (out / "events.jsonl").read_bytes()
    r = _train(tmp_path / "fsx", out, f"--data={data}", "--lr", "0.01")
    assert r.exit_code == 2 and "holds another run" in r.output and "optim.lr: 0.002 -> 0.01" in r.output, r.output
    assert (out / "events.jsonl").read_bytes() == before
    # The same run placed otherwise (other restart layers, checkpoints kept) resumes it.
    r = _train(tmp_path / "fsx", out, f"--data={data}", "--restart-layers", "inprocess", "--ckpt-keep", "5")
    assert r.exit_code == 0, r.output


def test_the_defining_settings_are_compared_and_the_placing_ones_may_change(tmp_path):
    base = flags("--data", "/d", "--out", str(tmp_path), "--max-steps", "10")
    record_settings(tmp_path, base)
    check_run_directory(tmp_path, flags("--data", "/d", "--out", str(tmp_path), "--max-steps", "30", "--tp", "2",
                                        "--restart-layers", "injob", "--collective-timeout-s", "9"))
    for changed, what in ((["--warmup-steps", "5"], "optim.warmup_steps: 20 -> 5"), (["--seed", "1"], "run.seed"),
                          (["--model", "llama"], "model.name"), (["--batch-size", "3"], "data.batch_size")):
        with pytest.raises(RunMismatch, match=what):
            check_run_directory(tmp_path, flags("--data", "/d", "--out", str(tmp_path), "--max-steps", "10",
                                                *changed))


def test_a_summary_an_earlier_launch_left_is_not_this_ones(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7, "ended_t": time.time() - 60}))
    assert read_summary(tmp_path, since=time.time()) is None
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7}))            # written before ended_t existed
    assert read_summary(tmp_path, since=1.0) is None
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 7, "ended_t": time.time()}))
    assert read_summary(tmp_path, since=time.time() - 60)["steps"] == 7


def test_the_pipeline_refuses_a_setting_twice_and_takes_auto(tmp_path):
    kw = dict(fsx_root=str(tmp_path), dataset_name="d", dataset_version="1", run_id="r", backend="local")
    with pytest.raises(ValueError, match="trainer_config sets run.max_steps, which the parameter max_steps sets"):
        build_train_config(**kw, trainer_config={"run": {"max_steps": 5}})
    with pytest.raises(ValueError, match="trainer_config sets data.data, which dataset_name and dataset_version"):
        build_train_config(**kw, trainer_config={"data.data": "/elsewhere"})
    with pytest.raises(ValueError, match=r"trainer_config: optim.lr: 'fast' is not a float"):
        build_train_config(**kw, trainer_config={"optim.lr": "fast"})
    s = build_train_config(**kw, ckpt_every="auto", trainer_config={"checkpoint": {"mtbf_s": 3600}})
    assert s.trainer_config["checkpoint"] == {"ckpt_every": "auto", "mtbf_s": 3600.0}
    assert json.loads(settings_path(tmp_path / "runs" / "r").read_text())["checkpoint"]["ckpt_every"] == "auto"
    with pytest.raises(ValueError, match="--ckpt-every must be a number of steps or 'auto'"):
        build_train_config(**{**kw, "run_id": "r2"}, ckpt_every="often")


def _job_files(out) -> list[dict]:
    return [json.loads(f.read_text()) for f in sorted(jobs_dir(out).glob("*.lock"))]


@pytest.mark.timeout(600)
def test_a_second_job_in_a_run_directory_is_refused_and_writes_nothing(tmp_path, dataset, train, start_run,
                                                                       monkeypatch):
    monkeypatch.setenv("GOODPUT_STOPPED_S", "600")    # the first job's launcher is stopped on purpose below
    first = train("--nproc", "2", "--max-steps", "100000")
    first.wait_for("step")
    (holder,) = [record["pid"] for record in _job_files(first.out)]
    assert holder in [p.pid for p in psutil.Process(first.proc.pid).children(recursive=True)]

    # goodput train looks before anything starts.
    r = CliRunner().invoke(main, ["train", "--nproc", "2", "--data", str(dataset), "--out", str(first.out), *TINY,
                                  "--max-steps", "2"])
    assert r.exit_code == 2 and "is in use" in r.output and f"pid {holder} " in r.output, r.output

    # The first job between two attempts (its launcher held before it restarts its ranks): no rank of it lives,
    # and it still holds the directory. A job whose launcher did not look (one started at the same moment, or
    # a cluster's) is refused by its node's launch wrapper before any rank starts. It names the directory by
    # another path, which leaves it a log of its own.
    (launcher,) = [c for c in psutil.Process(holder).children() if "zygote" not in " ".join(c.cmdline())]
    ranks = [psutil.Process(e["pid"]) for e in first.events() if e["event"] == "worker_start"]
    launcher.suspend()
    try:
        for rank in ranks:
            rank.kill()
        assert not psutil.wait_procs(ranks, timeout=60)[1]
        (tmp_path / "same").symlink_to(first.out)
        second = start_run(tmp_path / "same", "--max-steps", "2", "--run-lock-wait-s", "0")
        assert second.wait(180) == 2
        assert f"is in use: another job is training there (pid {holder} " in second.tail(), second.tail()
    finally:
        launcher.resume()

    # The first job restarts its ranks and trains on; the second wrote nothing.
    assert until(lambda: len([e for e in first.events() if e["event"] == "run_start"]) == 2
                 or first.proc.poll() is not None, 180), first.output()
    events = first.events()
    assert [e.get("layer") for e in events if e["event"] == "restart"] == ["injob"]
    assert len([e for e in events if e["event"] == "worker_start"]) == 4, "two attempts of the first job's ranks"
    os.killpg(first.proc.pid, signal.SIGTERM)
    assert first.proc.wait(180) == 128 + signal.SIGTERM, first.output()
    assert not jobs_dir(first.out).exists()


def _holder(out, job: str, look: bool = True) -> subprocess.Popen:
    """A process holding its share of ``job``'s hold on ``out`` until its standard input closes; ``look=False``:
    one that has named its job and not yet looked for others."""
    take = "JobLock.hold(sys.argv[1], sys.argv[2], 0)" if look else "JobLock._share(Path(sys.argv[1]), sys.argv[2])"
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                             f"from trainer.runlock import JobLock; lock = {take}; print('held', flush=True); "
                             "sys.stdin.read()", str(out), job], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_job_waits_for_another_that_ends_and_is_refused_by_one_that_does_not(tmp_path):
    first = _holder(tmp_path, "first")
    with pytest.raises(RunInUse, match=f"pid {first.pid} on "):
        JobLock.hold(tmp_path, "second", 0)
    assert f"pid {first.pid} on " in in_use_by(tmp_path)
    # Another node of the same job shares it, and leaves the job's file to the node still holding it.
    JobLock.hold(tmp_path, "first", 0).close()
    assert [r["job"] for r in _job_files(tmp_path)] == ["first"]

    # A job that is ending (its final checkpoint): the next one waits for it instead of failing.
    waiting, got = threading.Event(), []

    class Seen(logging.Handler):
        def emit(self, record):
            if "waiting up to" in record.getMessage():
                waiting.set()

    seen = Seen()
    logging.getLogger("trainer").addHandler(seen)
    try:
        waiter = threading.Thread(target=lambda: got.append(JobLock.hold(tmp_path, "second", 120, poll_s=0.05)))
        waiter.start()
        assert waiting.wait(60)
        first.stdin.close()
        assert first.wait(60) == 0
        waiter.join(120)
    finally:
        logging.getLogger("trainer").removeHandler(seen)
    assert got and [r["job"] for r in _job_files(tmp_path)] == ["second"], "the ended job's file is gone"
    got[0].close()
    assert not jobs_dir(tmp_path).exists(), "a job that ends leaves nothing"

    # A job killed outright leaves no hold behind.
    killed = _holder(tmp_path, "killed")
    killed.kill()
    killed.wait()
    assert in_use_by(tmp_path) is None
    JobLock.hold(tmp_path, "next", 0).close()


def test_of_two_jobs_started_at_once_the_one_that_started_first_trains(tmp_path):
    older = JobLock._share(tmp_path, "older")[0]          # both named, neither has looked yet
    younger = _holder(tmp_path, "younger", look=False)
    try:
        JobLock.hold(tmp_path, "older", 0).close()        # the younger job gives way to it
        with pytest.raises(RunInUse, match=f"pid {os.getpid()} on "):
            JobLock.hold(tmp_path, "younger", 0)          # and is refused when it looks
    finally:
        os.close(older)
        younger.stdin.close()
        younger.wait()
