"""Does Gluon (Triton's explicit-layout dialect) make the dense-KL teacher loop much faster on
sm_90 than plain Triton?  A bounded probe of the dominant loop of the dense KL pass.

The loop ("teacher rows"): ``Hq`` query heads, ``Hi`` index heads of ``G = Hq / Hi`` query heads
each, one key head per index head group (``Hkv == Hi``: query head ``h`` uses key head
``h // G``), one index key head ``k_idx`` shared by all index heads, one causal sequence::

    out[t, i, :] = sum_{s <= t} mean_{h in group i} exp(scale q[t, h] . k[s, h // G] - lse[t, h])
                                * k_idx[s, :]                                  # [T, Hi, Di] fp32

i.e. a forward attention with known LSE, the head mean folded in and ``V = k_idx`` (the teacher
of ``msa_megatron/ops/triton/dense_kl.py``; its student part is ``1/G`` of this).

Three implementations of the same math:

- :func:`teacher_rows_torch`: float64 reference, chunked over rows;
- :func:`teacher_rows_triton`: plain Triton written like the dense KL (program = query tile of
  ``BM`` rows x index head; causal key tiles of ``BN``; inside, the ``G`` heads: ``S = q_h k^T``,
  ``p += exp2(S scale log2e - lse_h log2e)``; then ``acc += p k_idx``); runs under
  ``TRITON_INTERPRET=1``;
- :func:`teacher_rows_gluon`: the same loop in Gluon for sm_90, warp-specialised: a 1-warp
  producer partition streams K / ``k_idx`` tiles (per key step) and ``Q_h`` tiles (per head)
  by TMA into shared-memory rings guarded by mbarriers; the consumer warpgroup issues the
  ``S`` products as async ``wgmma`` one head ahead, so head ``h``'s exp2 runs under head
  ``h + 1``'s product.

Usage (from the repository root)::

    . benchmarks/gpu_env.sh; python benchmarks/gluon_probe.py OUT.json --tokens 4096 32768
    PYTHONPATH=/tmp/t36site:$PWD python benchmarks/gluon_probe.py compile   # CPU, sm_90 SASS

The GPU run checks each implementation against the reference at 4096 tokens (bf16 inputs),
times it at every ``--tokens`` (CUDA events, median) and writes a JSON; a failing
implementation records its error and the others go on (Gluon runs last: a launch failure
poisons the CUDA context). ``compile`` compiles both kernels for ``GPUTarget("cuda", 90, 32)``
and prints registers, spills, shared memory, warps and the SASS's ``HGMMA`` / wait counts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import sys
import traceback

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
HEADS, INDEX_HEADS, HEAD_DIM, INDEX_DIM = 64, 4, 128, 128  # paper heads (Hkv == Hi)
CHECK_TOKENS = 4096


def _check_inputs(q, k, lse, k_idx, index_heads):
    """Shapes ``(T, Hq, Hi, D, Di)`` of the inputs; ValueError naming a bad argument."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    tokens, heads, dim = q.shape
    if k.dim() != 3 or k.shape[0] != tokens or k.shape[2] != dim:
        raise ValueError(f"k must be [T, Hkv, D] = [{tokens}, Hkv, {dim}], got {tuple(k.shape)}")
    if index_heads < 1 or heads % index_heads:
        raise ValueError(f"index_heads must divide Hq = {heads}, got {index_heads}")
    if k.shape[1] != index_heads:
        raise ValueError(f"k must have one key head per index head ({index_heads}), "
                         f"got {k.shape[1]}")
    if tuple(lse.shape) != (tokens, heads):
        raise ValueError(f"lse must be [T, Hq] = [{tokens}, {heads}], got {tuple(lse.shape)}")
    if k_idx.dim() != 2 or k_idx.shape[0] != tokens:
        raise ValueError(f"k_idx must be [T, Di], got {tuple(k_idx.shape)}")
    if k.dtype != q.dtype or k_idx.dtype != q.dtype:
        raise TypeError(f"q, k, k_idx must share a dtype, got {q.dtype}, {k.dtype}, "
                        f"{k_idx.dtype}")
    return tokens, heads, index_heads, dim, k_idx.shape[1]


