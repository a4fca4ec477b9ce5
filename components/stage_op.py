"""KFP component: stage an S3 prefix onto FSx and build the dataset (``components.stage.stage_dataset``)."""

import os

from kfp import dsl
from kfp.dsl import Dataset, Output

# The image the component runs in: it has this package (and so kfp) installed. Override both at
# compile time through the environment, e.g. a python base image plus a wheel in PACKAGES.
BASE_IMAGE = os.environ.get("GOODPUT_COMPONENT_IMAGE", "ghcr.io/goodput-pipelines/goodput:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def stage_op(
    source: str,
    fsx_root: str,
    name: str,
    version: str,
    endpoint_url: str = "",
    max_concurrency: int = 32,
    val_percent: int = 5,
    fsx_dra: bool = False,
    allow_refused: bool = False,
    *,
    dataset: Output[Dataset],
):
    """Stage an S3 prefix (or a directory) onto FSx and build the training dataset there.

    Args:
        source: ``s3://bucket/prefix``, or a directory visible to the pod.
        fsx_root: the FSx mount path in the pod (e.g. ``/fsx``).
        name: dataset name; the dataset lands in ``<fsx_root>/datasets/<name>/<version>/``.
        version: dataset version.
        endpoint_url: S3-compatible endpoint URL; empty for AWS (credentials from IRSA).
        max_concurrency: parallel GETs of small objects, and as many again of parts of large objects.
        val_percent: share of files in the validation split.
        fsx_dra: the dataset's ``raw/`` is linked to the bucket by an FSx data repository association;
            preload it with ``lfs hsm_restore`` instead of copying.
        allow_refused: succeed even when unsafe keys were refused (they are reported in the metadata).
        dataset: output; its URI is the dataset directory, its metadata the counts.
    """
    from components.stage import stage_dataset

    result = stage_dataset(source, fsx_root, name, version, endpoint_url or None,
                           max_concurrency=max_concurrency, val_percent=val_percent, fsx_dra=fsx_dra)
    dataset.uri = result.dataset_dir
    dataset.metadata.update({k: v for k, v in result.to_dict().items() if k not in ("refused", "failed")})
    dataset.metadata["refused"] = len(result.refused)
    dataset.metadata["refused_keys"] = [r["key"] for r in result.refused[:100]]
    if result.refused and not allow_refused:
        raise RuntimeError(f"{len(result.refused)} keys were refused (unsafe paths), e.g. "
                           f"{result.refused[0]['key']!r}: {result.refused[0]['reason']}")
