"""Models other than bytegpt through the real trainer (2 CPU ranks, FSDP2, ft_launcher): the recovery layers
recover them exactly, ``--init-from`` starts from Hugging Face weights, and bad models are refused at parse
time."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from components.evaluate.evaluate import run_spec, training_seq_len
from trainer.config import parse_config
from trainer.launch import LaunchConfig

from tests.conftest import GOODPUT, Run

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
COMMON = ["--seq-len", "64", "--batch-size", "8", "--eval-windows", "16", "--log-every", "5"]
STEPS = ["--max-steps", "12", "--ckpt-every", "4"]
FAST_FT = {"step_timeout_s": 4.0, "workload_check_interval_s": 0.5}
MODELS = {
    "llama": ["--model", "llama", "--model-flavor", "debug", "--model-config", '{"n_layers": 2, "dim": 64}'],
    "convlm": ["--model", "convlm:model_spec", "--model-flavor", "tiny"],
}


@pytest.fixture
def convlm_importable(monkeypatch):
    """The example package on the ranks' PYTHONPATH, as if installed in the trainer image."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES / "convlm"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(EXAMPLES / "convlm"))


def _run(out: Path, dataset: Path, args: list[str], max_restarts: int = 0) -> dict:
    run = Run(out, ["--data", str(dataset), *COMMON, "--out", str(out), *STEPS, *args],
              LaunchConfig(nproc_per_node=2, max_restarts=max_restarts, **FAST_FT))
    try:
        assert run.wait() == 0, run.tail()
    finally:
        run.kill()
    return run.summary()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_an_exception_and_a_kill_9_are_recovered_exactly(tmp_path, dataset, convlm_importable, model):
    clean = _run(tmp_path / "clean", dataset, MODELS[model])
    assert clean["steps"] == 12 and clean["faults"] == []
    # Throughput per step; on CPU there is no device peak, so no MFU rather than an invented one.
    steps = [json.loads(line) for line in (tmp_path / "clean" / "events.jsonl").read_text().splitlines()]
    steps = [e for e in steps if e["event"] == "step"]
    assert all(e["tokens_per_s"] > 0 and "mfu" not in e for e in steps)
    assert clean["tokens_per_s_p50"] > 0 and clean["mfu_p50"] is None
    # The run's config.json rebuilds the model evaluate scores, at the training sequence length.
    run_config = json.loads((tmp_path / "clean" / "config.json").read_text())
    spec = run_spec(run_config)
    assert spec.name == MODELS[model][1] and training_seq_len(run_config, spec) == 64

    faulted = _run(tmp_path / "faulted", dataset, [*MODELS[model], "--inject-fault", "exception@3:1",
                                                   "--inject-fault", "kill@9:0"], max_restarts=2)
    assert [(f["kind"], f["layer"]) for f in faulted["faults"]] == [("exception", "inprocess"), ("kill", "injob")]
    assert (faulted["restarts_inprocess"], faulted["restarts_injob"]) == (1, 1)
    assert faulted["params_sha256"] == clean["params_sha256"]


def _hf_llama_dir(path: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                                      rms_norm_eps=1e-5, max_position_embeddings=128, tie_word_embeddings=False,
                                      rope_theta=10000.0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_init_from_a_transformers_directory_trains_from_its_weights_and_exports_them_back(tmp_path, dataset):
    from safetensors.torch import load_file
    import torch

    hf = _hf_llama_dir(tmp_path / "hf")
    # Learning rate 0: every step leaves the weights as loaded, so the export must be the input, tensor for tensor.
    summary = _run(tmp_path / "run", dataset, ["--model", "llama", "--init-from", str(hf), "--lr", "0",
                                               "--max-steps", "2", "--warmup-steps", "1"])
    assert summary["steps"] == 2
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["path"] for e in events if e["event"] == "init_from"] == [str(hf)]
    proc = subprocess.run([*GOODPUT, "export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "export")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ours, theirs = load_file(tmp_path / "export" / "model.safetensors"), load_file(hf / "model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt5"], "expected a built-in"),
    (["--model", "llama", "--model-flavor", "huge"], "llama has the flavors debug"),
    (["--model", "llama", "--n-layer", "3"], "give --model llama its fields with --model-config"),
    (["--model", "llama", "--model-config", '{"n_layer": 3}'], "llama has no field(s) n_layer"),
    (["--model", "llama", "--model-config", '{"vocab_size": 100}'], "has a vocabulary of 256 tokens"),
    (["--model", "llama", "--seq-len", "4096"], "longer than --model llama reads"),
    (["--model", "bytegpt", "--init-from", "."], "no Hugging Face layout"),
])
def test_bad_models_are_refused_when_the_config_is_parsed(dataset, args, message):
    with pytest.raises(ValueError, match="invalid trainer configuration") as e:
        parse_config(["--data", str(dataset), *args])
    assert message in str(e.value)


def test_the_model_vocabulary_follows_the_dataset_unless_pinned(dataset):
    cfg = parse_config(["--data", str(dataset), "--model", "llama", "--model-flavor", "llama3-8b",
                        "--seq-len", "64"])
    assert cfg.model.spec(dataset).vocab.size == 256            # tokenizer-agnostic: the dataset's bytes
    assert parse_config(["--data", str(dataset)]).model.spec(dataset).vocab.size == 256
    pinned = parse_config(["--data", str(dataset), "--model", "llama", "--model-flavor", "llama3-8b",
                           "--model-config", '{"vocab_size": 1000}', "--seq-len", "64"])
    assert pinned.model.spec(dataset).vocab.size == 1000
