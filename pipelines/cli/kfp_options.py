"""What the KFP client commands share: endpoint and auth options, the lazily built client, the pipeline
package, and error reporting.

The client is built on first use of ``ctx.obj.client`` (KFP ``kfp/cli/cli.py`` passes it the same way),
so a command validates its arguments first and a bad argument never costs a request.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path

import click

from pipelines.kfp_client import Endpoint, build_client


class KfpContext:
    """``ctx.obj`` of a client command: the endpoint and, once asked for, the client."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self._client = None

    @property
    def client(self):
        if self._client is None:
            self._client = build_client(self.endpoint)
        return self._client


def _store_endpoint(ctx: click.Context, param: click.Parameter, value):
    # Each option's callback fills one field of the Endpoint in ctx.obj; `expose_value=False` keeps them
    # out of the command's signature.
    if not isinstance(ctx.obj, KfpContext):
        ctx.obj = KfpContext(Endpoint())
    setattr(ctx.obj.endpoint, param.name, value or "")
    return value


def connection_options(f):
    """--host --namespace --token --cookie --ui-host, each with its KFP_* environment variable."""
    common = {"callback": _store_endpoint, "expose_value": False, "show_envvar": True}
    opts = [
        click.option("--host", envvar="KFP_HOST", metavar="URL", **common,
                     help="KFP API endpoint, e.g. http://localhost:8080 or https://kubeflow.example.com/pipeline."),
        click.option("--namespace", "-n", envvar="KFP_NAMESPACE", **common,
                     help="Kubeflow profile namespace (multi-user Kubeflow)."),
        click.option("--token", envvar="KFP_TOKEN", metavar="TOKEN", **common,
                     help="Bearer token for the API (prefer the environment variable: shells keep history)."),
        click.option("--cookie", envvar="KFP_COOKIE", metavar="NAME=VALUE", **common,
                     help="Session cookie of multi-user Kubeflow, e.g. authservice_session=..."),
        click.option("--ui-host", envvar="KFP_UI_HOST", metavar="URL", **common,
                     help="KFP UI base URL for links [default: --host]."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def api_errors(f):
    """Turn API and connection errors into one-line click errors (exit code 1); a ValueError (no such
    pipeline, a bad argument) goes on to the ``goodput`` group, which reports it with exit code 2."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        from kfp_server_api.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        try:
            return f(*args, **kwargs)
        except ApiException as e:
            raise click.ClickException(f"KFP API: HTTP {e.status} {e.reason}: {_message(e.body)}") from None
        except HTTPError as e:
            raise click.ClickException(f"cannot reach the KFP API: {e}") from None
        except TimeoutError as e:
            raise click.ClickException(str(e)) from None
    return wrapper


def _message(body) -> str:
    import json

    try:
        return json.loads(body).get("message") or str(body)
    except (TypeError, ValueError, AttributeError):
        return str(body or "").strip()


def package_option(f):
    return click.option(
        "--package", type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Compiled pipeline YAML (`goodput compile -o FILE`) [default: compile this checkout's pipeline].")(f)


@contextlib.contextmanager
def pipeline_package(package: Path | None):
    """The given package, or this checkout's pipeline compiled into a temporary file."""
    if package is not None:
        yield package
        return
    from pipelines.compile import compile_pipeline

    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        yield compile_pipeline(Path(tmp) / "pipeline.yaml")


def params_options(f):
    f = click.option("--params-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="YAML mapping of pipeline parameters (overridden by -p).")(f)
    return click.option("-p", "--param", "params", multiple=True, metavar="KEY=VALUE",
                        help="A pipeline parameter; repeat for more. Checked against the pipeline before sending.")(f)


def target_options(f):
    f = click.option("--version", "version_name", default="", metavar="NAME",
                     help="With --pipeline: the version to run [default: the newest].")(f)
    f = click.option("--pipeline", "pipeline_name", default="", metavar="NAME",
                     help="Run an uploaded pipeline by name instead of a package.")(f)
    return package_option(f)


@contextlib.contextmanager
def run_target(kfp: KfpContext, package: Path | None, pipeline_name: str, version_name: str,
               params: tuple[str, ...], params_file: Path | None):
    """Yield (what to run as submit_run/create_schedule keyword arguments, checked arguments).

    Malformed ``-p`` and unreadable params files fail before any request; with a package (the default:
    this checkout's pipeline) unknown names, wrong types and settings the check-settings step would
    reject (``-p max_steps=-5``) do too. An uploaded pipeline's parameters are only known after asking
    for its version, so they are checked right after that request. A ParamError (a ValueError) is
    reported by the ``goodput`` group as one line, exit status 2.
    """
    from pipelines.params import check_settings, load_params_file, load_pipeline_spec, parse_pairs, resolve_arguments

    parse_pairs(params)
    if params_file:
        load_params_file(params_file)
    if pipeline_name and package:
        raise click.UsageError("give --package or --pipeline, not both")
    if version_name and not pipeline_name:
        raise click.UsageError("--version needs --pipeline")
    if pipeline_name:
        from pipelines.kfp_client import resolve_version

        pipeline_id, version = api_errors(resolve_version)(kfp.client, pipeline_name, version_name,
                                                           kfp.endpoint.namespace)
        spec = version.pipeline_spec or {}
        spec = spec.get("pipeline_spec", spec)      # {pipeline_spec, platform_spec} when there is a platform spec
        arguments = resolve_arguments(spec, params, params_file)
        check_settings(spec, arguments)
        yield {"pipeline_id": pipeline_id, "version_id": version.pipeline_version_id}, arguments
        return
    with pipeline_package(package) as pkg:
        spec = load_pipeline_spec(pkg)
        arguments = resolve_arguments(spec, params, params_file)
        check_settings(spec, arguments)
        yield {"package": pkg}, arguments
