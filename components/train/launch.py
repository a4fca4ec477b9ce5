"""The train step: the trainer as a Kubeflow PyTorchJob or TrainJob on EKS, or as ``goodput train`` here.

The backends are named for what they launch:

- ``pytorchjob`` (``cluster`` is its old name): a Training Operator PyTorchJob (``components.train.pytorchjob``);
- ``trainjob``: a Kubeflow Trainer v2 TrainJob (``components.train.trainjob``) referencing a ClusterTrainingRuntime
  (``goodput-nvrx``, or ``job["runtime"]``), which must be installed: it is read first, and a missing one is
  refused before anything is created;
- ``local``: ft_launcher processes on this machine.

A cluster backend creates the job under a name derived from the KFP run and task (a restarted launcher
re-attaches instead of creating a duplicate), supervises it (``components.train.supervise``, one supervisor for both
kinds: phases, restarts, the master's log, a reason on failure, deletion on cancel or timeout) and reads
``summary.json`` from FSx. ``backend="local"`` runs the same trainer
settings through ``trainer.launch.run_local_training``, so the pipeline runs end to end without a
cluster. Either way the outputs are a ``Model`` (URI: the run's checkpoint directory) and ``Metrics``
(the summary's numbers).

Core, without KFP::

    from components.train.launch import train
    result = train("local", {"run": {"max_steps": 20}}, run_id="dev", task_name="train", fsx_root="fsx")

The pipeline passes ``run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER`` and
``task_name=dsl.PIPELINE_TASK_NAME_PLACEHOLDER`` (also the defaults), mounts FSx at ``fsx_root`` with
``kubernetes.mount_pvc`` and runs the step as a service account bound by ``deploy/rbac.yaml``.
"""

# No `from __future__ import annotations`: KFP reads the component's annotations as types.
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

from kfp import dsl
from kfp.dsl import Metrics, Model, Output

from components.train.parameters import TRAINER_IMAGE
from trainer import layout

__all__ = ["TrainResult", "train", "train_op", "write_outputs", "local_launch", "BASE_IMAGE", "TRAINER_IMAGE"]

