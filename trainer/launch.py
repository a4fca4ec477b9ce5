"""The command that starts the trainer's processes: NVRx ``ft_launcher`` running ``python -m trainer``.

One builder serves both faces: ``goodput train`` runs it on this machine (``--standalone``), and the
PyTorchJob and TrainJob builders put it into every pod (c10d rendezvous on the master service). The
launcher's options are ``compat.launcher_args``: only flags the target NVRx release accepts, with their
meaning on it. This module imports no torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import compat
from .config import TrainConfig, check_run_directory, parse_config
from . import layout
from .data import default_dataset_dir, ensure_default_dataset
from .digests import path_digest
from .fault_spec import Fault
from .peer import SECRET_ENV as PEER_SECRET_ENV
from .runlock import in_use_by
from .signals import (NODE_ENV, STOP_SIGNALS, STOPPED_S, StoppedFor, handlers, marked, parent_death_preexec,
                      reap)
from .warmstart import NodePlace, wait_unless_stopped


LAUNCHER_MODULE = "nvidia_resiliency_ext.fault_tolerance.launcher"
# The rendezvous timeouts' defaults: ft_launcher's join timeout (it raises torch's 600 s), torch's last call.
# Not passed when kept, so a pod's command changes only where a setting does.
NVRX_JOIN_TIMEOUT_S = 900.0
TORCH_LAST_CALL_S = 30.0


@dataclass
class LaunchConfig:
    """How the worker group is started and when ft_launcher restarts it."""

    # Either may be a $(VAR) placeholder that the pod's environment fills in (a TrainJob's PET_NNODES).
    nproc_per_node: int | str = field(default=2, metadata={"help": "worker processes per node (GPUs per node)"})
    nnodes: int | str = field(default=1, metadata={"help": "nodes in the job"})
    max_restarts: int = field(default=3, metadata={"help": "in-job restarts of the worker group before failing"})
    rdzv_endpoint: str = field(default="", metadata={
        "help": "host:port of the c10d rendezvous; empty = --standalone (one node, local store)"})
    rdzv_id: str = field(default="goodput", metadata={"help": "rendezvous id shared by the job's nodes"})
    join_timeout_s: float = field(default=NVRX_JOIN_TIMEOUT_S, metadata={
        "help": "seconds a node waits in the c10d rendezvous for the others (a node that never joins fails "
                "the job after this)"})
    last_call_timeout_s: float = field(default=TORCH_LAST_CALL_S, metadata={
        "help": "elastic jobs: once the fewest nodes have joined, seconds the rendezvous waits for more"})
    # A lost node is dropped from the rendezvous after interval x attempts without a heartbeat: the survivors'
    # next round waits that long. Shorter recovers sooner; too short drops a live node whose beats a network
    # hiccup or a stalled store delayed (its job then restarts), and every beat is a write to the store.
    keep_alive_interval_s: float = field(default=0.0, metadata={
        "help": "seconds between a node's rendezvous heartbeats (0: NVRx's 5 s; 0.5 s for local nodes)"})
    keep_alive_max_attempts: int = field(default=0, metadata={
        "help": "heartbeats a node may miss before the rendezvous drops it as lost (0: NVRx's 3, also for "
                "local nodes)"})
    # Every step of a rendezvous round is seen by the other nodes at their next poll; each poll is a read of
    # the rendezvous store by every waiting node.
    rdzv_poll_interval_s: float = field(default=0.0, metadata={
        "help": "seconds between a waiting node's reads of the rendezvous state (0: NVRx's 1 s; 0.1 s for local "
                "nodes)"})
    # Rank-monitor timeouts (seconds). Sections are opened by the trainer; each timeout is a safe upper
    # bound for its phase, and the trainer tightens ``step`` from measured step times at run time.
    setup_timeout_s: float = field(default=600.0, metadata={"help": "init, data, resume (section 'setup')"})
    step_timeout_s: float = field(default=300.0, metadata={"help": "one training step (section 'step')"})
    checkpoint_timeout_s: float = field(default=900.0, metadata={
        "help": "a blocking checkpoint (section 'checkpoint')"})
    out_of_section_timeout_s: float = field(default=600.0, metadata={"help": "code outside any section"})
    workload_check_interval_s: float = field(default=1.0, metadata={
        "help": "how often the rank monitor checks its rank (bounds hang detection latency)"})
    monitor_interval_s: float = field(default=0.5, metadata={
        "help": "how often the launcher polls its workers (bounds dead-process detection latency)"})
    term_timeout_s: float = field(default=60.0, metadata={
        "help": "SIGTERM to SIGKILL grace when the launcher is stopped (covers the SIGTERM checkpoint)"})
    # Survivors of a restarting group have nothing to finish (the memory snapshot and the commit protocol
    # survive SIGKILL), and a hung rank cannot honour SIGTERM: the grace only delays the restart.
    workers_stop_timeout_s: float = field(default=1.0, metadata={
        "help": "SIGTERM to SIGKILL grace for surviving workers when the group is restarted"})
    warm_start: bool = field(default=True, metadata={
        "help": "fork ranks from a process that imported torch once (trainer.warmstart), so a restarted "
                "group skips the imports"})

    def validate(self) -> "LaunchConfig":
        counts = {"nnodes": self.nnodes, "nproc_per_node": self.nproc_per_node}
        known = {k: compat.count(v, k) for k, v in counts.items() if not compat.is_placeholder(v)}
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must not be negative, got {self.max_restarts}")
        if self.join_timeout_s <= 0 or self.last_call_timeout_s < 0:
            raise ValueError(f"join_timeout_s must be positive and last_call_timeout_s not negative, got "
                             f"{self.join_timeout_s} and {self.last_call_timeout_s}")
        if min(self.keep_alive_interval_s, self.keep_alive_max_attempts, self.rdzv_poll_interval_s) < 0:
            raise ValueError(f"keep_alive_interval_s, keep_alive_max_attempts and rdzv_poll_interval_s must not be "
                             f"negative (0: NVRx's default), got {self.keep_alive_interval_s}, "
                             f"{self.keep_alive_max_attempts} and {self.rdzv_poll_interval_s}")
        if known.get("nnodes", 2) > 1 and not self.rdzv_endpoint:   # a placeholder may be many nodes
            raise ValueError("a multi-node job needs rdzv_endpoint (host:port of the rendezvous)")
        return self

    def keep_alive(self) -> tuple[float, int]:
        """(heartbeat interval s, missed beats) with NVRx's for what is 0."""
        return (self.keep_alive_interval_s or compat.NVRX_KEEP_ALIVE[0],
                self.keep_alive_max_attempts or compat.NVRX_KEEP_ALIVE[1])

    def rdzv_timing_conf(self, release: compat.Release) -> dict[str, str]:
        """The ``--rdzv-conf`` entries of the keep-alive and the poll (none for NVRx's); ``ValueError`` where
        the release's rendezvous cannot honour them."""
        return compat.keep_alive_conf(*self.keep_alive(), release, self.rdzv_poll_interval_s or compat.NVRX_RDZV_POLL_S)


