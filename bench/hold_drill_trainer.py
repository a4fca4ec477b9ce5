"""Stress drill of the first-save hold on the real trainer: does every committed checkpoint hold its step's state?

Each round is the run in which a held write once committed wrong values (docs/nvrx.md): ``goodput train``
under ft_launcher, 2 ranks (gloo, FSDP2), 14 steps, a checkpoint every 4, an exception at step 5 on rank 1
(in-process restart) and a SIGKILL at step 9 on rank 0 (in-job restart), with the rank's writer holding a
save while its worker boots on every release (``bench/_drill_site``: the path 0.6/0.7 take, and 0.4.1 took
when the fault was seen), ``--busy`` busy loops on the cores meanwhile. Every checkpoint is kept. After each
round every committed checkpoint is loaded and compared, chunk by chunk (each rank's shard), with the state
the same step has in a reference run of the same code without faults that checkpoints every step
synchronously (training resumes exactly, so the states match step for step; the round's final
``params_sha256`` against the reference's says whether it resumed from a wrong one).

    python bench/hold_drill_trainer.py --rounds 10                              # this checkout, installed NVRx
    python bench/hold_drill_trainer.py --rounds 10 --code /path/to/other/checkout
    python bench/hold_drill_trainer.py --rounds 10 --nvrx-tree T/0.6.0 --nvrx-deps T/deps-0.6

``--second-job-after 1,4``: each round also starts a second job of the same round in the same run directory,
1 s after the first in even rounds and 4 s in odd ones (one job holds a run directory since
``trainer/runlock.py``: the second is refused there; run with ``--code`` on older code).

``--nvrx-tree``: a release's pure-Python tree from its wheel (as tests/data/nvrx/README.md extracts it),
first on PYTHONPATH with ``--nvrx-deps`` after it; the release's version is read from its dist-info.
Prints a line per round and the counts: rounds, checkpoints checked, mismatched checkpoints (and which
rank's shard, which tensors), rounds whose held write was handed over, final weights other than the reference,
and the races between the live state and a save that reads it, by kind, of the checks made (``bench/_drill_site``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from trainer import layout
from trainer.events import Event, read_events

HERE = Path(__file__).resolve().parent
MODEL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--seq-len", "64", "--batch-size", "8",
         "--eval-windows", "16", "--ckpt-keep", "100"]
INTERRUPTS = ((4, 1), (8, 0), (11, 1), (15, 0), (19, 1), (23, 0), (26, 1))   # (step, rank) of each exception
# (its steps, the round's checkpointing and faults)
SCENARIOS = {
    # the run of docs/nvrx.md in which the fault was seen: each start's first save held (steps 4 and 12)
    "restarts": (14, ["--ckpt-every", "4", "--inject-fault", "exception@5:1", "--inject-fault", "kill@9:0"]),
    # checkpoints due while the first write waits for the boot: owed memory copies, written once it is warm
    # (CheckpointManager.save_owed) or superseded
    "owed": (40, ["--ckpt-every", "6", "--inject-fault", "kill@33:0"]),
    # in-process restarts one after another: each lands the Wrapper's asynchronous exception on the other rank
    # wherever its main thread is, the writer's bookkeeping (hand-over, finalize) included
    "interrupts": (30, ["--ckpt-every", "3", *(arg for step, rank in INTERRUPTS
                                               for arg in ("--inject-fault", f"exception@{step}:{rank}"))]),
}
REFERENCE = ["--ckpt-every", "1", "--ckpt-sync"]


def _env(code: Path, tree: Path | None, deps: Path | None, hold: bool, watch: Path | None = None) -> dict:
    path = [str(HERE / "_drill_site"), *([str(tree)] if tree else []), *([str(deps)] if deps else []), str(code)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONWARNINGS": "ignore",
           "GOODPUT_DRILL_HOLD": "1" if hold else "0", "GOODPUT_DRILL_WATCH": str(watch or "")}
    if tree:
        (info,) = tree.glob("nvidia_resiliency_ext-*.dist-info")
        env["GOODPUT_NVRX_VERSION"] = info.name.removesuffix(".dist-info").split("-")[1]
    return env


def _start(out: Path, steps: int, args: list[str], env: dict, log: str = "log") -> subprocess.Popen:
    with open(f"{out}.{log}", "wb") as f:
        return subprocess.Popen(["goodput", "train", "--nproc", "2", "--max-restarts", "2", "--restart-layers",
                                 "both", *MODEL, "--max-steps", str(steps), *args, "--out", str(out)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        return -9


def _train(out: Path, steps: int, args: list[str], env: dict, timeout: float) -> int:
    return _wait(_start(out, steps, args, env), timeout)


def _committed(out: Path) -> dict[int, Path]:
    root = layout.checkpoints_dir(out)
    return {step: layout.step_dir(root, step) for step in layout.committed_steps(root)}


def _chunks(path: Path) -> dict:
    """{(fqn, chunk offsets): (rank whose file holds it, tensor)} of a checkpoint, read without a process group."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    tmp = path.parent / f".{path.name}.pt"
    dcp_to_torch_save(str(path), str(tmp))
    full = torch.load(tmp, weights_only=False)
    tmp.unlink()
    meta = FileSystemReader(str(path)).read_metadata()
    flat = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        else:
            flat[prefix] = v

    walk("", full)
    out = {}
    for fqn, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        tensor = flat[fqn]
        for c in md.chunks:
            part = tensor
            for dim, (o, s) in enumerate(zip(c.offsets, c.sizes)):
                part = part.narrow(dim, o, s)
            file = meta.storage_data[MetadataIndex(fqn, c.offsets)].relative_path   # __<rank>_<n>.distcp
            out[(fqn, tuple(c.offsets))] = (int(file.split("_")[2]), part)
    return out


