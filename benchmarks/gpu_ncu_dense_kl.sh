#!/usr/bin/env bash
# Nsight Compute profile of the Gluon dense KL's kernels (pass A, lse_z, pass B) at one length,
# one key chunk (dz budget 8 GiB), paper heads: one warm call (compiles), then one profiled call.
# Run from the repository root on the GPU machine (device tool), writing under $OUT:
#   T=32768 OUT=... [KL_PASS_A=split] [KERNELS="dense_kl_pass_a_split ..."] bash benchmarks/gpu_ncu_dense_kl.sh
# Writes $OUT/ncu_dense_kl_<T>.tgz (one file: the device tool returns few files): per kernel the details page (speed of light, workload, warp
# states, occupancy), raw metrics (CSV) and, for pass A, the SASS source page with per-
# instruction sampled stall reasons (where the warps wait).
set -u
. benchmarks/gpu_env.sh
: "${OUT:?set OUT}"
T=${T:-32768}
dir=/tmp/ncu_dense_kl_$T
rm -rf "$dir"; mkdir -p "$dir"
drv=(python3 -c "
import sys, torch
sys.path.insert(0, 'benchmarks')
from gluon_probe import _kl_inputs, apply_pass_a_env
apply_pass_a_env()
from msa_megatron.ops.triton import dense_kl_gluon as g
x = _kl_inputs([$T], (64, 4, 4, 1), torch.bfloat16, 'cuda')
for _ in range(2):
    g.dense_kl_chunked(*x, 128 ** -0.5, 128 ** -0.5, 1.0, True, pass_a=g.pass_a_gluon,
                       budget=8 << 30)
torch.cuda.synchronize()
")
for k in ${KERNELS:-dense_kl_pass_a _lse_z_kernel _dk_pass_kernel}; do
    t0=$(date +%s)
    timeout "${KERNEL_LIMIT:-120}" ncu --clock-control none --set full --import-source no \
        -k "regex:^${k}\$" --launch-skip 1 -c 1 -f -o "/tmp/ncu_$k" "${drv[@]}" \
        > "$dir/ncu_$k.log" 2>&1
    echo "$k: rc $? in $(( $(date +%s) - t0 )) s"
    if [ -f "/tmp/ncu_$k.ncu-rep" ]; then
        ncu -i "/tmp/ncu_$k.ncu-rep" --page details > "$dir/ncu_$k.txt" 2>&1
        ncu -i "/tmp/ncu_$k.ncu-rep" --page raw --csv > "$dir/ncu_${k}_raw.csv" 2>&1
        if [[ "$k" == dense_kl_pass_a* ]]; then
            ncu -i "/tmp/ncu_$k.ncu-rep" --page source --print-source sass --csv \
                > "$dir/ncu_${k}_sass.csv" 2> "$dir/ncu_${k}_sass.err"
        fi
        grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Shared Memory Configuration Size|L2 Hit|DRAM Throughput|Issue Slots Busy|Executed Ipc Active" \
            "$dir/ncu_$k.txt" | sed "s/^/  /"
    else
        tail -5 "$dir/ncu_$k.log"
    fi
done
tar -czf "$OUT/ncu_dense_kl_$T.tgz" -C "$dir" .
