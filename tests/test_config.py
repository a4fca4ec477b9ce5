"""Configuration: precedence, validation, and the flags the CLI documents."""

from __future__ import annotations

import json

import pytest

from trainer.config import config_from_dict, describe_flags, parse_config


def test_command_line_beats_file_beats_defaults(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nn_layer = 6\nn_embd = 96\n[run]\nmax_steps = 7\n')
    cfg = parse_config(["--config", str(toml), "--data", "d", "--n-embd", "64"])
    assert (cfg.model.n_layer, cfg.model.n_embd, cfg.run.max_steps) == (6, 64, 7)
    assert cfg.model.n_head == 4                                   # default
    again = config_from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize("args,message", [
    (["--n-embd", "130"], "divisible"),
    (["--max-steps", "0"], "--max-steps must be at least 1"),
    (["--ckpt-every", "soon"], "'auto'"),
    (["--inject-fault", "explode@3"], "bad fault"),
    (["--chaos-seed", "3"], "--fault-every"),
    (["--inprocess-soft-timeout-s", "500"], "soft < hard"),
    (["--ckpt-copy-nice", "20"], "--ckpt-copy-nice must be between 0 and 19, got 20"),
    (["--ckpt-writer-nice", "-1"], "--ckpt-writer-nice must be between 0 and 19, got -1"),
])
def test_invalid_settings_are_all_reported(args, message):
    with pytest.raises(ValueError, match=message):
        parse_config(["--data", "d", *args])


def test_missing_data_and_unknown_file_keys_are_errors(tmp_path):
    with pytest.raises(ValueError, match="--data is required"):
        parse_config([])
    toml = tmp_path / "c.toml"
    toml.write_text("[model]\nn_layers = 3\n")
    with pytest.raises(ValueError, match="unknown setting model.n_layers"):
        parse_config(["--config", str(toml), "--data", "d"])


def test_repeatable_and_boolean_flags():
    cfg = parse_config(["--data", "d", "--inject-fault", "kill@3:1", "--inject-fault", "hang@5",
                        "--ckpt-sync", "--ckpt-every", "auto"])
    assert cfg.faults.inject_fault == ["kill@3:1", "hang@5"]
    assert cfg.checkpoint.sync is True and cfg.checkpoint.ckpt_every == "auto"


def test_every_flag_is_documented_with_its_default():
    flags = {flag.split()[0]: text for _, rows in describe_flags() for flag, text in rows}
    assert "--restart-layers" in flags and "--restart" not in flags   # see RestartConfig.restart
    assert all("(default:" in text for text in flags.values())


def test_model_flags_and_their_defaults():
    cfg = parse_config(["--data", "d", "--model", "llama", "--model-flavor", "debug", "--model-config",
                        '{"n_layers": 2}', "--activation-checkpointing", "selective", "--compile"])
    m = cfg.model
    assert (m.name, m.flavor, m.activation_checkpointing, m.compile) == ("llama", "debug", "selective", True)
    assert m.spec("d").config.n_layers == 2
    default = parse_config(["--data", "d"])
    assert default.model.name == "bytegpt" and default.restart.restart == "auto"
    # bytegpt's flags are its fields: a run keeps building the model it always did.
    assert parse_config(["--data", "d", "--n-layer", "3"]).model.spec("d").config.n_layer == 3


def test_restart_layers_auto_resolves_to_the_installed_releases_default():
    from trainer import compat

    # On 0.4.1 (installed here) in-process restart is maintained: both layers, as before auto existed.
    assert compat.resolve_restart_layers(parse_config(["--data", "d"]).restart.restart,
                                         compat.release("0.4.1")) == "both"
    assert parse_config(["--data", "d", "--restart-layers", "injob"]).restart.restart == "injob"


def test_the_saved_config_names_the_resolved_model(tmp_path):
    cfg = parse_config(["--data", "d", "--model", "llama", "--seq-len", "64"])
    spec = cfg.model.spec("d")
    cfg.save(tmp_path / "config.json", model=spec.describe())
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model"]["name"] == "llama" and saved["model"]["flavor"] == "debug"
    assert saved["model"]["config"] == spec.describe()["config"] and saved["model"]["seq_len"] == 64
