"""The process group and this process's device, from the launcher's environment, and the stores it meets on.
(How a model is spread over the ranks is ``trainer.models.parallelize``.)"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ensure_launcher_env() -> None:
    """Without a launcher (no RANK in the environment), describe a single-process group on a free port,
    so that ``python -m trainer`` works on its own."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))


def init_distributed(timeout_s: float, store: dist.Store) -> Dist:
    """Join the process group described by the launcher's environment (torchrun / ft_launcher) on ``store``
    (``restart.iteration_store``: one key space per attempt). NCCL on CUDA, gloo on CPU."""
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
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)


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
