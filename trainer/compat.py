"""What the trainer uses of NVRx (nvidia-resiliency-ext), by release, and every private torch/NVRx API it touches.

Checked on 0.4.1 (what the tests install: constraints.txt), 0.5.0, 0.6.0 and 0.7.0 (read from their PyPI
wheels and the NVIDIA/nvidia-resiliency-ext tags; the launchers' argument tables with their provenance are
``tests/data/nvrx/launcher-<version>.json``, the per-release table is ``docs/nvrx.md``). A release newer
than 0.7 is treated as 0.7 and said so in ``Release.checked``; one older than 0.4.1 is refused.

Everything here is a pure function of a ``Release`` and settings, so the launch command can be built for a
release other than the one installed (the trainer image's pin: ``target_release("0.7.0")`` or
``GOODPUT_NVRX_VERSION``). Nothing imports torch or NVRx at import time; the accessors of private APIs
import on first use and fail naming the API and the installed version when an upgrade broke one.

    release = target_release()                       # installed, or $GOODPUT_NVRX_VERSION
    pods = image_release(job_nvrx_release)           # a pod's command: the trainer image's (IMAGE_RELEASE)
    argv = ["ft_launcher", *launcher_args(launch, release, LauncherExtras(gpu=True)), "-m", "trainer", ...]
    layers = resolve_restart_layers("auto", release)  # "injob" where in-process restart is deprecated
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import signal
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from packaging.version import InvalidVersion, Version

DIST = "nvidia-resiliency-ext"
VERSION_ENV = "GOODPUT_NVRX_VERSION"
CHECKED = ("0.4.1", "0.5.0", "0.6.0", "0.7.0")
_OLDEST, _NEWEST = Version(CHECKED[0]), Version(CHECKED[-1])
# The release images/trainer.Dockerfile installs unless built with another NVRX_RELEASE (tests/test_images.py
# ties the two; the image carries it as the label IMAGE_RELEASE_LABEL): the newest checked one (0.4.1 has no
# wheel for the image's Python 3.12; docs/nvrx.md). Pods' launch commands are built for it unless a job names
# its image's release.
IMAGE_RELEASE = "0.7.0"
IMAGE_RELEASE_LABEL = "io.goodput.nvrx-release"
# NCCL releases in which aborting a communicator (what in-process restart does) segfaults: NVRx 0.5 notes.
_NCCL_ABORT_SEGFAULT = ((2, 28, 3), (2, 28, 9))


class NVRxCompatError(RuntimeError):
    """A release or a private API this module was not written for."""


# ---------------------------------------------------------------------------------------------- releases

@dataclass(frozen=True)
class Release:
    """What one NVRx release offers the trainer (each field read from that release's sources)."""

    version: Version
    checked: bool                      # False: newer than any release read; taken as the newest checked
    inprocess: str                     # "supported" | "deprecated" (0.6: NVIDIA points to in-job restart)
    rendezvous: tuple[str, ...]        # ft rendezvous implementations the launcher accepts, default first
    restarts_counted: str              # --max-restarts counts restarts "per-node" (each agent) or of the "job"
    needs_infra_rank_off: bool         # 0.5: ranks come from SLURM_PROCID/GROUP_RANK unless told otherwise
    workers_stop_timeout_default_s: float
    hot_spares: bool                   # --nnodes MIN:MAX runs MIN nodes, the rest wait as standbys
    node_health_check_endpoint: bool   # --ft-node-health-check-endpoint (a node health daemon's UDS)
    storage_checks: bool               # --ft-storage-health-check-path, --ft-enable-dist-storage-healthcheck
    nic_link_state_check: bool         # --ft-enable-nic-healthcheck (before each rendezvous; on by default)
    progress_tracking: bool            # --ft-checkpoint-iteration-file: ends restarts that make no progress
    inprocess_device_checks: tuple[str, ...]   # the Wrapper's device health checks ("cuda", "gpu", ...)
    wrapper_adds_device_checks: bool   # the Wrapper appends GPU, NVLink, NIC checks whenever LOCAL_RANK is set
    straggler_module: str
    public_results_queue: bool         # filesystem_async.get_write_results_queue(mp_mode) exists
    async_queue_qos: bool              # AsyncCallsQueue(cpu_priority=...) and a worker SIGTERM handler
    preload_builds_buckets: bool       # the writer's preload function builds the write buckets (in the worker)
    plan_copies_cpu_tensors: bool      # planning a write clones every CPU tensor: it saves what they held then
    end_all_sections_works: bool       # RankMonitorClient.end_all_sections() closes anything (a no-op from 0.5)
    no_restart_exit_code: int | None   # the launcher's exit code when NVRx decides not to restart


def release(version: str | Version) -> Release:
    """The ``Release`` of ``version``; a release newer than those checked is treated as the newest one."""
    v = _parse(version)
    if v < _OLDEST:
        raise NVRxCompatError(f"{DIST} {v} is older than {_OLDEST}, the oldest release the trainer supports; "
                              f"install {DIST}>={_OLDEST}")
    at_least = (lambda minor: (v.major, v.minor) >= (0, minor))
    return Release(
        version=v,
        checked=(v.major, v.minor) <= (_NEWEST.major, _NEWEST.minor),
        inprocess="deprecated" if at_least(6) else "supported",
        rendezvous=("barrier",) if at_least(7) else ("barrier", "legacy") if at_least(6)
        else ("legacy", "barrier") if at_least(5) else ("legacy",),
        restarts_counted="job" if at_least(6) else "per-node",
        needs_infra_rank_off=(v.major, v.minor) == (0, 5),
        workers_stop_timeout_default_s=15.0 if at_least(5) else 30.0,
        hot_spares=at_least(6),
        node_health_check_endpoint=at_least(6),
        storage_checks=at_least(6),
        nic_link_state_check=at_least(6),
        progress_tracking=at_least(6),
        inprocess_device_checks=("cuda", "gpu", "nvlink", "nic") if at_least(5) else ("cuda",),
        wrapper_adds_device_checks=at_least(5),
        straggler_module=("nvidia_resiliency_ext.attribution.straggler" if at_least(5)
                          else "nvidia_resiliency_ext.straggler"),
        public_results_queue=at_least(6),
        async_queue_qos=at_least(6),
        preload_builds_buckets=at_least(6),
        plan_copies_cpu_tensors=at_least(7),
        end_all_sections_works=not at_least(5),
        no_restart_exit_code=93 if at_least(7) else None,
    )


def installed_version() -> Version | None:
    try:
        return Version(importlib.metadata.version(DIST))
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_release() -> Release:
    """The release this process imports: what code that calls NVRx must be written for."""
    v = installed_version()
    if v is None:
        raise NVRxCompatError(f"{DIST} is not installed (pip install '{DIST}>={_OLDEST}')")
    return release(v)


def target_release(version: str | Version | None = None) -> Release:
    """The release a command is built for: ``version``, else ``$GOODPUT_NVRX_VERSION`` (the trainer image's
    pin), else the installed one."""
    chosen = version or os.environ.get(VERSION_ENV) or installed_version()
    if not chosen:
        raise NVRxCompatError(f"{DIST} is not installed here: name the trainer image's release "
                              f"(e.g. {VERSION_ENV}=0.7.0) to build a command for it")
    return release(chosen)


def image_release(version: str | Version | None = None) -> Release:
    """The release a pod's launch command is built for: ``version`` (the trainer image's, its
    ``io.goodput.nvrx-release`` label), else ``IMAGE_RELEASE``.

    Never the installed one: the launcher that builds a job may have none (the component image) or another.
    A release newer than those checked is refused, not taken as the newest: the pod's ft_launcher parses the
    command, and which flags it takes is unknown."""
    rel = release(version or IMAGE_RELEASE)
    if not rel.checked:
        raise NVRxCompatError(f"{DIST} {rel.version} is newer than the releases the launch command is checked "
                              f"against ({', '.join(CHECKED)}): build the trainer image with one of those "
                              f"(--build-arg NVRX_RELEASE=...) or add {rel.version} to trainer/compat.py")
    return rel


def _parse(version: str | Version) -> Version:
    try:
        return version if isinstance(version, Version) else Version(str(version))
    except InvalidVersion:
        raise NVRxCompatError(f"{version!r} is not a version of {DIST} (e.g. 0.7.0)") from None


# -------------------------------------------------------------------------------------- recovery layers

def default_restart_layers(rel: Release) -> str:
    """In-job first where in-process restart is deprecated; both layers while it is maintained."""
    return "injob" if rel.inprocess == "deprecated" else "both"


def resolve_restart_layers(requested: str, rel: Release) -> str:
    """``--restart-layers``: "auto" becomes the release's default; an explicit choice is kept (in-process
    restart still works where it is deprecated: every checked release has the Wrapper)."""
    if requested == "auto":
        return default_restart_layers(rel)
    if requested not in ("inprocess", "injob", "both"):
        raise ValueError(f"restart layers must be auto, inprocess, injob or both, got {requested!r}")
    return requested


def inprocess_nccl_problem(nccl_version: tuple[int, int, int]) -> str | None:
    """Why in-process restart must not run with this NCCL, or None (aborting a communicator segfaults in
    NCCL 2.28.3 to 2.28.8)."""
    low, high = _NCCL_ABORT_SEGFAULT
    if low <= tuple(nccl_version) < high:
        return (f"NCCL {'.'.join(map(str, nccl_version))} segfaults when in-process restart aborts a "
                f"communicator (fixed in 2.28.9); use --restart-layers injob or another NCCL")
    return None


def inprocess_health_checks(rel: Release, *, cuda: bool, nic: bool = False) -> tuple[str, ...]:
    """The Wrapper's device checks after a fault: none without CUDA; the NIC check only when asked (it maps
    GPUs to NICs by PCI topology, which EFA instances need not expose)."""
    if not cuda:
        return ()
    return tuple(c for c in rel.inprocess_device_checks if c != "nic" or nic)


def build_inprocess_health_checks(rel: Release, *, cuda: bool, max_rank_faults: int, local_rank: int = 0,
                                  nic: bool = False) -> list:
    """The NVRx objects for ``inprocess_health_checks`` (of this rank's GPU), device checks first, the fault
    counter last (a Compose runs them right to left)."""
    from nvidia_resiliency_ext.inprocess import health_check as hc

    def device_check(name: str):
        if name == "cuda":
            return hc.CudaHealthCheck()
        cls = {"gpu": "ChainedGPUHealthCheck", "nvlink": "ChainedNVLHealthCheck", "nic": "ChainedNicHealthCheck"}
        return _attr(hc, cls[name])(device_index=local_rank)

    checks = [device_check(name) for name in inprocess_health_checks(rel, cuda=cuda, nic=nic)]
    return [*checks, hc.FaultCounter(max_rank_faults=max_rank_faults)]


def install_restart_health_checks(wrapper, checks: list, rel: Release) -> None:
    """Make ``checks`` the whole health check a ``Wrapper`` runs after a fault.

    From 0.5 the Wrapper appends GPU, NVLink and NIC checks of its own whenever LOCAL_RANK is set: without
    NVML (CPU) its GPU check fails every restart, so in-process restart never succeeds there, and its NIC
    check needs a PCI map of GPUs to NICs. Up to 0.4.1 the constructor's ``health_check`` is already all.
    """
    if not rel.wrapper_adds_device_checks:
        return
    from nvidia_resiliency_ext.inprocess import Compose

    _attr(wrapper, "restart_health_check")      # what the Wrapper composed in its constructor
    wrapper.restart_health_check = Compose(*checks) if checks else None


def import_straggler(rel: Release):
    """NVRx's straggler detection package (``Detector``), wherever this release keeps it."""
    return importlib.import_module(rel.straggler_module)


# -------------------------------------------------------------------------------------- launch command

class LaunchSettings(Protocol):
    """What ``launcher_args`` reads: the fields of ``trainer.launch.LaunchConfig``."""

    nproc_per_node: int | str          # or a $(VAR) placeholder the pod's environment fills in
    nnodes: int | str
    max_restarts: int
    rdzv_endpoint: str
    rdzv_id: str
    setup_timeout_s: float
    step_timeout_s: float
    checkpoint_timeout_s: float
    out_of_section_timeout_s: float
    workload_check_interval_s: float
    monitor_interval_s: float
    term_timeout_s: float
    workers_stop_timeout_s: float


@dataclass(frozen=True)
class LauncherExtras:
    """Launcher features that only some releases have. Each one asked for on a release without it is an
    error, not a silently dropped flag."""

    gpu: bool = False                  # NCCL over the node's NICs: their link-state check runs (0.6+)
    min_nodes: int = 0                 # elastic: fewest nodes to train with (0.4.1-0.5 only; 0 = fixed size)
    spare_nodes: int = 0               # hot spares waiting to replace a failed node (0.6+)
    segment: int = 0                   # nodes per NVLink-domain segment of the active nodes (0.6+, GPU); 0 = off
    node_health_check_endpoint: str = ""     # UDS of a node health-check daemon, e.g. unix:///var/run/nvhcd.sock
    storage_paths: tuple[str, ...] = field(default_factory=tuple)   # absolute paths checked before rendezvous
    dist_storage_check: bool = False   # Lustre/NFS mounts reachable before rendezvous (FSx is Lustre)
    progress_file: str = ""            # file holding the newest step a restart resumes from (0.6+)


def launcher_args(launch: LaunchSettings, rel: Release, extras: LauncherExtras = LauncherExtras()) -> list[str]:
    """ft_launcher's options (everything between the launcher and ``-m trainer``) for ``rel``.

    Only flags the release's launcher accepts, each with its meaning on that release; the release's
    default rendezvous implementation is kept (legacy up to 0.5, where barrier needs infrastructure group
    ranks a PyTorchJob pod does not set; barrier from 0.6, the only one in 0.7).
    """
    rdzv = (["--standalone"] if not launch.rdzv_endpoint else
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id])
    sections = (f"setup:{launch.setup_timeout_s:g},step:{launch.step_timeout_s:g},"
                f"checkpoint:{launch.checkpoint_timeout_s:g}")
    args = [
        "--nnodes", nnodes_arg(launch.nnodes, rel, min_nodes=extras.min_nodes, spare_nodes=extras.spare_nodes),
        *_segment_args(launch.nnodes, rel, extras),
        "--nproc-per-node", str(launch.nproc_per_node if is_placeholder(launch.nproc_per_node)
                                else count(launch.nproc_per_node, "nproc_per_node")),
        *rdzv,
        # Counted per node up to 0.5, for the whole job (every node's restarts together) from 0.6.
        "--max-restarts", str(launch.max_restarts),
        "--monitor-interval", f"{launch.monitor_interval_s:g}",
        "--term-timeout", f"{launch.term_timeout_s:g}",
        # Always given: the release's default changed (30 s to 15 s in 0.5) and both are seconds of restart.
        "--workers-stop-timeout", f"{launch.workers_stop_timeout_s:g}",
        "--ft-workload-check-interval", f"{launch.workload_check_interval_s:g}",
        "--ft-rank-section-timeouts", sections,
        "--ft-rank-out-of-section-timeout", f"{launch.out_of_section_timeout_s:g}",
    ]
    return args + _health_check_args(rel, extras)


