"""The fan-out stage as a sub-pipeline: wiring only. The goodput pipeline calls it as one step.

    plan (list, tokenizer) -> ParallelFor(partitions): stage partition -> merge (manifest, atomically)

Every step mounts the FSx claim and may read the S3 secret; the components are in ``components/stage_*_op.py``
and the logic in ``components.stage.fanout``.
"""

from kfp import dsl
from kfp.dsl import Dataset

from components.stage.merge_op import stage_merge_op
from components.stage.partition_op import stage_partition_op
from components.stage.plan_op import stage_plan_op
from pipelines.pods import on_fsx, placed, with_s3_secret

MAX_PARALLEL_PODS = 64
"""Most partition pods at once (dsl.ParallelFor's parallelism is a compile-time constant)."""


def _pod(task: dsl.PipelineTask, fsx_pvc, s3_secret, node_selector, tolerations) -> dsl.PipelineTask:
    return with_s3_secret(placed(on_fsx(task, fsx_pvc), node_selector, tolerations), s3_secret)


@dsl.pipeline(name="goodput-stage", description="Stage and tokenize a dataset onto FSx with parallel worker pods.")
def stage_pipeline(
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
    pack_bytes: int = 256 * 1024 * 1024,
    bpe_sample_bytes: int = 256 * 1024 * 1024,
    partition_min_bytes: int = 1024 * 1024 * 1024,
    train_glob: str = "",
    val_glob: str = "",
    batch_bytes: int = 4 * 1024 * 1024,
    val_tokens: int = 0,
    fsx_pvc: str = "fsx-claim",
    s3_secret: str = "goodput-s3",
    step_node_selector: dict = {},
    step_tolerations: list = [],
) -> Dataset:
    """Stage ``source`` into ``<fsx_root>/datasets/<name>/<version>/`` with ``stage_parallelism`` worker pods.

    Steps:
      1. plan: list the source once, refuse unsafe keys (``refused_key_policy``), stage the tokenizer
         (train it for ``bpe:``), cut the listing into partitions.
      2. stage partition (one pod per partition, in parallel): fetch its objects, tokenize them on every core.
      3. merge: check every partition finished, write the manifest atomically.

    Args:
        source: ``s3://bucket/prefix`` of the documents, or a directory visible to the pods.
        fsx_root: FSx path in the pods (``/fsx`` on a cluster).
        name: dataset name.
        version: dataset version.
        endpoint_url: S3-compatible endpoint; empty for AWS S3.
        stage_parallelism: most partition pods: one per ``partition_min_bytes`` of source, at most one per pack.
        tokenizer: ``bytes``, a tokenizer.json / model directory / ``s3://`` one, or ``bpe:VOCAB``.
        data_format: ``auto`` (by file name), ``text``, ``jsonl`` or ``parquet``.
        text_field: the JSONL field holding a document.
        text_column: the Parquet column holding a document.
        include: comma-separated globs of paths to stage (empty: all).
        exclude: comma-separated globs of paths to leave out.
        val_percent: when the source has no splits of its own, the share of documents in the validation split.
        bad_record_policy: ``skip`` (leave bad records out, report them) or ``fail``.
        refused_key_policy: ``fail`` (unsafe keys fail the plan step, nothing written) or ``skip``.
        pack_bytes: source bytes per pack of shards (the unit of work of a partition).
        bpe_sample_bytes: a ``bpe:`` tokenizer is trained on the training files up to this many source bytes.
        partition_min_bytes: source bytes per pod below which fewer pods are used (the fan-out's size threshold).
        train_glob: comma-separated globs of the training split's files (overrides the source's own splits).
        val_glob: comma-separated globs of the validation split's files.
        batch_bytes: text a tokenizer process holds at once (a batch, or a long document's piece).
        val_tokens: when the source has no splits of its own, about this many tokens of documents in the validation
            split, in place of ``val_percent`` (0: use ``val_percent``).
        fsx_pvc: the FSx for Lustre PersistentVolumeClaim.
        s3_secret: Kubernetes secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, used if it exists.
        step_node_selector: nodeSelector of the step pods.
        step_tolerations: tolerations of the step pods.
    """
    pod = dict(fsx_pvc=fsx_pvc, s3_secret=s3_secret, node_selector=step_node_selector, tolerations=step_tolerations)
    plan = stage_plan_op(source=source, fsx_root=fsx_root, name=name, version=version, endpoint_url=endpoint_url,
                         stage_parallelism=stage_parallelism, tokenizer=tokenizer, data_format=data_format,
                         text_field=text_field, text_column=text_column, include=include, exclude=exclude,
                         val_percent=val_percent, bad_record_policy=bad_record_policy,
                         refused_key_policy=refused_key_policy, pack_bytes=pack_bytes,
                         bpe_sample_bytes=bpe_sample_bytes, partition_min_bytes=partition_min_bytes,
                         train_glob=train_glob, val_glob=val_glob, batch_bytes=batch_bytes, val_tokens=val_tokens)
    # A refusal under the fail policy recurs on every attempt, so the plan is not retried.
    _pod(plan, **pod).set_display_name("stage: plan").set_caching_options(False)
    with dsl.ParallelFor(plan.output, parallelism=MAX_PARALLEL_PODS, name="stage-partitions") as partition:
        part = stage_partition_op(fsx_root=fsx_root, name=name, version=version, partition=partition,
                                  endpoint_url=endpoint_url)
        # Fetching resumes from the partition's journal, so a retry continues where the attempt stopped.
        _pod(part, **pod).set_display_name("stage: partition").set_caching_options(False)
        part.set_retry(3, backoff_duration="60s").set_cpu_request("8").set_memory_request("16Gi")
    merge = stage_merge_op(fsx_root=fsx_root, name=name, version=version)
    merge.after(part)                              # the partitions' records on FSx are its input
    _pod(merge, **pod).set_display_name("stage: merge").set_caching_options(False).set_retry(2)
    return merge.outputs["dataset"]
