"""The model registry: publish a promoted model (evaluate does, when its gate passes) and read its record
back as the run's KFP ``Model`` artifact (the register step).

Layout (a directory or ``s3://bucket/prefix``)::

    <registry>/<model_name>/<version>/config.json        a Hugging Face directory, servable as it lands:
    <registry>/<model_name>/<version>/model.safetensors  transformers' from_pretrained and vLLM load it
                      (or model-0000i-of-0000n.safetensors + model.safetensors.index.json above the shard size)
    <registry>/<model_name>/<version>/tokenizer.json ... the dataset's tokenizer files, when it has them
    <registry>/<model_name>/<version>/model.pt           instead, for a model without a Hugging Face adapter
                                                         (bytegpt): torch.save of the full state dict
    <registry>/<model_name>/<version>/metadata.json      source run, step, metrics, model spec, format, files
    <registry>/<model_name>/production.json              the current production version (written last)

Files go up first, then ``metadata.json`` (which lists them), then ``production.json``: a crash at any
moment leaves production naming a complete model. A version's ``model_uri`` is its directory for a
Hugging Face layout and its ``model.pt`` otherwise.

The register step, which the pipeline runs only when evaluate says ``promoted``, reads the record back,
checks that every file ``metadata.json`` lists is there and whether ``production.json`` still names this
model (a concurrent run may have promoted another since), and publishes it as a ``Model`` artifact whose
metadata are the version, URI, format, step, loss and ``params_sha256``. The KFP component is
``components.evaluate.register_op.register_op``.

    from components.evaluate.register import registered_model
    record = registered_model("fsx/models/llama/<run>-step000000060", "fsx/models", "llama")
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from components.evaluate.registry_format import HF_FORMAT, TORCH_FORMAT, RegistrationError
from trainer.durable import copy_file, write_bytes
from trainer.s3url import is_s3_url, parse_s3_url

MODEL_FILE = "model.pt"
METADATA_FILE = "metadata.json"
PRODUCTION_FILE = "production.json"
MODEL_CARD = "README.md"


def check_registry_uri(uri: str) -> str:
    """``uri`` if it is a registry we serve: a directory, ``s3://bucket/prefix``, ``mlflow://HOST:PORT`` or
    ``mlflow+https://HOST[/PATH]``; any other scheme is refused (it would otherwise become a local directory)."""
    from components.evaluate.mlflow_registry import is_mlflow, tracking_uri

    scheme, sep, _ = uri.partition("://")
    if is_mlflow(uri):
        tracking_uri(uri)           # a host is given
    elif sep and scheme != "s3":
        raise ValueError(f"registry {uri!r}: the scheme {scheme}:// is not served; give a directory, "
                         f"s3://BUCKET/PREFIX, mlflow://HOST:PORT or mlflow+https://HOST")
    return uri