def nnodes_arg(nodes: int | str, rel: Release, *, min_nodes: int = 0, spare_nodes: int = 0) -> str:
    """``--nnodes``: a fixed size, elastic MIN:MAX (up to 0.5), or N active plus hot spares (0.6+).

    From 0.6 MIN:MAX no longer means "train with MIN to MAX nodes": exactly MIN nodes train and the rest
    stand by, so an elastic job's meaning cannot be kept there. ``nodes`` may be a placeholder the pod's
    environment fills in (``$(PET_NNODES)``): it is passed as it is, and cannot take a MIN or spares.
    """
    if is_placeholder(nodes):
        if min_nodes or spare_nodes:
            raise ValueError(f"--nnodes {nodes} comes from the pod's environment: min_nodes and spare_nodes "
                             f"need a known node count")
        return str(nodes)
    nodes = count(nodes, "nodes")
    if min_nodes < 0 or spare_nodes < 0:
        raise ValueError(f"need no negative counts, got min_nodes={min_nodes} spare_nodes={spare_nodes}")
    elastic = 0 < min_nodes < nodes
    if elastic and spare_nodes:
        raise ValueError("min_nodes (elastic) and spare_nodes (hot spares) cannot be combined")
    if spare_nodes:
        if not rel.hot_spares:
            raise ValueError(f"hot spares need {DIST} >= 0.6.0 (the target is {rel.version}: there --nnodes "
                             f"MIN:MAX trains on up to MAX nodes)")
        return f"{nodes}:{nodes + spare_nodes}"
    if elastic:
        if rel.hot_spares:
            raise ValueError(f"{DIST} {rel.version} trains on exactly MIN of --nnodes MIN:MAX nodes (the rest "
                             f"are hot spares), so min_nodes={min_nodes} < nodes={nodes} cannot mean an elastic "
                             f"job; use hot spares (spare_nodes) instead")
        return f"{min_nodes}:{nodes}"
    return str(nodes)


