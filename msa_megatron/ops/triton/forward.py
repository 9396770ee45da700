"""Main-branch forward (MSA_SPEC section 3, dense causal in warmup mode, section 5).

Sparse mode is key-block-outer over the layer's reverse index (:mod:`.reverse_index`, built
once per selection on the GPU): one work item (one index head, one selected start row, up to
``ITEM_PAIRS`` pairs, items listed in token order) loads the block's K/V once and streams the
(token, query head) rows that selected it through the matrix unit in tiles of ``FWD_ROWS``
rows, the next tile's query rows loading while the current one is multiplied. Each row gets a
partial output normalised over that block and its log-sum-exp; :func:`_attn_merge_kernel`
merges a row's ``k`` partials by their LSE in slot order (no atomics on floats,
deterministic). Partials are kept for one chunk of query tokens at a time, at most
``PARTIAL_QS`` times the bytes of q, capped at ``PARTIAL_MAX_BYTES`` (up to 16 chunks;
:func:`._common.partial_budget`).

Dense mode is query-outer: one program owns tokens x the query heads of one index head and
walks the key tiles from its lowest to its highest reachable key row, with the support mask
deciding per element (any packing, any ``q_kbase``).
The output is normalised in fp32; ``lse`` (natural log, fp32) is kept for the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    ALL_ROWS, DENSE_KEY_TILE, DENSE_ROWS, FULL_ROWS, SPARSE_ROWS, dot_flags, mma,
    next_pow2, partial_budget, persistent_programs, row_filter, stage_options, support_mask,
    tile_rows,
)
from ._isolation import launch_both, log_sum_exp, nonfinite, nonfinite_flag, skip, support_mma
from .reverse_index import (
    SUB_CHUNKS, bucket_rows, build_reverse_index, chunk_count, chunk_tokens_bound, item_pairs,
)

# Sparse item kernel (_attn_fwd_blocks_kernel): rows (token x head) per tile and warps. 64 rows
# at 4 warps is one warpgroup MMA of 64 rows, and two programs fit one sm_90 multiprocessor
# (registers and shared memory: benchmarks/NOTES.md, "v9 -> v10"), so one program's products
# run while the other waits on memory; 128 rows at 8 warps is one program per multiprocessor
# (two warpgroups share the K/V tiles). The persistent grid is 8 // FWD_WARPS programs per SM.
FWD_ROWS = 64
FWD_WARPS = 4
# Merge kernel (_attn_merge_kernel): rows (token x head) per program and warps.
MERGE_ROWS = 64
MERGE_WARPS = 4
LOG2E = 1.4426950408889634


@triton.jit
def query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, full_ptr, HPI: tl.constexpr, HR: tl.constexpr,
               TOK: tl.constexpr, HI: tl.constexpr, FULL: tl.constexpr):
    """Rows of a query-outer program: ``(t, h, valid, pos, kbase)``, each ``[TOK*HR]``
    (``valid`` filtered by :func:`._common.row_filter`)."""
    r = tl.arange(0, TOK * HR)
    t = tile * TOK + r // HR
    hl = r % HR
    valid = row_filter((t < Tq) & (hl < HPI), t, i, full_ptr, HI, FULL)
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
    return t, i * HPI + hl, valid, pos, kbase


@triton.jit
def sub_chunk_rows(sub_t0_ptr, sc0, sc1, qpos_ptr, full_ptr, i, HPI: tl.constexpr,
                   HR: tl.constexpr, TOK: tl.constexpr, HI: tl.constexpr, FULL: tl.constexpr):
    """Rows of a program of the per-row slot sums (merge, dQ / dq_idx sum) over sub-chunks
    ``sc0 .. sc1 - 1``: ``(tc, hl, t64, valid, pos)``, each ``[TOK*HR]``: the token relative
    to the first sub-chunk, the head slot, the token (int64), the rows that hold a real token
    and head (filtered by :func:`._common.row_filter`) and their positions."""
    t0 = tl.load(sub_t0_ptr + sc0)
    r = tl.arange(0, TOK * HR)
    tc = tl.program_id(0) * TOK + r // HR
    hl = r % HR
    t = t0 + tc
    valid = row_filter((tc < tl.load(sub_t0_ptr + sc1) - t0) & (hl < HPI), t, i, full_ptr, HI,
                       FULL)
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    return tc, hl, t.to(tl.int64), valid, pos


@triton.jit
def pair_rows(pair_ptr, p0, hi, f0, HI: tl.constexpr, TOPK: tl.constexpr, HPI: tl.constexpr,
              HR: tl.constexpr, TOK: tl.constexpr):
    """Rows of a key-block-outer tile: ``TOK`` sorted pairs from ``p0`` (< ``hi``) x ``HR``
    head rows. Returns ``(flat, t, i, hl, valid)``; ``flat`` is the pair's index relative to
    ``f0`` (the first pair of the chunk whose partials are being written)."""
    r = tl.arange(0, TOK * HR)
    pr = p0 + r // HR
    on = pr < hi
    flat = tl.load(pair_ptr + pr, mask=on, other=0)
    hl = r % HR
    return flat - f0, flat // (HI * TOPK), flat // TOPK % HI, hl, on & (hl < HPI)


@triton.jit
def _fwd_step(q, m, l, acc, k_ptr, v_ptr, krow, kmask, inside, g, s_kt, s_kh, scale,
              D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr):
    """One key tile of the online softmax; ``inside [R, N]`` is the support."""
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
    acc = acc * alpha[:, None] + support_mma(p.to(vt.dtype), vt, nonfinite(vt), inside, UPCAST,
                                             IEEE, ISO)
    return m_new, l, acc


@triton.jit(do_not_specialize=("Tq", "Tk"))
def _attn_fwd_dense_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, qkb_ptr, full_ptr, o_ptr, lse_ptr,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_lt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, HI: tl.constexpr, FULL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr, bad_ptr,
):
    if skip(bad_ptr, ISO):
        return
    R: tl.constexpr = TOK * HR
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # late (long) rows first
    i = tl.program_id(1)
    t, h, valid, pos, kbase = query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, full_ptr, HPI, HR, TOK,
                                         HI, FULL)
    d = tl.arange(0, D)
    q_off = t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    m = tl.full([R], float("-inf"), tl.float32)
    l = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, D], tl.float32)
    c = tl.arange(0, BN)
    k_lo = tl.min(tl.where(valid, kbase, Tk))
    k_hi = tl.max(tl.where(valid, kbase + pos, -1))
    for k0 in range(k_lo, k_hi + 1, BN):
        krow = k0 + c
        kmask = krow <= k_hi
        inside = support_mask(krow, kmask, kbase, pos, valid)
        m, l, acc = _fwd_step(q, m, l, acc, k_ptr, v_ptr, krow, kmask, inside, i // IPG,
                              s_kt, s_kh, scale, D, UPCAST, IEEE, ISO)
    # a valid row's support is never empty, so l = 0 means every score was -Inf (an Inf in the
    # inputs): NaN, as softmax gives it (MSA_SPEC 7); NaN stays NaN
    l_safe = tl.where(l == 0, float("nan"), l)
    tl.store(o_ptr + q_off, (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty),
             mask=valid[:, None])
    tl.store(lse_ptr + t.to(tl.int64) * s_lt + h, log_sum_exp(m, l), mask=valid)


@triton.jit
def _tile_pairs(pair_ptr, p0, hi, HR: tl.constexpr, TOK: tl.constexpr):
    """Flat pair index of each row of the tile of ``TOK`` pairs from ``p0`` (``-1`` at and past
    ``hi``), ``[TOK*HR]`` (``HR`` rows per pair)."""
    pr = p0 + tl.arange(0, TOK * HR) // HR
    return tl.load(pair_ptr + pr, mask=pr < hi, other=-1)


@triton.jit
def _tile_valid(flat, HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr):
    """Rows of a tile that hold a pair and a real head (heads are padded to ``HR``)."""
    return (flat >= 0) & (tl.arange(0, TOK * HR) % HR < HPI)


@triton.jit
def _tile_limit(flat, qpos_ptr, qkb_ptr, s0, HI: tl.constexpr, TOPK: tl.constexpr,
                HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr):
    """Per row, the last key column of the block at start row ``s0`` inside the row's support
    (``-1``: none, for rows without a pair). A selected block starts at or after the row's
    sequence start, so only the upper end bounds the support; it also keeps key rows past
    ``Tk`` out (the query's own key row is below ``Tk``)."""
    valid = _tile_valid(flat, HPI, HR, TOK)
    t = flat // (HI * TOPK)
    pos = tl.load(qpos_ptr + t, mask=valid, other=0)
    kb = tl.load(qkb_ptr + t, mask=valid, other=0)
    return tl.where(valid, kb + pos - s0, -1)


@triton.jit
def _tile_q(q_ptr, flat, s_qt, s_qh, HI: tl.constexpr, TOPK: tl.constexpr, HPI: tl.constexpr,
            HR: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr):
    """Gathered query rows ``[TOK*HR, D]`` of a tile (zeros in rows without a pair)."""
    hl = tl.arange(0, TOK * HR) % HR
    t = flat // (HI * TOPK)
    h = flat // TOPK % HI * HPI + hl
    d = tl.arange(0, D)
    return tl.load(q_ptr + t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :],
                   mask=_tile_valid(flat, HPI, HR, TOK)[:, None], other=0.0)


