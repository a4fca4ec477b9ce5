"""Kueue (kueue.x-k8s.io, checked on v0.19.2): the queue label of a job, what its Workload says about
admission, and the cluster's queue objects (``deploy/kueue/``) made from the instance table.

A job labelled ``kueue.x-k8s.io/queue-name: <LocalQueue>`` is created suspended (a PyTorchJob's
``spec.runPolicy.suspend``, a TrainJob's ``spec.suspend``: what Kueue's webhook would set). Kueue makes a
``Workload`` of it, labelled ``kueue.x-k8s.io/job-uid`` and owned by the job (a controller ownerReference, so
it goes with the job), reserves quota in the LocalQueue's ClusterQueue (condition ``QuotaReserved``), admits it
(``Admitted``) and unsuspends the job. Until then the Workload's ``QuotaReserved`` condition says why it waits
("couldn't assign flavors to pod set master: insufficient quota for nvidia.com/gpu in flavor p5.48xlarge, ...").

    from components.train.kueue import cluster_manifests, workload_state
    cluster_manifests({"p5.48xlarge": 32})        # ResourceFlavors + ClusterQueue of deploy/kueue/
    workload_state(call, client, "team-a", job_uid)

This module imports neither torch nor kfp, and the kubernetes client only where it calls the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from components.train.pytorchjob import (
    EFA_RESOURCE, GPU_RESOURCE, INSTANCE_TYPE_LABEL, INSTANCE_TYPES, NodeShape, node_allocatable)

__all__ = ["QUEUE_LABEL", "WORKLOAD", "LOCAL_QUEUE", "CLUSTER_QUEUE", "WorkloadState", "queue_of",
           "workload_state", "flavor_manifests", "cluster_queue_manifest", "local_queue_manifest",
           "cluster_manifests"]

API_GROUP, API_VERSION = "kueue.x-k8s.io", "v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
WORKLOAD = (API_GROUP, API_VERSION, "workloads")
LOCAL_QUEUE = "goodput"             # the LocalQueue deploy/kueue/ makes in each namespace that trains
CLUSTER_QUEUE = "goodput-gpu"
PART_OF = {"app.kubernetes.io/part-of": "goodput-pipelines"}
# What a trainer pod requests (components.train.pytorchjob): every one must be covered, or Kueue admits nothing.
RESOURCES = ("cpu", "memory", GPU_RESOURCE, EFA_RESOURCE)

Call = Callable[..., dict]
NO_WORKLOAD = "Kueue has made no Workload of it yet"
# Kueue makes a job's Workload within seconds; none after this long means Kueue does not manage the job.
NO_WORKLOAD_HINT_S = 60.0


def queue_of(manifest: dict) -> str:
    """The LocalQueue a job is labelled with ("" = not queued by Kueue)."""
    return ((manifest.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL, "")


@dataclass(frozen=True)
class WorkloadState:
    admitted: bool
    reason: str                     # why it waits (Kueue's own words), or where it was admitted
    cluster_queue: str = ""


def workload_state(call: Call, client, ns: str, job_uid: str) -> WorkloadState:
    """What the job's Workload says: admitted (and to which ClusterQueue), or why not yet."""
    from kubernetes import client as k8s

    items = call(k8s.CustomObjectsApi(client).list_namespaced_custom_object, *WORKLOAD[:2], ns, WORKLOAD[2],
                 label_selector=f"{JOB_UID_LABEL}={job_uid}").get("items") or []
    if not items:
        return WorkloadState(False, NO_WORKLOAD)
    wl = max(items, key=lambda w: w["metadata"].get("creationTimestamp") or "")
    status = wl.get("status") or {}
    cq = (status.get("admission") or {}).get("clusterQueue", "")
    conds = {c.get("type"): c for c in status.get("conditions") or []}

    def true(kind: str) -> bool:
        return str((conds.get(kind) or {}).get("status")) == "True"

    def said(c: dict) -> str:
        return ": ".join(x for x in (c.get("reason"), c.get("message")) if x) or c.get("type", "")

    if true("Admitted"):
        return WorkloadState(True, f"admitted to ClusterQueue {cq}" if cq else "admitted", cq)
    if true("Evicted"):
        return WorkloadState(False, f"evicted: {said(conds['Evicted'])}", cq)
    if true("QuotaReserved"):
        return WorkloadState(False, f"quota reserved in ClusterQueue {cq or '?'}; waiting for its admission checks",
                             cq)
    c = conds.get("QuotaReserved") or conds.get("Admitted")
    return WorkloadState(False, said(c) if c else "Workload pending (no conditions yet)", cq)


