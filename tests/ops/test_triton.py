"""``backend="triton"`` against the oracle (msa_megatron.reference).

Without CUDA the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` is set here,
before anything imports the kernel modules (they import Triton lazily). The interpreter is
slow, so shapes are small (T <= 300, D 16-32); it multiplies bf16 operands of ``tl.dot`` as raw
bits, which the kernels avoid by upcasting there, so bf16 is covered too.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.api import msa_attention  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from tests.support.inputs import assert_selection_equal, check_selection_structure, rel_err  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Relative error bars (norm of the difference over the norm of the fp64 oracle).
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
# Block scores closer than this (fp32 ranking vs fp32 oracle) count as a near-tie.
TIE_TOL = 1e-3


@pytest.fixture(scope="module", autouse=True)
def _fast_interpreter():
    """Skip the interpreter's re-patching of ``triton.language`` on every nested jit call.

    The interpreter patches the language once per kernel launch and again, identically, on
    each call of a ``@triton.jit`` helper (about 5 ms each, most of the test time). This keeps
    the first patch of each launch. Only used when the installed interpreter has the expected
    internals; results are the same either way.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter as it

    needed = ("InterpretedFunction", "GridExecutor", "_patch_lang", "InterpreterError")
    if not all(hasattr(it, name) for name in needed) or not hasattr(it.InterpretedFunction,
                                                                      "rewrite"):
        yield
        return
    patched = set()
    grid_call, fn_call = it.GridExecutor.__call__, it.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        patched.clear()
        return grid_call(self, *args, **kwargs)

    def call(self, *args, **kwargs):
        if id(self.fn.__globals__) not in patched:
            it._patch_lang(self.fn)
            patched.add(id(self.fn.__globals__))
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    it.GridExecutor.__call__, it.InterpretedFunction.__call__ = launch, call
    yield
    it.GridExecutor.__call__, it.InterpretedFunction.__call__ = grid_call, fn_call


def _triton():
    from msa_megatron.ops import triton as backend

    return backend


def _layout(lens, gen_cp=False):
    """``(q_pos, q_kbase, Tk, rows, cu_seqlens)``: THD sequences, or a CP-like layout (Tk > Tq).

    ``gen_cp``: one sequence of ``sum(lens)`` keys whose queries are chunks 0 and 3 of 4 (the
    load-balanced layout of rank 0 at CP = 2; ``cu_seqlens`` is then None); ``rows`` are the
    query rows of the full sequence.
    """
    total = sum(lens)
    if gen_cp:
        q = total // 4
        rows = torch.cat([torch.arange(0, q), torch.arange(3 * q, total)])
        return (rows.to(torch.int32).to(DEVICE), torch.zeros(rows.numel(), dtype=torch.int32,
                device=DEVICE), total, rows.to(DEVICE), None)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    q_pos, q_kbase = query_layout(cu, total, DEVICE)
    return q_pos, q_kbase, total, torch.arange(total, device=DEVICE), cu


def _randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


def _assert_selection_equal_general(got, want, q_idx, k_idx, q_pos, q_kbase, block_size):
    """:func:`tests.support.inputs.assert_selection_equal` for a general query layout (no
    ``cu_seqlens``): equal except near-ties, where each chosen block's oracle score must be >=
    the oracle's worst chosen score minus TIE_TOL, with the same count."""
    assert got.shape == want.shape and got.dtype == torch.int32
    diff = (got != want).any(dim=2)
    if not diff.any():
        return
    scores = ref.block_scores_reference(q_idx.float(), k_idx.float(), q_pos, q_kbase,
                                        block_size=block_size)
    for t, i in diff.nonzero().tolist():
        g, w = got[t, i], want[t, i]
        assert (g >= 0).sum() == (w >= 0).sum(), f"row ({t}, {i}): {g.tolist()} vs {w.tolist()}"
        s = scores[i, t]
        worst = s[w[w >= 0].long()].min()
        chosen = s[g[g >= 0].long()]
        assert (chosen >= worst - TIE_TOL).all(), f"row ({t}, {i}): {g.tolist()} vs {w.tolist()}"


