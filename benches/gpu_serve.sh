#!/usr/bin/env bash
# Serving benchmark on a CUDA machine without network: `pagedkv bench serve` against pagedkv's
# OpenAI-compatible server over a random-weight Llama-3-8B (benches/bench_serve_gpu.py).
# The server's dependencies the machine lacks (FastAPI, Starlette, pydantic, uvicorn and
# theirs) come as wheels in .whl/ (cp312 manylinux and pure Python), unpacked into /tmp/site.
# Usage (repository root): OUT=/some/dir bash benches/gpu_serve.sh [--quick] [other args]
set -u -o pipefail
SITE="${SITE:-/tmp/site}"
ls .whl/*.whl >/dev/null 2>&1 || {
  echo "no wheels in .whl/: run from the repository root, after scripts/fetch_serve_wheels.sh"
  exit 1
}
PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || {
  # Without pip a wheel is still a zip archive laid out for site-packages.
  echo "pip failed; unpacking the wheels directly"
  python3 -c 'import sys, zipfile
for w in sys.argv[2:]: zipfile.ZipFile(w).extractall(sys.argv[1])' "$SITE" .whl/*.whl || exit 1
}
. "$(dirname "$0")/gpu_env.sh"
# gpu_env.sh sets PYTHONPATH=python; the unpacked wheels go first.
export PYTHONPATH="$SITE:python"
"$PY" -c 'import fastapi, pydantic, starlette, uvicorn
print("server deps:", *(f"{m.__name__} {m.__version__}"
                        for m in (fastapi, pydantic, starlette, uvicorn)))' || exit 1
"$PY" benches/bench_serve_gpu.py --json "$OUT/bench_serve_gpu.json" "$@" 2>&1 \
  | tee "$OUT/bench_serve_gpu.log"
exit "${PIPESTATUS[0]}"
