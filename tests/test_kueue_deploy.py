"""deploy/kueue/ and the jobs the builders make for Kueue, checked against Kueue v0.19.2's CRDs
(``../shared/schemas``) and the Training Operator's and Trainer's: flavors for every instance type of the table,
a ClusterQueue whose quotas are the node groups of deploy/cluster.yaml and that covers every resource a trainer pod
requests, a LocalQueue per namespace (standalone KFP's and each profile's), Kueue configured for both job kinds.
"""

from __future__ import annotations

import re

import pytest
import yaml

from components.train import kueue
from components.train.pytorchjob import INSTANCE_TYPES, JobSpec, job_manifest, node_allocatable
from components.train.trainjob import trainjob_manifest

from tests.deploy_checks import DEPLOY, SHARED_SCHEMAS, crd_validator, load_all, schema_errors

KUEUE = DEPLOY / "kueue"
CLUSTER = dict(CLUSTER_NAME="goodput", AWS_REGION="us-west-2", AWS_ACCOUNT_ID="123456789012", GPU_AZ="us-west-2a",
               SECOND_AZ="us-west-2b")


def validator(plural: str, version: str = "v1beta2"):
    return crd_validator(SHARED_SCHEMAS / f"kueue.x-k8s.io_{plural}.yaml", version)


def node_group_sizes() -> dict[str, int]:
    """Nodes per instance type: the GPU node groups' maxSize in deploy/cluster.yaml."""
    (cluster,) = load_all(DEPLOY / "cluster.yaml", **CLUSTER)
    out: dict[str, int] = {}
    for group in cluster["managedNodeGroups"]:
        for itype in group.get("instanceTypes") or [group.get("instanceType")]:
            if itype in INSTANCE_TYPES:
                out[itype] = out.get(itype, 0) + int(group["maxSize"])
    return out


def test_the_queues_are_generated_from_the_instance_table_and_the_node_groups():
    nodes = node_group_sizes()
    assert nodes == {"p5.48xlarge": 32, "p4d.24xlarge": 16}
    text = (KUEUE / "queues" / "queues.yaml").read_text()
    assert text == kueue.render(nodes), "regenerate: python -m components.train.kueue " + " ".join(
        f"{k}={v}" for k, v in nodes.items())


def test_every_queue_object_is_valid_for_kueue_v0_19():
    docs = load_all(KUEUE / "queues" / "queues.yaml")
    kinds = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues"}
    for doc in docs:
        assert doc["apiVersion"] == "kueue.x-k8s.io/v1beta2"
        assert schema_errors(validator(kinds[doc["kind"]]), doc) == [], doc["metadata"]["name"]
    (profile_lq,) = [d for d in load_all(DEPLOY / "profile" / "profile.yaml", PROFILE_NAMESPACE="team-a",
                                         FSX_FILE_SYSTEM_ID="fs-1", FSX_DNS_NAME="x", FSX_MOUNT_NAME="y")
                     if d["kind"] == "LocalQueue"]
    assert schema_errors(validator("localqueues"), profile_lq) == []
    assert profile_lq["metadata"]["namespace"] == "team-a"
    (lq,) = [d for d in docs if d["kind"] == "LocalQueue"]
    for q in (lq, profile_lq):     # the queue the docs name, in the ClusterQueue below
        assert (q["metadata"]["name"], q["spec"]["clusterQueue"]) == (kueue.LOCAL_QUEUE, kueue.CLUSTER_QUEUE)
    assert lq["metadata"]["namespace"] == "kubeflow"


