"""``goodput train``: help, and bad input rejected before anything is written or started."""

from __future__ import annotations

from click.testing import CliRunner

from pipelines.cli import main


def test_help_explains_launcher_and_trainer_flags():
    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0
    for text in ("--nproc", "--restart", "--step-timeout-s", "--max-restarts", "--ckpt-every", "--inject-fault",
                 "Trainer options"):
        assert text in result.output


def test_bad_flags_fail_before_any_side_effect(tmp_path):
    fsx, out = tmp_path / "fsx", tmp_path / "run"
    for args, message in ((["--n-embd", "100", "--n-head", "3"], "divisible"),
                          (["--inject-fault", "boom@1"], "bad fault"),
                          (["--max-steps", "0"], "--max-steps must be at least 1")):
        result = CliRunner().invoke(main, ["train", "--fsx-root", str(fsx), "--out", str(out), *args])
        assert result.exit_code != 0 and message in result.output
    assert not fsx.exists() and not out.exists()
    result = CliRunner().invoke(main, ["train", "--fsx-root", str(fsx), "--max-restarts", "-1"])
    assert result.exit_code != 0 and "max_restarts" in result.output and not fsx.exists()
