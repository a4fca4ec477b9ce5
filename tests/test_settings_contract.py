"""Every trainer setting, set through each door a user has, arrives in the settings the trainer runs with.

The values are generated from the settings tree (``trainer.config.SECTIONS``): a new setting is covered without a
new test. A value the generator cannot make up (a path, a URL) or one that the checks constrain is in
``CHOSEN``; a generated value the checks refuse fails this test with the checks' reason, which says which
value to choose instead. ``GROUPS`` are the few settings that exclude each other (bytegpt's fields and another
model, DDP and a device mesh): each group is one run, and together they set every setting off its default.

The doors: the pipeline's parameters and ``trainer_config`` object through the compiled pipeline's check-settings
step under kfp.local (the settings it records in the run directory), the trainer's command-line flags and a
TOML file through ``goodput render-job`` (the settings the job's pods run the trainer with) and ``goodput train``
(the settings it hands its launcher).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from components.train.parameters import PIPELINE_SETTINGS
from components.train.settings import DECIDED_SETTINGS
from pipelines.cli import main
from trainer.config import SECTIONS, TrainConfig, parse_config

# Values the checks constrain, or that are names and paths.
CHOSEN = {
    "model.name": "bytegpt", "model.init_from": "", "model.flavor": "default", "model.config": '{"n_layer": 3}',
    "model.n_head": 8, "model.n_embd": 256,
    "model.dropout": 0.1, "model.seq_len": 64, "data.data": "/fsx/datasets/mine/7", "run.out": "/fsx/runs/contract",
    "checkpoint.ckpt_every": "auto", "checkpoint.memory_dir": "/dev/shm/contract", "checkpoint.writer_nice": 10,
    "checkpoint.mirror": "s3://bucket/prefix", "checkpoint.mirror_endpoint_url": "http://s3.local:9000",
    "checkpoint.sigterm_grace_s": 20.0, "checkpoint.mirror_drain_s": 10.0,
    "parallel.parallel": "fsdp", "parallel.dp_replicate": 1, "parallel.dp_shard": 2,
    "parallel.tp": 1,
    "faults.inject_fault": ["kill@3:1"], "spot.metadata_url": "http://imds.local",
    "metrics.metrics_port": 9700, "metrics.metrics_addr": "127.0.0.1", "metrics.data_wait_warn": 0.5,
}
# One run each: (settings set in that run instead of the values above). Every setting is off its default in one.
GROUPS = {
    "bytegpt": {},
    "llama with a device mesh": {"model.name": "llama", "model.flavor": "debug", "model.config": '{"n_layers": 2}',
                                 "parallel.tp": 2},
    "ddp": {"parallel.parallel": "ddp", "parallel.dp_replicate": 0, "parallel.dp_shard": 0, "parallel.tp": 1},
    "llama from a Hugging Face directory": {"model.name": "llama", "model.flavor": "", "model.config": "",
                                            "model.init_from": "LLAMA_DIR"},
}
BYTEGPT_ONLY = ("model.n_layer", "model.n_head", "model.n_embd", "model.dropout")


def _generated(f: dataclasses.Field) -> object:
    if "choices" in f.metadata:
        return next(c for c in f.metadata["choices"] if c != f.default)
    kind = str(f.type)
    if kind == "bool":
        return not f.default
    if kind == "int":
        return f.default + 1
    if kind == "float":
        return f.default * 2 + 1
    raise AssertionError(f"no value for a {kind} setting {f.name}: add one to CHOSEN")


def group_values(group: str, llama_dir: Path = Path("llama")) -> dict[str, object]:
    """``{"section.field": value}``: every setting off its default, as far as the group allows."""
    values = {f"{s}.{f.name}": CHOSEN.get(f"{s}.{f.name}", None) for s, cls in SECTIONS.items()
              for f in dataclasses.fields(cls)}
    fields = {f"{s}.{f.name}": f for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    values = {k: v if v is not None else _generated(fields[k]) for k, v in values.items()}
    values.pop("model.vocab_size")      # the dataset's, resolved when the trainer starts
    overrides = GROUPS[group]
    if overrides.get("model.name", "bytegpt") != "bytegpt":
        values.update({k: fields[k].default for k in BYTEGPT_ONLY})
    values.update({k: str(llama_dir) if v == "LLAMA_DIR" else v for k, v in overrides.items()})
    return values


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.llama_dirs import save_small_llama

    return save_small_llama(tmp_path_factory.mktemp("hf") / "llama")


def test_the_groups_set_every_setting_off_its_default():
    defaults = TrainConfig().to_dict()
    off = {k for g in GROUPS for k, v in group_values(g).items()
           if v != defaults[k.split(".")[0]][k.split(".")[1]]}
    every = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)} - {"model.vocab_size"}
    assert every - off == set()


def _arrived(cfg: TrainConfig, values: dict[str, object]) -> list[str]:
    """The settings whose value is not the one set."""
    got = cfg.to_dict()
    return [f"{k}: set {v!r}, arrived {got[k.split('.')[0]][k.split('.')[1]]!r}" for k, v in values.items()
            if got[k.split(".")[0]][k.split(".")[1]] != v]


def _flags(values: dict[str, object]) -> list[str]:
    out = []
    for key, value in values.items():
        section, name = key.split(".")
        f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
        flag = f.metadata.get("flag") or "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [a for v in value for a in (flag, v)]
        else:
            out += [flag, str(value)]
    return out


def _rendered_trainer(argv: list[str]) -> TrainConfig:
    """The settings the pods of ``goodput render-job ARGV`` run the trainer with (read by the trainer's parser)."""
    r = CliRunner().invoke(main, ["render-job", "--image", "ecr/trainer:1", "--nodes", "1", "--gpus-per-node", "2",
                                  *argv])
    assert r.exit_code == 0, r.output
    import yaml

    (job,) = yaml.safe_load_all(r.stdout)
    cmd = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    return parse_config(cmd[cmd.index("trainer") + 1:])


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_setting_given_as_a_flag_reaches_the_pods_trainer(group, llama_dir):
    values = group_values(group, llama_dir)
    assert _arrived(_rendered_trainer(_flags(values)), values) == []


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_setting_given_in_a_toml_file_reaches_the_pods_trainer(group, tmp_path, llama_dir):
    values = group_values(group, llama_dir)
    tables: dict[str, dict] = {}
    for key, value in values.items():
        section, name = key.split(".")
        tables.setdefault(section, {})[name] = value
    toml = tmp_path / "run.toml"
    toml.write_text("\n".join(f"[{s}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in t.items())
                              for s, t in tables.items()))
    assert _arrived(_rendered_trainer(["--config", str(toml)]), values) == []


def _pipeline_arguments(values: dict[str, object], fsx: Path) -> dict:
    """The run's pipeline arguments that set ``values``: a parameter where the setting has its own, the rest in
    ``trainer_config``."""
    params = {"fsx_root": str(fsx), "registry": str(fsx / "models"), "dataset_name": "mine", "dataset_version": "7",
              "s3_endpoint_url": values["checkpoint.mirror_endpoint_url"]}
    by_setting = {setting: param for param, setting in PIPELINE_SETTINGS.items()}
    rest = {}
    for key, value in values.items():
        if key in by_setting:
            params[by_setting[key]] = ",".join(value) if key == "faults.inject_fault" else value
        elif key not in DECIDED_SETTINGS:
            rest[key] = value
    return {**params, "trainer_config": rest}


@pytest.mark.filterwarnings("ignore:You may be attemping to run a task that uses custom:RuntimeWarning")
def test_every_setting_given_to_the_pipeline_is_recorded_by_its_check_settings_step(tmp_path, llama_dir):
    """One run of the compiled pipeline's check-settings step (kfp.local) per group; the step records the
    settings the trainer will run with in the run directory (settings.json)."""
    import yaml
    from kfp import compiler, local

    from components.train.settings_op import train_config_op
    from pipelines.params import _settings_inputs
    from pipelines.pipeline import build_pipeline

    package = tmp_path / "pipeline.yaml"
    compiler.Compiler().compile(build_pipeline("local"), str(package))
    spec = next(yaml.safe_load_all(package.read_text()))
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    types = {name: p.annotation for name, p in inspect.signature(train_config_op.python_func).parameters.items()}
    for group in sorted(GROUPS):
        values = group_values(group, llama_dir)
        fsx = tmp_path / group.replace(" ", "-")
        fsx.mkdir()
        inputs = _settings_inputs(spec, _pipeline_arguments(values, fsx))
        # The compiled spec holds integers' defaults as floats (a protobuf Value); KFP's backend casts them back.
        inputs = {k: int(v) if types[k] is int else v for k, v in inputs.items() if k != "run_id"}
        task = train_config_op(**inputs, run_id=f"run-{len(group)}")
        run_dir = Path(task.outputs["run_dir"])
        recorded = TrainConfig.from_values({s: {k: v for k, v in t.items() if s != "model" or k != "vocab_size"}
                                            for s, t in json.loads((run_dir / "settings.json").read_text()).items()})
        decided = {"data.data": f"{fsx}/datasets/mine/7", "run.out": str(run_dir)}
        assert _arrived(recorded, {**values, **decided}) == [], group
        # ... and the train step runs the trainer with the same settings.
        assert task.outputs["trainer_config"] == recorded.document()


def test_the_settings_doc_lists_the_pipeline_parameters_and_the_defining_settings():
    """docs/settings.md stays true: its tables are the code's."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "settings.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| `([\w.]+)`", text, re.M))
    assert rows == PIPELINE_SETTINGS
    defining = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                if f.metadata.get("defines")}
    listed = text.split("must be the same to resume it:")[1].split("A run pointed")[0]
    assert set(re.findall(r"`([\w.]+)`", listed)) == defining


def test_the_check_settings_component_is_generated_from_the_declaration():
    """components/train/settings_op.py is what components.train.parameters makes of the run's parameters: a
    parameter declared there and not regenerated (python -m components.train.parameters) fails here."""
    from components.train.parameters import OP_PATH, render_op

    assert OP_PATH.read_text() == render_op(), "run python -m components.train.parameters"


def test_a_pipeline_parameter_that_is_a_trainer_setting_has_the_trainers_type_and_default():
    """One default per setting: the Create-run form's is the trainer's."""
    from components.train.parameters import PARAMETERS
    from pipelines.pipeline import goodput_pipeline

    form = inspect.signature(goodput_pipeline.pipeline_func).parameters
    defaults = TrainConfig().to_dict()
    for param, setting in PIPELINE_SETTINGS.items():
        section, name = setting.split(".")
        default = defaults[section][name]
        assert form[param].default == (",".join(default) if isinstance(default, list) else default), param
        assert form[param].default == PARAMETERS[param].default
