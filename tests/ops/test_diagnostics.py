"""Selection-quality diagnostics (msa_megatron/diagnostics.py) against a brute-force oracle."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from msa_megatron.diagnostics import (
    distance_bins,
    distance_histogram,
    sample_rows,
    selection_recall,
)
from msa_megatron.reference import select_blocks_reference
from tests.support.inputs import make_inputs


def _teachers(inp, rows):
    """(row number r, position p in its sequence, index head i, teacher [p + 1] float64) for
    each sampled row and index head: the dense causal softmax of each query head over its
    sequence's prefix, averaged over the index head's query heads."""
    q, k, cu = inp["q"].double(), inp["k"].double(), inp["cu_seqlens"].tolist()
    Hq, Hkv, Hi, D = q.shape[1], k.shape[1], inp["q_idx"].shape[1], q.shape[2]
    for r, t in enumerate(rows.tolist()):
        seq = max(i for i in range(len(cu) - 1) if cu[i] <= t < cu[i + 1])
        start, p = cu[seq], t - cu[seq]
        for i in range(Hi):
            heads = range(i * Hq // Hi, (i + 1) * Hq // Hi)
            teacher = sum(torch.softmax((k[start:t + 1, h // (Hq // Hkv)] @ q[t, h]) * D ** -0.5, 0)
                          for h in heads)
            yield r, p, i, teacher / len(heads)


def _recall_oracle(inp, rows, block_size, top_k, backend_sel):
    """Per (row, index head): the teacher's mass over the selected blocks."""
    out = torch.zeros(len(rows), inp["q_idx"].shape[1], dtype=torch.float64)
    for r, p, i, teacher in _teachers(inp, rows):
        chosen = {b for b in backend_sel[rows[r], i].tolist() if b >= 0}
        out[r, i] = sum(float(teacher[u]) for u in range(p + 1) if u // block_size in chosen)
    return out


@pytest.mark.parametrize("lengths,heads,kv_heads,index_heads", [
    ((40, 7, 90), 4, 2, 2),     # a sequence shorter than a block, partial last blocks
    ((130,), 16, 1, 1),         # G = 16
    ((33, 64), 2, 2, 2),        # G = 1
])
def test_recall_matches_bruteforce(lengths, heads, kv_heads, index_heads, seed):
    inp = make_inputs(lengths, heads=heads, kv_heads=kv_heads, index_heads=index_heads,
                      dtype=torch.float64, seed=seed, requires_grad=False)
    T = sum(lengths)
    rows = sample_rows(T, 25, torch.Generator().manual_seed(seed))
    opts = dict(block_size=16, top_k=3)
    sample = selection_recall(inp["q"], inp["k"], inp["q_idx"], inp["k_idx"], rows,
                              inp["cu_seqlens"], backend="reference", **opts)
    full_sel = select_blocks_reference(inp["q_idx"], inp["k_idx"], inp["cu_seqlens"], **opts)
    assert torch.equal(sample.block_idx, full_sel[rows])
    expected = _recall_oracle(inp, rows, 16, 3, full_sel)
    torch.testing.assert_close(sample.recall.double(), expected, rtol=1e-5, atol=1e-6)
    assert sample.recall.shape == (rows.numel(), index_heads)
    assert torch.all(sample.recall <= 1 + 1e-6) and torch.all(sample.recall >= 0)


def test_recall_is_one_when_every_block_is_selected(seed):
    inp = make_inputs((50, 100), seed=seed, requires_grad=False)
    rows = torch.arange(150)
    sample = selection_recall(inp["q"], inp["k"], inp["q_idx"], inp["k_idx"], rows,
                              inp["cu_seqlens"], block_size=16, top_k=7, backend="torch")
    torch.testing.assert_close(sample.recall, torch.ones_like(sample.recall))
    torch.testing.assert_close(sample.best_recall, torch.ones_like(sample.recall))
    # With one block (the own one) only, the recall is the mass of the own block: < 1 somewhere.
    own = selection_recall(inp["q"], inp["k"], inp["q_idx"], inp["k_idx"], rows,
                           inp["cu_seqlens"], block_size=16, top_k=1, backend="torch")
    assert float(own.recall.min()) < 0.99


def _best_oracle(inp, rows, block_size, top_k, init_blocks, local_blocks):
    """Per (row, index head): the largest teacher mass over every selection the spec allows
    (the forced blocks and any ``top_k - #forced`` other eligible blocks), by enumeration."""
    out = torch.zeros(len(rows), inp["q_idx"].shape[1], dtype=torch.float64)
    for r, p, i, teacher in _teachers(inp, rows):
        own = p // block_size
        forced = {b for b in range(own + 1) if b < init_blocks or b > own - local_blocks}
        others = [b for b in range(own + 1) if b not in forced]
        mass = [float(teacher[b * block_size:(b + 1) * block_size].sum()) for b in range(own + 1)]
        slots = max(top_k - len(forced), 0)
        best = max(sum(mass[b] for b in chosen)
                   for chosen in itertools.combinations(others, min(slots, len(others))))
        out[r, i] = sum(mass[b] for b in forced) + best
    return out


@pytest.mark.parametrize("lengths,top_k,init_blocks,local_blocks", [
    ((40, 7, 90), 3, 0, 1),
    ((130,), 4, 1, 2),      # sink and two local blocks forced
    ((100, 60), 2, 1, 1),   # the forced blocks fill the budget
])
def test_best_recall_is_the_best_allowed_selection(lengths, top_k, init_blocks, local_blocks,
                                                   seed):
    inp = make_inputs(lengths, heads=4, kv_heads=2, index_heads=2, dtype=torch.float64,
                      seed=seed, requires_grad=False)
    rows = sample_rows(sum(lengths), 20, torch.Generator().manual_seed(seed))
    sample = selection_recall(inp["q"], inp["k"], inp["q_idx"], inp["k_idx"], rows,
                              inp["cu_seqlens"], block_size=16, top_k=top_k,
                              init_blocks=init_blocks, local_blocks=local_blocks,
                              backend="reference")
    expected = _best_oracle(inp, rows, 16, top_k, init_blocks, local_blocks)
    torch.testing.assert_close(sample.best_recall.double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.all(sample.recall <= sample.best_recall + 1e-6)
    if top_k > init_blocks + local_blocks:  # the random index misses the best blocks somewhere
        assert float((sample.best_recall - sample.recall).max()) > 1e-3
    else:  # the forced blocks fill the budget: every selection is the best one
        torch.testing.assert_close(sample.recall, sample.best_recall)


@pytest.mark.parametrize("options,message", [
    (dict(block_size=0, top_k=2), "block_size"),
    (dict(block_size=16, top_k=0), "top_k (0) must be >= init_blocks + local_blocks"),
    (dict(block_size=16, top_k=1, init_blocks=1), "top_k (1) must be >= init_blocks"),
    (dict(block_size=16, top_k=2, local_blocks=0), "local_blocks must be >= 1"),
])
def test_recall_rejects_a_selection_the_layer_would_refuse(options, message):
    inp = make_inputs((40,), requires_grad=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        selection_recall(inp["q"], inp["k"], inp["q_idx"], inp["k_idx"], torch.arange(4),
                         inp["cu_seqlens"], backend="torch", **options)


def test_recall_rejects_bad_rows():
    inp = make_inputs((20,), requires_grad=False)
    args = (inp["q"], inp["k"], inp["q_idx"], inp["k_idx"])
    with pytest.raises(ValueError, match="rows must lie"):
        selection_recall(*args, torch.tensor([0, 20]), block_size=16, top_k=1)
    with pytest.raises(ValueError, match="1-D integer"):
        selection_recall(*args, torch.tensor([0.0]), block_size=16, top_k=1)
    with pytest.raises(ValueError, match="positive"):
        sample_rows(10, 0)


def test_recall_checks_the_backend_like_the_layer():
    """The probe runs the selection itself: a backend that cannot run the inputs is refused
    with the layer's own message, not a kernel error (triton: index head dim 96)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # triton's own limit, not the device
    inp = make_inputs((40,), index_head_dim=96, requires_grad=False, device=device)
    args = (inp["q"], inp["k"], inp["q_idx"], inp["k_idx"], torch.tensor([3, 30], device=device))
    with pytest.raises(ValueError, match="supports Di in"):
        selection_recall(*args, block_size=16, top_k=2, backend="triton")
    assert selection_recall(*args, block_size=16, top_k=2, backend="torch").recall.shape == (2, 2)


def test_distance_histogram_bins():
    # Query in block 9 (B = 16, position 150): own 9, neighbour 8, sink 0, 7 -> "2-3",
    # 3 and 2 -> "4-7"; unused slots are ignored.
    block_idx = torch.tensor([[[0, 2, 3, 7, 8, 9, -1]]], dtype=torch.int32)
    counts = distance_histogram(block_idx, torch.tensor([150]), 16, max_distance=9)
    assert list(counts) == distance_bins(9) == ["own", "neighbour", "sink", "2-3", "4-7", "8-15"]
    assert counts == {"own": 1, "neighbour": 1, "sink": 1, "2-3": 1, "4-7": 2, "8-15": 0}
