#!/usr/bin/env bash
# Fetch, on a machine with network, the wheels tests/gpu/run.sh installs on a
# GPU machine that has none: the broker's and client's pure-Python
# dependencies (and the two with C parts, for CPython 3.12 on x86-64).  The
# GPU machine's image already has torch, cupy, numpy, pytest, ml_dtypes.
#
#   bash tests/gpu/wheels.sh            # -> .whl/ (git-ignored; carry it to the GPU machine)
#   PYVER=3.11 bash tests/gpu/wheels.sh DIR   # for another CPython (a dry run of run.sh here)
#
# Versions are pinned to the ones the CPU test suite runs with.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl}
mkdir -p "$dest"
pins=(
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  uvicorn==0.54.0 httptools==0.9.0 h11==0.16.0 click==8.5.1 anyio==4.16.0 idna==3.20
  prometheus-client==0.26.0
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
ls -1 "$dest"
du -sh "$dest"
