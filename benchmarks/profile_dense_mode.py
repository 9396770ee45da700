"""Where dense mode's time goes beyond its two parts: per-kernel CUDA time and GPU idle time of
``msa_attention(mode="dense")`` fwd+bwd against cuDNN SDPA fwd+bwd and the KL alone.

One H200 (from the repository root)::

    . benchmarks/gpu_env.sh; MSA_DENSE_DETERMINISTIC=0 python benchmarks/profile_dense_mode.py OUT.json

Paper heads (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, bf16, one sequence of ``--tokens``): per
case the wall time (CUDA events, median of 3 after a warm-up), torch.profiler's CUDA time per
kernel over 3 calls, their sum per call (busy) and wall minus busy (the GPU's idle time: host
synchronisations, launch gaps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_compile import (PAPER, kl_only_fn, loss_and_grads, make_inputs, op_fn,  # noqa: E402
                           sdpa_fn, time_ms)
from profile_dense_kl import kernel_times  # noqa: E402
from provenance import git_commit  # noqa: E402


def profile(call, calls: int = 3) -> dict:
    """Wall time of ``call`` (ms, median) and its kernels' CUDA time per call (ms)."""
    wall = time_ms(call, calls)["median"]
    kernels = kernel_times(call, calls, 100)
    busy = sum(k["ms_per_call"] for k in kernels.values())
    return dict(wall_ms=wall, busy_ms=busy, idle_ms=wall - busy, kernels=kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--trace", default=None,
                        help="folder: one call of each case as a Chrome trace (CPU and CUDA)")
    args = parser.parse_args()
    x = make_inputs(PAPER, args.tokens, None, "iid", "cuda", torch.bfloat16)
    fn = op_fn(PAPER, "dense")
    cases = {"dense_mode_fwd_bwd": lambda: loss_and_grads(fn, x),
             "cudnn_fwd_bwd": sdpa_fn(x, "CUDNN_ATTENTION", True),
             "kl_only_fwd_bwd": kl_only_fn(x, PAPER)}
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                  commit=git_commit(), tokens=args.tokens,
                  deterministic=os.environ.get("MSA_DENSE_DETERMINISTIC"), cases={})
    for name, call in cases.items():
        r = profile(call)
        result["cases"][name] = r
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                call()
                torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(args.trace, f"{name}.json"))
        print(f"{name}: wall {r['wall_ms']:.1f} ms, kernels {r['busy_ms']:.1f}, idle "
              f"{r['idle_ms']:.1f}", flush=True)
        for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["ms_per_call"])[:14]:
            print(f"   {v['ms_per_call']:8.3f} ms x{v['count']:<3d} {k[:90]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
