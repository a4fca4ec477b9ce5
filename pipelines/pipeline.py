"""The goodput training pipeline: wiring only. Compile it with ``goodput compile -o goodput-pipeline.yaml``.

Each step is a component (``components/``); this module only connects them and says what their pods
get from Kubernetes (kfp-kubernetes): the FSx claim, placement, the S3 secret, retries and caching.
"""

from kfp import dsl

from components.cleanup_op import cleanup_op
from components.evaluate_op import evaluate_op
from components.register_op import register_op
from components.train import TRAINER_IMAGE, train_op
from components.train_config_op import train_config_op
from pipelines.compile import PIPELINE_NAME
from pipelines.pods import FSX_MOUNT, on_fsx, placed, with_s3_secret
from pipelines.stage_pipeline import stage_pipeline

UNIFORM_LOSS = 5.545177444479562       # ln 256: nats per byte of a uniform guess


@dsl.pipeline(name=PIPELINE_NAME, description="Stage a dataset to FSx, train under NVRx in a PyTorchJob or TrainJob, "
                                              "evaluate the checkpoints and register the model if it is promoted.")
def goodput_pipeline(
    dataset_source: str,
    dataset_name: str = "corpus",
    dataset_version: str = "latest",
    s3_endpoint_url: str = "",
    s3_secret: str = "goodput-s3",
    tokenizer: str = "bytes",
    data_format: str = "auto",
    text_field: str = "text",
    text_column: str = "text",
    dataset_include: str = "",
    dataset_exclude: str = "",
    bad_record_policy: str = "skip",
    refused_key_policy: str = "fail",
    stage_parallelism: int = 4,
    n_layer: int = 12,
    n_head: int = 12,
    n_embd: int = 768,
    seq_len: int = 1024,
    batch_size: int = 8,
    max_steps: int = 5000,
    ckpt_every: int = 250,
    seed: int = 1337,
    parallel: str = "fsdp",
    nodes: int = 2,
    gpus_per_node: int = -1,
    instance_type: str = "p5.48xlarge",
    spot: bool = False,
    gpu_resource: str = "nvidia.com/gpu",
    efa_per_node: int = -1,
    cpu: str = "",
    memory: str = "",
    shm_size: str = "",
    node_group: str = "",
    scheduler: str = "",
    queue: str = "",
    max_restarts: int = 3,
    backoff_limit: int = 3,
    train_timeout_s: float = 3 * 86400.0,
    inject_fault: str = "",
    promotion_threshold: float = UNIFORM_LOSS,
    promotion_tolerance: float = 0.0,
    baseline: str = "",
    require_beat_baseline: bool = False,
    model_name: str = "bytegpt",
    registry: str = FSX_MOUNT + "/models",
    trainer_image: str = TRAINER_IMAGE,
    trainer_service_account: str = "",
    namespace: str = "",
    fsx_pvc: str = "fsx-claim",
    fsx_root: str = FSX_MOUNT,
    step_node_selector: dict = {},
    step_tolerations: list = [],
    backend: str = "pytorchjob",
    local_nproc: int = 2,
):
    """Train a byte-level GPT on EKS where a GPU failure costs seconds.

    Steps (all inside an exit handler):
      1. check settings: the trainer's arguments and the job are validated before anything runs.
      2. stage: ``dataset_source`` (s3://bucket/prefix or a directory) -> <fsx>/datasets/<name>/<version>,
         tokenized by ``tokenizer`` in up to ``stage_parallelism`` pods (plan, partitions, merge).
      3. train: a PyTorchJob (backend=pytorchjob) or a Trainer v2 TrainJob (backend=trainjob) of ``nodes`` x
         ``gpus_per_node`` under NVRx ft_launcher, or ft_launcher processes in the step itself (backend=local);
         writes <fsx>/runs/<run id>.
      4. evaluate: every committed checkpoint on the validation split, report, promotion gate; a promoted
         model is written to ``registry``.
      5. register (only if promoted): the registered model becomes the run's Model artifact.
      Exit handler, whatever happened: delete a PyTorchJob or TrainJob the run left running.

    Args:
        dataset_source: s3://bucket/prefix of the text files, or a directory visible to the stage pod.
        dataset_name: dataset name on FSx.
        dataset_version: dataset version on FSx (a directory name; "latest" by default).
        s3_endpoint_url: S3-compatible endpoint (MinIO, ...); empty for AWS S3.
        s3_secret: Kubernetes secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, used if it exists.
        tokenizer: bytes (one token per byte), a tokenizer.json / Hugging Face model directory / s3:// one,
            or bpe:VOCAB (a byte-level BPE trained on the staged text).
        data_format: auto (by file name), text, jsonl (.jsonl, .gz, .zst) or parquet.
        text_field: the JSONL field holding a document.
        text_column: the Parquet column holding a document.
        dataset_include: comma-separated globs of source paths to stage (empty: all).
        dataset_exclude: comma-separated globs of source paths to leave out.
        bad_record_policy: skip (leave bad records out and report them) or fail.
        refused_key_policy: fail (unsafe object keys stop the run before anything is written) or skip.
        stage_parallelism: most stage worker pods (one per GiB of source, at most this many).
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: model width.
        seq_len: context length in bytes.
        batch_size: sequences per micro-batch per GPU.
        max_steps: optimizer steps.
        ckpt_every: checkpoint interval in steps.
        seed: random seed.
        parallel: fsdp or ddp.
        nodes: nodes in the job.
        gpus_per_node: GPUs (trainer processes) per node; -1 = every GPU of instance_type.
        instance_type: EC2 instance type of the trainer nodes (p5.48xlarge, p5e/p5en.48xlarge, p4d/p4de.24xlarge,
            g5/g6/g6e.*): sizes GPUs, EFA, CPU, memory and /dev/shm to it; empty = any node (set the sizes).
        spot: let the trainer pods run on spot nodes.
        gpu_resource: nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-3g.40gb for small jobs.
        efa_per_node: EFA interfaces per pod; -1 = the instance type's.
        cpu: CPU request per trainer pod; empty = the node's allocatable less the DaemonSets.
        memory: memory per trainer pod; empty = as for cpu.
        shm_size: /dev/shm per trainer pod; empty = a quarter of the memory.
        node_group: EKS node group of the trainer pods (eks.amazonaws.com/nodegroup); empty = any.
        scheduler: gang scheduler of the trainer pods: empty, volcano, scheduler-plugins or yunikorn.
        queue: the gang's queue: a Volcano queue, or a YuniKorn queue root.<name>.
        max_restarts: in-job restarts of the worker group by ft_launcher.
        backoff_limit: job restarts before it fails (PyTorchJob pod restarts; a TrainJob's must be its runtime's).
        train_timeout_s: deadline of the train step in seconds.
        inject_fault: KIND@STEP[:RANK] faults for the trainer, comma-separated (recovery drills).
        promotion_threshold: promote only below this validation loss (nats per byte).
        promotion_tolerance: and at most this much worse than the production model.
        baseline: a Hugging Face model directory on FSx (e.g. the model the run started from) scored on the
            same validation windows; empty = none.
        require_beat_baseline: promote only a model strictly better than ``baseline``.
        model_name: the model's name in the registry.
        registry: model registry, a directory on FSx or s3://bucket/prefix.
        trainer_image: image of the trainer pods.
        trainer_service_account: service account of the trainer pods; empty = the namespace default.
        namespace: namespace of the job; empty = the pipeline's.
        fsx_pvc: the FSx for Lustre PersistentVolumeClaim.
        fsx_root: FSx path in the pods; keep /fsx on a cluster (the claim is mounted there).
        step_node_selector: nodeSelector of the step pods, e.g. {"karpenter.sh/capacity-type": "on-demand"}.
        step_tolerations: tolerations of the step pods (a list of Kubernetes toleration objects).
        backend: pytorchjob (a Training Operator PyTorchJob; "cluster" is its old name), trainjob (a Kubeflow
            Trainer v2 TrainJob on the goodput-nvrx runtime: deploy/trainer-v2) or local (goodput run --local).
        local_nproc: ranks of the local backend.
    """
    cleanup = cleanup_op(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, backend=backend, namespace=namespace)
    placed(cleanup, step_node_selector, step_tolerations)
    cleanup.set_display_name("cleanup").set_caching_options(False).set_retry(2, backoff_duration="30s")

    with dsl.ExitHandler(cleanup, name="goodput-run"):
        config = train_config_op(
            fsx_root=fsx_root, dataset_name=dataset_name, dataset_version=dataset_version,
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, max_steps=max_steps, ckpt_every=ckpt_every, n_layer=n_layer,
            n_head=n_head, n_embd=n_embd, seq_len=seq_len, batch_size=batch_size, parallel=parallel, seed=seed,
            inject_fault=inject_fault, max_restarts=max_restarts, backoff_limit=backoff_limit,
            instance_type=instance_type, fsx_pvc=fsx_pvc, service_account=trainer_service_account,
            backend=backend, image=trainer_image, nodes=nodes, gpus_per_node=gpus_per_node, spot=spot,
            gpu_resource=gpu_resource, efa_per_node=efa_per_node, cpu=cpu, memory=memory, shm_size=shm_size,
            node_group=node_group, scheduler=scheduler, queue=queue)
        placed(config, step_node_selector, step_tolerations)
        config.set_display_name("check settings").set_caching_options(False)

        # Staging is never taken from KFP's cache: an unchanged source is only listed and compared (cheap),
        # and a changed one is restaged whatever the version says.
        stage = stage_pipeline(
            source=dataset_source, fsx_root=fsx_root, name=dataset_name, version=dataset_version,
            endpoint_url=s3_endpoint_url, stage_parallelism=stage_parallelism, tokenizer=tokenizer,
            data_format=data_format, text_field=text_field, text_column=text_column, include=dataset_include,
            exclude=dataset_exclude, bad_record_policy=bad_record_policy, refused_key_policy=refused_key_policy,
            fsx_pvc=fsx_pvc, s3_secret=s3_secret, step_node_selector=step_node_selector,
            step_tolerations=step_tolerations)
        stage.set_display_name("stage").set_caching_options(False)
        stage.after(config)                           # no data flows: a bad setting stops the run before staging

        train = train_op(backend=backend, trainer_args=config.outputs["trainer_args"],
                         job_options=config.outputs["job_options"], image=trainer_image, nodes=nodes,
                         gpus_per_node=gpus_per_node, spot=spot, namespace=namespace, timeout_s=train_timeout_s,
                         fsx_root=fsx_root, local_nproc=local_nproc)
        # The dataset reaches the trainer through FSx at the path in trainer_args (--data), not as a KFP
        # artifact, so the edge to the stage is an explicit one.
        train.after(stage)
        # Placement set on this task would go to the job's pods (train_op's task_config passthroughs),
        # which job_options place already; so none here. The FSx mount is passed through to the job's
        # pods and kept on the launcher's pod, which reads the run's summary.json from FSx.
        on_fsx(train, fsx_pvc)
        # A retried train step re-attaches to its job (named from the run) and the trainer resumes
        # from the last committed checkpoint: retries never duplicate a job.
        train.set_display_name("train").set_caching_options(False).set_retry(2, backoff_duration="120s")

        evaluate = evaluate_op(run_dir=config.outputs["run_dir"], threshold=promotion_threshold,
                               tolerance=promotion_tolerance, model_name=model_name, registry=registry,
                               baseline=baseline, require_beat_baseline=require_beat_baseline,
                               endpoint_url=s3_endpoint_url)
        evaluate.after(train)                         # reads the run directory on FSx that train wrote
        with_s3_secret(placed(on_fsx(evaluate, fsx_pvc), step_node_selector, step_tolerations), s3_secret)
        evaluate.set_display_name("evaluate").set_caching_options(False).set_retry(2, backoff_duration="60s")
        evaluate.set_cpu_request("4").set_memory_request("16Gi")

        with dsl.If(evaluate.outputs["promoted"] == True, name="promoted"):  # noqa: E712 - a pipeline condition
            register = register_op(model_uri=evaluate.outputs["model_uri"], registry=registry,
                                   model_name=model_name, endpoint_url=s3_endpoint_url)
            with_s3_secret(placed(on_fsx(register, fsx_pvc), step_node_selector, step_tolerations), s3_secret)
            register.set_display_name("register").set_caching_options(False).set_retry(2, backoff_duration="30s")
