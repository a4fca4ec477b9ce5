"""The KFP API calls behind ``goodput upload|run|schedule|runs``, as plain functions of a ``kfp.Client``.

Usable without click (VX ``trigger_pipeline``)::

    from pipelines.kfp_client import Endpoint, build_client, submit_run
    client = build_client(Endpoint(host="https://kubeflow.example.com/pipeline", namespace="ml",
                                   cookie="authservice_session=..."))
    run = submit_run(client, experiment="goodput", run_name="nightly", package="pipeline.yaml",
                     arguments={"max_steps": 200}, namespace="ml")

``kfp.Client`` prints its own "details" links; they are swallowed here and the callers print one link
built by :func:`run_url`, so the output does not depend on kfp's prints.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "SKIPPED", "CANCELED"})


@dataclass
class Endpoint:
    """Where the KFP API is and who is calling it."""

    host: str = ""
    """API base URL, e.g. ``http://localhost:8080`` (port-forward) or ``https://kubeflow.example.com/pipeline``."""
    namespace: str = ""
    """Kubernetes namespace (the Kubeflow profile) for multi-user Kubeflow; empty for single-user KFP."""
    token: str = ""
    """Bearer token sent as ``Authorization: Bearer ...`` (e.g. a service-account or OIDC token)."""
    cookie: str = ""
    """Cookie header for Kubeflow behind Dex/oauth2-proxy, e.g. ``authservice_session=...``."""
    ui_host: str = ""
    """Base URL of the KFP UI for links; defaults to ``host``."""

    def validate(self) -> "Endpoint":
        if not self.host:
            raise ValueError("no KFP endpoint: pass --host or set KFP_HOST (e.g. http://localhost:8080 after "
                             "`kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80`)")
        if not self.host.startswith(("http://", "https://")):
            raise ValueError(f"--host {self.host!r} needs a scheme: http:// or https://")
        if self.cookie and "=" not in self.cookie:
            raise ValueError("--cookie takes NAME=VALUE, e.g. authservice_session=<value from the browser>")
        return self

    @property
    def ui(self) -> str:
        return (self.ui_host or self.host).rstrip("/")


def build_client(endpoint: Endpoint):
    """A ``kfp.Client`` for ``endpoint``; the one place that imports kfp's client."""
    import kfp

    class Client(kfp.Client):
        # kfp.Client asks /healthz (multi-user?) when no namespace is set, retrying 5 times 5 s apart;
        # one attempt makes a wrong --host fail at once.
        def get_kfp_healthz(self, sleep_duration: int = 5):
            return self._healthz_api.healthz_service_get_healthz()

    endpoint.validate()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore", FutureWarning)   # "This client only works with KFP v2.0.0-beta.2 and later"
        return Client(host=endpoint.host.rstrip("/"), namespace=endpoint.namespace or "kubeflow",
                      existing_token=endpoint.token or None, cookies=endpoint.cookie or None,
                      ui_host=endpoint.ui)


def run_url(endpoint: Endpoint, run_id: str) -> str:
    return f"{endpoint.ui}/#/runs/details/{run_id}"


def pipeline_url(endpoint: Endpoint, pipeline_id: str, version_id: str | None = None) -> str:
    tail = f"/version/{version_id}" if version_id else ""
    return f"{endpoint.ui}/#/pipelines/details/{pipeline_id}{tail}"


def recurring_run_url(endpoint: Endpoint, recurring_run_id: str) -> str:
    return f"{endpoint.ui}/#/recurringrun/details/{recurring_run_id}"


def _quiet():
    """kfp.Client prints links with print(); keep them out of our output."""
    return contextlib.redirect_stdout(io.StringIO())


def _name_filter(name: str) -> str:
    # filter.proto: operation EQUALS on display_name.
    return json.dumps({"predicates": [{"operation": "EQUALS", "key": "display_name", "stringValue": name}]})


def content_version(package: Path) -> str:
    """A version name from the package's bytes: compiling is deterministic, so unchanged source uploads once."""
    return "sha256-" + hashlib.sha256(Path(package).read_bytes()).hexdigest()[:12]


# --- pipelines --------------------------------------------------------------------------------------------

def find_pipeline(client, name: str, namespace: str = ""):
    """The pipeline called ``name`` or None."""
    resp = client.list_pipelines(filter=_name_filter(name), namespace=namespace or None, page_size=2)
    found = [p for p in (resp.pipelines or []) if p.display_name == name]
    if len(found) > 1:
        raise ValueError(f"{len(found)} pipelines are called {name!r}; delete one or pick another --name")
    return found[0] if found else None


