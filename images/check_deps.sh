#!/usr/bin/env bash
# Do the images' Python dependencies resolve for the images' platforms? pip's resolver, run for the base image's
# Python and glibc without building anything or installing here (needs PyPI; .ci/run runs it):
#
#   bash images/check_deps.sh                  # the component image, and the trainer image with every NVRx
#   bash images/check_deps.sh trainer 0.7.0    # one image (and one NVRx release)
#
# The trainer image is checked with each NVRx release it can be built with (NVRX_RELEASE): trainer/compat.py's
# CHECKED releases that have a wheel for its Python. torch comes from the base image (an NGC build, held at its
# version); PyPI's release of the same version stands in for it. A dependency PyPI has only as an sdist is built
# into a wheel here first (it must come out pure Python, py3-none-any, so it is the same on the image's platform).
set -euo pipefail
cd "$(dirname "$0")/.."

# What each base image is: its FROM line, Python, glibc (manylinux_2_<minor>). A changed FROM fails here until
# these are updated.
TRAINER_BASE="nvcr.io/nvidia/pytorch:26.07-py3"; TRAINER_PYTHON=3.12; TRAINER_GLIBC_MINOR=39   # Ubuntu 24.04
TRAINER_TORCH=2.13.0                                                                         # 2.13.0a0 there
COMPONENTS_BASE="python:3.11.13-slim-bookworm"; COMPONENTS_PYTHON=3.11; COMPONENTS_GLIBC_MINOR=36   # Debian 12
# NVRx releases with no wheel for the trainer image's Python: not buildable there (PyPI has 0.4.1 for <= 3.11).
NVRX_NOT_ON_TRAINER_PYTHON="0.4.1"
# Pinned dependencies that PyPI has as sdists only.
SDIST_ONLY="kfp-server-api sqlitedict word2number"

die() { echo "check_deps: $*" >&2; exit 1; }

base_of() { sed -n 's/^FROM \([^ ]*\).*/\1/p' "images/$1.Dockerfile"; }
[ "$(base_of trainer)" = "$TRAINER_BASE" ] || die "images/trainer.Dockerfile is FROM $(base_of trainer), not $TRAINER_BASE: update this script's facts about the base"
[ "$(base_of components)" = "$COMPONENTS_BASE" ] || die "images/components.Dockerfile is FROM $(base_of components), not $COMPONENTS_BASE: update this script's facts about the base"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
wheels="$work/wheels"
mkdir -p "$wheels"

pin() { sed -n "s/^$1==\([^ #]*\).*/\1/p" images/requirements-components.txt images/requirements-trainer.txt | head -1; }
for name in $SDIST_ONLY; do
    version=$(pin "$name")
    [ -n "$version" ] || die "$name is not pinned in images/requirements-*.txt"
    python -m pip wheel --quiet --no-deps --no-binary "$name" -w "$wheels" "$name==$version" > "$work/pip.log" 2>&1 \
        || { grep -v '^WARNING: Location' "$work/pip.log" >&2; die "$name $version: no wheel built"; }
    ls "$wheels" | grep -q "^${name//-/_}-$version-py3-none-any.whl$" \
        || die "$name $version did not build as a pure-Python wheel: $(ls "$wheels")"
done

# resolve WHAT PYTHON GLIBC_MINOR REQUIREMENT...: pip's resolver for that interpreter and platform, nothing installed.
resolve() {
    local what=$1 python=$2 glibc=$3; shift 3
    local platforms=() m
    for m in $(seq "$glibc" -1 17); do platforms+=(--platform "manylinux_2_${m}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64)
    if python -m pip install --dry-run --quiet --ignore-installed --target "$work/none" --only-binary=:all: \
            --implementation cp --python-version "$python" "${platforms[@]}" --find-links "$wheels" \
            --report "$work/report.json" "$@" > "$work/pip.log" 2>&1; then
        echo "ok: $what ($(python -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["install"]))' \
            "$work/report.json") distributions for Python $python, manylinux_2_$glibc x86_64)"
    else
        grep -v '^WARNING: Location' "$work/pip.log" >&2
        die "$what does not resolve for Python $python on manylinux_2_$glibc x86_64"
    fi
}

image=${1:-all}
if [ "$image" = all ] || [ "$image" = components ]; then
    resolve "components image" "$COMPONENTS_PYTHON" "$COMPONENTS_GLIBC_MINOR" -r images/requirements-components.txt
fi
if [ "$image" = all ] || [ "$image" = trainer ]; then
    releases=${2:-$(python -c 'from trainer import compat; print(*compat.CHECKED)')}
    for nvrx in $releases; do
        if [[ " $NVRX_NOT_ON_TRAINER_PYTHON " == *" $nvrx "* ]]; then
            echo "skip: trainer image with NVRx $nvrx (no wheel for Python $TRAINER_PYTHON)"
            continue
        fi
        resolve "trainer image with NVRx $nvrx" "$TRAINER_PYTHON" "$TRAINER_GLIBC_MINOR" \
            -r images/requirements-trainer.txt "nvidia-resiliency-ext==$nvrx" "torch==$TRAINER_TORCH"
    done
fi
