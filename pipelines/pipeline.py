"""The goodput training pipeline: wiring only. Compile it with ``goodput compile -o goodput-pipeline.yaml``.

Each step is a component (``components/``); this module only connects them and says what their pods
get from Kubernetes (kfp-kubernetes): the FSx claim, placement, the S3 secret, retries and caching.

The train backend is chosen when the pipeline is compiled, so the KFP Create-run form shows only what a
cluster user sets: ``build_pipeline("pytorchjob")`` (``goodput_pipeline``, the default of ``goodput compile``)
and ``build_pipeline("trainjob")`` take the parameters of ``pipeline_parameters``; ``build_pipeline("local")``
(``goodput run --local``) adds ``local_nproc``. The wiring is one function, ``_wire``, for all three.
"""

import inspect

from kfp import dsl

from components.cleanup_op import cleanup_op
from components.evaluate_op import evaluate_op
from components.job_kinds import BACKENDS, backend_name
from components.register_op import register_op
from components.stage_model_op import stage_model_op
from components.train import TRAINER_IMAGE, train_op
from components.train_config_op import train_config_op
from pipelines import PIPELINE_NAME
from pipelines.pods import FSX_MOUNT, on_fsx, placed, with_mlflow_secret, with_s3_secret
from pipelines.stage_pipeline import stage_pipeline

UNIFORM_LOSS = 5.545177444479562       # ln 256: nats per byte of a uniform guess
DESCRIPTION = ("Stage a dataset to FSx, train under NVRx in a {kind}, evaluate the checkpoints and register the "
               "model if it is promoted.")
KINDS = {"pytorchjob": "PyTorchJob", "trainjob": "Kubeflow Trainer v2 TrainJob",
         "local": "local ft_launcher process tree (goodput run --local)"}


