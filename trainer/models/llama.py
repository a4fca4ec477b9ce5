"""Llama 3: RMSNorm, rotary embeddings (``rope_theta``, Llama 3.1 frequency scaling), SwiGLU MLP,
grouped-query attention, tied or untied embeddings. Only the model and its tensor-parallel plan live here;
FSDP2 is applied from outside (``trainer.models.parallelize``), per ``TransformerBlock`` then the root.

RoPE rotates the two halves of each head (``rotate_half``), the layout in which Hugging Face stores
Llama's ``q_proj``/``k_proj`` rows, so HF checkpoints load without the row permutation that Meta's
interleaved-pair layout needs (``trainer.models.hf``), and a rank reading its FSDP2 shard of a
projection reads exactly those rows from the file.

Flavors carry the published hyperparameters (Meta's ``config.json`` of each model); ``debug`` is sized
for 2 CPU cores and reads bytes (vocabulary 256), like ``bytegpt``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .registry import apply_overrides, pick_flavor
from .spec import ModelSpec, TensorParallelPlan, Vocabulary


@dataclass(frozen=True)
class LlamaArgs:
    dim: int = 128
    """model width (hidden size)"""
    n_layers: int = 4
    """transformer blocks"""
    n_heads: int = 4
    """query heads"""
    n_kv_heads: int = 2
    """key/value heads (grouped-query attention: n_heads / n_kv_heads queries share one)"""
    head_dim: int = 0
    """width of one head (0 = dim / n_heads)"""
    ffn_dim: int = 384
    """SwiGLU hidden width (Hugging Face's intermediate_size)"""
    vocab_size: int = 256
    """token ids (256: bytes)"""
    norm_eps: float = 1e-5
    """RMSNorm epsilon"""
    rope_theta: float = 500000.0
    """RoPE base"""
    rope_scaling_factor: float = 0.0
    """Llama 3.1 frequency scaling: factor by which long wavelengths are stretched (0 = off)"""
    rope_low_freq_factor: float = 1.0
    """Llama 3.1 scaling: wavelengths above original_max_seq_len / this are scaled fully"""
    rope_high_freq_factor: float = 4.0
    """Llama 3.1 scaling: wavelengths below original_max_seq_len / this are kept"""
    rope_original_max_seq_len: int = 8192
    """Llama 3.1 scaling: the context length the model was pretrained with"""
    max_seq_len: int = 2048
    """longest sequence (the rotary table's length)"""
    tie_embeddings: bool = False
    """the output projection reuses the token embedding"""
    init_std: float = 0.02
    """standard deviation of the weights' (truncated) normal initialisation"""

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    def problems(self) -> list[str]:
        out = [f"{k} must be at least 1, got {getattr(self, k)}"
               for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len")
               if getattr(self, k) < 1]
        if not out:
            if not self.head_dim and self.dim % self.n_heads:
                out.append(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}), or set head_dim")
            if self.n_heads % self.n_kv_heads:
                out.append(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
            if self.head_size % 2:
                out.append(f"the head width ({self.head_size}) must be even for rotary embeddings")
        if self.rope_scaling_factor and not self.rope_high_freq_factor > self.rope_low_freq_factor > 0:
            out.append("rope scaling needs rope_high_freq_factor > rope_low_freq_factor > 0")
        if self.rope_scaling_factor < 0 or self.rope_theta <= 0 or self.norm_eps <= 0:
            out.append("rope_scaling_factor must not be negative, rope_theta and norm_eps must be positive")
        return out


_LLAMA31_SCALING = dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_seq_len=8192,
                        max_seq_len=131072, rope_theta=500000.0, norm_eps=1e-5, vocab_size=128256)
FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(),
    # Llama 3.2 1B and 3B: tied embeddings, 32x frequency scaling.
    "llama3-1b": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                           rope_scaling_factor=32.0, **_LLAMA31_SCALING),
    "llama3-3b": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192, tie_embeddings=True,
                           rope_scaling_factor=32.0, **_LLAMA31_SCALING),
    # Llama 3.1 8B and 70B: untied, 8x frequency scaling.
    "llama3-8b": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                           rope_scaling_factor=8.0, **_LLAMA31_SCALING),
    "llama3-70b": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                            rope_scaling_factor=8.0, **_LLAMA31_SCALING),
}


