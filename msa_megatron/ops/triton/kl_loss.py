"""Index-branch KL (MSA_SPEC section 4): value and both input gradients in one call.

The KL is a scalar loss, so ``d kl / d q_idx`` and ``d kl / d k_idx`` are computed with the
value (the backward only scales them by the incoming gradient). Nothing of the size of the
support is stored: teacher and student probabilities are recomputed tile by tile.
Per (token, index head) ``i`` with support ``u``: teacher ``T = mean_h exp(s_h - lse_h)`` over
the index head's query heads (the forward's ``lse``), student ``log Qs = z - lse_z``,
``KL = sum T (log T - log Qs)``, ``dz = Qs - T``, ``dq_idx = sum dz k_idx``,
``dk_idx = sum dz q_idx`` (times ``index_scale * kl_scale``).

Sparse mode, key-block-outer over the layer's reverse index (:mod:`.reverse_index`): pass A,
over all tokens at once, gives each (token, index head, slot) the log-sum-exp of ``z`` over its
block, merged per token; pass B, per chunk of query tokens and per (unit of index heads,
selected start row, key sub-tile), recomputes ``T`` and ``Qs`` for the rows that selected the
block, adds ``dz^T q_idx`` to an fp32 index-key gradient of its rows (one partial per unit,
summed in a fixed order) and writes per-pair partials of the KL value and of ``dq_idx``.
Pass B visits only the (KV group, start row) numbers with pairs in the chunk
(:func:`.reverse_index.chunk_groups`), taken from a per-chunk counter, row tiles of
``PASS_B_ROWS`` pairs against ``PASS_B_KEYS`` key rows. Dense mode: a query-outer rows kernel
(``lse_z``, KL, ``dq_idx``) and a key-tile-outer kernel (``dk_idx``).

A row tile holds one row per (token, index head) pair: the teacher is summed over the index
head's query heads, one product per head (:func:`_kl_tile`), so the student and both gradient
products run at one row per pair (until v7 rows were token x query head, and those three
products did ``Hq / Hi`` times the useful work).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (
    ALL_ROWS, DENSE_KEY_TILE, DENSE_ROWS, FULL_ROWS, GATHER_ROWS, KEY_SUBTILE, KL_ROWS,
    SPARSE_ROWS, dot_flags, mma, partial_budget, persistent_programs, row_filter, stage_options,
    student_row_stats, support_mask, tile_rows,
)
from ._isolation import launch_both, log_sum_exp, nonfinite, nonfinite_flag, skip, support_mma
from .backward import sum_partials_kernel
from .forward import pair_rows, query_rows, warps_for
from .reverse_index import (
    SUB_CHUNKS, bucket_pairs, bucket_rows, build_reverse_index, chunk_count, chunk_groups,
    chunk_tokens_bound, item_pairs, query_tile_ranges,
)

# dz = Qs - T lies in [-1, 1]; it is scaled by this power of two (exact) before being rounded to
# fp16/bf16 for the matrix products, so small differences keep their precision in fp16.
_DZ_SCALE = tl.constexpr(4096.0)
_LOG2E = tl.constexpr(1.4426950408889634)
# Sparse pass B (_kl_keys_kernel, SPARSE): pairs per row tile, key rows per item (a selected
# block is split in sub-tiles of this many rows) and warps. 64 pairs x 64 keys at 4 warps is one
# warpgroup MMA and two programs fit one sm_90 multiprocessor, so one program's exponentials
# and waits run under the other's products; 64 pairs x 128 keys at 8 warps is one program per
# multiprocessor that gathers each pair's query rows once per block instead of twice (half the
# query bytes through L2, half the per-pair partials). benchmarks/NOTES.md, "KL v10". The
# persistent grid is 8 // PASS_B_WARPS programs per multiprocessor, taking items from a counter.
PASS_B_ROWS = 64
PASS_B_KEYS = 64
PASS_B_WARPS = 4
# Sparse pass A (_kl_lsez_blocks_kernel): pairs per row tile and warps. Its items (128 pairs)
# are chains of dependent small loads before one product: 64-pair tiles at 4 warps let two
# programs share a multiprocessor (one 8-warp program per SM at 128 pairs), so one item's loads
# wait under the other's work.
PASS_A_ROWS = 64
PASS_A_WARPS = 4
# Pass B launched once per sub-chunk of tokens (True) or once per chunk of partials (False).
PASS_B_PER_SUB = True


@triton.jit
def _kl_tile(kt, kit, krow, kmask, t, i, valid, q_ptr, lse_ptr, qi_ptr, lsez_ptr, qpos_ptr,
             qkb_ptr, s_qt, s_qh, s_lt, s_it, s_ih, s_zt, scale, iscale,
             HPI: tl.constexpr, D: tl.constexpr, DI: tl.constexpr, UPCAST: tl.constexpr,
             IEEE: tl.constexpr, AHEAD: tl.constexpr = True):
    """Rows (token ``t``, index head ``i``), one per pair, against one key tile:
    ``(dz * _DZ_SCALE, kl, q_idx rows, on, reach)``; ``on [R, N]`` is the support.

    The teacher is summed over the index head's ``HPI`` query heads, one ``[R, N]`` product
    each (the only products at query-head size); the student and both gradient products run
    at one row per pair. ``kl`` is per row, summed over the tile; a NaN teacher is kept (it
    makes the KL NaN, as in the oracle), ``0 log 0 = 0``.

    Loads are issued by hand ahead of their use (v10): the index rows, ``lse_z`` and the first
    head's query rows and LSE at the start, and each next head's query rows and LSE before the
    current head's product, into registers (the pipeliner would issue them after the product
    and wait at once). ``AHEAD=False`` leaves the head loop's loads to the pipeliner (shared
    memory instead of registers: the query-outer rows kernel, which holds a ``[R, DI]``
    gradient accumulator and the index rows across its key loop, spills less). The support is
    applied once to the head sum (never per head), in base 2 (``scale * log2 e`` in the one
    multiply).
    """
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)
    di = tl.arange(0, DI)
    q_rows = q_ptr + (t64 * s_qt + (i * HPI).to(tl.int64) * s_qh)  # the pair's first head
    lse_rows = lse_ptr + (t64 * s_lt + i * HPI)
    qi = tl.load(qi_ptr + t64[:, None] * s_it + i[:, None] * s_ih + di[None, :],
                 mask=valid[:, None], other=0.0)
    lse_z = tl.load(lsez_ptr + t64 * s_zt + i, mask=valid, other=0.0)
    scale2 = scale * _LOG2E
    teacher = tl.zeros([t.shape[0], kt.shape[0]], tl.float32)
    if AHEAD:
        q = tl.load(q_rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        lse2 = tl.load(lse_rows, mask=valid, other=float("inf")) * _LOG2E
        for hl in range(HPI):
            more = valid & (hl + 1 < HPI)
            q_next = tl.load(q_rows[:, None] + (hl + 1) * s_qh + d[None, :],
                             mask=more[:, None], other=0.0)
            lse2_next = tl.load(lse_rows + (hl + 1), mask=more, other=float("inf")) * _LOG2E
            teacher += tl.exp2(mma(q, tl.trans(kt), UPCAST, IEEE) * scale2 - lse2[:, None])
            q, lse2 = q_next, lse2_next
    else:
        for hl in range(HPI):
            q = tl.load(q_rows[:, None] + hl * s_qh + d[None, :], mask=valid[:, None], other=0.0)
            lse2 = tl.load(lse_rows + hl, mask=valid, other=float("inf")) * _LOG2E
            teacher += tl.exp2(mma(q, tl.trans(kt), UPCAST, IEEE) * scale2 - lse2[:, None])
    # Outside the support the head sum is finite or +inf (never NaN for finite inputs): dropped
    # here once; a NaN there (non-finite q/k/lse) is dropped too, as the per-head mask did.
    on = support_mask(krow, kmask, kbase, pos, valid)
    teacher = tl.where(on, teacher * (1.0 / HPI), 0.0)
    log_qs = mma(qi, tl.trans(kit), UPCAST, IEEE) * iscale - lse_z[:, None]
    has_t = teacher != 0  # (0 outside the support)
    log_t = tl.log(tl.where(has_t, teacher, 1.0))
    kl = tl.sum(tl.where(has_t, teacher * (log_t - log_qs), 0.0), axis=1)
    dz = tl.where(on, tl.exp(log_qs) - teacher, 0.0) * _DZ_SCALE
    return dz, kl, qi, on, tl.max(tl.where(valid, kbase + pos, -1))


@triton.jit(do_not_specialize=("Tq", "Tk"))
def _kl_rows_dense_kernel(
    q_ptr, k_ptr, lse_ptr, qi_ptr, ki_ptr, qpos_ptr, qkb_ptr, full_ptr, kl_ptr, lsez_ptr, dqi_ptr,
    Tq, Tk, scale, iscale, grad_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_it, s_ih, s_jt, s_jh, s_zt,
    HPI: tl.constexpr, ROWS: tl.constexpr, IPG: tl.constexpr, HPK: tl.constexpr,
    D: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr, HI: tl.constexpr,
    FULL: tl.constexpr, GRAD: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ISO: tl.constexpr, bad_ptr,
):
    """Query-outer over the causal row (dense mode; rows marked full in sparse mode), ``ROWS``
    tokens of one index head per program: ``lse_z``, per-token KL and ``dq_idx``."""
    if skip(bad_ptr, ISO):
        return
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    i = tl.program_id(1)
    g = i // IPG
    j = i // HPK
    t, _h, valid, pos, kbase = query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, full_ptr, 1, 1, ROWS,
                                         HI, FULL)
    ii = i + 0 * t
    t64 = t.to(tl.int64)
    di = tl.arange(0, DI)
    d = tl.arange(0, D)
    c = tl.arange(0, BN)
    qi = tl.load(qi_ptr + t64[:, None] * s_it + i * s_ih + di[None, :], mask=valid[:, None],
                 other=0.0)
    k_lo = tl.min(tl.where(valid, kbase, Tk))
    k_hi = tl.max(tl.where(valid, kbase + pos, -1))
    # Pass 1: the student's log-normaliser over the causal row.
    mz, lz = student_row_stats(qi, ki_ptr, j, s_jt, s_jh, kbase, pos, valid, k_lo, k_hi, iscale,
                               BN, DI, UPCAST, IEEE)
    lse_z = tl.where(valid, log_sum_exp(mz, lz), 0.0)
    tl.store(lsez_ptr + t64 * s_zt + i, lse_z, mask=valid)
    # Pass 2: teacher, KL and the index-query gradient.
    kl = tl.zeros([ROWS], tl.float32)
    dqi = tl.zeros([ROWS, DI], tl.float32)
    for k0 in range(k_lo, k_hi + 1, BN):
        krow = k0 + c
        kmask = krow <= k_hi
        k64 = krow.to(tl.int64)[:, None]
        kt = tl.load(k_ptr + k64 * s_kt + g * s_kh + d[None, :], mask=kmask[:, None], other=0.0)
        kit = tl.load(ki_ptr + k64 * s_jt + j * s_jh + di[None, :], mask=kmask[:, None], other=0.0)
        dz, kl_tile, _qi, on, _reach = _kl_tile(kt, kit, krow, kmask, t, ii, valid, q_ptr, lse_ptr,
                                         qi_ptr, lsez_ptr, qpos_ptr, qkb_ptr, s_qt, s_qh, s_lt,
                                         s_it, s_ih, s_zt, scale, iscale, HPI, D, DI, UPCAST,
                                         IEEE, False)
        kl += kl_tile
        if GRAD:
            dqi += support_mma(dz.to(kit.dtype), kit, nonfinite(kit), on, UPCAST, IEEE, ISO)
    tl.store(kl_ptr + t64 * s_zt + i, kl, mask=valid)
    if GRAD:
        dqi = dqi * (iscale * grad_scale / _DZ_SCALE)
        tl.store(dqi_ptr + t64[:, None] * s_it + i * s_ih + di[None, :],
                 dqi.to(dqi_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=("Tk", "NBMAX"))
def _kl_lsez_blocks_kernel(
    qi_ptr, ki_ptr, qpos_ptr, qkb_ptr, plz_ptr, pair_ptr, item_cell_ptr, cell_start_ptr,
    off_ptr, sub_item_ptr, starts_ptr, meta_ptr, Tk, NBMAX, iscale, s_it, s_ih, s_jt, s_jh,
    HI: tl.constexpr, TOPK: tl.constexpr, IPG: tl.constexpr, HPK: tl.constexpr,
    DI: tl.constexpr, BN: tl.constexpr, ROWS: tl.constexpr, SUB: tl.constexpr,
    ITEM: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    """Sparse pass A: log-sum-exp of ``z`` over each selected block, one value per pair (all
    tokens at once: ``plz [Tq * Hi * k]``), persistent over the per-pair items."""
    c = tl.arange(0, BN)
    di = tl.arange(0, DI)
    for w in range(tl.program_id(0), tl.load(sub_item_ptr + SUB), tl.num_programs(0)):
        lo, hi, bucket = item_pairs(item_cell_ptr, cell_start_ptr, off_ptr, meta_ptr, w, NBMAX,
                                    SUB, ITEM)
        g, head, s0 = bucket_rows(starts_ptr, meta_ptr, bucket, IPG)
        j = head // HPK
        krow = s0 + c
        kmask = krow < Tk
        kit = tl.load(ki_ptr + krow.to(tl.int64)[:, None] * s_jt + j * s_jh + di[None, :],
                      mask=kmask[:, None], other=0.0)
        for p0 in range(lo, hi, ROWS):
            flat, t, i, _, valid = pair_rows(pair_ptr, p0, hi, 0, HI, TOPK, 1, 1, ROWS)
            pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
            kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
            qi = tl.load(qi_ptr + t.to(tl.int64)[:, None] * s_it + i[:, None] * s_ih + di[None, :],
                         mask=valid[:, None], other=0.0)
            z = mma(qi, tl.trans(kit), UPCAST, IEEE) * iscale
            z = tl.where(support_mask(krow, kmask, kbase, pos, valid), z, float("-inf"))
            m = tl.max(z, axis=1)
            m = tl.where(m == float("-inf"), 0.0, m)
            l = tl.sum(tl.exp(z - m[:, None]), axis=1)
            tl.store(plz_ptr + flat, log_sum_exp(m, l), mask=valid)


@triton.jit(do_not_specialize=("ci", "s_g", "fc", "sc0", "sc1", "Tq", "Tk"))
def _kl_keys_kernel(
    q_ptr, k_ptr, lse_ptr, qi_ptr, ki_ptr, lsez_ptr, qpos_ptr, qkb_ptr, part_ptr, pkl_ptr,
    pdqi_ptr, pair_ptr, off_ptr, starts_ptr, meta_ptr, sub_t0_ptr, grp_ptr, n_grp_ptr, taken_ptr,
    full_ptr, qt_lo_ptr, qt_hi_ptr, ci, s_g, fc, sc0, sc1, Tq, Tk, scale, iscale, grad_scale,
    s_qt, s_qh, s_kt, s_kh, s_lt, s_it, s_ih, s_jt, s_jh, s_zt, s_pu,
    HI: tl.constexpr, TOPK: tl.constexpr, HPI: tl.constexpr, ROWS: tl.constexpr,
    IPG: tl.constexpr, HPK: tl.constexpr, UNIT: tl.constexpr,
    D: tl.constexpr, DI: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr, SUB: tl.constexpr,
    SPARSE: tl.constexpr, FULL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ISO: tl.constexpr, bad_ptr,
):
    """Index-key gradient of key rows, one fp32 partial per unit (``part [units, Tk, DI]``);
    row tiles hold ``ROWS`` (token, index head) pairs, one row each (:func:`_kl_tile`).

    Sparse (pass B): persistent over (unit x start row, key sub-tile) items, taken from the
    counter ``taken_ptr[ci]`` (0 at launch), for the pairs of
    sub-chunks ``sc0 .. sc1 - 1``, visiting only the ``n_grp_ptr[ci]`` (KV group x start row)
    numbers listed in row ``ci`` of ``grp_ptr`` (row stride ``s_g``; those with pairs in these
    sub-chunks, :func:`.reverse_index.chunk_groups`; whole tensors and ``do_not_specialize``
    on the chunk's ints: one compile for every chunk); adds to ``part`` (chunks run one after
    the other) and writes per-pair partials of the KL (``pkl``) and of ``dq_idx`` (``pdqi``, rows
    ``flat * NSUB + sub``, relative to the chunk's first pair, that of sub-chunk ``fc``: a chunk
    of partials may be walked by one launch per sub-chunk). Dense: one program per key tile and
    unit, over the query tiles that can see the tile (rows filtered by ``FULL``); writes
    ``part``.
    """
    if skip(bad_ptr, ISO):
        return
    UPG: tl.constexpr = IPG // UNIT
    NSUB: tl.constexpr = BN // KS
    out_scale = iscale * grad_scale / _DZ_SCALE
    r = tl.arange(0, ROWS)
    c = tl.arange(0, KS)
    d = tl.arange(0, D)
    di = tl.arange(0, DI)
    if SPARSE:
        grp_ptr += ci.to(tl.int64) * s_g
        n_grp_ptr += ci
        f0 = tl.load(sub_t0_ptr + fc) * (HI * TOPK)  # the chunk's first pair
        n_w = tl.load(n_grp_ptr) * (UPG * NSUB)
        # Items from the chunk's counter (0 at launch): a program that drew short items takes
        # more. Each item owns its index-key rows and its pairs' partial rows, so which program
        # takes it changes no result (bitwise deterministic).
        w = tl.atomic_add(taken_ptr + ci, 1)
        while w < n_w:
            gb = tl.load(grp_ptr + w // (UPG * NSUB))
            ug = w // NSUB % UPG
            sub = w % NSUB
            g, _head, s0 = bucket_rows(starts_ptr, meta_ptr, gb * IPG, IPG)
            unit = g * UPG + ug
            j = unit * UNIT // HPK
            krow = s0 + sub * KS + c
            kmask = krow < Tk
            k64 = krow.to(tl.int64)[:, None]
            kt = tl.load(k_ptr + k64 * s_kt + g * s_kh + d[None, :], mask=kmask[:, None], other=0.0)
            kit = tl.load(ki_ptr + k64 * s_jt + j * s_jh + di[None, :], mask=kmask[:, None],
                          other=0.0)
            kit_bad = nonfinite(kit)
            dki = tl.zeros([KS, DI], tl.float32)
            reach = -1
            for m in range(UNIT):
                lo, hi = bucket_pairs(off_ptr, meta_ptr, gb * IPG + ug * UNIT + m, sc0, sc1, SUB)
                for p0 in range(lo, hi, ROWS):
                    flat, t, i, _hl, valid = pair_rows(pair_ptr, p0, hi, f0, HI, TOPK, 1, 1,
                                                       ROWS)
                    dz, kl, qi, on, rr = _kl_tile(kt, kit, krow, kmask, t, i, valid, q_ptr,
                                                  lse_ptr, qi_ptr, lsez_ptr, qpos_ptr, qkb_ptr,
                                                  s_qt, s_qh, s_lt, s_it, s_ih, s_zt, scale,
                                                  iscale, HPI, D, DI, UPCAST, IEEE)
                    reach = tl.maximum(reach, rr)
                    dki += support_mma(tl.trans(dz.to(qi.dtype)), qi, nonfinite(qi),
                                       tl.trans(on), UPCAST, IEEE, ISO)
                    dqi = support_mma(dz.to(kit.dtype), kit, kit_bad, on, UPCAST,
                                      IEEE, ISO) * out_scale
                    prow = flat.to(tl.int64) * NSUB + sub
                    tl.store(pkl_ptr + prow, kl, mask=valid)
                    tl.store(pdqi_ptr + prow[:, None] * DI + di[None, :], dqi, mask=valid[:, None])
            out = (kmask & (krow <= reach))[:, None]
            p_off = unit.to(tl.int64) * s_pu + k64 * DI + di[None, :]
            tl.store(part_ptr + p_off, tl.load(part_ptr + p_off, mask=out, other=0.0)
                     + dki * out_scale, mask=out)
            w = tl.atomic_add(taken_ptr + ci, 1)
    else:
        n = tl.program_id(0)
        unit = tl.program_id(1)
        g = unit // UPG
        j = unit * UNIT // HPK
        krow = n * KS + c
        kmask = krow < Tk
        k64 = krow.to(tl.int64)[:, None]
        a_lo = tl.load(qt_lo_ptr + n)
        a_hi = tl.load(qt_hi_ptr + n)
        seen = kmask & (c < tl.where(a_lo < a_hi, KS, 0))  # no traffic if no row sees the tile
        kt = tl.load(k_ptr + k64 * s_kt + g * s_kh + d[None, :], mask=seen[:, None], other=0.0)
        kit = tl.load(ki_ptr + k64 * s_jt + j * s_jh + di[None, :], mask=seen[:, None],
                      other=0.0)
        dki = tl.zeros([KS, DI], tl.float32)
        for ii in range(UNIT):
            i = unit * UNIT + ii + 0 * r
            for a in range(a_lo, a_hi):
                t = a * ROWS + r
                rows = row_filter(t < Tq, t, i, full_ptr, HI, FULL)
                dz, _kl, qi, on, _reach = _kl_tile(kt, kit, krow, kmask, t, i, rows, q_ptr, lse_ptr,
                                            qi_ptr, lsez_ptr, qpos_ptr, qkb_ptr, s_qt, s_qh, s_lt,
                                            s_it, s_ih, s_zt, scale, iscale, HPI, D, DI, UPCAST,
                                            IEEE)
                dki += support_mma(tl.trans(dz.to(qi.dtype)), qi, nonfinite(qi), tl.trans(on),
                                   UPCAST, IEEE, ISO)
        tl.store(part_ptr + unit.to(tl.int64) * s_pu + k64 * DI + di[None, :], dki * out_scale,
                 mask=kmask[:, None])


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
    dev = q.device
    q, k, lse, q_idx, k_idx = (x.contiguous() for x in (q, k, lse, q_idx, k_idx))
    hpi, ipg, hpk = Hq // Hi, Hi // Hkv, Hi // Hik
    unit = math.gcd(ipg, hpk)  # index heads sharing one KV group and one index key head
    n_units = Hi // unit
    if Tq == 0:
        empty = (torch.zeros_like(q_idx, dtype=torch.float32),
                 torch.zeros_like(k_idx, dtype=torch.float32)) if compute_grad else (
            q_idx.new_empty((0,)), k_idx.new_empty((0,)))
        return torch.zeros((), dtype=torch.float32, device=dev), *empty
    upcast, ieee = dot_flags(q.dtype)
    opts = stage_options(q.dtype)
    # Row tiles of (token, index head) pairs, one row each (the teacher loops over the query
    # heads): PASS_A_ROWS / PASS_B_ROWS in the sparse passes, KL_ROWS in the dense key kernel,
    # DENSE_ROWS query-outer.
    kl_rows = tile_rows(KL_ROWS, q.dtype)
    scales = (float(softmax_scale), float(index_scale), float(kl_scale))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
               q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1))
    # Gradients stay fp32: ~1/(N*Hi) in size, they would underflow in fp16.
    dq_idx = torch.empty_like(q_idx, dtype=torch.float32) if compute_grad else q_idx.new_empty((0,))
    rev = None
    lse_z = torch.empty((Tq, Hi), dtype=torch.float32, device=dev)
    if block_idx is not None:
        block_idx = block_idx.contiguous()
        top_k = block_idx.shape[2]
        rev = build_reverse_index(block_idx, q_pos, q_kbase, Tk, block_size, Hkv)
        # Sparse pass A: the student's log-normaliser of the rows in the index.
        a_rows = tile_rows(PASS_A_ROWS, q.dtype)
        lse_z_part = torch.full((Tq, Hi, top_k), float("-inf"), dtype=torch.float32, device=dev)
        _kl_lsez_blocks_kernel[(persistent_programs(dev, rev.max_items),)](
            q_idx, k_idx, q_pos, q_kbase, lse_z_part, rev.pair, rev.item_cell, rev.cell_start,
            rev.off, rev.sub_item, rev.starts, rev.meta, Tk, rev.max_buckets, scales[1],
            *strides[5:], HI=Hi, TOPK=top_k, IPG=ipg, HPK=hpk, DI=Di, BN=block_size,
            ROWS=a_rows, SUB=SUB_CHUNKS, ITEM=rev.item_pairs, UPCAST=upcast, IEEE=ieee,
            num_warps=PASS_A_WARPS if q.dtype.itemsize <= 2 else warps_for(a_rows), **opts,
        )
        torch.logsumexp(lse_z_part, dim=2, out=lse_z)
        del lse_z_part
    # Dense kernels: every row in dense mode, the rows whose selection is their whole causal
    # prefix in sparse mode (dk_idx written for every key row; the sparse items add to it).
    full = q_pos if rev is None else rev.full
    which = ALL_ROWS if rev is None else FULL_ROWS
    kl_tok = torch.zeros((Tq, Hi), dtype=torch.float32, device=dev)
    rows_tok = tile_rows(DENSE_ROWS, q.dtype)
    bad = nonfinite_flag(q_idx, k_idx)  # the operands support_mma isolates here
    launch_both(
        _kl_rows_dense_kernel, (triton.cdiv(Tq, rows_tok), Hi), q, k, lse, q_idx, k_idx, q_pos,
        q_kbase, full, kl_tok, lse_z,
        dq_idx if compute_grad else q_idx, Tq, Tk, *scales, *strides, lse_z.stride(0),
        HPI=hpi, ROWS=rows_tok, IPG=ipg, HPK=hpk, D=D, DI=Di, BN=DENSE_KEY_TILE,
        HI=Hi, FULL=which, GRAD=compute_grad, UPCAST=upcast, IEEE=ieee, bad_ptr=bad,
        num_warps=warps_for(rows_tok), **opts,
    )
    sums = [kl_tok.sum()]
    part = None
    if compute_grad:
        part = torch.empty((n_units, Tk, Di), dtype=torch.float32, device=dev)
        ks = KEY_SUBTILE
        present = None if rev is None else rev.full.any(1)
        qt_lo, qt_hi = query_tile_ranges(q_pos, q_kbase, Tk, kl_rows, ks, present)
        launch_both(
            _kl_keys_kernel, (triton.cdiv(Tk, ks), n_units), q, k, lse, q_idx, k_idx, lse_z,
            q_pos, q_kbase, part, part, part, q_pos, q_pos, q_pos,
            q_pos, q_pos, q_pos, q_pos, q_pos, full, qt_lo, qt_hi, 0, 0, 0, 0, 0, Tq, Tk, *scales,
            *strides, lse_z.stride(0), part.stride(0), HI=Hi, TOPK=1, HPI=hpi, ROWS=kl_rows,
            IPG=ipg, HPK=hpk, UNIT=unit, D=D, DI=Di, BN=ks, KS=ks, SUB=SUB_CHUNKS, SPARSE=False,
            FULL=which, UPCAST=upcast, IEEE=ieee, bad_ptr=bad,
            num_warps=warps_for(max(kl_rows, ks)), **opts,
        )
    if rev is not None:
        if part is None:  # the value only: pass B still adds its (unused) index-key gradient
            part = torch.zeros((n_units, Tk, Di), dtype=torch.float32, device=dev)
        ks = min(block_size, PASS_B_KEYS)
        nsub = block_size // ks
        per_query = Hi * top_k * nsub * (Di + 1) * 4
        chunks = chunk_count(Tq * per_query, partial_budget(q.numel() * q.element_size()))
        rows = chunk_tokens_bound(rev, chunks)
        pkl = torch.zeros(rows * Hi * top_k * nsub, dtype=torch.float32, device=dev)
        pdqi = torch.empty((rows * Hi * top_k * nsub, Di), dtype=torch.float32, device=dev)
        step = SUB_CHUNKS // chunks
        # One launch per sub-chunk (PASS_B_PER_SUB): the query rows a launch gathers are those
        # of one sub-chunk's tokens (32K: 34 MB at the paper heads, inside the 50 MB L2) instead
        # of a whole chunk's; partials stay per chunk.
        per_sub = PASS_B_PER_SUB and step > 1
        lists = SUB_CHUNKS if per_sub else chunks
        groups, n_groups = chunk_groups(rev, lists)
        taken = torch.zeros(lists, dtype=torch.int32, device=dev)  # item counters per launch
        b_rows = tile_rows(PASS_B_ROWS, q.dtype)
        b_warps = PASS_B_WARPS if q.dtype.itemsize <= 2 else warps_for(b_rows)
        for ci, sc0 in enumerate(range(0, SUB_CHUNKS, step)):
            if sc0:
                pkl.zero_()
            for a in range(sc0, sc0 + step, 1 if per_sub else step):
                b = a + 1 if per_sub else a + step
                launch_both(
                    _kl_keys_kernel,
                    (persistent_programs(dev, n_units * Tk * nsub, max(1, 8 // b_warps)),), q, k,
                    lse, q_idx, k_idx, lse_z, q_pos, q_kbase, part, pkl, pdqi, rev.pair,
                    rev.off, rev.starts, rev.meta, rev.sub_t0, groups, n_groups, taken, rev.full,
                    q_pos, q_pos, a if per_sub else ci, groups.stride(0), sc0, a, b,
                    Tq, Tk, *scales, *strides, lse_z.stride(0), part.stride(0),
                    HI=Hi, TOPK=top_k, HPI=hpi, ROWS=b_rows, IPG=ipg, HPK=hpk, UNIT=unit,
                    D=D, DI=Di, BN=block_size, KS=ks, SUB=SUB_CHUNKS, SPARSE=True,
                    FULL=SPARSE_ROWS, UPCAST=upcast, IEEE=ieee, bad_ptr=bad, num_warps=b_warps,
                    **opts,
                )
            sums.append(pkl.sum())
            if compute_grad:
                sum_partials_kernel[(triton.cdiv(rows, GATHER_ROWS), Hi)](
                    pdqi, block_idx, q_pos, rev.full, dq_idx, rev.sub_t0, sc0, sc0 + step,
                    block_idx.stride(0), block_idx.stride(1), q_idx.stride(0), q_idx.stride(1),
                    HI=Hi, TOPK=top_k, NSUB=nsub, HPI=1, HR=1, TOK=GATHER_ROWS, D=Di,
                    BN=block_size, FULL=SPARSE_ROWS, num_warps=warps_for(GATHER_ROWS),
                )
    value = torch.stack(sums).sum() * kl_scale
    if not compute_grad:
        return value, dq_idx, k_idx.new_empty((0,))
    dk_idx = part.view(Hik, hpk // unit, Tk, Di).sum(1).transpose(0, 1).contiguous()
    return value, dq_idx, dk_idx