# deploy/kueue/: made from the instance table -------------------------------------------------------------

def flavor_manifests() -> list[dict]:
    """One ResourceFlavor per instance type of ``INSTANCE_TYPES``, named after it: Kueue puts the type's node
    label into the pods' nodeSelector, so a job lands on the kind of node its quota was counted against."""
    return [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "ResourceFlavor",
             "metadata": {"name": itype, "labels": dict(PART_OF)},
             "spec": {"nodeLabels": {INSTANCE_TYPE_LABEL: itype}}} for itype in INSTANCE_TYPES]


def _quota(shape: NodeShape, nodes: int) -> dict[str, str]:
    """What ``nodes`` nodes of ``shape`` offer to pods (the kubelet's allocatable)."""
    cpu_m, mem_mib = node_allocatable(shape)
    if not nodes:
        return {r: "0" for r in RESOURCES}
    return {"cpu": f"{nodes * cpu_m}m", "memory": f"{nodes * mem_mib}Mi", GPU_RESOURCE: str(nodes * shape.gpus),
            EFA_RESOURCE: str(nodes * shape.efa)}


def cluster_queue_manifest(nodes: dict[str, int], name: str = CLUSTER_QUEUE) -> dict:
    """The ClusterQueue: for each instance type (the table's order), the quota of ``nodes[type]`` nodes (0 for
    a type the cluster has none of). Every namespace's LocalQueue may point at it; no preemption."""
    unknown = sorted(set(nodes) - set(INSTANCE_TYPES))
    if unknown:
        raise ValueError(f"instance types {unknown} are not in the instance table: one of {', '.join(INSTANCE_TYPES)}")
    flavors = [{"name": itype, "resources": [{"name": r, "nominalQuota": q} for r, q in
                                             _quota(shape, int(nodes.get(itype, 0))).items()]}
               for itype, shape in INSTANCE_TYPES.items()]
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "ClusterQueue",
            "metadata": {"name": name, "labels": dict(PART_OF)},
            "spec": {"namespaceSelector": {}, "queueingStrategy": "BestEffortFIFO",
                     "resourceGroups": [{"coveredResources": list(RESOURCES), "flavors": flavors}]}}


def local_queue_manifest(namespace: str, name: str = LOCAL_QUEUE, cluster_queue: str = CLUSTER_QUEUE) -> dict:
    return {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(PART_OF)},
            "spec": {"clusterQueue": cluster_queue}}


def cluster_manifests(nodes: dict[str, int]) -> list[dict]:
    """The cluster-scoped objects of deploy/kueue/cluster-queue.yaml."""
    return [*flavor_manifests(), cluster_queue_manifest(nodes)]


def render(nodes: dict[str, int], namespace: str = "kubeflow") -> str:
    """deploy/kueue/queues/queues.yaml: the flavors, the ClusterQueue for ``nodes`` and the LocalQueue of
    ``namespace`` (standalone KFP's; a Kubeflow profile's is in deploy/profile/profile.yaml)."""
    import yaml

    header = ("# Generated: python -m components.train.kueue " + " ".join(f"{k}={v}" for k, v in nodes.items()) + "\n"
              "# from the instance table (components/train/pytorchjob.py INSTANCE_TYPES) and the GPU node groups of\n"
              "# deploy/cluster.yaml (their maxSize); tests/test_kueue_deploy.py fails when they differ. A flavor's\n"
              "# quota is what its nodes offer to pods (allocatable): regenerate with the nodes your cluster has.\n"
              "#   kubectl apply --server-side -f deploy/kueue/queues/queues.yaml    (after deploy/kueue)\n")
    docs = [*cluster_manifests(nodes), local_queue_manifest(namespace)]
    return header + yaml.safe_dump_all(docs, sort_keys=False)


if __name__ == "__main__":      # python -m components.train.kueue p5.48xlarge=32 p4d.24xlarge=16 > deploy/kueue/...
    import sys

    counts = {k: int(v) for k, _, v in (a.partition("=") for a in sys.argv[1:])}
    sys.stdout.write(render(counts))
