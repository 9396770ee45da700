#!/usr/bin/env bash
# Integration run on a 2-GPU H200 machine (device tool, kind nvidia-h200-x2), one call:
#   1. tests/megatron on CUDA + NCCL with megatron-core 0.19.2 (carried as a wheel in .whl/);
#   2. context-parallel parity check, then CP=1 / CP=2 step times and bytes (benchmarks/bench_cp.py);
#   3. the tiny pretraining example on GPUs (TP=2) for a few steps;
#   4. the Megatron-LM entry point (megatron.training) for a few iterations on mock data.
# Usage: bash benchmarks/gpu_integration.sh [steps...]  (default: all); logs and JSON go to $OUT.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
python3 -c "import torch, triton, megatron.core as mc; print('torch', torch.__version__, 'triton', triton.__version__, 'megatron-core', mc.__version__, 'gpus', torch.cuda.device_count())"
steps=${*:-megatron cp tiny megatron_lm}

for step in $steps; do
    echo "=== $step ($(date +%T))"
    case $step in
    megatron)
        MSA_TEST_DEVICE=cuda MSA_TEST_BACKEND=triton timeout 120 python3 -m pytest -q -x -rs tests/megatron/test_megatron_tp.py tests/megatron/test_megatron_cp.py tests/megatron/test_megatron_tp_share.py tests/megatron/test_megatron_recompute.py tests/megatron/test_megatron_spec.py tests/megatron/test_megatron_modes.py 2>&1 | tee "$OUT/megatron_gpu.log" | tail -25
        ;;
    cp)
        timeout 190 torchrun --nproc-per-node 2 benchmarks/bench_cp.py "$OUT/cp_h200x2.json" \
            --seqlens 65536 131072 262144 --dists iid --iters 3 2>&1 | tee "$OUT/cp.log" | tail -30
        ;;
    tiny)
        timeout 80 torchrun --nproc-per-node 2 examples/pretrain_tiny.py --device cuda --tp 2 \
            --steps 30 --warmup-steps 10 --no-baseline --out-dir "$OUT/tiny" 2>&1 | tee "$OUT/tiny.log" | tail -12
        ;;
    megatron_lm)
        TP=2 CP=1 SEQ_LEN=4096 NUM_LAYERS=2 HIDDEN=1024 FFN_HIDDEN=2816 HEADS=8 QUERY_GROUPS=2 \
        GLOBAL_BATCH=2 TRAIN_ITERS=6 MSA_WARMUP_STEPS=3 TRANSFORMER_IMPL=local OUT_DIR=/tmp/mlm \
        GPUS_PER_NODE=2 timeout 90 bash examples/megatron_lm/train_single_node.sh \
            --log-interval 1 --save-interval 100000 --eval-interval 100000 \
            2>&1 | tee "$OUT/megatron_lm.log" | tail -25
        ;;
    esac
done
