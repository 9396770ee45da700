"""The GPU reverse index (counting sort) against a plain-Python sort of the same pairs."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron.layout import query_layout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _selection(q_pos, hi, top_k, block, gen):
    """Random valid selections, ascending, -1 padded, plus a few slots past the own block."""
    tq = q_pos.numel()
    own = (q_pos.long() // block)
    out = torch.full((tq, hi, top_k), -1, dtype=torch.int32)
    for t in range(tq):
        for i in range(hi):
            n = int(own[t]) + 1
            pick = torch.randperm(n + 2, generator=gen)[:min(top_k, n)].sort().values
            out[t, i, :pick.numel()] = pick.to(torch.int32)  # may hold blocks past the own one
    return out.to(DEVICE)


def _full(block_idx, q_pos, block):
    """Rows whose selection holds every block of their causal prefix (the dense kernels')."""
    tq, hi, _ = block_idx.shape
    return torch.tensor([[set(block_idx[t, i].tolist()) - {-1} == set(range(int(q_pos[t]) // block
                                                                         + 1))
                          for i in range(hi)] for t in range(tq)])


def _expected(block_idx, q_pos, q_kbase, block, hkv):
    """Used pairs of rows that are not full, stable-sorted by (KV group, start row, index head
    in group)."""
    tq, hi, k = block_idx.shape
    ipg = hi // hkv
    full = _full(block_idx, q_pos, block)
    keys, flats = [], []
    for t in range(tq):
        for i in range(hi):
            if full[t, i]:
                continue
            for s in range(k):
                b = int(block_idx[t, i, s])
                if b < 0 or b * block > int(q_pos[t]):
                    continue
                keys.append((i // ipg, int(q_kbase[t]) + b * block, i % ipg))
                flats.append((t * hi + i) * k + s)
    order = sorted(range(len(flats)), key=lambda n: (keys[n], flats[n]))
    return [flats[n] for n in order], [keys[n] for n in order]


LAYOUTS = [
    # lens (THD) or None for a CP-like layout, Hi, Hkv, k, block
    ([70, 0, 33, 1, 50], 4, 2, 3, 16),
    ([120], 2, 1, 4, 16),
    (None, 2, 2, 2, 16),
    ([200], 4, 1, 20, 16),  # 80 entries per token: a scatter step ends inside a token
    ([60], 16, 1, 65, 16),  # Hi * top_k = 1040 > 1024 (was Triton's tensor-size limit)
]


@pytest.mark.parametrize("tile_tokens", [128, 2])
@pytest.mark.parametrize("case", LAYOUTS, ids=lambda c: str(c[0]))
def test_reverse_index_is_a_stable_counting_sort(case, tile_tokens, monkeypatch):
    from msa_megatron.ops.triton import reverse_index as ri

    monkeypatch.setattr(ri, "TILE_TOKENS", tile_tokens)
    monkeypatch.setattr(ri, "ITEM_PAIRS", 5)
    lens, hi, hkv, k, block = case
    gen = torch.Generator().manual_seed(7)
    if lens is None:  # chunks 0 and 3 of 4 of one 128-token sequence (CP 2, rank 0)
        rows = torch.cat([torch.arange(0, 32), torch.arange(96, 128)])
        q_pos = rows.to(torch.int32).to(DEVICE)
        q_kbase = torch.zeros_like(q_pos)
        tk = 128
    else:
        tk = sum(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                          device=DEVICE)
        q_pos, q_kbase = query_layout(cu, tk, DEVICE)
    block_idx = _selection(q_pos.cpu(), hi, k, block, gen)
    rev = ri.build_reverse_index(block_idx, q_pos, q_kbase, tk, block, hkv)
    full = _full(block_idx.cpu(), q_pos.cpu(), block)
    assert torch.equal(rev.full.cpu().bool(), full)
    assert 0 < int(full.sum()) < full.numel()  # both paths are exercised
    want, keys = _expected(block_idx.cpu(), q_pos.cpu(), q_kbase.cpu(), block, hkv)
    n = len(want)
    assert rev.pair[:n].tolist() == want
    ns, nt, ts, nb = rev.meta.tolist()
    assert nt % ri.SUB_CHUNKS == 0 and ts * nt >= q_pos.numel()
    if tile_tokens == 2:
        assert nt > ri.SUB_CHUNKS  # several tiles per sub-chunk were exercised
    starts = rev.starts[:ns].tolist()
    ipg = hi // hkv
    # Cells: bucket-major, tile-minor, covering exactly the sorted list.
    off = rev.off.tolist()
    assert off[0] == 0 and off[nb * nt] == n
    for pos in range(n):
        g, s, il = keys[pos]
        bucket = (g * ns + starts.index(s)) * ipg + il
        assert off[bucket * nt] <= pos < off[(bucket + 1) * nt]
    # Items: within one bucket and one sub-chunk, at most ITEM_PAIRS, covering every pair once.
    sub_item, sub_t0 = rev.sub_item.tolist(), rev.sub_t0.tolist()
    assert sub_t0[0] == 0 and sub_t0[-1] == q_pos.numel()
    seen = torch.zeros(n, dtype=torch.int64)
    per_tok = hi * k
    for sc in range(ri.SUB_CHUNKS):
        for w in range(sub_item[sc], sub_item[sc + 1]):
            cell = int(rev.item_cell[w])
            j = w - int(rev.cell_start[cell])
            assert cell // rev.max_buckets == sc
            b = cell % rev.max_buckets
            lo, hi_ = off[b * nt + sc * nt // 16] + 5 * j, off[b * nt + (sc + 1) * nt // 16]
            hi_ = min(hi_, lo + 5)
            assert 0 < hi_ - lo <= 5
            seen[lo:hi_] += 1
            for pos in range(lo, hi_):
                g, s, il = keys[pos]
                assert b == (g * ns + starts.index(s)) * ipg + il
                assert sub_t0[sc] <= want[pos] // per_tok < sub_t0[sc + 1]
    assert bool((seen == 1).all())
    # Per-chunk group lists: exactly the (KV group, start row) numbers with pairs in the chunk,
    # ascending, then the others (a permutation).
    n_groups = rev.max_buckets // ipg
    for chunks in (1, 2, 16):
        groups, count = ri.chunk_groups(rev, chunks)
        assert groups.shape == (chunks, n_groups) and count.shape == (chunks,)
        again = ri.chunk_groups(rev, chunks)  # built once per index (backward and KL share)
        assert again[0] is groups and again[1] is count
        step = ri.SUB_CHUNKS // chunks
        for c in range(chunks):
            t0, t1 = sub_t0[c * step], sub_t0[(c + 1) * step]
            used = sorted({(keys[pos][0] * ns + starts.index(keys[pos][1]))
                           for pos in range(n) if t0 <= want[pos] // per_tok < t1})
            row = groups[c].tolist()
            assert int(count[c]) == len(used) and row[:len(used)] == used
            assert sorted(row) == list(range(n_groups))
    with pytest.raises(ValueError, match="chunks"):
        ri.chunk_groups(rev, 3)


def test_reverse_index_is_cached_per_selection():
    from msa_megatron.ops.triton import reverse_index as ri

    cu = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    q_pos, q_kbase = query_layout(cu, 40, DEVICE)
    block_idx = _selection(q_pos.cpu(), 2, 2, 16, torch.Generator().manual_seed(1))
    first = ri.build_reverse_index(block_idx, q_pos, q_kbase, 40, 16, 1)
    assert ri.build_reverse_index(block_idx, q_pos, q_kbase, 40, 16, 1) is first
    block_idx.add_(0)  # an in-place write (version bump) invalidates the cached index
    assert ri.build_reverse_index(block_idx, q_pos, q_kbase, 40, 16, 1) is not first


def test_reverse_index_of_inference_tensors_is_built_not_cached():
    """Tensors made under ``torch.inference_mode()`` have no version counter, so the cache key
    could not be read ("Inference tensors do not track version counter"): the index is built
    every time instead, and equals the one of normal tensors."""
    from msa_megatron.ops.triton import reverse_index as ri

    cu = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    q_pos, q_kbase = query_layout(cu, 40, DEVICE)
    block_idx = _selection(q_pos.cpu(), 2, 2, 16, torch.Generator().manual_seed(1))
    expected = ri.build_reverse_index(block_idx, q_pos, q_kbase, 40, 16, 1)
    with torch.inference_mode():
        inf_idx, inf_pos, inf_kbase = block_idx.clone(), q_pos.clone(), q_kbase.clone()
        first = ri.build_reverse_index(inf_idx, inf_pos, inf_kbase, 40, 16, 1)
        inf_idx.add_(0)  # no version bump to see: a cached index could go stale unnoticed
        assert ri.build_reverse_index(inf_idx, inf_pos, inf_kbase, 40, 16, 1) is not first
    used = int(expected.off[-1])  # the tail of ``pair`` is unused
    assert torch.equal(first.off, expected.off)
    assert torch.equal(first.pair[:used], expected.pair[:used])


def test_msa_attention_runs_under_inference_mode():
    """Evaluation under ``torch.inference_mode()`` with the triton backend (the default on
    CUDA) gives the torch backend's result."""
    from msa_megatron import msa_attention

    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(37, h, 16, generator=gen).to(DEVICE) for h in (4, 2, 2, 2, 1)]
    cu = torch.tensor([0, 20, 37], dtype=torch.int32, device=DEVICE)
    with torch.inference_mode():
        out, kl = msa_attention(*xs, cu, block_size=16, top_k=2, backend="triton")
    ref_out, ref_kl = msa_attention(*xs, cu, block_size=16, top_k=2, backend="torch")
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kl, ref_kl, atol=1e-6, rtol=1e-5)


def test_partial_budget_is_four_q_capped():
    """Chunks of the paper config's backward partials (Hq 64, D 128, bf16, k 16, B 128:
    256 KiB per token, 16x q): 4 up to 128K tokens (budget 4x q), 16 at 1M (budget capped at
    8 GiB, so each chunk holds 1x q: half the 2x-q buffer)."""
    from msa_megatron.ops.triton import _common
    from msa_megatron.ops.triton import reverse_index as ri

    per_token_q, per_token_bwd = 64 * 128 * 2, 64 * 16 * 128 * 2
    got = {}
    for tokens in (8192, 32768, 131072, 1 << 20):
        q_bytes = tokens * per_token_q
        budget = _common.partial_budget(q_bytes)
        assert budget == max(min(4 * q_bytes, 8 << 30), 64 << 20)
        got[tokens] = ri.chunk_count(tokens * per_token_bwd, budget)
    assert got == {8192: 4, 32768: 4, 131072: 4, 1 << 20: 16}
    million = (1 << 20) * per_token_bwd
    assert million // got[1 << 20] == 16 << 30  # 2x q: 8 chunks of 32 GiB
    assert million // got[1 << 20] < million // ri.chunk_count(million, 2 * (16 << 30))
    assert _common.partial_budget(1) == _common.PARTIAL_MIN_BYTES
