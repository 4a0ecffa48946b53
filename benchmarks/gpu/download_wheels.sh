#!/usr/bin/env bash
# What benchmarks/gpu_check.py needs beyond torch, transformers, accelerate, peft, safetensors, numpy and
# pytest, downloaded beforehand for a machine with no network: DeepSpeed (its source distribution, built
# on the GPU machine against that machine's torch) and the wheels it needs, for Linux x86-64 and
# CPython 3.10-3.12. gpu_check.py installs them from the folder with --no-index when DeepSpeed is missing.
#
#   benchmarks/gpu/download_wheels.sh [DIR]        # default: wheels/ (git-ignored)
#   make gpu-wheels
#
# Environment: PYTHON (default python3), DEEPSPEED (default: deepspeed>=0.16,<1, as in pyproject.toml),
# PY_VERSIONS (default "3.10 3.11 3.12"), PLATFORM (default manylinux2014_x86_64).
set -euo pipefail
DIR=${1:-wheels}
PYTHON=${PYTHON:-python3}
DEEPSPEED=${DEEPSPEED:-"deepspeed>=0.16,<1"}
PY_VERSIONS=${PY_VERSIONS:-"3.10 3.11 3.12"}
PLATFORM=${PLATFORM:-manylinux2014_x86_64}
# DeepSpeed's own requirements that the GPU machine does not bring (torch, numpy, packaging, psutil and
# tqdm come with torch / accelerate), and what building its source distribution needs.
DEPS="einops hjson msgpack ninja py-cpuinfo pydantic setuptools wheel"

mkdir -p "$DIR"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$DIR" "$DEEPSPEED"
for v in $PY_VERSIONS; do
  # shellcheck disable=SC2086
  "$PYTHON" -m pip download -q --only-binary :all: --python-version "$v" --platform "$PLATFORM" \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$DIR" $DEPS
done
ls -1 "$DIR"
du -sh "$DIR"
