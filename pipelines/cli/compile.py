"""``goodput compile``: write the pipeline as KFP YAML, for ``goodput upload`` or the KFP UI."""

from __future__ import annotations

import hashlib
from pathlib import Path

import click


@click.command("compile")
@click.option("-o", "--output", default="goodput-pipeline.yaml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Where to write the pipeline YAML.")
def compile_cmd(output: Path) -> None:
    """Compile the pipeline to KFP YAML. The same source always gives the same bytes.

    \b
    Example:
      goodput compile -o goodput-pipeline.yaml   # then upload it in the KFP UI, or `goodput upload`
    """
    from pipelines.compile import compile_pipeline

    path = compile_pipeline(output)
    data = path.read_bytes()
    click.echo(f"wrote {path} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]})")
