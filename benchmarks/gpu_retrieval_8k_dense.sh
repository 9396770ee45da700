#!/usr/bin/env bash
# Does dense attention learn the fused-record retrieval task at 8K tokens on ONE H200, and how
# does that depend on tokens per step and learning rate? (issue 19, before the MSA comparison at
# 8K). Four dense-only lanes share the GPU (small models are host-bound, so they overlap):
#   w64k   8K-token sequences (curriculum from 64), 64K-token windows, lr 3e-3
#   w16k   same, 16K-token windows
#   w64k-lr1e-3   as w64k at lr 1e-3
#   t2k    2K-token sequences, 16K-token windows, lr 3e-3 (the fallback length)
# LANE_S seconds per lane (default 480). Logs and metrics: $OUT/retrieval_8k_dense.tgz.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" runs
. benchmarks/gpu_env.sh
S=${LANE_S:-480}
M="--task retrieval --runs dense --warmup-steps 0 --steps 6000 --record-format fused --layers 4 --hidden 256 --ffn-hidden 704 --heads 4 --query-groups 2 --index-head-dim 64 --block-size 128 --top-k 8 --rotary-base 1000000 --pairs 32 --queries 32 --key-vocab 32 --value-vocab 32 --answer-weight 64 --task-len-min 64 --task-question-every 8 --lr-warmup 50 --log-interval 50 --eval-interval 200 --probe-interval 200 --eval-windows 1"
L8="--task-len 8192 --task-curriculum 1500 --min-distance 1024"
MASTER_PORT=29621 timeout $S python3 examples/pretrain_tiny.py $M $L8 --seq-len 65536 --lr 3e-3 --out-dir runs/w64k > runs/w64k.log 2>&1 &
MASTER_PORT=29622 timeout $S python3 examples/pretrain_tiny.py $M $L8 --seq-len 16384 --lr 3e-3 --out-dir runs/w16k > runs/w16k.log 2>&1 &
MASTER_PORT=29623 timeout $S python3 examples/pretrain_tiny.py $M $L8 --seq-len 65536 --lr 1e-3 --out-dir runs/w64k_lr1e-3 > runs/w64k_lr1e-3.log 2>&1 &
MASTER_PORT=29624 timeout $S python3 examples/pretrain_tiny.py $M --task-len 2048 --task-curriculum 1000 --min-distance 512 --seq-len 16384 --lr 3e-3 --out-dir runs/t2k > runs/t2k.log 2>&1 &
wait
for d in w64k w16k w64k_lr1e-3 t2k; do echo "=== $d"; grep -h "exact match\|step .*/6000" runs/$d.log | grep -v -i warn | tail -n 8; tail -n 2 runs/$d.log; done
tar czf "$OUT/retrieval_8k_dense.tgz" runs/*.log runs/w64k runs/w16k runs/w64k_lr1e-3 runs/t2k 2>/dev/null
