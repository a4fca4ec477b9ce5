"""How long the training loop is blocked per checkpoint: NVRx async vs synchronous torch DCP.

Two runs of the same training, side by side in one invocation, on 2 CPU ranks: one writes its
checkpoints through NVRx's async path (shared-memory snapshot, background writer), the other with
synchronous ``torch.distributed.checkpoint.save``. The state (model + AdamW moments, all ranks) is
about 200 MB or more. Blocking = the time ``CheckpointManager.save`` holds the loop (getting the state
dict included: ``trainer.live_state`` builds it once, then refreshes it) plus, for the async save, any wait for
its background copy before the next optimizer step, from the events of each run's interval checkpoints
(the final, deliberately blocking one is excluded). The phases of each save are in its ``ckpt_snapshot``
event (``wait_s`` includes building the state dict).

The loop is not the only thing a save slows down: the background copy and NVRx's writer process share
the CPU with training. On a GPU node they use host cores the training does not; on 2 CPU cores they
compete with it, and the "after-save steps" column shows that cost: how much longer the two steps after
each save took than the run's median step.

The physical limit of the blocking part is one copy of the rank's shard in memory: the bench measures it in
the same invocation (``copy of the shard``: rank 0's bytes of the newest checkpoint, copied once from one
buffer into another in shared memory, p50 of 10), and beside it the checksum of those bytes (XXH3, what each
save computes on its checksum thread once the staging copy is whole: background time, never blocking) against
the mean background write (``ckpt_committed``'s ``commit_s``).

    python bench/checkpoint_stall.py                 # ~4 minutes on 2 cores
    python bench/checkpoint_stall.py --n-embd 512    # a bigger state
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from _runs import dataset, events, summary, table, train

from trainer.checkpoint.integrity import digest
from trainer.events import Event
from trainer.launch import LaunchConfig
from trainer.layout import checkpoints_dir


def _p50(fn, n: int = 10) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shard_copy_and_checksum_s(nbytes: int) -> tuple[float, float]:
    """(one copy of ``nbytes`` from one shared-memory buffer into another, their checksum), p50 seconds."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).share_memory_()
    dst = torch.empty(nbytes, dtype=torch.uint8).share_memory_()
    dst.copy_(src)   # the pages are touched once, as the staging copy's are after its first save
    return _p50(lambda: dst.copy_(src)), _p50(lambda: digest(dst.numpy()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=416)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ckpt-every", type=int, default=6)
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    root = a.workdir or Path(tempfile.mkdtemp(prefix="bench-stall-"))
    data = dataset(root)
    common = ["--data", str(data), "--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd), "--n-head", "8",
              "--seq-len", "64", "--batch-size", "1", "--max-steps", str(a.steps), "--ckpt-every",
              str(a.ckpt_every), "--ckpt-keep", "2", "--log-every", "5", "--restart-layers", "injob"]
    results = {}
    for name, extra in (("nvrx-async", []), ("sync-dcp", ["--ckpt-sync"])):
        out = root / name
        code, wall = train(out, [*common, "--out", str(out), *extra], LaunchConfig(nproc_per_node=2, max_restarts=0))
        if code != 0:
            raise SystemExit(f"{name} run failed ({code}); see {out}.log")
        log = events(out)
        blocks = [e["block_s"] for e in log if e["event"] == Event.CKPT_SNAPSHOT and e["step"] < a.steps]
        step_s = {e["step"]: e["step_s"] for e in log if e["event"] == Event.STEP}
        saved = [e["step"] for e in log if e["event"] == Event.CKPT_SNAPSHOT and e["step"] < a.steps]
        after = {s + i for s in saved for i in (1, 2)}
        median_step = statistics.median(v for k, v in step_s.items() if k not in after and k > 2)
        extra = statistics.mean(step_s[k] - median_step for k in after if k in step_s)
        s = summary(out)
        state_mb = sum(f.stat().st_size for f in checkpoints_dir(out).glob("step_*/*.distcp")) / 2 / 1e6
        newest = sorted(checkpoints_dir(out).glob("step_*"))[-1]
        rank0_bytes = sum(f.stat().st_size for f in newest.glob("__0_*.distcp"))
        commit_s = [e["commit_s"] for e in log if e["event"] == Event.CKPT_COMMITTED and e["step"] < a.steps]
        results[name] = {"blocks": blocks, "wall": wall, "sha": s["params_sha256"], "state_mb": state_mb,
                         "extra": extra, "rank0_bytes": rank0_bytes, "commit_s": commit_s}
    base = statistics.median(results["sync-dcp"]["blocks"])
    copy_s, checksum_s = shard_copy_and_checksum_s(results["nvrx-async"]["rank0_bytes"])
    rows = []
    for name, r in results.items():
        med = statistics.median(r["blocks"])
        rows.append([name, f"{r['state_mb']:.0f}", len(r["blocks"]), f"{med * 1e3:.1f}",
                     f"{max(r['blocks']) * 1e3:.1f}", f"{copy_s * 1e3:.1f}", f"{base / med:.1f}x",
                     f"{r['extra'] * 1e3:+.0f}", f"{r['wall']:.0f}"])
    print(f"model n_layer={a.n_layer} n_embd={a.n_embd}; {a.steps} steps, checkpoint every {a.ckpt_every}; 2 CPU ranks")
    print(table(rows, ["save", "state MB (per ckpt)", "ckpts", "block p50 ms", "block max ms",
                       "copy of the shard ms", "sync p50 / this p50", "after-save steps, +ms each", "run wall s"]))
    r = results["nvrx-async"]
    med = statistics.median(r["blocks"])
    print(f"\nasync: block p50 {med / copy_s:.2f}x one copy of the shard (goal: at most 1x), "
          f"block max {max(r['blocks']) / med:.2f}x its p50 (goal: at most 2x)")
    write_s = statistics.mean(r["commit_s"]) if r["commit_s"] else float("nan")
    print(f"checksums of rank 0's shard ({r['rank0_bytes'] / 1e6:.0f} MB): {checksum_s * 1e3:.1f} ms on the "
          f"checksum thread per save ({checksum_s / write_s:.1%} of the mean background write, {write_s:.2f} s); "
          f"blocking: none (the loop does not wait for them)")
    ratio = base / statistics.median(results["nvrx-async"]["blocks"])
    print(f"\nasync blocks 1/{ratio:.0f} of the synchronous save (goal: at least 1/30)")
    same = results["nvrx-async"]["sha"] == results["sync-dcp"]["sha"]
    print(f"final params identical across the two runs: {same}")


if __name__ == "__main__":
    main()
