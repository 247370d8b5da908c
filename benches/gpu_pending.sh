#!/usr/bin/env bash
# Runs, on a CUDA machine, what is built and tested on the CPU but not yet measured on a GPU, in
# parts that each fit one 10-minute device call. Each step has its own time limit and writes its
# log (and JSON) under $OUT as it goes, so a call cut short still returns what finished.
# Usage (repository root): OUT=/some/dir bash benches/gpu_pending.sh [tiers|engine]
#   tiers:  the gpu tests of the swap engine (per-block order, layer-by-layer loads), the split-K
#           prefill, the kernel bounds, the tiers and swap through the engine; then
#           bench_tiers_gpu.py with --layerwise (TTFT by prompt length, whole-block and by layer,
#           against recompute; the reuse workload in three arms; a profile of the 4K calls).
#   engine: the gpu tests of the GEMV, the fused forward and the runner; then bench_gemv.py
#           --sweep and bench_step_host.py --gemv 16 (the batch-1 step, cuBLAS against the GEMV).
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
part="${1:-tiers}"
rc=0
step() {  # step NAME SECONDS CMD...: runs CMD under a time limit, its output to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local r=${PIPESTATUS[0]}
  echo "== $name rc=$r"
  [ "$r" -eq 0 ] || rc=1
}
xdist=""
"$PY" -c "import xdist" 2>/dev/null && xdist="-n 4"
case "$part" in
  tiers)
    step gpu_tests_tiers 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider $xdist \
      tests/test_swap.py tests/test_kernels_prefill.py tests/test_kernels_bounds.py \
      tests/test_tiers_engine.py tests/test_engine_swap.py
    step bench_tiers_gpu 330 "$PY" benches/bench_tiers_gpu.py --reps 2 --layerwise --reuse \
      --reuse-prompts 600 --reuse-blocks 4096 --reuse-host 40GiB --profile-dir "$OUT" \
      --profile-lens 4096 --json "$OUT/bench_tiers_gpu.json"
    ;;
  engine)
    step gpu_tests_engine 200 "$PY" -m pytest -m gpu -q -p no:cacheprovider $xdist \
      tests/test_kernels_gemv.py tests/test_fused.py tests/test_engine_runner.py
    step bench_gemv 150 "$PY" benches/bench_gemv.py --sweep --json "$OUT/bench_gemv.json"
    step bench_step_host 200 "$PY" benches/bench_step_host.py --batches 1,8 --gemv 16 \
      --json "$OUT/step_host.json"
    ;;
  *)
    echo "usage: OUT=DIR bash benches/gpu_pending.sh [tiers|engine]" >&2
    exit 2
    ;;
esac
exit $rc
