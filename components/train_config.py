"""The run's settings, checked before anything is staged, turned into the train step's inputs.

The pipeline's parameters are typed (``max_steps: int``, ``spot: bool``); the train step takes the trainer's
settings (``trainer.config.TrainConfig.document()``: ``{section: {field: value}}``) and ``JobSpec`` settings
(a dict). Which trainer setting each pipeline parameter is, is ``PIPELINE_SETTINGS``; every other trainer
setting comes in through the ``trainer_config`` object. The settings are resolved and validated here once, and
recorded in the run directory (``settings.json``), which the trainer holds every later start of the run to.

The step is first in the pipeline: a bad setting (an unknown model or flavor, model_config that is not JSON,
a model whose vocabulary the dataset's tokenizer overflows, an ``init_from`` that does not exist, an unknown
fault kind, a node count the job builder rejects) fails in seconds, before a dataset is staged or a GPU is
requested. It also decides where the run's ``init_from`` comes from:

    init_from                 the trainer's --init-from              staged first (components.stage_model)
    ""                        none (a fresh start)                   -
    /fsx/models/llama/v3      that Hugging Face directory, as is     -
    s3://bucket/llama3-1b     <fsx>/pretrained/bucket/llama3-1b      from that prefix
    production                the registry's production model:       from S3 when the registry is on S3
                              its directory on FSx, or staged
                              (no production model yet: an error, before anything is staged)

The KFP component is ``components.train_config_op.train_config_op``; this module imports no kfp (nor torch:
the model is checked with torch when it is installed, as in the trainer image the step runs on).

    from components.train_config import build_train_config
    settings = build_train_config(fsx_root="fsx", dataset_name="corpus", dataset_version="1", run_id="dev",
                                  model="llama", model_flavor="debug", max_steps=60, inject_fault="kill@30:1")
    settings.trainer_config, settings.job_options, settings.run_dir

``check_run_parameters`` applies the same checks to a whole set of pipeline parameters (``goodput run``
calls them before submitting, so ``nodes=0`` fails on the user's machine, not in a pod).
"""

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import tempfile
from pathlib import Path
from typing import NamedTuple

from trainer import layout
from trainer.s3url import is_s3_url

PRODUCTION = "production"
"""``init_from`` value naming the registry's current production model."""
BASELINE_INIT_FROM = "init_from"
"""``baseline`` value naming the model the run started from (wherever ``init_from`` put it)."""
PIPELINE_SETTINGS = {
    "max_steps": "run.max_steps", "ckpt_every": "checkpoint.ckpt_every", "ckpt_mirror": "checkpoint.mirror",
    "require_mirror": "checkpoint.require_mirror", "model": "model.name", "model_flavor": "model.flavor",
    "model_config": "model.config", "init_from": "model.init_from", "seq_len": "model.seq_len",
    "batch_size": "data.batch_size", "parallel": "parallel.parallel", "dp_replicate": "parallel.dp_replicate",
    "dp_shard": "parallel.dp_shard", "tp": "parallel.tp", "seed": "run.seed", "inject_fault": "faults.inject_fault",
}
"""The trainer setting each pipeline parameter of its own sets; ``trainer_config`` sets the others."""
DECIDED_SETTINGS = {"data.data": "dataset_name and dataset_version", "run.out": "the run's id (runs/<run id>)",
                    "checkpoint.mirror_endpoint_url": "s3_endpoint_url"}
"""Trainer settings the pipeline decides from other parameters."""


class TrainSettings(NamedTuple):
    """What the check-settings step hands on (its outputs, by these names)."""

    trainer_config: dict        # the trainer's settings besides their defaults (TrainConfig.document())
    job_options: dict
    run_dir: str
    init_from_source: str       # s3:// prefix the stage-model step copies to init_from_dir; "" = nothing to copy
    init_from_dir: str          # the trainer's --init-from ("" = a fresh start)
    model_name: str             # the model's name in the registry
    baseline_dir: str           # the Hugging Face directory evaluate scores as the baseline ("" = none)
    evaluate_accelerator: str   # the evaluate pod's GPU resource ...
    evaluate_gpus: int          # ... and how many (0: CPU)