def _segment_args(nodes: int | str, rel: Release, extras: LauncherExtras) -> list[str]:
    """``--ft-segment``: hot spares and ranks by NVLink domain (GPU ClusterUUID, read with nvidia-smi), whole
    segments of the active nodes kept together; the active node count must be a multiple of it."""
    if not extras.segment:
        return []
    if extras.segment < 0:
        raise ValueError(f"--ft-segment must be a number of nodes (0 = off), got {extras.segment}")
    if not rel.hot_spares:
        raise ValueError(f"--ft-segment needs {DIST} >= 0.6.0; the target is {rel.version}")
    if not extras.gpu:
        raise ValueError("--ft-segment groups nodes by their GPUs' NVLink domain: it needs GPU nodes")
    if is_placeholder(nodes) or count(nodes, "nodes") % extras.segment:
        raise ValueError(f"--ft-segment {extras.segment} must divide the number of training nodes, got {nodes}")
    return ["--ft-segment", str(extras.segment)]


def uds_path(endpoint: str) -> str:
    """The socket file of a node health-check endpoint (``/path`` or ``unix:///path``), or "" for anything
    else: NVRx skips, without a word, an endpoint that is not an absolute Unix socket path."""
    path = endpoint[len("unix://"):] if endpoint.startswith("unix://") else endpoint
    return path if path.startswith("/") and not path.endswith("/") and "," not in path else ""


