"""A run directory belongs to one run, and what a user sets is what runs.

``goodput train`` once lost ``--data=DIR`` (it trained on the default dataset) and ``--restart-layers`` (its own
default was appended after the user's flags); a run pointed at another run's directory resumed that run's
checkpoints with other settings; a summary an earlier launch left was reported as this one's.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
from click.testing import CliRunner

from components.train.settings import build_train_config
from pipelines.cli import main
from trainer.config import RunMismatch, check_run_directory, record_settings
from trainer.layout import settings_path
from trainer.summary import read_summary

from tests.conftest import TINY
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
