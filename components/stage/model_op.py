"""KFP component: stage the run's ``init_from`` model directory from S3 onto FSx (``components.stage.model``)."""

import os

from kfp import dsl

# The image the component runs in: it has this package (and so kfp) installed. Override both at
# compile time through the environment, as for the other components.
BASE_IMAGE = os.environ.get("GOODPUT_COMPONENT_IMAGE", "ghcr.io/goodput-pipelines/goodput:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def stage_model_op(source: str, dest: str, endpoint_url: str = "") -> int:
    """Copy a Hugging Face model directory from S3 to FSx, atomically; nothing to do when ``source`` is empty.

    Args:
        source: ``s3://bucket/prefix`` of the model directory (the check-settings step's ``init_from_source``:
            the ``init_from`` parameter, or the registry's production model on S3); empty: none.
        dest: its directory on FSx, which the trainer's ``--init-from`` names (``init_from_dir``).
        endpoint_url: S3-compatible endpoint; empty for AWS S3 (IRSA credentials).

    Returns:
        the number of files copied (0 when ``dest`` was up to date).
    """
    from components.stage.model import stage_model

    return stage_model(source, dest, endpoint_url or None)["transferred"]