def registry_name(model: str, model_name: str = "") -> str:
    """The registry name of the model: ``model_name``, else the built-in's name or the user module's last part."""
    from trainer.layout import NAME_RE

    name = model_name or model.partition(":")[0].rsplit(".", 1)[-1]
    if not NAME_RE.match(name):
        raise ValueError(f"model_name {name!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
    return name


def open_registry(uri: str, endpoint_url: str | None = None):
    """The registry at ``uri``: a ``Registry`` (directory, S3) or a
    ``components.evaluate.mlflow_registry.MlflowRegistry``."""
    from components.evaluate.mlflow_registry import MlflowRegistry, is_mlflow

    return MlflowRegistry(check_registry_uri(uri)) if is_mlflow(uri) else Registry(uri, endpoint_url)


class Registry:
    """A model registry location: a directory or ``s3://bucket/prefix`` (boto3, standard credentials)."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        check_registry_uri(uri)
        self.uri = uri.rstrip("/")
        self.s3 = is_s3_url(self.uri)
        if self.s3:
            from components.s3 import s3_client

            url = parse_s3_url(self.uri, "registry")
            self.bucket, self.prefix = url.bucket, url.key
            self.client = s3_client(endpoint_url, retry_mode="standard", max_attempts=5)

    def _key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def location(self, rel: str) -> str:
        return f"{self.uri}/{rel}"

    def read_json(self, rel: str) -> dict | None:
        if self.s3:
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=self._key(rel))["Body"].read()
            except self.client.exceptions.NoSuchKey:
                return None
            return json.loads(body)
        path = Path(self.uri) / rel
        return json.loads(path.read_text()) if path.is_file() else None

    def exists(self, rel: str) -> bool:
        if self.s3:
            from botocore.exceptions import ClientError

            try:
                self.client.head_object(Bucket=self.bucket, Key=self._key(rel))
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise
            return True
        return (Path(self.uri) / rel).is_file()

    def fetch(self, rel: str, dest: Path) -> Path:
        if self.s3:
            dest.parent.mkdir(parents=True, exist_ok=True)
            self.client.download_file(self.bucket, self._key(rel), str(dest))
            return dest
        return Path(self.uri) / rel

    def put_file(self, src: Path, rel: str) -> str:
        if self.s3:
            self.client.upload_file(str(src), self.bucket, self._key(rel))
        else:
            dest = Path(self.uri) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            copy_file(src, dest)
        return self.location(rel)

    def put_json(self, obj: dict, rel: str) -> str:
        data = json.dumps(obj, indent=1).encode()
        if self.s3:
            self.client.put_object(Bucket=self.bucket, Key=self._key(rel), Body=data,
                                   ContentType="application/json")
        else:
            dest = Path(self.uri) / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(dest, data)
        return self.location(rel)


def publish_model(reg: Registry, model_name: str, version: str, spec: Any, state_dict: dict, metadata: dict,
                  tmp: Path, *, tokenizer_dir: Path | None = None, max_shard_bytes: int | None = None,
                  production_extra: dict | None = None) -> dict:
    """Write a model's files, then its ``metadata.json``, then point ``production.json`` at it (last).

    Args:
        reg: the registry.
        model_name, version: where it goes: ``<model_name>/<version>/``.
        spec: the model's ``trainer.models.ModelSpec``; with a Hugging Face adapter the version is a
            Hugging Face directory (``trainer.models.hf.export_state_dict``), else one ``model.pt``.
        state_dict: the full weights, our names.
        metadata: what ``metadata.json`` records; ``format``, ``files`` and ``model_uri`` are added.
        tmp: a scratch directory for the files before they are uploaded.
        tokenizer_dir: tokenizer files to ship with a Hugging Face directory.
        max_shard_bytes: shard the safetensors above this (default: Hugging Face's 5 GB).
        production_extra: more fields for ``production.json`` (the loss it was promoted with).

    Returns:
        version, model_uri, metadata_uri, format.

    Raises:
        RegistrationError: the version is registered already with other weights.
    """
    import torch

    from trainer.models.hf import DEFAULT_MAX_SHARD_BYTES, export_state_dict

    base = f"{model_name}/{version}"
    existing = reg.read_json(f"{base}/{METADATA_FILE}")
    if existing is not None:
        # A retried evaluate step registers the same weights again: point production at them, rewrite nothing.
        if existing.get("params_sha256") != metadata.get("params_sha256"):
            raise RegistrationError(f"{reg.location(base)} already holds other weights (params_sha256 "
                                    f"{str(existing.get('params_sha256'))[:16]}..., these are "
                                    f"{str(metadata.get('params_sha256'))[:16]}...): a registered version never "
                                    f"changes; give the run another name or remove that version")
        fmt = existing.get("format", TORCH_FORMAT)
        model_uri = existing.get("model_uri") or reg.location(f"{base}/{MODEL_FILE}")
        metadata_uri = reg.location(f"{base}/{METADATA_FILE}")
        _point_production(reg, model_name, version, model_uri, metadata_uri, fmt, production_extra)
        return {"version": version, "model_uri": model_uri, "metadata_uri": metadata_uri, "format": fmt}
    if spec.hf is not None:
        local = export_state_dict(state_dict, spec, tmp / "hf", tokenizer_dir=tokenizer_dir, overwrite=True,
                                  max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
        fmt, model_uri = HF_FORMAT, reg.location(base)
    else:
        local = tmp / "pt"
        local.mkdir(parents=True, exist_ok=True)
        torch.save(state_dict, local / MODEL_FILE)
        fmt, model_uri = TORCH_FORMAT, reg.location(f"{base}/{MODEL_FILE}")
    (local / MODEL_CARD).write_text(model_card(model_name, version, metadata, fmt))
    files = sorted(p.name for p in local.iterdir())
    for name in files:
        reg.put_file(local / name, f"{base}/{name}")
    meta = dict(metadata, format=fmt, files=files, model_uri=model_uri)
    if fmt == TORCH_FORMAT:
        meta["format_note"] = (f"{spec.name} has no Hugging Face adapter (its spec sets no `hf`): the weights are "
                               f"torch.save of its state dict; build the model with trainer.models.resolve_model"
                               f"(**model) and load_state_dict")
    metadata_uri = reg.put_json(meta, f"{base}/{METADATA_FILE}")
    _point_production(reg, model_name, version, model_uri, metadata_uri, fmt, production_extra)
    return {"version": version, "model_uri": model_uri, "metadata_uri": metadata_uri, "format": fmt}


def model_card(model_name: str, version: str, metadata: dict, fmt: str = HF_FORMAT, mlflow_uri: str = "") -> str:
    """The README.md of a registered version: what it was trained on, how far, how well, and how to load it."""
    data, metrics = metadata.get("data") or {}, metadata.get("metrics") or {}
    summary = metadata.get("run_summary") or {}
    model = metadata.get("model") or {}
    goodput = summary.get("goodput")
    lines = [f"# {model_name} {version}", "",
             f"{model.get('name', model_name)} {model.get('flavor', '')}".rstrip() + f", trained by goodput-pipelines "
             f"from the run `{metadata.get('source_run')}` (checkpoint of step {metadata.get('step')}).", "",
             "## Training", "",
             f"- data: `{data.get('dir')}` (manifest sha256 `{data.get('manifest_sha256')}`)",
             f"- tokenizer: {data.get('tokenizer_spec') or data.get('tokenizer') or 'bytes (one token per byte)'}",
             f"- steps: {summary.get('steps', metadata.get('step'))}, tokens: {summary.get('tokens', '-')}",
             f"- goodput: {goodput:.1%}" if isinstance(goodput, (int, float)) else "- goodput: -",
             f"- weights sha256: `{metadata.get('params_sha256')}`", "",
             "## Evaluation", "",
             f"- validation loss: {metrics.get('val_loss', float('nan')):.4f} nats/token, "
             f"{metrics.get('bpb', float('nan')):.4f} bits/byte ({metrics.get('windows')} windows of "
             f"{metrics.get('seq_len')} tokens)"]
    tasks = metrics.get("tasks") or {}
    if tasks:
        lines += ["", "| task | metric | value |", "| --- | --- | --- |"]
        lines += [f"| {t} | {m} | {v:.4f} |" for t, values in sorted(tasks.items()) for m, v in sorted(values.items())]
    gate = metadata.get("gate") or {}
    lines += ["", f"Promoted on {metadata.get('promote_on') or 'val_loss'}: {gate.get('reason', '')}", "",
              "## Load it", ""]
    if fmt == HF_FORMAT and mlflow_uri:
        lines += ["```python", "import mlflow, transformers", "",
                  f"mlflow.set_tracking_uri({mlflow_uri!r})",
                  f"# this version: models:/{model_name}/<version> (its tag goodput.version is {version})",
                  f"path = mlflow.artifacts.download_artifacts('models:/{model_name}@production')",
                  "model = transformers.AutoModelForCausalLM.from_pretrained(path)", "```"]
    elif fmt == HF_FORMAT:
        lines += ["```python", "import transformers", "",
                  "model = transformers.AutoModelForCausalLM.from_pretrained('DIR')  # this directory", "```",
                  "", "vLLM serves the directory as it is: `vllm serve DIR`."]
    else:
        lines += ["```python", "import torch", "from trainer.models import build_local, resolve_model", "",
                  "spec = resolve_model(**metadata['model'])  # metadata.json beside this file",
                  "model = build_local(spec); model.load_state_dict(torch.load('model.pt'))", "```"]
    return "\n".join(lines) + "\n"


def publish_model_mlflow(reg, model_name: str, version: str, spec: Any, state_dict: dict, metadata: dict, tmp: Path,
                         *, tokenizer_dir: Path | None = None, max_shard_bytes: int | None = None,
                         checkpoints: list[dict] = (), files: dict[str, str] | None = None) -> dict:
    """``publish_model`` for an MLflow registry (``components.evaluate.mlflow_registry``): the Hugging Face
    directory with its model card becomes a new version, ``production`` moves to it last. Arguments as
    ``publish_model``; ``checkpoints`` (every scored one) and ``files`` (report.html, evaluation.json) go to
    the version's run."""
    from trainer.models.hf import DEFAULT_MAX_SHARD_BYTES, export_state_dict

    if spec.hf is None:
        raise RegistrationError(f"an MLflow registry takes Hugging Face directories; {spec.name} has no Hugging Face "
                                f"layout (its spec sets no `hf`): register it in a directory or s3:// registry")
    from components.evaluate.mlflow_registry import tracking_uri

    local = export_state_dict(state_dict, spec, tmp / "hf", tokenizer_dir=tokenizer_dir, overwrite=True,
                              max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)
    (local / MODEL_CARD).write_text(model_card(model_name, version, metadata, HF_FORMAT, tracking_uri(reg.uri)))
    return reg.publish(model_name, version, local, metadata, list(checkpoints), files or {})


def _point_production(reg: Registry, model_name: str, version: str, model_uri: str, metadata_uri: str, fmt: str,
                      extra: dict | None) -> None:
    reg.put_json({"version": version, "model_uri": model_uri, "metadata_uri": metadata_uri, "format": fmt,
                  **(extra or {}), "promoted_at": time.time()}, f"{model_name}/{PRODUCTION_FILE}")


def load_registered_model(reg: Registry, model_name: str, version: str, meta: dict, tmp: Path):
    """(spec, model) of a registered version, weights loaded, on the CPU; ``meta`` is its metadata.

    Metadata written before models were pluggable name no ``model``: those are ByteGPT ``model.pt`` files.
    """
    import torch

    from trainer.models import build_local, resolve_model
    from trainer.models.hf import load_hf_weights

    described = meta.get("model") or {"name": "bytegpt", "flavor": "", "config": meta["model_config"]}
    spec = resolve_model(described["name"], described.get("flavor", ""), described.get("config") or {})
    model = build_local(spec)
    files = meta.get("files") or [MODEL_FILE]
    local = tmp / f"registered-{version}"
    paths = {name: reg.fetch(f"{model_name}/{version}/{name}", local / name) for name in files}
    if meta.get("format") == HF_FORMAT:
        load_hf_weights(model, spec, paths[files[0]].parent)
    else:
        model.load_state_dict(torch.load(paths[MODEL_FILE], map_location="cpu", weights_only=True))
    return spec, model.eval()


def registered_model(model_uri: str, registry: str, model_name: str, endpoint_url: str | None = None,
                     log: Callable[[str], None] = print) -> dict:
    """The registry's record of the model at ``model_uri``: version, URIs, format, step, metrics, production flag.

    Raises:
        RegistrationError: ``model_uri`` is empty or not in ``registry``, or its metadata or any file the
            metadata lists is missing.
    """
    from components.evaluate.mlflow_registry import is_mlflow

    if is_mlflow(registry):
        from components.evaluate.mlflow_registry import registered_model as mlflow_registered_model

        return mlflow_registered_model(model_uri, registry, model_name, log)
    reg = Registry(registry, endpoint_url)
    prefix = reg.location(f"{model_name}/")
    version = model_uri[len(prefix):].removesuffix(f"/{MODEL_FILE}") if model_uri.startswith(prefix) else ""
    if not version or "/" in version:
        raise RegistrationError(f"model URI {model_uri!r} is not a registered model under {prefix} (expected "
                                f"{prefix}VERSION or {prefix}VERSION/{MODEL_FILE}): was the evaluate step given "
                                f"this registry?")
    meta = reg.read_json(f"{model_name}/{version}/{METADATA_FILE}")
    if meta is None:
        raise RegistrationError(f"{reg.location(f'{model_name}/{version}/{METADATA_FILE}')} is missing")
    missing = [f for f in meta.get("files") or [MODEL_FILE] if not reg.exists(f"{model_name}/{version}/{f}")]
    if missing:
        raise RegistrationError(f"{reg.location(f'{model_name}/{version}')}: {', '.join(missing)} is missing "
                                f"(listed in its {METADATA_FILE})")
    production = reg.read_json(f"{model_name}/{PRODUCTION_FILE}") or {}
    is_production = production.get("model_uri") == model_uri
    if not is_production:
        log(f"note: {reg.location(f'{model_name}/{PRODUCTION_FILE}')} names {production.get('version')!r}, "
            f"not {version!r}: another run was promoted after this one")
    metrics = meta.get("metrics") or {}
    return {"model_name": model_name, "version": version, "model_uri": model_uri,
            "metadata_uri": reg.location(f"{model_name}/{version}/{METADATA_FILE}"), "production": is_production,
            "format": meta.get("format", TORCH_FORMAT), "step": meta.get("step"), "val_loss": metrics.get("val_loss"),
            "bpb": metrics.get("bpb"), "params_sha256": meta.get("params_sha256"), "source_run": meta.get("source_run")}