def test_the_cluster_queue_has_a_flavor_per_instance_type_and_the_quota_of_its_nodes():
    docs = load_all(KUEUE / "queues" / "queues.yaml")
    flavors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceFlavor"}
    assert list(flavors) == list(INSTANCE_TYPES)
    for itype, f in flavors.items():
        assert f["spec"]["nodeLabels"] == {"node.kubernetes.io/instance-type": itype}
    (cq,) = [d for d in docs if d["kind"] == "ClusterQueue"]
    (group,) = cq["spec"]["resourceGroups"]
    assert [f["name"] for f in group["flavors"]] == list(INSTANCE_TYPES)
    quota = {f["name"]: {r["name"]: r["nominalQuota"] for r in f["resources"]} for f in group["flavors"]}
    p5 = INSTANCE_TYPES["p5.48xlarge"]
    assert quota["p5.48xlarge"]["nvidia.com/gpu"] == str(32 * p5.gpus) == "256"
    assert quota["p5.48xlarge"]["vpc.amazonaws.com/efa"] == str(32 * p5.efa)
    assert quota["p5.48xlarge"]["cpu"] == f"{32 * node_allocatable(p5)[0]}m"
    assert quota["p4d.24xlarge"]["nvidia.com/gpu"] == "128" and quota["g5.xlarge"]["nvidia.com/gpu"] == "0"


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_a_kueue_job_is_labelled_suspended_and_within_what_the_queue_covers(kind):
    spec = JobSpec(image="img:1", nodes=4, instance_type="p5.48xlarge", scheduler="kueue", queue="goodput",
                   run_id="r", task_name="t")
    if kind == "pytorchjob":
        job = job_manifest(spec)
        assert job["spec"]["runPolicy"]["suspend"] is True
        pods = [r["template"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
        v = crd_validator(SHARED_SCHEMAS / "kubeflow.org_pytorchjobs.yaml", "v1")
        assert "schedulingPolicy" not in job["spec"]["runPolicy"], "Kueue gangs the job, not a PodGroup"
    else:
        job = trainjob_manifest(spec)
        assert job["spec"]["suspend"] is True
        pods = []
        v = crd_validator(SHARED_SCHEMAS / "trainer.kubeflow.org_trainjobs.yaml", "v1alpha1")
        patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]
        assert "annotations" not in patch["metadata"], "no Volcano queue for a Kueue job"
    assert schema_errors(v, job) == []
    assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "goodput"
    for pod in pods:
        # Pods labelled with the queue would be queued again by Kueue's pod integration.
        assert kueue.QUEUE_LABEL not in pod["metadata"]["labels"]
        assert pod["spec"].get("schedulerName") is None          # the default scheduler places admitted pods
        requests = set(pod["spec"]["containers"][0]["resources"]["requests"])
        assert requests <= set(kueue.RESOURCES), "a request the ClusterQueue does not cover is never admitted"
    # Without Kueue nothing is suspended or labelled so.
    plain = job_manifest(JobSpec(image="img:1"))
    assert "suspend" not in plain["spec"]["runPolicy"] and kueue.QUEUE_LABEL not in plain["metadata"]["labels"]


def test_kueue_is_pinned_and_configured_for_both_job_kinds():
    (k,) = load_all(KUEUE / "kustomization.yaml")
    assert k["resources"] == ["https://github.com/kubernetes-sigs/kueue/releases/download/v0.19.2/manifests.yaml"]
    (gen,) = k["configMapGenerator"]
    assert (gen["name"], gen["namespace"], gen["behavior"]) == ("kueue-manager-config", "kueue-system", "replace")
    assert k["generatorOptions"] == {"disableNameSuffixHash": True}     # the Deployment mounts it by this name
    (config,) = load_all(KUEUE / gen["files"][0])
    assert (config["apiVersion"], config["kind"]) == ("config.kueue.x-k8s.io/v1beta2", "Configuration")
    frameworks = config["integrations"]["frameworks"]
    assert {"kubeflow.org/pytorchjob", "trainer.kubeflow.org/trainjob", "jobset.x-k8s.io/jobset"} <= set(frameworks)
    readme = (KUEUE / "README.md").read_text()
    assert "v0.19.2" in readme and "kubectl apply --server-side -f deploy/kueue/queues/queues.yaml" in readme


def test_the_workload_crd_is_the_one_the_launcher_reads():
    """The launcher finds a job's Workload by Kueue's job-uid label and reads its conditions and admission."""
    crd = yaml.safe_load((SHARED_SCHEMAS / "kueue.x-k8s.io_workloads.yaml").read_text())
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == kueue.API_VERSION]
    status = v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert "clusterQueue" in status["admission"]["properties"] and "conditions" in status
    assert re.search(r"v0\.19\.2", (SHARED_SCHEMAS / "README.md").read_text())


