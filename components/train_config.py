"""The run's settings, checked before anything is staged, turned into ``train_op``'s inputs.

The pipeline's parameters are typed (``max_steps: int``, ``spot: bool``); the train step takes the
trainer's command line (a list of strings) and ``JobSpec`` settings (a dict). Building those from the
parameters is a mapping, so it lives here and not in the pipeline function; it also cannot be left to
KFP's placeholder substitution inside a list or dict, which turns ``200`` into ``"200.0"`` under
``kfp.local`` and every number into a string.

The step is first in the pipeline: a bad setting (an unknown fault kind, a node count the job builder
rejects) fails in seconds, before a dataset is staged or a GPU is requested. The KFP component is
``components.train_config_op.train_config_op``; this module imports no kfp.

    from components.train_config import build_train_config
    args, job, run_dir = build_train_config(fsx_root="fsx", dataset_name="corpus", dataset_version="1",
                                            run_id="dev", max_steps=60, inject_fault="kill@30:1")

``check_run_parameters`` applies the same checks to a whole set of pipeline parameters (``goodput run``
calls it before submitting, so ``nodes=0`` fails on the user's machine, not in a pod).
"""

import inspect


def build_train_config(*, fsx_root: str, dataset_name: str, dataset_version: str, run_id: str,
                       max_steps: int = 200, ckpt_every: int = 50, n_layer: int = 4, n_head: int = 4,
                       n_embd: int = 128, seq_len: int = 128, batch_size: int = 16, parallel: str = "fsdp",
                       seed: int = 1337, inject_fault: str = "", extra_trainer_args: list | None = None,
                       max_restarts: int = 3, backoff_limit: int = 3, instance_type: str = "",
                       fsx_pvc: str = "fsx-claim", service_account: str = "", backend: str = "pytorchjob",
                       image: str = "", nodes: int = 1, gpus_per_node: int = -1, gpu_resource: str = "nvidia.com/gpu",
                       efa_per_node: int = -1, cpu: str = "", memory: str = "", shm_size: str = "",
                       node_group: str = "", scheduler: str = "", queue: str = "",
                       spot: bool = False) -> tuple[list[str], dict, str]:
    """(trainer arguments, job settings, run directory) for ``train_op``, validated as the train step will.

    Args:
        fsx_root: FSx mount path in the pods (cluster) or the local stand-in; the dataset is read from
            ``<fsx_root>/datasets/<dataset_name>/<dataset_version>``, where the stage step wrote it.
        dataset_name: staged dataset name.
        dataset_version: staged dataset version.
        run_id: the KFP run id; the trainer writes to ``<fsx_root>/runs/<run_id>`` (a retried step resumes
            there, and the evaluate step reads it).
        max_steps: optimizer steps.
        ckpt_every: checkpoint interval in optimizer steps.
        n_layer: transformer blocks.
        n_head: attention heads.
        n_embd: model width.
        seq_len: context length in bytes.
        batch_size: sequences per micro-batch per rank.
        parallel: ``fsdp`` or ``ddp``.
        seed: random seed.
        inject_fault: comma-separated ``KIND@STEP[:RANK]`` faults for the trainer (recovery drills).
        extra_trainer_args: further ``python -m trainer`` arguments, appended last.
        max_restarts: in-job restarts of the worker group by ft_launcher.
        backoff_limit: PyTorchJob pod restarts before the job fails.
        instance_type: EC2 instance type of the trainer nodes (empty = any); a documented one
            (``components.pytorchjob.INSTANCE_TYPES``) sizes GPUs, EFA, CPU, memory and /dev/shm to it.
        fsx_pvc: the FSx PersistentVolumeClaim mounted into the trainer pods.
        service_account: service account of the trainer pods (empty = the namespace default).
        backend: ``pytorchjob`` (or its old name ``cluster``), ``trainjob`` or ``local``; the job settings are
            checked as the chosen kind's builder checks them (``trainjob``: against the ``goodput-nvrx`` runtime,
            or the one ``runtime`` names), not for ``local``.
        image: trainer image (checked for ``cluster``).
        nodes: nodes in the job (checked for ``cluster``).
        gpus_per_node: GPUs per pod; -1 = every GPU of ``instance_type`` (8 without one).
        gpu_resource: ``nvidia.com/gpu``, or a MIG slice such as ``nvidia.com/mig-3g.40gb``.
        efa_per_node: EFA interfaces per pod; -1 = the instance type's.
        cpu: CPU request per pod; empty = the node's allocatable less the DaemonSets.
        memory: memory per pod; empty = as for cpu.
        shm_size: /dev/shm per pod; empty = a quarter of the memory.
        node_group: EKS node group of the trainer pods (empty = any).
        scheduler: gang scheduler: empty, volcano, scheduler-plugins or yunikorn.
        queue: the gang's queue (Volcano queue, or YuniKorn root.<name>).
        spot: spot nodes allowed (checked for ``cluster``).

    Raises:
        ValueError: a setting the trainer or the job builder would reject.
    """
    from components.job_kinds import backend_name
    from components.pytorchjob import INSTANCE_TYPES, JobSpec
    from trainer.config import parse_config
    from trainer.launch import check_faults

    if not run_id or "{{$" in run_id:
        raise ValueError(f"run_id {run_id!r} must be set: pass dsl.PIPELINE_JOB_ID_PLACEHOLDER from the pipeline")
    root = str(fsx_root).rstrip("/")
    run_dir = f"{root}/runs/{run_id}"
    args = ["--data", f"{root}/datasets/{dataset_name}/{dataset_version}", "--out", run_dir,
            "--max-steps", str(int(max_steps)), "--ckpt-every", str(int(ckpt_every)),
            "--n-layer", str(int(n_layer)), "--n-head", str(int(n_head)), "--n-embd", str(int(n_embd)),
            "--seq-len", str(int(seq_len)), "--batch-size", str(int(batch_size)), "--parallel", parallel,
            "--seed", str(int(seed))]
    faults = [f.strip() for f in inject_fault.split(",") if f.strip()]
    for fault in faults:
        args += ["--inject-fault", fault]
    args += [str(a) for a in (extra_trainer_args or [])]
    try:
        parse_config(args)
    except SystemExit:       # argparse has printed why
        raise ValueError(f"the trainer rejects these arguments: {' '.join(args)}") from None
    shape = INSTANCE_TYPES.get(instance_type)
    gpus = int(gpus_per_node) if int(gpus_per_node) >= 0 else (shape.gpus if shape else 8)
    job = {"launch": {"max_restarts": int(max_restarts)}, "backoff_limit": int(backoff_limit), "pvc": fsx_pvc,
           "fsx_mount": root or "/", "instance_type": instance_type, "service_account": service_account,
           "gpus_per_node": gpus, "gpu_resource": gpu_resource, "efa_per_node": int(efa_per_node), "cpu": cpu,
           "memory": memory, "shm_size": shm_size, "node_group": node_group, "scheduler": scheduler,
           "queue": queue}
    backend = backend_name(backend)
    if backend != "local":      # the local backend's rank count is the train step's local_nproc
        # A fault on a rank or a step the job does not have would never fire.
        check_faults(faults, int(nodes) * gpus, int(max_steps))
    spec = {**job, "image": image, "nodes": int(nodes), "spot": bool(spot), "trainer_args": args}
    if backend == "pytorchjob":
        JobSpec.from_dict(spec).validate()
    elif backend == "trainjob":
        from components.trainjob import RuntimeSpec, build_trainjob

        build_trainjob(JobSpec.from_dict(spec), RuntimeSpec())
    return args, job, run_dir


def check_run_parameters(params: dict) -> None:
    """Check a run's pipeline parameters (the pipeline's defaults filled in) as the check-settings step will.

    ``goodput run`` calls this before submitting. Parameters of other steps are ignored; ``run_id`` is a
    stand-in (the real one exists only once KFP starts the run).

    Raises:
        ValueError: a setting the trainer or the job builder would reject.
    """
    renamed = {"service_account": "trainer_service_account", "image": "trainer_image"}
    wanted = set(inspect.signature(build_train_config).parameters) - {"run_id"}
    kwargs = {name: params[renamed.get(name, name)] for name in wanted if renamed.get(name, name) in params}
    build_train_config(run_id="run-id", **kwargs)