# ---------------------------------------------------------------- selection
SELECT_CASES = [
    # lens, Hi, Hik, Di, block, top_k, init, local, dtype, cp-like layout
    ([300], 2, 1, 16, 16, 4, 0, 1, torch.float32, False),
    ([10], 1, 1, 16, 16, 3, 0, 1, torch.float32, False),  # shorter than a block
    ([37, 0, 16, 1, 90, 5, 5, 60], 4, 2, 32, 16, 3, 0, 1, torch.float16, False),  # short docs
    ([130, 0, 70, 99], 8, 1, 16, 32, 5, 1, 2, torch.float16, False),  # init + local
    ([50], 2, 2, 16, 16, 6, 0, 1, torch.float32, False),  # top_k >= number of blocks
    ([160], 4, 1, 32, 16, 3, 0, 1, torch.bfloat16, False),
    ([192], 2, 1, 16, 16, 4, 1, 1, torch.float32, True),  # Tk > Tq (context parallel)
]


@pytest.mark.parametrize("case", SELECT_CASES, ids=lambda c: f"{c[0]}-Hi{c[1]}-Hik{c[2]}-k{c[5]}")
def test_select_matches_reference(case):
    lens, hi, hik, di, block, top_k, init, local, dtype, cp = case
    q_pos, q_kbase, tk, rows, cu = _layout(lens, cp)
    q_idx = _randn(tk, hi, di, dtype=dtype)[rows]
    k_idx = _randn(tk, hik, di, dtype=dtype)
    got = _triton().select(q_idx, k_idx, q_pos, q_kbase, block_size=block, top_k=top_k,
                           init_blocks=init, local_blocks=local)
    want = ref.select_core_reference(q_idx.float(), k_idx.float(), q_pos, q_kbase,
                                     block_size=block, top_k=top_k, init_blocks=init,
                                     local_blocks=local)
    options = dict(block_size=block, top_k=top_k, init_blocks=init, local_blocks=local)
    if cu is None:
        check_selection_structure(got.cpu(), q_pos.cpu(), **options)
        _assert_selection_equal_general(got, want, q_idx, k_idx, q_pos, q_kbase, block)
    else:
        assert_selection_equal(got, want, q_idx.float(), k_idx.float(), cu, **options)


def test_select_breaks_ties_to_the_lower_block():
    """Equal block scores (repeated index keys) must pick the lower block numbers."""
    q_pos, q_kbase, tk, _, _ = _layout([96])
    k_idx = _randn(16, 1, 16, dtype=torch.float32).repeat(6, 1, 1)  # every block identical
    q_idx = _randn(tk, 2, 16, dtype=torch.float32)
    got = _triton().select(q_idx, k_idx, q_pos, q_kbase, block_size=16, top_k=3)
    want = ref.select_core_reference(q_idx, k_idx, q_pos, q_kbase, block_size=16, top_k=3)
    assert torch.equal(got, want)
    last = got[-1, 0].tolist()
    assert last == [0, 1, 5], last  # two ties resolved low, plus the forced own block


# Selection in its two kernels with tiny tiles, groups and chunks: tiles straddle documents, a
# row's blocks come from several block-key programs, queries from several buffer chunks, and
# the top-k walk takes few blocks per step (evictions among equal kept keys).
SELECT_SMALL = dict(SELECT_ROWS=16, SELECT_ROWS_FP32=16, GROUP_BLOCKS=2, KEY_BUFFER_BYTES=4096,
                    MIN_CHUNK_TOKENS=1, TOPK_ROWS=16, TOPK_CHUNK=2)
ODD_SELECT_CASES = [
    # lens, Hi, Hik, block, top_k, init, local
    ([7], 2, 1, 16, 2, 0, 1),  # shorter than a block
    ([33, 47], 1, 1, 16, 2, 0, 1),  # Hi / Hik = 1, lengths not a multiple of the block
    ([100], 16, 1, 16, 3, 0, 1),  # 16 index heads on one index key head
    ([3, 0, 17, 1, 5, 40, 2, 16, 31], 4, 2, 16, 2, 0, 1),  # many short documents
    ([120], 2, 1, 16, 9, 1, 2),  # top_k larger than most prefixes
    ([150, 70], 2, 1, 16, 16, 0, 1),  # top_k 16: a top-k row width of 16
    ([200], 2, 1, 16, 17, 2, 1),  # top_k 17: width 32, padding slots
]