def launcher_command(launch: LaunchConfig, trainer_args: list[str], *, executable: str | None = None,
                     release: compat.Release | None = None,
                     extras: compat.LauncherExtras = compat.LauncherExtras(),
                     rdzv_conf: dict[str, str] | None = None, standby_gate: Path | None = None) -> list[str]:
    """ft_launcher argv that runs ``python -m trainer <trainer_args>`` on one node (behind
    ``python -m trainer.warmstart`` unless ``launch.warm_start`` is off).

    Args:
        launch: worker group and fault-tolerance settings.
        trainer_args: arguments of ``python -m trainer``.
        executable: Python interpreter for a local run (the launcher module runs under it); None means
            the ``ft_launcher`` entry point on PATH, as in the trainer image.
        release: the NVRx release the command is for (the trainer image's pin); None means
            ``compat.target_release()``: ``$GOODPUT_NVRX_VERSION``, else the installed one.
        extras: launcher features only some releases have (hot spares, health checks); one the release
            lacks is a ``ValueError``.
        rdzv_conf: more c10d rendezvous settings (``--rdzv-conf``) of a multi-node job.
        standby_gate: a FIFO: the launcher imports NVRx, then waits for a line on it before it joins the
            rendezvous (a standby node, ``LocalCluster.promote``).

    A keep-alive or poll other than NVRx's (``launch.keep_alive_*``, ``launch.rdzv_poll_interval_s``) goes into
    ``--rdzv-conf`` and the launcher runs as ``python -m trainer.launch`` (``compat.prepare_launcher``), which
    makes NVRx's rendezvous read them.
    """
    launch.validate()
    release = compat.target_release() if release is None else release
    keep_alive = launch.rdzv_timing_conf(release) if launch.rdzv_endpoint else {}
    conf = {**({"join_timeout": f"{launch.join_timeout_s:g}"} if launch.join_timeout_s != NVRX_JOIN_TIMEOUT_S
               else {}),
            **({"last_call_timeout": f"{launch.last_call_timeout_s:g}"}
               if launch.last_call_timeout_s != TORCH_LAST_CALL_S else {}),
            **keep_alive, **(rdzv_conf or {})}
    rdzv = ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items())] if conf and launch.rdzv_endpoint else []
    # NVRx reads neither setting, and has no gate: an entry point of ours makes its rendezvous read the
    # --rdzv-conf keys and holds a standby back.
    gate = [STANDBY_GATE_FLAG, str(standby_gate)] if standby_gate else []
    head = ([executable or "python", "-m", compat.LAUNCHER_ENTRY, *gate] if keep_alive or gate else
            [executable, "-m", LAUNCHER_MODULE] if executable else ["ft_launcher"])
    # Cold too, the wrapper's zygote is the node's janitor: it ends what a killed launcher leaves behind. It is
    # told the node's place in the job (its peer daemon's) with the values the launcher gets.
    place = NodePlace(compat.nnodes_arg(launch.nnodes, release, min_nodes=extras.min_nodes,
                                        spare_nodes=extras.spare_nodes),
                      launch.rdzv_endpoint, launch.rdzv_id) if launch.rdzv_endpoint else NodePlace()
    head = [executable or "python", "-m", "trainer.warmstart", *([] if launch.warm_start else ["--cold"]),
            *place.args(), *head]
    return [
        *head,
        *compat.launcher_args(launch, release, extras),
        *rdzv,
        "-m", "trainer",
        *trainer_args,
    ]


