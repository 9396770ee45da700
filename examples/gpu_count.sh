# The launchers' one GPU count, sourced by examples/run_tiny.sh and
# examples/megatron_lm/msa_gpt_args.sh (bash; safe under `set -euo pipefail`).
#
# msa_count_gpus sets (and always returns 0):
#   MSA_GPUS_LISTED  GPUs `nvidia-smi --list-gpus` lists (lines "GPU <n>: ..."); empty when
#                    nvidia-smi is not installed
#   MSA_GPU_LISTING  the first line nvidia-smi printed (for messages); empty without it
#   MSA_GPUS         the GPUs a process started here can use: MSA_GPUS_LISTED, at most as many
#                    as CUDA_VISIBLE_DEVICES names when it is set (an empty value hides all);
#                    0 without nvidia-smi
msa_count_gpus() {
    local listing visible=0 id ids
    MSA_GPUS=0 MSA_GPUS_LISTED='' MSA_GPU_LISTING=''
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        return 0
    fi
    listing=$(nvidia-smi --list-gpus 2>&1) || true
    MSA_GPUS_LISTED=$(printf '%s\n' "$listing" | grep -c '^GPU [0-9]' || true)
    MSA_GPU_LISTING=$(printf '%s\n' "$listing" | head -n 1)
    MSA_GPUS=$MSA_GPUS_LISTED
    if [ "${CUDA_VISIBLE_DEVICES+set}" = set ] && [ "$MSA_GPUS" -gt 0 ]; then
        # CUDA sees only the listed devices (one process per visible GPU)
        IFS=, read -ra ids <<< "$CUDA_VISIBLE_DEVICES"
        for id in "${ids[@]}"; do
            if [ -n "${id// /}" ]; then visible=$((visible + 1)); fi
        done
        if [ "$visible" -lt "$MSA_GPUS" ]; then MSA_GPUS=$visible; fi
    fi
    return 0
}
