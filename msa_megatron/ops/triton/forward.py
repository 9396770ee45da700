"""Main-branch forward (MSA_SPEC section 3, dense causal in warmup mode, section 5).

Query-outer: one program owns ``TOK`` query tokens x the ``Hq/Hi`` query heads of one index
head (rows = token x head; all heads lie in one KV group, so each K/V tile is loaded once for
all of them). Sparse mode: ``TOK = 1`` and the program walks the token's selected blocks.
Dense mode: the program walks key tiles from its lowest to its highest reachable key row, with
the support mask deciding per element (any packing, any ``q_kbase``).
The output is normalised in fp32 and ``lse`` (natural log, fp32) is kept for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    DENSE_KEY_TILE, GATHER_ROWS, MIN_DOT_ROWS, dot_flags, mma, next_pow2, support_mask,
)


@triton.jit
def query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, HPI: tl.constexpr, HR: tl.constexpr,
               TOK: tl.constexpr):
    """Rows of a query-outer program: ``(t, h, valid, pos, kbase)``, each ``[TOK*HR]``."""
    r = tl.arange(0, TOK * HR)
    t = tile * TOK + r // HR
    hl = r % HR
    valid = (t < Tq) & (hl < HPI)
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
    return t, i * HPI + hl, valid, pos, kbase


@triton.jit
def _fwd_step(q, m, l, acc, k_ptr, v_ptr, krow, kmask, inside, g, s_kt, s_kh, scale,
              D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """One key tile of the online softmax; ``inside [R, N]`` (or ``[1, N]``) is the support."""
    d = tl.arange(0, D)
    off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
    kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
    vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
    s = tl.where(inside, mma(q, tl.trans(kt), UPCAST, IEEE) * scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    p = tl.exp(s - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + mma(p.to(vt.dtype), vt, UPCAST, IEEE)
    return m_new, l, acc


@triton.jit
def _attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, bidx_ptr, qpos_ptr, qkb_ptr, o_ptr, lse_ptr,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_bt, s_bh, s_lt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr, SPARSE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    R: tl.constexpr = TOK * HR
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # late (long) rows first
    i = tl.program_id(1)
    g = i // IPG
    t, h, valid, pos, kbase = query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, HPI, HR, TOK)
    d = tl.arange(0, D)
    q_off = t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, D], tl.float32)
    c = tl.arange(0, BN)
    if SPARSE:
        pos0 = tl.load(qpos_ptr + tile)
        kb0 = tl.load(qkb_ptr + tile)
        for s in range(TOPK):
            blk = tl.load(bidx_ptr + tile.to(tl.int64) * s_bt + i * s_bh + s)
            u = blk * BN + c
            kmask = (u >= 0) & (u <= pos0)  # one token: the support is per column
            m, l, acc = _fwd_step(q, m, l, acc, k_ptr, v_ptr, kb0 + u, kmask, kmask[None, :],
                                  g, s_kt, s_kh, scale, D, UPCAST, IEEE)
    else:
        k_lo = tl.min(tl.where(valid, kbase, Tk))
        k_hi = tl.max(tl.where(valid, kbase + pos, -1))
        for k0 in range(k_lo, k_hi + 1, BN):
            krow = k0 + c
            kmask = krow <= k_hi
            inside = support_mask(krow, kmask, kbase, pos, valid)
            m, l, acc = _fwd_step(q, m, l, acc, k_ptr, v_ptr, krow, kmask, inside,
                                  g, s_kt, s_kh, scale, D, UPCAST, IEEE)
    l_safe = tl.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + q_off, out.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(lse_ptr + t.to(tl.int64) * s_lt + h, m + tl.log(l_safe), mask=valid)


def query_tiling(hpi: int, one_token: bool) -> tuple:
    """``(TOK, HR)``: tokens per row tile and rows per token (a power of two >= ``hpi``).

    ``one_token``: the sparse query-outer kernels (one token per program, padded to the
    matrix-unit minimum); otherwise tiles of about ``GATHER_ROWS`` token x head rows.
    """
    if one_token:
        return 1, max(MIN_DOT_ROWS, next_pow2(hpi))
    hr = next_pow2(hpi)
    return max(1, GATHER_ROWS // hr), hr


def warps_for(rows: int, cols: int) -> int:
    """num_warps of a kernel whose largest fp32 tile is ``[rows, cols]``."""
    return 4 if rows * cols <= 64 * 64 else 8


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx, q_pos: torch.Tensor,
    q_kbase: torch.Tensor, block_size: int, softmax_scale: float, index_heads: int,
) -> tuple:
    """Sparse (``block_idx [Tq, Hi, k]``) or dense causal (``block_idx=None``) attention.

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (fp16/bf16/fp32, contiguous rows).
        block_idx: ``[Tq, Hi, k]`` int32 selection or None (dense warmup mode).
        q_pos, q_kbase: ``[Tq]`` int32 query layout.
        block_size: B; softmax_scale: resolved float; index_heads: Hi (groups rows in dense mode).

    Returns:
        ``(out [Tq, Hq, D] q.dtype, lse [Tq, Hq] float32)``.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    hi = block_idx.shape[1] if block_idx is not None else index_heads
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty((Tq, Hq), dtype=torch.float32, device=q.device)
    if Tq == 0:
        return out, lse
    sparse = block_idx is not None
    hpi = Hq // hi
    tok, hr = query_tiling(hpi, sparse)
    bn = block_size if sparse else DENSE_KEY_TILE
    bidx = block_idx.contiguous() if sparse else q_pos  # placeholder pointer in dense mode
    upcast, ieee = dot_flags(q.dtype)
    grid = (triton.cdiv(Tq, tok), hi)
    _attn_fwd_kernel[grid](
        q, k, v, bidx, q_pos, q_kbase, out, lse, Tq, Tk, float(softmax_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        bidx.stride(0) if sparse else 0, bidx.stride(1) if sparse else 0, lse.stride(0),
        HPI=hpi, HR=hr, TOK=tok, IPG=hi // Hkv, D=D, BN=bn,
        TOPK=block_idx.shape[2] if sparse else 1, SPARSE=sparse, UPCAST=upcast, IEEE=ieee,
        num_warps=warps_for(tok * hr, max(bn, D)),
    )
    return out, lse
