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

    python bench/checkpoint_stall.py                 # ~4 minutes on 2 cores
    python bench/checkpoint_stall.py --n-embd 512    # a bigger state
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _runs import dataset, events, summary, table, train

from trainer.launch import LaunchConfig


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
        blocks = [e["block_s"] for e in log if e["event"] == "ckpt_snapshot" and e["step"] < a.steps]
        step_s = {e["step"]: e["step_s"] for e in log if e["event"] == "step"}
        saved = [e["step"] for e in log if e["event"] == "ckpt_snapshot" and e["step"] < a.steps]
        after = {s + i for s in saved for i in (1, 2)}
        median_step = statistics.median(v for k, v in step_s.items() if k not in after and k > 2)
        extra = statistics.mean(step_s[k] - median_step for k in after if k in step_s)
        s = summary(out)
        state_mb = sum(f.stat().st_size for f in (out / "checkpoints").glob("step_*/*.distcp")) / 2 / 1e6
        results[name] = {"blocks": blocks, "wall": wall, "sha": s["params_sha256"], "state_mb": state_mb,
                         "extra": extra}
    base = statistics.median(results["sync-dcp"]["blocks"])
    rows = []
    for name, r in results.items():
        med = statistics.median(r["blocks"])
        rows.append([name, f"{r['state_mb']:.0f}", len(r["blocks"]), f"{med * 1e3:.1f}",
                     f"{max(r['blocks']) * 1e3:.1f}", f"{base / med:.1f}x", f"{r['extra'] * 1e3:+.0f}",
                     f"{r['wall']:.0f}"])
    print(f"model n_layer={a.n_layer} n_embd={a.n_embd}; {a.steps} steps, checkpoint every {a.ckpt_every}; 2 CPU ranks")
    print(table(rows, ["save", "state MB (per ckpt)", "ckpts", "block p50 ms", "block max ms", "sync p50 / this p50",
                       "after-save steps, +ms each", "run wall s"]))
    ratio = base / statistics.median(results["nvrx-async"]["blocks"])
    print(f"\nasync blocks 1/{ratio:.0f} of the synchronous save (goal: at least 1/30)")
    same = results["nvrx-async"]["sha"] == results["sync-dcp"]["sha"]
    print(f"final params identical across the two runs: {same}")


if __name__ == "__main__":
    main()
