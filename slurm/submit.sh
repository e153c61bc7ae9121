#!/bin/bash
# The sbatch command of `make slurm-prepare-<dataset>` / `make slurm-train-<family>-<dataset>`:
# printed (each argument shell-quoted, ready to paste) or, with SUBMIT=1, submitted.
#   slurm/submit.sh prepare <dataset>
#   slurm/submit.sh train <train config> <dataset>
# Every value a user gives (SOURCE OUT REVISION PARTS CPUS DATA_ROOT | CONFIG DATA HF STEPS OUT
# ARGS NODES GPUS) arrives as an environment variable (make exports the variables its command
# line sets, and the default SOURCE_MANTIS / SOURCE_INFOVQA / SOURCE_VIDEO; the Makefile never
# writes one into a shell command line): a value holding `;`, `$(...)` or spaces stays one
# argument and never runs. ARGS is split into key=value words on spaces (never globbed).
set -euo pipefail
set -f
kind=${1:?usage: submit.sh prepare|train ...}
number() {  # a whole number or one line naming the variable
    [[ "$2" =~ ^[0-9]+$ ]] || { echo "make: $1 must be a whole number, got '$2'" >&2; exit 2; }
}
if [[ "$kind" == prepare ]]; then
    dataset=$2 parts=${PARTS:-8} cpus=${CPUS:-16}
    case $dataset in
        mantis) source=${SOURCE:-${SOURCE_MANTIS:-TIGER-Lab/Mantis-Instruct}} ;;
        infovqa) source=${SOURCE:-${SOURCE_INFOVQA:-Ahren09/InfoVQA}} ;;
        *) source=${SOURCE:-${SOURCE_VIDEO:-lmms-lab/LLaVA-Video-178K}} ;;
    esac
    number PARTS "$parts"
    number CPUS "$cpus"
    (( parts >= 1 )) || { echo "make: PARTS must be at least 1" >&2; exit 2; }
    cmd=(sbatch "--array=0-$((parts - 1))" "--cpus-per-task=$cpus" slurm/prepare.sbatch
         "$dataset" "$source" "${OUT:-${DATA_ROOT:-data}/$dataset}")
    [[ -n "${REVISION:-}" ]] && cmd+=(--revision "$REVISION")
else
    config=${CONFIG:-$2} dataset=$3 nodes=${NODES:-1} gpus=${GPUS:-8}
    number NODES "$nodes"
    number GPUS "$gpus"
    # torchrun per node (one SLURM task each), one training process per GPU of the node
    # (GPUS=0: none asked for, over train.sbatch's own 8; a CPU cluster's job, one process)
    cmd=(sbatch "--nodes=$nodes" --ntasks-per-node=1 "--gpus-per-node=$gpus" slurm/train.sbatch
         "$config" "data.path=${DATA:-${DATA_ROOT:-data}/$dataset/metadataset.yaml}")
    [[ -n "${HF:-}" ]] && cmd+=("model.hf=$HF")
    [[ -n "${STEPS:-}" ]] && cmd+=("train.steps=$STEPS")
    [[ -n "${OUT:-}" ]] && cmd+=("out=$OUT")
    # shellcheck disable=SC2206  # word splitting of ARGS is the point (globbing is off)
    [[ -n "${ARGS:-}" ]] && cmd+=($ARGS)
fi
if [[ -n "${SUBMIT:-}" ]]; then
    exec "${cmd[@]}"
fi
printf '%q ' "${cmd[@]}"
echo