def teacher_rows_torch(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                       k_idx: torch.Tensor, index_heads: int, chunk: int = 64) -> torch.Tensor:
    """Reference teacher rows in float64, ``chunk`` query rows at a time.

    q ``[T, Hq, D]``, k ``[T, Hi, D]`` (query head ``h`` uses key head ``h // (Hq / Hi)``),
    lse ``[T, Hq]`` (natural log, of ``softmax(D**-0.5 q k^T)`` over the causal prefix),
    k_idx ``[T, Di]`` -> ``[T, Hi, Di]`` float32."""
    tokens, heads, hi, dim, di = _check_inputs(q, k, lse, k_idx, index_heads)
    group, scale = heads // hi, dim ** -0.5
    out = torch.empty(tokens, hi, di, dtype=torch.float32, device=q.device)
    kk = k.double().repeat_interleave(group, dim=1)  # [T, Hq, D]
    kid = k_idx.double()
    for r0 in range(0, tokens, chunk):
        r1 = min(r0 + chunk, tokens)
        s = torch.einsum("rhd,shd->rhs", q[r0:r1].double(), kk[:r1]) * scale  # [R, Hq, S]
        p = torch.exp(s - lse[r0:r1].double()[:, :, None])
        rows = torch.arange(r0, r1, device=q.device)[:, None, None]
        p = p.masked_fill(torch.arange(r1, device=q.device)[None, None, :] > rows, 0.0)
        p = p.view(r1 - r0, hi, group, r1).mean(dim=2)  # [R, Hi, S]
        out[r0:r1] = (p @ kid[:r1]).float()
    return out


