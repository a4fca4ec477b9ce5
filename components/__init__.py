"""KFP components. Each module holds one capability: a plain Python function (the core, used by the CLI
and the tests) and a thin ``@dsl.component`` that imports and calls it.

Exports are resolved lazily, so importing one component's module never imports the others (or torch).
"""

from __future__ import annotations

import importlib

# exported name -> module that defines it
_EXPORTS = {
    "stage_dataset": "components.stage.dataset",
    "stage_op": "components.stage.dataset_op",
    "StageResult": "components.stage.dataset",
    "StageError": "components.stage.dataset",
    "evaluate_run": "components.evaluate.evaluate",
    "evaluate_op": "components.evaluate.evaluate_op",
    "EvaluationResult": "components.evaluate.evaluate",
    "JobSpec": "components.train.pytorchjob",
    "build_pytorchjob": "components.train.pytorchjob",
    "job_manifest": "components.train.pytorchjob",
    "job_name_for": "components.train.pytorchjob",
    "run_job": "components.train.supervise",
    "SuperviseConfig": "components.train.supervise",
    "train_op": "components.train.launch",
    "TrainResult": "components.train.launch",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'components' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
