# The trainer image: CUDA PyTorch (NGC), EFA userspace + the aws-ofi-nccl plugin for NCCL over EFA on p5/p4d,
# NVIDIA Resiliency Extension (ft_launcher) and this package. The PyTorchJob runs
# `ft_launcher ... -m trainer ...` in it; the evaluate step runs here too (it needs torch).
#
#   docker build -f images/trainer.Dockerfile -t $REGISTRY/goodput-trainer:0.1.0 .
#   docker build -f images/trainer.Dockerfile --build-arg NVRX_RELEASE=0.6.0 -t $REGISTRY/goodput-trainer:0.1.0-nvrx0.6.0 .
#
# Pipeline parameter trainer_image=$REGISTRY/goodput-trainer:0.1.0; GOODPUT_EVALUATE_IMAGE at compile time.
# The pods' launch command is built for the image's NVRx release: the default below (trainer/compat.py's
# IMAGE_RELEASE, which a test ties to it), or the one an image built with another NVRX_RELEASE carries in its
# io.goodput.nvrx-release label, given to `goodput render-job --nvrx-release` / the job option nvrx_release.
# `bash images/check_deps.sh trainer` checks, without building, that the requirements resolve on this base for
# each release below.
# NGC PyTorch 26.07: torch 2.13.0a0 (the version trainer/compat.py's private torch APIs were checked on), CUDA 13.3,
# Python 3.12, Ubuntu 24.04 (glibc 2.39).
FROM nvcr.io/nvidia/pytorch:26.07-py3

ARG EFA_INSTALLER_VERSION=1.43.2
# A release trainer/compat.py was checked on that has a wheel for this Python: 0.5.0, 0.6.0 or 0.7.0 (0.4.1 has
# none for Python 3.12). The build fails for any other.
ARG NVRX_RELEASE=0.7.0
LABEL io.goodput.nvrx-release="${NVRX_RELEASE}"

# EFA: the container gets the devices from the EFA device plugin; it needs the userspace side only (no kernel
# module). The NGC image's own verbs libraries conflict with EFA's rdma-core, so they go first.
RUN apt-get update \
 && (apt-get remove -y --allow-change-held-packages ibverbs-utils libibverbs-dev libibverbs1 libmlx5-1 || true) \
 && cd /tmp \
 && curl -fsSLO https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz \
 && tar -xf aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz \
 && cd aws-efa-installer \
 && ./efa_installer.sh -y -g -d --skip-kmod --skip-limit-conf --no-verify \
 && cd / && rm -rf /tmp/aws-efa-installer* /var/lib/apt/lists/*
ENV PATH=/opt/amazon/efa/bin:${PATH} \
    LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib/x86_64-linux-gnu:/opt/amazon/efa/lib:${LD_LIBRARY_PATH} \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

WORKDIR /opt/goodput
COPY images/requirements-components.txt images/requirements-trainer.txt images/
# NGC's torch is a pre-release build (e.g. 2.13.0a0+...): held at exactly that version, so no requirement can
# make pip replace it with a PyPI wheel built for another CUDA. (NGC's own pins, PIP_CONSTRAINT, apply too.)
RUN pip list --format=freeze | grep -E '^torch==' > /tmp/base-constraints.txt \
 && pip install -c /tmp/base-constraints.txt -r images/requirements-trainer.txt "nvidia-resiliency-ext==${NVRX_RELEASE}"

COPY pyproject.toml README.md ./
COPY trainer trainer
COPY components components
COPY pipelines pipelines
# The installed NVRx is the labelled one, and one the launch command is checked for.
RUN pip install --no-deps . \
 && python -c "import torch, nvidia_resiliency_ext, prometheus_client, trainer.train, components.evaluate.evaluate" \
 && python -c "from trainer import compat; assert compat.installed_release() == compat.image_release('${NVRX_RELEASE}')" \
 && ft_launcher --help > /dev/null \
 && python -m trainer --help > /dev/null

# Not root (uid 10001, as in the component image, so files on FSx stay readable and writable by both).
# KFP's artifact mounts must exist and be writable for the evaluate step.
RUN useradd --uid 10001 --create-home goodput \
 && mkdir -p /gcs /minio /s3 /oci \
 && chown goodput /gcs /minio /s3 /oci
USER 10001
ENV HOME=/home/goodput

# The PyTorchJob gives the command; this is for `docker run IMAGE`.
CMD ["python", "-m", "trainer", "--help"]