# The Create-run form of the cluster pipelines: names, types, defaults, and (the docstring's Args) descriptions.
# Never called; its docstring is the template of every variant's ({train}: what that backend's train step runs).
def pipeline_parameters(
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
    dataset_train_glob: str = "",
    dataset_val_glob: str = "",
    dataset_val_tokens: int = 0,
    bad_record_policy: str = "skip",
    refused_key_policy: str = "fail",
    stage_parallelism: int = 4,
    model: str = "llama",
    model_flavor: str = "llama3-1b",
    model_config: str = "",
    init_from: str = "",
    seq_len: int = 1024,
    batch_size: int = 8,
    max_steps: int = 5000,
    ckpt_every: str = "250",
    ckpt_mirror: str = "",
    require_mirror: bool = False,
    seed: int = 1337,
    parallel: str = "fsdp",
    dp_replicate: int = 0,
    dp_shard: int = 0,
    tp: int = 1,
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
    admission_timeout_s: float = 86400.0,
    inject_fault: str = "",
    promotion_threshold: float = UNIFORM_LOSS,
    promotion_tolerance: float = 0.0,
    baseline: str = "",
    require_beat_baseline: bool = False,
    evaluate_gpu_resource: str = "",
    model_name: str = "",
    registry: str = FSX_MOUNT + "/models",
    mlflow_secret: str = "goodput-mlflow",
    eval_tasks: str = "",
    eval_limit: int = 0,
    promote_on: str = "val_loss",
    trainer_image: str = TRAINER_IMAGE,
    nvrx_release: str = "",
    hot_spares: int = 0,
    node_health_check_endpoint: str = "",
    trainer_service_account: str = "",
    namespace: str = "",
    fsx_pvc: str = "fsx-claim",
    fsx_root: str = FSX_MOUNT,
    step_node_selector: dict = {},
    step_tolerations: list = [],
    trainer_config: dict = {},
):
    """Train a model (llama, bytegpt or your own) on EKS where a GPU failure costs seconds.

    Steps (all inside an exit handler):
      1. check settings: the model (built on the meta device), the trainer's arguments, init_from and the
         job are validated before anything runs; init_from=production is resolved to the registry's model.
      2. stage: ``dataset_source`` (s3://bucket/prefix or a directory) -> <fsx>/datasets/<name>/<version>,
         tokenized by ``tokenizer`` in up to ``stage_parallelism`` pods (plan, partitions, merge); beside it,
         stage init_from: an S3 model directory is copied to <fsx>/pretrained/<bucket>/<prefix> (atomically).
      3. train: {train}; writes <fsx>/runs/<run id>.
      4. evaluate: every committed checkpoint on the validation split (and on ``eval_tasks``), report, promotion
         gate; a promoted model is written to ``registry`` as a Hugging Face directory (model.pt for a model
         without one), or registered in MLflow.
      5. register (only if promoted): the registered model becomes the run's Model artifact.
      Exit handler, whatever happened: delete a job the run left running.

    Args:
        dataset_source: s3://bucket/prefix of the text files, or a directory visible to the stage pod.
        dataset_name: dataset name on FSx.
        dataset_version: dataset version on FSx (a directory name; "latest" by default).
        s3_endpoint_url: S3-compatible endpoint (MinIO, ...); empty for AWS S3.
        s3_secret: Kubernetes secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, used if it exists.
        tokenizer: bytes (one token per byte), a tokenizer.json / Hugging Face model directory / s3:// one,
            or bpe:VOCAB (a byte-level BPE trained on the staged text); its vocabulary must fit the model's.
        data_format: auto (by file name), text, jsonl (.jsonl, .gz, .zst) or parquet.
        text_field: the JSONL field holding a document.
        text_column: the Parquet column holding a document.
        dataset_include: comma-separated globs of source paths to stage (empty: all).
        dataset_exclude: comma-separated globs of source paths to leave out.
        dataset_train_glob: comma-separated globs of the training split's files; they override the splits
            the source names (Hugging Face layouts) and the split by document.
        dataset_val_glob: comma-separated globs of the validation split's files.
        dataset_val_tokens: when the source has no splits of its own, about this many tokens of documents in the
            validation split (0: 5% of the documents).
        bad_record_policy: skip (leave bad records out and report them) or fail.
        refused_key_policy: fail (unsafe object keys stop the run before anything is written) or skip.
        stage_parallelism: most stage worker pods (one per GiB of source, at most this many).
        model: the model: llama, bytegpt (the byte-level demo GPT), or package.module:function naming your
            own model factory, installed in the trainer image (docs/models.md).
        model_flavor: a named size: llama debug, llama3-1b, llama3-3b, llama3-8b or llama3-70b; empty = the
            model's default; ignored with init_from (the directory's config.json is the architecture).
        model_config: inline JSON of model fields overriding the flavor's, e.g. {{"n_layers": 8}} (llama) or
            {{"n_layer": 12, "n_head": 12, "n_embd": 768}} (bytegpt); empty = none.
        init_from: weights a fresh run starts from (a run with a committed checkpoint resumes from that): a
            Hugging Face model directory on FSx, s3://bucket/prefix of one (staged to FSx first), or
            production (the registry's production model: a scheduled retrain continues from the last promoted
            one; the run fails at check settings if there is none yet); empty = random initialisation.
        seq_len: context length in tokens.
        batch_size: sequences per micro-batch per GPU.
        max_steps: optimizer steps.
        ckpt_every: checkpoint interval in steps, or auto: the Young-Daly interval from the measured checkpoint cost
            and the failures seen (set checkpoint.mtbf_s in trainer_config to give the expected time between them).
        ckpt_mirror: s3://bucket/prefix the trainer copies every committed checkpoint to in the background (through
            s3_endpoint_url when set), and resumes from when FSx has none; the trainer pods' service account needs
            write access to it; empty = no mirror.
        require_mirror: any failure of the mirror (its client, an upload, retention, no mirrored checkpoint
            downloadable) fails the train step; without it a failure is a warning in the step's log.
        seed: random seed.
        parallel: fsdp or ddp.
        dp_replicate: replicas of the model (HSDP); 0 = auto: the nodes, when a node has more than one
            data-parallel rank, else 1.
        dp_shard: ranks sharding the parameters within a replica; 0 = auto: the rest.
        tp: tensor-parallel ranks splitting each layer inside a node (llama; 1 = none); dp_replicate x
            dp_shard x tp must be nodes x gpus_per_node.
        nodes: nodes in the job (at least 1).
        gpus_per_node: GPUs (trainer processes) per node; -1 = sized from the mesh when dp_replicate and dp_shard are
            both given (dp_replicate x dp_shard x tp over the nodes), else every GPU of instance_type.
        instance_type: EC2 instance type of the trainer nodes (p5.48xlarge, p5e/p5en.48xlarge, p4d/p4de.24xlarge,
            g5/g6/g6e.*): sizes GPUs, EFA, CPU, memory and /dev/shm to it; empty = any node (set the sizes).
        spot: let the trainer pods run on spot nodes.
        gpu_resource: nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-3g.40gb for small jobs.
        efa_per_node: EFA interfaces per pod; -1 = the instance type's.
        cpu: CPU request per trainer pod; empty = the node's allocatable less the DaemonSets.
        memory: memory per trainer pod; empty = as for cpu.
        shm_size: /dev/shm per trainer pod; empty = a quarter of the memory.
        node_group: EKS node group of the trainer pods (eks.amazonaws.com/nodegroup); empty = any.
        scheduler: gang scheduler of the trainer pods: empty, volcano, scheduler-plugins or yunikorn; or kueue: the job
            waits in a Kueue LocalQueue until admitted (deploy/kueue/).
        queue: the job's queue: a Volcano queue, a YuniKorn queue root.<name>, or a Kueue LocalQueue (goodput).
        max_restarts: in-job restarts of the worker group by ft_launcher.
        backoff_limit: job restarts before it fails (PyTorchJob pod restarts; a TrainJob's must be its runtime's).
        train_timeout_s: deadline of the train step in seconds (with Kueue: from admission).
        admission_timeout_s: scheduler=kueue: how long the job may wait for admission before the step fails.
        inject_fault: KIND@STEP[:RANK] faults for the trainer, comma-separated (recovery drills).
        promotion_threshold: promote only below this validation loss (nats per token).
        promotion_tolerance: and at most this much worse than the production model.
        baseline: a model scored on the same validation windows: a Hugging Face model directory on FSx, or
            init_from (the model the run started from, wherever init_from put it); empty = none.
        require_beat_baseline: promote only a model strictly better than ``baseline`` (checked before staging:
            it needs one).
        evaluate_gpu_resource: the evaluate pod's GPU: nvidia.com/gpu, or a MIG slice such as
            nvidia.com/mig-3g.40gb (a whole GPU is waste for scoring); empty = a CPU pod.
        model_name: the model's name in the registry; empty = the model's (llama, bytegpt, your module's name).
        registry: model registry, a directory on FSx, s3://bucket/prefix, or an MLflow server: mlflow://HOST:PORT or
            mlflow+https://HOST (a registered model version, the alias production moved on promotion).
        mlflow_secret: Kubernetes secret with MLFLOW_TRACKING_TOKEN for an mlflow+https registry, used if it exists.
        eval_tasks: lm-evaluation-harness tasks scored on each checkpoint, comma-separated: harness task names
            (their datasets must be reachable from the evaluate pod), task files (.yaml) on FSx, or
            s3://bucket/prefix/file.yaml (the prefix is copied with it); empty = none.
        eval_limit: examples per task; 0 = all.
        promote_on: val_loss, or task:<task>/<metric> (higher is better, e.g. task:arc_easy/acc_norm): picks the best
            checkpoint and is compared with the production model's recorded score.
        trainer_image: image of the trainer pods.
        nvrx_release: the NVRx release in trainer_image (its io.goodput.nvrx-release label); the pods' launch
            command is built for it; empty = the release the project's trainer image pins.
        hot_spares: nodes beyond ``nodes`` that stand by and take a failed node's place (NVRx 0.6+).
        node_health_check_endpoint: Unix socket of a node health daemon on every node (NVRx 0.6+); empty = none.
        trainer_service_account: service account of the trainer pods; empty = the namespace default.
        namespace: namespace of the job; empty = the pipeline's.
        fsx_pvc: the FSx for Lustre PersistentVolumeClaim.
        fsx_root: FSx path in the pods; keep /fsx on a cluster (the claim is mounted there).
        step_node_selector: nodeSelector of the step pods, e.g. {{"karpenter.sh/capacity-type": "on-demand"}}.
        step_tolerations: tolerations of the step pods (a list of Kubernetes toleration objects).
        trainer_config: any other trainer setting, as {{"section": {{"field": value}}}} or {{"section.field": value}},
            e.g. {{"optim": {{"lr": 3e-4, "warmup_steps": 200}}, "data.grad_accum": 4}}; `python -m trainer --help`
            lists them (sections model, data, optim, parallel, checkpoint, run, restart, faults, spot, metrics).
            Checked with the rest at check settings; a setting that has a parameter of its own is set there.
    """


