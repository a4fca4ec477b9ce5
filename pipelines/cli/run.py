"""``goodput run``: the pipeline on a KFP cluster, or the whole pipeline on this machine (``--local``)."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import click

from pipelines.cli.kfp_options import api_errors, connection_options, params_options, run_target, target_options


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
@click.pass_obj
@api_errors
def run(kfp, local: bool, params, params_file, inject_faults, fsx_root, package, pipeline_name, version_name,
        experiment, run_name, service_account, enable_caching, verbose, wait, timeout, poll_interval) -> None:
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
    if local:
        if pipeline_name or enable_caching is not None or wait or service_account:
            raise click.UsageError("--local runs this checkout's pipeline here; --pipeline, --cache, --wait and "
                                   "--service-account are for cluster runs")
        from pipelines.local import run_local_cli

        sys.exit(run_local_cli(params=params, params_file=params_file, inject_faults=inject_faults,
                               fsx_root=fsx_root, package=package, verbose=verbose))
    if inject_faults:
        params = (*params, f"inject_fault={','.join(inject_faults)}")
    from pipelines.kfp_client import run_url, submit_run, wait_for_run

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
