"""MSA_SPEC section 7: a NaN/Inf input reaches exactly the rows whose support holds it.

Every backend (reference, torch, triton), forward and backward, sparse and dense mode, NaN and
Inf in each of q, k, v, q_idx, k_idx. The oracle (``msa_megatron.reference``, run in float64)
defines which (token, head) rows of the output and of every gradient are non-finite; a backend
must mark exactly those rows and match the oracle on all the others. The oracle itself is
checked against the support: its affected output rows are the rows whose support holds the
poisoned key (or the poisoned query row), and nothing reaches another packed sequence.

Triton runs in its CPU interpreter here (fp32: exact IEEE products there); its selection is
not under test in this file (the attention and KL cores get the oracle's selection).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.api import select_blocks  # noqa: E402
from msa_megatron.core import MSAOptions, msa_layer  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from tests.support.inputs import make_inputs, rel_err, seed_from  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ("q", "k", "v", "q_idx", "k_idx")
BLOCK = 16
# name: (sequence lengths, Hq, Hkv, Hi, Hik, top_k, poisoned (token, head, feature))
LAYOUTS = {
    # The issue's case: the first token of sequence 1; sequence 0's last tile reads past its end.
    "issue": ([20, 20], 2, 1, 1, 1, 1, (20, 0, 3)),
    # Inside a sequence, mid-block: earlier rows of the same tile and block never read it.
    "mid": ([45, 38], 4, 2, 2, 1, 2, (66, 1, 5)),
}
CASES = [("issue", "nan"), ("mid", "nan"), ("mid", "inf")]
# numpy, under Triton's interpreter, warns on every NaN it meets; NaN is the point here.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]
REL_TOL = 1e-4  # fp32 backends against the float64 oracle, on the rows that stay finite


def _inputs(layout: str, tensor: str, value: str):
    lens, hq, hkv, hi, hik, _, (tok, head, feat) = LAYOUTS[layout]
    x = make_inputs(lens, heads=hq, kv_heads=hkv, index_heads=hi, index_key_heads=hik,
                    seed=seed_from(f"{layout}-{tensor}-{value}"), requires_grad=False)
    poisoned = {n: t.clone() for n, t in x.items()}
    t = poisoned[tensor]
    t[tok, min(head, t.shape[1] - 1), feat] = float(value)
    return {n: t.to(DEVICE) for n, t in x.items()}, {n: t.to(DEVICE) for n, t in poisoned.items()}


def _run(backend: str, x, mode: str, top_k: int, block_idx, dtype):
    """``(out, kl, dq, dk, dv, dq_idx, dk_idx)`` of ``sum(out * cot) + kl``."""
    leaves = [x[n].detach().to(dtype).requires_grad_() for n in NAMES]
    T, hi = leaves[0].shape[0], leaves[3].shape[1]
    options = MSAOptions(backend=backend, block_size=BLOCK, top_k=top_k, mode=mode)
    res = msa_layer(*leaves, options=options, kl_scale=1.0 / (T * hi),
                    cu_seqlens=x["cu_seqlens"], block_idx=block_idx)
    out, kl = res.out, res.kl
    cot = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float64,
                         device=out.device).view(out.shape)
    loss = (out.to(torch.float64) * cot).sum() + kl.to(torch.float64)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
    return [out.detach(), kl.detach(), *grads]


def _affected(t: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` bool: the (token, head) row holds a NaN or an Inf."""
    return ~torch.isfinite(t).all(dim=-1)


def _assert_oracle_rows(got, want):
    """Every result of :func:`_run` but the KL: non-finite in exactly the oracle's (token, head)
    rows, within ``REL_TOL`` of it on the others."""
    names = ("out", "kl") + tuple("d" + n for n in NAMES)
    for name, a, b in zip(names, got, want):
        if name == "kl":
            continue
        bad = _affected(b)
        assert torch.equal(_affected(a), bad), (
            f"{name}: non-finite rows {_affected(a).nonzero().tolist()} != oracle "
            f"{bad.nonzero().tolist()}")
        assert rel_err(a[~bad], b[~bad]) < REL_TOL, name