@pytest.mark.parametrize("case", ODD_SELECT_CASES,
                         ids=lambda c: f"{c[0]}-Hi{c[1]}-Hik{c[2]}-k{c[4]}")
@pytest.mark.parametrize("small", [False, True], ids=["default", "small-tiles"])
def test_select_is_exact_on_integer_scores(case, small, monkeypatch):
    """Small integer inputs make every score exact in every backend, so the selection must be
    bit-equal to the oracle (ties to the lower block included), with the default tiles and
    with tiles, block groups and buffer chunks small enough that each splits the input."""
    from msa_megatron.ops.triton import selection

    if small:
        for name, value in SELECT_SMALL.items():
            monkeypatch.setattr(selection, name, value)
    lens, hi, hik, block, top_k, init, local = case
    q_pos, q_kbase, tk, _, _ = _layout(lens)
    gen = torch.Generator().manual_seed(len(lens) * 7 + hi)
    q_idx = torch.randint(-2, 3, (tk, hi, 16), generator=gen).float().to(DEVICE)
    k_idx = torch.randint(-2, 3, (tk, hik, 16), generator=gen).float().to(DEVICE)
    opts = dict(block_size=block, top_k=top_k, init_blocks=init, local_blocks=local)
    got = _triton().select(q_idx, k_idx, q_pos, q_kbase, **opts)
    want = ref.select_core_reference(q_idx, k_idx, q_pos, q_kbase, **opts)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_select_nonfinite_and_cp_layout_small_tiles(dtype, monkeypatch):
    """NaN and +-inf scores (inf keys, inf * 0 = NaN) and a context-parallel query layout
    (queries are chunks 0 and 3 of 4 of one sequence, Tk > Tq) through small tiles, groups and
    chunks: equal to the oracle."""
    from msa_megatron.ops.triton import selection

    for name, value in SELECT_SMALL.items():
        monkeypatch.setattr(selection, name, value)
    q_pos, q_kbase, tk, rows, _ = _layout([160], gen_cp=True)
    gen = torch.Generator().manual_seed(11)
    q_full = torch.randint(-2, 3, (tk, 2, 16), generator=gen).float()
    k_idx = torch.randint(-2, 3, (tk, 1, 16), generator=gen).float()
    k_idx[20, 0, 3] = float("inf")  # block 1: +inf or -inf or NaN (inf * 0) by query
    k_idx[70, 0, :] = float("-inf")
    k_idx[101, 0, 5] = float("nan")
    q_full[150, 1, :] = float("inf")
    q_idx = q_full[rows.cpu()].to(dtype).to(DEVICE)
    k_idx = k_idx.to(dtype).to(DEVICE)
    opts = dict(block_size=16, top_k=4, init_blocks=1, local_blocks=1)
    got = _triton().select(q_idx, k_idx, q_pos, q_kbase, **opts)
    want = ref.select_core_reference(q_idx.float(), k_idx.float(), q_pos, q_kbase, **opts)
    assert torch.equal(got.cpu(), want.cpu())


def test_select_kernels_refuse_an_unforced_own_block():
    """The block-key kernel scores no query's own block (it has no causal mask): it relies on
    local_blocks >= 1 and says so when called without it."""
    from msa_megatron.ops.triton.selection import select_blocks_triton

    q_pos, q_kbase, tk, _, _ = _layout([40])
    q_idx, k_idx = _randn(tk, 1, 16, dtype=torch.float32), _randn(tk, 1, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="local_blocks"):
        select_blocks_triton(q_idx, k_idx, q_pos, q_kbase, 16, 2, 0, 0, 0.25)


# ---------------------------------------------------------------- main attention
ATTN_CASES = [
    # lens, Hq, Hkv, Hi, D, block, top_k, dtype, cp-like layout
    ([150], 2, 2, 2, 16, 16, 3, torch.float32, False),  # G = 1
    ([60, 0, 37, 9], 16, 1, 1, 32, 16, 3, torch.float16, False),  # G = 16, zero-length doc
    ([30, 1, 17], 4, 1, 2, 16, 16, 2, torch.float16, False),  # Hi > Hkv, partial blocks
    ([64], 4, 2, 2, 16, 16, 2, torch.bfloat16, True),  # Tk > Tq
    ([5, 40, 3, 70, 0, 33, 1], 16, 2, 2, 16, 32, 2, torch.float16, False),  # short docs, B 32
]


