"""``goodput``: one click group, one module per command.

Commands are imported only when invoked, so ``goodput train`` never pays for importing kfp and
``goodput compile`` never imports torch.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute"; each module holds one command.
COMMANDS = {
    "train": "pipelines.cli.train:train",
    "render-job": "pipelines.cli.render_job:render_job",
    "stage": "pipelines.cli.stage:stage",
    "evaluate": "pipelines.cli.evaluate:evaluate",
    "compile": "pipelines.cli.compile:compile_cmd",
    "upload": "pipelines.cli.upload:upload",
    "run": "pipelines.cli.run:run",
    "schedule": "pipelines.cli.schedule:schedule",
    "runs": "pipelines.cli.runs:runs",
    "advise": "pipelines.cli.advise:advise",
    "fsx": "pipelines.cli.fsx:fsx",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="goodput-pipelines")
def main() -> None:
    """Train large PyTorch models on EKS with Kubeflow Pipelines, where a GPU failure costs seconds.

    Start with `goodput train` (a local run) and see `goodput COMMAND --help` for each command.
    """
