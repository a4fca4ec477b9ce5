"""The NVRx version gate (trainer/compat.py) against what each release really is.

The argument tables in tests/data/nvrx/ were taken from each release's own ft_launcher parser (the installed
release's is also checked against its live parser); a launch command "accepted by a release"
means its argv parses with a parser rebuilt from that release's table, as ft_launcher would parse it:
every flag known, every value of a known type and among the choices, and the trainer's arguments handed
through untouched. What the installed release does is asserted from its ``Release`` (the tests run on the
release ``constraints.txt`` pins, 0.4.1 in CI, and on any other checked one).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer import compat
from trainer.compat import LauncherExtras, release
from trainer.launch import LaunchConfig, local_launcher_command
from tests.trainer_flags import settings

DATA = Path(__file__).parent / "data" / "nvrx"
VERSIONS = compat.CHECKED
INSTALLED = compat.installed_release()
INSTALLED_VERSION = str(INSTALLED.version)
# A trainer command line with a flag that shares a prefix with launcher flags (--restart-layers vs
# --restart-policy): abbreviation matching would steal it on releases that allow abbreviations.
TRAINER_ARGS = ["--max-steps", "50", "--restart-layers", "both", "--ckpt-every", "10", "--out", "/fsx/runs/x"]


def table(version: str) -> dict:
    return json.loads((DATA / f"launcher-{version}.json").read_text())


class _Rejected(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):          # ft_launcher would exit 2 and print this
        raise _Rejected(message)


def release_parser(version: str) -> argparse.ArgumentParser:
    """ft_launcher's parser of ``version``, rebuilt from its table."""
    t = table(version)
    p = _Parser(allow_abbrev=t["parser"]["allow_abbrev"], prefix_chars=t["parser"]["prefix_chars"], add_help=False)
    for a in t["arguments"]:
        kw: dict = {"dest": a["dest"]} if a["options"] else {}
        if not a["takes_value"]:
            kw["action"] = "store_true"
        else:
            kw["type"] = {"int": int, "float": float}.get(a["type"], str)
            kw["nargs"] = argparse.REMAINDER if a["nargs"] == "..." else a["nargs"]
            if a["choices"] is not None:
                kw["choices"] = a["choices"]
        p.add_argument(*a["options"], **kw) if a["options"] else p.add_argument(a["dest"], **kw)
    return p


def launcher_options(argv: list[str]) -> list[str]:
    """What follows the launcher itself in a launch command (the warm-start wrapper and python come first; our
    entry point's standby gate is its own, not ft_launcher's)."""
    from trainer.launch import STANDBY_GATE_FLAG

    for i, word in enumerate(argv):
        if word in ("ft_launcher", "nvidia_resiliency_ext.fault_tolerance.launcher", compat.LAUNCHER_ENTRY):
            return argv[i + 3:] if argv[i + 1:i + 2] == [STANDBY_GATE_FLAG] else argv[i + 1:]
    raise AssertionError(f"no ft_launcher in {argv}")


def parse(version: str, options: list[str]) -> argparse.Namespace:
    ns = release_parser(version).parse_args(options)
    assert ns.module and ns.training_script == "trainer", ns
    return ns


def command(launch: LaunchConfig, version: str, extras: LauncherExtras = LauncherExtras()) -> list[str]:
    return [*compat.launcher_args(launch, release(version), extras), "-m", "trainer", *TRAINER_ARGS]


CLUSTER = LaunchConfig(nnodes=4, nproc_per_node=8, rdzv_endpoint="job-master-0:23456", rdzv_id="job", max_restarts=5)


# ------------------------------------------------------------------------------------ the tables themselves

