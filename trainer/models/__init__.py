"""Pluggable models: the protocol (``ModelSpec``), the registry (built-ins and ``package.module:function``),
the parallelisation plan, and Hugging Face weights in and out. ``docs/models.md`` describes them."""

from .parallelize import apply_parallelism, build_local, build_meta, build_model, num_params, unwrap
from .registry import ModelError, apply_overrides, load_model_config, pick_flavor, resolve_model, spec_from_run_config
from .spec import HFAdapter, ModelSpec, ParallelPlan, TensorParallelPlan, Vocabulary, lm_cross_entropy

__all__ = ["HFAdapter", "ModelError", "ModelSpec", "ParallelPlan", "TensorParallelPlan", "Vocabulary",
           "apply_overrides", "apply_parallelism", "build_local", "build_meta", "build_model", "lm_cross_entropy",
           "load_model_config", "num_params", "pick_flavor", "resolve_model", "spec_from_run_config", "unwrap"]
