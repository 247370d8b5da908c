#!/usr/bin/env bash
# Runs the `gpu`-marked tests compiled on a CUDA machine (kernels, pinned step buffers, the model
# runner, the whole engine), logging under $OUT. TESTS picks the files (default: the whole suite).
# Usage (repository root): OUT=/some/dir [TESTS="tests/x.py ..."] bash benches/gpu_validate.sh [pytest args...]
set -u -o pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
# shellcheck disable=SC2086 # TESTS is a list of paths
"$PY" -m pytest -m gpu ${TESTS:-tests} -q -s -p no:cacheprovider -rs --durations=15 "$@" 2>&1 | tee "$OUT/gpu_tests.log"