def _oracle_selection(x, top_k):
    return select_blocks(x["q_idx"].double(), x["k_idx"].double(), x["cu_seqlens"],
                         block_size=BLOCK, top_k=top_k, backend="reference")


@pytest.mark.parametrize("tensor", NAMES)
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("layout,value", CASES)
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_non_finite_reaches_only_the_oracle_rows(backend, layout, value, mode, tensor):
    top_k = LAYOUTS[layout][5]
    _, x = _inputs(layout, tensor, value)
    block_idx = _oracle_selection(x, top_k) if mode == "sparse" else None
    want = _run("reference", x, mode, top_k, block_idx, torch.float64)
    got = _run(backend, x, mode, top_k, block_idx, torch.float32)
    kl_got, kl_want = got[1], want[1]
    assert bool(torch.isfinite(kl_got)) == bool(torch.isfinite(kl_want)), (kl_got, kl_want)
    if torch.isfinite(kl_want):
        assert abs(kl_got.item() - kl_want.item()) <= REL_TOL * abs(kl_want.item()) + 1e-7
    _assert_oracle_rows(got, want)


def _minus_inf_scores(case: str):
    """Inputs where an Inf turns scores into -Inf (not NaN, not +Inf): ``row``: query row 120,
    head 1 holds -Inf in feature 2 and every key's feature 2 is positive, so all the row's
    scores are -Inf (softmax: NaN); ``block``: every query's feature 2 is positive and the keys
    61..76 of KV head 0 (block 1 of sequence 1) hold -Inf there, so that whole block scores
    -Inf for every row of its sequence (weight 0 in the softmax; NaN in dQ through
    ``0 * -Inf``)."""
    x = make_inputs([45, 90], heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    seed=seed_from(f"minus-inf-{case}"), requires_grad=False)
    if case == "row":
        x["k"][:, :, 2] = x["k"][:, :, 2].abs() + 0.5
        x["q"][120, 1, 2] = float("-inf")
    else:
        x["q"][:, :, 2] = x["q"][:, :, 2].abs() + 0.5
        x["k"][61:77, 0, 2] = float("-inf")
        # the index selects block 1 for every later row of the sequence (rows past its third
        # block run the per-block kernel: top-k 3 of 4..6 blocks)
        x["q_idx"][:, :, 0] = x["q_idx"][:, :, 0].abs() + 0.5
        x["k_idx"][61:77, :, 0] = 30.0
    return {n: t.to(DEVICE) for n, t in x.items()}


@pytest.mark.parametrize("case", ["row", "block"])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scores_of_minus_inf_give_the_oracles_rows(backend, mode, case):
    """A row whose scores are all -Inf gets NaN (out, its gradients), as the oracle's softmax,
    not 0; a block whose scores are all -Inf gets no weight (its partial's LSE -Inf), not
    ``exp(0)``: the Triton forward once gave 0 and a finite, wrong dV there."""
    x = _minus_inf_scores(case)
    block_idx = _oracle_selection(x, 3) if mode == "sparse" else None
    want = _run("reference", x, mode, 3, block_idx, torch.float64)
    got = _run(backend, x, mode, 3, block_idx, torch.float32)
    assert bool(torch.isfinite(got[1])) == bool(torch.isfinite(want[1]))
    _assert_oracle_rows(got, want)


