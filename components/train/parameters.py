"""The run's parameters, declared once: the pipeline's Create-run form and the check-settings step's inputs (and
its outputs, ``TrainSettings``).

Each ``Parameter`` has a name, a type, a default and a description. One that is a trainer setting (``setting=``,
``section.field`` of ``trainer.config``) takes its type, default and description from the trainer's settings
tree, so the trainer's default is the pipeline's; the others (the job's shape, staging, evaluation) are declared
here with theirs. From ``PARAMETERS`` come:

- the pipeline's signature and the descriptions of its Create-run form (``pipelines.pipeline.build_pipeline``);
- the check-settings component, ``components/train/settings_op.py``, generated as source text (KFP reads a
  lightweight component's signature from its source): ``python -m components.train.parameters`` writes it, and
  tests/test_settings_contract.py fails when the file is not what this declaration makes;
- ``build_train_config``'s arguments (``resolve``: the defaults filled in, every value checked against its type)
  and the trainer setting each parameter of its own sets (``PIPELINE_SETTINGS``).

This module imports neither kfp nor torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

from components.evaluate.evaluate import UNIFORM_LOSS
from trainer.config import SECTIONS, coerce_value

TRAINER_IMAGE = "ghcr.io/goodput-pipelines/trainer:0.1.0"
"""The trainer image the project publishes: the trainer pods' and the check-settings step's default."""
FSX_MOUNT = "/fsx"
"""Where the FSx claim is mounted in the pipeline's pods."""
REQUIRED = inspect.Parameter.empty
"""The default of a parameter without one: the run must give it."""
ALL_BACKENDS = ("pytorchjob", "trainjob", "local")


@dataclass(frozen=True)
class Parameter:
    """One parameter of the run.

    ``checked``: an input of the check-settings step (``build_train_config``); the others are only the inputs of
    the steps that use them (staging, evaluation, the pods' placement). ``backends``: the pipelines that have it.
    """

    name: str
    type: type
    default: Any
    help: str
    setting: str = ""
    checked: bool = True
    backends: tuple[str, ...] = ALL_BACKENDS


def _p(name: str, type_: type, default: Any, help: str, **kw: Any) -> Parameter:
    return Parameter(name, type_, default, help, **kw)


def _s(name: str, setting: str, help: str = "") -> Parameter:
    """A parameter that is the trainer setting ``setting``: its type, default and (unless ``help``) description.
    A list setting (``faults.inject_fault``) is a comma-separated string in the form."""
    section, _, field_name = setting.partition(".")
    f = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == field_name)
    default = getattr(SECTIONS[section](), field_name)
    kind = {"str": str, "int": int, "float": float, "bool": bool, "list": list}[str(f.type)]
    if kind is list:
        return Parameter(name, str, ",".join(default), help or f.metadata["help"] + " (comma-separated)", setting)
    return Parameter(name, kind, default, help or f.metadata["help"], setting)


