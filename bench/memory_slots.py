"""What the first memory snapshots after a restart hold the loop, against the snapshots after them.

A restarted rank (a new ``CheckpointManager`` on the same node directory, as after an in-job restart) restores
from the node's memory, then copies its state into the replica's two slots in turn, as the loop does between
checkpoints. The first copy into each slot used to map it on the loop's blocking path (allocated on tmpfs and,
on a GPU, page-locked for the device-to-host copy); the restore now maps both on a thread. Printed per round:
the restore, the holds of the first copy into each slot, the p50 hold of the copies after them, and the first
two against that p50 (the goal: 1x, nothing paid for a restart). A hold is what the loop waits for: starting the
copy (``snapshot_to_memory``), then ``finish_snapshot`` once the copy is done, as the loop's forward and backward
passes outlast it.

One process, world size 1 (gloo; NCCL and the device's state where CUDA is available):

    python bench/memory_slots.py                      # 100 MB of state, 118 tensors, 5 restarts
    python bench/memory_slots.py --mb 1000 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.checkpoint import CheckpointManager
from trainer.config import CheckpointConfig
from trainer.events import EventLog
from trainer.layout import events_path
from trainer.parallel import Dist


def _state(mb: int, tensors: int, device: torch.device, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = mb * 2**20 // 4 // tensors
    return {"model": {f"w{i}": torch.randn(n, generator=g).to(device) for i in range(tensors)}, "step": seed}


def _held(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=100, help="state size in MB")
    p.add_argument("--tensors", type=int, default=118)
    p.add_argument("--rounds", type=int, default=5, help="restarts")
    p.add_argument("--copies", type=int, default=6, help="memory snapshots per round (the first two: one per slot)")
    p.add_argument("--steps-s", type=float, default=1.0,
                   help="seconds the loop trains between the restore and its first memory snapshot (the trainer's "
                        "--memory-snapshot-every-s, 1 s by default)")
    a = p.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    d = Dist(0, 1, 0, device)
    root = Path(tempfile.mkdtemp(prefix="bench-slots-"))
    shm = Path(tempfile.mkdtemp(prefix="bench-slots-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        _rounds(a, d, root, shm, device)
    finally:   # the slots are node memory: two copies of the state
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


def _rounds(a: argparse.Namespace, d: Dist, root: Path, shm: Path, device: torch.device) -> None:
    cfg = CheckpointConfig(memory_dir=str(shm))
    events = EventLog(events_path(root), 0)
    live = _state(a.mb, a.tensors, device, 0)
    step, rows = 0, []
    print(f"{a.mb} MB of state in {a.tensors} tensors on {device}; {a.rounds} restarts, {a.copies} copies each")
    print("round  restore ms  1st copy ms  2nd copy ms  later p50 ms  1st/p50  2nd/p50")
    for r in range(a.rounds + 1):
        mgr = CheckpointManager(root, cfg, d, events, run_id="bench")
        try:
            restore_s = _held(lambda: mgr.restore(live))
            time.sleep(a.steps_s)   # the loop's steps before its first memory snapshot is due
            holds = []
            for _ in range(a.copies):
                step += 1
                live["step"] = step
                start = _held(lambda: mgr.snapshot_to_memory(step, live))
                mgr.copying.copy.result()   # the loop's forward and backward passes, which outlast the copy
                holds.append(start + _held(mgr.finish_snapshot))
                mgr.wait_for_mark()
        finally:
            mgr.close()
        if r == 0:   # the first start: nothing on the node to restore, slots created
            continue
        later = statistics.median(holds[2:])
        rows.append((holds[0] / later, holds[1] / later))
        print(f"{r:5d}  {restore_s * 1e3:10.1f}  {holds[0] * 1e3:11.1f}  {holds[1] * 1e3:11.1f}  {later * 1e3:12.2f}"
              f"  {holds[0] / later:6.2f}x  {holds[1] / later:6.2f}x")
    first, second = statistics.median(x for x, _ in rows), statistics.median(y for _, y in rows)
    print(f"median over the restarts: the first copy {first:.2f}x and the second {second:.2f}x the later copies' "
          "p50 (goal: 1x)")


if __name__ == "__main__":
    main()
