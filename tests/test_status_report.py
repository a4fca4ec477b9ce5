"""Rank 0's progress reports (``trainer.status_report``) and the launcher's progress line
(``components.train.progress``).

The TrainJob path runs the real kubeflow SDK (``update_trainjob_status``) against a local receiver of its request,
which records what it got (or fails, or never answers); the annotation path runs against the real API server in
``tests/test_k8s_status_annotations.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.train.progress import ProgressLog, follow_file, format_duration, from_file, from_trainjob, progress_line
from trainer.events import read_events
from trainer.goodput import account
from trainer.hooks import StepReport
from trainer.layout import progress_path
from trainer.status_report import (SERVER_URL_ENV, Figures, FileSink, Sink, StatusReporter,
                                   TrainJobStatusSink, build_sinks)

sdk = pytest.importorskip("kubeflow.trainer.backends.kubernetes.utils")
STATUS_PATH = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team-a/trainjobs/gp-train-1/status"
TOKEN = "projected-token-for-trainer.kubeflow.org"


class Receiver:
    """Kubeflow Trainer's status endpoint as the SDK sees it: records each request; ``mode`` ok (200), fail (500)
    or hang (reads the request, never answers until the test ends)."""

    def __init__(self, mode: str = "ok"):
        self.mode, self.requests, self.got = mode, [], threading.Condition()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.got:
                    receiver.requests.append((time.monotonic(), self.path, dict(self.headers), body))
                    receiver.got.notify_all()
                if receiver.mode == "hang":
                    receiver.release.wait(30)
                    return
                code = 200 if receiver.mode == "ok" else 500
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}{STATUS_PATH}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, n: int, timeout: float = 30) -> None:
        with self.got:
            assert self.got.wait_for(lambda: len(self.requests) >= n, timeout), f"{len(self.requests)} requests"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def trainjob_env(tmp_path, monkeypatch):
    """A pod of a TrainJob with the TrainJobStatus gate: the env the controller injects, and a receiver."""
    def start(mode: str = "ok") -> Receiver:
        r = Receiver(mode)
        receivers.append(r)
        token = tmp_path / "token"
        token.write_text(TOKEN)
        monkeypatch.setenv(SERVER_URL_ENV, r.url)
        monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
        monkeypatch.delenv("KUBEFLOW_TRAINER_SERVER_CA_CERT", raising=False)
        return r

    receivers: list[Receiver] = []
    # The SDK keeps its last update's time and its token in module globals: each test starts as a new process.
    monkeypatch.setattr(sdk, "_last_update_time", 0.0)
    monkeypatch.setattr(sdk, "_cached_token", None)
    sdk_log = logging.getLogger(sdk.__name__)
    level = sdk_log.level
    yield start
    sdk_log.setLevel(level)
    for r in receivers:
        r.close()


def run_events(path: Path) -> list[dict]:
    """A run's log so far, 20 ms of wall time per 10 ms step: a start, an in-job restart, steps, checkpoints
    committed at 20 and 40."""
    t0, lines = 1_000_000.0, []

    def emit(event: str, t: float, **fields) -> None:
        lines.append(json.dumps({"event": event, "t": t, "rank": 0, **fields}))

    emit("run_start", t0, world_size=2, restart_count=0)
    for step in range(1, 51):
        t = t0 + 0.02 * step
        emit("step", t, step=step, loss=2.0, step_s=0.01, lr=1e-3, tokens=step * 512, tokens_per_s=51200.0)
        if step == 30:
            emit("restart", t, layer="injob", restart_count=1)
        if step in (20, 40):
            emit("ckpt_committed", t, step=step)
    path.write_text("\n".join(lines) + "\n")
    return read_events(path)


def report(step: int) -> StepReport:
    return StepReport(step=step, loss=2.5 - step / 100, step_s=0.01, data_wait_s=0.0, tokens=512,
                      tokens_seen=512 * step, lr=1e-3, mfu=None)


def test_the_sdk_posts_progress_eta_and_the_live_metrics(tmp_path, trainjob_env):
    receiver = trainjob_env("ok")
    events = run_events(tmp_path / "events.jsonl")
    sinks = build_sinks(tmp_path)
    assert [type(s) for s in sinks] == [FileSink, TrainJobStatusSink]
    rep = StatusReporter(sinks, max_steps=100, events_path=tmp_path / "events.jsonl", every_s=30)
    for step in range(1, 51):
        rep.after_step(report(step))
    rep.close()          # the last figures go out at close

    receiver.wait_for(1)
    assert len(receiver.requests) == 1
    _, path, headers, body = receiver.requests[0]
    assert path == STATUS_PATH and headers["Authorization"] == f"Bearer {TOKEN}"
    ts = body["trainerStatus"]
    assert ts["progressPercentage"] == 50
    assert isinstance(ts["estimatedRemainingSeconds"], int) and ts["estimatedRemainingSeconds"] >= 0
    assert ts["lastUpdatedTime"]
    metrics = {m["name"]: m["value"] for m in ts["metrics"]}
    acc = account(events)
    assert metrics == {"step": "50", "max_steps": "100", "loss": "2.0", "tokens_per_s": "51200.0",
                       "goodput": str(acc["goodput"]), "last_committed_step": "40", "restarts_inprocess": "0",
                       "restarts_injob": "1", "restarts_job": "0"}
    # The launcher reads the same figures back from the TrainJob's status and prints its line from them.
    got = from_trainjob({"status": {"trainerStatus": ts}})
    assert (got.step, got.max_steps, got.goodput, got.restarts, got.last_committed_step) == (
        50, 100, acc["goodput"], {"inprocess": 0, "injob": 1, "job": 0}, 40)
    assert progress_line(got) == (f"[train] step 50/100, goodput {100 * acc['goodput']:.1f}%, "
                                  f"ETA {format_duration(ts['estimatedRemainingSeconds'])}, restarts: injob 1")
    # The file sink wrote the same figures for the local backend.
    assert from_file(tmp_path) == Figures.from_json(progress_path(tmp_path).read_text())
    assert from_file(tmp_path).metrics() == metrics
    assert rep.sent == {"file": 1, "trainjob-status": 1} and not any(rep.failed.values())


class Recording(Sink):
    name = "recording"

    def __init__(self, min_interval_s: float = 0.0):
        self.min_interval_s = min_interval_s
        self.sent: list[tuple[float, int]] = []
        self.cond = threading.Condition()

    def send(self, figures: Figures) -> None:
        with self.cond:
            self.sent.append((time.monotonic(), figures.step))
            self.cond.notify_all()


def test_reports_are_throttled_and_the_sdk_gets_at_most_one_per_5_s(tmp_path, trainjob_env):
    receiver = trainjob_env("ok")
    run_events(tmp_path / "events.jsonl")
    every = 0.2
    rec = Recording()
    rep = StatusReporter([rec, TrainJobStatusSink()], max_steps=100_000, events_path=tmp_path / "events.jsonl",
                         every_s=every)
    step, deadline = 0, time.monotonic() + 60
    with rec.cond:
        while len(rec.sent) < 6:
            assert time.monotonic() < deadline, rec.sent
            step += 1
            rep.after_step(report(step))
            rec.cond.wait(0.01)          # woken by a send, else 10 ms: one step each time, like a loop
    rep.close()
    gaps = [b[0] - a[0] for a, b in zip(rec.sent, rec.sent[1:])]
    assert min(gaps[:5]) >= every * 0.9, gaps           # at most one report per --status-every-s
    periodic = [s for _, s in rec.sent[:-1]]      # the last one is close's, which always reports
    assert periodic == sorted(set(periodic)), "a step reported twice"
    arrived = [t for t, *_ in receiver.requests]
    assert len(arrived) >= 1
    assert all(b - a >= 5.0 for a, b in zip(arrived, arrived[1:])), arrived   # the SDK's own limit is respected
    assert rep.failed["trainjob-status"] == 0


def test_a_failing_receiver_is_counted_logged_once_and_never_fails_the_run(tmp_path, trainjob_env, caplog):
    receiver = trainjob_env("fail")
    run_events(tmp_path / "events.jsonl")
    rep = StatusReporter([TrainJobStatusSink()], max_steps=100, events_path=tmp_path / "events.jsonl", every_s=0.05)
    caplog.set_level(logging.INFO)
    step = 0
    with receiver.got:
        while len(receiver.requests) < 4:
            step += 1
            rep.after_step(report(min(step, 99)))
            receiver.got.wait(0.01)
    rep.close()
    assert rep.failed["trainjob-status"] >= 4 and rep.sent["trainjob-status"] == 0
    ours = [r for r in caplog.records
            if r.name == "trainer" and "progress report to trainjob-status failed" in r.message]
    theirs = [r for r in caplog.records if r.name == sdk.__name__ and r.levelno >= logging.WARNING]
    assert len(ours) == 1 and len(theirs) == 1, [r.message for r in caplog.records]
    assert any("failed {'trainjob-status': " in r.message for r in caplog.records)   # the count, at the end


def test_a_hanging_receiver_never_stalls_the_loop_and_close_is_bounded(tmp_path, trainjob_env, caplog):
    receiver = trainjob_env("hang")
    run_events(tmp_path / "events.jsonl")
    rep = StatusReporter([TrainJobStatusSink()], max_steps=100, events_path=tmp_path / "events.jsonl",
                         every_s=0.05, close_timeout_s=1.0)
    rep.after_step(report(1))
    receiver.wait_for(1)         # the reporter's thread now waits for an answer that does not come
    took = []
    for step in range(2, 200):
        t0 = time.perf_counter()
        rep.after_step(report(step))
        took.append(time.perf_counter() - t0)
    assert max(took) < 0.05, max(took)
    t0 = time.monotonic()
    rep.close()
    assert time.monotonic() - t0 < 3.0
    assert any("still in flight" in r.message for r in caplog.records)


def test_a_missing_sdk_turns_the_trainjob_sink_off_with_one_line(tmp_path, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_kubeflow(name, *args, **kw):
        if name.startswith("kubeflow.trainer"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kw)

    monkeypatch.setenv(SERVER_URL_ENV, "https://trainer.example:8082/status")
    monkeypatch.setattr(builtins, "__import__", no_kubeflow)
    sinks = build_sinks(tmp_path)
    assert [type(s) for s in sinks] == [FileSink, TrainJobStatusSink]
    rep = StatusReporter(sinks, max_steps=10, events_path=tmp_path / "events.jsonl", every_s=0.05)
    for step in range(1, 5):
        rep.after_step(report(step))
    rep.close()
    assert rep.failed["trainjob-status"] == 1 and rep.sent["file"] >= 1      # off after one try; the file goes on
    (line,) = [r.message for r in caplog.records if "trainjob-status off" in r.message]
    assert "pip install 'kubeflow>=0.5'" in line


def test_no_reports_off_rank_0_or_when_off(tmp_path):
    rep = StatusReporter([], max_steps=10, events_path=tmp_path / "events.jsonl", every_s=10)
    rep.after_step(report(1))
    rep.close()
    assert not rep.enabled and not progress_path(tmp_path).exists()
    off = StatusReporter([FileSink(tmp_path)], max_steps=10, events_path=tmp_path / "events.jsonl", every_s=0)
    off.after_step(report(1))
    off.close()
    assert not off.enabled and not progress_path(tmp_path).exists()


def test_eta_comes_from_the_wall_time_per_step_and_restarts_reset_it(tmp_path):
    clock = iter([100.0, 101.0, 102.0, 200.0, 200.5])
    rep = StatusReporter([Recording()], max_steps=100, events_path=tmp_path / "events.jsonl", every_s=3600,
                         clock=lambda: next(clock))
    for step in (10, 11, 12):
        rep.after_step(report(step))
    assert rep.figures().eta_s == 88          # 1 s per step, 88 steps left
    for step in (5, 6):                        # a restart went back to step 5: 0.5 s per step since
        rep.after_step(report(step))
    assert rep.figures().eta_s == 47
    rep.close()


def test_each_report_reads_the_run_anew_so_the_last_one_has_the_final_goodput(tmp_path):
    """The figures sent at close come after the final checkpoint and validation (``run_end``): their goodput is
    the run's, not the one of the report before."""
    path = tmp_path / "events.jsonl"
    run_events(path)
    rep = StatusReporter([Recording()], max_steps=100, events_path=path, every_s=3600)
    rep.after_step(report(50))
    before = rep.figures()
    last = json.loads(path.read_text().splitlines()[-1])
    with open(path, "a") as f:               # the end, 1 s of final checkpoint and validation later
        f.write(json.dumps({"event": "run_end", "t": last["t"] + 1.0, "rank": 0, "step": 50}) + "\n")
    after = rep.figures()
    rep.close()
    assert after.goodput == account(read_events(path))["goodput"] < before.goodput


