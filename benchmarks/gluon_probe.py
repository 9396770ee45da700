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
times it at every ``--tokens`` (CUDA events, median) and writes a JSON; each implementation
runs in its own process (Gluon last) with a time limit (``--timeout``), so a failing or hanging
one records its error and the others go on. ``compile`` compiles every kernel for
``GPUTarget("cuda", 90, 32)`` and prints registers, spills, shared memory, warps, the
``setmaxnreg`` values, whether ptxas serialised the wgmma, and SASS counts (``HGMMA``,
``WARPGROUP.DEPBAR`` waits, ``MUFU.EX2`` ...). Results: ``benchmarks/NOTES.md``, "Gluon probe
(session 12)".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import traceback

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
HEADS, INDEX_HEADS, HEAD_DIM, INDEX_DIM = 64, 4, 128, 128  # paper heads (Hkv == Hi)
CHECK_TOKENS = 4096
# the order of a GPU run: Gluon last
IMPLS = ("triton", "gluon", "gluon_wg1", "gluon_bn128", "gluon_pp", "gluon_bn128_q2",
         "gluon_bn128_k1q6")


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
                 G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 DI: tl.constexpr, DIAGONAL: tl.constexpr):
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
    m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest rows first (causal tail)
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


@gluon.jit
def _gluon_producer(q_desc, k_desc, ki_desc, q_smem, k_smem, ki_smem, q_ready, q_empty,
                    kv_ready, kv_empty, m, i, last, G: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, D: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr):
    """Producer partition (1 warp): per key step its K and ``k_idx`` tiles into ring slot
    ``n % KS``, then the ``G`` heads' Q tiles into the Q ring, each once its slot is free."""
    qc = 0
    for n in range(last):
        slot = n % KS
        mbarrier.wait(kv_empty.index(slot), ((n // KS) & 1) ^ 1)  # first round: passes
        mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes + ki_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n * BN, i * D], kv_ready.index(slot),
                                        k_smem.index(slot))
        tma.async_copy_global_to_shared(ki_desc, [n * BN, 0], kv_ready.index(slot),
                                        ki_smem.index(slot))
        for j in range(G):
            qs = qc % QS
            mbarrier.wait(q_empty.index(qs), ((qc // QS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [m * BM, (i * G + j) * D],
                                            q_ready.index(qs), q_smem.index(qs))
            qc += 1


@gluon.jit
def _gluon_consumer(lse2_ptr, out_ptr, q_smem, k_smem, ki_smem, q_ready, q_empty, kv_ready,
                    kv_empty, m, i, full, last, T, HI, C, G: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, DI: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr,
                    WARPS: gl.constexpr, ACC_SMEM: gl.constexpr):
    """Consumer partition (the default one, ``WARPS`` warps, ``BM = 16 WARPS`` rows): per key
    step the ``G`` products ``S_h = Q_h K^T`` as async wgmma, ``S_{h+1}`` issued before head
    ``h``'s exp2 (which runs under it); then ``acc += p k_idx`` (``p`` from registers)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, DI, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    # the G heads' lse2 rows staged once in shared memory (per-head pointer tensors, hoisted
    # out of the key loop by the compiler, took ~64 registers)
    flat = gl.arange(0, G * BM, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    lr = m * BM + flat % BM
    lse_tile = gl.load(lse2_ptr + (i * G + flat // BM) * T + lr, mask=lr < T, other=0.0)
    lse_smem = gl.allocate_shared_memory(gl.float32, [G * BM],
                                         gl.SwizzledSharedLayout(1, 1, 1, [0]), lse_tile)
    gl.thread_barrier()
    zero_s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    acc = gl.zeros([BM, DI], gl.float32, layout=o_layout)
    if ACC_SMEM:  # acc in shared memory between key steps: its registers free in the head loop
        acc_smem = gl.allocate_shared_memory(gl.float32, [BM, DI],
                                             gl.SwizzledSharedLayout(1, 1, 1, [1, 0]), acc)
    qc = 0
    for n in range(last):
        slot = n % KS
        mbarrier.wait(kv_ready.index(slot), (n // KS) & 1)
        kt = k_smem.index(slot).permute((1, 0))  # [D, BN]
        mbarrier.wait(q_ready.index(qc % QS), (qc // QS) & 1)
        s_next = warpgroup_mma(q_smem.index(qc % QS), kt, zero_s, use_acc=False, is_async=True)
        p = zero_s
        for j in gl.static_range(G):
            s_now = s_next
            if j + 1 < G:  # issue head j + 1's product before head j's exp2
                qn = qc + 1
                mbarrier.wait(q_ready.index(qn % QS), (qn // QS) & 1)
                s_next = warpgroup_mma(q_smem.index(qn % QS), kt, zero_s, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_now, ))
            else:
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_now, ))
            gl.thread_barrier()  # every warp's reads of the Q slot done: the arrive is thread 0's
            mbarrier.arrive(q_empty.index(qc % QS), count=1)
            lse2 = lse_smem.slice(j * BM, BM).load(gl.SliceLayout(1, s_layout))
            p += gl.exp2(s * C - lse2[:, None])
            qc += 1
        if n >= full:  # the diagonal: causal mask
            cols = n * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
            p = gl.where(cols[None, :] <= rows[:, None], p, 0.0)
        pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        if ACC_SMEM:  # each thread reads back what it wrote: no barrier
            acc = acc_smem.load(o_layout)
        acc = warpgroup_mma(pb, ki_smem.index(slot), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if ACC_SMEM:
            acc_smem.store(acc)
        gl.thread_barrier()
        mbarrier.arrive(kv_empty.index(slot), count=1)
    if ACC_SMEM:
        acc = acc_smem.load(o_layout)
    out_rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
    out_cols = gl.arange(0, DI, layout=gl.SliceLayout(0, o_layout))
    gl.store(out_ptr + (out_rows[:, None] * HI + i) * DI + out_cols[None, :], acc,
             mask=out_rows[:, None] < T)


@gluon.jit
def _teacher_rows_gluon_kernel(q_desc, k_desc, ki_desc, lse2_ptr, out_ptr, T, HI, C,
                               G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                               D: gl.constexpr, DI: gl.constexpr, QS: gl.constexpr,
                               KS: gl.constexpr, ACC_SMEM: gl.constexpr,
                               PRODUCER_REGS: gl.constexpr,
                               num_warps: gl.constexpr):
    """Program (query tile ``m``, index head ``i``): shared rings and barriers, then the
    consumer (default partition) and the producer (1 worker warp)."""
    m = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest rows first (causal tail)
    i = gl.program_id(1)
    full = (m * BM) // BN
    last = gl.cdiv(gl.minimum(m * BM + BM, T), BN)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QS, BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KS, BN, D], k_desc.layout)
    ki_smem = gl.allocate_shared_memory(ki_desc.dtype, [KS, BN, DI], ki_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(QS):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=1)
    for s in gl.static_range(KS):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_gluon_consumer, (lse2_ptr, out_ptr, q_smem, k_smem, ki_smem, q_ready, q_empty,
                           kv_ready, kv_empty, m, i, full, last, T, HI, C, G, BM, BN, DI, QS,
                           KS, num_warps, ACC_SMEM)),
        (_gluon_producer, (q_desc, k_desc, ki_desc, q_smem, k_smem, ki_smem, q_ready, q_empty,
                           kv_ready, kv_empty, m, i, last, G, BM, BN, D, QS, KS)),
    ], [1], [PRODUCER_REGS])


@gluon.jit
def _gluon_pp_producer(q_desc, k_desc, ki_desc, qa_smem, qb_smem, k_smem, ki_smem, qa_ready,
                       qa_empty, qb_ready, qb_empty, kv_ready, kv_empty, m, i, last,
                       G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                       QS: gl.constexpr, KS: gl.constexpr):
    """Producer of the ping-pong kernel: per key step K and ``k_idx``, then per head the Q
    tiles of both consumers' row halves (``BM / 2`` rows each) into their own rings."""
    qc = 0
    for n in range(last):
        slot = n % KS
        mbarrier.wait(kv_empty.index(slot), ((n // KS) & 1) ^ 1)
        mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes + ki_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n * BN, i * D], kv_ready.index(slot),
                                        k_smem.index(slot))
        tma.async_copy_global_to_shared(ki_desc, [n * BN, 0], kv_ready.index(slot),
                                        ki_smem.index(slot))
        for j in range(G):
            qs = qc % QS
            phase = ((qc // QS) & 1) ^ 1
            mbarrier.wait(qa_empty.index(qs), phase)
            mbarrier.expect(qa_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [m * BM, (i * G + j) * D],
                                            qa_ready.index(qs), qa_smem.index(qs))
            mbarrier.wait(qb_empty.index(qs), phase)
            mbarrier.expect(qb_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [m * BM + BM // 2, (i * G + j) * D],
                                            qb_ready.index(qs), qb_smem.index(qs))
            qc += 1


@gluon.jit
def _teacher_rows_gluon_pp_kernel(q_desc, k_desc, ki_desc, lse2_ptr, out_ptr, T, HI, C,
                                  G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                                  D: gl.constexpr, DI: gl.constexpr, QS: gl.constexpr,
                                  KS: gl.constexpr, ACC_SMEM: gl.constexpr,
                                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                  num_warps: gl.constexpr):
    """Ping-pong: program (query tile ``m`` of ``BM`` rows, index head ``i``) with two consumer
    partitions of one warpgroup each (the default and a worker) on the two row halves, each
    with its own Q ring and barriers (a thread barrier syncs only its own partition, so the
    two drift apart and one's exp2 runs under the other's products), sharing the K / ``k_idx``
    ring (``empty`` counts both); both walk the whole tile's key steps (the first half's last
    one masked out)."""
    HALF: gl.constexpr = BM // 2
    m = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest rows first (causal tail)
    i = gl.program_id(1)
    last = gl.cdiv(gl.minimum(m * BM + BM, T), BN)
    qa_smem = gl.allocate_shared_memory(q_desc.dtype, [QS, HALF, D], q_desc.layout)
    qb_smem = gl.allocate_shared_memory(q_desc.dtype, [QS, HALF, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KS, BN, D], k_desc.layout)
    ki_smem = gl.allocate_shared_memory(ki_desc.dtype, [KS, BN, DI], ki_desc.layout)
    qa_ready = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    qa_empty = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    qb_ready = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    qb_empty = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(QS):
        mbarrier.init(qa_ready.index(s), count=1)
        mbarrier.init(qa_empty.index(s), count=1)
        mbarrier.init(qb_ready.index(s), count=1)
        mbarrier.init(qb_empty.index(s), count=1)
    for s in gl.static_range(KS):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # one release per consumer
    fence_async_shared()
    gl.warp_specialize([
        (_gluon_consumer, (lse2_ptr, out_ptr, qa_smem, k_smem, ki_smem, qa_ready, qa_empty,
                           kv_ready, kv_empty, m * 2, i, (m * BM) // BN, last, T, HI, C, G,
                           HALF, BN, DI, QS, KS, 4, ACC_SMEM)),
        (_gluon_consumer, (lse2_ptr, out_ptr, qb_smem, k_smem, ki_smem, qb_ready, qb_empty,
                           kv_ready, kv_empty, m * 2 + 1, i, (m * BM + HALF) // BN, last, T,
                           HI, C, G, HALF, BN, DI, QS, KS, 4, ACC_SMEM)),
        (_gluon_pp_producer, (q_desc, k_desc, ki_desc, qa_smem, qb_smem, k_smem, ki_smem,
                              qa_ready, qa_empty, qb_ready, qb_empty, kv_ready, kv_empty, m, i,
                              last, G, BM, BN, D, QS, KS)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# gluon: two consumer warpgroups (BM 128, 8 warps) sharing the K / k_idx tiles; the variants
# change only what they name
GLUON_TILES = {"block_m": 128, "block_n": 64, "q_stages": 4, "kv_stages": 2, "num_warps": 8,
               "producer_regs": 40, "acc_smem": False, "ping_pong": False, "consumer_regs": 232}
GLUON_VARIANTS = {
    "gluon": {},
    "gluon_wg1": {"block_m": 64, "num_warps": 4},  # one consumer warpgroup
    # key tiles of 128 (half the Q traffic through L2: 1 byte per 128 FLOPs), one consumer
    # warpgroup, acc kept in shared memory between key steps
    "gluon_bn128": {"block_m": 64, "num_warps": 4, "block_n": 128, "q_stages": 3,
                    "acc_smem": True},
    # two consumer partitions (one warpgroup each, 64 rows each) that drift apart: ping-pong
    "gluon_pp": {"block_m": 128, "num_warps": 4, "ping_pong": True, "q_stages": 3},
    # the Q ring's depth (session 13: is the head loop waiting on Q tiles' TMA latency?): two
    # slots (one head of lead), and six slots with a single K / k_idx slot (same shared bytes)
    "gluon_bn128_q2": {"block_m": 64, "num_warps": 4, "block_n": 128, "q_stages": 2,
                       "acc_smem": True},
    "gluon_bn128_k1q6": {"block_m": 64, "num_warps": 4, "block_n": 128, "q_stages": 6,
                         "kv_stages": 1, "acc_smem": True},
}


def _gluon_descriptors(q, k, k_idx, block_m, block_n):
    """TMA descriptors of the 2-D views ``q [T, Hq D]``, ``k [T, Hi D]``, ``k_idx [T, Di]``."""
    tokens, heads, dim = q.shape
    di = k_idx.shape[1]
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    descs = []
    for view, block in ((q.view(tokens, heads * dim), [block_m, dim]),
                        (k.view(tokens, -1), [block_n, dim]), (k_idx, [block_n, di])):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        descs.append(TensorDescriptor(view, list(view.shape), list(view.stride()), block, layout))
    return descs


def _gluon_kernel(t: dict, group: int, dim: int, index_dim: int):
    """``(kernel, rows of a Q tile, constexprs)`` of the Gluon kernel for tiles ``t``."""
    constants = {"G": group, "BM": t["block_m"], "BN": t["block_n"], "D": dim, "DI": index_dim,
                 "QS": t["q_stages"], "KS": t["kv_stages"], "ACC_SMEM": t["acc_smem"],
                 "PRODUCER_REGS": t["producer_regs"], "num_warps": t["num_warps"]}
    if t["ping_pong"]:
        constants["CONSUMER_REGS"] = t["consumer_regs"]
        return _teacher_rows_gluon_pp_kernel, t["block_m"] // 2, constants
    return _teacher_rows_gluon_kernel, t["block_m"], constants


def teacher_rows_gluon(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor,
                       k_idx: torch.Tensor, index_heads: int, **tiles) -> torch.Tensor:
    """Teacher rows by the warp-specialised Gluon kernel (sm_90, bf16 / fp16 inputs);
    arguments and result as :func:`teacher_rows_torch`; ``tiles`` override
    :data:`GLUON_TILES` (a consumer warpgroup per 64 rows: ``block_m`` must be ``16
    num_warps``, or with ``ping_pong`` ``32 num_warps``)."""
    tokens, heads, hi, dim, di = _check_inputs(q, k, lse, k_idx, index_heads)
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"q must be bf16 or fp16 for the Gluon kernel, got {q.dtype}")
    unknown = set(tiles) - set(GLUON_TILES)
    if unknown:
        raise ValueError(f"unknown tiles {sorted(unknown)}; known: {sorted(GLUON_TILES)}")
    t = dict(GLUON_TILES, **tiles)
    per_warp = 32 if t["ping_pong"] else 16
    if t["block_m"] != per_warp * t["num_warps"]:
        raise ValueError(f"block_m must be {per_warp} num_warps = {per_warp * t['num_warps']}, "
                         f"got {t['block_m']}")
    kernel, q_rows, constants = _gluon_kernel(t, heads // hi, dim, di)
    q, k, k_idx = q.contiguous(), k.contiguous(), k_idx.contiguous()
    out = torch.empty(tokens, hi, di, dtype=torch.float32, device=q.device)
    descs = _gluon_descriptors(q, k, k_idx, q_rows, t["block_n"])
    grid = (triton.cdiv(tokens, t["block_m"]), hi)
    kernel[grid](*descs, _lse2(lse, heads // hi), out, tokens, hi, dim ** -0.5 * LOG2E,
                 **constants)
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


def implementations() -> dict:
    """``{name: function(q, k, lse, k_idx, index_heads)}`` of :data:`IMPLS`."""
    impls = {"triton": teacher_rows_triton}
    impls.update({name: functools.partial(teacher_rows_gluon, **tiles)
                  for name, tiles in GLUON_VARIANTS.items()})
    return impls


def run_impl(name: str, token_counts) -> dict:
    """One implementation on the GPU: its errors against the reference at ``CHECK_TOKENS``
    and its median time per token count (``{"errors", "times", "tiles"}``); raises on failure
    (the entry so far in the exception's ``entry`` attribute)."""
    device = torch.device("cuda")
    impl = implementations()[name]
    entry = {"tiles": dict(GLUON_TILES, **GLUON_VARIANTS[name]) if name in GLUON_VARIANTS
             else {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2},
             "times": {}}
    try:
        inputs = paper_inputs(CHECK_TOKENS, device)
        out = impl(*inputs, INDEX_HEADS)
        torch.cuda.synchronize()
        entry["errors"] = errors(out, teacher_rows_torch(*inputs, INDEX_HEADS))
        print(f"{name:9s} check T {CHECK_TOKENS}: max_abs {entry['errors']['max_abs']:.3e} "
              f"rel_norm {entry['errors']['rel_norm']:.3e}", flush=True)
        for tokens in token_counts:
            if tokens != CHECK_TOKENS:
                inputs = paper_inputs(tokens, device)
            ms = time_ms(lambda: impl(*inputs, INDEX_HEADS))
            tflops = flops(tokens) / ms / 1e9
            entry["times"][str(tokens)] = {"ms": ms, "tflops": tflops}
            print(f"{name:9s} T {tokens:6d}: {ms:9.3f} ms {tflops:7.1f} TFLOP/s", flush=True)
    except Exception as error:
        error.entry = entry
        raise
    return entry


def run_gpu(path: str, token_counts, impl_names, timeout: float = 75.0) -> int:
    """Each implementation in its own process (a launch failure poisons only that process's
    CUDA context; a barrier deadlock ends at ``timeout`` seconds, and the Gluon ones after it
    are skipped: they share the kernel), Gluon last; the results, or each failure's text, in
    the JSON at ``path`` (rewritten after each implementation)."""
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "tokens": list(token_counts),
              "shape": {"Hq": HEADS, "Hi": INDEX_HEADS, "D": HEAD_DIM, "Di": INDEX_DIM,
                        "dtype": "bf16"}, "impls": {}}
    hung = None
    for name in [name for name in IMPLS if name in impl_names]:
        if hung and name in GLUON_VARIANTS:
            result["impls"][name] = {"error": f"skipped: {hung} hung"}
            print(f"{name:9s} skipped ({hung} hung)", flush=True)
            continue
        with tempfile.NamedTemporaryFile(suffix=".json") as part:
            command = [sys.executable, os.path.abspath(__file__), "--child", name, part.name,
                       "--tokens", *map(str, token_counts)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                print(done.stdout, end="", flush=True)
                with open(part.name) as f:
                    text = f.read()
                entry = json.loads(text) if text else {}
                if done.returncode and "error" not in entry:
                    entry["error"] = f"exit status {done.returncode}"
                if done.returncode:
                    entry["stderr"] = done.stderr[-4000:]
            except subprocess.TimeoutExpired as expired:
                out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else \
                    (expired.stdout or "")
                print(out, end="")
                entry = {"error": f"timed out after {timeout} s (a hang: barrier deadlock?)",
                         "stdout": out[-4000:]}
                hung = name if name in GLUON_VARIANTS else None
        if "error" in entry:
            print(f"{name:9s} FAILED: {entry['error'][:500]}", flush=True)
        result["impls"][name] = entry
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    with open(path, "w") as f:  # with the skipped ones
        json.dump(result, f, indent=1)
    return 0


def run_child(name: str, path: str, token_counts) -> int:
    """``--child``: :func:`run_impl` of ``name``; its entry (or the error so far) to ``path``."""
    try:
        entry = run_impl(name, token_counts)
        status = 0
    except Exception as error:  # recorded for the parent
        entry = dict(getattr(error, "entry", {}), error=f"{type(error).__name__}: {error}"[-4000:],
                     traceback=traceback.format_exc()[-4000:])
        status = 1
    with open(path, "w") as f:
        json.dump(entry, f)
    return status


SASS_COUNTS = {"HGMMA": r"\bHGMMA\.", "WARPGROUP.DEPBAR": r"\bWARPGROUP\.DEPBAR",
               "WARPGROUP.ARRIVE": r"\bWARPGROUP\.ARRIVE", "WARPSYNC": r"\bWARPSYNC\b",
               "SYNCS": r"\bSYNCS\.", "UTMALDG": r"\bUTMALDG\b", "USETMAXREG": r"\bUSETMAXREG\b",
               "MUFU.EX2": r"\bMUFU\.EX2\b", "BAR.SYNC": r"\bBAR\.SYNC\b"}


def sass_counts(sass: str) -> dict:
    """Instruction counts of interest in ``nvdisasm`` text (:data:`SASS_COUNTS`)."""
    return {name: len(re.findall(pattern, sass)) for name, pattern in SASS_COUNTS.items()}


def ptxas_resources(log: str) -> dict:
    """Registers and spill store / load bytes of each function in a ``ptxas -v`` log (the last
    ``Used`` line is the kernel's)."""
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"registers": int(regs[-1]) if regs else None,
            "spill_stores": int(spill[-1][0]) if spill else None,
            "spill_loads": int(spill[-1][1]) if spill else None}


def serialized(log: str) -> str:
    """The ptxas warning codes (``C7514`` ...) saying it serialised a kernel's wgmma, or ""."""
    return ",".join(sorted(set(re.findall(r"\((C\d+)\) Potential Performance Loss: "
                                          r"wgmma\.mma_async instructions are serialized", log))))


def compile_sm90(name: str) -> dict:
    """Compile kernel ``name`` (one of :data:`IMPLS`) at the paper heads for sm_90 on any
    machine; its resources (registers, spills, shared bytes, warps), SASS counts and whether
    ptxas serialised the wgmma (the codes of its "wgmma.mma_async instructions are serialized"
    warnings, C7514 / C7515: each product then waits for the previous one; "" if none)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v on every compile: registers, spills
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    group = HEADS // INDEX_HEADS
    if name == "triton":
        bm, bn = 128, 64
        signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "ki_ptr": "*bf16", "lse2_ptr": "*fp32",
                     "out_ptr": "*fp32", "T": "i32", "HQ": "i32", "C": "fp32"}
        constants = {"G": group, "BM": bm, "BN": bn, "D": HEAD_DIM, "DI": INDEX_DIM}
        options = {"num_warps": 8, "num_stages": 2}
        attrs = {(j,): [["tt.divisibility", 16]] for j in range(5)}
        source = ASTSource(_teacher_rows_triton_kernel,
                           dict(signature, **{c: "constexpr" for c in constants}), constants,
                           attrs)
    elif name in GLUON_VARIANTS:
        t = dict(GLUON_TILES, **GLUON_VARIANTS[name])
        kernel, q_rows, constants = _gluon_kernel(t, group, HEAD_DIM, INDEX_DIM)
        bm, bn = t["block_m"], t["block_n"]
        descs = {}
        for arg, block in (("q_desc", [q_rows, HEAD_DIM]), ("k_desc", [bn, HEAD_DIM]),
                           ("ki_desc", [bn, INDEX_DIM])):
            layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
            descs[arg] = f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"
        signature = dict(descs, lse2_ptr="*fp32", out_ptr="*fp32", T="i32", HI="i32", C="fp32")
        options = {"num_warps": t["num_warps"]}
        attrs = {(j,): [["tt.divisibility", 16]] for j in (3, 4)}
        source = GluonASTSource(kernel, dict(signature, **{c: "constexpr" for c in constants}),
                                constants, attrs)
    elif name in KL_GROUPS:
        return compile_kl_sm90(name)
    else:
        raise ValueError(f"name must be one of {IMPLS + tuple(KL_GROUPS)}, got {name!r}")
    return _compiled(name, source, options, bm, bn)


def _compiled(name: str, source, options: dict, bm: int, bn: int) -> dict:
    """Compile ``source`` for sm_90: the fields of :func:`compile_sm90`."""
    from triton.backends.compiler import GPUTarget

    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sass_check import sass_text, uninitialized_uniform_reads

    sass = sass_text(kernel.asm["cubin"]) or ""
    if os.environ.get("SASS_DUMP"):  # write the SASS to this file (reading spills, loops)
        with open(os.environ["SASS_DUMP"], "w") as f:
            f.write(sass)
    maxnreg = sorted({int(r) for r in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned"
                                                 r"\.u32\s+(\d+)", kernel.asm["ptx"])})
    return dict(kernel=name, block_m=bm, block_n=bn, shared=kernel.metadata.shared,
                num_warps=kernel.metadata.num_warps, **ptxas_resources(log.getvalue()),
                setmaxnreg=maxnreg, wgmma_serialized=serialized(log.getvalue()),
                sass=sass_counts(sass),  # ptxas 12.8's never-written uniform registers
                uninit=[f"{r}@{a:#x}" for a, r, _ in uninitialized_uniform_reads(sass)])


def run_compile(argv) -> int:
    """``compile [triton|gluon ...]``: one line per kernel; exit status 1 if any fails."""
    names = argv or list(IMPLS) + list(KL_GROUPS)
    print(f"triton {triton.__version__}, sm_90, paper heads Hq {HEADS} Hi {INDEX_HEADS} "
          f"D {HEAD_DIM} Di {INDEX_DIM}, bf16")
    bad = 0
    for name in names:
        try:
            r = compile_sm90(name)
        except Exception as error:  # a compile failure is a finding, reported
            bad += 1
            print(f"{name:7s} FAILED: {type(error).__name__}: {str(error)[-2000:]}")
            continue
        sass = " ".join(f"{k} {v}" for k, v in r["sass"].items())
        print(f"{name:7s} BM {r['block_m']} BN {r['block_n']} warps {r['num_warps']} "
              f"regs {r['registers']} spill {r['spill_stores']}/{r['spill_loads']} "
              f"shared {r['shared']} setmaxnreg {r['setmaxnreg']} "
              f"wgmma serialised {r['wgmma_serialized'] or 'no'} "
              f"uninit UR {' '.join(r['uninit']) or 'none'} | {sass}", flush=True)
    return 1 if bad else 0


# --- the fused dense KL (msa_megatron/ops/triton/dense_kl_gluon.py): sm_90 compile, GPU check ---
# compile names: Hq / Hi of the kernel; "kls": the split kernel (teacher and epilogue warpgroups)
KL_GROUPS = {"kl": 16, "kl_g4": 4, "kl_g1": 1, "kls": 16, "kls_g4": 4, "kls_g1": 1}
KL_CHECKS = {  # name: (document lengths, (Hq, Hkv, Hi, Hik), dtype, dz budget bytes or None)
    "one_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, None),
    "one_fp16": ([4096], (64, 4, 4, 1), torch.float16, None),
    "packed_bf16": ([1000, 37, 3059], (64, 4, 4, 1), torch.bfloat16, None),
    "t4000_bf16": ([4000], (64, 4, 4, 1), torch.bfloat16, None),
    "hpi4_bf16": ([4096], (16, 4, 4, 1), torch.bfloat16, None),
    "chunks_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, 16 << 20),  # 8 key chunks
}
# shapes the kernel is written for but dense_kl_gluon._VERIFIED_ONLY keeps on the Triton pass
# until they pass here (``--kl-child check_wide OUT``): head dim 64, two index heads per KV group,
# two index key heads, one KV head for four index heads
KL_CHECKS_WIDE = {
    "d64_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, None, 64),
    "ipg2_bf16": ([4096], (32, 4, 8, 1), torch.bfloat16, None),
    "hik2_bf16": ([4096], (64, 4, 4, 2), torch.bfloat16, None),
    "hkv1_bf16": ([1000, 37, 3059], (16, 1, 4, 1), torch.bfloat16, None),
}
# the context-parallel (CP) layout, which dense_kl_gluon.shape_support keeps on the Triton pass
# until these pass (``--kl-child check_cp OUT``): one CP rank's query rows (megatron-core's
# load-balanced split, msa_megatron.parallel.cp_layout: chunks r and 2 CP - 1 - r of every
# document) against the keys of all tokens, per-row positions and key bases from build_cp_layout.
# The sixth field is (cp_size, cp_rank); document lengths are multiples of 2 CP, as megatron-core
# pads THD sequences for CP ([1000, 37, 3059] padded for CP 2: [1000, 40, 3060])
KL_CHECKS_CP = {
    "cp2_r0_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, None, HEAD_DIM, (2, 0)),
    "cp2_r1_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, None, HEAD_DIM, (2, 1)),
    "cp2_r1_packed_bf16": ([1000, 40, 3060], (64, 4, 4, 1), torch.bfloat16, None, HEAD_DIM,
                           (2, 1)),
    "cp4_r2_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, None, HEAD_DIM, (4, 2)),
    "cp2_r1_chunks_bf16": ([4096], (64, 4, 4, 1), torch.bfloat16, 8 << 20, HEAD_DIM, (2, 1)),
    "cp2_r1_hpi4_bf16": ([4096], (16, 4, 4, 1), torch.bfloat16, None, HEAD_DIM, (2, 1)),
}
# float64 oracle too (Hq 16: affordable at 4096 tokens)
KL_REFERENCE = ("hpi4_bf16", "cp2_r1_hpi4_bf16")
KL_TOKENS = (32768, 131072)


def compile_kl_sm90(name: str) -> dict:
    """Compile the Gluon pass A of the dense KL (``dense_kl_pass_a``, bf16, D = Di = 128,
    ``G = KL_GROUPS[name]`` heads per index head, with gradients) for sm_90; the fields of
    :func:`compile_sm90`."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from msa_megatron.ops.triton import _dense_kl_gluon_kernels as kern

    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    group, bm, bn = KL_GROUPS[name], kern.BLOCK_M, kern.BLOCK_N
    descs = {}
    for arg, block in (("q_desc", [bm, HEAD_DIM]), ("k_desc", [bn, HEAD_DIM]),
                       ("qi_desc", [bm, INDEX_DIM]), ("ki_desc", [bn, INDEX_DIM]),
                       ("dz_desc", [bm, bn])):
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)
        descs[arg] = f"tensordesc<bf16[{block[0]}, {block[1]}],{layout!r}>"
    signature = dict(descs, lse2_ptr="*fp32", lsez_ptr="*fp32", qpos_ptr="*i32", qkb_ptr="*i32",
                     nlo_ptr="*i32", nhi_ptr="*i32", dq_ptr="*fp32", klpart_ptr="*fp32",
                     Tq="i32", Tq_pad="i32", r0="i32", ch_lo="i32", ch_hi="i32", scale2="fp32",
                     iscale="fp32")
    constants = {"HI": INDEX_HEADS, "G": group, "IPG": 1, "HPK": INDEX_HEADS, "BM": bm, "BN": bn,
                 "D": HEAD_DIM, "DI": INDEX_DIM, "QS": kern.Q_STAGES, "KS": kern.KV_STAGES,
                 "KI_AT": min(2, group - 1), "GRAD": True, "DZS": 4096.0,
                 "PRODUCER_REGS": kern.PRODUCER_REGS, "num_warps": kern.WARPS}
    kernel = kern.dense_kl_pass_a
    if name.startswith("kls"):
        kernel = kern.dense_kl_pass_a_split
        del constants["KI_AT"]
        constants["EPILOGUE_REGS"] = kern.EPILOGUE_REGS
        from msa_megatron.ops.triton.dense_kl_gluon import PASS_A  # the product's rings

        constants["QS"] = int(os.environ.get("KLS_QS", PASS_A["q_stages"]))
        constants["KS"] = int(os.environ.get("KLS_KS", PASS_A["kv_stages"]))
        constants["DZ_IN_P"] = os.environ.get("KLS_DZ_IN_P", str(int(PASS_A["dz_in_p"]))) == "1"
    attrs = {(j,): [["tt.divisibility", 16]] for j in range(5, 13)}
    source = GluonASTSource(kernel,
                            dict(signature, **{c: "constexpr" for c in constants}), constants,
                            attrs)
    return _compiled(name, source, {"num_warps": kern.WARPS}, bm, bn)


def _kl_inputs(lens, heads, dtype, device, seed=0, dim=HEAD_DIM, cp=None):
    """Dense-KL inputs: random normal q, k, q_idx, k_idx of ``heads = (Hq, Hkv, Hi, Hik)`` (D =
    Di = ``dim``), packed documents of ``lens``, the main LSE of each query row against its keys
    (fp32 math, chunked; above 8192 tokens in one document that of torch's flash attention
    forward).

    ``cp = (cp_size, cp_rank)``: the view of one context-parallel rank instead (megatron-core's
    load-balanced layout, :func:`msa_megatron.parallel.cp_layout.build_cp_layout`; each length a
    multiple of ``2 cp_size``): q and q_idx are the rank's rows of the whole problem's, k and
    k_idx all tokens in global order (the gathered keys), q_pos / q_kbase the rows' positions in
    their document and the global row of its start."""
    from msa_megatron.layout import query_layout
    from msa_megatron.parallel.cp_layout import build_cp_layout

    hq, hkv, hi, hik = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    q_pos, q_kbase = query_layout(cu, tokens, device)
    q, k, q_idx, k_idx = (torch.randn(tokens, h, dim, device=device, generator=gen).to(dtype)
                          for h in (hq, hkv, hi, hik))
    kk = k.repeat_interleave(hq // hkv, dim=1)
    if cp is not None:
        layout = build_cp_layout(cu, cp[0], cp[1], 1, device)
        q, q_idx = q[layout.local_rows], q_idx[layout.local_rows]
        q_pos, q_kbase = layout.q_pos, layout.q_kbase
    elif len(lens) == 1 and tokens > 8192:  # timing sizes: the LSE of torch's flash forward
        qt, kt = q.transpose(0, 1)[None], kk.transpose(0, 1)[None]
        lse = torch.ops.aten._scaled_dot_product_flash_attention(
            qt, kt, kt, 0.0, True, False, scale=dim ** -0.5)[1]
        return q, k, lse[0].t().float().contiguous(), q_idx, k_idx, q_pos.contiguous(), \
            q_kbase.contiguous()
    rows = q.shape[0]
    lse = torch.empty(rows, hq, dtype=torch.float32, device=device)
    keys = torch.arange(tokens, device=device)
    for r0 in range(0, rows, 1024):
        r1 = min(r0 + 1024, rows)
        s = torch.einsum("rhd,uhd->rhu", q[r0:r1].float(), kk.float()) * dim ** -0.5
        lo, last = q_kbase[r0:r1].long(), (q_kbase[r0:r1] + q_pos[r0:r1]).long()
        out = (keys[None] < lo[:, None]) | (keys[None] > last[:, None])
        lse[r0:r1] = torch.logsumexp(s.masked_fill(out[:, None], -math.inf), dim=2)
    return q.contiguous(), k, lse, q_idx.contiguous(), k_idx, q_pos.contiguous(), \
        q_kbase.contiguous()


def _kl_errors(got, want) -> dict:
    """Norm-wise relative errors of ``(kl, dq_idx, dk_idx)``."""
    return {name: (a.double() - b.double()).norm().item()
            / max(b.double().norm().item(), 1e-300)
            for name, a, b in zip(("kl", "dq_idx", "dk_idx"), got, want)}


def run_kl_check(path: str, device: str = "cuda", checks=None, pass_a=None) -> dict:
    """``--kl-child check``: each :data:`KL_CHECKS` case, Gluon against the plain Triton dense
    KL (and the float64 oracle for :data:`KL_REFERENCE`), a bitwise repeat; the entry rewritten
    to ``path`` after each case (a crash keeps the rows so far). ``checks``: a dict of cases
    ``name: (lens, heads, dtype, budget[, dim[, (cp_size, cp_rank)]])`` (default
    :data:`KL_CHECKS`; :data:`KL_CHECKS_WIDE`, :data:`KL_CHECKS_CP`); ``device`` and ``pass_a``
    (default the Gluon one): for a CPU dry run (:func:`.dense_kl_gluon.pass_a_torch`). The
    comparison runs whatever ``gluon_kl_supported`` says (its answer is in the row): the check
    exists to run shapes it does not allow yet."""
    from msa_megatron import reference as ref
    from msa_megatron.ops.triton import dense_kl_gluon as dkg
    from msa_megatron.ops.triton.dense_kl import dense_kl_loss

    device = torch.device(device)
    pass_a = pass_a or dkg.pass_a_gluon
    entry = {}
    for name, (lens, heads, dtype, budget, *more) in (checks or KL_CHECKS).items():
        dim = more[0] if more else HEAD_DIM
        cp = more[1] if len(more) > 1 else None
        x = _kl_inputs(lens, heads, dtype, device, dim=dim, cp=cp)
        scales = (dim ** -0.5, dim ** -0.5, 1.0, True)
        ok, why = dkg.gluon_kl_supported(x[0], x[1], x[3], x[4])
        row = {"lens": lens, "heads": heads, "dtype": str(dtype), "budget": budget,
               "supported": ok, "why": why}
        if cp is not None:
            row.update(cp_size=cp[0], cp_rank=cp[1], query_rows=x[0].shape[0],
                       key_rows=x[1].shape[0])
        entry[name] = row
        kw = {} if budget is None else {"budget": budget}
        got = dkg.dense_kl_chunked(*x, *scales, pass_a=pass_a, **kw)
        again = dkg.dense_kl_chunked(*x, *scales, pass_a=pass_a, **kw)
        row["bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(got, again))
        row["finite"] = all(bool(torch.isfinite(a).all()) for a in got)
        want = dense_kl_loss(*x, *scales)
        row["vs_triton"] = _kl_errors(got, want)
        row["kl"] = {"gluon": got[0].item(), "triton": want[0].item()}
        if name in KL_REFERENCE:
            leaves = [t.double().requires_grad_() for t in (x[3], x[4])]
            oracle = ref.kl_core_reference(x[0].double(), x[1].double(), *leaves, None, x[5],
                                           x[6], block_size=16, softmax_scale=scales[0],
                                           index_scale=scales[1], kl_scale=1.0)
            oracle = (oracle, *torch.autograd.grad(oracle, leaves))
            row["gluon_vs_float64"] = _kl_errors(got, oracle)
            row["triton_vs_float64"] = _kl_errors(want, oracle)
            del oracle, leaves
        print(f"kl check {name:12s}: {json.dumps(row)}", flush=True)
        with open(path, "w") as f:
            json.dump(entry, f)
        del x, got, again, want
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return entry


def run_kl_time(impl: str, path: str, token_counts) -> dict:
    """``--kl-child time_<impl>``: median fwd+grad time of one dense KL implementation
    (``gluon``: :func:`dense_kl_loss_gluon`, ``triton``: :func:`dense_kl.dense_kl_loss`) at
    the paper heads, one sequence, per token count; rewritten to ``path`` after each."""
    from msa_megatron.ops.triton.dense_kl import dense_kl_loss
    from msa_megatron.ops.triton.dense_kl_gluon import dense_kl_loss_gluon

    fn = dense_kl_loss_gluon if impl == "gluon" else dense_kl_loss
    entry = {}
    for tokens in token_counts:
        x = _kl_inputs([tokens], (HEADS, INDEX_HEADS, INDEX_HEADS, 1), torch.bfloat16,
                       torch.device("cuda"))
        reps = 5 if tokens <= 32768 else 3
        ms = time_ms(lambda: fn(*x, HEAD_DIM ** -0.5, INDEX_DIM ** -0.5, 1.0, True),
                     warmup=2, reps=reps)
        entry[str(tokens)] = {"ms": ms, "reps": reps}
        print(f"kl {impl:6s} T {tokens:6d}: {ms:9.3f} ms (median of {reps})", flush=True)
        with open(path, "w") as f:
            json.dump(entry, f)
        del x
        torch.cuda.empty_cache()
    return entry


def run_kl(path: str, token_counts, timeout: float,
           children=("check", "time_triton", "time_gluon")) -> int:
    """``kl OUT.json``: the check, then the Triton and Gluon timings, each in its own process
    with a time limit (a Gluon crash or hang loses only its row); JSON at ``path``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import git_commit

    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "commit": git_commit(), "tokens": list(token_counts),
              "kl_pass_a": os.environ.get("KL_PASS_A", "default"),
              "kl_lse_z": os.environ.get("KL_LSE_Z", "default"),
              "paper": {"Hq": HEADS, "Hkv": INDEX_HEADS, "Hi": INDEX_HEADS, "Hik": 1,
                        "D": HEAD_DIM, "Di": INDEX_DIM, "dtype": "bf16"}, "rows": {}}
    for child in children:
        with tempfile.NamedTemporaryFile(suffix=".json") as part:
            command = [sys.executable, os.path.abspath(__file__), "--kl-child", child, part.name,
                       "--tokens", *map(str, token_counts)]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
                print(done.stdout, end="", flush=True)
                status = done.returncode
                tail = done.stderr[-4000:]
            except subprocess.TimeoutExpired as expired:
                out = expired.stdout.decode() if isinstance(expired.stdout, bytes) else \
                    (expired.stdout or "")
                print(out, end="", flush=True)
                status, tail = "timeout", f"timed out after {timeout} s"
            with open(part.name) as f:
                text = f.read()
            entry = {"result": json.loads(text) if text else {}}
            if status:
                entry["error"] = f"exit status {status}"
                entry["stderr"] = tail
                print(f"{child}: FAILED ({status}): {tail[-1500:]}", flush=True)
        result["rows"][child] = entry
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def apply_pass_a_env() -> None:
    """``KL_PASS_A=KERNEL[:Q_STAGES:KV_STAGES[:p]]`` (``fused`` / ``split``; ``p``: dz staged
    in the p slot) sets ``dense_kl_gluon.PASS_A`` for this process (the kl children inherit
    it)."""
    from msa_megatron.ops.triton import dense_kl_gluon as dkg

    if os.environ.get("KL_LSE_Z"):  # "finite" / "general": dense_kl_gluon.LSE_Z_KERNEL
        dkg.LSE_Z_KERNEL = os.environ["KL_LSE_Z"]
    spec = os.environ.get("KL_PASS_A")
    if not spec:
        return

    name, *stages = spec.split(":")
    dkg.PASS_A["kernel"] = name
    if stages:
        dkg.PASS_A["q_stages"], dkg.PASS_A["kv_stages"] = map(int, stages[:2])
    dkg.PASS_A["dz_in_p"] = "p" in stages[2:]


def run_kl_child(child: str, path: str, token_counts) -> int:
    """``--kl-child NAME PATH``: one row of :func:`run_kl` (an exception is re-raised after
    what was written so far stays in ``path``)."""
    apply_pass_a_env()
    if child == "check":
        run_kl_check(path)
    elif child == "check_wide":
        run_kl_check(path, checks=KL_CHECKS_WIDE)
    elif child == "check_cp":
        run_kl_check(path, checks=KL_CHECKS_CP)
    else:
        run_kl_time(child.split("_", 1)[1], path, token_counts)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:
        return run_compile(argv[1:])
    if argv[:1] in (["kl"], ["--kl-child"]):
        parser = argparse.ArgumentParser(description="dense KL: Gluon vs Triton (GPU)")
        if argv[0] == "--kl-child":
            parser.add_argument("child", choices=("check", "check_wide", "check_cp",
                                                  "time_triton", "time_gluon"))
        parser.add_argument("out", help="JSON file to write")
        parser.add_argument("--tokens", type=int, nargs="+", default=list(KL_TOKENS))
        parser.add_argument("--timeout", type=float, default=180.0,
                            help="seconds per child (the check; each implementation's timing)")
        if argv[0] == "kl":
            parser.add_argument("--children", nargs="+",
                                default=["check", "time_triton", "time_gluon"],
                                choices=("check", "check_wide", "check_cp", "time_triton",
                                         "time_gluon"))
        args = parser.parse_args(argv[1:])
        if not torch.cuda.is_available():
            print("no CUDA device: the kl run needs the GPU")
            return 2
        if argv[0] == "--kl-child":
            return run_kl_child(args.child, args.out, args.tokens)
        return run_kl(args.out, args.tokens, args.timeout, args.children)
    child = argv[:1] == ["--child"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if child:
        argv = argv[1:]
        parser.add_argument("name", choices=IMPLS)
    parser.add_argument("out", help="JSON file to write")
    parser.add_argument("--tokens", type=int, nargs="+", default=[CHECK_TOKENS, 32768])
    parser.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--timeout", type=float, default=75.0,
                        help="seconds per implementation (check, compiles and timing)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the timing run needs the GPU (the compile subcommand does not)")
        return 2
    if child:
        return run_child(args.name, args.out, args.tokens)
    return run_gpu(args.out, args.tokens, args.impl, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