TRAIN_STEPS = {
    "pytorchjob": "a Training Operator PyTorchJob of ``nodes`` x ``gpus_per_node`` under NVRx ft_launcher",
    "trainjob": "a Kubeflow Trainer v2 TrainJob on the goodput-nvrx runtime (deploy/trainer-v2) of ``nodes`` x "
                "``gpus_per_node`` under NVRx ft_launcher",
    "local": "``local_nodes`` x ``local_nproc`` ft_launcher ranks in the step itself",
}
LOCAL_PARAMETERS = [inspect.Parameter("local_nproc", inspect.Parameter.KEYWORD_ONLY, default=2, annotation=int),
                    inspect.Parameter("local_nodes", inspect.Parameter.KEYWORD_ONLY, default=1, annotation=int)]
LOCAL_ARGS = ("\n    local_nproc: ranks per node of the local backend (trainer processes on this machine)."
              "\n    local_nodes: nodes of the local backend: separate node process trees on this machine.")


def build_pipeline(backend: str = "pytorchjob"):
    """The goodput pipeline for a train backend: ``pytorchjob``, ``trainjob`` or ``local``.

    One wiring (``_wire``) under three signatures: the cluster ones take ``pipeline_parameters``, the local
    one also ``local_nproc`` and ``local_nodes``. KFP reads a pipeline's parameters from its function's signature
    and docstring.
    """
    backend = backend_name(backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    signature = inspect.signature(pipeline_parameters)
    params = list(signature.parameters.values()) + (LOCAL_PARAMETERS if backend == "local" else [])
    names = [p.name for p in params]

    def goodput_pipeline(*args):
        _wire(backend, **dict(zip(names, args)))

    goodput_pipeline.__signature__ = signature.replace(
        parameters=[p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])
    doc = inspect.getdoc(pipeline_parameters).replace("{train}", TRAIN_STEPS[backend])
    goodput_pipeline.__doc__ = doc.replace("{{", "{").replace("}}", "}") + (LOCAL_ARGS if backend == "local" else "")
    return dsl.pipeline(name=PIPELINE_NAME, description=DESCRIPTION.format(kind=KINDS[backend]))(goodput_pipeline)


def _wire(backend: str, *, local_nproc=None, local_nodes=None, **p) -> None:
    """The steps and what their pods get; ``p`` are the pipeline's parameters (channels)."""
    cleanup = cleanup_op(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, backend=backend, namespace=p["namespace"])
    placed(cleanup, p["step_node_selector"], p["step_tolerations"])
    cleanup.set_display_name("cleanup").set_caching_options(False).set_retry(2, backoff_duration="30s")

    def step_pod(task):
        return with_s3_secret(placed(on_fsx(task, p["fsx_pvc"]), p["step_node_selector"], p["step_tolerations"]),
                              p["s3_secret"])

    with dsl.ExitHandler(cleanup, name="goodput-run"):
        config = train_config_op(
            fsx_root=p["fsx_root"], dataset_name=p["dataset_name"], dataset_version=p["dataset_version"],
            run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, max_steps=p["max_steps"], ckpt_every=p["ckpt_every"],
            model=p["model"], model_flavor=p["model_flavor"], model_config=p["model_config"],
            init_from=p["init_from"], tokenizer=p["tokenizer"], seq_len=p["seq_len"], batch_size=p["batch_size"],
            parallel=p["parallel"], seed=p["seed"], inject_fault=p["inject_fault"], max_restarts=p["max_restarts"],
            dp_replicate=p["dp_replicate"], dp_shard=p["dp_shard"], tp=p["tp"],
            backoff_limit=p["backoff_limit"], instance_type=p["instance_type"], fsx_pvc=p["fsx_pvc"],
            service_account=p["trainer_service_account"], backend=backend, image=p["trainer_image"],
            nodes=p["nodes"], gpus_per_node=p["gpus_per_node"], spot=p["spot"], gpu_resource=p["gpu_resource"],
            efa_per_node=p["efa_per_node"], cpu=p["cpu"], memory=p["memory"], shm_size=p["shm_size"],
            node_group=p["node_group"], scheduler=p["scheduler"], queue=p["queue"], nvrx_release=p["nvrx_release"],
            hot_spares=p["hot_spares"], node_health_check_endpoint=p["node_health_check_endpoint"],
            registry=p["registry"],
            model_name=p["model_name"], endpoint_url=p["s3_endpoint_url"],
            evaluate_gpu_resource=p["evaluate_gpu_resource"], baseline=p["baseline"],
            require_beat_baseline=p["require_beat_baseline"], train_timeout_s=p["train_timeout_s"],
            admission_timeout_s=p["admission_timeout_s"], stage_parallelism=p["stage_parallelism"],
            ckpt_mirror=p["ckpt_mirror"], require_mirror=p["require_mirror"], eval_tasks=p["eval_tasks"],
            eval_limit=p["eval_limit"], promote_on=p["promote_on"], trainer_config=p["trainer_config"])
        # FSx and the S3 secret: it checks that init_from exists and reads the registry's production model.
        step_pod(config).set_display_name("check settings").set_caching_options(False)

        # Staging is never taken from KFP's cache: an unchanged source is only listed and compared (cheap),
        # and a changed one is restaged whatever the version says.
        stage = stage_pipeline(
            source=p["dataset_source"], fsx_root=p["fsx_root"], name=p["dataset_name"],
            version=p["dataset_version"], endpoint_url=p["s3_endpoint_url"],
            stage_parallelism=p["stage_parallelism"], tokenizer=p["tokenizer"], data_format=p["data_format"],
            text_field=p["text_field"], text_column=p["text_column"], include=p["dataset_include"],
            exclude=p["dataset_exclude"], train_glob=p["dataset_train_glob"], val_glob=p["dataset_val_glob"],
            val_tokens=p["dataset_val_tokens"],
            bad_record_policy=p["bad_record_policy"],
            refused_key_policy=p["refused_key_policy"], fsx_pvc=p["fsx_pvc"], s3_secret=p["s3_secret"],
            step_node_selector=p["step_node_selector"], step_tolerations=p["step_tolerations"])
        stage.set_display_name("stage").set_caching_options(False)
        stage.after(config)                           # no data flows: a bad setting stops the run before staging

        # An S3 init_from (or a production model on S3) is copied to FSx; with nothing to copy it returns at once.
        stage_model = stage_model_op(source=config.outputs["init_from_source"], dest=config.outputs["init_from_dir"],
                                     endpoint_url=p["s3_endpoint_url"])
        step_pod(stage_model).set_display_name("stage init_from").set_caching_options(False)
        stage_model.set_retry(3, backoff_duration="60s")     # an interrupted copy resumes from its journal

        train_kw = {"local_nproc": local_nproc, "local_nodes": local_nodes} if backend == "local" else {}
        train = train_op(backend=backend, trainer_config=config.outputs["trainer_config"],
                         job_options=config.outputs["job_options"], image=p["trainer_image"], nodes=p["nodes"],
                         gpus_per_node=p["gpus_per_node"], spot=p["spot"], namespace=p["namespace"],
                         timeout_s=p["train_timeout_s"], fsx_root=p["fsx_root"], **train_kw)
        # The dataset and the init_from model reach the trainer through FSx at the paths in trainer_config
        # (--data, --init-from), not as KFP artifacts, so the edges to the stages are explicit ones.
        train.after(stage, stage_model)
        # Placement set on this task would go to the job's pods (train_op's task_config passthroughs),
        # which job_options place already; so none here. The FSx mount is passed through to the job's
        # pods and kept on the launcher's pod, which reads the run's summary.json from FSx.
        on_fsx(train, p["fsx_pvc"])
        # A retried train step re-attaches to its job (named from the run) and the trainer resumes
        # from the last committed checkpoint: retries never duplicate a job.
        train.set_display_name("train").set_caching_options(False).set_retry(2, backoff_duration="120s")

        evaluate = evaluate_op(run_dir=config.outputs["run_dir"], threshold=p["promotion_threshold"],
                               tolerance=p["promotion_tolerance"], model_name=config.outputs["model_name"],
                               registry=p["registry"], baseline=config.outputs["baseline_dir"],
                               require_beat_baseline=p["require_beat_baseline"], endpoint_url=p["s3_endpoint_url"],
                               eval_tasks=p["eval_tasks"], eval_limit=p["eval_limit"], promote_on=p["promote_on"])
        with_mlflow_secret(evaluate, p["mlflow_secret"])
        evaluate.after(train)                         # reads the run directory on FSx that train wrote
        step_pod(evaluate).set_display_name("evaluate").set_caching_options(False).set_retry(2, backoff_duration="60s")
        evaluate.set_cpu_request("4").set_memory_request("16Gi")
        # A GPU (or a MIG slice) only when evaluate_gpu_resource names one: the check gives the count 0 or 1.
        evaluate.set_accelerator_type(config.outputs["evaluate_accelerator"])
        evaluate.set_accelerator_limit(config.outputs["evaluate_gpus"])

        with dsl.If(evaluate.outputs["promoted"] == True, name="promoted"):  # noqa: E712 - a pipeline condition
            register = register_op(model_uri=evaluate.outputs["model_uri"], registry=p["registry"],
                                   model_name=config.outputs["model_name"], endpoint_url=p["s3_endpoint_url"])
            step_pod(register).set_display_name("register").set_caching_options(False)
            with_mlflow_secret(register, p["mlflow_secret"])
            register.set_retry(2, backoff_duration="30s")


goodput_pipeline = build_pipeline("pytorchjob")
"""The cluster pipeline on PyTorchJobs, as ``goodput compile`` compiles it by default."""
