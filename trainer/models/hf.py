"""Hugging Face layouts both ways: ``--init-from DIR`` loads a Hugging Face Llama directory
(``config.json`` + ``*.safetensors``, one file or sharded with an index) into our ``llama``;
``export_*`` writes a directory that ``transformers`` loads and vLLM serves.

Loading goes through torch DCP's ``HuggingFaceStorageReader``: each rank asks for its own FSDP2 shards,
and the reader slices exactly those rows out of the memory-mapped safetensors files, so a 70B model is
never read whole by any rank. No q/k permutation is needed: our RoPE uses the rotate-half layout in which
HF stores ``q_proj``/``k_proj`` (see ``trainer.models.llama``).

Export streams a DCP checkpoint one output file at a time (at most ``max_shard_bytes`` in memory), with
no process group, and writes into a temporary directory renamed into place at the end, so a crash leaves
no half-written model directory.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from .. import layout
from ..durable import publish_dir
from .spec import ModelSpec

log = logging.getLogger(__name__)

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10 ** 9     # Hugging Face's own default shard size ("5GB")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "generation_config.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFError(ValueError):
    """A Hugging Face directory that cannot be read into (or written from) this model."""


class LlamaHFAdapter:
    """Our ``llama`` names and config <-> Hugging Face's ``LlamaForCausalLM``."""

    _BLOCK = {"attention.wq.weight": "self_attn.q_proj.weight", "attention.wk.weight": "self_attn.k_proj.weight",
              "attention.wv.weight": "self_attn.v_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
              "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w3.weight": "mlp.up_proj.weight",
              "feed_forward.w2.weight": "mlp.down_proj.weight", "attention_norm.weight": "input_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight"}
    _TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}
    _BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
    _TOP_BACK = {v: k for k, v in _TOP.items()}
    _LAYER = re.compile(r"^(model\.)?layers\.(\d+)\.(.+)$")
    free_fields = ("max_seq_len", "init_std")
    """config fields that may differ from the Hugging Face directory's without changing what the weights mean"""

    def to_hf(self, fqn: str) -> str:
        if fqn in self._TOP:
            return self._TOP[fqn]
        m = self._LAYER.match(fqn)
        if m and m.group(3) in self._BLOCK:
            return f"model.layers.{m.group(2)}.{self._BLOCK[m.group(3)]}"
        raise KeyError(f"{fqn!r} is not a llama parameter")

    def from_hf(self, name: str) -> str | None:
        if name in self._TOP_BACK:
            return self._TOP_BACK[name]
        m = self._LAYER.match(name)
        if m and m.group(1) and m.group(3) in self._BLOCK_BACK:
            return f"layers.{m.group(2)}.{self._BLOCK_BACK[m.group(3)]}"
        return None

    def hf_config(self, args, dtype: torch.dtype) -> dict:
        scaling = None
        if args.rope_scaling_factor:
            scaling = {"rope_type": "llama3", "factor": args.rope_scaling_factor,
                       "low_freq_factor": args.rope_low_freq_factor, "high_freq_factor": args.rope_high_freq_factor,
                       "original_max_position_embeddings": args.rope_original_max_seq_len}
        # The classic keys (rope_theta, rope_scaling, torch_dtype): transformers 4 and 5 and vLLM read them.
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
                "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
                "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads,
                "head_dim": args.head_size, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
                "rope_theta": args.rope_theta, "rope_scaling": scaling, "max_position_embeddings": args.max_seq_len,
                "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "initializer_range": args.init_std,
                "torch_dtype": str(dtype).removeprefix("torch."), "use_cache": True}

    def overrides_from_hf(self, cfg: dict) -> dict:
        if cfg.get("model_type") != "llama":
            raise HFError(f"model_type is {cfg.get('model_type')!r}; only Hugging Face Llama directories "
                          f"(model_type llama) load into --model llama")
        unsupported = [k for k, ok in (("hidden_act", cfg.get("hidden_act", "silu") == "silu"),
                                       ("attention_bias", not cfg.get("attention_bias", False)),
                                       ("mlp_bias", not cfg.get("mlp_bias", False))) if not ok]
        if unsupported:
            raise HFError(f"config.json sets {', '.join(f'{k}={cfg[k]!r}' for k in unsupported)}, which Llama 3 "
                          f"does not use and our llama does not implement")
        # transformers 5 writes rope_parameters (with rope_theta inside); earlier, rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        heads = cfg["num_attention_heads"]
        out = {"dim": cfg["hidden_size"], "n_layers": cfg["num_hidden_layers"], "n_heads": heads,
               "n_kv_heads": cfg.get("num_key_value_heads") or heads, "ffn_dim": cfg["intermediate_size"],
               "vocab_size": cfg["vocab_size"], "norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
               "rope_theta": float(theta), "max_seq_len": cfg.get("max_position_embeddings", 2048),
               "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
               "init_std": float(cfg.get("initializer_range", 0.02)),
               "head_dim": 0 if cfg.get("head_dim") in (None, cfg["hidden_size"] // heads) else cfg["head_dim"],
               "rope_scaling_factor": 0.0}
        if kind == "llama3":
            out.update(rope_scaling_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_seq_len=int(rope["original_max_position_embeddings"]))
        elif kind != "default":
            raise HFError(f"rope type {kind!r} is not supported (Llama 3 uses 'llama3' or none)")
        return out


# ------------------------------------------------------------------------------------------ reading
def read_hf_config(hf_dir: str | Path) -> dict:
    path = Path(hf_dir) / CONFIG
    if not path.is_file():
        raise HFError(f"{hf_dir} is not a Hugging Face model directory: {CONFIG} not found")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"{path} is not valid JSON: {e}") from None