def is_placeholder(value: int | str) -> bool:
    """A count the kubelet fills in from the pod's environment (``$(PET_NNODES)``)."""
    return isinstance(value, str) and re.fullmatch(r"\$\([A-Za-z_][A-Za-z0-9_]*\)", value) is not None


def count(value: int | str, name: str) -> int:
    """A node or process count given as a number or its digits; at least 1."""
    try:
        n = float(value) if not isinstance(value, bool) else 0.5
    except (TypeError, ValueError):
        n = 0.5
    if not n.is_integer():
        raise ValueError(f"{name} must be a whole number or a $(VAR) placeholder, got {value!r}")
    n = int(n)
    if n < 1:
        raise ValueError(f"{name} must be at least 1, got {value!r}")
    return n


def _health_check_args(rel: Release, extras: LauncherExtras) -> list[str]:
    wanted = {"node_health_check_endpoint": (extras.node_health_check_endpoint, rel.node_health_check_endpoint),
              "storage_paths": (extras.storage_paths, rel.storage_checks),
              "dist_storage_check": (extras.dist_storage_check, rel.storage_checks),
              "progress_file": (extras.progress_file, rel.progress_tracking)}
    missing = [name for name, (value, available) in wanted.items() if value and not available]
    if missing:
        raise ValueError(f"{', '.join(missing)} need{'s' if len(missing) == 1 else ''} {DIST} >= 0.6.0; the "
                         f"target is {rel.version}")
    if extras.node_health_check_endpoint and not uds_path(extras.node_health_check_endpoint):
        raise ValueError(f"node_health_check_endpoint must be a Unix socket's absolute path (/var/run/nvhcd/"
                         f"nvhcd.sock or unix:///var/run/nvhcd/nvhcd.sock), got "
                         f"{extras.node_health_check_endpoint!r}: NVRx would skip the check silently")
    relative = [p for p in extras.storage_paths if not p.startswith("/")]
    if relative or "," in "".join(extras.storage_paths):
        raise ValueError(f"storage_paths must be absolute paths without commas, got {list(extras.storage_paths)}")
    args: list[str] = []
    if rel.needs_infra_rank_off:
        # 0.5 refuses to rendezvous (either implementation) without SLURM_PROCID or GROUP_RANK, which
        # neither a PyTorchJob pod nor a local run sets; 0.6 assigns ranks itself when they are missing.
        args += ["--ft-use-infra-group-rank", "false"]
    if rel.nic_link_state_check and not extras.gpu:
        args += ["--ft-enable-nic-healthcheck", "false"]   # gloo on CPU does not use the RDMA ports it checks
    if extras.node_health_check_endpoint:
        args += ["--ft-node-health-check-endpoint", extras.node_health_check_endpoint]
    if extras.storage_paths:
        args += ["--ft-storage-health-check-path", ",".join(extras.storage_paths)]
    if extras.dist_storage_check:
        args += ["--ft-enable-dist-storage-healthcheck", "true"]
    if extras.progress_file:
        args += ["--ft-checkpoint-iteration-file", extras.progress_file]
    return args


