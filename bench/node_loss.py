"""Node loss: time from the loss to the first resumed step, and steps redone, side by side in one invocation.

Two nodes of one CPU rank each (``trainer.launch.LocalCluster``): once the run is past step LOSS_AT, node 1's
whole process tree is killed and its memory-snapshot directory wiped, and a replacement node is started at
once (what the PyTorchJob's restart policy does with a new pod; here it costs no scheduling or image pull).
The same trainer and workload under:

- ``ft_launcher, FSx checkpoint``: peer copies off (``--no-peer-snapshots``): node 0 still has its memory
  snapshot, node 1's went with the node, so the newest step both have is the last committed checkpoint;
- ``torchrun --max-restarts``: plain torch elastic agents, same rendezvous, same checkpoints, peer copies off;
- ``ft_launcher, peer snapshot``: the trainer's default: each node's janitor keeps the other node's memory
  snapshots (``trainer/peer.py``), and the replacement's ranks restore theirs from node 0's copy;
- ``ft_launcher, peer + warm standby``: the same, with the replacement a third node tree started with the
  others (``LocalCluster(standby=1)``: wrapper, zygote with torch imported, launcher with NVRx imported) that
  waits before the rendezvous and is promoted in the lost node's place (``promote(1)``), so the replacement
  starts no process. What NVRx 0.6+'s hot spares give a cluster (docs/multinode.md).

Overhead: the median step time of fault-free runs with peer copies against runs without, alternated
``--overhead-pairs`` times (this host's load drifts by more than the 2% budget between two runs).

Recovery = node killed -> first training step completed after it; redone = the newest step done before the
loss minus the step the run resumed from. The weights at the end are compared with a fault-free run's. The
loss comes in the steady state, between checkpoints: past step LOSS_AT, once the step-40 checkpoint is committed
and a memory snapshot was taken after it (the first checkpoint's write waits for the writer's boot), and once
the standby waits at its gate. The loss then comes just after a snapshot: the steps redone with the peer copy
show how far the holder's copy lagged, not the average over the snapshot interval (half of it).
Where the seconds went: when each stage ended, from both nodes' launcher logs and the ranks' events.

The nodes' rendezvous drops the lost node after LocalCluster's keep-alive (``trainer.launch.LOCAL_KEEP_ALIVE``,
0.5 s x 3 missed heartbeats) and waiting nodes poll it every ``LOCAL_RDZV_POLL_S`` (0.1 s) unless
``--keep-alive`` / ``--rdzv-poll-s`` name others; ``--keep-alive 5:3 --rdzv-poll-s 1`` is NVRx's own.

    python bench/node_loss.py                        # ~8 minutes on 2 cores
    python bench/node_loss.py --modes standby,fsx    # some of the variants (the fault-free run comes first)
    python bench/node_loss.py --keep-alive 5:3 --rdzv-poll-s 1   # with NVRx's rendezvous timing
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import statistics
import sys
import time
from pathlib import Path

from _runs import WORKDIR_HELP, dataset, events, table, workdir

from trainer.events import Event
from trainer.launch import LOCAL_KEEP_ALIVE, LOCAL_RDZV_POLL_S, LaunchConfig, LocalCluster
from trainer.layout import run_dir, summary_path

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--eval-windows", "16", "--log-every", "5", "--max-steps", "160", "--ckpt-every", "40",
        "--memory-snapshot-every-s", "0.5"]   # SNAPSHOT_EVERY_S
LOSS_AT = 60
CKPT_EVERY = 40
LAUNCH = LaunchConfig(nnodes=2, nproc_per_node=1, max_restarts=3, monitor_interval_s=0.1,
                      workload_check_interval_s=0.1, workers_stop_timeout_s=0.3, join_timeout_s=120)
COLUMNS = {"fsx": "ft_launcher, FSx checkpoint", "torchrun": "torchrun --max-restarts",
           "peer": "ft_launcher, peer snapshot", "standby": "ft_launcher, peer + warm standby"}
PEER_OFF = ("fsx", "torchrun")
SNAPSHOT_EVERY_S = 0.5


class TorchrunCluster(LocalCluster):
    """The same node trees with plain ``torchrun`` as each node's agent (no zygote, no rank monitors)."""

    launcher_modules = ("torch.distributed.run",)

    def command(self, node) -> list[str]:
        launch, i = self.launch, node.index
        return [sys.executable, "-m", self.launcher_modules[0], "--nnodes", str(launch.nnodes),
                "--nproc-per-node", str(launch.nproc_per_node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id,
                "--rdzv-conf", f"is_host={int(i == 0)},join_timeout={launch.join_timeout_s:g}",
                "--max-restarts", str(launch.max_restarts), "--monitor-interval", f"{launch.monitor_interval_s:g}",
                "-m", "trainer", *self.args, "--restart-layers", "injob",
                "--memory-snapshot-dir", str(node.memory_dir)]


def _keep_alive(value: str) -> tuple[float, int]:
    interval, _, attempts = value.partition(":")
    try:
        return float(interval), int(attempts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not INTERVAL_S:ATTEMPTS, e.g. 5:3") from None


def _steady(ev: list[dict]) -> bool:
    """Past LOSS_AT, the step-CKPT_EVERY checkpoint committed, and a memory snapshot taken since."""
    committed = next((e["t"] for e in ev if e["event"] == Event.CKPT_COMMITTED and e["step"] == CKPT_EVERY), None)
    return (committed is not None and any(e["event"] == Event.STEP and e["step"] >= LOSS_AT for e in ev) and
            any(e["event"] == Event.MEMORY_SNAPSHOT and e["t"] > committed for e in ev))


def run(kind: str, root: Path, data: Path, lose: bool, timeout: float, launch: LaunchConfig = LAUNCH,
        name: str | None = None) -> dict:
    out = run_dir(root, name or f"{kind}{'' if lose else '-clean'}")
    args = ["--data", str(data), *TINY, "--out", str(out), *(["--no-peer-snapshots"] if kind in PEER_OFF else [])]
    cluster = (TorchrunCluster if kind == "torchrun" else LocalCluster)(
        launch, args, workdir=out.parent / out.name, standby=int(kind == "standby" and lose))
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {}
    with cluster:
        t0 = time.monotonic()
        cluster.start()
        if lose:
            while not _steady(events(out)) or not cluster.standby_ready():
                if time.monotonic() - t0 > timeout or all(n.proc.poll() is not None for n in cluster.nodes):
                    raise RuntimeError(f"{kind}: the run did not reach step {LOSS_AT}; see {out}/node*.log")
                time.sleep(0.05)
            cluster.kill(1)
            result["lost_at"] = time.time()
            cluster.promote(1) if cluster.standbys else cluster.start(1)
        try:
            result["code"] = cluster.supervise(timeout=timeout)
        except TimeoutError:
            result["code"] = "timeout"
        logs = [n.log for n in cluster.nodes]    # the survivor's, and the replacement's (a standby's own)
    summary = summary_path(out)
    result["sha"] = json.loads(summary.read_text())["params_sha256"] if summary.exists() else None
    ev = events(out)
    result["step_s_p50"] = statistics.median(e["step_s"] for e in ev if e["event"] == Event.STEP and e["step"] > 5)
    if lose:
        before = max(e["step"] for e in ev if e["event"] == Event.STEP and e["t"] <= result["lost_at"])
        loads = [e for e in ev if e["event"] in (Event.CKPT_LOADED, Event.FRESH_START) and e["t"] > result["lost_at"]]
        steps = [e for e in ev if e["event"] == Event.STEP and loads and e["t"] > loads[0]["t"]]
        if loads and steps:
            result.update(recovered_s=steps[0]["t"] - result["lost_at"], redone=before - loads[0]["step"],
                          source=loads[0]["source"] if loads[0]["event"] == Event.CKPT_LOADED else "nothing (step 0)")
        if kind != "torchrun":
            result["timeline"] = timeline(result["lost_at"], ev, *logs)
    return result


_STAMP = re.compile(r"^\[?(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]? (.*)")


def _log_lines(log: Path, since: float) -> list[tuple[float, str]]:
    """(wall time, text) of the lines of a node's log stamped after ``since`` (its launcher's and trainer's
    lines carry the local time to the millisecond)."""
    lines = []
    for line in log.read_text(errors="replace").splitlines():
        if m := _STAMP.match(line):
            t = datetime.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            if t >= since:
                lines.append((t, m[2]))
    return lines


def timeline(lost_at: float, ev: list[dict], survivor_log: Path, replacement_log: Path) -> list[tuple[str, float]]:
    """When each stage of the recovery ended, in seconds after the loss: from both nodes' launcher logs and
    the ranks' events. A stage that left no trace is missing."""
    survivor, replacement = _log_lines(survivor_log, lost_at), _log_lines(replacement_log, lost_at)
    after = [e for e in ev if e["t"] > lost_at]

    def first(lines, *needles):
        return next((t for t, text in lines if any(n in text for n in needles)), None)

    def last_rank(name, key=lambda e: e["t"]):
        found = [key(e) for e in after if e["event"] == name]
        return max(found) if len(found) >= 2 else None      # both ranks

    first_step = next((e["t"] for e in after if e["event"] == Event.STEP), None)
    stages = [
        ("survivor's rank sees the peer gone", first(survivor, "Connection reset", "Connection closed", "fn_ex")),
        ("replacement's launcher asks to join", first(replacement, "attempts to join")),
        ("survivor's agent restarts its workers", first(survivor, "will restart worker group")),
        ("survivor's agent asks to join", first(survivor, "attempts to join")),
        ("round complete (both nodes joined)", max(
            (t for t in (first(survivor, "has joined round"), first(replacement, "has joined round")) if t),
            default=None)),
        ("both ranks started (worker_start)", last_rank(Event.WORKER_START)),
        ("process groups up, restore begins", last_rank(Event.CKPT_LOADED, lambda e: e["t"] - e.get("load_s", 0))),
        ("both ranks restored (ckpt_loaded)", last_rank(Event.CKPT_LOADED)),
        ("first resumed step", first_step),
    ]
    return [(name, round(t - lost_at, 3)) for name, t in stages if t is not None]


def _modes(value: str) -> list[str]:
    modes = value.split(",")
    if unknown := [m for m in modes if m not in COLUMNS]:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}: choose from {', '.join(COLUMNS)}")
    return [m for m in COLUMNS if m in modes]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=None, help=WORKDIR_HELP)
    p.add_argument("--timeout-s", type=float, default=240.0, help="per run")
    p.add_argument("--overhead-pairs", type=int, default=3,
                   help="fault-free runs with peer copies off and on, alternated, for the overhead (default 3)")
    p.add_argument("--modes", type=_modes, default=list(COLUMNS), metavar="MODE,...",
                   help=f"the variants to run, of {','.join(COLUMNS)} (default: all)")
    p.add_argument("--keep-alive", type=_keep_alive, default="{:g}:{}".format(*LOCAL_KEEP_ALIVE),
                   metavar="INTERVAL_S:ATTEMPTS",
                   help="the rendezvous keep-alive of the ft_launcher runs (default %(default)s; NVRx's is 5:3)")
    p.add_argument("--rdzv-poll-s", type=float, default=LOCAL_RDZV_POLL_S,
                   help="how often a waiting node reads the rendezvous state (default %(default)s; NVRx's is 1)")
    a = p.parse_args()
    with workdir(a.workdir, "bench-node-loss-") as root:
        _bench(a, root)