def hf_tensor_shapes(hf_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise HFError(f"{hf_dir} has no *.safetensors files (a PyTorch .bin checkpoint? convert it with "
                      f"transformers' save_pretrained(safe_serialization=True))")
    index = Path(hf_dir) / INDEX
    if index.is_file():
        named = set(json.loads(index.read_text())["weight_map"].values())
        missing = sorted(n for n in named if not (Path(hf_dir) / n).is_file())
        if missing:
            raise HFError(f"{index} names files that are not there: {', '.join(missing)}")
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                shapes[key] = tuple(st.get_slice(key).get_shape())
    return shapes


def spec_for_hf_dir(name: str, hf_dir: str | Path, config: str | dict | None = None) -> ModelSpec:
    """The spec of ``--model NAME --init-from DIR``: the architecture of DIR's ``config.json``, then the
    ``--model-config`` overrides (for the fields that do not change the weights, like ``max_seq_len``)."""
    from .registry import load_model_config, resolve_model

    adapter = resolve_model(name).hf
    if adapter is None:
        raise HFError(f"--model {name} has no Hugging Face layout (its spec sets no `hf` adapter); --init-from "
                      f"works with llama")
    return resolve_model(name, "", {**adapter.overrides_from_hf(read_hf_config(hf_dir)), **load_model_config(config)})


def check_hf_dir(spec: ModelSpec, hf_dir: str | Path, names: Iterable[str]) -> None:
    """Raise HFError when DIR's config or tensors do not match the model (before anything is read)."""
    if spec.hf is None:
        raise HFError(f"--model {spec.name} has no Hugging Face layout; --init-from works with llama")
    theirs = spec.hf.overrides_from_hf(read_hf_config(hf_dir))
    ours = asdict(spec.config)
    diff = [f"{k}: ours {ours[k]!r}, {hf_dir} {v!r}" for k, v in theirs.items()
            if k not in getattr(spec.hf, "free_fields", ()) and ours.get(k) != v]
    if diff:
        raise HFError(f"{hf_dir} holds a different architecture than the model to train: " + "; ".join(diff))
    shapes = hf_tensor_shapes(hf_dir)
    missing = sorted(spec.hf.to_hf(n) for n in names if spec.hf.to_hf(n) not in shapes)
    if missing:
        raise HFError(f"{hf_dir} lacks tensors the model needs: {', '.join(missing[:5])}"
                      + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_hf_weights(model: nn.Module, spec: ModelSpec, hf_dir: str | Path) -> None:
    """Overwrite ``model``'s weights (plain, DDP or FSDP2-sharded) with those of a Hugging Face directory.

    Collective when a process group is initialised: every rank calls it and reads only its own shards.
    Tensors are converted to the model's dtype.
    """
    state = get_model_state_dict(model)
    check_hf_dir(spec, hf_dir, state)
    wanted = {spec.hf.to_hf(n): t for n, t in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")   # no_dist is the intent
        dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(hf_dir)),
                 no_dist=not dist.is_initialized())
    # The state dict's tensors need not be the parameters' own memory (DCP loaded into them): set them.
    set_model_state_dict(model, {n: wanted[spec.hf.to_hf(n)] for n in state})


# ------------------------------------------------------------------------------------------ writing
def _shard_groups(entries: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names packed into files of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, nbytes in entries:
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _copy_tokenizer(tokenizer_dir: Path, out: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, out / name)
            copied.append(name)
    if not copied:
        raise HFError(f"{tokenizer_dir} holds none of the tokenizer files {', '.join(TOKENIZER_FILES)}")
    return copied


def _write_hf_dir(spec: ModelSpec, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                  load: Callable[[list[str]], dict[str, torch.Tensor]], out_dir: str | Path, dtype: str | None,
                  max_shard_bytes: int, tokenizer_dir: str | Path | None, overwrite: bool,
                  progress: Callable[[str], None]) -> Path:
    from safetensors.torch import save_file

    if spec.hf is None:
        raise HFError(f"--model {spec.name} has no Hugging Face layout (its spec sets no `hf` adapter); "
                      f"export works with llama")
    if dtype is not None and dtype not in _DTYPES:
        raise HFError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if max_shard_bytes < 1:
        raise HFError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise HFError(f"{out} exists and is not empty; choose another directory or overwrite it")
    cast = _DTYPES[dtype] if dtype else None
    sized = [(n, int(torch.Size(s).numel()) * (cast or d).itemsize) for n, s, d in entries]
    groups = _shard_groups(sized, max_shard_bytes)
    files = [SINGLE_FILE] if len(groups) == 1 else \
        [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weight_map = {}
    for file, names in zip(files, groups):
        tensors = {spec.hf.to_hf(n): (t.to(cast) if cast else t).contiguous() for n, t in load(names).items()}
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        progress(f"wrote {file} ({len(tensors)} tensors)")
    if len(files) > 1:
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": sum(b for _, b in sized)},
                                             "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    (tmp / CONFIG).write_text(json.dumps(spec.hf.hf_config(spec.config, cast or entries[0][2]), indent=2))
    if tokenizer_dir is not None:
        progress(f"copied {', '.join(_copy_tokenizer(Path(tokenizer_dir), tmp))}")
    publish_dir(tmp, out)
    return out


def export_state_dict(state_dict: dict[str, torch.Tensor], spec: ModelSpec, out_dir: str | Path, *,
                      dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      tokenizer_dir: str | Path | None = None, overwrite: bool = False,
                      progress: Callable[[str], None] = log.info) -> Path:
    """Write a full (unsharded) state dict with our names as a Hugging Face directory.

    Args:
        state_dict: parameter name -> tensor, as ``model.state_dict()`` of the spec's model.
        spec: the model's spec (its ``hf`` adapter names the tensors and writes ``config.json``).
        out_dir: the directory to create; it must not exist or be empty unless ``overwrite``.
        dtype: float32, bfloat16 or float16 (None: each tensor as stored).
        max_shard_bytes: above this, tensors go into several files with ``model.safetensors.index.json``.
        tokenizer_dir: a directory whose tokenizer files are copied in.
        overwrite: replace an existing directory (atomically: the old one is removed after the new is in place).
    """
    entries = [(n, tuple(t.shape), t.dtype) for n, t in state_dict.items()]
    return _write_hf_dir(spec, entries, lambda names: {n: state_dict[n] for n in names}, out_dir, dtype,
                         max_shard_bytes, tokenizer_dir, overwrite, progress)


def export_checkpoint(checkpoint_dir: str | Path, spec: ModelSpec, out_dir: str | Path, *,
                      dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                      tokenizer_dir: str | Path | None = None, overwrite: bool = False,
                      progress: Callable[[str], None] = log.info) -> Path:
    """Write the ``model.*`` weights of a DCP checkpoint directory (any world size, FSDP2 or DDP) as a
    Hugging Face directory, one output file in memory at a time and without a process group. Arguments
    as ``export_state_dict``. The checkpoint's bytes are verified against the checksums its commit recorded
    first: ``HFError`` unless they are the bytes that were staged."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..checkpoint.integrity import ChecksumMismatch, verify_files

    try:
        verify_files(Path(checkpoint_dir))
    except ChecksumMismatch as e:
        raise HFError(f"{checkpoint_dir} is not exported: {e}") from None
    meta = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata().state_dict_metadata
    entries = [(k[len("model."):], tuple(m.size), m.properties.dtype) for k, m in meta.items()
               if k.startswith("model.") and isinstance(m, TensorStorageMetadata)]
    if not entries:
        raise HFError(f"{checkpoint_dir} holds no model.* tensors: not a checkpoint of `goodput train`")

    def load(names: list[str]) -> dict[str, torch.Tensor]:
        shapes = {n: (s, d) for n, s, d in entries}
        state = {"model": {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}}
        # Only these names are requested: DCP reads them and leaves the rest (and the optimizer) on disk.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
        return state["model"]

    return _write_hf_dir(spec, entries, load, out_dir, dtype, max_shard_bytes, tokenizer_dir, overwrite, progress)


def dataset_tokenizer(data_dir: str | Path) -> Path | None:
    """The tokenizer files staged with a dataset (``DATA/tokenizer/`` or ``DATA/``), if any."""
    for candidate in (Path(data_dir) / "tokenizer", Path(data_dir)):
        if any((candidate / f).is_file() for f in TOKENIZER_FILES):
            return candidate
    return None


def _dataset_tokenizer(run_config: dict) -> Path | None:
    """The tokenizer files staged with the run's dataset, if any."""
    data = run_config.get("data", {}).get("data")
    return dataset_tokenizer(data) if data else None


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str | None = None,
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, tokenizer_dir: str | Path | None = None,
               overwrite: bool = False, progress: Callable[[str], None] = log.info) -> Path:
    """``goodput export``: a committed checkpoint of a run (the newest, or ``step``) as a Hugging Face directory.

    The model is the one the run's ``config.json`` names; the tokenizer files come from ``tokenizer_dir``,
    else from the run's dataset when it has them.
    """
    from ..layout import committed_steps, step_dir
    from .registry import spec_from_run_config

    run_dir = Path(run_dir)
    config_path = layout.config_path(run_dir)
    if not config_path.is_file():
        raise HFError(f"{config_path} not found: {run_dir} is not a run directory of `goodput train`")
    run_config = json.loads(config_path.read_text())
    spec = spec_from_run_config(run_config)
    if spec.hf is None:
        raise HFError(f"the run trained {spec.name!r}, which has no Hugging Face layout (its spec sets no `hf` "
                      f"adapter); export works with llama")
    steps = committed_steps(layout.checkpoints_dir(run_dir))
    if not steps:
        raise HFError(f"no committed checkpoint under {layout.checkpoints_dir(run_dir)}")
    if step is not None and step not in steps:
        raise HFError(f"step {step} has no committed checkpoint in {run_dir}; committed: "
                      f"{', '.join(map(str, steps[-10:]))}")
    chosen = step if step is not None else steps[-1]
    progress(f"exporting step {chosen} of {run_dir} ({spec.name} {spec.flavor}) to {out_dir}")
    tokenizer = Path(tokenizer_dir) if tokenizer_dir else _dataset_tokenizer(run_config)
    return export_checkpoint(step_dir(layout.checkpoints_dir(run_dir), chosen), spec, out_dir, dtype=dtype,
                             max_shard_bytes=max_shard_bytes, tokenizer_dir=tokenizer, overwrite=overwrite,
                             progress=progress)
