"""``goodput schedule``: recurring runs (a weekly retrain) and their ``list|pause|resume|delete``."""

from __future__ import annotations

from datetime import datetime, timezone

import click

from pipelines.cli.kfp_options import api_errors, connection_options, params_options, run_target, target_options


class _CreateByDefault(click.Group):
    """``goodput schedule --cron ...`` means ``goodput schedule create --cron ...``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["create", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_CreateByDefault)
def schedule() -> None:
    """Recurring runs: create one (the default subcommand), or list, pause, resume, delete.

    \b
    Examples:
      goodput schedule --name weekly-retrain --cron "0 0 3 * * MON" --pipeline goodput-train
      goodput schedule --name nightly --every 1d --start 2026-01-05T02:00:00Z -p max_steps=500
      goodput schedule list
      goodput schedule pause weekly-retrain
    """


@schedule.command()
@click.option("--name", required=True, help="Name of the recurring run.")
@click.option("--cron", default="", metavar="EXPR",
              help="6-field KFP cron: second minute hour day-of-month month day-of-week, e.g. '0 0 3 * * MON' "
                   "(Mondays 03:00 UTC); or @daily, @weekly, '@every 168h'.")
@click.option("--every", default="", metavar="INTERVAL", help="Or a fixed interval: 3600, 90m, 6h, 7d, 1w.")
@click.option("--start", default="", metavar="TIME", help="First possible run, ISO 8601 (UTC if no zone).")
@click.option("--end", default="", metavar="TIME", help="No runs after this, ISO 8601.")
@click.option("--max-concurrency", type=click.IntRange(1, 10), default=1, show_default=True,
              help="Runs of this schedule allowed at once (KFP allows 1-10).")
@click.option("--catchup/--no-catchup", default=False, show_default=True,
              help="After a pause, run every missed slot (catchup) or only the latest (no catchup).")
@click.option("--experiment", default="goodput", show_default=True, help="KFP experiment (created if missing).")
@click.option("--service-account", default="", help="Kubernetes service account of the runs' pods [default: KFP's].")
@click.option("--description", default="")
@target_options
@params_options
@connection_options
@click.pass_obj
@api_errors
def create(kfp, name, cron, every, start, end, max_concurrency, catchup, experiment, service_account, description,
           package, pipeline_name, version_name, params, params_file) -> None:
    """Create an enabled recurring run of the pipeline (a package, or an uploaded pipeline's version)."""
    from pipelines.cron import ScheduleError, next_fire, parse_interval, parse_time, validate_cron
    from pipelines.kfp_client import create_schedule, recurring_run_url

    # A ScheduleError is a ValueError: the `goodput` group reports it as one line, exit status 2.
    if bool(cron) == bool(every):
        raise ScheduleError("give exactly one of --cron and --every")
    start_t = parse_time(start) if start else None
    end_t = parse_time(end) if end else None
    if start_t and end_t and end_t <= start_t:
        raise ScheduleError(f"--end {end} is not after --start {start}")
    cron_expr = validate_cron(cron, start_t) if cron else None
    interval_s = parse_interval(every) if every else None
    first = None
    if cron_expr and not cron_expr.startswith("@"):
        first = next_fire(cron_expr, start_t or datetime.now(timezone.utc))
        if end_t and first and first > end_t:
            raise ScheduleError(f"--cron {cron_expr!r} first fires at {first:%Y-%m-%d %H:%M:%S} UTC, after "
                                f"--end {end}: the schedule would never run")
    with run_target(kfp, package, pipeline_name, version_name, params, params_file) as (what, arguments):
        rr = create_schedule(kfp.client, name=name, experiment=experiment, arguments=arguments,
                             namespace=kfp.endpoint.namespace, cron=cron_expr, interval_s=interval_s, start=start_t,
                             end=end_t, max_concurrency=max_concurrency, catchup=catchup,
                             service_account=service_account, description=description, **what)
    when = f"cron {cron_expr!r}" if cron_expr else f"every {interval_s} s"
    when += f" (first run {first:%Y-%m-%d %H:%M:%S} UTC)" if first else ""
    click.echo(f"scheduled {name!r} ({rr.recurring_run_id}): {when}, max concurrency {max_concurrency}, "
               f"{'catch up' if catchup else 'no catch-up'}")
    click.echo(recurring_run_url(kfp.endpoint, rr.recurring_run_id))


@schedule.command("list")
@click.option("--experiment", default="", help="Only this experiment's recurring runs.")
@click.option("--max", "limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@connection_options
@click.pass_obj
@api_errors
def list_cmd(kfp, experiment: str, limit: int) -> None:
    """List recurring runs, newest first."""
    from rich.console import Console
    from rich.table import Table

    from pipelines.kfp_client import list_schedules

    rows = list_schedules(kfp.client, namespace=kfp.endpoint.namespace, experiment=experiment, limit=limit)
    table = Table("id", "name", "status", "trigger", "max conc.", "created")
    for r in rows:
        trig = r.trigger
        when = (f"cron {trig.cron_schedule.cron}" if trig and trig.cron_schedule else
                f"every {trig.periodic_schedule.interval_second} s" if trig and trig.periodic_schedule else "")
        table.add_row(r.recurring_run_id, r.display_name, str(r.status or ""), when, str(r.max_concurrency or ""),
                      f"{r.created_at:%Y-%m-%d %H:%M}" if r.created_at else "")
    Console(width=160).print(table)


def _action(verb: str, done: str):
    @schedule.command(verb)
    @click.argument("name_or_id")
    @connection_options
    @click.pass_obj
    @api_errors
    def cmd(kfp, name_or_id: str) -> None:
        from pipelines.kfp_client import resolve_schedule_id, schedule_action

        rid = resolve_schedule_id(kfp.client, name_or_id, kfp.endpoint.namespace)
        schedule_action(kfp.client, verb, rid)
        click.echo(f"{done} recurring run {rid}")

    cmd.help = f"{verb.capitalize()} a recurring run, by name or id."
    return cmd


pause = _action("pause", "paused")
resume = _action("resume", "resumed")
delete = _action("delete", "deleted")
