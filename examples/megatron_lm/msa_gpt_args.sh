# Arguments of pretrain_msa_gpt.py, sourced by the launchers next to this file. Every value can be
# overridden from the environment, e.g. `TP=4 CP=2 MSA_TOP_K=16 bash train_single_node.sh`.
# Defaults: a ~1B-parameter Llama-style GPT, 8k tokens per sequence, bf16, mock data.

TP=${TP:-2}                      # tensor parallel
CP=${CP:-2}                      # context parallel
PP=${PP:-1}                      # pipeline parallel (data parallel = world / (TP * CP * PP))
SEQ_LEN=${SEQ_LEN:-8192}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-64}
TRAIN_ITERS=${TRAIN_ITERS:-10000}
NUM_LAYERS=${NUM_LAYERS:-16}
HIDDEN=${HIDDEN:-2048}
FFN_HIDDEN=${FFN_HIDDEN:-5632}
HEADS=${HEADS:-16}               # head dim = HIDDEN / HEADS = 128
QUERY_GROUPS=${QUERY_GROUPS:-4}  # GQA groups; MSA uses one index head per group by default
LR=${LR:-3e-4}
MIN_LR=${MIN_LR:-3e-5}
TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-transformer_engine}   # or "local" without Transformer Engine

# MSA (MSA_SPEC.md): block size, top-k, index branch, KL weight, dense warmup.
MSA_BLOCK_SIZE=${MSA_BLOCK_SIZE:-128}
MSA_TOP_K=${MSA_TOP_K:-16}
MSA_INDEX_HEAD_DIM=${MSA_INDEX_HEAD_DIM:-128}
MSA_INDEX_KEY_HEADS=${MSA_INDEX_KEY_HEADS:-1}
MSA_KL_COEFF=${MSA_KL_COEFF:-1.0}
MSA_WARMUP_STEPS=${MSA_WARMUP_STEPS:-500}
MSA_CP_KV_EXCHANGE=${MSA_CP_KV_EXCHANGE:-allgather}   # or "selective"

# Data: DATA_PATH="1.0 /data/corpus_text_document" (Megatron indexed dataset) with a tokenizer,
# or empty for --mock-data.
DATA_PATH=${DATA_PATH:-}
TOKENIZER_ARGS=${TOKENIZER_ARGS:---tokenizer-type NullTokenizer --vocab-size 32000}
OUT_DIR=${OUT_DIR:-runs/msa_gpt}

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
    --transformer-impl "$TRANSFORMER_IMPL"
    --micro-batch-size "$MICRO_BATCH"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    --min-lr "$MIN_LR"
    --lr-decay-style cosine
    --lr-warmup-iters 200
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --log-interval 10
    --eval-interval 1000
    --eval-iters 10
    --save "$OUT_DIR/checkpoints"
    --save-interval 1000
    --tensorboard-dir "$OUT_DIR/tensorboard"
    --msa-block-size "$MSA_BLOCK_SIZE"
    --msa-top-k "$MSA_TOP_K"
    --msa-index-head-dim "$MSA_INDEX_HEAD_DIM"
    --msa-index-key-heads "$MSA_INDEX_KEY_HEADS"
    --msa-kl-coeff "$MSA_KL_COEFF"
    --msa-warmup-steps "$MSA_WARMUP_STEPS"
    --msa-cp-kv-exchange "$MSA_CP_KV_EXCHANGE"
)
if [ "$TP" -gt 1 ] && [ "$TRANSFORMER_IMPL" = transformer_engine ]; then
    MSA_GPT_ARGS+=(--sequence-parallel)   # megatron's local torch norms reject sequence parallel
fi
if [ "$TRANSFORMER_IMPL" = local ]; then
    # The fused RoPE kernel and persistent layer norm come from Transformer Engine / Apex.
    MSA_GPT_ARGS+=(--no-rope-fusion --no-persist-layer-norm)
fi
if [ -n "$DATA_PATH" ]; then
    # shellcheck disable=SC2206  # DATA_PATH is a Megatron blend: "weight prefix [weight prefix ...]"
    MSA_GPT_ARGS+=(--data-path $DATA_PATH --split 969,30,1)
else
    MSA_GPT_ARGS+=(--mock-data)
fi
# shellcheck disable=SC2206  # tokenizer flags are a list of words
MSA_GPT_ARGS+=($TOKENIZER_ARGS)
