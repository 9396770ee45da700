"""Run one part of the sparse op on the GPU, synchronising after every step, so a memory fault is
pinned to that part (run it under ``compute-sanitizer --tool memcheck``, or alone: a fault
then raises at the step that caused it).

Usage (from the repository root, on the GPU machine)::

    python benchmarks/gpu_memcheck.py PART HEADS [TOKENS]
    compute-sanitizer --tool memcheck --print-limit 4 --show-backtrace device \\
        python benchmarks/gpu_memcheck.py bwd paper 4096

``PART``: ``select`` (the block selection), ``fwd`` (selection, then the sparse attention
forward), ``bwd`` (then its backward: dQ, dK, dV), ``kl`` (selection, forward, then the KL value
and its index gradients) or ``dense`` (the whole op in dense mode, all gradients). ``HEADS``: a
head layout of ``bench_kernels.HEADS`` (``paper``: 64 query heads, 4 KV groups, 4 index heads;
``peer``; ``tp-shard``). ``TOKENS``: 4096 (default) packs the check's documents
(``bench_kernels.CHECK_DOCS``), any other count is one sequence. Inputs are those of
``bench_kernels.py`` (bf16, D = Di = 128, block 128, top-k 16, iid index inputs, seed 0).

``CUDA_LAUNCH_BLOCKING=1`` is set unless given, so an asynchronous fault is reported by the
launch that caused it. Prints ``<part> <heads> PASS`` (exit status 0) or the traceback and
``<part> <heads> FAIL`` (exit status 1). The values are not checked here (``bench_kernels.py
--check-list`` does that); a run under the sanitizer is a check that no kernel of the part reads
or writes out of bounds (benchmarks/NOTES.md, "v10 backward: out-of-bounds shared read on the
GPU").
"""

from __future__ import annotations

import os
import sys
import traceback

os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import bench_kernels as bk  # noqa: E402
from msa_megatron.ops import triton as tri  # noqa: E402

PARTS = ("select", "fwd", "bwd", "kl", "dense")


def run(part: str, heads_name: str, tokens: int) -> None:
    """Run ``part`` on the GPU for ``heads_name`` at ``tokens`` tokens, printing each step.

    Raises:
        ValueError: unknown ``part`` or ``heads_name``, or ``tokens < 1``.
    """
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    if heads_name not in bk.HEADS:
        raise ValueError(f"heads must be one of {tuple(bk.HEADS)}, got {heads_name!r}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    dev = torch.device("cuda")
    heads, dims = bk.HEADS[heads_name], dict(bk.DIMS)
    torch.manual_seed(0)
    lens = list(bk.CHECK_DOCS) if tokens == bk.CHECK_TOKENS else [tokens]
    x = bk.make_inputs(heads, dims, tokens, lens, "iid", dev, torch.bfloat16)

    def step(name: str, *extra) -> None:
        torch.cuda.synchronize()
        print(part, heads_name, name, "ok", *extra, flush=True)

    if part == "dense":
        _, kl, _ = bk.whole_op(x, dims, "dense")
        step("dense op and gradients", float(kl))
        return
    bi = tri.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"], block_size=dims["block"],
                    top_k=dims["top_k"])
    step("select")
    if part == "select":
        return
    q, k, v = (x[n].detach().requires_grad_() for n in ("q", "k", "v"))
    out, lse = tri.attention(q, k, v, bi, x["q_pos"], x["q_kbase"], block_size=dims["block"])
    step("forward")
    if part == "bwd":
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        step("backward", [round(float(g.float().norm()), 3) for g in grads])
    elif part == "kl":
        qi, ki = (x[n].detach().requires_grad_() for n in ("q_idx", "k_idx"))
        value = tri.kl(q.detach(), k.detach(), lse.detach(), qi, ki, bi, x["q_pos"],
                       x["q_kbase"], block_size=dims["block"],
                       kl_scale=1.0 / (tokens * heads["hi"]))
        step("KL value", float(value))
        torch.autograd.grad(value, (qi, ki))
        step("KL index gradients")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (2, 3) or argv[0] not in PARTS or argv[1] not in bk.HEADS:
        print(__doc__)
        return 2
    part, heads_name = argv[0], argv[1]
    try:
        run(part, heads_name, int(argv[2]) if len(argv) == 3 else bk.CHECK_TOKENS)
    except Exception:
        traceback.print_exc()
        print(part, heads_name, "FAIL", flush=True)
        return 1
    print(part, heads_name, "PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
