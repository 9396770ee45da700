"""Fused block selection (MSA_SPEC section 2): index scores, causal block max, forced blocks,
top-k, all in one Triton kernel; no ``[T, T]`` or ``[T, T/B]`` tensor exists in memory.

One program owns a tile of ``TOK`` query tokens x the ``Hi/Hik`` index heads reading one index
key head (rows = token x head). It walks the key blocks of the tile's sequences in ascending
order, computes the ``[rows, B]`` score tile with one matrix product, reduces it to block scores
(max over ``u <= p``), and keeps a running top-k per row in registers. Walking blocks in
ascending order makes the tie rule exact: a later block replaces a kept one only when its score
is strictly larger. A tile whose tokens belong to several sequences (short documents, any
``q_kbase``) handles one sequence ("segment") at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_flags, mma, next_pow2

# Rows (tokens x heads) of one selection tile (128: 2.1 ms vs 2.8 ms for 64 at paper 32K, H200).
SELECT_ROWS = 128
# Ranking key of a block (int64, larger is better): class << 60 | ordered fp32 score << 28 |
# (2^28 - 1 - block). Class 2 = forced, 1 = eligible by score, 0 = empty slot. The low bits make
# equal scores rank the lower block first, exactly the tie rule of MSA_SPEC 2.4.
_CLASS_SHIFT = tl.constexpr(60)
_SCORE_SHIFT = tl.constexpr(28)
_BLOCK_BITS = tl.constexpr((1 << 28) - 1)
_PADDING_KEY = tl.constexpr(2**63 - 1)  # never the worst slot
_SIGN_FLIP = tl.constexpr(2**31)


@triton.jit
def _ordered_bits(s):
    """Map fp32 to int64 in [0, 2^32) preserving order (-0.0 and +0.0 equal, NaN lowest)."""
    s = tl.where(s == s, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits >= 0, bits + _SIGN_FLIP, -1 - bits)


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
    kept = tl.where(col < TOPK, 0, _PADDING_KEY).to(tl.int64) + tl.zeros([R, K_P2], tl.int64)
    done = valid == 0
    left = tl.sum(valid.to(tl.int32))
    while left > 0:
        # One sequence of the tile at a time: its rows share q_kbase.
        seg_kb = tl.min(tl.where(done, Tk, kb))
        inseg = (done == 0) & (kb == seg_kb)
        seg_pos = tl.max(tl.where(inseg, pos, -1))
        for b in range(0, seg_pos // BLK + 1):
            u = b * BLK + c
            kt = tl.load(ki_ptr + (seg_kb + u).to(tl.int64)[:, None] * s_kt + j * s_kh + d[None, :],
                         mask=(u <= seg_pos)[:, None], other=0.0)
            z = mma(q, tl.trans(kt), UPCAST, IEEE) * scale
            z = tl.where(u[None, :] <= pos[:, None], z, float("-inf"))
            elig = inseg & (b <= own)
            forced = (b > own - LOCAL) | (b < INIT)
            klass = tl.where(elig, tl.where(forced, 2, 1), 0).to(tl.int64)
            key = ((klass << _CLASS_SHIFT) | (_ordered_bits(tl.max(z, axis=1)) << _SCORE_SHIFT)
                   | (_BLOCK_BITS - b))
            key = tl.where(elig, key, 0)
            worst, worst_col = tl.min(kept, axis=1, return_indices=True)
            hit = (key > worst)[:, None] & (col == worst_col[:, None])
            kept = tl.where(hit, key[:, None], kept)
        done = done | inseg
        left = tl.sum((done == 0).to(tl.int32))
    # Ascending block numbers: rank each kept block among the row's kept blocks.
    filled = (kept > 0) & (kept != _PADDING_KEY)
    block = tl.where(filled, _BLOCK_BITS - (kept & _BLOCK_BITS), _BLOCK_BITS + 1)
    rank = tl.sum((block[:, None, :] < block[:, :, None]).to(tl.int32), axis=2)
    slot = tl.arange(0, K_P2)[None, :, None]
    picked = tl.sum(tl.where((rank[:, None, :] == slot) & filled[:, None, :], block[:, None, :], 0),
                    axis=2)
    n_kept = tl.sum(filled.to(tl.int32), axis=1)
    picked = tl.where(col < n_kept[:, None], picked, -1)
    out_off = t.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + col
    tl.store(out_ptr + out_off, picked.to(tl.int32), mask=valid[:, None] & (col < TOPK))


def select_blocks_triton(
    q_idx: torch.Tensor, k_idx: torch.Tensor, q_pos: torch.Tensor, q_kbase: torch.Tensor,
    block_size: int, top_k: int, init_blocks: int, local_blocks: int, index_scale: float,
) -> torch.Tensor:
    """Top-k key blocks per query token and index head (MSA_SPEC section 2).

    Args:
        q_idx: ``[Tq, Hi, Di]`` fp16/bf16/fp32 index queries; k_idx: ``[Tk, Hik, Di]``.
        q_pos, q_kbase: ``[Tq]`` int32 query layout (:mod:`msa_megatron.ops.layout`).
        block_size, top_k, init_blocks, local_blocks: selection options (validated by the caller).
        index_scale: logit scale (resolved float).

    Returns:
        ``[Tq, Hi, top_k]`` int32 block numbers relative to the sequence start, ascending,
        ``-1`` in unused slots. Scores are fp32 from the input dtype; ties go to the lower block.
        NaN inputs never break the result's structure: the GPU block max skips NaN scores and a
        block whose max is NaN ranks below every other (the oracle ranks NaN first).
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
    tok = max(1, SELECT_ROWS // hr)  # rows = max(SELECT_ROWS, hr) >= 16, as tl.dot needs
    rows = tok * hr
    upcast, ieee = dot_flags(q_idx.dtype)
    grid = (triton.cdiv(Tq, tok), Hik)
    _select_kernel[grid](
        q_idx, k_idx, q_pos, q_kbase, out, Tq, Tk, float(index_scale),
        q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1),
        out.stride(0), out.stride(1),
        HPK=hpk, HR=hr, TOK=tok, DI=Di, BLK=block_size, TOPK=top_k, K_P2=next_pow2(top_k),
        INIT=init_blocks, LOCAL=local_blocks, UPCAST=upcast, IEEE=ieee,
        num_warps=4 if rows <= 64 else 8,
    )
    return out
