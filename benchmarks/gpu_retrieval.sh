#!/usr/bin/env bash
# The retrieval comparison of README's GPU section, on a 2-GPU H200 machine (device kind
# nvidia-h200-x2): 8K tokens per sequence on GPU 0, 32K on GPU 1, one examples/run_retrieval.sh
# each (shared dense warm-up, then msa / random / local / dense). megatron-core comes from
# wheels in .whl/ when present. Results: runs/r8k, runs/r32k (and $OUT/r19.tgz).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. benchmarks/gpu_env.sh
C="--task-len-min 256 --value-vocab 32 --lr 2e-3 --answer-weight 32 --eval-interval 100 --probe-interval 100 --log-interval 100 --eval-windows 2"
CUDA_VISIBLE_DEVICES=0 LEN=32768 STEPS=1300 WARMUP=1000 TOPK=8 OUT=runs/r8k timeout 545 bash examples/run_retrieval.sh $C --task-len 8192 --pairs 256 --queries 128 --min-distance 1024 --key-vocab 512 > r8k.out 2>&1 &
CUDA_VISIBLE_DEVICES=1 LEN=32768 STEPS=760 WARMUP=600 TOPK=16 OUT=runs/r32k timeout 545 bash examples/run_retrieval.sh $C --task-len 32768 --pairs 512 --queries 256 --min-distance 4096 --key-vocab 1024 > r32k.out 2>&1 &
wait
for d in r8k r32k; do echo "=== $d"; grep -h "exact match\|held-out" runs/$d/variants.log | grep -v Warn | tail -30; cat $d.out | tail -8; done
python3 examples/retrieval_report.py runs/r8k; python3 examples/retrieval_report.py runs/r32k
tar czf $OUT/r19.tgz runs/r8k runs/r32k r8k.out r32k.out
