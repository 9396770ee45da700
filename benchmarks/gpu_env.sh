# Sourced by the benchmarks/gpu_*.sh scripts (from the repository root): the environment every
# GPU run here needs. NVLink multicast stays off (NCCL, torch symmetric memory, NVSHMEM);
# megatron-core and other missing packages come from wheels in .whl/ (installed into /tmp/site).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
