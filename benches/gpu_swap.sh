#!/usr/bin/env bash
# Runs the swap and metrics GPU tests (compiled), then the swap benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_swap.sh [bench_swap.py args...]
set -u -o pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
"$PY" -m pytest tests/test_swap.py tests/test_metrics.py tests/test_engine_swap.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc=$?
"$PY" benches/bench_swap.py --json "$OUT/bench_swap.json" "$@" 2>&1 | tee "$OUT/bench_swap.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
