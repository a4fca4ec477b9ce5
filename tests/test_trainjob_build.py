"""The TrainJob and ClusterTrainingRuntime builders: every object they make is one a Trainer v2.3 cluster accepts,
and one of the Trainer's next line (v2.4), and the pods the Trainer makes of it are the PyTorchJob backend's pods.

The TrainJob and the runtime are checked against their CRD schemas, made strict the way the API server prunes:
v2.3.0's (``../shared/schemas``) and those of the newest Trainer here (``tests/data/trainer-v2-8c0f5059``: master
at 8c0f5059, 2026-08-21, after v2.3.0; see its README). The JobSet the Trainer would build of them is assembled
here the way Trainer v2.3.0's controller does it (runtime template, TrainJob trainer fields, ``PET_*`` env, runtime
patches merged) and checked against the JobSet v0.12.0 CRD, and its node command is parsed by ft_launcher's own
parser.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from components.train.pytorchjob import JobSpec, job_manifest
from components.train.trainjob import (
    FAILURE_RULES, RDZV_PORT, RuntimeSpec, build_runtime, build_trainjob, runtime_manifest, trainer_command,
    trainjob_manifest)
from trainer.config import parse_config
from trainer.launch import LaunchConfig, local_launcher_command
from trainer.warmstart import parser as warmstart_parser

from tests.trainer_flags import settings
from tests.deploy_checks import (DEPLOY, SHARED_SCHEMAS, crd_validator, load_all, model_roundtrip_problems,
                                 schema_errors)

IMG = "123456789012.dkr.ecr.us-west-2.amazonaws.com/goodput:0.1.0"
INT32 = (-2**31, 2**31 - 1)
# ../shared/schemas beside the checkout; GOODPUT_SCHEMAS points elsewhere (a git worktree has no ../shared).
SCHEMAS = Path(os.environ.get("GOODPUT_SCHEMAS", SHARED_SCHEMAS))


def _validator(file: str, version: str, where: Path = SCHEMAS):
    v = crd_validator(where / file, version)
    formats = jsonschema.FormatChecker()

    @formats.checks("int32")
    def _int32(x):
        return not isinstance(x, int) or INT32[0] <= x <= INT32[1]

    return v.evolve(format_checker=formats)


# The Trainer CRDs each object must be valid for: the release deploy/trainer-v2 installs by default, and the next.
TRAINER_CRDS = {"v2.3.0": SCHEMAS, "next": Path(__file__).parent / "data" / "trainer-v2-8c0f5059"}


@pytest.fixture(scope="module", params=sorted(TRAINER_CRDS))
def schemas(request):
    crds = TRAINER_CRDS[request.param]
    return {"trainjob": _validator("trainer.kubeflow.org_trainjobs.yaml", "v1alpha1", crds),
            "runtime": _validator("trainer.kubeflow.org_clustertrainingruntimes.yaml", "v1alpha1", crds),
            "jobset": _validator("jobset.x-k8s.io_jobsets.yaml", "v1alpha2")}


def spec(**kw) -> JobSpec:
    return JobSpec(**{"image": IMG, **kw})


# The Trainer's controller, as far as this project relies on it ------------------------------------------

def _env(value: str, name: str) -> dict:
    return {"name": name, "value": value}


def _upsert(items: list[dict], new: list[dict], key: str = "name") -> list[dict]:
    out = {i[key]: i for i in items}
    for n in new:
        out[n[key]] = n
    return list(out.values())


def _smp(base, patch):
    """Strategic merge as used for the fields a runtime patch may set: maps merge, ``volumes`` and
    ``replicatedJobs`` merge by name, other lists (tolerations) are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _smp(base.get(k), v) if k in base else v
        return out
    if isinstance(base, list) and isinstance(patch, list) and patch and all("name" in p for p in patch) \
            and all(isinstance(b, dict) and "name" in b for b in base):
        merged = {b["name"]: b for b in base}
        for p in patch:
            merged[p["name"]] = _smp(merged[p["name"]], p) if p["name"] in merged else p
        return list(merged.values())
    return patch


