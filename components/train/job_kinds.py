"""What the supervisor (``components.train.supervise``) needs to know of each job kind, and nothing else.

Creating, re-attaching, watching, log streaming, deletion, timeouts and the shared part of a failure's
explanation (pods, events, the log's tail) are one piece of code for every kind; a ``JobKind`` says where the
kind lives in the API, how its status reads as a phase, which pods are its own and which one is the master,
and what it adds to a diagnosis:

- ``PYTORCHJOB``: Training Operator ``kubeflow.org/v1`` pytorchjobs; phase from the conditions, counts from
  ``replicaStatuses``, pods labelled ``training.kubeflow.org/job-name``, the master replica (elastic: worker
  0), container ``pytorch``.
- ``TRAINJOB``: Kubeflow Trainer v2 ``trainer.kubeflow.org/v1alpha1`` trainjobs and the JobSet of the same
  name the Trainer makes of one; phase from the TrainJob's conditions (``Complete``/``Failed``/``Suspended``)
  and its ``jobsStatus``, restarts from the JobSet's ``restarts``, pods labelled
  ``jobset.sigs.k8s.io/jobset-name``, node 0 (``trainjob.MASTER_POD_SELECTOR``), container ``node``; a failure
  is explained by the JobSet's conditions and the node Job's pod failure policy rule (``FAILURE_RULES``).

This module imports neither torch nor kfp, and the kubernetes client only where it calls the API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

__all__ = ["JobKind", "PYTORCHJOB", "TRAINJOB", "KINDS", "BACKENDS", "backend_name", "kind_of", "unreadable"]

# ``call(api_method, *args, **kw)`` -> the decoded JSON body (the supervisor's request wrapper).
Call = Callable[..., dict]


def unreadable(e: BaseException) -> str:
    """Why a read failed, for a report that says what it lacks: an API error's status and reason, any other
    error's type and message."""
    from kubernetes.client.rest import ApiException

    return f"{e.status} {e.reason}" if isinstance(e, ApiException) else f"{type(e).__name__}: {e}"


def _true(job: dict) -> list[dict]:
    return [c for c in (job.get("status") or {}).get("conditions") or [] if str(c.get("status")) == "True"]


def _counts(name: str, status: dict) -> str:
    return f"{name} " + " ".join(f"{k}={v}" for k, v in sorted(status.items())
                                 if k not in ("name", "selector", "labelSelector") and not isinstance(v, (list, dict)))


@dataclass(frozen=True)
class JobKind:
    """A job kind's place in the API and how its objects read; the base is the kind-neutral part."""

    kind: str
    group: str
    version: str
    plural: str
    container: str            # the trainer container, whose log is streamed
    rbac_hint: str

    # The job ---------------------------------------------------------------------------------

    def phase(self, job: dict) -> tuple[str, dict]:
        """(phase, its condition): Succeeded/Failed if set, else the newest true condition."""
        true = _true(job)
        for terminal in ("Failed", "Succeeded"):
            for c in true:
                if c.get("type") == terminal:
                    return terminal, c
        if not true:
            return "Pending", {}
        latest = max(enumerate(true), key=lambda ic: (ic[1].get("lastTransitionTime") or "", ic[0]))[1]
        return latest.get("type", "Unknown"), latest

    def replicas(self, job: dict) -> str:
        """The job's replica counts as one line ("" if none yet)."""
        return ""

    def suspended(self, job: dict) -> bool:
        """Whether the job is suspended (a job queued by Kueue is, until Kueue admits it)."""
        raise NotImplementedError

    # Its pods --------------------------------------------------------------------------------

    def pod_selector(self, name: str) -> str:
        raise NotImplementedError

    def master_selector(self, name: str, manifest: dict) -> tuple[str, str]:
        """(label selector of the pod whose log is streamed, the prefix of its lines)."""
        raise NotImplementedError

    def replica_of(self, pod: dict) -> tuple[str, str]:
        """(replica type, index) of one of the job's pods: what a replacement pod has in common with it."""
        raise NotImplementedError

    def is_master(self, pod: dict) -> bool:
        raise NotImplementedError

    # What else the kind has: read with the pods (at most every pods_every_s), and on failure ---------

    def related(self, call: Call, client, ns: str, name: str) -> dict:
        """Objects the kind's controller made of the job (TrainJob: its JobSet); {} if none."""
        return {}

    def restarts(self, per_replica: dict[tuple[str, str], int], related: dict) -> dict[str, int]:
        """Restarts by replica type, from those seen of each replica's pods (container restarts + replacement
        pods, by (type, index)) and what the kind's controller counted: each replica restarts on its own."""
        out: dict[str, int] = {}
        for (rtype, _), n in per_replica.items():
            out[rtype] = out.get(rtype, 0) + n
        return out

    def explain(self, call: Call, client, ns: str, name: str, related: dict) -> list[str]:
        """Lines of a failure message beyond the job's conditions, the pods, events and the log."""
        return []


