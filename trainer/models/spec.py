"""The model protocol: what a model gives the trainer (``ModelSpec``) and how it is parallelised
(``ParallelPlan``).

The trainer knows a model only through its spec, so checkpoints, restarts, snapshots and goodput work
the same for every model. A spec is made by a function ``fn(flavor: str, overrides: dict) -> ModelSpec``
(``trainer.models.registry``); ``docs/models.md`` walks through writing one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")
PARALLEL_MODES = ("fsdp", "ddp")
PARAM_DTYPES = ("auto", "bfloat16", "float32")


@dataclass(frozen=True)
class ParallelPlan:
    """How a model is spread over the ranks; the trainer fills it from its flags."""

    mode: str = "fsdp"
    """fsdp: FSDP2 ``fully_shard`` per block, then the root; ddp: one replica per rank (small models)."""
    activation_checkpointing: str = "none"
    """none; full: recompute each block in backward; selective: keep matmul and attention outputs,
    recompute the cheap elementwise ops (norms, activations, RoPE)."""
    compile: bool = False
    """``torch.compile`` each block's forward (the module tree and parameter names stay as they are)."""
    param_dtype: str = "auto"
    """FSDP2 compute dtype of parameters: auto = bfloat16 on CUDA (gradients reduced in float32) and
    float32 on CPU, where bfloat16 matmuls are slow; the stored (sharded) parameters stay float32."""

    def __post_init__(self) -> None:
        for name, value, allowed in (("mode", self.mode, PARALLEL_MODES),
                                     ("activation_checkpointing", self.activation_checkpointing,
                                      ACTIVATION_CHECKPOINTING),
                                     ("param_dtype", self.param_dtype, PARAM_DTYPES)):
            if value not in allowed:
                raise ValueError(f"ParallelPlan.{name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a model splits its layers over a tensor-parallel group (``--tp``): optional in a ``ModelSpec``; a
    model without one trains with ``--tp 1`` only."""

    apply: Callable[[nn.Module, Any], None]
    """``apply(model, tp_mesh)``: ``torch.distributed.tensor.parallel.parallelize_module`` on the model's
    modules (on the meta device on GPU, materialised on CPU), before FSDP2 shards the result"""
    problems: Callable[[int, int], list[str]] = lambda tp, seq_len: []
    """``problems(tp, seq_len)``: why this model cannot split ``tp`` ways at that sequence length (heads not
    divisible, ...), each one line saying what to change; checked before any rank starts"""


class HFAdapter(Protocol):
    """Names and config of a model in Hugging Face layout (``trainer.models.hf`` reads and writes it)."""

    def to_hf(self, fqn: str) -> str:
        """Our parameter name -> its name in a Hugging Face checkpoint."""

    def from_hf(self, name: str) -> str | None:
        """A Hugging Face checkpoint name -> ours (None: a name the model does not use)."""

    def hf_config(self, config: Any, dtype: torch.dtype) -> dict:
        """The ``config.json`` of a Hugging Face directory holding this model."""

    def overrides_from_hf(self, hf_config: dict) -> dict:
        """The model-config fields that describe the architecture in a Hugging Face ``config.json``."""


@dataclass(frozen=True)
class Vocabulary:
    """The token ids a model reads: a dataset must be encoded with the same."""

    size: int
    """number of token ids (the embedding rows)"""
    tokenizer: str = "bytes"
    """"bytes": ids are raw bytes (the datasets of ``trainer.data``); "": any tokenizer with ``size`` ids
    (the dataset's, or the one of ``--init-from``); else a Hugging Face tokenizer directory."""


def lm_cross_entropy(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy of a model whose forward maps token ids to logits (batch, seq, vocab)."""
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def _default_blocks(model: nn.Module) -> list[nn.Module]:
    for attr in ("layers", "blocks"):
        blocks = getattr(model, attr, None)
        if isinstance(blocks, (nn.ModuleList, nn.ModuleDict)):
            return list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    raise TypeError(f"{type(model).__name__} has no `layers` or `blocks` ModuleList: give ModelSpec.blocks "
                    f"a function that returns the model's repeated blocks (the FSDP2 sharding units)")


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs from a model.

    ``build`` runs under ``torch.device("meta")``: it allocates nothing, so a 70B model can be planned on
    any host; ``build_model`` then shards (or replicates) it, materialises it with ``to_empty`` and calls
    ``init_weights``.
    """

    name: str
    """how the model was named (``llama``, ``pkg.module:function``): saved with the run"""
    flavor: str
    """the named size it was built from"""
    config: Any
    """the resolved model configuration (a dataclass), saved with the run and in exports"""
    build: Callable[[], nn.Module]
    """construct the module; called on the meta device, so it must not initialise weights itself"""
    init_weights: Callable[[nn.Module], None]
    """fill every parameter and buffer in place, under ``torch.no_grad`` with the run's seed set; it may
    receive FSDP2-sharded parameters (DTensors), so use ``torch.nn.init`` or in-place tensor ops"""
    vocab: Vocabulary
    """the token ids the model reads"""
    max_seq_len: int
    """the longest sequence the model accepts"""
    flops_per_token: Callable[[int], float]
    """training FLOPs (forward + backward) per token at a sequence length, for MFU"""
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] = lm_cross_entropy
    """``loss(model, inputs, targets)``: the mean loss of a batch (model is the parallelised module)"""
    blocks: Callable[[nn.Module], list[nn.Module]] = _default_blocks
    """the repeated blocks: FSDP2 units, activation-checkpointing and compile units"""
    parallelize: Callable[..., nn.Module] | None = None
    """``parallelize(model, plan, dist) -> module`` replacing the default plan (``apply_parallelism``)"""
    tensor_parallel: TensorParallelPlan | None = None
    """the model's tensor-parallel plan (``--tp`` above 1); None: data parallelism only"""
    hf: HFAdapter | None = None
    """Hugging Face names and config (``--init-from``, ``goodput export``); None: not exportable"""
    extra: dict = field(default_factory=dict)
    """anything else the model's own code wants to carry"""

    def tp_problems(self, tp: int, seq_len: int) -> list[str]:
        """Why this model cannot train with ``--tp tp`` (none at tp 1)."""
        if tp <= 1:
            return []
        if self.tensor_parallel is None:
            return [f"--model {self.name} has no tensor-parallel plan (ModelSpec.tensor_parallel): use --tp 1, or "
                    f"give it one (docs/models.md)"]
        return self.tensor_parallel.problems(tp, seq_len)

    def describe(self) -> dict:
        """What identifies the model in a run's config: name, flavor, resolved config."""
        cfg = dataclasses.asdict(self.config) if dataclasses.is_dataclass(self.config) else dict(self.config)
        return {"name": self.name, "flavor": self.flavor, "config": cfg}
