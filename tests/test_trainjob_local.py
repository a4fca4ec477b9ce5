"""A TrainJob's trainer command, run unchanged on this machine: the runtime's ft_launcher command and the
TrainJob's args, with the ``PET_*`` variables the Trainer would set for one node, train to the end.

The only substitutions are the ones a pod's environment makes: the kubelet's ``$(VAR)`` expansion, and the
image's ``python`` and ``ft_launcher`` entry points resolved to this interpreter. The rendezvous is the
pod's (c10d on the first node's address and port), not the ``--standalone`` of ``goodput train``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

from components.train.pytorchjob import JobSpec
from components.train.trainjob import JOB_NAME_ENV, trainer_command
from trainer import compat
from trainer.warmstart import parser as warmstart_parser

from tests.conftest import TINY
from tests.test_trainjob_build import IMG, expand
from tests.trainer_flags import settings

LAUNCHER_MODULE = "nvidia_resiliency_ext.fault_tolerance.launcher"
# The command is built for the release that runs it here (the image's default may be a newer one).
INSTALLED = str(compat.installed_version())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_trainjob_command_trains_here_unchanged(fsx_root, dataset):
    name = "tj-local"
    out = fsx_root / "runs" / name
    # metrics_port=0: other test runs on this machine may hold 9500.
    s = JobSpec(name=name, image=IMG, gpus_per_node=0, nproc_per_node=2, fsx_mount=str(fsx_root), metrics_port=0,
                nvrx_release=INSTALLED,
                trainer=settings(*TINY, "--max-steps", "6", "--ckpt-every", "3", "--data", str(dataset)))
    env = [{"name": "PET_NNODES", "value": "1"}, {"name": "PET_NPROC_PER_NODE", "value": "2"},
           {"name": "PET_MASTER_ADDR", "value": "127.0.0.1"}, {"name": "PET_MASTER_PORT", "value": str(_free_port())}]
    argv = expand(trainer_command(s), env + [{"name": JOB_NAME_ENV, "value": name}], {})
    launcher = len(argv) - len(warmstart_parser().parse_args(argv[3:]).command)   # after the wrapper's options
    assert argv[:3] == ["python", "-m", "trainer.warmstart"] and argv[launcher] == "ft_launcher"
    assert "$(" not in " ".join(argv)
    argv = [sys.executable, *argv[1:launcher], sys.executable, "-m", LAUNCHER_MODULE, *argv[launcher + 1:]]
    assert "--standalone" not in argv and argv[argv.index("--rdzv-id") + 1] == name
    log = fsx_root / f"{name}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert code == 0, tail
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 6, tail
    assert summary["tokens"] == 6 * 8 * 64 * 2       # steps x batch x sequence x ranks: PET_NPROC_PER_NODE took
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))[-1] == \
        "step_000000006"


def test_the_local_backend_runs_a_trainjobs_command_for_one_node(fsx_root, dataset):
    """What the local backend launches (``components.train.launch.local_launch`` through ``goodput train``'s
    launcher) is the TrainJob's trainer command with the ``PET_*`` values of one node: the same flags, the same
    c10d rendezvous, only the entry points resolved to this interpreter."""
    from components.train.launch import local_launch
    from trainer.launch import LaunchConfig, local_launcher_command

    name = "tj-local"
    args = [*TINY, "--max-steps", "6", "--data", str(dataset), "--out", str(fsx_root / "runs" / name)]
    launch = local_launch({"launch": {"max_restarts": 5}}, 2, name)
    s = JobSpec(name=name, image=IMG, gpus_per_node=0, nproc_per_node=2, fsx_mount=str(fsx_root), metrics_port=0,
                nvrx_release=INSTALLED,
                trainer=settings(*args), launch=LaunchConfig(max_restarts=5))
    host, port = launch.rdzv_endpoint.split(":")
    env = [{"name": "PET_NNODES", "value": "1"}, {"name": "PET_NPROC_PER_NODE", "value": "2"},
           {"name": "PET_MASTER_ADDR", "value": host}, {"name": "PET_MASTER_PORT", "value": port},
           {"name": JOB_NAME_ENV, "value": name}]
    pod = expand(trainer_command(s), env, {})
    launcher = len(pod) - len(warmstart_parser().parse_args(pod[3:]).command)   # after the wrapper's options
    assert pod[:3] == ["python", "-m", "trainer.warmstart"] and pod[launcher] == "ft_launcher"
    local = local_launcher_command(launch, s.trainer_config().argv())
    assert local == [sys.executable, *pod[1:launcher], sys.executable, "-m", LAUNCHER_MODULE, *pod[launcher + 1:]]
    assert local[local.index("--max-restarts") + 1] == "5" and "--standalone" not in local
