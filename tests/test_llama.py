"""The llama model: published sizes, a sharding plan on the meta device that never allocates the weights,
the parallel plan's options (activation checkpointing, FSDP2, DDP) leaving the math unchanged."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.models import ParallelPlan, build_local, build_meta, build_model, num_params, resolve_model
from trainer.models.llama import Llama, flops_per_token
from trainer.models.parallelize import apply_block_options, apply_parallelism
from trainer.parallel import Dist

# Parameter counts of Meta's published checkpoints (the sums of their safetensors shapes).
PUBLISHED = {"llama3-1b": 1_235_814_400, "llama3-3b": 3_212_749_824, "llama3-8b": 8_030_261_248,
             "llama3-70b": 70_553_706_496}


def spawn_ranks(fn, world_size: int, *args) -> None:
    """Run ``fn(dist, *args)`` on ``world_size`` gloo ranks (spawned processes); a rank's exception fails
    the caller with its traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank_main, args=(world_size, port, fn, args), nprocs=world_size, join=True)


def _rank_main(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK="0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        fn(Dist(rank, world_size, 0, torch.device("cpu")), *args)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("flavor", sorted(PUBLISHED))
def test_flavors_have_the_published_parameter_counts(flavor):
    spec = resolve_model("llama", flavor)
    model = build_meta(spec)
    assert all(p.is_meta for p in model.parameters())
    assert num_params(model) == PUBLISHED[flavor]
    assert spec.flops_per_token(8192) > 6 * (PUBLISHED[flavor] - spec.config.vocab_size * spec.config.dim * 2)


def test_flops_per_token_is_six_per_matmul_weight_plus_attention():
    args = resolve_model("llama", "llama3-8b").config
    matmul = PUBLISHED["llama3-8b"] - args.vocab_size * args.dim - args.dim * (2 * args.n_layers + 1)
    assert flops_per_token(args, 4096) == 6 * matmul + 12 * 32 * 32 * 128 * 4096


def _shard_70b_on_meta(d: Dist, out: Path) -> None:
    import psutil

    spec = resolve_model("llama", "llama3-70b")
    model = apply_parallelism(build_meta(spec), spec, ParallelPlan(mode="fsdp"), d)
    local = [p.to_local() for p in model.parameters()]
    torch.save({"local_bytes": sum(t.numel() * t.element_size() for t in local),
                "all_meta": all(t.is_meta for t in local), "global": num_params(model),
                "rss": psutil.Process().memory_info().rss,
                "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}, out / f"rank{d.rank}.pt")


def test_llama3_70b_shards_on_the_meta_device_into_equal_parts(tmp_path):
    world = 2
    spawn_ranks(_shard_70b_on_meta, world, tmp_path)
    total_bytes = PUBLISHED["llama3-70b"] * 4    # float32 master weights
    for rank in range(world):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["global"] == PUBLISHED["llama3-70b"] and r["sharded"] and r["all_meta"]
        assert r["local_bytes"] == total_bytes // world
        assert r["rss"] < 4 * 1024 ** 3     # the whole model would be 282 GB, a rank's shard 141 GB


def _backward_cost(model: Llama, tokens: torch.Tensor) -> tuple[int, int, torch.Tensor, list[torch.Tensor]]:
    """(matmul FLOPs of backward, RMSNorm forwards run again in backward, loss, gradients)."""
    from torch.utils.flop_counter import FlopCounterMode

    norms = []
    for m in model.modules():
        if type(m).__name__ == "RMSNorm":
            m.register_forward_hook(lambda *_: norms.append(1))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    in_forward = len(norms)
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return flops.get_total_flops(), len(norms) - in_forward, loss.detach(), [p.grad for p in model.parameters()]


def test_activation_checkpointing_recomputes_what_it_says_and_keeps_the_gradients():
    spec = resolve_model("llama", "debug", {"n_layers": 2})
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode in ("none", "selective", "full"):
        model = build_local(spec)
        apply_block_options(spec.blocks(model), ParallelPlan(activation_checkpointing=mode))
        results[mode] = _backward_cost(model, tokens)
        # The plan changes no parameter name: checkpoints and exports do not depend on it.
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in Llama(spec.config).named_parameters()]
    (flops_none, redo_none, *_), (flops_sel, redo_sel, *_), (flops_full, redo_full, *_) = results.values()
    assert redo_none == 0 and redo_sel == redo_full == 2 * 2     # both blocks' two norms run again
    assert flops_sel == flops_none < flops_full                   # selective keeps the matmuls' outputs
    for mode in ("selective", "full"):
        assert torch.equal(results[mode][2], results["none"][2])
        for g, ref in zip(results[mode][3], results["none"][3]):
            torch.testing.assert_close(g, ref, rtol=0, atol=1e-6)


CASES = [("fsdp", False), ("ddp", False), ("fsdp", True)]     # (mode, tied embeddings)


def _train_two_steps(d: Dist, out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    mine = tokens[d.rank::d.world_size]
    for mode, tied in CASES:
        spec = resolve_model("llama", "debug", {"n_layers": 2, "tie_embeddings": tied})
        model = build_model(spec, ParallelPlan(mode=mode), d, seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            spec.loss(model, mine[:, :-1], mine[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if d.rank == 0:
            torch.save(full, out / f"{mode}-{tied}.pt")


def test_two_ranks_train_like_one(tmp_path, process_group):
    """FSDP2 (built on meta, sharded, materialised) and DDP on 2 ranks give the weights that one process
    training on the whole batch gets: the plan shards, and does not change, the model (tied embeddings,
    used by the root's output projection, included)."""
    dist.destroy_process_group()    # the fixture's 1-rank group: the spawned ranks make their own
    try:
        spawn_ranks(_train_two_steps, 2, tmp_path)
    finally:
        dist.init_process_group("gloo")
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    halves = [tokens[0::2], tokens[1::2]]
    for tied in (False, True):
        spec = resolve_model("llama", "debug", {"n_layers": 2, "tie_embeddings": tied})
        model = build_model(spec, ParallelPlan(mode="fsdp"), process_group, seed=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            # The mean of the two ranks' mean losses, as their averaged gradients are.
            sum(spec.loss(model, h[:, :-1], h[:, 1:]) for h in halves).div(2).backward()
            opt.step()
            opt.zero_grad()
        one = {n: p.full_tensor() for n, p in model.named_parameters()}
        for mode, _ in filter(lambda c: c[1] == tied, CASES):
            two = torch.load(tmp_path / f"{mode}-{tied}.pt")
            assert set(one) == set(two)
            for name in one:
                torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-5, msg=f"{mode} {name}")


def test_mfu_uses_the_named_devices_dense_bf16_peak():
    from trainer.models.mfu import device_peak_flops, mfu

    gpu = torch.device("cuda", 0)
    assert device_peak_flops(gpu, "NVIDIA H200") == device_peak_flops(gpu, "NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops(gpu, "NVIDIA H100 PCIe") == 756e12 and device_peak_flops(gpu, "NVIDIA L4") == 121e12
    assert device_peak_flops(torch.device("cpu")) is None and device_peak_flops(gpu, "Some GPU") is None
    spec = resolve_model("llama", "llama3-1b")
    # 40k tokens/s of llama3-1b at 8192 on an H200 is 43% of its peak.
    assert round(mfu(40_000, spec.flops_per_token(8192), 989e12), 2) == 0.43
    assert mfu(40_000, 1.0, None) is None
