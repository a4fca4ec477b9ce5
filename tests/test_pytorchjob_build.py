"""The PyTorchJob builder: every manifest it can produce is one a real cluster accepts.

Each manifest is checked against the Training Operator's CRD schema (``../shared/schemas``), made strict
the way the API server is (unknown fields are pruned there, so here they are errors), against the
operator's admission webhook rules, and its pod command against ft_launcher's own argument parser.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from components.train.pytorchjob import JobSpec, build_pytorchjob, job_manifest, job_name_for
from pipelines.cli import main
from trainer import compat
from tests.trainer_flags import settings
from trainer.config import parse_config, settings_values
from trainer.launch import LaunchConfig
from trainer.warmstart import parser as warmstart_parser

SCHEMAS = Path(os.environ.get("GOODPUT_SHARED") or Path(__file__).resolve().parents[1].parent / "shared") / "schemas"
INT32 = (-2**31, 2**31 - 1)
INT64 = (-2**63, 2**63 - 1)


# The schema, as the API server applies it ----------------------------------------------------

def _kubernetes_dialect(node):
    """Apply the Kubernetes extensions: int-or-string, preserve-unknown-fields, and pruning (strict)."""
    if isinstance(node, list):
        return [_kubernetes_dialect(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: (v if k == "x-kubernetes-validations" else _kubernetes_dialect(v)) for k, v in node.items()}
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node and "type" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False     # the API server would silently drop the field
    return node


@pytest.fixture(scope="module")
def validator():
    path = SCHEMAS / "kubeflow.org_pytorchjobs.yaml"
    if not path.is_file():
        pytest.fail(f"missing {path}: the CRD schemas are expected in ../shared/schemas beside the repository")
    crd = yaml.safe_load(path.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _kubernetes_dialect(version["schema"]["openAPIV3Schema"])
    formats = jsonschema.FormatChecker()

    @formats.checks("int32")
    def _int32(v):
        return not isinstance(v, int) or INT32[0] <= v <= INT32[1]

    @formats.checks("int64")
    def _int64(v):
        return not isinstance(v, int) or INT64[0] <= v <= INT64[1]

    return jsonschema.Draft7Validator(schema, format_checker=formats)


def schema_errors(validator, manifest: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]


def webhook_errors(m: dict) -> list[str]:
    """The Training Operator's admission rules for PyTorchJob (pkg/webhooks/pytorch, release 1.9)."""
    import re

    errs = []
    name = m["metadata"]["name"]
    if not re.match(r"^[a-z]([-a-z0-9]*[a-z0-9])?$", name) or len(name) > 63:
        errs.append("name is not a DNS-1035 label")
    spec = m["spec"]
    replicas = spec["pytorchReplicaSpecs"]
    if "elasticPolicy" in spec:
        if "Worker" not in replicas:
            errs.append("elastic needs Worker")
        if "nProcPerNode" in spec["elasticPolicy"] and "nprocPerNode" in spec:
            errs.append("elasticPolicy.nProcPerNode with nprocPerNode")
    for rtype, r in replicas.items():
        if rtype not in ("Master", "Worker"):
            errs.append(f"replica type {rtype}")
        if rtype == "Master" and r.get("replicas") != 1:
            errs.append("Master replicas must be 1")
        if rtype == "Worker" and r.get("replicas", 1) < 1:
            errs.append("Worker replicas must be at least 1")
        containers = r["template"]["spec"]["containers"]
        if not any(c["name"] == "pytorch" and c.get("image") for c in containers):
            errs.append(f"{rtype}: no container 'pytorch' with an image")
    return errs


# Options across the builder ------------------------------------------------------------------