def _bench(a: argparse.Namespace, root: Path) -> None:
    launch = dataclasses.replace(LAUNCH, keep_alive_interval_s=a.keep_alive[0], keep_alive_max_attempts=a.keep_alive[1],
                                 rdzv_poll_interval_s=a.rdzv_poll_s)
    data = dataset(root)
    # Fault-free runs, peer copies off and on, alternated: the first "off" run is the weights' reference.
    clean, p50 = None, {"fsx": [], "peer": []}
    for i in range(a.overhead_pairs):
        for kind in ("fsx", "peer"):
            r = run(kind, root, data, lose=False, timeout=a.timeout_s, launch=launch, name=f"{kind}-clean{i}")
            print(f"fault-free 2-node run, peer copies {'on' if kind == 'peer' else 'off'}: {r}", flush=True)
            clean = clean or r
            p50[kind].append(r["step_s_p50"])
            if r["sha"] != clean["sha"]:
                raise SystemExit(f"fault-free runs ended with different weights: {r['sha']} != {clean['sha']}")
    measured = {}
    for kind in a.modes:
        measured[kind] = r = run(kind, root, data, lose=True, timeout=a.timeout_s, launch=launch)
        print(f"{COLUMNS[kind]}: {r}", flush=True)
    base = measured.get("torchrun", {}).get("recovered_s")
    rows = [["recovery (loss -> first resumed step)"], ["steps redone"], ["resumed from"], ["weights = fault-free"]]
    for kind in a.modes:
        r = measured[kind]
        rec = r.get("recovered_s")
        rows[0].append("failed" if rec is None else
                       f"{rec:.2f} s" + (f" ({rec / base:.2f}x)" if base and kind != "torchrun" else ""))
        rows[1].append(str(r.get("redone", "-")))
        rows[2].append(r.get("source", f"exit {r['code']}"))
        rows[3].append(str(r["sha"] == clean["sha"]) if r["sha"] else "no summary")
    off, on = statistics.median(p50["fsx"]), statistics.median(p50["peer"])
    overhead = on / off
    print(f"\nstep time p50, fault-free, median of {a.overhead_pairs} alternated runs each: {off * 1e3:.1f} ms "
          f"without peer copies, {on * 1e3:.1f} ms with ({overhead:.3f}x; runs: "
          f"{', '.join(f'{x * 1e3:.0f}' for x in p50['fsx'])} / {', '.join(f'{x * 1e3:.0f}' for x in p50['peer'])} ms)")
    interval_steps = SNAPSHOT_EVERY_S / off
    print(f"\nnode 1 of 2 lost after step {LOSS_AT} and replaced at once; checkpoint every {CKPT_EVERY} steps, memory "
          f"snapshot every 0.5 s; ft_launcher's keep-alive {a.keep_alive[0]:g} s x {a.keep_alive[1]}, rendezvous "
          f"poll {a.rdzv_poll_s:g} s" + (" (ratio to torchrun)" if base else ""))
    print(table(rows, ["", *(COLUMNS[k] for k in a.modes)]))
    traced = [k for k in a.modes if measured[k].get("timeline")]
    if traced:
        print("\nwhere the seconds went: when each stage ended, s after the loss (+ s since the previous stage)")
        names = list(dict.fromkeys(name for k in traced for name, _ in measured[k]["timeline"]))
        stages = {k: dict(measured[k]["timeline"]) for k in traced}
        cells = {k: _deltas(measured[k]["timeline"]) for k in traced}
        print(table([[name, *(f"{stages[k][name]:.2f} (+{cells[k][name]:.2f})" if name in stages[k] else "-"
                              for k in traced)] for name in names], ["stage", *(COLUMNS[k] for k in traced)]))
    standby = measured.get("standby", {}).get("recovered_s")
    redone = {k: measured[k].get("redone") for k in ("peer", "standby") if k in measured}
    recovery = ("not run" if "standby" not in a.modes else "failed" if standby is None else
                f"{standby:.2f} s with peer + warm standby, {'met' if standby <= 5 else 'not met'}")
    redone_cells = ", ".join(f"{'failed' if v is None else v} steps ({COLUMNS[k]})" for k, v in redone.items())
    print(f"\ngoals: recovery <= 5 s: {recovery}; redone <= the snapshot interval ({SNAPSHOT_EVERY_S:g} s, "
          f"{interval_steps:.1f} steps) with the peer copy: {redone_cells or 'not run'}; step time with peer "
          f"copies <= 1.02x: {overhead:.3f}x")


def _deltas(stages: list[tuple[str, float]]) -> dict[str, float]:
    """Each stage's time since the latest stage that ended before it (the loss for the first)."""
    out, done = {}, [0.0]
    for name, t in sorted(stages, key=lambda s: s[1]):
        out[name] = t - max(d for d in done if d <= t)
        done.append(t)
    return out


if __name__ == "__main__":
    main()
