"""The trainer's configuration: one dataclass per concern, combined in ``TrainConfig``.

Every field has a type, a default and a help text with units; it is the one definition of the setting.
From it come the command-line flag (``--field-name``, or the flag named in its metadata), the TOML/JSON keys
(``[section] field = value``), the pipeline's ``trainer_config`` object (``{"section": {"field": value}}`` or
``{"section.field": value}``) and the check of each value's type (``settings_problems``). Precedence is
command line > ``--settings JSON`` > ``--config FILE`` > defaults, validated once in ``TrainConfig.validate``.

A launcher hands a run's settings to its ranks as one document (``TrainConfig.document()``, through
``--settings``), never as flags built one by one. The run directory records them (``settings.json``,
``record_settings``): a run pointed at a directory that holds another run (a setting marked ``defines`` differs)
is refused with what differs; settings that only place the run (nodes, parallelism, restarts, timeouts) may
change on a resume. This module imports no torch at import time, so that the CLI stays fast; validating the
model (``ModelConfig.spec``) imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import layout
from .durable import write_json, write_text
from .fault_spec import Fault
from .s3url import parse_s3_url


def _f(default: Any, help: str, flag: str | None = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, "flag": flag, **kw})


def _d(default: Any, help: str, flag: str | None = None, **kw: Any) -> Any:
    """A setting that defines the run (model, data, seed, optimizer and schedule): a resume must keep it."""
    return _f(default, help, flag, defines=True, **kw)


# ByteGPT's architecture flags, kept for --model bytegpt (where they override its fields); other models take
# --model-config.
BYTEGPT_FLAGS = ("n_layer", "n_head", "n_embd", "dropout")


@dataclass
class ModelConfig:
    name: str = _d("bytegpt", "the model: bytegpt, llama, or package.module:function naming your own model "
                              "factory (docs/models.md)", flag="--model")
    flavor: str = _d("", "a named size of the model (llama: debug, llama3-1b, llama3-3b, llama3-8b, llama3-70b; "
                         "empty = the model's default)", flag="--model-flavor")
    config: str = _d("", "fields overriding the flavor's: inline JSON ('{\"n_layers\": 8}') or a .json/.toml file",
                     flag="--model-config")
    init_from: str = _d("", "a Hugging Face model directory (config.json + *.safetensors) whose weights a fresh "
                            "run starts from; a run with a committed checkpoint resumes from that instead")
    activation_checkpointing: str = _f("none", "recompute activations in backward: none, full (each block), "
                                               "selective (keep matmul and attention outputs)",
                                       choices=("none", "full", "selective"))
    compile: bool = _f(False, "torch.compile each block's forward")
    n_layer: int = _d(4, "bytegpt: transformer blocks")
    n_head: int = _d(4, "bytegpt: attention heads per block")
    n_embd: int = _d(128, "bytegpt: model width (embedding size)")
    seq_len: int = _d(128, "tokens per training sequence (at most the model's max_seq_len)")
    dropout: float = _d(0.0, "bytegpt: dropout probability")
    vocab_size: int = _f(256, "bytegpt: vocabulary size (the dataset's, resolved at start)", cli=False)

    def spec(self, data_dir: str | Path):
        """The ``ModelSpec`` to train on the dataset in ``data_dir``; a ValueError says what to fix.

        A model whose vocabulary is not tied to a tokenizer (``bytes`` or any) and not pinned by
        --model-config or --init-from takes the dataset's vocabulary size; any other is checked against it
        (``trainer.data.check_vocab``). Imports torch: only called to validate or to build.
        """
        from .data import check_vocab, read_manifest
        from .models import load_model_config, resolve_model
        from .models.hf import spec_for_hf_dir

        overrides = load_model_config(self.config)
        if self.name == "bytegpt":
            overrides = {**{k: getattr(self, k) for k in (*BYTEGPT_FLAGS, "seq_len")}, **overrides}
        try:
            manifest = read_manifest(Path(data_dir))
        except (OSError, ValueError):   # no dataset yet, or a broken one: the dataset's own checks say why
            manifest = None
        if self.init_from:
            spec = spec_for_hf_dir(self.name, self.init_from, overrides)
        else:
            spec = resolve_model(self.name, self.flavor, overrides)
            follows = (spec.vocab.tokenizer in ("bytes", "") and "vocab_size" not in overrides
                       and dataclasses.is_dataclass(spec.config) and hasattr(spec.config, "vocab_size"))
            if manifest is not None and follows and spec.vocab.size != manifest["vocab_size"]:
                spec = resolve_model(self.name, spec.flavor, {**overrides, "vocab_size": manifest["vocab_size"]})
        if manifest is not None:
            check_vocab(data_dir, spec.vocab.size)
        if self.seq_len > spec.max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} is longer than --model {self.name} reads "
                             f"(max_seq_len {spec.max_seq_len})")
        return spec


@dataclass
class DataConfig:
    data: str = _d("", "dataset directory holding manifest.json (see `python -m trainer.data`)")
    batch_size: int = _d(16, "sequences per micro-batch per rank")
    grad_accum: int = _d(1, "micro-batches accumulated per optimizer step")
    eval_windows: int = _f(64, "validation windows (each seq_len bytes) for final_val_loss")


@dataclass
class OptimConfig:
    lr: float = _d(2e-3, "peak learning rate of AdamW")
    min_lr_ratio: float = _d(0.1, "final learning rate as a fraction of the peak (cosine decay)")
    warmup_steps: int = _d(20, "linear warmup steps")
    weight_decay: float = _d(0.1, "AdamW weight decay on matrices")
    beta1: float = _d(0.9, "AdamW beta1")
    beta2: float = _d(0.95, "AdamW beta2")
    grad_clip: float = _d(1.0, "clip the global gradient norm to this value (0 = off)")


@dataclass
class ParallelConfig:
    parallel: str = _f("fsdp", "data parallelism: fsdp (FSDP2 fully_shard) or ddp", choices=("fsdp", "ddp"))
    dp_replicate: int = _f(0, "replicas of the model with fsdp (HSDP: parameters sharded within a replica, gradients "
                              "all-reduced between them); 0 = auto: the nodes when each node has more than one "
                              "data-parallel rank, else 1")
    dp_shard: int = _f(0, "ranks that shard the parameters within a replica (FSDP2); 0 = auto: the rest of the ranks")
    tp: int = _f(1, "tensor-parallel ranks that split each layer (inside a node; the model needs a tensor-parallel "
                    "plan: llama has one); dp_replicate x dp_shard x tp must be the ranks (nodes x nproc)")


@dataclass
class CheckpointConfig:
    ckpt_every: str = _f("50", "checkpoint every N optimizer steps (0 = only at the end), or 'auto': the "
                               "Young-Daly interval from measured checkpoint cost and --mtbf-s")
    mtbf_s: float = _f(0.0, "with --ckpt-every auto: expected seconds between failures that only a committed "
                            "checkpoint recovers, the ones that lose the nodes' memory copies: node loss, job "
                            "restart (0 = from the restarts in this run that loaded a checkpoint, else 24 h)")
    ckpt_every_s: float = _f(0.0, "also checkpoint when this many seconds passed since the last one (0 = off)")
    memory_every_s: float = _f(1.0, "between checkpoints, copy the state to node-local shared memory (no write) "
                                    "this often, so a restart in the same process or on the same node redoes at "
                                    "most this much work; copies are spaced at least 20x their own duration "
                                    "apart (0 = off: restarts go back to the last checkpoint)",
                               flag="--memory-snapshot-every-s")
    memory_dir: str = _f("/dev/shm", "where memory snapshots live: a memory-backed file system on the node (two "
                                     "copies of each rank's state; if it is missing or full, they stay in process "
                                     "memory and only in-process restarts use them)",
                         flag="--memory-snapshot-dir")
    peer_snapshots: bool = _f(True, "with more than one node and memory snapshots on: also keep each node's memory "
                                    "snapshots on the next node (a ring, copied in the background by a niced "
                                    "daemon of each node's launch wrapper), so that a lost node's replacement "
                                    "resumes from them instead of the last committed checkpoint "
                                    "(--no-peer-snapshots: off)")
    keep: int = _f(3, "committed checkpoints to keep (older ones are deleted)", flag="--ckpt-keep")
    sync: bool = _f(False, "write checkpoints synchronously (torch DCP) instead of NVRx async",
                    flag="--ckpt-sync")
    write_threads: int = _f(1, "writer processes per rank for async checkpoints", flag="--ckpt-threads")
    writer_nice: int = _f(19, "CPU niceness of the async checkpoint writer processes (0-19), from their start. "
                              "Where they share cores with training, a high value keeps them from slowing the "
                              "steps (their start after every restart imports torch), but writes take longer "
                              "and a save is postponed while the previous write runs; on idle host cores it "
                              "changes nothing", flag="--ckpt-writer-nice")
    copy_nice: int = _f(10, "CPU niceness of each rank's checkpoint copy and checksum threads (0-19). The copy "
                            "runs behind the next step's forward and backward passes and has until the optimizer "
                            "step to finish: where the threads share cores with training, a high value lets the "
                            "loop's thread have the core first, so a save holds the loop for less and more evenly. "
                            "On cores busy with other work the copy may not finish in time, and the loop then waits "
                            "for it (0: the rank's own niceness)", flag="--ckpt-copy-nice")
    write_timeout_s: float = _f(300.0, "a checkpoint write (or the writer's boot before its first one) that takes "
                                       "longer counts as hung: the writer is killed and the rank restarted "
                                       "in-job", flag="--ckpt-write-timeout-s")
    sigterm_grace_s: float = _f(30.0, "seconds the final checkpoint after SIGTERM may take before the "
                                      "pod's grace period runs out; exceeding it is logged")
    # Mirror of committed checkpoints in S3 (trainer/mirror.py): survives the loss of FSx, its AZ or the cluster.
    mirror: str = _f("", "copy every committed checkpoint in the background to s3://BUCKET/PREFIX and resume "
                         "from there when FSx has none (empty = off)", flag="--ckpt-mirror")
    mirror_endpoint_url: str = _f("", "S3-compatible endpoint URL of the mirror (empty = AWS S3)",
                                  flag="--ckpt-mirror-endpoint-url")
    mirror_keep: int = _f(3, "committed checkpoints to keep in the mirror (older ones are deleted)",
                          flag="--ckpt-mirror-keep")
    mirror_concurrency: int = _f(8, "parallel S3 requests of mirror uploads and downloads (s3transfer threads)",
                                 flag="--ckpt-mirror-concurrency")
    mirror_part_mib: int = _f(64, "multipart threshold and part size of mirror transfers, in MiB (at least 5)",
                              flag="--ckpt-mirror-part-mib")
    mirror_max_attempts: int = _f(10, "attempts per S3 request (botocore standard retries: backoff with jitter "
                                      "on throttling, 5xx and connection errors)", flag="--ckpt-mirror-max-attempts")
    mirror_retry_s: float = _f(5.0, "seconds before a checkpoint whose upload failed is uploaded again "
                                    "(doubles per failure, at most 300 s)", flag="--ckpt-mirror-retry-s")
    mirror_drain_s: float = _f(30.0, "seconds the end of training (or exit after SIGTERM) waits for the mirror "
                                     "to finish uploading", flag="--ckpt-mirror-drain-s")
    require_mirror: bool = _f(False, "with --ckpt-mirror: any mirror failure (its S3 client or thread, an upload "
                                     "after its retries, retention, no mirrored checkpoint downloadable, the last "
                                     "checkpoints not mirrored within --ckpt-mirror-drain-s) fails the run; without "
                                     "it a failure is warned about and training goes on",
                              flag="--require-mirror")

    @property
    def every_steps(self) -> int | None:
        """``ckpt_every`` as a number of steps; None for ``auto`` (the interval policy chooses)."""
        return None if self.ckpt_every == "auto" else int(self.ckpt_every)


@dataclass
class RunConfig:
    out: str = _f("fsx/runs/local", "run directory: checkpoints/, events.jsonl, summary.json")
    seed: int = _d(1337, "random seed (model init, data order, dropout)")
    max_steps: int = _f(200, "optimizer steps to train")
    log_every: int = _f(10, "print a progress line every N steps")
    lock_wait_s: float = _f(60.0, "seconds a job waits for another job training in --out to end (a stopped "
                                  "job's final checkpoint) before it refuses to start: one job at a time per run "
                                  "directory, its in-job restarts included", flag="--run-lock-wait-s")


@dataclass
class RestartConfig:
    restart: str = _f("auto", "recovery layers: inprocess (NVRx Wrapper restarts the training function in the "
                      "same processes), injob (ft_launcher restarts the worker group), both, or auto (the installed "
                      "NVRx release's default: both while in-process restart is maintained, else injob)",
                      choices=("auto", "inprocess", "injob", "both"),
                      # Not --restart: ft_launcher's argparse would claim it as an abbreviation of its own
                      # --restart-policy, even after the script name.
                      flag="--restart-layers")
    collective_timeout_s: float = _f(300.0, "process-group timeout: the last-resort bound on a wait for a peer "
                                            "that vanished inside a collective (faults are normally caught "
                                            "sooner: the per-step sync is interruptible by the Wrapper, hung "
                                            "ranks are killed by the rank monitor, NCCL is aborted by NVRx); "
                                            "it must exceed the slowest legitimate wait, such as a checkpoint "
                                            "write on a busy file system")
    monitor_interval_s: float = _f(0.25, "NVRx Wrapper's monitor, heartbeat and watchdog intervals",
                                   flag="--inprocess-interval-s")
    soft_timeout_s: float = _f(60.0, "Wrapper: no progress for this long aborts the rank's collectives",
                               flag="--inprocess-soft-timeout-s")
    hard_timeout_s: float = _f(90.0, "Wrapper: no progress for this long terminates the rank",
                               flag="--inprocess-hard-timeout-s")
    heartbeat_timeout_s: float = _f(30.0, "Wrapper: a rank silent this long is treated as dead",
                                    flag="--inprocess-heartbeat-timeout-s")
    barrier_timeout_s: float = _f(120.0, "Wrapper: limit on its restart barriers", flag="--inprocess-barrier-timeout-s")
    max_rank_faults: int = _f(20, "in-process restarts caused by one rank before it is terminated "
                                  "(the in-job layer takes over)", flag="--inprocess-max-rank-faults")
    ft_calc_after_steps: int = _f(20, "steps measured before the rank monitor's step timeout is tightened")
    ft_min_step_timeout_s: float = _f(30.0, "the tightened step timeout never goes below this")
    ft_ipc_timeout_s: float = _f(30.0, "a rank monitor that does not answer the rank within this many seconds counts "
                                       "as hung: the rank restarts in-job (NVRx's client would wait forever)")


@dataclass
class FaultConfig:
    inject_fault: list = _f(None, "inject KIND@STEP[:RANK] (exception, kill, hang, hang-after-snapshot, sigterm, "
                                  "ckpt-crash; corrupt-snapshot, corrupt-ckpt, corrupt-mirror, corrupt-peer "
                                  "take /SEED); repeatable",
                            metavar="KIND@STEP[:RANK]")
    chaos_seed: int = _f(-1, "seed of random faults (kinds, ranks, moments); -1 = off")
    fault_every: float = _f(0.0, "with --chaos-seed: mean seconds between random faults", flag="--fault-every")

    def __post_init__(self) -> None:
        if self.inject_fault is None:
            self.inject_fault = []


@dataclass
class SpotConfig:
    watch: bool = _f(False, "poll the EC2 instance metadata service (IMDSv2) for a spot interruption notice; "
                            "on one, checkpoint (and mirror) at once and train on until SIGTERM",
                     flag="--spot-watch")
    metadata_url: str = _f("http://169.254.169.254", "base URL of the instance metadata service",
                           flag="--spot-metadata-url")
    poll_s: float = _f(2.0, "seconds between two polls of spot/instance-action", flag="--spot-poll-s")


def _mirror_and_spot_problems(c: CheckpointConfig, s: SpotConfig) -> list[str]:
    problems = []
    if c.mirror:
        try:
            parse_s3_url(c.mirror, "--ckpt-mirror")
        except ValueError as e:
            problems.append(str(e))
    for name, value, low in (("--ckpt-mirror-keep", c.mirror_keep, 1), ("--ckpt-mirror-concurrency",
                             c.mirror_concurrency, 1), ("--ckpt-mirror-part-mib", c.mirror_part_mib, 5),
                             ("--ckpt-mirror-max-attempts", c.mirror_max_attempts, 1)):
        if value < low:
            problems.append(f"{name} must be at least {low}, got {value}")
    if c.require_mirror and not c.mirror:
        problems.append("--require-mirror needs a mirror: --ckpt-mirror s3://BUCKET/PREFIX")
    if c.mirror_retry_s <= 0 or c.mirror_drain_s < 0:
        problems.append("--ckpt-mirror-retry-s must be positive and --ckpt-mirror-drain-s not negative")
    if s.poll_s <= 0:
        problems.append(f"--spot-poll-s must be positive, got {s.poll_s}")
    return problems


@dataclass
class MetricsConfig:
    metrics_port: int = _f(0, "serve Prometheus metrics on this port + LOCAL_RANK (0 = off; the PyTorchJob "
                              "builder turns it on at 9500)")
    metrics_addr: str = _f("0.0.0.0", "address the metrics endpoint listens on")
    run_refresh_s: float = _f(10.0, "rank 0 recomputes the run's goodput and restarts from events.jsonl at most "
                                    "this often, in seconds", flag="--metrics-refresh-s")
    data_wait_window: int = _f(50, "steps per data-starvation window")
    data_wait_warn: float = _f(0.25, "warn once per window when waiting for batches takes at least this share "
                                     "of the step time (0 = off)")
    status_every_s: float = _f(10.0, "rank 0 reports the run's progress (step, ETA, loss, tokens/s, goodput, restarts, "
                                     "last committed step) this often, in seconds: progress.json in --out, and a "
                                     "TrainJob's status or the pod's annotation on a cluster (0 = off)")
    straggler_report_s: float = _f(0.0, "GPU only: every this many seconds NVRx's straggler detection scores each "
                                        "rank's CUDA kernels against the fastest rank's and its own best, and rank 0 "
                                        "records ranks below 0.75 as a 'straggler' event and metric (0 = off)")


def _metrics_problems(m: MetricsConfig) -> list[str]:
    problems = []
    if m.metrics_port != 0 and not 1 <= m.metrics_port <= 65535:
        problems.append(f"--metrics-port must be 0 (off) or a port number, got {m.metrics_port}")
    if m.straggler_report_s < 0:
        problems.append(f"--straggler-report-s must be 0 (off) or a number of seconds, got {m.straggler_report_s}")
    if m.status_every_s < 0:
        problems.append(f"--status-every-s must be 0 (off) or a number of seconds, got {m.status_every_s}")
    if m.data_wait_window < 1 or not 0 <= m.data_wait_warn <= 1 or m.run_refresh_s < 0:
        problems.append("--data-wait-window must be at least 1, --data-wait-warn in [0, 1] and "
                        "--metrics-refresh-s not negative")
    return problems


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "parallel": ParallelConfig,
    "checkpoint": CheckpointConfig,
    "run": RunConfig,
    "restart": RestartConfig,
    "faults": FaultConfig,
    "spot": SpotConfig,
    "metrics": MetricsConfig,
}


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    faults: FaultConfig = field(default_factory=FaultConfig)
    spot: SpotConfig = field(default_factory=SpotConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self, check_model: bool = True) -> "TrainConfig":
        """``check_model=False``: the model is not built (a caller whose settings were checked with it already)."""
        m, d, o, c, r = self.model, self.data, self.optim, self.checkpoint, self.run
        problems = []
        if m.n_embd % m.n_head:
            problems.append(f"--n-embd ({m.n_embd}) must be divisible by --n-head ({m.n_head})")
        defaults = ModelConfig()
        changed = [_flag(f) for f in dataclasses.fields(m) if f.name in BYTEGPT_FLAGS
                   and getattr(m, f.name) != getattr(defaults, f.name)]
        if m.name != "bytegpt" and changed:
            problems.append(f"{', '.join(changed)} set bytegpt's fields; give --model {m.name} its fields with "
                            f"--model-config")
        for name, value in (("--n-layer", m.n_layer), ("--n-head", m.n_head), ("--seq-len", m.seq_len),
                            ("--batch-size", d.batch_size), ("--grad-accum", d.grad_accum),
                            ("--max-steps", r.max_steps), ("--ckpt-keep", c.keep),
                            ("--ckpt-threads", c.write_threads)):
            if value < 1:
                problems.append(f"{name} must be at least 1, got {value}")
        try:
            if (c.every_steps or 0) < 0:
                raise ValueError
        except ValueError:
            problems.append(f"--ckpt-every must be a number of steps or 'auto', got {c.ckpt_every!r}")
        for name, value in (("--ckpt-writer-nice", c.writer_nice), ("--ckpt-copy-nice", c.copy_nice)):
            if not 0 <= value <= 19:
                problems.append(f"{name} must be between 0 and 19, got {value}")
        if c.ckpt_every_s < 0 or c.mtbf_s < 0 or c.memory_every_s < 0:
            problems.append("--ckpt-every-s, --mtbf-s and --memory-snapshot-every-s must not be negative")
        rs = self.restart
        if not (rs.monitor_interval_s < rs.soft_timeout_s < rs.hard_timeout_s < rs.barrier_timeout_s
                and rs.heartbeat_timeout_s < rs.barrier_timeout_s and rs.monitor_interval_s < rs.heartbeat_timeout_s):
            problems.append("in-process timeouts must satisfy interval < soft < hard < barrier and "
                            "interval < heartbeat < barrier")
        if rs.collective_timeout_s <= 0:
            problems.append("--collective-timeout-s must be positive")
        if r.lock_wait_s < 0:
            problems.append(f"--run-lock-wait-s must not be negative, got {r.lock_wait_s:g}")
        if not 0 <= m.dropout < 1:
            problems.append(f"--dropout must be in [0, 1), got {m.dropout}")
        if o.lr < 0:   # 0 keeps the weights as built or loaded (--init-from): a round trip check
            problems.append(f"--lr must not be negative, got {o.lr}")
        if not d.data:
            problems.append("--data is required: a dataset directory with manifest.json")
        for spec in self.faults.inject_fault:
            try:
                kind = Fault.parse(spec).kind
                if kind == "corrupt-mirror" and not c.mirror:
                    problems.append(f"--inject-fault {spec} needs --ckpt-mirror")
                if kind == "corrupt-peer" and not c.peer_snapshots:
                    problems.append(f"--inject-fault {spec} needs peer snapshots (drop --no-peer-snapshots)")
            except ValueError as e:
                problems.append(str(e))
        if self.faults.chaos_seed >= 0 and self.faults.fault_every <= 0:
            problems.append("--chaos-seed needs --fault-every SECONDS > 0")
        problems += _mirror_and_spot_problems(c, self.spot)
        problems += _metrics_problems(self.metrics)
        # The model is built to check it, which needs torch: the component image that runs the pipeline's
        # check-settings step and the job launcher has none, and there the trainer checks it when it starts.
        from .mesh import setting_problems

        p = self.parallel
        problems += setting_problems(p.parallel, p.dp_replicate, p.dp_shard, p.tp)
        if not problems and check_model and _torch_available():
            try:
                problems += self.model.spec(d.data).tp_problems(p.tp, m.seq_len)
            except ValueError as e:   # ModelError, HFError, check_vocab: each says what to fix
                problems.append(str(e))
        if problems:
            raise ValueError("invalid trainer configuration: " + "; ".join(problems))
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_values(cls, values: dict[str, dict[str, Any]]) -> "TrainConfig":
        """A config from ``settings_values`` (not validated)."""
        return cls(**{s: SECTIONS[s](**values.get(s, {})) for s in SECTIONS})

    def argv(self) -> list[str]:
        """The arguments of ``python -m trainer`` that run with these settings: the document, as one argument."""
        return ["--settings", json.dumps(self.document(), sort_keys=True, separators=(",", ":"))]

    def document(self) -> dict:
        """The settings that differ from their defaults, ``{section: {field: value}}``: what a launcher hands the
        ranks (``--settings``) and what ``settings_values`` reads back."""
        defaults = TrainConfig().to_dict()
        return {section: changed for section, values in self.to_dict().items()
                if (changed := {k: v for k, v in values.items() if v != defaults[section][k]})}

    def save(self, path: Path, model: dict | None = None) -> None:
        """Write the config as JSON; ``model``: the resolved spec (``ModelSpec.describe()``: name, flavor,
        config), which evaluate and export rebuild the model from (``spec_from_run_config``)."""
        d = self.to_dict()
        d["model"].update(model or {})
        write_text(path, json.dumps(d, indent=1, sort_keys=True))


def _torch_available() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:          # an import hook that refuses it (tests of the component image)
        return False


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def describe_flags() -> list[tuple[str, list[tuple[str, str]]]]:
    """(section, [(flag and metavar, help with default)]) for the trainer's flags, for help texts."""
    out = []
    for section, cls in SECTIONS.items():
        rows = []
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            meta = "" if f.type in ("bool", bool) else " " + f.metadata.get("metavar", str(f.type).upper())
            rows.append((_flag(f) + meta, f"{f.metadata['help']} (default: {f.default})"))
        out.append((section, rows))
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line that says what to fix (a ValueError, as every other bad setting), not the whole usage.
        raise ValueError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(prog: str = "python -m trainer") -> argparse.ArgumentParser:
    """The trainer's argument parser, one group per config section."""
    p = _Parser(prog=prog, description="Train a model (bytegpt, llama or your own) with FSDP2/DDP, NVRx async "
                                       "checkpoints and exact resume.", argument_default=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help="settings file: TOML with [model], [data], ... tables, or JSON of the "
                                               "same shape (a run directory's settings.json)")
    p.add_argument("--settings", metavar="JSON", help="settings as one JSON object, {\"section\": {\"field\": value}} "
                                                      "or {\"section.field\": value}; over --config, under flags")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section)
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False:
                continue
            kw: dict[str, Any] = {"dest": f"{section}.{f.name}",
                                  "help": f"{f.metadata['help']} (default: {f.default})"}
            if f.type in ("bool", bool):
                kw["action"] = argparse.BooleanOptionalAction
            elif f.type in ("list", list):
                kw["action"] = "append"
                kw["metavar"] = f.metadata.get("metavar", "VALUE")
            else:
                kw["type"] = {"int": int, "float": float, "str": str}[str(f.type)]
                kw["metavar"] = str(f.type).upper()
            if "choices" in f.metadata:
                kw["choices"] = f.metadata["choices"]
            group.add_argument(_flag(f), **kw)
    return p


