"""Order of the main backward's items (:func:`msa_megatron.ops.triton.backward.largest_first`)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron.layout import query_layout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _selection(q_pos, hi, top_k, block, gen):
    """Valid selections: the own block plus random earlier ones, ascending, -1 padded."""
    out = torch.full((q_pos.numel(), hi, top_k), -1, dtype=torch.int32)
    for t, own in enumerate((q_pos.long() // block).tolist()):
        for i in range(hi):
            earlier = torch.randperm(own, generator=gen)[:top_k - 1]
            pick = torch.cat([earlier, torch.tensor([own])]).sort().values
            out[t, i, :pick.numel()] = pick.to(torch.int32)
    return out.to(DEVICE)


@pytest.mark.parametrize("hkv", [1, 2])
def test_largest_first_lists_each_chunks_groups_by_pair_count(hkv):
    from msa_megatron.ops.triton import backward
    from msa_megatron.ops.triton import reverse_index as ri

    lens, hi, top_k, block = [150, 0, 97], 2, 3, 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEVICE)
    total = sum(lens)
    q_pos, q_kbase = query_layout(cu, total, DEVICE)
    block_idx = _selection(q_pos.cpu(), hi, top_k, block, torch.Generator().manual_seed(3))
    rev = ri.build_reverse_index(block_idx, q_pos, q_kbase, total, block, hkv)
    ipg, nb = rev.ipg, int(rev.meta[3])
    off, nt = rev.off.cpu().tolist(), int(rev.meta[1])
    sub_t0 = rev.sub_t0.cpu().tolist()
    tokens = (rev.pair[:off[nb * nt]] // (hi * top_k)).cpu()
    n_groups = rev.max_buckets // ipg
    for chunks in (1, 2, 16):
        groups, count = backward.largest_first(rev, chunks)
        assert backward.largest_first(rev, chunks)[0] is groups  # cached per index
        base, base_count = ri.chunk_groups(rev, chunks)
        assert groups.shape == (chunks, n_groups) and torch.equal(count, base_count)
        step = ri.SUB_CHUNKS // chunks
        for c in range(chunks):
            a, b = c * step * (nt // ri.SUB_CHUNKS), (c + 1) * step * (nt // ri.SUB_CHUNKS)
            pairs = [sum(off[bk * nt + b] - off[bk * nt + a]
                         for bk in range(gb * ipg, gb * ipg + ipg) if bk < nb)
                     for gb in range(n_groups)]
            row, n = groups[c].tolist(), int(count[c])
            assert sorted(row) == list(range(n_groups))  # a permutation
            assert sorted(row[:n]) == sorted(base[c, :n].tolist())  # the non-empty groups
            got = [pairs[gb] for gb in row]
            assert got == sorted(got, reverse=True) and min(got[:n], default=1) > 0
            # all of the chunk's pairs, counted from the pairs' tokens
            t0, t1 = sub_t0[c * step], sub_t0[(c + 1) * step]
            assert sum(got) == int(((tokens >= t0) & (tokens < t1)).sum())
    with pytest.raises(ValueError, match="chunks"):
        backward.largest_first(rev, 3)


@pytest.mark.parametrize("units, min_tiles", [(4, 1), (3, 2), (64, 1), (1, 1), (5, 100)])
def test_split_query_tiles_cuts_each_tiles_range_in_order(units, min_tiles):
    """The dense dK/dV split (:func:`msa_megatron.ops.triton.backward.split_query_tiles`): a
    tile's first slice and its extra units cover its query tiles once, in order, in slices of
    ``L = max(ceil(V / units), min_tiles)``; at most ``units`` extra units; the sum list names
    every tile with extra units, ascending, with its first unit and count."""
    from msa_megatron.ops.triton import backward

    lo = torch.tensor([0, 2, 5, 9, 9, 0, 3, 0], dtype=torch.int32, device=DEVICE)
    hi = torch.tensor([10, 9, 6, 9, 3, 4, 30, 1], dtype=torch.int32, device=DEVICE)
    nt = lo.numel()
    first_hi, unit, sums = backward.split_query_tiles(lo, hi, units, min_tiles)
    assert unit.shape == sums.shape == (3, units) and first_hi.shape == (nt,)
    count = (hi - lo).clamp_min(0).cpu()
    span = max(-(-int(count.sum()) // units), min_tiles)
    unit, sums, first_hi = unit.cpu(), sums.cpu(), first_hi.cpu()
    used = unit[0] < nt
    assert not used[used.sum():].any()  # used units first
    assert (unit[1:, ~used] == 0).all()
    listed = []
    for n in range(nt):
        slices = [(int(lo[n]), int(first_hi[n]))]
        slices += [(int(a), int(b)) for t, a, b in unit[:, used].T.tolist() if t == n]
        want = [(a, min(a + span, int(hi[n]))) for a in range(int(lo[n]), int(hi[n]), span)]
        if count[n] == 0:
            assert slices[0][0] >= slices[0][1] and len(slices) == 1
        else:
            assert slices == want, n
        if len(slices) > 1:
            units_of_n = (unit[0] == n).nonzero().flatten().tolist()
            listed.append([n, units_of_n[0], len(units_of_n)])
            assert units_of_n == list(range(units_of_n[0], units_of_n[0] + len(units_of_n)))
    assert int(used.sum()) <= units
    has = sums[0] < nt
    assert sums[:, has].T.tolist() == listed and not has[len(listed):].any()
    with pytest.raises(ValueError, match="units"):
        backward.split_query_tiles(lo, hi, 0, 1)
    with pytest.raises(ValueError, match="NT"):
        backward.split_query_tiles(lo[:0], hi[:0], 4, 1)
