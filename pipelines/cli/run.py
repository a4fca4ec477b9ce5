"""``goodput run``: the pipeline on a KFP cluster, or the whole pipeline on this machine (``--local``)."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from pipelines.cli import OneLineError
from pipelines.cli.kfp_options import api_errors, connection_options, params_options, run_target, target_options

# Options that only a cluster run applies (to the KFP API or the run it creates), and those only --local applies.
_CLUSTER_ONLY = ("pipeline_name", "version_name", "experiment", "run_name", "service_account", "enable_caching",
                 "wait", "timeout", "poll_interval", "host", "namespace", "token", "cookie", "ui_host")
_LOCAL_ONLY = ("fsx_root", "verbose")
_WAIT_ONLY = ("timeout", "poll_interval")


def _given(ctx: click.Context, names) -> list[str]:
    """The options among ``names`` given on the command line, as typed (``--run-name``)."""
    flags = {p.name: "/".join([p.opts[0], *p.secondary_opts]) for p in ctx.command.params}
    return [flags[n] for n in names if ctx.get_parameter_source(n) is click.core.ParameterSource.COMMANDLINE]


def _refuse_unapplied(ctx: click.Context, local: bool, wait: bool) -> None:
    """An option this run would not apply is refused (one line, exit 2) before anything is compiled or sent.
    The KFP_* environment variables are not given to this run: --local leaves them alone."""
    if local:
        given, why = _given(ctx, _CLUSTER_ONLY), "only for cluster runs (--local runs this checkout's pipeline here)"
    elif _given(ctx, _LOCAL_ONLY):
        given, why = _given(ctx, _LOCAL_ONLY), "only for --local runs"
    else:
        given, why = ([] if wait else _given(ctx, _WAIT_ONLY)), "only with --wait"
    if given:
        raise OneLineError(f"{', '.join(given)}: {why}; leave {'it' if len(given) == 1 else 'them'} out", 2)


@click.command()
@click.option("--local", "local", is_flag=True,
              help="Run the whole pipeline here (kfp.local SubprocessRunner, local training backend).")
@params_options
@click.option("--inject-fault", "inject_faults", multiple=True, metavar="KIND@STEP[:RANK]",
              help="Passed through to the trainer (e.g. kill@40:1) so recovery shows; repeat for more.")
@click.option("--fsx-root", default="fsx", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="--local: the directory standing in for FSx (datasets, runs, models).")
@target_options
@click.option("--experiment", default="goodput", show_default=True, help="KFP experiment (created if missing).")
@click.option("--run-name", default="", help="[default: goodput-<UTC time>]")
@click.option("--service-account", default="", help="Kubernetes service account of the run's pods "
              "(needs the RBAC in deploy/rbac.yaml to create PyTorchJobs) [default: KFP's].")
@click.option("--cache/--no-cache", "enable_caching", default=None,
              help="Override every task's compiled caching setting for this run.")
@click.option("--verbose", "-v", is_flag=True,
              help="--local: show everything the steps print (launcher and NVRx logs too); it is always in the log.")
@click.option("--wait", is_flag=True, help="Follow the run until it ends; exit 0 only if it succeeded.")
@click.option("--timeout", type=float, default=None, metavar="SECONDS", help="--wait: give up after this long.")
@click.option("--poll-interval", type=float, default=10.0, show_default=True, metavar="SECONDS",
              help="--wait: seconds between status requests.")
@connection_options
@click.pass_context
@api_errors
def run(ctx: click.Context, local: bool, params, params_file, inject_faults, fsx_root, package, pipeline_name,
        version_name, experiment, run_name, service_account, enable_caching, verbose, wait, timeout,
        poll_interval) -> None:
    """Run the pipeline: on KFP (default), or entirely on this machine with --local.

    \b
    Examples:
      goodput run --local                              # stage -> train -> evaluate -> register, here
      goodput run --local --inject-fault exception@30:1   # NVRx restarts rank 1 in-process
      goodput run --local --inject-fault kill@40:1        # ft_launcher restarts the ranks
      goodput run --local -p model=llama -p model_flavor=debug     # the Llama 3 architecture, CPU-sized
      goodput run --local -p model=llama -p init_from=./my-llama   # from a Hugging Face directory
      KFP_HOST=http://localhost:8080 goodput run -p dataset_source=s3://my-bucket/corpus/ -p nodes=2 --wait
      goodput run --pipeline goodput-train --params-file prod.yaml -n my-profile --cookie "$KFP_COOKIE"
    """
    _refuse_unapplied(ctx, local, wait)
    if local:
        from pipelines.local import run_local_cli

        sys.exit(run_local_cli(params=params, params_file=params_file, inject_faults=inject_faults,
                               fsx_root=fsx_root, package=package, verbose=verbose))
    if inject_faults:
        params = (*params, f"inject_fault={','.join(inject_faults)}")
    from pipelines.kfp_client import run_url, submit_run, wait_for_run

    kfp = ctx.obj

    run_name = run_name or f"goodput-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    with run_target(kfp, package, pipeline_name, version_name, params, params_file) as (what, arguments):
        created = submit_run(kfp.client, experiment=experiment, run_name=run_name, arguments=arguments,
                             namespace=kfp.endpoint.namespace, service_account=service_account,
                             enable_caching=enable_caching, **what)
    click.echo(f"run {run_name!r} ({created.run_id}) in experiment {experiment!r}")
    click.echo(run_url(kfp.endpoint, created.run_id))
    if not wait:
        return
    t0, last = time.monotonic(), {}

    def show(r, changed):
        stamp = f"{time.monotonic() - t0:7.1f}s"
        if last.get("state") != r.state:
            click.echo(f"{stamp}  run {r.state}")
            last["state"] = r.state
        for task, state in sorted(changed.items()):
            click.echo(f"{stamp}    {task:<24} {state}")

    final = wait_for_run(kfp.client, created.run_id, poll_s=poll_interval, timeout_s=timeout, on_update=show)
    if final.state != "SUCCEEDED":
        raise click.ClickException(f"run {created.run_id} ended {final.state}"
                                   + (f": {final.error.message}" if getattr(final, "error", None) else ""))
