"""``--model bytegpt``: the byte-level GPT of ``trainer.model`` behind the model protocol.

Its weights are initialised by ByteGPT's own constructor, run once on the CPU with the run's seed and
copied in, so a run starts from the same weights as before models were pluggable.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from ..model import ByteGPT, ByteGPTConfig
from .registry import apply_overrides, pick_flavor
from .spec import ModelSpec, Vocabulary

FLAVORS = {"default": ByteGPTConfig()}


def _init_weights(model: nn.Module) -> None:
    fresh = ByteGPT(model.cfg)
    # A full state dict into a plain or FSDP2-sharded model: each rank keeps its own slices.
    set_model_state_dict(model, fresh.state_dict(), options=StateDictOptions(full_state_dict=True))


def _loss(model: nn.Module, inputs, targets):
    _, loss = model(inputs, targets)
    return loss


def flops_per_token(cfg: ByteGPTConfig, seq_len: int) -> float:
    """6 per matmul weight (attention, MLP, head) plus attention's 12 * layers * width * seq_len."""
    matmul = cfg.n_layer * (4 * cfg.n_embd ** 2 + 8 * cfg.n_embd ** 2) + cfg.n_embd * cfg.vocab_size
    return 6.0 * matmul + 12.0 * cfg.n_layer * cfg.n_embd * seq_len


def model_spec(flavor: str = "", overrides: dict | None = None) -> ModelSpec:
    """``--model bytegpt``: the ``trainer.model.ByteGPTConfig`` fields as overrides."""
    name, cfg = pick_flavor(FLAVORS, flavor, "default", "bytegpt")
    cfg = apply_overrides(cfg, overrides or {}, "bytegpt")
    if cfg.n_embd % cfg.n_head or min(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len) < 1:
        raise ValueError(f"invalid bytegpt config: n_layer, n_head, n_embd, seq_len must be positive and n_embd "
                         f"({cfg.n_embd}) divisible by n_head ({cfg.n_head})")
    return ModelSpec(name="bytegpt", flavor=name, config=cfg, build=lambda: ByteGPT(cfg), init_weights=_init_weights,
                     vocab=Vocabulary(cfg.vocab_size, "bytes"), max_seq_len=cfg.seq_len,
                     flops_per_token=lambda t: flops_per_token(cfg, t), loss=_loss,
                     blocks=lambda m: list(m.blocks))