def local_launcher_command(launch: LaunchConfig, trainer_args: list[str]) -> list[str]:
    """The same command for this machine: the launcher runs under this interpreter."""
    return launcher_command(launch, trainer_args, executable=sys.executable)


class LaunchError(ValueError):
    """A run that cannot work as asked (settings, data, output directory): found before any process starts.

    It would fail the same way every time, so no layer retries it."""


def _check_writable(path: Path, what: str) -> None:
    """``path`` is, or can be created as, a writable directory (nothing is created here)."""
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise LaunchError(f"{what} {path} cannot be created: {existing} is not a directory")
    try:   # a probe, removed at once: permissions alone do not tell (root, read-only mounts, /proc)
        tempfile.TemporaryDirectory(dir=existing, prefix=".goodput-probe-").cleanup()
    except OSError as e:
        raise LaunchError(f"{what} {path} is not writable: cannot create anything in {existing} "
                          f"({e.strerror})") from None


def _check_dataset(data: Path, cfg) -> None:
    """The manifest exists, parses, has the format and splits the trainer reads, and each rank gets a window."""
    from .data import Split

    try:
        splits = [Split.open(data, split) for split in ("train", "val")]
    except json.JSONDecodeError as e:
        raise LaunchError(f"dataset {data}: manifest.json is not valid JSON ({e}); rebuild it with "
                          "`python -m trainer.data` or `goodput stage`") from None
    except (OSError, ValueError) as e:
        raise LaunchError(f"dataset {data}: {e}") from None
    except (KeyError, TypeError) as e:
        raise LaunchError(f"dataset {data}: manifest.json lacks {e} (is it a goodput dataset?)") from None
    if len(splits[0]) < cfg.model.seq_len + 2:
        raise LaunchError(f"dataset {data}: the train split holds {len(splits[0])} tokens, fewer than one "
                          f"sequence of {cfg.model.seq_len + 1}")


