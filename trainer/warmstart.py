"""Warm start: ranks are forked from a process that has already imported torch, NVRx and the trainer.

Importing them costs about 5 s of CPU per rank on a small machine (2-4 s on a GPU node, where every local
rank pays it at once), which is most of what an in-job restart costs. So the launch command is

    python -m trainer.warmstart ft_launcher ... -m trainer ...

(with ``--nnodes``, ``--rdzv-endpoint`` and ``--rdzv-id`` before ``ft_launcher`` where the node joins a c10d
rendezvous: the wrapper's own options, the same values ``trainer.launch.launcher_command`` gives the launcher),
which runs the launcher with ``GOODPUT_WARMSTART_SOCKET`` set, next to a *zygote*: a process that imports
everything once and then waits. Each ``python -m trainer`` the launcher starts sees the variable and,
instead of importing, hands its arguments, environment, working directory and stdio to the zygote, which
forks a child to run them. The launcher's worker stays a thin proxy that it supervises as usual: signals
it receives are forwarded to the child, the child's exit status (or death by signal) becomes its own, and a
child whose proxy disappears (the launcher's SIGKILL) kills itself. The rank monitor kills a hung rank
directly: the child registers with its own pid. When a child has exited, the zygote kills whatever it left
in its process group (NVRx's checkpoint helpers outlive a killed rank otherwise).

Fork safety: the zygote never starts a thread and never initialises CUDA (a forked child could not use
it); if either happened it refuses to fork and the worker starts cold, as it would without warm start.
Anything that goes wrong on the way (no zygote, a zygote that died) also ends in a cold start.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil

from .events import Event
from .layout import checkpoints_dir, events_path, replica_dir
from .peer import ENV as PEER_ENV
from .peer import JOB_ENV as PEER_JOB_ENV
from .peer import secret_from_env
from .peer import start_daemon as peer_daemon
from .runlock import JobLock, RunInUse
from .signals import (STOPPED_S, StoppedFor, handlers, in_process_group, is_gone, is_stopped, marked,
                      parent_death_preexec, reap)

ENV = "GOODPUT_WARMSTART_SOCKET"
ZYGOTE_PID_ENV = "GOODPUT_ZYGOTE_PID"
# Bounds on waits for the zygote (environment, seconds): a proxy for its reply to a fork request (it may still
# be importing), and the wrapper for its exit. Past them the worker starts cold, or the zygote is killed.
HANDOFF_TIMEOUT_S = float(os.environ.get("GOODPUT_WARMSTART_TIMEOUT_S", "120"))
ZYGOTE_EXIT_S = 10.0
forked = False          # True in a rank forked from the zygote (reported in its worker_start event)
_MAX_MSG = 1 << 20
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


@dataclass(frozen=True)
class ChildRun:
    """What a forked child runs: ``before_threads()`` while it has one thread, then ``main(argv)`` (its exit code)."""

    before_threads: Callable[[], None]
    main: Callable[[list[str]], int]


# ---- the launch wrapper ------------------------------------------------------------------------------

@dataclass(frozen=True)
class NodePlace:
    """The node's place in the job, as its launcher has it (``launcher_command`` gives both the same values):
    the defaults are one node with a local store (``--standalone``)."""

    nnodes: str = "1"             # the launcher's --nnodes: N, or MIN:MAX (elastic, hot spares)
    rdzv_endpoint: str = ""       # host:port of the c10d rendezvous
    rdzv_id: str = ""             # the rendezvous id the job's nodes share

    @property
    def multinode(self) -> bool:
        """Whether the job may run with more than one node."""
        try:
            return max(int(n) for n in self.nnodes.split(":")) > 1
        except ValueError:     # not a count: unresolved here, so possibly many nodes
            return True

    @property
    def peer_host(self) -> str:
        """Where the node's peer store listens: loopback when the rendezvous is on loopback (the nodes share this
        machine), else every interface (pod-to-pod ports are open)."""
        host = self.rdzv_endpoint.rpartition(":")[0].strip("[]")
        return "127.0.0.1" if host in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"

    @functools.cached_property
    def job(self) -> str:
        """The job's identity, the same on all its nodes: its rendezvous (the endpoint's port is the job's while it
        runs), or one of this node's own with a local store."""
        return f"{self.rdzv_endpoint}/{self.rdzv_id}" if self.rdzv_endpoint else uuid.uuid4().hex

    def args(self) -> list[str]:
        """The wrapper's options that give this place (none for one node with a local store)."""
        if self == NodePlace():
            return []
        return ["--nnodes", self.nnodes, "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]


def run_with_zygote(command: list[str], warm: bool = True, node: NodePlace = NodePlace()) -> int:
    """Start a zygote, run ``command`` with ``GOODPUT_WARMSTART_SOCKET`` pointing at it, return its exit code.

    ``warm=False``: the zygote imports nothing and forks nothing (the ranks start cold); it is only the
    node's janitor: once this process is gone, however it ended, it kills what the run left (the ranks it
    forked, every process that inherited the launcher's environment) and deletes the run's memory snapshots.
    With more than one node (``node``) and memory snapshots on, it also runs the node's peer daemon
    (``trainer.peer``).
    A rank's ``fatal`` event (an error no restart changes) stops the launcher: exit status 2. It holds the node's
    share of its job's hold on the run directory (``trainer.runlock``) from before anything starts until it
    ends: another job training there is waited for, then refused with exit status 2.
    """
    cfg = _trainer_config(command)
    wants_peer = (cfg is not None and cfg.checkpoint.peer_snapshots and cfg.checkpoint.memory_every_s > 0
                  and node.multinode)
    if wants_peer:
        try:   # before anything starts: peer snapshots never run unauthenticated
            secret_from_env()
        except ValueError as e:
            print(f"warm start: {e}", file=sys.stderr)
            return 2
    try:   # before anything starts: one job at a time in a run directory
        lock = JobLock.hold(cfg.run.out, node.job, cfg.run.lock_wait_s) if cfg else None
    except RunInUse as e:
        print(f"warm start: {e}", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="goodput-warmstart-")
    path = os.path.join(workdir, "zygote.sock")
    replicas = [str(replica_dir(Path(cfg.checkpoint.memory_dir), checkpoints_dir(cfg.run.out)))] if cfg else []
    fatal = _FatalWatch(events_path(cfg.run.out) if cfg else None)
    # The node's peer daemon (trainer/peer.py): keeps the ring predecessor's memory snapshots, ships this
    # node's; a child of this process, so it outlives in-job restarts and dies with the node.
    peer = peer_env = None
    if wants_peer:
        # The job's identity in every peer message: the rendezvous id its nodes share.
        job = {PEER_JOB_ENV: os.environ.get(PEER_JOB_ENV) or node.rdzv_id or "none"}
        try:
            peer, address = peer_daemon(Path(replicas[0]), node.peer_host, env={**os.environ, **job},
                                        events=events_path(cfg.run.out))
            peer_env = {PEER_ENV: address, **job}
        except OSError as e:     # no address to listen on or to give: a node loss then resumes from FSx
            print(f"warm start: no peer memory snapshots on this node: {e}", file=sys.stderr)
    # Bound and listening before the zygote has finished importing: workers that connect early queue in
    # the backlog. Once the zygote holds the only copy, its death makes connects fail, i.e. a cold start.
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(256)
    # The zygote exits when this pipe closes, i.e. when this process is gone, however it ended.
    alive_r, alive_w = os.pipe()
    zygote = subprocess.Popen(
        zygote_command(listener.fileno(), alive_r, warm, [*replicas, workdir]),
        pass_fds=(listener.fileno(), alive_r), start_new_session=True,
        env={**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})
    listener.close()
    os.close(alive_r)
    env = {**os.environ, ZYGOTE_PID_ENV: str(zygote.pid), **(peer_env or {})}
    if warm:
        env[ENV] = path
    # The launcher (and so every worker it starts) dies with this process: see signals.die_with_parent.
    proc = subprocess.Popen(command, env=env, preexec_fn=parent_death_preexec(signal.SIGKILL))
    try:
        with handlers({s: lambda signum, _f: proc.send_signal(signum) for s in _FORWARDED}):
            code = wait_unless_stopped(proc, "warm start: the launcher", poll=lambda: fatal.check(proc))
        if fatal.reason is not None:
            code = 2
        elif code < 0:
            print(f"warm start: the launcher (pid {proc.pid}) died of {signal.Signals(-code).name}", file=sys.stderr)
    finally:
        if peer is not None:    # before the zygote removes the snapshots: it would write them again
            peer.kill()
            peer.wait()
        os.close(alive_w)
        try:
            zygote.wait(timeout=ZYGOTE_EXIT_S)
        except subprocess.TimeoutExpired:
            # Stopped or stuck: it cannot clean up, so this process does (its forks die with their proxies).
            print(f"warm start: the zygote (pid {zygote.pid}) did not exit within {ZYGOTE_EXIT_S:g}s; killed it",
                  file=sys.stderr)
            zygote.kill()
            zygote.wait()
            _remove(replicas)
        shutil.rmtree(workdir, ignore_errors=True)
        if lock is not None:
            lock.close()
    return code


def zygote_command(listen_fd: int, alive_fd: int, warm: bool, remove_at_end: list[str]) -> list[str]:
    """The command of the zygote (``python -m trainer.zygote``, whose ``main`` parses it): it serves forks on
    ``listen_fd`` while ``alive_fd`` is open, imports nothing unless ``warm``, and removes the directories
    ``remove_at_end`` at the end."""
    return [sys.executable, "-m", "trainer.zygote", "--listen-fd", str(listen_fd), "--alive-fd", str(alive_fd),
            *([] if warm else ["--cold"]), *(a for d in remove_at_end for a in ("--remove-at-end", d))]


def wait_unless_stopped(proc: subprocess.Popen, what: str, poll=None) -> int:
    """``proc``'s exit code; a ``proc`` stopped (SIGSTOP) for ``STOPPED_S`` is hung: it is SIGKILLed (with
    its process group, when it leads one) and its death reported as ``what``, so nothing waits forever.
    ``poll`` is called every half second meanwhile."""
    hung = StoppedFor()
    while True:
        try:
            return proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if poll is not None:
            poll()
        if hung(proc.pid):
            print(f"{what} (pid {proc.pid}) was stopped for {STOPPED_S:g}s; killed it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()


def _trainer_args(command: list[str]) -> list[str] | None:
    """The arguments of the trainer that ``command`` runs (``LAUNCHER... -m trainer ARGS``), None if it runs none.
    Found in the command: a TrainJob's pods append them to the runtime's command, which all its jobs share."""
    for i in range(1, len(command)):
        if command[i - 1:i + 1] == ["-m", "trainer"]:
            return command[i + 1:]
    return None


def _trainer_config(command: list[str]):
    """The config of the trainer that ``command`` runs (``-m trainer ARGS``), or None."""
    args = _trainer_args(command)
    if args is None:
        return None
    from .config import parse_config

    try:
        # Not validated here: checking the model imports torch (seconds of CPU before the zygote and the launcher
        # start), and the ranks validate the same settings before they train.
        return parse_config(args, validate=False)
    except (ValueError, SystemExit, OSError):
        return None


class _FatalWatch:
    """Stops the launcher once a rank reported an error no restart changes (a ``fatal`` event, see
    ``trainer.train.run``): the launcher would restart the group for nothing, up to its last attempt."""

    def __init__(self, events: Path | None):
        self.events, self.reason = events, None
        self.offset = events.stat().st_size if events is not None and events.exists() else 0

    def check(self, proc: subprocess.Popen) -> None:
        if self.events is None or self.reason is not None or not self.events.exists():
            return
        with open(self.events, "rb") as f:
            f.seek(self.offset)
            new = f.read()
        self.offset += new.rfind(b"\n") + 1
        for line in new[:new.rfind(b"\n") + 1].splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == Event.FATAL:
                    self.reason = event["reason"]
                    print(f"goodput: rank {event['rank']}: {self.reason}; the launcher is stopped, no layer "
                          f"retries an error that would come back", file=sys.stderr)
                    proc.send_signal(signal.SIGTERM)
                    return


def _remove(directories: list[str]) -> None:
    for d in directories:
        shutil.rmtree(d, ignore_errors=True)


# ---- the zygote (its process: ``trainer.zygote``, which says what it imports and runs) -----------------

def _fork_unsafe() -> str | None:
    import torch

    if threading.active_count() > 1:
        return f"the zygote runs {threading.active_count()} threads"
    if torch.cuda.is_initialized():
        return "the zygote initialised CUDA"
    return None


def serve(listen_fd: int, alive_fd: int, child: ChildRun | None, remove_at_end: tuple[str, ...] = ()) -> None:
    """The zygote's loop: fork a child per request to run ``child``, report each child's exit status to its proxy.

    ``child=None``: a janitor only (see ``run_with_zygote``); requests are refused, the ranks start cold.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # the wrapper decides when the zygote ends
    listener = socket.socket(fileno=listen_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)     # a child's exit wakes the loop through wake_r
    children: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    for f in (listener, wake_r, alive_fd):
        sel.register(f, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                if child is None:
                    _send(conn, {"refused": "warm start is off"})
                    conn.close()
                    continue
                pid = _fork_child(conn, child, close_in_child=(listen_fd, wake_r, wake_w, alive_fd))
                if pid is not None:
                    children[pid] = conn
            elif key.fileobj == wake_r:
                os.read(wake_r, 4096)
            elif not os.read(alive_fd, 1):
                # The wrapper is gone: end what is left of the run (its ranks with their process groups, and
                # every process that inherited the launcher's environment: the rank monitors, cold ranks and
                # their helpers), all at once, then what it keeps outside its run directory (memory snapshots, the
                # wrapper's socket), whether the wrapper exited or was killed.
                _kill_leftovers(children, everything=True)
                _remove(list(remove_at_end))
                return
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _kill_leftovers([pid])
            conn = children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


def _kill_leftovers(pgids, everything: bool = False) -> None:
    """SIGKILL what dead ranks left in their process groups ``pgids`` (``everything``: also each process of the
    run, i.e. whose environment names this zygote, and wait until they are gone): NVRx's checkpoint workers
    and result-queue manager ignore SIGTERM, so each killed rank would leak them, with their share of the
    checkpoint staging memory, for as long as the node runs. Multiprocessing's resource tracker is spared: it
    exits by itself once they are gone, unlinking what they registered."""
    deadline = time.monotonic() + (ZYGOTE_EXIT_S if everything else 0)
    while True:     # again: a process may have started another before it was killed
        found = [p for pgid in pgids for p in in_process_group(pgid)]
        if everything:
            found += marked(ZYGOTE_PID_ENV, str(os.getpid()))
        found = [p for p in found if not _is_resource_tracker(p)]
        if not found:
            return
        reap(found, gone_s=max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            return


def _is_resource_tracker(proc) -> bool:
    try:
        return any("resource_tracker" in a for a in proc.cmdline())
    except psutil.Error:   # gone meanwhile
        return False


def _fork_child(conn: socket.socket, child: ChildRun, close_in_child: tuple[int, ...]) -> int | None:
    conn.settimeout(10)
    try:
        msg, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 3)
        request = json.loads(msg)
    except (OSError, ValueError):
        conn.close()
        return None
    reason = _fork_unsafe()
    if reason is not None or len(fds) != 3:
        _send(conn, {"refused": reason or "stdio not received"})
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    pid = os.fork()
    if pid == 0:
        for fd in close_in_child:
            os.close(fd)
        os._exit(_run_child(conn, request, fds, child))
    # Here too, as shells do: the zygote may end the run's process groups before the child has run at all.
    with contextlib.suppress(ProcessLookupError):
        os.setpgid(pid, pid)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    return pid


def _run_child(conn: socket.socket, request: dict, fds: list[int], child: ChildRun) -> int:
    """In the forked child: become the worker the proxy would have been, run it, return its exit code."""
    global forked
    forked = True
    os.setpgid(0, 0)        # its own process group, so that what it leaves behind can be found and ended
    signal.set_wakeup_fd(-1)
    for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    conn.settimeout(None)
    child.before_threads()   # forking (which it may do) is safe only while the process runs one thread
    threading.Thread(target=_die_with_proxy, args=(conn, request["proxy"]), name="warmstart-proxy-watch",
                     daemon=True).start()
    try:
        code = child.main(sys.argv[1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()   # os._exit skips them; multiprocessing and logging clean up there
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def _die_with_proxy(conn: socket.socket, proxy: int) -> None:
    """The proxy never writes after its request: EOF means it died, and so must this child. A proxy stopped
    (SIGSTOP) for ``STOPPED_S`` is killed first: it could not report this child's exit, and its launcher
    would wait for it forever."""
    conn.settimeout(0.5)
    hung = StoppedFor()
    try:
        while True:
            try:
                if not conn.recv(1):
                    return
            except socket.timeout:
                pass
            if hung(proxy):
                print(f"warm start: the proxy of rank pid {os.getpid()} (pid {proxy}) was stopped for "
                      f"{STOPPED_S:g}s; killed both", file=sys.stderr)
                os.kill(proxy, signal.SIGKILL)
                return
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


# ---- the proxy (the process the launcher started) -----------------------------------------------------

def delegate(argv: list[str]) -> None:
    """Run ``python -m trainer argv`` in a child of the zygote and exit as it exited (dying of the same
    signal if it died of one, so the launcher sees what it would have seen); return to start cold.

    Every wait here is bounded: a zygote that does not answer within ``HANDOFF_TIMEOUT_S`` (or at once, when
    it is stopped or gone) means a cold start; a child stopped for ``STOPPED_S`` is killed (the launcher then
    restarts the group); a zygote that does not report a child's exit within ``STOPPED_S`` of it makes this
    process exit 1.
    """
    path = os.environ.get(ENV)
    if not path:
        return None
    pending: list[int] = []
    child: list[int] = []

    def forward(signum, _frame):
        if child:
            os.kill(child[0], signum)
        else:
            pending.append(signum)

    zygote = int(os.environ.get(ZYGOTE_PID_ENV, "0"))
    with handlers({s: forward for s in _FORWARDED}):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            request = {"argv": [sys.argv[0], *argv], "cwd": os.getcwd(), "proxy": os.getpid(),
                       "env": {k: v for k, v in os.environ.items() if k != ENV}}
            conn.settimeout(STOPPED_S)     # a full backlog of a stopped zygote would block the connect
            try:
                conn.connect(path)
                socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
                reply, why = _await_zygote(conn, zygote)
            except OSError:
                reply, why = None, "no zygote answered"
            if reply is None or "pid" not in reply:
                print(f"warm start: {reply['refused'] if reply else why}; starting cold", file=sys.stderr)
                return None
            child.append(reply["pid"])
            for s in pending:
                os.kill(child[0], s)
            status = _await_exit(conn, child[0], zygote)
            if status is None:    # the zygote died or hung: the child cannot report, so it must not outlive us
                with contextlib.suppress(ProcessLookupError):   # it may have died first
                    os.kill(child[0], signal.SIGKILL)
                return 1
    exit_like(status["exit"])


def _await_zygote(conn: socket.socket, zygote: int) -> tuple[dict | None, str]:
    """The zygote's reply to a fork request, or (None, why) once it is gone, stopped or too slow."""
    deadline = time.monotonic() + HANDOFF_TIMEOUT_S
    while True:
        if select.select([conn], [], [], 0.1)[0]:
            return _recv(conn), "no zygote answered"
        if zygote and (is_stopped(zygote) or is_gone(zygote)):
            return None, f"the zygote (pid {zygote}) is {'stopped' if is_stopped(zygote) else 'gone'}"
        if time.monotonic() > deadline:
            return None, f"the zygote (pid {zygote}) did not answer within {HANDOFF_TIMEOUT_S:g}s"


def _await_exit(conn: socket.socket, pid: int, zygote: int) -> dict | None:
    """The exit status the zygote reports for its child ``pid``; None if it cannot (gone, stopped)."""
    hung, exited_at = StoppedFor(), None
    while True:
        if select.select([conn], [], [], 0.5)[0]:
            return _recv(conn)
        now = time.monotonic()
        if hung(pid):
            print(f"warm start: rank pid {pid} was stopped for {STOPPED_S:g}s; killed it", file=sys.stderr)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        exited_at = (exited_at or now) if is_gone(pid) else None
        if exited_at is not None and now - exited_at > STOPPED_S:
            print(f"warm start: the zygote (pid {zygote}) did not report the exit of rank pid {pid}",
                  file=sys.stderr)
            return None


def exit_like(code: int) -> None:
    """Exit with ``code`` as ``Popen.returncode`` reports it: a negative one is death by that signal."""
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):     # those two cannot be handled anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def _send(conn: socket.socket, obj: dict) -> None:
    try:
        conn.send(json.dumps(obj).encode())
    except OSError:
        pass          # the proxy is gone; its child kills itself


def _recv(conn: socket.socket) -> dict | None:
    try:
        msg = conn.recv(_MAX_MSG)
    except OSError:
        return None
    return json.loads(msg) if msg else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.warmstart",
                                description="Run COMMAND (ft_launcher ... -m trainer ...) next to a warm-start zygote.")
    p.add_argument("--cold", action="store_true",
                   help="fork nothing (the ranks start cold): the zygote only cleans up after the run")
    p.add_argument("--nnodes", default=NodePlace.nnodes, help="the launcher's --nnodes: N or MIN:MAX")
    p.add_argument("--rdzv-endpoint", default=NodePlace.rdzv_endpoint,
                   help="the launcher's c10d rendezvous, host:port (none: --standalone)")
    p.add_argument("--rdzv-id", default=NodePlace.rdzv_id, help="the launcher's rendezvous id")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the launcher's command line")
    return p


def main(argv: list[str]) -> None:
    p = parser()
    a = p.parse_args(argv)
    if not a.command:
        p.error("give the COMMAND to run (ft_launcher ... -m trainer ...)")
    exit_like(run_with_zygote(a.command, warm=not a.cold,
                              node=NodePlace(a.nnodes, a.rdzv_endpoint, a.rdzv_id)))


if __name__ == "__main__":
    # Through the package module, not this ``__main__`` copy: ``forked`` must be set where the trainer reads it.
    from trainer.warmstart import main as package_main

    package_main(sys.argv[1:])
