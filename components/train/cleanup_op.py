"""KFP component: the exit handler that deletes the jobs a run left running (``components.train.cleanup``)."""

import os

from kfp import dsl

# The image the component runs in: it has this package (and so kfp) installed. Override both at
# compile time through the environment, as for the other components.
BASE_IMAGE = os.environ.get("GOODPUT_COMPONENT_IMAGE", "ghcr.io/goodput-pipelines/goodput:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def cleanup_op(run_id: str, backend: str = "pytorchjob", namespace: str = ""):
    """Exit handler: delete the PyTorchJobs and TrainJobs this run left unfinished.

    Args:
        run_id: the KFP run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), the label the launcher put on its job.
        backend: ``pytorchjob`` (or ``cluster``) and ``trainjob`` delete leftover jobs of both kinds (the
            backend's kind must be listable); ``local`` has none (the trainer ran inside the train task).
        namespace: namespace of the jobs; empty = this pod's own.
    """
    from components.train.job_kinds import BACKENDS, backend_name

    kind = BACKENDS[backend_name(backend)]
    if kind is None:
        print(f"backend {backend!r}: no job to clean up")
        return
    from components.train.cleanup import cleanup_run_jobs

    cleanup_run_jobs(run_id, namespace, required=[kind])
