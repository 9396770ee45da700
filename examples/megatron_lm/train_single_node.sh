#!/usr/bin/env bash
# MSA GPT pretraining on one node: `bash examples/megatron_lm/train_single_node.sh [extra flags]`.
# Needs megatron-core 0.19.x (Python >= 3.12), msa-megatron installed, GPUs; settings in
# msa_gpt_args.sh (environment overrides), extra flags go to pretrain_msa_gpt.py. One process per
# GPU: GPUS_PER_NODE, else the count `nvidia-smi --list-gpus` gives; with no GPU it stops with
# one line and status 2 (on CPU, use examples/run_tiny.sh).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=msa_gpt_args.sh
source "$HERE/msa_gpt_args.sh"
msa_gpus_per_node train_single_node.sh || exit $?   # GPUS_PER_NODE, else nvidia-smi's count

export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec torchrun --standalone --nproc-per-node "$GPUS_PER_NODE" \
    "$HERE/${ENTRY:-pretrain_msa_gpt.py}" "${MSA_GPT_ARGS[@]}" "$@"