def test_the_installed_releases_table_is_its_live_parser():
    """The extraction is faithful where it can be compared: the live parser of the installed release."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    assert INSTALLED_VERSION in VERSIONS, f"the tests run on a release the gate was checked on, not {INSTALLED_VERSION}"
    live = [(list(a.option_strings), a.dest, a.default, a.nargs != 0, None if a.choices is None else list(a.choices))
            for a in get_args_parser()._actions if not isinstance(a, argparse._HelpAction)]
    recorded = [(a["options"], a["dest"], a["default"], a["takes_value"], a["choices"])
                for a in table(INSTALLED_VERSION)["arguments"]]
    assert recorded == live


@pytest.mark.parametrize("version", VERSIONS)
def test_each_table_says_where_it_came_from(version):
    prov = table(version)["provenance"]
    assert prov["version"] == version and prov["wheel"].startswith(f"nvidia_resiliency_ext-{version}-")
    assert len(prov["wheel_sha256"]) == 64 and prov["file"].endswith("fault_tolerance/launcher.py")
    if version == "0.7.0":        # published from a commit the repository has no tag (nor launcher.py) for
        assert prov["git"]["tag"] is None and prov["git"]["commit"] is None
    else:
        assert prov["git"]["tag"] == f"v{version}" and prov["git"]["launcher_matches_tag"]


def test_the_rebuilt_parsers_reject_what_those_releases_reject():
    """The tables carry the changes the gate avoids, so a command that used them would fail here."""
    tail = ["-m", "trainer"]
    with pytest.raises(_Rejected, match="invalid choice"):
        parse("0.7.0", ["--ft-rdzv-impl", "legacy", *tail])            # legacy rendezvous removed
    with pytest.raises(_Rejected, match="invalid choice"):
        parse("0.6.0", ["--ft-restart-policy", "min-healthy", *tail])  # min-healthy removed
    with pytest.raises(_Rejected, match="unrecognized"):
        parse("0.4.1", ["--ft-rdzv-impl", "barrier", *tail])           # no choice of rendezvous yet
    with pytest.raises(_Rejected, match="unrecognized"):
        parse("0.5.0", ["--ft-node-health-check-endpoint", "/run/nvhcd.sock", *tail])   # came in 0.6
    with pytest.raises(_Rejected, match="unrecognized"):
        parse("0.5.0", ["--ft-param-workload_check_interval", "1", *tail])  # --ft-param-* removed in 0.5
    assert parse("0.4.1", ["--ft-param-workload_check_interval", "1", *tail]).ft_workload_check_interval == 1.0


# ------------------------------------------------------------------------------- the gate, release by release

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("launch", [LaunchConfig(), CLUSTER], ids=["local", "cluster"])
def test_a_command_built_for_each_release_uses_only_flags_it_accepts(version, launch):
    ns = parse(version, command(launch, version, LauncherExtras(gpu=launch is CLUSTER)))
    assert ns.training_script_args == TRAINER_ARGS
    assert (ns.nnodes, ns.nproc_per_node, ns.max_restarts) == (str(launch.nnodes), str(launch.nproc_per_node),
                                                               launch.max_restarts)
    assert ns.standalone == (not launch.rdzv_endpoint)
    assert float(ns.workers_stop_timeout) == launch.workers_stop_timeout_s
    assert ns.ft_rank_section_timeouts == "setup:600,step:300,checkpoint:900"


def test_what_only_0_6_and_later_offer_reaches_their_command():
    extras = LauncherExtras(gpu=True, spare_nodes=2, segment=2, node_health_check_endpoint="unix:///var/run/nvhcd.sock",
                            storage_paths=("/fsx", "/fsx/runs/x"), dist_storage_check=True,
                            progress_file="/fsx/runs/x/checkpoints/resumable_step")
    for version in ("0.6.0", "0.7.0"):
        ns = parse(version, command(CLUSTER, version, extras))
        assert ns.nnodes == "4:6"                          # 4 train, 2 hot spares stand by
        assert ns.ft_segment == 2                          # in whole NVLink domains of 2 nodes
        assert ns.ft_node_health_check_endpoint == "unix:///var/run/nvhcd.sock"
        assert ns.ft_storage_healthcheck_path == "/fsx,/fsx/runs/x"
        assert ns.ft_enable_dist_storage_healthcheck == "true"
        assert ns.ft_checkpoint_iteration_file == "/fsx/runs/x/checkpoints/resumable_step"
        assert ns.ft_enable_nic_healthcheck is None       # GPU: NVRx's default (on)
        assert parse(version, command(LaunchConfig(), version)).ft_enable_nic_healthcheck == "false"   # CPU
    for version in ("0.4.1", "0.5.0"):
        for one in (dict(spare_nodes=2), dict(segment=2, gpu=True), dict(node_health_check_endpoint="/run/h.sock"),
                    dict(storage_paths=("/fsx",)), dict(dist_storage_check=True), dict(progress_file="/f")):
            with pytest.raises(ValueError, match=f"0.6.0.*{version}|{version}"):
                compat.launcher_args(CLUSTER, release(version), LauncherExtras(**one))


def test_elastic_jobs_keep_their_meaning_or_are_refused():
    """--nnodes MIN:MAX trains on MIN..MAX nodes up to 0.5; from 0.6 it trains on MIN and parks the rest."""
    for version in ("0.4.1", "0.5.0"):
        assert compat.nnodes_arg(8, release(version), min_nodes=2) == "2:8"
    for version in ("0.6.0", "0.7.0"):
        with pytest.raises(ValueError, match="hot spares"):
            compat.nnodes_arg(8, release(version), min_nodes=2)
        assert compat.nnodes_arg(8, release(version), spare_nodes=1) == "8:9"
    with pytest.raises(ValueError, match="cannot be combined"):
        compat.nnodes_arg(8, release("0.7.0"), min_nodes=2, spare_nodes=1)
    with pytest.raises(ValueError, match="absolute"):
        compat.launcher_args(CLUSTER, release("0.7.0"), LauncherExtras(storage_paths=("fsx",)))


# ------------------------------------------------------------------------------- chosen defaults per release

EXPECTED = {
    #          layers,  rendezvous,  restarts,   straggler package
    "0.4.1": ("both", "legacy", "per-node", "nvidia_resiliency_ext.straggler"),
    "0.5.0": ("both", "legacy", "per-node", "nvidia_resiliency_ext.attribution.straggler"),
    "0.6.0": ("injob", "barrier", "job", "nvidia_resiliency_ext.attribution.straggler"),
    "0.7.0": ("injob", "barrier", "job", "nvidia_resiliency_ext.attribution.straggler"),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_defaults_chosen_for_each_release(version):
    rel = release(version)
    layers, rendezvous, restarts, straggler = EXPECTED[version]
    assert compat.resolve_restart_layers("auto", rel) == layers
    assert compat.resolve_restart_layers("both", rel) == "both"        # in-process stays available
    assert (rel.rendezvous[0], rel.restarts_counted, rel.straggler_module) == (rendezvous, restarts, straggler)
    assert compat.inprocess_health_checks(rel, cuda=False) == ()       # CUDA checks only on GPU
    gpu = ("cuda",) if version == "0.4.1" else ("cuda", "gpu", "nvlink")
    assert compat.inprocess_health_checks(rel, cuda=True) == gpu
    assert ("nic" in compat.inprocess_health_checks(rel, cuda=True, nic=True)) == (version != "0.4.1")


@pytest.mark.parametrize("version", VERSIONS)
def test_the_release_facts_agree_with_that_releases_sources(version):
    """Every per-release decision of the gate, checked against the launcher table and the modules of the
    release (not a second hand-written copy)."""
    rel, t = release(version), table(version)
    args = {a["dest"]: a for a in t["arguments"]}
    facts = t["facts"]
    rdzv = args.get("ft_rdzv_impl")
    assert rel.rendezvous == ((rdzv["default"], *[c for c in rdzv["choices"] if c != rdzv["default"]])
                              if rdzv else ("legacy",))
    assert rel.workers_stop_timeout_default_s == args["workers_stop_timeout"]["default"]
    infra = args.get("ft_use_infra_group_rank")
    assert rel.needs_infra_rank_off == bool(infra and "Default: True" in infra["help"])
    assert rel.hot_spares == ("ft_segment" in args)
    assert rel.node_health_check_endpoint == ("ft_node_health_check_endpoint" in args)
    assert rel.storage_checks == ({"ft_storage_healthcheck_path", "ft_enable_dist_storage_healthcheck"} <= set(args))
    assert rel.nic_link_state_check == ("ft_enable_nic_healthcheck" in args)
    assert rel.progress_tracking == ("ft_checkpoint_iteration_file" in args)
    assert rel.restarts_counted == ("job" if facts["max_restarts_count_job_cycles"] else "per-node")
    exit_code = args.get("ft_no_restart_exit_code")
    assert rel.no_restart_exit_code == (93 if exit_code and "Default: 93" in exit_code["help"] else None)
    assert facts["straggler_modules"] == [rel.straggler_module]
    assert facts["inprocess_wrapper"]
    chained = {"gpu": "ChainedGPUHealthCheck", "nvlink": "ChainedNVLHealthCheck", "nic": "ChainedNicHealthCheck",
               "cuda": "CudaHealthCheck"}
    assert {chained[c] for c in rel.inprocess_device_checks} == set(facts["inprocess_health_checks"]) & set(
        chained.values())
    assert rel.public_results_queue == facts["public_write_results_queue"]
    assert rel.wrapper_adds_device_checks == facts["wrapper_adds_device_checks"]
    assert rel.preload_builds_buckets == facts["preload_builds_buckets"]
    assert rel.plan_copies_cpu_tensors == facts["plan_copies_cpu_tensors"]
    assert rel.end_all_sections_works == (not facts["end_all_sections_is_noop"])
    assert rel.async_queue_qos == facts["persistent_worker_handles_sigterm"] == (
        "cpu_priority" in facts["async_calls_queue_params"])
    assert set(compat.async_calls_queue_kwargs(rel, 19)) <= set(facts["async_calls_queue_params"])


def test_versions_outside_those_checked():
    newer = release("0.8.1")
    assert not newer.checked and newer.rendezvous == release("0.7.0").rendezvous
    assert release("0.7.3").checked
    with pytest.raises(compat.NVRxCompatError, match="older than 0.4.1"):
        release("0.3.0")
    with pytest.raises(compat.NVRxCompatError, match="not a version"):
        release("latest")
    with pytest.raises(ValueError, match="auto, inprocess, injob or both"):
        compat.resolve_restart_layers("both-layers", newer)


def test_the_target_release_is_the_override_then_the_image_pin_then_the_installed_one(monkeypatch):
    monkeypatch.delenv(compat.VERSION_ENV, raising=False)
    assert compat.target_release() == INSTALLED
    monkeypatch.setenv(compat.VERSION_ENV, "0.6.0")
    assert str(compat.target_release().version) == "0.6.0"
    assert str(compat.target_release("0.7.0").version) == "0.7.0"
    assert compat.installed_release() == INSTALLED           # code that calls NVRx ignores the pin
    monkeypatch.delenv(compat.VERSION_ENV)
    monkeypatch.setattr(compat, "installed_version", lambda: None)
    with pytest.raises(compat.NVRxCompatError, match=compat.VERSION_ENV):
        compat.target_release()
    with pytest.raises(compat.NVRxCompatError, match="not installed"):
        compat.installed_release()


def test_a_pods_command_is_for_the_images_release_never_the_installed_one(monkeypatch):
    """The component image that builds jobs has no NVRx; a release whose launcher was not read is refused there,
    not guessed at."""
    monkeypatch.setattr(compat, "installed_version", lambda: None)
    monkeypatch.setenv(compat.VERSION_ENV, "0.5.0")
    assert compat.image_release() == release(compat.IMAGE_RELEASE)
    assert compat.image_release("0.7.3") == release("0.7.3")                   # a patch release of a checked one
    with pytest.raises(compat.NVRxCompatError, match="0.8.0 is newer than the releases .* NVRX_RELEASE"):
        compat.image_release("0.8.0")
    with pytest.raises(compat.NVRxCompatError, match="older than 0.4.1"):
        compat.image_release("0.4.0")


def test_segments_and_the_health_endpoint_are_checked_where_nvrx_would_not():
    seg = dict(gpu=True, spare_nodes=1)
    with pytest.raises(ValueError, match="must divide"):
        compat.launcher_args(CLUSTER, release("0.7.0"), LauncherExtras(segment=3, **seg))
    with pytest.raises(ValueError, match="GPU nodes"):
        compat.launcher_args(CLUSTER, release("0.7.0"), LauncherExtras(segment=2))
    for bad in ("localhost:50051", "dns:///nvhcd", "nvhcd.sock", "unix://relative.sock"):   # NVRx skips these
        with pytest.raises(ValueError, match="Unix socket's absolute path"):
            compat.launcher_args(CLUSTER, release("0.6.0"), LauncherExtras(node_health_check_endpoint=bad))
    assert compat.uds_path("unix:///var/run/nvhcd/nvhcd.sock") == compat.uds_path("/var/run/nvhcd/nvhcd.sock") == \
        "/var/run/nvhcd/nvhcd.sock"


def test_nccl_releases_that_segfault_on_abort_keep_in_process_restart_off():
    assert "2.28.9" in compat.inprocess_nccl_problem((2, 28, 5))
    assert compat.inprocess_nccl_problem((2, 28, 9)) is None and compat.inprocess_nccl_problem((2, 27, 7)) is None


def test_importing_the_gate_imports_no_torch():
    code = "import sys, trainer.compat; sys.exit('torch' in sys.modules or 'nvidia_resiliency_ext' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ------------------------------------------------------------------------------- today's launch command

def test_the_flags_launch_py_emits_today_parse_on_every_release(monkeypatch):
    """trainer/launch.py (on the gate, for 0.4.1) and components/train/pytorchjob.py (for the image's release): every
    flag
    is accepted by 0.4.1 to 0.7 (none breaks at parse time); what changes meaning is listed by the next test."""
    from components.train.pytorchjob import JobSpec

    monkeypatch.setenv(compat.VERSION_ENV, "0.4.1")
    local = launcher_options(local_launcher_command(LaunchConfig(), TRAINER_ARGS))
    pod_spec = JobSpec(image="ecr/goodput:1", nodes=4, gpus_per_node=8, trainer=settings(*TRAINER_ARGS))
    pod = launcher_options(pod_spec.pod_command())
    for version in VERSIONS:
        assert parse(version, local).training_script_args == TRAINER_ARGS
        assert parse(version, pod).training_script_args == pod_spec.trainer_config().argv()
        if not release(version).hot_spares:      # an elastic job: up to 0.5 (from 0.6 MIN:MAX means spares)
            elastic = JobSpec(image="ecr/goodput:1", nodes=8, min_nodes=2, gpus_per_node=8, nvrx_release=version)
            assert parse(version, launcher_options(elastic.pod_command())).nnodes == "2:8"
    # On 0.4.1 launch.py builds the options it wrote by hand before it used the gate.
    assert local[:local.index("-m")] == [
        "--nnodes", "1", "--nproc-per-node", "2", "--standalone", "--max-restarts", "3", "--monitor-interval", "0.5",
        "--term-timeout", "60", "--workers-stop-timeout", "1", "--ft-workload-check-interval", "1",
        "--ft-rank-section-timeouts", "setup:600,step:300,checkpoint:900", "--ft-rank-out-of-section-timeout", "600"]
    # 0.5.0 parses today's command but, without the flag the gate adds, rendezvous fails on every node.
    assert parse("0.5.0", local).ft_use_infra_group_rank is None
    assert parse("0.5.0", command(LaunchConfig(), "0.5.0")).ft_use_infra_group_rank == "false"


@pytest.mark.parametrize("version", VERSIONS)
def test_launch_py_builds_the_command_for_the_release_it_is_given(version, monkeypatch):
    from trainer.launch import launcher_command

    monkeypatch.delenv(compat.VERSION_ENV, raising=False)
    argv = launcher_command(CLUSTER, TRAINER_ARGS, release=release(version), extras=LauncherExtras(gpu=True))
    assert launcher_options(argv) == command(CLUSTER, version, LauncherExtras(gpu=True))
    assert parse(version, launcher_options(argv)).training_script_args == TRAINER_ARGS
    monkeypatch.setenv(compat.VERSION_ENV, version)      # None: the image's pin
    assert launcher_command(CLUSTER, TRAINER_ARGS, extras=LauncherExtras(gpu=True)) == argv


@pytest.mark.parametrize("version", VERSIONS)
def test_a_keep_alive_goes_into_rdzv_conf_on_releases_with_a_keep_alive_rendezvous(version):
    """0.4.1-0.5 (legacy rendezvous): the release's parser takes the command, the keys reach --rdzv-conf beside
    the others, the training script's arguments are intact; 0.6+ (barrier: no heartbeats) refuses it."""
    import dataclasses

    from trainer.launch import launcher_command

    fast = dataclasses.replace(CLUSTER, keep_alive_interval_s=1, keep_alive_max_attempts=3, join_timeout_s=60)
    polled = dataclasses.replace(CLUSTER, rdzv_poll_interval_s=0.1)
    if not compat.has_keep_alive(release(version)):
        for launch in (fast, polled):
            with pytest.raises(ValueError, match="no keep-alive"):
                launcher_command(launch, TRAINER_ARGS, release=release(version))
        return
    ns = parse(version, launcher_options(launcher_command(fast, TRAINER_ARGS, release=release(version))))
    assert ns.rdzv_conf == "join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=3"
    assert ns.training_script_args == TRAINER_ARGS
    # A poll of ours, with NVRx's keep-alive; and a standby's gate, which our entry point takes before them.
    argv = launcher_command(polled, TRAINER_ARGS, release=release(version), standby_gate=Path("/run/gate"))
    assert argv[argv.index(compat.LAUNCHER_ENTRY) + 1:][:2] == ["--standby-gate", "/run/gate"]
    ns = parse(version, launcher_options(argv))
    assert ns.rdzv_conf == "keep_alive_interval=5,keep_alive_max_attempt=3,poll_interval=0.1"
    assert ns.training_script_args == TRAINER_ARGS


def test_counts_the_pods_environment_fills_in_pass_through_unchanged():
    """A TrainJob's node command takes its counts from $(PET_NNODES) and $(PET_NPROC_PER_NODE)."""
    from trainer.launch import launcher_command

    pod = LaunchConfig(nnodes="$(PET_NNODES)", nproc_per_node="$(PET_NPROC_PER_NODE)",
                       rdzv_endpoint="$(PET_MASTER_ADDR):$(PET_MASTER_PORT)")
    for version in VERSIONS:
        ns = parse(version, launcher_options(launcher_command(pod, TRAINER_ARGS, release=release(version))))
        assert (ns.nnodes, ns.nproc_per_node) == ("$(PET_NNODES)", "$(PET_NPROC_PER_NODE)")
    with pytest.raises(ValueError, match="known node count"):
        compat.launcher_args(pod, release("0.7.0"), LauncherExtras(spare_nodes=1))
    with pytest.raises(ValueError, match="rdzv_endpoint"):       # may be many nodes
        LaunchConfig(nnodes="$(PET_NNODES)").validate()
    for bad in ("four", "$(PET NNODES)", 0, 2.5, True):
        with pytest.raises(ValueError, match="nnodes"):
            LaunchConfig(nnodes=bad, rdzv_endpoint="h:1").validate()
    assert compat.launcher_args(LaunchConfig(nnodes=2.0, nproc_per_node="8", rdzv_endpoint="h:1"),
                                release("0.4.1"))[:4] == ["--nnodes", "2", "--nproc-per-node", "8"]


def test_what_todays_command_means_differently_on_later_releases():
    """The list phase 2 must act on: what today's command and trainer do that is accepted everywhere but
    means something else on a later release (each fact checked against the sources above)."""
    changed = {}
    for version in VERSIONS:
        rel = release(version)
        changed[version] = {name for name, differs in (
            ("--nnodes MIN:MAX trains MIN nodes, the rest stand by", rel.hot_spares),
            ("--max-restarts counts the job's restarts, not each node's", rel.restarts_counted == "job"),
            ("the writer's own SIGTERM handler ends the final save", rel.async_queue_qos),
            ("--restart-layers both: in-process restart is deprecated", compat.default_restart_layers(rel) != "both"),
            ("the Wrapper's own GPU check fails every in-process restart on CPU", rel.wrapper_adds_device_checks),
            ("FTManager.reset's end_all_sections() closes nothing", not rel.end_all_sections_works),
            ("AsyncRequest without preload_fn: every save fails", rel.preload_builds_buckets),
            ("AsyncCallsQueue without cpu_shm_mode: the CPU worker dies", rel.async_queue_qos),
            ("no rendezvous without SLURM_PROCID/GROUP_RANK", rel.needs_infra_rank_off),
            ("planning before the staging copy saves the previous snapshot", rel.plan_copies_cpu_tensors),
        ) if differs}
    assert changed["0.4.1"] == set() and len(changed["0.5.0"]) == 3
    assert len(changed["0.6.0"]) == 8 and changed["0.7.0"] - changed["0.6.0"] == {
        "planning before the staging copy saves the previous snapshot"}


# ------------------------------------------------------------------------- private APIs on the installed release

def test_every_private_api_resolves_on_the_installed_release_and_on_every_checked_one():
    assert compat.check_internals() == [f"{m}.{p}" for m, p in compat.INTERNALS]
    for version in VERSIONS:       # recorded by tests/data/nvrx/extract.py against each release's modules
        recorded = table(version)["internals"]
        assert recorded["broken"] == [] and recorded["resolved"] == [f"{m}.{p}" for m, p in compat.INTERNALS], \
            f"{version}: regenerate tests/data/nvrx (extract.py) after changing compat.INTERNALS"


def test_a_private_api_an_upgrade_removed_fails_loudly_naming_the_version(monkeypatch):
    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    monkeypatch.delattr(filesystem_async, "_get_write_results_queue")
    with pytest.raises(compat.NVRxCompatError, match=rf"_get_write_results_queue is missing under "
                                                     rf"nvidia-resiliency-ext {re.escape(INSTALLED_VERSION)}, torch"):
        compat.check_internals()
    if not INSTALLED.public_results_queue:        # from 0.6 the trainer starts it through the public call
        with pytest.raises(compat.NVRxCompatError, match=f"nvidia-resiliency-ext {INSTALLED_VERSION}"):
            compat.start_write_results_queue(INSTALLED)


def test_accessors_written_for_a_newer_release_refuse_the_installed_one():
    """Built for 0.7 but run on an older release (an image whose pin and package disagree): a clear error, not a
    wrong call."""
    if INSTALLED.public_results_queue:
        pytest.skip(f"{INSTALLED_VERSION} has every API the accessors for 0.7 call")
    with pytest.raises(compat.NVRxCompatError, match=f"get_write_results_queue is missing.*{INSTALLED_VERSION}"):
        compat.start_write_results_queue(release("0.7.0"))
    if "gpu" not in INSTALLED.inprocess_device_checks:
        with pytest.raises(compat.NVRxCompatError, match=f"ChainedGPUHealthCheck is missing.*{INSTALLED_VERSION}"):
            compat.build_inprocess_health_checks(release("0.7.0"), cuda=True, max_rank_faults=3)


def test_the_trainers_write_results_queue_is_the_one_nvrx_s_writers_use(monkeypatch):
    import multiprocessing

    from nvidia_resiliency_ext.checkpointing.async_ckpt import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)
    assert compat.write_results_queue() is None
    ours = multiprocessing.Queue()
    compat.set_write_results_queue(ours)
    assert compat.write_results_queue() is ours
    assert compat.start_write_results_queue(INSTALLED) is ours    # NVRx's writers will use this one
    monkeypatch.delattr(filesystem_async, "_results_queue")
    with pytest.raises(compat.NVRxCompatError, match="_results_queue is missing"):
        compat.set_write_results_queue(ours)