@triton.jit(do_not_specialize=("sc0", "sc1", "Tk", "NBMAX"))
def _attn_fwd_blocks_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, qkb_ptr, po_ptr, plse_ptr,
    pair_ptr, item_cell_ptr, cell_start_ptr, off_ptr, sub_item_ptr, sub_t0_ptr, starts_ptr,
    meta_ptr, next_ptr, sc0, sc1, Tk, NBMAX, scale2,
    s_qt, s_qh, s_kt, s_kh,
    HI: tl.constexpr, TOPK: tl.constexpr, HPI: tl.constexpr, HR: tl.constexpr,
    TOK: tl.constexpr, IPG: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
    SUB: tl.constexpr, ITEM: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ISO: tl.constexpr, bad_ptr,
):
    """Partial output and LSE of every (pair, head) row of sub-chunks ``sc0 .. sc1 - 1`` over
    its selected block.

    Persistent over the per-pair items of the reverse index (one index head, one start row, up
    to ``ITEM_PAIRS`` pairs), taken from the integer counter ``next_ptr[sc0]`` (0 at launch): an
    item owns its partial rows, so which program takes it changes no result (bitwise
    deterministic). The partial row of pair ``flat`` (relative to the chunk) and head ``hl`` is
    ``flat * HPI + hl``. ``scale2`` is the softmax scale times log2(e) (the tile's softmax runs
    in base 2; the LSE is stored in natural log).

    The tile loop is software-pipelined by hand: while tile ``j`` is multiplied, the query rows
    and support limits of tile ``j + 1`` and the pair numbers of tile ``j + 2`` are in flight
    (every load's address is already in registers, so no load waits on another in the loop).
    """
    if skip(bad_ptr, ISO):
        return
    c = tl.arange(0, BN)
    d = tl.arange(0, D)
    hl = tl.arange(0, TOK * HR) % HR
    f0 = tl.load(sub_t0_ptr + sc0) * (HI * TOPK)
    w0 = tl.load(sub_item_ptr + sc0)
    w_hi = tl.load(sub_item_ptr + sc1)
    w = w0 + tl.atomic_add(next_ptr + sc0, 1)
    while w < w_hi:
        lo, hi, bucket = item_pairs(item_cell_ptr, cell_start_ptr, off_ptr, meta_ptr, w, NBMAX,
                                    SUB, ITEM)
        g, _, s0 = bucket_rows(starts_ptr, meta_ptr, bucket, IPG)
        krow = s0 + c
        kmask = krow < Tk
        off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
        kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
        vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
        v_bad = nonfinite(vt)
        flat = _tile_pairs(pair_ptr, lo, hi, HR, TOK)
        flat_next = _tile_pairs(pair_ptr, lo + TOK, hi, HR, TOK)
        lim = _tile_limit(flat, qpos_ptr, qkb_ptr, s0, HI, TOPK, HPI, HR, TOK)
        q = _tile_q(q_ptr, flat, s_qt, s_qh, HI, TOPK, HPI, HR, TOK, D)
        for p0 in range(lo, hi, TOK):
            # Loads of the next tiles first: they complete under this tile's products.
            lim_next = _tile_limit(flat_next, qpos_ptr, qkb_ptr, s0, HI, TOPK, HPI, HR, TOK)
            q_next = _tile_q(q_ptr, flat_next, s_qt, s_qh, HI, TOPK, HPI, HR, TOK, D)
            flat_after = _tile_pairs(pair_ptr, p0 + 2 * TOK, hi, HR, TOK)
            inside = c[None, :] <= lim[:, None]
            s = tl.where(inside, mma(q, tl.trans(kt), UPCAST, IEEE) * scale2, float("-inf"))
            m = tl.max(s, axis=1)
            m = tl.where(m == float("-inf"), 0.0, m)
            p = tl.exp2(s - m[:, None])
            l = tl.sum(p, axis=1)
            # l = 0: every score of the block -Inf (a selected block always holds a key of the
            # row's support; an Inf in the inputs): LSE -Inf, no weight in the merge
            lse = tl.where(m == float("inf"), m,
                           tl.where(l == 0, float("-inf"),
                                    (m + tl.log2(tl.where(l == 0, 1.0, l))) * 0.6931471805599453))
            inv = 1.0 / tl.where(l == 0, 1.0, l)  # NaN stays NaN
            o = support_mma(p.to(vt.dtype), vt, v_bad, inside, UPCAST, IEEE, ISO) * inv[:, None]
            valid = _tile_valid(flat, HPI, HR, TOK)
            prow = (flat - f0).to(tl.int64) * HPI + hl
            tl.store(po_ptr + prow[:, None] * D + d[None, :], o.to(po_ptr.dtype.element_ty),
                     mask=valid[:, None])
            tl.store(plse_ptr + prow, lse, mask=valid)
            flat, flat_next, lim, q = flat_next, flat_after, lim_next, q_next
        w = w0 + tl.atomic_add(next_ptr + sc0, 1)


