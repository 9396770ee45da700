#!/usr/bin/env bash
# Issue 12, dense-mode vendor routes on one H200, one call, < 4 minutes: every route's probe
# (with the reason of a refusal), cuDNN call variants at 2K against fp32 math (dense-entry pair
# on BSHD views / BHSD copies / K,V expanded, the lower-level op, autograd SDPA; the previous
# THD call in a subprocess), the public op in dense mode vs the fp32 oracle with the route calls
# counted, whether the cuDNN backward is bitwise repeatable, then dense mode fwd+bwd at 32K
# (deterministic and not) against cuDNN SDPA fwd+bwd. benchmarks/gpu_dense_route.py; JSON and
# log go to $OUT (default /tmp/out).
# Device tool: run(kind="nvidia-h200", command="bash benchmarks/gpu_dense_route.sh").
# BUDGET / LIMIT / TTIME (e.g. TTIME=32768,131072 for a longer call) override the defaults.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -n "${NCCL_NVLS_ENABLE:-}" ] || . benchmarks/gpu_env.sh
timeout "${LIMIT:-225}" python3 benchmarks/gpu_dense_route.py "$OUT/dense_route_h200.json" \
    --budget "${BUDGET:-195}" --t-time "${TTIME:-32768}" > "$OUT/dense_route.log" 2>&1
echo "exit $?"
grep -a "^meta\|^probe \|^variant \|^thd \|^op \|^row \|^-- \|^summary \|^cudnn backward" \
    "$OUT/dense_route.log" \
    | cut -c1-700
