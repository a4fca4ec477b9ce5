"""KFP component: list the source and plan a fan-out stage (``components.stage.fanout.plan_stage``)."""

from kfp import dsl

from components.stage.dataset_op import BASE_IMAGE, PACKAGES


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def stage_plan_op(
    source: str,
    fsx_root: str,
    name: str,
    version: str,
    endpoint_url: str = "",
    stage_parallelism: int = 4,
    tokenizer: str = "bytes",
    data_format: str = "auto",
    text_field: str = "text",
    text_column: str = "text",
    include: str = "",
    exclude: str = "",
    val_percent: int = 5,
    bad_record_policy: str = "skip",
    refused_key_policy: str = "fail",
    max_concurrency: int = 32,
    pack_bytes: int = 256 * 1024 * 1024,
    bpe_sample_bytes: int = 256 * 1024 * 1024,
    partition_min_bytes: int = 1024 * 1024 * 1024,
    train_glob: str = "",
    val_glob: str = "",
    batch_bytes: int = 4 * 1024 * 1024,
    val_tokens: int = 0,
) -> list:
    """Plan the staging of ``source`` into ``<fsx_root>/datasets/<name>/<version>/`` by parallel workers.

    Args:
        source: ``s3://bucket/prefix``, or a directory visible to the pod.
        fsx_root: the FSx mount path in the pod (e.g. ``/fsx``).
        name: dataset name.
        version: dataset version.
        endpoint_url: S3-compatible endpoint URL; empty for AWS (credentials from IRSA).
        stage_parallelism: most worker pods: one per ``partition_min_bytes`` of source, at most one per pack.
        tokenizer: ``bytes``, a tokenizer.json / Hugging Face model directory / ``s3://`` one, or ``bpe:VOCAB``
            (trained here, on the sample files, before the workers start).
        data_format: ``auto`` (by file name), ``text``, ``jsonl`` or ``parquet``.
        text_field: the JSONL field holding a document.
        text_column: the Parquet column holding a document.
        include: comma-separated globs of paths to stage (empty: all).
        exclude: comma-separated globs of paths to leave out.
        val_percent: when the source has no splits of its own, the share of documents in the validation split.
        bad_record_policy: ``skip`` (leave bad records out, report them) or ``fail``.
        refused_key_policy: ``fail``: unsafe keys fail this step before anything is written; ``skip``: they
            are left out and reported.
        max_concurrency: parallel GETs (for the ``bpe:`` sample).
        pack_bytes: source bytes per pack of shards; the unit of work a partition gets.
        bpe_sample_bytes: a ``bpe:`` tokenizer is trained on the training files up to this many source bytes.
        partition_min_bytes: source bytes per worker below which fewer workers are used (the size threshold).
        train_glob: comma-separated globs of the training split's files (overrides the source's own splits).
        val_glob: comma-separated globs of the validation split's files.
        batch_bytes: text a tokenizer process holds at once (a batch, or a long document's piece).
        val_tokens: when the source has no splits of its own, about this many tokens of documents in the validation
            split, in place of ``val_percent`` (0: use ``val_percent``).

    Returns:
        The partition numbers, one per worker (the items of the ParallelFor).
    """
    from components.stage.fanout import plan_stage

    return plan_stage(source, fsx_root, name, version, endpoint_url or None, stage_parallelism=stage_parallelism,
                      tokenizer=tokenizer, data_format=data_format, text_field=text_field, text_column=text_column,
                      include=include, exclude=exclude, val_percent=val_percent, bad_record_policy=bad_record_policy,
                      refused_key_policy=refused_key_policy, max_concurrency=max_concurrency,
                      pack_bytes=pack_bytes, bpe_sample_bytes=bpe_sample_bytes,
                      partition_min_bytes=partition_min_bytes, train_glob=train_glob, val_glob=val_glob,
                      batch_bytes=batch_bytes, val_tokens=val_tokens)
