"""The rendezvous keep-alive (``LaunchConfig.keep_alive_*``): when a lost node is dropped from the rendezvous.

NVRx 0.4.1-0.5 hard-code 5 s x 3 missed heartbeats; ``python -m trainer.launch`` (``trainer.launch.launcher_main``)
makes their legacy FT rendezvous read ``keep_alive_interval`` / ``keep_alive_max_attempt`` from ``--rdzv-conf``.
The rendezvous test runs the installed NVRx's real handlers on a real c10d store, one process per node.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys

import pytest

from trainer import compat
from trainer.launch import (LOCAL_KEEP_ALIVE, LOCAL_RDZV_POLL_S, STANDBY_GATE_FLAG, LaunchConfig, LocalCluster,
                            launcher_command)
from trainer.warmstart import parser as warmstart_parser
from tests.trainer_flags import flags

# One node's rendezvous handler, made as the launcher makes it (the c10d handler of the registry after
# ``honour_rdzv_conf``; 0.4.1 registers it in its own copy of torch's registry). It says how long it serves the
# rendezvous state from its cache (the poll), joins a round on each line of stdin and prints "rank world" for it.
NODE = """
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from trainer import compat
compat.honour_rdzv_conf()
from nvidia_resiliency_ext.fault_tolerance import launcher
launcher._register_ft_rdzv_handler()
from nvidia_resiliency_ext.fault_tolerance._torch_elastic_compat.rendezvous import rendezvous_handler_registry
port, is_host, conf = sys.argv[1], sys.argv[2], dict(kv.split("=") for kv in sys.argv[3].split(",") if kv)
params = RendezvousParameters("c10d", f"127.0.0.1:{port}", "keepalive", 2, 2, is_host=is_host, join_timeout="10",
                              **conf)
handler = rendezvous_handler_registry.create_handler(params)
print("ready", handler._state_holder._cache_duration, flush=True)
for _ in sys.stdin:
    try:
        info = handler.next_rendezvous()
        rank, world = (info.rank, info.world_size) if hasattr(info, "rank") else info[1:]
        print(rank, world, flush=True)
    except Exception as e:
        print("failed", type(e).__name__, e, flush=True)
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port: int, is_host: bool, conf: str, poll_s: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", NODE, str(port), str(int(is_host)), conf], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.stdout.readline().split() == ["ready", f"{poll_s:g}"]
    return p


def _round(*nodes: subprocess.Popen) -> list[str]:
    for n in nodes:
        n.stdin.write("join\n")
        n.stdin.flush()
    return [n.stdout.readline().strip()[:300] for n in nodes]


@pytest.mark.skipif(not compat.has_keep_alive(compat.installed_release()),
                    reason="the installed NVRx's rendezvous has no keep-alive")
def test_a_lost_node_is_dropped_after_the_configured_keep_alive_not_nvrx_15_s():
    """Node 1 is SIGKILLed after the first round; node 0 and a replacement form the next round. That round
    completes only once the rendezvous dropped node 1 as dead: within the 10 s join timeout with a 1 s x 2
    keep-alive, never with NVRx's 15 s (the round then fails with a timeout, as without the entry point). The
    nodes poll the rendezvous every 0.2 s instead of every second."""
    settings = compat.keep_alive_conf(1, 2, compat.installed_release(), poll_s=0.2)
    port, conf = _port(), ",".join(f"{k}={v}" for k, v in settings.items())
    nodes = [_node(port, True, conf, 0.2)]
    try:
        nodes.append(_node(port, False, conf, 0.2))
        assert sorted(_round(*nodes)) == ["0 2", "1 2"]
        nodes.append(_node(port, False, conf, 0.2))    # the replacement, ready before the loss
        nodes[1].send_signal(signal.SIGKILL)
        nodes[1].wait()
        assert sorted(_round(nodes[0], nodes[2])) == ["0 2", "1 2"]
    finally:
        for n in nodes:
            n.kill()
            n.wait()


def _launcher(argv: list[str]) -> list[str]:
    """The launcher's command: what the warm-start wrapper (``python -m trainer.warmstart OPTIONS``) runs."""
    return warmstart_parser().parse_args(argv[3:]).command


def test_pods_keep_nvrx_keep_alive_unless_set():
    """The pods' command stays ``ft_launcher`` with no keep-alive keys; a keep-alive set goes into
    ``--rdzv-conf`` and the launcher runs behind the entry point that honours it."""
    pod = LaunchConfig(nnodes=2, rdzv_endpoint="job-master-0:23456")
    argv = launcher_command(pod, ["--max-steps", "1"], release=compat.release("0.4.1"))
    assert _launcher(argv)[0] == "ft_launcher" and "--rdzv-conf" not in argv
    fast = LaunchConfig(nnodes=2, rdzv_endpoint="job-master-0:23456", keep_alive_interval_s=1)
    argv = launcher_command(fast, ["--max-steps", "1"], release=compat.release("0.5.0"))
    assert _launcher(argv)[:3] == ["python", "-m", "trainer.launch"]
    assert argv[argv.index("--rdzv-conf") + 1] == "keep_alive_interval=1,keep_alive_max_attempt=3"
    # NVRx's own values, given explicitly, change nothing.
    same = LaunchConfig(nnodes=2, rdzv_endpoint="h:1", keep_alive_interval_s=5, keep_alive_max_attempts=3)
    assert _launcher(launcher_command(same, [], release=compat.release("0.4.1")))[0] == "ft_launcher"


