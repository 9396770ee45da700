#!/usr/bin/env bash
# Short retrieval runs on ONE H200 (issue 19): does dense attention learn associative recall at
# all, which record format learns faster, and (lane cmp) does the KL-trained index beat a random
# one once it does? Four processes share the GPU (small models: launch-bound, so they overlap).
#   pair64 / fused64  dense only, 64-token sequences, 8 records, 4 layers, hidden 256
#   pair1k            dense only, pair records, mixed lengths 64..1024 tokens, 32 records
#   cmp1k             examples/run_retrieval.sh at 1024 tokens, fused records, block 32, top-k 4:
#                     dense warm-up, then msa / random / local / dense from the same weights
# LANE_S seconds per lane (default 430). Logs and metrics: $OUT/retrieval_short.tgz.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
S=${LANE_S:-430}
M="--layers 4 --hidden 256 --ffn-hidden 704 --heads 4 --query-groups 2 --index-head-dim 64 --value-vocab 32 --answer-weight 64 --lr 3e-3 --lr-warmup 100 --log-interval 250 --eval-windows 2"
T="--task retrieval --runs dense --warmup-steps 0 --seq-len 4096 --block-size 32 --top-k 4 --probe-interval 0 --eval-interval 500"
mkdir -p runs
MASTER_PORT=29611 timeout $S python3 examples/pretrain_tiny.py $T $M --steps 12000 --record-format pair --task-len 64 --pairs 8 --queries 8 --key-vocab 16 --min-distance 24 --out-dir runs/pair64 > runs/pair64.log 2>&1 &
MASTER_PORT=29612 timeout $S python3 examples/pretrain_tiny.py $T $M --steps 12000 --record-format fused --task-len 64 --pairs 8 --queries 8 --key-vocab 16 --min-distance 24 --out-dir runs/fused64 > runs/fused64.log 2>&1 &
MASTER_PORT=29613 timeout $S python3 examples/pretrain_tiny.py $T $M --steps 8000 --record-format pair --task-len 1024 --task-len-min 64 --task-question-every 8 --pairs 32 --queries 32 --key-vocab 32 --min-distance 256 --out-dir runs/pair1k > runs/pair1k.log 2>&1 &
MASTER_PORT=29614 LEN=4096 STEPS=4600 WARMUP=3000 TOPK=4 BLOCK=32 OUT=runs/cmp1k timeout $S bash examples/run_retrieval.sh $M --record-format fused --task-len 1024 --task-len-min 64 --task-question-every 8 --pairs 32 --queries 32 --key-vocab 32 --min-distance 256 --eval-interval 200 --probe-interval 200 --log-interval 100 > runs/cmp1k.log 2>&1 &
wait
pkill -f examples/pretrain_tiny.py; sleep 2
for d in pair64 fused64 pair1k; do echo "=== $d"; grep -h "exact match\|answer loss" runs/$d.log | grep -v -i warn | tail -6; tail -3 runs/$d.log; done
echo "=== cmp1k"; grep -h "exact match\|held-out\|answer loss\|^|" runs/cmp1k/variants.log runs/cmp1k.log 2>/dev/null | grep -v -i warn | tail -40
tar czf $OUT/retrieval_short.tgz runs/*.log runs/pair64 runs/fused64 runs/pair1k runs/cmp1k 2>/dev/null
