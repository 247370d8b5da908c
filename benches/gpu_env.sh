# Sourced by the benches/gpu_*.sh scripts: their common set-up on a CUDA machine, run from the
# repository root. OUT (default ./out) is created; PY is the interpreter (PYTHON, default
# python3); the package imports from python/, Hugging Face stays offline, Triton compiles (no
# interpreter); the GPU's name, driver and clocks go to $OUT/nvidia-smi.txt.
OUT="${OUT:-out}"
mkdir -p "$OUT"
export PYTHONPATH=python PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv 2>&1 \
  | tee "$OUT/nvidia-smi.txt"
