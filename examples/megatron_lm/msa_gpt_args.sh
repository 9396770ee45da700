# Arguments of pretrain_msa_gpt.py, sourced by the launchers next to this file. Every value can be
# overridden from the environment, e.g. `TP=4 CP=2 MSA_TOP_K=16 bash train_single_node.sh`.
# Defaults: a ~1B-parameter Llama-style GPT, 8k tokens per sequence, bf16, mock data.
# Every default is valid for any TRAIN_ITERS >= 1 and with or without Transformer Engine / Apex
# (the entry point turns off what needs them and prints one line saying what).

TP=${TP:-2}                      # tensor parallel
CP=${CP:-2}                      # context parallel
PP=${PP:-1}                      # pipeline parallel (data parallel = world / (TP * CP * PP))
SEQ_LEN=${SEQ_LEN:-8192}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
TRAIN_ITERS=${TRAIN_ITERS:-10000}
# Learning-rate schedule: warmup 10% of the decay (at most 200 iterations), decay over the run.
LR_DECAY_ITERS=${LR_DECAY_ITERS:-$TRAIN_ITERS}
_warmup=$(( LR_DECAY_ITERS / 10 )); [ "$_warmup" -gt 200 ] && _warmup=200
LR_WARMUP_ITERS=${LR_WARMUP_ITERS:-$_warmup}
NUM_LAYERS=${NUM_LAYERS:-16}
HIDDEN=${HIDDEN:-2048}
FFN_HIDDEN=${FFN_HIDDEN:-5632}
HEADS=${HEADS:-16}               # head dim = HIDDEN / HEADS = 128
QUERY_GROUPS=${QUERY_GROUPS:-4}  # GQA groups; MSA uses one index head per group by default
PRECISION=${PRECISION---bf16}  # --bf16 | --fp16 | "" (fp32)
DIST_OPTIMIZER=${DIST_OPTIMIZER:-1}   # 1: megatron's distributed optimizer (optimizer state sharded over DP)
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
# transformer_engine | local; empty: Transformer Engine when it imports, else megatron-core's layers.
TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-}

# MSA (MSA_SPEC.md): block size, top-k, index branch, KL weight, dense warmup.
MSA_BLOCK_SIZE=${MSA_BLOCK_SIZE:-128}
MSA_TOP_K=${MSA_TOP_K:-16}
MSA_INDEX_HEAD_DIM=${MSA_INDEX_HEAD_DIM:-128}
MSA_INDEX_KEY_HEADS=${MSA_INDEX_KEY_HEADS:-1}
MSA_KL_COEFF=${MSA_KL_COEFF:-1.0}
MSA_WARMUP_STEPS=${MSA_WARMUP_STEPS:-500}
MSA_CP_KV_EXCHANGE=${MSA_CP_KV_EXCHANGE:-allgather}   # or "selective"
MSA_BACKEND=${MSA_BACKEND:-}     # triton | torch | reference; empty: MSAConfig's default (triton on CUDA)

# Data: DATA_PATH="1.0 /data/corpus_text_document" (Megatron indexed dataset, e.g. the byte-level
# one prepare_data.py writes) with its tokenizer, or empty for --mock-data. The default tokenizer
# is the byte-level one of prepare_data.py with data (257 ids, end of document 256) and a
# 32000-id null tokenizer with mock data.
DATA_PATH=${DATA_PATH:-}
if [ -n "$DATA_PATH" ]; then
    TOKENIZER_ARGS=${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 257 --null-tokenizer-eod-id 256}
else
    TOKENIZER_ARGS=${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 32000}
fi
SPLIT=${SPLIT:-98,2,0}           # train, validation, test shares of the documents

# Checkpoints: saved to CKPT_DIR every SAVE_INTERVAL iterations and at the end, loaded from
# LOAD_DIR (default: CKPT_DIR, so re-running the same command resumes). Paths are made absolute,
# so every node of a multi-node job names the same (shared) directory.
# CHECKPOINTS=0 turns saving and loading off (benchmarks).
CHECKPOINTS=${CHECKPOINTS:-1}
OUT_DIR=$(realpath -m "${OUT_DIR:-runs/msa_gpt}")
CKPT_DIR=$(realpath -m "${CKPT_DIR:-$OUT_DIR/checkpoints}")
LOAD_DIR=$(realpath -m "${LOAD_DIR:-$CKPT_DIR}")
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}

