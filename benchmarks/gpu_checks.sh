#!/usr/bin/env bash
# One 2-GPU call (device kind nvidia-h200-x2) that checks on real GPUs what changed in a session,
# with megatron-core 0.19.2 from .whl/ when present. Lanes run side by side, so timings printed
# here are not benchmark numbers (other lanes share the GPUs); correctness is what counts.
#   kernels  (GPU 1) tests/ops on CUDA (bf16/fp16 Triton vs the oracle), then bench_kernels.py
#            correctness checks (--quick-checks, no timing rows)
#   megatron (GPUs 0+1) tests/megatron TP/modes/probe in CUDA mode, triton backend
#   resume   (GPUs 0+1) benchmarks/gpu_integration.sh data train resume
#   compile  (GPU 1) benchmarks/bench_compile.py checks: torch.compile of the op and of a GPT layer,
#            dense-mode routes vs our kernels and the oracle (no timing sections)
#   retrieval (GPU 0) examples/run_retrieval.sh at 8K, results in runs/r8k
# Usage: bash benchmarks/gpu_checks.sh [lanes...]; logs in $OUT/gpu_checks.tgz (with runs/r8k),
# their tails and a summary line printed last.
set -u
FINAL=${OUT:-/tmp/out}
OUT=/tmp/gpu_checks
mkdir -p "$OUT" "$FINAL"
. benchmarks/gpu_env.sh
lanes=${*:-kernels compile megatron resume retrieval}
LIMIT=${LIMIT:-380}
has() { [[ " $lanes " == *" $1 "* ]]; }
declare -A PIDS
if has retrieval; then
    ( CUDA_VISIBLE_DEVICES=0 LEN=32768 STEPS=${STEPS:-1900} WARMUP=${WARMUP:-1500} TOPK=8 OUT=runs/r8k \
      timeout $LIMIT bash examples/run_retrieval.sh --task-len 8192 --task-len-min 32 --pairs 256 \
      --queries 128 --min-distance 1024 --key-vocab 512 --value-vocab 32 --lr 3e-3 \
      --answer-weight 32 --eval-interval 200 --probe-interval 200 --log-interval 100 \
      --eval-windows 2 > "$OUT/retrieval.log" 2>&1 ) & PIDS[retrieval]=$!
fi
if has kernels; then
    ( export CUDA_VISIBLE_DEVICES=1
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/ops/test_triton.py \
          tests/ops/test_nonfinite.py tests/ops/test_kl_precision.py tests/ops/test_dense_kl.py \
          tests/ops/test_dense_route.py tests/ops/test_diagnostics.py > "$OUT/kernels_tests.log" 2>&1
      rc=$?
      timeout 150 python3 benchmarks/bench_kernels.py "$OUT/kernels_checks.json" --budget 140 \
          --configs paper-8k --flex-configs "" --quick-checks > "$OUT/kernels_bench.log" 2>&1
      exit $(( rc || $? )) ) & PIDS[kernels]=$!
fi
if has compile; then
    ( CUDA_VISIBLE_DEVICES=1 timeout $LIMIT python3 benchmarks/bench_compile.py \
        "$OUT/compile.json" --budget $((LIMIT - 30)) --sections op,dense_checks,layer \
        > "$OUT/compile.log" 2>&1 ) & PIDS[compile]=$!
fi
if has megatron; then
    ( MSA_TEST_DEVICE=cuda MSA_TEST_BACKEND=triton timeout $LIMIT python3 -m pytest -q -x \
        -p no:cacheprovider tests/megatron/test_megatron_tp.py tests/megatron/test_megatron_modes.py \
        tests/megatron/test_megatron_probe.py > "$OUT/megatron_tests.log" 2>&1 ) & PIDS[megatron]=$!
fi
if has resume; then
    ( OUT=$OUT/integration RUN=/tmp/msa_resume timeout $LIMIT bash benchmarks/gpu_integration.sh \
        data train resume > "$OUT/resume_lane.log" 2>&1 ) & PIDS[resume]=$!
fi
summary="SUMMARY"
for lane in "${!PIDS[@]}"; do
    wait "${PIDS[$lane]}"; rc=$?
    summary+=" $lane=$([ $rc = 0 ] && echo PASS || echo "FAIL(rc=$rc)")"
done
for f in "$OUT"/*.log; do echo "=== $f"; grep -v -i "warn" "$f" | tail -8; done
echo "$summary" | tee "$OUT/summary.txt"
tar czf "$FINAL/gpu_checks.tgz" "$OUT" $(ls -d runs/r8k 2>/dev/null)
