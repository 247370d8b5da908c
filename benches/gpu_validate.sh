#!/usr/bin/env bash
# Runs the `gpu`-marked tests compiled on a CUDA machine (kernels, pinned step buffers, the model
# runner, the whole engine), logging under $OUT. TESTS picks the files (default: the whole suite).
# Usage (repository root): OUT=/some/dir [TESTS="tests/x.py ..."] bash benches/gpu_validate.sh [pytest args...]
set -u -o pipefail
. "$(dirname "$0")/gpu_env.sh"
# shellcheck disable=SC2086 # TESTS is a list of paths
"$PY" -m pytest -m gpu ${TESTS:-tests} -q -s -p no:cacheprovider -rs --durations=15 "$@" 2>&1 | tee "$OUT/gpu_tests.log"
