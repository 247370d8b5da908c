#!/usr/bin/env bash
# Runs, on a CUDA machine, what is built and tested on the CPU but not yet measured on a GPU, in
# parts that each fit one 10-minute device call. Each step has its own time limit and writes its
# log (and JSON) under $OUT as it goes, so a call cut short still returns what finished.
# Usage (repository root): OUT=/some/dir bash benches/gpu_pending.sh
#   [engine|groups|concurrency|spec|async|offload]
#   engine: the gpu tests changed since their last compiled run (the disk tier through the engine
#           with a pinned prefill rate; the local-kernel plan tests); then bench_engine.py at
#           batch 32, 128 and 256 (decode against the memory floor of the device it runs on) and
#           transformers' compiled static-cache generate at batch 1 and 128 beside LLM.generate.
#   groups: the gpu tests of KV cache groups (hybrid models through the engine in bf16, CUDA
#           graphs over every group's buffers, the window/chunk/sink kernels compiled); then the
#           vLLM offloading handlers' CUDA tests and their bench (benches/gpu_vllm_offload.sh).
#   concurrency: the most 32K-token sequences a random-weight gpt-oss-20b-shaped model holds at
#           once (engine-sized pool) against the analytic optimum and full accounting, then run
#           (benches/bench_groups_gpu.py).
#   spec:   the gpu tests of speculative decoding (verify steps replayed by decode graphs), then
#           the oracle proposer at Llama-3-8B dimensions (k = 4, alpha 0.5/0.7/0.9, batch 1/8/64:
#           speedup, share of the ideal, the cost model's switch-off) (benches/bench_spec_oracle.py),
#           first with the batch kept full (4 requests per slot, batch 8/64), then closed; output
#           lengths ragged (64-192 tokens), as a served mix is.
#   offload: the vLLM offloading copier's CUDA tests, then its bench side by side with an older
#           copier in four alternating rounds (BASELINE, default benches/_baseline_offload_copy.py:
#           write it before the call, e.g. git show dc18c53:python/pagedkv/vllm/offload_copy.py >
#           benches/_baseline_offload_copy.py; the GPU machine has no git); not measured on an
#           H200 since the transfer's split moved into the core.
#   async:  the gpu test of asynchronous scheduling (CUDA graphs, the next step's tokens fed on the
#           device), then LLM.generate's decode step with and without it at batch 1, 32, 128.
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
part="${1:-engine}"
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
  engine)
    step gpu_tests_fixed 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider $xdist \
      tests/test_tiers_engine.py tests/test_kernels_local.py
    step bench_engine 420 "$PY" benches/bench_engine.py --batches 1,32,128,256 --llm \
      --transformers 1,128 --json "$OUT/bench_engine.json"
    ;;
  groups)
    step gpu_tests_groups 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider $xdist \
      tests/test_kernels_local.py tests/test_engine_groups.py
    step gpu_vllm_offload 240 bash benches/gpu_vllm_offload.sh
    ;;
  concurrency)
    step bench_groups_gpu 560 "$PY" benches/bench_groups_gpu.py --model gpt-oss-20b \
      --context 32768 --json "$OUT/bench_groups_gpu.json"
    ;;
  async)
    step gpu_tests_async 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_async_scheduling.py
    step bench_engine_async 420 "$PY" benches/bench_engine.py --batches 1,32,128 --llm \
      --async-ab --json "$OUT/bench_engine_async.json"
    ;;
  spec)
    step gpu_tests_spec 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider $xdist \
      tests/test_spec_decode.py tests/test_spec_draft.py
    step bench_spec_oracle_open 300 "$PY" benches/bench_spec_oracle.py --batches 8,64 \
      --requests-per-slot 4 --ragged --alphas 0.5,0.7,0.9 --k 4 \
      --json "$OUT/bench_spec_oracle_open.json"
    step bench_spec_oracle 420 "$PY" benches/bench_spec_oracle.py --batches 1,8,64 --ragged \
      --alphas 0.5,0.7,0.9 --k 4 --json "$OUT/bench_spec_oracle.json"
    ;;
  offload)
    step gpu_vllm_offload 240 bash benches/gpu_vllm_offload.sh \
      --baseline "${BASELINE:-benches/_baseline_offload_copy.py}" --rounds 4
    ;;
  *)
    echo "usage: OUT=DIR bash benches/gpu_pending.sh [engine|groups|concurrency|spec|async|offload]" >&2
    exit 2
    ;;
esac
exit $rc
