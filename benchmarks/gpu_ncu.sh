#!/usr/bin/env bash
# Nsight Compute profile of the MSA kernels: one launch of each named kernel in one whole-op
# step (select + attention + KL, forward and backward) of benchmarks/bench_kernels.py's config.
# Run from the repository root on the GPU machine (device tool), writing under $OUT:
#   CONFIG=paper-32k MODE=sparse DIST=iid SKIP=0 OUT=... bash benchmarks/gpu_ncu.sh [KERNEL...]
# SKIP = matching launches skipped before the profiled one (per-chunk kernels launch once per
# chunk). Per kernel: ncu_<kernel>.txt (the details page: speed of light, compute and memory
# workload, warp-state stalls, occupancy, launch statistics) and the raw metrics as CSV, all in
# one archive $OUT/ncu_<config>_<mode>_<dist>.tgz. Clocks are left alone (--clock-control none,
# ../shared/BENCHMARK.md).
# LAUNCHES=all instead profiles every launch of the named kernels in one process with a few
# metrics (duration, active cycles of the least / average / most busy multiprocessor, tensor
# pipe): how the time of the per-chunk launches splits, and their tails (idle multiprocessors
# at a launch's end). Written as $OUT/ncu_launches_<config>_<mode>_<dist>.csv.
set -u
. benchmarks/gpu_env.sh
: "${OUT:?set OUT}"
CONFIG=${CONFIG:-paper-32k} MODE=${MODE:-sparse} DIST=${DIST:-iid} SKIP=${SKIP:-0}
KERNELS=("$@")
if [ ${#KERNELS[@]} -eq 0 ]; then
    KERNELS=(_attn_bwd_blocks_kernel _kl_keys_kernel _attn_fwd_blocks_kernel _attn_merge_kernel
             _kl_lsez_blocks_kernel _block_keys_kernel _topk_kernel sum_partials_kernel)
fi
work=/tmp/ncu_${CONFIG}_${MODE}_${DIST}
rm -rf "$work"; mkdir -p "$work"
# PROFILE_ARGS: more bench_kernels.py flags (the CPU test passes --dry-run)
# shellcheck disable=SC2206
step=(python3 benchmarks/bench_kernels.py /tmp/ncu_unused.json --profile-only "$CONFIG"
      --profile-mode "$MODE" --profile-dist "$DIST" ${PROFILE_ARGS:-})
t0=$(date +%s)
if [ "${LAUNCHES:-one}" = all ]; then
    regex=$(IFS='|'; echo "${KERNELS[*]}")
    ncu --clock-control none --csv --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,\
sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,\
sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active \
        -k "regex:^(${regex})\$" "${step[@]}" > "$OUT/ncu_launches_${CONFIG}_${MODE}_${DIST}.csv" \
        2> "$work/launches.log"
    echo "all launches: rc $? in $(( $(date +%s) - t0 )) s"
    exit 0
fi
"${step[@]}" || exit 1   # compiles every kernel once (Triton's cache), outside the profiler
echo "warm step: $(( $(date +%s) - t0 )) s"
for k in "${KERNELS[@]}"; do
    t0=$(date +%s)
    timeout "${KERNEL_LIMIT:-150}" ncu --clock-control none --set full --import-source no \
        -k "regex:^${k}\$" --launch-skip "$SKIP" -c 1 -f -o "$work/$k" "${step[@]}" \
        > "$work/ncu_$k.log" 2>&1
    echo "$k: rc $? in $(( $(date +%s) - t0 )) s"
    if [ -f "$work/$k.ncu-rep" ]; then
        ncu -i "$work/$k.ncu-rep" --page details > "$work/ncu_$k.txt" 2>&1
        ncu -i "$work/$k.ncu-rep" --page raw --csv > "$work/ncu_${k}_raw.csv" 2>&1
        grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occupancy|L2 Hit|DRAM Throughput" \
            "$work/ncu_$k.txt" | sed "s/^/  /"
        rm -f "$work/$k.ncu-rep"
    else
        tail -5 "$work/ncu_$k.log"
    fi
done
tar -czf "$OUT/ncu_${CONFIG}_${MODE}_${DIST}.tgz" -C "$work" .
