"""Errors of the ``goodput`` CLI: an expected error is one line saying what to fix (exit 2), ``--debug`` shows
its traceback, a bug keeps its traceback. The handler is the ``goodput`` group's, so it covers every command;
the examples of issue 18 run through CliRunner and through a real ``goodput`` process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pipelines.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent

IMAGES = ["--component-image", "registry.example/goodput:0.1.0", "--trainer-image", "registry.example/trainer:0.1.0"]


@click.command()
@click.option("--kind", required=True)
def boom(kind: str) -> None:
    """A command that raises what it is told to, as a command in a file of another engineer might."""
    from botocore.exceptions import NoCredentialsError

    from components.evaluate.evaluate import EvaluationError

    raise {"value": ValueError("invalid PyTorchJob settings:\n  --cpu -4 must be positive\n  --nodes 0 too"),
           "project": EvaluationError("no committed checkpoint under run/checkpoints"),
           "refused": ConnectionRefusedError(111, "Connection refused"),
           "aws": NoCredentialsError(),
           "bug": KeyError("oops")}[kind]


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setitem(COMMANDS, "boom", f"{__name__}:boom")

    def invoke(*args: str):
        return CliRunner().invoke(main, list(args), catch_exceptions=False)
    return invoke


def one_error_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), output
    return lines[0]


def test_a_value_error_from_any_command_is_one_line_exit_2(cli):
    res = cli("boom", "--kind", "value")
    assert res.exit_code == 2
    assert one_error_line(res.output) == "Error: invalid PyTorchJob settings: --cpu -4 must be positive; --nodes 0 too"


def test_debug_shows_the_traceback_and_keeps_the_exit_status(cli):
    res = cli("--debug", "boom", "--kind", "value")
    assert res.exit_code == 2
    assert "Traceback (most recent call last)" in res.output and "in boom" in res.output
    assert res.output.strip().splitlines()[-1].startswith("Error: invalid PyTorchJob settings")
    res = CliRunner().invoke(main, ["boom", "--kind", "value"], env={"GOODPUT_DEBUG": "1"})
    assert "Traceback" in res.output


@pytest.mark.parametrize("kind, code, text", [
    ("project", 1, "Error: no committed checkpoint under run/checkpoints"),     # a failure the project reports
    ("refused", 1, "Error: Connection refused"),                                # the world did not answer
    ("aws", 1, "Error: Unable to locate credentials"),                          # a service said no
])
def test_reported_failures_are_one_line_exit_1(cli, kind, code, text):
    res = cli("boom", "--kind", kind)
    assert res.exit_code == code and one_error_line(res.output) == text


def test_a_bug_keeps_its_traceback_and_says_so(cli):
    res = cli("boom", "--kind", "bug")
    assert res.exit_code == 1
    assert "Traceback (most recent call last)" in res.output and "KeyError: 'oops'" in res.output
    assert "unexpected KeyError" in res.output and "This is a bug in goodput" in res.output


def test_compile_into_an_unwritable_place_names_the_option(cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = cli("compile", *IMAGES, "-o", str(blocker / "sub" / "p.yaml"))
    assert res.exit_code == 2
    assert one_error_line(res.output) == (f"Error: -o {blocker}/sub/p.yaml: {blocker} is a file, not a directory; "
                                          "give a path you can write to")
    assert blocker.read_text() == ""


def test_an_unwritable_fsx_root_is_one_line_and_creates_nothing(cli, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = cli("train", "--fsx-root", str(blocker / "fsx"), "--out", str(tmp_path / "run"), "--max-steps", "2")
    assert res.exit_code == 2
    line = one_error_line(res.output)
    assert line.startswith("Error: --fsx-root: ") and f"{blocker} is not a directory" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_corrupt_summary_names_the_file(cli, tmp_path):
    bad = tmp_path / "summary.json"
    bad.write_text('{"steps": 3,')
    res = cli("advise", "--gpus", "8", "--hours", "1", "--summary", str(bad), "--interruption-rate", "0.1",
              "--on-demand-price", "2", "--spot-price", "1")
    assert res.exit_code == 2 and f"{bad} is not a run's summary.json" in res.output and "Traceback" not in res.output


def _goodput() -> list[str]:
    exe = shutil.which("goodput", path=str(Path(sys.executable).parent)) or shutil.which("goodput")
    assert exe, "the goodput console script is not installed (pip install -e .)"
    return [exe]


@pytest.mark.parametrize("args, message", [
    (["schedule", "--name", "w", "--cron", "0 0 0 30 2 *"], "'0 0 0 30 2 *' never fires"),
    (["schedule", "--name", "w", "--cron", "@every 0h"], "'@every 0h' would run every 1 s"),
    (["schedule", "--name", "w", "--cron", "61 * * * *"], "invalid too: minute: 61 is outside 0-59"),
    (["run", "-p", "dataset_source=s3://b/p/", "-p", "max_steps=-5"], "--max-steps must be at least 1, got -5"),
    (["run", "-p", "dataset_source=s3://b/p/", "--inject-fault", "kill@x"], "bad fault 'kill@x'"),
    (["compile", *IMAGES, "-o", "{blocker}/p.yaml"], "-o {blocker}/p.yaml: {blocker} is a file, not a directory"),
])
def test_the_issues_examples_in_a_real_goodput_process(tmp_path, args, message):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = [a.format(blocker=blocker) for a in args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KFP_", "GOODPUT_"))}
    env.update(PYTHONPATH=str(ROOT), KFP_HOST="http://127.0.0.1:9", HOME=str(tmp_path))   # nothing may be sent
    proc = subprocess.run([*_goodput(), *args], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    assert one_error_line(proc.stderr).startswith("Error: ") and message.format(blocker=blocker) in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]        # nothing written
