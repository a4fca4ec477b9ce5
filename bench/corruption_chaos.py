"""Corruption chaos as real trainings: per seed, one byte of a copy of the state is flipped between its save and
the restore that needs it, and the run must refuse the copy, restore from the next source, and end with the
fault-free run's weights.

Each seed is a 2-rank ``python -m trainer`` (14 steps, a synchronous checkpoint every 2, every 6 for the peer
copies; memory snapshots as often as they may be taken between them; the S3 mirror on a local moto server) with
``--inject-fault`` set to ``trainer.fault_spec.corruption_fault(seed)``: the target kind in turn (a rank's memory
snapshot, a shard of the newest committed checkpoint, an object of the newest mirrored checkpoint, the copy of a
rank's newest memory snapshot that another node keeps), the step, the rank and the byte drawn from the seed. The
peer copies need two nodes: those seeds run as a ``LocalCluster`` of 2 nodes x 1 rank, the others under NVRx
ft_launcher on one node; both against the same fault-free run (one node, 2 ranks: one thread per rank, the same
weights bit for bit).
Printed per seed: the byte flipped, whether the restore refused it (``checksum_mismatch`` with that source and
step), where it restored from instead, and whether the final ``params_sha256`` is the fault-free run's. Exits 1
unless every seed passed. Needs ``moto[server]`` (the ``test`` extra)::

    python bench/corruption_chaos.py --seeds 20
    python bench/corruption_chaos.py --seeds 5 --kinds corrupt-peer     # one kind (or several, in turn)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from _runs import WORKDIR_HELP, dataset, events, import_from_repo, summary, table, train, workdir

from trainer.fault_spec import CORRUPT_KINDS, corruption_fault
from trainer.faults import corruption_outcome
from trainer.launch import LaunchConfig, LocalCluster

TRAIN = ["--max-steps", "14", "--ckpt-sync", "--memory-snapshot-every-s", "0.01", "--n-layer", "2", "--n-embd", "64",
         "--n-head", "2", "--seq-len", "64", "--batch-size", "8", "--eval-windows", "16"]
RUN = [*TRAIN, "--ckpt-every", "2"]
# A peer copy is restored only when it is newer than the newest checkpoint, and memory snapshots stay 20x their copy
# time apart, counted from the last save (under load a first copy took 40 ms: none fit between checkpoints 2 steps
# apart). Checkpoints 6 steps apart leave room for them.
PEER_RUN = [*TRAIN, "--ckpt-every", "6"]
BUCKET = "ckpt"
# The peer seeds' two nodes: a lost rank's restart is noticed within a step.
NODES = LaunchConfig(nnodes=2, nproc_per_node=1, max_restarts=2, monitor_interval_s=0.1,
                     workload_check_interval_s=0.1, workers_stop_timeout_s=0.3, join_timeout_s=120)


def train_nodes(out: Path, args: list[str], timeout: float = 1800) -> tuple[int | str, float]:
    """Run one training as 2 local nodes of 1 rank to completion; return (exit code, wall seconds). The nodes' logs
    go to ``<out>.nodes/``."""
    logs = out.parent / f"{out.name}.nodes"
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with LocalCluster(NODES, args, workdir=logs) as cluster:
        cluster.start()
        try:
            code = cluster.supervise(timeout=timeout)
        except TimeoutError:
            code = "timeout"
    return code, time.monotonic() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0..N-1")
    parser.add_argument("--kinds", nargs="+", choices=CORRUPT_KINDS, default=list(CORRUPT_KINDS),
                        help="the corrupt-* kinds the seeds take in turn")
    parser.add_argument("--workdir", type=Path, default=None, help=WORKDIR_HELP)
    args = parser.parse_args()
    with workdir(args.workdir, "corruption-chaos-") as work:
        _bench(args, work)


def _bench(args: argparse.Namespace, work: Path) -> None:
    import_from_repo()
    from tests.s3_stand_in import CREDENTIALS, MotoS3

    data = dataset(work)
    # The trainers inherit the credentials of the local S3 (and reach no real one).
    # One thread per rank in every run, as ft_launcher sets for 2 ranks on one node (a LocalCluster would give each
    # node's rank its share of the cores).
    os.environ.update({**CREDENTIALS, "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1",
                       "OMP_NUM_THREADS": "1"})
    with MotoS3() as s3:
        s3.client().create_bucket(Bucket=BUCKET)
        url = s3.url
        launch = LaunchConfig(nproc_per_node=2, max_restarts=2)
        code, _ = train(work / "fault-free", ["--data", str(data), "--out", str(work / "fault-free"), *RUN], launch)
        assert code == 0, f"the fault-free run failed: {work / 'fault-free'}.log"
        clean = summary(work / "fault-free")["params_sha256"]
        rows, passed = [], 0
        for seed in range(args.seeds):
            spec = corruption_fault(seed, world_size=2, kinds=tuple(args.kinds))
            kind = spec.split("@")[0]
            out = work / f"seed-{seed}"
            mirror = ["--ckpt-mirror", f"s3://{BUCKET}/seed-{seed}", "--ckpt-mirror-endpoint-url", url]
            argv = ["--data", str(data), "--out", str(out), *(PEER_RUN if kind == "corrupt-peer" else RUN),
                    *(mirror if kind == "corrupt-mirror" else []), "--inject-fault", spec]
            code, wall = train_nodes(out, argv) if kind == "corrupt-peer" else train(out, argv, launch)
            try:
                o = corruption_outcome(events(out))
            except ValueError:      # the fault never fired
                o = {"target": "(not fired)", "detected": False, "resumed": None, "fell_back": False}
            equal = code == 0 and summary(out)["params_sha256"] == clean
            ok = equal and o["detected"] and o["fell_back"]
            passed += ok
            resumed = "-" if o["resumed"] is None else f"{o['resumed'][0]} step {o['resumed'][1]}"
            rows.append([seed, spec, o["target"], "yes" if o["detected"] else "NO", resumed,
                         "yes" if equal else f"NO (exit {code})", f"{wall:.0f}"])
            print(f"seed {seed}: {rows[-1]}", flush=True)
    print()
    print(table(rows, ["seed", "fault", "target", "detected", "restored from", "final sha equal", "wall s"]))
    print(f"\n{passed}/{len(rows)} seeds: the corrupted copy refused, restored from the next source, and the final "
          f"params_sha256 the fault-free run's ({clean[:16]})")
    sys.exit(0 if passed == len(rows) else 1)


if __name__ == "__main__":
    main()