def check_faults(specs: list[str], world_size: int, max_steps: int) -> None:
    """Refuse an injected fault that could never fire: a rank the run does not have, a step after the last."""
    for f in map(Fault.parse, specs):
        if f.rank >= world_size:
            raise LaunchError(f"--inject-fault {f.id}: rank {f.rank} does not exist in a run of {world_size} "
                              f"rank(s) (ranks are 0..{world_size - 1})")
        if f.step > max_steps:
            raise LaunchError(f"--inject-fault {f.id}: step {f.step} comes after the last step ({max_steps})")


def validate_launch(cfg: TrainConfig, launch: LaunchConfig, fsx_root: Path, *,
                    model_checked: bool = False) -> TrainConfig:
    """Everything about a local run that can be checked before any process starts or anything is written.

    Returns the settings, validated, with the default dataset (under ``fsx_root``) where they name none;
    raises ``LaunchError`` with one line that says what to fix. ``model_checked``: the model is not built again
    (importing torch for it costs seconds of CPU before the launcher starts; the ranks check it too).
    """
    default_data = not cfg.data.data
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, data=str(default_dataset_dir(fsx_root)))
                              ) if default_data else cfg
    try:
        cfg.validate(check_model=not model_checked)
        launch.validate()
        check_run_directory(Path(cfg.run.out), cfg)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if busy := in_use_by(cfg.run.out):
        raise LaunchError(busy)
    if compat.is_placeholder(launch.nproc_per_node) or compat.is_placeholder(launch.nnodes):
        raise LaunchError(f"a local run needs node and process counts, got nnodes={launch.nnodes} "
                          f"nproc_per_node={launch.nproc_per_node}")
    check_faults(cfg.faults.inject_fault, int(launch.nproc_per_node) * int(launch.nnodes), cfg.run.max_steps)
    _check_writable(Path(cfg.run.out), "--out")
    if default_data:
        if not (default_dataset_dir(fsx_root) / layout.MANIFEST).is_file():   # to be built
            _check_writable(default_dataset_dir(fsx_root), "--fsx-root: the default dataset directory")
    else:
        _check_dataset(Path(cfg.data.data), cfg)
    return cfg


def run_local_training(settings: TrainConfig, launch: LaunchConfig, fsx_root: Path, *,
                       min_nodes: int = 0, model_checked: bool = False) -> tuple[int, dict | None]:
    """Validate, build the default dataset if needed, launch, wait; return (exit code, this run's summary or None).

    The core of ``goodput train`` without click, used by the local training backend too. ``LaunchError``
    before anything starts. ``launch.nnodes`` > 1 starts that many node process trees (``LocalCluster``);
    ``min_nodes`` (< nnodes) makes the job elastic (``--nnodes MIN:MAX``). SIGINT and SIGTERM stop the run:
    the ranks commit a checkpoint and exit, and the exit code is 130 or 143 (128 + the signal) with no summary.
    ``model_checked``: the settings' model was built and checked already (the pipeline's check-settings step).
    """
    nodes = compat.count(launch.nnodes, "nnodes") if not compat.is_placeholder(launch.nnodes) else 1
    if min_nodes and not 0 < min_nodes < nodes:
        raise LaunchError(f"--nodes MIN:MAX needs 1 <= MIN < MAX, got {min_nodes}:{nodes}")
    # The nodes of a local run meet on a loopback port chosen when they start.
    checked = dataclasses.replace(launch, rdzv_endpoint=launch.rdzv_endpoint or "127.0.0.1:0") if nodes > 1 else launch
    cfg = validate_launch(settings, checked, fsx_root, model_checked=model_checked)
    try:
        compat.nnodes_arg(nodes, compat.target_release(), min_nodes=min_nodes)
        if nodes > 1:
            launch.rdzv_timing_conf(compat.target_release())
    except ValueError as e:
        raise LaunchError(str(e)) from None
    if not settings.data.data:
        try:
            ensure_default_dataset(fsx_root)
        except OSError as e:
            raise LaunchError(f"cannot build the default dataset under {fsx_root}: {e}") from None
        _check_dataset(Path(cfg.data.data), cfg)
    args = cfg.argv()
    started = time.time()
    stopped_by: list[int] = []
    if nodes > 1:
        cluster = LocalCluster(launch, args, min_nodes=min_nodes)
        stop_run = cluster.terminate
    else:
        # Its own session: a terminal's Ctrl-C reaches this process only, which stops the run once, with SIGTERM
        # (ft_launcher would pass SIGINT on to every process group of its workers, where NVRx's helpers die of
        # it). The launcher's tree dies with this process when it is killed (SIGKILL: its own stop signals
        # end the run with a checkpoint, through ``stop``).
        proc = subprocess.Popen(local_launcher_command(launch, args), start_new_session=True,
                                preexec_fn=parent_death_preexec(signal.SIGKILL))
        stop_run = lambda: proc.send_signal(signal.SIGTERM)  # noqa: E731

    def stop(signum, _frame):
        if not stopped_by:
            stopped_by.append(signum)
            stop_run()

    with handlers({s: stop for s in STOP_SIGNALS}):
        if nodes > 1:
            with cluster:
                cluster.start()
                code = cluster.supervise()
            if code and not stopped_by and not _any_rank_started(Path(cfg.run.out), since=started):
                print(f"goodput train: no rank ever started: not all {nodes} nodes joined the rendezvous "
                      f"within --join-timeout-s ({launch.join_timeout_s:g} s)", file=sys.stderr)
        else:
            code = wait_unless_stopped(proc, "goodput train: the launch wrapper")
            if code < 0:
                print(f"goodput train: the launch wrapper (pid {proc.pid}) died of {signal.Signals(-code).name}",
                      file=sys.stderr)
    if stopped_by:
        return 128 + stopped_by[0], None
    if code < 0:
        code = 128 - code
    from .summary import read_summary

    summary = read_summary(Path(cfg.run.out), since=started) if code == 0 else None
    return code, summary


