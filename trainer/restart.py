"""In-process restart: the NVRx ``inprocess.Wrapper`` around the training function.

An exception on any rank (or a rank that stops making progress) makes the Wrapper restart the wrapped
function in every live process: torch.distributed is torn down (NCCL communicators are aborted; gloo
peers see their sockets close, or at worst the collective timeout) and the function runs again with
``call_wrapper.iteration`` incremented. The function creates its process group on a store prefixed by
that iteration, restores the newest state (the in-memory snapshot when every rank holds the same one,
else the last committed checkpoint), and carries on.

What bounds recovery latency on gloo: the faulting rank's Wrapper aborts and destroys its process group,
which closes its sockets, so peers blocked in a collective fail at once; ``--collective-timeout-s`` is
the upper bound when a peer disappears without closing them. ``--monitor-interval-s`` bounds how fast
the Wrapper's monitor notices a restart requested by another rank.
"""

# No ``from __future__ import annotations`` here: the Wrapper finds the parameter that receives its
# CallWrapper by the parameter's annotation, which must be the class itself, not a string.
import functools
import json
import logging
import os
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from . import compat
from .config import RestartConfig
from .errors import HelperHung, recurring_cause
from .parallel import free_port, wait_until_listening


def build_wrapper(cfg: RestartConfig, cuda: bool):
    """The configured ``inprocess.Wrapper`` (imported lazily: only the in-process modes need it)."""
    from nvidia_resiliency_ext import inprocess

    rel = compat.installed_release()
    checks = compat.build_inprocess_health_checks(rel, cuda=cuda, max_rank_faults=cfg.max_rank_faults,
                                                  local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    interval = timedelta(seconds=cfg.monitor_interval_s)

    class Store(inprocess.store.TCPStore):
        """NVRx's store, joined only once its host (rank 0) listens: see ``wait_until_listening``."""

        def __init__(self, **kwargs):
            if int(os.environ["RANK"]) != compat.wrapper_store_host_rank(type(self)):
                wait_until_listening(os.environ["MASTER_ADDR"], kwargs["port"], cfg.barrier_timeout_s)
            super().__init__(**kwargs)

        def termination_barrier(self, *, ranks, **kwargs):
            return super().termination_barrier(ranks=compat.termination_barrier_ranks(ranks), **kwargs)

    class KeepGlooGroups(inprocess.abort.Abort):
        """Before NVRx's abort destroys the failed attempt's process groups: see ``_abandon_gloo_groups``."""

        def __call__(self, state):
            _abandon_gloo_groups()
            return state

    class KeepWorldSize(inprocess.rank_assignment.RankAssignment):
        """A rank lost for good (its process ended, or it stopped sending heartbeats: its node is gone) ends the
        in-process layer's attempt instead of shrinking the world in these processes: the session, the data
        and the snapshots are built for the launch's world size. The rank exits with the error, its launcher
        agent restarts the workers (in-job), and an elastic job's rendezvous goes on with the nodes left."""

        def __call__(self, ctx):
            if ctx.terminated_ranks:
                raise inprocess.exception.RestartAbort(
                    f"ranks {sorted(ctx.terminated_ranks)} are gone: left to the in-job layer")
            return ctx

    wrapper = inprocess.Wrapper(
        # Composed right to left: the gloo groups are kept before AbortTorchDistributed destroys them.
        abort=inprocess.Compose(inprocess.abort.AbortTorchDistributed(), KeepGlooGroups()),
        # The Wrapper's own store gets its own port: MASTER_PORT is the launcher's rendezvous store.
        store_factory=Store,
        store_kwargs={"port": _wrapper_store_port()},
        health_check=inprocess.Compose(*checks),
        rank_assignment=inprocess.Compose(inprocess.rank_assignment.ActivateAllRanks(), KeepWorldSize()),
        monitor_thread_interval=interval,
        monitor_process_interval=interval,
        heartbeat_interval=interval,
        progress_watchdog_interval=interval,
        soft_timeout=timedelta(seconds=cfg.soft_timeout_s),
        hard_timeout=timedelta(seconds=cfg.hard_timeout_s),
        heartbeat_timeout=timedelta(seconds=cfg.heartbeat_timeout_s),
        barrier_timeout=timedelta(seconds=cfg.barrier_timeout_s),
        completion_timeout=timedelta(seconds=cfg.barrier_timeout_s),
        last_call_wait=timedelta(seconds=min(1.0, cfg.monitor_interval_s * 2)),
    )
    # From 0.5 the Wrapper adds device checks of its own (that fail without NVML): ours are the whole list.
    compat.install_restart_health_checks(wrapper, checks, rel)
    return wrapper


def run_with_inprocess_restart(fn: Callable, cfg: RestartConfig, cuda: bool):
    """Call ``fn(call_wrapper)`` under the Wrapper; it is called again after every in-process restart."""
    from nvidia_resiliency_ext import inprocess

    def attempt(call_wrapper: Optional[inprocess.CallWrapper] = None):
        try:
            return fn(call_wrapper)
        except HelperHung as e:
            # The same processes would meet the same helper: the in-job layer restarts them, helpers included.
            raise inprocess.exception.RestartAbort(str(e)) from e
        except Exception as e:
            recurring = recurring_cause(e)
            if recurring is None:
                raise
            # See trainer.train.run.
            raise inprocess.exception.RestartAbort(f"{type(recurring).__name__}: {recurring}") from e

    return build_wrapper(cfg, cuda)(attempt)()


# The gloo process groups of failed attempts, kept until the process exits. Destroying a gloo group joins
# its worker threads, and one may be blocked in a collective with a peer that is restarting too (the step's
# all-reduce that a failed rank never joined). Under DDP the group outlives destroy_process_group (DDP's
# reducer holds it), so its last reference went in the Wrapper's garbage collection before the next
# attempt, which then waited for that collective until the Wrapper's hard timeout killed the rank. Kept,
# the blocked thread ends in the background when the peer's process exits or at --collective-timeout-s.
# One group per in-process restart; NCCL's are aborted by NVRx instead.
_abandoned_groups: list = []


def _abandon_gloo_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        groups = compat.process_group_names()   # NVRx's abort reads the same registry
        _abandoned_groups.extend(g for g in groups if dist.get_backend(g) == "gloo")


def abort_process_group() -> None:
    """Abort this rank's collectives and destroy its process groups (NVRx's abort, as the Wrapper does):
    a peer waiting on this rank fails at once instead of at a timeout."""
    from nvidia_resiliency_ext.inprocess.abort import AbortTorchDistributed

    AbortTorchDistributed()(None)


@functools.lru_cache(maxsize=None)
def _launcher_store() -> "dist.TCPStore":
    """The store at MASTER_ADDR:MASTER_PORT: the launcher agent's, or else hosted by rank 0 (once per process)."""
    agent_hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosting = int(os.environ["RANK"]) == 0 and not agent_hosted
    if not hosting:
        wait_until_listening(host, port)
    return dist.TCPStore(host, port, int(os.environ["WORLD_SIZE"]), is_master=hosting, multi_tenant=True,
                         wait_for_workers=False, use_libuv=True)


def _wrapper_store_port() -> int:
    """A port that is free on rank 0's host right now, agreed through the launcher's store.

    A fixed choice such as MASTER_PORT + 1 can sit in TIME_WAIT after busy traffic; the Wrapper's
    TCPStore then fails to bind on rank 0 and every rank waits for a server that never comes.
    """
    store = _launcher_store()
    key = f"goodput/wrapper_port/{_launch_round()}"
    if int(os.environ["RANK"]) == 0:
        store.set(key, str(free_port()))
    return int(store.get(key))


def iteration_store(iteration: int) -> "dist.Store":
    """The store for this attempt's process group, prefixed by the launch round and the in-process iteration,
    so a rank never reads a key an earlier attempt wrote (such as a dead peer's gloo address: seen under
    torchrun, whose agent keeps its store across restarts).

    Under a launcher the rendezvous store at MASTER_ADDR:MASTER_PORT is hosted by the agent; without one,
    rank 0 hosts it.
    """
    return dist.PrefixStore(f"goodput/attempt/{_launch_round()}/{iteration}", _launcher_store())


def launch_agents(timeout_s: float) -> dict[int, tuple[int, str | None]]:
    """Every node's launcher agent in this round, as rank 0 learns it: ``{group rank: (restart count, attempt)}``
    (``{}`` on the other ranks). Collective over the nodes: each node's local rank 0 posts its agent's in the
    launcher's store.

    ``TORCHELASTIC_RESTART_COUNT`` is each agent's own count (docs/multinode.md): a replacement node's agent
    starts at 0 while the others count their restart, so which layer restarted is the job's answer, not one
    node's. ``attempt`` is the agent's error file (its own log directory and attempt): an agent that restarts
    its workers for a membership change keeps it. A node that does not post within ``timeout_s`` is left out
    (its ranks would fail the round anyway; rank 0 then decides from the nodes it heard).
    """
    store, key = _launcher_store(), f"goodput/agents/{_launch_round()}/"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        store.set(key + os.environ.get("GROUP_RANK", "0"), json.dumps(
            [int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), os.environ.get("TORCHELASTIC_ERROR_FILE")]))
    if int(os.environ["RANK"]) != 0:
        return {}
    keys = [key + str(node) for node in range(int(os.environ.get("GROUP_WORLD_SIZE", "1")))]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:   # torch's DistStoreError (a timeout) is one
        logging.getLogger("trainer").warning("not every node's agent reported within %.0fs: deciding which layer "
                                             "restarted from the nodes that did", timeout_s)
        keys = [k for k in keys if store.check([k])]
    return {int(k.rsplit("/", 1)[1]): tuple(json.loads(v)) for k, v in zip(keys, store.multi_get(keys))}


def _launch_round() -> str:
    """The same on every rank of one start of the worker group, and new at the next.

    Each agent counts only its own restarts (a node restarted for another node's failure, or a replacement,
    does not), so the restart count serves only where the agent's store outlives the rounds (torchrun's agent
    store); otherwise every round has a rendezvous store of its own, at a new MASTER_PORT.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return os.environ["MASTER_PORT"]
