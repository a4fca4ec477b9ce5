"""Hugging Face layouts both ways, with ``transformers`` as the reference: its Llama loads into ours and
gives the same logits (one process, and sharded over 2 FSDP2 ranks), our exports are tensor-for-tensor
what we wrote and ``transformers`` reads them into a model with our logits; ``goodput export`` turns a
committed DCP checkpoint into such a directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pipelines.cli.export import export
from trainer.layout import step_dir
from trainer.models import ParallelPlan, build_local, build_meta, build_model, resolve_model
from trainer.models.hf import INDEX, HFError, export_state_dict, load_hf_weights, spec_for_hf_dir
from trainer.parallel import Dist

from .committed import save_committed
from .test_llama import spawn_ranks

transformers = pytest.importorskip("transformers")
# The test writes its checkpoints in one process, as evaluate and export read them.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

TOKENS = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(7))


def hf_model(tied: bool) -> "transformers.LlamaForCausalLM":
    """A small random Llama with every feature ours must match: GQA, Llama 3.1 RoPE scaling (with an
    original context shorter than the test sequence, so all three frequency bands occur), random norms."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=100, rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=tied,
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


@pytest.fixture(params=[False, True], ids=["untied", "tied"])
def hf_dir(request, tmp_path) -> tuple[Path, torch.Tensor]:
    """(a sharded Hugging Face directory saved by transformers, its logits on TOKENS)."""
    model = hf_model(request.param)
    path = tmp_path / "hf"
    model.save_pretrained(path, max_shard_size="60KB")
    assert (path / INDEX).is_file()
    with torch.no_grad():
        return path, model(TOKENS).logits


def ours_from(hf_path: Path, seed: int = 1):
    spec = spec_for_hf_dir("llama", hf_path)
    return spec, build_local(spec, seed=seed)


def test_transformers_llama_loads_into_ours_with_the_same_logits(hf_dir):
    path, reference = hf_dir
    spec, model = ours_from(path)
    before = model(TOKENS).detach()
    load_hf_weights(model, spec, path)
    with torch.no_grad():
        logits = model(TOKENS)
    assert not torch.allclose(before, reference, atol=1e-3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def _load_sharded(d: Dist, hf_path: Path, out: Path) -> None:
    spec = spec_for_hf_dir("llama", hf_path)
    model = build_model(spec, ParallelPlan(mode="fsdp"), d, seed=1)
    load_hf_weights(model, spec, hf_path)
    with torch.no_grad():
        logits = model(TOKENS)
    torch.save({"logits": logits, "wq0": model.layers[0].attention.wq.weight.to_local().clone()},
               out / f"rank{d.rank}.pt")


def test_two_fsdp2_ranks_each_load_their_shards_of_a_transformers_llama(tmp_path):
    model = hf_model(tied=False)
    model.save_pretrained(tmp_path / "hf", max_shard_size="60KB")
    with torch.no_grad():
        reference = model(TOKENS).logits
    spawn_ranks(_load_sharded, 2, tmp_path / "hf", tmp_path)
    q = model.model.layers[0].self_attn.q_proj.weight.detach()
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(r["logits"], reference, rtol=0, atol=1e-5)
        assert torch.equal(r["wq0"], q.chunk(2)[rank])    # this rank's rows, and only those


def test_export_round_trips_exactly_and_transformers_gives_our_logits(tmp_path):
    spec = resolve_model("llama", "debug", {"dim": 64, "n_layers": 2, "ffn_dim": 96, "max_seq_len": 128,
                                            "rope_scaling_factor": 8.0, "rope_original_max_seq_len": 16})
    model = build_local(spec)
    state = model.state_dict()
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    out = export_state_dict(state, spec, tmp_path / "export", max_shard_bytes=100_000, tokenizer_dir=tmp_path / "tok")
    assert (out / INDEX).is_file() and (out / "tokenizer.json").is_file()
    assert not (tmp_path / ".export.partial").exists()

    back_spec, back = ours_from(out, seed=5)
    assert back_spec.config == spec.config
    load_hf_weights(back, back_spec, out)
    assert back.state_dict().keys() == state.keys()
    for name, t in back.state_dict().items():
        assert torch.equal(t, state[name]), name

    hf = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=0, atol=1e-5)