def effective_jobset(runtime: dict, job: dict) -> dict:
    """The JobSet Trainer v2.3.0 builds from ``runtime`` and ``job`` (pkg/runtime/core/trainingruntime.go,
    framework/plugins/{torch,jobset}): patches merged, numNodes -> parallelism, image/command/args, env with
    the PET_* variables, resourcesPerNode merged per resource, the rendezvous port declared."""
    spec = copy.deepcopy(runtime["spec"]["template"]["spec"])
    labels = {}
    for patch in job["spec"].get("runtimePatches", []):
        tpl = patch["trainingRuntimeSpec"]["template"]
        labels.update(tpl.get("metadata", {}).get("labels", {}))
        spec = _smp(spec, tpl.get("spec", {}))
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    (rjob,) = spec["replicatedJobs"]
    assert rjob["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    nodes = trainer.get("numNodes", runtime["spec"]["mlPolicy"]["numNodes"])
    rjob["replicas"] = 1
    rjob["template"]["spec"]["parallelism"] = rjob["template"]["spec"]["completions"] = nodes
    (c,) = [c for c in rjob["template"]["spec"]["template"]["spec"]["containers"] if c["name"] == "node"]
    for key in ("image", "command", "args"):
        if key in trainer:
            c[key] = trainer[key]
    res = c.setdefault("resources", {})
    for kind, quantities in trainer.get("resourcesPerNode", {}).items():
        res[kind] = {**res.get(kind, {}), **quantities}
    c["env"] = _upsert(c.get("env", []), trainer.get("env", []) + [
        _env(str(nodes), "PET_NNODES"), _env(str(trainer.get("numProcPerNode", "auto")), "PET_NPROC_PER_NODE"),
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        _env(f"{name}-node-0-0.{name}", "PET_MASTER_ADDR"), _env(str(RDZV_PORT), "PET_MASTER_PORT")])
    c["ports"] = _upsert(c.get("ports", []), [{"containerPort": RDZV_PORT}], key="containerPort")
    return {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {"name": name, "namespace": job["metadata"].get("namespace", "default"), "labels": labels},
            "spec": spec}


def node_pod(jobset: dict) -> dict:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def expand(argv: list[str], env: list[dict], pod_labels: dict) -> list[str]:
    """The kubelet's ``$(VAR)`` expansion of a container's command and args (plus the downward API labels)."""
    values = {e["name"]: e["value"] for e in env if "value" in e}
    for e in env:
        path = e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        m = re.fullmatch(r"metadata\.labels\['(.+)'\]", path)
        if m:
            values[e["name"]] = pod_labels[m.group(1)]
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m.group(1), m.group(0)), a) for a in argv]


# Every option validates --------------------------------------------------------------------------------

VOLCANO = RuntimeSpec()
COSCHEDULING = RuntimeSpec(name="goodput-nvrx-coscheduling", schedule_timeout_s=300,
                           pods=JobSpec(image=IMG, scheduler="scheduler-plugins"))
CPU = RuntimeSpec(name="goodput-nvrx-cpu",
                  pods=JobSpec(image=IMG, gpus_per_node=0, nproc_per_node=4, scheduler="", backoff_limit=1))
# A runtime for images with NVRx 0.7 on nodes that run a node health daemon.
NVRX_0_7 = RuntimeSpec(name="goodput-nvrx-0-7", pods=JobSpec(
    image=IMG, scheduler="volcano", nvrx_release="0.7.0", node_health_check_endpoint="/var/run/nvhcd/nvhcd.sock"))