def test_the_line_and_durations():
    f = Figures(step=4200, max_steps=10000, goodput=0.991, eta_s=3 * 3600 + 12 * 60 + 7)
    assert progress_line(f) == "[train] step 4200/10000, goodput 99.1%, ETA 3h12m"
    assert format_duration(245) == "4m05s" and format_duration(42) == "42s"
    done = Figures(step=10000, max_steps=10000, goodput=0.95, eta_s=0)
    assert progress_line(done) == "[train] step 10000/10000, goodput 95.0%"
    assert from_trainjob({"status": {}}) is None
    assert from_trainjob({"status": {"trainerStatus": {"progressPercentage": 3, "metrics": [
        {"name": "loss", "value": "1"}]}}}) is None          # not our trainer's status: no line


def test_the_local_backend_prints_the_line_each_time_the_file_changes(tmp_path):
    lines: list[str] = []
    sink = FileSink(tmp_path)
    shown = threading.Condition()

    def log(line):
        with shown:
            lines.append(line)
            shown.notify_all()

    with follow_file(tmp_path, log, every_s=0.05):
        for step in (10, 20):
            sink.send(Figures(step=step, max_steps=40, goodput=0.9, eta_s=60, updated=f"t{step}"))
            with shown:
                assert shown.wait_for(lambda: len(lines) >= step // 10, 30)
        sink.send(Figures(step=40, max_steps=40, goodput=0.95, updated="t40"))
    assert lines == ["[train] step 10/40, goodput 90.0%, ETA 1m00s", "[train] step 20/40, goodput 90.0%, ETA 1m00s",
                     "[train] step 40/40, goodput 95.0%"]
    p = ProgressLog(lines.append)
    p.observe(from_file(tmp_path))
    sink.send(Figures(step=40, max_steps=40, goodput=0.95, updated="t41"))
    p.observe(from_file(tmp_path))         # the same line, reported again: not printed again
    assert lines[-1] == "[train] step 40/40, goodput 95.0%" and len(lines) == 4


def test_the_interval_is_a_trainer_setting_refused_when_negative():
    from trainer.config import parse_config

    assert parse_config(["--data", "d"]).metrics.status_every_s == 10.0
    assert parse_config(["--data", "d", "--status-every-s", "0"]).metrics.status_every_s == 0
    with pytest.raises(ValueError, match="--status-every-s must be 0 .off. or a number of seconds, got -1"):
        parse_config(["--data", "d", "--status-every-s", "-1"])