# The image the component runs in (this package and kfp installed), and the trainer image of the
# job's pods (CUDA torch, nvidia-resiliency-ext, this package). Override at compile time.
BASE_IMAGE = os.environ.get("GOODPUT_COMPONENT_IMAGE", "ghcr.io/goodput-pipelines/goodput:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


def _component(passthroughs: tuple[str, ...] = (), **kw):
    # Inside a running step (_KFP_RUNTIME=true) kfp.dsl has no ``component`` (nor TaskConfigField), yet
    # the step's body imports this module for ``train``: there the function stays a plain function.
    if os.environ.get("_KFP_RUNTIME") == "true":
        return lambda func: func
    fields = [getattr(dsl.TaskConfigField, f) for f in passthroughs]
    # The FSx volume goes to the job's pods and stays on this launcher's pod too: it reads summary.json.
    volumes = dsl.TaskConfigPassthrough(field=dsl.TaskConfigField.KUBERNETES_VOLUMES, apply_to_task=True)
    return dsl.component(task_config_passthroughs=[*fields, volumes], **kw)


@dataclass
class TrainResult:
    backend: str
    job_name: str
    run_dir: str                       # as seen by this process (under fsx_root)
    checkpoint_dir: str
    summary: dict
    latest_step: int | None = None     # newest committed checkpoint
    namespace: str = ""
    job_restarts: dict = field(default_factory=dict)   # cluster: pod/container restarts per replica type
    reattached: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def train(backend: str, trainer_config: dict, *, run_id: str, task_name: str, fsx_root: str | Path,
          job: dict | None = None, namespace: str = "", kube_api: str = "", supervise=None,
          local_nproc: int = 2, local_nodes: int = 1, log: Callable[[str], None] = print) -> TrainResult:
    """Run the trainer to the end on the chosen backend; return where the run is and its summary.

    Args:
        backend: ``pytorchjob`` (``cluster``), ``trainjob`` or ``local`` (ft_launcher processes here).
        trainer_config: the trainer's settings, ``{section: {field: value}}`` (``trainer.config``); ``run.out``
            defaults to ``<fsx>/runs/<job name>``, ``data.data`` to the default dataset on FSx.
        run_id: KFP run id; with ``task_name`` it names the job (and the default run directory).
        task_name: KFP task name.
        fsx_root: where FSx is mounted in this process (the launcher pod, or a local directory).
        job: ``JobSpec`` settings (cluster), e.g. ``{"image": ..., "nodes": 4, "spot": True}``; for
            ``trainjob`` also ``runtime``: the ClusterTrainingRuntime's name or its ``RuntimeSpec`` settings.
        namespace: namespace of the job; empty = this pod's namespace.
        kube_api: Kubernetes API URL; empty = in-cluster config (tests and ``kubectl proxy`` set it).
        supervise: a ``SuperviseConfig`` (timeouts, retries, log streaming).
        local_nproc: ranks per node of the local backend.
        local_nodes: nodes of the local backend (node process trees on this machine, ``trainer.launch.LocalCluster``).
        log: where progress lines go.

    Raises:
        ValueError: bad settings, before anything starts. RuntimeError (``JobFailed``, ``JobCancelled``,
        ``JobTimeout``): the run did not finish; the message says why.
    """
    from components.train.job_kinds import backend_name
    from components.train.pytorchjob import job_name_for

    backend = backend_name(backend)
    if not run_id or "{{$" in run_id or not task_name or "{{$" in task_name:
        raise ValueError(f"run_id ({run_id!r}) and task_name ({task_name!r}) must be set: pass "
                         "dsl.PIPELINE_JOB_ID_PLACEHOLDER and dsl.PIPELINE_TASK_NAME_PLACEHOLDER from the pipeline")
    name = (job or {}).get("name") or job_name_for(run_id, task_name)
    if backend == "local":
        return _train_local(trainer_config, name, Path(fsx_root), job or {}, local_nproc, local_nodes, log)
    return _train_cluster(backend, trainer_config, name, run_id, task_name, Path(fsx_root), job or {}, namespace,
                          kube_api, supervise, log)


def local_launch(job: dict, nproc: int, name: str, nodes: int = 1):
    """The local backend's launch settings: ``nodes`` nodes of ``nproc`` ranks with the rendezvous a TrainJob's pods get
    (c10d on node 0's address and a port, the job's name as its id), so that what runs here is a TrainJob's
    trainer command (``components.train.trainjob.trainer_command``) with the ``PET_*`` values of each node."""
    import socket

    from components.train.pytorchjob import JobSpec

    launch = JobSpec.from_dict({k: v for k, v in job.items() if k == "launch"}).launch
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    launch.nproc_per_node, launch.nnodes = nproc, nodes
    launch.rdzv_endpoint, launch.rdzv_id = f"127.0.0.1:{port}", name
    return launch


def _train_local(trainer_config: dict, name: str, fsx_root: Path, job: dict, nproc: int, nodes: int,
                 log) -> TrainResult:
    import json

    from components.train.progress import follow_file
    from trainer.config import TrainConfig, settings_values
    from trainer.launch import run_local_training

    values = settings_values(trainer_config, "trainer_config")
    values["run"].setdefault("out", str(layout.run_dir(fsx_root, name)))
    cfg = TrainConfig.from_values(values)
    out = Path(cfg.run.out).resolve()
    launch = local_launch(job, nproc, name, nodes)
    log(f"local training: {nodes} x {nproc} ranks under ft_launcher, settings {json.dumps(cfg.document())}")
    with follow_file(out, log):
        # The check-settings step built the model to check it: the launch does not import torch for it again.
        code, summary = run_local_training(cfg, launch, fsx_root, model_checked=True)
    if code in (130, 143):
        raise RuntimeError(f"local training was interrupted ({'SIGINT' if code == 130 else 'SIGTERM'}); the ranks "
                           f"committed a checkpoint in {layout.checkpoints_dir(out)}")
    if code == 2:
        # The trainer refused something that would fail the same way again (settings, data): not retried.
        raise ValueError(f"local training refused its settings or data (exit code 2); the run directory is {out} "
                         "(events.jsonl says why)")
    if code != 0:
        raise RuntimeError(f"local training failed with exit code {code}; the run directory is {out} "
                           "(events.jsonl says what happened)")
    if summary is None:
        raise RuntimeError(f"local training stopped before its last step (SIGTERM); the last committed "
                           f"checkpoint is in {layout.checkpoints_dir(out)}")
    return _result("local", name, out, summary)


def _train_cluster(backend, trainer_config: dict, name, run_id, task_name, fsx_root: Path, job: dict,
                   namespace: str, kube_api: str, supervise, log) -> TrainResult:
    from components.train.pytorchjob import JobSpec, job_manifest
    from components.train.supervise import api_client, current_namespace, run_job
    from trainer.config import check_run_directory

    job = dict(job)
    runtime = job.pop("runtime", None)
    admission = job.pop("admission_timeout_s", None)
    settings = {**job, "name": name, "run_id": run_id, "task_name": task_name, "trainer": trainer_config}
    settings["namespace"] = namespace or job.get("namespace") or (current_namespace() if not kube_api else "default")
    spec = JobSpec.from_dict(settings)
    # Everything is validated before the first request.
    if backend == "trainjob":
        from components.train.trainjob import RuntimeSpec, trainjob_manifest

        rt = RuntimeSpec.from_dict({"name": runtime} if isinstance(runtime, str) else runtime or {})
        manifest = trainjob_manifest(spec, rt)
    elif runtime is not None:
        raise ValueError("job setting 'runtime' (a ClusterTrainingRuntime) is for backend=trainjob")
    else:
        manifest = job_manifest(spec)
    if admission is not None:
        supervise = _with_admission_timeout(supervise, admission, spec.scheduler)
    what = manifest["kind"]
    cfg = spec.trainer_config()
    out = PurePosixPath(cfg.run.out)
    local_out = fsx_root / out.relative_to(spec.fsx_mount)
    check_run_directory(local_out, cfg)
    client = api_client(kube_api)
    if backend == "trainjob":
        _check_runtime(client, rt.name, log)
    log(f"{what} {spec.namespace}/{name}: {spec.nodes} node(s) x {spec.procs} process(es), image "
        f"{spec.image}, run directory {out} (here {local_out})")
    outcome = run_job(manifest, namespace=spec.namespace, client=client, cfg=supervise, log=log)
    summary_path = layout.summary_path(local_out)
    if not summary_path.is_file():
        raise RuntimeError(f"{what} {spec.namespace}/{name} succeeded but {summary_path} is missing: is the "
                           f"FSx claim {spec.pvc!r} mounted at {fsx_root} in this pod?")
    import json

    result = _result(backend, name, local_out, json.loads(summary_path.read_text()))
    result.namespace, result.job_restarts, result.reattached = spec.namespace, outcome.restarts, not outcome.created
    return result


def _with_admission_timeout(supervise, seconds, scheduler: str):
    """``supervise`` with the job setting ``admission_timeout_s``: how long Kueue may keep the job queued."""
    import dataclasses

    from components.train.supervise import SuperviseConfig

    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = math.nan
    if not value > 0:
        raise ValueError(f"job setting admission_timeout_s must be a number of seconds above 0, got {seconds!r}")
    if scheduler != "kueue":
        raise ValueError("job setting admission_timeout_s is how long Kueue may keep the job queued: set "
                         "scheduler=kueue and queue (a LocalQueue)")
    return dataclasses.replace(supervise or SuperviseConfig(), admission_timeout_s=value)


def _check_runtime(client, name: str, log) -> None:
    """Refuse a TrainJob whose ClusterTrainingRuntime is not installed (the Trainer's webhook would reject it
    with less to go on); a launcher not allowed to read runtimes goes on and leaves the check to the webhook."""
    from kubernetes import client as k8s
    from kubernetes.client.rest import ApiException

    from components.train.trainjob import API_VERSION

    group, version = API_VERSION.split("/")
    try:
        k8s.CustomObjectsApi(client).get_cluster_custom_object(
            group, version, "clustertrainingruntimes", name, _request_timeout=30)
    except ApiException as e:
        if e.status == 404:
            raise ValueError(f"ClusterTrainingRuntime {name!r} is not installed (or the Trainer v2 CRDs are "
                             "missing): install it with `kubectl apply --server-side -k deploy/trainer-v2/runtime`"
                             " (deploy/trainer-v2/README.md), or name an installed one") from None
        if e.status != 403:
            raise
        log(f"cannot read ClusterTrainingRuntime {name} (403; deploy/trainer-v2/rbac.yaml grants it): "
            "creating the TrainJob unchecked")


def _result(backend: str, name: str, out: Path, summary: dict) -> TrainResult:
    from trainer.layout import committed_steps
    from trainer.mirror import mirror_warning

    # Said again where the step's log ends: the trainer's own warnings may be far up, or in another pod's log.
    warning = mirror_warning(summary.get("mirror"))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    ckpt = layout.checkpoints_dir(out)
    steps = committed_steps(ckpt)
    return TrainResult(backend, name, str(out), str(ckpt), summary, steps[-1] if steps else None)


def job_settings_from_task_config(tc, job: dict) -> dict:
    """``job`` completed with the pod settings the pipeline put on the train task (``dsl.TaskConfig``).

    ``task.set_accelerator_limit(8)``, ``.set_cpu_request``, ``.set_memory_limit``, ``.set_env_variable``,
    ``kubernetes.add_toleration`` and ``kubernetes.add_node_selector`` reach the job's pods instead of
    the launcher's pod. Settings in ``job`` win over the task's.
    """
    if tc is None:
        return dict(job)
    out = dict(job)
    res = getattr(tc, "resources", None) or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    gpus = limits.get("nvidia.com/gpu", requests.get("nvidia.com/gpu"))
    if gpus is not None and "gpus_per_node" not in job:
        out["gpus_per_node"] = int(gpus)
    cpu = requests.get("cpu", limits.get("cpu"))
    if cpu is not None and "cpu" not in job:
        out["cpu"] = str(cpu)
    memory = limits.get("memory", requests.get("memory"))
    if memory is not None and "memory" not in job:
        out["memory"] = str(memory)
    if getattr(tc, "node_selector", None):
        out["node_selector"] = {**tc.node_selector, **job.get("node_selector", {})}
    if getattr(tc, "tolerations", None):
        out["tolerations"] = [*job.get("tolerations", []), *tc.tolerations]
    env = {e["name"]: e["value"] for e in (getattr(tc, "env", None) or []) if "value" in e}
    if env:
        out["env"] = {**env, **job.get("env", {})}
    return out


def flat_metrics(summary: dict, prefix: str = "") -> dict[str, float]:
    """The summary's numbers (nested dicts joined with '_'), for KFP Metrics."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_metrics(v, key + "_"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def write_outputs(result: TrainResult, model, metrics) -> None:
    """Fill the step's Model (the checkpoint directory) and Metrics (from summary.json)."""
    s = result.summary
    model.uri = result.checkpoint_dir
    latest = (f"{result.checkpoint_dir}/step_{result.latest_step:09d}" if result.latest_step is not None else "")
    model.metadata.update({k: v for k, v in {
        "framework": "pytorch", "format": "torch-dcp", "backend": result.backend, "job_name": result.job_name,
        "namespace": result.namespace, "run_dir": result.run_dir, "latest_checkpoint": latest,
        "latest_step": -1 if result.latest_step is None else result.latest_step,
        "params_sha256": s.get("params_sha256") or "", "steps": s.get("steps", 0),
        "final_val_loss": s.get("final_val_loss"), "reattached": result.reattached,
    }.items() if v is not None})
    for key, value in flat_metrics(s).items():
        metrics.log_metric(key, value)
    for rtype, n in sorted(result.job_restarts.items()):
        metrics.log_metric(f"job_restarts_{rtype.lower()}", float(n))


@_component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False,
            # Pod settings on the task go to the job's pods, not to this launcher's pod.
            passthroughs=("RESOURCES", "ENV", "KUBERNETES_TOLERATIONS", "KUBERNETES_NODE_SELECTOR"))
