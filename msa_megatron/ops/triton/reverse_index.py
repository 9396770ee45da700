"""Reverse index of a selection: for every selected key block, the (token, index head, slot)
pairs that chose it. Built with torch ops (one stable sort, no host sync) per chunk of queries.

The key-block-outer kernels walk it: one work item per key block and KV group (attention) or
per key block and unit of index heads (KL), so each item loads its K/V block once for all the
query rows that selected it, owns its key rows (dK, dV, dk_idx written without atomics) and
writes per-pair partial results that a fixed-order combine adds up: bitwise deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ReverseIndex:
    """Selected (token, index head, slot) pairs sorted by the key block they selected.

    Attributes:
        key: ``[P]`` sorted ``((g * Tk + start_row) * units_per_group + unit_in_group)``; pairs
            of unused slots sort last with key ``sentinel``.
        pair: ``[P]`` int32 flat index ``(t * Hi + i) * k + slot`` of each sorted pair.
        unit_lo, n_units: work items, one per (KV group, key block, unit of index heads): pairs
            ``unit_lo[w] .. unit_lo[w+1]`` for ``w < n_units`` (``n_units`` is ``[1]`` int32).
        max_items: host-side bound on the item count (sizes the persistent grids).
    """

    key: torch.Tensor
    pair: torch.Tensor
    unit_lo: torch.Tensor
    n_units: torch.Tensor
    max_items: int


def _segments(sorted_key: torch.Tensor, sentinel: int, max_items: int):
    """Start of each run of equal keys (``[max_items+1]`` int32) and the run count (``[1]``)."""
    flags = torch.ones_like(sorted_key, dtype=torch.bool)
    flags[1:] = sorted_key[1:] != sorted_key[:-1]
    run = torch.cumsum(flags, 0) - 1
    wanted = torch.arange(max_items + 1, device=sorted_key.device, dtype=run.dtype)
    lo = torch.searchsorted(run, wanted).to(torch.int32)
    count = (flags & (sorted_key != sentinel)).sum().to(torch.int32).reshape(1)
    return lo, count


def build_reverse_index(
    block_idx: torch.Tensor, q_pos: torch.Tensor, q_kbase: torch.Tensor, num_keys: int,
    block_size: int, num_kv_heads: int, unit_heads: int,
) -> ReverseIndex:
    """Sort the selected pairs of ``block_idx [Tq, Hi, k]`` by (KV group, key block, unit).

    ``block_idx``, ``q_pos`` and ``q_kbase`` may be a chunk of the queries: pair indices are
    relative to the chunk.

    Args:
        block_idx: ``[Tq, Hi, k]`` int32 selection (``-1`` unused; blocks past the query's own
            block are ignored as unused).
        q_pos, q_kbase: ``[Tq]`` int32 query layout.
        num_keys: Tk, rows of the key buffer.
        block_size: B.
        num_kv_heads: Hkv.
        unit_heads: index heads per unit (a divisor of ``Hi/Hkv``; ``Hi/Hkv`` gives one item
            per (KV group, key block), as the attention kernels use).
    """
    Tq, Hi, K = block_idx.shape
    dev = block_idx.device
    ipg = Hi // num_kv_heads
    upg = ipg // unit_heads
    blk = block_idx.to(torch.int64)
    pos = q_pos.to(torch.int64)[:, None, None]
    start = q_kbase.to(torch.int64)[:, None, None] + blk * block_size
    head = torch.arange(Hi, device=dev, dtype=torch.int64)[None, :, None]
    key = ((head // ipg) * num_keys + start) * upg + (head % ipg) // unit_heads
    sentinel = num_kv_heads * num_keys * upg
    key = torch.where((blk >= 0) & (blk * block_size <= pos), key, sentinel).reshape(-1)
    if sentinel < 2**31 - 1:
        key = key.to(torch.int32)
    key, order = torch.sort(key, stable=True)
    max_items = max(1, min(key.numel(), num_kv_heads * upg * num_keys))
    unit_lo, n_units = _segments(key, sentinel, max_items)
    return ReverseIndex(key, order.to(torch.int32), unit_lo, n_units, max_items)


def query_tile_ranges(
    q_pos: torch.Tensor, q_kbase: torch.Tensor, num_keys: int, tokens: int, key_tile: int,
) -> tuple:
    """For dense mode: which query tiles can see each key tile (no host sync).

    Query tile ``a`` holds query rows ``a*tokens .. (a+1)*tokens - 1``; key tile ``n`` holds key
    rows ``n*key_tile ..``. Returns ``(lo, hi)``, ``[cdiv(Tk, key_tile)]`` int32 each: the query
    tiles outside ``[lo, hi)`` have no key of tile ``n`` in any row's causal range. Exact for
    any layout (prefix max of the tiles' highest key row, suffix min of their lowest).
    """
    Tq = q_pos.numel()
    dev = q_pos.device
    n_tiles = -(-Tq // tokens)
    pad = n_tiles * tokens - Tq
    kb = q_kbase.to(torch.int64)
    reach = kb + q_pos.to(torch.int64)
    kb = torch.nn.functional.pad(kb, (0, pad), value=num_keys)
    reach = torch.nn.functional.pad(reach, (0, pad), value=-1)
    reach_max = torch.cummax(reach.view(n_tiles, tokens).amax(1), 0).values
    tile_min = torch.flip(kb.view(n_tiles, tokens).amin(1), (0,))
    base_min = torch.flip(torch.cummin(tile_min, 0).values, (0,))
    first = torch.arange(0, num_keys, key_tile, device=dev, dtype=torch.int64)
    lo = torch.searchsorted(reach_max, first)
    hi = torch.searchsorted(base_min, first + key_tile - 1, right=True)
    return lo.to(torch.int32), hi.to(torch.int32)
