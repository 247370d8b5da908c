#!/usr/bin/env bash
# Kernel bounds checks on a CUDA machine: times the current decode/prefill/scatter kernels against
# the kernels before the bounds checks, side by side in one process, then runs the `gpu` kernel
# tests compiled (the bounds tests also under compute-sanitizer memcheck, when it is there).
#
# The GPU machine gets a copy of the working tree without git history, so the old kernels travel
# as an untracked copy:
#   bash benches/gpu_kernel_safety.sh --prepare [REF]   # here: benches/_old_kernels from REF (main)
#   OUT=dir bash benches/gpu_kernel_safety.sh           # on the GPU machine (repository root)
#   bash benches/gpu_kernel_safety.sh --clean           # here, afterwards: remove the copy
# Logs and JSON go to $OUT (default ./out): bench_bounds.log, bounds.json, gpu_tests.log,
# memcheck.log. COMPARE (default decode,prefill,scatter) picks the timed kernels, SUITES (default
# all) the test groups: decode_ref decode_rest prefill_ref prefill_rest scatter_copy bounds memcheck.
set -u -o pipefail
OLD=benches/_old_kernels
case "${1:-}" in
  --prepare)
    ref="${2:-main}"
    rm -rf "$OLD" && mkdir -p "$OLD"
    for f in $(git ls-tree --name-only "$ref" python/pagedkv/kernels/ | grep '\.py$'); do
      # The copy is a top-level package: its imports from pagedkv proper become absolute.
      git show "$ref:$f" | sed -E 's/^from \.\.([a-z_]+) import/from pagedkv.\1 import/; s/^from \.\. import/from pagedkv import/' > "$OLD/$(basename "$f")"
    done
    echo "old kernels from $ref ($(git rev-parse --short "$ref")) in $OLD"
    exit 0 ;;
  --clean)
    rm -rf "$OLD"
    exit 0 ;;
esac
[ -f "$OLD/__init__.py" ] || { echo "no $OLD: run --prepare first"; exit 2; }
. "$(dirname "$0")/gpu_env.sh"
TEST_TIMEOUT="${TEST_TIMEOUT:-150}"
# The bench log starts with the GPU's name and clocks, as it always has.
cp "$OUT/nvidia-smi.txt" "$OUT/bench_bounds.log"

# 1. Timings first, alone on the GPU.
timeout 240 "$PY" benches/bench_kernels.py --compare-old "$OLD" \
  --compare-what "${COMPARE:-decode,prefill,scatter}" --json "$OUT/bounds.json" 2>&1 | tee -a "$OUT/bench_bounds.log"
brc=$?

# 2. Tests, in parallel processes (compilation is the long part and runs on the CPU).
mkdir -p "$OUT/t"
SUITES="${SUITES:-decode_ref decode_rest prefill_ref prefill_rest scatter_copy bounds memcheck}"
run() {  # name, then the pytest arguments
  local name=$1; shift
  case " $SUITES " in *" $name "*) ;; *) return 0 ;; esac
  timeout "$TEST_TIMEOUT" "$PY" -m pytest -m gpu -q -p no:cacheprovider "$@" > "$OUT/t/$name.log" 2>&1
  echo $? > "$OUT/t/$name.rc"
}
run decode_ref tests/test_kernels_decode.py -k "matches_reference_gpu" &
run decode_rest tests/test_kernels_decode.py -k "not matches_reference_gpu" &
run prefill_ref tests/test_kernels_prefill.py -k "matches_reference_gpu" &
run prefill_rest tests/test_kernels_prefill.py -k "not matches_reference_gpu" &
run scatter_copy tests/test_kernels_scatter_copy.py &
run bounds tests/test_kernels_bounds.py &
if command -v compute-sanitizer > /dev/null && [[ " $SUITES " == *" memcheck "* ]]; then
  # One cudaMalloc per tensor, so memcheck sees each tensor's own bounds.
  ( PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$TEST_TIMEOUT" compute-sanitizer --tool memcheck \
      --error-exitcode 99 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels_bounds.py \
      > "$OUT/memcheck.log" 2>&1; echo $? > "$OUT/t/memcheck.rc" ) &
fi
wait
trc=0
for f in "$OUT"/t/*.rc; do
  name=$(basename "$f" .rc); rc=$(cat "$f")
  [ "$rc" = 0 ] || trc=1
  if [ -f "$OUT/t/$name.log" ]; then
    { echo "===== $name (rc=$rc)"; cat "$OUT/t/$name.log"; } >> "$OUT/gpu_tests.log"
    echo "$name rc=$rc: $(tail -n 1 "$OUT/t/$name.log")"
  else
    echo "$name rc=$rc: $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/memcheck.log" | tail -n 2 | tr '\n' ' ')"
  fi
done
rm -rf "$OUT/t"
echo "bench rc=$brc tests rc=$trc"
exit $(( brc != 0 || trc != 0 ))
