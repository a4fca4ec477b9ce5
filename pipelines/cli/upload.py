"""``goodput upload``: the pipeline into KFP, as a new pipeline or a new version of an existing one."""

from __future__ import annotations

from pathlib import Path

import click

from pipelines.cli.kfp_options import api_errors, connection_options, package_option, pipeline_package
from pipelines import PIPELINE_NAME


@click.command()
@package_option
@click.option("--name", default=PIPELINE_NAME, show_default=True, help="Pipeline name in KFP.")
@click.option("--version", "version_name", default="", metavar="NAME",
              help="Version name when the pipeline exists [default: sha256-<first 12 hex of the package>, so an "
                   "unchanged package is not uploaded twice].")
@click.option("--description", default="", help="Shown in the KFP UI.")
@connection_options
@click.pass_obj
@api_errors
def upload(kfp, package: Path | None, name: str, version_name: str, description: str) -> None:
    """Upload the pipeline: creates NAME, or adds a version to the pipeline called NAME.

    \b
    Example:
      KFP_HOST=http://localhost:8080 goodput upload
      goodput upload --package goodput-pipeline.yaml --host https://kubeflow.example.com/pipeline \\
          -n my-profile --cookie "authservice_session=$SESSION"
    """
    from pipelines.kfp_client import pipeline_url
    from pipelines.kfp_client import upload as upload_package

    with pipeline_package(package) as pkg:
        res = upload_package(kfp.client, pkg, name=name, version=version_name, description=description,
                             namespace=kfp.endpoint.namespace)
    if res.new_pipeline:
        click.echo(f"created pipeline {name!r} ({res.pipeline_id}) with version {res.version_name!r}")
    elif res.unchanged:
        click.echo(f"pipeline {name!r} already has version {res.version_name!r} ({res.version_id}); nothing uploaded")
    else:
        click.echo(f"uploaded version {res.version_name!r} ({res.version_id}) of pipeline {name!r}")
    click.echo(pipeline_url(kfp.endpoint, res.pipeline_id, res.version_id))
