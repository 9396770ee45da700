"""``backend="torch"`` against the oracle (:mod:`msa_megatron.reference`) and against the spec's
own properties: selection, outputs, LSE, KL value, all five gradients, dense mode, packing
invariance, the KL gradient formula, stop-gradients, NaN isolation and determinism."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import pytest
import torch
import torch.nn.functional as F

from msa_megatron import msa_attention, select_blocks
from msa_megatron import reference as ref
from msa_megatron.ops import torch_backend
from msa_megatron.layout import query_layout
from tests.support.inputs import (
    TOLERANCES,
    assert_close,
    assert_selection_equal,
    make_cu_seqlens,
    make_inputs,
    seed_from,
)
from tests.support.spec_loop import spec_select

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
NAMES = ("q", "k", "v", "q_idx", "k_idx")
KL_COEFF = 3.0  # weight of the KL in the test loss, so both gradient paths are exercised


@dataclass(frozen=True)
class Case:
    lengths: Tuple[int, ...]
    heads: Tuple[int, int, int, int] = (4, 2, 2, 1)  # Hq, Hkv, Hi, Hik
    block_size: int = 16
    top_k: int = 3
    init_blocks: int = 0
    local_blocks: int = 1
    dims: Tuple[int, int] = (16, 16)  # D, Di


CASES = {
    "shorter_than_block": Case((10,)),
    "not_multiple_of_block": Case((45, 70)),
    "zero_length_docs": Case((0, 33, 0, 0, 20, 0)),
    "many_short_docs": Case((7, 1, 19, 3, 25, 11, 2, 16, 9, 22, 5, 14, 1, 17), top_k=2),
    "G1": Case((50, 30), heads=(2, 2, 2, 1)),
    "G16": Case((40, 27), heads=(16, 1, 2, 1), dims=(8, 8)),
    "Hi_gt_Hkv": Case((61,), heads=(8, 2, 4, 1)),
    "Hik_gt_1": Case((61, 20), heads=(8, 2, 4, 2), dims=(8, 12)),
    "init_and_two_local": Case((100, 64), top_k=4, init_blocks=1, local_blocks=2),
    "top_k_covers_all": Case((90,), top_k=16),
    "block32": Case((130, 75), block_size=32, top_k=2),
    "block64": Case((200,), block_size=64, top_k=2, init_blocks=1, dims=(32, 32)),
}


def _inputs(case: Case, dtype: torch.dtype, seed: int):
    Hq, Hkv, Hi, Hik = case.heads
    D, Di = case.dims
    return make_inputs(case.lengths, heads=Hq, kv_heads=Hkv, index_heads=Hi, index_key_heads=Hik,
                       head_dim=D, index_head_dim=Di, dtype=dtype, seed=seed)


def _options(case: Case) -> dict:
    return dict(block_size=case.block_size, top_k=case.top_k, init_blocks=case.init_blocks,
                local_blocks=case.local_blocks)


def _cotangent(x, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(x["q"].shape, generator=gen, dtype=torch.float64).to(x["q"].dtype)


def _run(fn, x, cotangent):
    """``fn(q, k, v, q_idx, k_idx) -> (out, kl)``; returns ``[out, kl, dq, dk, dv, dq_idx, dk_idx]``
    from the loss ``sum(out * cotangent) + KL_COEFF * kl``."""
    leaves = [x[n] for n in NAMES]
    out, kl = fn(*leaves)
    loss = (out.to(torch.float64) * cotangent.to(torch.float64)).sum() + KL_COEFF * kl
    grads = torch.autograd.grad(loss, leaves)
    return [out, kl, *grads]


def _compare(got, want, tol):
    for name, a, b in zip(("out", "kl") + tuple("d" + n for n in NAMES), got, want):
        assert a.dtype == b.dtype or name == "kl", f"{name}: dtype {a.dtype} != {b.dtype}"
        assert_close(a, b, max(tol, 1e-6) if name == "kl" else tol, name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
def test_sparse_matches_reference(name, dtype, seed):
    case = CASES[name]
    x = _inputs(case, dtype, seed)
    cu = x["cu_seqlens"]
    sel = select_blocks(x["q_idx"], x["k_idx"], cu, backend="torch", **_options(case))
    sel_ref = select_blocks(x["q_idx"], x["k_idx"], cu, backend="reference", **_options(case))
    assert_selection_equal(sel, sel_ref, x["q_idx"], x["k_idx"], cu, **_options(case))

    # The public op selects internally (the same selection as above); the oracle reuses it so
    # that a near-tie cannot change the support being compared.
    cot = _cotangent(x, seed)
    got = _run(lambda *t: msa_attention(*t, cu, backend="torch", **_options(case)), x, cot)
    want = _run(lambda *t: ref.msa_attention_reference(*t, cu, block_idx=sel, **_options(case)),
                x, cot)
    _compare(got, want, TOLERANCES[dtype])

    T = x["q"].shape[0]
    q_pos, q_kbase = query_layout(cu, T, x["q"].device)
    with torch.no_grad():
        _, lse = torch_backend.attention(x["q"], x["k"], x["v"], sel, q_pos, q_kbase,
                                         block_size=case.block_size)
        _, lse_ref = ref.attention_core_reference(x["q"], x["k"], x["v"], sel, q_pos, q_kbase,
                                                  block_size=case.block_size)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    lse_tol = 1e-12 if dtype == torch.float64 else max(TOLERANCES[dtype], 1e-6)
    assert_close(lse, lse_ref, lse_tol, "lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["zero_length_docs", "many_short_docs", "G16", "Hik_gt_1",
                                  "block32"])
def test_dense_matches_reference(name, dtype, seed):
    case = CASES[name]
    x = _inputs(case, dtype, seed)
    cu = x["cu_seqlens"]
    cot = _cotangent(x, seed)
    opts = _options(case)
    got = _run(lambda *t: msa_attention(*t, cu, mode="dense", backend="torch", **opts), x, cot)
    want = _run(lambda *t: ref.msa_attention_reference(*t, cu, mode="dense", **opts), x, cot)
    _compare(got, want, TOLERANCES[dtype])


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("name", CASES)
def test_small_chunks_match_reference(name, mode, seed, monkeypatch):
    """Many chunks per sequence (each with its own union of blocks) give the same result."""
    monkeypatch.setattr(torch_backend, "CHUNK_ELEMENTS", 512)
    monkeypatch.setattr(torch_backend, "MAX_CHUNK_QUERIES", 5)
    case = CASES[name]
    x = _inputs(case, torch.float64, seed)
    cu = x["cu_seqlens"]
    opts = _options(case)
    sel = select_blocks(x["q_idx"], x["k_idx"], cu, backend="torch", **opts)
    sel_ref = select_blocks(x["q_idx"], x["k_idx"], cu, backend="reference", **opts)
    assert torch.equal(sel, sel_ref)
    cot = _cotangent(x, seed)
    got = _run(lambda *t: msa_attention(*t, cu, mode=mode, backend="torch", **opts), x, cot)
    want = _run(lambda *t: ref.msa_attention_reference(*t, cu, mode=mode, **opts), x, cot)
    _compare(got, want, TOLERANCES[torch.float64])


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_packing_invariance(mode, seed):
    """A sequence's selection, output and gradients do not depend on where it is packed, and the
    KL sum of a pack is the sum of its sequences' KL sums."""
    opts = dict(block_size=16, top_k=3, init_blocks=1)
    heads = dict(heads=8, kv_heads=2, index_heads=4, index_key_heads=2)
    target = make_inputs((53,), dtype=torch.float64, seed=seed, **heads)
    fillers = [make_inputs((n,), dtype=torch.float64, seed=seed + n, **heads)
               for n in (17, 40, 0, 9)]

    def run(parts):
        x = {n: torch.cat([p[n].detach() for p in parts]).requires_grad_() for n in NAMES}
        cu = make_cu_seqlens([p["q"].shape[0] for p in parts])
        sel = select_blocks(x["q_idx"], x["k_idx"], cu, backend="torch", **opts)
        out, kl = msa_attention(*(x[n] for n in NAMES), cu, mode=mode, backend="torch", **opts)
        cot = torch.cat([_cotangent(p, 7) for p in parts])
        ((out * cot).sum() + kl).backward()
        T, Hi = x["q_idx"].shape[:2]
        kl_sum = kl.double() * T * Hi
        return sel, out, [x[n].grad * (T * Hi if n.endswith("idx") else 1) for n in NAMES], kl_sum

    alone = run([target])
    packs = (([fillers[0], target, fillers[1]], 17),
             ([fillers[2], fillers[3], fillers[1], target], 49))
    for parts, start in packs:
        sel, out, grads, kl_sum = run(parts)
        rows = slice(start, start + 53)
        assert torch.equal(sel[rows], alone[0])
        assert_close(out[rows], alone[1], 1e-12, "out")
        for n, g, g_alone in zip(NAMES, grads, alone[2]):
            assert_close(g[rows], g_alone, 1e-12, "d" + n)
        parts_kl = sum(run([p])[3] for p in parts if p["q"].shape[0])
        assert abs(kl_sum - parts_kl) <= 1e-5 * abs(parts_kl)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_dense_equals_causal_sdpa(dtype, seed):
    x = make_inputs((0, 37, 64, 5), heads=8, kv_heads=2, index_heads=2, dtype=dtype, seed=seed)
    cu = x["cu_seqlens"]
    main = [x["q"], x["k"], x["v"]]
    cot = _cotangent(x, seed)
    out, _ = msa_attention(*main, x["q_idx"], x["k_idx"], cu, mode="dense", backend="torch",
                           block_size=16)
    grads = torch.autograd.grad((out * cot).sum(), main)

    bounds = cu.tolist()
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            q, k, v = (t[a:b].transpose(0, 1).unsqueeze(0) for t in main)
            pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                          .squeeze(0).transpose(0, 1))
    expected = torch.cat(pieces)
    expected_grads = torch.autograd.grad((expected * cot).sum(), main)
    tol = TOLERANCES[dtype]
    assert_close(out, expected, tol, "out")
    for n, g, e in zip(("dq", "dk", "dv"), grads, expected_grads):
        assert_close(g, e, tol, n)