def rope_frequencies(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies of the head's rotary pairs (float32), with Llama 3.1's scaling: wavelengths
    longer than the pretraining context / low_freq_factor are stretched by the factor, shorter than
    context / high_freq_factor kept, and those between blended smoothly."""
    d = args.head_size
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    if not args.rope_scaling_factor:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    ctx, low, high = args.rope_original_max_seq_len, args.rope_low_freq_factor, args.rope_high_freq_factor
    smooth = ((ctx / wavelen - low) / (high - low)).clamp(0, 1)
    blended = (1 - smooth) * inv_freq / args.rope_scaling_factor + smooth * inv_freq
    return torch.where(wavelen > ctx / low, inv_freq / args.rope_scaling_factor,
                       torch.where(wavelen < ctx / high, inv_freq, blended))


def rotary_table(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """(2, max_seq_len, head_dim): cos and sin of every position's angle, each half of the head repeated."""
    pos = torch.arange(args.max_seq_len, dtype=torch.int64, device=device).float()
    angles = torch.outer(pos, rope_frequencies(args, device))
    angles = torch.cat((angles, angles), dim=-1)
    return torch.stack((angles.cos(), angles.sin()))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by the angles: pairs are (i, i + head_dim / 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in float32 whatever the compute dtype, as Llama's reference does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_size
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them (and n_kv_heads / tp).
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rope[0, :t].to(x.dtype), rope[1, :t].to(x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Each key/value head serves n_heads / n_kv_heads query heads.
            k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab_size)."""

    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from the config, so not saved: a checkpoint holds only weights.
        self.register_buffer("rope", torch.empty(2, args.max_seq_len, args.head_size), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        h = self.norm(h)
        if self.output is not None:
            return self.output(h)
        logits = F.linear(h, self.tok_embeddings.weight)
        # Tensor-parallel: the tied weight is split over the vocabulary, so are these logits; gathered whole.
        return logits.full_tensor() if isinstance(logits, DTensor) else logits

    @torch.no_grad()
    def init_weights(self) -> None:
        """Truncated-normal matrices (the projections that write to the residual stream scaled down with
        depth, GPT-2 style), unit norms, and the rotary table. Works on FSDP2-sharded parameters."""
        std, depth_std = self.args.init_std, self.args.init_std / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=1.0 if self.output is not None else std)
        for layer in self.layers:
            for norm in (layer.attention_norm, layer.ffn_norm):
                nn.init.ones_(norm.weight)
            for w in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                nn.init.trunc_normal_(w.weight, std=std, a=-2 * std, b=2 * std)
            for w in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(w.weight, std=depth_std, a=-2 * depth_std, b=2 * depth_std)
        nn.init.ones_(self.norm.weight)
        if self.output is not None:
            bound = 3 / math.sqrt(self.args.dim)
            nn.init.trunc_normal_(self.output.weight, std=1 / math.sqrt(self.args.dim), a=-bound, b=bound)
        self.rope.copy_(rotary_table(self.args, self.rope.device))


def num_params(args: LlamaArgs) -> int:
    """Parameters of a Llama with these args, counted from the shapes."""
    hd = args.head_size
    attn = args.dim * hd * (2 * args.n_heads + 2 * args.n_kv_heads)
    block = attn + 3 * args.dim * args.ffn_dim + 2 * args.dim
    emb = args.vocab_size * args.dim
    return args.n_layers * block + emb * (1 if args.tie_embeddings else 2) + args.dim


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matmul (forward 2, backward 4; the output
    projection counted even when tied, the embedding lookup not) plus attention's scores and values,
    12 * layers * heads * head_dim * seq_len (PaLM's appendix B, torchtitan's convention)."""
    matmul_weights = num_params(args) - args.vocab_size * args.dim * (0 if args.tie_embeddings else 1) \
        - args.dim * (2 * args.n_layers + 1)
    return 6.0 * matmul_weights + 12.0 * args.n_layers * args.n_heads * args.head_size * seq_len


def tensor_parallel(model: Llama, tp_mesh) -> None:
    """Megatron-style tensor parallelism with sequence-parallel norms (torchtitan's plan): the embedding's
    rows and the output's columns split over the vocabulary, attention by heads (wq, wk, wv column-wise,
    wo row-wise), SwiGLU by its hidden width (w1, w3 column-wise, w2 row-wise). Between the blocks the
    residual stream is split along the sequence (``Shard(1)``), so the norms run on 1/tp of the tokens; it
    is gathered before each attention and MLP, and the row-wise projections reduce-scatter back into it.
    The logits are gathered whole, so the loss is the one of ``--tp 1``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Tied embeddings: the output is the embedding's weight, already split over the vocabulary.
        **({} if model.output is None else
           {"output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def tensor_parallel_problems(args: LlamaArgs, tp: int, seq_len: int) -> list[str]:
    out = [f"llama: {what} ({n}) must be a multiple of --tp {tp} ({why})" for what, n, why in (
        ("n_kv_heads", args.n_kv_heads, "each rank keeps whole key/value heads"),
        ("ffn_dim", args.ffn_dim, "the MLP splits its hidden width"),
        ("vocab_size", args.vocab_size, "the embedding and output split the vocabulary"),
        ("--seq-len", seq_len, "the norms split the sequence")) if n % tp]
    return out


def model_spec(flavor: str = "", overrides: dict | None = None) -> ModelSpec:
    """``--model llama``: a flavor (default ``debug``) with ``--model-config`` overrides."""
    from .hf import LlamaHFAdapter

    name, args = pick_flavor(FLAVORS, flavor, "debug", "llama")
    args = apply_overrides(args, overrides or {}, "llama")
    problems = args.problems()
    if problems:
        raise ValueError("invalid llama config: " + "; ".join(problems))
    return ModelSpec(name="llama", flavor=name, config=args, build=lambda: Llama(args),
                     init_weights=Llama.init_weights,
                     vocab=Vocabulary(args.vocab_size, "bytes" if args.vocab_size == 256 else ""),
                     max_seq_len=args.max_seq_len, flops_per_token=lambda t: flops_per_token(args, t),
                     blocks=lambda m: list(m.layers), hf=LlamaHFAdapter(),
                     tensor_parallel=TensorParallelPlan(
                         tensor_parallel, lambda tp, seq_len: tensor_parallel_problems(args, tp, seq_len)))
