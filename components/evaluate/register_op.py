"""KFP component: publish the promoted, registered model as the run's Model artifact
(``components.evaluate.register``)."""

import os

from kfp import dsl
from kfp.dsl import Model, Output

# The image the component runs in: it has this package (and so kfp) installed. Override both at
# compile time through the environment, as for the other components.
BASE_IMAGE = os.environ.get("GOODPUT_COMPONENT_IMAGE", "ghcr.io/goodput-pipelines/goodput:0.1.0")
PACKAGES = os.environ.get("GOODPUT_COMPONENT_PACKAGES", "").split()


@dsl.component(base_image=BASE_IMAGE, packages_to_install=PACKAGES, install_kfp_package=False)
def register_op(model_uri: str, registry: str, model_name: str, endpoint_url: str = "", *,
                model: Output[Model]):
    """Publish the promoted, registered model as this run's Model artifact.

    Args:
        model_uri: where evaluate registered the model (its ``model_uri`` output): a Hugging Face directory
            (``config.json``, safetensors, tokenizer files, README.md model card), for a model without one its
            ``model.pt``, or ``models:/<name>/<version>`` in MLflow.
        registry: the model registry evaluate wrote to: a directory, ``s3://bucket/prefix``, or an MLflow server
            (``mlflow://HOST:PORT``, ``mlflow+https://HOST``; the token from ``MLFLOW_TRACKING_TOKEN``), where the
            version must exist with its artifacts.
        model_name: the model's name in the registry.
        endpoint_url: S3-compatible endpoint for an ``s3://`` registry; empty for AWS.
        model: output; metadata = the registry record (version, format, step, loss, params_sha256), file = a
            JSON pointer to the registered model.
    """
    import json

    from components.evaluate.register import registered_model

    record = registered_model(model_uri, registry, model_name, endpoint_url or None)
    model.metadata.update({k: v for k, v in record.items() if v is not None})
    model.metadata["framework"] = "pytorch"
    with open(model.path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"registered {record['model_name']} {record['version']}: {model_uri}"
          f"{' (production)' if record['production'] else ''}")
