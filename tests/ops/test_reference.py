"""The oracle (:mod:`msa_megatron.reference`) against the spec written as plain loops.

:mod:`tests.support.spec_loop` follows MSA_SPEC sections 2-5 token by token and head by head in
float64; the oracle must match it in selection, output, LSE, KL value and every gradient, in
sparse and dense mode, on small odd shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

import pytest
import torch

from msa_megatron import reference as ref
from msa_megatron.layout import query_layout
from tests.support.inputs import assert_close, make_inputs
from tests.support.spec_loop import spec_attention, spec_kl, spec_select

TOL = 1e-10  # both sides are float64


@dataclass(frozen=True)
class Case:
    lengths: Tuple[int, ...]
    heads: Tuple[int, int, int, int] = (4, 2, 2, 1)  # Hq, Hkv, Hi, Hik
    block_size: int = 16
    top_k: int = 2
    init_blocks: int = 0
    local_blocks: int = 1
    dims: Tuple[int, int] = field(default=(8, 8))  # D, Di


CASES = {
    "one_seq_partial_block": Case((37,)),
    "packed_with_empty_docs_init_block": Case((5, 0, 23, 18), heads=(4, 1, 2, 2), top_k=3,
                                               init_blocks=1),
    "two_local_blocks_G1": Case((40,), heads=(2, 2, 2, 1), local_blocks=2, dims=(6, 5)),
    "top_k_covers_all_blocks": Case((20, 13), heads=(8, 2, 4, 2), top_k=8),
}


def _inputs(case: Case, seed: int):
    Hq, Hkv, Hi, Hik = case.heads
    D, Di = case.dims
    return make_inputs(case.lengths, heads=Hq, kv_heads=Hkv, index_heads=Hi, index_key_heads=Hik,
                       head_dim=D, index_head_dim=Di, dtype=torch.float64, seed=seed)


def _options(case: Case) -> dict:
    return dict(block_size=case.block_size, top_k=case.top_k, init_blocks=case.init_blocks,
                local_blocks=case.local_blocks)


@pytest.mark.parametrize("name", CASES)
def test_selection_matches_spec(name, seed):
    case = CASES[name]
    x = _inputs(case, seed)
    got = ref.select_blocks_reference(x["q_idx"], x["k_idx"], x["cu_seqlens"], **_options(case))
    want = spec_select(x["q_idx"].detach(), x["k_idx"].detach(), case.lengths, **_options(case))
    assert torch.equal(got, want)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("name", CASES)
def test_attention_matches_spec(name, mode, seed):
    case = CASES[name]
    x = _inputs(case, seed)
    T, Hi = x["q_idx"].shape[:2]
    q_pos, q_kbase = query_layout(x["cu_seqlens"], T, x["q"].device)
    block_idx = None
    if mode == "sparse":
        block_idx = ref.select_blocks_reference(x["q_idx"], x["k_idx"], x["cu_seqlens"],
                                                **_options(case))
    cotangent = torch.randn(x["q"].shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(seed + 1))
    main = [x["q"], x["k"], x["v"]]

    out, lse = ref.attention_core_reference(*main, block_idx, q_pos, q_kbase,
                                            block_size=case.block_size, index_heads=Hi)
    grads = torch.autograd.grad((out * cotangent).sum(), main)
    out_s, lse_s = spec_attention(*main, block_idx, case.lengths, block_size=case.block_size,
                                  index_heads=Hi)
    grads_s = torch.autograd.grad((out_s * cotangent).sum(), main)

    assert_close(out, out_s, TOL, "out")
    assert_close(lse, lse_s, TOL, "lse")
    for name_, g, g_s in zip(("dq", "dk", "dv"), grads, grads_s):
        assert_close(g, g_s, TOL, name_)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("name", CASES)
def test_kl_matches_spec(name, mode, seed):
    case = CASES[name]
    x = _inputs(case, seed)
    index = [x["q_idx"], x["k_idx"]]
    block_idx = None
    if mode == "sparse":
        block_idx = ref.select_blocks_reference(*index, x["cu_seqlens"], **_options(case))

    _, kl = ref.msa_attention_reference(x["q"], x["k"], x["v"], *index, x["cu_seqlens"],
                                        mode=mode, block_idx=block_idx, **_options(case))
    kl_grads = torch.autograd.grad(kl, index)
    kl_s = spec_kl(x["q"], x["k"], *index, block_idx, case.lengths, block_size=case.block_size)
    kl_grads_s = torch.autograd.grad(kl_s, index)

    # The public oracle returns the KL in float32 (MSA_SPEC 4: an fp32 scalar).
    assert abs(kl.item() - kl_s.item()) <= 1e-6 * abs(kl_s.item())
    for name_, g, g_s in zip(("dq_idx", "dk_idx"), kl_grads, kl_grads_s):
        assert_close(g, g_s, TOL, name_)


def test_kl_core_float64_value_matches_spec(seed):
    """The float64 KL core keeps float64 precision (the fp32 cast happens only at the API)."""
    case = CASES["packed_with_empty_docs_init_block"]
    x = _inputs(case, seed)
    T, Hi = x["q_idx"].shape[:2]
    q_pos, q_kbase = query_layout(x["cu_seqlens"], T, x["q"].device)
    block_idx = ref.select_blocks_reference(x["q_idx"], x["k_idx"], x["cu_seqlens"],
                                            **_options(case))
    kl = ref.kl_core_reference(x["q"], x["k"], x["q_idx"], x["k_idx"], block_idx, q_pos, q_kbase,
                               block_size=case.block_size, kl_scale=1.0 / (T * Hi))
    kl_s = spec_kl(x["q"], x["k"], x["q_idx"], x["k_idx"], block_idx, case.lengths,
                   block_size=case.block_size)
    assert kl.dtype == torch.float64
    assert abs(kl.item() - kl_s.item()) <= TOL * abs(kl_s.item())
