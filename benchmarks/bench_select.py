"""Tile variants of the selection kernels on one GPU, paper heads, bf16, iid and coherent index
inputs: time of ``select`` (CUDA events, L2 flushed), each kernel's share (torch profiler) and
the ratio to the bare causal index GEMM at the bf16 matmul rate measured in the same run.
Every variant's selection must be bit-equal to the default variant's (else FAIL).

Usage (writes JSON; prints one line per variant)::

    python benchmarks/bench_select.py OUT.json [--tokens 32768,131072] [--dists iid,coherent]
        [--variants NAME,...] [--budget 240]

CPU dry run of the script itself (Triton interpreter, tiny shapes)::

    TRITON_INTERPRET=1 python benchmarks/bench_select.py /tmp/s.json --dry-run --tokens 600
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_kernels import index_input, time_ms  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops import triton as tri  # noqa: E402
from msa_megatron.ops.triton import selection  # noqa: E402

# name -> (SELECT_ROWS, SELECT_KEY_SUBTILE, SELECT_WARPS, SELECT_STAGES, GROUP_BLOCKS); the
# first is the default. ptxas sm_90 (Triton 3.6): 256/128/16/3 122 regs 161 KiB (1 program per
# SM); 256/64/8/3 116 regs 113 KiB (2 per SM: exactly the 228 KiB Triton's PREFER_SHARED
# gives); 256/64/8/2 111 regs 97 KiB (2 per SM, but no load ahead of the one awaited);
# 128/128/8/2 106 regs 97 KiB (2 per SM, twice the L2 traffic of index keys).
VARIANTS = {
    "r256-ks128-w16-s3-g32": (256, 128, 16, 3, 32),
    "r256-ks64-w8-s3-g32": (256, 64, 8, 3, 32),
    "r256-ks128-w16-s3-g64": (256, 128, 16, 3, 64),
    "r256-ks64-w8-s2-g32": (256, 64, 8, 2, 32),
    "r256-ks128-w16-s2-g32": (256, 128, 16, 2, 32),
    "r128-ks128-w8-s2-g32": (128, 128, 8, 2, 32),
    "r128-ks128-w8-s3-g32": (128, 128, 8, 3, 32),
}
NAMES = ("SELECT_ROWS", "SELECT_KEY_SUBTILE", "SELECT_WARPS", "SELECT_STAGES", "GROUP_BLOCKS")


def kernel_ms(fn, reps: int = 3) -> dict:
    """CUDA time per call of each Triton kernel launched by ``fn`` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.key.startswith("_"):
            total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            out[e.key] = total / 1e3 / reps
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--tokens", default="32768,131072")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--dists", default="iid,coherent",
                        help="iid, coherent (bench_kernels), rising (scores grow with the key "
                             "position: every block enters the top-k, the top-k walk's worst case)")
    parser.add_argument("--budget", type=float, default=240.0)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU interpreter (TRITON_INTERPRET=1), --tokens small")
    args = parser.parse_args()
    start = time.time()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    n = 256 if args.dry_run else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.float32 if args.dry_run else torch.bfloat16)
    mm = time_ms(lambda: a @ a)["median"]
    rate = 2 * n**3 / mm / 1e9  # TFLOP/s
    del a
    saved = {n: getattr(selection, n) for n in NAMES}
    rows = []
    for t in map(int, args.tokens.split(",")):
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        q_pos, q_kbase = query_layout(cu, t, dev)
        causal = t * (t + 1) // 2  # as bench_kernels.flops
        gemm_ms = 2 * 4 * 128 * causal / rate / 1e9
        for dist in args.dists.split(","):
            torch.manual_seed(1)
            q_idx = index_input(t, 4, 128, "iid" if dist == "rising" else dist, dev,
                                torch.bfloat16)
            k_idx = index_input(t, 1, 128, "iid" if dist == "rising" else dist, dev,
                                torch.bfloat16)
            if dist == "rising":  # a shared direction, growing with the key position
                q_idx[..., 0] = 4.0
                k_idx[..., 0] = torch.linspace(0, 8, t, device=dev)[:, None]
            want = None
            for name in args.variants.split(","):
                if time.time() - start > args.budget:
                    print(f"budget: skipping {t} {dist} {name}", flush=True)
                    continue
                for n, v in zip(NAMES, VARIANTS[name]):
                    setattr(selection, n, v)
                entry = dict(tokens=t, dist=dist, variant=name, gemm_ms=gemm_ms)
                try:
                    def fn():
                        return tri.select(q_idx, k_idx, q_pos, q_kbase, block_size=128,
                                          top_k=16)
                    got = fn()
                    if want is None:
                        want = got
                    entry["equal_to_default"] = bool(torch.equal(got, want))
                    entry["ms"] = time_ms(fn)["median"]
                    entry["ratio"] = entry["ms"] / gemm_ms
                    if not args.dry_run:
                        entry["kernels_ms"] = kernel_ms(fn)
                except Exception as e:  # a failing variant is a finding
                    entry["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(entry)
                print(json.dumps(entry), flush=True)
    for n, v in saved.items():
        setattr(selection, n, v)
    with open(args.out, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name() if not args.dry_run else "cpu",
                       matmul_tflops=rate, rows=rows), f, indent=1)
    print(f"matmul {rate:.0f} TFLOP/s")
    for r in rows:
        ok = "ok" if r.get("equal_to_default") else "FAIL"
        print(f"{r['tokens']} {r['dist']} {r['variant']} {ok} {r.get('ms', float('nan')):.2f} ms "
              f"x{r.get('ratio', float('nan')):.2f} gemm  {r.get('kernels_ms', r.get('error'))}")
    return 0 if all(r.get("equal_to_default") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
