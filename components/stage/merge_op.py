"""KFP component: write the manifest of a fanned-out stage (``components.stage.fanout.merge_stage``)."""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

from components.stage.dataset_op import BASE_IMAGE, PACKAGES


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def stage_merge_op(fsx_root: str, name: str, version: str, *, dataset: Output[Dataset], metrics: Output[Metrics]):
    """Check every partition finished, then write ``manifest.json`` (atomically, last).

    Args:
        fsx_root: the FSx mount path in the pod.
        name: dataset name.
        version: dataset version.
        dataset: output; its URI is the dataset directory, its metadata the counts (as the stage step's).
        metrics: output; tokens, refused keys and bad records, as the KFP UI shows them.
    """
    from components.stage.dataset import result_metadata
    from components.stage.fanout import merge_stage

    result = merge_stage(fsx_root, name, version)
    dataset.uri = result.dataset_dir
    dataset.metadata.update(result_metadata(result))
    for key in ("train_tokens", "val_tokens", "vocab_size", "excluded", "refused", "bad_records"):
        metrics.log_metric(key, dataset.metadata[key])
