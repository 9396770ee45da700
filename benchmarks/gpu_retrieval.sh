#!/usr/bin/env bash
# The retrieval comparison of README's GPU section, on a 2-GPU H200 machine (device kind
# nvidia-h200-x2): 8K tokens per sequence on GPU 0, 32K on GPU 1, one examples/run_retrieval.sh
# each (shared dense warm-up, then msa / random / local / dense). megatron-core comes from
# wheels in .whl/ when present. Results: runs/r8k, runs/r32k (and $OUT/r19.tgz).
#
# Recipe (v2; v1 never learned the answers, dense included): windows of 64K tokens packed with
# short, answer-dense sequences first (--task-curriculum: the longest length grows from 256
# to --task-len over the first CUR steps, short ones stay in the mix; one question per 8 tokens
# in them: a CPU probe began learning only after ~230K answered questions), RoPE base 1e6 so that
# keys still match thousands of tokens away, lr 3e-3 (v1: 2e-3), every record asked
# (--queries = --pairs) with a key vocabulary no larger than the records. Each lane stays under 500 s (8.3 min) wall:
# v1/v2 logs ran ~0.2-0.3 s per 32K-token step (small model, launch-bound) plus ~40 s start.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
C="--task-len-min 256 --task-question-every 8 --rotary-base 1000000 --value-vocab 32 --lr 3e-3 --lr-warmup 50 --answer-weight 32 --eval-interval 100 --probe-interval 200 --log-interval 50 --eval-windows 2"
# LANES picks the runs (default both); GPU_R8K / GPU_R32K the device of each.
LANES=${LANES:-r8k r32k}
lane() { [[ " $LANES " == *" $1 "* ]]; }
lane r8k && CUDA_VISIBLE_DEVICES=${GPU_R8K:-0} LEN=65536 STEPS=1140 WARMUP=900 TOPK=8 OUT=runs/r8k timeout 500 bash examples/run_retrieval.sh $C --task-len 8192 --task-curriculum 600 --pairs 128 --queries 128 --min-distance 1024 --key-vocab 128 > r8k.out 2>&1 &
lane r32k && CUDA_VISIBLE_DEVICES=${GPU_R32K:-1} LEN=65536 STEPS=940 WARMUP=700 TOPK=16 OUT=runs/r32k timeout 500 bash examples/run_retrieval.sh $C --task-len 32768 --task-curriculum 450 --pairs 256 --queries 256 --min-distance 4096 --key-vocab 256 > r32k.out 2>&1 &
wait
for d in $LANES; do echo "=== $d"; grep -h "exact match\|held-out\|answer loss" runs/$d/variants.log | grep -v Warn | tail -40; tail -8 $d.out; done
for d in $LANES; do python3 examples/retrieval_report.py runs/$d; done
tar czf $OUT/r19.tgz $(for d in $LANES; do echo runs/$d $d.out; done)