# The Create-run form, in its order. The Args of the pipeline's docstring, and so the form's descriptions.
_DECLARED = [
    _p("dataset_source", str, REQUIRED, "s3://bucket/prefix of the text files, or a directory visible to the stage "
       "pod.", checked=False),
    _p("dataset_name", str, "corpus", "dataset name on FSx."),
    _p("dataset_version", str, "latest", "dataset version on FSx (a directory name)."),
    _p("s3_endpoint_url", str, "", "S3-compatible endpoint (MinIO, ...) of every s3:// location of the run "
       "(dataset, init_from, registry, checkpoint mirror); empty for AWS S3."),
    _p("s3_secret", str, "goodput-s3", "Kubernetes secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, used if it "
       "exists.", checked=False),
    _p("tokenizer", str, "bytes", "bytes (one token per byte), a tokenizer.json / Hugging Face model directory / "
       "s3:// one, or bpe:VOCAB (a byte-level BPE trained on the staged text); its vocabulary must fit the model's."),
    _p("data_format", str, "auto", "auto (by file name), text, jsonl (.jsonl, .gz, .zst) or parquet.", checked=False),
    _p("text_field", str, "text", "the JSONL field holding a document.", checked=False),
    _p("text_column", str, "text", "the Parquet column holding a document.", checked=False),
    _p("dataset_include", str, "", "comma-separated globs of source paths to stage (empty: all).", checked=False),
    _p("dataset_exclude", str, "", "comma-separated globs of source paths to leave out.", checked=False),
    _p("dataset_train_glob", str, "", "comma-separated globs of the training split's files; they override the "
       "splits the source names (Hugging Face layouts) and the split by document.", checked=False),
    _p("dataset_val_glob", str, "", "comma-separated globs of the validation split's files.", checked=False),
    _p("dataset_val_tokens", int, 0, "when the source has no splits of its own, about this many tokens of documents "
       "in the validation split (0: 5% of the documents).", checked=False),
    _p("bad_record_policy", str, "skip", "skip (leave bad records out and report them) or fail.", checked=False),
    _p("refused_key_policy", str, "fail", "fail (unsafe object keys stop the run before anything is written) or "
       "skip.", checked=False),
    _p("stage_parallelism", int, 4, "most stage worker pods (one per GiB of source, at most this many)."),
    _s("model", "model.name"),
    _s("model_flavor", "model.flavor", "a named size of the model (llama: debug, llama3-1b, llama3-3b, llama3-8b, "
       "llama3-70b); empty = the model's default; ignored with init_from (the directory's config.json is the "
       "architecture)."),
    _s("model_config", "model.config", "inline JSON of model fields overriding the flavor's, e.g. "
       "{\"n_layers\": 8} (llama) or {\"n_layer\": 12, \"n_head\": 12, \"n_embd\": 768} (bytegpt); empty = none."),
    _s("init_from", "model.init_from", "weights a fresh run starts from (a run with a committed checkpoint resumes "
       "from that): a Hugging Face model directory on FSx, s3://bucket/prefix of one (staged to FSx first), or "
       "production (the registry's production model: a scheduled retrain continues from the last promoted one; the "
       "run fails at check settings if there is none yet); empty = random initialisation."),
    _s("seq_len", "model.seq_len"),
    _s("batch_size", "data.batch_size"),
    _s("max_steps", "run.max_steps"),
    _s("ckpt_every", "checkpoint.ckpt_every"),
    _s("ckpt_mirror", "checkpoint.mirror"),
    _s("require_mirror", "checkpoint.require_mirror"),
    _s("seed", "run.seed"),
    _s("parallel", "parallel.parallel"),
    _s("dp_replicate", "parallel.dp_replicate"),
    _s("dp_shard", "parallel.dp_shard"),
    _s("tp", "parallel.tp"),
    _p("nodes", int, 2, "nodes in the job (at least 1)."),
    _p("gpus_per_node", int, -1, "GPUs (trainer processes) per node; -1 = sized from the mesh when dp_replicate and "
       "dp_shard are both given (dp_replicate x dp_shard x tp over the nodes), else every GPU of instance_type (8 "
       "without one)."),
    _p("instance_type", str, "p5.48xlarge", "EC2 instance type of the trainer nodes (p5.48xlarge, p5e/p5en.48xlarge, "
       "p4d/p4de.24xlarge, g5/g6/g6e.*): sizes GPUs, EFA, CPU, memory and /dev/shm to it; empty = any node (set the "
       "sizes)."),
    _p("spot", bool, False, "let the trainer pods run on spot nodes; the trainer then watches for spot interruption "
       "notices (spot.watch) unless trainer_config says otherwise."),
    _p("gpu_resource", str, "nvidia.com/gpu", "nvidia.com/gpu, or a MIG slice such as nvidia.com/mig-3g.40gb for small "
       "jobs."),
    _p("efa_per_node", int, -1, "EFA interfaces per pod; -1 = the instance type's."),
    _p("cpu", str, "", "CPU request per trainer pod; empty = the node's allocatable less the DaemonSets."),
    _p("memory", str, "", "memory per trainer pod; empty = as for cpu."),
    _p("shm_size", str, "", "/dev/shm per trainer pod; empty = a quarter of the memory."),
    _p("node_group", str, "", "EKS node group of the trainer pods (eks.amazonaws.com/nodegroup); empty = any."),
    _p("scheduler", str, "", "gang scheduler of the trainer pods: empty, volcano, scheduler-plugins or yunikorn; or "
       "kueue: the job waits in a Kueue LocalQueue until admitted (deploy/kueue/)."),
    _p("queue", str, "", "the job's queue: a Volcano queue, a YuniKorn queue root.<name>, or a Kueue LocalQueue "
       "(goodput)."),
    _p("max_restarts", int, 3, "in-job restarts of the worker group by ft_launcher."),
    _p("backoff_limit", int, 3, "job restarts before it fails (PyTorchJob pod restarts; a TrainJob's must be its "
       "runtime's)."),
    _p("train_timeout_s", float, 3 * 86400.0, "deadline of the train step in seconds (with Kueue: from admission)."),
    _p("admission_timeout_s", float, 86400.0, "scheduler=kueue: how long the job may wait for admission before the "
       "step fails."),
    _s("inject_fault", "faults.inject_fault"),
    _p("promotion_threshold", float, UNIFORM_LOSS, "promote only below this validation loss (nats per token).",
       checked=False),
    _p("promotion_tolerance", float, 0.0, "and at most this much worse than the production model.", checked=False),
    _p("baseline", str, "", "a model scored on the same validation windows: a Hugging Face model directory on FSx, "
       "or init_from (the model the run started from, wherever init_from put it); empty = none."),
    _p("require_beat_baseline", bool, False, "promote only a model strictly better than baseline (checked before "
       "staging: it needs one)."),
    _p("evaluate_gpu_resource", str, "", "the evaluate pod's GPU: nvidia.com/gpu, or a MIG slice such as "
       "nvidia.com/mig-3g.40gb (a whole GPU is waste for scoring); empty = a CPU pod."),
    _p("model_name", str, "", "the model's name in the registry; empty = the model's (llama, bytegpt, your module's "
       "name)."),
    _p("registry", str, FSX_MOUNT + "/models", "model registry, a directory on FSx, s3://bucket/prefix, or an MLflow "
       "server: mlflow://HOST:PORT or mlflow+https://HOST (a registered model version, the alias production moved on "
       "promotion)."),
    _p("mlflow_secret", str, "goodput-mlflow", "Kubernetes secret with MLFLOW_TRACKING_TOKEN for an mlflow+https "
       "registry, used if it exists.", checked=False),
    _p("eval_tasks", str, "", "lm-evaluation-harness tasks scored on each checkpoint, comma-separated: harness task "
       "names (their datasets must be reachable from the evaluate pod), task files (.yaml) on FSx, or "
       "s3://bucket/prefix/file.yaml (the prefix is copied with it); empty = none."),
    _p("eval_limit", int, 0, "examples per task; 0 = all."),
    _p("promote_on", str, "val_loss", "val_loss, or task:<task>/<metric> (higher is better, e.g. "
       "task:arc_easy/acc_norm): picks the best checkpoint and is compared with the production model's recorded "
       "score."),
    _p("trainer_image", str, TRAINER_IMAGE, "image of the trainer pods."),
    _p("nvrx_release", str, "", "the NVRx release in trainer_image (its io.goodput.nvrx-release label); the pods' "
       "launch command is built for it; empty = the release the project's trainer image pins."),
    _p("hot_spares", int, 0, "nodes beyond nodes that stand by and take a failed node's place (NVRx 0.6+, PyTorchJob "
       "only)."),
    _p("node_health_check_endpoint", str, "", "Unix socket of a node health daemon on every node (NVRx 0.6+); empty "
       "= none."),
    _p("trainer_service_account", str, "", "service account of the trainer pods; empty = the namespace default."),
    _p("namespace", str, "", "namespace of the job; empty = the pipeline's.", checked=False),
    _p("fsx_pvc", str, "fsx-claim", "the FSx for Lustre PersistentVolumeClaim."),
    _p("fsx_root", str, FSX_MOUNT, "FSx path in the pods; keep /fsx on a cluster (the claim is mounted there)."),
    _p("step_node_selector", dict, {}, "nodeSelector of the step pods, e.g. "
       "{\"karpenter.sh/capacity-type\": \"on-demand\"}.", checked=False),
    _p("step_tolerations", list, [], "tolerations of the step pods (a list of Kubernetes toleration objects).",
       checked=False),
    _p("trainer_config", dict, {}, "any other trainer setting, as {\"section\": {\"field\": value}} or "
       "{\"section.field\": value}, e.g. {\"optim\": {\"lr\": 3e-4, \"warmup_steps\": 200}, \"data.grad_accum\": 4}; "
       "`python -m trainer --help` lists them (sections " + ", ".join(SECTIONS) + "). Checked with the rest at check "
       "settings; a setting that has a parameter of its own is set there."),
    _p("local_nproc", int, 2, "ranks per node of the local backend (trainer processes on this machine).",
       checked=False, backends=("local",)),
    _p("local_nodes", int, 1, "nodes of the local backend: separate node process trees on this machine.",
       checked=False, backends=("local",)),
]
PARAMETERS: dict[str, Parameter] = {p.name: p for p in _DECLARED}
"""Every parameter of the run, by name, in the form's order."""
PIPELINE_SETTINGS: dict[str, str] = {p.name: p.setting for p in _DECLARED if p.setting}
"""The trainer setting each pipeline parameter of its own sets; ``trainer_config`` sets the others."""
CHECKED = [p for p in _DECLARED if p.checked]
"""The check-settings step's inputs from the pipeline's parameters (besides ``STEP_INPUTS``)."""
STEP_INPUTS = [
    Parameter("run_id", str, REQUIRED, "the KFP run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER); names the run directory, "
              "<fsx_root>/runs/<run_id>."),
    Parameter("backend", str, "pytorchjob", "the train backend the pipeline was compiled for: pytorchjob (or its old "
              "name cluster), trainjob or local; the job settings are checked as that kind's builder checks them."),
]
"""The check-settings step's inputs the pipeline sets itself, not the user."""


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