def find_version(client, pipeline_id: str, version_name: str):
    resp = client.list_pipeline_versions(pipeline_id, filter=_name_filter(version_name), page_size=2)
    found = [v for v in (resp.pipeline_versions or []) if v.display_name == version_name]
    return found[0] if found else None


def latest_version(client, pipeline_id: str):
    resp = client.list_pipeline_versions(pipeline_id, sort_by="created_at desc", page_size=1)
    if not resp.pipeline_versions:
        raise ValueError(f"pipeline {pipeline_id} has no versions")
    return resp.pipeline_versions[0]


@dataclass
class UploadResult:
    pipeline_id: str
    version_id: str
    version_name: str
    new_pipeline: bool
    """True when the pipeline did not exist and was created (with its first version)."""
    unchanged: bool
    """True when a version of that name existed already and nothing was uploaded."""


def upload(client, package: Path, *, name: str, version: str = "", description: str = "",
           namespace: str = "") -> UploadResult:
    """Upload ``package`` as pipeline ``name``: a new pipeline, or a new version of the existing one.

    Version names default to :func:`content_version`. Nothing is uploaded when the pipeline has a version of that
    name, or (no ``version`` given) when the package's spec is its newest version's, whatever that one's name.
    """
    package = Path(package)
    existing = find_pipeline(client, name, namespace)
    if existing is None:
        with _quiet():
            created = client.upload_pipeline(str(package), pipeline_name=name, description=description or None,
                                             namespace=namespace or None)
        first = latest_version(client, created.pipeline_id)
        return UploadResult(created.pipeline_id, first.pipeline_version_id, first.display_name,
                            new_pipeline=True, unchanged=False)
    same = find_version(client, existing.pipeline_id, version or content_version(package))
    if same is None and not version:
        same = _same_spec_as_latest(client, existing, package)
    version = same.display_name if same is not None else version or content_version(package)
    if same is not None:
        return UploadResult(existing.pipeline_id, same.pipeline_version_id, version, new_pipeline=False,
                            unchanged=True)
    with _quiet():
        created = client.upload_pipeline_version(str(package), version, pipeline_id=existing.pipeline_id,
                                                 description=description or None)
    return UploadResult(existing.pipeline_id, created.pipeline_version_id, version, new_pipeline=False,
                        unchanged=False)


def stored_spec(package: Path) -> dict:
    """The package's spec as KFP stores it in a version's ``pipeline_spec`` (a protobuf Struct): the pipeline spec,
    or with a platform spec (kfp-kubernetes settings) both, as ``{"pipeline_spec": ..., "platform_spec": ...}``."""
    docs = [d for d in yaml.safe_load_all(Path(package).read_text()) if d]
    return docs[0] if len(docs) == 1 else {"pipeline_spec": docs[0], "platform_spec": docs[1]}


def _struct_digest(value) -> str:
    """A digest of a spec that a protobuf Struct round trip leaves unchanged (there every number is a float)."""
    def plain(v):
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return hashlib.sha256(json.dumps(plain(value), sort_keys=True).encode()).hexdigest()


def _same_spec_as_latest(client, pipeline, package: Path):
    """The pipeline's newest version when it holds the package's spec (the first upload's version is named by KFP,
    not by content: without this, the same package uploaded again would add a second version)."""
    latest = latest_version(client, pipeline.pipeline_id)
    full = client.get_pipeline_version(pipeline.pipeline_id, latest.pipeline_version_id)
    if full.pipeline_spec and _struct_digest(full.pipeline_spec) == _struct_digest(stored_spec(package)):
        return latest
    return None


def resolve_version(client, pipeline: str, version: str = "", namespace: str = "") -> tuple[str, object]:
    """(pipeline id, version object) for an uploaded pipeline by name; the newest version unless named."""
    p = find_pipeline(client, pipeline, namespace)
    if p is None:
        raise ValueError(f"no pipeline called {pipeline!r}; upload it first with `goodput upload --name {pipeline}`")
    v = find_version(client, p.pipeline_id, version) if version else latest_version(client, p.pipeline_id)
    if v is None:
        raise ValueError(f"pipeline {pipeline!r} has no version {version!r}")
    # The listing may leave the spec out; the version itself has it.
    return p.pipeline_id, client.get_pipeline_version(p.pipeline_id, v.pipeline_version_id)


# --- runs ------------------------------------------------------------------------------------------------

def experiment_id(client, name: str, namespace: str = "") -> str:
    """Id of experiment ``name``, created if missing."""
    with _quiet():
        return client.create_experiment(name, namespace=namespace or None).experiment_id


