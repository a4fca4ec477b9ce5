"""The GPU path end to end: FSDP2 on NCCL, NVRx async checkpoints with CUDA copies, the CUDA health
check of the in-process restart, the node-memory replica of CUDA state, in-job restarts, exact resume.

Three runs of the same training under ft_launcher, one rank per GPU on this node:

- ``clean``: NVRx async checkpoints;
- ``sync``: the same with synchronous torch DCP saves. It is the blocking baseline, and since checkpoint
  writing does not touch the training math, its weights equal ``clean``'s exactly when this GPU stack is
  deterministic run to run;
- ``faults``: ``clean`` plus an exception (in-process restart), a SIGKILL (in-job restart) and a hang
  (the rank monitor kills it, in-job restart). Its weights must equal ``clean``'s where ``sync``'s do;
- ``straggler``: ``clean`` with NVRx's straggler detection (``--straggler-report-s``); from 40% of the
  steps on, another process runs matrix products on the last rank's GPU, which slows that rank's kernels:
  rank 0 must report it in a ``straggler`` event (on one GPU against its own earlier speed, the individual
  score; with several, against the others too).

It prints each run's checkpoint blocking, its memory snapshots' holds, the async/sync ratio, each fault's
recovery and layer, the straggler reports, and whether the weights match. Run it on a GPU node (CPU works
too, with gloo, as a smoke test)::

    python bench/gpu_check.py                      # ~3 minutes on one H200
    python bench/gpu_check.py --n-layer 2 --n-embd 64 --steps 60 --ckpt-every 10   # a CPU smoke test
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _runs import WORKDIR_HELP, dataset, events, summary, table, train, workdir

from trainer.events import Event
from trainer.launch import LaunchConfig
from trainer.layout import checkpoints_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--timeout", type=float, default=240, help="seconds per run")
    p.add_argument("--runs", default="clean,sync,faults,straggler", help="which of the runs, comma-separated")
    p.add_argument("--straggler-report-s", type=float, default=5.0, help="the straggler run's report interval")
    p.add_argument("--workdir", type=Path, default=None, help=WORKDIR_HELP)
    a = p.parse_args()
    if torch.cuda.is_available():
        # In a process of its own: NVRx's launcher (0.6+) waits before every restart, up to 50 s, until the
        # GPU's used memory is below 512 MB, and this process's CUDA memory would count.
        copier = multiprocessing.get_context("spawn").Process(target=copy_rates)
        copier.start()
        copier.join()
    with workdir(a.workdir, "bench-gpu-") as root:
        _bench(a, root)


def _bench(a: argparse.Namespace, root: Path) -> None:
    nproc = max(1, torch.cuda.device_count())
    common = ["--data", str(dataset(root)), "--n-layer", str(a.n_layer), "--n-embd", str(a.n_embd),
              "--n-head", str(a.n_head), "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
              "--max-steps", str(a.steps), "--ckpt-every", str(a.ckpt_every), "--ckpt-keep", "2",
              "--log-every", "50", "--ft-calc-after-steps", "10", "--ft-min-step-timeout-s", "2"]
    at = [a.steps * k // 10 for k in (3, 5, 7)]
    faults = [f"exception@{at[0]}", f"kill@{at[1]}", f"hang@{at[2]}"]
    runs = {"clean": [], "sync": ["--ckpt-sync"], "faults": [x for f in faults for x in ("--inject-fault", f)],
            "straggler": ["--straggler-report-s", str(a.straggler_report_s)]}
    launch = LaunchConfig(nproc_per_node=nproc, max_restarts=3, workload_check_interval_s=0.25,
                          monitor_interval_s=0.2, workers_stop_timeout_s=2.0)
    rows, sha, block_p50 = [], {}, {}
    for name in a.runs.split(","):
        extra = runs[name]
        out = root / name
        slowed = nproc - 1 if name == "straggler" and torch.cuda.is_available() else None
        with _gpu_hog(out, device=slowed, after_step=a.steps * 4 // 10):
            code, wall = train(out, [*common, "--out", str(out), *extra], launch, timeout=a.timeout)
        if code != 0:
            print(f"{name}: exit {code}; log: {out}.log")
            print((Path(f"{out}.log")).read_text()[-4000:])
            continue
        s, log = summary(out), events(out)
        blocks = [e["block_s"] for e in log if e["event"] == Event.CKPT_SNAPSHOT and e["step"] < a.steps]
        steps = [e["step_s"] for e in log if e["event"] == Event.STEP and e["step"] > 5]
        copies = [e["copy_s"] for e in log if e["event"] == Event.MEMORY_SNAPSHOT]
        # The loop's hold per memory snapshot: the first two (one per slot: a slot's first copy used to
        # page-lock it on the loop), then the p50 of the others.
        memory = [e["block_s"] * 1e3 for e in log if e["event"] == Event.MEMORY_SNAPSHOT and not e.get("owed")]
        ckpt_copies = [e["copy_s"] for e in log if e["event"] == Event.CKPT_SNAPSHOT and "copy_s" in e]
        ckpts = checkpoints_dir(out).glob("step_*")
        state_gb = max((sum(f.stat().st_size for f in d.glob("*.distcp")) for d in ckpts), default=0) / nproc / 1e9
        loads = [(e["source"], e["step"]) for e in log if e["event"] == Event.CKPT_LOADED]
        sha[name] = s["params_sha256"]
        if blocks:
            block_p50[name] = statistics.median(blocks)
        rows.append([name, f"{wall:.1f}", f"{statistics.median(steps) * 1e3:.1f}" if steps else "-",
                     f"{statistics.median(blocks) * 1e3:.1f}" if blocks else "-",
                     f"{max(blocks) * 1e3:.1f}" if blocks else "-",
                     _memory_holds(memory),
                     s["final_val_loss"], s["goodput"],
                     f"{state_gb:.2f}", _rate(state_gb, copies), _rate(state_gb, ckpt_copies),
                     sha[name][:12], " ".join(f"{src}@{st}" for src, st in loads) or "-"])
        for f in s["faults"]:
            print(f"  {name}: {f['kind']}@{f['step']} rank {f['rank']}: detected {f.get('detected_s')} s, "
                  f"recovered {f.get('recovered_s')} s by {f.get('layer')}")
        if name == "straggler":
            _print_stragglers(log, slowed)
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
          f"{nproc} rank(s), torch {torch.__version__}")
    print(table(rows, ["run", "wall s", "step ms p50", "ckpt block ms p50", "max",
                       "memory hold ms: first two / p50 (n)", "val loss", "goodput",
                       "state GB/rank", "replica copy GB/s", "ckpt copy GB/s", "params sha", "loads"]))
    if "clean" in block_p50 and "sync" in block_p50:
        print(f"checkpoint blocking, async/sync (p50): 1/{block_p50['sync'] / block_p50['clean']:.0f}")
    if "clean" in sha and "sync" in sha:
        print(f"weights clean == sync (deterministic stack): {sha['clean'] == sha['sync']}")
    if "clean" in sha and "faults" in sha:
        print(f"weights faults == clean: {sha['clean'] == sha['faults']}")
    if "clean" in sha and "straggler" in sha:
        print(f"weights straggler == clean (detection changes no math): {sha['clean'] == sha['straggler']}")


# Runs on the slowed rank's GPU (its own CUDA context, time-sliced with the rank's): as a throttled or shared GPU.
_HOG = "import torch\nx = torch.randn(8192, 8192, device='cuda')\nwhile True:\n    x @ x\n"


class _gpu_hog:
    """While the block runs: once ``out``'s training has logged ``after_step``, a process of matrix products
    on GPU ``device`` (None: nothing)."""

    def __init__(self, out: Path, device: int | None, after_step: int):
        self.out, self.device, self.after_step = out, device, after_step
        self.done, self.proc = threading.Event(), None
        self.watch = threading.Thread(target=self._start_when_due, daemon=True)

    def __enter__(self):
        if self.device is not None:
            self.watch.start()
        return self

    def _start_when_due(self) -> None:
        while not self.done.wait(0.5):
            if any(e["event"] == Event.STEP and e["step"] >= self.after_step for e in events(self.out)):
                self.proc = subprocess.Popen([sys.executable, "-c", _HOG], start_new_session=True,
                                             env={**os.environ, "CUDA_VISIBLE_DEVICES": str(self.device)})
                print(f"  straggler: matrix products on GPU {self.device} from step {self.after_step}")
                return

    def __exit__(self, *exc):
        self.done.set()
        if self.watch.is_alive():
            self.watch.join()
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _print_stragglers(log: list[dict], slowed: int | None) -> None:
    reports = [e for e in log if e["event"] == Event.STRAGGLER]
    for e in reports:
        print(f"  straggler event at step {e['step']}: ranks {e['ranks']} on {e['nodes']}, "
              f"relative {e['relative']}, individual {e['individual']}")
    if slowed is None:
        print("  straggler: no GPU, detection is off (the run's log says why)")
    else:
        print(f"  straggler: slowed rank {slowed} reported: {any(slowed in e['ranks'] for e in reports)}")


def copy_rates(gb: float = 2.0) -> None:
    """Device-to-host copy speed into a replica slot (a /dev/shm mapping) as ``trainer.checkpoint.replica`` leaves it
    (page-locked with cudaHostRegister), into the same kind of mapping left pageable, and into pinned memory."""
    from trainer.checkpoint.replica import NodeReplica

    src = torch.randn(int(gb * 1e9) // 4, device="cuda")
    shm = Path(tempfile.mkdtemp(prefix="goodput-", dir="/dev/shm"))
    locked, pageable = NodeReplica(shm / "locked", 0, pin=True), NodeReplica(shm / "pageable", 0)
    t0 = time.monotonic()
    slot = locked.buffer({"x": src}, 0)["x"]
    print(f"replica slot of {gb:g} GB mapped and registered in {time.monotonic() - t0:.2f} s "
          f"(page-locked: {locked.pinned[0] is not None})")
    targets = {"replica slot (registered)": slot, "pinned (torch)": torch.empty_like(src, device="cpu").pin_memory(),
               "pageable mapping": pageable.buffer({"x": src}, 0)["x"]}
    for name, dst in targets.items():
        dst.copy_(src)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        print(f"  device-to-host into {name}: {3 * gb / (time.monotonic() - t0):.1f} GB/s")
    locked.discard()
    pageable.discard()
    shutil.rmtree(shm, ignore_errors=True)


def _memory_holds(ms: list[float]) -> str:
    """The first two memory snapshots' holds, then the p50 of the others and how many."""
    first = " ".join(f"{m:.1f}" for m in ms[:2]) or "-"
    return f"{first} / {statistics.median(ms[2:]):.1f} ({len(ms) - 2})" if len(ms) > 2 else first


def _rate(gb: float, seconds: list[float]) -> str:
    """GB/s of the median device-to-host copy of one rank's state."""
    return f"{gb / statistics.median(seconds):.1f}" if seconds and gb and statistics.median(seconds) > 0 else "-"


if __name__ == "__main__":
    main()
