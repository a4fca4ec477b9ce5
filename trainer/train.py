"""The training loop, top to bottom: init, build, resume, loop, teardown.

Launch (2 CPU processes, gloo):

    goodput train --nproc 2 --max-steps 100 --out RUN_DIR          # under NVRx ft_launcher
    torchrun --standalone --nproc-per-node 2 -m trainer --data DATASET --out RUN_DIR --restart inprocess

Any model of the protocol (``--model``, ``trainer.models``) trains the same way. Restarted with the same
arguments, it resumes from the newest committed checkpoint in RUN_DIR and ends with bitwise the same
parameters as a run that was never interrupted.

Recovery layers (``--restart-layers``): ``inprocess`` runs ``train`` under NVRx's in-process Wrapper, which
calls it again in the same processes after a fault; ``injob`` leaves faults to ft_launcher, which
restarts the worker group; ``both`` does the first for exceptions and hangs the Wrapper can abort, the
second for processes that die; ``auto`` (default) is the installed NVRx release's choice
(``compat.resolve_restart_layers``: ``both`` while in-process restart is maintained, else ``injob``).
Everything that does not depend on the process group lives in ``Session`` and survives in-process restarts.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict

from . import compat, warmstart
from .checkpoint import COMMITTED, CheckpointManager, step_dir
from .config import OptimConfig, TrainConfig
from .data import BatchSampler, Split, eval_windows
from .events import EventLog, read_events
from .faults import FaultInjector
from .ft import FTManager
from .goodput import IntervalPolicy
from .live_state import LiveStateDict
from .metrics import build_metrics
from .models import ModelSpec, ParallelPlan, build_model, num_params
from .models.hf import load_hf_weights
from .models.mfu import device_peak_flops, mfu
from .parallel import Dist, ensure_launcher_env, init_distributed
from .restart import RECURRING, abort_process_group, iteration_store, run_with_inprocess_restart
from .signals import SigtermFlag
from .spot import build_spot_watcher
from .summary import summarize, write_summary

log = logging.getLogger("trainer")


@dataclass
class TrainState:
    """Loop counters saved in every checkpoint (the data position is ``batches_read``)."""

    step: int = 0
    batches_read: int = 0
    tokens: int = 0


def get_lr(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning-rate multiplier: linear warmup, then cosine decay to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False)


def rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def params_sha256(model: torch.nn.Module) -> str | None:
    """SHA-256 over the full, unsharded parameters in name order (rank 0; None elsewhere).

    Collective: every rank must call it.
    """
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for name in sorted(full):
        t = full[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_step(model, spec: ModelSpec, optimizer, sampler: BatchSampler, cfg: TrainConfig, d: Dist,
               before_optimizer_step=None) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` micro-batches; returns the mean loss on this rank."""
    total = torch.zeros((), device=d.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=d.device.type == "cuda")
    for _ in range(cfg.data.grad_accum):
        x, y = (torch.from_numpy(a).to(d.device, non_blocking=True) for a in sampler.next_batch())
        with autocast:
            loss = spec.loss(model, x, y)
        (loss / cfg.data.grad_accum).backward()
        total += loss.detach()
    if cfg.optim.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    if before_optimizer_step is not None:
        before_optimizer_step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / cfg.data.grad_accum


@torch.no_grad()
def validation_loss(model, spec: ModelSpec, split: Split, cfg: TrainConfig, d: Dist) -> float:
    """Mean loss over the first ``eval_windows`` validation windows, split across ranks (collective)."""
    model.eval()
    windows = list(eval_windows(split, cfg.model.seq_len, cfg.data.eval_windows))
    mine = windows[d.rank::d.world_size]
    # Every rank runs the same number of forwards: FSDP2 all-gathers parameters in each one.
    per_rank = math.ceil(len(windows) / d.world_size)
    sums = torch.zeros(2, dtype=torch.float64, device=d.device)
    for i in range(per_rank):
        x, y = mine[i] if i < len(mine) else windows[0]
        loss = spec.loss(model, torch.from_numpy(x)[None].to(d.device), torch.from_numpy(y)[None].to(d.device))
        if i < len(mine):
            sums += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=d.device)
    dist.all_reduce(sums)
    model.train()
    return float(sums[0] / sums[1])