def _compare(got: Path, want: Path) -> dict[int, list[str]]:
    """{rank: tensors (chunks) of its shard whose values differ from the reference's same step}."""
    import torch

    a, b = _chunks(got), _chunks(want)
    bad: dict[int, list[str]] = {}
    for key, (rank, t) in a.items():
        ref = b.get(key)
        if ref is None or ref[1].shape != t.shape or not torch.equal(ref[1], t):
            bad.setdefault(rank, []).append(key[0])
    return bad


def _events(out: Path) -> list[dict]:
    path = layout.events_path(out)
    return read_events(path) if path.exists() else []


def _owed_written(events: list[dict]) -> list[int]:
    """Steps checkpointed from a memory copy owed to a busy writer (an ``owed`` memory snapshot), then written
    (save_owed)."""
    owed = {e["step"] for e in events if e["event"] == Event.MEMORY_SNAPSHOT and e.get("owed")}
    return [e["step"] for e in events if e["event"] == Event.CKPT_START and e["step"] in owed]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _params(out: Path) -> str | None:
    path = layout.summary_path(out)
    return json.loads(path.read_text()).get("params_sha256") if path.exists() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default="restarts")
    p.add_argument("--reference", type=Path, help="a reference run of this scenario and code made before (reused)")
    p.add_argument("--code", type=Path, default=HERE.parent, help="the trainer checkout to run")
    p.add_argument("--nvrx-tree", type=Path, help="a release's pure-Python tree (default: the installed release)")
    p.add_argument("--nvrx-deps", type=Path, help="the tree's pure-Python dependencies")
    p.add_argument("--busy", type=int, default=2, help="busy loops on the cores during the rounds")
    p.add_argument("--work", type=Path, default=Path("/tmp/hold-drill-trainer"), help="run directories")
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--second-job-after", default="",
                   help="seconds, comma-separated, one per round in turn: a second job of the round started that "
                        "long after the first in the same run directory (refused where one job holds it)")
    a = p.parse_args()
    code = a.code.resolve()
    tree, deps = a.nvrx_tree and a.nvrx_tree.resolve(), a.nvrx_deps and a.nvrx_deps.resolve()
    work = a.work / f"{int(time.time())}-{os.getpid()}"
    work.mkdir(parents=True)
    release = _env(code, tree, deps, True).get("GOODPUT_NVRX_VERSION", "installed")
    rev = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    print(f"code {code} ({rev}), NVRx {release}, scenario {a.scenario}, {a.busy} busy loops, runs in {work}",
          flush=True)

    steps, faults = SCENARIOS[a.scenario]
    ref = a.reference or work / "reference"
    rc = 0 if a.reference else _train(ref, steps, REFERENCE, _env(code, tree, deps, False), a.timeout_s)
    want, ref_params = _committed(ref), _params(ref)
    if rc != 0 or sorted(want) != list(range(1, steps + 1)):
        sys.exit(f"the reference run failed (exit {rc}): see {ref}.log")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    rounds = checked = handed = wrong_final = failed = overwritten = owed_written = watched = 0
    mismatches = []
    races: Counter = Counter()        # kind -> races seen (bench/_drill_site: copy_running, live_tensor, changed)
    race_checks: Counter = Counter()  # kind -> checks made
    t0 = time.monotonic()
    try:
        for r in range(a.rounds):
            out, watch = work / f"round{r:03d}", work / f"round{r:03d}.watch"
            watch.mkdir()
            env = _env(code, tree, deps, True, watch)
            first = _start(out, steps, faults, env)
            second = None
            if a.second_job_after:
                delays = [float(x) for x in a.second_job_after.split(",")]
                time.sleep(delays[r % len(delays)])      # the round's schedule, not a synchronisation
                second = _start(out, steps, faults, env, log="second.log")
            rc = _wait(first, a.timeout_s)
            second_rc = None if second is None else _wait(second, a.timeout_s)
            overwrites = _lines(watch / "violations.jsonl")
            watched += len(_lines(watch / "checks.jsonl"))
            races_here = _lines(watch / "races.jsonl")
            races.update(x["kind"] for x in races_here)
            race_checks.update(x["kind"] for x in _lines(watch / "race_checks.jsonl"))
            ev = _events(out)
            held = [e for e in ev if e["event"] == Event.CKPT_HANDED_OVER and e.get("held_for_boot")]
            # an owed checkpoint: a memory copy of the step, later written as its checkpoint (save_owed)
            owed = _owed_written(ev)
            loaded = [f"{e['source']} {e['step']}" for e in ev if e["event"] == Event.CKPT_LOADED and e["rank"] == 0]
            bad_here = []
            for step, path in _committed(out).items():
                checked += 1
                diff = _compare(path, want[step])
                if diff:
                    bad_here.append((step, diff))
            final = _params(out)
            rounds += 1
            handed += bool(held)
            wrong_final += final is not None and final != ref_params
            failed += rc != 0
            overwritten += len(overwrites)
            owed_written += len(owed)
            mismatches += [(r, s, d) for s, d in bad_here]
            starts = [e.get("layer") for e in ev if e["event"] == Event.RESTART]
            commits = Counter(e["step"] for e in ev if e["event"] == Event.CKPT_COMMITTED)
            print(f"round {r}: exit {rc}{'' if second is None else f', second job exit {second_rc}'}, "
                  f"restarts {starts}, commits by step {dict(commits)}, committed {sorted(_committed(out))}, "
                  f"held writes {len(held)}, owed written {owed}, "
                  f"resumed from {loaded}, final params {'=' if final == ref_params else final} reference, "
                  f"mismatched checkpoints {[(s, {k: len(v) for k, v in d.items()}) for s, d in bad_here]}, "
                  f"staging overwritten under an unfinished write {overwrites}, races {races_here}",
                  flush=True)
    finally:
        for b in busy:
            b.kill()
    print(f"NVRx {release}, code {rev}: {rounds} rounds, {checked} checkpoints checked, {len(mismatches)} "
          f"mismatched, {handed} rounds with a held write handed over, {owed_written} owed checkpoints written, "
          f"{wrong_final} with other final weights, "
          f"{failed} failed runs, {overwritten} of {watched} staging overwrites under an unfinished write, "
          f"races {', '.join(f'{k} {races[k]} of {race_checks[k]}' for k in sorted(race_checks)) or 'not checked'}; "
          f"{time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.1f}")
    for r, step, diff in mismatches:
        for rank, keys in diff.items():
            print(f"  round {r} step {step} rank {rank}: {len(keys)} tensors differ ({', '.join(keys[:3])}...)")


if __name__ == "__main__":
    main()
