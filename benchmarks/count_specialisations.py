"""Count the Triton kernel variants the GPU's JIT compiles for MSA fwd+bwd steps, on CPU.

Every launch's JIT cache key (constexprs, launch options, per argument the type and Triton's
specialisation: 16-byte alignment of a tensor, an int equal to 1 or divisible by 16 unless the
kernel marks it ``do_not_specialize``) is computed with Triton's own binder for sm_90
(:class:`tests.support.jit_keys.JitKeys`). One process runs the steps in order, as a training
run does, and prints per step the variants it adds; every step after the first should add none
(one compile serves every token chunk and every length)::

    TRITON_INTERPRET=1 python benchmarks/count_specialisations.py
    TRITON_INTERPRET=1 python benchmarks/count_specialisations.py --steps 8192,32845/7
    TRITON_INTERPRET=1 python benchmarks/count_specialisations.py --heads small --chunks 16 \\
        --execute --steps 256,320

Steps: ``N`` is one sequence of N tokens, ``N/d`` N tokens packed in d documents of uneven
lengths. Default: the paper config (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, B 128, k 16, bf16)
at 8K, 32K, 32K+77, 32K in 14 documents, 64K and 128K. The kernels are not run (the host code
picks every launch from the shapes alone: no host synchronisation), so a 128K step takes seconds
and a few GB of memory; ``--execute`` runs them in the interpreter (small shapes only).
``--chunks 16`` sets the per-chunk partial budget to one byte, so the forward, backward and KL
run their maximum of 16 token chunks at any length (the paper config runs 16 / 16 / 4 on the
GPU at every length from 4K to 256K).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msa_megatron.core import MSAOptions, msa_layer  # noqa: E402
from msa_megatron.ops.triton import _common  # noqa: E402
from tests.support.jit_keys import JitKeys  # noqa: E402

HEADS = {"paper": dict(hq=64, hkv=4, hi=4, hik=1, d=128, di=128, block=128, top_k=16),
         "small": dict(hq=16, hkv=2, hi=2, hik=1, d=64, di=64, block=16, top_k=4)}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_STEPS = "8192,32768,32845,32768/14,65536,131072"
# Kernels launched once per token chunk (the ones the fix is about).
CHUNKED = ("_block_keys_kernel", "_topk_kernel", "_attn_fwd_blocks_kernel",
           "_attn_merge_kernel", "_attn_bwd_blocks_kernel", "sum_partials_kernel",
           "_kl_keys_kernel")


def parse_step(text: str) -> tuple:
    """``"N"`` -> (N, 1); ``"N/d"`` -> (N, d)."""
    total, _, docs = text.partition("/")
    return int(total), int(docs or 1)


def cu_seqlens(total: int, docs: int) -> torch.Tensor:
    """Boundaries of ``docs`` documents of uneven lengths (weights 1, 2, 3, ...) over
    ``total`` tokens."""
    weights = torch.arange(1, docs + 1, dtype=torch.float64)
    ends = (weights.cumsum(0) / weights.sum() * total).round().to(torch.int64)
    ends[-1] = total
    return torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(torch.int32)


def run_step(heads: dict, dtype, total: int, docs: int, execute: bool) -> None:
    """One sparse fwd+bwd of the MSA layer (inputs 0 unless the kernels run)."""
    shapes = (heads["hq"], heads["hkv"], heads["hkv"], heads["hi"], heads["hik"])
    dims = (heads["d"], heads["d"], heads["d"], heads["di"], heads["di"])
    gen = torch.Generator().manual_seed(total + docs)
    leaves = [(torch.randn((total, h, dim), generator=gen) if execute
               else torch.zeros((total, h, dim))).to(dtype).requires_grad_(True)
              for h, dim in zip(shapes, dims)]
    res = msa_layer(*leaves, cu_seqlens=cu_seqlens(total, docs), kl_scale=1.0 / total,
                    options=MSAOptions(backend="triton", block_size=heads["block"],
                                       top_k=heads["top_k"]))
    grads = torch.autograd.grad((res.out, res.kl),
                                leaves, (torch.ones_like(res.out), torch.ones_like(res.kl)))
    del res, grads, leaves


def chunk_counts(launches) -> str:
    """Token chunks per op, from the launches of one step."""
    kl = max(0, launches["_kl_keys_kernel"] - 2) // 2  # minus the dense key kernel (both ISO)
    return (f"chunks select {launches['_topk_kernel']} fwd {launches['_attn_merge_kernel']} "
            f"bwd {launches['_attn_bwd_blocks_kernel'] // 2} kl {kl}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", choices=tuple(HEADS), default="paper")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--steps", default=DEFAULT_STEPS,
                        help=f"comma-separated N or N/docs (default {DEFAULT_STEPS})")
    parser.add_argument("--chunks", choices=("16", "auto"), default="auto")
    parser.add_argument("--execute", action="store_true", help="run the kernels (small shapes)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("run under TRITON_INTERPRET=1 (launches are recorded in the interpreter)")
    if args.chunks == "16":
        _common.PARTIAL_QS, _common.PARTIAL_MIN_BYTES = 0, 1
    heads, dtype = HEADS[args.heads], DTYPES[args.dtype]
    keys = JitKeys()
    print(f"{args.heads} heads {heads}, {args.dtype}, chunks {args.chunks}: variants the GPU's "
          f"JIT compiles (sm_90 cache keys)", flush=True)
    for i, step in enumerate(args.steps.split(",")):
        total, docs = parse_step(step)
        snap, before = keys.snapshot(), keys.launches.copy()
        with keys.watch(execute=args.execute):
            run_step(heads, dtype, total, docs, args.execute)
        new = keys.added(snap)
        chunked = sum(n for name, n in new.items() if name in CHUNKED)
        print(f"step {i + 1}: {total} tokens in {docs} document(s), "
              f"{chunk_counts(keys.launches - before)}: {sum(new.values())} new variants "
              f"({chunked} of chunked kernels) {sorted(new.items())}", flush=True)
    counts = keys.counts()
    print(f"total: {keys.total()} variants over all steps, "
          f"{sum(n for name, n in counts.items() if name in CHUNKED)} of chunked kernels "
          f"{sorted((n, c) for n, c in counts.items() if n in CHUNKED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
