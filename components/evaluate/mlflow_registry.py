"""An MLflow model registry (``registry=mlflow://HOST:PORT`` or ``mlflow+https://HOST/PATH``) as evaluate's and
register's registry, beside the FSx/S3 file registry of ``components.evaluate.register``.

    mlflow://mlflow.mlflow.svc:5000        the tracking server at http://mlflow.mlflow.svc:5000
    mlflow+https://mlflow.example.com      at https://mlflow.example.com; the token from MLFLOW_TRACKING_TOKEN
                                           (on a cluster: the ``mlflow_secret`` Kubernetes secret)

A promoted model becomes a version of the registered model ``model_name``, in this order:

    1. a run in the experiment ``goodput/<model_name>``: the evaluation's metrics (each checkpoint's at its step,
       the best one's, each task's), the tags below, ``model/`` = the Hugging Face directory with its model card
       README.md, and ``report.html`` and ``evaluation.json``
    2. the model version, source ``model/`` of that run, with the same tags
    3. the alias ``production`` moved to it (last)

Tags: ``goodput.version`` (``<run>-step<N>``), ``goodput.run_id``, ``goodput.params_sha256``,
``goodput.dataset_manifest_sha256``, ``goodput.tokenizer``, ``goodput.goodput``, ``goodput.nvrx_release``,
``goodput.step``. A failure at any of these steps deletes what was created (the version, the run) before it
is raised, so a reader sees the old production model and no half-registered version; an unreachable server
fails the step before anything is written. A version registered already with the same weights (a retried
step) gets the alias again; other weights under the same ``goodput.version`` are refused.

The production model's recorded scores (``val_loss``, ``tasks/<task>/<metric>``) are its run's metrics; its
weights are the version's artifacts (``production_dir``). The client is ``mlflow-skinny``, imported only here.
"""

from __future__ import annotations

import json
import logging
import time
from importlib.metadata import PackageNotFoundError, version as package_version
from pathlib import Path
from typing import Any

from components.evaluate.registry_format import HF_FORMAT, RegistrationError

log = logging.getLogger(__name__)

SCHEMES = {"mlflow": "http", "mlflow+http": "http", "mlflow+https": "https"}
ALIAS = "production"
MODEL_DIR = "model"
TAG = "goodput."
TOKEN_ENV = "MLFLOW_TRACKING_TOKEN"


def is_mlflow(uri: str | None) -> bool:
    return bool(uri) and uri.partition("://")[0] in SCHEMES and "://" in uri


def tracking_uri(uri: str) -> str:
    """``mlflow://host:port[/path]`` -> ``http://host:port[/path]``; ``mlflow+https://...`` -> ``https://...``."""
    scheme, _, rest = uri.partition("://")
    if scheme not in SCHEMES or not rest.split("/")[0]:
        raise ValueError(f"registry {uri!r}: expected mlflow://HOST:PORT or mlflow+https://HOST[/PATH]")
    return f"{SCHEMES[scheme]}://{rest.rstrip('/')}"


class MlflowRegistryError(RuntimeError):
    """The MLflow server cannot be reached, or refused what was asked."""


def _client(uri: str):
    try:
        from mlflow import MlflowClient
    except ImportError as e:
        raise MlflowRegistryError(f"registry {uri}: the MLflow client is not installed (pip install mlflow-skinny): "
                                  f"{e}") from None
    url = tracking_uri(uri)
    return MlflowClient(tracking_uri=url, registry_uri=url)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def _metric_name(name: str) -> str:
    # MLflow metric names: letters, digits, _ - . / and spaces; a harness filter suffix (",strict-match") is not.
    return name.replace(",", "/")