@pytest.mark.parametrize("version", ["0.6.0", "0.7.0"])
def test_a_keep_alive_is_refused_where_the_rendezvous_has_none(version):
    fast = LaunchConfig(nnodes=2, rdzv_endpoint="h:1", keep_alive_max_attempts=2)
    with pytest.raises(ValueError, match="no keep-alive heartbeats"):
        launcher_command(fast, [], release=compat.release(version))
    assert _launcher(launcher_command(LaunchConfig(nnodes=2, rdzv_endpoint="h:1"), [],
                                      release=compat.release(version)))[0] == "ft_launcher"


def test_bad_keep_alive_is_an_error_before_anything_starts():
    for bad in (dict(keep_alive_interval_s=-1), dict(keep_alive_max_attempts=-2)):
        with pytest.raises(ValueError, match="must not be negative"):
            LaunchConfig(**bad).validate()
    # Nodes waiting in the rendezvous beat about once a second: a shorter limit would drop them as lost.
    too_short = LaunchConfig(nnodes=2, rdzv_endpoint="h:1", keep_alive_interval_s=0.25, keep_alive_max_attempts=2)
    with pytest.raises(ValueError, match="at least 2 s"):
        launcher_command(too_short, [], release=compat.release("0.4.1"))
    # With a faster poll, two polls bound it; one missed beat is never a loss; a poll is at most NVRx's second.
    polled = dataclasses.replace(too_short, rdzv_poll_interval_s=0.1)
    assert "keep_alive_interval=0.25" in " ".join(launcher_command(polled, [], release=compat.release("0.4.1")))
    for bad, match in ((dict(keep_alive_max_attempts=1, keep_alive_interval_s=5), "at least 2 missed beats"),
                       (dict(rdzv_poll_interval_s=2), r"poll interval must be in \(0, 1\]"),
                       (dict(rdzv_poll_interval_s=-1), "must not be negative")):
        with pytest.raises(ValueError, match=match):
            launcher_command(dataclasses.replace(polled, **bad), [], release=compat.release("0.4.1"))


def test_local_nodes_get_the_short_keep_alive_unless_one_is_set(tmp_path, monkeypatch):
    monkeypatch.delenv(compat.VERSION_ENV, raising=False)
    if not compat.has_keep_alive(compat.installed_release()):
        pytest.skip("the installed NVRx's rendezvous has no keep-alive")
    args = ["--out", str(tmp_path / "out"), "--memory-snapshot-dir", str(tmp_path / "shm")]
    for launch, expected in ((LaunchConfig(nnodes=2, nproc_per_node=1), (*LOCAL_KEEP_ALIVE, LOCAL_RDZV_POLL_S)),
                             (LaunchConfig(nnodes=2, nproc_per_node=1, keep_alive_interval_s=2,
                                           rdzv_poll_interval_s=0.5), (2, 3, 0.5))):
        cluster = LocalCluster(launch, args, standby=1)
        for node in (cluster.nodes[1], cluster.standbys[0]):
            cmd = cluster.command(node)
            assert cmd[cmd.index("-m", 3) + 1] == compat.LAUNCHER_ENTRY
            conf = dict(kv.split("=") for kv in cmd[cmd.index("--rdzv-conf") + 1].split(","))
            assert (float(conf["keep_alive_interval"]), int(conf["keep_alive_max_attempt"]),
                    float(conf["poll_interval"])) == expected
            assert conf["is_host"] == "0"
        # Only the standby's launcher waits at a gate before it joins.
        assert STANDBY_GATE_FLAG not in cluster.command(cluster.nodes[1])
        cmd = cluster.command(cluster.standbys[0])
        assert cmd[cmd.index(compat.LAUNCHER_ENTRY) + 1:][:2] == [STANDBY_GATE_FLAG, str(cluster.standbys[0].gate)]


def test_goodput_train_refuses_a_too_short_keep_alive_before_anything_is_written(tmp_path, monkeypatch):
    from trainer.launch import LaunchError, run_local_training

    monkeypatch.delenv(compat.VERSION_ENV, raising=False)
    launch = LaunchConfig(nnodes=2, nproc_per_node=1, keep_alive_interval_s=0.5, keep_alive_max_attempts=2)
    with pytest.raises(LaunchError, match="at least 2 s"):
        run_local_training(flags("--max-steps", "1", "--out", str(tmp_path / "out")), launch, tmp_path / "fsx")
    assert list(tmp_path.iterdir()) == []