def test_render_job_helps_with_kueue_and_the_peer_secret():
    from click.testing import CliRunner

    from pipelines.cli.render_job import render_job

    r = CliRunner().invoke(render_job, ["--image", "img:1", "--scheduler", "kueue", "--queue", "goodput"])
    assert r.exit_code == 0, r.output
    job = yaml.safe_load(r.output)
    assert job["metadata"]["labels"][kueue.QUEUE_LABEL] == "goodput" and job["spec"]["runPolicy"]["suspend"]
    r = CliRunner().invoke(render_job, ["--image", "img:1", "--scheduler", "kueue"])
    assert r.exit_code != 0 and "scheduler=kueue needs queue" in r.output
    assert "kubectl create secret generic <name>-peer" in CliRunner().invoke(render_job, ["--help"]).output


def test_the_deploy_readme_points_at_kueue():
    text = (DEPLOY / "README.md").read_text()
    assert "deploy/kueue" in text


def test_the_pipelines_kueue_settings_reach_the_train_steps_job_options():
    from components.train.settings import build_train_config

    base = dict(fsx_root="/fsx", dataset_name="d", dataset_version="1", run_id="r", trainer_image="img:1",
                model="bytegpt", reachable=False)
    job = build_train_config(**base, scheduler="kueue", queue="goodput", admission_timeout_s=600).job_options
    assert (job["scheduler"], job["queue"], job["admission_timeout_s"]) == ("kueue", "goodput", 600.0)
    assert "admission_timeout_s" not in build_train_config(**base).job_options
    with pytest.raises(ValueError, match="admission_timeout_s=600 is how long Kueue may keep the job queued"):
        build_train_config(**base, admission_timeout_s=600)
    with pytest.raises(ValueError, match="scheduler=kueue needs queue"):
        build_train_config(**base, scheduler="kueue")


def _conditions(*conds: tuple[str, str, str, str]) -> list[dict]:
    return [{"type": t, "status": s, "reason": r, "message": m, "lastTransitionTime": "2026-01-01T00:00:00Z"}
            for t, s, r, m in conds]


@pytest.mark.parametrize("status, admitted, reason", [
    (None, False, kueue.NO_WORKLOAD),
    ({}, False, "Workload pending (no conditions yet)"),
    ({"conditions": _conditions(("QuotaReserved", "False", "Pending", "insufficient quota for nvidia.com/gpu"))},
     False, "Pending: insufficient quota for nvidia.com/gpu"),
    ({"conditions": _conditions(("QuotaReserved", "True", "QuotaReserved", "ok")),
      "admission": {"clusterQueue": "goodput-gpu"}},
     False, "quota reserved in ClusterQueue goodput-gpu; waiting for its admission checks"),
    ({"conditions": _conditions(("QuotaReserved", "True", "QuotaReserved", "ok"), ("Admitted", "True", "Admitted", "")),
      "admission": {"clusterQueue": "goodput-gpu"}}, True, "admitted to ClusterQueue goodput-gpu"),
    ({"conditions": _conditions(("Evicted", "True", "Preempted", "preempted by a higher priority workload"),
                                ("QuotaReserved", "False", "Pending", "waiting"))},
     False, "evicted: Preempted: preempted by a higher priority workload"),
])
def test_the_workload_says_why_a_job_waits_in_kueues_words(status, admitted, reason):
    items = [] if status is None else [{"metadata": {"name": "w", "creationTimestamp": "2026-01-01T00:00:00Z"},
                                        "status": status}]
    seen = {}

    def call(fn, *args, **kw):
        seen.update(args=args, kw=kw)
        return {"items": items}

    state = kueue.workload_state(call, None, "team-a", "uid-1")
    assert (state.admitted, state.reason) == (admitted, reason)
    assert seen["args"] == ("kueue.x-k8s.io", "v1beta2", "team-a", "workloads")
    assert seen["kw"] == {"label_selector": "kueue.x-k8s.io/job-uid=uid-1"}
