#!/usr/bin/env bash
# pagedkv against FlashInfer on a CUDA machine with no network (benches/bench_peers.py).
# FlashInfer comes as a trimmed archive of its installed files (flashinfer-python 0.7.2.post1 and
# apache-tvm-ffi, the JIT sources it needs; the machine has nvcc, ninja and the other
# dependencies), made where there is network by scripts/fetch_flashinfer.sh: PEERS_ARCHIVE,
# default .whl/fi.tar.xz. Its compiled modules are kept in
# FLASHINFER_WORKSPACE_BASE; with SAVE_CACHE=1 they are packed into $OUT (parts of 15 MB) and a
# later run given them in .whl/fi_cache.tar.xz.* reuses them instead of compiling.
# Usage (repository root): OUT=/some/dir ONLY=decode,fp8,prefill bash benches/gpu_peers.sh
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
SITE=/tmp/peers_site
mkdir -p "$SITE"
tar -C "$SITE" -xJf "${PEERS_ARCHIVE:-.whl/fi.tar.xz}" || exit 1
export PYTHONPATH="python:$SITE"
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws FLASHINFER_CUDA_ARCH_LIST="9.0a" MAX_JOBS="${MAX_JOBS:-16}"
mkdir -p "$FLASHINFER_WORKSPACE_BASE"
if ls .whl/fi_cache.tar.xz.* >/dev/null 2>&1; then
  cat .whl/fi_cache.tar.xz.* | tar -C "$FLASHINFER_WORKSPACE_BASE" -xJf - && echo "restored FlashInfer's compiled modules"
fi
timeout "${BENCH_TIMEOUT:-540}" "$PY" benches/bench_peers.py --build --only "${ONLY:-decode,fp8,prefill}" \
  ${BENCH_ARGS:-} --json "$OUT/peers.json" 2>&1 | tee "$OUT/peers.log"
brc=${PIPESTATUS[0]}
for f in /tmp/pagedkv_fi_build/*.log; do echo "== $f"; tail -n 15 "$f"; done > "$OUT/builds.log" 2>/dev/null
if [ "${SAVE_CACHE:-0}" = 1 ]; then
  (cd "$FLASHINFER_WORKSPACE_BASE" && find . -name '*.so' -print0 | tar --null -cf - -T - | xz -1 -T0) \
    | split -b 15M - "$OUT/fi_cache.tar.xz."
  ls -la "$OUT"/fi_cache.tar.xz.* | head
fi
echo "bench rc=$brc"
exit "$brc"