VARIANTS = {
    "defaults": (dict(), VOLCANO),
    "nvrx-0.5-image": (dict(nodes=2, nvrx_release="0.5.0"), VOLCANO),
    "nvrx-0.7-health-daemon": (dict(nodes=4, nvrx_release="0.7.0",
                                    node_health_check_endpoint="/var/run/nvhcd/nvhcd.sock"), NVRX_0_7),
    "one-node": (dict(nodes=1), VOLCANO),
    "multi-node-spot": (dict(nodes=4, spot=True, node_group="p5-spot",
                             node_selector={"eks.amazonaws.com/capacityType": "SPOT"}), VOLCANO),
    "on-demand": (dict(nodes=2, node_selector={"karpenter.sh/capacity-type": "on-demand"}), VOLCANO),
    "volcano-queue": (dict(nodes=2, scheduler="volcano", queue="research"), VOLCANO),
    "p4d": (dict(nodes=2, spot=True, efa_per_node=4, cpu="90", memory="1000Gi", shm_size="256Gi",
                 node_selector={"node.kubernetes.io/instance-type": "p4d.24xlarge"}), VOLCANO),
    "fewer-procs": (dict(nodes=2, gpus_per_node=4, nproc_per_node=2), VOLCANO),
    "kfp-labels-env": (dict(run_id="3fa85f64-5717-4562-b3fc-2c963f66afa6", task_name="train", labels={"team": "a"},
                            env={"NCCL_DEBUG": "INFO"}, service_account="trainer", namespace="team-a",
                            pvc="fsx-other", termination_grace_s=300,
                            launch=LaunchConfig(term_timeout_s=200)), VOLCANO),
    "launch-settings": (dict(nodes=3, launch=LaunchConfig(max_restarts=7, step_timeout_s=60)), VOLCANO),
    "deadline-tolerations": (dict(active_deadline_s=86400, tolerations=[
        {"key": "maintenance", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}]), VOLCANO),
    "trainer-settings": (dict(trainer=settings("--max-steps", "500", "--data", "/fsx/datasets/c4/1", "--out",
                                               "/fsx/runs/exp1", "--parallel", "ddp")), VOLCANO),
    "long-name-many-nodes": (dict(name="a" * 50, nodes=1000), VOLCANO),
    "coscheduling": (dict(nodes=2, scheduler="scheduler-plugins"), COSCHEDULING),
    "kueue": (dict(nodes=2, scheduler="kueue", queue="goodput"), VOLCANO),
    "cpu": (dict(nodes=2, gpus_per_node=0, nproc_per_node=2, backoff_limit=1), CPU),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_validates_against_the_trainjob_runtime_and_jobset_crds(schemas, variant):
    settings, runtime = VARIANTS[variant]
    job, rt = trainjob_manifest(spec(**settings), runtime), runtime_manifest(runtime)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert (rt["apiVersion"], rt["kind"]) == ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime")
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": runtime.name}
    assert schema_errors(schemas["trainjob"], job) == []
    assert schema_errors(schemas["runtime"], rt) == []
    # The runtime's template is a JobSet spec; so is what the Trainer makes of it for this job.
    bare = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {"name": "x"},
            "spec": rt["spec"]["template"]["spec"]}
    assert schema_errors(schemas["jobset"], bare) == []
    assert schema_errors(schemas["jobset"], effective_jobset(rt, job)) == []


