"""``--model bytegpt``: a decoder-only transformer over bytes (vocab 256 unless the dataset's tokenizer has
more), and its spec for the model protocol. Parallelism is applied from outside (``trainer.models.parallelize``).

Its weights are initialised by ByteGPT's own constructor, run once on the CPU with the run's seed and
copied in, so a run starts from the same weights as before models were pluggable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from .registry import apply_overrides, pick_flavor
from .spec import ModelSpec, Vocabulary


@dataclass
class ByteGPTConfig:
    """``--model bytegpt``'s fields (``--model-config``; ``--n-layer`` ... ``--dropout`` set them too)."""

    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    seq_len: int = 128
    """positions of the learned position embedding: the longest sequence the model reads"""
    dropout: float = 0.0
    vocab_size: int = 256


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ByteGPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: ByteGPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ByteGPT(nn.Module):
    def __init__(self, cfg: ByteGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of residual projections keeps the residual stream's variance flat with depth.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


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
    """``--model bytegpt``: the ``ByteGPTConfig`` fields as overrides."""
    name, cfg = pick_flavor(FLAVORS, flavor, "default", "bytegpt")
    cfg = apply_overrides(cfg, overrides or {}, "bytegpt")
    if cfg.n_embd % cfg.n_head or min(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len) < 1:
        raise ValueError(f"invalid bytegpt config: n_layer, n_head, n_embd, seq_len must be positive and n_embd "
                         f"({cfg.n_embd}) divisible by n_head ({cfg.n_head})")
    return ModelSpec(name="bytegpt", flavor=name, config=cfg, build=lambda: ByteGPT(cfg), init_weights=_init_weights,
                     vocab=Vocabulary(cfg.vocab_size, "bytes"), max_seq_len=cfg.seq_len,
                     flops_per_token=lambda t: flops_per_token(cfg, t), loss=_loss,
                     blocks=lambda m: list(m.blocks))
