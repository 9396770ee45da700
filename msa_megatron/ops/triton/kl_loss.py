"""Index-branch KL (MSA_SPEC section 4): value and both input gradients in one call.

The KL is a scalar loss, so ``d kl / d q_idx`` and ``d kl / d k_idx`` are computed with the
value (the backward only scales them by the incoming gradient). Nothing of the size of the
support is stored: teacher and student probabilities are recomputed tile by tile.

- Rows kernel (query-outer, like the forward): pass 1 computes the student's log-normaliser
  ``lse_z`` over the support; pass 2 recomputes the teacher ``T`` (mean over the index head's
  query heads of ``exp(s - lse)``, from the forward's ``lse``) and accumulates
  ``KL = sum T (log T - z + lse_z)`` and ``dq_idx = sum (Qs - T) k_idx``.
- Keys kernel (key-block-outer, like dK/dV): ``dk_idx = sum (Qs - T) q_idx`` per key block,
  from the reverse index (sparse) or over query tiles (dense); one partial per unit of index
  heads (heads sharing a KV group and an index key head), summed in a fixed order after.

Rows hold token x query head; the index query of a token is repeated on its head rows so the
index scores use the matrix unit; per-token values are read from the token's first head row.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import DENSE_KEY_TILE, dot_flags, mma, persistent_programs, support_mask, token_mean
from .forward import query_rows, query_tiling, warps_for
from .reverse_index import build_reverse_index, query_tile_ranges


@triton.jit
def _teacher_student(q, qi, lse, lse_z, inside, kt, kit, scale, iscale, TOK: tl.constexpr,
                     HR: tl.constexpr, HPI: tl.constexpr, UPCAST: tl.constexpr,
                     IEEE: tl.constexpr):
    """Teacher ``T`` and student log-probability ``z - lse_z`` on one key tile, ``[R, N]``."""
    p = tl.where(inside, tl.exp(mma(q, tl.trans(kt), UPCAST, IEEE) * scale - lse[:, None]), 0.0)
    teacher = token_mean(p, TOK, HR, HPI)
    log_qs = mma(qi, tl.trans(kit), UPCAST, IEEE) * iscale - lse_z[:, None]
    return teacher, log_qs


@triton.jit
def _kl_rows_kernel(
    q_ptr, k_ptr, lse_ptr, qi_ptr, ki_ptr, bidx_ptr, qpos_ptr, qkb_ptr, kl_ptr, lsez_ptr, dqi_ptr,
    Tq, Tk, scale, iscale, grad_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_it, s_ih, s_jt, s_jh, s_bt, s_bh, s_zt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    HPK: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr,
    TOPK: tl.constexpr, SPARSE: tl.constexpr, GRAD: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    R: tl.constexpr = TOK * HR
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    i = tl.program_id(1)
    g = i // IPG
    j = i // HPK
    t, h, valid, pos, kbase = query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, HPI, HR, TOK)
    first = valid & (h == i * HPI)
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)
    di = tl.arange(0, DI)
    c = tl.arange(0, BN)
    q = tl.load(q_ptr + t64[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    qi = tl.load(qi_ptr + t64[:, None] * s_it + i * s_ih + di[None, :],
                 mask=(t < Tq)[:, None], other=0.0)
    lse = tl.load(lse_ptr + t64 * s_lt + h, mask=valid, other=float("inf"))
    if SPARSE:
        pos0 = tl.load(qpos_ptr + tile)
        kb0 = tl.load(qkb_ptr + tile)
        n_steps = TOPK
    else:
        k_lo = tl.min(tl.where(valid, kbase, Tk))
        k_hi = tl.max(tl.where(valid, kbase + pos, -1))
        n_steps = tl.cdiv(k_hi + 1 - k_lo, BN)
    # Pass 1: the student's normaliser over the support.
    mz = tl.full([R], float("-inf"), tl.float32)
    lz = tl.zeros([R], tl.float32)
    for step in range(n_steps):
        if SPARSE:
            u = tl.load(bidx_ptr + tile.to(tl.int64) * s_bt + i * s_bh + step) * BN + c
            krow = kb0 + u
            kmask = (u >= 0) & (u <= pos0)
            inside = kmask[None, :]
        else:
            krow = k_lo + step * BN + c
            kmask = krow <= k_hi
            inside = support_mask(krow, kmask, kbase, pos, valid)
        kit = tl.load(ki_ptr + krow.to(tl.int64)[:, None] * s_jt + j * s_jh + di[None, :],
                      mask=kmask[:, None], other=0.0)
        z = tl.where(inside, mma(qi, tl.trans(kit), UPCAST, IEEE) * iscale, float("-inf"))
        m_new = tl.maximum(mz, tl.max(z, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        lz = lz * tl.exp(mz - m_use) + tl.sum(tl.exp(z - m_use[:, None]), axis=1)
        mz = m_new
    lse_z = tl.where(valid, mz + tl.log(tl.where(lz > 0, lz, 1.0)), 0.0)
    # Pass 2: teacher, KL terms and the index-query gradient.
    kl = tl.zeros([R], tl.float32)
    dqi = tl.zeros([R, DI], tl.float32)
    for step in range(n_steps):
        if SPARSE:
            u = tl.load(bidx_ptr + tile.to(tl.int64) * s_bt + i * s_bh + step) * BN + c
            krow = kb0 + u
            kmask = (u >= 0) & (u <= pos0)
            inside = kmask[None, :]
        else:
            krow = k_lo + step * BN + c
            kmask = krow <= k_hi
            inside = support_mask(krow, kmask, kbase, pos, valid)
        k64 = krow.to(tl.int64)[:, None]
        kt = tl.load(k_ptr + k64 * s_kt + g * s_kh + d[None, :], mask=kmask[:, None], other=0.0)
        kit = tl.load(ki_ptr + k64 * s_jt + j * s_jh + di[None, :], mask=kmask[:, None], other=0.0)
        teacher, log_qs = _teacher_student(q, qi, lse, lse_z, inside, kt, kit, scale, iscale,
                                           TOK, HR, HPI, UPCAST, IEEE)
        pos_t = inside & (teacher > 0)
        log_t = tl.log(tl.where(pos_t, teacher, 1.0))
        kl += tl.sum(tl.where(pos_t, teacher * (log_t - log_qs), 0.0), axis=1)
        if GRAD:
            dz = tl.where(inside, tl.exp(log_qs) - teacher, 0.0)
            dqi += mma(dz.to(kit.dtype), kit, UPCAST, IEEE)
    z_off = t64 * s_zt + i
    tl.store(kl_ptr + z_off, kl, mask=first)
    tl.store(lsez_ptr + z_off, lse_z, mask=first)
    if GRAD:
        dqi = dqi * (iscale * grad_scale)
        tl.store(dqi_ptr + t64[:, None] * s_it + i * s_ih + di[None, :],
                 dqi.to(dqi_ptr.dtype.element_ty), mask=first[:, None])


@triton.jit
def _kl_keys_step(dki, kt, kit, krow, kmask, t, i, hl, valid, q_ptr, lse_ptr, qi_ptr, lsez_ptr,
                  qpos_ptr, qkb_ptr, s_qt, s_qh, s_lt, s_it, s_ih, s_zt, scale, iscale,
                  HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr,
                  DI: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """Add one tile of gathered (token, head) rows to a key block's index-key gradient."""
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
    t64 = t.to(tl.int64)
    h = i * HPI + hl
    d = tl.arange(0, D)
    di = tl.arange(0, DI)
    q = tl.load(q_ptr + t64[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    lse = tl.load(lse_ptr + t64 * s_lt + h, mask=valid, other=float("inf"))
    first = valid & (hl == 0)
    qi = tl.load(qi_ptr + t64[:, None] * s_it + i[:, None] * s_ih + di[None, :],
                 mask=first[:, None], other=0.0)
    lse_z = tl.load(lsez_ptr + t64 * s_zt + i, mask=first, other=0.0)
    inside = support_mask(krow, kmask, kbase, pos, valid)
    teacher, log_qs = _teacher_student(q, qi, lse, lse_z, inside, kt, kit, scale, iscale,
                                       TOK, HR, HPI, UPCAST, IEEE)
    dz = tl.where(inside & first[:, None], tl.exp(log_qs) - teacher, 0.0)
    dki += mma(tl.trans(dz.to(qi.dtype)), qi, UPCAST, IEEE)
    return dki, tl.max(tl.where(valid, kbase + pos, -1))


@triton.jit
def _kl_keys_kernel(
    q_ptr, k_ptr, lse_ptr, qi_ptr, ki_ptr, lsez_ptr, qpos_ptr, qkb_ptr, part_ptr,
    key_ptr, pair_t_ptr, pair_i_ptr, item_lo_ptr, n_items_ptr, qt_lo_ptr, qt_hi_ptr,
    Tq, Tk, scale, iscale, grad_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_it, s_ih, s_jt, s_jh, s_zt, s_pu,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    HPK: tl.constexpr, UNIT: tl.constexpr, D: tl.constexpr, DI: tl.constexpr,
    BN: tl.constexpr, SPARSE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    UPG: tl.constexpr = IPG // UNIT
    r = tl.arange(0, TOK * HR)
    hl = r % HR
    c = tl.arange(0, BN)
    d = tl.arange(0, D)
    di = tl.arange(0, DI)
    if SPARSE:
        n_items = tl.load(n_items_ptr)
        for w in range(tl.program_id(0), n_items, tl.num_programs(0)):
            lo = tl.load(item_lo_ptr + w)
            hi = tl.load(item_lo_ptr + w + 1)
            key = tl.load(key_ptr + lo)
            g = key // UPG // Tk
            unit = g * UPG + key % UPG
            j = unit * UNIT // HPK
            krow = key // UPG % Tk + c
            kmask = krow < Tk
            k64 = krow.to(tl.int64)[:, None]
            kt = tl.load(k_ptr + k64 * s_kt + g * s_kh + d[None, :], mask=kmask[:, None], other=0.0)
            kit = tl.load(ki_ptr + k64 * s_jt + j * s_jh + di[None, :], mask=kmask[:, None],
                          other=0.0)
            dki = tl.zeros([BN, DI], tl.float32)
            reach = -1
            for p0 in range(lo, hi, TOK):
                pr = p0 + r // HR
                on = pr < hi
                t = tl.load(pair_t_ptr + pr, mask=on, other=0)
                i = tl.load(pair_i_ptr + pr, mask=on, other=0)
                dki, rr = _kl_keys_step(dki, kt, kit, krow, kmask, t, i, hl, on & (hl < HPI),
                                        q_ptr, lse_ptr, qi_ptr, lsez_ptr, qpos_ptr, qkb_ptr,
                                        s_qt, s_qh, s_lt, s_it, s_ih, s_zt, scale, iscale,
                                        HPI, HR, TOK, D, DI, UPCAST, IEEE)
                reach = tl.maximum(reach, rr)
            out = kmask & (krow <= reach)
            tl.store(part_ptr + unit.to(tl.int64) * s_pu + k64 * DI + di[None, :],
                     dki * (iscale * grad_scale), mask=out[:, None])
    else:
        n = tl.program_id(0)
        unit = tl.program_id(1)
        g = unit // UPG
        j = unit * UNIT // HPK
        krow = n * BN + c
        kmask = krow < Tk
        k64 = krow.to(tl.int64)[:, None]
        kt = tl.load(k_ptr + k64 * s_kt + g * s_kh + d[None, :], mask=kmask[:, None], other=0.0)
        kit = tl.load(ki_ptr + k64 * s_jt + j * s_jh + di[None, :], mask=kmask[:, None], other=0.0)
        dki = tl.zeros([BN, DI], tl.float32)
        a_lo = tl.load(qt_lo_ptr + n)
        a_hi = tl.load(qt_hi_ptr + n)
        for ii in range(UNIT):
            i = unit * UNIT + ii + 0 * r
            for a in range(a_lo, a_hi):
                t = a * TOK + r // HR
                dki, rr = _kl_keys_step(dki, kt, kit, krow, kmask, t, i, hl, (t < Tq) & (hl < HPI),
                                        q_ptr, lse_ptr, qi_ptr, lsez_ptr, qpos_ptr, qkb_ptr,
                                        s_qt, s_qh, s_lt, s_it, s_ih, s_zt, scale, iscale,
                                        HPI, HR, TOK, D, DI, UPCAST, IEEE)
        tl.store(part_ptr + unit.to(tl.int64) * s_pu + k64 * DI + di[None, :],
                 dki * (iscale * grad_scale), mask=kmask[:, None])


def kl_loss(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
    block_idx, q_pos: torch.Tensor, q_kbase: torch.Tensor, block_size: int, softmax_scale: float,
    index_scale: float, kl_scale: float, compute_grad: bool,
) -> tuple:
    """``kl_scale * sum_{p,i} KL[i,p]`` and its gradients to q_idx and k_idx (MSA_SPEC 4-5).

    Args:
        q: ``[Tq, Hq, D]``, k: ``[Tk, Hkv, D]`` main queries/keys (read only; no gradient).
        lse: ``[Tq, Hq]`` fp32 from the forward.
        q_idx: ``[Tq, Hi, Di]``, k_idx: ``[Tk, Hik, Di]``.
        block_idx: ``[Tq, Hi, k]`` int32, or None for the whole causal row (dense mode).
        q_pos, q_kbase: ``[Tq]`` int32 layout; scales resolved floats.
        compute_grad: also return the gradients (else empty ``[0]`` tensors).

    Returns:
        ``(kl 0-dim fp32, dq_idx [Tq, Hi, Di] or [0], dk_idx [Tk, Hik, Di] or [0])``.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    _, Hi, Di = q_idx.shape
    Hik = k_idx.shape[1]
    q, k, lse, q_idx, k_idx = (x.contiguous() for x in (q, k, lse, q_idx, k_idx))
    sparse = block_idx is not None
    hpi, ipg, hpk = Hq // Hi, Hi // Hkv, Hi // Hik
    kl_tok = torch.zeros((Tq, Hi), dtype=torch.float32, device=q.device)
    lse_z = torch.empty_like(kl_tok)
    dq_idx = torch.empty_like(q_idx) if compute_grad else q_idx.new_empty((0,))
    if Tq == 0:
        dk_idx = torch.zeros_like(k_idx) if compute_grad else k_idx.new_empty((0,))
        return kl_tok.sum(), dq_idx, dk_idx
    upcast, ieee = dot_flags(q.dtype)
    bn = block_size if sparse else DENSE_KEY_TILE
    bidx = block_idx.contiguous() if sparse else q_pos
    tok, hr = query_tiling(hpi, sparse)
    _kl_rows_kernel[(triton.cdiv(Tq, tok), Hi)](
        q, k, lse, q_idx, k_idx, bidx, q_pos, q_kbase, kl_tok, lse_z,
        dq_idx if compute_grad else q_idx, Tq, Tk, float(softmax_scale), float(index_scale), float(kl_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
        q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1),
        bidx.stride(0) if sparse else 0, bidx.stride(1) if sparse else 0, kl_tok.stride(0),
        HPI=hpi, HR=hr, TOK=tok, IPG=ipg, HPK=hpk, D=D, DI=Di, BN=bn,
        TOPK=block_idx.shape[2] if sparse else 1, SPARSE=sparse, GRAD=compute_grad,
        UPCAST=upcast, IEEE=ieee, num_warps=warps_for(tok * hr, max(bn, D, Di)),
    )
    value = kl_tok.sum() * kl_scale
    if not compute_grad:
        return value, dq_idx, k_idx.new_empty((0,))
    # Units: index heads sharing one KV group and one index key head.
    unit = math.gcd(ipg, hpk)
    n_units = Hi // unit
    tok, hr = query_tiling(hpi, False)
    if sparse:
        rev = build_reverse_index(block_idx, q_pos, q_kbase, Tk, block_size, Hkv, unit)
        grid = (persistent_programs(q.device, rev.max_items),)
        tables = (rev.key, rev.pair_t, rev.pair_i, rev.unit_lo, rev.n_units, q_pos, q_pos)
        part = torch.zeros((n_units, Tk, Di), dtype=torch.float32, device=q.device)
    else:
        qt_lo, qt_hi = query_tile_ranges(q_pos, q_kbase, Tk, tok, bn)
        grid = (triton.cdiv(Tk, bn), n_units)
        tables = (q_pos, q_pos, q_pos, q_pos, q_pos, qt_lo, qt_hi)
        part = torch.empty((n_units, Tk, Di), dtype=torch.float32, device=q.device)
    _kl_keys_kernel[grid](
        q, k, lse, q_idx, k_idx, lse_z, q_pos, q_kbase, part, *tables,
        Tq, Tk, float(softmax_scale), float(index_scale), float(kl_scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
        q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1), lse_z.stride(0),
        part.stride(0),
        HPI=hpi, HR=hr, TOK=tok, IPG=ipg, HPK=hpk, UNIT=unit, D=D, DI=Di, BN=bn,
        SPARSE=sparse, UPCAST=upcast, IEEE=ieee, num_warps=warps_for(max(tok * hr, bn), max(D, Di)),
    )
    dk_idx = part.view(Hik, hpk // unit, Tk, Di).sum(1).transpose(0, 1).to(k_idx.dtype)
    return value, dq_idx, dk_idx