IMG = "123456789012.dkr.ecr.us-west-2.amazonaws.com/goodput-trainer:0.1.0"
VARIANTS = {
    "single-node": dict(nodes=1),
    "multi-node": dict(nodes=4, node_group="p5-48xl", priority_class="training-high", service_account="trainer"),
    "elastic": dict(nodes=8, min_nodes=4, nvrx_release="0.5.0"),     # elastic jobs end with NVRx 0.5
    "volcano-gang": dict(nodes=16, scheduler="volcano", queue="research", priority_class="high"),
    "scheduler-plugins": dict(nodes=2, scheduler="scheduler-plugins"),
    "custom-scheduler-name": dict(nodes=2, scheduler="volcano", scheduler_name="volcano-gpu"),
    "spot-managed-nodegroup": dict(nodes=2, spot=True, node_selector={"eks.amazonaws.com/capacityType": "SPOT"}),
    "spot-karpenter": dict(nodes=2, spot=True, spot_taint="karpenter.sh/capacity-type=spot:NoSchedule",
                           node_selector={"karpenter.sh/capacity-type": "spot"}),
    "on-demand": dict(nodes=2, node_selector={"eks.amazonaws.com/capacityType": "ON_DEMAND"}),
    "cpu-only": dict(gpus_per_node=0, nproc_per_node=2, nodes=2),
    "fewer-procs-than-gpus": dict(gpus_per_node=8, nproc_per_node=4, efa_per_node=4),
    "explicit-resources": dict(cpu="96", memory="1100Gi", shm_size="256Gi", efa_per_node=16, gpus_per_node=4),
    "policies": dict(restart_policy="ExitCode", clean_pod_policy="All", backoff_limit=0, active_deadline_s=86400,
                     ttl_after_finished_s=-1, termination_grace_s=300),
    "never-restart": dict(restart_policy="Never", clean_pod_policy="None", ttl_after_finished_s=0),
    "extras": dict(env={"NCCL_DEBUG": "INFO", "HF_HOME": "/fsx/hf"}, labels={"team": "ml-infra"},
                   tolerations=[{"key": "dedicated", "operator": "Equal", "value": "training",
                                 "effect": "NoSchedule"}],
                   namespace="team-a", image_pull_policy="Always", master_port=29500),
    "kfp-run": dict(name=job_name_for("5f0c1a0e-7d8b-4c43-9a51-3fe1b9d2e001", "train"),
                    run_id="5f0c1a0e-7d8b-4c43-9a51-3fe1b9d2e001", task_name="train", nodes=3),
    "trainer-settings": dict(trainer=settings("--max-steps", "1000", "--ckpt-every", "100", "--data",
                                              "/fsx/datasets/c4/1", "--out", "/fsx/runs/exp1", "--parallel", "ddp")),
    "launch-timeouts": dict(launch=LaunchConfig(max_restarts=10, step_timeout_s=60, term_timeout_s=90),
                            termination_grace_s=150),
    "long-name-many-nodes": dict(name="a" * 52, nodes=1001),
    "yunikorn-gang": dict(nodes=4, scheduler="yunikorn", queue="root.research"),
    "mig-slice": dict(gpus_per_node=1, gpu_resource="nvidia.com/mig-3g.40gb", instance_type="p4de.24xlarge"),
    "instance-p4d": dict(nodes=2, instance_type="p4d.24xlarge"),
    "instance-g6e": dict(nodes=2, instance_type="g6e.12xlarge", gpus_per_node=4),
    # NVRx releases of the image: the command is built for each; 0.6+ offers hot spares and a node health daemon.
    "nvrx-0.5": dict(nodes=2, nvrx_release="0.5.0"),
    "nvrx-0.6-cpu": dict(gpus_per_node=0, nproc_per_node=2, nodes=2, nvrx_release="0.6.0"),
    "hot-spares-0.7": dict(nodes=4, hot_spares=2, nvrx_release="0.7.0", scheduler="volcano"),
    "one-node-one-spare-0.6": dict(nodes=1, hot_spares=1, nvrx_release="0.6.0"),
    "nvlink-segments-0.7": dict(nodes=8, hot_spares=4, nvlink_segment=4, nvrx_release="0.7.0",
                                scheduler="yunikorn"),
    "node-health-daemon-0.7": dict(nodes=2, nvrx_release="0.7.0",
                                   node_health_check_endpoint="unix:///var/run/nvhcd/nvhcd.sock"),
}


