#!/usr/bin/env bash
# Runs the gpu-marked tests (compiled), then the host-tier benchmark, on a CUDA machine.
# Usage (repository root): OUT=/some/dir bash benches/gpu_tiers.sh [bench_tiers_gpu.py args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
bash "$(dirname "$0")/gpu_validate.sh"
rc=$?
"$PY" benches/bench_tiers_gpu.py --json "$OUT/bench_tiers_gpu.json" "$@" 2>&1 | tee "$OUT/bench_tiers_gpu.log"
brc=$?
echo "tests rc=$rc bench rc=$brc"
exit $(( rc != 0 || brc != 0 ))
