"""The training loop, top to bottom: build, restore, loop, teardown (``Trainer``).

Launch (2 CPU processes, gloo):

    goodput train --nproc 2 --max-steps 100 --out RUN_DIR          # under NVRx ft_launcher
    torchrun --standalone --nproc-per-node 2 -m trainer --data DATASET --out RUN_DIR --restart inprocess

Any model of the protocol (``--model``, ``trainer.models``) trains the same way. Restarted with the same
arguments, it resumes from the newest committed checkpoint in RUN_DIR and ends with bitwise the same
parameters as a run that was never interrupted.

Recovery layers (``--restart-layers``): ``inprocess`` builds a new ``Trainer`` under NVRx's in-process
Wrapper after every fault, in the same processes; ``injob`` leaves faults to ft_launcher, which restarts
the worker group; ``both`` does the first for exceptions and hangs the Wrapper can abort, the second for
processes that die; ``auto`` (default) is the installed NVRx release's choice
(``compat.resolve_restart_layers``). What the loop does for them is behind ``Recovery``
(``trainer.recovery``); what it saves, and when, behind the ``Checkpointer`` (``trainer.checkpoint``);
metrics and fault injection watch it as hooks (``trainer.hooks``). What survives an in-process restart is
the ``Session`` (``trainer.session``).
"""

from __future__ import annotations

import gc
import logging
import math
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict

from . import digests
from .checkpoint import Checkpointer, StepSignals
from .config import OptimConfig, TrainConfig
from .data import BatchSampler, Split, eval_windows
from .events import Event, EventLog, read_events
from .hooks import StepHook, StepReport
from .layout import summary_path
from .live_state import LiveStateDict
from .mesh import launcher_mesh
from .models import ModelSpec, ParallelPlan, build_model, num_params
from .models.parallelize import clip_grad_norm_
from .models.hf import load_hf_weights
from .models.mfu import device_peak_flops, mfu
from .parallel import Dist, init_distributed
from .recovery import Recovery, exit_if_recurring, run_under_layers
from .restart import iteration_store
from .session import Session
from .status_report import StatusReporter, build_status_reporter
from .straggler import straggler_hooks
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
    return digests.params_sha256(full) if dist.get_rank() == 0 else None


@torch.no_grad()
def validation_loss(model, spec: ModelSpec, split: Split, cfg: TrainConfig, d: Dist) -> float:
    """Mean loss over the first ``eval_windows`` validation windows, split across ranks (collective)."""
    model.eval()
    windows = list(eval_windows(split, cfg.model.seq_len, cfg.data.eval_windows))
    mine = windows[d.dp_rank::d.dp_size]   # a tensor-parallel group reads the same windows
    # Every rank runs the same number of forwards: FSDP2 all-gathers parameters in each one.
    per_rank = math.ceil(len(windows) / d.dp_size)
    sums = torch.zeros(2, dtype=torch.float64, device=d.device)
    for i in range(per_rank):
        x, y = mine[i] if i < len(mine) else windows[0]
        loss = spec.loss(model, torch.from_numpy(x)[None].to(d.device), torch.from_numpy(y)[None].to(d.device))
        if i < len(mine):
            sums += torch.tensor([loss.item(), 1.0], dtype=torch.float64, device=d.device)
    dist.all_reduce(sums)
    model.train()
    return float(sums[0] / sums[1])


