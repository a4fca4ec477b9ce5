"""Delete what a pipeline run leaves running: the pipeline's exit handler.

The train launcher deletes its job when it is cancelled or times out, but a launcher pod that is killed
outright (node loss, OOM, a force-deleted pod) cannot, and the job keeps its GPUs. The exit handler runs
after the run, whatever its outcome, and deletes every PyTorchJob and TrainJob labelled with the run's id
(``goodput.dev/kfp-run-id``, set by ``components.train.pytorchjob`` and ``components.train.trainjob``) that has not
finished. Finished jobs are left for their TTL, so their status stays readable. A kind whose CRD is not
installed, or that the step may not list (only the other backend's Role is bound), is skipped unless the run's
backend launches it.

    python -c "from components.train.cleanup import cleanup_run_jobs; cleanup_run_jobs('<kfp run id>', 'team-a')"

The KFP component is ``components.train.cleanup_op.cleanup_op``; this module imports neither kfp, torch
nor (at import time) the kubernetes client.
"""

from typing import Callable, Iterable

from components.train.job_kinds import KINDS, JobKind


def _finished(kind: JobKind, job: dict) -> bool:
    return kind.phase(job)[0] in ("Succeeded", "Failed")


def cleanup_run_jobs(run_id: str, namespace: str = "", *, client=None, kinds: Iterable[JobKind] | None = None,
                     required: Iterable[JobKind] = (), wait_s: float = 20.0,
                     log: Callable[[str], None] = print) -> list[str]:
    """Delete the unfinished jobs of KFP run ``run_id``; return the names of those deleted.

    Args:
        run_id: the KFP run id the train launcher labelled its job with.
        namespace: where the jobs are; empty = this pod's namespace (or kubectl's current one).
        client: a ``kubernetes.client.ApiClient``; None = in-cluster config, else ~/.kube/config.
        kinds: the job kinds to look at (``components.train.job_kinds``); None = PyTorchJob and TrainJob.
        required: kinds that must be listable (the run's backend): for these a missing CRD or RBAC is an
            error; the others are skipped with a line in the log.
        wait_s: how long each deletion waits for the job to be gone.
        log: where progress lines go.

    Raises:
        RuntimeError: a job could not be deleted (its GPUs may still be held).
        kubernetes.client.rest.ApiException: the jobs of a required kind could not be listed (RBAC:
            deploy/rbac.yaml, deploy/trainer-v2/rbac.yaml).
    """
    from kubernetes import client as k8s
    from kubernetes.client.rest import ApiException

    from components.train.pytorchjob import RUN_ID_LABEL, label_value
    from components.train.supervise import api_client, current_namespace, delete_job

    if not run_id:
        raise ValueError("cleanup needs the KFP run id")
    ns = namespace or current_namespace()
    client = client or api_client()
    label = label_value(run_id)
    required = list(required)

    def ours(kind: JobKind) -> list[dict]:
        listed = k8s.CustomObjectsApi(client).list_namespaced_custom_object(
            kind.group, kind.version, ns, kind.plural, label_selector=f"{RUN_ID_LABEL}={label}", _request_timeout=30)
        # The selector filters on a real API server; checking the label again costs nothing.
        return [j for j in listed.get("items", []) if (j["metadata"].get("labels") or {}).get(RUN_ID_LABEL) == label]

    deleted: list[str] = []
    for kind in (list(KINDS.values()) if kinds is None else list(kinds)):
        try:
            jobs = ours(kind)
        except ApiException as e:
            if e.status not in (403, 404) or kind in required:
                raise
            why = "not installed" if e.status == 404 else "not listable by this step (403)"
            log(f"{kind.plural} {why} in {ns}: none of them to clean up")
            continue
        left = [j["metadata"]["name"] for j in jobs if not _finished(kind, j)]
        if not left:
            log(f"no unfinished {kind.kind} of run {run_id} in {ns} ({len(jobs)} finished)")
            continue
        for name in left:
            delete_job(name, ns, client, kind=kind, wait_s=wait_s, log=log)
        # Foreground deletion may outlast wait_s (pods get their grace period); a job that is still there
        # but carries a deletionTimestamp is on its way out. One without it was not deleted.
        stuck = [j["metadata"]["name"] for j in ours(kind)
                 if j["metadata"]["name"] in left and not j["metadata"].get("deletionTimestamp")]
        if stuck:
            raise RuntimeError(f"{kind.kind}(s) {', '.join(stuck)} in {ns} could not be deleted; delete them by hand "
                               f"(kubectl delete {kind.kind.lower()} -n {ns} {' '.join(stuck)}) or their GPUs stay "
                               "allocated")
        deleted += left
    return deleted