def test_a_save_plan_is_trusted_after_one_planning():
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import CheckpointMetadataCache

    cache, metadata = CheckpointMetadataCache(), object()
    cache.set_cache_metadata("central-plan", "local-plan", False)   # what the first planning leaves
    assert not cache.validated_cache_reuse
    compat.trust_save_plan(cache, metadata)
    assert cache.validated_cache_reuse and cache.cached_global_metadata is metadata
    assert cache.get_cache_metadata()[:2] == ("central-plan", "local-plan")


def test_a_section_timeout_goes_through_the_rank_monitors_own_state():
    import dataclasses

    from nvidia_resiliency_ext.fault_tolerance.data import SectionTimeouts
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient

    key = RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY
    # What an initialised client's state_dict() holds once it calculated section timeouts.
    learned = dataclasses.asdict(SectionTimeouts(section={"setup": 600.0, "step": 300.0}))
    state = compat.with_section_timeout({key: {"section": learned}}, "step", 42.0)
    client = RankMonitorClient()      # not started by ft_launcher: loading a state still works
    client.load_state_dict(state)
    assert client.loaded_section_timeouts.section == {"setup": 600.0, "step": 42.0}
    with pytest.raises(compat.NVRxCompatError, match="layout"):
        compat.with_section_timeout({key: {}}, "step", 42.0)      # no calculated timeouts in the state


