#!/usr/bin/env bash
# Runs the kernel GPU tests, then the kernel benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_kernels.sh [--tune | --tune=prefill] [--skip-tests]
# Logs and JSON go to $OUT (default ./out).
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
rc=0
TUNE=""
SKIP_TESTS=0
for a in "$@"; do
  case "$a" in
    --tune) TUNE="--tune" ;;
    --tune=*) TUNE="--tune --tune-what ${a#--tune=}" ;;
    --skip-tests) SKIP_TESTS=1 ;;
  esac
done
if [ "$SKIP_TESTS" = 0 ]; then
  "$PY" -m pytest -m gpu tests/test_kernels_*.py -x -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
  rc=$?
  tail -n 3 "$OUT/gpu_tests.log"
fi
"$PY" benches/bench_kernels.py --json "$OUT/bench_kernels.json" $TUNE 2>&1 | tee "$OUT/bench_kernels.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