def _any_rank_started(out: Path, since: float) -> bool:
    from .events import Event, read_events

    return any(e["event"] == Event.RUN_START and e["t"] >= since for e in read_events(layout.events_path(out)))


# ---- many nodes on this machine -----------------------------------------------------------------------

KILL_TIMEOUT_S = 10.0
# Loopback does not drop packets: a lost node is dropped after 1.5 s without a heartbeat instead of NVRx's 15 s
# (1-1.5 s after the loss: its last beat came up to an interval before), and a waiting node re-reads the
# rendezvous state every 0.1 s instead of every second (each step of a round is seen that much sooner; with 2-4
# nodes the store serves a few dozen reads a second). A node's agent beats from a thread of its own, and a
# waiting one at each poll: 1.5 s tolerates an agent stalled for two beats.
LOCAL_KEEP_ALIVE = (0.5, 3)
LOCAL_RDZV_POLL_S = 0.1
STANDBY_GATE_FLAG = "--standby-gate"
# A standby's launcher must have imported NVRx (and so torch) before its promotion counts as warm; past this,
# ``promote`` gives up on it.
STANDBY_READY_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalNode:
    """One node of a ``LocalCluster``: its launch wrapper (the tree's root, a session of its own) and the
    memory-snapshot directory that stands for the node's /dev/shm."""

    index: int
    memory_dir: Path
    log: Path | None
    proc: subprocess.Popen | None = None
    generation: int = 0      # how many times it was started (a replacement is the next generation)
    lost: bool = False       # killed by ``LocalCluster.kill``: a node loss, not a failure of the job
    gate: Path | None = None  # a standby's: the FIFO its launcher waits on before it joins the rendezvous

    @property
    def marker(self) -> str:
        return f"{self.memory_dir}:{self.generation}"


def await_promotion(gate: Path) -> None:
    """A standby launcher's wait: say it is ready (``<gate>.ready``), then block until a line comes on the FIFO
    ``gate`` (``LocalCluster.promote``). It ends with the node: the launch wrapper's SIGTERM, or its death."""
    Path(f"{gate}.ready").touch()
    with open(gate, "rb") as fifo:    # blocks until the writer opens it
        fifo.readline()