class Trainer:
    """One attempt at training: a fresh process group, the model built and restored, the loop, teardown.

    Under the in-process Wrapper a new one is built after every fault, from the same ``session``;
    ``call_wrapper`` is the Wrapper's (None without that layer).
    """

    def __init__(self, session: Session, call_wrapper=None, status: StatusReporter | None = None):
        cfg = self.cfg = session.cfg
        self.session, self.spec, self.events = session, session.spec, session.events
        self.recovery = Recovery(session.ft, session.sigterm, call_wrapper, session.events, is_main=session.rank == 0)
        with self.recovery.section("setup"):
            p = cfg.parallel
            shape = launcher_mesh(p.parallel, p.dp_replicate, p.dp_shard, p.tp)
            d = self.d = init_distributed(cfg.restart.collective_timeout_s,
                                          store=iteration_store(self.recovery.iteration), shape=shape,
                                          form_mesh=p.parallel == "fsdp")
            if self.recovery.iteration > 0 and d.is_main:
                self.events.emit(Event.RESTART, layer="inprocess", iteration=self.recovery.iteration)

            # ---- build: the same on every rank (same seed), then sharded/replicated
            plan = ParallelPlan(mode=cfg.parallel.parallel, activation_checkpointing=cfg.model.activation_checkpointing,
                                compile=cfg.model.compile)
            self.model = build_model(self.spec, plan, d, cfg.run.seed)
            self.n_params = num_params(self.model)
            self.optimizer = build_optimizer(self.model, cfg.optim)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, lambda s: get_lr(s, cfg.optim, cfg.run.max_steps))
            self.sampler = BatchSampler(session.split_train, rank=d.dp_rank, world_size=d.dp_size,
                                        batch_size=cfg.data.batch_size, seq_len=cfg.model.seq_len, seed=cfg.run.seed)
            self.state = TrainState()
            self.live = LiveStateDict(self.model, self.optimizer)
            self.tokens_per_step = cfg.data.batch_size * cfg.data.grad_accum * cfg.model.seq_len * d.dp_size
            # MFU per device, against its dense bf16 peak (None on CPU: no honest peak to divide by).
            self.flops_per_token = self.spec.flops_per_token(cfg.model.seq_len)
            self.peak_flops = device_peak_flops(d.device)
            self.checkpointer = Checkpointer(session.checkpoints(d), cfg.checkpoint, d, app=self, guard=self.recovery,
                                             spot=session.spot, max_steps=cfg.run.max_steps, events=self.events,
                                             events_path=session.events_path,
                                             on_blocking=session.metrics.observe_checkpoint)
            self.optimizer.register_step_pre_hook(self._copy_whole_before_update)
            self.update_hooks: list[StepHook] = [session.faults]
            self.step_hooks: list[StepHook] = [self.recovery, session.metrics,
                                               StepLog(self.events, cfg.run.max_steps, cfg.run.log_every, d.is_main)]
            self.step_hooks += [status] if status is not None else []
            self.step_hooks += straggler_hooks(cfg.metrics, self, d, self.events, session.metrics)   # GPU only

            # ---- restore: from memory or a checkpoint; else a fresh start
            resumed_from, source = self.checkpointer.load()
            if resumed_from is None:
                self._fresh_start()
            self.sampler.batches_read = self.state.batches_read
            if d.is_main:
                log.info("model %s (%s) %.2fM params, %s (mesh %s) on %d x %s, %d tokens/step, %s", self.spec.name,
                         self.spec.flavor, self.n_params / 1e6, cfg.parallel.parallel, d.mesh_tag, d.world_size,
                         d.device.type,
                         self.tokens_per_step,
                         f"resumed from step {resumed_from} ({source})" if resumed_from is not None else "fresh start")
                self.events.emit(Event.RESUMED if resumed_from is not None else Event.FRESH_START, step=self.state.step,
                                 source=source)

    def _copy_whole_before_update(self, *_) -> None:
        """Optimizer step pre-hook: whatever takes the step, a checkpoint's copy of the state is whole first."""
        self.checkpointer.maybe_wait_for_staging()

    def _fresh_start(self) -> None:
        if self.cfg.model.init_from:   # a fresh start only: a committed checkpoint or snapshot wins
            load_hf_weights(self.model, self.spec, self.cfg.model.init_from)   # collective: each rank its shards
            if self.d.is_main:
                self.events.emit(Event.INIT_FROM, path=self.cfg.model.init_from)
        # Per-rank stream for dropout; model init used the shared seed.
        torch.manual_seed(self.cfg.run.seed + 1 + self.d.rank)

    # ---- what a checkpoint holds
    def state_dict(self) -> dict:
        """Everything a checkpoint holds. RNG state is per rank, so its key carries the rank."""
        model_sd, optim_sd = self.live()
        return {"model": model_sd, "optim": optim_sd, "scheduler": self.scheduler.state_dict(),
                "train": asdict(self.state), f"rng_rank{self.d.rank}": rng_state(self.d.device),
                "ft": self.recovery.state_dict()}

    def load_state_dict(self, loaded: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        self.scheduler.load_state_dict(loaded["scheduler"])
        self.state = TrainState(**loaded["train"])
        rng = loaded.get(f"rng_rank{self.d.rank}")
        if rng is not None:
            set_rng_state(rng, self.d.device)
        else:   # resharded from fewer ranks: this rank had no stream; a new one from the run seed, rank and step
            torch.manual_seed(int(np.random.SeedSequence([self.cfg.run.seed, self.d.rank, self.state.step])
                                  .generate_state(1)[0]))
        self.recovery.load_state_dict(loaded["ft"])

    # ---- the loop
    def train(self) -> dict | None:
        """Train to ``max_steps``; return the summary on rank 0 (None elsewhere, and when stopped early)."""
        state = self.state
        with self.recovery.loop(first_step=state.step + 1):
            while state.step < self.cfg.run.max_steps:
                with self.recovery.step_section(state.step + 1):
                    report, signals = self.step()
                for hook in self.step_hooks:
                    hook.after_step(report)
                # What is due is saved; the last step's checkpoint, or a stop's, is the final one.
                if self.checkpointer.step(report, signals).stop:
                    return self.stop()
        return self.finish()

    def step(self) -> tuple[StepReport, StepSignals]:
        """One training step and the ranks' agreement on it: its report, and the signals of every rank."""
        t0 = time.monotonic()
        step = self.state.step + 1
        loss, data_wait_s, staging_wait_s = self.train_step(step)
        self.scheduler.step()
        self.state.step = step
        self.state.batches_read = self.sampler.batches_read
        self.state.tokens += self.tokens_per_step
        # Sync point, once per step: the mean loss and every rank's signals (a stop signal; rank 0's save
        # decisions, a spot notice, the writers' state) travel in one all-reduce, so every rank takes the same
        # decisions at the same step.
        mine = self.checkpointer.signals(step, stop=self.recovery.stop_requested)
        sums = torch.cat([loss.float().reshape(1), mine.as_tensor(self.d.device)])
        self.recovery.all_reduce(sums)
        loss_sum, *signal_sums = sums.tolist()
        # A wait for the checkpoint copy is the checkpoint's blocking time, not the step's.
        step_s = time.monotonic() - t0 - staging_wait_s
        tokens_per_s = self.tokens_per_step / step_s if step_s > 0 else 0.0
        report = StepReport(step=step, loss=loss_sum / self.d.world_size, step_s=step_s, data_wait_s=data_wait_s,
                            tokens=self.tokens_per_step, tokens_seen=self.state.tokens,
                            lr=self.scheduler.get_last_lr()[0],
                            mfu=mfu(tokens_per_s / self.d.world_size, self.flops_per_token, self.peak_flops))
        return report, StepSignals.agreed(signal_sums)

    def train_step(self, step: int) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over ``grad_accum`` micro-batches: (mean loss on this rank, seconds spent
        waiting for batches, seconds spent waiting for a checkpoint's copy of the state)."""
        cfg, d = self.cfg, self.d
        total, data_wait_s = torch.zeros((), device=d.device), 0.0
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=d.device.type == "cuda")
        for _ in range(cfg.data.grad_accum):
            t0 = time.perf_counter()
            x, y = (torch.from_numpy(a).to(d.device, non_blocking=True) for a in self.sampler.next_batch())
            data_wait_s += time.perf_counter() - t0
            with autocast:
                loss = self.spec.loss(self.model, x, y)
            (loss / cfg.data.grad_accum).backward()
            total += loss.detach()
        if cfg.optim.grad_clip > 0:
            clip_grad_norm_(self.model, cfg.optim.grad_clip)
        # A checkpoint's copy of the state is whole before a fault can fire and the optimizer changes the state.
        staging_wait_s = self.checkpointer.maybe_wait_for_staging()
        for hook in self.update_hooks:
            hook.before_optimizer_step(step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / cfg.data.grad_accum, data_wait_s, staging_wait_s

    # ---- the end
    def stop(self) -> None:
        """Every rank saw the stop signal (SIGTERM or SIGINT) at the same step, and its final checkpoint is
        committed: leave."""
        dist.destroy_process_group()
        return None

    def finish(self) -> dict | None:
        """Teardown: validation, the identity of the weights, the mirror drained, the summary (rank 0)."""
        state, summary = self.state, None
        with self.recovery.section("checkpoint"):
            val_loss = validation_loss(self.model, self.spec, self.session.split_val, self.cfg, self.d)
            sha = params_sha256(self.model)
            self.checkpointer.close(state.step)   # after the last collective: the summary sees the mirror drained
            if self.d.is_main:
                self.events.emit(Event.RUN_END, step=state.step, val_loss=round(val_loss, 6))
                summary = summarize(read_events(self.session.events_path), steps=state.step, tokens=state.tokens,
                                    final_val_loss=val_loss, params_sha256=sha, n_params=self.n_params,
                                    mesh=self.d.shape.describe())
                write_summary(summary_path(self.session.out), summary)
                log.info("done: %d steps, val loss %.4f, %d checkpoints, goodput %.3f, params %s", state.step,
                         val_loss, summary["checkpoints_committed"], summary["goodput"], sha[:16])
            dist.destroy_process_group()
        return summary


class StepLog(StepHook):
    """Rank 0: a ``step`` event per step in ``events.jsonl``, a log line every ``--log-every`` steps."""

    def __init__(self, events: EventLog, max_steps: int, log_every: int, is_main: bool):
        self.events, self.max_steps, self.log_every, self.is_main = events, max_steps, log_every, is_main

    def after_step(self, r: StepReport) -> None:
        if not self.is_main:
            return
        self.events.emit(Event.STEP, step=r.step, loss=round(r.loss, 6), step_s=round(r.step_s, 5), lr=r.lr,
                         tokens=r.tokens_seen, tokens_per_s=round(r.tokens_per_s, 1),
                         **({"mfu": round(r.mfu, 5)} if r.mfu is not None else {}))
        if r.step % self.log_every == 0 or r.step == 1:
            log.info("step %d/%d loss %.4f %.0f ms %.0f tok/s", r.step, self.max_steps, r.loss, r.step_s * 1e3,
                     r.tokens_per_s)


def run(cfg: TrainConfig) -> dict | None:
    """Entry point: train under the configured recovery layers."""
    # The modules imported so far (torch: about 300k objects) live as long as the process. Frozen, they
    # are not scanned by full collections, and the in-process Wrapper runs those until nothing is left
    # before every restart: 0.4-0.5 s each on these objects here, twice per restart.
    gc.freeze()
    try:
        session = Session(cfg)
        # Rank 0's progress reports outlive in-process restarts, as the session does.
        status = build_status_reporter(rank=session.rank, out=session.out, events_path=session.events_path,
                                       max_steps=cfg.run.max_steps, every_s=cfg.metrics.status_every_s)
        try:
            return run_under_layers(cfg, lambda call_wrapper: Trainer(session, call_wrapper, status).train())
        finally:
            status.close()
            session.close()
    except BaseException as e:
        exit_if_recurring(cfg, e)   # an error every attempt would meet: said once, exit status 2
        raise
