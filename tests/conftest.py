"""Shared fixtures: a real dataset, a one-process gloo group, and real multi-process training runs under NVRx
ft_launcher."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.data import ensure_default_dataset
from trainer.events import read_events
from trainer.launch import LaunchConfig, LocalCluster, local_launcher_command
from trainer.parallel import Dist
from trainer.layout import replica_dir
from trainer.signals import marked as processes_marked

# A model small enough that a step takes ~0.1 s on one CPU core.
TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--eval-windows", "16", "--log-every", "5"]


@pytest.fixture(autouse=True)
def default_stop_signals():
    """Every test runs with Python's own SIGINT and SIGTERM handling, whatever the runner started the suite with (a
    background job of a shell without job control inherits SIGINT ignored, and then a Ctrl-C test's SIGINT would do
    nothing) and whatever product code an earlier test ran in this process left installed."""
    def default() -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    default()
    yield
    default()


# The workload every recovery test runs: 14 steps, a checkpoint every 4.
STEPS = ["--max-steps", "14", "--ckpt-every", "4"]


@pytest.fixture
def process_group(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo")
    yield Dist(0, 1, 0, torch.device("cpu"))
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def fsx_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fsx")


@pytest.fixture(scope="session")
def dataset(fsx_root) -> Path:
    """The default dataset (this Python's standard library), built once per session."""
    return ensure_default_dataset(fsx_root)


class Run:
    """A training run started in the background: ft_launcher + 2 ranks of ``python -m trainer``."""

    def __init__(self, out: Path, args: list[str], launch: LaunchConfig):
        self.out, self.args, self.launch = out, args, launch
        self.log = out.parent / f"{out.name}.log"
        out.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            # A new session, so that cleanup can kill the launcher and every worker it started.
            self.proc = subprocess.Popen(local_launcher_command(launch, args), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def events(self) -> list[dict]:
        return read_events(self.out / "events.jsonl")

    def wait_for(self, predicate, timeout: float = 120.0, what: str = "event") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self.events():
                if predicate(e):
                    return e
            if self.proc.poll() is not None:
                raise AssertionError(f"run exited ({self.proc.returncode}) before {what}; log:\n{self.tail()}")
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; log:\n{self.tail()}")

    def wait(self, timeout: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"run did not finish in {timeout}s; log:\n{self.tail()}")

    def worker_pid(self, rank: int) -> int:
        return [e for e in self.events() if e["event"] == "worker_start" and e["rank"] == rank][-1]["pid"]

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def kill(self) -> None:
        # The launcher's session, then each worker's: torchelastic starts workers as session leaders, and
        # their NVRx writer processes live in the workers' groups.
        pgids = [self.proc.pid] + [e["pid"] for e in self.events() if e["event"] == "worker_start"]
        for pgid in pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()


@pytest.fixture
def start_run(dataset):
    """Start a 2-rank run: ``start_run(out, *trainer_args, max_restarts=0, data=None)`` (``data``: another
    dataset than the default); all are killed at teardown."""
    runs: list[Run] = []

    def start(out: Path, *args: str, max_restarts: int = 0, nproc: int = 2, data: Path | None = None,
              **launch) -> Run:
        run = Run(out, ["--data", str(data or dataset), *TINY, "--out", str(out), *args],
                  LaunchConfig(nproc_per_node=nproc, max_restarts=max_restarts, **launch))
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()


GOODPUT = [sys.executable, "-c", "from pipelines.cli import main; main()"]
MARK = "GOODPUT_TEST_RUN"


def marked(value: str) -> list[int]:
    """Live processes whose environment carries ``MARK=value`` (every process of the run inherits it)."""
    return [p.pid for p in processes_marked(MARK, value)]


def until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def copy_due_after_checkpoint(events: list[dict], step: int) -> bool:
    """Whether rank 0's policy had to take a memory snapshot at step ``step`` + 1 or + 2, after the checkpoint of
    ``step`` (``--memory-snapshot-every-s`` tiny): copies are spaced 20x the last one's duration apart, from the
    checkpoint's snapshot on, and the copy at ``step`` + 2 is decided after step ``step`` + 1 ended."""
    spacing_s = 20 * [e["copy_s"] for e in events if e["event"] == "memory_snapshot" and e["step"] < step][-1]
    saved_at = next(e["t"] for e in events if e["event"] == "ckpt_snapshot" and e["step"] == step)
    next_at = next(e["t"] for e in events if e["event"] == "step" and e["step"] == step + 1)
    return spacing_s < next_at - saved_at


class Train:
    """``goodput train`` in a session of its own (its pid is its process group), marked by environment."""

    def __init__(self, tmp_path: Path, dataset: Path, *args: str, name: str = "run"):
        self.out, self.mark = tmp_path / name, uuid.uuid4().hex
        self.log = open(tmp_path / f"{name}.log", "w+")
        self.proc = subprocess.Popen(
            [*GOODPUT, "train", "--data", str(dataset), "--out", str(self.out), *TINY, *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, MARK: self.mark})

    def events(self) -> list[dict]:
        return read_events(self.out / "events.jsonl")

    def wait_for(self, event: str, timeout: float = 180) -> None:
        assert until(lambda: any(e["event"] == event for e in self.events()) or self.proc.poll() is not None,
                     timeout) and self.proc.poll() is None, self.output()

    def output(self, tail: int | None = 4000) -> str:
        """The run's output, its last ``tail`` characters (None: all of it)."""
        self.log.seek(0)
        return self.log.read()[-tail if tail else 0:]

    def summary_sha(self) -> str:
        return json.loads((self.out / "summary.json").read_text())["params_sha256"]

    def replica(self) -> Path:
        return replica_dir(Path("/dev/shm"), self.out / "checkpoints")

    def close(self) -> None:
        for pid in marked(self.mark):
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def train(tmp_path, dataset):
    runs: list[Train] = []

    def start(*args: str, name: str = "run") -> Train:
        runs.append(Train(tmp_path, dataset, *args, name=name))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


@pytest.fixture(scope="session")
def clean_sha(tmp_path_factory, dataset):
    """``clean_sha(mode)``: params_sha256 of an uninterrupted run of STEPS (per parallelism), computed once."""
    shas: dict[str, str] = {}

    def get(mode: str = "fsdp") -> str:
        if mode not in shas:
            out = tmp_path_factory.mktemp(f"clean-{mode}") / "run"
            run = Run(out, ["--data", str(dataset), *TINY, "--out", str(out), *STEPS, "--parallel", mode],
                      LaunchConfig(nproc_per_node=2, max_restarts=0))
            try:
                assert run.wait() == 0, run.tail()
            finally:
                run.kill()
            summary = run.summary()
            assert summary["steps"] == 14 and summary["restarts"] == 0 and summary["faults"] == []
            shas[mode] = summary["params_sha256"]
        return shas[mode]

    return get


@pytest.fixture(scope="module")
def s3():
    """moto's real S3 HTTP server on loopback, one per test module, with test credentials in the environment
    (and none of a real profile or instance role reachable)."""
    from tests.s3_stand_in import CREDENTIALS, MotoS3

    with pytest.MonkeyPatch.context() as mp:
        for k, v in CREDENTIALS.items():
            mp.setenv(k, v)
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        mp.delenv("AWS_PROFILE", raising=False)
        with MotoS3() as server:
            yield server


@pytest.fixture(scope="module")
def s3_registry(s3):
    """A bucket on the moto S3 server for a model registry: (server, s3://<bucket>/registry)."""
    bucket = f"models-{uuid.uuid4().hex[:8]}"
    s3.client().create_bucket(Bucket=bucket)
    return s3, f"s3://{bucket}/registry"


# Tight rank-monitor timeouts and a short rendezvous wait: a lost node is noticed within seconds.
FT = dict(max_restarts=2, step_timeout_s=4.0, workload_check_interval_s=0.5, join_timeout_s=60.0)


@pytest.fixture
def cluster(tmp_path, dataset):
    """``cluster(*trainer_args, nodes=2, min_nodes=0, standby=0, order=None, **launch)``: a started LocalCluster
    of 1-rank nodes; ``order``: the nodes to start, in that order (the first started gets group rank 0)."""
    started: list[LocalCluster] = []

    def start(*args: str, nodes: int = 2, min_nodes: int = 0, standby: int = 0, order=None, **launch) -> LocalCluster:
        out = tmp_path / "run"
        c = LocalCluster(LaunchConfig(nnodes=nodes, nproc_per_node=1, **{**FT, **launch}),
                         ["--data", str(dataset), *TINY, "--out", str(out), *args], min_nodes=min_nodes,
                         workdir=tmp_path, standby=standby)
        c.out = out
        started.append(c)
        if order is None:
            c.start()
        for i in order or ():
            c.start(i)
        return c

    yield start
    for c in started:
        c.close()
