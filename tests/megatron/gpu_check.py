"""GPU check of the Megatron MSA layers: the CPU tests of tests/megatron on CUDA with NCCL, plus
the paper's head layout (64 query / 4 KV heads) at TP 8 against TP 1.

Run on the GPU machine (megatron-core 0.19.x or 0.16.x, one GPU per rank) from the repository root::

    python tests/megatron/gpu_check.py                    # tests/megatron on CUDA, triton backend
    python tests/megatron/gpu_check.py --paper            # + 64/4 heads at TP 8 (needs 8 GPUs)
    python tests/megatron/gpu_check.py --backend torch    # the torch backend instead

Tests needing more ranks than GPUs are skipped (the TP=4 tests need 4 GPUs, the metrics test 8).
Exit status 0 when everything ran and passed. This runs one pytest process; the same tests as
parallel pytest processes under a deadline (minutes on 2 GPUs): step ``tests`` of
``benchmarks/gpu_integration.sh`` (``benchmarks/gpu_tests.py``).
"""

from __future__ import annotations

import argparse
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _paper_check() -> None:
    import torch

    from tests.dist_utils import run_distributed
    from tests.support.gpt_harness import Setup, train_worker

    setup = Setup(heads=64, groups=4, hidden=512, kv_channels=64, index_head_dim=64,
                  block_size=64, top_k=4, seq=512, layers=2)
    reference = run_distributed(train_worker, 1, args=(setup, 1), tp=1)[0]
    records = run_distributed(train_worker, 8, args=(setup, 8), tp=8)
    rows_ref = [s["rows"] for s in reference["selections"]]
    rows_tp = [sum(r["selections"][i]["rows"] for r in records) for i in range(len(rows_ref))]
    assert rows_tp == rows_ref, (rows_tp, rows_ref)
    for record in records:
        torch.testing.assert_close(torch.stack(record["loss"]), torch.stack(reference["loss"]),
                                   rtol=1e-4, atol=1e-5)
        for step, grads in enumerate(record["grads"]):
            for name, grad in reference["grads"][step].items():
                torch.testing.assert_close(grads[name], grad, rtol=2e-3, atol=2e-5,
                                           msg=f"{name} step {step}")
    print("paper layout 64/4 heads at TP 8: losses, gradients and selections match TP 1")


def main() -> int:
    parser = argparse.ArgumentParser(description="GPU check of the Megatron MSA layers (NCCL)")
    parser.add_argument("--backend", default="triton", choices=("triton", "torch", "reference"))
    parser.add_argument("--paper", action="store_true", help="also run 64/4 heads at TP 8")
    args = parser.parse_args()
    os.environ["MSA_TEST_DEVICE"] = "cuda"
    os.environ["MSA_TEST_BACKEND"] = args.backend
    sys.path.insert(0, REPO_ROOT)
    os.chdir(REPO_ROOT)
    import pytest

    status = pytest.main(["-q", "-rs", os.path.join("tests", "megatron")])
    if status != 0:
        return int(status)
    if args.paper:
        _paper_check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