@dataclass(frozen=True)
class _PyTorchJob(JobKind):
    job_label: str = "training.kubeflow.org/job-name"
    type_label: str = "training.kubeflow.org/replica-type"
    index_label: str = "training.kubeflow.org/replica-index"

    def replicas(self, job: dict) -> str:
        statuses = (job.get("status") or {}).get("replicaStatuses") or {}
        return ", ".join(_counts(rt, s) for rt, s in sorted(statuses.items()))

    def suspended(self, job: dict) -> bool:
        return ((job.get("spec") or {}).get("runPolicy") or {}).get("suspend") is True

    def pod_selector(self, name: str) -> str:
        return f"{self.job_label}={name}"

    def master_selector(self, name: str, manifest: dict) -> tuple[str, str]:
        spec = manifest.get("spec") or {}
        elastic = "elasticPolicy" in spec and "Master" not in (spec.get("pytorchReplicaSpecs") or {})
        rtype = "worker" if elastic else "master"
        return (f"{self.job_label}={name},{self.type_label}={rtype},{self.index_label}=0", f"[{rtype}-0]")

    def replica_of(self, pod: dict) -> tuple[str, str]:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return labels.get(self.type_label, "?").capitalize(), labels.get(self.index_label, "?")

    def is_master(self, pod: dict) -> bool:
        return ((pod.get("metadata") or {}).get("labels") or {}).get(self.type_label) == "master"


# The JobSet's and the node Job's labels (trainer v2.3.0 / jobset v0.12.0).
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
_RULE_INDEX = re.compile(r"matching (\w+) rule at index (\d+)")


@dataclass(frozen=True)
class _TrainJob(JobKind):
    def phase(self, job: dict) -> tuple[str, dict]:
        true = {c.get("type"): c for c in _true(job)}
        for cond, phase in (("Failed", "Failed"), ("Complete", "Succeeded"), ("Suspended", "Suspended")):
            if cond in true:
                return phase, true[cond]
        jobs = (job.get("status") or {}).get("jobsStatus") or []
        if any((j.get("active") or 0) > 0 or (j.get("ready") or 0) > 0 for j in jobs):
            return "Running", {}
        return ("Created" if jobs or true else "Pending"), {}

    def replicas(self, job: dict) -> str:
        return ", ".join(_counts(j.get("name", "?"), j) for j in (job.get("status") or {}).get("jobsStatus") or [])

    def suspended(self, job: dict) -> bool:
        return (job.get("spec") or {}).get("suspend") is True

    def pod_selector(self, name: str) -> str:
        return f"{JOBSET_NAME_LABEL}={name}"

    def master_selector(self, name: str, manifest: dict) -> tuple[str, str]:
        from components.train.trainjob import MASTER_POD_SELECTOR

        return f"{JOBSET_NAME_LABEL}={name},{MASTER_POD_SELECTOR}", "[node-0]"

    def replica_of(self, pod: dict) -> tuple[str, str]:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        return "Node", labels.get(COMPLETION_INDEX_LABEL, "?")

    def is_master(self, pod: dict) -> bool:
        return self.replica_of(pod)[1] == "0"

    def related(self, call: Call, client, ns: str, name: str) -> dict:
        from kubernetes import client as k8s
        from kubernetes.client.rest import ApiException

        try:
            return {"jobset": call(k8s.CustomObjectsApi(client).get_namespaced_custom_object, *JOBSET[:2], ns,
                                   JOBSET[2], name)}
        except ApiException as e:
            if e.status == 404:          # not made yet (or gone with the TrainJob)
                return {}
            raise

    def restarts(self, per_replica: dict[tuple[str, str], int], related: dict) -> dict[str, int]:
        # A JobSet restart recreates every node's pod at once: one restart, however many pods. The JobSet counts
        # them (also those before a re-attach); the pods tell when its status is not readable.
        status = (related.get("jobset") or {}).get("status") or {}
        seen = max(per_replica.values(), default=0)
        return {"Node": max(seen, int(status.get("restarts") or 0))} if per_replica or status else {}

    def explain(self, call: Call, client, ns: str, name: str, related: dict) -> list[str]:
        from components.train.trainjob import FAILURE_RULES
        from kubernetes import client as k8s

        lines = []
        jobset = related.get("jobset") or {}
        status = jobset.get("status") or {}
        for c in _true(jobset):
            lines.append(f"  JobSet condition {c.get('type')}: {c.get('reason', '')}: {c.get('message', '')}")
        if status.get("restarts"):
            lines.append(f"  JobSet restarts: {status['restarts']} ({status.get('restartsCountTowardsMax', 0)} "
                         "counted against backoff_limit)")
        # The node Job names the pod failure policy rule that failed it; FAILURE_RULES say what that means.
        try:
            jobs = call(k8s.BatchV1Api(client).list_namespaced_job, ns,
                        label_selector=f"{JOBSET_NAME_LABEL}={name}").get("items") or []
        except Exception as e:  # noqa: BLE001 - the diagnosis says what it lacks, and keeps the JobSet's part
            jobs = []
            lines.append(f"  its node Jobs cannot be read ({unreadable(e)}): which pod failure policy rule failed "
                         "them is unknown")
        for job in jobs:
            for c in _true(job):
                if c.get("type") != "Failed":
                    continue
                lines.append(f"  job {job['metadata']['name']} failed: {c.get('reason', '')}: {c.get('message', '')}")
                m = _RULE_INDEX.search(c.get("message") or "")
                if m and int(m.group(2)) < len(FAILURE_RULES):
                    rule = FAILURE_RULES[int(m.group(2))]
                    lines.append(f"  pod failure policy: {rule.name} -> JobSet {rule.action}: {_MEANING[rule.name]}")
        return lines


