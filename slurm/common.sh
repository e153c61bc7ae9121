# Sourced by prepare.sbatch and train.sbatch: the project root (this file's parent folder) and
# its venv's python; a missing venv is one line, exit 2.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="${VLM_PYTHON:-$ROOT/.venv/bin/python}"
if [[ ! -x "$PY" ]]; then
    echo "slurm: no venv python at $PY (run make install in $ROOT, or set VLM_PYTHON)" >&2
    exit 2
fi
cd "$ROOT"
