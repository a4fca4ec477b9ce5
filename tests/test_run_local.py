"""``goodput run --local`` end to end: the compiled pipeline on kfp.local, with one injected fault.

The run is a real ``goodput`` process in its own session (so a hang can be killed whole): stage the
default dataset into a temporary FSx stand-in, train 2 ranks under ft_launcher with an exception raised
on rank 1 mid-run (recovered in-process by NVRx), evaluate, register, clean up. About 2 minutes on 2 CPU
cores. A killed rank (``kill@STEP:RANK``, recovered by the in-job layer) leaves orphaned workers behind;
that path is covered by ``test_orphaned_workers_of_a_killed_process_do_not_outlive_the_run``.
"""

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipelines.cli import main
from tests.conftest import marked as _marked
from tests.conftest import until
from trainer.events import read_events
from trainer.layout import committed_steps

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
    assert "trainer settings (besides the defaults):" in out
    assert "Executor input" not in out and "executor_input" not in out
    print(f"goodput run --local with one fault: {wall:.0f} s wall")


def _goodput_run(args: list[str], timeout: float = 400) -> tuple[int, str]:
    """``goodput run --local ARGS`` in a session of its own; (exit code, output). Nothing of it outlives it."""
    proc = subprocess.Popen([*GOODPUT, "run", "--local", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, "COLUMNS": "200"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"goodput run --local did not finish in {timeout} s:\n{out[-6000:]}")
    finally:
        for pid in session_processes(proc.pid):
            os.kill(pid, signal.SIGKILL)
    return proc.returncode, out


@pytest.mark.timeout(480)
def test_run_local_trains_llama_from_a_transformers_directory(tmp_path):
    """-p model=llama -p init_from=DIR: the pipeline checks DIR, the trainer starts from its weights, and the
    promoted model is registered as a Hugging Face directory that transformers loads."""
    import transformers

    from tests.llama_dirs import save_small_llama

    hf = save_small_llama(tmp_path / "pretrained")
    fsx = tmp_path / "fsx"
    code, out = _goodput_run(["--fsx-root", str(fsx), "-p", "model=llama", "-p", f"init_from={hf}",
                              "-p", "max_steps=10", "-p", "ckpt_every=5"])
    assert code == 0, out[-6000:]
    (run_dir,) = (fsx / "runs").iterdir()
    (start,) = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "init_from"]
    assert start["path"] == str(hf)
    assert json.loads((run_dir / "config.json").read_text())["model"]["name"] == "llama"
    production = json.loads((fsx / "models" / "llama" / "production.json").read_text())
    assert production["format"] == "huggingface"
    transformers.LlamaForCausalLM.from_pretrained(production["model_uri"])
    # The console: goodput's progress lines, not kfp.local's.
    assert "[check settings] started" in out and "[train] done in" in out and "[stage init_from] done" in out
    assert " - INFO - " not in out and "Executing task" not in out


@pytest.mark.timeout(480)
def test_run_local_stages_an_s3_init_from_to_fsx_and_scores_it_as_the_baseline(tmp_path, monkeypatch):
    """-p init_from=s3://...: check settings reads its config.json from S3, the "stage init_from" step copies it
    to <fsx>/pretrained/, the trainer starts from that copy, and evaluate scores it as the baseline."""
    from tests.llama_dirs import save_small_llama
    from tests.s3_stand_in import CREDENTIALS, MotoS3

    for k, v in {**CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)        # the run's processes inherit them
    hf = save_small_llama(tmp_path / "pretrained")
    fsx = tmp_path / "fsx"
    with MotoS3() as s3:
        s3.client().create_bucket(Bucket="models")
        for f in hf.iterdir():
            s3.client().upload_file(str(f), "models", f"llama/{f.name}")
        code, out = _goodput_run(["--fsx-root", str(fsx), "-p", "model=llama", "-p", "init_from=s3://models/llama",
                                  "-p", f"s3_endpoint_url={s3.url}", "-p", "baseline=init_from",
                                  "-p", "max_steps=6", "-p", "ckpt_every=3"])
    assert code == 0, out[-6000:]
    staged = fsx / "pretrained" / "models" / "llama"
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == {
        p.name: p.read_bytes() for p in staged.iterdir() if p.name != ".staged.json"}
    (run_dir,) = (fsx / "runs").iterdir()
    (start,) = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "init_from"]
    assert start["path"] == str(staged)
    evaluation = json.loads((run_dir / "evaluation" / "evaluation.json").read_text())
    assert evaluation["baseline"]["dir"] == str(staged) and evaluation["baseline"]["val_loss"] > 0
    assert "[stage init_from] done" in out


