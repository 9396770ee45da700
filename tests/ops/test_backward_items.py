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