class Session:
    """What lives as long as the process: config, event log, signal flag, faults, rank monitor, the
    checkpoint writer. In-process restarts reuse it, so no restart pays for these twice."""

    def __init__(self, cfg: TrainConfig):
        ensure_launcher_env()
        self.cfg = cfg
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.out = Path(cfg.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.spec = cfg.model.spec(cfg.data.data)   # the model, its vocabulary checked against the dataset
        self.events_path = self.out / "events.jsonl"
        self.events = EventLog(self.events_path, self.rank)
        self.run_id: str | None = None    # rank 0's, from _record_start; the others learn it in restore
        self.sigterm = SigtermFlag.install()
        if self.rank == 0:
            self._record_start()
        self.events.emit("worker_start", pid=os.getpid(), warm=warmstart.forked)
        self.faults = FaultInjector(cfg.faults.inject_fault, self.rank, self.world_size, self.events,
                                    self.events_path,
                                    chaos_seed=cfg.faults.chaos_seed if cfg.faults.chaos_seed >= 0 else None,
                                    fault_every_s=cfg.faults.fault_every)
        self.ft = FTManager(cfg.restart.ft_calc_after_steps, cfg.restart.ft_min_step_timeout_s,
                            cfg.restart.ft_ipc_timeout_s)
        # --metrics-port: Prometheus endpoint on port + LOCAL_RANK; the data-starvation warning either way.
        self.metrics = build_metrics(cfg.metrics, rank=self.rank, world_size=self.world_size, events=self.events,
                                     events_path=self.events_path)
        self.spot = build_spot_watcher(cfg.spot, self.events)   # --spot-watch: IMDSv2 poller on local rank 0
        self.split_train = Split.open(Path(cfg.data.data), "train")
        self.split_val = Split.open(Path(cfg.data.data), "val")
        self.ckpt: CheckpointManager | None = None

    def _record_start(self) -> None:
        restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        starts = [e for e in read_events(self.events_path) if e["event"] == "run_start"]
        earlier = bool(starts)
        # Names the run across its restarts; memory snapshots left on a node are trusted only by their run.
        self.run_id = (starts[0].get("run_id") if starts else None) or uuid.uuid4().hex
        self.cfg.save(self.out / "config.json", model=self.spec.describe())
        self.events.emit("run_start", world_size=self.world_size, restart_count=restart_count, run_id=self.run_id)
        if restart_count > 0:
            self.events.emit("restart", layer="injob", restart_count=restart_count)
        elif earlier:
            self.events.emit("restart", layer="job")

    def checkpoints(self, d: Dist) -> CheckpointManager:
        if self.ckpt is None:
            self.ckpt = CheckpointManager(self.out / "checkpoints", self.cfg.checkpoint, d, self.events,
                                          on_write_started=self.faults.on_checkpoint_write_started,
                                          run_id=self.run_id)
        return self.ckpt

    def close(self) -> None:
        self.spot.close()
        self.metrics.close()
        if self.ckpt is not None:
            self.ckpt.close()
        self.ft.close()
        self.events.close()


def train(session: Session, call_wrapper=None) -> dict | None:
    """Run (or resume) training to ``max_steps``; return the summary on rank 0 (None if stopped early).

    Under the in-process Wrapper, ``call_wrapper`` is injected and this runs again after every fault.
    """
    cfg, events, ft = session.cfg, session.events, session.ft
    iteration = call_wrapper.iteration if call_wrapper is not None else 0
    session.sigterm.in_loop = False
    ft.reset()
    with ft.section("setup"):
        d = init_distributed(cfg.restart.collective_timeout_s, store=iteration_store(iteration))
        if iteration > 0 and d.is_main:
            events.emit("restart", layer="inprocess", iteration=iteration)

        # ---- build: the same on every rank (same seed), then sharded/replicated
        spec = session.spec
        plan = ParallelPlan(mode=cfg.parallel.parallel, activation_checkpointing=cfg.model.activation_checkpointing,
                            compile=cfg.model.compile)
        model = build_model(spec, plan, d, cfg.run.seed)
        n_params = num_params(model)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                      lambda s: get_lr(s, cfg.optim, cfg.run.max_steps))
        sampler = BatchSampler(session.split_train, rank=d.rank, world_size=d.world_size,
                               batch_size=cfg.data.batch_size, seq_len=cfg.model.seq_len, seed=cfg.run.seed)
        sampler.next_batch = session.metrics.time_batches(sampler.next_batch)   # data wait vs compute
        ckpt = session.checkpoints(d)
        state = TrainState()
        tokens_per_step = cfg.data.batch_size * cfg.data.grad_accum * cfg.model.seq_len * d.world_size
        # MFU per device, against its dense bf16 peak (None on CPU: no honest peak to divide by).
        flops_per_token, peak_flops = spec.flops_per_token(cfg.model.seq_len), device_peak_flops(d.device)

        model_and_optim = LiveStateDict(model, optimizer)

        def app_state() -> dict:
            """Everything a checkpoint holds. RNG state is per rank, so its key carries the rank."""
            model_sd, optim_sd = model_and_optim()
            return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(),
                    "train": asdict(state), f"rng_rank{d.rank}": rng_state(d.device), "ft": ft.state_json()}

        # ---- resume: the newest memory snapshot every rank holds (after an in-process restart, or on the
        # same nodes after an in-job one), else the newest committed checkpoint, else a fresh start
        resumed_from, source, loaded = ckpt.restore(app_state())
        if resumed_from is not None:
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
            scheduler.load_state_dict(loaded["scheduler"])
            state = TrainState(**loaded["train"])
            set_rng_state(loaded[f"rng_rank{d.rank}"], d.device)
            ft.load_state_json(loaded["ft"])
        else:
            if cfg.model.init_from:   # a fresh start only: a committed checkpoint or snapshot wins above
                load_hf_weights(model, spec, cfg.model.init_from)   # collective: each rank reads its shards
                if d.is_main:
                    events.emit("init_from", path=cfg.model.init_from)
            # Per-rank stream for dropout; model init above used the shared seed.
            torch.manual_seed(cfg.run.seed + 1 + d.rank)
        sampler.batches_read = state.batches_read
        if d.is_main:
            log.info("model %s (%s) %.2fM params, %s on %d x %s, %d tokens/step, %s", spec.name, spec.flavor,
                     n_params / 1e6, cfg.parallel.parallel, d.world_size, d.device.type, tokens_per_step,
                     f"resumed from step {resumed_from} ({source})" if resumed_from is not None else "fresh start")
            events.emit("resumed" if resumed_from is not None else "fresh_start", step=state.step, source=source)
        policy = IntervalPolicy(cfg.checkpoint, events_path=session.events_path, start_step=state.step,
                                events=events if d.is_main else None)

        def observe_checkpoint(block_s: float) -> None:
            policy.observe_checkpoint(block_s)
            session.metrics.observe_checkpoint(block_s)

        ckpt.on_snapshot = observe_checkpoint
        snapshot_wait_s = 0.0
        writers_busy = False    # any rank's checkpoint write was running at the start of the last step
        writers_cold = False    # and some rank's first write since its writer started was still running
        owed: list = []   # (step, copy in node memory) of checkpoints due while the writers were cold

        def before_update() -> None:
            """Between backward and the optimizer step, which changes the state."""
            nonlocal snapshot_wait_s
            # A checkpoint's copy of the state ran alongside this step's forward and backward passes; it
            # must be whole before the optimizer writes to the state.
            with _atomic(call_wrapper):
                snapshot_wait_s = ckpt.finish_snapshot()
            session.faults.maybe_fire(state.step + 1)

    # ---- loop
    session.sigterm.in_loop = True
    first_step = state.step + 1
    try:
        while state.step < cfg.run.max_steps:
            # The first step after a (re)start pays for lazy initialisation (FSDP, optimizer state, the
            # backend's first collectives: NCCL communicators at scale take seconds), so what the step
            # timeout learns covers steady-state steps only. The rank monitor times that first step as
            # setup, unless the run already learned its step timeout (restored with the state; it is
            # never under --ft-min-step-timeout-s): a hang there must not wait for the setup timeout.
            steady = state.step >= first_step
            with ft.section("step" if steady or ft.calculated else "setup"):
                ckpt.maybe_finalize()
                t0 = time.monotonic()
                snapshot_wait_s = 0.0
                loss = train_step(model, spec, optimizer, sampler, cfg, d, before_optimizer_step=before_update)
                scheduler.step()
                state.step += 1
                state.batches_read = sampler.batches_read
                state.tokens += tokens_per_step
                # Sync point, once per step: mean loss, any rank's SIGTERM, rank 0's checkpoint and memory
                # snapshot decisions and whether any rank's checkpoint writer is busy travel in one
                # all-reduce, so every rank takes the same decisions at the same step.
                due = d.is_main and policy.due(state.step, cfg.run.max_steps, writers_busy or ckpt.writing)
                # A spot interruption notice seen on this rank's node makes a checkpoint due (any rank: SUM below).
                due = session.spot.maybe_due(state.step, cfg.run.max_steps) or due
                # Between checkpoints, a copy in memory bounds what a restart redoes.
                to_memory = d.is_main and not due and not owed and policy.memory_due(
                    state.step, cfg.run.max_steps, ckpt.replica_copy_s)
                flags = torch.cat([loss.float().reshape(1),
                                   torch.tensor([session.sigterm.is_set, due, ckpt.writing, to_memory,
                                                 ckpt.cold and ckpt.writes_in_flight > 0],
                                                dtype=torch.float32, device=d.device)])
                _all_reduce_interruptible(flags)
                loss_mean, stop, due = flags[0].item() / d.world_size, flags[1].item() > 0, flags[2].item() > 0
                writers_busy, to_memory, writers_cold = flags[3].item() > 0, flags[4].item() > 0, flags[5].item() > 0
                # A wait for the checkpoint copy is the checkpoint's blocking time, not the step's.
                step_s = time.monotonic() - t0 - snapshot_wait_s
            policy.observe_step(step_s, writing=writers_busy)
            step_timeout_s = ft.observe_step() if steady else None
            if step_timeout_s is not None and d.is_main:
                events.emit("ft_step_timeout", step=state.step, timeout_s=round(step_timeout_s, 3))
            tokens_per_s = tokens_per_step / step_s if step_s > 0 else 0.0
            step_mfu = mfu(tokens_per_s / d.world_size, flops_per_token, peak_flops)
            session.metrics.observe_step(state.step, step_s, tokens_per_step, mfu=step_mfu)
            if d.is_main:
                events.emit("step", step=state.step, loss=round(loss_mean, 6), step_s=round(step_s, 5),
                            lr=scheduler.get_last_lr()[0], tokens=state.tokens, tokens_per_s=round(tokens_per_s, 1),
                            **({"mfu": round(step_mfu, 5)} if step_mfu is not None else {}))
                if state.step % cfg.run.log_every == 0 or state.step == 1:
                    log.info("step %d/%d loss %.4f %.0f ms %.0f tok/s", state.step, cfg.run.max_steps, loss_mean,
                             step_s * 1e3, tokens_per_s)
            if stop:
                for step, copy in owed:   # due before the stop: taken from their copies in memory
                    with ft.section("checkpoint"), _atomic(call_wrapper):
                        ckpt.save(step, copy)
                        ckpt.finish_snapshot()
                return _stop_on_sigterm(session, ckpt, d, state, app_state, call_wrapper)
            if due and writers_busy and writers_cold and len(owed) < 2:
                # The save would wait for the previous write, which runs on a writer that has not finished one
                # yet: it may still be booting (seconds, after every start and in-job restart). The state is
                # copied to node memory now (one of its two slots) and that copy written once the writer is
                # warm: the checkpoint is this step's, and the loop waits for no boot. (Flags all-reduced:
                # every rank agrees.)
                with _atomic(call_wrapper):
                    owed.append((state.step, ckpt.snapshot_to_memory(state.step, app_state)))
            elif due:
                with ft.section("checkpoint"), _atomic(call_wrapper):
                    if writers_busy:
                        # The save will wait for the previous write (on every rank: the flag was all-reduced).
                        # Copied to node memory first, this step is what a restart meanwhile resumes from.
                        ckpt.snapshot_to_memory(state.step, app_state)
                    ckpt.save(state.step, app_state)
            elif owed and not (writers_busy and writers_cold):
                with ft.section("checkpoint"), _atomic(call_wrapper):
                    ckpt.save(*owed.pop(0))
            elif to_memory:
                with _atomic(call_wrapper):
                    ckpt.snapshot_to_memory(state.step, app_state)
            if state.step == first_step:
                ckpt.start_writer()   # not before: see CheckpointManager.start_writer
    except BaseException:
        # Failing over to a restart: from here a SIGTERM has nothing to save and ends the process at once,
        # and the rank monitor must not time the in-process restart against the step timeout.
        session.sigterm.in_loop = False
        ft.reset()
        if call_wrapper is None:
            # No in-process layer: the launcher restarts every rank, so peers blocked in a collective with
            # this one should fail now, not at the rank monitor's step timeout or the collective timeout.
            abort_process_group()
        raise

    # ---- teardown: the final checkpoint, validation, identity of the weights
    with ft.section("checkpoint"):
        ckpt.maybe_finalize()
        for step, copy in owed:
            with _atomic(call_wrapper):
                ckpt.save(step, copy)
                ckpt.finish_snapshot()
        if not (step_dir(ckpt.root, state.step) / COMMITTED).exists():
            with _atomic(call_wrapper):
                ckpt.save(state.step, app_state, blocking=True)
        ckpt.wait()
        ckpt.drop_replica()   # older than the final checkpoint
        val_loss = validation_loss(model, spec, session.split_val, cfg, d)
        sha = params_sha256(model)
        summary = None
        if d.is_main:
            ckpt.maybe_drain_mirror()   # after the last collective: the summary sees the final one mirrored
            events.emit("run_end", step=state.step, val_loss=round(val_loss, 6))
            summary = summarize(read_events(session.events_path), steps=state.step, tokens=state.tokens,
                                final_val_loss=val_loss, params_sha256=sha, n_params=n_params)
            write_summary(session.out / "summary.json", summary)
            log.info("done: %d steps, val loss %.4f, %d checkpoints, goodput %.3f, params %s", state.step, val_loss,
                     summary["checkpoints_committed"], summary["goodput"], sha[:16])
        dist.destroy_process_group()
    return summary


