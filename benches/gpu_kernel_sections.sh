#!/usr/bin/env bash
# Chosen sections of the kernel benchmark on a CUDA machine, after the `gpu` tests of the kernels
# they time: the ragged-batch planner, the anchor shapes heuristic vs plan, host cost per call,
# scatter variants, fp8 vs bf16 decode (bench_kernels.py --only).
# Usage (repository root): OUT=/some/dir TESTS="decode bounds" ONLY=ragged,anchor bash benches/gpu_kernel_sections.sh
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
TESTS="${TESTS-decode fp8 bounds scatter_copy prefill}"
ONLY="${ONLY:-ragged,anchor,host,scatter2,fp8}"
files=""
for t in $TESTS; do files="$files tests/test_kernels_$t.py"; done
rc=0
if [ -n "$files" ]; then
  timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -m gpu $files -q -p no:cacheprovider -n "${WORKERS:-8}" \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25
  rc=${PIPESTATUS[0]}
fi
timeout "${BENCH_TIMEOUT:-330}" "$PY" benches/bench_kernels.py --only "$ONLY" ${BENCH_ARGS:-} --json "$OUT/bench_kernel_sections.json" \
  2>&1 | tee "$OUT/bench_kernel_sections.log" | grep -v "^{'device'"
brc=${PIPESTATUS[0]}
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
