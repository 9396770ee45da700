"""The per-layer store of checkpointed selections finds an entry by the inputs it was chosen
from (MSA_SPEC section 6): any order of recomputation, near-bitwise recomputation, boundaries,
the size cap and unmatched recomputations."""

from __future__ import annotations

import warnings

import pytest
import torch

from msa_megatron.megatron import selection_store
from msa_megatron.megatron.selection_store import SelectionStore, fingerprint, token_signs

T, HI, HIK, DI = 50, 4, 1, 8


def _inputs(seed: int, tokens: int = T):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, HI, DI, generator=gen), torch.randn(tokens, HIK, DI, generator=gen))


def _block_idx(seed: int, tokens: int = T):
    return torch.full((tokens, 2, 3), seed, dtype=torch.int32)


def test_token_signs_depend_on_position_only():
    long = token_signs(1000, torch.device("cpu")).clone()
    short = token_signs(7, torch.device("cpu"))
    assert torch.equal(long[:7], short)
    assert set(long.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(long.mean())) < 0.1  # balanced, so sums of different data differ


def test_fingerprint_sees_order_and_values():
    q, k = _inputs(0)
    base = fingerprint(q, k)
    assert base.shape == (HI * DI + HIK * DI,) and base.dtype == torch.float32
    swapped = q.clone()
    swapped[[3, 4]] = q[[4, 3]]
    assert not torch.allclose(fingerprint(swapped, k), base)  # a token order change shows


def test_fingerprint_in_chunks_equals_one_pass(monkeypatch):
    q, k = _inputs(0)
    whole = fingerprint(q, k)
    monkeypatch.setattr(selection_store, "_CHUNK_ELEMENTS", 3 * HI * DI)  # 3 tokens a chunk
    torch.testing.assert_close(fingerprint(q, k), whole, rtol=1e-6, atol=1e-5)
    signs = token_signs(T, q.device)
    torch.testing.assert_close(whole[:HI * DI], (signs[:, None, None] * q).sum(0).flatten())


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_take_returns_each_inputs_own_selection_in_any_order(order):
    store = SelectionStore(layer_number=3)
    inputs = [_inputs(seed) for seed in range(3)]
    for seed, (q, k) in enumerate(inputs):
        store.put(_block_idx(seed), q, k, None, None)
    for seed in order:
        got = store.take(*inputs[seed], None, None)
        assert got is not None and int(got[0, 0, 0]) == seed
    assert len(store) == 0


def test_close_recomputation_matches_and_different_data_does_not():
    store = SelectionStore()
    q, k = _inputs(0)
    store.put(_block_idx(0), q, k, None, None)
    # fp32-level differences in the recomputation still match
    noisy = (q * (1 + 1e-5 * torch.randn_like(q)), k * (1 + 1e-5 * torch.randn_like(k)))
    assert store.take(*noisy, None, None) is not None
    store.put(_block_idx(0), q, k, None, None)
    near = q.clone()
    near[7] = torch.randn(HI, DI)  # one token of another micro-batch differs
    fresh = SelectionStore()
    fresh.put(_block_idx(0), q, k, None, None)
    with pytest.warns(UserWarning, match="none chosen from the inputs"):
        assert fresh.take(near, k, None, None) is None
    with pytest.warns(UserWarning, match="none chosen from the inputs"):
        assert store.take(*_inputs(1), None, None) is None  # another micro-batch: reselect
    assert len(store) == 1  # the stored entry is kept for its own recomputation
    assert store.take(*_inputs(0, tokens=T - 1), None, None) is None  # other token count


def test_identical_inputs_take_the_oldest_first():
    store = SelectionStore()
    q, k = _inputs(0)
    store.put(_block_idx(7), q, k, None, None)
    store.put(_block_idx(8), q, k, None, None)
    assert int(store.take(q, k, None, None)[0, 0, 0]) == 7
    assert int(store.take(q, k, None, None)[0, 0, 0]) == 8


def test_boundaries_are_part_of_the_match():
    store = SelectionStore()
    q, k = _inputs(0)
    cu = torch.tensor([0, 20, T], dtype=torch.int32)
    store.put(_block_idx(0), q, k, cu, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.take(q, k, torch.tensor([0, 21, T], dtype=torch.int32), None) is None
        assert store.take(q, k, torch.tensor([0, 10, 20, T]), None) is None
        assert store.take(q, k, None, None) is None
        assert store.take(q, k, cu, cu) is None  # padded THD is not the same call
    assert store.take(q, k, cu.to(torch.int64), None) is not None  # values, not dtype


def test_store_is_capped_and_warns_once(monkeypatch):
    monkeypatch.setattr(selection_store, "MAX_STORED", 3)
    store = SelectionStore()
    inputs = [_inputs(seed) for seed in range(5)]
    with pytest.warns(UserWarning, match="oldest was dropped") as record:
        for seed, (q, k) in enumerate(inputs):
            store.put(_block_idx(seed), q, k, None, None)
    assert len(record) == 1 and len(store) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert store.take(*inputs[0], None, None) is None  # dropped: the caller reselects
    assert int(store.take(*inputs[4], None, None)[0, 0, 0]) == 4


def test_empty_store_and_meta_inputs_are_silent():
    store = SelectionStore()
    q, k = _inputs(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.take(q, k, None, None) is None
        store.put(_block_idx(0).to("meta"), q.to("meta"), k.to("meta"), None, None)
        assert len(store) == 0
        assert store.take(q.to("meta"), k.to("meta"), None, None) is None
    store.put(_block_idx(0), q, k, None, None)
    store.clear()
    assert len(store) == 0
