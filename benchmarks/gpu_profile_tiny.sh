#!/usr/bin/env bash
# Host profile of the tiny example on one GPU (issue 19): many short documents per window (the
# retrieval curriculum's start) vs whole 8K-token sequences. Writes $OUT/profile_*.txt.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
M="--task retrieval --runs dense --warmup-steps 0 --record-format fused --layers 4 --hidden 256 --ffn-hidden 704 --heads 4 --query-groups 2 --index-head-dim 64 --block-size 128 --top-k 8 --rotary-base 1000000 --pairs 32 --queries 32 --key-vocab 32 --value-vocab 32 --answer-weight 64 --task-question-every 8 --task-len 8192 --min-distance 1024 --seq-len 16384 --lr 3e-3 --log-interval 2 --eval-interval 0 --probe-interval 0 --eval-windows 1"
MASTER_PORT=29631 timeout ${LANE_S:-100} python3 benchmarks/profile_tiny.py $OUT/profile_short_docs -- $M --steps 12 --task-len-min 64 --task-curriculum 1500 --out-dir runs/prof_short 2>&1 | grep -v -i warn | tail -n 45
MASTER_PORT=29632 timeout ${LANE_S:-100} python3 benchmarks/profile_tiny.py $OUT/profile_8k_docs -- $M --steps 12 --out-dir runs/prof_8k 2>&1 | grep -v -i warn | tail -n 30
