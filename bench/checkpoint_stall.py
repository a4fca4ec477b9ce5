"""How long the training loop is blocked per checkpoint: NVRx async (with and without checksums) vs synchronous
torch DCP, beside one copy of the rank's shard in memory.

Three runs of the same training, one after the other in one invocation, on 2 CPU ranks: two write their
checkpoints through NVRx's async path (shared-memory staging copy, background writer), one of them with the
checkpoint checksums turned off through the product's internal benchmark hook
(``trainer.checkpoint.integrity.BENCH_NO_CHECKSUMS_ENV``: its checkpoints record no checksums, so no restore
would ever load them), and the third with synchronous ``torch.distributed.checkpoint.save``. The state (model +
AdamW moments, all ranks) is about 200 MB. Blocking = the time ``CheckpointManager.save`` holds the loop
(getting the state dict included: ``trainer.live_state`` builds it once, then refreshes it) plus, for the
async save, any wait for its background copy before the next optimizer step, from the ``ckpt_snapshot`` events
of each run's checkpoints, the first included, those of the end of training (deliberately blocking: the final
save, and owed checkpoints written from memory just before it) excluded. A checkpoint due while a write still
runs is owed: copied to node memory at its step (an ``owed`` ``memory_snapshot``), staged from that copy once no
write runs; both holds are counted (``holds (owed)``: all the holds, and how many were such copies). The phases
of each save are in its event (``wait_s`` includes building the state dict and, for an owed checkpoint, the wait
for its memory copy's mark); ``core_wait_s`` is how much of the hold the loop's thread was ready to run and waited
for a core (CPU contention, not the save's own work).

Between checkpoints the state is also copied to node memory (``--memory-snapshot-every-s``): ``memory copy`` is
the p50 hold of those copies (the owed ones excluded, counted above) and how many there were.

The physical limit of the blocking part is one copy of the rank's shard in memory: ``copy ms`` is rank 0's bytes
of the newest checkpoint copied once from one shared-memory buffer into another in this process, p50 of 10,
measured right after the runs. ``checksum ms`` is what the checksum thread does per save, measured the same
way: XXH3 of those bytes (background time: the loop never waits for it). ``hand-over ms`` is the p50 time the
writer's hand-over thread spent giving a write to NVRx's worker (``ckpt_handed_over``; from 0.6 NVRx returns only
once the worker has received the write's tensors: background time too). ``write s`` is the mean background
write per checkpoint (``ckpt_committed``'s ``commit_s``: from the save to its commit).

The background copy and NVRx's writer process share the CPU with training: on a GPU node they use host cores
the training does not; on 2 CPU cores they compete with it, and ``after-save`` shows that cost (how much
longer the two steps after each save took than the run's median step).

    python bench/checkpoint_stall.py                 # ~2 minutes on 2 idle cores
    python bench/checkpoint_stall.py --n-embd 512    # a bigger state
    python bench/checkpoint_stall.py --copy-nice 0   # the copy threads at the ranks' niceness
    python bench/checkpoint_stall.py --repeat 4      # the async runs 4 times each (~5 min): how often goals are met
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from pathlib import Path

import torch

from _runs import WORKDIR_HELP, dataset, events, summary, table, train, workdir

from trainer.checkpoint.integrity import BENCH_NO_CHECKSUMS_ENV, digest
from trainer.config import CheckpointConfig
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


RUNS = (("nvrx-async", "on", [], {}),
        ("nvrx-async", "off", [], {BENCH_NO_CHECKSUMS_ENV: "1"}),
        ("sync-dcp", "on", ["--ckpt-sync"], {}))


def _measure(out: Path, steps: int) -> dict:
    """A finished run's blocking times, background writes, slowdown after saves and the identity of its weights."""
    log = events(out)
    # A checkpoint due while a write runs is owed: copied to memory at its step (an owed memory snapshot), staged
    # from there once no write runs. Both hold the loop. The end of training blocks deliberately: after the last
    # step the owed checkpoints left are written from memory, then the final save, each waiting for the last.
    loop_end = max(e["t"] for e in log if e["event"] == Event.STEP)
    snapshots = [e for e in log if (e["event"] == Event.CKPT_SNAPSHOT or e["event"] == Event.MEMORY_SNAPSHOT
                                    and e.get("owed")) and e["t"] <= loop_end]
    blocks = [e["block_s"] for e in snapshots]
    step_s = {e["step"]: e["step_s"] for e in log if e["event"] == Event.STEP}
    after = {e["step"] + i for e in snapshots for i in (1, 2)}
    median_step = statistics.median(v for k, v in step_s.items() if k not in after and k > 2)
    newest = sorted(checkpoints_dir(out).glob("step_*"))[-1]
    return {"blocks": blocks, "slowest": max(snapshots, key=lambda e: e["block_s"]),
            "owed": sum(e["event"] == Event.MEMORY_SNAPSHOT for e in snapshots), "sha": summary(out)["params_sha256"],
            "extra": statistics.mean(step_s[k] - median_step for k in after if k in step_s),
            "state_mb": sum(f.stat().st_size for f in newest.glob("*.distcp")) / 1e6,
            "rank0_bytes": sum(f.stat().st_size for f in newest.glob("__0_*.distcp")),
            "write_s": [e["commit_s"] for e in log if e["event"] == Event.CKPT_COMMITTED and e["step"] < steps],
            "hand_over_s": [e["hand_over_s"] for e in log if e["event"] == Event.CKPT_HANDED_OVER],
            "memory_blocks": [e["block_s"] for e in log if e["event"] == Event.MEMORY_SNAPSHOT and not e.get("owed")]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=416)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--ckpt-every", type=int, default=6)
    p.add_argument("--copy-nice", type=int, default=CheckpointConfig.copy_nice,
                   help="--ckpt-copy-nice of every run (0: the copy and checksum threads at the ranks' niceness)")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the two async configurations this many times, alternating, for how often each goal is "
                        "met (the synchronous run once: the reference)")
    p.add_argument("--workdir", type=Path, default=None, help=WORKDIR_HELP)
    a = p.parse_args()
    if a.repeat < 1:
        p.error("--repeat must be at least 1")
    with workdir(a.workdir, "bench-stall-") as root:
        results = _run(a, root)
    _report(a, results)


