"""The goodput training pipeline: wiring only. Compile it with ``goodput compile -o goodput-pipeline.yaml``.

Each step is a component (``components/``); this module only connects them and says what their pods
get from Kubernetes (kfp-kubernetes): the FSx claim, placement, the S3 secret, retries and caching.

The train backend is chosen when the pipeline is compiled, so the KFP Create-run form shows only what a
cluster user sets: ``build_pipeline("pytorchjob")`` (``goodput_pipeline``, the default of ``goodput compile``)
and ``build_pipeline("trainjob")`` take the run's parameters (``components.train.parameters``, where they are
declared once); ``build_pipeline("local")`` (``goodput run --local``) adds ``local_nproc`` and ``local_nodes``. The
wiring is one function, ``_wire``, for all three.
"""

import inspect

from kfp import dsl

from components.train.cleanup_op import cleanup_op
from components.evaluate.evaluate_op import evaluate_op
from components.train.job_kinds import BACKENDS, backend_name
from components.evaluate.register_op import register_op
from components.stage.model_op import stage_model_op
from components.train.launch import train_op
from components.train.parameters import CHECKED, describe, for_backend
from components.train.settings_op import train_config_op
from pipelines import PIPELINE_NAME
from pipelines.pods import on_fsx, placed, with_mlflow_secret, with_s3_secret
from pipelines.stage_pipeline import stage_pipeline

DESCRIPTION = ("Stage a dataset to FSx, train under NVRx in a {kind}, evaluate the checkpoints and register the "
               "model if it is promoted.")
KINDS = {"pytorchjob": "PyTorchJob", "trainjob": "Kubeflow Trainer v2 TrainJob",
         "local": "local ft_launcher process tree (goodput run --local)"}


DOC = """Train a model (llama, bytegpt or your own) on EKS where a GPU failure costs seconds.

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
"""
"""The pipeline's description above its parameters (``{train}``: what the backend's train step runs); the Args,
the parameters' descriptions in the Create-run form, come from ``components.train.parameters``."""


TRAIN_STEPS = {
    "pytorchjob": "a Training Operator PyTorchJob of ``nodes`` x ``gpus_per_node`` under NVRx ft_launcher",
    "trainjob": "a Kubeflow Trainer v2 TrainJob on the goodput-nvrx runtime (deploy/trainer-v2) of ``nodes`` x "
                "``gpus_per_node`` under NVRx ft_launcher",
    "local": "``local_nodes`` x ``local_nproc`` ft_launcher ranks in the step itself",
}


def build_pipeline(backend: str = "pytorchjob"):
    """The goodput pipeline for a train backend: ``pytorchjob``, ``trainjob`` or ``local``.

    One wiring (``_wire``) under three signatures, made from ``components.train.parameters``: the local one
    also has ``local_nproc`` and ``local_nodes``. KFP reads a pipeline's parameters from its function's signature
    and docstring.
    """
    backend = backend_name(backend)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    params = for_backend(backend)
    names = [p.name for p in params]

    def goodput_pipeline(*args):
        _wire(backend, **dict(zip(names, args)))

    goodput_pipeline.__signature__ = inspect.Signature([
        inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=p.default, annotation=p.type)
        for p in params])
    goodput_pipeline.__doc__ = (DOC.replace("{train}", TRAIN_STEPS[backend]) + "\nArgs:\n"
                                + "\n".join(describe(p) for p in params))
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
        config = train_config_op(run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER, backend=backend,
                                 **{param.name: p[param.name] for param in CHECKED})
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
