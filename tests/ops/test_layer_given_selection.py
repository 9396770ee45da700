"""``core.msa_layer`` inputs that only the layer takes: a given ``block_idx`` (reused selection)
must be one selection could return, and ``cu_seqlens_real`` must start at 0; anything else is
a ValueError naming it, before any backend computes (MSA_SPEC sections 2.5 and 7)."""

from __future__ import annotations

import pytest
import torch

from msa_megatron.core import MSAOptions, msa_layer
from msa_megatron.ops.backends import get_backend

T, HQ, HKV, HI, D, DI, BLOCK, TOP_K = 40, 4, 2, 2, 16, 8, 16, 3


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(T, HQ, D), (T, HKV, D), (T, HKV, D), (T, HI, DI), (T, 1, DI)]
    return [torch.randn(*s, generator=gen) for s in shapes]


OPTIONS = MSAOptions(block_size=BLOCK, top_k=TOP_K, backend="torch")
CU = torch.tensor([0, 25, T], dtype=torch.int32)  # two sequences: block numbers restart at 25


def _layer(block_idx=None, cu_real=None):
    return msa_layer(*_inputs(), options=OPTIONS, kl_scale=1.0, cu_seqlens=CU,
                     cu_seqlens_real=cu_real, block_idx=block_idx)


def _selection():
    return _layer().block_idx


def test_a_returned_selection_is_accepted_and_gives_the_same_result():
    first = _layer()
    again = _layer(block_idx=first.block_idx.clone())
    assert torch.equal(again.out, first.out) and torch.equal(again.kl, first.kl)


def _edit(row, values):
    def change(b):
        b[row, 1] = torch.tensor(values, dtype=torch.int32)  # the second index head
    return change


# Row 39 is position 14 of the second sequence (own block 0); row 24 is position 24 of the
# first one (own block 1).
BAD = {
    "past its own block": _edit(24, [1, 2, -1]),
    "below -1": _edit(24, [-2, 1, -1]),
    "a block twice": _edit(24, [1, 1, -1]),
    "descending": _edit(24, [1, 0, -1]),
    "block after an unused slot": _edit(24, [-1, 1, -1]),
    "no own block": _edit(24, [0, -1, -1]),
    "nothing selected": _edit(39, [-1, -1, -1]),
    "block of the previous sequence": _edit(39, [0, 1, -1]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_impossible_selections_are_rejected_before_compute(case, monkeypatch):
    block_idx = _selection()
    BAD[case](block_idx)
    module = get_backend("torch")
    for core in ("select", "attention", "kl"):
        monkeypatch.setattr(module, core, lambda *a, **k: pytest.fail("a backend core ran"))
    with pytest.raises(ValueError, match=r"block_idx row \d+ .* strictly ascending"):
        _layer(block_idx=block_idx)


def test_given_selection_on_another_device_is_named():
    block_idx = _selection().to("meta")
    with pytest.raises(ValueError, match="block_idx is on meta"):
        _layer(block_idx=block_idx)


@pytest.mark.parametrize("real", [[2, 20, 40], [1, 1, 1]])
def test_real_boundaries_must_start_at_zero(real):
    with pytest.raises(ValueError, match="real .*cu_seqlens .* must start at 0"):
        _layer(cu_real=torch.tensor(real, dtype=torch.int32))


def test_real_boundaries_starting_at_zero_are_accepted():
    out = _layer(cu_real=torch.tensor([0, 20, 33], dtype=torch.int32))
    assert torch.isfinite(out.out).all() and torch.isfinite(out.kl)