def _all_reduce_interruptible(tensor: torch.Tensor) -> None:
    """All-reduce that waits in Python rather than inside the backend.

    When another rank fails, NVRx's Wrapper interrupts this thread with an asynchronous exception; it
    is delivered within one poll here, whereas a wait inside gloo would last until the collective
    timeout.
    """
    work = dist.all_reduce(tensor, async_op=True)
    while not work.is_completed():
        time.sleep(0.0005)
    work.wait()


def _stop_on_sigterm(session: Session, ckpt: CheckpointManager, d: Dist, state: TrainState, app_state,
                     call_wrapper) -> None:
    """Every rank saw the stop flag (SIGTERM or SIGINT) at the same step: commit a final checkpoint and return."""
    session.events.emit("sigterm", step=state.step, signal=session.sigterm.name)
    t0 = time.monotonic()
    with session.ft.section("checkpoint"), _atomic(call_wrapper):
        ckpt.save(state.step, app_state, blocking=True)
    ckpt.drop_replica()   # older than the checkpoint just committed
    took = time.monotonic() - t0
    if d.is_main:
        if took > session.cfg.checkpoint.sigterm_grace_s:
            log.warning("final checkpoint took %.1fs, over the %.0fs grace period", took,
                        session.cfg.checkpoint.sigterm_grace_s)
        session.events.emit("exit", reason=session.sigterm.name, step=state.step, ckpt_s=round(took, 4))
    dist.destroy_process_group()
    return None


