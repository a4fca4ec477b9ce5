"""``goodput render-job``: print the training job as YAML for ``kubectl apply -f -``: a PyTorchJob (kubeflow.org/v1),
a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1), or the ClusterTrainingRuntime a TrainJob references."""

from __future__ import annotations

import dataclasses

import click

from components.train.pytorchjob import JobSpec
from trainer import compat

_HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(JobSpec)}
_DEFAULTS = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
             for f in dataclasses.fields(JobSpec)}
KINDS = ("pytorchjob", "trainjob", "runtime")
RUNTIME_NAME = "goodput-nvrx"
# JobSpec settings a ClusterTrainingRuntime takes (components.train.trainjob.RuntimeSpec.pods).
RUNTIME_POD_SETTINGS = {"image", "image_pull_policy", "gpus_per_node", "gpu_resource", "efa_per_node", "cpu",
                        "memory", "shm_size", "pvc", "fsx_mount", "priority_class", "service_account", "scheduler",
                        "scheduler_name", "backoff_limit", "ttl_after_finished_s", "termination_grace_s",
                        "metrics_port", "nproc_per_node", "instance_type", "spot_taint", "nvrx_release",
                        "node_health_check_endpoint"}


def _pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        key, eq, value = v.partition("=")
        if not eq or not key:
            raise click.UsageError(f"{what} {v!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _release(ctx, param, value: str) -> str:
    """The trainer image's NVRx release, refused at once unless the launch command is checked for it."""
    try:
        return str(compat.image_release(value).version)
    except compat.NVRxCompatError as e:
        raise click.BadParameter(str(e)) from None


def _opt(name: str, **kw):
    """An option for JobSpec field ``name``, documented by the field's own help."""
    flag = "--" + name.replace("_", "-")
    default = next(f for f in dataclasses.fields(JobSpec) if f.name == name).default
    kw.setdefault("help", _HELP[name])
    if "is_flag" not in kw and "multiple" not in kw:
        kw.setdefault("default", default)
        kw.setdefault("show_default", True)
    return click.option(flag, name, **kw)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                 "help_option_names": ["-h", "--help"]})
@click.option("--kind", type=click.Choice(KINDS), default="pytorchjob", show_default=True,
              help="what to print: the job for the pytorchjob or trainjob backend, or `runtime`, the "
                   "ClusterTrainingRuntime a TrainJob references (built from the pod options given here)")
@click.option("--runtime", "runtime_name", default=RUNTIME_NAME, show_default=True,
              help="trainjob/runtime: the ClusterTrainingRuntime's name")
@_opt("name")
@_opt("namespace")
@_opt("image")
@_opt("image_pull_policy", type=click.Choice(["Always", "IfNotPresent", "Never"]))
@_opt("nodes", type=int)
@_opt("min_nodes", type=int)
@_opt("hot_spares", type=int)
@_opt("nvlink_segment", type=int)
@_opt("gpus_per_node", type=int)
@_opt("gpu_resource")
@_opt("instance_type")
@_opt("nproc_per_node", type=int)
@_opt("efa_per_node", type=int)
@_opt("cpu")
@_opt("memory")
@_opt("shm_size")
@_opt("pvc")
@_opt("fsx_mount")
@_opt("node_group")
@click.option("--node-selector", "node_selector", multiple=True, metavar="KEY=VALUE", help=_HELP["node_selector"])
@click.option("--spot/--no-spot", default=False, show_default=True, help=_HELP["spot"])
@_opt("spot_taint")
@_opt("priority_class")
@_opt("service_account")
@_opt("scheduler", type=click.Choice(["", "volcano", "scheduler-plugins", "yunikorn", "kueue"]))
@_opt("scheduler_name")
@_opt("queue")
@_opt("restart_policy")
@_opt("backoff_limit", type=int)
@_opt("active_deadline_s", type=int)
@_opt("ttl_after_finished_s", type=int)
@_opt("clean_pod_policy")
@_opt("termination_grace_s", type=int)
@_opt("master_port", type=int)
@click.option("--env", "env", multiple=True, metavar="NAME=VALUE", help=_HELP["env"])
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help=_HELP["labels"])
@click.option("--max-restarts", type=int, default=3, show_default=True,
              help="in-job restarts of the worker group by ft_launcher (layer 2 of recovery; counted per node up "
                   "to NVRx 0.5, for the whole job from 0.6)")
