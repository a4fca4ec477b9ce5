"""``Session``: what lives as long as the training process, across in-process restarts.

The config, the event log, the stop-signal flag, fault injection, the rank monitor's client, metrics,
the spot watcher, the datasets, and the checkpoint manager (its writer process, staging copy and memory
snapshots). In-process restarts reuse it, so no restart pays for these twice; each attempt (``Trainer``)
builds only what depends on the process group.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from . import layout, warmstart
from .checkpoint import CheckpointManager
from .config import TrainConfig, record_settings
from .data import Split
from .events import Event, EventLog, read_events
from .faults import FaultInjector
from .ft import FTManager
from .metrics import build_metrics
from .parallel import Dist, ensure_launcher_env
from .restart import launch_agents
from .signals import SigtermFlag
from .spot import build_spot_watcher


class Session:
    def __init__(self, cfg: TrainConfig):
        ensure_launcher_env()
        self.cfg = cfg
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.out = Path(cfg.run.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.spec = cfg.model.spec(cfg.data.data)   # the model, its vocabulary checked against the dataset
        self.events_path = layout.events_path(self.out)
        self.events = EventLog(self.events_path, self.rank)
        self.run_id: str | None = None    # rank 0's, from _record_start; the others learn it in restore
        self.sigterm = SigtermFlag.install()
        # Every node's agent (collective, before the process group: on the launcher's store it is built on).
        agents = launch_agents(cfg.restart.collective_timeout_s)
        if self.rank == 0:
            self._record_start(agents)
        self.events.emit(Event.WORKER_START, pid=os.getpid(), warm=warmstart.forked)
        self.faults = FaultInjector(cfg.faults.inject_fault, self.rank, self.world_size, self.events,
                                    self.events_path,
                                    chaos_seed=cfg.faults.chaos_seed if cfg.faults.chaos_seed >= 0 else None,
                                    fault_every_s=cfg.faults.fault_every, ckpt=cfg.checkpoint)
        self.ft = FTManager(cfg.restart.ft_calc_after_steps, cfg.restart.ft_min_step_timeout_s,
                            cfg.restart.ft_ipc_timeout_s)
        # --metrics-port: Prometheus endpoint on port + LOCAL_RANK; the data-starvation warning either way.
        self.metrics = build_metrics(cfg.metrics, rank=self.rank, world_size=self.world_size, events=self.events,
                                     events_path=self.events_path)
        self.spot = build_spot_watcher(cfg.spot, self.events)   # --spot-watch: IMDSv2 poller on local rank 0
        self.split_train = Split.open(Path(cfg.data.data), "train")
        self.split_val = Split.open(Path(cfg.data.data), "val")
        self.ckpt: CheckpointManager | None = None

    def _record_start(self, agents: dict[int, tuple[int, str | None]] | None = None) -> None:
        """``run_start``, and which layer restarted: decided job-wide from every node's agent (``agents``, by
        group rank: ``launch_agents``; None: this process's agent only).

        An in-job restart if any agent counted a restart, or any agent's attempt (its per-process log directory
        and attempt) was seen before: an agent that restarts its workers for a membership change (a node joined
        or left) keeps both; a replacement node's agent is new. A start where every agent is new is a new job's.
        """
        restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if agents is None:
            agents = {int(os.environ.get("GROUP_RANK", "0")):
                      (restart_count, os.environ.get("TORCHELASTIC_ERROR_FILE"))}
        starts = [e for e in read_events(self.events_path) if e["event"] == Event.RUN_START]
        attempts = {str(node): attempt for node, (_, attempt) in agents.items() if attempt}
        seen = {a for e in starts for a in (e.get("agent_attempts") or {}).values()}
        most = max(count for count, _ in agents.values())
        # Names the run across its restarts; memory snapshots left on a node are trusted only by their run.
        self.run_id = (starts[0].get("run_id") if starts else None) or uuid.uuid4().hex
        record_settings(self.out, self.cfg)
        self.cfg.save(layout.config_path(self.out), model=self.spec.describe())
        self.events.emit(Event.RUN_START, world_size=self.world_size, restart_count=restart_count, run_id=self.run_id,
                         agent_attempts=attempts,
                         agent_restart_counts={str(node): count for node, (count, _) in agents.items()})
        if most > 0:
            self.events.emit(Event.RESTART, layer="injob", restart_count=most)
        elif seen & set(attempts.values()):
            self.events.emit(Event.RESTART, layer="injob", restart_count=0, membership_change=True)
        elif starts:
            self.events.emit(Event.RESTART, layer="job")

    def checkpoints(self, d: Dist) -> CheckpointManager:
        """The process's checkpoint manager, built by the first attempt (it needs the process's device)."""
        if self.ckpt is None:
            self.ckpt = CheckpointManager(layout.checkpoints_dir(self.out), self.cfg.checkpoint, d, self.events,
                                          on_write_started=self.faults.on_checkpoint_write_started,
                                          # Snapshots name the mesh too: another one shards the state otherwise.
                                          run_id=None if self.run_id is None else f"{self.run_id}/{d.mesh_tag}")
            self.faults.snapshots_marked = self.ckpt.wait_for_mark
        return self.ckpt

    def close(self) -> None:
        self.spot.close()
        self.metrics.close()
        if self.ckpt is not None:
            self.ckpt.close()
        self.ft.close()
        self.events.close()
