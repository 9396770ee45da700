"""Main-branch backward: dQ query-outer, dK/dV key-block-outer, no atomics (deterministic).

- dQ: the forward's query-outer walk; it also writes ``delta = rowsum(dO * O)`` (fp32).
- dK/dV, sparse: one work item per (KV group, selected key block) from the reverse index
  (:mod:`.reverse_index`); the item gathers the (token, head) rows that selected the block into
  tiles of token x head rows, and owns its key rows, so dK/dV are written once, in a fixed order.
  A persistent grid walks the items.
- dK/dV, dense: one program per (key tile, KV group) over the query tiles that can see it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    DENSE_KEY_TILE, dot_flags, mma, persistent_programs, support_mask,
)
from .forward import query_rows, query_tiling, warps_for
from .reverse_index import build_reverse_index, query_tile_ranges


@triton.jit
def _dq_step(q, do, lse, delta, dq, k_ptr, v_ptr, krow, kmask, inside, g, s_kt, s_kh, scale,
             D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    d = tl.arange(0, D)
    off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
    kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
    vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
    s = mma(q, tl.trans(kt), UPCAST, IEEE) * scale
    p = tl.where(inside, tl.exp(s - lse[:, None]), 0.0)
    dp = mma(do, tl.trans(vt), UPCAST, IEEE)
    ds = p * (dp - delta[:, None])
    return dq + mma(ds.to(kt.dtype), kt, UPCAST, IEEE)


@triton.jit
def _attn_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, bidx_ptr, qpos_ptr, qkb_ptr, dq_ptr,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_bt, s_bh, s_lt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, TOPK: tl.constexpr, SPARSE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    i = tl.program_id(1)
    g = i // IPG
    t, h, valid, pos, kbase = query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, HPI, HR, TOK)
    d = tl.arange(0, D)
    q_off = t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + q_off, mask=valid[:, None], other=0.0)
    o = tl.load(o_ptr + q_off, mask=valid[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    l_off = t.to(tl.int64) * s_lt + h
    tl.store(delta_ptr + l_off, delta, mask=valid)
    lse = tl.load(lse_ptr + l_off, mask=valid, other=float("inf"))
    dq = tl.zeros([TOK * HR, D], tl.float32)
    c = tl.arange(0, BN)
    if SPARSE:
        pos0 = tl.load(qpos_ptr + tile)
        kb0 = tl.load(qkb_ptr + tile)
        for s in range(TOPK):
            blk = tl.load(bidx_ptr + tile.to(tl.int64) * s_bt + i * s_bh + s)
            u = blk * BN + c
            kmask = (u >= 0) & (u <= pos0)
            dq = _dq_step(q, do, lse, delta, dq, k_ptr, v_ptr, kb0 + u, kmask, kmask[None, :],
                          g, s_kt, s_kh, scale, D, UPCAST, IEEE)
    else:
        k_lo = tl.min(tl.where(valid, kbase, Tk))
        k_hi = tl.max(tl.where(valid, kbase + pos, -1))
        for k0 in range(k_lo, k_hi + 1, BN):
            krow = k0 + c
            kmask = krow <= k_hi
            inside = support_mask(krow, kmask, kbase, pos, valid)
            dq = _dq_step(q, do, lse, delta, dq, k_ptr, v_ptr, krow, kmask, inside,
                          g, s_kt, s_kh, scale, D, UPCAST, IEEE)
    tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _kv_rows_step(dk, dv, kt, vt, krow, kmask, t, h, valid, q_ptr, do_ptr, lse_ptr, delta_ptr,
                  qpos_ptr, qkb_ptr, s_qt, s_qh, s_lt, scale,
                  D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Add the gradient of one tile of gathered query rows to a key block's dK, dV."""
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
    d = tl.arange(0, D)
    off = t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + off, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + off, mask=valid[:, None], other=0.0)
    l_off = t.to(tl.int64) * s_lt + h
    lse = tl.load(lse_ptr + l_off, mask=valid, other=float("inf"))
    delta = tl.load(delta_ptr + l_off, mask=valid, other=0.0)
    inside = support_mask(krow, kmask, kbase, pos, valid)
    s = mma(q, tl.trans(kt), UPCAST, IEEE) * scale
    p = tl.where(inside, tl.exp(s - lse[:, None]), 0.0)
    dv += mma(tl.trans(p.to(do.dtype)), do, UPCAST, IEEE)
    dp = mma(do, tl.trans(vt), UPCAST, IEEE)
    ds = p * (dp - delta[:, None])
    dk += mma(tl.trans(ds.to(q.dtype)), q, UPCAST, IEEE)
    return dk, dv, tl.max(tl.where(valid, kbase + pos, -1))


