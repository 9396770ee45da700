"""Main-branch backward, deterministic (no float atomics).

``delta = rowsum(dO * O)`` first (:func:`_delta_kernel`).

Sparse mode, key-block-outer like the forward (same reverse index): per chunk of query tokens,
one work item per (KV group, selected start row; a whole block of up to ``ITEM_KEYS`` key rows,
else sub-tiles of that many) recomputes ``P`` for the (token, head) rows of the chunk that
selected the block, in the index's fixed order (token-ascending), adds ``P^T dO`` and
``dS^T Q`` to fp32 dK/dV accumulators of its own key rows, and writes the rows' partial
``dQ = dS K`` for that block; partials are summed per row in slot order afterwards. Products
run with the keys as rows (swap-AB). The item's row tiles are software-pipelined by hand (the
next tile's rows load under the current tile's products; benchmarks/NOTES.md, "v9 -> v10
(backward)"). Items are dealt by an integer counter, most pairs first (:func:`largest_first`),
but each owns its key rows and partial rows, and chunks run one after the other, so the
gradients are bitwise deterministic.

Dense mode: dQ query-outer (one program per tokens x heads of an index head, walking key
tiles), dK/dV key-tile-outer over the query tiles that can see the tile
(:func:`.reverse_index.query_tile_ranges`). The same kernels serve the rows of a sparse call
whose selection is their whole causal prefix; there only the first key tiles of each sequence
have rows, so a key tile's query tiles are cut into slices taken by several programs, whose
fp32 partial dK/dV are added in slice order afterwards (:func:`split_query_tiles`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    ALL_ROWS, DENSE_KEY_TILE, FULL_ROWS, GATHER_ROWS, SPARSE_ROWS, dot_flags, mma,
    partial_budget, persistent_programs, row_filter, stage_options, support_mask, tile_rows,
)
from ._isolation import launch_both, nonfinite, nonfinite_flag, skip, support_mma
from .forward import (LOG2E, _tile_pairs, _tile_valid, query_rows, query_tiling,
                      sub_chunk_rows, warps_for)
from .reverse_index import (
    SUB_CHUNKS, ReverseIndex, bucket_pairs, bucket_rows, build_reverse_index, chunk_count,
    chunk_tokens_bound, query_tile_ranges,
)

# Rows of one tile of the delta kernel.
_DELTA_ROWS = 64
# log2(e) in the item kernel (P recomputed in base 2 from the LSE times this).
_LOG2E = tl.constexpr(LOG2E)
# Key-row-owning kernels (_attn_bwd_blocks_kernel, _attn_bwd_dkdv_dense_kernel): key rows per
# program (a whole block of B <= 128 in the sparse items: each gathered Q/dO row and each dQ
# partial serves all of the block's keys), (token, head) rows per tile (the N of the swap-AB
# products). At 128 keys, 32 rows, 8 warps the item kernel (with the next tile's rows in
# registers) needs 255 registers, ~80 B of spilled loop-invariant values and 128 KiB of shared
# memory on sm_90 (benchmarks/NOTES.md, "v9 -> v10 (backward)" and "v10 backward:
# out-of-bounds shared read on the GPU"): one program per multiprocessor; two at 4 warps
# (64 keys, fp32 inputs). Variants selectable here:
# ITEM_KEYS, ITEM_ROWS = 128, 16 (8 warps) or 64, 16 (4 warps, two programs per SM); both
# measured slower on the H200 than 128, 32 (main_bwd 33.2 / 35.2 ms against 26.6 at 32K;
# benchmarks/results/kernels_h200_v11_bwd_*.json).
ITEM_KEYS = 128
ITEM_ROWS = 32
# Dense dK/dV (_attn_bwd_dkdv_dense_kernel) split over slices of query tiles. In a sparse call
# only the rows whose selection is their whole causal prefix (the first k * B tokens of each
# sequence) are dense: at paper 32K, 64 of the kernel's 1024 programs (16 key tiles x 4 KV
# groups) had rows, each walking up to 2048 tokens alone, 75% of the launch's 2.2 ms idle
# (ncu, benchmarks/NOTES.md "ncu of every kernel (session 11)"). So every key tile's query-tile
# range is cut into slices of at most L query tiles, L = max(ceil(V / U), SPLIT_MIN_TILES)
# (V: query tiles of all key tiles, U = ceil(SPLIT_UNITS / Hkv) extra programs per KV group),
# computed on the device (no host sync): the first slice of a tile is its own program (as
# unsplit), the others (at most V / L <= U) are the extra programs, with fp32 partials summed
# in slice order afterwards (bitwise deterministic). A sparse call always splits (free when no
# tile has more than L query tiles: the extra programs return at once); dense mode (every key
# tile has rows) only below DENSE_SPLIT_BELOW unsplit programs (paper heads: below 8K keys),
# with fp32 dK/dV buffers then. The split is a function of the shapes and the layout (q_pos,
# q_kbase, full rows) only, never of the device. SPLIT_MIN_TILES keeps a slice's K/V load and
# 2 x 64 KiB partial write + read small against its rows (16 tiles: 512 rows of 256 B each of
# Q and dO). Partial buffers: SPLIT_UNITS * KS * D * 8 bytes (128 MiB at 128 keys, D 128),
# freed before the sparse partials. Under the interpreter (tests): 8 extra programs over all
# KV groups, slices of 1 query tile, so the tests' small shapes split.
SPLIT_UNITS = 1024
SPLIT_MIN_TILES = 16
DENSE_SPLIT_BELOW = 256
INTERPRETER_SPLIT = (8, 1)


def key_tiling(dtype: torch.dtype, block_size: int) -> tuple:
    """``(KS, num_warps)`` of the key-row-owning kernels: ``min(block_size, ITEM_KEYS)`` key
    rows (half for 4-byte elements, whose tiles take twice the shared memory; at least 16) at
    8 warps for 128 key rows (two warpgroups, 64 rows each), else 4."""
    ks = min(block_size, max(16, ITEM_KEYS if dtype.itemsize <= 2 else ITEM_KEYS // 2))
    return ks, 8 if ks >= 128 else 4


def programs_per_sm(num_warps: int) -> int:
    """Co-resident programs of the item kernel per multiprocessor (sm_90 registers: 255 per
    thread fit 8 warps once, 4 warps twice)."""
    return 1 if num_warps >= 8 else 2


@triton.jit(do_not_specialize=("rows",))
def _delta_kernel(o_ptr, do_ptr, delta_ptr, rows, D: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, D)
    off = r.to(tl.int64)[:, None] * D + d[None, :]
    o = tl.load(o_ptr + off, mask=(r < rows)[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off, mask=(r < rows)[:, None], other=0.0).to(tl.float32)
    tl.store(delta_ptr + r, tl.sum(o * do, axis=1), mask=r < rows)


@triton.jit(do_not_specialize=("Tq", "Tk"))
def _attn_bwd_dq_dense_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, full_ptr, dq_ptr,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_lt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    D: tl.constexpr, BN: tl.constexpr, HI: tl.constexpr, FULL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr, bad_ptr,
):
    if skip(bad_ptr, ISO):
        return
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    i = tl.program_id(1)
    g = i // IPG
    t, h, valid, pos, kbase = query_rows(tile, i, Tq, qpos_ptr, qkb_ptr, full_ptr, HPI, HR, TOK,
                                         HI, FULL)
    d = tl.arange(0, D)
    q_off = t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + q_off, mask=valid[:, None], other=0.0)
    l_off = t.to(tl.int64) * s_lt + h
    lse = tl.load(lse_ptr + l_off, mask=valid, other=float("inf"))
    delta = tl.load(delta_ptr + l_off, mask=valid, other=0.0)
    dq = tl.zeros([TOK * HR, D], tl.float32)
    c = tl.arange(0, BN)
    k_lo = tl.min(tl.where(valid, kbase, Tk))
    k_hi = tl.max(tl.where(valid, kbase + pos, -1))
    for k0 in range(k_lo, k_hi + 1, BN):
        krow = k0 + c
        kmask = krow <= k_hi
        off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
        kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
        vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
        s = mma(q, tl.trans(kt), UPCAST, IEEE) * scale
        inside = support_mask(krow, kmask, kbase, pos, valid)
        p = tl.where(inside, tl.exp(s - lse[:, None]), 0.0)
        ds = tl.where(inside, p * (mma(do, tl.trans(vt), UPCAST, IEEE) - delta[:, None]), 0.0)
        dq += support_mma(ds.to(kt.dtype), kt, nonfinite(kt), inside, UPCAST, IEEE, ISO)
    tl.store(dq_ptr + q_off, (dq * scale).to(dq_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _kv_rows_step(dk, dv, kt, vt, krow, kmask, t, h, valid, q_ptr, do_ptr, lse_ptr, delta_ptr,
                  qpos_ptr, qkb_ptr, s_qt, s_qh, s_lt, scale,
                  D: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  ISO: tl.constexpr):
    """One tile of (token, head) rows against key rows ``krow``, keys as the products' rows
    (swap-AB: ``S^T = K Q^T``, ``dV += P^T dO``, ``dP^T = V dO^T``, ``dK += dS^T Q``): the
    ``[keys, rows]`` tiles share the accumulators' row layout (no transposes) and the rows of
    the tile can be fewer than 64. Adds to dK, dV; returns the rows' ``dS^T`` (fp32
    ``[keys, rows]``, times the softmax scale, so dK needs no scaling; 0 off the support), the
    support mask ``[keys, rows]`` and the highest key row the rows reach."""
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kbase = tl.load(qkb_ptr + t, mask=valid, other=0)
    d = tl.arange(0, D)
    off = t.to(tl.int64)[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + off, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + off, mask=valid[:, None], other=0.0)
    l_off = t.to(tl.int64) * s_lt + h
    lse = tl.load(lse_ptr + l_off, mask=valid, other=float("inf"))
    delta = tl.load(delta_ptr + l_off, mask=valid, other=0.0)
    u = krow[:, None] - kbase[None, :]
    inside = (u >= 0) & (u <= pos[None, :]) & valid[None, :] & kmask[:, None]
    st = mma(kt, tl.trans(q), UPCAST, IEEE) * scale
    pt = tl.where(inside, tl.exp(st - lse[None, :]), 0.0)
    dv += support_mma(pt.to(do.dtype), do, nonfinite(do), inside, UPCAST, IEEE, ISO)
    dpt = mma(vt, tl.trans(do), UPCAST, IEEE)
    dst = tl.where(inside, pt * (dpt - delta[None, :]), 0.0) * scale
    dk += support_mma(dst.to(q.dtype), q, nonfinite(q), inside, UPCAST, IEEE, ISO)
    return dk, dv, dst, inside, tl.max(tl.where(valid, kbase + pos, -1))


@triton.jit
def _item_rows(flat, q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, k0, s_qt, s_qh,
               s_lt, HI: tl.constexpr, TOPK: tl.constexpr, HPI: tl.constexpr,
               HR: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr):
    """Everything one row tile of an item reads, from its pair numbers ``flat`` alone (no load
    waits on another): ``(q, do)`` ``[TOK*HR, D]`` (zeros in rows without a pair), the row's
    LSE in base 2 (``+inf`` there), ``delta`` (0 there) and the support limit, the last key
    column (relative to key row ``k0``) inside the row's support (``-1`` there). A selected
    block starts at or after the row's sequence start, so only the upper end bounds the
    support; the query's own key row is below ``Tk``, so the limit also keeps key rows past
    ``Tk`` out."""
    hl = tl.arange(0, TOK * HR) % HR
    valid = _tile_valid(flat, HPI, HR, TOK)
    t = flat // (HI * TOPK)
    h = flat // TOPK % HI * HPI + hl
    t64 = t.to(tl.int64)
    d = tl.arange(0, D)
    off = t64[:, None] * s_qt + h[:, None] * s_qh + d[None, :]
    q = tl.load(q_ptr + off, mask=valid[:, None], other=0.0)
    do = tl.load(do_ptr + off, mask=valid[:, None], other=0.0)
    lse2 = tl.load(lse_ptr + t64 * s_lt + h, mask=valid, other=float("inf")) * _LOG2E
    delta = tl.load(delta_ptr + t64 * s_lt + h, mask=valid, other=0.0)
    pos = tl.load(qpos_ptr + t, mask=valid, other=0)
    kb = tl.load(qkb_ptr + t, mask=valid, other=0)
    return q, do, lse2, delta, tl.where(valid, kb + pos - k0, -1)


@triton.jit(do_not_specialize=("ci", "s_g", "sc0", "sc1", "Tk"))
def _attn_bwd_blocks_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, dk_ptr, dv_ptr, pdq_ptr,
    pair_ptr, off_ptr, starts_ptr, meta_ptr, sub_t0_ptr, grp_ptr, n_grp_ptr, next_ptr, ci, s_g,
    sc0, sc1, Tk, scale, scale2,
    s_qt, s_qh, s_kt, s_kh, s_lt,
    HI: tl.constexpr, TOPK: tl.constexpr, HPI: tl.constexpr, HR: tl.constexpr,
    TOK: tl.constexpr, IPG: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, KS: tl.constexpr,
    SUB: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr, bad_ptr,
):
    """Sparse dK/dV (added to fp32 ``dk``/``dv`` [Tk, Hkv, D]) and partial dQ rows
    ``(flat * NSUB + sub) * HPI + hl`` of ``pdq`` for the pairs of sub-chunks ``sc0 .. sc1-1``.

    Persistent; items (KV group x start row, key sub-tile of ``KS`` rows; ``NSUB = BN // KS``,
    1 by default: the whole block) are taken from the integer counter ``next_ptr[ci]`` (0 at
    launch), so a long item does not hold back the items dealt after it. One item owns its key
    rows (no two items write the same dK/dV or partial row), so which program takes which
    item does not change any result: bitwise deterministic. Only the ``n_grp_ptr[ci]``
    (KV group x start row) numbers listed in row ``ci`` of ``grp_ptr`` (row stride ``s_g``;
    those with pairs in these sub-chunks, most pairs first: :func:`largest_first`) are visited.
    Whole tensors and the chunk ``ci`` (not per-chunk slices, whose alignment Triton would
    specialise on) and ``do_not_specialize`` on the chunk's ints: one compile serves every
    chunk and length. ``scale2`` is the softmax scale times log2(e) (``P`` is recomputed in
    base 2 from the LSE in base 2).

    The row-tile loop is software-pipelined by hand: while tile ``j`` is multiplied, the query
    and output-gradient rows, LSEs, deltas and support limits of tile ``j + 1`` and the pair
    numbers of tile ``j + 2`` are in flight (every load's address is already in registers, so
    no load in the loop waits on another)."""
    if skip(bad_ptr, ISO):
        return
    grp_ptr += ci.to(tl.int64) * s_g
    n_grp_ptr += ci
    next_ptr += ci
    NSUB: tl.constexpr = BN // KS
    c = tl.arange(0, KS)
    d = tl.arange(0, D)
    hl = tl.arange(0, TOK * HR) % HR
    f0 = tl.load(sub_t0_ptr + sc0) * (HI * TOPK)
    n_items = tl.load(n_grp_ptr) * NSUB
    w = tl.atomic_add(next_ptr, 1)
    while w < n_items:
        gb = tl.load(grp_ptr + w // NSUB)
        g, _, s0 = bucket_rows(starts_ptr, meta_ptr, gb * IPG, IPG)
        k0 = s0 + (w % NSUB) * KS
        krow = k0 + c
        kmask = krow < Tk
        off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
        kt = tl.load(k_ptr + off, mask=kmask[:, None], other=0.0)
        vt = tl.load(v_ptr + off, mask=kmask[:, None], other=0.0)
        k_bad = nonfinite(kt)
        # The accumulators start from the fp32 buffers (earlier chunks, dense rows): the item's
        # end is a plain store, not a read-modify-write beside both live accumulators.
        o_row = krow.to(tl.int64) * s_kt + g * s_kh
        dk = tl.load(dk_ptr + o_row[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        dv = tl.load(dv_ptr + o_row[:, None] + d[None, :], mask=kmask[:, None], other=0.0)
        # Per row slot of the tile, the highest support limit seen (reduced at the item's end:
        # no per-tile reduction, no second copy of the limits in another layout).
        reach = tl.full([TOK * HR], -1, tl.int32)
        for il in range(IPG):
            lo, hi = bucket_pairs(off_ptr, meta_ptr, gb * IPG + il, sc0, sc1, SUB)
            flat = _tile_pairs(pair_ptr, lo, hi, HR, TOK)
            flat_next = _tile_pairs(pair_ptr, lo + TOK, hi, HR, TOK)
            q, do, lse2, delta, lim = _item_rows(flat, q_ptr, do_ptr, lse_ptr, delta_ptr,
                                                 qpos_ptr, qkb_ptr, k0, s_qt, s_qh, s_lt, HI,
                                                 TOPK, HPI, HR, TOK, D)
            for p0 in range(lo, hi, TOK):
                # Loads of the next tiles first: they complete under this tile's products.
                q_n, do_n, lse2_n, delta_n, lim_n = _item_rows(
                    flat_next, q_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, k0, s_qt,
                    s_qh, s_lt, HI, TOPK, HPI, HR, TOK, D)
                flat_after = _tile_pairs(pair_ptr, p0 + 2 * TOK, hi, HR, TOK)
                # Keys as the products' rows (swap-AB): S^T = K Q^T, dV += P^T dO,
                # dP^T = V dO^T, dK += dS^T Q; [keys, rows] tiles share the accumulators' row
                # layout.
                inside = c[:, None] <= lim[None, :]
                st = mma(kt, tl.trans(q), UPCAST, IEEE)
                pt = tl.where(inside, tl.exp2(st * scale2 - lse2[None, :]), 0.0)
                dv += support_mma(pt.to(do.dtype), do, nonfinite(do), inside, UPCAST, IEEE, ISO)
                dpt = mma(vt, tl.trans(do), UPCAST, IEEE)
                # dP^T is NaN off the support where V is (the launch flag does not cover V)
                dst = tl.where(inside, pt * (dpt - delta[None, :]), 0.0) * scale
                dk += support_mma(dst.to(q.dtype), q, nonfinite(q), inside, UPCAST, IEEE, ISO)
                reach = tl.maximum(reach, lim)
                valid = _tile_valid(flat, HPI, HR, TOK)
                prow = ((flat - f0).to(tl.int64) * NSUB + w % NSUB) * HPI + hl
                # dQ = dS K (rows x D; mma.sync at 32 rows). Not dQ^T = K^T dS^T from shared
                # memory: at 128 keys ptxas 12.8 (Triton 3.6) compiles that product's dS^T
                # descriptors from two never-written uniform registers (the H200 read shared
                # memory out of bounds; benchmarks/NOTES.md, "v10 backward: out-of-bounds shared
                # read on the GPU").
                dq = support_mma(tl.trans(dst.to(kt.dtype)), kt, k_bad, tl.trans(inside), UPCAST,
                                 IEEE, ISO)
                tl.store(pdq_ptr + prow[:, None] * D + d[None, :],
                         dq.to(pdq_ptr.dtype.element_ty), mask=valid[:, None])
                flat, flat_next = flat_next, flat_after
                q, do, lse2, delta, lim = q_n, do_n, lse2_n, delta_n, lim_n
        # Rows past the reach belong to others (a block overlapping the next sequence); store
        # addresses from the start row loaded again: the load's addresses, kept alive across
        # the row loop, would cost about 30 registers (spilled).
        _, _, s1 = bucket_rows(starts_ptr, meta_ptr, gb * IPG, IPG)
        o_row = (s1 + (w % NSUB) * KS + c).to(tl.int64) * s_kt + g * s_kh
        out = (c <= tl.max(reach))[:, None]
        tl.store(dk_ptr + o_row[:, None] + d[None, :], dk, mask=out)
        tl.store(dv_ptr + o_row[:, None] + d[None, :], dv, mask=out)
        w = tl.atomic_add(next_ptr, 1)


@triton.jit(do_not_specialize=("NT", "n_units", "Tq", "Tk"))
def _attn_bwd_dkdv_dense_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, full_ptr, dk_ptr, dv_ptr,
    qt_lo_ptr, qt_hi_ptr, unit_ptr, pdk_ptr, pdv_ptr, NT, n_units,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_lt,
    HPI: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, IPG: tl.constexpr,
    D: tl.constexpr, KS: tl.constexpr, HI: tl.constexpr, FULL: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr, bad_ptr,
):
    """Dense dK/dV of key tiles of ``KS`` rows (rows filtered by ``FULL``), KV group
    ``program_id(1)``.

    Program ``n < NT`` (``NT = cdiv(Tk, KS)``): key tile ``n`` over query tiles ``qt_lo[n] ..
    qt_hi[n] - 1``; writes every key row of the tile to ``dk``/``dv`` (zeros where no row sees
    it). Program ``NT + u`` (``u < n_units``; launched only when split): unit ``u`` of
    ``unit [3, n_units]`` int32 (key tile, first query tile, end query tile; key tile ``NT``:
    unused, returns at once); writes its fp32 sums, all ``KS`` rows, to row block ``u * Hkv +
    g`` of ``pdk``/``pdv`` ``[n_units, Hkv, KS, D]``, which :func:`_dkdv_split_sum_kernel` adds
    to the tile's rows (:func:`split_query_tiles`). Each program sums its query tiles in order:
    deterministic."""
    if skip(bad_ptr, ISO):
        return
    p = tl.program_id(0)
    g = tl.program_id(1)
    if p < NT:
        n = p
        a_lo = tl.load(qt_lo_ptr + p)
        a_hi = tl.load(qt_hi_ptr + p)
    else:
        n = tl.load(unit_ptr + (p - NT))
        a_lo = tl.load(unit_ptr + n_units + (p - NT))
        a_hi = tl.load(unit_ptr + 2 * n_units + (p - NT))
    if n >= NT:
        return
    r = tl.arange(0, TOK * HR)
    hl = r % HR
    c = tl.arange(0, KS)
    d = tl.arange(0, D)
    krow = n * KS + c
    kmask = krow < Tk
    off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
    seen = kmask & (krow < tl.where(a_lo < a_hi, Tk, 0))  # no traffic if no row sees the tile
    kt = tl.load(k_ptr + off, mask=seen[:, None], other=0.0)
    vt = tl.load(v_ptr + off, mask=seen[:, None], other=0.0)
    dk = tl.zeros([KS, D], tl.float32)
    dv = tl.zeros([KS, D], tl.float32)
    for ii in range(IPG):
        for a in range(a_lo, a_hi):
            t = a * TOK + r // HR
            rows = row_filter((t < Tq) & (hl < HPI), t, g * IPG + ii, full_ptr, HI, FULL)
            dk, dv, _, _, _ = _kv_rows_step(dk, dv, kt, vt, krow, kmask, t,
                                            (g * IPG + ii) * HPI + hl, rows, q_ptr, do_ptr,
                                            lse_ptr, delta_ptr, qpos_ptr, qkb_ptr, s_qt, s_qh,
                                            s_lt, scale, D, UPCAST, IEEE, ISO)
    if p < NT:
        tl.store(dk_ptr + off, dk.to(dk_ptr.dtype.element_ty), mask=kmask[:, None])
        tl.store(dv_ptr + off, dv.to(dv_ptr.dtype.element_ty), mask=kmask[:, None])
    else:
        prow = ((p - NT).to(tl.int64) * tl.num_programs(1) + g) * KS + c
        tl.store(pdk_ptr + prow[:, None] * D + d[None, :], dk)
        tl.store(pdv_ptr + prow[:, None] * D + d[None, :], dv)


@triton.jit(do_not_specialize=("NT", "n_units", "Tk"))
def _dkdv_split_sum_kernel(dk_ptr, dv_ptr, pdk_ptr, pdv_ptr, sum_ptr, NT, n_units, Tk, s_kt,
                           s_kh, KS: tl.constexpr, D: tl.constexpr):
    """Adds the split units' partials to the fp32 ``dk``/``dv`` ``[Tk, Hkv, D]`` rows of one
    key tile, KV group ``program_id(1)``: program ``j`` takes row ``j`` of ``sum [3, n_units]``
    int32 (key tile, its first unit, its unit count; key tile ``NT``: none, returns at once)
    and adds units ``first .. first + count - 1`` of ``pdk``/``pdv`` in that order, after the
    tile's first slice already in ``dk``/``dv``: a fixed order, bitwise deterministic."""
    j = tl.program_id(0)
    g = tl.program_id(1)
    n = tl.load(sum_ptr + j)
    if n >= NT:
        return
    first = tl.load(sum_ptr + n_units + j)
    count = tl.load(sum_ptr + 2 * n_units + j)
    c = tl.arange(0, KS)
    d = tl.arange(0, D)
    krow = n * KS + c
    kmask = krow < Tk
    off = krow.to(tl.int64)[:, None] * s_kt + g * s_kh + d[None, :]
    acc = tl.load(dk_ptr + off, mask=kmask[:, None], other=0.0)
    for i in range(0, count):
        prow = ((first + i).to(tl.int64) * tl.num_programs(1) + g) * KS + c
        acc += tl.load(pdk_ptr + prow[:, None] * D + d[None, :])
    tl.store(dk_ptr + off, acc, mask=kmask[:, None])
    acc = tl.load(dv_ptr + off, mask=kmask[:, None], other=0.0)
    for i in range(0, count):
        prow = ((first + i).to(tl.int64) * tl.num_programs(1) + g) * KS + c
        acc += tl.load(pdv_ptr + prow[:, None] * D + d[None, :])
    tl.store(dv_ptr + off, acc, mask=kmask[:, None])