@pytest.mark.parametrize("tensor", NAMES)
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("layout,value", CASES)
def test_oracle_marks_rows_whose_support_holds_the_value(layout, value, mode, tensor):
    """The oracle's affected rows: never another sequence; for q/k/v exactly the output rows
    whose support holds the poisoned row (q: the row itself); q_idx/k_idx change only the
    selection and the KL, so the outputs stay finite."""
    lens, hq, hkv, hi, _, top_k, (tok, head, _) = LAYOUTS[layout]
    _, x = _inputs(layout, tensor, value)
    block_idx = _oracle_selection(x, top_k) if mode == "sparse" else None
    res = _run("reference", x, mode, top_k, block_idx, torch.float64)
    seq = torch.zeros(sum(lens), dtype=torch.bool, device=DEVICE)
    seq[lens[0]:] = True  # the poisoned token lies in sequence 1
    for t in res[:1] + res[2:]:
        assert not _affected(t)[~seq].any(), "a non-finite value reached another sequence"
    T = sum(lens)
    q_pos, q_kbase = query_layout(x["cu_seqlens"], T, DEVICE)
    supp = ref.support_mask(block_idx, q_pos, q_kbase, T, BLOCK, hi)  # [Hi, T, T]
    supp = supp.repeat_interleave(hq // hi, dim=0)  # [Hq, T, T]
    expect = torch.zeros(T, hq, dtype=torch.bool, device=DEVICE)
    if tensor == "q":
        expect[tok, head] = True
    elif tensor in ("k", "v"):
        group = torch.arange(hq, device=DEVICE) // (hq // hkv)
        expect = (supp[:, :, tok] & (group == min(head, hkv - 1))[:, None]).T
    out_bad = _affected(res[0])
    if tensor == "k" and value == "inf":
        # q.k = -inf gives probability 0 (a finite row); the gradient dq still sees the Inf.
        assert not (out_bad & ~expect).any() and torch.equal(_affected(res[2]), expect)
    else:
        assert torch.equal(out_bad, expect)


@pytest.mark.parametrize("value", ["nan", "inf"])
@pytest.mark.parametrize("tensor", ["q_idx", "k_idx"])
@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_selection_of_other_sequences_is_unchanged(backend, tensor, value):
    lens, _, _, _, _, top_k, _ = LAYOUTS["mid"]
    clean, x = _inputs("mid", tensor, value)
    sel = [select_blocks(d["q_idx"], d["k_idx"], d["cu_seqlens"], block_size=BLOCK,
                         top_k=top_k, backend=backend) for d in (clean, x)]
    assert torch.equal(sel[0][:lens[0]], sel[1][:lens[0]])
    if backend == "torch":
        assert torch.equal(sel[1], _oracle_selection(x, top_k))


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_overflowing_logits_of_finite_inputs_reach_the_kl(backend, mode):
    """Finite inputs whose main logit overflows fp32 in one row (q[40, 0, 3] * k[10, 0, 3] =
    1e40, 2.5e39 after the softmax scale): that row's probabilities, so its teacher, are NaN, and the KL value is NaN as the
    oracle's in the same dtype. The torch backend's all-finite path once dropped the NaN teacher
    from the value (``teacher > 0`` is false for NaN) and logged a finite KL while the row's
    output and ``dq_idx`` were NaN."""
    x = make_inputs([45, 38], heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    seed=seed_from(f"overflow-{mode}"), requires_grad=False)
    # Feature 3 of every other query is 0, so only row 40 head 0 sees the huge key: other rows
    # would otherwise get huge but finite logits (~1e18), which fp32 kernels cannot subtract
    # from their LSE exactly (TF32 products on GPU give inf there, the CPU oracle does not).
    x["q"][:, :, 3] = 0.0
    x["q"][40, 0, 3] = 1e21
    x["k"][10, 0, 3] = 1e19
    x = {n: t.to(DEVICE) for n, t in x.items()}
    assert all(torch.isfinite(x[n]).all() for n in NAMES)
    block_idx = _oracle_selection(x, 2) if mode == "sparse" else None
    if block_idx is not None:  # the overflowing key is in row 40's support
        assert bool((block_idx[40, 0] == 0).any())
    want = _run("reference", x, mode, 2, block_idx, torch.float32)
    got = _run(backend, x, mode, 2, block_idx, torch.float32)
    assert not bool(torch.isfinite(want[1])), "the oracle's KL must see the overflow"
    assert not bool(torch.isfinite(got[1])), f"KL {got[1].item()} hides the NaN teacher"
    for name, i in (("out", 0), ("dq_idx", 5)):
        assert torch.equal(_affected(got[i]), _affected(want[i])), name
        assert bool(_affected(want[i])[40].any()), name