@triton.jit
def _attn_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, dk_ptr, dv_ptr,
    key_ptr, pair_t_ptr, pair_i_ptr, item_lo_ptr, n_items_ptr, qt_lo_ptr, qt_hi_ptr,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_lt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, SPARSE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    r = tl.arange(0, TOK * HR)
    hl = r % HR
    c = tl.arange(0, BN)
    d = tl.arange(0, D)
    if SPARSE:
        n_items = tl.load(n_items_ptr)
        for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
            lo = tl.load(item_lo_ptr + w)
            hi = tl.load(item_lo_ptr + w + 1)
            gk = tl.load(key_ptr + lo)
            g = gk // Tk
            krow = gk % Tk + c
            kmask = krow < Tk
            off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
            kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
            vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
            dk = tl.zeros([BN, D], tl.float32)
            dv = tl.zeros([BN, D], tl.float32)
            reach = -1
            for p0 in range(lo, hi, TOK):
                pr = p0 + r // HR
                on = pr < hi
                t = tl.load(pair_t_ptr + pr, mask=on, other=0)
                i = tl.load(pair_i_ptr + pr, mask=on, other=0)
                dk, dv, rr = _kv_rows_step(dk, dv, kt, vt, krow, kmask, t, i * HPI + hl,
                                           on & (hl < HPI), q_ptr, do_ptr, lse_ptr, delta_ptr,
                                           qpos_ptr, qkb_ptr, s_qt, s_qh, s_lt, scale,
                                           D, UPCAST, IEEE)
                reach = tl.maximum(reach, rr)
            out = kmask & (krow <= reach)  # rows past the sequence belong to other items
            tl.store(dk_ptr + off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=out[:, None])
            tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=out[:, None])
    else:
        n = tl.program_id(0)
        g = tl.program_id(1)
        krow = n * BN + c
        kmask = krow < Tk
        off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
        kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
        vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        a_lo = tl.load(qt_lo_ptr + n)
        a_hi = tl.load(qt_hi_ptr + n)
        for ii in range(IPG):
            for a in range(a_lo, a_hi):
                t = a * TOK + r // HR
                dk, dv, rr = _kv_rows_step(dk, dv, kt, vt, krow, kmask, t,
                                           (g * IPG + ii) * HPI + hl, (t < Tq) & (hl < HPI),
                                           q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr,
                                           s_qt, s_qh, s_lt, scale, D, UPCAST, IEEE)
        tl.store(dk_ptr + off, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kmask[:, None])
        tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=kmask[:, None])


def attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, block_idx, q_pos: torch.Tensor, q_kbase: torch.Tensor, block_size: int,
    softmax_scale: float, index_heads: int,
) -> tuple:
    """Gradients ``(dq, dk, dv)`` of :func:`.forward.attention_forward` (deterministic).

    Args: as :func:`.forward.attention_forward`, plus ``dout [Tq, Hq, D]``, the forward's
    ``out`` and ``lse [Tq, Hq]`` fp32.

    Returns:
        ``dq [Tq, Hq, D]``, ``dk, dv [Tk, Hkv, D]`` in the input dtype.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    sparse = block_idx is not None
    hi = block_idx.shape[1] if sparse else index_heads
    hpi, ipg = Hq // hi, hi // Hkv
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k) if sparse else torch.empty_like(k)
    dv = torch.zeros_like(v) if sparse else torch.empty_like(v)
    if Tq == 0:
        return dq, dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    upcast, ieee = dot_flags(q.dtype)
    bn = block_size if sparse else DENSE_KEY_TILE
    bidx = block_idx.contiguous() if sparse else q_pos
    tok, hr = query_tiling(hpi, sparse)
    _attn_bwd_dq_kernel[(triton.cdiv(Tq, tok), hi)](
        q, k, v, out, dout, lse, delta, bidx, q_pos, q_kbase, dq, Tq, Tk, float(softmax_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        bidx.stride(0) if sparse else 0, bidx.stride(1) if sparse else 0, lse.stride(0),
        HPI=hpi, HR=hr, TOK=tok, IPG=ipg, D=D, BN=bn,
        TOPK=block_idx.shape[2] if sparse else 1, SPARSE=sparse, UPCAST=upcast, IEEE=ieee,
        num_warps=warps_for(tok * hr, max(bn, D)),
    )
    tok, hr = query_tiling(hpi, False)
    if sparse:
        # Units of a whole group: keys are (g * Tk + start_row), one item per (group, block).
        rev = build_reverse_index(block_idx, q_pos, q_kbase, Tk, block_size, Hkv, ipg)
        grid = (persistent_programs(q.device, rev.max_items),)
        tables = (rev.key, rev.pair_t, rev.pair_i, rev.unit_lo, rev.n_units, q_pos, q_pos)
    else:
        qt_lo, qt_hi = query_tile_ranges(q_pos, q_kbase, Tk, tok, bn)
        grid = (triton.cdiv(Tk, bn), Hkv)
        tables = (q_pos, q_pos, q_pos, q_pos, q_pos, qt_lo, qt_hi)
    _attn_bwd_dkdv_kernel[grid](
        q, k, v, dout, lse, delta, q_pos, q_kbase, dk, dv, *tables, Tq, Tk, float(softmax_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
        HPI=hpi, HR=hr, TOK=tok, IPG=ipg, D=D, BN=bn, SPARSE=sparse,
        UPCAST=upcast, IEEE=ieee, num_warps=warps_for(max(tok * hr, bn), D),
    )
    return dq, dk, dv
