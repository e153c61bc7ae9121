#!/usr/bin/env bash
# The GPU check of issues 4, 5, 23, 24 and 44 in ONE device call of about 8 minutes, installs
# included (bench/gpu_check.py; results in $OUT/gpu_check.json, the cards in $OUT/cards):
# kernel checks, then every family's training steps at published per-layer shapes on
# real-shaped samples (tokens/s, padded slots/s, TFLOP/s, MFU, vision / LM split, memory), then
# HF parity (verify), then packed rows, grouped-GEMM experts (with TE) and the vision towers.
#
# The device machine has torch + CUDA + Triton but none of this project's dependencies: carry
# them as wheels in .whl/ (at most 64 MiB; docs/benchmarks.md, "GPU check", lists them and how
# to build the Triton-only mamba_ssm wheel), e.g. through the device tool:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Extra arguments go to bench/gpu_check.py (e.g. --part kernels train).
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-480}  # the whole call, installs included
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
left=$((BUDGET_S - SECONDS))
# the check stops starting new work 40 s before its end; timeout is the hard stop
timeout "$((left - 10))" python3 bench/gpu_check.py --out "$OUT" --budget-s "$((left - 50))" "$@" \
    || echo "gpu_check.py ended with $? (the JSON holds every row that finished)"
python3 bench/gpu_cards.py "$OUT/gpu_check.json" --out "$OUT/cards"
