"""Delete what a pipeline run leaves running: the pipeline's exit handler.

The train launcher deletes its PyTorchJob when it is cancelled or times out, but a launcher pod that
is killed outright (node loss, OOM, a force-deleted pod) cannot, and the job keeps its GPUs. The exit
handler runs after the run, whatever its outcome, and deletes every PyTorchJob labelled with the run's
id (``goodput.dev/kfp-run-id``, set by ``components.pytorchjob``) that has not finished. Finished
jobs are left for their TTL, so their status stays readable.

    python -c "from components.cleanup import cleanup_run_jobs; cleanup_run_jobs('<kfp run id>', 'team-a')"

The KFP component is ``components.cleanup_op.cleanup_op``; this module imports neither kfp, torch
nor (at import time) the kubernetes client.
"""


from typing import Callable


def _finished(job: dict) -> bool:
    conds = (job.get("status") or {}).get("conditions") or []
    return any(c.get("type") in ("Succeeded", "Failed") and c.get("status") == "True" for c in conds)


def cleanup_run_jobs(run_id: str, namespace: str = "", *, client=None, wait_s: float = 20.0,
                     log: Callable[[str], None] = print) -> list[str]:
    """Delete the unfinished PyTorchJobs of KFP run ``run_id``; return the names of those deleted.

    Args:
        run_id: the KFP run id the train launcher labelled its job with.
        namespace: where the jobs are; empty = this pod's namespace (or kubectl's current one).
        client: a ``kubernetes.client.ApiClient``; None = in-cluster config, else ~/.kube/config.
        wait_s: how long each deletion waits for the job to be gone.
        log: where progress lines go.

    Raises:
        RuntimeError: a job could not be deleted (its GPUs may still be held).
        kubernetes.client.rest.ApiException: the jobs could not be listed (RBAC: deploy/rbac.yaml).
    """
    from kubernetes import client as k8s

    from components.pytorchjob import RUN_ID_LABEL, label_value
    from components.supervise import GROUP, PLURAL, VERSION, api_client, current_namespace, delete_job

    if not run_id:
        raise ValueError("cleanup needs the KFP run id")
    ns = namespace or current_namespace()
    client = client or api_client()
    label = label_value(run_id)

    def ours() -> list[dict]:
        listed = k8s.CustomObjectsApi(client).list_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, label_selector=f"{RUN_ID_LABEL}={label}", _request_timeout=30)
        # The selector filters on a real API server; checking the label again costs nothing.
        return [j for j in listed.get("items", []) if (j["metadata"].get("labels") or {}).get(RUN_ID_LABEL) == label]

    jobs = ours()
    left = [j["metadata"]["name"] for j in jobs if not _finished(j)]
    if not left:
        log(f"no unfinished PyTorchJob of run {run_id} in {ns} ({len(jobs)} finished)")
        return []
    for name in left:
        delete_job(name, ns, client, wait_s=wait_s, log=log)
    # Foreground deletion may outlast wait_s (pods get their grace period); a job that is still there
    # but carries a deletionTimestamp is on its way out. One without it was not deleted.
    stuck = [j["metadata"]["name"] for j in ours()
             if j["metadata"]["name"] in left and not j["metadata"].get("deletionTimestamp")]
    if stuck:
        raise RuntimeError(f"PyTorchJob(s) {', '.join(stuck)} in {ns} could not be deleted; delete them by hand "
                           f"(kubectl delete pytorchjob -n {ns} {' '.join(stuck)}) or their GPUs stay allocated")
    return left