# ------------------------------------------------------------------------------ rendezvous keep-alive
# A lost node leaves the rendezvous only once its agent's keep-alive heartbeats stopped for interval x attempts.
# The legacy FT rendezvous (the default up to 0.5) hard-codes 5 s x 3 in FtRendezvousHandler.from_backend
# (0.4.1, 0.5.0): no launcher flag or --rdzv-conf key sets them. torch's own c10d handler (torchrun, 2.13)
# reads the same two --rdzv-conf keys, whole seconds; NVRx's fork of it does not. The barrier rendezvous
# (0.6, 0.7) keeps the fields but never reads them: it has no heartbeats.
# A node waiting in the rendezvous re-reads the shared state once a second (``_delay(seconds=1)`` in the op
# executor's loop, and the state holder's 1 s cache): every step of a round (the lost node dropped, a node
# joining, the round complete) is seen by the others up to a second late. ``poll_interval`` sets both.
NVRX_KEEP_ALIVE = (5.0, 3)            # (interval s, missed beats): NVRx's, kept where nothing is passed
NVRX_RDZV_POLL_S = 1.0                # a waiting node's re-read of the rendezvous state: NVRx's
KEEP_ALIVE_KEYS = ("keep_alive_interval", "keep_alive_max_attempt")   # --rdzv-conf keys, RendezvousSettings' names
POLL_KEY = "poll_interval"            # --rdzv-conf key of ours (no torch or NVRx handler has one)
# A node waiting in the rendezvous beats only when it polls the store: a node silent for less than two polls may
# be one that is waiting, not one that is lost; and one missed beat is not a loss.
MIN_KEEP_ALIVE_POLLS = 2
LAUNCHER_ENTRY = "trainer.launch"     # the launcher entry point that honours them (``prepare_launcher``)
_LEGACY_RDZV = "nvidia_resiliency_ext.fault_tolerance._ft_rendezvous"


def has_keep_alive(rel: Release) -> bool:
    """Whether the release's default rendezvous drops a lost node by missed keep-alive heartbeats."""
    return rel.rendezvous[0] == "legacy"


def keep_alive_conf(interval_s: float, max_attempts: int, rel: Release,
                    poll_s: float = NVRX_RDZV_POLL_S) -> dict[str, str]:
    """The ``--rdzv-conf`` entries of a keep-alive and a rendezvous poll interval (empty for NVRx's own);
    ``honour_rdzv_conf`` must run in the launcher. Either for a release whose rendezvous has no heartbeats is
    a ``ValueError``."""
    if (interval_s, max_attempts, poll_s) == (*NVRX_KEEP_ALIVE, NVRX_RDZV_POLL_S):
        return {}
    if not has_keep_alive(rel):
        raise ValueError(f"NVRx {rel.version}'s {rel.rendezvous[0]} rendezvous has no keep-alive heartbeats "
                         f"(a lost node is found by the barrier's join counts): leave the keep-alive at NVRx's "
                         f"{NVRX_KEEP_ALIVE[0]:g} s x {NVRX_KEEP_ALIVE[1]} and the poll at {NVRX_RDZV_POLL_S:g} s")
    if poll_s <= 0 or poll_s > NVRX_RDZV_POLL_S:
        raise ValueError(f"the rendezvous poll interval must be in (0, {NVRX_RDZV_POLL_S:g}] s, got {poll_s:g}")
    if max_attempts < MIN_KEEP_ALIVE_POLLS or interval_s * max_attempts < MIN_KEEP_ALIVE_POLLS * poll_s:
        raise ValueError(f"a keep-alive of {interval_s:g} s x {max_attempts} drops a node after "
                         f"{interval_s * max_attempts:g} s without a heartbeat, but nodes waiting in the rendezvous "
                         f"beat only when they poll, every {poll_s:g} s: allow at least {MIN_KEEP_ALIVE_POLLS} missed "
                         f"beats and make interval x attempts at least {MIN_KEEP_ALIVE_POLLS * poll_s:g} s")
    return {**dict(zip(KEEP_ALIVE_KEYS, (f"{interval_s:g}", str(max_attempts)))),
            **({POLL_KEY: f"{poll_s:g}"} if poll_s != NVRX_RDZV_POLL_S else {})}


