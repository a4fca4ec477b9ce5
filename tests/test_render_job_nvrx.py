"""``goodput render-job`` and the job options of the pipeline build the pods' launch command for the trainer image's
NVRx release, and that release's ft_launcher accepts it.

"Accepts" is the check of tests/test_compat_nvrx.py: the argv parses with the parser rebuilt from the release's
own argument table (tests/data/nvrx/), the trainer's arguments handed through untouched. A TrainJob's command
is the one its pods run: the TrainJob's own, else its runtime's, expanded as the kubelet does with the
``PET_*`` values the Trainer sets.
"""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner

from components.train.pytorchjob import JobSpec, job_manifest
from components.train.trainjob import JOB_NAME_ENV, RuntimeSpec, runtime_manifest, trainjob_manifest
from pipelines.cli import main
from trainer import compat
from trainer.config import parse_config

from tests.trainer_flags import settings
from tests.test_compat_nvrx import VERSIONS, launcher_options, parse
from tests.test_trainjob_build import effective_jobset, expand, node_pod

IMG = "123456789012.dkr.ecr.us-west-2.amazonaws.com/goodput-trainer:0.1.0"
TRAINER = ["--max-steps", "50", "--restart-layers", "both", "--ckpt-every", "10"]


def runs_the_trainer_flags(ns) -> bool:
    """ft_launcher's parsed command runs the trainer with the settings of ``TRAINER``."""
    cfg = parse_config(ns.training_script_args, validate=False)
    return (cfg.run.max_steps, cfg.restart.restart, cfg.checkpoint.ckpt_every) == (50, "both", "10")


# What a release's command adds to the common flags (each read from that release's table in test_compat_nvrx).
ONLY_ON = {"0.5.0": ("--ft-use-infra-group-rank", "false")}


def render(*argv: str) -> tuple[int, str, list[dict]]:
    r = CliRunner().invoke(main, ["render-job", "--image", IMG, *argv, *TRAINER])
    return r.exit_code, r.output, (list(yaml.safe_load_all(r.stdout)) if r.exit_code == 0 else [])


def pytorchjob_command(m: dict) -> list[str]:
    """Replica 0's command (every replica runs the same)."""
    replica = next(iter(m["spec"]["pytorchReplicaSpecs"].values()))
    return replica["template"]["spec"]["containers"][0]["command"]


def trainjob_command(job: dict, runtime: dict, nodes: int, procs: int) -> list[str]:
    """The argv a TrainJob's node pod runs: the JobSet the Trainer makes of it, expanded by the kubelet."""
    c = node_pod(effective_jobset(runtime, job))["spec"]["containers"][0]
    env = [e for e in c["env"] if "value" in e] + [{"name": JOB_NAME_ENV, "value": job["metadata"]["name"]}]
    argv = expand(c["command"] + c["args"], env, {})
    assert "$(" not in " ".join(argv)
    assert (argv[argv.index("--nnodes") + 1], argv[argv.index("--nproc-per-node") + 1]) == (str(nodes), str(procs))
    return argv


@pytest.mark.parametrize("gpus", [8, 0], ids=["gpu", "cpu"])
@pytest.mark.parametrize("version", VERSIONS)
def test_render_job_builds_a_pytorchjob_command_the_images_release_accepts(version, gpus):
    code, out, (m,) = render("--nvrx-release", version, "--nodes", "4", "--gpus-per-node", str(gpus),
                             *(["--nproc-per-node", "2", "--efa-per-node", "0"] if not gpus else []))
    assert code == 0, out
    options = launcher_options(pytorchjob_command(m))
    ns = parse(version, options)
    assert runs_the_trainer_flags(ns) and ns.nnodes == "4"
    assert options[:options.index("-m")] == compat.launcher_args(
        JobSpec(image=IMG, nodes=4, gpus_per_node=gpus, nproc_per_node=0 if gpus else 2).launch_config(),
        compat.release(version), compat.LauncherExtras(gpu=bool(gpus)))
    flag = ONLY_ON.get(version)
    assert (flag is not None and options[options.index(flag[0]) + 1] == flag[1]) or (
        "--ft-use-infra-group-rank" not in options)
    # The NIC link-state check (0.6+, on by default) is turned off on CPU pods only: gloo uses no RDMA port.
    nic_off = "--ft-enable-nic-healthcheck" in options
    assert nic_off == (not gpus and compat.release(version).nic_link_state_check)


def _pod_runs_for(version: str, job: dict, runtime: RuntimeSpec, procs: int) -> None:
    """The TrainJob's pods run a command ``version`` accepts; the job carries its own exactly when the runtime's
    (built for the runtime's release) is not the one for ``version``."""
    ns = parse(version, launcher_options(trainjob_command(job, runtime_manifest(runtime), 3, procs)))
    assert runs_the_trainer_flags(ns)
    pods = runtime.pods
    wanted = compat.launcher_args(pods.launch_config(), compat.release(version), pods.launcher_extras())
    assert ("command" in job["spec"]["trainer"]) == (
        wanted != compat.launcher_args(pods.launch_config(), pods.release, pods.launcher_extras()))
    if version == "0.5.0":
        assert "command" in job["spec"]["trainer"] and ns.ft_use_infra_group_rank == "false"