class MlflowRegistry:
    """One MLflow tracking server's model registry."""

    def __init__(self, uri: str):
        self.uri = uri
        self.client = _client(uri)

    def location(self, model_name: str, version: str | int | None = None) -> str:
        return f"{self.uri} model {model_name}" + (f" version {version}" if version is not None else "")

    def check_reachable(self) -> None:
        """Fails now (before anything is scored or written) when the server does not answer."""
        try:
            self.client.search_registered_models(max_results=1)
        except Exception as e:
            raise MlflowRegistryError(f"registry {self.uri} ({tracking_uri(self.uri)}) cannot be reached: "
                                      f"{_short(e)}") from e

    def _by_alias(self, model_name: str):
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(model_name, ALIAS)
        except MlflowException as e:
            if e.get_http_status_code() == 404 or "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
                return None
            raise

    def production(self, model_name: str) -> dict | None:
        """The production version's record (version, model_uri, recorded val_loss and tasks), or None."""
        mv = self._by_alias(model_name)
        if mv is None:
            return None
        metrics = self.client.get_run(mv.run_id).data.metrics if mv.run_id else {}
        tasks: dict[str, dict[str, float]] = {}
        for key, value in metrics.items():
            if key.startswith("tasks/") and key.count("/") >= 2:
                _, task, metric = key.split("/", 2)
                tasks.setdefault(task, {})[metric] = value
        return {"version": mv.tags.get(f"{TAG}version", str(mv.version)), "mlflow_version": str(mv.version),
                "model_uri": f"models:/{model_name}/{mv.version}", "val_loss": metrics.get("val_loss"),
                "tasks": tasks, "step": int(mv.tags[f"{TAG}step"]) if f"{TAG}step" in mv.tags else None,
                "source_run": mv.tags.get(f"{TAG}run_id"), "model": json.loads(mv.tags.get(f"{TAG}model", "null"))}

    def download(self, model_name: str, mlflow_version: str, dest: Path) -> Path:
        """The version's Hugging Face directory, downloaded under ``dest``."""
        from mlflow.artifacts import download_artifacts

        dest.mkdir(parents=True, exist_ok=True)
        uri = self.client.get_model_version_download_uri(model_name, mlflow_version)
        return Path(download_artifacts(artifact_uri=uri, dst_path=str(dest), tracking_uri=tracking_uri(self.uri)))

    def _existing(self, model_name: str, goodput_version: str):
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.search_model_versions(
                f"name='{model_name}' and tags.`{TAG}version`='{goodput_version}'")
        except MlflowException as e:
            if "RESOURCE_DOES_NOT_EXIST" in str(e.error_code):
                return None
            raise
        return found[0] if found else None

    def publish(self, model_name: str, version: str, hf_dir: Path, metadata: dict, checkpoints: list[dict],
                files: dict[str, str]) -> dict:
        """Register ``hf_dir`` as a new version of ``model_name`` and move ``production`` to it (last).

        Args:
            model_name: the registered model.
            version: our version name (``<run>-step<N>``), kept as the ``goodput.version`` tag.
            hf_dir: the Hugging Face directory (with its README.md model card): the version's artifacts.
            metadata: what the file registry's metadata.json holds; its metrics and identity become the
                run's metrics and the tags.
            checkpoints: every scored checkpoint (their val_loss, bpb and task metrics are logged at their step).
            files: artifact name -> text logged beside the model (report.html, evaluation.json).

        Returns:
            version, model_uri (``models:/<name>/<n>``), metadata_uri (the run), format, mlflow_version.

        Raises:
            MlflowRegistryError: the server failed; what this call created is deleted first.
            components.evaluate.registry_format.RegistrationError: the version is registered already with other weights.
        """
        from mlflow.entities import Metric

        tags = self._tags(version, metadata)
        try:
            self._ensure_model(model_name)
            existing = self._existing(model_name, version)
        except Exception as e:
            raise MlflowRegistryError(f"registry {self.uri} cannot be used: {_short(e)}") from e
        if existing is not None:
            if existing.tags.get(f"{TAG}params_sha256") != metadata.get("params_sha256"):
                raise RegistrationError(
                    f"{self.location(model_name, existing.version)} is {version} already, with other weights "
                    f"(params_sha256 {str(existing.tags.get(f'{TAG}params_sha256'))[:16]}...): a registered version "
                    f"never changes; give the run another name or delete that version")
            self.client.set_registered_model_alias(model_name, ALIAS, existing.version)
            return self._record(model_name, existing.version, existing.run_id, version)
        run_id, mv = None, None
        try:
            experiment = self._experiment(f"goodput/{model_name}")
            run = self.client.create_run(experiment, run_name=version, tags=tags)
            run_id = run.info.run_id
            now = int(time.time() * 1000)
            metrics = [Metric(_metric_name(k), float(v), now, step) for c in checkpoints
                       for k, v, step in self._checkpoint_metrics(c)]
            metrics += [Metric(_metric_name(k), float(v), now, int(metadata["step"]))
                        for k, v in self._best_metrics(metadata).items()]
            for i in range(0, len(metrics), 1000):          # MLflow takes at most 1000 metrics a batch
                self.client.log_batch(run_id, metrics=metrics[i:i + 1000])
            self.client.log_artifacts(run_id, str(hf_dir), MODEL_DIR)
            for name, text in files.items():
                self.client.log_text(run_id, text, name)
            self.client.set_terminated(run_id)
            source = f"{run.info.artifact_uri}/{MODEL_DIR}"
            mv = self.client.create_model_version(model_name, source, run_id=run_id, tags=tags,
                                                  description=f"{version}: {HF_FORMAT} directory (see README.md)")
            self.client.set_registered_model_alias(model_name, ALIAS, mv.version)
        except Exception as e:
            self._undo(model_name, mv, run_id)
            if isinstance(e, MlflowRegistryError):
                raise
            raise MlflowRegistryError(f"registering {version} in {self.uri} failed, nothing was left registered: "
                                      f"{_short(e)}") from e
        log.info("registered %s as %s; alias %s moved", version, self.location(model_name, mv.version), ALIAS)
        return self._record(model_name, mv.version, run_id, version)

    def _record(self, model_name: str, mlflow_version, run_id: str | None, version: str) -> dict:
        return {"version": version, "model_uri": f"models:/{model_name}/{mlflow_version}",
                "metadata_uri": f"{tracking_uri(self.uri)}/#/models/{model_name}/versions/{mlflow_version}",
                "format": HF_FORMAT, "mlflow_version": str(mlflow_version), "mlflow_run_id": run_id}

    def _undo(self, model_name: str, mv, run_id: str | None) -> None:
        for what, undo in (("version", lambda: mv is not None and self.client.delete_model_version(
                model_name, mv.version)), ("run", lambda: run_id is not None and self.client.delete_run(run_id))):
            try:
                undo()
            except Exception as e:       # the server went away mid-way: say what may be left, raise the cause
                log.error("could not delete the %s created before the failure: %s", what, _short(e))

    def _ensure_model(self, model_name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(model_name)
        except MlflowException as e:
            if "RESOURCE_DOES_NOT_EXIST" not in str(e.error_code):
                raise
            self.client.create_registered_model(model_name, description="Trained by goodput-pipelines")

    def _experiment(self, name: str) -> str:
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    @staticmethod
    def _checkpoint_metrics(c: dict):
        for key in ("val_loss", "bpb"):
            if isinstance(c.get(key), (int, float)):
                yield f"checkpoint_{key}", c[key], int(c["step"])
        for task, values in (c.get("tasks") or {}).items():
            for metric, value in values.items():
                yield f"checkpoint_tasks/{task}/{metric}", value, int(c["step"])

    @staticmethod
    def _best_metrics(metadata: dict) -> dict[str, float]:
        metrics = metadata.get("metrics") or {}
        out = {k: metrics[k] for k in ("val_loss", "bpb") if isinstance(metrics.get(k), (int, float))}
        for task, values in (metrics.get("tasks") or {}).items():
            out.update({f"tasks/{task}/{m}": v for m, v in values.items()})
        return out

    @staticmethod
    def _tags(version: str, metadata: dict) -> dict[str, str]:
        data = metadata.get("data") or {}
        summary = metadata.get("run_summary") or {}
        try:
            nvrx = package_version("nvidia-resiliency-ext")
        except PackageNotFoundError:
            nvrx = ""
        tags: dict[str, Any] = {
            "version": version, "run_id": Path(str(metadata.get("source_run", ""))).name,
            "source_run": metadata.get("source_run"), "step": metadata.get("step"),
            "params_sha256": metadata.get("params_sha256"), "dataset_manifest_sha256": data.get("manifest_sha256"),
            "tokenizer": data.get("tokenizer_spec") or data.get("tokenizer") or "bytes",
            "goodput": summary.get("goodput"), "nvrx_release": nvrx, "promote_on": metadata.get("promote_on"),
            "model": json.dumps(metadata.get("model"), sort_keys=True)}
        return {f"{TAG}{k}": str(v) for k, v in tags.items() if v is not None and v != ""}


def registered_model(model_uri: str, registry: str, model_name: str, log=print) -> dict:
    """The register step's read-back of a version evaluate registered: ``models:/<name>/<n>`` must exist in
    the registry with its artifacts; ``production`` says whether the alias still names it.

    Raises:
        components.evaluate.registry_format.RegistrationError: not a version of this registered model, or no artifacts.
    """
    prefix = f"models:/{model_name}/"
    number = model_uri[len(prefix):] if model_uri.startswith(prefix) else ""
    if not number.isdigit():
        raise RegistrationError(f"model URI {model_uri!r} is not a version of {model_name} (expected {prefix}N): was "
                                f"the evaluate step given this registry?")
    reg = MlflowRegistry(registry)
    reg.check_reachable()
    try:
        mv = reg.client.get_model_version(model_name, number)
        listed = reg.client.list_artifacts(mv.run_id, MODEL_DIR) if mv.run_id else []
        production = reg._by_alias(model_name)
        metrics = reg.client.get_run(mv.run_id).data.metrics if mv.run_id else {}
    except Exception as e:
        raise RegistrationError(f"{reg.location(model_name, number)} cannot be read: {_short(e)}") from e
    names = {Path(f.path).name for f in listed}
    if "config.json" not in names:
        raise RegistrationError(f"{reg.location(model_name, number)} has no {MODEL_DIR}/config.json among its "
                                f"artifacts: not a Hugging Face directory")
    is_production = production is not None and str(production.version) == str(mv.version)
    if not is_production:
        log(f"note: the alias {ALIAS} of {model_name} names version "
            f"{production.version if production else None}, not {number}: another run was promoted after this one")
    return {"model_name": model_name, "version": mv.tags.get(f"{TAG}version", number), "model_uri": model_uri,
            "metadata_uri": reg._record(model_name, number, mv.run_id, "")["metadata_uri"],
            "production": is_production, "format": HF_FORMAT, "step": int(mv.tags[f"{TAG}step"])
            if f"{TAG}step" in mv.tags else None, "val_loss": metrics.get("val_loss"), "bpb": metrics.get("bpb"),
            "params_sha256": mv.tags.get(f"{TAG}params_sha256"), "source_run": mv.tags.get(f"{TAG}source_run"),
            "mlflow_version": number}
