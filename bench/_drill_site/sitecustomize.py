"""Loaded by every Python process of a ``bench/hold_drill_trainer.py`` run (this folder is first on PYTHONPATH).

``GOODPUT_DRILL_HOLD=1``: the rank's checkpoint writer holds a save while its worker boots on every release
(the path 0.6/0.7 take), as it did on every release when the wrong-values write was seen on 0.4.1.
``GOODPUT_DRILL_WATCH=DIR``: each time a save is about to overwrite the staging copy, the rank checks that no
write reading it is unfinished (held, or in NVRx's queue and not finalized), and appends a line to
``DIR/violations.jsonl`` where one is (every check: ``DIR/checks.jsonl``). It also appends to ``DIR/races.jsonl``
a line per race between the state and a save that reads it (every check counted in ``DIR/race_checks.jsonl``):
``copy_running``, the optimizer step, or a load into the live state, while a copy of it into a snapshot runs;
``live_tensor``, a write handed to NVRx with a tensor that shares memory with the live state (NVRx's preload
is a no-op on CPU tensors, so its worker would read the state as the next steps change it); ``changed``, a
tensor of a write that changed between the end of its copy and the write's finalize (held, queued or being
written: what the worker read is not what was staged).
"""

import functools
import json
import os
import threading
import weakref

from drill_hooks import crc32s, hold_while_booting, live_storages, patch_on_import, tensors


def _own_staging(module):
    init = module.CheckpointManager.__init__

    def __init__(mgr, *args, **kwargs):
        init(mgr, *args, **kwargs)
        mgr.staging.drill_owner = mgr

    module.CheckpointManager.__init__ = __init__


def _watch_staging(module):
    stage = module.Staging.stage

    def checked(staging, state):
        mgr = getattr(staging, "drill_owner", None)
        if mgr is not None and mgr.writer.queue is not None:
            writes = [c.idx for c in mgr.writer.queue.async_calls
                      if getattr(c.async_request.async_fn, "__name__", "") != "_prepare_writer"]
            line = {"rank": mgr.d.rank, "pid": os.getpid(), "unfinalized_writes": writes,
                    "held": len(mgr.writer.deferred), "writes_in_flight": mgr.writer.writes_in_flight}
            for name, write in (("checks", True), ("violations", bool(writes or mgr.writer.deferred))):
                if write:
                    with open(os.path.join(os.environ["GOODPUT_DRILL_WATCH"], f"{name}.jsonl"), "a") as f:
                        f.write(json.dumps(line) + "\n")
        return stage(staging, state)

    module.Staging.stage = checked