def train_op(
    backend: str = "pytorchjob",
    trainer_config: dict = {},
    image: str = "ghcr.io/goodput-pipelines/trainer:0.1.0",     # TRAINER_IMAGE: KFP runs the source alone
    nodes: int = 1,
    gpus_per_node: int = 8,
    spot: bool = False,
    job_options: dict = {},
    namespace: str = "",
    timeout_s: float = 7 * 86400.0,
    fsx_root: str = "/fsx",
    local_nproc: int = 2,
    local_nodes: int = 1,
    kube_api: str = "",
    run_id: str = dsl.PIPELINE_JOB_ID_PLACEHOLDER,
    task_name: str = dsl.PIPELINE_TASK_NAME_PLACEHOLDER,
    *,
    task_config: dsl.TaskConfig,
    model: Output[Model],
    metrics: Output[Metrics],
):
    """Train under NVRx: a PyTorchJob (backend=pytorchjob) or a TrainJob (backend=trainjob) on EKS, or
    `goodput train` here (backend=local).

    Args:
        backend: ``pytorchjob`` (or its old name ``cluster``), ``trainjob`` or ``local``.
        trainer_config: the trainer's settings, ``{"section": {"field": value}}`` (``python -m trainer --help``);
            ``run.out`` defaults to ``<fsx>/runs/<job name>``, ``data.data`` to the default dataset on FSx.
        image: trainer image of the job's pods (cluster).
        nodes: pods (nodes) in the job (cluster).
        gpus_per_node: GPUs per pod, one trainer process per GPU (cluster); a GPU limit set on the task
            (``set_accelerator_limit``) wins.
        spot: let the pods run on spot nodes (cluster).
        job_options: further ``components.train.pytorchjob.JobSpec`` settings by name, e.g. ``{"node_group":
            "p5", "scheduler": "volcano", "queue": "training", "launch": {"max_restarts": 5}}`` (Kueue:
            ``"scheduler": "kueue", "queue": "goodput", "admission_timeout_s": 3600``); trainjob:
            ``runtime``, the ClusterTrainingRuntime's name (default ``goodput-nvrx``) or its settings.
        namespace: namespace of the job; empty = the namespace of this step's pod.
        timeout_s: overall deadline in seconds (with Kueue: from admission); past it the job is deleted and the
            step fails.
        fsx_root: where FSx is mounted in this step's pod (cluster), or a local directory (local).
        local_nproc: ranks per node of the local backend.
        local_nodes: nodes of the local backend.
        kube_api: Kubernetes API URL; empty = this pod's service account (in-cluster).
        run_id: the KFP run id (names the job, so a retried step re-attaches).
        task_name: the KFP task name (names the job).
        task_config: the task's pod settings (GPU/CPU/memory, env, tolerations, node selector), set by
            the pipeline on this task and forwarded to the job's pods (cluster); ``job_options`` win.
        model: output; URI = the run's checkpoint directory on FSx, metadata = latest step, sha256, job.
        metrics: output; the numbers of the trainer's summary.json (steps, losses, restarts, goodput).
    """
    from components.train.supervise import SuperviseConfig
    from components.train.launch import job_settings_from_task_config, train, write_outputs

    job = job_settings_from_task_config(task_config, job_options)
    job.setdefault("gpus_per_node", gpus_per_node)
    job.update(image=image, nodes=nodes, spot=spot)
    result = train(backend, dict(trainer_config), run_id=run_id, task_name=task_name, fsx_root=fsx_root,
                   job=job if backend != "local" else {k: v for k, v in job_options.items() if k == "launch"},
                   namespace=namespace, kube_api=kube_api, supervise=SuperviseConfig(timeout_s=timeout_s),
                   local_nproc=local_nproc, local_nodes=local_nodes)
    write_outputs(result, model, metrics)
