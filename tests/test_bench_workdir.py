"""A bench's runs go to a temporary directory unless told where: removed when the bench ends well (the runs'
checkpoints are gigabytes each time), kept and named when it fails (their logs say why)."""

from __future__ import annotations

import contextlib
import importlib.util
import tempfile
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("_runs", Path(__file__).resolve().parents[1] / "bench" / "_runs.py")
_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_runs)


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """Where ``tempfile`` makes the benches' directories, for this test."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("end", [None, SystemExit(0)], ids=["returns", "exits-0"])
def test_a_bench_that_ends_well_removes_its_runs(scratch, end):
    with pytest.raises(SystemExit) if end else contextlib.nullcontext():
        with _runs.workdir(None, "bench-x-") as root:
            (root / "run.log").write_text("ok")
            assert root.parent == scratch
            if end:
                raise end
    assert not root.exists()


@pytest.mark.parametrize("end", [RuntimeError("a run failed"), SystemExit("run failed (1); see its log"),
                                 SystemExit(1), KeyboardInterrupt()],
                         ids=["raises", "exits-message", "exits-1", "ctrl-c"])
def test_a_bench_that_fails_keeps_its_runs_and_says_where(scratch, end, capsys):
    with pytest.raises(type(end)):
        with _runs.workdir(None, "bench-x-") as root:
            (root / "run.log").write_text("why")
            raise end
    assert (root / "run.log").read_text() == "why"
    assert f"the runs are kept in {root}" in capsys.readouterr().err


def test_a_given_workdir_is_kept(tmp_path):
    given = tmp_path / "mine"
    given.mkdir()
    with _runs.workdir(given, "bench-x-") as root:
        (root / "run.log").write_text("ok")
    assert root == given and (given / "run.log").exists()
