# The light image of the pipeline's steps: stage, stage init_from, train (the job's launcher), register, cleanup.
# No torch, no CUDA (check settings builds the model on the meta device and evaluate loads checkpoints with
# torch: both run on the trainer image).
#
#   docker build -f images/components.Dockerfile -t $REGISTRY/goodput-components:0.1.0 .
#
# Compile the pipeline against it: GOODPUT_COMPONENT_IMAGE=$REGISTRY/goodput-components:0.1.0 goodput compile
FROM python:3.11.13-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# mimalloc: the stage's tokenizer workers preload it (components/stage/tokens.py); a third of their time on
# glibc's malloc is allocation.
RUN apt-get update && apt-get install -y --no-install-recommends libmimalloc2.0 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/goodput
COPY images/requirements-components.txt images/
RUN pip install -r images/requirements-components.txt

COPY pyproject.toml README.md ./
COPY trainer trainer
COPY components components
COPY pipelines pipelines
# --no-deps: the package's dependencies include torch and nvidia-resiliency-ext, which no step here imports.
# The check fails the build if a component module pulls in torch at import time.
RUN pip install --no-deps . \
 && python -c "import sys, components.stage.dataset, components.stage.model, components.train.launch, components.train.settings, components.evaluate.register, components.train.cleanup, components.train.supervise, components.train.pytorchjob, pipelines.cli; sys.exit('torch' in sys.modules)" \
 && goodput --help > /dev/null

# Not root. KFP writes artifacts below /gcs, /minio, /s3 or /oci, which must exist and be writable. The same
# uid as the trainer image, so both can read and write what the other leaves on FSx.
RUN useradd --uid 10001 --create-home goodput \
 && mkdir -p /gcs /minio /s3 /oci \
 && chown goodput /gcs /minio /s3 /oci
USER 10001
ENV HOME=/home/goodput

# KFP runs its own command (python3 -m kfp.dsl.executor_main); this is for `docker run IMAGE`.
CMD ["goodput", "--help"]