@triton.jit(do_not_specialize=("sc0", "sc1"))
def _attn_merge_kernel(
    po_ptr, plse_ptr, bidx_ptr, qpos_ptr, full_ptr, o_ptr, lse_ptr, sub_t0_ptr, sc0, sc1,
    s_bt, s_bh, s_qt, s_qh, s_lt,
    HI: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, HPI: tl.constexpr,
    HR: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
    FULL: tl.constexpr,
):
    """Output and LSE of ``TOK`` tokens x ``HR`` heads of index head ``program_id(1)`` (rows of
    sub-chunks ``sc0 .. sc1 - 1`` that ``FULL`` keeps: SPARSE_ROWS) from their ``TOPK``
    partials, merged by LSE in slot order (slots without a valid block, never written, are
    skipped).

    The slots' block numbers and LSEs are loaded as ``[rows, KP]`` tiles (``KP``: ``TOPK``
    padded to a power of two), so no load of the slot loop waits on another load (up to 32
    slots: a bit mask of the written slots).
    """
    R: tl.constexpr = TOK * HR
    i = tl.program_id(1)
    tc, hl, t64, valid, pos = sub_chunk_rows(sub_t0_ptr, sc0, sc1, qpos_ptr, full_ptr, i, HPI,
                                             HR, TOK, HI, FULL)
    sl = tl.arange(0, KP)
    blk = tl.load(bidx_ptr + t64[:, None] * s_bt + i * s_bh + sl[None, :],
                  mask=valid[:, None] & (sl < TOPK)[None, :], other=-1)
    ok = (blk >= 0) & (blk * BN <= pos[:, None])
    if KP <= 32:  # slot s written: bit s
        okbits = tl.sum(ok.to(tl.int32) << sl[None, :], axis=1)
    base = (tc.to(tl.int64) * HI + i) * TOPK
    lb = tl.load(plse_ptr + (base[:, None] + sl[None, :]) * HPI + hl[:, None], mask=ok,
                 other=float("-inf"))
    m = tl.max(lb, axis=1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    lse = tl.where(valid, log_sum_exp(m, tl.sum(tl.exp(lb - m_use[:, None]), axis=1)), 0.0)
    d = tl.arange(0, D)
    acc = tl.zeros([R, D], tl.float32)
    for s in range(TOPK):  # both loads of a slot depend only on registers: issued together
        if KP <= 32:
            oks = ((okbits >> s) & 1) != 0
        else:
            bs = tl.load(bidx_ptr + t64 * s_bt + i * s_bh + s, mask=valid, other=-1)
            oks = valid & (bs >= 0) & (bs * BN <= pos)
        prow = (base + s) * HPI + hl
        part = tl.load(po_ptr + prow[:, None] * D + d[None, :], mask=oks[:, None], other=0.0)
        wgt = tl.exp(tl.load(plse_ptr + prow, mask=oks, other=float("-inf")) - lse)
        acc += wgt[:, None] * part.to(tl.float32)
    tl.store(o_ptr + t64[:, None] * s_qt + (i * HPI + hl)[:, None] * s_qh + d[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=valid[:, None])
    tl.store(lse_ptr + t64 * s_lt + i * HPI + hl, lse, mask=valid)


def query_tiling(hpi: int, rows: int) -> tuple:
    """``(TOK, HR)``: tokens per row tile and rows per token (a power of two >= ``hpi``), for
    tiles of about ``rows`` token x head rows."""
    hr = next_pow2(hpi)
    return max(1, rows // hr), hr


def warps_for(rows: int) -> int:
    """num_warps for tiles of ``rows`` rows: one warpgroup (64-row MMAs) up to 64 rows."""
    return 4 if rows <= 64 else 8


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx, q_pos: torch.Tensor,
    q_kbase: torch.Tensor, block_size: int, softmax_scale: float, index_heads: int,
) -> tuple:
    """Sparse (``block_idx [Tq, Hi, k]``) or dense causal (``block_idx=None``) attention.

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]`` (fp16/bf16/fp32).
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
    hpi = Hq // hi
    upcast, ieee = dot_flags(q.dtype)
    rev = None
    if block_idx is not None:
        block_idx = block_idx.contiguous()
        rev = build_reverse_index(block_idx, q_pos, q_kbase, Tk, block_size, Hkv)
    # Dense kernel: every row in dense mode, the rows whose selection is their whole causal
    # prefix in sparse mode.
    bad = nonfinite_flag(v)  # the only operand support_mma isolates here
    opts = stage_options(q.dtype)
    tok, hr = query_tiling(hpi, tile_rows(DENSE_ROWS, q.dtype))
    launch_both(
        _attn_fwd_dense_kernel, (triton.cdiv(Tq, tok), hi), q, k, v, q_pos, q_kbase,
        q_pos if rev is None else rev.full, out, lse, Tq, Tk,
        float(softmax_scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
        HPI=hpi, HR=hr, TOK=tok, IPG=hi // Hkv, D=D, BN=DENSE_KEY_TILE, HI=hi,
        FULL=ALL_ROWS if rev is None else FULL_ROWS, UPCAST=upcast, IEEE=ieee, bad_ptr=bad,
        num_warps=warps_for(tok * hr), **opts,
    )
    if rev is None:
        return out, lse
    tok, hr = query_tiling(hpi, tile_rows(FWD_ROWS, q.dtype))
    warps = FWD_WARPS if q.element_size() <= 2 else 4
    top_k = block_idx.shape[2]
    per_query = Hq * top_k * (D * q.element_size() + 4)
    chunks = chunk_count(Tq * per_query, partial_budget(q.numel() * q.element_size()))
    rows = chunk_tokens_bound(rev, chunks)
    part = torch.empty((rows * hi * top_k * hpi, D), dtype=q.dtype, device=q.device)
    part_lse = torch.empty(part.shape[0], dtype=torch.float32, device=q.device)
    taken = torch.zeros(SUB_CHUNKS, dtype=torch.int32, device=q.device)  # counter per launch
    programs = persistent_programs(q.device, rev.max_items, max(1, 8 // warps))
    mtok, mhr = query_tiling(hpi, tile_rows(MERGE_ROWS, q.dtype))
    step = SUB_CHUNKS // chunks
    for sc0 in range(0, SUB_CHUNKS, step):
        launch_both(
            _attn_fwd_blocks_kernel, (programs,), q, k, v, q_pos, q_kbase, part, part_lse,
            rev.pair, rev.item_cell, rev.cell_start, rev.off, rev.sub_item, rev.sub_t0,
            rev.starts, rev.meta, taken, sc0, sc0 + step, Tk, rev.max_buckets,
            float(softmax_scale) * LOG2E, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            HI=hi, TOPK=top_k, HPI=hpi, HR=hr, TOK=tok, IPG=hi // Hkv, D=D, BN=block_size,
            SUB=SUB_CHUNKS, ITEM=rev.item_pairs, UPCAST=upcast, IEEE=ieee, bad_ptr=bad,
            num_warps=warps, **opts,
        )
        _attn_merge_kernel[(triton.cdiv(rows, mtok), hi)](
            part, part_lse, block_idx, q_pos, rev.full, out, lse, rev.sub_t0, sc0, sc0 + step,
            block_idx.stride(0), block_idx.stride(1), q.stride(0), q.stride(1), lse.stride(0),
            HI=hi, TOPK=top_k, KP=next_pow2(top_k), HPI=hpi, HR=mhr, TOK=mtok, D=D,
            BN=block_size, FULL=SPARSE_ROWS, num_warps=MERGE_WARPS,
        )
    return out, lse
