"""``goodput``: one click group, one module per command.

Commands are imported only when invoked, so ``goodput train`` never pays for importing kfp and
``goodput compile`` never imports torch.

Errors are reported here, once for every command: an error the user can fix (a bad value, a path that
cannot be written) is one line saying what to fix and exit status 2; a failure that the project reports
on purpose (its own exception types), or that a service reports (AWS, KFP, Kubernetes), or a connection
that fails, is one line and exit status 1; anything else is a bug and keeps its traceback.
``goodput --debug`` (or ``GOODPUT_DEBUG=1``) shows the traceback of every error.
"""

from __future__ import annotations

import errno
import importlib
import traceback
from pathlib import Path

import click

# name -> "module:attribute"; each module holds one command.
COMMANDS = {
    "train": "pipelines.cli.train:train",
    "render-job": "pipelines.cli.render_job:render_job",
    "stage": "pipelines.cli.stage:stage",
    "evaluate": "pipelines.cli.evaluate:evaluate",
    "export": "pipelines.cli.export:export",
    "compile": "pipelines.cli.compile:compile_cmd",
    "upload": "pipelines.cli.upload:upload",
    "run": "pipelines.cli.run:run",
    "schedule": "pipelines.cli.schedule:schedule",
    "runs": "pipelines.cli.runs:runs",
    "advise": "pipelines.cli.advise:advise",
    "fsx": "pipelines.cli.fsx:fsx",
}

_PACKAGES = ("trainer", "components", "pipelines")
_SERVICES = ("botocore", "boto3", "s3transfer", "kfp_server_api", "kubernetes", "urllib3")
_ARGV = "goodput.argv"          # ctx.meta key: the arguments after `goodput`, to name the option a path came from
# Errors of a path the user chose: the fix is another path (or its permissions).
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENOENT,
                errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG, errno.ELOOP}


class OneLineError(click.ClickException):
    """An error reported as one line (``Error: ...``) with its own exit status."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def exit_code_for(e: BaseException) -> int | None:
    """2 for an error the user fixes in the command line, 1 for a reported failure, None for a bug."""
    if isinstance(e, ValueError):                # ParamError, ScheduleError, settings the trainer or job reject
        return 2
    if isinstance(e, (ConnectionError, TimeoutError)):
        return 1                                 # nothing wrong with the command; the world did not answer
    if isinstance(e, OSError):
        return 2 if e.errno in _PATH_ERRNOS or e.errno is None else 1
    package = type(e).__module__.split(".")[0]
    if package in _PACKAGES:
        return 1                                 # StageError, EvaluationError, JobFailed, ...: raised on purpose
    if package in _SERVICES:
        return 1                                 # AWS, KFP or Kubernetes said no (credentials, access, not found)
    return None


def _option_for(path: Path, argv: list[str]) -> tuple[str, str] | None:
    """(option, value) given on the command line whose path is the failing path, under it, or above it."""
    pairs = [tuple(a.split("=", 1)) for a in argv if a.startswith("--") and "=" in a]
    pairs += [(a, b) for a, b in zip(argv, argv[1:]) if a.startswith("-") and not b.startswith("-")]
    for opt, value in pairs:
        given = Path(value).absolute()
        if path == given or given in path.parents or path in given.parents:
            return opt, value
    return None


def _os_message(e: OSError, argv: list[str]) -> str:
    if not e.filename:
        return e.strerror or str(e)
    shown, reason = str(e.filename), e.strerror or str(e)
    if e.errno in (errno.EEXIST, errno.ENOTDIR):
        # mkdir of a path under a file: name the file, not the directory that could not be made.
        path = Path(shown).absolute()
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            shown, reason = str(blocker), "is a file, not a directory"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = f"cannot be written ({e.strerror})"
    fix = "" if e.errno == errno.ENOENT else "; give a path you can write to"
    given = _option_for(Path(shown).absolute(), argv)
    if given is None:
        return f"{shown}: {reason}{fix}"
    opt, value = given
    where = "" if Path(value).absolute() == Path(shown).absolute() else f" {shown}"
    return f"{opt} {value}:{where} {reason}{fix}"


def one_line(e: BaseException, argv: list[str] = ()) -> str:
    """The error as a single line: a message listing several problems keeps them, joined by '; '."""
    if isinstance(e, OSError):
        text = _os_message(e, list(argv))
    else:
        text = str(e) or type(e).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    head, rest = lines[0], lines[1:]
    return head + (" " if head.endswith(":") else "; ") + "; ".join(rest) if rest else head


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_ARGV] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort, BrokenPipeError):
            raise                                    # click reports these itself
        except Exception as e:
            code = exit_code_for(e)
            if code is None or ctx.params.get("debug"):
                click.echo("".join(traceback.format_exception(e)).rstrip(), err=True)
            if code is None:
                raise OneLineError(f"unexpected {type(e).__name__}: {one_line(e)}. This is a bug in goodput: "
                                   "please report it with the traceback above", 1) from e
            raise OneLineError(one_line(e, ctx.meta.get(_ARGV, [])), code) from e


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="goodput-pipelines")
@click.option("--debug", is_flag=True, envvar="GOODPUT_DEBUG", show_envvar=True,
              help="Show the traceback of an error (by default an expected error is one line).")
def main(debug: bool) -> None:
    """Train large PyTorch models on EKS with Kubeflow Pipelines, where a GPU failure costs seconds.

    Start with `goodput train` (a local run) and see `goodput COMMAND --help` for each command.
    Errors you can fix exit with status 2 and one line saying what to fix; --debug shows the traceback.
    """
