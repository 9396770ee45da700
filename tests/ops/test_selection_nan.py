"""One ranking rule for NaN block scores in every backend (MSA_SPEC section 2.4, DESIGN.md).

A block whose score is NaN ranks above every number (as ``torch.topk`` and the oracle's
descending stable sort do), ties go to the lower block, forced blocks come first. The inputs
are small integers, so every backend computes the same scores exactly and the selections must
be equal, not merely equal up to near-ties.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK, TOP_K, DI = 16, 3, 16
LENS = [100, 0, 37]  # two sequences (one empty between): NaN must stay in its own sequence


def _select(backend, q_idx, k_idx, q_pos, q_kbase):
    opts = dict(block_size=BLOCK, top_k=TOP_K, init_blocks=0, local_blocks=1)
    if backend == "reference":
        return ref.select_core_reference(q_idx, k_idx, q_pos, q_kbase, **opts)
    if backend == "torch":
        from msa_megatron.ops import torch_backend

        return torch_backend.select(q_idx, k_idx, q_pos, q_kbase, **opts)
    from msa_megatron.ops import triton as triton_backend

    return triton_backend.select(q_idx, k_idx, q_pos, q_kbase, **opts)


def _inputs(where):
    gen = torch.Generator().manual_seed(3)
    total = sum(LENS)
    cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q_pos, q_kbase = query_layout(cu, total, DEVICE)
    q_idx = torch.randint(-2, 3, (total, 2, DI), generator=gen).float()
    k_idx = torch.randint(-2, 3, (total, 1, DI), generator=gen).float()
    if where == "k_idx":
        k_idx[20, 0, 5] = float("nan")  # block 1 of sequence 0, from position 20 on
    elif where == "q_idx":
        q_idx[70, 1, 3] = float("nan")  # every block of token 70, index head 1
        q_idx[90, 0, 0] = float("nan")
        k_idx[100 + 33, 0, 0] = float("nan")  # sequence 1 only
    return q_idx.to(DEVICE), k_idx.to(DEVICE), q_pos, q_kbase


@pytest.mark.parametrize("where", ["k_idx", "q_idx", "none"])
def test_nan_ranking_is_the_same_in_every_backend(where):
    q_idx, k_idx, q_pos, q_kbase = _inputs(where)
    want = _select("reference", q_idx, k_idx, q_pos, q_kbase)
    for backend in ("torch", "triton"):
        got = _select(backend, q_idx, k_idx, q_pos, q_kbase)
        assert torch.equal(got.cpu(), want.cpu()), backend
    want = want.cpu()
    if where == "k_idx":
        # From position 20 of sequence 0 on, block 1 is NaN: always chosen (own block forced).
        assert all(1 in want[t, i].tolist() for t in range(20, 100) for i in range(2))
    if where == "q_idx":
        # Every block of (70, 1) is NaN: the own block, then ties to the lowest blocks.
        assert want[70, 1].tolist() == [0, 1, 4]
        assert want[90, 0].tolist() == [0, 1, 5]


def test_triton_block_max_propagates_nan():
    """A NaN anywhere in a block's causal part makes the block's score NaN (not skipped), so
    the block is chosen over every finite block even when its other keys score lowest."""
    total = 64
    cu = torch.tensor([0, total], dtype=torch.int32, device=DEVICE)
    q_pos, q_kbase = query_layout(cu, total, DEVICE)
    q_idx = torch.ones(total, 1, DI)
    k_idx = torch.ones(total, 1, DI)
    k_idx[16:32] = -5.0  # block 1 scores lowest...
    k_idx[17, 0, 2] = float("nan")  # ...but holds a NaN from position 17 on
    q_idx, k_idx = q_idx.to(DEVICE), k_idx.to(DEVICE)
    for backend in ("reference", "torch", "triton"):
        got = _select(backend, q_idx, k_idx, q_pos, q_kbase).cpu()
        # Query at position 63 (own block 3 forced): NaN block 1, then block 0 (beats block 2
        # only by the tie rule: blocks 0 and 2 score the same).
        assert got[63, 0].tolist() == [0, 1, 3], backend
