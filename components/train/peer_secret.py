"""The per-job peer secret: the key the trainer's ranks authenticate peer messages with (an HMAC), as a
Kubernetes Secret the launcher makes for each job.

The Secret is ``<job name>-peer`` with key ``secret`` (32 random bytes, hex). The launcher creates it before the
job, then makes the job its owner (an ownerReference: the garbage collector deletes it with the job, also when
the job's TTL removes it) and deletes it itself on cancel, timeout and cleanup. The trainer containers read it
as ``GOODPUT_PEER_SECRET`` (env ``valueFrom.secretKeyRef``, set by the job builders); its value is never logged.

This module imports neither torch nor kfp, and the kubernetes client only where it calls the API.
"""

from __future__ import annotations

import secrets
from typing import Callable

__all__ = ["ENV", "KEY", "secret_name", "env_var", "uses_peer_secret", "create", "own", "delete"]

ENV = "GOODPUT_PEER_SECRET"     # the trainer's contract: this variable holds the job's secret
KEY = "secret"

Log = Callable[[str], None]


def secret_name(job_name: str) -> str:
    return f"{job_name}-peer"


def env_var(job_name: str) -> dict:
    """The container env entry that reads the job's secret."""
    return {"name": ENV, "valueFrom": {"secretKeyRef": {"name": secret_name(job_name), "key": KEY}}}


def uses_peer_secret(manifest: dict) -> bool:
    """Whether a container of ``manifest`` reads the job's peer secret (jobs built before it existed do not)."""
    want = secret_name(manifest["metadata"]["name"])

    def walk(node) -> bool:
        if isinstance(node, dict):
            ref = (node.get("valueFrom") or {}).get("secretKeyRef") if node.get("name") == ENV else None
            if isinstance(ref, dict) and ref.get("name") == want:
                return True
            return any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False

    return walk(manifest.get("spec") or {})


def create(core, ns: str, job_name: str, labels: dict, timeout: float) -> bool:
    """Create the job's Secret with a fresh value; False if it exists already (a re-attaching launcher's job
    runs with that one, so it is kept)."""
    from kubernetes import client as k8s
    from kubernetes.client.rest import ApiException

    body = k8s.V1Secret(metadata=k8s.V1ObjectMeta(name=secret_name(job_name), labels=labels or None),
                        type="Opaque", string_data={KEY: secrets.token_hex(32)})
    try:
        core.create_namespaced_secret(ns, body, _request_timeout=timeout, _preload_content=False)
        return True
    except ApiException as e:
        if e.status != 409:
            raise
        return False


def own(core, ns: str, job: dict, timeout: float) -> None:
    """Make ``job`` (as the API returned it: with its uid) the Secret's only owner, so it goes with the job."""
    meta = job["metadata"]
    owner = {"apiVersion": job["apiVersion"], "kind": job["kind"], "name": meta["name"], "uid": meta["uid"]}
    core.patch_namespaced_secret(secret_name(meta["name"]), ns, {"metadata": {"ownerReferences": [owner]}},
                                 _request_timeout=timeout, _preload_content=False)


def delete(core, ns: str, job_name: str, log: Log, timeout: float = 10) -> None:
    """Delete the job's Secret (gone already is fine)."""
    from kubernetes.client.rest import ApiException

    try:
        core.delete_namespaced_secret(secret_name(job_name), ns, _request_timeout=timeout, _preload_content=False)
        log(f"deleted Secret {ns}/{secret_name(job_name)}")
    except ApiException as e:
        if e.status != 404:
            log(f"could not delete Secret {ns}/{secret_name(job_name)}: {e.status} {e.reason}")
