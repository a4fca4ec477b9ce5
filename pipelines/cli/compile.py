"""``goodput compile``: write the pipeline as KFP YAML, for ``goodput upload`` or the KFP UI."""

from __future__ import annotations

import hashlib
from pathlib import Path

import click


@click.command("compile")
@click.option("--backend", type=click.Choice(["pytorchjob", "trainjob"]), default="pytorchjob", show_default=True,
              help="How the train step runs the trainer: a Training Operator PyTorchJob, or a Kubeflow Trainer v2 "
                   "TrainJob on the goodput-nvrx runtime (deploy/trainer-v2). Compiled in: the run form has no "
                   "backend parameter.")
@click.option("--component-image", envvar="GOODPUT_COMPONENT_IMAGE", required=True, metavar="IMAGE",
              help="Image of the stage, train (launcher), register and cleanup steps (images/components.Dockerfile), "
                   "with a tag or digest, e.g. "
                   "$REGISTRY/goodput-components:0.1.0. Default: $GOODPUT_COMPONENT_IMAGE.")
@click.option("--trainer-image", envvar="GOODPUT_TRAINER_IMAGE", required=True, metavar="IMAGE",
              help="Image of the job's pods and of the check-settings and evaluate steps (images/trainer.Dockerfile), "
                   "e.g. "
                   "$REGISTRY/goodput-trainer:0.1.0; the default of the trainer_image run parameter. "
                   "Default: $GOODPUT_TRAINER_IMAGE.")
@click.option("-o", "--output", default="goodput-pipeline.yaml", show_default=True,
              type=click.Path(dir_okay=False, path_type=Path), help="Where to write the pipeline YAML.")
def compile_cmd(backend: str, component_image: str, trainer_image: str, output: Path) -> None:
    """Compile the pipeline to KFP YAML. The same source, backend and images always give the same bytes.

    \b
    Examples:
      goodput compile --component-image $REGISTRY/goodput-components:0.1.0 \\
          --trainer-image $REGISTRY/goodput-trainer:0.1.0 -o goodput-pipeline.yaml
      goodput compile --backend trainjob ... -o goodput-trainjob.yaml    # Kubeflow Trainer v2
      # then upload it in the KFP UI, or `goodput upload`
    """
    from pipelines.compile import compile_pipeline

    try:
        path = compile_pipeline(output, backend=backend, component_image=component_image, trainer_image=trainer_image)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    data = path.read_bytes()
    click.echo(f"wrote {path} ({len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()[:12]}; "
               f"backend {backend}; components {component_image}, trainer {trainer_image})")