def honour_rdzv_conf() -> None:
    """Make the installed legacy FT rendezvous read ``KEEP_ALIVE_KEYS`` and ``POLL_KEY`` from ``--rdzv-conf``;
    run in the launcher process before it builds its rendezvous handler (it imports ``create_handler`` then).

    The handler, its state holder and its op executor each keep the settings (0.4.1, 0.5.0): all three get
    the new ones before the first heartbeat. The poll is the module's ``_delay(seconds=1)`` (its only 1 s
    delay: the other is round 0's random skew) and the state holder's ``_cache_duration``; one handler per
    launcher process, so the module-wide delay is that handler's. Without the keys a handler is left as NVRx
    made it.
    """
    if not has_keep_alive(installed_release()):
        return
    from datetime import timedelta

    rdzv = importlib.import_module(_LEGACY_RDZV)
    original = _attr(rdzv, "create_handler")
    if getattr(original, "honours_rdzv_conf", False):
        return
    delay = _attr(rdzv, "_delay")

    def create_handler(store, backend, params):
        handler = original(store, backend, params)
        interval, attempts, poll = (params.config.get(k) for k in (*KEEP_ALIVE_KEYS, POLL_KEY))
        if poll is not None:
            poll_s = float(poll)
            rdzv._delay = lambda seconds: delay(poll_s if seconds == NVRX_RDZV_POLL_S else seconds)
            holder = _attr(handler, "_state_holder")
            _attr(holder, "_cache_duration")
            holder._cache_duration = poll_s
        if interval is None and attempts is None:
            return handler
        settings = replace(
            _attr(handler, "_settings"),
            keep_alive_interval=timedelta(seconds=float(interval if interval is not None else NVRX_KEEP_ALIVE[0])),
            keep_alive_max_attempt=int(attempts if attempts is not None else NVRX_KEEP_ALIVE[1]))
        for holder in (handler, _attr(handler, "_state_holder"), _attr(handler, "_op_executor")):
            _attr(holder, "_settings")
            holder._settings = settings
        return handler

    create_handler.honours_rdzv_conf = True
    rdzv.create_handler = create_handler


def prepare_launcher() -> Callable[[list[str]], None]:
    """NVRx's launcher ``main`` (``ft_launcher argv``; it exits), imported, with ``honour_rdzv_conf`` applied:
    what a standby node does before it waits."""
    honour_rdzv_conf()
    from nvidia_resiliency_ext.fault_tolerance.launcher import main

    return main


# ------------------------------------------------------------------------------ async checkpoint queue

def async_calls_queue_kwargs(rel: Release, writer_nice: int) -> dict[str, Any]:
    """Arguments of ``AsyncCallsQueue``: the persistent worker; from 0.6 at the writer's niceness (NVRx sets
    10 itself, and only logs that it may not lower our 19) and with ``cpu_shm_mode``: the trainer hands the
    worker its own CPU shared-memory staging copy, never CUDA tensors, so the worker needs no CUDA context.
    Without the flag it creates one on a GPU node (memory and seconds after every restart) and dies on a CPU
    one (``rank % torch.cuda.device_count()``)."""
    kwargs: dict[str, Any] = {"persistent": True}
    if rel.async_queue_qos:
        kwargs.update(cpu_priority=writer_nice, cpu_shm_mode=True)
    return kwargs


def save_request(writer, finalize_fns: list, rel: Release):
    """The ``AsyncRequest`` that writes what ``writer`` (a planned ``FileSystemWriterAsync``) holds.

    Up to 0.5 the planned write buckets travel in the save arguments, and the preload function would only
    copy them to the host again, with a CUDA sync (the trainer's staging copy is host memory already). From
    0.6 the arguments carry None in their place: the preload function builds the buckets in the worker, and
    a request without it makes the worker fail on every save.
    """
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    save_fn, preload_fn, save_args = writer.get_save_function_and_args()
    return AsyncRequest(save_fn, save_args, finalize_fns,
                        preload_fn=preload_fn if rel.preload_builds_buckets else None)


def writer_ignores_sigterm() -> None:
    """Run inside NVRx's persistent worker (its first request): from 0.6 the worker installs a SIGTERM handler
    that exits, replacing the SIG_IGN it inherited, and the launcher's SIGTERM to the process group would end
    the final checkpoint's write."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def start_write_results_queue(rel: Release):
    """NVRx's write-results queue, started now unless it exists (``set_write_results_queue``), through the
    public call where there is one."""
    fs = _filesystem_async()
    if rel.public_results_queue:
        return _attr(fs, "get_write_results_queue")()
    return _attr(fs, "_get_write_results_queue")()


def write_results_queue():
    """The queue NVRx's writers report to, or None before one was made (its module-level cache)."""
    return _attr(_filesystem_async(), "_results_queue")


def set_write_results_queue(queue) -> None:
    """Make ``queue`` the one NVRx's writers report to: the trainer's own, whose manager dies with the rank
    (NVRx's ``get_write_results_queue(mp_mode)`` from 0.6 makes a plain one, which a SIGKILLed rank leaves
    behind). Every checked release reads and fills the same module-level cache."""
    fs = _filesystem_async()
    _attr(fs, "_results_queue")
    fs._results_queue = queue