def submit_run(client, *, experiment: str, run_name: str, arguments: dict, namespace: str = "",
               package: Path | None = None, pipeline_id: str | None = None, version_id: str | None = None,
               service_account: str = "", enable_caching: bool | None = None):
    """Create a run from a compiled package, or from an uploaded pipeline version; returns the V2beta1Run."""
    exp = experiment_id(client, experiment, namespace)
    with _quiet():
        return client.run_pipeline(experiment_id=exp, job_name=run_name,
                                   pipeline_package_path=str(package) if package else None,
                                   pipeline_id=pipeline_id, version_id=version_id, params=arguments,
                                   enable_caching=enable_caching, service_account=service_account or None)


def task_states(run) -> dict[str, str]:
    """``{task display name: state}`` from a run's details (empty until the run has started)."""
    details = getattr(run, "run_details", None)
    out = {}
    for t in (details.task_details if details and details.task_details else []):
        out[t.display_name or t.task_id] = str(t.state or "")
    return out


def wait_for_run(client, run_id: str, *, poll_s: float = 10.0, timeout_s: float | None = None,
                 on_update: Callable[[object, dict[str, str]], None] | None = None):
    """Poll until the run reaches a terminal state; ``on_update(run, changed_task_states)`` on every change.

    Raises:
        TimeoutError: ``timeout_s`` passed first (the run keeps going on the cluster).
    """
    start = time.monotonic()
    seen_state, seen_tasks = None, {}
    while True:
        run = client.get_run(run_id)
        state = str(run.state or "")
        tasks = task_states(run)
        changed = {k: v for k, v in tasks.items() if seen_tasks.get(k) != v}
        if on_update and (state != seen_state or changed):
            on_update(run, changed)
        seen_state, seen_tasks = state, tasks
        if state in TERMINAL_STATES:
            return run
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(f"run {run_id} still {state} after {timeout_s:g} s")
        time.sleep(poll_s)


def list_runs(client, *, namespace: str = "", experiment: str = "", limit: int = 20):
    exp = _existing_experiment_id(client, experiment, namespace) if experiment else None
    resp = client.list_runs(page_size=limit, sort_by="created_at desc", experiment_id=exp,
                            namespace=namespace or None)
    return resp.runs or []


def _existing_experiment_id(client, name: str, namespace: str) -> str:
    try:
        return client.get_experiment(experiment_name=name, namespace=namespace or None).experiment_id
    except ValueError as e:   # kfp: "No experiment is found with name ..."
        raise ValueError(f"no experiment called {name!r}") from e


# --- recurring runs ----------------------------------------------------------------------------------------

def create_schedule(client, *, name: str, experiment: str, arguments: dict, namespace: str = "",
                    cron: str | None = None, interval_s: int | None = None, start=None, end=None,
                    max_concurrency: int = 1, catchup: bool = False, package: Path | None = None,
                    pipeline_id: str | None = None, version_id: str | None = None, service_account: str = "",
                    description: str = ""):
    """Create an enabled recurring run; exactly one of ``cron`` (validated 6-field) and ``interval_s``."""
    exp = experiment_id(client, experiment, namespace)
    with _quiet():
        return client.create_recurring_run(
            experiment_id=exp, job_name=name, description=description or None, start_time=start, end_time=end,
            interval_second=interval_s, cron_expression=cron, max_concurrency=max_concurrency,
            no_catchup=not catchup, params=arguments, pipeline_package_path=str(package) if package else None,
            pipeline_id=pipeline_id, version_id=version_id, enabled=True,
            service_account=service_account or None)


def list_schedules(client, *, namespace: str = "", experiment: str = "", limit: int = 50):
    exp = _existing_experiment_id(client, experiment, namespace) if experiment else None
    resp = client.list_recurring_runs(page_size=limit, sort_by="created_at desc", experiment_id=exp,
                                      namespace=namespace or None)
    return resp.recurring_runs or []


def resolve_schedule_id(client, name_or_id: str, namespace: str = "") -> str:
    """A recurring run's id from its name; anything that names none is taken as an id."""
    resp = client.list_recurring_runs(filter=_name_filter(name_or_id), namespace=namespace or None, page_size=2)
    found = [r for r in (resp.recurring_runs or []) if r.display_name == name_or_id]
    if len(found) > 1:
        raise ValueError(f"{len(found)} recurring runs are called {name_or_id!r}; use the id")
    return found[0].recurring_run_id if found else name_or_id


def schedule_action(client, action: str, recurring_run_id: str) -> None:
    """``pause`` | ``resume`` | ``delete`` a recurring run."""
    call = {"pause": client.disable_recurring_run, "resume": client.enable_recurring_run,
            "delete": client.delete_recurring_run}[action]
    call(recurring_run_id)