def _attention_inputs(lens, hq, hkv, hi, d, dtype, cp):
    q_pos, q_kbase, tk, rows, _ = _layout(lens, cp)
    q = _randn(tk, hq, d, dtype=dtype)[rows]
    k, v = _randn(tk, hkv, d, dtype=dtype), _randn(tk, hkv, d, dtype=dtype)
    return q, k, v, q_pos, q_kbase


def _random_selection(tq, hi, top_k, q_pos, block):
    """A valid selection: the own block plus random earlier blocks, ascending, -1 padded."""
    own = (q_pos.long() // block)[:, None, None]
    noise = torch.rand(tq, hi, int(own.max()) + 1, device=DEVICE)
    b = torch.arange(noise.shape[2], device=DEVICE)[None, None, :]
    noise = torch.where(b == own, 2.0, torch.where(b < own, noise, -1.0))
    kk = min(top_k, noise.shape[2])
    val, idx = noise.topk(kk, dim=2)
    idx = torch.where(val >= 0, idx, noise.shape[2]).sort(dim=2).values
    out = torch.full((tq, hi, top_k), -1, dtype=torch.int32, device=DEVICE)
    out[:, :, :kk] = torch.where(idx == noise.shape[2], -1, idx).to(torch.int32)
    return out


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"{c[0]}-G{c[1] // c[2]}-Hi{c[3]}")
def test_attention_matches_reference(case, dense):
    lens, hq, hkv, hi, d, block, top_k, dtype, cp = case
    q, k, v, q_pos, q_kbase = _attention_inputs(lens, hq, hkv, hi, d, dtype, cp)
    block_idx = None if dense else _random_selection(q.shape[0], hi, top_k, q_pos, block)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = _triton().attention(q, k, v, block_idx, q_pos, q_kbase, block_size=block,
                                   index_heads=hi)
    dout = _randn(*out.shape, dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want, want_lse = ref.attention_core_reference(q64, k64, v64, block_idx, q_pos, q_kbase,
                                                  block_size=block, index_heads=hi)
    want_grads = torch.autograd.grad(want, (q64, k64, v64), dout.double())
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, want) < TOL[dtype]
    assert (lse.double() - want_lse).abs().max().item() < 1e-4
    for name, got, exp in zip("qkv", (dq, dk, dv), want_grads):
        assert got.dtype == dtype
        assert rel_err(got, exp) < 2 * TOL[dtype], name


def _assert_attention_and_kl_match_reference(q, k, v, q_idx, k_idx, block_idx, q_pos, q_kbase,
                                             block_size):
    """Triton attention + KL forward and the five gradients against the float64 oracle (fp32
    inputs): output, LSE, KL value, q/k/v/q_idx/k_idx gradients."""
    q, k, v, q_idx, k_idx = (x.requires_grad_() for x in (q, k, v, q_idx, k_idx))
    backend = _triton()
    out, lse = backend.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=block_size)
    kl = backend.kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=block_size)
    dout = _randn(*out.shape, dtype=torch.float32)
    grads = torch.autograd.grad((out, kl), (q, k, v, q_idx, k_idx), (dout, torch.ones_like(kl)))
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, q_idx, k_idx)]
    want, want_lse = ref.attention_core_reference(*leaves[:3], block_idx, q_pos, q_kbase,
                                                  block_size=block_size)
    want_kl = ref.kl_core_reference(leaves[0], leaves[1], leaves[3], leaves[4], block_idx, q_pos,
                                    q_kbase, block_size=block_size)
    want_grads = torch.autograd.grad((want, want_kl), leaves, (dout.double(),
                                                               torch.ones_like(want_kl)))
    assert rel_err(out, want) < TOL[torch.float32]
    assert (lse.double() - want_lse).abs().max().item() < 1e-4
    assert abs(kl.item() - want_kl.item()) <= 1e-4 * abs(want_kl.item())
    for name, got, exp in zip(("q", "k", "v", "q_idx", "k_idx"), grads, want_grads):
        assert rel_err(got, exp) < 2 * TOL[torch.float32], name


