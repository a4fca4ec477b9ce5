"""KFP component: stage an S3 prefix onto FSx and build the dataset (``components.stage.dataset.stage_dataset``)."""

import os

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output

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
    tokenizer: str = "bytes",
    data_format: str = "auto",
    text_field: str = "text",
    text_column: str = "text",
    include: str = "",
    exclude: str = "",
    bad_record_policy: str = "skip",
    refused_key_policy: str = "fail",
    train_glob: str = "",
    val_glob: str = "",
    batch_bytes: int = 4 * 1024 * 1024,
    val_tokens: int = 0,
    *,
    dataset: Output[Dataset],
    metrics: Output[Metrics],
):
    """Stage an S3 prefix (or a directory) onto FSx and build the training dataset there.

    Args:
        source: ``s3://bucket/prefix``, or a directory visible to the pod.
        fsx_root: the FSx mount path in the pod (e.g. ``/fsx``).
        name: dataset name; the dataset lands in ``<fsx_root>/datasets/<name>/<version>/``.
        version: dataset version.
        endpoint_url: S3-compatible endpoint URL; empty for AWS (credentials from IRSA).
        max_concurrency: parallel GETs of small objects, and as many again of parts of large objects.
        val_percent: when the source has no splits of its own, the share of documents in the validation split.
        fsx_dra: the dataset's ``raw/`` is linked to the bucket by an FSx data repository association;
            preload it with ``lfs hsm_restore`` instead of copying.
        tokenizer: ``bytes``, a tokenizer.json / Hugging Face model directory / ``s3://`` one, or ``bpe:VOCAB``.
        data_format: ``auto`` (by file name), ``text``, ``jsonl`` or ``parquet``.
        text_field: the JSONL field holding a document.
        text_column: the Parquet column holding a document.
        include: comma-separated globs of paths to stage (empty: all).
        exclude: comma-separated globs of paths to leave out.
        bad_record_policy: ``skip`` (leave bad records out, report them) or ``fail`` (the step fails).
        refused_key_policy: ``fail``: unsafe keys fail the step before anything is written; ``skip``: they
            are left out and reported, and the step succeeds.
        train_glob: comma-separated globs of the training split's files (overrides the source's own splits).
        val_glob: comma-separated globs of the validation split's files.
        batch_bytes: text a tokenizer process holds at once (a batch, or a long document's piece): the bound on
            the step's memory per core.
        val_tokens: when the source has no splits of its own, about this many tokens of documents in the validation
            split, in place of ``val_percent`` (0: use ``val_percent``).
        dataset: output; its URI is the dataset directory, its metadata the counts.
        metrics: output; tokens, refused keys and bad records, as the KFP UI shows them.
    """
    from components.stage.dataset import result_metadata, stage_dataset

    result = stage_dataset(source, fsx_root, name, version, endpoint_url or None, max_concurrency=max_concurrency,
                           val_percent=val_percent, fsx_dra=fsx_dra, tokenizer=tokenizer, data_format=data_format,
                           text_field=text_field, text_column=text_column, include=include, exclude=exclude,
                           bad_record_policy=bad_record_policy, refused_key_policy=refused_key_policy,
                           train_glob=train_glob, val_glob=val_glob, batch_bytes=batch_bytes, val_tokens=val_tokens)
    dataset.uri = result.dataset_dir
    dataset.metadata.update(result_metadata(result))
    for key in ("train_tokens", "val_tokens", "vocab_size", "transferred", "excluded", "refused", "bad_records"):
        metrics.log_metric(key, dataset.metadata[key])
