#!/usr/bin/env bash
# pagedkv against FlashInfer on a CUDA machine with no network (benches/bench_peers.py).
# FlashInfer comes as a trimmed archive of its installed files (flashinfer-python 0.7.2.post1 and
# apache-tvm-ffi, the JIT sources it needs; the machine has nvcc, ninja and the other
# dependencies), made where there is network by scripts/fetch_flashinfer.sh: PEERS_ARCHIVE,
# default .whl/fi.tar.xz. FlashInfer compiles its modules on first use (about 1-3 minutes each,
# in background processes while pagedkv's kernels are timed).
# Usage (repository root): OUT=/some/dir ONLY=decode,fp8,prefill bash benches/gpu_peers.sh
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
SITE=/tmp/peers_site
mkdir -p "$SITE"
tar -C "$SITE" -xJf "${PEERS_ARCHIVE:-.whl/fi.tar.xz}" || exit 1
export PYTHONPATH="python:$SITE"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST="9.0a" MAX_JOBS="${MAX_JOBS:-16}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
timeout "${BENCH_TIMEOUT:-540}" "$PY" benches/bench_peers.py --build --only "${ONLY:-decode,fp8,prefill}" \
  ${BENCH_ARGS:-} --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log"
brc=${PIPESTATUS[0]}
for f in /tmp/pagedkv_fi_build/*.log; do echo "== $f"; tail -n 15 "$f"; done > "$OUT/builds.log" 2>/dev/null
echo "bench rc=$brc"
exit "$brc"