class LocalCluster:
    """N nodes on this machine, each the process tree a PyTorchJob pod runs: ``python -m trainer.warmstart``
    (the node's zygote and janitor) -> ft_launcher -> rank monitors, ranks and their checkpoint writers,
    joined by c10d rendezvous on a loopback port.

    The command is ``launcher_command``'s, as in the pods, with two differences of place: each node gets its
    own ``--memory-snapshot-dir`` (its /dev/shm), and node 0 hosts the rendezvous store (``is_host``; on a
    cluster the master pod does, found by its hostname, which here every node shares). ``kill`` is a node
    loss (every process of the node at once, its memory snapshots wiped), ``start(i)`` of a lost node is its
    replacement, as the PyTorchJob's restart policy makes one.

    ``standby``: that many more node trees, started with the others and warm (launch wrapper, zygote with torch
    imported, launcher with NVRx imported) but waiting before the rendezvous (``--standby-gate``);
    ``promote(i)`` makes one take lost node ``i``'s place, so a replacement costs no process start. What NVRx
    0.6+ calls hot spares (``--nnodes N:N+S``); on 0.4.1-0.5 a PyTorchJob cannot pre-start a pod this way.

        with LocalCluster(LaunchConfig(nnodes=2, nproc_per_node=1), args, workdir=tmp, standby=1) as cluster:
            cluster.start()
            cluster.kill(1); cluster.promote(1)      # or cluster.start(1): a cold replacement
            code = cluster.supervise()
    """

    # The node agent's modules: NVRx's launcher, or our entry point to it (rendezvous settings, a standby's
    # gate); a benchmark's baseline may swap them.
    launcher_modules = (LAUNCHER_MODULE, compat.LAUNCHER_ENTRY)

    def __init__(self, launch: LaunchConfig, trainer_args: list[str], *, min_nodes: int = 0,
                 workdir: Path | None = None, env: dict[str, str] | None = None, standby: int = 0):
        """``workdir``: node logs go to ``<workdir>/node<i>.log`` and ``standby<k>.log`` (else this process's
        stdout and stderr). Memory snapshots go under ``--memory-snapshot-dir`` of ``trainer_args``
        (``/dev/shm``), one directory per node, ``goodput-nodes-<hash of --out>/node<i>`` (``standby<k>``)."""
        n = compat.count(launch.nnodes, "nnodes")
        if standby < 0:
            raise ValueError(f"standby must be a number of nodes, got {standby}")
        self.launch = dataclasses.replace(launch, rdzv_endpoint=f"127.0.0.1:{_free_port()}")
        if compat.has_keep_alive(compat.target_release()):
            self.launch = dataclasses.replace(
                self.launch, keep_alive_interval_s=launch.keep_alive_interval_s or LOCAL_KEEP_ALIVE[0],
                keep_alive_max_attempts=launch.keep_alive_max_attempts or LOCAL_KEEP_ALIVE[1],
                rdzv_poll_interval_s=launch.rdzv_poll_interval_s or LOCAL_RDZV_POLL_S)
        self.min_nodes, self.env = min_nodes, {**os.environ, **(env or {})}
        self.cfg = parse_config(list(trainer_args), validate=False)
        # Every node's ranks share this machine's cores: each gets its share of them (the launcher sets 1 only
        # where a node has several ranks), so that CPU ranks neither oversubscribe nor compute differently
        # from the same ranks on one node.
        ranks = n * compat.count(launch.nproc_per_node, "nproc_per_node")
        self.env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
        # The run's peer secret (every node's daemon and ranks authenticate their messages with it): one per run
        # unless the caller gave one.
        self.env.setdefault(PEER_SECRET_ENV, secrets.token_hex(32))
        # Named after the run, so a run killed whole (SIGKILL leaves the node directories: each node's janitor
        # removes only the snapshots in it) leaves nothing the next one does not reuse; emptied at the start:
        # new nodes, empty memory.
        self.root = Path(self.cfg.checkpoint.memory_dir) / "goodput-nodes-{}".format(
            path_digest(Path(self.cfg.run.out)))
        shutil.rmtree(self.root, ignore_errors=True)
        self.stopping = False
        self.nodes = [LocalNode(i, self.root / f"node{i}", workdir / f"node{i}.log" if workdir else None)
                      for i in range(n)]
        # Indices after the nodes' (never 0: a standby does not host the store) until promoted.
        self.standbys = [LocalNode(n + k, self.root / f"standby{k}", workdir / f"standby{k}.log" if workdir else None,
                                   gate=self.root / f"standby{k}.gate") for k in range(standby)]

    def command(self, node: LocalNode) -> list[str]:
        extras = compat.LauncherExtras(min_nodes=self.min_nodes)
        memory = dataclasses.replace(self.cfg.checkpoint, memory_dir=str(node.memory_dir))
        return launcher_command(self.launch, dataclasses.replace(self.cfg, checkpoint=memory).argv(),
                                executable=sys.executable, extras=extras, rdzv_conf={"is_host": int(node.index == 0)},
                                standby_gate=node.gate)

    def start(self, i: int | None = None) -> None:
        """Start every node and standby, or node ``i`` (again: a replacement, with an empty memory-snapshot
        directory).

        One after the other, each once its launcher runs: the first rendezvous orders the nodes by
        (address, launcher pid), and here every node has the same address, so node i gets group rank i
        only if the launchers' pids rise with i (on a cluster the pods' host names order them; later rounds
        keep each surviving node's rank, and a replacement takes the rank it left free).
        """
        for node in [*self.nodes, *self.standbys] if i is None else [self.nodes[i]]:
            if self.stopping:     # stopped (a signal) while the nodes were being started: start no more
                return
            if node.proc is not None and node.proc.poll() is None:
                raise RuntimeError(f"node {node.index} is running")
            node.generation += 1
            node.lost = False
            node.memory_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            if node.gate:
                node.gate.unlink(missing_ok=True)
                Path(f"{node.gate}.ready").unlink(missing_ok=True)
                os.mkfifo(node.gate, 0o600)
            log = open(node.log, "ab") if node.log else None
            try:
                # A session of its own (a terminal's Ctrl-C reaches this process only, which stops the nodes
                # with SIGTERM); the node dies with this process when it is killed.
                node.proc = subprocess.Popen(
                    self.command(node), stdout=log, stderr=subprocess.STDOUT if log else None,
                    start_new_session=True, env={**self.env, NODE_ENV: node.marker},
                    preexec_fn=parent_death_preexec(signal.SIGKILL))
            finally:
                if log:
                    log.close()
            self._await_launcher(node)

    def _await_launcher(self, node: LocalNode) -> None:
        import psutil

        deadline = time.monotonic() + KILL_TIMEOUT_S
        while node.proc.poll() is None and time.monotonic() < deadline:
            for proc in self._processes(node):
                with contextlib.suppress(psutil.Error):
                    # The launcher itself, not the wrapper whose arguments name it.
                    if proc.cmdline()[1:3] in [["-m", m] for m in self.launcher_modules]:
                        return
            time.sleep(0.05)

    def standby_ready(self) -> bool:
        """Whether every standby's launcher has imported NVRx and waits at its gate."""
        return all(Path(f"{s.gate}.ready").exists() and s.proc.poll() is None for s in self.standbys)

    def promote(self, i: int) -> None:
        """Make the first standby lost node ``i``'s replacement: it joins the rendezvous now and takes the
        group rank ``i`` left free. Its memory-snapshot directory is its own (empty). ``RuntimeError`` if there
        is no standby, node ``i`` still runs, or the standby is not (or no longer) waiting."""
        if not self.standbys:
            raise RuntimeError("no standby node left to promote")
        if self.nodes[i].proc is not None and self.nodes[i].proc.poll() is None:
            raise RuntimeError(f"node {i} is running: only a lost node is replaced")
        node, deadline = self.standbys[0], time.monotonic() + STANDBY_READY_TIMEOUT_S
        while True:
            if node.proc is None or node.proc.poll() is not None:
                raise RuntimeError(f"standby {node.memory_dir.name} is not running")
            try:     # a writer's non-blocking open fails (ENXIO) until the launcher waits on the gate
                fd = os.open(node.gate, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError as e:
                if e.errno != errno.ENXIO or time.monotonic() > deadline:
                    raise RuntimeError(f"standby {node.memory_dir.name} did not reach its gate within "
                                       f"{STANDBY_READY_TIMEOUT_S:g}s ({e.strerror})") from None
            time.sleep(0.01)
        try:
            os.write(fd, b"promoted\n")
        finally:
            os.close(fd)
        self.standbys.pop(0)
        node.index, node.gate = i, None     # a node now: started again, it joins at once
        self.nodes[i] = node

    def pids(self, i: int) -> list[int]:
        """Live processes of node ``i``'s tree (every one carries its marker in its environment)."""
        return [p.pid for p in self._processes(self.nodes[i])]

    def _processes(self, node: LocalNode) -> list:
        return marked(NODE_ENV, node.marker)

    def kill(self, i: int) -> None:
        """Node loss: SIGKILL every process of node ``i`` at once and wipe its memory snapshots."""
        self._kill(self.nodes[i])

    def _kill(self, node: LocalNode) -> None:
        node.lost = True
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while procs := self._processes(node):     # again: a launcher may have started a worker meanwhile
            if time.monotonic() > deadline:
                raise RuntimeError(f"node {node.index}: processes {[p.pid for p in procs]} survived SIGKILL for "
                                   f"{KILL_TIMEOUT_S:g}s")
            reap(procs, gone_s=max(0.0, deadline - time.monotonic()))
        if node.proc is not None:
            node.proc.wait()
        shutil.rmtree(node.memory_dir, ignore_errors=True)

    def terminate(self) -> None:
        """SIGTERM every running node: its ranks agree at the end of the step, commit and exit."""
        self.stopping = True
        for node in [*self.nodes, *self.standbys]:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)

    def supervise(self, timeout: float | None = None) -> int:
        """Wait for the job; return 0 once every node that was not lost exited 0, else a failed node's exit
        code (negative: the signal it died of). Standbys not promoted are not waited for.

        A node that fails (or is stopped for ``STOPPED_S``: killed) while fewer than the job's minimum of
        nodes remain ends the others (SIGTERM, then SIGKILL after ``term_timeout_s``): they could only wait
        for it until their rendezvous times out. A lost node is not a failure: a replacement may be started.
        ``timeout``: give up (``TimeoutError``, the nodes left running) after that many seconds.
        """
        need = self.min_nodes or len(self.nodes)
        deadline = None if timeout is None else time.monotonic() + timeout
        hung = StoppedFor()
        while True:
            failed = [n for n in self.nodes if not n.lost and n.proc is not None and n.proc.poll() not in (None, 0)]
            running = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
            if failed and len(self.nodes) - len(failed) < need:
                code = failed[0].proc.returncode
                print(f"goodput: node {failed[0].index} exited with {code}; fewer than {need} nodes are left, "
                      f"so the job is stopped", file=sys.stderr)
                self._stop(running)
                return code
            if not running:
                return failed[0].proc.returncode if failed else 0
            for n in running:
                if hung(n.proc.pid):
                    print(f"goodput: node {n.index}'s launch wrapper (pid {n.proc.pid}) was stopped for "
                          f"{STOPPED_S:g}s; killed the node", file=sys.stderr)
                    self.kill(n.index)
                    n.lost = False   # not a loss to be replaced: a failure of the job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish in {timeout:g}s")
            time.sleep(0.2)

    def _stop(self, nodes: list[LocalNode]) -> None:
        for n in nodes:
            n.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.launch.term_timeout_s
        for n in nodes:
            try:
                n.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._kill(n)

    def close(self) -> None:
        """Kill whatever is left of every node and standby and remove the memory-snapshot directories."""
        for node in [*self.nodes, *self.standbys]:
            if node.proc is not None:
                self._kill(node)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def last_stop(out: Path, since: float) -> int | None:
    """The step of the checkpoint the ranks committed when a stop signal ended their run after ``since``
    (wall clock), from the run directory's events; None if they were stopped before they trained."""
    from .events import Event, read_events

    exits = [e for e in read_events(layout.events_path(out)) if e["event"] == Event.EXIT and e["t"] >= since]
    return exits[-1]["step"] if exits else None


def launcher_main(argv: list[str]) -> None:
    """``python -m trainer.launch [--standby-gate FIFO] FT_LAUNCHER_ARGS...``: ft_launcher with the rendezvous
    settings of ours honoured; a standby's waits at its gate once NVRx is imported (it exits)."""
    main = compat.prepare_launcher()
    if argv[:1] == [STANDBY_GATE_FLAG]:
        await_promotion(Path(argv[1]))
        argv = argv[2:]
    main(argv)


if __name__ == "__main__":   # the launcher with rendezvous settings of ours (launcher_command's head)
    launcher_main(sys.argv[1:])