def test_short_rows_not_selecting_every_block_stay_sparse():
    """Rows with at most k blocks whose selection (a caller's) leaves a block out must not go
    through the dense kernels: output, LSE, gradients and KL follow the given selection."""
    q, k, v, q_pos, q_kbase = _attention_inputs([70, 0, 40], 4, 2, 2, 16, torch.float32, False)
    block_idx = _random_selection(q.shape[0], 2, 3, q_pos, 16)
    own = (q_pos.long() // 16)
    short = (own == 1).nonzero().flatten()  # two blocks, both selected by _random_selection
    block_idx[short, 0] = torch.tensor([1, -1, -1], dtype=torch.int32, device=DEVICE)
    q_idx = _randn(q.shape[0], 2, 16, dtype=torch.float32)
    k_idx = _randn(k.shape[0], 1, 16, dtype=torch.float32)
    _assert_attention_and_kl_match_reference(q, k, v, q_idx, k_idx, block_idx, q_pos, q_kbase,
                                             block_size=16)


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
def test_backward_is_deterministic(dense):
    """Two backward passes give bitwise equal gradients (no atomics)."""
    q, k, v, q_pos, q_kbase = _attention_inputs([30, 0, 11], 4, 2, 2, 16, torch.float16, False)
    block_idx = None if dense else _random_selection(q.shape[0], 2, 2, q_pos, 16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, _ = _triton().attention(q, k, v, block_idx, q_pos, q_kbase, block_size=16,
                                 index_heads=2)
    dout = _randn(*out.shape, dtype=torch.float16)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    second = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_chunks_and_key_subtiles_match_reference(monkeypatch):
    """Queries split in many chunks and blocks split in key sub-tiles give the same results."""
    from msa_megatron.ops.triton import _common, backward, kl_loss

    monkeypatch.setattr(_common, "PARTIAL_QS", 0)  # every consumer splits into 16 chunks
    monkeypatch.setattr(_common, "PARTIAL_MIN_BYTES", 1)
    monkeypatch.setattr(kl_loss, "KEY_SUBTILE", 16)
    monkeypatch.setattr(kl_loss, "PASS_B_KEYS", 16)
    monkeypatch.setattr(backward, "ITEM_KEYS", 16)
    q, k, v, q_pos, q_kbase = _attention_inputs([45, 0, 30], 4, 2, 2, 16, torch.float32, False)
    q_idx = _randn(q.shape[0], 2, 16, dtype=torch.float32)
    k_idx = _randn(k.shape[0], 1, 16, dtype=torch.float32)
    block_idx = _random_selection(q.shape[0], 2, 2, q_pos, 32)
    _assert_attention_and_kl_match_reference(q, k, v, q_idx, k_idx, block_idx, q_pos, q_kbase,
                                             block_size=32)


@pytest.mark.parametrize("top_k", [5, 34], ids=["bitmask-slots", "more-than-32-slots"])
def test_forward_item_tiles_match_reference_and_repeat(monkeypatch, top_k):
    """The sparse forward with items spanning several row tiles (the prefetched next tiles run
    past an item's end), merge tiles straddling sequences, and more than 32 slots per row (the
    merge then reads each slot's block instead of a bit mask): output and LSE equal the
    oracle's, and a second call is bitwise equal."""
    from msa_megatron.ops.triton import forward

    monkeypatch.setattr(forward, "FWD_ROWS", 16)  # 8 tokens x 2 heads per tile
    monkeypatch.setattr(forward, "MERGE_ROWS", 16)
    q, k, v, q_pos, q_kbase = _attention_inputs([700, 90], 4, 2, 2, 16, torch.float32, False)
    block_idx = _random_selection(q.shape[0], 2, top_k, q_pos, 16)
    backend = _triton()
    out, lse = backend.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=16)
    want, want_lse = ref.attention_core_reference(q.double(), k.double(), v.double(), block_idx,
                                                  q_pos, q_kbase, block_size=16)
    assert rel_err(out, want) < TOL[torch.float32]
    assert (lse.double() - want_lse).abs().max().item() < 1e-4
    again, again_lse = backend.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=16)
    assert torch.equal(out, again) and torch.equal(lse, again_lse)