_KINDS = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}


def coerce_value(kind: type | str, value: Any, where: str, choices: tuple = ()) -> Any:
    """``value`` as a ``kind`` (``str``, ``int``, ``float``, ``bool``, ``list`` of strings or ``dict``, or its name),
    else a one-line ValueError that names ``where``; with ``choices``, one of them.

    The one rule for typed values from a settings file, ``--settings``, the pipeline's parameters and KFP dict
    parameters. A KFP dict parameter is a protobuf Struct, where every number is a float: 200.0 is the int 200;
    a whole number given for a str setting is its text (``ckpt_every = 250``, where "N or auto" is asked). No
    string is taken for a number or a boolean: text is parsed by the command line's own typed options.
    """
    t = kind if isinstance(kind, str) else kind.__name__
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "int" and number and float(value).is_integer():
        value = int(value)
    elif t == "float" and number:
        value = float(value)
    elif t == "str" and number and float(value).is_integer():
        value = str(int(value))
    ok = isinstance(value, _KINDS[t]) and not (t in ("int", "float") and isinstance(value, bool))
    if t == "list":
        ok = ok and all(isinstance(v, str) for v in value)
    if not ok:
        raise ValueError(f"{where}: {value!r} is not a{'n' if t == 'int' else ''} {t}")
    if choices and value not in choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(choices)}")
    return value


