"""KFP component: fetch and tokenize one partition of a planned stage (``components.stage.fanout.stage_partition``)."""

from kfp import dsl

from components.stage.dataset_op import BASE_IMAGE, PACKAGES


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def stage_partition_op(fsx_root: str, name: str, version: str, partition: int, endpoint_url: str = "",
                       max_concurrency: int = 32) -> int:
    """Fetch one partition's objects into the dataset's ``raw/`` and tokenize them on every core of the pod.

    Args:
        fsx_root: the FSx mount path in the pod.
        name: dataset name.
        version: dataset version.
        partition: which partition of the plan (an item of the plan step's output).
        endpoint_url: S3-compatible endpoint URL; empty for AWS.
        max_concurrency: parallel GETs of small objects, and as many again of parts of large objects.

    Returns:
        The number of files this partition tokenized.
    """
    from components.stage.fanout import stage_partition

    return stage_partition(fsx_root, name, version, partition, endpoint_url or None,
                           max_concurrency=max_concurrency).files