@pytest.mark.parametrize("top_k", [5, 34], ids=["bitmask-slots", "more-than-32-slots"])
def test_backward_item_tiles_match_reference_and_repeat(monkeypatch, top_k):
    """The sparse backward with items spanning many row tiles (the prefetched next tiles run
    past an item's end and past a bucket's end into the next index head's pairs), several
    token chunks, and more than 32 slots per row (the dQ sum then reads each slot's block
    instead of a bit mask): gradients equal the oracle's and a second call is bitwise equal."""
    from msa_megatron.ops.triton import _common, backward

    monkeypatch.setattr(backward, "ITEM_ROWS", 16)  # fp32: 8 tokens x 2 heads per tile
    monkeypatch.setattr(_common, "PARTIAL_QS", 0)  # 16 token chunks
    monkeypatch.setattr(_common, "PARTIAL_MIN_BYTES", 1)
    q, k, v, q_pos, q_kbase = _attention_inputs([300, 0, 90], 4, 1, 2, 16, torch.float32, False)
    block_idx = _random_selection(q.shape[0], 2, top_k, q_pos, 16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, _ = _triton().attention(q, k, v, block_idx, q_pos, q_kbase, block_size=16)
    dout = _randn(*out.shape, dtype=torch.float32)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want, _ = ref.attention_core_reference(*leaves, block_idx, q_pos, q_kbase, block_size=16)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    for name, got, exp in zip("qkv", grads, want_grads):
        assert rel_err(got, exp) < 2 * TOL[torch.float32], name
    again = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["sparse-split", "dense-split", "dense-unsplit"])
def test_dense_dkdv_split_matches_reference_and_repeat(monkeypatch, mode):
    """The dense dK/dV kernel with each key tile's query tiles split over several programs
    (fp32 partials summed in slice order; a sparse call's full-prefix rows, and dense mode),
    and unsplit: gradients equal the oracle's, a second call is bitwise equal, and the split
    runs (tiles with two and more extra slices)."""
    from msa_megatron.ops.triton import backward

    sparse = mode == "sparse-split"
    split = mode.endswith("-split")
    monkeypatch.setattr(backward, "INTERPRETER_SPLIT", (64, 1))  # 32 per KV group
    monkeypatch.setattr(backward, "DENSE_SPLIT_BELOW", 10 ** 6 if split else 0)
    made = []
    original = backward.split_query_tiles

    def recording(*args):
        made.append(original(*args))
        return made[-1]

    monkeypatch.setattr(backward, "split_query_tiles", recording)
    # fp32: key tiles of 16 rows, 8 tokens x 2 heads per query tile; with k = 5 blocks of 16
    # the first 80 tokens of each document are full-prefix rows (10 query tiles).
    q, k, v, q_pos, q_kbase = _attention_inputs([200, 0, 90], 4, 2, 2, 16, torch.float32, False)
    block_idx = _random_selection(q.shape[0], 2, 5, q_pos, 16) if sparse else None
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, _ = _triton().attention(q, k, v, block_idx, q_pos, q_kbase, block_size=16,
                                 index_heads=2)
    dout = _randn(*out.shape, dtype=torch.float32)
    grads = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    want, _ = ref.attention_core_reference(*leaves, block_idx, q_pos, q_kbase, block_size=16,
                                           index_heads=2)
    want_grads = torch.autograd.grad(want, leaves, dout.double())
    for name, got, exp in zip("qkv", grads, want_grads):
        assert got.dtype == torch.float32
        assert rel_err(got, exp) < 2 * TOL[torch.float32], name
    again = torch.autograd.grad(out, (q, k, v), dout)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)
    assert len(made) == (2 if split else 0)
    if split:
        nt = made[0][0].numel()
        _, unit, sums = made[0]
        assert (unit[0] < nt).sum() >= 4 and (sums[2][sums[0] < nt] >= 2).any()


# ---------------------------------------------------------------- KL
KL_CASES = [
    # lens, Hq, Hkv, Hi, Hik, D, Di, block, top_k, dtype
    ([120], 4, 2, 2, 1, 16, 16, 16, 3, torch.float32),
    ([24, 0, 17, 9], 16, 1, 1, 1, 32, 16, 16, 2, torch.float16),
    ([20, 1, 17], 8, 2, 4, 2, 16, 32, 16, 2, torch.float16),  # Hik > 1, Di != D
    ([20, 19], 4, 2, 4, 4, 16, 16, 16, 2, torch.float32),  # Hik > Hkv: per-head units
    ([37, 5, 0, 50], 2, 2, 2, 1, 16, 16, 16, 3, torch.float32),  # G = 1, one head per index head
]


