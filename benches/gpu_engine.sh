#!/usr/bin/env bash
# Runs the engine's GPU tests (compiled), then the engine benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_engine.sh [bench_engine.py args...]
set -u -o pipefail
OUT="${OUT:-out}"
unset TRITON_INTERPRET
TESTS="tests/test_engine_runner.py tests/test_engine.py" bash "$(dirname "$0")/gpu_validate.sh"
rc=$?
PYTHONPATH=python HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 \
    "${PYTHON:-python3}" benches/bench_engine.py --json "$OUT/bench_engine.json" "$@" 2>&1 | tee "$OUT/bench_engine.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
