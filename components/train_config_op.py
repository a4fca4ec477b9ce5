"""KFP component: check the run's settings and build the train step's inputs (``components.train_config``)."""

import os
from typing import NamedTuple

from kfp import dsl

# The image the component runs in. The check-settings step runs on the trainer image (it builds the model
# to check it, with torch and the user's model package); ``goodput compile --trainer-image`` sets it.
BASE_IMAGE = os.environ.get("GOODPUT_TRAINER_IMAGE", "ghcr.io/goodput-pipelines/trainer:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def train_config_op(
    fsx_root: str,
    dataset_name: str,
    dataset_version: str,
    run_id: str,
    max_steps: int,
    ckpt_every: str,
    model: str,
    model_flavor: str,
    model_config: str,
    init_from: str,
    tokenizer: str,
    seq_len: int,
    batch_size: int,
    parallel: str,
    dp_replicate: int,
    dp_shard: int,
    tp: int,
    seed: int,
    inject_fault: str,
    max_restarts: int,
    backoff_limit: int,
    instance_type: str,
    fsx_pvc: str,
    service_account: str,
    backend: str,
    image: str,
    nodes: int,
    gpus_per_node: int,
    spot: bool,
    gpu_resource: str = "nvidia.com/gpu",
    efa_per_node: int = -1,
    cpu: str = "",
    memory: str = "",
    shm_size: str = "",
    node_group: str = "",
    scheduler: str = "",
    queue: str = "",
    nvrx_release: str = "",
    hot_spares: int = 0,
    node_health_check_endpoint: str = "",
    registry: str = "",
    model_name: str = "",
    endpoint_url: str = "",
    evaluate_gpu_resource: str = "",
    baseline: str = "",
    require_beat_baseline: bool = False,
    train_timeout_s: float = 7 * 86400.0,
    admission_timeout_s: float = 86400.0,
    stage_parallelism: int = 4,
    trainer_config: dict = {},
    ckpt_mirror: str = "",
    require_mirror: bool = False,
    eval_tasks: str = "",
    eval_limit: int = 0,
    promote_on: str = "val_loss",
) -> NamedTuple("TrainConfig", [("trainer_config", dict), ("job_options", dict), ("run_dir", str),
                                ("init_from_source", str), ("init_from_dir", str), ("model_name", str),
                                ("baseline_dir", str), ("evaluate_accelerator", str), ("evaluate_gpus", int)]):
    """Check the run's settings; record the trainer's in the run directory and hand them, the job settings and
    the run directory to the train step.

    Args:
        fsx_root: FSx mount path in the pods (cluster) or the local stand-in (local).
        dataset_name: staged dataset name.
        dataset_version: staged dataset version.
        run_id: the KFP run id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``); names the run directory.
        max_steps: optimizer steps.
        ckpt_every: checkpoint interval in optimizer steps, or auto (the Young-Daly interval).
        model: bytegpt, llama, or package.module:function (a model factory in the trainer image).
        model_flavor: a named size of the model; empty = its default.
        model_config: inline JSON of fields overriding the flavor's; empty = none.
        init_from: a Hugging Face model directory on FSx, s3:// of one, or production; empty = random init.
        tokenizer: the dataset's tokenizer; its vocabulary must fit the model's.
        seq_len: context length in tokens.
        batch_size: sequences per micro-batch per rank.
        parallel: fsdp or ddp.
        dp_replicate: replicas of the model (HSDP); 0 = auto.
        dp_shard: ranks sharding the parameters within a replica; 0 = auto.
        tp: tensor-parallel ranks inside a node (1 = none).
        seed: random seed.
        inject_fault: comma-separated KIND@STEP[:RANK] faults (recovery drills); empty = none.
        max_restarts: in-job restarts by ft_launcher.
        backoff_limit: job restarts before the job fails (PyTorchJob pod restarts; TrainJob: the runtime's).
        instance_type: EC2 instance type of the trainer nodes (empty = any); a documented one sizes the pods.
        fsx_pvc: FSx PersistentVolumeClaim of the trainer pods.
        service_account: service account of the trainer pods (empty = default).
        backend: pytorchjob (or its old name cluster), trainjob or local.
        image: trainer image.
        nodes: nodes in the job.
        gpus_per_node: GPUs per pod; -1 = every GPU of the instance type (8 without one).
        spot: spot nodes allowed.
        gpu_resource: nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-3g.40gb.
        efa_per_node: EFA interfaces per pod; -1 = the instance type's.
        cpu: CPU request per pod; empty = sized to the instance type.
        memory: memory per pod; empty = sized to the instance type.
        shm_size: /dev/shm per pod; empty = a quarter of the memory.
        node_group: EKS node group of the trainer pods (empty = any).
        scheduler: gang scheduler: empty, volcano, scheduler-plugins or yunikorn; or kueue (Kueue admission).
        queue: the job's queue (Volcano queue, YuniKorn root.<name>, or a Kueue LocalQueue).
        nvrx_release: NVRx release of the trainer image; empty = the pinned one (``compat.IMAGE_RELEASE``).
        hot_spares: standby nodes beyond ``nodes`` (NVRx 0.6+, PyTorchJob only).
        node_health_check_endpoint: Unix socket of the node health daemon (NVRx 0.6+); empty = none.
        registry: the model registry, for init_from=production.
        model_name: the model's name in the registry; empty = the model's.
        endpoint_url: S3-compatible endpoint; empty for AWS S3.
        evaluate_gpu_resource: the evaluate pod's GPU resource (nvidia.com/gpu or a MIG slice); empty = CPU.
        baseline: a Hugging Face directory evaluate scores beside the run, or init_from; empty = none.
        require_beat_baseline: promote only a model better than the baseline (which must be given).
        train_timeout_s: the train step's deadline in seconds (Kueue: from admission).
        admission_timeout_s: scheduler=kueue: how long the job may wait for admission.
        stage_parallelism: most stage worker pods.
        trainer_config: any other trainer setting, {"section": {"field": value}} (``python -m trainer --help``).
        ckpt_mirror: s3://BUCKET/PREFIX the trainer mirrors committed checkpoints to; empty = none.
        require_mirror: any failure of the mirror fails the run (needs ckpt_mirror).
        eval_tasks: evaluate's lm-evaluation-harness tasks (checked: names and task files; their data by evaluate).
        eval_limit: examples per task (0: all).
        promote_on: val_loss or task:<task>/<metric> (a task of eval_tasks).
    """
    import json
    from collections import namedtuple

    from components.train_config import build_train_config

    settings = build_train_config(
        fsx_root=fsx_root, dataset_name=dataset_name, dataset_version=dataset_version, run_id=run_id,
        max_steps=max_steps, ckpt_every=ckpt_every, model=model, model_flavor=model_flavor,
        model_config=model_config, init_from=init_from, tokenizer=tokenizer, seq_len=seq_len,
        batch_size=batch_size, parallel=parallel, seed=seed, inject_fault=inject_fault,
        dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp,
        trainer_config=trainer_config, max_restarts=max_restarts, backoff_limit=backoff_limit,
        instance_type=instance_type, fsx_pvc=fsx_pvc, service_account=service_account, backend=backend,
        image=image, nodes=nodes, gpus_per_node=gpus_per_node, spot=spot, gpu_resource=gpu_resource,
        efa_per_node=efa_per_node, cpu=cpu, memory=memory, shm_size=shm_size, node_group=node_group,
        scheduler=scheduler, queue=queue, nvrx_release=nvrx_release, hot_spares=hot_spares,
        node_health_check_endpoint=node_health_check_endpoint, registry=registry, model_name=model_name,
        endpoint_url=endpoint_url,
        evaluate_gpu_resource=evaluate_gpu_resource, baseline=baseline, require_beat_baseline=require_beat_baseline,
        train_timeout_s=train_timeout_s, admission_timeout_s=admission_timeout_s,
        stage_parallelism=stage_parallelism, ckpt_mirror=ckpt_mirror, require_mirror=require_mirror,
        eval_tasks=eval_tasks, eval_limit=eval_limit, promote_on=promote_on)
    print("trainer settings (besides the defaults):", json.dumps(settings.trainer_config, sort_keys=True))
    return namedtuple("TrainConfig", settings._fields)(*settings)
