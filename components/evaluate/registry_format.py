"""What both model registries record, the file registry (``components.evaluate.register``) and the MLflow one
(``components.evaluate.mlflow_registry``): a version's format, and the error of a registry that does not hold
what evaluate registered."""

HF_FORMAT = "huggingface"
TORCH_FORMAT = "torch.save(state_dict)"


class RegistrationError(RuntimeError):
    """The registry does not hold what evaluate says it registered."""