@pytest.mark.parametrize("version", VERSIONS)
def test_render_job_builds_a_trainjob_command_the_images_release_accepts(version):
    """Against the goodput-nvrx runtime, whose command is built for the pinned release."""
    code, out, (job,) = render("--kind", "trainjob", "--nvrx-release", version, "--nodes", "3")
    assert code == 0, out
    _pod_runs_for(version, job, RuntimeSpec(), 8)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_cpu_trainjob_for_each_release_on_a_cpu_runtime(version):
    """On CPU 0.6+ needs a flag 0.4.1 lacks (the NIC check off): the job's own command."""
    runtime = RuntimeSpec(name="goodput-nvrx-cpu", pods=JobSpec(image=IMG, gpus_per_node=0, nproc_per_node=2,
                                                                scheduler=""))
    job = trainjob_manifest(JobSpec(image=IMG, nodes=3, gpus_per_node=0, nproc_per_node=2, nvrx_release=version,
                                    trainer=settings(*TRAINER)), runtime)
    _pod_runs_for(version, job, runtime, 2)
    runs = launcher_options(trainjob_command(job, runtime_manifest(runtime), 3, 2))
    assert ("--ft-enable-nic-healthcheck" in runs) == compat.release(version).nic_link_state_check


def test_the_pinned_release_is_the_default():
    code, out, (m,) = render("--nodes", "2")
    assert code == 0, out
    assert pytorchjob_command(m) == JobSpec(image=IMG, nodes=2, trainer=settings(*TRAINER),
                                            nvrx_release=compat.IMAGE_RELEASE).pod_command()
    r = CliRunner().invoke(main, ["render-job", "--kind", "runtime", "--image", IMG])
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout) == runtime_manifest(RuntimeSpec.from_dict({"image": IMG}))
    assert "--nvrx-release TEXT" in CliRunner().invoke(main, ["render-job", "--help"]).output


@pytest.mark.parametrize("version", ["0.6.0", "0.7.0"])
def test_hot_spares_a_segment_and_the_node_health_daemon_reach_the_command_from_0_6(version):
    code, out, (m,) = render("--nvrx-release", version, "--nodes", "4", "--hot-spares", "4", "--nvlink-segment", "2",
                             "--node-health-check-endpoint", "/var/run/nvhcd/nvhcd.sock")
    assert code == 0, out
    ns = parse(version, launcher_options(pytorchjob_command(m)))
    assert (ns.nnodes, ns.ft_segment, ns.ft_node_health_check_endpoint) == ("4:8", 2, "/var/run/nvhcd/nvhcd.sock")
    assert m["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 8
    assert (m["spec"]["elasticPolicy"]["minReplicas"], m["spec"]["elasticPolicy"]["maxReplicas"]) == (4, 8)


@pytest.mark.parametrize("version", ["0.4.1", "0.5.0"])
@pytest.mark.parametrize("option, value", [("--hot-spares", "1"), ("--nvlink-segment", "2"),
                                           ("--node-health-check-endpoint", "/var/run/nvhcd/nvhcd.sock")])
def test_what_only_0_6_has_is_refused_for_older_images_in_one_line(version, option, value):
    code, out, _ = render("--nvrx-release", version, "--nodes", "4", option, value)
    assert code == 2 and "apiVersion" not in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert f"NVRx {version}" in line and "0.6.0" in line


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob", "runtime"])
@pytest.mark.parametrize("version, why", [("0.8.0", "newer than the releases the launch command is checked against"),
                                          ("0.3.2", "older than 0.4.1"), ("latest", "is not a version")])
def test_an_unsupported_release_is_refused_in_one_line_before_anything_is_printed(kind, version, why):
    r = CliRunner().invoke(main, ["render-job", "--kind", kind, "--image", IMG, "--nvrx-release", version])
    assert r.exit_code == 2 and r.stdout.count("apiVersion") == 0
    (line,) = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert line.startswith("Error: Invalid value for '--nvrx-release'") and why in line


def test_the_release_travels_in_the_pipelines_job_options():
    """The check-settings step's job options reach the builders as JobSpec settings (a KFP dict: numbers as
    floats); a job for a 0.7 image gets 0.7's command and its hot spares."""
    options = {"nvrx_release": "0.7.0", "hot_spares": 1.0, "node_health_check_endpoint": "/var/run/nvhcd/nvhcd.sock",
               "launch": {"max_restarts": 5.0}, "gpus_per_node": 8.0}
    s = JobSpec.from_dict({**options, "image": IMG, "nodes": 2.0, "trainer": settings(*TRAINER)})
    ns = parse("0.7.0", launcher_options(pytorchjob_command(job_manifest(s))))
    assert (ns.nnodes, ns.max_restarts, ns.ft_node_health_check_endpoint) == ("2:3", 5, "/var/run/nvhcd/nvhcd.sock")
    with pytest.raises(ValueError, match="nvrx_release: nvidia-resiliency-ext 0.9.0 is newer"):
        job_manifest(JobSpec.from_dict({"image": IMG, "nvrx_release": "0.9.0"}))