@pytest.mark.parametrize("dense", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("case", KL_CASES, ids=lambda c: f"{c[0]}-Hi{c[3]}-Hik{c[4]}")
def test_kl_matches_reference(case, dense):
    lens, hq, hkv, hi, hik, d, di, block, top_k, dtype = case
    q, k, v, q_pos, q_kbase = _attention_inputs(lens, hq, hkv, hi, d, dtype, False)
    tk = k.shape[0]
    q_idx = _randn(q.shape[0], hi, di, dtype=dtype).requires_grad_()
    k_idx = _randn(tk, hik, di, dtype=dtype).requires_grad_()
    block_idx = None if dense else _random_selection(q.shape[0], hi, top_k, q_pos, block)
    backend = _triton()
    _, lse = backend.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=block,
                               index_heads=hi)
    value = backend.kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=block,
                       kl_scale=0.37)
    dq_idx, dk_idx = torch.autograd.grad(2.0 * value, (q_idx, k_idx))
    qi64, ki64 = (x.detach().double().requires_grad_() for x in (q_idx, k_idx))
    want = ref.kl_core_reference(q.double(), k.double(), qi64, ki64, block_idx, q_pos, q_kbase,
                                 block_size=block, kl_scale=0.37)
    want_dq, want_dk = torch.autograd.grad(2.0 * want, (qi64, ki64))
    assert value.dtype == torch.float32 and value.dim() == 0
    assert abs(value.item() - want.item()) <= 1e-4 * abs(want.item()) + 1e-6
    assert dq_idx.dtype == dtype and dk_idx.dtype == dtype
    assert rel_err(dq_idx, want_dq) < 2 * TOL[dtype]
    assert rel_err(dk_idx, want_dk) < 2 * TOL[dtype]


def _sparse_kl_many_tiles(monkeypatch, dtype):
    """Inputs whose sparse KL pass walks 4 query chunks, key sub-tiles of 16 rows and several
    16-pair row tiles per selected block: ``(q, k, lse, q_idx, k_idx, block_idx, q_pos,
    q_kbase)`` (block 32, 2 of up to 5 blocks selected: most rows are sparse)."""
    from msa_megatron.ops.triton import _common, kl_loss

    monkeypatch.setattr(_common, "PARTIAL_QS", 0)
    monkeypatch.setattr(_common, "PARTIAL_MIN_BYTES", 40000)  # of ~121 KB of partials
    monkeypatch.setattr(kl_loss, "KEY_SUBTILE", 16)
    monkeypatch.setattr(kl_loss, "PASS_B_KEYS", 16)
    monkeypatch.setattr(kl_loss, "KL_ROWS", 16)
    monkeypatch.setattr(kl_loss, "PASS_B_ROWS", 16)
    q, k, v, q_pos, q_kbase = _attention_inputs([150, 3, 0, 70], 8, 2, 2, 16, dtype, False)
    q_idx = _randn(q.shape[0], 2, 16, dtype=dtype)
    k_idx = _randn(k.shape[0], 1, 16, dtype=dtype)
    block_idx = _random_selection(q.shape[0], 2, 2, q_pos, 32)
    own = q_pos.long() // 32
    assert ((block_idx >= 0).sum(2) < (own + 1)[:, None]).sum() > 100  # rows of the sparse pass
    _, lse = _triton().attention(q, k, v, block_idx, q_pos, q_kbase, block_size=32)
    return q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase


def test_kl_many_row_tiles_match_reference(monkeypatch):
    """The sparse KL with a block's pairs spread over several row tiles, chunks and key
    sub-tiles: value and both index gradients against the float64 oracle."""
    q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase = _sparse_kl_many_tiles(monkeypatch,
                                                                               torch.float32)
    q_idx, k_idx = q_idx.requires_grad_(), k_idx.requires_grad_()
    value = _triton().kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=32)
    dq_idx, dk_idx = torch.autograd.grad(value, (q_idx, k_idx))
    qi64, ki64 = (x.detach().double().requires_grad_() for x in (q_idx, k_idx))
    want = ref.kl_core_reference(q.double(), k.double(), qi64, ki64, block_idx, q_pos, q_kbase,
                                 block_size=32)
    want_dq, want_dk = torch.autograd.grad(want, (qi64, ki64))
    assert abs(value.item() - want.item()) <= 1e-4 * abs(want.item())
    assert rel_err(dq_idx, want_dq) < 2 * TOL[torch.float32]
    assert rel_err(dk_idx, want_dk) < 2 * TOL[torch.float32]


