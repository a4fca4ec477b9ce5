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


def test_bad_node_counts_fail_before_any_side_effect(tmp_path, monkeypatch):
    from trainer import compat

    fsx, out = tmp_path / "fsx", tmp_path / "run"
    for nodes, message in (("0", "need N >= 1"), ("2:2", "1 <= MIN < MAX"), ("two", "is not N or MIN:MAX")):
        result = CliRunner().invoke(main, ["train", "--nodes", nodes, "--fsx-root", str(fsx), "--out", str(out)])
        assert result.exit_code == 2 and message in result.output, result.output
    # From NVRx 0.6 MIN:MAX means hot spares: an elastic run is refused, not silently changed.
    monkeypatch.setenv(compat.VERSION_ENV, "0.6.0")
    result = CliRunner().invoke(main, ["train", "--nodes", "1:2", "--fsx-root", str(fsx), "--out", str(out)])
    assert result.exit_code != 0 and "hot spares" in result.output, result.output
    result = CliRunner().invoke(main, ["train", "--nodes", "2", "--join-timeout-s", "0", "--fsx-root", str(fsx)])
    assert result.exit_code != 0 and "join_timeout_s" in result.output, result.output
    assert not fsx.exists() and not out.exists()


def test_help_explains_nodes_and_the_rendezvous_timeouts():
    result = CliRunner().invoke(main, ["train", "--help"])
    for text in ("--nodes", "MIN:MAX", "--join-timeout-s", "--last-call-timeout-s"):
        assert text in result.output
