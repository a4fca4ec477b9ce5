"""KFP component: the exit handler that deletes PyTorchJobs a run left running (``components.cleanup``)."""

import os

from kfp import dsl

# The image the component runs in: it has this package (and so kfp) installed. Override both at
# compile time through the environment, as for the other components.
BASE_IMAGE = os.environ.get("GOODPUT_COMPONENT_IMAGE", "ghcr.io/goodput-pipelines/goodput:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def cleanup_op(run_id: str, backend: str = "cluster", namespace: str = ""):
    """Exit handler: delete the PyTorchJobs this run left unfinished.

    Args:
        run_id: the KFP run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``), the label the launcher put on its job.
        backend: ``cluster`` deletes leftover jobs; ``local`` has none (the trainer ran inside the train task).
        namespace: namespace of the jobs; empty = this pod's own.
    """
    if backend != "cluster":
        print(f"backend {backend!r}: no PyTorchJob to clean up")
        return
    from components.cleanup import cleanup_run_jobs

    cleanup_run_jobs(run_id, namespace)
