#!/usr/bin/env bash
# Downloads the wheels benches/gpu_serve.sh installs on a CUDA machine with no network: the
# server's dependencies (FastAPI, Starlette, pydantic, pydantic-core, uvicorn and what they need)
# that such a machine lacks, for CPython 3.12 on x86-64 Linux, into .whl/ (about 3.3 MB).
# anyio, h11, httpx and prometheus-client are assumed present there. Versions are the ones the
# server's tests run with; override with the environment variables below.
# Usage (repository root, with network): bash scripts/fetch_serve_wheels.sh [DIR]
set -euo pipefail
DIR="${1:-.whl}"
PY="${PYTHON:-python3}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" "fastapi==${FASTAPI_VERSION:-0.165.0}" "starlette==${STARLETTE_VERSION:-1.10.0}" \
  "pydantic==${PYDANTIC_VERSION:-2.14.4}" "pydantic-core==${PYDANTIC_CORE_VERSION:-2.50.5}" \
  "uvicorn==${UVICORN_VERSION:-0.54.0}" annotated-types==0.8.0 annotated-doc==0.0.7 \
  typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 click==8.5.1
ls -l "$DIR"/*.whl