def _record(name: str, line: dict) -> None:
    with open(os.path.join(os.environ["GOODPUT_DRILL_WATCH"], f"{name}.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **line}) + "\n")


_copies = [0]                        # copies of the live state into a snapshot running on the copier thread
_copies_lock = threading.Lock()
_optimizers: "weakref.WeakSet" = weakref.WeakSet()   # the process's optimizers: the live state
_digests: dict = {}                  # id(write buckets) -> (checkpoint, digests when the copy was whole)


def _check_no_copy(where: str) -> None:
    _record("race_checks", {"kind": "copy_running", "where": where})
    if _copies[0]:
        _record("races", {"kind": "copy_running", "where": where, "copies": _copies[0]})


def _count_copies(module):
    copy = module.Copier.copy

    @functools.wraps(copy)
    def counted(copier, *args, **kwargs):
        with _copies_lock:
            _copies[0] += 1
        try:
            return copy(copier, *args, **kwargs)
        finally:
            with _copies_lock:
                _copies[0] -= 1

    module.Copier.copy = counted


def _guard_updates(module):
    build = module.build_optimizer

    def built(*args, **kwargs):
        optimizer = build(*args, **kwargs)
        _optimizers.add(optimizer)
        return optimizer

    module.build_optimizer = built
    # On the class: the LR scheduler wraps the optimizer's bound step method.
    step = module.torch.optim.AdamW.step

    @functools.wraps(step)
    def checked(optimizer, *args, **kwargs):
        _check_no_copy("optimizer.step")
        return step(optimizer, *args, **kwargs)

    module.torch.optim.AdamW.step = checked
    load = module.Trainer.load_state_dict

    def loading(trainer, loaded):
        _check_no_copy("Trainer.load_state_dict")
        return load(trainer, loaded)

    module.Trainer.load_state_dict = loading


def _guard_copy_back(module):
    copy_back = module._copy_state_dict

    def checked(*args, **kwargs):
        _check_no_copy("restore's copy into the live state")
        return copy_back(*args, **kwargs)

    module._copy_state_dict = checked


def _buckets(request):
    """What a request's worker writes from: the write buckets in its arguments (up to 0.5), else the
    (checkpoint directory, data) its preload function builds them from (0.6+)."""
    args = list(request.async_fn_args or ())
    if len(args) > 1 and isinstance(args[1], list):
        return args[1]
    preload = request.preload_fn
    if isinstance(preload, functools.partial) and preload.args and isinstance(preload.args[0], (list, tuple)):
        return preload.args[0]
    return None


def _checkpoint(buckets) -> str:
    if isinstance(buckets, tuple) and isinstance(buckets[0], str):   # 0.6+: (checkpoint directory, data)
        return os.path.basename(buckets[0])
    return os.path.basename(os.path.dirname(str(buckets[0][0])))


def _digest(buckets) -> tuple[str, list[int]]:
    return _checkpoint(buckets), crc32s(tensors(buckets))


def _watch_writes(module):
    """Writer._built (the copy is whole and planned): the digests of what the write will write; the hand-over to
    NVRx (AsyncCallsQueue.schedule_async_request): no live tensor among them, nothing changed since; the write's
    finalize: nothing changed since."""
    built = module.Writer._built

    def building(writer, request):
        request = built(writer, request)
        buckets = _buckets(request)
        if buckets:
            _digests[id(buckets)] = _digest(buckets)
        return request

    module.Writer._built = building


def _compare(buckets, when: str) -> None:
    if not buckets or id(buckets) not in _digests:
        return
    where, before = _digests[id(buckets)]
    _, now = _digest(buckets)
    _record("race_checks", {"kind": "changed", "when": when, "checkpoint": where})
    changed = sum(a != b for a, b in zip(before, now))
    if changed:
        _record("races", {"kind": "changed", "when": when, "checkpoint": where, "tensors": len(now),
                          "changed": changed})


def _watch_queue(module):
    schedule = module.AsyncCallsQueue.schedule_async_request

    def handed(queue, request):
        buckets = _buckets(request)
        if buckets:
            live = live_storages(list(_optimizers))
            written = tensors(buckets)
            shared = sum(t.untyped_storage().data_ptr() in live for t in written)
            where = _checkpoint(buckets)
            _record("race_checks", {"kind": "live_tensor", "checkpoint": where, "tensors": len(written)})
            if shared:
                _record("races", {"kind": "live_tensor", "checkpoint": where, "tensors": len(written),
                                  "live": shared})
            _compare(buckets, "handed over")
        return schedule(queue, request)

    module.AsyncCallsQueue.schedule_async_request = handed
    finalize = module.AsyncRequest.execute_finalize_fns

    def finalizing(request, *args, **kwargs):
        buckets = _buckets(request)
        _compare(buckets, "finalized")
        _digests.pop(id(buckets), None)
        return finalize(request, *args, **kwargs)

    module.AsyncRequest.execute_finalize_fns = finalizing


_PATCHES = {}
if os.environ.get("GOODPUT_DRILL_HOLD") == "1":
    _PATCHES["trainer.checkpoint.writer"] = hold_while_booting
if os.environ.get("GOODPUT_DRILL_WATCH"):
    _PATCHES["trainer.checkpoint.manager"] = _own_staging
    _PATCHES["trainer.checkpoint.staging"] = lambda m: (_watch_staging(m), _count_copies(m))
    _PATCHES["trainer.checkpoint.writer"] = lambda m, hold=_PATCHES.get("trainer.checkpoint.writer"): (
        hold and hold(m), _watch_writes(m))
    _PATCHES["trainer.train"] = _guard_updates
    _PATCHES["torch.distributed._state_dict_utils"] = _guard_copy_back
    _PATCHES["nvidia_resiliency_ext.checkpointing.async_ckpt.core"] = _watch_queue


patch_on_import(_PATCHES)
