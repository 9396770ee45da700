#!/usr/bin/env bash
# Issue 12 on one H200, one call, < 5 minutes: dense-mode routes (cuDNN / FlashAttention) and
# dense checks against the fp32 oracle, torch.compile of the public op and of a megatron-core GPT
# with MSA layers (fullgraph, sparse and dense, fp32 and bf16, no shim), then dense mode at 32K
# and 128K against dense cuDNN (essential rows). benchmarks/bench_compile.py; JSON and log go to
# $OUT (default /tmp/out). megatron-core comes from .whl/*.whl (installed into /tmp/site).
# Device tool: run(kind="nvidia-h200", carry=[".whl"], command="bash benchmarks/gpu_compile_dense.sh").
# SECTIONS / ROWS / BUDGET / LIMIT override the defaults (ROWS=all, SECTIONS=... for a longer run).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
timeout "${LIMIT:-285}" python3 benchmarks/bench_compile.py "$OUT/compile_dense_h200.json" \
    --budget "${BUDGET:-265}" --sections "${SECTIONS:-dense_checks,op,dense_rows,layer}" \
    --rows "${ROWS:-essential}" --dists "${DISTS:-iid}" --no-kl-sweep \
    > "$OUT/compile_dense.log" 2>&1
echo "exit $?"
grep -a "^-- \|^|\|^route\|^compile_\|^dense_checks" "$OUT/compile_dense.log" | tail -50
