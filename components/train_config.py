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
    args, job, run_dir = build_train_config(fsx_root="fsx", dataset_name="pystdlib", dataset_version="3.11",
                                            run_id="dev", max_steps=60, inject_fault="kill@30:1")
"""


INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


def build_train_config(*, fsx_root: str, dataset_name: str, dataset_version: str, run_id: str,
                       max_steps: int = 200, ckpt_every: int = 50, n_layer: int = 4, n_head: int = 4,
                       n_embd: int = 128, seq_len: int = 128, batch_size: int = 16, parallel: str = "fsdp",
                       seed: int = 1337, inject_fault: str = "", extra_trainer_args: list | None = None,
                       max_restarts: int = 3, backoff_limit: int = 3, instance_type: str = "",
                       fsx_pvc: str = "fsx-claim", service_account: str = "", backend: str = "cluster",
                       image: str = "", nodes: int = 1, gpus_per_node: int = 8,
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
        instance_type: EC2 instance type the trainer pods must run on (empty = any).
        fsx_pvc: the FSx PersistentVolumeClaim mounted into the trainer pods.
        service_account: service account of the trainer pods (empty = the namespace default).
        backend: ``cluster`` or ``local``; the job settings are only checked for ``cluster``.
        image: trainer image (checked for ``cluster``).
        nodes: nodes in the job (checked for ``cluster``).
        gpus_per_node: GPUs per pod (checked for ``cluster``).
        spot: spot nodes allowed (checked for ``cluster``).

    Raises:
        ValueError: a setting the trainer or the job builder would reject.
    """
    from components.pytorchjob import JobSpec
    from trainer.config import parse_config

    if not run_id or "{{$" in run_id:
        raise ValueError(f"run_id {run_id!r} must be set: pass dsl.PIPELINE_JOB_ID_PLACEHOLDER from the pipeline")
    root = str(fsx_root).rstrip("/")
    run_dir = f"{root}/runs/{run_id}"
    args = ["--data", f"{root}/datasets/{dataset_name}/{dataset_version}", "--out", run_dir,
            "--max-steps", str(int(max_steps)), "--ckpt-every", str(int(ckpt_every)),
            "--n-layer", str(int(n_layer)), "--n-head", str(int(n_head)), "--n-embd", str(int(n_embd)),
            "--seq-len", str(int(seq_len)), "--batch-size", str(int(batch_size)), "--parallel", parallel,
            "--seed", str(int(seed))]
    for fault in (f.strip() for f in inject_fault.split(",")):
        if fault:
            args += ["--inject-fault", fault]
    args += [str(a) for a in (extra_trainer_args or [])]
    try:
        parse_config(args)
    except SystemExit:       # argparse has printed why
        raise ValueError(f"the trainer rejects these arguments: {' '.join(args)}") from None
    job = {"launch": {"max_restarts": int(max_restarts)}, "backoff_limit": int(backoff_limit), "pvc": fsx_pvc,
           "fsx_mount": root or "/",
           "node_selector": {INSTANCE_TYPE_LABEL: instance_type} if instance_type else {},
           "service_account": service_account}
    if backend == "cluster":
        JobSpec.from_dict({**job, "image": image, "nodes": int(nodes), "gpus_per_node": int(gpus_per_node),
                           "spot": bool(spot), "trainer_args": args}).validate()
    elif backend != "local":
        raise ValueError(f"backend must be cluster or local, got {backend!r}")
    return args, job, run_dir