@triton.jit(do_not_specialize=("sc0", "sc1"))
def sum_partials_kernel(
    pdq_ptr, bidx_ptr, qpos_ptr, full_ptr, dq_ptr, sub_t0_ptr, sc0, sc1, s_bt, s_bh, s_qt, s_qh,
    HI: tl.constexpr, TOPK: tl.constexpr, NSUB: tl.constexpr, HPI: tl.constexpr,
    HR: tl.constexpr, TOK: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, FULL: tl.constexpr,
):
    """``dq[t, h] = sum`` of the row's (slot, sub-tile) partials, in slot order (dQ, dq_idx),
    for the tokens of sub-chunks ``sc0 .. sc1 - 1`` (rows kept by ``FULL``). Slots without a
    valid block (never written) are skipped.

    Up to 32 slots, the slots' blocks are loaded as one ``[rows, KP]`` tile (``KP``: ``TOPK``
    padded to a power of two) and kept as a bit mask, so the partial loads of the slot loop
    depend only on registers (no chain of a block load, then its partial, per slot)."""
    R: tl.constexpr = TOK * HR
    KP: tl.constexpr = (1 if TOPK <= 1 else 2 if TOPK <= 2 else 4 if TOPK <= 4 else
                        8 if TOPK <= 8 else 16 if TOPK <= 16 else 32)
    i = tl.program_id(1)
    tc, hl, t64, valid, pos = sub_chunk_rows(sub_t0_ptr, sc0, sc1, qpos_ptr, full_ptr, i, HPI,
                                             HR, TOK, HI, FULL)
    if TOPK <= 32:  # slot s written: bit s
        sl = tl.arange(0, KP)
        blk = tl.load(bidx_ptr + t64[:, None] * s_bt + i * s_bh + sl[None, :],
                      mask=valid[:, None] & (sl < TOPK)[None, :], other=-1)
        ok = (blk >= 0) & (blk * BN <= pos[:, None])
        okbits = tl.sum(ok.to(tl.int32) << sl[None, :], axis=1)
    base = (tc.to(tl.int64) * HI + i) * (TOPK * NSUB)
    d = tl.arange(0, D)
    acc = tl.zeros([R, D], tl.float32)
    for s in range(TOPK * NSUB):
        if TOPK <= 32:
            oks = ((okbits >> (s // NSUB)) & 1) != 0
        else:
            bs = tl.load(bidx_ptr + t64 * s_bt + i * s_bh + s // NSUB, mask=valid, other=-1)
            oks = valid & (bs >= 0) & (bs * BN <= pos)
        prow = (base + s) * HPI + hl
        acc += tl.load(pdq_ptr + prow[:, None] * D + d[None, :], mask=oks[:, None],
                       other=0.0).to(tl.float32)
    tl.store(dq_ptr + t64[:, None] * s_qt + (i * HPI + hl)[:, None] * s_qh + d[None, :],
             acc.to(dq_ptr.dtype.element_ty), mask=valid[:, None])


def split_units(device: torch.device, programs: int, kv_groups: int, sparse: bool) -> tuple:
    """``(units, min_tiles)`` of the dense dK/dV split: extra programs per KV group (0: no
    split) and the fewest query tiles per slice (see SPLIT_UNITS). ``programs``: key tiles x
    KV groups of the unsplit launch. Under the interpreter: ``INTERPRETER_SPLIT``."""
    total, min_tiles = (INTERPRETER_SPLIT if device.type != "cuda"
                        else (SPLIT_UNITS, SPLIT_MIN_TILES))
    if programs == 0 or not (sparse or programs < DENSE_SPLIT_BELOW):
        return 0, min_tiles
    return -(-total // kv_groups), min_tiles


def split_query_tiles(qt_lo: torch.Tensor, qt_hi: torch.Tensor, units: int,
                      min_tiles: int) -> tuple:
    """Cuts each key tile's query tiles ``qt_lo[n] .. qt_hi[n] - 1`` (``[NT]`` int32,
    :func:`.reverse_index.query_tile_ranges`) into slices of ``L`` query tiles, on the device
    (no host sync): ``L = max(ceil(V / units), min_tiles)``, ``V`` the query tiles of all key
    tiles, so a tile's extra slices (all but its first) number at most ``V / L <= units``.

    Args:
        qt_lo, qt_hi: ``[NT]`` int32 (``NT >= 1``; ``lo >= hi``: no query tile).
        units: extra programs (>= 1).
        min_tiles: fewest query tiles per slice (>= 1).

    Returns:
        ``(first_hi, unit, sums)``: ``first_hi [NT]`` int32, the end of each tile's first slice
        (which stays the tile's own program); ``unit [3, units]`` int32, per extra program its
        key tile, first and end query tile (slices of a tile consecutive, in order; unused
        programs: key tile ``NT``, empty range); ``sums [3, units]`` int32, per key tile with
        extra slices (ascending; then key tile ``NT``) the tile, its first unit and its unit
        count, for :func:`_dkdv_split_sum_kernel`.

    Raises:
        ValueError: ``units`` or ``min_tiles`` below 1, or no key tile.
    """
    if units < 1 or min_tiles < 1:
        raise ValueError(f"units and min_tiles must be >= 1, got {units} and {min_tiles}")
    nt = qt_lo.numel()
    if nt < 1 or qt_hi.numel() != nt:
        raise ValueError(f"qt_lo and qt_hi must be [NT] with NT >= 1, got {nt} and "
                         f"{qt_hi.numel()}")
    lo, hi = qt_lo.to(torch.int64), qt_hi.to(torch.int64)
    count = (hi - lo).clamp_min(0)
    span = ((count.sum() + units - 1) // units).clamp_min(min_tiles)  # L, 0-dim on the device
    extra = ((count + span - 1) // span - 1).clamp_min(0)
    end = extra.cumsum(0)  # units of tile n: end[n] - extra[n] .. end[n] - 1
    first = end - extra
    u = torch.arange(units, device=lo.device, dtype=torch.int64)
    tile = torch.searchsorted(end, u, right=True)  # NT past the last unit
    at = tile.clamp_max(nt - 1)
    used = tile < nt
    u_lo = lo[at] + (u - first[at] + 1) * span
    u_hi = torch.minimum(u_lo + span, hi[at])
    unit = torch.stack([tile, torch.where(used, u_lo, 0), torch.where(used, u_hi, 0)])
    tile = torch.searchsorted((extra > 0).cumsum(0), u, right=True)
    at = tile.clamp_max(nt - 1)
    sums = torch.stack([tile, first[at], extra[at]])
    first_hi = torch.minimum(hi, lo + span)
    return (first_hi.to(torch.int32), unit.to(torch.int32).contiguous(),
            sums.to(torch.int32).contiguous())


def largest_first(rev: ReverseIndex, chunks: int) -> tuple:
    """Per chunk of ``SUB_CHUNKS // chunks`` sub-chunks, the (KV group, start row) numbers
    ``gb`` of the item kernel, most pairs first (ties by ``gb``), on the device (no host sync).

    The items are dealt by a counter in this order, so the longest items (blocks that many
    rows of the chunk selected: coherent selections) start first and the launch does not end
    on one long item started late. Which program takes which item changes no result.

    Args:
        rev: the index.
        chunks: a power of two dividing ``SUB_CHUNKS``.

    Returns:
        ``(groups, count)``: ``groups [chunks, G]`` int32 (``G = max_buckets // ipg``), row
        ``c`` listing chunk ``c``'s ``count[c]`` non-empty ``gb`` first, the empty ones after;
        ``count [chunks]`` int32. Cached on ``rev`` (read-only tensors).

    Raises:
        ValueError: ``chunks`` is not a power of two dividing ``SUB_CHUNKS``.
    """
    if chunks < 1 or SUB_CHUNKS % chunks or chunks & (chunks - 1):
        raise ValueError(f"chunks must be a power of two dividing {SUB_CHUNKS}, got {chunks}")
    key = ("backward_largest_first", chunks)
    cached = rev.chunk_groups_cache.get(key)
    if cached is not None:
        return cached
    dev = rev.off.device
    n_groups = rev.max_buckets // rev.ipg
    cap = rev.off.numel() - 1
    nt = rev.meta[1].to(torch.int64)
    # Buckets past the last one read empty cells (the offsets' end).
    bb = torch.minimum(torch.arange(n_groups * rev.ipg, device=dev, dtype=torch.int64),
                       rev.meta[3].to(torch.int64))
    sc = torch.arange(0, SUB_CHUNKS + 1, SUB_CHUNKS // chunks, device=dev, dtype=torch.int64)
    lo = rev.off[(bb[None, :] * nt + (sc * (nt // SUB_CHUNKS))[:, None]).clamp_max(cap)]
    pairs = (lo[1:] - lo[:-1]).view(chunks, n_groups, rev.ipg).sum(2)  # [chunks, G]
    order = torch.sort(pairs, dim=1, descending=True, stable=True).indices
    result = (order.to(torch.int32).contiguous(), (pairs > 0).sum(1).to(torch.int32))
    rev.chunk_groups_cache[key] = result
    return result


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
    if Tq == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    _delta_kernel[(triton.cdiv(Tq * Hq, _DELTA_ROWS),)](out, dout, delta, Tq * Hq, D=D,
                                                       ROWS=_DELTA_ROWS)
    upcast, ieee = dot_flags(q.dtype)
    scale = float(softmax_scale)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0))
    tok, hr = query_tiling(hpi, tile_rows(GATHER_ROWS, q.dtype))
    opts = stage_options(q.dtype)
    rev = None
    if sparse:
        block_idx = block_idx.contiguous()
        rev = build_reverse_index(block_idx, q_pos, q_kbase, Tk, block_size, Hkv)
    # Dense kernels: every row in dense mode; in sparse mode the rows whose selection is their
    # whole causal prefix, with dK/dV into fp32 buffers the sparse items then add to (fp32 also
    # when the dense dK/dV is split: its slices are added there).
    ks, kwarps = key_tiling(q.dtype, block_size if sparse else ITEM_KEYS)
    n_tiles = triton.cdiv(Tk, ks)
    units, min_tiles = split_units(q.device, n_tiles * Hkv, Hkv, sparse)
    dq = torch.empty_like(q)
    dk, dv = (torch.empty(x.shape, dtype=torch.float32 if sparse or units else x.dtype,
                          device=x.device) for x in (k, v))
    full = q_pos if rev is None else rev.full
    which = ALL_ROWS if rev is None else FULL_ROWS
    bad = nonfinite_flag(q, k, dout)  # the operands support_mma isolates here
    launch_both(
        _attn_bwd_dq_dense_kernel, (triton.cdiv(Tq, tok), hi), q, k, v, dout, lse, delta, q_pos,
        q_kbase, full, dq, Tq, Tk, scale, *strides,
        HPI=hpi, HR=hr, TOK=tok, IPG=ipg, D=D, BN=DENSE_KEY_TILE, HI=hi, FULL=which,
        UPCAST=upcast, IEEE=ieee, bad_ptr=bad, num_warps=warps_for(tok * hr), **opts,
    )
    # Key-row-owning kernels (dense dK/dV, sparse items): keys as the products' rows.
    ktok, khr = query_tiling(hpi, tile_rows(ITEM_ROWS, q.dtype))
    kopts = {**opts, "num_warps": kwarps}
    present = None if rev is None else rev.full.any(1)
    qt_lo, qt_hi = query_tile_ranges(q_pos, q_kbase, Tk, ktok, ks, present)
    unit = sums = pdk = pdv = qt_lo  # placeholders, never read without a split
    if units:
        qt_hi, unit, sums = split_query_tiles(qt_lo, qt_hi, units, min_tiles)
        pdk, pdv = (torch.empty((units, Hkv, ks, D), dtype=torch.float32, device=q.device)
                    for _ in range(2))
    launch_both(
        _attn_bwd_dkdv_dense_kernel, (n_tiles + units, Hkv), q, k, v, dout, lse, delta,
        q_pos, q_kbase, full, dk, dv, qt_lo, qt_hi, unit, pdk, pdv, n_tiles, units, Tq, Tk,
        scale, *strides, HPI=hpi, HR=khr, TOK=ktok, IPG=ipg, D=D, KS=ks, HI=hi, FULL=which,
        UPCAST=upcast, IEEE=ieee, bad_ptr=bad, **kopts,
    )
    if units:
        _dkdv_split_sum_kernel[(units, Hkv)](dk, dv, pdk, pdv, sums, n_tiles, units, Tk,
                                            dk.stride(0), dk.stride(1), KS=ks, D=D,
                                            num_warps=8)
        del pdk, pdv  # before the sparse partials are allocated
    if not sparse:
        return dq, dk.to(k.dtype), dv.to(v.dtype)
    top_k = block_idx.shape[2]
    nsub = block_size // ks
    per_query = Hq * top_k * nsub * D * q.element_size()
    chunks = chunk_count(Tq * per_query, partial_budget(q.numel() * q.element_size()))
    rows = chunk_tokens_bound(rev, chunks)
    part = torch.empty((rows * hi * top_k * nsub * hpi, D), dtype=q.dtype, device=q.device)
    step = SUB_CHUNKS // chunks
    groups, n_groups = largest_first(rev, chunks)
    taken = torch.zeros(chunks, dtype=torch.int32, device=q.device)  # item counter per launch
    programs = persistent_programs(q.device, Hkv * Tk * nsub, programs_per_sm(kwarps))
    for ci, sc0 in enumerate(range(0, SUB_CHUNKS, step)):
        launch_both(
            _attn_bwd_blocks_kernel, (programs,), q, k, v, dout, lse, delta, q_pos, q_kbase, dk,
            dv, part, rev.pair, rev.off, rev.starts, rev.meta, rev.sub_t0, groups, n_groups,
            taken, ci, groups.stride(0), sc0, sc0 + step, Tk, scale, scale * LOG2E, *strides,
            HI=hi, TOPK=top_k, HPI=hpi, HR=khr, TOK=ktok, IPG=ipg, D=D, BN=block_size, KS=ks,
            SUB=SUB_CHUNKS, UPCAST=upcast, IEEE=ieee, bad_ptr=bad, **kopts,
        )
        sum_partials_kernel[(triton.cdiv(rows, tok), hi)](
            part, block_idx, q_pos, rev.full, dq, rev.sub_t0, sc0, sc0 + step,
            block_idx.stride(0), block_idx.stride(1), q.stride(0), q.stride(1), HI=hi,
            TOPK=top_k, NSUB=nsub, HPI=hpi, HR=hr, TOK=tok, D=D, BN=block_size,
            FULL=SPARSE_ROWS, num_warps=warps_for(tok * hr),
        )
    return dq, dk.to(k.dtype), dv.to(v.dtype)
