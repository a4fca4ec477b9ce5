"""``goodput fsx``: link the FSx for Lustre file system to S3 (``pipelines.fsx``)."""

from __future__ import annotations

import click


def _events(value: str) -> list[str]:
    return [e.strip().upper() for e in value.split(",") if e.strip()] if value else []


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--region", default=None, help="AWS region (default: the AWS configuration's).")
@click.option("--endpoint-url", default=None, help="FSx API endpoint (default: AWS).")
@click.pass_context
def fsx(ctx: click.Context, region: str | None, endpoint_url: str | None) -> None:
    """FSx for Lustre data repository associations (PERSISTENT_2 file systems)."""
    ctx.ensure_object(dict)
    ctx.obj["fsx_client"] = lambda: __import__("pipelines.fsx", fromlist=["fsx_client"]).fsx_client(
        region, endpoint_url)


@fsx.command()
@click.option("--file-system-id", required=True, help="The file system, fs-0123456789abcdef0.")
@click.option("--fsx-path", required=True, help="Directory below the file system's root, e.g. the raw/ of a "
              "dataset: /datasets/corpus/1/raw (/fsx/datasets/corpus/1/raw in the pods).")
@click.option("--s3", "s3_uri", required=True, help="s3://BUCKET/PREFIX/ to link (the dataset bucket).")
@click.option("--auto-import", default="NEW,CHANGED,DELETED", show_default=True,
              help="Bucket changes imported automatically, comma-separated; empty = none.")
@click.option("--auto-export", default="", show_default=True,
              help="File system changes exported to the bucket, comma-separated; empty = none (read-only use).")
@click.option("--batch-import/--no-batch-import", default=True, show_default=True,
              help="Load the metadata of the whole prefix right after creation.")
@click.option("--chunk-mib", type=int, default=None, help="Stripe size of imported files in MiB (FSx default 1024).")
@click.option("--wait/--no-wait", default=False, show_default=True, help="Wait until the link is AVAILABLE.")
@click.option("--timeout-s", type=float, default=1800.0, show_default=True, help="Limit of --wait.")
@click.option("--poll-s", type=float, default=15.0, show_default=True, help="Seconds between checks of --wait.")
@click.pass_context
def link(ctx, file_system_id, fsx_path, s3_uri, auto_import, auto_export, batch_import, chunk_mib, wait,
         timeout_s, poll_s) -> None:
    """Create a data repository association: the S3 prefix appears at --fsx-path on the file system.

    Link a dataset's raw/ directory, then stage it with `goodput stage ... --fsx-dra` (the stage
    component's fsx_dra): its files are preloaded in place instead of copied.

    \b
    Example:
      goodput fsx link --file-system-id fs-0123456789abcdef0 --fsx-path /datasets/corpus/1/raw \\
          --s3 s3://my-datasets/corpus/ --wait
    """
    from pipelines.fsx import LinkError, link_data_repository, wait_for_link

    client = ctx.obj["fsx_client"]()
    try:
        assoc = link_data_repository(file_system_id, fsx_path, s3_uri, import_events=_events(auto_import),
                                     export_events=_events(auto_export), batch_import=batch_import,
                                     chunk_mib=chunk_mib, client=client)
        click.echo(f"{assoc['AssociationId']}: {assoc['FileSystemPath']} <-> {assoc['DataRepositoryPath']} "
                   f"({assoc['Lifecycle']})")
        if wait:
            wait_for_link(assoc["AssociationId"], client=client, timeout_s=timeout_s, poll_s=poll_s, log=click.echo)
    except LinkError as e:
        raise click.ClickException(str(e)) from None


@fsx.command()
@click.option("--file-system-id", required=True, help="The file system, fs-0123456789abcdef0.")
@click.pass_context
def links(ctx, file_system_id) -> None:
    """List the data repository associations of a file system."""
    from pipelines.fsx import list_links

    for a in list_links(file_system_id, client=ctx.obj["fsx_client"]()):
        click.echo(f"{a['AssociationId']}\t{a['Lifecycle']}\t{a['FileSystemPath']}\t{a['DataRepositoryPath']}")
