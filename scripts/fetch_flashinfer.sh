#!/usr/bin/env bash
# Packs FlashInfer for benches/gpu_peers.sh on a CUDA machine with no network: downloads
# flashinfer-python and apache-tvm-ffi (CPython 3.12, x86-64) from PyPI, keeps what its JIT needs
# for attention (the Python package, its headers, the attention sources, cutlass/cccl headers)
# and writes one archive of the installed files, .whl/fi.tar.xz by default (about 15 MB).
# The machine it runs on needs nvcc, ninja, nvidia-ml-py, einops, tabulate and torch already.
# Usage (repository root, with network): bash scripts/fetch_flashinfer.sh [OUT_ARCHIVE]
set -euo pipefail
OUT_ARCHIVE="${1:-.whl/fi.tar.xz}"
FI_VERSION="${FI_VERSION:-0.7.2.post1}"
TVM_FFI_VERSION="${TVM_FFI_VERSION:-0.1.15.post2}"
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/wheels" "flashinfer-python==$FI_VERSION" "apache-tvm-ffi==$TVM_FFI_VERSION"
mkdir -p "$work/site"
for w in "$work"/wheels/*.whl; do (cd "$work/site" && "$PY" -m zipfile -e "$w" .); done
data="$work/site/flashinfer/data"
# Attention's JIT sources are the top-level files of csrc; the subfolders serve other kernels.
find "$data/csrc" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
rm -rf "$data/cutlass/examples" "$data/cutlass/python" "$data/cutlass/test" "$data/cutlass/media" \
  "$data/cccl/benchmarks" "$data/cccl/ci" "$data/cccl/docs" "$data/cccl/python" "$data/cccl/cudax"
# FA3 includes cutlass/util from tools/util/include; the rest of tools is not needed.
find "$data/cutlass/tools" -mindepth 1 -maxdepth 1 ! -name util -exec rm -rf {} +
mkdir -p "$(dirname "$OUT_ARCHIVE")"
tar -C "$work/site" -cf - . | xz -6 -T0 > "$OUT_ARCHIVE"
ls -la "$OUT_ARCHIVE"