def test_sparse_equals_dense_when_top_k_covers_every_block(seed):
    x = make_inputs((70, 0, 33), heads=4, kv_heads=2, index_heads=2, dtype=torch.float64, seed=seed)
    cu = x["cu_seqlens"]
    cot = _cotangent(x, seed)
    sparse = _run(lambda *t: msa_attention(*t, cu, block_size=16, top_k=5, backend="torch"), x, cot)
    dense = _run(lambda *t: msa_attention(*t, cu, block_size=16, top_k=5, mode="dense",
                                          backend="torch"), x, cot)
    _compare(sparse, dense, 1e-12)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_kl_gradient_is_student_minus_teacher(mode, seed):
    """d kl / d z = (Qs - T) / (N * Hi) on the support (MSA_SPEC 4), with Qs and T built here."""
    lengths, B = (29, 0, 46), 16
    x = make_inputs(lengths, heads=8, kv_heads=2, index_heads=4, index_key_heads=2,
                    dtype=torch.float64, seed=seed)
    q, k, q_idx, k_idx, cu = x["q"], x["k"], x["q_idx"], x["k_idx"], x["cu_seqlens"]
    T, Hq, D = q.shape
    Hi, Hik, Di = q_idx.shape[1], k_idx.shape[1], q_idx.shape[2]
    _, kl = msa_attention(q, k, x["v"], q_idx, k_idx, cu, block_size=B, top_k=2, mode=mode,
                          backend="torch")
    dq_idx, dk_idx = torch.autograd.grad(kl, [q_idx, k_idx])

    block_idx = None
    if mode == "sparse":
        block_idx = select_blocks(q_idx, k_idx, cu, block_size=B, top_k=2, backend="torch")
    q_pos, q_kbase = query_layout(cu, T, q.device)
    support = ref.support_mask(block_idx, q_pos, q_kbase, T, B, Hi)  # [Hi, T, T]
    with torch.no_grad():
        logits = torch.einsum("phd,ugd->hpug", q, k).mul(D ** -0.5)  # [Hq, T, T, Hkv]
        groups = torch.arange(Hq) // (Hq // k.shape[1])
        logits = logits[torch.arange(Hq), :, :, groups]  # each head against its own KV group
        logits = logits.masked_fill(~support.repeat_interleave(Hq // Hi, dim=0), float("-inf"))
        teacher = torch.softmax(logits, dim=-1).view(Hi, Hq // Hi, T, T).mean(dim=1)
        k_rep = k_idx.repeat_interleave(Hi // Hik, dim=1)  # [T, Hi, Di]
        z = torch.einsum("pid,uid->ipu", q_idx, k_rep).mul(Di ** -0.5)
        student = torch.softmax(z.masked_fill(~support, float("-inf")), dim=-1)
        dz = (student - teacher) / (T * Hi)
        expected_dq = torch.einsum("ipu,uid->pid", dz, k_rep) * Di ** -0.5
        expected_dk = (torch.einsum("ipu,pid->uid", dz, q_idx) * Di ** -0.5)
        expected_dk = expected_dk.view(T, Hik, Hi // Hik, Di).sum(dim=2)
    assert_close(dq_idx, expected_dq, 1e-10, "dq_idx")
    assert_close(dk_idx, expected_dk, 1e-10, "dk_idx")


def test_kl_gives_no_gradient_to_main_branch_and_out_none_to_index(seed):
    x = make_inputs((40, 25), dtype=torch.float32, seed=seed)
    out, kl = msa_attention(*(x[n] for n in NAMES), x["cu_seqlens"], block_size=16, top_k=2,
                            backend="torch")
    assert kl.dim() == 0 and kl.dtype == torch.float32 and kl.item() > 0
    assert torch.autograd.grad(kl, [x["q"], x["k"], x["v"]], allow_unused=True,
                               retain_graph=True) == (None, None, None)
    assert torch.autograd.grad(out.sum(), [x["q_idx"], x["k_idx"]],
                               allow_unused=True) == (None, None)


def test_kl_value_without_grad_equals_value_with_grad(seed):
    x = make_inputs((40, 25), dtype=torch.float32, seed=seed)
    leaves = [x[n] for n in NAMES]
    _, kl = msa_attention(*leaves, x["cu_seqlens"], block_size=16, top_k=2, backend="torch")
    with torch.no_grad():
        _, kl_no_grad = msa_attention(*leaves, x["cu_seqlens"], block_size=16, top_k=2,
                                      backend="torch")
    assert torch.equal(kl.detach(), kl_no_grad)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_nan_in_one_sequence_does_not_leak(mode, seed):
    lengths, poisoned = (30, 41, 25), slice(30, 71)
    clean = make_inputs(lengths, dtype=torch.float32, seed=seed)
    dirty = {n: t.detach().clone() for n, t in clean.items()}
    for n in NAMES:
        dirty[n][50, 0, 0] = float("nan")
        dirty[n] = dirty[n].requires_grad_()
    opts = dict(block_size=16, top_k=2, mode=mode, backend="torch")
    cot = _cotangent(clean, seed)
    results = []
    for x in (clean, dirty):
        sel = select_blocks(x["q_idx"], x["k_idx"], x["cu_seqlens"], block_size=16, top_k=2,
                            backend="torch")
        results.append([sel] + _run(lambda *t: msa_attention(*t, x["cu_seqlens"], **opts), x, cot))
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[poisoned] = False
    for name, a, b in zip(("selection", "out", "kl") + NAMES, results[0], results[1]):
        if name == "kl":
            continue  # one scalar over every sequence: NaN by definition
        assert torch.isfinite(b[keep].float()).all(), f"{name}: NaN reached another sequence"
        assert torch.equal(a[keep], b[keep]), f"{name}: another sequence changed"
    assert not torch.isfinite(results[1][1][50]).all(), "the poisoned row itself must show the NaN"


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_backward_is_deterministic(mode, seed, monkeypatch):
    monkeypatch.setattr(torch_backend, "CHUNK_ELEMENTS", 4096)
    x = make_inputs((150, 90), heads=8, kv_heads=2, index_heads=4, dtype=torch.float32, seed=seed)
    cot = _cotangent(x, seed)

    def fn(*t):
        return msa_attention(*t, x["cu_seqlens"], block_size=16, top_k=3, mode=mode,
                             backend="torch")

    first, second = _run(fn, x, cot), _run(fn, x, cot)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_empty_batch(seed):
    x = make_inputs((0,), dtype=torch.float32, seed=seed)
    out, kl = msa_attention(*(x[n] for n in NAMES), x["cu_seqlens"], block_size=16, top_k=2,
                            backend="torch")
    assert out.shape == x["q"].shape and kl.item() == 0.0
    (out.sum() + kl).backward()
    assert x["q"].grad.shape == x["q"].shape


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_exact_ties_go_to_the_lower_block(dtype):
    """Block scores [1, 3, 3, 2, 3] (exact in every dtype): ties resolve to the lower block."""
    B, Di, values = 16, 4, (1.0, 3.0, 3.0, 2.0, 3.0)
    k_idx = torch.tensor(values).repeat_interleave(B)[:, None, None].expand(-1, 1, Di)
    k_idx = k_idx.to(dtype).contiguous()
    q_idx = torch.ones(k_idx.shape[0], 2, Di, dtype=dtype)
    opts = dict(block_size=B, top_k=3, index_scale=1.0)
    got = select_blocks(q_idx, k_idx, backend="torch", **opts)
    assert torch.equal(got, select_blocks(q_idx, k_idx, backend="reference", **opts))
    assert torch.equal(got, spec_select(q_idx.double(), k_idx.double(), [k_idx.shape[0]], **opts))
    assert got[-1, 0].tolist() == [1, 2, 4] and got[50, 1].tolist() == [1, 2, 3]


def test_nan_scores_rank_like_the_reference(seed):
    x = make_inputs((80, 40), dtype=torch.float32, seed=seed, requires_grad=False)
    k_idx = x["k_idx"].clone()
    k_idx[20, 0, 3] = float("nan")  # block 1 of the first sequence
    opts = dict(block_size=16, top_k=2)
    got = select_blocks(x["q_idx"], k_idx, x["cu_seqlens"], backend="torch", **opts)
    want = select_blocks(x["q_idx"], k_idx, x["cu_seqlens"], backend="reference", **opts)
    assert torch.equal(got, want)
    assert (got[32:80, :, 0] == 1).all(), "a NaN block score ranks first, as in the oracle"


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("rank", [0, 1])
def test_general_layout_matches_reference(rank, mode, seed):
    """Context-parallel style layout: local queries (load-balanced chunks ``rank`` and
    ``2*CP-1-rank`` of every sequence, CP = 2) against the full key buffer (more rows than
    queries), through the backend cores."""
    from msa_megatron.ops import reference_backend

    lengths, cp, B = (48, 72), 2, 16
    positions, bases, start = [], [], 0
    for n in lengths:
        size = n // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            positions += range(chunk * size, (chunk + 1) * size)
            bases += [start] * size
        start += n
    q_pos = torch.tensor(positions, dtype=torch.int32)
    q_kbase = torch.tensor(bases, dtype=torch.int32)
    Tq = len(positions)
    keys = make_inputs(lengths, heads=8, kv_heads=2, index_heads=4, index_key_heads=2,
                       dtype=torch.float64, seed=seed)
    queries = make_inputs((Tq,), heads=8, kv_heads=2, index_heads=4, index_key_heads=2,
                          dtype=torch.float64, seed=seed + 1)
    q, q_idx, k, v, k_idx = queries["q"], queries["q_idx"], keys["k"], keys["v"], keys["k_idx"]
    cot = _cotangent(queries, seed)
    kl_scale = 1.0 / (Tq * 4)

    results = []
    for backend in (torch_backend, reference_backend):
        block_idx = backend.select(q_idx, k_idx, q_pos, q_kbase, block_size=B, top_k=3,
                                   init_blocks=1)
        support = block_idx if mode == "sparse" else None
        out, lse = backend.attention(q, k, v, support, q_pos, q_kbase, block_size=B, index_heads=4)
        kl = backend.kl(q.detach(), k.detach(), lse, q_idx, k_idx, support, q_pos, q_kbase,
                        block_size=B, kl_scale=kl_scale)
        grads = torch.autograd.grad((out * cot).sum() + KL_COEFF * kl, [q, k, v, q_idx, k_idx])
        results.append([block_idx, out, lse, kl, *grads])
    assert torch.equal(results[0][0], results[1][0])
    for name, a, b in zip(("out", "lse", "kl", "dq", "dk", "dv", "dq_idx", "dk_idx"),
                          results[0][1:], results[1][1:]):
        # the reference backend returns kl and lse in float32
        assert_close(a, b, 1e-6 if name in ("kl", "lse") else 1e-10, name)


def test_empty_support_row_gives_zero_output_and_no_nan(seed):
    """A malformed selection (a row of -1, which ``select`` never returns) masks the whole row:
    output 0, LSE -inf, finite gradients and KL; other rows unchanged."""
    x = make_inputs((40,), heads=4, kv_heads=2, index_heads=2, dtype=torch.float32, seed=seed)
    q_pos, q_kbase = query_layout(None, 40, x["q"].device)
    block_idx = torch_backend.select(x["q_idx"], x["k_idx"], q_pos, q_kbase, block_size=16,
                                     top_k=2)
    broken = block_idx.clone()
    broken[30, 1] = -1
    results = []
    for sel in (block_idx, broken):
        out, lse = torch_backend.attention(x["q"], x["k"], x["v"], sel, q_pos, q_kbase,
                                           block_size=16)
        kl = torch_backend.kl(x["q"].detach(), x["k"].detach(), lse, x["q_idx"], x["k_idx"], sel,
                              q_pos, q_kbase, block_size=16)
        grads = torch.autograd.grad(out.sum() + kl, [x[n] for n in NAMES])
        results.append((out, lse, kl, grads))
    out, lse, kl, grads = results[1]
    assert (out[30, 2:] == 0).all() and (lse[30, 2:] == float("-inf")).all()
    assert torch.isfinite(kl) and all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(out[:30], results[0][0][:30]) and torch.equal(lse[31:], results[0][1][31:])


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_non_finite_input_reaches_only_the_rows_that_read_it(mode, tensor):
    """MSA_SPEC section 7: a NaN/Inf in one row of q, k or v reaches the outputs (and q
    gradients) of exactly the rows the oracle marks, inside one sequence too; every other row
    keeps its clean value."""
    inputs = make_inputs([70, 58], heads=4, kv_heads=2, index_heads=2, dtype=torch.float64,
                         seed=seed_from(f"nonfinite-{mode}-{tensor}"))
    options = dict(block_size=16, top_k=2, mode=mode)

    def run(backend, poison):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()
                  if n != "cu_seqlens"}
        if poison:
            with torch.no_grad():
                leaves[tensor][40, 0, 1] = float("nan") if tensor != "v" else float("inf")
        out, _ = msa_attention(leaves["q"], leaves["k"], leaves["v"], leaves["q_idx"],
                               leaves["k_idx"], inputs["cu_seqlens"], backend=backend, **options)
        out.backward(torch.ones_like(out))
        return out.detach(), leaves["q"].grad

    clean_out, clean_dq = run("torch", poison=False)
    ref_out, _ = run("reference", poison=True)
    got_out, got_dq = run("torch", poison=True)
    affected = ~torch.isfinite(ref_out).all(dim=-1)  # [T, Hq]
    assert affected.any() and not affected.all()
    assert torch.equal(~torch.isfinite(got_out).all(dim=-1), affected)
    torch.testing.assert_close(got_out[~affected], clean_out[~affected])
    rows = ~affected.any(dim=1)
    torch.testing.assert_close(got_dq[rows], clean_dq[rows])