def trust_save_plan(plan_cache, metadata) -> None:
    """Make NVRx reuse the current save plan from the next save on (it waits for a second identical plan
    otherwise); the caller checks that the plan stays valid."""
    if not _attr(plan_cache, "validated_cache_reuse"):
        central_plan, local_plan, _, _ = plan_cache.get_cache_metadata()
        plan_cache.set_cache_metadata(central_plan, local_plan, False)
        _attr(plan_cache, "cached_global_metadata")
        plan_cache.cached_global_metadata = metadata


def _filesystem_async():
    return importlib.import_module(_ASYNC + "filesystem_async")


# ------------------------------------------------------------------------------------------ rank monitor

def under_ft_launcher() -> bool:
    """Whether this rank was started by ft_launcher (its rank monitor's socket is in the environment)."""
    from nvidia_resiliency_ext.fault_tolerance import data

    return os.environ.get(_attr(data, "FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR")) is not None


def rank_monitor_socket(client):
    """A ``RankMonitorClient``'s connection to its monitor (None before ``init_workload_monitoring``)."""
    return _attr(client, "rank_monitor_socket")


def set_section_timeout(client, section: str, timeout: float) -> None:
    """Set one section's timeout on a ``RankMonitorClient`` through its state round trip (the path a
    restored checkpoint takes)."""
    client.load_state_dict(with_section_timeout(client.state_dict(), section, timeout))


def has_calculated_timeouts(state: dict) -> bool:
    """Whether a ``RankMonitorClient.state_dict()`` holds timeouts calculated from measured sections."""
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient

    return bool(state.get(_attr(RankMonitorClient, "CURRENT_TIMEOUTS_STATE_KEY")))


def with_section_timeout(state: dict, section: str, timeout: float) -> dict:
    """``RankMonitorClient.state_dict()`` with one calculated section timeout replaced; the layout is
    NVRx's, checked here."""
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient

    key = _attr(RankMonitorClient, "CURRENT_TIMEOUTS_STATE_KEY")
    try:
        state[key]["section"]["section"][section] = timeout
    except (KeyError, TypeError):
        raise NVRxCompatError(f"the rank monitor's state under {_versions()} has no [{key!r}]['section']"
                              f"['section'] (calculated section timeouts), the layout checked on NVRx "
                              f"{', '.join(CHECKED)}; trainer/compat.py must be updated") from None
    return state


def wrapper_store_host_rank(store_cls) -> int:
    """The rank that hosts an ``inprocess.store.TCPStore`` (subclass)'s server."""
    return _attr(store_cls, "TCP_STORE_HOST_RANK")


def termination_barrier_ranks(ranks) -> list[int]:
    """The ranks an ``inprocess.store.TCPStore.termination_barrier`` is given, as ints. NVRx 0.4.1's sibling
    monitor enters a peer it found dead with the store's bytes (b'1'), and every later termination barrier
    then fails on ``int("b'1'")``: a ValueError that replaces the error the Wrapper was exiting on. Checked
    on 0.4.1; the conversion is a no-op where the ranks are ints already."""
    return [int(r.decode() if isinstance(r, bytes) else r) for r in ranks]


# ----------------------------------------------------------------------------------- private torch APIs

def process_group_names() -> list:
    """Every live process group (torch's registry, read by NVRx's abort too)."""
    import torch.distributed.distributed_c10d as c10d

    return list(_attr(_attr(c10d, "_world"), "pg_names"))


def cpu_state_dict_helpers() -> tuple[Callable, Callable]:
    """torch's (``_copy_state_dict``, ``_create_cpu_state_dict``): a shared-memory/pinned CPU copy of a state
    dict and the copy into it, as torch DCP's own async staging does."""
    import torch.distributed._state_dict_utils as sdu

    return _attr(sdu, "_copy_state_dict"), _attr(sdu, "_create_cpu_state_dict")


def shared_cpu_state_dict(state: dict, pin: bool) -> dict:
    """``state``'s structure with new CPU tensors, every one in shared memory (and pinned, with ``pin``).

    torch's ``_create_cpu_state_dict`` (seen on 2.13) gives a 0-d tensor in private memory, and a 0-d DTensor
    back as itself, the live one. Both get a shared tensor of their own here: a private tensor pickled to NVRx's
    worker is moved into shared memory by the queue's feeder thread, its storage swapped under whatever reads it
    then (the checksum thread), and a live one would be written as it is at write time.
    """
    import torch
    import torch.utils._pytree as pytree   # checked on torch 2.13
    from torch.distributed.tensor import DTensor

    def own(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor) and t.dim() == 0:
            local = t.to_local().detach().to("cpu").clone().share_memory_()
            return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False)
        local_tensor(t).share_memory_()   # a no-op on a tensor already shared
        return t

    _, create = cpu_state_dict_helpers()
    return pytree.tree_map_only(torch.Tensor, own, create(state, share_memory=True, pin_memory=pin))


def local_tensor(t):
    """A DTensor's local shard itself (``to_local()`` may return an autograd view), else ``t``."""
    from torch.distributed.tensor import DTensor

    return _attr(t, "_local_tensor") if isinstance(t, DTensor) else t


