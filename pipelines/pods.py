"""What the pipeline's step pods get from Kubernetes (kfp-kubernetes): the FSx claim, placement, the S3 secret.

Shared by the pipeline and its stage sub-pipeline, so every step pod is dressed the same way.
"""

from kfp import dsl, kubernetes

# Where every step pod mounts the FSx claim (a constant: kfp-kubernetes mount paths are compile-time).
from components.train.parameters import FSX_MOUNT
S3_KEYS = {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY"}
MLFLOW_KEYS = {"MLFLOW_TRACKING_TOKEN": "MLFLOW_TRACKING_TOKEN"}


def on_fsx(task: dsl.PipelineTask, pvc) -> dsl.PipelineTask:
    return kubernetes.mount_pvc(task, pvc_name=pvc, mount_path=FSX_MOUNT)


def placed(task: dsl.PipelineTask, node_selector, tolerations) -> dsl.PipelineTask:
    kubernetes.add_node_selector_json(task, node_selector)
    kubernetes.add_toleration_json(task, tolerations)
    return task


def with_s3_secret(task: dsl.PipelineTask, secret) -> dsl.PipelineTask:
    # Optional: with IRSA (EKS) there is no secret and boto3 uses the pod's role; for an S3-compatible
    # endpoint the keys come from this secret. Never a credential in the compiled YAML.
    return kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=S3_KEYS, optional=True)


def with_mlflow_secret(task: dsl.PipelineTask, secret) -> dsl.PipelineTask:
    # Optional, as the S3 secret: an mlflow+https:// registry's tracking token (MLflow's client reads
    # MLFLOW_TRACKING_TOKEN); a server without authentication needs none.
    return kubernetes.use_secret_as_env(task, secret_name=secret, secret_key_to_env=MLFLOW_KEYS, optional=True)
