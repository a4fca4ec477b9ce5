"""KFP components. Each module holds one capability: a plain Python function (the core, used by the CLI
and the tests) and a thin ``@dsl.component`` that imports and calls it.

Exports are resolved lazily, so importing one component's module never imports the others (or torch).
"""

from __future__ import annotations

import importlib

# exported name -> module that defines it
_EXPORTS = {
    "stage_dataset": "components.stage",
    "stage_op": "components.stage_op",
    "StageResult": "components.stage",
    "StageError": "components.stage",
    "evaluate_run": "components.evaluate",
    "evaluate_op": "components.evaluate_op",
    "EvaluationResult": "components.evaluate",
    "JobSpec": "components.pytorchjob",
    "build_pytorchjob": "components.pytorchjob",
    "job_manifest": "components.pytorchjob",
    "job_name_for": "components.pytorchjob",
    "run_job": "components.supervise",
    "SuperviseConfig": "components.supervise",
    "train_op": "components.train",
    "TrainResult": "components.train",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'components' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
