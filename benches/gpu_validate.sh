#!/usr/bin/env bash
# Runs every `gpu`-marked test of the suite compiled on a CUDA machine (kernels, pinned step
# buffers, the model runner, the whole engine), with a per-file log under $OUT.
# Usage (repository root): OUT=/some/dir bash benches/gpu_validate.sh [pytest args...]
set -u -o pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
"$PY" -m pytest -m gpu tests -q -s -p no:cacheprovider -rs --durations=15 "$@" 2>&1 | tee "$OUT/gpu_tests.log"
