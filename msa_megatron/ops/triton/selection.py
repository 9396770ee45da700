"""Fused block selection (MSA_SPEC section 2): index scores, causal block max, forced blocks,
top-k, all in one Triton kernel; no ``[T, T]`` or ``[T, T/B]`` tensor exists in memory.

One program owns a tile of ``TOK`` query tokens x the ``Hi/Hik`` index heads reading one index
key head (rows = token x head). It walks the key blocks of the tile's sequences in ascending
order, computes the ``[rows, B]`` score tile with one matrix product (the next block's index
keys are loaded while the current one is reduced), applies the causal mask only on blocks that
reach past a row's position, reduces the tile to block maxima (NaN propagating), scales the
maxima (exact: the scale is positive and rounding is monotone) and keeps a running top-k per
row in registers: ranking keys (int32, the fp32 score's order) and block ids (int32). A block
is compared with the row's current k-th key first; only when some row of the tile beats it
is the top-k updated. Walking blocks in ascending order makes the tie rule exact: a later block
replaces a kept one only when its key is strictly larger, and the evicted block is the worst
key's highest block. A tile whose tokens belong to several sequences (short documents, any
``q_kbase``) handles one sequence ("segment") at a time.

Ranking (MSA_SPEC section 2, DESIGN "Ranking with NaN"): forced blocks first, then NaN block
scores, then numbers in descending order (+0 == -0), ties to the lower block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_flags, mma, next_pow2, stage_options, tile_rows

# Rows (tokens x heads) of one selection tile (128: 2.1 ms vs 2.8 ms for 64 at paper 32K, H200).
SELECT_ROWS = 128
# int32 ranking keys (larger is better): a number's key has the order of its fp32 value; every
# NaN ranks above +inf; forced blocks above NaN; empty slots below every block.
_FORCED_KEY = tl.constexpr(2**31 - 1)
_NAN_KEY = tl.constexpr(0x7FC00000)  # above the key of +inf (0x7F800000)
_EMPTY_KEY = tl.constexpr(-(2**31))
_MAGNITUDE = tl.constexpr(2**31 - 1)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rank_key(s):
    """int32 key with the order of fp32 ``s`` (-0.0 == +0.0, every NaN above +inf)."""
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ _MAGNITUDE)
    return tl.where(s != s, _NAN_KEY, key)


@triton.jit
def _select_kernel(
    qi_ptr, ki_ptr, qpos_ptr, qkb_ptr, out_ptr,
    Tq, Tk, scale,
    s_qt, s_qh, s_kt, s_kh, s_ot, s_oh,
    HPK: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr, DI: tl.constexpr,
    BLK: tl.constexpr, TOPK: tl.constexpr, K_P2: tl.constexpr,
    INIT: tl.constexpr, LOCAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    R: tl.constexpr = TOK * HR
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # late (long) tiles first
    j = tl.program_id(1)
    r = tl.arange(0, R)
    t = tile * TOK + r // HR
    hl = r % HR
    valid = (t < Tq) & (hl < HPK)
    head = j * HPK + hl
    pos = tl.load(qpos_ptr + t, mask=valid, other=0)
    kb = tl.load(qkb_ptr + t, mask=valid, other=0)
    own = pos // BLK
    d = tl.arange(0, DI)
    q = tl.load(qi_ptr + t.to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    c = tl.arange(0, BLK)
    col = tl.arange(0, K_P2)[None, :]
    real = col < TOPK
    keys = tl.where(real, _EMPTY_KEY, _FORCED_KEY) + tl.zeros([R, K_P2], tl.int32)
    ids = tl.full([R, K_P2], -1, tl.int32)
    done = valid == 0
    left = tl.sum(valid.to(tl.int32))
    while left > 0:
        # One sequence of the tile at a time: its rows share q_kbase.
        seg_kb = tl.min(tl.where(done, Tk, kb))
        inseg = (done == 0) & (kb == seg_kb)
        seg_pos = tl.max(tl.where(inseg, pos, -1))
        seg_min = tl.min(tl.where(inseg, pos, seg_pos))
        thresh = tl.min(tl.where(real, keys, _FORCED_KEY), axis=1)  # the row's k-th key
        k_off = (seg_kb + c).to(tl.int64)[:, None] * s_kt + j * s_kh + d[None, :]
        k_next = tl.load(ki_ptr + k_off, mask=(c <= seg_pos)[:, None], other=0.0)
        for b in range(0, seg_pos // BLK + 1):
            kt = k_next
            u_next = (b + 1) * BLK + c
            k_next = tl.load(ki_ptr + k_off + (b + 1) * BLK * s_kt,
                             mask=(u_next <= seg_pos)[:, None], other=0.0)
            z = mma(q, tl.trans(kt), UPCAST, IEEE)
            if (b + 1) * BLK - 1 > seg_min:  # the block reaches past some row's position
                z = tl.where((b * BLK + c)[None, :] <= pos[:, None], z, float("-inf"))
            key = _rank_key(tl.reduce(z, 1, _max_nan) * scale)
            elig = inseg & (b <= own)
            key = tl.where((b > own - LOCAL) | (b < INIT), _FORCED_KEY, key)
            hit = elig & (key > thresh)
            if tl.max(hit.to(tl.int32)) > 0:
                # Evict the worst kept block: lowest key, among equal keys the highest block.
                worst = (keys == thresh[:, None]) & real
                _, worst_col = tl.max(tl.where(worst, ids, -2), axis=1, return_indices=True)
                upd = hit[:, None] & (col == worst_col[:, None])
                keys = tl.where(upd, key[:, None], keys)
                ids = tl.where(upd, b, ids)
                thresh = tl.min(tl.where(real, keys, _FORCED_KEY), axis=1)
        done = done | inseg
        left = tl.sum((done == 0).to(tl.int32))
    # Ascending block numbers: rank each kept block among the row's kept blocks.
    filled = real & (keys != _EMPTY_KEY)
    block = tl.where(filled, ids, 2**30)
    rank = tl.sum((block[:, None, :] < block[:, :, None]).to(tl.int32), axis=2)
    slot = tl.arange(0, K_P2)[None, :, None]
    picked = tl.sum(tl.where((rank[:, None, :] == slot) & filled[:, None, :], block[:, None, :], 0),
                    axis=2)
    n_kept = tl.sum(filled.to(tl.int32), axis=1)
    picked = tl.where(col < n_kept[:, None], picked, -1)
    out_off = t.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + col
    tl.store(out_ptr + out_off, picked.to(tl.int32), mask=valid[:, None] & real)


def select_blocks_triton(
    q_idx: torch.Tensor, k_idx: torch.Tensor, q_pos: torch.Tensor, q_kbase: torch.Tensor,
    block_size: int, top_k: int, init_blocks: int, local_blocks: int, index_scale: float,
) -> torch.Tensor:
    """Top-k key blocks per query token and index head (MSA_SPEC section 2).

    Args:
        q_idx: ``[Tq, Hi, Di]`` fp16/bf16/fp32 index queries; k_idx: ``[Tk, Hik, Di]``.
        q_pos, q_kbase: ``[Tq]`` int32 query layout (:mod:`msa_megatron.layout`).
        block_size, top_k, init_blocks, local_blocks: selection options (validated by the caller).
        index_scale: logit scale (resolved float).

    Returns:
        ``[Tq, Hi, top_k]`` int32 block numbers relative to the sequence start, ascending,
        ``-1`` in unused slots. Scores are fp32 from the input dtype; forced blocks first, then
        NaN block scores (a NaN anywhere in a block's causal part makes its score NaN), then
        the largest scores; ties go to the lower block (the oracle's rule).
    """
    Tq, Hi, Di = q_idx.shape
    Tk, Hik, _ = k_idx.shape
    out = torch.empty((Tq, Hi, top_k), dtype=torch.int32, device=q_idx.device)
    if Tq == 0:
        return out
    q_idx = q_idx.contiguous()
    k_idx = k_idx.contiguous()
    hpk = Hi // Hik
    hr = next_pow2(hpk)
    tok = max(1, tile_rows(SELECT_ROWS, q_idx.dtype) // hr)  # rows >= 16, as tl.dot needs
    rows = tok * hr
    upcast, ieee = dot_flags(q_idx.dtype)
    grid = (triton.cdiv(Tq, tok), Hik)
    _select_kernel[grid](
        q_idx, k_idx, q_pos, q_kbase, out, Tq, Tk, float(index_scale),
        q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1),
        out.stride(0), out.stride(1),
        HPK=hpk, HR=hr, TOK=tok, DI=Di, BLK=block_size, TOPK=top_k, K_P2=next_pow2(top_k),
        INIT=init_blocks, LOCAL=local_blocks, UPCAST=upcast, IEEE=ieee,
        num_warps=4 if rows <= 64 else 8, **stage_options(q_idx.dtype),
    )
    return out