_MEANING = {
    "NodeGone": "the pod's node went away (spot reclaim, eviction, preemption); restarts do not count",
    "ProgramIsWrong": "the program or its settings are wrong (exit 2: usage, 93: NVRx gave up, 126/127: the image "
                      "cannot run the command); not retried: fix the arguments or the image",
    "NodeIsBad": "the container could not start on its node (exit 128, e.g. a broken GPU or driver); the gang is "
                 "recreated, counted against backoff_limit: cordon the node",
}

PYTORCHJOB = _PyTorchJob(
    kind="PyTorchJob", group="kubeflow.org", version="v1", plural="pytorchjobs", container="pytorch",
    rbac_hint="the launcher's service account may not manage pytorchjobs and their peer secrets or read pods, logs, "
              "events and Kueue workloads here: apply deploy/rbac.yaml (a Role + RoleBinding for the pipeline runner)")
TRAINJOB = _TrainJob(
    kind="TrainJob", group="trainer.kubeflow.org", version="v1alpha1", plural="trainjobs", container="node",
    rbac_hint="the launcher's service account may not manage trainjobs and their peer secrets or read jobsets, jobs, "
              "pods, logs, events and Kueue workloads here: apply deploy/trainer-v2/rbac.yaml (profiles: "
              "rbac-profile.yaml)")
KINDS = {k.kind: k for k in (PYTORCHJOB, TRAINJOB)}


def kind_of(manifest: dict) -> JobKind:
    """The adapter of ``manifest``'s kind; ValueError for a kind the supervisor does not know."""
    kind = manifest.get("kind", "")
    if kind not in KINDS or manifest.get("apiVersion") != f"{KINDS[kind].group}/{KINDS[kind].version}":
        raise ValueError(f"cannot supervise {manifest.get('apiVersion')} {kind or '(no kind)'}: one of "
                         + ", ".join(f"{k.group}/{k.version} {k.kind}" for k in KINDS.values()))
    return KINDS[kind]


# The train step's backends, named for what they launch; ``cluster`` is the PyTorchJob backend's old name.
BACKENDS = {"pytorchjob": PYTORCHJOB, "trainjob": TRAINJOB, "local": None}
_ALIASES = {"cluster": "pytorchjob"}


def backend_name(backend: str) -> str:
    """``backend`` by its current name; ValueError for one that does not exist."""
    name = _ALIASES.get(backend, backend)
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)} (or cluster, the old name of pytorchjob), "
                         f"got {backend!r}")
    return name
