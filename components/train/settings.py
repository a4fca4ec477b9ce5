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

    init_from                 the trainer's --init-from              staged first (components.stage.model)
    ""                        none (a fresh start)                   -
    /fsx/models/llama/v3      that Hugging Face directory, as is     -
    s3://bucket/llama3-1b     <fsx>/pretrained/bucket/llama3-1b      from that prefix
    production                the registry's production model:       from S3 when the registry is on S3
                              its directory on FSx, or staged
                              (no production model yet: an error, before anything is staged)

The KFP component is ``components.train.settings_op.train_config_op``; this module imports no kfp (nor torch:
the model is checked with torch when it is installed, as in the trainer image the step runs on).

    from components.train.settings import build_train_config
    settings = build_train_config(fsx_root="fsx", dataset_name="corpus", dataset_version="1", run_id="dev",
                                  model="llama", model_flavor="debug", max_steps=60, inject_fault="kill@30:1")
    settings.trainer_config, settings.job_options, settings.run_dir

``check_run_parameters`` applies the same checks to a whole set of pipeline parameters (``goodput run``
calls them before submitting, so ``nodes=0`` fails on the user's machine, not in a pod).
"""

import contextlib
import dataclasses
import importlib.util
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

from components.train.parameters import CHECKED, PARAMETERS, PIPELINE_SETTINGS, TrainSettings, resolve
from trainer import layout
from trainer.s3url import is_s3_url

PRODUCTION = "production"
"""``init_from`` value naming the registry's current production model."""
BASELINE_INIT_FROM = "init_from"
"""``baseline`` value naming the model the run started from (wherever ``init_from`` put it)."""
DECIDED_SETTINGS = {"data.data": "dataset_name and dataset_version", "run.out": "the run's id (runs/<run id>)",
                    "checkpoint.mirror_endpoint_url": "s3_endpoint_url"}
"""Trainer settings the pipeline decides from other parameters."""


def resolve_init_from(init_from: str, *, fsx_root: str, registry: str, model_name: str, endpoint_url: str = "",
                      reachable: bool = True) -> tuple[str, str]:
    """(S3 source to stage, the trainer's --init-from directory) for the ``init_from`` parameter.

    ``reachable``: FSx, the registry and S3 can be read from here (the step's pod; ``goodput run --local``).
    Without it (``goodput run`` checking before it submits) nothing is looked up.

    Raises:
        ValueError: no production model yet, one without a Hugging Face directory, a bad S3 URI.
    """
    from components.stage.model import staged_model_dir

    init_from = init_from.strip()
    if not init_from:
        return "", ""
    if init_from == PRODUCTION:
        from components.evaluate.mlflow_registry import is_mlflow

        if is_mlflow(registry):
            raise ValueError(f"init_from=production reads a directory or s3:// registry, not {registry}: give the "
                             f"production model's Hugging Face directory (s3:// or on FSx) as init_from")
        if not reachable:
            return "", ""
        from components.evaluate.register import PRODUCTION_FILE, Registry
        from components.evaluate.registry_format import HF_FORMAT

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
    from components.stage.dataset import parse_source

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
    from components.stage.tokenizer import parse_tokenizer

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


def _check_mlflow_answers(registry: str, timeout_s: float = 10.0) -> None:
    """An MLflow registry's server answers (any HTTP status will do: only reaching it is checked), so that a wrong
    address fails now and not in the evaluate step after training."""
    import urllib.error
    import urllib.request

    from components.evaluate.mlflow_registry import is_mlflow, tracking_uri

    if not is_mlflow(registry):
        return
    url = tracking_uri(registry).rstrip("/") + "/health"
    try:
        urllib.request.urlopen(url, timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass
    except (OSError, ValueError) as e:
        raise ValueError(f"registry {registry}: the MLflow server cannot be reached at {url} "
                         f"({getattr(e, 'reason', e)}); check the address, or that it runs") from None


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


def build_train_config(*, reachable: bool = True, record: bool = True, **params) -> TrainSettings:
    """The train step's inputs (``TrainSettings``), validated as the trainer and the job builder will.

    Args:
        params: the check-settings step's inputs by name (``components.train.parameters``: ``run_id``, ``backend``
            and the run's parameters it checks, described there); the rest take their defaults. The dataset is
            read from ``<fsx_root>/datasets/<dataset_name>/<dataset_version>``, where the stage step wrote it; the
            trainer writes to ``<fsx_root>/runs/<run_id>`` (a retried step resumes there, and evaluate reads it).
            The job settings are checked as the backend's builder checks them (``trainjob``: against the
            ``goodput-nvrx`` runtime), not for ``local``.
        reachable: FSx, the registry and S3 can be read from here; False (``goodput run`` before submitting)
            leaves what needs them, and a model package installed only in the trainer image, to the step.
        record: write the run's settings to its run directory (the step); False for a check before the run
            exists, which has no run directory of its own.

    Raises:
        ValueError: a setting the trainer or the job builder would reject, an unknown parameter, a value of the
            wrong type.
    """
    from components.train.job_kinds import backend_name
    from components.train.pytorchjob import GPU_RESOURCE, GPU_RESOURCE_PATTERN, INSTANCE_TYPES, JobSpec
    from trainer.config import ModelConfig, _torch_available, record_settings
    from trainer.launch import check_faults
    from trainer.mesh import check_launch

    p = SimpleNamespace(**resolve(params))
    if not p.run_id or "{{$" in p.run_id:
        raise ValueError(f"run_id {p.run_id!r} must be set: pass dsl.PIPELINE_JOB_ID_PLACEHOLDER from the pipeline")
    for what, least in (("nodes", 1), ("gpus_per_node", -1), ("stage_parallelism", 1)):
        if getattr(p, what) < least:
            raise ValueError(f"{what} must be at least {least}, got {getattr(p, what)}"
                             + (" (-1: every GPU of instance_type)" if what == "gpus_per_node" else ""))
    if not p.train_timeout_s > 0:
        raise ValueError(f"train_timeout_s must be above 0 seconds, got {p.train_timeout_s}")
    if not p.admission_timeout_s > 0:
        raise ValueError(f"admission_timeout_s must be above 0 seconds, got {p.admission_timeout_s}")
    if p.admission_timeout_s != PARAMETERS["admission_timeout_s"].default and p.scheduler != "kueue":
        raise ValueError(f"admission_timeout_s={p.admission_timeout_s:g} is how long Kueue may keep the job queued: "
                         "set scheduler=kueue and queue (a LocalQueue), or leave it at its default")
    if p.evaluate_gpu_resource and not GPU_RESOURCE_PATTERN.match(p.evaluate_gpu_resource):
        raise ValueError(f"evaluate_gpu_resource {p.evaluate_gpu_resource!r} must be empty (a CPU pod), "
                         f"nvidia.com/gpu or a MIG slice like nvidia.com/mig-3g.40gb")
    model_config = p.model_config.strip()
    if model_config:       # inline JSON here (the trainer's --model-config also takes a file)
        try:
            fields = json.loads(model_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"model_config is not valid JSON ({e.msg} at column {e.colno}): {model_config[:80]!r}; "
                             f"give an object such as {{\"n_layers\": 8}}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"model_config must be a JSON object of model fields, e.g. {{\"n_layers\": 8}}; got "
                             f"{model_config[:80]!r}")
    if p.registry:
        from components.evaluate.register import check_registry_uri

        check_registry_uri(p.registry)
        if reachable:
            _check_mlflow_answers(p.registry)
    from components.evaluate.tasks import check_task_settings

    check_task_settings(p.eval_tasks, p.eval_limit, p.promote_on)
    root = p.fsx_root.rstrip("/")
    from components.evaluate.register import registry_name

    name = registry_name(p.model, p.model_name)
    endpoint_url = p.s3_endpoint_url
    source, init_dir = resolve_init_from(p.init_from, fsx_root=root, registry=p.registry, model_name=name,
                                         endpoint_url=endpoint_url, reachable=reachable)
    baseline_dir = _baseline_dir(p.baseline, p.init_from, init_dir, p.require_beat_baseline, reachable)
    run_dir = str(layout.run_dir(root, p.run_id))
    # The parameters that are trainer settings, as the trainer takes them: stripped, a list split at commas,
    # init_from resolved; with init_from the directory's config.json is the architecture, so no flavor.
    own = {param: getattr(p, param) for param in PIPELINE_SETTINGS}
    own.update(ckpt_mirror=p.ckpt_mirror.strip(), model_config=model_config, init_from=init_dir,
               model_flavor="" if p.init_from.strip() else p.model_flavor,
               inject_fault=[f.strip() for f in p.inject_fault.split(",") if f.strip()])
    data = str(layout.dataset_dir(root, p.dataset_name, p.dataset_version))
    cfg = _trainer_settings(p.trainer_config, own, data=data, out=run_dir, endpoint_url=endpoint_url)
    backend = backend_name(p.backend)
    if p.spot and backend != "local" and "watch" not in p.trainer_config.get("spot", {}):
        # On spot nodes the trainer watches for the two-minute notice, and checkpoints when it comes.
        cfg.spot.watch = True
    with _config_to_check(source, init_dir, endpoint_url, reachable) as config_dir:
        # Checked where the run's files can be read (the step's pod, a local run); before submitting, a model
        # only the trainer image has is left to the step, and so is an init_from (its architecture decides).
        model_checked = (reachable or _model_importable(p.model)) and (config_dir or not init_dir)
        checked = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=config_dir or "")
                                      if model_checked else ModelConfig(seq_len=cfg.model.seq_len))
        try:
            checked.validate()
        except ValueError as e:
            raise ValueError(f"trainer_config and the parameters: {e}") from None
        vocab = tokenizer_vocab(p.tokenizer, reachable)
        if model_checked and vocab is not None and _torch_available():
            _check_vocab(checked, vocab, p.tokenizer)
        shape = INSTANCE_TYPES.get(p.instance_type)
        gpus = p.gpus_per_node if p.gpus_per_node >= 0 else _gpus_from_mesh(cfg.parallel, p.nodes, shape)
        job = {"launch": {"max_restarts": p.max_restarts}, "backoff_limit": p.backoff_limit, "pvc": p.fsx_pvc,
               "fsx_mount": root or "/", "instance_type": p.instance_type, "service_account": p.trainer_service_account,
               "gpus_per_node": gpus, "gpu_resource": p.gpu_resource, "efa_per_node": p.efa_per_node, "cpu": p.cpu,
               "memory": p.memory, "shm_size": p.shm_size, "node_group": p.node_group, "scheduler": p.scheduler,
               "queue": p.queue, "nvrx_release": p.nvrx_release, "hot_spares": p.hot_spares,
               "node_health_check_endpoint": p.node_health_check_endpoint,
               **({"admission_timeout_s": p.admission_timeout_s} if p.scheduler == "kueue" else {})}
        if backend != "local":      # the local backend's rank count is the train step's local_nproc
            # A fault on a rank or a step the job does not have would never fire.
            check_faults(cfg.faults.inject_fault, p.nodes * gpus, cfg.run.max_steps)
            # The device mesh must be the job's ranks: nodes x GPUs per node.
            mesh = cfg.parallel
            check_launch(mesh.parallel, mesh.dp_replicate, mesh.dp_shard, mesh.tp, gpus, range(p.nodes, p.nodes + 1))
        # The job builder checks the trainer's arguments too: those checked above, for the same reason.
        spec = {**{k: v for k, v in job.items() if k != "admission_timeout_s"}, "image": p.trainer_image,
                "nodes": p.nodes, "spot": p.spot, "trainer": checked.document()}
        if backend == "pytorchjob":
            JobSpec.from_dict(spec).validate()
        elif backend == "trainjob":
            from components.train.trainjob import RuntimeSpec, build_trainjob

            build_trainjob(JobSpec.from_dict(spec), RuntimeSpec())
    if record and reachable and Path(root).is_dir():      # FSx mounted (the step's pod, a local run): the run's record
        record_settings(Path(run_dir), cfg)
    return TrainSettings(cfg.document(), job, run_dir, source, init_dir, name, baseline_dir,
                         p.evaluate_gpu_resource or GPU_RESOURCE, 1 if p.evaluate_gpu_resource else 0)


def check_run_parameters(params: dict, *, reachable: bool = False) -> None:
    """Check a run's pipeline parameters (the pipeline's defaults filled in) as the check-settings step will.

    ``goodput run`` calls this before submitting. Parameters of other steps are ignored; ``run_id`` is a
    stand-in (the real one exists only once KFP starts the run).

    Raises:
        ValueError: a setting the trainer or the job builder would reject.
    """
    checked = {p.name for p in CHECKED} | {"backend"}
    build_train_config(run_id="run-id", reachable=reachable, record=False,
                       **{k: v for k, v in params.items() if k in checked})
