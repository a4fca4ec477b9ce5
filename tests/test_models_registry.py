"""The model registry: built-ins, flavors and --model-config overrides, the user's package.module:function
(the example package under examples/), and clear refusals of bad names and configs before anything is built."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from trainer.models.bytegpt import ByteGPT
from trainer.models import ModelError, ParallelPlan, build_model, num_params, resolve_model, spec_from_run_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def user_code(monkeypatch, tmp_path):
    """The example package and a scratch directory of broken factories, importable as installed code."""
    monkeypatch.syspath_prepend(str(EXAMPLES / "convlm"))
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "broken_models.py").write_text(textwrap.dedent("""
        NOT_CALLABLE = 3

        def returns_a_module(flavor, overrides):
            import torch
            return torch.nn.Linear(2, 2)

        def rejects_its_config(flavor, overrides):
            raise ValueError(f"width {overrides.get('width')} is too small")
    """))
    return tmp_path


def test_builtins_resolve_with_flavor_and_overrides(tmp_path):
    llama = resolve_model("llama", "llama3-8b", '{"max_seq_len": 8192, "rope_theta": 10000}')
    assert (llama.name, llama.flavor, llama.config.dim, llama.config.max_seq_len) == ("llama", "llama3-8b", 4096, 8192)
    assert isinstance(llama.config.rope_theta, float) and llama.vocab.size == 128256
    assert resolve_model("llama").flavor == "debug"
    (tmp_path / "m.toml").write_text("n_layer = 2\nn_embd = 64\n")
    (tmp_path / "m.json").write_text(json.dumps({"n_head": 2}))
    assert resolve_model("bytegpt", "", str(tmp_path / "m.toml")).config.n_layer == 2
    assert resolve_model("bytegpt", "", str(tmp_path / "m.json")).config.n_head == 2


def test_bytegpt_starts_from_the_weights_the_trainer_always_built(process_group):
    spec = resolve_model("bytegpt", "", {"n_layer": 2, "n_embd": 64, "n_head": 2})
    model = build_model(spec, ParallelPlan(mode="ddp"), process_group, seed=1337)
    torch.manual_seed(1337)
    reference = ByteGPT(spec.config)
    for (name, p), (_, q) in zip(model.module.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(p, q), name


def test_a_run_config_names_its_model():
    spec = resolve_model("llama", "debug", {"n_layers": 2})
    again = spec_from_run_config({"model": spec.describe()})
    assert (again.name, again.flavor, again.config) == ("llama", "debug", spec.config)
    legacy = spec_from_run_config({"model": {"n_layer": 3, "n_head": 4, "n_embd": 128, "seq_len": 64,
                                             "dropout": 0.0, "vocab_size": 256}})
    assert legacy.name == "bytegpt" and legacy.config.n_layer == 3


def test_user_model_from_the_example_package_trains_under_fsdp2(user_code, process_group):
    spec = resolve_model("convlm:model_spec", "tiny", '{"kernel_size": 4}')
    assert spec.name == "convlm:model_spec" and spec.config.kernel_size == 4 and spec.vocab.tokenizer == "bytes"
    model = build_model(spec, ParallelPlan(mode="fsdp", activation_checkpointing="full"), process_group, seed=0)
    assert num_params(model) > 0 and all(type(p).__name__ == "DTensor" for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(30):
        loss = spec.loss(model, data[:, :-1], data[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0      # it learns the batch: loss, blocks and init all plugged in


def test_user_model_is_causal(user_code):
    spec = resolve_model("convlm:model_spec", "tiny")
    model = spec.build()
    spec.init_weights(model)
    with torch.no_grad():
        torch.nn.init.normal_(model.blocks[0].conv.weight)
        a = torch.randint(0, 256, (1, 16))
        b = a.clone()
        b[0, 10:] = (b[0, 10:] + 1) % 256
        torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])


@pytest.mark.parametrize("name, flavor, config, message", [
    ("gpt5", "", None, r"expected a built-in \(bytegpt, llama\) or package.module:function"),
    ("pkg.mod:fn:extra", "", None, "expected a built-in"),
    ("no_such_package_xyz.models:build", "", None, "cannot import 'no_such_package_xyz.models'.*trainer image"),
    ("broken_models:missing", "", None, "has no attribute 'missing'"),
    ("broken_models:NOT_CALLABLE", "", None, "is a int, not a function"),
    ("broken_models:returns_a_module", "", None, "returned a Linear, not a trainer.models.ModelSpec"),
    ("broken_models:rejects_its_config", "", '{"width": 1}', "width 1 is too small"),
    ("llama", "llama3-405b", None, "llama has the flavors debug, llama3-1b, llama3-3b, llama3-8b, llama3-70b"),
    ("llama", "", '{"dimension": 64}', "llama has no field.s. dimension; its fields are"),
    ("llama", "", '{"dim": "wide"}', r"wrong type for llama: dim='wide' \(expected int\)"),
    ("llama", "", '{"n_heads": 3}', r"dim \(128\) must be divisible by n_heads \(3\)"),
    ("llama", "", '{"n_kv_heads": 3}', r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
    ("llama", "", '{"dim": 64,', "--model-config is not valid JSON"),
    ("llama", "", "no/such/file.toml", "no such file"),
    ("llama", "", "[1, 2]", "must be a JSON object"),
    ("convlm:model_spec", "", '{"kernel_size": 0}', "every convlm size must be at least 1"),
])
def test_bad_names_and_configs_are_refused_clearly(user_code, name, flavor, config, message):
    with pytest.raises(ModelError, match=message):
        resolve_model(name, flavor, config)


def test_a_config_file_of_the_wrong_shape_is_refused(tmp_path):
    (tmp_path / "list.json").write_text("[1]")
    (tmp_path / "bad.toml").write_text("dim = = 3")
    (tmp_path / "m.yaml").write_text("dim: 3")
    for path, message in (("list.json", "must be a JSON object"), ("bad.toml", "cannot be parsed"),
                          ("m.yaml", "expected a .json or .toml file")):
        with pytest.raises(ModelError, match=message):
            resolve_model("llama", "", str(tmp_path / path))
