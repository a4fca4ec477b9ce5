"""ConvLM: causal depthwise convolutions and gated MLPs over bytes, behind the trainer's model protocol.

    goodput train --model convlm:model_spec --model-flavor small

``model_spec(flavor, overrides)`` returns a ``trainer.models.ModelSpec``; the trainer builds the module
on the meta device, shards each ``ConvBlock`` with FSDP2 (the default plan finds ``blocks``), then
materialises it and calls ``init_weights``. ``tensor_parallel`` is its plan for ``--tp`` above 1: each
gated MLP split over the tensor-parallel ranks by its hidden width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer.models import ModelSpec, TensorParallelPlan, Vocabulary, apply_overrides, pick_flavor


@dataclass(frozen=True)
class ConvLMConfig:
    dim: int = 128
    """channels"""
    n_layers: int = 4
    """convolution blocks"""
    kernel_size: int = 8
    """bytes each convolution looks back over (the receptive field grows by this per block)"""
    expansion: int = 2
    """gated MLP width as a multiple of dim"""
    vocab_size: int = 256
    """token ids (bytes)"""
    max_seq_len: int = 1024
    """longest sequence accepted"""


FLAVORS = {"tiny": ConvLMConfig(dim=64, n_layers=2), "small": ConvLMConfig()}


class ConvBlock(nn.Module):
    """x + conv(norm(x)), then x + gated MLP(norm(x)); the convolution sees only the past."""

    def __init__(self, cfg: ConvLMConfig):
        super().__init__()
        self.conv_norm = nn.LayerNorm(cfg.dim)
        self.conv = nn.Conv1d(cfg.dim, cfg.dim, cfg.kernel_size, groups=cfg.dim)
        self.mlp_norm = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 2 * cfg.expansion * cfg.dim)
        self.down = nn.Linear(cfg.expansion * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_norm(x).transpose(1, 2)
        # Left padding only: output t depends on inputs t - kernel_size + 1 .. t.
        h = self.conv(F.pad(h, (self.conv.kernel_size[0] - 1, 0)))
        x = x + h.transpose(1, 2)
        # Gate and value interleaved (rows 2i, 2i + 1): a column-wise shard of ``up`` holds whole pairs.
        gate, value = self.up(self.mlp_norm(x)).unflatten(-1, (-1, 2)).unbind(-1)
        return x + self.down(F.silu(gate) * value)


class ConvLM(nn.Module):
    def __init__(self, cfg: ConvLMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(ConvBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.head.weight, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for block in self.blocks:
            # Each kernel starts as a causal moving average, so early layers pass a smoothed signal.
            nn.init.constant_(block.conv.weight, 1.0 / self.cfg.kernel_size)
            nn.init.zeros_(block.conv.bias)
            nn.init.normal_(block.up.weight, std=0.02)
            nn.init.zeros_(block.up.bias)
            nn.init.normal_(block.down.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers))
            nn.init.zeros_(block.down.bias)


def flops_per_token(cfg: ConvLMConfig) -> float:
    """6 per matmul weight and per convolution tap (forward 2, backward 4)."""
    per_block = 3 * cfg.expansion * cfg.dim ** 2 + cfg.dim * cfg.kernel_size
    return 6.0 * (cfg.n_layers * per_block + cfg.dim * cfg.vocab_size)


def tensor_parallel(model: ConvLM, tp_mesh) -> None:
    """Each block's gated MLP split by its hidden width: ``up`` column-wise, ``down`` row-wise (one
    all-reduce per block); the embedding, convolutions, norms and head stay whole on every rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def tensor_parallel_problems(cfg: ConvLMConfig, tp: int, seq_len: int) -> list[str]:
    hidden = cfg.expansion * cfg.dim
    return [f"convlm: expansion x dim ({hidden}) must be a multiple of --tp {tp}"] if hidden % tp else []


def model_spec(flavor: str = "", overrides: dict | None = None) -> ModelSpec:
    """The trainer's entry point: ``--model convlm:model_spec``."""
    name, cfg = pick_flavor(FLAVORS, flavor, "small", "convlm")
    cfg = apply_overrides(cfg, overrides or {}, "convlm")
    if min(cfg.dim, cfg.n_layers, cfg.kernel_size, cfg.expansion, cfg.max_seq_len) < 1:
        raise ValueError(f"every convlm size must be at least 1: {cfg}")
    return ModelSpec(name="convlm", flavor=name, config=cfg, build=lambda: ConvLM(cfg),
                     init_weights=ConvLM.init_weights, vocab=Vocabulary(cfg.vocab_size, "bytes"),
                     max_seq_len=cfg.max_seq_len, flops_per_token=lambda seq_len: flops_per_token(cfg),
                     tensor_parallel=TensorParallelPlan(tensor_parallel,
                                                        lambda tp, seq_len: tensor_parallel_problems(cfg, tp, seq_len)))