def test_run_local_rejects_bad_arguments_before_running(tmp_path):
    fsx = tmp_path / "fsx"
    for args, message in ((["-p", "max_stepz=3"], "unknown parameter(s) max_stepz"),
                          (["-p", "max_steps=many"], "expects integer"),
                          # a value of the right type that the check-settings step would refuse
                          (["-p", "max_steps=-5"], "--max-steps must be at least 1"),
                          (["-p", "nodes=0"], "nodes must be at least 1"),
                          (["-p", "model=llama", "-p", "model_flavor=huge"], "llama has the flavors"),
                          (["-p", "model_config={oops"], "model_config is not valid JSON"),
                          (["-p", f"init_from={tmp_path}/nowhere"], "no config.json there"),
                          (["-p", "model=llama", "-p", "init_from=production"], "no production model 'llama'"),
                          (["-p", "backend=local"], "unknown parameter(s) backend"),
                          # a registry URL of a scheme not served, instead of a directory named after it
                          (["-p", "registry=ftp://host/models"], "the scheme ftp:// is not served"),
                          (["-p", "registry=mlflow://"], "expected mlflow://HOST:PORT")):
        res = CliRunner().invoke(main, ["run", "--local", "--fsx-root", str(fsx), *args])
        assert res.exit_code == 2, res.output
        assert message in res.output
    assert not fsx.exists()


@pytest.mark.parametrize("option", [["--run-name", "demo"], ["--experiment", "e"], ["--version", "v2"],
                                    ["--timeout", "60"], ["--poll-interval", "1"], ["--host", "http://kfp:8080"],
                                    ["--token", "t"], ["--namespace", "team"], ["--cookie", "a=b"],
                                    ["--ui-host", "http://ui"], ["--service-account", "sa"], ["--no-cache"],
                                    ["--wait"], ["--pipeline", "goodput-train"]])
def test_run_local_refuses_the_options_of_cluster_runs(tmp_path, option):
    fsx = tmp_path / "fsx"
    # An unknown parameter too: the option is refused first, and an unrefused one never starts a run here.
    res = CliRunner().invoke(main, ["run", "--local", "--fsx-root", str(fsx), *option, "-p", "max_stepz=3"])
    assert res.exit_code == 2, res.output
    shown = "--cache/--no-cache" if option[0] == "--no-cache" else option[0]
    assert res.output.strip() == f"Error: {shown}: only for cluster runs (--local runs this checkout's " \
                                 "pipeline here); leave it out", res.output
    assert not fsx.exists()


def test_run_local_leaves_the_kfp_environment_alone(tmp_path):
    """KFP_HOST in the environment is not an option of this run: --local goes on to check its parameters."""
    res = CliRunner().invoke(main, ["run", "--local", "--fsx-root", str(tmp_path / "fsx"), "-p", "max_stepz=3"],
                             env={"KFP_HOST": "http://kfp:8080", "KFP_TOKEN": "t"})
    assert res.exit_code == 2 and "unknown parameter(s) max_stepz" in res.output, res.output


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
        # Found by the marker in its environment (/proc): the scan may run before the new worker shows it.
        assert until(lambda: {proc.pid, worker} <= set(run.processes()), 30), run.processes()
        time.sleep(0.5)
        assert worker not in run.killed                  # its rank is alive: left alone
        proc.kill()                                      # the fault: the rank dies, its worker is orphaned
        proc.wait()
        deadline = time.monotonic() + 10
        while worker in run.processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker in run.killed and worker not in run.processes()
    assert run.processes() == {}                          # the resource tracker went at the end


