"""Goodput under faults: a fixed workload run fault-free and with one fault in every F seconds of its
fault-free time (in the middle of each; kinds in turn: hang, kill, exception, the costliest first; ranks
in turn), all layers on (``--restart-layers both`` under ft_launcher). Goodput = fault-free wall time /
faulted wall time, side by side in one invocation; the faulted runs' own accounting (summary.json) is
printed too. Then the projection to a 16,384-GPU job at Llama 3's failure rate, from the costs measured
here.

On a shared machine the speed of the steps drifts by more than the 1% a fault may cost: 10-15% between
minutes of one run, and the host's load can halve or double it from one run to the next. So the
fault-free run is made twice, first and last, to show that spread, and each fault's cost is also measured
in the faulted run's own timeline, where the speed is that of the same minute: the wall time from the
last completion of the step it resumed from, before the fault, to the completion of the step WINDOW_S
seconds of work later, after recovery, minus that much work at the median pace of the steps just before
the fault and just after that window. Detection, restart, redone steps and the slower steps after a
restart (most likely its checkpoint writers starting up) count. The same measure at the same steps of the fault-free
runs, where nothing happened, shows its noise. Goodput (local) = 1 - the faults' summed cost / the
faulted run's wall time.

The projection splits the failures: Llama 3's share of hardware interruptions (``--node-loss-share``) lose
a node, recovered in ``--node-recovery-s`` (a replacement joining: ``bench/node_loss.py`` measures it) from the
peer's copy of its memory snapshot (half the snapshot interval redone on average), and side by side from the
checkpoint (half a checkpoint interval) as without peer copies; the rest at the recovery measured here.

The model is small (0.1M parameters), so it runs under DDP, as the trainer advises for small models
(``--parallel fsdp`` measures FSDP2, whose DTensor bookkeeping is most of a step this small on CPU and
whose caches are cold in every process an in-job restart starts). Memory snapshots every 0.25 s: about 7
steps here (on a GPU, with steps of seconds, the default 1 s is a snapshot every step). The rank monitor's
step timeout is the one NVRx learns from the run's own steps (safety factor x the longest of the first
20) with a 1 s floor, far above this workload's longest steps.

    python bench/goodput.py --minutes 10 --fault-every 300,60     # ~50 minutes on 2 cores
    python bench/goodput.py --minutes 4 --fault-every 60          # a quicker look
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from _runs import WORKDIR_HELP, dataset, events, summary, table, train, workdir

from trainer.events import Event
from trainer.goodput import LLAMA3_FAILURES_PER_GPU_HOUR, LLAMA3_NODE_LOSS_SHARE, project
from trainer.launch import LaunchConfig

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--log-every", "500", "--ckpt-every", "auto", "--ckpt-keep", "2", "--ft-min-step-timeout-s", "1"]
# A hung rank cannot honour SIGTERM and survivors have nothing to finish: a short stop grace.
FT = LaunchConfig(nproc_per_node=2, max_restarts=100, step_timeout_s=5.0, workload_check_interval_s=0.5,
                  monitor_interval_s=0.1, workers_stop_timeout_s=0.1)
KINDS = ("hang", "kill", "exception")


def schedule(every_s: float, step_s: float, steps: int, world_size: int = 2) -> list[str]:
    """``--inject-fault`` specs: one fault in the middle of every ``every_s`` seconds of fault-free time."""
    at = [round((k + 0.5) * every_s / step_s) for k in range(math.ceil(steps * step_s / every_s))]
    return [f"{KINDS[k % len(KINDS)]}@{step}:{(k + 1) % world_size}" for k, step in enumerate(at) if step < steps]


WINDOW_S = 10.0


def completions(out: Path) -> list[tuple[float, int]]:
    """(wall clock, step) of every step completed, in order (a step redone after a restart appears twice)."""
    return [(e["t"], e["step"]) for e in events(out) if e["event"] == Event.STEP]


def cost_since(done: list[tuple[float, int]], i: int, steps: int, search_from: int) -> float:
    """Wall time from completion ``i`` to the next completion of ``steps`` steps later (searched from
    ``search_from``), minus ``steps`` at the pace around them: the mean of the median step intervals of
    the ``steps`` completions before ``i`` and after the end (both sides, so that a drift cancels)."""
    steps = min(steps, done[-1][1] - done[i][1])    # a fault near the end of the run: up to its last step
    end = next(k for k in range(search_from, len(done)) if done[k][1] == done[i][1] + steps)
    sides = [range(max(1, i - steps + 1), i + 1), range(end + 1, min(len(done), end + 1 + steps))]
    pace = statistics.mean(statistics.median(done[k][0] - done[k - 1][0] for k in side) for side in sides if side)
    return done[end][0] - done[i][0] - steps * pace


def fault_costs(out: Path, step_s: float) -> list[tuple[dict, int, float]]:
    """(fault event, step resumed from, cost in seconds) of every fault of a run, from its own timeline."""
    done, steps = completions(out), round(WINDOW_S / step_s)
    result = []
    for fault in (e for e in events(out) if e["event"] == Event.FAULT_INJECTED):
        after = next(k for k, (t, _) in enumerate(done) if t > fault["t"])   # the first step after recovery
        resumed = done[after][1] - 1
        before = max(k for k in range(after) if done[k][1] == resumed)       # its completion before the fault
        result.append((fault, resumed, cost_since(done, before, steps, after)))
    return result


def null_cost(out: Path, resumed: int, step_s: float) -> float:
    """The same measure at the same step of a run without faults (0 but for the machine's noise)."""
    done, steps = completions(out), round(WINDOW_S / step_s)
    i = next(k for k, (_, step) in enumerate(done) if step == resumed)
    return cost_since(done, i, steps, i)


def median_step_s(out: Path) -> float:
    return statistics.median(e["step_s"] for e in events(out) if e["event"] == Event.STEP)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the fault-free workload")
    p.add_argument("--fault-every", default="300,60", help="comma-separated seconds between faults")
    p.add_argument("--parallel", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--memory-snapshot-every-s", default="0.25")
    p.add_argument("--node-loss-share", type=float, default=LLAMA3_NODE_LOSS_SHARE,
                   help="projection: share of failures that lose a node (default: Llama 3's hardware share)")
    p.add_argument("--node-recovery-s", type=float, default=20.0,
                   help="projection: node loss to first resumed step (bench/node_loss.py: 17.6 s here, peer copy)")
    p.add_argument("--workdir", type=Path, default=None, help=WORKDIR_HELP + "; a new one (an old one resumes runs)")
    a = p.parse_args()
    with workdir(a.workdir, "bench-goodput-") as root:
        _bench(a, root)


def _bench(a: argparse.Namespace, root: Path) -> None:
    data = dataset(root)
    model = [*TINY, "--parallel", a.parallel, "--memory-snapshot-every-s", a.memory_snapshot_every_s]

    # Size the workload: time a short probe run, then scale the steps to the requested minutes.
    probe = root / "probe"
    train(probe, ["--data", str(data), *model, "--out", str(probe), "--max-steps", "200"], FT)
    # The median step, not the mean: the probe's first steps share the CPU with NVRx's writer starting up.
    step_s = median_step_s(probe)
    steps = max(100, int(a.minutes * 60 / step_s))
    base = ["--data", str(data), *model, "--max-steps", str(steps)]

    def run(name: str, faults: list[str]) -> tuple[Path, float] | None:
        out = root / name
        code, wall = train(out, [*base, "--out", str(out), *[x for f in faults for x in ("--inject-fault", f)]], FT)
        if code != 0:
            print(f"{name}: exit code {code}; see {out}.log", flush=True)
            return None
        return out, wall

    clean = run("clean", [])
    assert clean is not None, "the fault-free run failed"
    faulted = {}
    for every in [float(x) for x in a.fault_every.split(",")]:
        # Every fault here is recovered from memory, so --ckpt-every auto keeps the fault-free run's interval:
        # disk checkpoints are for the failures that lose the nodes (none in this bench).
        faulted[every] = run(f"faults-every-{every:g}s", schedule(every, step_s, steps))
    again = run("clean-again", [])
    assert again is not None, "the second fault-free run failed"

    clean_wall, clean_sha = clean[1], summary(clean[0])["params_sha256"]
    header = ["faults", "wall s", "faults", "recovery p50 s", "accounted goodput", "goodput = clean/faulted",
              "fault cost s (local)", "same measure, fault-free runs", "goodput (local)", "same weights"]
    rows, recoveries, blocks = [], [], []
    for label, out, wall in [("none", *clean), ("none, again", *again)]:
        s = summary(out)
        blocks.append(s["ckpt_block_s_p50"])
        rows.append([label, f"{wall:.0f}", "0", "-", f"{s['goodput']:.3f}", f"{100 * clean_wall / wall:.1f}%",
                     "-", "-", "-", "yes" if s["params_sha256"] == clean_sha else "NO"])
    for every, result in faulted.items():
        if result is None:
            rows.append([f"every {every:g} s", "-", "?", "run failed", *["-"] * 6])
            continue
        out, wall = result
        s = summary(out)
        rec = [f["recovered_s"] for f in s["faults"] if f["recovered_s"] is not None]
        recoveries += rec
        blocks.append(s["ckpt_block_s_p50"])
        costs = fault_costs(out, step_s)
        nulls = [sum(null_cost(o, resumed, step_s) for _, resumed, _ in costs) for o, _ in (clean, again)]
        lost = sum(c for _, _, c in costs)
        rows.append([f"every {every:g} s", f"{wall:.0f}", str(len(s["faults"])),
                     f"{statistics.median(rec):.1f}" if rec else "-", f"{s['goodput']:.3f}",
                     f"{100 * clean_wall / wall:.1f}%", f"{lost:.1f}", " / ".join(f"{n:+.1f}" for n in nulls),
                     f"{100 * (1 - lost / wall):.2f}%", "yes" if s["params_sha256"] == clean_sha else "NO"])
        each = ", ".join(f"{f['kind']}@{f['step']}:{f['rank']} {c:.2f} s (resumed from {r})" for f, r, c in costs)
        print(f"every {every:g}s, each fault's cost: {each}", flush=True)
    print(f"workload: {steps} steps (~{a.minutes:g} min fault-free), 2 CPU ranks, {a.parallel}, checkpoints every "
          f"'auto' steps, memory snapshots every {a.memory_snapshot_every_s} s; step p50 "
          f"{1e3 * median_step_s(clean[0]):.1f} / {1e3 * median_step_s(again[0]):.1f} ms in the fault-free runs")
    print(table(rows, header))
    recovery = statistics.median(recoveries) if recoveries else 10.0
    proj = project(16384, LLAMA3_FAILURES_PER_GPU_HOUR, ckpt_block_s=statistics.median(blocks),
                   recovery_s=recovery, job_ckpt_block_s=60.0, job_recovery_s=600.0, job_hours=24.0,
                   node_loss_share=a.node_loss_share, snapshot_every_s=float(a.memory_snapshot_every_s),
                   node_recovery_s=a.node_recovery_s)
    print("\nprojection, 16,384 GPUs at Llama 3's rate (419 interruptions / 54 days), measured costs here "
          f"(block {statistics.median(blocks):.3f} s, recovery {recovery:.1f} s); {100 * a.node_loss_share:.0f}% of "
          f"the failures lose a node ({a.node_recovery_s:g} s to recover; from the peer copy, snapshots every "
          f"{a.memory_snapshot_every_s} s, or from the checkpoint: ours_without_peer); baselines: job-level restart "
          "(60 s sync checkpoints, 600 s to reschedule and reload) and restart from scratch (24 h job):")
    print(json.dumps(proj, indent=1))


if __name__ == "__main__":
    main()