def for_backend(backend: str) -> list[Parameter]:
    """The parameters of the pipeline compiled for ``backend``."""
    return [p for p in _DECLARED if backend in p.backends]


def resolve(values: dict[str, Any]) -> dict[str, Any]:
    """The check-settings step's arguments: ``values`` (by name) checked against their types, the defaults filled
    in. A name that is not an input of the step, a missing required one or a value of another type is a ValueError
    naming it."""
    declared = {p.name: p for p in (*STEP_INPUTS, *CHECKED)}
    for name in sorted(set(values) - set(declared)):
        close = difflib.get_close_matches(name, declared, n=1)
        hint = f"did you mean {close[0]}?" if close else "components.train.parameters lists them"
        raise ValueError(f"unknown run parameter {name} ({hint})")
    out = {}
    for name, p in declared.items():
        if name not in values and p.default is REQUIRED:
            raise ValueError(f"the run parameter {name} is required")
        out[name] = coerce_value(p.type, values[name], name) if name in values else p.default
    return out


def describe(p: Parameter, indent: int = 4) -> str:
    """``name: help``, wrapped as a Google-style docstring's Args entry (what KFP shows in the form)."""
    return textwrap.fill(f"{p.name}: {p.help}", width=116 - indent, initial_indent=" " * indent,
                         subsequent_indent=" " * (indent + 4), break_on_hyphens=False, break_long_words=False)