def spec(**kw) -> JobSpec:
    return JobSpec(**{"image": IMG, **kw})


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_validates_against_the_crd_and_the_webhook(validator, variant):
    manifest = job_manifest(spec(**VARIANTS[variant]))
    assert schema_errors(validator, manifest) == []
    assert webhook_errors(manifest) == []
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    # Replica names (and so Services and hostnames) fit a DNS label.
    workers = manifest["spec"]["pytorchReplicaSpecs"].get("Worker", {}).get("replicas", 0)
    assert len(f"{manifest['metadata']['name']}-worker-{max(workers - 1, 0)}") <= 63


def test_the_schema_check_is_strict(validator):
    """Not vacuous: a misspelt field, a wrong type and an out-of-range int32 are all caught."""
    good = job_manifest(spec(nodes=2))
    bad = copy.deepcopy(good)
    bad["spec"]["runPolicy"]["backofLimit"] = 3
    assert any("backofLimit" in e for e in schema_errors(validator, bad))
    bad = copy.deepcopy(good)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "1"
    assert schema_errors(validator, bad)
    bad = copy.deepcopy(good)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"] = 2**63
    assert schema_errors(validator, bad)
    bad = copy.deepcopy(good)
    bad["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "memory"] = "lots"
    assert schema_errors(validator, bad)


def test_builds_kubeflow_training_models():
    from kubeflow.training.models import KubeflowOrgV1PyTorchJob, KubeflowOrgV1ReplicaSpec

    job = build_pytorchjob(spec(nodes=2))
    assert isinstance(job, KubeflowOrgV1PyTorchJob)
    assert all(isinstance(r, KubeflowOrgV1ReplicaSpec) for r in job.spec.pytorch_replica_specs.values())


def _pod(manifest: dict, rtype: str = "Master") -> dict:
    return manifest["spec"]["pytorchReplicaSpecs"][rtype]["template"]["spec"]


def test_multi_node_pods_carry_what_training_on_p5_needs():
    m = job_manifest(spec(nodes=4, spot=True, node_group="p5", scheduler="volcano", queue="q", priority_class="hi",
                          service_account="trainer", run_id="run-1", task_name="train"))
    replicas = m["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    assert m["spec"]["nprocPerNode"] == "8"
    for rtype in ("Master", "Worker"):
        pod = _pod(m, rtype)
        (c,) = pod["containers"]
        assert c["name"] == "pytorch" and c["image"] == IMG
        assert c["ports"] == [{"name": "pytorchjob-port", "containerPort": 23456, "protocol": "TCP"},
                              *({"name": f"metrics-{i}", "containerPort": 9500 + i, "protocol": "TCP"}
                                for i in range(8))]
        res = c["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "8"
        assert res["limits"]["vpc.amazonaws.com/efa"] == "32"
        assert res["requests"]["cpu"] == "160" and res["limits"]["memory"] == "1600Gi"
        mounts = {v["name"]: v["mountPath"] for v in c["volumeMounts"]}
        assert mounts == {"fsx": "/fsx", "dshm": "/dev/shm"}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["fsx"]["persistentVolumeClaim"]["claimName"] == "fsx-claim"
        assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "512Gi"}
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1" and "NCCL_DEBUG" in env
        # Every pod reads the job's own peer secret, which the launcher makes (components.train.peer_secret).
        assert env["GOODPUT_PEER_SECRET"] == {"secretKeyRef": {"name": f"{m['metadata']['name']}-peer",
                                                               "key": "secret"}}
        keys = {t["key"] for t in pod["tolerations"]}
        assert {"nvidia.com/gpu", "vpc.amazonaws.com/efa", "spot"} <= keys
        assert pod["nodeSelector"] == {"eks.amazonaws.com/nodegroup": "p5"}
        assert pod["schedulerName"] == "volcano" and pod["priorityClassName"] == "hi"
        assert pod["serviceAccountName"] == "trainer"
        assert pod["terminationGracePeriodSeconds"] == 120
        labels = replicas[rtype]["template"]["metadata"]["labels"]
        assert labels["goodput.dev/kfp-run-id"] == "run-1" and labels["goodput.dev/kfp-task"] == "train"
    assert m["metadata"]["labels"]["goodput.dev/kfp-run-id"] == "run-1"
    rp = m["spec"]["runPolicy"]
    assert rp["schedulingPolicy"] == {"minAvailable": 4, "queue": "q", "priorityClass": "hi"}
    assert rp["backoffLimit"] == 3 and rp["cleanPodPolicy"] == "Running" and rp["ttlSecondsAfterFinished"] == 86400
    assert replicas["Master"]["restartPolicy"] == "OnFailure"


def test_pod_command_is_ft_launcher_with_a_c10d_rendezvous_on_replica_0():
    """Parsed by ft_launcher's own argument parser (the installed NVRx), as in the pod."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    installed = str(compat.installed_version())
    fixed = spec(name="exp", nodes=4, trainer=settings("--max-steps", "50"), nvrx_release=installed)
    cmd = _pod(job_manifest(fixed))["containers"][0]["command"]
    # ft_launcher runs behind the warm-start zygote (ranks are forked from one process that imported torch).
    wrapper = warmstart_parser().parse_args(cmd[3:])
    assert cmd[:3] == ["python", "-m", "trainer.warmstart"] and wrapper.command[0] == "ft_launcher"
    args = get_args_parser().parse_args(wrapper.command[1:])
    assert (wrapper.nnodes, wrapper.rdzv_endpoint, wrapper.rdzv_id) == ("4", "exp-master-0:23456", "exp")
    assert (args.nnodes, args.nproc_per_node) == ("4", "8")
    assert (args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == ("c10d", "exp-master-0:23456", "exp")
    assert args.max_restarts == 3 and not args.standalone
    assert args.module and args.training_script == "trainer"
    # The trainer's settings as one document, read by the trainer's own parser: nothing is scanned by hand.
    assert parse_config(args.training_script_args, validate=False).document() == {
        "data": {"data": "/fsx/datasets/pystdlib/3.11"}, "run": {"out": "/fsx/runs/exp", "max_steps": 50},
        "metrics": {"metrics_port": 9500}}
    # Elastic (up to NVRx 0.5; from 0.6 MIN:MAX means hot spares): workers only, MIN:MAX nodes, the store on worker 0.
    if not compat.installed_release().hot_spares:
        elastic = job_manifest(spec(name="el", nodes=8, min_nodes=2, nvrx_release=installed))
        assert set(elastic["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
        policy = elastic["spec"]["elasticPolicy"]
        assert policy["minReplicas"] == 2 and policy["maxReplicas"] == 8
        wrapper = warmstart_parser().parse_args(_pod(elastic, "Worker")["containers"][0]["command"][3:])
        args = get_args_parser().parse_args(wrapper.command[1:])
        expected = ("2:8", "el-worker-0:23456")
        assert (args.nnodes, args.rdzv_endpoint) == (wrapper.nnodes, wrapper.rdzv_endpoint) == expected
    # One node: a local store, nothing to resolve.
    one = spec(nodes=1, nvrx_release=installed)
    args = get_args_parser().parse_args(_pod(job_manifest(one))["containers"][0]["command"][4:])
    assert args.standalone


def test_hot_spares_are_workers_beyond_the_training_nodes_under_an_elastic_policy():
    """NVRx 0.6+: --nnodes N:N+k trains on N nodes, k stand by; the job has N+k Worker pods, the PyTorchJob's
    elasticPolicy says min N max N+k (the operator's PET_NNODES), the gang needs only the N."""
    m = job_manifest(spec(name="hs", nodes=4, hot_spares=2, nvlink_segment=2, nvrx_release="0.7.0",
                          scheduler="volcano"))
    assert set(m["spec"]["pytorchReplicaSpecs"]) == {"Worker"} and _pod(m, "Worker")
    assert m["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 6
    assert {k: m["spec"]["elasticPolicy"][k] for k in ("minReplicas", "maxReplicas")} == \
        {"minReplicas": 4, "maxReplicas": 6}
    assert m["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == 4
    cmd = _pod(m, "Worker")["containers"][0]["command"]
    assert cmd[cmd.index("--nnodes") + 1] == "4:6" and cmd[cmd.index("--ft-segment") + 1] == "2"
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "hs-worker-0:23456"
    # The supervisor streams the store's pod: worker 0 (no Master replica).
    from components.train.job_kinds import PYTORCHJOB

    assert PYTORCHJOB.master_selector("hs", m)[0].endswith("replica-type=worker,training.kubeflow.org/replica-index=0")
    # One training node and a spare: two pods, so a rendezvous service instead of --standalone.
    one = _pod(job_manifest(spec(name="one", nodes=1, hot_spares=1, nvrx_release="0.6.0")), "Worker")
    assert "--standalone" not in one["containers"][0]["command"]


def test_the_node_health_daemons_socket_directory_is_mounted_read_only_from_the_node():
    pod = _pod(job_manifest(spec(nodes=2, nvrx_release="0.6.0",
                                 node_health_check_endpoint="unix:///var/run/nvhcd/nvhcd.sock")))
    (c,) = pod["containers"]
    assert c["command"][c["command"].index("--ft-node-health-check-endpoint") + 1] == \
        "unix:///var/run/nvhcd/nvhcd.sock"
    assert {"name": "node-health", "mountPath": "/var/run/nvhcd", "readOnly": True} in c["volumeMounts"]
    assert {"name": "node-health", "hostPath": {"path": "/var/run/nvhcd", "type": "DirectoryOrCreate"}} in \
        pod["volumes"]
    plain = _pod(job_manifest(spec(nodes=2, nvrx_release="0.6.0")))
    assert "node-health" not in {v["name"] for v in plain["volumes"]}


def test_cpu_job_and_overrides():
    m = job_manifest(spec(gpus_per_node=0, env={"NCCL_DEBUG": "INFO"}))
    c = _pod(m)["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert "vpc.amazonaws.com/efa" not in c["resources"]["limits"]
    assert "tolerations" not in _pod(m)
    assert {e["name"]: e.get("value") for e in c["env"]} == {"NCCL_DEBUG": "INFO", "GOODPUT_PEER_SECRET": None,
                                                             "POD_NAME": None}
    # Rank 0 annotates its own pod with its progress: the downward API gives it the pod's name.
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]
    assert m["spec"]["nprocPerNode"] == "1"
    m = job_manifest(spec(env={"NCCL_DEBUG": "INFO"}))
    env = {e["name"]: e.get("value") for e in _pod(m)["containers"][0]["env"]}
    assert env["NCCL_DEBUG"] == "INFO" and env["FI_PROVIDER"] == "efa"


BAD = {
    "zero nodes": (dict(nodes=0), "nodes must be at least 1"),
    "GPUs without an image": (dict(image=""), "an image is required for 8 GPUs per node"),
    "spot with on-demand selector": (dict(spot=True, node_selector={"eks.amazonaws.com/capacityType": "ON_DEMAND"}),
                                     "allows only on-demand nodes"),
    "spot with karpenter on-demand": (dict(spot=True, node_selector={"karpenter.sh/capacity-type": "on-demand"}),
                                      "allows only on-demand nodes"),
    "spot selector without toleration": (dict(node_selector={"eks.amazonaws.com/capacityType": "SPOT"}),
                                         "add --spot"),
    "uppercase name": (dict(name="Train-Job"), "not a DNS-1035 label"),
    "name starting with a digit": (dict(name="1train"), "not a DNS-1035 label"),
    "name with underscore": (dict(name="train_job"), "not a DNS-1035 label"),
    "name too long for replicas": (dict(name="a" * 55, nodes=200), "too long"),
    "bad namespace": (dict(namespace="Team_A"), "namespace"),
    "negative gpus": (dict(gpus_per_node=-1), "gpus_per_node must not be negative"),
    "more procs than gpus": (dict(nproc_per_node=16), "exceeds gpus_per_node"),
    "efa without gpus": (dict(gpus_per_node=0, efa_per_node=4), "without GPUs"),
    "min nodes above nodes": (dict(nodes=2, min_nodes=3), "min_nodes"),
    "bad quantity": (dict(memory="lots"), "not a Kubernetes quantity"),
    "queue without volcano": (dict(queue="q"), "scheduler=volcano"),
    "unknown scheduler": (dict(scheduler="slurm"), "scheduler must be one of"),
    "kueue without a queue": (dict(scheduler="kueue"), "scheduler=kueue needs queue, the name of a LocalQueue"),
    "peer secret in env": (dict(env={"GOODPUT_PEER_SECRET": "x"}), "env GOODPUT_PEER_SECRET: set by the launcher"),
    "bad restart policy": (dict(restart_policy="Sometimes"), "restart_policy"),
    "bad clean pod policy": (dict(clean_pod_policy="Some"), "clean_pod_policy"),
    "negative backoff": (dict(backoff_limit=-1), "backoff_limit"),
    "grace below ft_launcher term timeout": (dict(termination_grace_s=30), "must exceed ft_launcher's term timeout"),
    "trainer sigterm grace too long": (dict(trainer=settings("--sigterm-grace-s", "90")), "--sigterm-grace-s"),
    "bad trainer setting": (dict(trainer={"run": {"steps_max": 10}}), "unknown setting run.steps_max"),
    "bad trainer type": (dict(trainer={"run.max_steps": "ten"}), "run.max_steps: 'ten' is not an int"),
    "bad trainer value": (dict(trainer=settings("--n-embd", "100", "--n-head", "3")), "divisible"),
    "out not on fsx": (dict(trainer=settings("--out", "/tmp/run")), "not on the FSx mount"),
    "data not on fsx": (dict(trainer=settings("--data", "data/x")), "not on the FSx mount"),
    "no pvc": (dict(pvc=""), "pvc is required"),
    "bad node selector value": (dict(node_selector={"zone": "us west"}), "not a valid label value"),
    "bad label key": (dict(labels={"bad key": "x"}), "label"),
    "bad env name": (dict(env={"1BAD": "x"}), "env name"),
    "bad taint": (dict(spot=True, spot_taint="spot=true"), "spot_taint"),
    "bad toleration effect": (dict(tolerations=[{"key": "a", "operator": "Exists", "effect": "Sometimes"}]), "effect"),
    "port out of range": (dict(master_port=80), "master_port"),
    "negative max restarts": (dict(launch=LaunchConfig(max_restarts=-1)), "max_restarts"),
    "image with spaces": (dict(image="my image"), "is not an image reference"),
    "nvrx release not checked": (dict(nvrx_release="0.8.0"), "newer than the releases the launch command is checked"),
    "nvrx release too old": (dict(nvrx_release="0.3.0"), "older than 0.4.1"),
    "nvrx release not a version": (dict(nvrx_release="latest"), "'latest' is not a version"),
    "hot spares before 0.6": (dict(hot_spares=1, nvrx_release="0.5.0"), "hot spares need nvidia-resiliency-ext >= 0.6"),
    "negative hot spares": (dict(hot_spares=-1, nvrx_release="0.7.0"), "must not be negative"),
    "elastic on 0.6": (dict(nodes=8, min_nodes=4, nvrx_release="0.6.0"), "cannot mean an elastic job"),
    "elastic with hot spares": (dict(nodes=8, min_nodes=4, hot_spares=1, nvrx_release="0.5.0"), "hot spares"),
    "segment before 0.6": (dict(nodes=4, nvlink_segment=2, nvrx_release="0.5.0"), "--ft-segment needs"),
    "segment not dividing nodes": (dict(nodes=6, nvlink_segment=4, nvrx_release="0.7.0"), "must divide"),
    "segment without gpus": (dict(gpus_per_node=0, nodes=4, nvlink_segment=2, nvrx_release="0.7.0"), "GPU nodes"),
    "health endpoint before 0.6": (dict(node_health_check_endpoint="/var/run/nvhcd/nvhcd.sock",
                                        nvrx_release="0.5.0"), "needs nvidia-resiliency-ext >= 0.6.0"),
    "health endpoint not a socket path": (dict(node_health_check_endpoint="localhost:50051", nvrx_release="0.7.0"),
                                          "Unix socket's absolute path"),
    "health socket in a shared host directory": (dict(node_health_check_endpoint="/var/run/nvhcd.sock",
                                                      nvrx_release="0.7.0"), "a directory of its own"),
    "spares make names too long": (dict(name="a" * 54, nodes=8, hot_spares=3, nvrx_release="0.7.0"), "too long"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_settings_are_rejected_with_a_clear_error(case):
    settings, message = BAD[case]
    with pytest.raises(ValueError, match="invalid PyTorchJob settings") as err:
        build_pytorchjob(spec(**settings))
    assert message in str(err.value)


def test_all_problems_are_listed_at_once():
    with pytest.raises(ValueError) as err:
        build_pytorchjob(JobSpec(name="X", nodes=0, image="", pvc=""))
    text = str(err.value)
    assert all(s in text for s in ("DNS-1035", "nodes must be at least 1", "an image is required", "pvc is required"))


def test_from_dict_takes_kfp_values_and_rejects_unknown_settings(validator):
    assert JobSpec.from_dict({"nodes": 2, "launch": {"max_restarts": 7}}).launch.max_restarts == 7
    # A KFP dict parameter arrives as a protobuf Struct: every number a float.
    s = JobSpec.from_dict({"image": IMG, "nodes": 3.0, "backoff_limit": 2.0, "spot": True, "master_port": 29500.0,
                           "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute",
                                            "tolerationSeconds": 30.0}], "launch": {"max_restarts": 4.0}})
    m = job_manifest(s)
    assert schema_errors(validator, m) == []
    assert m["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2 and m["spec"]["runPolicy"]["backoffLimit"] == 2
    assert type(m["spec"]["runPolicy"]["backoffLimit"]) is int and s.spot is True and s.launch.max_restarts == 4
    assert _pod(m)["tolerations"][-1]["tolerationSeconds"] == 30
    with pytest.raises(ValueError, match="^job setting nodes: 2.5 is not an int$"):
        JobSpec.from_dict({"nodes": 2.5})
    # No string is a number or a boolean (KFP keeps a Struct's strings as strings): the trainer's settings' rule.
    for value, kind in (("true", "bool"), ("29500", "int")):
        key = "spot" if kind == "bool" else "master_port"
        with pytest.raises(ValueError, match=f"^job setting {key}: '{value}' is not an? {kind}$"):
            JobSpec.from_dict({key: value})
    with pytest.raises(ValueError, match="^settings: run.max_steps: '5' is not an int$"):
        settings_values({"run.max_steps": "5"})
    assert settings_values({"run.max_steps": 5.0})["run"]["max_steps"] == 5
    with pytest.raises(ValueError, match="unknown job settings.*'gpus'"):
        JobSpec.from_dict({"gpus": 8})
    with pytest.raises(ValueError, match="unknown launch settings"):
        JobSpec.from_dict({"launch": {"restarts": 1}})


def test_job_names_are_deterministic_dns_labels_unique_per_run_and_task():
    a = job_name_for("3fa85f64-5717-4562-b3fc-2c963f66afa6", "train-op")
    assert a == job_name_for("3fa85f64-5717-4562-b3fc-2c963f66afa6", "train-op")
    assert a != job_name_for("3fa85f64-5717-4562-b3fc-2c963f66afa7", "train-op")
    assert a != job_name_for("3fa85f64-5717-4562-b3fc-2c963f66afa6", "train-op-2")
    for task in ("train-op", "Train Model (FSDP)", "x" * 200, "___"):
        name = job_name_for("run", task)
        assert len(name) <= 40
        JobSpec(name=name, image=IMG, nodes=1000).validate()      # fits -worker-998
    with pytest.raises(ValueError):
        job_name_for("", "train")


# goodput render-job ---------------------------------------------------------------------------

def test_render_job_prints_one_valid_pytorchjob(validator):
    r = CliRunner().invoke(main, ["render-job", "--name", "exp1", "--nodes", "2", "--gpus-per-node", "8", "--image",
                                  IMG, "--spot", "--node-group", "p5", "--scheduler", "volcano", "--queue", "q",
                                  "--env", "NCCL_DEBUG=INFO", "--max-restarts", "5", "--max-steps", "100"])
    assert r.exit_code == 0, r.output
    docs = list(yaml.safe_load_all(r.stdout))
    assert len(docs) == 1
    m = docs[0]
    assert (m["apiVersion"], m["kind"], m["metadata"]["name"]) == ("kubeflow.org/v1", "PyTorchJob", "exp1")
    assert schema_errors(validator, m) == [] and webhook_errors(m) == []
    cmd = _pod(m)["containers"][0]["command"]
    assert cmd[cmd.index("--max-restarts") + 1] == "5"
    assert parse_config(cmd[cmd.index("trainer") + 1:], validate=False).run.max_steps == 100
    assert "&id" not in r.stdout             # no YAML anchors: each replica spelled out for kubectl


@pytest.mark.parametrize("argv, message", [
    (["--nodes", "0", "--image", IMG], "nodes must be at least 1"),
    (["--gpus-per-node", "8"], "an image is required"),
    (["--image", IMG, "--spot", "--node-selector", "eks.amazonaws.com/capacityType=ON_DEMAND"], "on-demand"),
    (["--image", IMG, "--name", "Not_DNS"], "DNS-1035"),
    (["--image", IMG, "--env", "NOEQUALS"], "KEY=VALUE"),
    (["--image", IMG, "--max-stepz", "3"], "unrecognized arguments: --max-stepz 3"),
    (["--image", IMG, "--cpu", "-4"], "cpu '-4' is not a Kubernetes quantity above 0"),
    (["--image", IMG, "--memory", "0"], "memory '0' is not a Kubernetes quantity above 0"),
    (["--image", IMG, "--instance-type", "g5.xlarge"], "g5.xlarge has 1 GPUs"),
    (["--image", IMG, "--gpu-resource", "amd.com/gpu"], "gpu_resource"),
])
def test_render_job_rejects_bad_settings_without_printing_yaml(argv, message):
    r = CliRunner().invoke(main, ["render-job", *argv])
    assert r.exit_code != 0
    assert message in r.output
    assert "apiVersion" not in r.stdout


def test_one_bad_setting_is_one_line_saying_what_to_fix():
    r = CliRunner().invoke(main, ["render-job", "--image", IMG, "--cpu", "-4"])
    (line,) = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert line == "Error: invalid PyTorchJob settings: cpu '-4' is not a Kubernetes quantity above 0 (e.g. 96, " \
                   "500m, 512Gi)"


def test_pods_run_as_the_images_user_and_mig_slices_replace_gpus():
    pod = job_manifest(spec(gpus_per_node=2, gpu_resource="nvidia.com/mig-1g.10gb"))["spec"][
        "pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True,
                                      "fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch"}
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/mig-1g.10gb"] == "2" and "nvidia.com/gpu" not in res["limits"]
    assert "vpc.amazonaws.com/efa" not in res["limits"], "a slice is a small job: no EFA"


def test_builder_fields_all_documented():
    for f in dataclasses.fields(JobSpec):
        assert f.metadata.get("help"), f.name
