"""The process group and this process's device, from the launcher's environment, the device mesh the ranks
form (``dp_replicate`` x ``dp_shard`` x ``tp``), and the stores they meet on. (How a model is spread over
the mesh is ``trainer.models.parallelize``.)"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .mesh import MESH_DIMS, MeshShape


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    shape: MeshShape | None = None
    """the mesh's shape (None: one data-parallel group of every rank)"""
    mesh: DeviceMesh | None = None
    """the device mesh, dims ``MESH_DIMS``; None where the shape is flat (FSDP2 and DDP use the world)"""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def mesh_tag(self) -> str:
        """The mesh's ``RxSxT`` (one shard group of every rank where no shape was given)."""
        return (self.shape or MeshShape(1, self.world_size, 1)).tag

    @property
    def tp(self) -> int:
        return self.shape.tp if self.shape is not None else 1

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: which batches it reads (the same in a tensor-parallel group)."""
        return self.rank // self.tp

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """What FSDP2 shards over: (replicate, shard) for HSDP, shard alone, or None (every rank)."""
        if self.mesh is None:
            return None
        return self.mesh["dp_replicate", "dp_shard"] if self.shape.dp_replicate > 1 else self.mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if self.mesh is not None and self.tp > 1 else None


def ensure_launcher_env() -> None:
    """Without a launcher (no RANK in the environment), describe a single-process group on a free port,
    so that ``python -m trainer`` works on its own."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def init_distributed(timeout_s: float, store: dist.Store, shape: MeshShape | None = None,
                     form_mesh: bool = True) -> Dist:
    """Join the process group described by the launcher's environment (torchrun / ft_launcher) on ``store``
    (``restart.iteration_store``: one key space per attempt), and form ``shape``'s device mesh (``with_mesh``).
    NCCL on CUDA, gloo on CPU."""
    ensure_launcher_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), store=store,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    return with_mesh(Dist(dist.get_rank(), dist.get_world_size(), local_rank, device), shape, form_mesh)


def with_mesh(d: Dist, shape: MeshShape | None, form: bool = True) -> Dist:
    """``d`` with ``shape`` and, if ``form`` and the shape is not flat, its device mesh (collective: its
    sub-groups are new process groups). DDP forms none: it replicates over the whole group."""
    if shape is None or shape.flat or not form:
        return Dist(d.rank, d.world_size, d.local_rank, d.device, shape)
    if shape.world_size != d.world_size:
        raise ValueError(f"the mesh {shape.tag} is {shape.world_size} ranks, the process group {d.world_size}")
    mesh = init_device_mesh(d.device.type, (shape.dp_replicate, shape.dp_shard, shape.tp), mesh_dim_names=MESH_DIMS)
    return Dist(d.rank, d.world_size, d.local_rank, d.device, shape, mesh)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_listening(host: str, port: int, timeout_s: float = 300.0) -> None:
    """Return once ``host:port`` accepts connections (polled every 5 ms); TimeoutError after ``timeout_s``.

    A rank that joins a store hosted by another rank calls this first: its peers are started in no
    particular order, and torch's store client backs off for about 0.3 s after a refused connection,
    which every restart would otherwise pay whenever a client starts before its host.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f}s: is rank 0 running, "
                                   f"and is MASTER_ADDR reachable from this node?") from e
            time.sleep(0.005)