@_opt("nvrx_release", default=compat.IMAGE_RELEASE, callback=_release,
      help=f"NVRx release in the trainer image (its {compat.IMAGE_RELEASE_LABEL} label): the launch command uses "
           f"only what that release's ft_launcher accepts; one of {', '.join(compat.CHECKED)} (or a patch release "
           "of one)")
@_opt("node_health_check_endpoint")
@_opt("run_id")
@_opt("task_name")
@click.pass_context
def render_job(ctx: click.Context, kind, runtime_name, node_selector, env, labels, max_restarts, **settings) -> None:
    """Print the job that trains on EKS under NVRx, as YAML on stdout: a PyTorchJob (--kind pytorchjob), a
    TrainJob referencing the goodput-nvrx ClusterTrainingRuntime (--kind trainjob), or that runtime
    (--kind runtime).

    The job's pods read its peer secret, the Secret <name>-peer (key `secret`), which the train step's launcher
    makes for each job; for a job applied by hand, create it first:
    kubectl create secret generic <name>-peer --from-literal=secret=$(openssl rand -hex 32).
    With --scheduler kueue --queue <LocalQueue> the job is created suspended, for Kueue to admit.

    Unknown options are the trainer's (`python -m trainer`, see `goodput train --help`); --data and
    --out default to the default dataset and runs/<name> on the FSx mount. Invalid settings exit
    non-zero with every problem listed, and print no YAML. A TrainJob is checked against the runtime's
    defaults (deploy/trainer-v2/runtime/goodput-nvrx.yaml); settings that are the runtime's in Trainer v2
    (backoff limit, scheduler, ...) are refused with the runtime's value.

    \b
    Examples:
      goodput render-job --nodes 4 --image $ECR/goodput-trainer:0.1.0 --spot --node-group p5 \\
          --scheduler volcano --queue training --max-steps 5000 | kubectl apply -f -
      goodput render-job --kind trainjob --nodes 4 --image $ECR/goodput-trainer:0.1.0 --spot | kubectl apply -f -
      goodput render-job --kind runtime --image $ECR/goodput-trainer:0.1.0 | kubectl apply --server-side -f -
      goodput render-job --nodes 8 --hot-spares 1 --nvrx-release 0.7.0 --image $ECR/goodput-trainer:0.1.0-nvrx0.7.0 \\
          --node-health-check-endpoint /var/run/nvhcd/nvhcd.sock | kubectl apply -f -
    """
    import yaml

    from components.train.pytorchjob import job_manifest
    from components.train.trainjob import RuntimeSpec, runtime_manifest, trainjob_manifest
    from trainer.config import parse_config
    from trainer.launch import LaunchConfig

    extra = dict(node_selector=_pairs(node_selector, "--node-selector"), env=_pairs(env, "--env"),
                 labels=_pairs(labels, "--label"), launch=LaunchConfig(max_restarts=max_restarts))
    try:
        if kind == "runtime":
            if ctx.args:
                raise ValueError(f"a runtime has no trainer arguments (got {' '.join(ctx.args)}): they are a "
                                 "TrainJob's")
            # The pod settings given on the command line (those that differ from a job's defaults).
            given = {k: v for k, v in settings.items() if v != _DEFAULTS[k] and k in RUNTIME_POD_SETTINGS}
            jobs = ["--" + k.replace("_", "-") for k, v in settings.items() if v != _DEFAULTS[k] and k not in given]
            if jobs:
                raise ValueError(f"a runtime does not take {', '.join(jobs)}: they are a TrainJob's (--kind trainjob)")
            manifest = runtime_manifest(RuntimeSpec.from_dict({"name": runtime_name, **given, **{
                k: v for k, v in extra.items() if v != _DEFAULTS[k]}}))
        else:
            trainer = parse_config(ctx.args, validate=False, prog="goodput render-job")
            spec = JobSpec(**settings, **extra, trainer=trainer.document())
            if kind == "trainjob":
                manifest = trainjob_manifest(spec, RuntimeSpec(name=runtime_name))
            else:
                manifest = job_manifest(spec)
    except ValueError as e:
        raise click.UsageError(str(e)) from None

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:
            return True

    click.echo(yaml.dump(manifest, Dumper=_NoAliases, sort_keys=False, default_flow_style=False), nl=False)
