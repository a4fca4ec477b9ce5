"""Build a spec's model for a parallel mode, scale-correct (torchtitan's ``parallelize`` pattern):
construct on the meta device, apply the plan (activation checkpointing, compile, FSDP2 or DDP), then
materialise with ``to_empty`` and initialise.

    model = build_model(spec, ParallelPlan(mode="fsdp", activation_checkpointing="selective"), dist, seed=0)

Weights are never whole on one GPU: on CUDA the model is sharded first and initialised shard by shard
(DTensor's random ops give each shard its own part of one stream). On CPU, DTensor's random ops fill
every shard from the same numbers, so the model is materialised and initialised whole, then sharded:
the same weights for any world size, as the trainer did before models were pluggable.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .. import compat
from ..parallel import Dist
from .spec import ModelSpec, ParallelPlan

# Outputs that selective checkpointing keeps: the expensive ops. Everything else in a block (norms,
# activations, RoPE, residual adds) is recomputed in backward.
_SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
             *compat.attention_ops()}


def _save_expensive(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, selective: bool):
    context_fn = functools.partial(create_selective_checkpoint_contexts, _save_expensive) if selective else None

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return run


def apply_block_options(blocks: list[nn.Module], plan: ParallelPlan) -> None:
    """Activation checkpointing and ``torch.compile`` per block.

    Both replace the block's ``forward`` rather than wrapping the module, so parameter names (the keys
    of checkpoints and of Hugging Face exports) do not depend on the plan, and FSDP2's hooks, which run
    around ``forward``, stay outside the recomputed and the compiled region.
    """
    for block in blocks:
        forward = block.forward
        if plan.compile:
            forward = torch.compile(forward)
        if plan.activation_checkpointing != "none":
            forward = _checkpointed(forward, plan.activation_checkpointing == "selective")
        if forward is not block.forward:
            block.forward = forward


def mixed_precision(plan: ParallelPlan, device: torch.device) -> MixedPrecisionPolicy:
    """bfloat16 compute with float32 gradient reduction on GPU; float32 throughout on CPU (``auto``)."""
    dtype = plan.param_dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "bfloat16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_parallelism(model: nn.Module, spec: ModelSpec, plan: ParallelPlan, dist: Dist) -> nn.Module:
    """The spec's own ``parallelize`` if it has one, else the default plan: the spec's tensor-parallel plan
    on the mesh's ``tp`` dimension (``dist.tp`` above 1), block options, then FSDP2 ``fully_shard`` per block
    and the root over the data-parallel dimensions (``fsdp``: one shard group, or HSDP's replicas of shard
    groups) or ``DistributedDataParallel`` (``ddp``)."""
    if spec.parallelize is not None:
        return spec.parallelize(model, plan, dist)
    if dist.tp > 1:
        if spec.tensor_parallel is None:
            raise ValueError(spec.tp_problems(dist.tp, 0)[0])
        spec.tensor_parallel.apply(model, dist.tp_mesh)
    blocks = spec.blocks(model)
    apply_block_options(blocks, plan)
    if plan.mode == "ddp":
        return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    mp = mixed_precision(plan, dist.device)
    mesh = dist.dp_mesh   # None: every rank
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again first in backward: keeping them skips a gather.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    return model


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose parameters live on different meshes: a tensor
    -parallel plan that leaves some modules whole (their parameters sharded by FSDP2 alone) gives DTensors of
    two meshes, whose norms DTensor cannot stack. The norm of each mesh's gradients is made whole first, and
    the total is the norm of those. One mesh (no tensor parallelism) is torch's own computation."""
    params = [p for p in model.parameters() if p.grad is not None]
    groups: dict = {}
    for p in params:
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups.values()]
    total = torch.nn.utils.get_total_norm([n.full_tensor() if isinstance(n, DTensor) else n for n in norms])
    for group in groups.values():   # one foreach op per mesh: DTensor refuses to mix them in one
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def build_meta(spec: ModelSpec) -> nn.Module:
    """The spec's module on the meta device: shapes and structure, no memory."""
    with torch.device("meta"):
        return spec.build()


def init_materialized(model: nn.Module, spec: ModelSpec, seed: int) -> None:
    """Run the spec's ``init_weights`` with the seed set, as every rank must (same seed everywhere)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        spec.init_weights(model)


def build_local(spec: ModelSpec, device: torch.device | str = "cpu", seed: int = 0) -> nn.Module:
    """The spec's model whole on one device, initialised, with no process group (evaluate, export, tests).
    Load weights into it afterwards: ``dcp.load(..., no_dist=True)`` or ``hf.load_hf_weights``."""
    model = build_meta(spec)
    model.to_empty(device=device)
    init_materialized(model, spec, seed)
    return model


def build_model(spec: ModelSpec, plan: ParallelPlan, dist: Dist, seed: int) -> nn.Module:
    """Build, parallelise, materialise on ``dist.device`` and initialise the spec's model.

    Collective when ``plan.mode`` is ddp (DDP broadcasts rank 0's weights). Returns the module to train:
    the FSDP2-sharded model itself, or its DDP wrapper.
    """
    if dist.device.type == "cuda" and plan.mode == "fsdp":
        model = apply_parallelism(build_meta(spec), spec, plan, dist)
        model.to_empty(device=dist.device)
        init_materialized(model, spec, seed)
        return model
    return apply_parallelism(build_local(spec, dist.device, seed), spec, plan, dist)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (FSDP2 does not wrap)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def num_params(model: nn.Module) -> int:
    """Parameters of the whole model (sharded or not, meta or not), each shared one counted once."""
    # A DTensor's numel is that of the whole tensor, not of this rank's shard.
    return sum(p.numel() for p in unwrap(model).parameters())
