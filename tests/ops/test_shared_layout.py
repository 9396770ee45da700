"""layout.shared_query_layout: the composer's query layout, the same tensors again for the same
layout (so a backend's host reads of it happen once), never stale, never under tracing or in
inference mode."""

import numpy as np
import pytest
import torch

from msa_megatron import layout
from msa_megatron.layout import query_layout, shared_query_layout

CPU = torch.device("cpu")


def _same(a, b):
    return a[0] is b[0] and a[1] is b[1]


def _equal(got, want):
    return all(torch.equal(x, y) for x, y in zip(got, want))


@pytest.mark.parametrize("cu", [None, [0, 5, 5, 17, 40]])
def test_same_layout_gives_the_same_tensors(cu):
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    first = shared_query_layout(cu, 40, CPU)
    assert _equal(first, query_layout(cu, 40, CPU))
    assert _same(shared_query_layout(cu, 40, CPU), first)
    if cu is not None:  # an equal but other tensor: its own memo, equal values
        other = shared_query_layout(cu.clone(), 40, CPU)
        assert not _same(other, first) and _equal(other, first)


def test_a_modified_layout_is_rebuilt():
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    first = shared_query_layout(cu, 40, CPU)
    cu[1] = 25  # in place: the version moves
    again = shared_query_layout(cu, 40, CPU)
    assert not _same(again, first) and _equal(again, query_layout(cu, 40, CPU))
    again[0].add_(0)  # a result modified in place is not handed out again
    assert not _same(shared_query_layout(cu, 40, CPU), again)
    single = shared_query_layout(None, 40, CPU)
    single[1].zero_()
    assert not _same(shared_query_layout(None, 40, CPU), single)


def test_single_sequence_memo_is_bounded_and_keyed_by_length():
    a = shared_query_layout(None, 33, CPU)
    b = shared_query_layout(None, 34, CPU)
    assert a[0].shape == (33,) and b[0].shape == (34,) and not _same(a, b)
    for n in range(100, 100 + layout._SHARED_SINGLE_MAX):
        shared_query_layout(None, n, CPU)
    assert len(layout._SHARED_SINGLE) <= layout._SHARED_SINGLE_MAX
    assert not _same(shared_query_layout(None, 33, CPU), a)  # evicted, rebuilt


def test_inference_mode_is_not_remembered():
    """An inference tensor cannot be saved for a later backward: inside inference mode the
    layout is built fresh and not kept, so a training call afterwards gets normal tensors."""
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    with torch.inference_mode():
        inside = shared_query_layout(cu, 20, CPU)
        assert inside[0].is_inference()
    outside = shared_query_layout(cu, 20, CPU)
    assert not outside[0].is_inference() and _equal(outside, inside)


def test_values_changed_without_a_version_bump_are_seen():
    """Writes that do not move the autograd version counter (a numpy buffer shared through
    ``torch.from_numpy`` and refilled per micro-batch, ``.data`` writes; on GPUs also
    ``torch.distributed.broadcast`` into a kept buffer) still change the layout: the memo
    compares values, so a refilled buffer never hands out the previous micro-batch's layout."""
    buf = np.array([0, 20, 40], dtype=np.int32)
    cu = torch.from_numpy(buf)
    first = shared_query_layout(cu, 40, CPU)
    version = cu._version
    buf[1] = 5
    assert cu._version == version  # the trap: the tensor's version did not move
    again = shared_query_layout(cu, 40, CPU)
    assert not _same(again, first) and _equal(again, query_layout(cu, 40, CPU))
    cu.data[1] = 30
    assert _equal(shared_query_layout(cu, 40, CPU), query_layout(cu, 40, CPU))
    # values passed by the caller (the validated host read) are what the memo compares
    assert _equal(shared_query_layout(cu, 40, CPU, (0, 30, 40)), query_layout(cu, 40, CPU))


def test_msa_attention_follows_a_refilled_cu_seqlens_buffer():
    """End to end: the same ``cu_seqlens`` tensor refilled in place without a version bump
    gives the result of a fresh tensor with the new values (was: the old layout's output, bit
    for bit, across the new document boundary)."""
    from msa_megatron import msa_attention
    gen = torch.Generator().manual_seed(7)
    q, k, v, qi, ki = (torch.randn(40, h, 16, generator=gen) for h in (4, 2, 2, 2, 1))
    buf = np.array([0, 20, 40], dtype=np.int32)
    cu = torch.from_numpy(buf)
    before, _ = msa_attention(q, k, v, qi, ki, cu, block_size=16, top_k=2, backend="torch")
    buf[1] = 5
    out, kl = msa_attention(q, k, v, qi, ki, cu, block_size=16, top_k=2, backend="torch")
    fresh, kl_fresh = msa_attention(q, k, v, qi, ki, torch.tensor([0, 5, 40], dtype=torch.int32),
                                    block_size=16, top_k=2, backend="torch")
    assert not torch.equal(before, fresh)  # the two layouts give different results
    assert torch.equal(out, fresh) and torch.equal(kl, kl_fresh)
