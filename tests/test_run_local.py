"""``goodput run --local`` end to end: the compiled pipeline on kfp.local, with one injected fault.

The run is a real ``goodput`` process in its own session (so a hang can be killed whole): stage the
default dataset into a temporary FSx stand-in, train 2 ranks under ft_launcher with an exception raised
on rank 1 mid-run (recovered in-process by NVRx), evaluate, register, clean up. About 2 minutes on 2 CPU
cores. A killed rank (``kill@STEP:RANK``, recovered by the in-job layer) leaves orphaned workers behind;
that path is covered by ``test_orphaned_workers_of_a_killed_process_do_not_outlive_the_run``.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipelines.cli import main

GOODPUT = [sys.executable, "-c", "from pipelines.cli import main; main()"]


def session_processes(sid: int) -> list[int]:
    """Processes still alive in session ``sid`` (zombies excluded)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":      # fields: state ppid pgrp session ...
            alive.append(int(stat.parent.name))
    return alive


@pytest.mark.timeout(480)
def test_run_local_with_an_injected_fault(tmp_path):
    fsx = tmp_path / "fsx"
    cmd = [*GOODPUT, "run", "--local", "--fsx-root", str(fsx), "-p", "max_steps=40", "--inject-fault", "exception@30:1"]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        # SIGTERM first: goodput stops every process of the run, also those that left its session.
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"goodput run --local did not finish in 400 s:\n{out[-6000:]}")
    wall = time.monotonic() - t0
    try:
        assert proc.returncode == 0, out[-6000:]
        # Nothing outlives the run: not the trainer ranks, not the writers orphaned by the killed rank.
        assert session_processes(proc.pid) == []
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)

    (run_dir,) = (fsx / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40
    assert [(f["kind"], f["rank"], f["step"]) for f in summary["faults"]] == [("exception", 1, 30)]
    assert summary["restarts_inprocess"] + summary["restarts_injob"] >= 1
    assert 0 < summary["goodput"] < 1
    evaluation = json.loads((run_dir / "evaluation" / "evaluation.json").read_text())
    assert evaluation["promoted"] is True
    report = run_dir / "evaluation" / "report.html"
    assert report.is_file() and "<svg" in report.read_text()
    # The promoted model went to the registry, and the register branch published it.
    production = json.loads((fsx / "models" / "bytegpt" / "production.json").read_text())
    assert Path(production["model_uri"]).is_file()
    (pipeline_run,) = [p for p in (fsx / "pipeline-root").iterdir() if p.is_dir()]
    registered = json.loads((pipeline_run / "register-op" / "executor_output.json").read_text())
    (model,) = registered["artifacts"]["model"]["artifacts"]
    assert model["metadata"]["model_uri"] == production["model_uri"]
    assert model["metadata"]["production"] is True

    # The summary the user sees, and the report's path.
    for text in ("succeeded", "exception@30:1 -> recovered by the", "goodput", "promoted?", str(report)):
        assert text in out, text
    assert "trainer arguments:" in out and "Executor input" not in out and "executor_input" not in out
    print(f"goodput run --local with one fault: {wall:.0f} s wall")


def test_run_local_rejects_bad_arguments_before_running(tmp_path):
    fsx = tmp_path / "fsx"
    for args, message in ((["-p", "max_stepz=3"], "unknown parameter(s) max_stepz"),
                          (["-p", "max_steps=many"], "expects integer"),
                          (["--pipeline", "goodput-train"], "--pipeline, --cache, --wait")):
        res = CliRunner().invoke(main, ["run", "--local", "--fsx-root", str(fsx), *args])
        assert res.exit_code == 2, res.output
        assert message in res.output
    assert not fsx.exists()


def test_orphaned_workers_of_a_killed_process_do_not_outlive_the_run():
    from pipelines.local import _RunProcesses

    # A stand-in for a trainer rank: it spawns a multiprocessing worker (like NVRx's checkpoint writer).
    rank = ("import multiprocessing as mp, time\n"
            "if __name__ == '__main__':\n"
            "    w = mp.get_context('spawn').Process(target=time.sleep, args=(120,)); w.start()\n"
            "    print(w.pid, flush=True); time.sleep(120)\n")
    with _RunProcesses(interval_s=0.1) as run:
        proc = subprocess.Popen([sys.executable, "-c", rank], stdout=subprocess.PIPE, text=True)
        worker = int(proc.stdout.readline())
        assert {proc.pid, worker} <= set(run.processes())
        time.sleep(0.5)
        assert worker not in run.killed                  # its rank is alive: left alone
        proc.kill()                                      # the fault: the rank dies, its worker is orphaned
        proc.wait()
        deadline = time.monotonic() + 10
        while worker in run.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker in run.killed and worker not in run.processes()
    assert run.processes() == {}                          # the resource tracker went at the end
