"""A save's copy of the live state into the staging copy runs on a thread behind the next step's forward and
backward passes; the optimizer step must not change the state before that copy is whole, and what is handed
to NVRx's worker must be the staging copy, never the live state (NVRx's preload is a no-op on CPU tensors: its
worker would read the state while later steps change it). Either would commit a checkpoint holding values of a
later step than its own, as the wrong-values write once seen on 0.4.1 did (docs/nvrx.md).

The real trainer (2 ranks, gloo, under ft_launcher) runs with a ``sitecustomize`` that holds the copy of the
step-4 save until the loop either waits for it (``Checkpointer.maybe_wait_for_staging``, before the optimizer
step) or has taken the optimizer step without waiting. The copy then runs, and each rank records whether the
staging copy holds the state as it was when the save was taken, and whether a write it handed to NVRx shares
memory with the live state. The writer holds saves while its worker boots, as on 0.6/0.7 and as it did on
0.4.1 when the fault was seen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import STEPS

SITE = '''
import json, os, threading

from drill_hooks import crc32s, hold_while_booting, live_storages, patch_on_import, tensors

OUT, STEP = os.environ["COPY_RACE_OUT"], int(os.environ["COPY_RACE_STEP"])
gate = threading.Event()     # the held copy may run
held = {}                    # id(pairs) -> crc32 of each live tensor when the save was taken
optimizers = []


def record(name, line):
    with open(os.path.join(OUT, name + ".jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rank": int(os.environ.get("RANK", -1)), **line}) + "\\n")


def patch_manager(m):
    save_async = m.CheckpointManager._save_async
    def gated_save(mgr, step, *args, **kwargs):
        mgr.staging.gated = step == STEP
        try:
            return save_async(mgr, step, *args, **kwargs)
        finally:
            mgr.staging.gated = False
    m.CheckpointManager._save_async = gated_save
    finish = m.CheckpointManager.finish_snapshot
    def waited(mgr, *args, **kwargs):
        gate.set()           # the loop waits for the copy: it may run
        return finish(mgr, *args, **kwargs)
    m.CheckpointManager.finish_snapshot = waited


def patch_staging(m):
    stage = m.Staging.stage
    def staged(staging, state):
        snapshot, pairs = stage(staging, state)
        if getattr(staging, "gated", False):
            gate.clear()     # armed from here: only a wait for this copy or a later optimizer step opens it
            held[id(pairs)] = crc32s([live for live, _ in pairs])
        return snapshot, pairs
    m.Staging.stage = staged
    copy = m.Copier.copy
    def gated_copy(copier, pairs, *args, **kwargs):
        if id(pairs) in held:
            if not gate.wait(300):
                record("errors", {"error": "the held copy was never let go"})
            seconds = copy(copier, pairs, *args, **kwargs)
            got = crc32s([staged for _, staged in pairs])
            record("copies", {"step": STEP, "tensors": len(got),
                              "later": sum(a != b for a, b in zip(held.pop(id(pairs)), got))})
            return seconds
        return copy(copier, pairs, *args, **kwargs)
    m.Copier.copy = gated_copy


def patch_train(m):
    build = m.build_optimizer
    def built(*args, **kwargs):
        optimizers.append(build(*args, **kwargs))
        return optimizers[-1]
    m.build_optimizer = built
    step = m.torch.optim.AdamW.step
    def stepped(optimizer, *args, **kwargs):
        try:
            return step(optimizer, *args, **kwargs)
        finally:
            gate.set()       # the optimizer step ran first: the copy now reads the later state
    m.torch.optim.AdamW.step = stepped


def patch_queue(m):
    schedule = m.AsyncCallsQueue.schedule_async_request
    def handed(queue, request):
        args = list(request.async_fn_args or ())
        written = tensors(args[1] if len(args) > 1 else []) + tensors(list(getattr(request.preload_fn, "args", ())))
        if written:
            live = live_storages(optimizers)
            record("handed", {"tensors": len(written),
                              "live": sum(t.untyped_storage().data_ptr() in live for t in written)})
        return schedule(queue, request)
    m.AsyncCallsQueue.schedule_async_request = handed


patch_on_import({"trainer.checkpoint.manager": patch_manager, "trainer.checkpoint.staging": patch_staging,
                 "trainer.checkpoint.writer": hold_while_booting, "trainer.train": patch_train,
                 "nvidia_resiliency_ext.checkpointing.async_ckpt.core": patch_queue})
'''


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_optimizer_step_waits_for_the_copy_and_nvrx_gets_the_staging_copy(tmp_path, start_run, monkeypatch):
    site, out = tmp_path / "site", tmp_path / "records"
    site.mkdir()
    out.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    # Its own sitecustomize first, then the hooks it shares with the hold drill's.
    hooks = Path(__file__).resolve().parents[1] / "bench" / "_drill_site"
    path = [str(site), str(hooks), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, path)))
    monkeypatch.setenv("COPY_RACE_OUT", str(out))
    monkeypatch.setenv("COPY_RACE_STEP", "4")
    run = start_run(tmp_path / "run", *STEPS)
    assert run.wait() == 0, run.tail()
    assert _lines(out / "errors.jsonl") == []
    copies = _lines(out / "copies.jsonl")
    # Each rank's step-4 copy held the state of step 4: not one tensor of it changed by step 5's update.
    assert sorted(c["rank"] for c in copies) == [0, 1], copies
    assert all(c["tensors"] > 0 and c["later"] == 0 for c in copies), copies
    handed = _lines(out / "handed.jsonl")
    # Every write handed to the worker (the step-4 one and later ones, on both ranks) reads the staging copy.
    assert len(handed) >= 2 and all(h["live"] == 0 for h in handed), handed