def registry_name(model: str, model_name: str = "") -> str:
    """The registry name of the model: ``model_name``, else the built-in's name or the user module's last part."""
    from trainer.layout import NAME_RE

    name = model_name or model.partition(":")[0].rsplit(".", 1)[-1]
    if not NAME_RE.match(name):
        raise ValueError(f"model_name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return name


def resolve_init_from(init_from: str, *, fsx_root: str, registry: str, model_name: str, endpoint_url: str = "",
                      reachable: bool = True) -> tuple[str, str]:
    """(S3 source to stage, the trainer's --init-from directory) for the ``init_from`` parameter.

    ``reachable``: FSx, the registry and S3 can be read from here (the step's pod; ``goodput run --local``).
    Without it (``goodput run`` checking before it submits) nothing is looked up.

    Raises:
        ValueError: no production model yet, one without a Hugging Face directory, a bad S3 URI.
    """
    from components.stage_model import staged_model_dir

    init_from = init_from.strip()
    if not init_from:
        return "", ""
    if init_from == PRODUCTION:
        from components.mlflow_registry import is_mlflow

        if is_mlflow(registry):
            raise ValueError(f"init_from=production reads a directory or s3:// registry, not {registry}: give the "
                             f"production model's Hugging Face directory (s3:// or on FSx) as init_from")
        if not reachable:
            return "", ""
        from components.register import HF_FORMAT, PRODUCTION_FILE, Registry

        reg = Registry(registry, endpoint_url or None)
        record = reg.read_json(f"{model_name}/{PRODUCTION_FILE}")
        if record is None:
            raise ValueError(f"init_from=production: {reg.location(f'{model_name}/{PRODUCTION_FILE}')} does not "
                             f"exist, so there is no production model {model_name!r} to continue from yet; run once "
                             f"with init_from empty (a fresh start) or a model directory, and promote it")
        if record.get("format") != HF_FORMAT:
            raise ValueError(f"init_from=production: production model {model_name} {record.get('version')} is "
                             f"{record.get('format')!r}, not a Hugging Face directory (only models with a Hugging "
                             f"Face layout, such as llama, can be continued from)")
        init_from = record["model_uri"]
    if is_s3_url(init_from):
        return init_from, staged_model_dir(fsx_root, init_from)
    if "://" in init_from:
        raise ValueError(f"init_from {init_from!r}: give a Hugging Face model directory, s3://BUCKET/PREFIX of "
                         f"one, or production")
    if reachable and not (Path(init_from) / "config.json").is_file():
        raise ValueError(f"init_from {init_from!r}: no config.json there (a Hugging Face model directory: "
                         f"config.json + *.safetensors)")
    return "", init_from


def _baseline_dir(baseline: str, init_from: str, init_dir: str, require_beat_baseline: bool, reachable: bool) -> str:
    """The directory evaluate scores as the baseline; its problems are found now, not after training."""
    baseline = baseline.strip()
    if require_beat_baseline and not baseline:
        raise ValueError("require_beat_baseline needs a baseline: a Hugging Face model directory, or init_from")
    if baseline == BASELINE_INIT_FROM:
        if not init_from.strip():
            raise ValueError("baseline=init_from needs init_from (the model the run starts from)")
        return init_dir
    if baseline and reachable and not (Path(baseline) / "config.json").is_file():
        raise ValueError(f"baseline {baseline!r}: no config.json there (a Hugging Face model directory, or "
                         f"init_from)")
    return baseline


@contextlib.contextmanager
def _config_to_check(source: str, init_dir: str, endpoint_url: str, reachable: bool):
    """A directory whose config.json is the one the run starts from (fetched from S3 when it is staged later),
    or None when it cannot be read from here."""
    if not init_dir or not reachable:
        yield None
        return
    if not source:
        yield init_dir
        return
    from botocore.exceptions import BotoCoreError, ClientError

    from components.s3 import s3_client
    from components.stage import parse_source

    bucket, prefix = parse_source(source)
    with tempfile.TemporaryDirectory(prefix="goodput-init-from-") as tmp:
        try:
            s3_client(endpoint_url or None, max_attempts=3).download_file(bucket, f"{prefix}config.json",
                                                                          f"{tmp}/config.json")
        except (BotoCoreError, ClientError) as e:
            raise ValueError(f"init_from {source!r}: cannot read s3://{bucket}/{prefix}config.json ({e}): is it a "
                             f"Hugging Face model directory the step's credentials can read?") from None
        yield tmp


def tokenizer_vocab(tokenizer: str, reachable: bool = True) -> int | None:
    """The vocabulary size a dataset staged with ``tokenizer`` will have, where it is known before staging."""
    from components.stage_tokenizer import parse_tokenizer

    spec = (tokenizer or "bytes").strip()
    if spec == "bytes" or spec.startswith("bpe:"):
        parsed = parse_tokenizer(spec)
        return 256 if parsed.kind == "bytes" else parsed.vocab
    if is_s3_url(spec) or not reachable:
        return None                 # read when the data is staged; the trainer checks it then
    from tokenizers import Tokenizer

    return Tokenizer.from_file(parse_tokenizer(spec).location).get_vocab_size()


def _check_vocab(config, vocab: int, tokenizer: str) -> None:
    """The model's vocabulary holds the dataset's ids: checked as the trainer will, on a stand-in manifest."""
    from trainer.data import MANIFEST, READABLE_FORMATS

    with tempfile.TemporaryDirectory(prefix="goodput-vocab-") as tmp:
        stand_in = Path(tmp) / MANIFEST
        stand_in.write_text(json.dumps({"format": READABLE_FORMATS[-1], "vocab_size": vocab,
                                        "tokenizer": {"spec": tokenizer}}))
        try:
            config.model.spec(tmp)
        except ValueError as e:
            raise ValueError(str(e).replace(f"{stand_in}: ", f"tokenizer {tokenizer!r}: ")) from None


def _model_importable(model: str) -> bool:
    """A built-in, or a user model whose package is installed here (else only the trainer image has it)."""
    if ":" not in model:
        return True        # a built-in, or a bad name the trainer refuses with the reason
    try:
        return importlib.util.find_spec(model.partition(":")[0]) is not None
    except (ImportError, ValueError):
        return False


def _gpus_from_mesh(mesh, nodes: int, shape) -> int:
    """GPUs per node when the job leaves them to the mesh (``gpus_per_node=-1``): a mesh given whole
    (``dp_replicate`` x ``dp_shard`` x ``tp``, none 0) sizes the job, split evenly over the nodes; else every GPU of
    the instance type (8 without one)."""
    every = shape.gpus if shape else 8
    ranks = mesh.dp_replicate * mesh.dp_shard * mesh.tp
    if not (mesh.dp_replicate and mesh.dp_shard) or mesh.parallel != "fsdp":
        return every
    if ranks % nodes or ranks // nodes > every:
        raise ValueError(f"the mesh dp_replicate x dp_shard x tp = {ranks} ranks does not split evenly over {nodes} "
                         f"node(s) of at most {every} GPUs: change the mesh or nodes, or set gpus_per_node")
    return ranks // nodes


def _trainer_settings(trainer_config: dict, own: dict, *, data: str, out: str, endpoint_url: str):
    """The trainer's ``TrainConfig`` (not validated) from ``trainer_config`` and ``own``, the values of the
    parameters of ``PIPELINE_SETTINGS``; ``trainer_config`` naming a setting that is set otherwise is refused."""
    from trainer.config import TrainConfig, settings_values

    values = settings_values(trainer_config, "trainer_config")
    given = {f"{section}.{name}" for section, table in values.items() for name in table}
    owned = {setting: f"the parameter {param}" for param, setting in PIPELINE_SETTINGS.items()}
    taken = sorted(given & (owned.keys() | DECIDED_SETTINGS.keys()))
    if taken:
        raise ValueError(f"trainer_config sets {taken[0]}, which {owned.get(taken[0]) or DECIDED_SETTINGS[taken[0]]} "
                         f"sets: give it there")
    for param, setting in PIPELINE_SETTINGS.items():
        section = setting.split(".")[0]
        values[section].update(settings_values({setting: own[param]}, param)[section])
    values["data"]["data"], values["run"]["out"] = data, out
    if own["ckpt_mirror"] and endpoint_url:
        values["checkpoint"]["mirror_endpoint_url"] = endpoint_url
    return TrainConfig.from_values(values)


def build_train_config(*, fsx_root: str, dataset_name: str, dataset_version: str, run_id: str,
                       max_steps: int = 200, ckpt_every: str = "50", ckpt_mirror: str = "",
                       require_mirror: bool = False,
                       model: str = "bytegpt", model_flavor: str = "",
                       model_config: str = "", init_from: str = "", tokenizer: str = "bytes", seq_len: int = 128,
                       batch_size: int = 16, parallel: str = "fsdp", dp_replicate: int = 0, dp_shard: int = 0,
                       tp: int = 1, seed: int = 1337, inject_fault: str = "",
                       trainer_config: dict | None = None, max_restarts: int = 3, backoff_limit: int = 3,
                       instance_type: str = "", fsx_pvc: str = "fsx-claim", service_account: str = "",
                       backend: str = "pytorchjob", image: str = "", nodes: int = 1, gpus_per_node: int = -1,
                       gpu_resource: str = "nvidia.com/gpu", efa_per_node: int = -1, cpu: str = "", memory: str = "",
                       shm_size: str = "", node_group: str = "", scheduler: str = "", queue: str = "",
                       nvrx_release: str = "", hot_spares: int = 0, node_health_check_endpoint: str = "",
                       spot: bool = False, registry: str = "", model_name: str = "", endpoint_url: str = "",
                       evaluate_gpu_resource: str = "", baseline: str = "", require_beat_baseline: bool = False,
                       train_timeout_s: float = 7 * 86400.0, admission_timeout_s: float = 86400.0,
                       stage_parallelism: int = 4,
                       eval_tasks: str = "", eval_limit: int = 0, promote_on: str = "val_loss",
                       reachable: bool = True) -> TrainSettings:
    """The train step's inputs (``TrainSettings``), validated as the trainer and the job builder will.

    Args:
        fsx_root: FSx mount path in the pods (cluster) or the local stand-in; the dataset is read from
            ``<fsx_root>/datasets/<dataset_name>/<dataset_version>``, where the stage step wrote it.
        dataset_name: staged dataset name.
        dataset_version: staged dataset version.
        run_id: the KFP run id; the trainer writes to ``<fsx_root>/runs/<run_id>`` (a retried step resumes
            there, and the evaluate step reads it).
        max_steps: optimizer steps.
        ckpt_every: checkpoint interval in optimizer steps, or ``auto`` (the Young-Daly interval).
        ckpt_mirror: ``s3://BUCKET/PREFIX`` the trainer copies every committed checkpoint to (``--ckpt-mirror``,
            through ``endpoint_url`` when set); empty = no mirror.
        require_mirror: any failure of that mirror fails the run (``--require-mirror``; needs ``ckpt_mirror``).
        model: ``bytegpt``, ``llama`` or ``package.module:function`` (the user's model factory, installed in
            the trainer image; docs/models.md).
        model_flavor: a named size of the model (llama: debug, llama3-1b, llama3-3b, llama3-8b, llama3-70b);
            empty = its default; ignored with ``init_from`` (its config.json is the architecture).
        model_config: inline JSON of fields overriding the flavor's, e.g. ``{"n_layers": 8}``; empty = none.
        init_from: the weights a fresh run starts from: a Hugging Face model directory on FSx, ``s3://`` of one
            (staged to FSx first) or ``production`` (the registry's production model); empty = random init.
        tokenizer: the dataset's tokenizer (the stage step's ``tokenizer``); its vocabulary, where known before
            staging (bytes, bpe:VOCAB, a tokenizer file), must fit the model's.
        seq_len: context length in tokens.
        batch_size: sequences per micro-batch per rank.
        parallel: ``fsdp`` or ``ddp``.
        dp_replicate: replicas of the model (HSDP); 0 = auto (``trainer.mesh.resolve_mesh``).
        dp_shard: ranks sharding the parameters within a replica; 0 = auto.
        tp: tensor-parallel ranks inside a node (1 = none); the mesh must be ``nodes`` x GPUs per node.
        seed: random seed.
        inject_fault: comma-separated ``KIND@STEP[:RANK]`` faults for the trainer (recovery drills).
        trainer_config: any other trainer setting, ``{"section": {"field": value}}`` or ``{"section.field": value}``
            (``python -m trainer --help`` lists them); a setting a parameter of its own sets is refused here.
        max_restarts: in-job restarts of the worker group by ft_launcher.
        backoff_limit: PyTorchJob pod restarts before the job fails.
        instance_type: EC2 instance type of the trainer nodes (empty = any); a documented one
            (``components.pytorchjob.INSTANCE_TYPES``) sizes GPUs, EFA, CPU, memory and /dev/shm to it.
        fsx_pvc: the FSx PersistentVolumeClaim mounted into the trainer pods.
        service_account: service account of the trainer pods (empty = the namespace default).
        backend: ``pytorchjob`` (or its old name ``cluster``), ``trainjob`` or ``local``; the job settings are
            checked as the chosen kind's builder checks them (``trainjob``: against the ``goodput-nvrx`` runtime,
            or the one ``runtime`` names), not for ``local``.
        image: trainer image (checked for the cluster backends).
        nodes: nodes in the job, at least 1.
        gpus_per_node: GPUs per pod; -1 = the mesh's ranks over ``nodes`` when ``dp_replicate`` and ``dp_shard`` are
            both given, else every GPU of ``instance_type`` (8 without one).
        gpu_resource: ``nvidia.com/gpu``, or a MIG slice such as ``nvidia.com/mig-3g.40gb``.
        efa_per_node: EFA interfaces per pod; -1 = the instance type's.
        cpu: CPU request per pod; empty = the node's allocatable less the DaemonSets.
        memory: memory per pod; empty = as for cpu.
        shm_size: /dev/shm per pod; empty = a quarter of the memory.
        node_group: EKS node group of the trainer pods (empty = any).
        scheduler: gang scheduler: empty, volcano, scheduler-plugins or yunikorn; or kueue (the job waits in a
            Kueue LocalQueue until admitted).
        queue: the job's queue (Volcano queue, YuniKorn root.<name>, or the Kueue LocalQueue, e.g. goodput).
        nvrx_release: NVRx release of the trainer image; empty = the pinned one (``compat.IMAGE_RELEASE``).
        hot_spares: standby nodes beyond ``nodes`` (NVRx 0.6+, PyTorchJob only).
        node_health_check_endpoint: Unix socket of the node health daemon (NVRx 0.6+); empty = none.
        spot: spot nodes allowed (checked for the cluster backends); the trainer then watches for spot interruption
            notices (``spot.watch``) unless ``trainer_config`` says otherwise.
        registry: the model registry (a directory, ``s3://bucket/prefix``, ``mlflow://HOST:PORT`` or
            ``mlflow+https://HOST``), for ``init_from=production`` and evaluate; another scheme is refused.
        model_name: the model's name in the registry; empty = the model's (``registry_name``).
        endpoint_url: S3-compatible endpoint for ``s3://`` init_from and registry; empty for AWS S3.
        evaluate_gpu_resource: the evaluate pod's GPU: ``nvidia.com/gpu``, a MIG slice such as
            ``nvidia.com/mig-3g.40gb``, or empty for a CPU pod.
        baseline: the model evaluate scores beside the run's: a Hugging Face directory, or ``init_from`` (the
            one the run started from); empty = none.
        require_beat_baseline: promote only a model better than ``baseline`` (which must then be given).
        train_timeout_s: the train step's deadline in seconds (above 0); with Kueue it runs from admission.
        admission_timeout_s: scheduler=kueue: how long the job may wait for admission (above 0); past it the
            step fails naming the queue and Kueue's reason.
        stage_parallelism: most stage worker pods (at least 1).
        eval_tasks: evaluate's lm-evaluation-harness tasks: names and task files (``components.eval_tasks``).
        eval_limit: examples per task (0: all).
        promote_on: ``val_loss`` or ``task:<task>/<metric>`` of a task in ``eval_tasks``.
        reachable: FSx, the registry and S3 can be read from here; False (``goodput run`` before submitting)
            leaves what needs them, and a model package installed only in the trainer image, to the step.

    Raises:
        ValueError: a setting the trainer or the job builder would reject.
    """
    from components.job_kinds import backend_name
    from components.pytorchjob import GPU_RESOURCE, GPU_RESOURCE_PATTERN, INSTANCE_TYPES, JobSpec
    from trainer.config import ModelConfig, _torch_available, record_settings
    from trainer.launch import check_faults
    from trainer.mesh import check_launch

    if not run_id or "{{$" in run_id:
        raise ValueError(f"run_id {run_id!r} must be set: pass dsl.PIPELINE_JOB_ID_PLACEHOLDER from the pipeline")
    for what, value, least in (("nodes", int(nodes), 1), ("gpus_per_node", int(gpus_per_node), -1),
                               ("stage_parallelism", int(stage_parallelism), 1)):
        if value < least:
            raise ValueError(f"{what} must be at least {least}, got {value}"
                             + (" (-1: every GPU of instance_type)" if what == "gpus_per_node" else ""))
    if not float(train_timeout_s) > 0:
        raise ValueError(f"train_timeout_s must be above 0 seconds, got {train_timeout_s}")
    if not float(admission_timeout_s) > 0:
        raise ValueError(f"admission_timeout_s must be above 0 seconds, got {admission_timeout_s}")
    if float(admission_timeout_s) != 86400.0 and scheduler != "kueue":
        raise ValueError(f"admission_timeout_s={admission_timeout_s} is how long Kueue may keep the job queued: set "
                         "scheduler=kueue and queue (a LocalQueue), or leave it at its default")
    if evaluate_gpu_resource and not GPU_RESOURCE_PATTERN.match(evaluate_gpu_resource):
        raise ValueError(f"evaluate_gpu_resource {evaluate_gpu_resource!r} must be empty (a CPU pod), nvidia.com/gpu "
                         f"or a MIG slice like nvidia.com/mig-3g.40gb")
    if model_config.strip():       # inline JSON here (the trainer's --model-config also takes a file)
        try:
            fields = json.loads(model_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"model_config is not valid JSON ({e.msg} at column {e.colno}): {model_config[:80]!r}; "
                             f"give an object such as {{\"n_layers\": 8}}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"model_config must be a JSON object of model fields, e.g. {{\"n_layers\": 8}}; got "
                             f"{model_config[:80]!r}")
    if registry:
        from components.register import check_registry_uri

        check_registry_uri(registry)
    from components.eval_tasks import check_task_settings

    check_task_settings(eval_tasks, eval_limit, promote_on)
    root = str(fsx_root).rstrip("/")
    name = registry_name(model, model_name)
    source, init_dir = resolve_init_from(init_from, fsx_root=root, registry=registry, model_name=name,
                                         endpoint_url=endpoint_url, reachable=reachable)
    baseline_dir = _baseline_dir(baseline, init_from, init_dir, require_beat_baseline, reachable)
    run_dir = str(layout.run_dir(root, run_id))
    own = {"max_steps": max_steps, "ckpt_every": ckpt_every, "ckpt_mirror": ckpt_mirror.strip(),
           "require_mirror": require_mirror, "model": model,
           # With init_from the directory's config.json is the architecture: a flavor would be ignored.
           "model_flavor": "" if init_from.strip() else model_flavor, "model_config": model_config.strip(),
           "init_from": init_dir, "seq_len": seq_len, "batch_size": batch_size, "parallel": parallel,
           "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "seed": seed,
           "inject_fault": [f.strip() for f in inject_fault.split(",") if f.strip()]}
    data = str(layout.dataset_dir(root, dataset_name, dataset_version))
    cfg = _trainer_settings(trainer_config or {}, own, data=data, out=run_dir, endpoint_url=endpoint_url)
    if spot and backend_name(backend) != "local" and "watch" not in (trainer_config or {}).get("spot", {}):
        # On spot nodes the trainer watches for the two-minute notice, and checkpoints when it comes.
        cfg.spot.watch = True
    with _config_to_check(source, init_dir, endpoint_url, reachable) as config_dir:
        # Checked where the run's files can be read (the step's pod, a local run); before submitting, a model
        # only the trainer image has is left to the step, and so is an init_from (its architecture decides).
        model_checked = (reachable or _model_importable(model)) and (config_dir or not init_dir)
        checked = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=config_dir or "")
                                      if model_checked else ModelConfig(seq_len=cfg.model.seq_len))
        try:
            checked.validate()
        except ValueError as e:
            raise ValueError(f"trainer_config and the parameters: {e}") from None
        vocab = tokenizer_vocab(tokenizer, reachable)
        if model_checked and vocab is not None and _torch_available():
            _check_vocab(checked, vocab, tokenizer)
        shape = INSTANCE_TYPES.get(instance_type)
        gpus = int(gpus_per_node) if int(gpus_per_node) >= 0 else _gpus_from_mesh(cfg.parallel, int(nodes), shape)
        job = {"launch": {"max_restarts": int(max_restarts)}, "backoff_limit": int(backoff_limit), "pvc": fsx_pvc,
               "fsx_mount": root or "/", "instance_type": instance_type, "service_account": service_account,
               "gpus_per_node": gpus, "gpu_resource": gpu_resource, "efa_per_node": int(efa_per_node), "cpu": cpu,
               "memory": memory, "shm_size": shm_size, "node_group": node_group, "scheduler": scheduler,
               "queue": queue, "nvrx_release": nvrx_release, "hot_spares": int(hot_spares),
               "node_health_check_endpoint": node_health_check_endpoint,
               **({"admission_timeout_s": float(admission_timeout_s)} if scheduler == "kueue" else {})}
        backend = backend_name(backend)
        if backend != "local":      # the local backend's rank count is the train step's local_nproc
            # A fault on a rank or a step the job does not have would never fire.
            check_faults(cfg.faults.inject_fault, int(nodes) * gpus, cfg.run.max_steps)
            # The device mesh must be the job's ranks: nodes x GPUs per node.
            mesh = cfg.parallel
            check_launch(mesh.parallel, mesh.dp_replicate, mesh.dp_shard, mesh.tp, gpus,
                         range(int(nodes), int(nodes) + 1))
        # The job builder checks the trainer's arguments too: those checked above, for the same reason.
        spec = {**{k: v for k, v in job.items() if k != "admission_timeout_s"}, "image": image, "nodes": int(nodes),
                "spot": bool(spot), "trainer": checked.document()}
        if backend == "pytorchjob":
            JobSpec.from_dict(spec).validate()
        elif backend == "trainjob":
            from components.trainjob import RuntimeSpec, build_trainjob

            build_trainjob(JobSpec.from_dict(spec), RuntimeSpec())
    if reachable and Path(root).is_dir():      # FSx mounted (the step's pod, a local run): the run's record
        record_settings(Path(run_dir), cfg)
    return TrainSettings(cfg.document(), job, run_dir, source, init_dir, name, baseline_dir,
                         evaluate_gpu_resource or GPU_RESOURCE, 1 if evaluate_gpu_resource else 0)


def check_run_parameters(params: dict, *, reachable: bool = False) -> None:
    """Check a run's pipeline parameters (the pipeline's defaults filled in) as the check-settings step will.

    ``goodput run`` calls this before submitting. Parameters of other steps are ignored; ``run_id`` is a
    stand-in (the real one exists only once KFP starts the run).

    Raises:
        ValueError: a setting the trainer or the job builder would reject.
    """
    renamed = {"service_account": "trainer_service_account", "image": "trainer_image",
               "endpoint_url": "s3_endpoint_url"}
    wanted = set(inspect.signature(build_train_config).parameters) - {"run_id", "reachable"}
    kwargs = {name: params[renamed.get(name, name)] for name in wanted if renamed.get(name, name) in params}
    build_train_config(run_id="run-id", reachable=reachable, **kwargs)
