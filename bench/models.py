"""Step time of our ``llama`` against ``transformers``' ``LlamaForCausalLM``: the same config, the same
weights, the same FSDP2 wrapping (``fully_shard`` per decoder layer, then the root), the same batches and
loss, on 2 CPU ranks (gloo), side by side in one run. With ``--against tp``: our llama with FSDP2 over the
2 ranks (tp=1) against the same model split by its tensor-parallel plan over them (mesh 1x1x2), at the same
global batch (tp=1: ``--batch`` per rank; tp=2: both ranks' batches, which the pair reads together).

Each rank alternates blocks of steps between the two models (forward, backward, AdamW), so a change in
the host's load hits both; the figure is the median step time of each and their ratio (goal: ours <= 1.0x).
Both models start from our weights and must give the same first loss, which is checked.

    python bench/models.py                               # llama debug, ~1 minute on 2 cores
    python bench/models.py --config '{"n_layers": 8, "dim": 256}' --batch 4 --seq-len 256
    python bench/models.py --against tp                  # tp=2 vs tp=1 (on CPU, for the record)
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _hf_model(spec):
    import transformers

    config = transformers.LlamaConfig(**{**spec.hf.hf_config(spec.config, torch.float32), "use_cache": False},
                                      attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(config)


def _rank(rank: int, a: argparse.Namespace, port: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainer.mesh import MeshShape
    from trainer.models import ParallelPlan, apply_parallelism, build_model, resolve_model
    from trainer.parallel import Dist, with_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.nproc, timeout=timedelta(seconds=300))
    d = Dist(rank, a.nproc, 0, torch.device("cpu"))
    spec = resolve_model("llama", a.flavor, a.config)
    plan = ParallelPlan(mode="fsdp", activation_checkpointing=a.activation_checkpointing)
    ours = build_model(spec, plan, d, seed=0)
    gens = [torch.Generator().manual_seed(1 + r) for r in range(a.nproc)]
    every_rank = [[torch.randint(0, spec.vocab.size, (a.batch, a.seq_len + 1), generator=g) for _ in range(4)]
                  for g in gens]
    batches = {"ours": every_rank[rank]}
    if a.against == "tp":
        split = build_model(spec, plan, with_mesh(d, MeshShape(1, 1, a.nproc)), seed=0)
        models = {"ours": (ours, lambda x: ours(x)), "tp": (split, lambda x: split(x))}
        batches["tp"] = [torch.cat(per_step) for per_step in zip(*every_rank)]   # the tensor-parallel group's
        base = "ours"
    else:
        full = get_model_state_dict(ours, options=StateDictOptions(full_state_dict=True))
        theirs = _hf_model(spec)
        theirs.load_state_dict({spec.hf.to_hf(n): t for n, t in full.items()}, strict=True)
        # The same plan through the same code: only the blocks differ in name.
        apply_parallelism(theirs, replace(spec, blocks=lambda m: list(m.model.layers)), plan, d)
        models = {"ours": (ours, lambda x: ours(x)), "transformers": (theirs, lambda x: theirs(input_ids=x).logits)}
        batches["transformers"] = batches["ours"]
        base = "transformers"
    optims = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for k, (m, _) in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    first: dict[str, float] = {}
    for r in range(a.rounds + 1):       # round 0 warms up (lazy FSDP init, allocator, first collectives)
        for name, (model, forward) in models.items():
            for i in range(a.steps):
                x = batches[name][i % len(batches[name])]
                dist.barrier()          # both ranks start the step together: the time is the step's, not a wait
                t0 = time.perf_counter()
                loss = F.cross_entropy(forward(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
                loss.backward()
                optims[name].step()
                optims[name].zero_grad(set_to_none=True)
                dt = time.perf_counter() - t0
                if name not in first:   # the mean over the ranks: the loss of the global batch
                    mean = loss.detach().clone()
                    dist.all_reduce(mean)
                    first[name] = mean.item() / a.nproc
                if r > 0:
                    times[name].append(dt)
    if rank == 0:
        assert abs(first["ours"] - first[base]) < 1e-4, f"the models differ: first losses {first}"
        med = {k: statistics.median(v) for k, v in times.items()}
        tokens = a.batch * a.seq_len * a.nproc
        print(f"llama {spec.flavor} {spec.config.n_layers} layers dim {spec.config.dim}, FSDP2 on {a.nproc} CPU "
              f"ranks x {a.threads} thread(s), batch {a.batch} x {a.seq_len} per rank, activation checkpointing "
              f"{a.activation_checkpointing}; {a.rounds} rounds x {a.steps} steps each (first loss "
              f"{first['ours']:.5f} both)")
        if a.against == "tp":
            print(f"tp: mesh 1x1x{a.nproc}, batch {a.batch * a.nproc} x {a.seq_len} per tensor-parallel group")
        print("measured on a shared host under load: read the ratio, not the absolute times")
        print(f"{'model':<14}{'median step ms':>16}{'p90 ms':>10}{'tokens/s':>12}")
        for k, v in times.items():
            p90 = sorted(v)[int(0.9 * (len(v) - 1))]
            print(f"{k:<14}{med[k] * 1e3:>16.1f}{p90 * 1e3:>10.1f}{tokens / med[k]:>12.0f}")
        if a.against == "tp":
            print(f"tp={a.nproc} / tp=1 step time: {med['tp'] / med['ours']:.3f}x (CPU gloo: for the record)")
        else:
            print(f"ours / transformers step time: {med['ours'] / med['transformers']:.3f}x (goal <= 1.0x)")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="debug")
    p.add_argument("--config", default=None, help="--model-config overrides (inline JSON or a file)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="steps per model per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--activation-checkpointing", default="none", choices=("none", "full", "selective"))
    p.add_argument("--against", default="transformers", choices=("transformers", "tp"),
                   help="transformers' LlamaForCausalLM, or ours split by tensor parallelism over the ranks")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(a, port), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
