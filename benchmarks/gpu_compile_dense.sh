#!/usr/bin/env bash
# Issue 12 on one H200, one call, < 6 minutes: torch.compile of the public op and of a megatron-core
# GPT with MSA layers (eager vs compiled), and dense (warmup) mode routed to cuDNN/FlashAttention
# with the one-pass KL: checks first, then 32K/128K rows against dense cuDNN/FLASH
# (benchmarks/bench_compile.py). JSON and log go to $OUT (default /tmp/out).
# megatron-core comes from .whl/*.whl (installed into /tmp/site) when present.
# Device tool: run(kind="nvidia-h200", carry=[".whl"], command="bash benchmarks/gpu_compile_dense.sh").
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
timeout "${LIMIT:-325}" python3 benchmarks/bench_compile.py "$OUT/compile_dense_h200.json" \
    --budget "${BUDGET:-300}" > "$OUT/compile_dense.log" 2>&1
echo "exit $?"
grep -v -i "warning\|warnings.warn\|^\s*$" "$OUT/compile_dense.log" | tail -70
