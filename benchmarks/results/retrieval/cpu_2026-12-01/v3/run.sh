#!/usr/bin/env bash
# usage: run.sh NAME SECONDS flags...   (dense-only retrieval run on CPU, one thread)
cd "$(dirname "$0")/../../../../.."; export PYTHONPATH=$PWD OMP_NUM_THREADS=1
name=$1; secs=$2; shift 2; mkdir -p runs/exp
BASE="--task retrieval --record-format fused --device cpu --dtype fp32 --runs dense --warmup-steps 0
 --layers 2 --hidden 128 --ffn-hidden 256 --heads 4 --query-groups 2 --index-head-dim 32 --block-size 16 --top-k 4
 --pairs 32 --queries 32 --key-vocab 32 --value-vocab 32 --answer-weight 64 --lr 3e-3 --lr-warmup 50
 --task-question-every 8 --log-interval 100 --eval-interval 250 --probe-interval 0 --eval-windows 4 --steps 20000"
MASTER_PORT=$((30000 + RANDOM % 20000)) timeout $secs python examples/pretrain_tiny.py $BASE --out-dir runs/exp/$name "$@" > runs/exp/$name.log 2>&1