MSA_GPT_ARGS=(
    --tensor-model-parallel-size "$TP"
    --context-parallel-size "$CP"
    --pipeline-model-parallel-size "$PP"
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN"
    --ffn-hidden-size "$FFN_HIDDEN"
    --num-attention-heads "$HEADS"
    --group-query-attention
    --num-query-groups "$QUERY_GROUPS"
    --seq-length "$SEQ_LEN"
    --max-position-embeddings "$SEQ_LEN"
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters "$LR_WARMUP_ITERS"
    --lr-decay-iters "$LR_DECAY_ITERS"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --overlap-grad-reduce
    --log-interval "$LOG_INTERVAL"
    --eval-interval "$EVAL_INTERVAL"
    --eval-iters "$EVAL_ITERS"
    --tensorboard-dir "$OUT_DIR/tensorboard"
    --msa-block-size "$MSA_BLOCK_SIZE"
    --msa-top-k "$MSA_TOP_K"
    --msa-index-head-dim "$MSA_INDEX_HEAD_DIM"
    --msa-index-key-heads "$MSA_INDEX_KEY_HEADS"
    --msa-kl-coeff "$MSA_KL_COEFF"
    --msa-warmup-steps "$MSA_WARMUP_STEPS"
    --msa-cp-kv-exchange "$MSA_CP_KV_EXCHANGE"
)
if [ "$CHECKPOINTS" = 1 ]; then
    MSA_GPT_ARGS+=(--save "$CKPT_DIR" --load "$LOAD_DIR" --save-interval "$SAVE_INTERVAL")
fi
if [ "$DIST_OPTIMIZER" = 1 ]; then
    MSA_GPT_ARGS+=(--use-distributed-optimizer)
fi
if [ -n "$PRECISION" ]; then
    MSA_GPT_ARGS+=("$PRECISION")
fi
if [ -n "$MSA_BACKEND" ]; then
    MSA_GPT_ARGS+=(--msa-backend "$MSA_BACKEND")
fi
if [ -n "$TRANSFORMER_IMPL" ]; then
    MSA_GPT_ARGS+=(--transformer-impl "$TRANSFORMER_IMPL")
fi
if [ "$TP" -gt 1 ]; then
    MSA_GPT_ARGS+=(--sequence-parallel)   # turned off by the entry point with torch norms
fi
if [ -n "$DATA_PATH" ]; then
    # shellcheck disable=SC2206  # DATA_PATH is a Megatron blend: "weight prefix [weight prefix ...]"
    MSA_GPT_ARGS+=(--data-path $DATA_PATH --split "$SPLIT")
else
    MSA_GPT_ARGS+=(--mock-data)
fi
# shellcheck disable=SC2206  # tokenizer flags are a list of words
MSA_GPT_ARGS+=($TOKENIZER_ARGS)

# shellcheck source=../gpu_count.sh
source "$(dirname "${BASH_SOURCE[0]}")/../gpu_count.sh"   # msa_count_gpus (run_tiny.sh's too)

# GPUS_PER_NODE for the launchers (processes per node): the environment's value, else the GPUs
# `nvidia-smi --list-gpus` lists (at most as many as CUDA_VISIBLE_DEVICES names, when it is set:
# msa_count_gpus). These launchers need NVIDIA GPUs (the CPU route is examples/run_tiny.sh);
# without any, one line on stderr and status 2, before torchrun starts.
# Usage: msa_gpus_per_node LAUNCHER_NAME || exit $?
msa_gpus_per_node() {
    local launcher=$1
    if [ -n "${GPUS_PER_NODE:-}" ]; then
        case $GPUS_PER_NODE in
            *[!0-9]*|0*) echo "$launcher: GPUS_PER_NODE=$GPUS_PER_NODE must be a positive integer" >&2
                         return 2 ;;
        esac
        return 0
    fi
    msa_count_gpus
    if [ -z "$MSA_GPUS_LISTED" ]; then
        echo "$launcher: no GPU found (nvidia-smi is not installed); this launcher needs NVIDIA" \
             "GPUs (set GPUS_PER_NODE if they are there; on CPU use examples/run_tiny.sh)" >&2
        return 2
    fi
    if [ "$MSA_GPUS_LISTED" -eq 0 ]; then
        echo "$launcher: no GPU found (nvidia-smi --list-gpus: ${MSA_GPU_LISTING:-no output}); this" \
             "launcher needs NVIDIA GPUs (set GPUS_PER_NODE if they are there; on CPU use" \
             "examples/run_tiny.sh)" >&2
        return 2
    fi
    if [ "$MSA_GPUS" -eq 0 ]; then
        echo "$launcher: no GPU visible (CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES'); this" \
             "launcher needs NVIDIA GPUs" >&2
        return 2
    fi
    GPUS_PER_NODE=$MSA_GPUS
}
