"""``goodput train`` refuses what would fail the same way every time before any process starts: one line
that says what to fix, exit status 2, nothing created, nothing started (so nothing to retry)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipelines.cli import main
from trainer.errors import recurring_cause
from trainer.launch import LaunchConfig, LaunchError, run_local_training
from tests.trainer_flags import flags


def _train(tmp_path, *args: str):
    fsx, out = tmp_path / "fsx", tmp_path / "out" / "run"
    result = CliRunner().invoke(main, ["train", "--fsx-root", str(fsx), "--out", str(out), *args])
    return result, fsx, out


def _dataset(tmp_path, manifest: str | None):
    data = tmp_path / "data"
    data.mkdir()
    if manifest is not None:
        (data / "manifest.json").write_text(manifest)
    return data


@pytest.mark.parametrize("manifest,message", [
    (None, "manifest.json not found"),
    ("{not json", "manifest.json is not valid JSON"),
    (json.dumps({"format": "goodput-dataset/1"}), "manifest.json lacks 'splits'"),
    (json.dumps({"format": "something-else"}), "unsupported dataset format"),
])
def test_a_bad_dataset_is_one_line_and_exit_2_with_nothing_created(tmp_path, manifest, message):
    data = _dataset(tmp_path, manifest)
    result, fsx, out = _train(tmp_path, "--data", str(data))
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: dataset ") and message in line, line
    assert not fsx.exists() and not (tmp_path / "out").exists()
    assert sorted(p.name for p in data.iterdir()) == ([] if manifest is None else ["manifest.json"])


@pytest.mark.parametrize("make_out", [
    lambda tmp: tmp / "a-file" / "run",            # an ancestor is a file
    lambda tmp: tmp.parent / "/proc/goodput-run",   # a file system where nothing can be created
])
def test_an_unwritable_out_is_refused_before_anything_starts(tmp_path, dataset, make_out):
    (tmp_path / "a-file").write_text("")
    out = make_out(tmp_path)
    result = CliRunner().invoke(main, ["train", "--data", str(dataset), "--out", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("Error: --out ") and str(out) in line
    assert not out.exists() and not list(tmp_path.glob(".goodput-probe-*"))


@pytest.mark.parametrize("fault,message", [
    ("kill@40:7", "rank 7 does not exist in a run of 2 rank(s)"),
    ("hang@500:1", "step 500 comes after the last step (200)"),
])
def test_a_fault_that_could_never_fire_is_refused(tmp_path, dataset, fault, message):
    result, fsx, out = _train(tmp_path, "--data", str(dataset), "--inject-fault", fault)
    assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_bad_setting_is_one_line(tmp_path):
    result, fsx, out = _train(tmp_path, "--max-steps", "0", "--n-embd", "100", "--n-head", "3")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert "--max-steps must be at least 1" in line and "divisible" in line
    assert not fsx.exists() and not out.exists()


def test_the_core_raises_launch_error_a_value_error_that_no_layer_retries(tmp_path):
    """The local training backend (the pipeline's train step) gets the same refusal, as a ``ValueError``."""
    data = _dataset(tmp_path, None)
    with pytest.raises(LaunchError, match="manifest.json not found") as e:
        run_local_training(flags("--data", str(data), "--out", str(tmp_path / "run")), LaunchConfig(),
                           tmp_path / "fsx")
    assert isinstance(e.value, ValueError) and not (tmp_path / "run").exists()


def _tiny_dataset(path):
    """A dataset whose train split is too small for 2 ranks of 64-byte windows (the trainer finds out when
    it builds its batch sampler, inside the in-process layer)."""
    from trainer.data import FORMAT

    path.mkdir()
    sizes = {"train": 100, "val": 1000}
    for split, size in sizes.items():
        (path / f"{split}_00000.bin").write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])
    (path / "manifest.json").write_text(json.dumps({"format": FORMAT, "splits": {
        split: {"shards": [{"path": f"{split}_00000.bin", "tokens": size}], "tokens": size}
        for split, size in sizes.items()}}))
    return path


@pytest.mark.parametrize("layers", ["both", "injob"])
def test_an_error_that_would_recur_inside_the_ranks_is_retried_by_no_layer(tmp_path, start_run, layers):
    """Past the checks before launch (here the launcher is started directly): the in-process layer passes the
    error on, the rank reports it, and the launch wrapper stops the launcher instead of letting it restart
    the group: exit 2 at the first attempt."""
    run = start_run(tmp_path / "run", "--max-steps", "5", "--restart-layers", layers, max_restarts=2,
                    data=_tiny_dataset(tmp_path / "tiny"))
    assert run.wait(timeout=240) == 2, run.tail()
    events = run.events()
    assert len([e for e in events if e["event"] == "worker_start"]) == 2      # one attempt, no restart
    assert not [e for e in events if e["event"] == "restart"]
    (reason,) = {e["reason"] for e in events if e["event"] == "fatal"}
    assert reason.startswith("ValueError: each rank's slice of the data holds 50 tokens")
    assert "no layer retries an error that would come back" in run.tail(200)


def _raised(error: BaseException, *, handling: BaseException | None = None, from_none: bool = False):
    """``error`` as raised (while ``handling`` was being handled: from its except block)."""
    try:
        try:
            if handling is not None:
                raise handling
        finally:
            if from_none:
                raise error from None
            raise error
    except BaseException as e:
        return e


def test_an_error_raised_while_a_failure_a_restart_cures_is_handled_is_that_failures():
    """The teardown after a lost peer meets torch's ValueError once the process group is gone: the rank must be
    restarted, not stopped as for an error that every attempt would meet."""
    gone = ValueError("Default process group has not been initialized")
    assert recurring_cause(_raised(gone)) is gone
    assert recurring_cause(_raised(gone, handling=RuntimeError("Connection closed by peer"))) is None
    assert recurring_cause(_raised(gone, handling=KeyError("lr"))) is gone
    assert recurring_cause(_raised(gone, handling=RuntimeError("x"), from_none=True)) is gone
    wrapped = RuntimeError("attempt failed")
    wrapped.__cause__ = gone
    assert recurring_cause(wrapped) is gone