def _atomic(call_wrapper):
    """The Wrapper's ``atomic()``: a save is never cut in half by a restart in progress."""
    return call_wrapper.atomic() if call_wrapper is not None else contextlib.nullcontext()


FATAL_WAIT_S = 30.0   # how long a rank with an error that would recur waits for the launch wrapper to stop the run


def run(cfg: TrainConfig) -> dict | None:
    """Entry point: train under the configured recovery layers."""
    # The modules imported so far (torch: about 300k objects) live as long as the process. Frozen, they
    # are not scanned by full collections, and the in-process Wrapper runs those until nothing is left
    # before every restart: 0.4-0.5 s each on these objects here, twice per restart.
    gc.freeze()
    try:
        session = Session(cfg)
        try:
            layers = compat.resolve_restart_layers(cfg.restart.restart, compat.installed_release())
            if layers in ("inprocess", "both"):
                return run_with_inprocess_restart(lambda call_wrapper: train(session, call_wrapper), cfg.restart,
                                                  cuda=torch.cuda.is_available())
            return train(session)
        finally:
            session.close()
    except BaseException as e:
        recurring = e if isinstance(e, RECURRING) else e.__cause__ if isinstance(e.__cause__, RECURRING) else None
        if recurring is None:
            raise
        # Settings or data that no restart changes: said once, as a "fatal" event the launch wrapper stops the
        # launcher on (it would restart the group for nothing), and exit status 2.
        reason = f"{type(recurring).__name__}: {recurring}"
        rank = int(os.environ.get("RANK", "0"))
        with contextlib.suppress(OSError):
            log_ = EventLog(Path(cfg.run.out) / "events.jsonl", rank)
            log_.emit("fatal", reason=reason)
            log_.close()
        print(f"error: rank {rank}: {reason} (not retried: it would fail the same way)", file=sys.stderr)
        if warmstart.ZYGOTE_PID_ENV in os.environ:
            # Under the launch wrapper, which stops the launcher on that event within a second: exiting now
            # would have the launcher restart the group first. SIGTERM (its default action) ends the wait.
            time.sleep(FATAL_WAIT_S)
        raise SystemExit(2) from None
