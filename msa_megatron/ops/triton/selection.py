"""Block selection (MSA_SPEC section 2): index scores, causal block max, forced blocks, top-k,
in two Triton kernels per chunk of query tokens; no ``[T, T]`` tensor exists in memory.

1. ``_block_keys_kernel``, a GEMM with a row-max epilogue: one program owns a tile of ``TOK``
   query tokens x the ``Hi/Hik`` index heads reading one index key head (rows = token x head,
   :data:`SELECT_ROWS` of them) and a group of :data:`GROUP_BLOCKS` key blocks. Per block it
   computes the ``[rows, KS]`` score sub-tiles with one matrix product each (index keys loaded
   by the software pipeline), reduces them to the block maximum (NaN propagating), scales it
   (exact: the scale is positive and rounding is monotone) and writes its int32 ranking key
   (the fp32 order) to a ``[blocks, rows]`` buffer. It scores only blocks that are ranked:
   neither forced nor in the last ``local_blocks`` of the tile's last row. Since
   ``local_blocks >= 1`` always forces the query's own block, every ranked block is complete
   and causal for every row that ranks it: no causal mask and no key past the sequence (the
   scores a row gets for its own or later blocks are never read). No running state: every
   block costs one MMA, one row max and one coalesced store; the programs are independent, so
   the causal triangle is spread over the whole GPU.
2. ``_topk_kernel``: one program (one warp) owns :data:`TOPK_ROWS` rows (token, index head)
   and walks the row's causal blocks in chunks of ``CB``, keeping the row's top-k in registers as (key, block)
   pairs. A chunk's keys are compared with the row's current k-th key first; only the blocks
   that beat it are inserted, best first (largest key, then lowest block), each evicting the
   worst kept block (lowest key, among equal keys the highest block). Walking chunks in
   ascending block order and inserting in that order makes the tie rule exact: a block enters
   only with a strictly larger key than the worst kept one. Finally the kept blocks are sorted
   ascending.

The buffer holds one chunk of query tokens (at most :data:`KEY_BUFFER_BYTES`); longer inputs
run the two kernels per chunk (no host synchronisation: the chunking follows the shapes only).
A tile whose tokens belong to several sequences (short documents, any ``q_kbase``) handles one
sequence ("segment") at a time; block numbers are relative to each row's sequence start.

Ranking (MSA_SPEC section 2, DESIGN "Ranking with NaN"): forced blocks first, then NaN block
scores, then numbers in descending order (+0 == -0), ties to the lower block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_flags, mma, next_pow2

# Block-key kernel for 2-byte inputs (ptxas for sm_90, Triton 3.6, paper heads; see
# benchmarks/NOTES.md "selection rewrite"):
# - SELECT_ROWS rows (tokens x heads) per tile. Each program reads every key block of its group
#   once, so the L2 -> shared-memory traffic of index keys is (T * Hi / rows) x 32 KiB blocks:
#   32 GiB at 128K with 256 rows, 64 GiB with 128 (the old kernel's, about 10 ms of L2
#   bandwidth, as long as the GEMM itself).
# - SELECT_KEY_SUBTILE keys per matrix product: 128 (a whole block) gives each warpgroup a
#   64 x 128 wgmma; SELECT_WARPS 16 (four warpgroups) keeps the fp32 tile at 64 registers per
#   thread: 122 registers, no spills.
# - SELECT_STAGES 3: the index-key load of block i + 2 is issued while block i is reduced
#   (two stages wait for the load just issued): 161 KiB of shared memory, one program per SM.
SELECT_ROWS = 256
SELECT_KEY_SUBTILE = 128
SELECT_WARPS = 16
SELECT_STAGES = 3
# fp32 inputs (interpreter tests, GPU checks): exact fp32 products on the CUDA cores; small
# tiles keep the register spills small.
SELECT_ROWS_FP32 = 32
# Key blocks per block-key program (the causal triangle is cut into tiles x groups).
GROUP_BLOCKS = 32
# Rows (token, index head) per top-k program (top_k <= 16; fewer for a larger top_k: 200
# registers at top_k 32 with 32 rows), and its warps (one: no barrier in the loop); blocks per
# step of its walk (at least the kept-list width, the power of two >= top_k).
TOPK_ROWS = 32
TOPK_WARPS = 1
TOPK_CHUNK = 16
# Bytes of the per-chunk buffer of block keys ([blocks, chunk rows] int32), and the fewest query
# tokens of a chunk (very long inputs: enough top-k programs to fill the GPU; 512 MiB at 1M).
KEY_BUFFER_BYTES = 256 << 20
MIN_CHUNK_TOKENS = 4096
# int32 ranking keys (larger is better): a number's key has the order of its fp32 value; every
# NaN ranks above +inf; forced blocks above NaN; ineligible blocks and empty slots below all.
_FORCED_KEY = tl.constexpr(2**31 - 1)
_NAN_KEY = tl.constexpr(0x7FC00000)  # above the key of +inf (0x7F800000)
_EMPTY_KEY = tl.constexpr(-(2**31))
_MAGNITUDE = tl.constexpr(2**31 - 1)
_NO_BLOCK = tl.constexpr(2**30)


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


@triton.jit(do_not_specialize=("t0", "t1"))
def _block_keys_kernel(
    qi_ptr, ki_ptr, qpos_ptr, qkb_ptr, key_ptr,
    t0, t1, scale,
    s_qt, s_qh, s_kt, s_kh, s_kb,
    HI: tl.constexpr, HPK: tl.constexpr, HR: tl.constexpr, TOK: tl.constexpr,
    DI: tl.constexpr, BLK: tl.constexpr, KS: tl.constexpr, GB: tl.constexpr,
    INIT: tl.constexpr, LOCAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
):
    R: tl.constexpr = TOK * HR
    NSUB: tl.constexpr = BLK // KS
    g = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # late (long) tiles first
    j = tl.program_id(2)
    r = tl.arange(0, R)
    t = t0 + tile * TOK + r // HR
    hl = r % HR
    valid = (t < t1) & (hl < HPK)
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    lo = g * GB
    if tl.max(pos) >= (lo + LOCAL) * BLK:  # some row ranks a block of this group
        head = j * HPK + hl
        kb = tl.load(qkb_ptr + t, mask=valid, other=0)
        brow = (t - t0) * HI + head  # the row of the key buffer
        d = tl.arange(0, DI)
        c = tl.arange(0, KS)
        q = tl.load(qi_ptr + t.to(tl.int64)[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                    mask=valid[:, None], other=0.0)
        done = valid == 0
        left = tl.sum(valid.to(tl.int32))
        while left > 0:
            # One sequence of the tile at a time: its rows share q_kbase.
            seg_kb = tl.min(tl.where(done, 2**31 - 1, kb))
            inseg = (done == 0) & (kb == seg_kb)
            seg_pos = tl.max(tl.where(inseg, pos, -1))
            # Ranked blocks: neither forced nor past the last row's own block, hence complete
            # and causal for every row that ranks them (no mask, no key past the sequence).
            b_hi = tl.minimum(lo + GB, seg_pos // BLK - LOCAL + 1)
            k_ptr = ki_ptr + seg_kb.to(tl.int64) * s_kt + j * s_kh
            m = tl.full([R], float("-inf"), tl.float32)
            for sub in range(tl.maximum(lo, INIT) * NSUB, b_hi * NSUB):  # sub-tiles of KS keys
                u = sub * KS + c
                kt = tl.load(k_ptr + u.to(tl.int64)[:, None] * s_kt + d[None, :])
                z = mma(q, tl.trans(kt), UPCAST, IEEE)
                m = _max_nan(m, tl.reduce(z, 1, _max_nan))
                if sub % NSUB == NSUB - 1:
                    # Scale after the max: exact (positive scale, monotone rounding).
                    tl.store(key_ptr + (sub // NSUB) * s_kb + brow, _rank_key(m * scale),
                             mask=inseg)
                    m = tl.full([R], float("-inf"), tl.float32)
            done = done | inseg
            left = tl.sum((done == 0).to(tl.int32))


@triton.jit
def _chunk_keys(key_ptr, row, own, col, s_kb, INIT, LOCAL: tl.constexpr):
    """``[rows, CB]`` ranking keys of blocks ``col`` (relative to the chunk; ``own`` and
    ``INIT`` too): buffer keys, forced blocks ``_FORCED_KEY``, blocks past ``own`` (and rows
    without blocks) ``_EMPTY_KEY``."""
    elig = col <= own[:, None]
    forced = (col > own[:, None] - LOCAL) | (col < INIT)
    key = tl.load(key_ptr + col * s_kb + row[:, None], mask=elig & (forced == 0),
                  other=_EMPTY_KEY)
    return tl.where(elig & forced, _FORCED_KEY, key)


@triton.jit(do_not_specialize=("t0", "n_rows"))
def _topk_kernel(
    key_ptr, qpos_ptr, out_ptr,
    t0, n_rows, s_kb, s_ot, s_oh,
    HI: tl.constexpr, BLK: tl.constexpr, TOPK: tl.constexpr, CB: tl.constexpr,
    INIT: tl.constexpr, LOCAL: tl.constexpr, ROWS: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = row < n_rows
    t = t0 + row // HI
    head = row % HI
    pos = tl.load(qpos_ptr + t, mask=valid, other=0)
    own = tl.where(valid, pos // BLK, -1)
    col = tl.arange(0, CB)[None, :]
    real = col < TOPK
    # Kept blocks: keys (padding slots past TOPK are forced: never the worst) and block ids
    # (empty slots hold distinct negative ids, so every id of a row is unique).
    keys = tl.where(real, _EMPTY_KEY, _FORCED_KEY) + tl.zeros([ROWS, CB], tl.int32)
    ids = -1 - col + tl.zeros([ROWS, CB], tl.int32)
    thresh = tl.full([ROWS], _EMPTY_KEY, tl.int32)  # the row's k-th key
    start = 0
    if TOPK == CB:  # the first CB blocks all fit: keep them without the insertion walk
        key = _chunk_keys(key_ptr, row, own, col, s_kb, INIT, LOCAL)
        keys = key
        ids = tl.where(key != _EMPTY_KEY, col, ids)
        thresh = tl.min(keys, axis=1)
        start = CB
    for c0 in range(start, tl.max(own) + 1, CB):
        key = _chunk_keys(key_ptr + c0 * s_kb, row, own - c0, col, s_kb, INIT - c0, LOCAL)
        hit = key > thresh[:, None]
        while tl.max(hit.to(tl.int32)) > 0:
            # The best remaining hit of each row: largest key, then lowest block.
            best = tl.max(tl.where(hit, key, _EMPTY_KEY), axis=1)
            pick = tl.min(tl.where(hit & (key == best[:, None]), col, CB), axis=1)
            # Evict the worst kept block: lowest key, among equal keys the highest block.
            worst = real & (keys == thresh[:, None])
            wid = tl.max(tl.where(worst, ids, -(2**31)), axis=1)
            upd = (pick < CB)[:, None] & worst & (ids == wid[:, None])
            keys = tl.where(upd, best[:, None], keys)
            ids = tl.where(upd, (c0 + pick)[:, None], ids)
            thresh = tl.min(tl.where(real, keys, _FORCED_KEY), axis=1)
            hit = hit & (col != pick[:, None]) & (key > thresh[:, None])
    # Ascending block numbers, -1 in unused slots.
    picked = tl.sort(tl.where(ids >= 0, ids, _NO_BLOCK), dim=1)
    picked = tl.where(picked == _NO_BLOCK, -1, picked)
    out_off = t.to(tl.int64)[:, None] * s_ot + head[:, None] * s_oh + col
    tl.store(out_ptr + out_off, picked, mask=valid[:, None] & real)


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

    Raises:
        ValueError: ``local_blocks < 1`` or ``top_k < init_blocks + local_blocks`` (the
            block-key kernel never scores a query's own block, which must be forced).

    Working memory: one ``[blocks, chunk tokens x Hi]`` int32 buffer of at most
    :data:`KEY_BUFFER_BYTES` (``blocks = ceil(Tk / block_size)``), at least
    :data:`MIN_CHUNK_TOKENS` tokens; longer inputs are processed in chunks of query tokens.
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
    wide = q_idx.dtype.itemsize <= 2
    tok = max(1, (SELECT_ROWS if wide else SELECT_ROWS_FP32) // hr)  # rows >= 16 for tl.dot
    rows = tok * hr
    if local_blocks < 1 or top_k < init_blocks + local_blocks:
        raise ValueError(f"select_blocks_triton: needs local_blocks >= 1 and top_k >= "
                         f"init_blocks + local_blocks, got top_k {top_k}, init_blocks "
                         f"{init_blocks}, local_blocks {local_blocks}")
    ks = min(SELECT_KEY_SUBTILE if wide else 64, block_size)
    n_blocks = triton.cdiv(max(Tk, 1), block_size)
    # Chunk of query tokens: a multiple of the tile, its keys within the buffer budget.
    chunk = max(KEY_BUFFER_BYTES // (4 * n_blocks * Hi), MIN_CHUNK_TOKENS) // tok * tok
    chunk = min(max(chunk, tok), triton.cdiv(Tq, tok) * tok, 65535 * tok,  # grid axis 1
                max(tok, (2**31 - 1) // (n_blocks * Hi) // tok * tok))  # int32 offsets
    keys = torch.empty((n_blocks, chunk * Hi), dtype=torch.int32, device=q_idx.device)
    upcast, ieee = dot_flags(q_idx.dtype)
    cb = max(TOPK_CHUNK, next_pow2(top_k))
    topk_rows = max(4, TOPK_ROWS * 16 // max(cb, 16))  # top_k > 16: fewer rows per warp
    for t0 in range(0, Tq, chunk):
        t1 = min(Tq, t0 + chunk)
        grid = (triton.cdiv(n_blocks, GROUP_BLOCKS), triton.cdiv(t1 - t0, tok), Hik)
        _block_keys_kernel[grid](
            q_idx, k_idx, q_pos, q_kbase, keys, t0, t1, float(index_scale),
            q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1), keys.stride(0),
            HI=Hi, HPK=hpk, HR=hr, TOK=tok, DI=Di, BLK=block_size, KS=ks, GB=GROUP_BLOCKS,
            INIT=init_blocks, LOCAL=local_blocks, UPCAST=upcast, IEEE=ieee,
            num_warps=min(SELECT_WARPS, max(4, rows // 16)) if wide else 4,
            num_stages=SELECT_STAGES if wide else 1,
        )
        n_rows = (t1 - t0) * Hi
        _topk_kernel[(triton.cdiv(n_rows, topk_rows),)](
            keys, q_pos, out, t0, n_rows, keys.stride(0), out.stride(0), out.stride(1),
            HI=Hi, BLK=block_size, TOPK=top_k, CB=cb, INIT=init_blocks, LOCAL=local_blocks,
            ROWS=topk_rows, num_warps=TOPK_WARPS,
        )
    return out
