#!/usr/bin/env bash
# Runs the engine's GPU tests (compiled), then the engine benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_engine.sh [bench_engine.py args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
TESTS="tests/test_engine_runner.py tests/test_engine.py" bash "$(dirname "$0")/gpu_validate.sh"
rc=$?
"$PY" benches/bench_engine.py --json "$OUT/bench_engine.json" "$@" 2>&1 | tee "$OUT/bench_engine.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