def test_kl_is_deterministic(monkeypatch):
    """Two sparse KL calls give bitwise equal values and index gradients (partials are summed
    in a fixed order, no atomics)."""
    q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase = _sparse_kl_many_tiles(monkeypatch,
                                                                               torch.float16)
    q_idx, k_idx = q_idx.requires_grad_(), k_idx.requires_grad_()
    runs = []
    for _ in range(2):
        value = _triton().kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=32)
        runs.append((value, *torch.autograd.grad(value, (q_idx, k_idx))))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# ---------------------------------------------------------------- whole op
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_msa_attention_matches_reference(mode):
    """Public op, backend="triton": output, KL and all five gradients vs the oracle."""
    lens, hq, hkv, hi, hik, d = [30, 0, 3, 20], 8, 2, 2, 1, 16
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    t = sum(lens)
    inputs = [_randn(t, h, d, dtype=torch.float32) for h in (hq, hkv, hkv, hi, hik)]
    options = dict(block_size=16, top_k=3, init_blocks=1, local_blocks=1, mode=mode)
    got_in = [x.clone().requires_grad_() for x in inputs]
    out, kl = msa_attention(*got_in, cu, backend="triton", **options)
    w = _randn(*out.shape, dtype=torch.float32)
    ((out * w).sum() + 3.0 * kl).backward()
    want_in = [x.double().requires_grad_() for x in inputs]
    want_out, want_kl = ref.msa_attention_reference(*want_in, cu, **options)
    ((want_out * w.double()).sum() + 3.0 * want_kl).backward()
    assert rel_err(out, want_out) < TOL[torch.float32]
    assert abs(kl.item() - want_kl.item()) <= 1e-4 * abs(want_kl.item())
    for name, a, b in zip(("q", "k", "v", "q_idx", "k_idx"), got_in, want_in):
        assert rel_err(a.grad, b.grad) < 2 * TOL[torch.float32], name


def test_compiles_fullgraph():
    """The custom ops trace with their fake implementations (no graph break)."""
    q, k, v, q_pos, q_kbase = _attention_inputs([24], 4, 2, 2, 16, torch.float32, False)
    q_idx = _randn(24, 2, 16, dtype=torch.float32).requires_grad_()
    k_idx = _randn(24, 1, 16, dtype=torch.float32).requires_grad_()
    backend = _triton()

    def step(q, k, v, q_idx, k_idx):
        block_idx = backend.select(q_idx, k_idx, q_pos, q_kbase, block_size=16, top_k=2)
        out, lse = backend.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=16)
        kl = backend.kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=16)
        return out, kl

    q, k, v = (x.requires_grad_() for x in (q, k, v))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out, kl = compiled(q, k, v, q_idx, k_idx)
    eager_out, eager_kl = step(q, k, v, q_idx, k_idx)
    assert torch.equal(out, eager_out) and torch.equal(kl, eager_kl)
    (out.sum() + kl).backward()
    assert all(x.grad is not None for x in (q, k, v, q_idx, k_idx))


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "change, error",
    [
        (dict(d=24), ValueError),  # head dim the kernels do not support
        (dict(di=48), ValueError),
        (dict(block_size=256), ValueError),
        (dict(dtype=torch.float64), TypeError),
    ],
    ids=["D", "Di", "block", "dtype"],
)
def test_rejects_unsupported_input(change, error):
    d, di = change.get("d", 16), change.get("di", 16)
    dtype = change.get("dtype", torch.float32)
    t = 20
    args = [_randn(t, h, dim, dtype=dtype) for h, dim in ((4, d), (2, d), (2, d), (2, di), (1, di))]
    with pytest.raises(error, match="triton"):
        msa_attention(*args, backend="triton", block_size=change.get("block_size", 16), top_k=2)