def causal_lse(q: torch.Tensor, k: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """``[T, Hq]`` natural-log LSE of ``D**-0.5 q k^T`` over the causal prefix (fp32 math)."""
    tokens, heads, dim = q.shape
    group = heads // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    for r0 in range(0, tokens, chunk):
        r1 = min(r0 + chunk, tokens)
        s = torch.einsum("rhd,shd->rhs", q[r0:r1].float(), kk[:r1]) * dim ** -0.5
        rows = torch.arange(r0, r1, device=q.device)[:, None, None]
        s = s.masked_fill(torch.arange(r1, device=q.device)[None, None, :] > rows, -math.inf)
        lse[r0:r1] = torch.logsumexp(s, dim=2)
    return lse


def _lse2(lse: torch.Tensor, group: int) -> torch.Tensor:
    """``[Hq, T]`` fp32: ``lse log2e + log2 G``, the head mean folded into the exponent."""
    return (lse.float() * LOG2E + math.log2(group)).t().contiguous()


@triton.jit
def _triton_tile(q_ptr, k_ptr, ki_ptr, lse2_ptr, acc, rows, n, i, T, HQ, C,
                 G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
                 DIAGONAL: tl.constexpr):
    """``acc + p k_idx`` of key tile ``n`` (``p``: the head-mean teacher of the tile)."""
    cols = n * BN + tl.arange(0, BN)
    dd = tl.arange(0, D)
    kt = tl.load(k_ptr + (cols[:, None] * (HQ // G) + i) * D + dd[None, :],
                 mask=cols[:, None] < T, other=0.0)
    p = tl.zeros([BM, BN], tl.float32)
    for j in range(G):
        h = i * G + j
        qt = tl.load(q_ptr + (rows[:, None] * HQ + h) * D + dd[None, :],
                     mask=rows[:, None] < T, other=0.0)
        lse2 = tl.load(lse2_ptr + h * T + rows, mask=rows < T, other=0.0)
        s = tl.dot(qt, tl.trans(kt))
        p += tl.exp2(s * C - lse2[:, None])
    if DIAGONAL:
        p = tl.where(cols[None, :] <= rows[:, None], p, 0.0)
    kit = tl.load(ki_ptr + cols[:, None] * DI + tl.arange(0, DI)[None, :],
                  mask=cols[:, None] < T, other=0.0)
    return tl.dot(p.to(kit.dtype), kit, acc)


@triton.jit
def _teacher_rows_triton_kernel(q_ptr, k_ptr, ki_ptr, lse2_ptr, out_ptr, T, HQ, C,
                                G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                D: tl.constexpr, DI: tl.constexpr):
    """Program (query tile ``m``, index head ``i``): rows ``[m BM, m BM + BM)`` of ``out``."""
    m = tl.program_id(0)
    i = tl.program_id(1)
    hi = HQ // G
    rows = m * BM + tl.arange(0, BM)
    acc = tl.zeros([BM, DI], tl.float32)
    full = (m * BM) // BN  # key tiles wholly below the query tile's first row
    last = tl.cdiv(tl.minimum(m * BM + BM, T), BN)
    for n in range(0, full):
        acc = _triton_tile(q_ptr, k_ptr, ki_ptr, lse2_ptr, acc, rows, n, i, T, HQ, C, G, BM, BN,
                           D, DI, False)
    for n in range(full, last):  # the diagonal: causal mask
        acc = _triton_tile(q_ptr, k_ptr, ki_ptr, lse2_ptr, acc, rows, n, i, T, HQ, C, G, BM, BN,
                           D, DI, True)
    di = tl.arange(0, DI)
    tl.store(out_ptr + (rows[:, None] * hi + i) * DI + di[None, :], acc,
             mask=rows[:, None] < T)


def teacher_rows_triton(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                        k_idx: torch.Tensor, index_heads: int, block_m: int = 128,
                        block_n: int = 64, num_warps: int = 8,
                        num_stages: int = 2) -> torch.Tensor:
    """Teacher rows by the plain Triton kernel; arguments and result as
    :func:`teacher_rows_torch` (``block_m`` / ``block_n``: the query / key tile)."""
    tokens, heads, hi, dim, di = _check_inputs(q, k, lse, k_idx, index_heads)
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    group = heads // hi
    q, k, k_idx = q.contiguous(), k.contiguous(), k_idx.contiguous()
    out = torch.empty(tokens, hi, di, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(tokens, block_m), hi)
    _teacher_rows_triton_kernel[grid](q, k, k_idx, _lse2(lse, group), out, tokens, heads,
                                      dim ** -0.5 * LOG2E, G=group, BM=block_m, BN=block_n,
                                      D=dim, DI=di, num_warps=num_warps, num_stages=num_stages)
    return out


def flops(tokens: int, heads: int = HEADS, index_heads: int = INDEX_HEADS, dim: int = HEAD_DIM,
          index_dim: int = INDEX_DIM) -> float:
    """``2 Hq D P + 2 Hi Di P`` with ``P = T^2 / 2`` causal pairs."""
    pairs = tokens * tokens / 2
    return 2 * heads * dim * pairs + 2 * index_heads * index_dim * pairs


def paper_inputs(tokens: int, device, dtype=torch.bfloat16, seed: int = 0):
    """``(q, k, lse, k_idx)`` at the paper heads, random normal, ``lse`` exact."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=device, generator=gen).to(dtype)
    k = torch.randn(tokens, INDEX_HEADS, HEAD_DIM, device=device, generator=gen).to(dtype)
    k_idx = torch.randn(tokens, INDEX_DIM, device=device, generator=gen).to(dtype)
    return q, k, causal_lse(q, k), k_idx


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max absolute and norm-wise relative error of ``out`` against ``ref``."""
    diff = (out.double() - ref.double())
    return {"max_abs": diff.abs().max().item(),
            "rel_norm": (diff.norm() / ref.double().norm().clamp_min(1e-300)).item()}


def time_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median CUDA-event time of ``fn()`` in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _implementations():
    impls = {"triton": teacher_rows_triton}
    impls["gluon"] = lambda *a, **kw: teacher_rows_gluon(*a, **kw)  # noqa: F821 (defined below)
    return impls


def run_gpu(path: str, token_counts, impl_names) -> int:
    """Check each implementation at ``CHECK_TOKENS``, time it at ``token_counts``, write JSON."""
    device = torch.device("cuda")
    impls = _implementations()
    order = [name for name in ("triton", "gluon") if name in impl_names]  # gluon last
    result = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "triton": triton.__version__, "tokens": list(token_counts),
              "shape": {"Hq": HEADS, "Hi": INDEX_HEADS, "D": HEAD_DIM, "Di": INDEX_DIM,
                        "dtype": "bf16"}, "impls": {}}

    def write():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    q, k, lse, k_idx = paper_inputs(CHECK_TOKENS, device)
    ref = teacher_rows_torch(q, k, lse, k_idx, INDEX_HEADS)
    for name in order:
        entry = result["impls"].setdefault(name, {"times": {}})
        try:
            out = impls[name](q, k, lse, k_idx, INDEX_HEADS)
            torch.cuda.synchronize()
            entry["errors"] = errors(out, ref)
            print(f"{name:7s} check T {CHECK_TOKENS}: max_abs {entry['errors']['max_abs']:.3e} "
                  f"rel_norm {entry['errors']['rel_norm']:.3e}", flush=True)
            for tokens in token_counts:
                args = (q, k, lse, k_idx) if tokens == CHECK_TOKENS else \
                    paper_inputs(tokens, device)
                ms = time_ms(lambda: impls[name](*args, INDEX_HEADS))
                tflops = flops(tokens) / ms / 1e9
                entry["times"][str(tokens)] = {"ms": ms, "tflops": tflops}
                print(f"{name:7s} T {tokens:6d}: {ms:9.3f} ms {tflops:7.1f} TFLOP/s", flush=True)
                del args
        except Exception as error:  # recorded; the next implementation still runs
            entry["error"] = f"{type(error).__name__}: {error}"[-4000:]
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(f"{name:7s} FAILED: {entry['error'][:500]}", flush=True)
        write()
    write()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:
        return run_compile(argv[1:])  # noqa: F821 (defined below)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--tokens", type=int, nargs="+", default=[CHECK_TOKENS, 32768])
    parser.add_argument("--impl", nargs="+", choices=["triton", "gluon"],
                        default=["triton", "gluon"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the timing run needs the GPU (the compile subcommand does not)")
        return 2
    return run_gpu(args.out, args.tokens, args.impl)


if __name__ == "__main__":
    sys.exit(main())
