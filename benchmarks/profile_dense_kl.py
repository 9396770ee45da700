"""Where the Gluon dense KL's time goes: per-kernel CUDA time of ``dense_kl_loss_gluon``.

One H200 (from the repository root)::

    . benchmarks/gpu_env.sh; python benchmarks/profile_dense_kl.py OUT.json [--tokens 32768]

Paper heads (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, bf16, one sequence); per length and dz
budget (default 2 GiB and 8 GiB): the wall time of one call (CUDA events, median of 3 after a
warm-up) and torch.profiler's CUDA time per kernel name over 3 calls, into JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_compile import time_ms  # noqa: E402
from gluon_probe import _kl_inputs  # noqa: E402
from provenance import git_commit  # noqa: E402


def profile(tokens: int, budget: int) -> dict:
    from msa_megatron.ops.triton import dense_kl_gluon as g

    x = _kl_inputs([tokens], (64, 4, 4, 1), torch.bfloat16, "cuda")
    scales = (128 ** -0.5, 128 ** -0.5, 1.0 / (tokens * 4), True)

    def call():
        return g.dense_kl_chunked(*x, *scales, pass_a=g.pass_a_gluon, budget=budget)

    wall = time_ms(call, 3)["median"]
    return dict(tokens=tokens, budget=budget, wall_ms=wall, kernels=kernel_times(call, 3, 90))


def kernel_times(call, calls: int, name_chars: int) -> dict:
    """torch.profiler's CUDA time of each kernel ``call`` launches, over ``calls`` calls: ``{name
    (first name_chars characters): {"ms_per_call", "count" (per call)}}``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us > 0:
            kernels[ev.key[:name_chars]] = dict(ms_per_call=us / calls / 1000,
                                                count=ev.count // calls)
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768])
    parser.add_argument("--budgets", type=int, nargs="+", default=[2 << 30, 8 << 30])
    args = parser.parse_args()
    runs = []
    for t in args.tokens:
        for b in args.budgets:
            r = profile(t, b)
            runs.append(r)
            print(f"T {t} budget {b >> 30} GiB: {r['wall_ms']:.2f} ms per call")
            for name, k in sorted(r["kernels"].items(), key=lambda kv: -kv[1]["ms_per_call"])[:12]:
                print(f"  {k['ms_per_call']:8.3f} ms  x{k['count']:<4d} {name}")
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                               commit=git_commit(), runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
