"""Recovery time per fault kind: in-process (NVRx Wrapper), in-job (NVRx ft_launcher, ranks forked warm
from the zygote, and cold with --no-warm-start) and plain ``torchrun --max-restarts``, on the same training
script, side by side in one invocation.

Recovery = fault injected -> first training step completed after recovery (from each run's
``summary.json``). One run per (fault, layer); 2 CPU ranks, a tiny model, a checkpoint every 5 steps,
the fault at step 12. The rank monitor's step timeout is the one NVRx learns from the run's own steps
(safety factor x the longest of the first steady steps, here with a 0.3 s floor); torchrun has no such
monitor, so a hang there lasts until the collective timeout.

    python bench/recovery.py            # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from _runs import WORKDIR_HELP, dataset, summary, table, torchrun, train, workdir

from trainer.launch import LaunchConfig

TINY = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
        "--max-steps", "20", "--ckpt-every", "5", "--log-every", "5",
        "--ft-calc-after-steps", "5", "--ft-min-step-timeout-s", "0.3"]
# Detection latency is bounded by polling: the rank monitor checks its rank and the launcher polls its
# workers every 0.1 s (torchrun too); a surviving worker gets 0.3 s to exit before SIGKILL when the group
# is restarted.
FT = LaunchConfig(nproc_per_node=2, max_restarts=3, workload_check_interval_s=0.1, monitor_interval_s=0.1,
                  workers_stop_timeout_s=0.3)
LAYERS = {
    "in-process": (["--restart-layers", "inprocess", "--inprocess-interval-s", "0.1"], FT, None),
    "in-job": (["--restart-layers", "injob"], FT, None),
    "in-job cold": (["--restart-layers", "injob"], dataclasses.replace(FT, warm_start=False), None),
    "torchrun": (["--restart-layers", "injob"], None, torchrun(2, 3)),
}
COLUMNS = {"in-process": "in-process (Wrapper)", "in-job": "in-job (ft_launcher, warm)",
           "in-job cold": "in-job, --no-warm-start", "torchrun": "torchrun --max-restarts"}
FAULTS = {"exception": ("exception@12:1", ["in-process", "in-job", "torchrun"]),
          "kill": ("kill@12:1", ["in-job", "in-job cold", "torchrun"]),
          "hang": ("hang@12:0", ["in-job", "in-job cold", "torchrun"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=None, help=WORKDIR_HELP)
    p.add_argument("--collective-timeout-s", type=float, default=30.0,
                   help="the trainer's process-group timeout (the only hang detector torchrun has)")
    a = p.parse_args()
    with workdir(a.workdir, "bench-recovery-") as root:
        _bench(a, root)


def _bench(a: argparse.Namespace, root: Path) -> None:
    data = dataset(root)
    measured: dict[tuple[str, str], dict] = {}
    for kind, (spec, layers) in FAULTS.items():
        for layer in layers:
            extra, launch, launcher = LAYERS[layer]
            out = root / f"{kind}-{layer.replace(' ', '-')}"
            args = ["--data", str(data), *TINY, "--out", str(out), "--inject-fault", spec,
                    "--collective-timeout-s", str(a.collective_timeout_s), *extra]
            code, _ = train(out, args, launch=launch, launcher=launcher)
            f = summary(out)["faults"][0] if code == 0 else {}
            measured[(kind, layer)] = f
            print(f"{kind:9s} {layer:10s} exit {code}  recovered {f.get('recovered_s')} s "
                  f"(detected {f.get('detected_s')} s, layer {f.get('layer')})", flush=True)
    rows = []
    for kind, (_, layers) in FAULTS.items():
        base = measured[(kind, "torchrun")].get("recovered_s")
        row = [kind]
        for layer in COLUMNS:
            r = measured.get((kind, layer), {}).get("recovered_s")
            if r is None:
                row.append("n/a" if layer not in layers else "failed")
            else:
                row.append(f"{r:.2f} s" + (f" ({r / base:.2f}x)" if base and layer != "torchrun" else ""))
        rows.append(row)
    print("\nrecovery time, fault -> first completed step after recovery (ratio to torchrun)")
    print(table(rows, ["fault", *COLUMNS.values()]))
    print("\ngoals: in-process <= 1.5 s, in-job kill <= 3 s, hang detection + recovery <= 3 s, each <= 0.5x torchrun")


if __name__ == "__main__":
    main()