def dtensor_like(local, like):
    """A DTensor over ``local`` with ``like``'s mesh, placements and global shape, without communication
    (``DTensor.from_local`` may redistribute or check shapes across ranks)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, _attr(like, "_spec"), requires_grad=False)


def foreach_copy(dst: list, src: list, non_blocking: bool = False) -> None:
    """One batched copy of ``src`` into ``dst`` (torch's ``_foreach_copy_``: per-tensor copies cost more)."""
    import torch

    _attr(torch, "_foreach_copy_")(dst, src, non_blocking=non_blocking)


def attention_ops() -> set:
    """aten's fused attention kernels (the private ``_scaled_dot_product_*`` ops ``F.scaled_dot_product_attention``
    dispatches to), whose outputs selective activation checkpointing keeps."""
    import torch

    return {_attr(_attr(torch.ops.aten, name), "default") for name in _ATTENTION_OPS}


_ATTENTION_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def preload_compiler() -> None:
    """Import ``torch._dynamo``, which ``fully_shard`` imports on its first call (over 1 s on 2 cores)."""
    import torch

    _attr(torch, "_dynamo")


def dcp_file_extents(metadata) -> dict[str, int]:
    """Bytes each file of a torch DCP file-system checkpoint holds at least: where its last entry ends
    (``Metadata.storage_data`` maps each entry to the private ``_StorageInfo``: relative_path, offset, length)."""
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        name = _attr(info, "relative_path")
        ends[name] = max(ends.get(name, 0), _attr(info, "offset") + _attr(info, "length"))
    return ends


# Every private or internal name the trainer touches (``X()`` creates an X to read an instance attribute),
# resolved by ``check_internals``: a test runs it on the installed releases, so an upgrade that breaks one
# fails there, not in a run.
_ASYNC = "nvidia_resiliency_ext.checkpointing.async_ckpt."
INTERNALS: tuple[tuple[str, str], ...] = (
    (_ASYNC + "filesystem_async", "_results_queue"),
    (_ASYNC + "filesystem_async", "_get_write_results_queue"),
    (_ASYNC + "state_dict_saver", "CheckpointMetadataCache().validated_cache_reuse"),
    (_ASYNC + "state_dict_saver", "CheckpointMetadataCache().cached_global_metadata"),
    ("nvidia_resiliency_ext.fault_tolerance.rank_monitor_client", "RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY"),
    ("nvidia_resiliency_ext.fault_tolerance.data", "FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR"),
    ("nvidia_resiliency_ext.inprocess.store", "TCPStore.TCP_STORE_HOST_RANK"),
    ("torch.distributed.distributed_c10d", "_world.pg_names"),
    ("torch.distributed._state_dict_utils", "_copy_state_dict"),
    ("torch.distributed._state_dict_utils", "_create_cpu_state_dict"),
    ("torch.distributed.tensor", "DTensor._local_tensor"),
    ("torch.distributed.tensor", "DTensor._spec"),
    ("torch", "_foreach_copy_"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("nvidia_resiliency_ext.fault_tolerance.rank_monitor_client", "RankMonitorClient().rank_monitor_socket"),
    ("torch.utils._pytree", "tree_map_only"),
    ("torch", "_dynamo"),
    *(("torch", f"ops.aten.{name}.default") for name in _ATTENTION_OPS),
)


def resolve_internals(internals, get: Callable[[Any, str], Any] = getattr) -> tuple[list[str], list[str]]:
    """Each ``(module, path)`` of ``internals`` looked up on what is installed, attribute by attribute with
    ``get`` (``X()`` in a path creates an X to read an instance attribute): the names that resolve, and
    ``"name: why"`` for each that does not. ``pipelines/kfp_compat.py`` checks kfp's with it."""
    resolved, broken = [], []
    for module, path in internals:
        try:
            obj = importlib.import_module(module)
            for part in path.split("."):
                obj = get(obj, part[:-2])() if part.endswith("()") else get(obj, part)
            resolved.append(f"{module}.{path}")
        except (ImportError, AttributeError, NVRxCompatError) as e:
            broken.append(f"{module}.{path}: {e}")
    return resolved, broken


def check_internals() -> list[str]:
    """Resolve every entry of ``INTERNALS`` on what is installed; raise one error listing all that broke."""
    resolved, broken = resolve_internals(INTERNALS, _attr)
    if broken:
        raise NVRxCompatError(f"private APIs the trainer uses are gone ({_versions()}; checked on NVRx "
                              f"{', '.join(CHECKED)}):\n  " + "\n  ".join(broken))
    return resolved


def _attr(obj, name: str):
    """``getattr`` that fails naming the API and the installed versions."""
    try:
        return getattr(obj, name)
    except AttributeError:
        where = getattr(obj, "__name__", type(obj).__name__)
        raise NVRxCompatError(f"{where}.{name} is missing under {_versions()} (the trainer uses it as checked on "
                              f"NVRx {', '.join(CHECKED)}); trainer/compat.py must be updated") from None


def _versions() -> str:
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return f"{DIST} {installed_version() or 'not installed'}, torch {torch}"
