"""``goodput render-job``: print the training PyTorchJob (kubeflow.org/v1) as YAML for ``kubectl apply -f -``."""

from __future__ import annotations

import dataclasses

import click

from components.pytorchjob import JobSpec

_HELP = {f.name: f.metadata.get("help", "") for f in dataclasses.fields(JobSpec)}


def _pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        key, eq, value = v.partition("=")
        if not eq or not key:
            raise click.UsageError(f"{what} {v!r}: expected KEY=VALUE")
        out[key] = value
    return out


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
@_opt("name")
@_opt("namespace")
@_opt("image")
@_opt("image_pull_policy", type=click.Choice(["Always", "IfNotPresent", "Never"]))
@_opt("nodes", type=int)
@_opt("min_nodes", type=int)
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
@_opt("scheduler", type=click.Choice(["", "volcano", "scheduler-plugins", "yunikorn"]))
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
              help="in-job restarts of the worker group by ft_launcher (layer 2 of recovery)")
@_opt("run_id")
@_opt("task_name")
@click.pass_context
def render_job(ctx: click.Context, node_selector, env, labels, max_restarts, **settings) -> None:
    """Print the PyTorchJob that trains on EKS under NVRx, as YAML on stdout.

    Unknown options are the trainer's (`python -m trainer`, see `goodput train --help`); --data and
    --out default to the default dataset and runs/<name> on the FSx mount. Invalid settings exit
    non-zero with every problem listed, and print no YAML.

    \b
    Example:
      goodput render-job --nodes 4 --image $ECR/goodput-trainer:0.1.0 --spot --node-group p5 \\
          --scheduler volcano --queue training --max-steps 5000 | kubectl apply -f -
    """
    import yaml

    from components.pytorchjob import job_manifest
    from trainer.launch import LaunchConfig

    spec = JobSpec(**settings, node_selector=_pairs(node_selector, "--node-selector"),
                   env=_pairs(env, "--env"), labels=_pairs(labels, "--label"),
                   trainer_args=list(ctx.args), launch=LaunchConfig(max_restarts=max_restarts))
    try:
        manifest = job_manifest(spec)
    except ValueError as e:
        raise click.UsageError(str(e)) from None

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data) -> bool:
            return True

    click.echo(yaml.dump(manifest, Dumper=_NoAliases, sort_keys=False, default_flow_style=False), nl=False)