# ------------------------------------------------------------------------------------------------ the component
OP_PATH = Path(__file__).with_name("settings_op.py")
_HEADER = """\
# Generated by python -m components.train.parameters; do not edit (components/train/parameters.py declares the run).
\"\"\"KFP component: check the run's settings and build the train step's inputs (``components.train.settings``).

Its inputs are the run's parameters of ``components.train.parameters`` that the check needs (``CHECKED``) and the
two the pipeline sets (``STEP_INPUTS``); KFP reads a lightweight component's inputs from its source, so this file
is generated from that declaration.
\"\"\"

import os
from typing import NamedTuple

from kfp import dsl

# The image the component runs in. The check-settings step runs on the trainer image (it builds the model
# to check it, with torch and the user's model package); ``goodput compile --trainer-image`` sets it.
BASE_IMAGE = os.environ.get("GOODPUT_TRAINER_IMAGE", "{image}")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def train_config_op(
"""


def render_op() -> str:
    """The source of ``components/train/settings_op.py``."""
    inputs = [*STEP_INPUTS, *CHECKED]
    outputs = ", ".join(f'("{name}", {t.__name__})' for name, t in get_type_hints(TrainSettings).items())
    returns = textwrap.fill(f') -> NamedTuple("TrainSettings", [{outputs}]):', width=118,
                            subsequent_indent=" " * 34, break_on_hyphens=False)
    call = textwrap.fill(", ".join(f"{p.name}={p.name}" for p in inputs) + ")", width=114,
                         initial_indent=" " * 8, subsequent_indent=" " * 8, break_on_hyphens=False)
    return (_HEADER.format(image=TRAINER_IMAGE)
            + "".join(f"    {p.name}: {p.type.__name__},\n" for p in inputs)
            + returns + "\n"
            + '    """Check the run\'s settings; record the trainer\'s in the run directory and hand them, the job '
              'settings and\n    the run directory to the train step.\n\n    Args:\n'
            + "".join(describe(p, 8) + "\n" for p in inputs)
            + '    """\n'
            "    import json\n    from collections import namedtuple\n\n"
            "    from components.train.settings import build_train_config\n\n"
            "    settings = build_train_config(\n" + call + "\n"
            '    print("trainer settings (besides the defaults):", json.dumps(settings.trainer_config, '
            'sort_keys=True))\n'
            '    return namedtuple("TrainSettings", settings._fields)(*settings)\n')


if __name__ == "__main__":      # python -m components.train.parameters: regenerate the check-settings component
    OP_PATH.write_text(render_op())
    print(f"wrote {OP_PATH}", file=sys.stderr)
