"""Register: record the promoted model as the run's KFP ``Model`` artifact, checked against the registry.

The evaluate step writes the consolidated model into the registry when its gate passes
(``<registry>/<model_name>/<version>/model.pt`` + ``metadata.json``, then ``production.json``). This
step, which the pipeline runs only when evaluate says ``promoted``, reads that record back, checks that
the files are there and whether ``production.json`` still names this model (a concurrent run may have
promoted another since), and publishes it as a ``Model`` artifact: the registered version, its URI, step,
validation loss and ``params_sha256`` become the artifact's metadata, so the KFP UI and ML Metadata
link the run to the model it produced. The weights stay in the registry; the artifact's file is a
small JSON pointer to them. The KFP component is ``components.register_op.register_op``.

    from components.register import registered_model
    record = registered_model("fsx/models/bytegpt/<run>-step000000060/model.pt", "fsx/models", "bytegpt")
"""


import os
from typing import Callable


class RegistrationError(RuntimeError):
    """The registry does not hold what evaluate says it registered."""


def registered_model(model_uri: str, registry: str, model_name: str, endpoint_url: str | None = None,
                     log: Callable[[str], None] = print) -> dict:
    """The registry's record of the model at ``model_uri``: version, URIs, step, metrics, production flag.

    Raises:
        RegistrationError: ``model_uri`` is empty or not in ``registry``, or its metadata or weights are
            missing.
    """
    from components.evaluate import METADATA_FILE, MODEL_FILE, PRODUCTION_FILE, Registry

    reg = Registry(registry, endpoint_url)
    prefix = reg.location(f"{model_name}/")
    if not model_uri or not model_uri.startswith(prefix) or not model_uri.endswith(f"/{MODEL_FILE}"):
        raise RegistrationError(f"model URI {model_uri!r} is not a {MODEL_FILE} under {prefix}: was the evaluate "
                                f"step given this registry?")
    version = model_uri[len(prefix):-len(MODEL_FILE) - 1]
    meta = reg.read_json(f"{model_name}/{version}/{METADATA_FILE}")
    if meta is None:
        raise RegistrationError(f"{reg.location(f'{model_name}/{version}/{METADATA_FILE}')} is missing")
    if not reg.s3 and not os.path.isfile(model_uri):
        raise RegistrationError(f"{model_uri} is missing")
    production = reg.read_json(f"{model_name}/{PRODUCTION_FILE}") or {}
    is_production = production.get("model_uri") == model_uri
    if not is_production:
        log(f"note: {reg.location(f'{model_name}/{PRODUCTION_FILE}')} names {production.get('version')!r}, "
            f"not {version!r}: another run was promoted after this one")
    metrics = meta.get("metrics") or {}
    return {"model_name": model_name, "version": version, "model_uri": model_uri,
            "metadata_uri": reg.location(f"{model_name}/{version}/{METADATA_FILE}"), "production": is_production,
            "step": meta.get("step"), "val_loss": metrics.get("val_loss"), "bpb": metrics.get("bpb"),
            "params_sha256": meta.get("params_sha256"), "source_run": meta.get("source_run")}
