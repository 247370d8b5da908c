#!/usr/bin/env bash
# The decode step's host gap on a CUDA machine: the layer-range graph tests and the engine's
# runner/fused gpu tests (compiled), then benches/bench_step_host.py (default: batches 1 and 128,
# one graph against 2 / 4 / 8 pieces, a profiler table), logging under $OUT.
# Usage (repository root): OUT=/some/dir bash benches/gpu_step_host.sh [bench args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
TESTS="tests/test_graph_pieces.py tests/test_fused.py tests/test_engine_runner.py" \
  bash "$(dirname "$0")/gpu_validate.sh"
rc=$?
[ $# -gt 0 ] || set -- --profile
"$PY" benches/bench_step_host.py --json "$OUT/step_host.json" "$@" 2>&1 | tee "$OUT/step_host.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
