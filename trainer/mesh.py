"""The device mesh's shape: ``dp_replicate`` x ``dp_shard`` x ``tp`` ranks, resolved from the settings and the
job's nodes x processes per node. No torch here: the launcher and the pipeline's settings check use it
before any rank starts; ``trainer.parallel`` forms the mesh itself."""

from __future__ import annotations

import os
from dataclasses import dataclass

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MeshShape:
    """How the ranks are arranged: ``dp_replicate`` replicas (HSDP: gradients all-reduced between them),
    each of ``dp_shard`` x ``tp`` ranks; ``dp_shard`` ranks shard the parameters (FSDP2), ``tp`` ranks
    split each layer (tensor parallelism). Rank ``r`` sits at (r // (dp_shard * tp), r // tp % dp_shard,
    r % tp): a tensor-parallel group is ``tp`` consecutive ranks, so it stays inside a node."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Ranks that read different batches: every rank of a tensor-parallel group reads the same."""
        return self.dp_replicate * self.dp_shard

    @property
    def flat(self) -> bool:
        """Plain FSDP2 (or DDP) over every rank: no device mesh to build."""
        return self.dp_replicate == 1 and self.tp == 1

    @property
    def tag(self) -> str:
        """``RxSxT``: what identifies a sharding of the state (memory snapshots of another one are not used)."""
        return f"{self.dp_replicate}x{self.dp_shard}x{self.tp}"

    def describe(self) -> dict:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}


def setting_problems(parallel: str, dp_replicate: int, dp_shard: int, tp: int) -> list[str]:
    """What is wrong with the mesh settings whatever the job's size (each one line)."""
    if tp < 1 or dp_replicate < 0 or dp_shard < 0:
        return [f"--tp must be at least 1 and --dp-replicate, --dp-shard at least 0 (auto), got {tp}, "
                f"{dp_replicate}, {dp_shard}"]
    if parallel == "ddp" and (tp > 1 or dp_shard > 1):
        return ["--parallel ddp replicates the whole model on every rank: use --parallel fsdp for --tp or "
                "--dp-shard above 1"]
    return []


def resolve_mesh(parallel: str, world_size: int, local_world_size: int, dp_replicate: int = 0, dp_shard: int = 0,
                 tp: int = 1) -> MeshShape:
    """The mesh of ``world_size`` ranks, ``local_world_size`` per node, from the settings (0: auto).

    Auto, with FSDP on several nodes of more than one rank: replicate across nodes, shard within a node
    (HSDP: parameter all-gathers stay inside the node, only gradient reductions cross nodes); otherwise
    one shard group over every data-parallel rank. A ValueError says what to change.
    """
    problems = setting_problems(parallel, dp_replicate, dp_shard, tp)
    if problems:
        raise ValueError(problems[0])
    if world_size % local_world_size:
        raise ValueError(f"{world_size} ranks are not whole nodes of {local_world_size}")
    if local_world_size % tp:
        raise ValueError(f"--tp {tp} must divide the ranks of a node ({local_world_size}): tensor parallelism "
                         f"stays inside a node")
    dp = world_size // tp
    nodes = world_size // local_world_size
    if parallel == "ddp":
        dp_replicate, dp_shard = dp_replicate or dp, 1
    elif not dp_replicate and not dp_shard:
        per_node = local_world_size // tp
        dp_replicate, dp_shard = (nodes, per_node) if nodes > 1 and per_node > 1 else (1, dp)
    elif not dp_shard:
        dp_shard = dp // dp_replicate if dp % dp_replicate == 0 else 0
    elif not dp_replicate:
        dp_replicate = dp // dp_shard if dp % dp_shard == 0 else 0
    shape = MeshShape(dp_replicate, dp_shard, tp)
    if shape.world_size != world_size:
        raise ValueError(f"--dp-replicate {dp_replicate or '?'} x --dp-shard {dp_shard or '?'} x --tp {tp} must "
                         f"be the {world_size} ranks ({nodes} node(s) x {local_world_size}); 0 leaves one to follow")
    return shape


def check_launch(parallel: str, dp_replicate: int, dp_shard: int, tp: int, nproc: int, nodes: range) -> None:
    """Before any rank starts: the mesh must fit every node count the job may run with (``nodes``: one
    count, or an elastic range), ``nproc`` ranks each; a ValueError says what to change."""
    for n in nodes:
        resolve_mesh(parallel, n * nproc, nproc, dp_replicate, dp_shard, tp)


def launcher_mesh(parallel: str, dp_replicate: int, dp_shard: int, tp: int) -> MeshShape:
    """The mesh of this launch, from the launcher's environment (WORLD_SIZE, LOCAL_WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return resolve_mesh(parallel, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), dp_replicate, dp_shard, tp)