def _run(a: argparse.Namespace, root: Path) -> dict:
    """Each of ``RUNS`` in ``root`` (the async ones ``a.repeat`` times), measured: {(save, checksums, run): ...}."""
    data = dataset(root)
    common = ["--data", str(data), "--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd), "--n-head", "8",
              "--seq-len", "64", "--batch-size", "1", "--max-steps", str(a.steps), "--ckpt-every",
              str(a.ckpt_every), "--ckpt-keep", "2", "--log-every", "5", "--restart-layers", "injob",
              "--ckpt-copy-nice", str(a.copy_nice)]
    results = {}
    for run, (name, checksums, extra, env) in ((i, r) for i in range(a.repeat) for r in RUNS):
        if name == "sync-dcp" and run > 0:
            continue
        out = root / f"{name}-checksums-{checksums}{f'-{run + 1}' if a.repeat > 1 else ''}"
        with _environ(env):
            code, wall = train(out, [*common, "--out", str(out), *extra],
                               LaunchConfig(nproc_per_node=2, max_restarts=0))
        if code != 0:
            raise SystemExit(f"{out.name} run failed ({code}); see {out}.log")
        r = results[name, checksums, run] = {**_measure(out, a.steps), "wall": wall}
        # Right after the run, so that the copy meets the load the run met (the machine may be shared).
        r["copy_s"], r["checksum_s"] = shard_copy_and_checksum_s(r["rank0_bytes"])
    return results


