"""Stress drill of the first-save hold: does a held checkpoint hold the state it was meant to?

Each round starts a checkpoint manager whose writer boots (a fresh NVRx worker), saves step 1 while the
worker boots (held with ``--hold``, as 0.6/0.7 do; handed over at once without), then runs "steps" that
change the live state the way an optimizer step does (in place, at the top of each step the writer is
asked to finalize and hand over), and ends with a blocking final save of a later step, as the end of
training does. Every checkpoint written is then read back and compared, tensor by tensor, with the state
it was meant to hold. Rounds run in ``--procs`` processes at once (each its own gloo group of one rank),
on top of whatever else loads the machine.

    python bench/hold_drill.py --rounds 20 --procs 2 --hold     # the hold path, as on 0.6/0.7
    python bench/hold_drill.py --rounds 20 --procs 2             # the installed release's own path

Prints runs and mismatches (checkpoints whose bytes differ from the state saved), and for a mismatch which
tensors, and whether the checkpoint would have loaded (its checksums verified).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import tempfile
import time
from pathlib import Path


def _state(step: int, n: int = 24) -> dict:
    import torch

    g = torch.Generator().manual_seed(step)
    model = {f"w{i}": torch.randn(96, 96, generator=g) for i in range(n)}
    optim = {f"m{i}": torch.randn(96, 96, generator=g) for i in range(n)}
    return {"model": model, "optim": {"exp_avg": optim, "step": torch.tensor(float(step))},
            "train": {"step": step}}


def _clone(state):
    import torch

    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    return state


def _mutate(state, by: float) -> None:
    """What an optimizer step does to the live state: every tensor changed in place."""
    for t in [*state["model"].values(), *state["optim"]["exp_avg"].values()]:
        t.add_(by)
    state["optim"]["step"].add_(1)


def _diff(expected, got, prefix="") -> list[str]:
    import torch

    if isinstance(expected, torch.Tensor):
        return [] if torch.equal(expected, got) else [prefix]
    if isinstance(expected, dict):
        return [d for k in expected for d in _diff(expected[k], got[k], f"{prefix}.{k}" if prefix else k)]
    return [] if expected == got else [prefix]


def _round(root: Path, hold: bool, steps_between: int) -> list[tuple[int, list[str], bool]]:
    """One round; returns (step, differing tensors, loads) for each checkpoint that differs."""
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import CheckpointManager, step_dir
    from trainer.config import CheckpointConfig
    from trainer.events import EventLog
    from trainer.layout import events_path
    from trainer.parallel import Dist

    d = Dist(0, 1, 0, torch.device("cpu"))
    mgr = CheckpointManager(root / "ckpt", CheckpointConfig(), d, EventLog(events_path(root), 0))
    mgr.writer.holds_while_booting = hold
    expected = {}
    try:
        mgr.start_writer()
        live = _state(1)
        mgr.save(1, live)
        mgr.finish_snapshot()
        expected[1] = _clone(live)
        for i in range(steps_between):
            _mutate(live, 1.0)          # the optimizer step after the save
            mgr.maybe_finalize()        # the top of the next step
            time.sleep(0.01)            # its forward and backward
        final = 2 + steps_between
        mgr.save(final, live, blocking=True)
        expected[final] = _clone(live)
        mgr.wait()
    finally:
        mgr.close()
    bad = []
    for step, want in expected.items():
        got = _clone(_state(0))
        got["train"]["step"] = -1
        dcp.load(got, checkpoint_id=str(step_dir(root / "ckpt", step)))
        diff = _diff(want, got)
        if diff:
            bad.append((step, diff, _would_load(step_dir(root / "ckpt", step), got)))
    return bad


def _would_load(path: Path, loaded: dict) -> str:
    """Whether a restore would use this checkpoint: its checksums (where the trainer records them) verified."""
    try:
        from trainer.checkpoint.integrity import ChecksumMismatch, verify_loaded
    except ImportError:
        return "LOADED (no checksums)"
    try:
        verify_loaded(path, loaded, rank=0)
    except ChecksumMismatch:
        return "refused by its checksums"
    return "LOADED (checksums matched)"


def _worker(args) -> tuple[int, list]:
    rounds, hold, steps_between, seed = args
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    found = []
    done = 0
    for r in range(rounds):
        with tempfile.TemporaryDirectory(prefix="hold-drill-") as tmp:
            bad = [(seed, r, *b) for b in _round(Path(tmp), hold, steps_between + (r % 3))]
        found += bad
        done += 1
        print(f"proc {seed} round {r}: {len(bad)} mismatches", flush=True)   # counts survive a cut-off run
    dist.destroy_process_group()
    return done, found


def _report(out, args) -> None:
    out.put(_worker(args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="rounds per process")
    p.add_argument("--procs", type=int, default=2, help="processes running rounds at once")
    p.add_argument("--hold", action="store_true", help="hold saves while the writer boots (0.6/0.7's path)")
    p.add_argument("--steps-between", type=int, default=2, help="steps between the held save and the final one")
    a = p.parse_args()
    t0 = time.monotonic()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_report, args=(out, (a.rounds, a.hold, a.steps_between, i))) for i in range(a.procs)]
    for proc in procs:
        proc.start()
    results = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    runs = sum(r[0] for r in results)
    bad = [b for r in results for b in r[1]]
    print(f"hold={a.hold}: {runs} rounds ({2 * runs} checkpoints), {len(bad)} mismatches, "
          f"{time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}")
    for seed, r, step, diff, loads in bad:
        print(f"  proc {seed} round {r} step {step}: {len(diff)} tensors differ ({', '.join(diff[:4])}...); "
              f"{loads}")


if __name__ == "__main__":
    main()