def test_torch_private_helpers(process_group):
    import torch

    assert dist_default_group_in(compat.process_group_names())
    copy_state_dict, create_cpu_state_dict = compat.cpu_state_dict_helpers()
    state = {"w": torch.arange(4.0)}
    staging = create_cpu_state_dict(state, share_memory=True)
    copy_state_dict(state, staging)
    assert torch.equal(staging["w"], state["w"]) and staging["w"].is_shared()
    dst = [torch.zeros(3), torch.zeros(2)]
    compat.foreach_copy(dst, [torch.ones(3), torch.full((2,), 2.0)])
    assert dst[0].tolist() == [1.0] * 3 and dst[1].tolist() == [2.0] * 2
    assert compat.local_tensor(state["w"]) is state["w"]


def test_dtensor_internals(process_group):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    live = distribute_tensor(torch.arange(4.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    assert compat.local_tensor(live) is live._local_tensor
    host = compat.dtensor_like(torch.full((4,), 7.0), live)
    assert host.placements == live.placements and host.device_mesh == live.device_mesh
    assert compat.local_tensor(host).tolist() == [7.0] * 4


def test_rank_monitor_accessors(monkeypatch):
    from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClient
    from nvidia_resiliency_ext.inprocess.store import TCPStore

    monkeypatch.delenv(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, raising=False)
    assert not compat.under_ft_launcher()
    monkeypatch.setenv(FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR, "/tmp/none.socket")
    assert compat.under_ft_launcher()
    assert compat.rank_monitor_socket(RankMonitorClient()) is None      # not connected yet
    assert compat.wrapper_store_host_rank(TCPStore) == 0
    key = RankMonitorClient.CURRENT_TIMEOUTS_STATE_KEY
    assert compat.has_calculated_timeouts({key: {"section": {}}}) and not compat.has_calculated_timeouts({})


def test_the_wrappers_health_check_is_ours_alone_where_it_adds_its_own():
    """From 0.5 the Wrapper appends GPU/NVLink/NIC checks when LOCAL_RANK is set; on CPU its GPU check fails
    every in-process restart. 0.4.1 has no such addition: the constructor's check is all, nothing to replace."""
    from nvidia_resiliency_ext import inprocess

    checks = compat.build_inprocess_health_checks(INSTALLED, cuda=False, max_rank_faults=3)
    wrapper = inprocess.Wrapper(health_check=inprocess.Compose(*checks))
    compat.install_restart_health_checks(wrapper, checks, INSTALLED)
    if INSTALLED.wrapper_adds_device_checks:
        assert isinstance(wrapper.restart_health_check, inprocess.Compose)     # ours replaced the Wrapper's
    else:
        assert not hasattr(wrapper, "restart_health_check")
        with pytest.raises(compat.NVRxCompatError, match=f"restart_health_check is missing.*{INSTALLED_VERSION}"):
            compat.install_restart_health_checks(wrapper, checks, release("0.5.0"))


def test_a_save_request_carries_the_write_buckets_as_the_release_expects(process_group, tmp_path):
    import torch
    from nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async import FileSystemWriterAsync
    from nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver import save_state_dict_async_plan

    writer = FileSystemWriterAsync(str(tmp_path), thread_count=1)
    writer, _, _ = save_state_dict_async_plan({"w": torch.arange(4.0)}, writer)
    req = compat.save_request(writer, ["finalize"], INSTALLED)
    assert req.finalize_fns == ["finalize"] and (req.preload_fn is not None) == INSTALLED.preload_builds_buckets
    if not INSTALLED.preload_builds_buckets:      # up to 0.5 the planned buckets travel in the arguments
        assert req.async_fn_args[1]
    # What 0.6+ gets: the preload function, which builds there the buckets its arguments leave out.
    assert compat.save_request(writer, [], release("0.7.0")).preload_fn is not None


def dist_default_group_in(groups) -> bool:
    import torch.distributed as dist

    return dist.group.WORLD in groups


def test_the_rest_of_the_release_dependent_calls_on_the_installed_release():
    rel = INSTALLED
    assert hasattr(compat.import_straggler(rel), "Detector")
    checks = compat.build_inprocess_health_checks(rel, cuda=True, max_rank_faults=3)
    names = {"cuda": "CudaHealthCheck", "gpu": "ChainedGPUHealthCheck", "nvlink": "ChainedNVLHealthCheck"}
    assert [type(c).__name__ for c in checks] == [*(names[n] for n in rel.inprocess_device_checks if n != "nic"),
                                                  "FaultCounter"]
    assert [type(c).__name__ for c in compat.build_inprocess_health_checks(rel, cuda=False, max_rank_faults=3)] \
        == ["FaultCounter"]
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue

    assert AsyncCallsQueue(**compat.async_calls_queue_kwargs(rel, 19)).persistent
    newer = compat.async_calls_queue_kwargs(release("0.7.0"), 19)
    assert newer == {"persistent": True, "cpu_priority": 19, "cpu_shm_mode": True}
    previous = signal.getsignal(signal.SIGTERM)
    try:
        compat.writer_ignores_sigterm()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)
