#!/usr/bin/env bash
# Issue 12 on one H200, one call, < 8 minutes: dense checks against the fp32 oracle (routes, our
# kernels, the one-pass KL bitwise repeat), the dense KL tile sweep at 32K (the bulk-copy /
# packed fixed-point KL kernel of dense_kl.py) and dense mode at 32K and 128K against dense
# cuDNN (essential rows), torch.compile of a megatron-core GPT with MSA layers (fullgraph, sparse
# and dense, bf16, no shim), torch.compile of the public op, then eager vs compiled fwd+bwd of
# the op (32K) and of the model (op_timing, layer_timing: last, so a budget cut loses only
# timings). benchmarks/bench_compile.py; JSON and log go to $OUT (default /tmp/out); the JSON is
# named after the card (compile_dense_h200.json, compile_dense_h100.json; nvidia-smi's name).
# megatron-core comes from .whl/*.whl (installed into /tmp/site).
# Device tool: run(kind="nvidia-h200", carry=[".whl"], command="bash benchmarks/gpu_compile_dense.sh").
# SECTIONS / ROWS / DISTS / LAYER_DTYPES / SWEEP (1: tile sweep) / BUDGET / LIMIT override.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. benchmarks/gpu_env.sh
sweep=()
[ "${SWEEP:-1}" = 1 ] || sweep=(--no-kl-sweep)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
    | grep -o -i 'h100\|h200\|b200\|a100' | head -1 | tr 'A-Z' 'a-z')
sections=${SECTIONS:-dense_checks,dense_rows,layer,op,op_timing,layer_timing}
timeout "${LIMIT:-450}" python3 benchmarks/bench_compile.py "$OUT/compile_dense_${card:-gpu}.json" \
    --budget "${BUDGET:-425}" --sections "$sections" \
    --rows "${ROWS:-essential}" --dists "${DISTS:-iid}" --layer-dtypes "${LAYER_DTYPES:-bf16}" \
    "${sweep[@]}" > "$OUT/compile_dense.log" 2>&1
echo "exit $?"
grep -a "^-- \|^|\|^route\|^compile_\|^dense_checks\|^kl_tile" "$OUT/compile_dense.log" | tail -50
