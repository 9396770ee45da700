#!/usr/bin/env bash
# Superseded by benchmarks/gpu_retrieval_chain.sh (recipe v3: chained warm-up, gated curriculum).
# Issue 19 on one H200 in two calls: the retrieval comparison of examples/README.md "Fused
# records" (CPU, 512 tokens: dense 0.938, KL-trained index 0.922, random 0.305, own block 0.016)
# at LEN_TASK tokens per sequence (default 8192; block 128, top-k TOPK of LEN_TASK/128 blocks).
#   PHASE=warmup    dense warm-up of WARMUP steps (length curriculum from 64 tokens), saved to
#                   $OUT/r$LEN_TASK/warmup (carry it back as runs/r$LEN_TASK/warmup next call)
#   PHASE=variants  msa / random / local / dense from that warm-up, four processes side by side,
#                   then examples/retrieval_report.py (table, JSON, plots under $OUT)
# Both phases must use the same WARMUP and STEPS (the learning-rate schedule depends on --steps).
# LANE_S caps each process (default 480 s). TAG names a second warm-up of the same length
# (runs/r$LEN_TASK$TAG). Variants spread over the visible GPUs (process i on GPU i mod count).
# Example (device tool, one H200):
#   run(carry=[".whl"], command="PHASE=warmup WARMUP=3000 STEPS=4000 bash benchmarks/gpu_retrieval_fused.sh")
#   run(carry=[".whl", "runs/r8192/warmup"], command="PHASE=variants WARMUP=3000 STEPS=4000 bash benchmarks/gpu_retrieval_fused.sh")
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
LEN_TASK=${LEN_TASK:-8192}; WARMUP=${WARMUP:-3000}; STEPS=${STEPS:-4000}; TOPK=${TOPK:-8}
WINDOW=${WINDOW:-16384}; S=${LANE_S:-480}
R=runs/r$LEN_TASK${TAG:-}
C="--task retrieval --record-format fused --seq-len $WINDOW --task-len $LEN_TASK --task-len-min 64
   --task-curriculum $((WARMUP / 3)) --task-question-every 8 --pairs 32 --queries 32 --key-vocab 32
   --value-vocab 32 --min-distance $((LEN_TASK / 4)) --answer-weight 64 --layers 4 --hidden 256
   --ffn-hidden 704 --heads 4 --query-groups 2 --index-head-dim 64 --block-size 128 --top-k $TOPK
   --rotary-base 1000000 --lr 3e-3 --lr-warmup 50 --warmup-steps $WARMUP --steps $STEPS
   --log-interval 100 --eval-interval 250 --probe-interval 250 --eval-windows 2"
mkdir -p "$R"
if [ "${PHASE:-warmup}" = warmup ]; then
    MASTER_PORT=${WARMUP_PORT:-29651} timeout "$S" python3 examples/pretrain_tiny.py $C --runs dense \
        --save-warmup "$R/warmup" --out-dir "$R/dense" > "$R/dense.log" 2>&1
    echo "exit $?"; grep -v -i warn "$R/dense.log" | grep "exact match\|saved\|step .*00/" | tail -n 25
    mkdir -p "$OUT/$R"; cp -r "$R/warmup" "$OUT/$R/" 2>/dev/null
else
    port=29660
    gpus=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
    visible=(${CUDA_VISIBLE_DEVICES:+${CUDA_VISIBLE_DEVICES//,/ }})
    i=0
    for run in msa random local dense; do
        port=$((port + 1))
        gpu=$((i % gpus)); i=$((i + 1))
        [ ${#visible[@]} -gt 0 ] && gpu=${visible[$gpu]}
        CUDA_VISIBLE_DEVICES=$gpu MASTER_PORT=$port timeout "$S" python3 examples/pretrain_tiny.py $C --runs "$run" \
            --load-warmup "$R/warmup" --out-dir "$R/$run" > "$R/$run.log" 2>&1 &
    done
    wait
    for run in msa random local dense; do
        echo "=== $run"; grep -v -i warn "$R/$run.log" | grep "exact match\|held-out" | tail -n 4
    done
    python3 examples/retrieval_report.py "$R" && cp "$R"/retrieval.* "$OUT/"
fi
tar czf "$OUT/retrieval_fused_${PHASE:-warmup}${TAG:-}.tgz" "$R"/*.log "$R"/*/metrics.json 2>/dev/null
