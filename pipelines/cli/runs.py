"""``goodput runs list|get``: what ran on KFP, and how it went."""

from __future__ import annotations

import json

import click

from pipelines.cli.kfp_options import api_errors, connection_options


@click.group()
def runs() -> None:
    """Runs on KFP: list recent ones, or show one with its tasks."""


@runs.command("list")
@click.option("--experiment", default="", help="Only this experiment's runs.")
@click.option("--max", "limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@connection_options
@click.pass_obj
@api_errors
def list_cmd(kfp, experiment: str, limit: int) -> None:
    """List runs, newest first."""
    from rich.console import Console
    from rich.table import Table

    from pipelines.kfp_client import list_runs

    table = Table("id", "name", "state", "created", "finished")
    for r in list_runs(kfp.client, namespace=kfp.endpoint.namespace, experiment=experiment, limit=limit):
        table.add_row(r.run_id, r.display_name, str(r.state or ""),
                      f"{r.created_at:%Y-%m-%d %H:%M}" if r.created_at else "",
                      f"{r.finished_at:%Y-%m-%d %H:%M}" if r.finished_at else "")
    Console(width=160).print(table)


@runs.command("get")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="The run as the API returns it.")
@connection_options
@click.pass_obj
@api_errors
def get_cmd(kfp, run_id: str, as_json: bool) -> None:
    """Show one run: state, arguments, tasks, link."""
    from pipelines.kfp_client import run_url, task_states

    r = kfp.client.get_run(run_id)
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=1, sort_keys=True, default=str))
        return
    click.echo(f"run {r.display_name!r} ({r.run_id}): {r.state}")
    if r.error and r.error.message:
        click.echo(f"  error: {r.error.message}")
    params = (r.runtime_config.parameters if r.runtime_config else None) or {}
    for k, v in sorted(params.items()):
        click.echo(f"  {k} = {v}")
    for task, state in task_states(r).items():
        click.echo(f"  task {task:<24} {state}")
    click.echo(run_url(kfp.endpoint, r.run_id))
