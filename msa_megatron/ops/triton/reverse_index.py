"""Reverse index of a selection, built on the GPU by a counting sort (no sort, no host sync).

For every selected key block, the (token, index head, slot) pairs that chose it. One index is
built per selection (per layer) and reused by the forward, the backward and the KL. Rows
(token, index head) whose selection holds every block of their causal prefix ("full" rows,
e.g. the first ``k * B`` positions of a sequence) are left out: the dense kernels compute them.

Buckets. A pair of token ``t`` and index head ``i`` selecting block ``b`` reads key rows
``s .. s + B - 1`` with ``s = q_kbase[t] + b * B`` (its start row). Start rows actually used
are numbered densely (``c``, ascending ``s``; ``NS`` of them) and a bucket is ``(i, c)``,
numbered ``bucket = (g * NS + c) * IPG + i % IPG`` (``g = i // IPG`` the KV group), so the
buckets of a KV group (backward) or of a KL unit of index heads are consecutive.

Counting sort over (bucket, token tile). Tokens are cut in ``NT`` tiles of ``TS`` tokens (a
multiple of 16 tiles, chosen on the device from the number of buckets so the count matrix fits
a buffer sized from the shapes). Cell ``bucket * NT + tile`` is counted (integer atomics:
exact, order-free), exclusively scanned (cell-major: bucket, then tile), and one program per
tile scatters its pairs token by token, so a bucket lists its pairs token-ascending (then head,
slot): deterministic. Sizes: ``P = Tq * Hi * k`` pairs; the count matrix has
``max(P // 4, 16 * Hi * Tk)`` cells (every start row a bucket still leaves 16 tiles).

Work. The token range is also cut in 16 sub-chunks (each a run of tiles). Items of the
key-block-outer kernels that write per-pair results (forward partials, KL log-normalisers):
``(bucket, sub-chunk, up to ITEM_PAIRS pairs)``, listed sub-chunk by sub-chunk, so a launch
walks the token range in order (Q rows stay in L2) and every item is at most ``ITEM_PAIRS``
long (no long tail). Kernels that own key rows (dK/dV, dk_idx) take a whole bucket within a
chunk of sub-chunks, walking its cells (:func:`bucket_pairs`). A consumer that needs its
per-pair partials in chunks of tokens processes ``NC`` (a power of two <= 16) chunks of
``16 / NC`` sub-chunks each; :func:`chunk_tokens_bound` bounds a chunk's tokens.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ._common import next_pow2

# Sub-chunks of the token range (a chunk of a consumer is a power-of-two run of them).
SUB_CHUNKS = 16
# Fewest tokens per tile of the counting sort (tiles are scattered by one program each).
TILE_TOKENS = 128
# Pairs per item of the per-pair kernels (pairs of one index head and start row): 128 fills the
# KL pass A's 128-row tiles (64 left them half empty) and halves the per-item index loads and K/V
# reloads of the forward items.
ITEM_PAIRS = 128
# Entries (pairs) one step of the scatter handles at once.
_STEP_ENTRIES = 64


@dataclass
class ReverseIndex:
    """Selected pairs sorted by (bucket, token tile, token, head, slot); device-side sizes.

    Attributes:
        pair: ``[P]`` int32 flat pair ``(t * Hi + i) * k + slot`` in sorted order (unused
            slots, blocks past the query's own block and full rows are left out; the tail is
            unused).
        off: ``[cap + 1]`` int32 exclusive scan of the cell counts: cell ``bucket * NT + tile``
            holds ``pair[off[cell] : off[cell + 1]]``.
        starts: ``[Tk + 1]`` int32 start row of each dense start-row number ``c``.
        meta: ``[4]`` int32 ``(NS, NT, TS, Hi * NS)`` (the last: bucket count) on the device.
        sub_t0: ``[SUB_CHUNKS + 1]`` int32 first token of each sub-chunk (last = Tq).
        item_cell: ``[max_items]`` int32 per-pair work items, sub-chunk by sub-chunk: item
            ``w`` is piece ``w - cell_start[item_cell[w]]`` (``ITEM_PAIRS`` pairs each) of cell
            ``item_cell[w] = sc * max_buckets + bucket`` (:func:`item_pairs`).
        cell_start: ``[SUB_CHUNKS * max_buckets + 1]`` int32 first item of each such cell.
        sub_item: ``[SUB_CHUNKS + 1]`` int32 first item of each sub-chunk (last = item count).
        full: ``[Tq, Hi]`` int8, 1 for rows whose selection is their whole causal prefix: they
            are left out of the index and go through the dense kernels.
        ipg: index heads per KV group (buckets per KV group and start row).
        item_pairs: pairs per item (``ITEM_PAIRS`` when built).
        max_items, max_buckets, tq, max_tiles: host-side bounds (grid and buffer sizes).
        chunk_groups_cache: :func:`chunk_groups`' lists per ``chunks`` and the per-sub-chunk
            mask they come from (``"sub_chunks"``), filled on first use: built once per index
            for the backward and the KL (read-only tensors).
    """

    pair: torch.Tensor
    off: torch.Tensor
    starts: torch.Tensor
    meta: torch.Tensor
    sub_t0: torch.Tensor
    item_cell: torch.Tensor
    cell_start: torch.Tensor
    sub_item: torch.Tensor
    full: torch.Tensor
    ipg: int
    item_pairs: int
    max_items: int
    max_buckets: int
    tq: int
    max_tiles: int
    chunk_groups_cache: dict = field(default_factory=dict, repr=False, compare=False)

@triton.jit
def _pair_buckets(bidx_ptr, qpos_ptr, qkb_ptr, cid_ptr, full_ptr, e, t, Tq, NS,
                  HI: tl.constexpr, TOPK: tl.constexpr, BLK: tl.constexpr, IPG: tl.constexpr):
    """Bucket of each entry ``e`` (flat pair index, token ``t``) and whether it is used (rows
    marked full go through the dense kernels and are left out)."""
    inb = t < Tq
    blk = tl.load(bidx_ptr + e, mask=inb, other=-1)
    pos = tl.load(qpos_ptr + t, mask=inb, other=-1)
    kb = tl.load(qkb_ptr + t, mask=inb, other=0)
    head = e // TOPK % HI
    full = tl.load(full_ptr + e // TOPK, mask=inb, other=1)
    used = inb & (blk >= 0) & (blk * BLK <= pos) & (full == 0)
    c = tl.load(cid_ptr + kb + blk * BLK, mask=used, other=0)
    bucket = ((head // IPG) * NS + c) * IPG + head % IPG
    return bucket, used


@triton.jit(do_not_specialize=("P",))
def _flag_kernel(bidx_ptr, qpos_ptr, qkb_ptr, flag_ptr, P,
                 TOPK: tl.constexpr, HI: tl.constexpr, BLK: tl.constexpr, R: tl.constexpr):
    e = tl.program_id(0) * R + tl.arange(0, R)
    t = e // (HI * TOPK)
    inb = e < P
    blk = tl.load(bidx_ptr + e, mask=inb, other=-1)
    pos = tl.load(qpos_ptr + t, mask=inb, other=-1)
    kb = tl.load(qkb_ptr + t, mask=inb, other=0)
    used = inb & (blk >= 0) & (blk * BLK <= pos)
    tl.store(flag_ptr + kb + blk * BLK, tl.full([R], 1, tl.int32), mask=used)


@triton.jit(do_not_specialize=("Tk",))
def _starts_kernel(flag_ptr, cid_ptr, starts_ptr, Tk, R: tl.constexpr):
    s = tl.program_id(0) * R + tl.arange(0, R)
    f = tl.load(flag_ptr + s, mask=s < Tk, other=0)
    c = tl.load(cid_ptr + s, mask=s < Tk, other=0)
    tl.store(starts_ptr + c, s, mask=(s < Tk) & (f != 0))


@triton.jit(do_not_specialize=("Tq",))
def _count_kernel(bidx_ptr, qpos_ptr, qkb_ptr, cid_ptr, full_ptr, meta_ptr, cnt_ptr, Tq,
                  HI: tl.constexpr, TOPK: tl.constexpr, BLK: tl.constexpr, IPG: tl.constexpr,
                  R: tl.constexpr):
    tile = tl.program_id(0)
    NS = tl.load(meta_ptr)
    NT = tl.load(meta_ptr + 1)
    TS = tl.load(meta_ptr + 2)
    if tile < NT:
        e0 = tile * TS * (HI * TOPK)
        e1 = tl.minimum((tile + 1) * TS, Tq) * (HI * TOPK)
        for a in range(e0, e1, R):
            e = a + tl.arange(0, R)
            t = e // (HI * TOPK)
            bucket, used = _pair_buckets(bidx_ptr, qpos_ptr, qkb_ptr, cid_ptr, full_ptr, e, t,
                                         tl.minimum(Tq, (tile + 1) * TS), NS, HI, TOPK, BLK,
                                         IPG)
            tl.atomic_add(cnt_ptr + bucket.to(tl.int64) * NT + tile, 1, mask=used & (e < e1))


@triton.jit(do_not_specialize=("Tq",))
def _scatter_kernel(bidx_ptr, qpos_ptr, qkb_ptr, cid_ptr, full_ptr, meta_ptr, cur_ptr, pair_ptr,
                    Tq,
                    HI: tl.constexpr, TOPK: tl.constexpr, BLK: tl.constexpr, IPG: tl.constexpr,
                    R: tl.constexpr):
    """One program per tile, its entries ``R`` at a time in entry (= token, head, slot) order:
    stable within a cell. ``R`` is fixed, whatever ``Hi * top_k``: the rank below compares
    ``[R, R]`` pairs."""
    tile = tl.program_id(0)
    NS = tl.load(meta_ptr)
    NT = tl.load(meta_ptr + 1)
    TS = tl.load(meta_ptr + 2)
    if tile < NT:
        t1 = tl.minimum((tile + 1) * TS, Tq)
        r = tl.arange(0, R)
        per: tl.constexpr = HI * TOPK
        e1 = t1 * per
        for e0 in range(tile * TS * per, e1, R):
            e = e0 + r
            t = e // per
            bucket, used = _pair_buckets(bidx_ptr, qpos_ptr, qkb_ptr, cid_ptr, full_ptr, e, t, t1,
                                         NS, HI, TOPK, BLK, IPG)
            used = used & (e < e1)
            same = (bucket[:, None] == bucket[None, :]) & used[:, None] & used[None, :]
            rank = tl.sum((same & (r[None, :] < r[:, None])).to(tl.int32), axis=1)
            count = tl.sum(same.to(tl.int32), axis=1)
            cell = bucket.to(tl.int64) * NT + tile
            base = tl.load(cur_ptr + cell, mask=used, other=0, cache_modifier=".cg")
            tl.store(pair_ptr + base + rank, e, mask=used)
            tl.debug_barrier()
            tl.store(cur_ptr + cell, base + count, mask=used & (rank == count - 1))
            tl.debug_barrier()


@triton.jit
def bucket_pairs(off_ptr, meta_ptr, bucket, sc0, sc1, SUB: tl.constexpr):
    """``(lo, hi)`` of ``bucket``'s pairs in cells of tiles of sub-chunks ``sc0 .. sc1 - 1``
    (contiguous: cells are bucket-major)."""
    NT = tl.load(meta_ptr + 1)
    cell = bucket.to(tl.int64) * NT
    lo = tl.load(off_ptr + cell + sc0 * (NT // SUB))
    hi = tl.load(off_ptr + cell + sc1 * (NT // SUB))
    return lo, hi


@triton.jit
def bucket_rows(starts_ptr, meta_ptr, bucket, IPG: tl.constexpr):
    """``(g, index head, start row)`` of a bucket."""
    NS = tl.load(meta_ptr)
    gc = bucket // IPG
    g = gc // NS
    s = tl.load(starts_ptr + gc % NS)
    return g, g * IPG + bucket % IPG, s


@triton.jit
def item_pairs(item_cell_ptr, cell_start_ptr, off_ptr, meta_ptr, w, NBMAX, SUB: tl.constexpr,
               ITEM: tl.constexpr):
    """``(lo, hi, bucket)`` of per-pair item ``w``."""
    cell = tl.load(item_cell_ptr + w)
    j = w - tl.load(cell_start_ptr + cell)
    sc = cell // NBMAX
    bucket = cell % NBMAX
    lo, hi = bucket_pairs(off_ptr, meta_ptr, bucket, sc, sc + 1, SUB)
    lo = lo + j * ITEM
    return lo, tl.minimum(lo + ITEM, hi), bucket


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _full_rows(block_idx: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[Tq, Hi]`` int8: 1 where the row's selection holds every block of its causal prefix
    (always so when it has at most ``k`` blocks): the dense kernels compute such rows exactly,
    without partials. Any layout: only the row's own selection and position count."""
    Tq, Hi, K = block_idx.shape
    blk = block_idx.to(torch.int64)
    own = (q_pos.to(torch.int64) // block_size)[:, None, None]
    inside = (blk >= 0) & (blk <= own) & (blk < K)
    present = torch.zeros((Tq, Hi, K + 1), dtype=torch.bool, device=block_idx.device)
    present.scatter_(2, torch.where(inside, blk, K), True)
    need = torch.arange(K, device=block_idx.device)[None, None, :] <= own
    return ((present[:, :, :K] | ~need).all(2) & (own[:, :, 0] < K)).to(torch.int8)


def _build(block_idx, q_pos, q_kbase, num_keys, block_size, num_kv_heads):
    Tq, Hi, K = block_idx.shape
    dev = block_idx.device
    ipg = Hi // num_kv_heads
    P = Tq * Hi * K
    nb_max = Hi * num_keys  # buckets if every key row started a selected block
    cap = max(P // 4, SUB_CHUNKS * nb_max, 1)
    max_tiles = SUB_CHUNKS * triton.cdiv(triton.cdiv(max(Tq, 1), TILE_TOKENS), SUB_CHUNKS)
    i32 = torch.int32
    # Dense numbering of the used start rows.
    flag = torch.zeros(num_keys + 1, dtype=i32, device=dev)
    R = 1024
    if P:
        _flag_kernel[(triton.cdiv(P, R),)](block_idx, q_pos, q_kbase, flag, P, TOPK=K, HI=Hi,
                                          BLK=block_size, R=R)
    cid64 = _exclusive_cumsum(flag[:num_keys])
    cid = cid64.to(i32)
    n_starts = cid64[num_keys:]
    starts = torch.zeros(num_keys + 1, dtype=i32, device=dev)
    _starts_kernel[(triton.cdiv(max(num_keys, 1), R),)](flag, cid, starts, num_keys, R=R)
    # Tiles: a multiple of SUB_CHUNKS with the count matrix inside cap.
    n_buckets = (n_starts * Hi).clamp_min(1)
    nt = (torch.div(cap, n_buckets, rounding_mode="floor") // SUB_CHUNKS * SUB_CHUNKS)
    nt = nt.clamp(SUB_CHUNKS, max_tiles)
    ts = torch.div(Tq + nt - 1, nt, rounding_mode="floor")
    meta = torch.cat([n_starts, nt, ts, n_starts * Hi]).to(i32)
    counts = torch.zeros(cap, dtype=i32, device=dev)
    hpk = next_pow2(Hi * K)
    full = _full_rows(block_idx, q_pos, block_size)
    args = (block_idx, q_pos, q_kbase, cid, full, meta)
    consts = dict(HI=Hi, TOPK=K, BLK=block_size, IPG=ipg)
    _count_kernel[(max_tiles,)](*args, counts, Tq, R=max(hpk, 256), **consts)
    off = _exclusive_cumsum(counts).to(i32)
    cur = off.clone()
    pair = torch.empty(max(P, 1), dtype=i32, device=dev)
    _scatter_kernel[(max_tiles,)](*args, cur, pair, Tq, R=_STEP_ENTRIES, **consts)
    del cur
    # Sub-chunk token ranges.
    sc = torch.arange(SUB_CHUNKS + 1, device=dev, dtype=torch.int64)
    sub_t0 = (sc * (nt // SUB_CHUNKS) * ts).clamp_max(Tq).to(i32)
    # Per-pair items: (sub-chunk, bucket) cells split in ITEM_PAIRS (int32 throughout: every
    # value is <= cap or <= P).
    bb = torch.minimum(torch.arange(nb_max, device=dev, dtype=i32), n_buckets.to(i32))
    first = (bb[None, :] * nt.to(i32) + (sc * (nt // SUB_CHUNKS)).to(i32)[:, None]).clamp_max(cap)
    lo_cell = off[first]  # [SUB + 1, nb_max]; buckets past the last one read empty cells
    del first, bb
    n_items = torch.div(lo_cell[1:] - lo_cell[:-1] + (ITEM_PAIRS - 1), ITEM_PAIRS,
                        rounding_mode="floor").reshape(-1)
    del lo_cell
    max_items = P // ITEM_PAIRS + min(P, SUB_CHUNKS * nb_max) + 1
    cell_start = torch.zeros(n_items.numel() + 1, dtype=i32, device=dev)
    torch.cumsum(n_items, 0, dtype=i32, out=cell_start[1:])
    reps = torch.cat([n_items, max_items - cell_start[-1:]])
    item_cell = torch.repeat_interleave(torch.arange(reps.numel(), device=dev, dtype=i32), reps,
                                        output_size=max_items).to(i32)
    del reps, n_items
    sub_item = cell_start[sc * nb_max]
    return ReverseIndex(pair, off, starts, meta, sub_t0, item_cell, cell_start, sub_item, full,
                        ipg, ITEM_PAIRS, max_items, nb_max, Tq, max_tiles)


# id(block_idx) -> (weak reference, key, index); an entry dies with its tensor.
_CACHE: dict = {}


def build_reverse_index(
    block_idx: torch.Tensor, q_pos: torch.Tensor, q_kbase: torch.Tensor, num_keys: int,
    block_size: int, num_kv_heads: int,
) -> ReverseIndex:
    """Reverse index of ``block_idx [Tq, Hi, k]`` (cached on the tensor: built once per
    selection and reused by the forward, the KL and the backward while it is alive and
    unmodified; built every time for tensors made under ``torch.inference_mode()``, which have
    no version counter to tell an unmodified tensor by).

    Args:
        block_idx: ``[Tq, Hi, k]`` int32 contiguous selection (``-1`` unused; blocks past the
            query's own block are ignored as unused).
        q_pos, q_kbase: ``[Tq]`` int32 query layout.
        num_keys: Tk, rows of the key buffer.
        block_size: B.
        num_kv_heads: Hkv.
    """
    if block_idx.is_inference() or q_pos.is_inference() or q_kbase.is_inference():
        return _build(block_idx, q_pos, q_kbase, num_keys, block_size, num_kv_heads)
    key = (block_idx._version, q_pos.data_ptr(), q_kbase.data_ptr(), q_pos._version,
           q_kbase._version, num_keys, block_size, num_kv_heads)
    hit = _CACHE.get(id(block_idx))
    if hit is not None and hit[0]() is block_idx and hit[1] == key:
        return hit[2]
    rev = _build(block_idx, q_pos, q_kbase, num_keys, block_size, num_kv_heads)
    ident = id(block_idx)
    try:
        ref = weakref.ref(block_idx, lambda _, ident=ident: _CACHE.pop(ident, None))
    except TypeError:
        return rev
    _CACHE[ident] = (ref, key, rev)
    return rev


def chunk_count(total_bytes: int, budget: int) -> int:
    """Chunks (a power of two <= SUB_CHUNKS) so per-pair partials of ``total_bytes`` for all
    tokens come to about ``budget`` bytes per chunk (more when 16 chunks are not enough)."""
    need = max(1, -(-int(total_bytes) // max(1, int(budget))))
    return min(SUB_CHUNKS, next_pow2(need))


def chunk_tokens_bound(rev: ReverseIndex, chunks: int) -> int:
    """Most tokens one of ``chunks`` chunks can hold (tile rounding included)."""
    return min(rev.tq, -(-rev.tq // chunks) + -(-rev.max_tiles // chunks))


def chunk_groups(rev: ReverseIndex, chunks: int) -> tuple:
    """Per chunk of ``SUB_CHUNKS // chunks`` sub-chunks, the (KV group, start row) numbers
    ``gb`` (buckets ``gb * ipg .. gb * ipg + ipg - 1``) with at least one pair in the chunk, on
    the device (no host sync): the key-row-owning kernels walk only these (a causal selection
    leaves about half of all (group, start row, chunk) visits empty; visiting them also
    clumps the non-empty ones on a few persistent programs).

    Args:
        rev: the index.
        chunks: a power of two dividing ``SUB_CHUNKS``.

    Returns:
        ``(groups, count)``: ``groups [chunks, G]`` int32 (``G = max_buckets // ipg``), row
        ``c`` listing chunk ``c``'s non-empty ``gb`` ascending in its first ``count[c]``
        entries, then the empty ones; ``count [chunks]`` int32. Built once per index and
        ``chunks`` (cached on ``rev``: the backward and the KL share them; callers must not
        write to them).

    Raises:
        ValueError: ``chunks`` is not a power of two dividing ``SUB_CHUNKS``.
    """
    if chunks < 1 or SUB_CHUNKS % chunks or chunks & (chunks - 1):
        raise ValueError(f"chunks must be a power of two dividing {SUB_CHUNKS}, got {chunks}")
    cached = rev.chunk_groups_cache.get(chunks)
    if cached is not None:
        return cached
    dev = rev.off.device
    n_groups = rev.max_buckets // rev.ipg
    used = rev.chunk_groups_cache.get("sub_chunks")
    if used is None:  # [SUB_CHUNKS, G]: groups with a pair in each sub-chunk, once per index
        cap = rev.off.numel() - 1
        nt = rev.meta[1].to(torch.int64)
        bb = torch.minimum(torch.arange(n_groups * rev.ipg, device=dev, dtype=torch.int64),
                           rev.meta[3].to(torch.int64))  # buckets past the last read empty cells
        sc = torch.arange(0, SUB_CHUNKS + 1, device=dev, dtype=torch.int64)
        lo = rev.off[(bb[None, :] * nt + (sc * (nt // SUB_CHUNKS))[:, None]).clamp_max(cap)]
        used = (lo[1:] != lo[:-1]).view(SUB_CHUNKS, n_groups, rev.ipg).any(2)
        del lo, bb
        rev.chunk_groups_cache["sub_chunks"] = used
    # A chunk's cells are its sub-chunks' (offsets ascend): non-empty iff one of them is.
    used = used.view(chunks, SUB_CHUNKS // chunks, n_groups).any(1)  # [chunks, G]
    # A permutation per row (no index written twice): used groups first, then the others.
    cu = torch.cumsum(used, 1)
    count = cu[:, -1:]
    j = torch.arange(n_groups, device=dev, dtype=torch.int64)
    dest = torch.where(used, cu - 1, count + j - cu)
    groups = torch.empty((chunks, n_groups), dtype=torch.int32, device=dev)
    groups.scatter_(1, dest, j.to(torch.int32).expand(chunks, n_groups))
    result = (groups, count[:, 0].to(torch.int32))
    rev.chunk_groups_cache[chunks] = result
    return result


def query_tile_ranges(
    q_pos: torch.Tensor, q_kbase: torch.Tensor, num_keys: int, tokens: int, key_tile: int,
    present=None,
) -> tuple:
    """For dense mode: which query tiles can see each key tile (no host sync).

    Query tile ``a`` holds query rows ``a*tokens .. (a+1)*tokens - 1``; key tile ``n`` holds key
    rows ``n*key_tile ..``. Returns ``(lo, hi)``, ``[cdiv(Tk, key_tile)]`` int32 each: the query
    tiles outside ``[lo, hi)`` have no key of tile ``n`` in any row's causal range. Exact for
    any layout (prefix max of the tiles' highest key row, suffix min of their lowest).
    ``present [Tq]`` bool (optional): only these tokens count (the others see no key).
    """
    Tq = q_pos.numel()
    dev = q_pos.device
    n_tiles = -(-Tq // tokens)
    pad = n_tiles * tokens - Tq
    kb = q_kbase.to(torch.int64)
    reach = kb + q_pos.to(torch.int64)
    if present is not None:
        kb = torch.where(present, kb, num_keys)
        reach = torch.where(present, reach, -1)
    kb = torch.nn.functional.pad(kb, (0, pad), value=num_keys)
    reach = torch.nn.functional.pad(reach, (0, pad), value=-1)
    reach_max = torch.cummax(reach.view(n_tiles, tokens).amax(1), 0).values
    tile_min = torch.flip(kb.view(n_tiles, tokens).amin(1), (0,))
    base_min = torch.flip(torch.cummin(tile_min, 0).values, (0,))
    first = torch.arange(0, num_keys, key_tile, device=dev, dtype=torch.int64)
    lo = torch.searchsorted(reach_max, first)
    hi = torch.searchsorted(base_min, first + key_tile - 1, right=True)
    return lo.to(torch.int32), hi.to(torch.int32)
