#!/usr/bin/env bash
# Runs the engine's GPU tests (compiled), then the engine benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_engine.sh [bench_engine.py args...]
set -u -o pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
"$PY" -m pytest -m gpu tests/test_engine_runner.py -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc=$?
"$PY" benches/bench_engine.py --json "$OUT/bench_engine.json" "$@" 2>&1 | tee "$OUT/bench_engine.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
