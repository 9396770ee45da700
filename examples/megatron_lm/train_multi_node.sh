#!/usr/bin/env bash
# MSA GPT pretraining on several nodes with torchrun's c10d rendezvous. Run the same command on
# every node:
#   NNODES=4 RDZV_HOST=node0 bash examples/megatron_lm/train_multi_node.sh [extra flags]
# RDZV_HOST is one node's hostname reachable by all (port RDZV_PORT, default 29400); RDZV_ID
# names the job. Settings: msa_gpt_args.sh (environment overrides). One process per GPU:
# GPUS_PER_NODE, else nvidia-smi's count; with no GPU it stops with one line and status 2.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=msa_gpt_args.sh
source "$HERE/msa_gpt_args.sh"
: "${NNODES:?set NNODES}" "${RDZV_HOST:?set RDZV_HOST}"
msa_gpus_per_node train_multi_node.sh || exit $?   # GPUS_PER_NODE, else nvidia-smi's count
RDZV_PORT=${RDZV_PORT:-29400}
RDZV_ID=${RDZV_ID:-msa-gpt}

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_HOST:$RDZV_PORT" --rdzv-id "$RDZV_ID" \
    "$HERE/${ENTRY:-pretrain_msa_gpt.py}" "${MSA_GPT_ARGS[@]}" "$@"
