#!/usr/bin/env bash
# The decode-speed run on a CUDA machine: the engine's gpu tests (compiled; the fused forward's
# among them), then benches/bench_engine.py with the arguments given (default: every batch size,
# fused and unfused side by side, LLM.generate included), logging under $OUT.
# Usage (repository root): OUT=/some/dir [TESTS="..."] bash benches/gpu_speed.sh [bench args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
rc=0
if [ "${TESTS-x}" != "" ]; then
  TESTS="${TESTS:-tests/test_fused.py tests/test_engine_runner.py tests/test_engine.py tests/test_engine_swap.py tests/test_tp.py}" \
    bash "$(dirname "$0")/gpu_validate.sh"
  rc=$?
fi
[ $# -gt 0 ] || set -- --batches 1,32,128,256 --ab --llm
"$PY" benches/bench_engine.py --json "$OUT/bench_engine.json" "$@" 2>&1 | tee "$OUT/bench_engine.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
