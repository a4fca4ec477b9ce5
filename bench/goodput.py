"""Goodput under faults: a fixed workload run fault-free and with one fault in every F seconds of its
fault-free time (in the middle of each; kinds in turn: hang, kill, exception, the costliest first; ranks
in turn), all layers on (``--restart-layers both`` under ft_launcher). Goodput = fault-free wall time /
faulted wall time, side by side in one invocation; the faulted runs' own accounting (summary.json) is
printed too. Then the projection to a 16,384-GPU job at Llama 3's failure rate, from the costs measured
here.

The rank monitor's step timeout is the one NVRx learns from the run's own steps (safety factor x the
longest of the first 20), with a 1 s floor: about 4x the longest step a fault-free run of this workload
takes here (0.27 s of 6,673 steps).

    python bench/goodput.py --minutes 10 --fault-every 300,60     # ~35 minutes on 2 cores
    python bench/goodput.py --minutes 4 --fault-every 60          # a quicker look
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from _runs import dataset, events, summary, table, train

from trainer.goodput import LLAMA3_FAILURES_PER_GPU_HOUR, project
from trainer.launch import LaunchConfig

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--log-every", "100", "--ckpt-every", "auto", "--ckpt-keep", "2", "--ft-min-step-timeout-s", "1"]
FT = LaunchConfig(nproc_per_node=2, max_restarts=100, step_timeout_s=5.0, workload_check_interval_s=0.5,
                  monitor_interval_s=0.2, workers_stop_timeout_s=0.3)
KINDS = ("hang", "kill", "exception")


def schedule(every_s: float, step_s: float, steps: int, world_size: int = 2) -> list[str]:
    """``--inject-fault`` specs: one fault in the middle of every ``every_s`` seconds of fault-free time."""
    at = [round((k + 0.5) * every_s / step_s) for k in range(math.ceil(steps * step_s / every_s))]
    return [f"{KINDS[k % len(KINDS)]}@{step}:{(k + 1) % world_size}" for k, step in enumerate(at) if step < steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the fault-free workload")
    p.add_argument("--fault-every", default="300,60", help="comma-separated seconds between faults")
    p.add_argument("--workdir", type=Path, default=None)
    a = p.parse_args()
    root = a.workdir or Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    data = dataset(root)

    # Size the workload: time a short probe run, then scale the steps to the requested minutes.
    probe = root / "probe"
    train(probe, ["--data", str(data), *TINY, "--out", str(probe), "--max-steps", "60"], FT)
    # The median step, not the mean: the probe's first steps share the CPU with NVRx's writer starting up.
    step_s = statistics.median(e["step_s"] for e in events(probe) if e["event"] == "step")
    steps = max(100, int(a.minutes * 60 / step_s))
    base = ["--data", str(data), *TINY, "--max-steps", str(steps)]

    clean = root / "clean"
    code, clean_wall = train(clean, [*base, "--out", str(clean)], FT)
    assert code == 0, f"fault-free run failed; see {clean}.log"
    clean_sha = summary(clean)["params_sha256"]
    rows, recoveries, blocks = [], [], [summary(clean)["ckpt_block_s_p50"]]
    rows.append(["none", f"{clean_wall:.0f}", "0", "-", f"{summary(clean)['goodput']:.3f}", "100.0%", "yes"])
    for every in [float(x) for x in a.fault_every.split(",")]:
        out = root / f"faults-every-{every:g}s"
        # Every fault here is recovered from memory, so --ckpt-every auto keeps the fault-free run's interval:
        # disk checkpoints are for the failures that lose the nodes (none in this bench).
        faults = [arg for spec in schedule(every, step_s, steps) for arg in ("--inject-fault", spec)]
        code, wall = train(out, [*base, "--out", str(out), *faults], FT)
        if code != 0:
            rows.append([f"every {every:g} s", f"{wall:.0f}", "?", "run failed", "-", "-", "-"])
            continue
        s = summary(out)
        rec = [f["recovered_s"] for f in s["faults"] if f["recovered_s"] is not None]
        recoveries += rec
        blocks.append(s["ckpt_block_s_p50"])
        layers = ", ".join(f"{f['kind']}@{f['step']}:{f['layer']} {f['recovered_s']} s" for f in s["faults"])
        rows.append([f"every {every:g} s", f"{wall:.0f}", str(len(s["faults"])),
                     f"{statistics.median(rec):.1f}" if rec else "-", f"{s['goodput']:.3f}",
                     f"{100 * clean_wall / wall:.1f}%", "yes" if s["params_sha256"] == clean_sha else "NO"])
        print(f"every {every:g}s faults: {layers}", flush=True)
    print(f"workload: {steps} steps (~{a.minutes:g} min fault-free), 2 CPU ranks, checkpoints every 'auto' steps")
    print(table(rows, ["faults", "wall s", "faults", "recovery p50 s", "accounted goodput",
                       "goodput = clean/faulted", "same weights"]))
    recovery = statistics.median(recoveries) if recoveries else 10.0
    proj = project(16384, LLAMA3_FAILURES_PER_GPU_HOUR, ckpt_block_s=statistics.median(blocks),
                   recovery_s=recovery, job_ckpt_block_s=60.0, job_recovery_s=600.0, job_hours=24.0)
    print("\nprojection, 16,384 GPUs at Llama 3's rate (419 interruptions / 54 days), measured costs here "
          f"(block {statistics.median(blocks):.3f} s, recovery {recovery:.1f} s); baselines: job-level restart "
          "(60 s sync checkpoints, 600 s to reschedule and reload) and restart from scratch (24 h job):")
    print(json.dumps(proj, indent=1))


if __name__ == "__main__":
    main()
