#!/usr/bin/env bash
# Device check for every Pallas kernel (correctness vs reference + timings vs cuDNN attention).
# Usage on a lent GPU (repository root):  bash scripts/gpu/check.sh [--quick] [--lengths ...]
# Writes $OUT/gpu_check.json and $OUT/gpu_check.log (OUT defaults to runs/gpu_check).
# The device image already has jax (CUDA), flax, optax, jaxtyping, einops, numpy; nothing is
# installed: the repository is put on PYTHONPATH instead of `pip install -e .` (no network there).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT_DIR="${OUT:-runs/gpu_check}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
"$PY" - <<'PYEOF'
import jax, sys
print("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices())
PYEOF
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv 2>/dev/null || true
# 340 s hard stop; the script itself stops starting new work after --budget-s (default 300 s).
timeout 340 "$PY" -m scripts.gpu.check --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