def test_export_refuses_to_write_over_a_model_directory(tmp_path):
    spec = resolve_model("llama", "debug", {"dim": 32, "n_layers": 1, "ffn_dim": 32})
    state = {n: torch.zeros(p.shape) for n, p in build_meta(spec).state_dict().items()}
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(HFError, match="not empty"):
        export_state_dict(state, spec, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").is_file()
    export_state_dict(state, spec, tmp_path / "out", overwrite=True, dtype="bfloat16")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not (tmp_path / "out" / "keep.txt").exists() and config["torch_dtype"] == "bfloat16"


def test_init_from_refuses_a_different_architecture(tmp_path):
    hf_model(tied=False).save_pretrained(tmp_path / "hf")
    spec = resolve_model("llama", "debug")
    model = build_local(spec)
    with pytest.raises(HFError, match=r"different architecture.*dim: ours 128.* 64"):
        load_hf_weights(model, spec, tmp_path / "hf")
    with pytest.raises(HFError, match="config.json not found"):
        spec_for_hf_dir("llama", tmp_path)


def _committed_run(tmp_path: Path, spec, state: dict, steps: list[int]) -> Path:
    """A run directory as `goodput train` leaves it: config.json and committed DCP checkpoints."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": spec.describe(), "data": {"data": str(tmp_path / "data")}}))
    for step in steps:
        path = step_dir(run / "checkpoints", step)
        scaled = {n: t * step for n, t in state.items()}
        save_committed(path, {"model": scaled, "optim": {"m": torch.ones(3)}}, step)
    return run


def test_goodput_export_writes_a_committed_checkpoint_that_transformers_loads(tmp_path):
    spec = resolve_model("llama", "debug", {"dim": 64, "n_layers": 2, "ffn_dim": 96})
    model = build_local(spec)
    state = model.state_dict()
    run = _committed_run(tmp_path, spec, state, [2, 4])
    (tmp_path / "data" / "tokenizer").mkdir(parents=True)
    (tmp_path / "data" / "tokenizer" / "tokenizer_config.json").write_text("{}")

    result = CliRunner().invoke(export, ["--run", str(run), "--step", "2", "--out", str(tmp_path / "hf"),
                                         "--max-shard-size", "0.0002"])
    assert result.exit_code == 0, result.output
    assert "step 2" in result.output and (tmp_path / "hf" / INDEX).is_file()
    assert (tmp_path / "hf" / "tokenizer_config.json").is_file()   # the dataset's tokenizer came along
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    hf_state = hf.state_dict()
    for name, t in state.items():
        assert torch.equal(hf_state[spec.hf.to_hf(name)], t * 2), name

    newest = CliRunner().invoke(export, ["--run", str(run), "--out", str(tmp_path / "hf4")])
    assert newest.exit_code == 0 and "step 4" in newest.output
    missing = CliRunner().invoke(export, ["--run", str(run), "--step", "3", "--out", str(tmp_path / "x")])
    assert missing.exit_code != 0 and "step 3 has no committed checkpoint" in missing.output
    assert not (tmp_path / "x").exists()


def test_goodput_export_explains_a_model_without_a_hugging_face_layout(tmp_path):
    spec = resolve_model("bytegpt")
    run = _committed_run(tmp_path, spec, {"head.weight": torch.ones(2, 2)}, [1])
    result = CliRunner().invoke(export, ["--run", str(run), "--out", str(tmp_path / "hf")])
    assert result.exit_code != 0 and "no Hugging Face layout" in result.output
