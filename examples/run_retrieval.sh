#!/usr/bin/env bash
# Does the KL-trained index find what matters? Train the same GPT on the retrieval task
# (examples/retrieval_task.py) four ways, same weights and data, and compare:
#   msa     MSA with the index trained by the KL loss
#   random  MSA with the index frozen at its random initialisation
#   local   own block only (top-k 1)
#   dense   dense attention every step
# The four runs go in parallel, one process each (they are small; on one GPU they share it).
#
#   bash examples/run_retrieval.sh                        # 8K tokens, GPU 0
#   LEN=32768 STEPS=1200 WARMUP=800 bash examples/run_retrieval.sh
#   RUNS="msa dense" DEVICE=cpu LEN=1024 BLOCK=32 bash examples/run_retrieval.sh --layers 2
#
# Environment: LEN (tokens per sequence), STEPS, WARMUP (dense steps before sparse), TOPK, BLOCK,
# RUNS, DEVICE (cuda | cpu), OUT (default runs/retrieval_$LEN), PYTHON. Extra flags go to
# examples/pretrain_tiny.py. Writes $OUT/<run>/metrics.json, then $OUT/retrieval.json, a table
# ($OUT/retrieval.md) and plots ($OUT/retrieval.png) from examples/retrieval_report.py.
set -euo pipefail
cd "$(dirname "$0")/.."

LEN=${LEN:-8192}
STEPS=${STEPS:-1500}
WARMUP=${WARMUP:-1000}
TOPK=${TOPK:-4}
BLOCK=${BLOCK:-128}
RUNS=${RUNS:-msa random local dense}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-runs/retrieval_$LEN}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

mkdir -p "$OUT"
port=29600
pids=()
for run in $RUNS; do
    port=$((port + 1))
    MASTER_PORT=$port "$PYTHON" examples/pretrain_tiny.py --task retrieval --runs "$run" \
        --device "$DEVICE" --seq-len "$LEN" --steps "$STEPS" --warmup-steps "$WARMUP" \
        --top-k "$TOPK" --block-size "$BLOCK" --layers 4 --hidden 256 --ffn-hidden 704 \
        --heads 4 --query-groups 2 --index-head-dim 64 --lr 1e-3 --lr-warmup 50 \
        --log-interval 50 --eval-interval 100 --eval-windows 4 --out-dir "$OUT/$run" "$@" \
        >"$OUT/$run.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for run in $RUNS; do echo "== $run"; grep -v Warning "$OUT/$run.log" | tail -4; done
"$PYTHON" examples/retrieval_report.py "$OUT"
exit $status