def test_the_schema_check_is_strict(schemas):
    """Not vacuous: a misspelt field, a wrong type and an out-of-range int32 are caught in each object."""
    job, rt = trainjob_manifest(spec(nodes=2)), runtime_manifest()
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNode"] = 2
    assert any("numNode" in e for e in schema_errors(schemas["trainjob"], bad))
    bad = copy.deepcopy(job)
    bad["spec"]["trainer"]["numNodes"] = "2"
    assert schema_errors(schemas["trainjob"], bad)
    bad = copy.deepcopy(job)
    bad["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]["template"][
        "spec"]["template"]["spec"]["priorityClassName"] = "hi"        # not a field a runtime patch may set
    assert schema_errors(schemas["trainjob"], bad)
    bad = copy.deepcopy(rt)
    bad["spec"]["template"]["spec"]["failurePolicy"]["maxRestart"] = 3
    assert any("maxRestart" in e for e in schema_errors(schemas["runtime"], bad))
    bad = copy.deepcopy(rt)
    bad["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] = 2**31
    assert schema_errors(schemas["runtime"], bad)
    bad = effective_jobset(rt, job)
    node_pod(bad)["spec"]["containers"][0]["resources"]["limits"]["memory"] = "lots"
    assert schema_errors(schemas["jobset"], bad)


def test_builds_kubeflow_trainer_api_models():
    from kubeflow_trainer_api.models import TrainerV1alpha1ClusterTrainingRuntime, TrainerV1alpha1TrainJob

    assert isinstance(build_trainjob(spec(nodes=2)), TrainerV1alpha1TrainJob)
    assert isinstance(build_runtime(), TrainerV1alpha1ClusterTrainingRuntime)


# The pods are the PyTorchJob backend's pods ---------------------------------------------------------------

@pytest.mark.parametrize("variant", ["multi-node-spot", "p4d", "kfp-labels-env", "deadline-tolerations",
                                     "nvrx-0.7-health-daemon"])
def test_trainjob_pods_are_the_pytorchjob_pods(variant):
    settings, runtime = VARIANTS[variant]
    s = spec(**settings)
    pod = node_pod(effective_jobset(runtime_manifest(runtime), trainjob_manifest(s, runtime)))
    want = next(iter(job_manifest(s)["spec"]["pytorchReplicaSpecs"].values()))["template"]
    got_c, want_c = pod["spec"]["containers"][0], want["spec"]["containers"][0]
    assert got_c["name"] == "node" and got_c["image"] == want_c["image"] == IMG
    assert got_c["resources"] == want_c["resources"]
    assert got_c["volumeMounts"] == want_c["volumeMounts"]
    # The same env, the job's peer secret included (the TrainJob's, not the runtime's).
    assert {e["name"]: e.get("value", e.get("valueFrom")) for e in want_c["env"]}.items() <= \
        {e["name"]: e.get("value", e.get("valueFrom")) for e in got_c["env"]}.items()
    metrics = [p for p in want_c["ports"] if p["name"].startswith("metrics-")]
    assert [p for p in got_c["ports"] if p.get("name", "").startswith("metrics-")][:len(metrics)] == metrics
    for key in ("volumes", "tolerations", "nodeSelector", "serviceAccountName", "terminationGracePeriodSeconds"):
        assert pod["spec"].get(key) == want["spec"].get(key), key
    assert pod["metadata"]["labels"] == want["metadata"]["labels"]       # the PodMonitor's and the supervisor's
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["schedulerName"] == "volcano"


def test_node_command_is_ft_launcher_with_a_c10d_rendezvous_on_node_0():
    """Expanded as the kubelet does with the Trainer's env, then parsed by ft_launcher's own parser."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    for nodes in (4, 1):
        s = spec(name="exp", nodes=nodes, trainer=settings("--max-steps", "50"))
        pod = node_pod(effective_jobset(runtime_manifest(), trainjob_manifest(s)))
        c = pod["spec"]["containers"][0]
        argv = expand(c["command"] + c["args"], c["env"], {"jobset.sigs.k8s.io/jobset-name": "exp"})
        wrapper = warmstart_parser().parse_args(argv[3:])
        assert argv[:3] == ["python", "-m", "trainer.warmstart"] and wrapper.command[0] == "ft_launcher"
        args = get_args_parser().parse_args(wrapper.command[1:])
        # The wrapper is told the node's place with the launcher's values (its peer daemon's job and address).
        assert (wrapper.nnodes, wrapper.rdzv_endpoint, wrapper.rdzv_id) == (args.nnodes, args.rdzv_endpoint,
                                                                            args.rdzv_id)
        assert (args.nnodes, args.nproc_per_node) == (str(nodes), "8")
        # One node too: its own pod's name resolves through the JobSet's headless Service.
        assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", f"exp-node-0-0.exp:{RDZV_PORT}",
                                                                         "exp")
        assert args.max_restarts == 3 and not args.standalone and args.module and args.training_script == "trainer"
        assert parse_config(args.training_script_args, validate=False).document() == {
            "data": {"data": "/fsx/datasets/pystdlib/3.11"}, "run": {"out": "/fsx/runs/exp", "max_steps": 50},
            "metrics": {"metrics_port": 9500}}
    # Launch settings other than the runtime's travel in the TrainJob's command.
    job = trainjob_manifest(spec(launch=LaunchConfig(max_restarts=9)))
    assert job["spec"]["trainer"]["command"][job["spec"]["trainer"]["command"].index("--max-restarts") + 1] == "9"
    assert "command" not in trainjob_manifest(spec())["spec"]["trainer"]


_NODE_FLAGS = {"--nnodes", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"}


def _without_head_and_node_flags(argv: list[str]) -> list[str]:
    """The launcher's flags and the trainer's command, without who starts the launcher and how nodes meet."""
    launcher = warmstart_parser().parse_args(argv[3:]).command
    out, it = [], iter(launcher[launcher.index("--nnodes"):])
    for a in it:
        if a in _NODE_FLAGS:
            next(it)
        elif a != "--standalone":
            out.append(a)
    return out


@pytest.mark.parametrize("launch", [LaunchConfig(), LaunchConfig(max_restarts=5, step_timeout_s=30, warm_start=False)])
def test_trainer_command_is_what_goodput_train_runs_locally_but_for_the_node_flags(launch):
    s = spec(nodes=2, trainer=settings("--max-steps", "20", "--ckpt-every", "5"), launch=launch)
    cluster = trainer_command(s)
    trainer_args = s.trainer_config().argv()
    local = local_launcher_command(dataclasses.replace(launch, nproc_per_node=2, nnodes=1, rdzv_endpoint=""),
                                   trainer_args)
    assert _without_head_and_node_flags(cluster) == _without_head_and_node_flags(local)
    assert cluster[-len(trainer_args) - 2:] == ["-m", "trainer", *trainer_args]
    # ...and it is what the pod runs: the runtime's (or the job's) command followed by the job's args.
    c = node_pod(effective_jobset(runtime_manifest(), trainjob_manifest(s)))["spec"]["containers"][0]
    assert c["command"] + c["args"] == cluster
    # Not vacuous: a changed launcher flag is a difference.
    other = local_launcher_command(dataclasses.replace(launch, max_restarts=launch.max_restarts + 1), [])
    assert _without_head_and_node_flags(cluster)[:10] != _without_head_and_node_flags(other)[:10]


# Restarts: which failure the JobSet restarts, counts or gives up on -----------------------------------------

def _jobset_action(rt: dict, reason: str, message: str) -> str:
    """The first JobSet failure policy rule matching a Job's failure (jobset v0.12 failure_policy.go), or the
    default for no match: a restart counted against maxRestarts."""
    for rule in rt["spec"]["template"]["spec"]["failurePolicy"]["rules"]:
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        if rule.get("onJobFailureMessagePatterns") and not any(
                re.search(p, message) for p in rule["onJobFailureMessagePatterns"]):
            continue
        return rule["action"]
    return "RestartJobSet (default)"


def _job_failure(rt: dict, exit_code: int | None = None, disrupted: bool = False) -> tuple[str, str]:
    """(reason, message) of the node Job's Failed condition, as the Job controller writes them for a failed pod
    (pkg/controller/job/pod_failure_policy.go), given backoffLimit 0."""
    job = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    for i, rule in enumerate(job["podFailurePolicy"]["rules"]):
        if disrupted and any(c["type"] == "DisruptionTarget" for c in rule.get("onPodConditions", [])):
            return "PodFailurePolicy", f"Pod ns/p has condition DisruptionTarget matching {rule['action']} rule " \
                                       f"at index {i}"
        codes = rule.get("onExitCodes")
        if exit_code is not None and codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return "PodFailurePolicy", f"Container node for pod ns/p failed with exit code {exit_code} matching " \
                                       f"{rule['action']} rule at index {i}"
    return "BackoffLimitExceeded", "Job has reached the specified backoff limit"


@pytest.mark.parametrize("exit_code, disrupted, action", [
    (None, True, "RestartJobSetAndIgnoreMaxRestarts"),     # spot reclaim, eviction, preemption: not counted
    (2, False, "FailJobSet"), (93, False, "FailJobSet"),   # usage error; NVRx: do not restart
    (126, False, "FailJobSet"), (127, False, "FailJobSet"),  # the image cannot run the command
    (128, False, "RestartJobSet"),                         # the container could not start on this node
    (1, False, "RestartJobSet (default)"),                 # ft_launcher gave up after its in-job restarts
    (137, False, "RestartJobSet (default)"),
])
def test_failures_are_told_apart_by_the_pod_and_jobset_failure_policies(exit_code, disrupted, action):
    rt = runtime_manifest()
    assert _jobset_action(rt, *_job_failure(rt, exit_code, disrupted)) == action


def test_the_node_job_passes_kubernetes_job_validation():
    """What the Job API (batch/v1 validation, not in the CRD schemas) demands of a pod failure policy."""
    job = runtime_manifest()["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"                    # a pod failure policy needs it
    assert len(job["podFailurePolicy"]["rules"]) <= 20
    names = {c["name"] for c in pod["containers"]}
    for rule in job["podFailurePolicy"]["rules"]:
        assert rule["action"] in ("FailJob", "FailIndex", "Ignore", "Count")
        codes = rule.get("onExitCodes")
        assert (codes is None) != ("onPodConditions" not in rule)    # exactly one requirement
        if codes:
            values = codes["values"]
            assert values == sorted(set(values)) and all(0 < v <= 255 for v in values) and len(values) <= 255
            assert codes["containerName"] in names


def test_a_runtime_name_need_not_be_a_job_name():
    assert runtime_manifest(RuntimeSpec(name="goodput-nvrx.v2-" + "x" * 60))["metadata"]["name"].startswith(
        "goodput-nvrx.v2")


def test_backoff_limit_is_the_jobset_restart_budget_and_rules_follow_failure_rules():
    rt = runtime_manifest(RuntimeSpec(pods=JobSpec(image=IMG, scheduler="volcano", backoff_limit=7)))
    policy = rt["spec"]["template"]["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 7 and policy["restartStrategy"] == "Recreate"
    assert [r["name"] for r in policy["rules"]] == [r.name for r in FAILURE_RULES]
    with pytest.raises(ValueError, match="backoff_limit=3 differs from ClusterTrainingRuntime goodput-nvrx's 7"):
        build_trainjob(spec(), RuntimeSpec(pods=JobSpec(image=IMG, scheduler="volcano", backoff_limit=7)))


def test_gang_scheduling_is_the_runtimes_pod_group_policy():
    assert runtime_manifest()["spec"]["podGroupPolicy"] == {"volcano": {}}
    assert runtime_manifest(COSCHEDULING)["spec"]["podGroupPolicy"] == {"coscheduling": {"scheduleTimeoutSeconds":
                                                                                         300}}
    assert "podGroupPolicy" not in runtime_manifest(CPU)["spec"]
    pod = node_pod(runtime_manifest(COSCHEDULING)["spec"]["template"])
    assert pod["spec"]["schedulerName"] == "scheduler-plugins-scheduler"
    job = trainjob_manifest(spec(scheduler="volcano", queue="research"))
    assert job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["metadata"]["annotations"] == {
        "scheduling.volcano.sh/queue-name": "research"}


# Bad settings -------------------------------------------------------------------------------------------------

BAD = {
    "elastic": (dict(nodes=4, min_nodes=2), "no elastic training"),
    "restart policy": (dict(restart_policy="Never"), "restart_policy='Never' is not used by a TrainJob"),
    "clean pod policy": (dict(clean_pod_policy="All"), "clean_pod_policy='All' is not used"),
    "master port": (dict(master_port=29400), "fixes the rendezvous port at 29500"),
    "backoff limit": (dict(backoff_limit=5), "backoff_limit=5 differs from ClusterTrainingRuntime goodput-nvrx's 3"),
    "ttl": (dict(ttl_after_finished_s=60), "ttl_after_finished_s=60 differs"),
    "fsx mount": (dict(fsx_mount="/data", trainer=settings("--data", "/data/d", "--out", "/data/o")), "fsx_mount"),
    "image pull policy": (dict(image_pull_policy="Always"), "image_pull_policy='Always' differs"),
    "metrics port": (dict(metrics_port=9600), "metrics_port=9600 differs"),
    "scheduler": (dict(scheduler="scheduler-plugins"), "gang scheduling and priority are the runtime's"),
    "priority class": (dict(priority_class="high"), "priority_class='high' differs"),
    "cpu job on gpu runtime": (dict(gpus_per_node=0, efa_per_node=0), "0 GPUs per node"),
    "no efa on efa runtime": (dict(efa_per_node=0), "0 EFA interfaces per node"),
    "reserved env": (dict(env={"PET_NNODES": "3"}), "set by the Trainer's torch plugin"),
    "name too long": (dict(name="a" * 54, nodes=11), "pod host names like"),    # fits a PyTorchJob's -worker-9
    "pytorchjob check": (dict(nodes=0), "nodes must be at least 1"),
    "bad trainer setting": (dict(trainer={"run": {"steps_max": 10}}), "unknown setting run.steps_max"),
    "spot with on-demand selector": (dict(spot=True, node_selector={"eks.amazonaws.com/capacityType": "ON_DEMAND"}),
                                     "allows only on-demand nodes"),
    "hot spares": (dict(nodes=4, hot_spares=1, nvrx_release="0.7.0"), "hot_spares=1: a TrainJob's node command"),
    "nvlink segment": (dict(nodes=4, nvlink_segment=2, nvrx_release="0.7.0"), "use the pytorchjob backend"),
    "health daemon not the runtime's": (dict(nvrx_release="0.7.0", node_health_check_endpoint="/run/nvhcd/x.sock"),
                                        "node_health_check_endpoint='/run/nvhcd/x.sock' differs"),
    "nvrx release not checked": (dict(nvrx_release="0.9.1"), "newer than the releases"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_settings_are_refused_with_a_clear_error(case):
    settings, message = BAD[case]
    with pytest.raises(ValueError, match="invalid TrainJob settings") as err:
        build_trainjob(spec(**settings))
    assert message in str(err.value)


def test_more_processes_than_the_runtime_declares_ports_for_are_refused():
    small = RuntimeSpec(pods=JobSpec(image=IMG, scheduler="volcano", gpus_per_node=4))
    build_trainjob(spec(gpus_per_node=4), small)
    with pytest.raises(ValueError, match="declares metrics ports for 4 local ranks"):
        build_trainjob(spec(gpus_per_node=8), small)


def test_all_problems_are_listed_at_once():
    with pytest.raises(ValueError) as err:
        build_trainjob(JobSpec(name="X", image="", nodes=4, min_nodes=2, backoff_limit=9))
    text = str(err.value)
    assert all(s in text for s in ("DNS-1035", "an image is required", "no elastic training", "backoff_limit=9"))


BAD_RUNTIMES = {
    "bad name": (dict(name="Goodput_NVRx"), "not a DNS-1123 subdomain"),
    "timeout without coscheduling": (dict(schedule_timeout_s=60), "scheduler-plugins"),
    "negative timeout": (dict(schedule_timeout_s=-1, scheduler="scheduler-plugins"), "must not be negative"),
    "bad pods": (dict(gpus_per_node=-1), "gpus_per_node must not be negative"),
    "unknown setting": (dict(gpus=8), "unknown job settings"),
}


@pytest.mark.parametrize("case", sorted(BAD_RUNTIMES))
def test_bad_runtime_settings_are_refused(case):
    settings, message = BAD_RUNTIMES[case]
    with pytest.raises(ValueError, match=message):
        build_runtime(RuntimeSpec.from_dict(settings))


def test_runtime_from_dict_takes_kfp_values():
    rt = RuntimeSpec.from_dict({"name": "goodput-nvrx-big", "backoff_limit": 5.0, "gpus_per_node": 8.0,
                                "schedule_timeout_s": 90.0, "scheduler": "scheduler-plugins"})
    assert (rt.name, rt.schedule_timeout_s, rt.pods.backoff_limit, rt.pods.scheduler) == \
        ("goodput-nvrx-big", 90, 5, "scheduler-plugins")
    assert runtime_manifest(rt)["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 5


# deploy/trainer-v2 ----------------------------------------------------------------------------------------------

TRAINER_V2 = DEPLOY / "trainer-v2"


def test_checked_in_runtime_is_the_builders():
    (doc,) = yaml.safe_load_all((TRAINER_V2 / "runtime" / "goodput-nvrx.yaml").read_text())   # not a template
    assert doc == runtime_manifest(), "regenerate deploy/trainer-v2/runtime/goodput-nvrx.yaml (see its header)"
    (kust,) = load_all(TRAINER_V2 / "runtime" / "kustomization.yaml")
    assert kust["resources"] == ["goodput-nvrx.yaml"]


def test_runtime_default_image_is_the_train_components():
    from components.train.launch import TRAINER_IMAGE

    assert RuntimeSpec().pods.image == TRAINER_IMAGE


def test_the_runtime_fits_trainer_v2_4s_limits():
    """Trainer v2.4 refuses runtimes whose replicated jobs' names are longer than 20 characters."""
    for options, runtime in VARIANTS.values():
        for rjob in runtime_manifest(runtime)["spec"]["template"]["spec"]["replicatedJobs"]:
            assert len(rjob["name"]) <= 20, rjob["name"]
        job = trainjob_manifest(spec(**options), runtime)
        for patch in job["spec"]["runtimePatches"]:
            for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
                assert len(rjob["name"]) <= 20, rjob["name"]


def test_deploy_installs_trainer_v2_3_or_v2_4_with_the_same_volcano():
    (v23,) = load_all(TRAINER_V2 / "kustomization.yaml")
    (v24,) = load_all(TRAINER_V2 / "v2.4" / "kustomization.yaml")
    assert v24["resources"][0] == "github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.4.0"
    assert v24["resources"][1:] == v23["resources"][1:]
    readme = (TRAINER_V2 / "README.md").read_text()
    assert "kubectl apply --server-side -k deploy/trainer-v2/v2.4" in readme and "## Trainer v2.4" in readme


def test_install_pins_trainer_v2_3_and_its_jobset():
    (kust,) = load_all(TRAINER_V2 / "kustomization.yaml")
    assert kust["resources"][0] == "github.com/kubeflow/trainer.git/manifests/overlays/manager?ref=v2.3.0"
    assert re.fullmatch(r"https://raw\.githubusercontent\.com/volcano-sh/volcano/v\d+\.\d+\.\d+/installer/"
                        r"volcano-development\.yaml", kust["resources"][1])
    # The schemas this test validates against are those versions' CRDs.
    readme = (SCHEMAS / "README.md").read_text()
    assert "kubeflow/trainer, tag v2.3.0" in readme and "jobset, tag v0.12.0" in readme


# What the supervisor calls (tests/test_k8s_supervise.py checks it against the audit log), and no more.
RBAC_NEEDS = {("trainer.kubeflow.org", "trainjobs"): {"create", "get", "list", "watch", "delete"},
              ("jobset.x-k8s.io", "jobsets"): {"get"}, ("", "pods"): {"list"}, ("", "pods/log"): {"get"},
              ("", "events"): {"list"}, ("batch", "jobs"): {"list"}, ("", "secrets"): {"create", "patch", "delete"},
              ("kueue.x-k8s.io", "workloads"): {"list"}}


def _granted(rules: list[dict]) -> dict:
    out: dict = {}
    for r in rules:
        for g in r["apiGroups"]:
            for res in r["resources"]:
                out.setdefault((g, res), set()).update(r["verbs"])
    return out


@pytest.mark.parametrize("file", ["rbac.yaml", "rbac-profile.yaml"])
def test_rbac_grants_what_the_launcher_needs_and_no_edits(file):
    docs = load_all(TRAINER_V2 / file)
    role = next(d for d in docs if d["kind"] in ("Role", "ClusterRole"))
    for d in docs:
        # A ClusterRole has a Role's fields (plus aggregationRule, unused here): checked through V1Role.
        assert model_roundtrip_problems({**d, "kind": "Role"} if d["kind"] == "ClusterRole" else d) == []
    granted = _granted(role["rules"])
    assert granted == RBAC_NEEDS
    # No edits of anything but the job's own peer secret (its ownerReference is a patch).
    assert not any(v in verbs for what, verbs in granted.items() if what != ("", "secrets")
                   for v in ("update", "patch", "*"))
    if file == "rbac-profile.yaml":
        assert role["metadata"]["labels"]["rbac.authorization.kubeflow.org/aggregate-to-kubeflow-edit"] == "true"
    else:
        (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        # Cluster-scoped, read only: the runtime the launcher checks before creating a TrainJob.
        (reader,) = [d for d in docs if d["kind"] == "ClusterRole"]
        assert _granted(reader["rules"]) == {("trainer.kubeflow.org", "clustertrainingruntimes"): {"get"}}
        (cbinding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
        assert cbinding["roleRef"]["name"] == reader["metadata"]["name"]
        assert cbinding["subjects"] == binding["subjects"]


def test_builder_fields_all_documented():
    for f in dataclasses.fields(RuntimeSpec):
        assert f.metadata.get("help"), f.name
    assert yaml.safe_dump(runtime_manifest())      # plain data, no model objects left inside


# goodput render-job --kind -------------------------------------------------------------------------------------

def _render(*argv: str):
    from click.testing import CliRunner

    from pipelines.cli import main

    return CliRunner().invoke(main, ["render-job", *argv])


def test_render_job_kind_trainjob_prints_the_builders_trainjob(schemas):
    r = _render("--kind", "trainjob", "--name", "exp1", "--nodes", "4", "--image", IMG, "--spot",
                "--node-group", "p5-spot", "--max-steps", "500")
    assert r.exit_code == 0, r.output
    (job,) = yaml.safe_load_all(r.output)
    assert job == trainjob_manifest(spec(name="exp1", nodes=4, spot=True, node_group="p5-spot",
                                         trainer=settings("--max-steps", "500")))
    assert schema_errors(schemas["trainjob"], job) == []
    r = _render("--kind", "trainjob", "--runtime", "goodput-nvrx-other", "--image", IMG)
    assert yaml.safe_load(r.output)["spec"]["runtimeRef"]["name"] == "goodput-nvrx-other"


def test_render_job_kind_runtime_prints_the_shipped_runtime_or_one_built_from_the_options(schemas):
    r = _render("--kind", "runtime")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.output) == yaml.safe_load((TRAINER_V2 / "runtime" / "goodput-nvrx.yaml").read_text())
    r = _render("--kind", "runtime", "--runtime", "goodput-nvrx-cpu", "--image", IMG, "--gpus-per-node", "0",
                "--efa-per-node", "0", "--backoff-limit", "1")
    assert r.exit_code == 0, r.output
    rt = yaml.safe_load(r.output)
    assert rt == runtime_manifest(RuntimeSpec.from_dict({"name": "goodput-nvrx-cpu", "image": IMG, "gpus_per_node": 0,
                                                         "efa_per_node": 0, "backoff_limit": 1}))
    assert rt["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 1
    assert schema_errors(schemas["runtime"], rt) == []


@pytest.mark.parametrize("argv, message", [
    (["--kind", "trainjob", "--nodes", "4", "--min-nodes", "2"], "no elastic training"),
    (["--kind", "trainjob", "--backoff-limit", "5"], "backoff_limit=5 differs from ClusterTrainingRuntime"),
    (["--kind", "runtime", "--max-steps", "5"], "a runtime has no trainer arguments"),
    # Job settings the runtime cannot carry are refused, not dropped.
    (["--kind", "runtime", "--nodes", "4"], "a runtime does not take --nodes: they are a TrainJob's"),
    (["--kind", "runtime", "--spot"], "a runtime does not take --spot"),
    (["--kind", "runtime", "--node-group", "p5"], "a runtime does not take --node-group"),
    (["--kind", "runtime", "--queue", "q"], "a runtime does not take --queue"),
    (["--kind", "runtime", "--name", "j", "--namespace", "ns"], "a runtime does not take --name, --namespace"),
    (["--kind", "slurm"], "Invalid value for '--kind'"),
])
def test_render_job_kind_refuses_what_the_kind_cannot_carry(argv, message):
    r = _render("--image", IMG, *argv)
    assert r.exit_code == 2 and message in r.output, r.output
    assert "apiVersion" not in r.output
