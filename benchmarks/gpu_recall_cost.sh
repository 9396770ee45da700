#!/usr/bin/env bash
# Cost of the selection-recall probe (issue 16 item 3, target < 2% of the step at 64K tokens):
# the tiny example on one GPU, 64K-token windows, sparse MSA, the same run twice: probe on every
# step (--probe-interval 1) and never (--probe-interval 0). Prints the steady-state tokens/s of
# both (the last log interval) and the per-probed-step overhead; logs to $OUT/recall_cost.tgz.
# Usage: [SEQ=65536 STEPS=30] bash benchmarks/gpu_recall_cost.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" runs
. benchmarks/gpu_env.sh
SEQ=${SEQ:-65536}; STEPS=${STEPS:-30}; DEVICE=${DEVICE:-cuda}
C="--device $DEVICE --runs msa --no-baseline --warmup-steps 2 --steps $STEPS --seq-len $SEQ --layers 4 --hidden 1024 --ffn-hidden 2816 --heads 8 --query-groups 2 --block-size 128 --top-k 16 --index-head-dim 128 --log-interval 10 --eval-windows 1 ${EXTRA:-}"
for p in 1 0; do
    MASTER_PORT=$((29640 + p)) timeout ${LANE_S:-200} python3 examples/pretrain_tiny.py $C --probe-interval $p --out-dir runs/recall_cost_p$p > runs/recall_cost_p$p.log 2>&1
    echo "probe-interval $p: $(grep -E "step +[0-9]+/$STEPS" runs/recall_cost_p$p.log | grep -v -i warn | tail -n 1)"
done
python3 - "$STEPS" <<'PY'
import re, sys
steps = sys.argv[1]
rate = {}
for p in (1, 0):
    lines = [l for l in open(f"runs/recall_cost_p{p}.log") if re.search(rf"step +\d+/{steps}", l)]
    m = re.search(r"([\d,]+) tok/s", lines[-1]) if lines else None
    rate[p] = float(m.group(1).replace(",", "")) if m else float("nan")
print(f"tokens/s: probe every step {rate[1]:,.0f}, no probe {rate[0]:,.0f}; "
      f"probe overhead per probed step {100 * (rate[0] / rate[1] - 1):.2f}%")
PY
tar czf "$OUT/recall_cost.tgz" runs/recall_cost_p*.log
