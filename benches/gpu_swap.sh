#!/usr/bin/env bash
# Runs the swap and metrics GPU tests (compiled), then the swap benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_swap.sh [bench_swap.py args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
"$PY" -m pytest tests/test_swap.py tests/test_metrics.py tests/test_engine_swap.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc=$?
"$PY" benches/bench_swap.py --json "$OUT/bench_swap.json" "$@" 2>&1 | tee "$OUT/bench_swap.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
