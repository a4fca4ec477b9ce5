"""Compile the pipeline to KFP YAML: ``goodput compile --component-image ... --trainer-image ... -o FILE``.

The train backend is a compile-time choice (``pipelines.pipeline.build_pipeline``): ``pytorchjob`` (the
default) or ``trainjob`` (``--backend``); the compiled pipeline has no backend parameter, and
``goodput run --local`` compiles the ``local`` variant itself. The output depends only on the source, the
backend and the two images: kfp 2.17 writes no timestamps, orders components and tasks as the pipeline
defines them, and the platform spec (kfp-kubernetes) is a mapping serialized with sorted keys, so compiling
twice, in two processes, gives the same bytes (tests/test_pipeline_compile.py).

Two images run the pipeline's pods. The *component image* (images/components.Dockerfile, no torch) runs
every other step; the *trainer image* (images/trainer.Dockerfile: CUDA torch, EFA, NVRx) runs the
job's pods (the ``trainer_image`` run parameter, whose default this sets), the check-settings step, which
builds the model to check it (torch, and the user's own model package, are only there), and the evaluate
step, which loads checkpoints with torch. The components' decorators fix a placeholder image at import time;
the compiled executors get the given ones here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

COMPONENT_IMAGE_ENV = "GOODPUT_COMPONENT_IMAGE"
TRAINER_IMAGE_ENV = "GOODPUT_TRAINER_IMAGE"
TRAINER_EXECUTORS = ("exec-train-config-op", "exec-evaluate-op")
"""Steps that run on the trainer image (they import torch, and the model's code)."""
BACKENDS = ("pytorchjob", "trainjob")
"""What ``goodput compile --backend`` compiles for; ``local`` is ``goodput run --local``'s."""


def check_image(ref: str, what: str) -> str:
    """``ref`` if it is a pinned image reference, else a ValueError saying what to pass."""
    from components.train.pytorchjob import image_ref_problem

    problem = image_ref_problem(ref, pinned=True)
    if problem:
        raise ValueError(f"{what}: {problem}")
    return ref


def compile_pipeline(path: Path, pipeline_func=None, *, backend: str = "pytorchjob", component_image: str = "",
                     trainer_image: str = "") -> Path:
    """Write the compiled pipeline (this checkout's unless ``pipeline_func`` is given) to ``path``.

    Args:
        path: where the YAML goes.
        pipeline_func: a ``@dsl.pipeline`` function; default this checkout's pipeline for ``backend``.
        backend: the train backend compiled in: ``pytorchjob``, ``trainjob`` or ``local``.
        component_image: image of every step but evaluate; empty = $GOODPUT_COMPONENT_IMAGE, else the
            components' built-in placeholder (fine for ``kfp.local``, which ignores images).
        trainer_image: image of the job's pods (default of the ``trainer_image`` parameter) and of the
            check-settings and evaluate steps; empty = $GOODPUT_TRAINER_IMAGE, else the placeholder.

    Raises:
        ValueError: an image is not a reference with a tag or digest, or an unknown backend.
    """
    from kfp import compiler

    component_image = component_image or os.environ.get(COMPONENT_IMAGE_ENV, "")
    trainer_image = trainer_image or os.environ.get(TRAINER_IMAGE_ENV, "")
    if component_image:
        check_image(component_image, "component image")
    if trainer_image:
        check_image(trainer_image, "trainer image")
    if pipeline_func is None:
        from pipelines.pipeline import build_pipeline

        pipeline_func = build_pipeline(backend)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(pipeline_func, package_path=str(path))
    if component_image or trainer_image:
        _set_images(path, component_image, trainer_image)
    return path


def _set_images(path: Path, component_image: str, trainer_image: str) -> None:
    """Point every executor at its image and default ``trainer_image`` to the trainer image, in place."""
    import yaml

    text = path.read_text()
    lines = text.splitlines(keepends=True)
    n = next((i for i, ln in enumerate(lines) if not ln.startswith("#")), len(lines))
    header, body = "".join(lines[:n]), "".join(lines[n:])
    docs = list(yaml.safe_load_all(body))
    spec = docs[0]
    for name, executor in spec["deploymentSpec"]["executors"].items():
        image = trainer_image if name in TRAINER_EXECUTORS else component_image
        if image and "container" in executor:
            executor["container"]["image"] = image
    param = spec["root"]["inputDefinitions"]["parameters"].get("trainer_image")
    if trainer_image and param is not None:
        param["defaultValue"] = trainer_image
        for comp in spec["components"].values():     # the train step's own default, for a reader of the YAML
            image = comp.get("inputDefinitions", {}).get("parameters", {}).get("image")
            if image is not None and "defaultValue" in image:
                image["defaultValue"] = trainer_image
        header = re.sub(r"(#\s+trainer_image: str \[Default: ')[^']*(')", rf"\g<1>{trainer_image}\g<2>", header)
    # As kfp writes it: its header comments, then the documents with sorted keys.
    path.write_text(header + yaml.dump_all(docs, sort_keys=True))
