#!/usr/bin/env bash
# GPU check of issues 4, 5, 23, 24 (<= 8 minutes on one H200): real-shaped vision towers forward +
# backward (TransformerEngine specs when TE is installed), packed-row parity, the MoE models'
# grouped-GEMM experts against the sequential ones, and a few real-shaped train.py steps,
# printing tokens/s, TFLOP/s and MFU (bench/gpu_check.py; results in $OUT/gpu_check.json).
#
# The device machine has torch + CUDA but none of this project's dependencies: carry them as
# wheels in .whl/ (see docs/benchmarks.md, "GPU check"), e.g. through the device tool:
#   run(command="bash bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)"
timeout 420 python3 bench/gpu_check.py --out "${OUT:-bench_out}" "$@"