# ---- retries: said, and not made where they cannot help --------------------------------------------------

def _retry_pipeline(tmp_path, fail_with: str, backoff: str):
    """A one-step pipeline whose step fails with ``fail_with`` on its first attempt only."""
    from kfp import compiler, dsl

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def flaky(marker: str, error: str):
        import os
        if not os.path.exists(marker):
            open(marker, "w").close()
            raise {"RuntimeError": RuntimeError, "ValueError": ValueError}[error]("the first attempt fails")

    @dsl.pipeline(name="retries")
    def pipe(marker: str, error: str):
        flaky(marker=marker, error=error).set_retry(2, backoff_duration=backoff)

    package = tmp_path / "retries.yaml"
    compiler.Compiler().compile(pipe, str(package))
    return package, {"marker": str(tmp_path / "attempted"), "error": fail_with}


def test_a_retried_step_says_when_and_why(tmp_path):
    from pipelines.local import run_local

    package, arguments = _retry_pipeline(tmp_path, "RuntimeError", "1s")
    out = io.StringIO()
    run = run_local(arguments, pipeline_root=tmp_path / "root", package=package, out=out)
    assert run.ok, out.getvalue()
    assert "retrying flaky in 1 s (attempt 2/3): RuntimeError: the first attempt fails" in out.getvalue()
    assert out.getvalue().count("[flaky] started") == 2 and "[flaky] done in" in out.getvalue()


def test_an_error_that_would_recur_is_not_retried(tmp_path):
    """A ValueError (settings, data format) fails the run at once; with a 600 s backoff a retry would show."""
    from pipelines.local import run_local

    package, arguments = _retry_pipeline(tmp_path, "ValueError", "600s")
    out = io.StringIO()
    run = run_local(arguments, pipeline_root=tmp_path / "root", package=package, out=out)
    assert not run.ok and "not retried" in run.error and "ValueError: the first attempt fails" in run.error
    # Attempted once: the console says so in goodput's words, the log in kfp.local's (its lines stay there).
    assert "retrying" not in out.getvalue() and out.getvalue().count("[flaky] started") == 1
    assert run.log_path.read_text().count("Executing task") == 1 and "Executing task" not in out.getvalue()


def test_under_a_kfp_without_an_internal_the_run_says_what_it_lacks_and_runs_on(tmp_path, monkeypatch):
    from kfp.local.orchestrator.enhanced_dag_orchestrator import ConditionEvaluator

    from pipelines.local import run_local

    monkeypatch.delattr(ConditionEvaluator, "_resolve_pipeline_channel")    # unused by this pipeline
    package, arguments = _retry_pipeline(tmp_path, "RuntimeError", "1s")
    out = io.StringIO()
    run = run_local(arguments, pipeline_root=tmp_path / "root", package=package, out=out)
    assert run.ok, out.getvalue()
    [warning] = [line for line in out.getvalue().splitlines() if line.startswith("warning:")]
    assert "ConditionEvaluator._resolve_pipeline_channel" in warning and "register step may be skipped" in warning
    assert "retrying flaky in 1 s (attempt 2/3)" in out.getvalue()      # the hooks that resolve are in place


# ---- Ctrl-C ----------------------------------------------------------------------------------------------

