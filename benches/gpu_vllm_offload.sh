#!/usr/bin/env bash
# Runs the offloading copier's tests (their CUDA cases included: the pipelined path, the kernel
# compiled) and the offloading handlers' benchmark on a CUDA machine; neither needs vLLM. The bench
# measures the copier's pipelined path beside a plain pinned copy and prints its worst row against
# the >= 90% goal (a few seconds; the tests' Triton compiles most).
# Usage (repository root): OUT=/some/dir bash benches/gpu_vllm_offload.sh [bench args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
"$PY" -m pytest tests/test_vllm_offload_copy.py tests/test_vllm_offload_keyed.py -q \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
rc=$?
"$PY" benches/bench_vllm_offload_gpu.py --json "$OUT/bench_vllm_offload_gpu.json" "$@" 2>&1 \
    | tee "$OUT/bench_vllm_offload_gpu.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
