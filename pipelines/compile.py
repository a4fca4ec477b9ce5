"""Compile the pipeline to KFP YAML: ``goodput compile -o goodput-pipeline.yaml``.

The output depends only on the source: kfp 2.17 writes no timestamps, orders components and tasks as
the pipeline defines them, and the platform spec (kfp-kubernetes) is a mapping serialized with sorted
keys, so compiling twice, in two processes, gives the same bytes (tests/test_pipeline_compile.py).
"""

from __future__ import annotations

from pathlib import Path

PIPELINE_NAME = "goodput-train"
"""The pipeline's name in KFP (``pipelineInfo.name``) and the default name for ``goodput upload``."""


def compile_pipeline(path: Path, pipeline_func=None) -> Path:
    """Write the compiled pipeline (this checkout's unless ``pipeline_func`` is given) to ``path``."""
    from kfp import compiler

    if pipeline_func is None:
        from pipelines.pipeline import goodput_pipeline as pipeline_func
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline_func, package_path=str(path))
    return path