@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)], ids=["ctrl-c", "sigterm"])
def test_a_stop_signal_commits_a_checkpoint_retries_nothing_registers_nothing_and_exits_128_plus_it(
        tmp_path, sig, to_group):
    """Ctrl-C reaches the whole foreground process group; a SIGTERM (``kill PID``) only goodput, which must pass it
    on to the train step's process, not just to the shell kfp.local runs it in."""
    fsx, mark = tmp_path / "fsx", uuid.uuid4().hex
    proc = subprocess.Popen([*GOODPUT, "run", "--local", "--fsx-root", str(fsx), "-p", "max_steps=100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "COLUMNS": "200", "GOODPUT_TEST_RUN": mark})
    try:
        deadline = time.monotonic() + 300
        while not any('"step": 20,' in p.read_text() for p in fsx.glob("runs/*/events.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0][-4000:]
            time.sleep(0.2)
        (os.killpg if to_group else os.kill)(proc.pid, sig)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 128 + sig, out[-4000:]
        assert f"interrupted ({sig.name})" in out and "nothing was registered" in out
        (events,) = fsx.glob("runs/*/events.jsonl")
        (stop,) = [json.loads(line) for line in events.read_text().splitlines() if '"exit"' in line]
        assert committed_steps(events.parent / "checkpoints") == [stop["step"]]
        assert f"committed a checkpoint at step {stop['step']}" in out
        (log,) = (fsx / "pipeline-root").glob("*.log")
        text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
        assert text.count("Executing task 'train-op'") == 1, "the train step was retried"
        assert "Executing task 'evaluate-op'" not in text
        assert not (fsx / "models").exists() or not list((fsx / "models").rglob("production.json"))
        deadline = time.monotonic() + 20
        while _marked(mark) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked(mark)
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()


_STEP_BEHIND_A_SHELL = """
import subprocess, sys
from pipelines.local import _Stop, _stopped_by_signals

stop = _Stop()
with _stopped_by_signals(stop):
    # As kfp.local runs a step: a shell that runs its Python and then more (so it does not exec the Python).
    step = subprocess.Popen(["sh", "-ec", sys.argv[1] + "; echo shell-went-on"])
    step.wait(timeout=120)
print("stopped by", stop.signum)
"""
_STEP = ("import pathlib, signal, sys; "
         "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[1]).write_text('SIGTERM'), sys.exit(0))); "
         "pathlib.Path(sys.argv[2]).touch(); signal.pause()")


def test_a_sigterm_reaches_the_steps_python_behind_its_shell(tmp_path):
    """``kill PID`` of goodput: the running step's Python gets the SIGTERM (the train step then stops its ranks with a
    checkpoint), not only the shell that kfp.local runs it in, whose death would leave it training."""
    got, ready = tmp_path / "got", tmp_path / "ready"
    step = f"{sys.executable} -c \"{_STEP}\" {got} {ready}"
    driver = subprocess.Popen([sys.executable, "-c", _STEP_BEHIND_A_SHELL, step], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert time.monotonic() < deadline and driver.poll() is None, "the step never started"
            time.sleep(0.05)
        driver.send_signal(signal.SIGTERM)     # goodput alone, as `kill PID` does
        out, _ = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert got.exists() and got.read_text() == "SIGTERM", "the step's Python was not sent SIGTERM"
    assert f"stopped by {int(signal.SIGTERM)}" in out


# ---- the console -----------------------------------------------------------------------------------------

# What a train step printed on this machine (abridged): kfp's status lines, launcher banners and INFO lines,
# NVML and asyncio tracebacks, NVRx's logger, leaked-semaphore warnings, and the trainer's own lines.
STEP_OUTPUT = """\
09:29:38.712 - INFO - Executing task \x1b[96m'train-op'\x1b[0m
    local training: 2 ranks under ft_launcher, --max-steps 600
    [2026-12-01 09:29:43,486] [INFO] [ft_launcher25888@vm] Using nproc_per_node=2.
    *****************************************
    Setting OMP_NUM_THREADS environment variable for each process to be 1 in default
    *****************************************
      entrypoint       : trainer
      rdzv_configs     : {'timeout': 900}
    [2026-12-01 09:29:43,900] [ERROR] [ft_launcher25888@vm] NVML Error: NVML Shared Library Not Found
    Traceback (most recent call last):
      File "/x/pynvml.py", line 3190, in _LoadNvmlLibrary
        nvmlLib = CDLL("libnvidia-ml.so.1")
    OSError: libnvidia-ml.so.1: cannot open shared object file: No such file or directory

    During handling of the above exception, another exception occurred:

    Traceback (most recent call last):
      File "/x/pynvml.py", line 1116, in _nvmlCheckReturn
        raise NVMLError(ret)
    pynvml.NVMLError_LibraryNotFound: NVML Shared Library Not Found

    [2026-12-01 09:29:44,519] [ALWAYS] [RankMonServer.Restarter] [NestedRestarter] name=[InJob] state=initialize
    2026-12-01 09:29:45,876 [trainer] model 0.14M params, fsdp on 2 x cpu, 1024 tokens/step, fresh start
    2026-12-01 09:29:45,044 [nvidia_resiliency_ext.checkpointing.async_ckpt.core] PersistentAsyncCaller: 1, Starting
    2026-12-01 09:29:46,037 [trainer] step 10/600 loss 5.5472 159 ms 6437 tok/s
    Traceback (most recent call last):
      File "/x/rank_monitor_server.py", line 348, in _handle_ipc_connection
        await self._waiter
    asyncio.exceptions.CancelledError
    /x/resource_tracker.py:254: UserWarning: resource_tracker: There appear to be 6 leaked semaphore objects
      warnings.warn('resource_tracker: There appear to be %d '
    Traceback (most recent call last):
      File "/x/components/train/launch.py", line 120, in _train_local
        raise RuntimeError("local training failed")
    RuntimeError: local training failed
09:30:55.181 - ERROR - Task \x1b[96m'train-op'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m
09:30:55.182 - ERROR - Pipeline \x1b[95m'goodput-train'\x1b[0m finished with status \x1b[91mFAILURE\x1b[0m
--------------------------------------------------------------------------------
"""


def test_the_console_shows_progress_and_step_lines_and_the_log_keeps_everything():
    from pipelines.local import _Progress

    out, log = io.StringIO(), io.StringIO()
    progress = _Progress(out, log, names={"train-op": "train"})
    progress.write(STEP_OUTPUT)
    shown = re.sub(r" in \d+\.\d s$", " in N s", out.getvalue(), flags=re.M)
    assert log.getvalue() == STEP_OUTPUT
    assert shown == (
        "[train] started\n"
        "    local training: 2 ranks under ft_launcher, --max-steps 600\n"
        "    2026-12-01 09:29:45,876 [trainer] model 0.14M params, fsdp on 2 x cpu, 1024 tokens/step, fresh start\n"
        "    2026-12-01 09:29:46,037 [trainer] step 10/600 loss 5.5472 159 ms 6437 tok/s\n"
        "    Traceback (most recent call last):\n"
        "      File \"/x/components/train/launch.py\", line 120, in _train_local\n"
        "        raise RuntimeError(\"local training failed\")\n"
        "    RuntimeError: local training failed\n"
        "[train] failure in N s\n"), shown
    assert progress.reason == "RuntimeError: local training failed"
    verbose = io.StringIO()
    _Progress(verbose, io.StringIO(), verbose=True).write(STEP_OUTPUT)
    assert verbose.getvalue() == re.sub(r"\x1b\[[0-9;]*m", "", STEP_OUTPUT)   # colours only on a terminal


def test_the_train_step_launches_without_importing_torch(tmp_path):
    """The check-settings step built the model to check it; the train step's local launch checks the rest of the
    settings without building it again (importing torch there cost seconds of CPU before the launcher started).
    A settings problem it does check still stops the launch first."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from components.train.launch import _train_local\n"
        "from trainer.launch import LaunchError\n"
        "try:\n"
        f"    _train_local({{'data': {{'data': {str(tmp_path / 'no-dataset')!r}}}}}, 'r', Path({str(tmp_path)!r}),\n"
        "                 {}, 2, 1, print)\n"
        "except LaunchError as e:\n"
        "    print('refused:', e)\n"
        "print('torch imported:', 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "refused: dataset" in out.stdout and "no-dataset" in out.stdout, out.stdout
    assert "torch imported: False" in out.stdout, out.stdout
