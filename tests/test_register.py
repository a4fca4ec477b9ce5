"""The register step: the promoted model's registry record, checked, published as the run's Model."""

import json

import pytest
from kfp import dsl

from components.evaluate.register import registered_model
from components.evaluate.registry_format import RegistrationError
from components.evaluate.register_op import register_op


@pytest.fixture
def registry(tmp_path):
    root = tmp_path / "models"
    for version in ("run-a-step000000060", "run-b-step000000080"):
        d = root / "bytegpt" / version
        d.mkdir(parents=True)
        (d / "model.pt").write_bytes(b"weights")
        (d / "metadata.json").write_text(json.dumps({
            "version": version, "step": 60, "metrics": {"val_loss": 2.9, "bpb": 4.2}, "params_sha256": "ab" * 32,
            "source_run": f"/fsx/runs/{version[:5]}"}))
    return root


def point_production(registry, version):
    uri = f"{registry}/bytegpt/{version}/model.pt"
    (registry / "bytegpt" / "production.json").write_text(json.dumps({"version": version, "model_uri": uri}))
    return uri


def test_record_of_the_production_model(registry):
    uri = point_production(registry, "run-a-step000000060")
    rec = registered_model(uri, str(registry), "bytegpt")
    assert rec["version"] == "run-a-step000000060" and rec["production"] is True
    assert rec["step"] == 60 and rec["val_loss"] == 2.9 and rec["params_sha256"] == "ab" * 32
    assert rec["metadata_uri"] == f"{registry}/bytegpt/run-a-step000000060/metadata.json"


def test_a_model_promoted_over_since_is_recorded_but_not_production(registry):
    uri = f"{registry}/bytegpt/run-a-step000000060/model.pt"
    point_production(registry, "run-b-step000000080")
    lines = []
    rec = registered_model(uri, str(registry), "bytegpt", log=lines.append)
    assert rec["production"] is False
    assert "another run was promoted after this one" in lines[0]


@pytest.mark.parametrize("uri, message", [
    ("", "is not a registered model under"),
    ("/elsewhere/bytegpt/v/model.pt", "is not a registered model under"),
    ("{registry}/bytegpt/v/extra/model.pt", "is not a registered model under"),
    ("{registry}/bytegpt/missing-version/model.pt", "metadata.json is missing"),
])
def test_what_evaluate_did_not_register_fails(registry, uri, message):
    with pytest.raises(RegistrationError, match=message):
        registered_model(uri.format(registry=registry), str(registry), "bytegpt")


def test_weights_missing_fails(registry):
    uri = point_production(registry, "run-a-step000000060")
    (registry / "bytegpt" / "run-a-step000000060" / "model.pt").unlink()
    with pytest.raises(RegistrationError, match="model.pt is missing"):
        registered_model(uri, str(registry), "bytegpt")


def test_a_hugging_face_directory_is_recorded_by_its_directory(registry):
    d = registry / "bytegpt" / "run-c-step000000090"
    d.mkdir()
    files = ["config.json", "model.safetensors"]
    for name in files:
        (d / name).write_text("{}")
    (d / "metadata.json").write_text(json.dumps({"format": "huggingface", "files": files, "step": 90}))
    rec = registered_model(str(d), str(registry), "bytegpt", log=lambda _: None)
    assert (rec["version"], rec["format"], rec["step"]) == ("run-c-step000000090", "huggingface", 90)
    (d / "model.safetensors").unlink()
    with pytest.raises(RegistrationError, match="model.safetensors is missing"):
        registered_model(str(d), str(registry), "bytegpt")


def test_component_publishes_the_model_artifact(registry, tmp_path):
    uri = point_production(registry, "run-a-step000000060")
    model = dsl.Model(name="model", uri=str(tmp_path / "out" / "model"))
    (tmp_path / "out").mkdir()
    model.path = str(tmp_path / "out" / "model")          # local artifact: path and uri coincide
    register_op.python_func(model_uri=uri, registry=str(registry), model_name="bytegpt", model=model)
    assert model.metadata["version"] == "run-a-step000000060" and model.metadata["production"] is True
    assert json.loads((tmp_path / "out" / "model").read_text())["model_uri"] == uri


def test_a_registry_from_before_pluggable_models_still_loads(tmp_path):
    # Its metadata names no model spec, no format and no files: a ByteGPT model.pt and its model_config.
    import dataclasses

    import torch

    from components.evaluate.evaluate import params_sha256
    from components.evaluate.register import Registry, load_registered_model
    from trainer.models.bytegpt import ByteGPT, ByteGPTConfig

    # What the trainer's model section held then: ByteGPT's fields alone.
    cfg = ByteGPTConfig(n_layer=1, n_embd=32, n_head=2, seq_len=16)
    torch.manual_seed(4)
    state = ByteGPT(cfg).state_dict()
    d = tmp_path / "models" / "bytegpt" / "old-step000000010"
    d.mkdir(parents=True)
    torch.save(state, d / "model.pt")
    meta = {"version": "old-step000000010", "model_config": dataclasses.asdict(cfg)}
    spec, model = load_registered_model(Registry(str(tmp_path / "models")), "bytegpt", "old-step000000010", meta,
                                        tmp_path / "tmp")
    assert spec.name == "bytegpt" and spec.config == cfg
    assert params_sha256(model.state_dict()) == params_sha256(state)