def _report(a: argparse.Namespace, results: dict) -> None:
    rank0_bytes = results["nvrx-async", "on", 0]["rank0_bytes"]
    sync_p50 = statistics.median(results["sync-dcp", "on", 0]["blocks"])
    sync_sha = results["sync-dcp", "on", 0]["sha"]
    rows = []
    for (name, checksums, run), r in results.items():
        p50, top = statistics.median(r["blocks"]), max(r["blocks"])
        write_s = statistics.mean(r["write_s"]) if r["write_s"] else float("nan")
        checksum_ms = r["checksum_s"] * 1e3 if checksums == "on" else 0.0
        hand_over = f"{statistics.median(r['hand_over_s']) * 1e3:.1f}" if r["hand_over_s"] else "-"
        memory = r["memory_blocks"]
        memory = f"{statistics.median(memory) * 1e3:.1f} ({len(memory)})" if memory else "-"
        rows.append([name, checksums, run + 1, f"{r['state_mb']:.0f}", f"{len(r['blocks'])} ({r['owed']})",
                     f"{r['copy_s'] * 1e3:.1f}",
                     f"{p50 * 1e3:.1f}", f"{top * 1e3:.1f}", f"{p50 / r['copy_s']:.2f}x", f"{top / p50:.2f}x",
                     f"1/{sync_p50 / p50:.0f}", memory, f"{checksum_ms:.1f}",
                     hand_over, "-" if name == "sync-dcp" else f"{write_s:.2f}", f"{r['extra'] * 1e3:+.0f}",
                     f"{r['wall']:.0f}", r["sha"] == sync_sha])
    print(f"model n_layer={a.n_layer} n_embd={a.n_embd}; {a.steps} steps, checkpoint every {a.ckpt_every}; "
          f"2 CPU ranks; copy threads at niceness {a.copy_nice}; rank 0's shard {rank0_bytes / 1e6:.0f} MB; "
          f"load average {_load()}")
    print(table(rows, ["save", "checksums", "run", "state MB", "holds (owed)", "copy ms", "block p50 ms",
                       "block max ms", "p50/copy", "max/p50", "p50 vs sync", "memory copy p50 ms (n)",
                       "checksum ms/save (bg)", "hand-over ms (bg)", "write s/save (bg)", "after-save +ms", "wall s",
                       "params = sync's"]))
    runs = {checksums: [r for (name, c, _), r in results.items() if name == "nvrx-async" and c == checksums]
            for checksums in ("on", "off")}
    for (name, checksums, run), r in results.items():
        if name != "sync-dcp":   # where the slowest save's time went (wait_s: for the previous write, mostly)
            phases = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["slowest"].items() if k.endswith("_s"))
            print(f"{name}, checksums {checksums}, run {run + 1}: slowest save step {r['slowest']['step']}, "
                  f"ms: {phases}")
    print("\ngoals: async block p50 at most 1x the copy, max at most 2x the p50, from the first save on")
    for checksums, rs in runs.items():
        p50s = [statistics.median(r["blocks"]) for r in rs]
        within_copy = sum(p <= r["copy_s"] for p, r in zip(p50s, rs))
        within_2x = sum(max(r["blocks"]) <= 2 * p for p, r in zip(p50s, rs))
        print(f"checksums {checksums}: p50 within the copy in {within_copy} of {len(rs)} runs, max within 2x the p50 "
              f"in {within_2x} of {len(rs)}")
    on, off = runs["on"], runs["off"]
    write_on = statistics.mean(w for r in on for w in r["write_s"])
    write_off = statistics.mean(w for r in off for w in r["write_s"])
    checksum_s = statistics.median(r["checksum_s"] for r in on)
    print(f"checksums: blocking p50 {statistics.median(b for r in on for b in r['blocks']) * 1e3:.1f} ms with, "
          f"{statistics.median(b for r in off for b in r['blocks']) * 1e3:.1f} ms without (all runs' holds); "
          f"background {checksum_s * 1e3:.1f} ms per save on the checksum thread, {checksum_s / write_on:.1%} of the "
          f"mean write with them ({write_on:.2f} s; {write_off:.2f} s without)")


@contextlib.contextmanager
def _environ(env: dict):
    """``env`` added to this process's environment (the launcher's ranks inherit it) for the block."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