def settings_values(doc: dict, where: str = "settings") -> dict[str, dict[str, Any]]:
    """``{section: {field: value}}`` from a settings document (nested tables, or ``"section.field"`` keys), each
    value checked against its field's type; an unknown section or field is a ValueError naming it."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected an object of settings, got {type(doc).__name__}")
    out: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in doc.items():
        section, _, name = key.partition(".")
        items = {name: value} if name else value
        if section not in SECTIONS or not isinstance(items, dict):
            raise ValueError(f"{where}: {key!r} is neither a section ({', '.join(SECTIONS)}) holding an object nor "
                             f"section.field")
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        for field_name, v in items.items():
            if field_name not in fields:
                raise ValueError(f"{where}: unknown setting {section}.{field_name} (the {section} settings are "
                                 f"{', '.join(fields)})")
            f = fields[field_name]
            out[section][field_name] = coerce_value(str(f.type), v, f"{where}: {section}.{field_name}",
                                                    f.metadata.get("choices", ()))
    return out


def _read_file(path: Path) -> dict:
    with open(path, "rb") as fh:
        if path.suffix == ".json":
            try:
                return json.load(fh)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return tomllib.load(fh)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML ({e})") from None


def parse_config(argv: list[str] | None = None, *, validate: bool = True,
                 prog: str = "python -m trainer") -> TrainConfig:
    """Parse the command line (with ``--config FILE`` and ``--settings JSON``) into a ``TrainConfig``, validated
    unless ``validate`` is off (a launcher completing the settings first)."""
    args = vars(build_parser(prog).parse_args(argv))
    documents = []
    if "config" in args:
        documents.append((str(args["config"]), _read_file(args.pop("config"))))
    if "settings" in args:
        try:
            documents.append(("--settings", json.loads(args.pop("settings"))))
        except json.JSONDecodeError as e:
            raise ValueError(f"--settings is not valid JSON ({e})") from None
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for where, doc in documents:
        for section, table in settings_values(doc, where).items():
            values[section].update(table)
    for dest, value in args.items():
        section, name = dest.split(".", 1)
        values[section][name] = value
    cfg = TrainConfig.from_values(values)
    return cfg.validate() if validate else cfg


def config_from_dict(d: dict, where: str = "settings") -> TrainConfig:
    """A config from a settings document (``TrainConfig.document()``, a saved ``config.json``); not validated.
    Keys a saved config.json adds to its model section (the resolved spec) are left out."""
    known = {s: {f.name for f in dataclasses.fields(cls)} for s, cls in SECTIONS.items()}
    doc = {s: {k: v for k, v in (d.get(s) or {}).items() if k in known[s]} for s in SECTIONS}
    return TrainConfig.from_values(settings_values(doc, where))


class RunMismatch(ValueError):
    """A run pointed at a run directory that holds another run."""


def defining_differences(recorded: TrainConfig, cfg: TrainConfig) -> list[str]:
    """``section.field: recorded -> now`` for each setting that defines a run and differs."""
    return [f"{section}.{f.name}: {getattr(getattr(recorded, section), f.name)!r} -> "
            f"{getattr(getattr(cfg, section), f.name)!r}"
            for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
            if f.metadata.get("defines")
            and getattr(getattr(recorded, section), f.name) != getattr(getattr(cfg, section), f.name)]


def check_run_directory(out: Path, cfg: TrainConfig) -> None:
    """Refuse (``RunMismatch``) a run whose directory ``out`` records another run's settings."""
    path = layout.settings_path(out)
    if not path.is_file():
        return
    try:
        recorded = config_from_dict(json.loads(path.read_text()), str(path))
    except (OSError, ValueError) as e:
        raise RunMismatch(f"{path} cannot be read ({e}): is {out} a run directory of this version?") from None
    differences = defining_differences(recorded, cfg)
    if differences:
        raise RunMismatch(f"{out} holds another run (it was started with other settings: {'; '.join(differences)}); "
                          f"give a new run directory, or that run's settings to resume it")


def record_settings(out: Path, cfg: TrainConfig) -> None:
    """Check ``out`` (``check_run_directory``) and record ``cfg`` as its run's settings."""
    check_run_directory(out, cfg)
    Path(out).mkdir(parents=True, exist_ok=True)
    write_json(layout.settings_path(out), cfg.to_dict(), indent=1)
