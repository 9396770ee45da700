"""Dense KL with a Gluon pass A (msa_megatron/ops/triton/dense_kl_gluon.py), on the CPU.

The key-chunk orchestration with pass A in torch (:func:`pass_a_torch`, the stand-in of the
Gluon kernel) and the Triton pass B under the interpreter, against the float64 oracle; pass B
alone against torch; the tile ranges (pass B reads only tiles pass A wrote); the supported()
reasons; and the sm_90 compile of the Gluon kernel when Triton 3.6 is at /tmp/t36site.
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops.triton import dense_kl_gluon as dkg  # noqa: E402
from msa_megatron.ops.triton.dense_kl import dense_kl_loss  # noqa: E402
from msa_megatron.parallel.cp_layout import build_cp_layout  # noqa: E402
from tests.support.inputs import rel_err  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T36 = "/tmp/t36site"


def _lse(q, k, q_pos, q_kbase, scale):
    """``[Tq, Hq]`` float64 main LSE over each row's support."""
    Tq, Hq, _ = q.shape
    Tk, Hkv, _ = k.shape
    kk = k.double().repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("thd,uhd->thu", q.double(), kk) * scale
    u = torch.arange(Tk)
    inside = (u[None] >= q_kbase.long()[:, None]) & (u[None] <= (q_kbase + q_pos).long()[:, None])
    return torch.logsumexp(s.masked_fill(~inside[:, None], -float("inf")), dim=2)


def _case(lens, heads, dims=(16, 16), dtype=torch.float32, seed=0):
    hq, hkv, hi, hik = heads
    d, di = dims
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(cu[-1])
    q_pos, q_kbase = query_layout(cu, t, "cpu")
    x = [torch.randn(*s, generator=gen, dtype=torch.float64).to(dtype)
         for s in ((t, hq, d), (t, hkv, d), (t, hi, di), (t, hik, di))]
    return (*x, q_pos.contiguous(), q_kbase.contiguous())


def _cp_case(lens, heads, cp_size, cp_rank, dims=(16, 16), dtype=torch.float32, seed=0):
    """One context-parallel rank's view of :func:`_case`'s problem (megatron-core's
    load-balanced split, :func:`build_cp_layout`): the rank's query rows against all keys, with
    their positions in their document and the global row of its start."""
    q, k, q_idx, k_idx, _, _ = _case(lens, heads, dims, dtype, seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = build_cp_layout(cu, cp_size, cp_rank, 1, torch.device("cpu"))
    rows = layout.local_rows
    return (q[rows].contiguous(), k, q_idx[rows].contiguous(), k_idx, layout.q_pos.contiguous(),
            layout.q_kbase.contiguous())


def _oracle(q, k, q_idx, k_idx, q_pos, q_kbase, kl_scale):
    leaves = [x.double().requires_grad_() for x in (q_idx, k_idx)]
    want = ref.kl_core_reference(q.double(), k.double(), *leaves, None, q_pos, q_kbase,
                                 block_size=16, softmax_scale=q.shape[2] ** -0.5,
                                 index_scale=q_idx.shape[2] ** -0.5, kl_scale=kl_scale)
    return (want, *torch.autograd.grad(want, leaves))


def _chunked(q, k, q_idx, k_idx, q_pos, q_kbase, kl_scale, **kw):
    lse = _lse(q, k, q_pos, q_kbase, q.shape[2] ** -0.5).float()
    return dkg.dense_kl_chunked(q, k, lse, q_idx, k_idx, q_pos, q_kbase, q.shape[2] ** -0.5,
                                q_idx.shape[2] ** -0.5, kl_scale, True,
                                pass_a=dkg.pass_a_torch, **kw)


CASES = {
    "T1": ([1], (16, 1, 1, 1)),
    "T5-hpi16": ([5], (16, 1, 1, 1)),
    "T130-hpi1": ([130], (2, 2, 2, 1)),
    "T300-paperlike": ([300], (16, 4, 4, 1)),
    "packed": ([61, 7, 90], (8, 2, 2, 1)),
}


@pytest.mark.parametrize("budget", [None, "small"], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("name", list(CASES))
def test_orchestration_matches_the_oracle(name, budget):
    lens, heads = CASES[name]
    x = _case(lens, heads)
    bm, bn = 16, 32
    kw = dict(bm=bm, bn=bn)
    if budget:  # one key tile per chunk
        kw["budget"] = heads[2] * dkg.triton.cdiv(sum(lens), bm) * bm * 4 * bn
    got = _chunked(*x, kl_scale=0.3, **kw)
    want = _oracle(*x, kl_scale=0.3)
    assert abs(got[0].item() - want[0].item()) <= 1e-4 * abs(want[0].item()) + 1e-6
    for label, a, b in zip(("dq_idx", "dk_idx"), got[1:], want[1:]):
        assert a.shape == b.shape, label
        assert rel_err(a, b) < 1e-4, label


CP_CASES = {  # lengths are multiples of 2 CP (megatron-core pads THD sequences for CP)
    "cp2-r0": ([320], 2, 0),
    "cp2-r1": ([320], 2, 1),
    "cp4-r2": ([320], 4, 2),
    "cp2-r1-packed": ([104, 8, 0, 296], 2, 1),
    "cp4-r1-packed": ([104, 8, 0, 296], 4, 1),
}


@pytest.mark.parametrize("budget", [None, "small"], ids=["one-chunk", "chunks"])
@pytest.mark.parametrize("name", list(CP_CASES))
def test_cp_layout_matches_the_triton_pass_and_the_oracle(name, budget):
    """The CP layout (fewer query rows than keys, each row's own key base and position): the
    orchestration with the torch pass A equals dense_kl.dense_kl_loss (which the Gluon pass is
    checked against on the GPU, gluon_probe --kl-child check_cp) and the float64 oracle, in one
    key chunk and in one chunk per key tile."""
    lens, cp_size, cp_rank = CP_CASES[name]
    x = _cp_case(lens, (8, 2, 2, 1), cp_size, cp_rank, seed=len(name) + cp_rank)
    assert x[0].shape[0] * cp_size == x[1].shape[0]
    bm, bn = 16, 32
    kw = dict(bm=bm, bn=bn, dz_fill=float("nan"))  # a tile pass B reads unwritten shows
    if budget:  # one key tile per chunk
        kw["budget"] = 2 * dkg.triton.cdiv(x[0].shape[0], bm) * bm * 4 * bn
    got = _chunked(*x, kl_scale=0.3, **kw)
    lse = _lse(x[0], x[1], x[4], x[5], x[0].shape[2] ** -0.5).float()
    triton_pass = dense_kl_loss(x[0], x[1], lse, x[2], x[3], x[4], x[5], x[0].shape[2] ** -0.5,
                                x[2].shape[2] ** -0.5, 0.3, True)
    want = _oracle(*x, kl_scale=0.3)
    for ref_name, other in (("triton", triton_pass), ("oracle", want)):
        assert abs(got[0].item() - other[0].item()) <= 1e-4 * abs(other[0].item()) + 1e-6, \
            ref_name
        for label, a, b in zip(("dq_idx", "dk_idx"), got[1:], other[1:]):
            assert a.shape == b.shape, (ref_name, label)
            assert torch.isfinite(a).all(), (ref_name, label)
            assert rel_err(a, b) < 1e-4, (ref_name, label)


def test_cp_layout_in_fp16_with_head_dim_32():
    """fp16 inputs (dz stored in fp16 as the kernel does), D = Di = 32, CP 4 rank 1 of packed
    documents, several key chunks: within fp16 rounding of the Triton pass and the oracle."""
    x = _cp_case([104, 8, 296], (8, 2, 2, 1), 4, 1, dims=(32, 32), dtype=torch.float16, seed=11)
    got = _chunked(*x, kl_scale=1.0, bm=16, bn=32, budget=2 * 7 * 16 * 2 * 64)
    lse = _lse(x[0], x[1], x[4], x[5], 32 ** -0.5).float()
    triton_pass = dense_kl_loss(x[0], x[1], lse, x[2], x[3], x[4], x[5], 32 ** -0.5,
                                32 ** -0.5, 1.0, True)
    want = _oracle(*x, kl_scale=1.0)
    for other, tol in ((triton_pass, 1e-4), (want, 1e-2)):
        assert abs(got[0].item() - other[0].item()) <= tol * abs(other[0].item())
        for a, b in zip(got[1:], other[1:]):
            assert rel_err(a, b) < tol


def test_fp16_and_the_default_tiles():
    x = _case([70, 150], (4, 1, 2, 1), dtype=torch.float16, seed=3)
    got = _chunked(*x, kl_scale=1.0)
    want = _oracle(*x, kl_scale=1.0)
    assert abs(got[0].item() - want[0].item()) <= 1e-2 * abs(want[0].item())
    for label, a, b in zip(("dq_idx", "dk_idx"), got[1:], want[1:]):
        assert rel_err(a, b) < 1e-2, label


def test_several_chunks_equal_one_chunk_and_unwritten_tiles_stay_unread():
    """NaN in every buffer tile pass A does not write: pass B must never read one."""
    x = _case([61, 7, 90], (8, 2, 2, 1), seed=5)
    one = _chunked(*x, kl_scale=1.0, bm=16, bn=32, dz_fill=float("nan"))
    many = _chunked(*x, kl_scale=1.0, bm=16, bn=32, dz_fill=float("nan"),
                    budget=2 * 10 * 16 * 4 * 32)
    for a, b in zip(one, many):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lens", [[300], [61, 7, 90], [1, 1, 1, 40]])
def test_tile_ranges_cover_the_support_and_agree(lens):
    q_pos, q_kbase = query_layout(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                               dtype=torch.int32), sum(lens), "cpu")
    bm, bn = 16, 32
    n_lo, n_hi, m_lo, m_hi = (x.tolist() for x in
                              dkg.key_tile_ranges(q_pos, q_kbase, sum(lens), bm, bn))
    pairs_a = {(m, n) for m in range(len(n_lo)) for n in range(n_lo[m], n_hi[m])}
    pairs_b = {(m, n) for n in range(len(m_lo)) for m in range(m_lo[n], m_hi[n])
               if n_lo[m] <= n < n_hi[m]}
    assert pairs_a == pairs_b  # pass B reads exactly the tiles pass A writes
    for t in range(sum(lens)):  # every (row, key) of the support lies in a walked tile pair
        for u in range(int(q_kbase[t]), int(q_kbase[t] + q_pos[t]) + 1):
            assert (t // bm, u // bn) in pairs_a
    for arr in (n_lo, n_hi):
        assert arr == sorted(arr)


@pytest.mark.parametrize("ch_lo,first_row", [(1, False), (3, True)])
def test_pass_b_matches_torch(ch_lo, first_row):
    """Pass B against torch for two key tiles of a chunk; ``first_row``: the chunk's buffer
    starts at the first query row reading it (``r0``, :func:`chunk_plan`), not at row 0."""
    torch.manual_seed(0)
    x = _case([61, 7, 90], (4, 1, 2, 1))
    q_idx, q_pos, q_kbase = x[2], x[4], x[5]
    tq, hi, di = q_idx.shape
    bm, bn, cols = 16, 32, 64
    n_lo, n_hi, m_lo, m_hi = dkg.key_tile_ranges(q_pos, q_kbase, tq, bm, bn)
    tq_pad = dkg.triton.cdiv(tq, bm) * bm
    r0 = int(m_lo[ch_lo]) * bm if first_row else 0
    assert r0 > 0 or not first_row
    dz_full = torch.randn(hi, tq_pad, cols)
    dz = dz_full[:, r0:].contiguous()
    segs = 3
    part = torch.full((segs, hi, cols, di), float("nan"))
    upcast, ieee = dkg.dot_flags(q_idx.dtype)
    dkg._dk_pass_kernel[(2, hi, segs)](dz, q_idx, n_lo, n_hi, m_lo, m_hi, part, tq,
                                       tq_pad - r0, r0, cols,
                                       ch_lo, q_idx.stride(0), q_idx.stride(1), HI=hi, DI=di,
                                       BM=bm, BN=bn, UPCAST=upcast, IEEE=ieee, ALIGN=1,
                                       RANGE_CHECK=True)
    dk = part.sum(0)
    for nn in range(2):
        n = ch_lo + nn
        want = torch.zeros(hi, bn, di)
        for m in range(len(n_lo)):
            if n_lo[m] <= n < n_hi[m]:
                t = torch.arange(m * bm, min(m * bm + bm, tq))
                want += torch.einsum("itu,tid->iud", dz_full[:, t, nn * bn:(nn + 1) * bn],
                                     q_idx[t])
        torch.testing.assert_close(dk[:, nn * bn:(nn + 1) * bn], want, rtol=1e-5, atol=1e-5)


def test_supported_reasons_and_the_error_on_cpu():
    x = _case([8], (4, 1, 1, 1), dtype=torch.bfloat16)
    ok, why = dkg.gluon_kl_supported(x[0], x[1], x[2], x[3])
    assert not ok and "CUDA" in why
    lse = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="unsupported inputs: needs a CUDA device"):
        dkg.dense_kl_loss_gluon(x[0], x[1], lse, x[2], x[3], x[4], x[5], 0.25, 0.25, 1.0, True)


def test_chunk_plan_covers_the_keys_within_the_budget():
    """Chunks in order, covering every key tile, each buffer within the budget (or one tile),
    starting at the first query row reading the chunk; causal rows make later chunks wider."""
    bm, bn, hi, item = 64, 128, 4, 2
    for T, budget, count in ((32768, 2 << 30, 3), (131072, 2 << 30, 35), (4096, 2 << 30, 1),
                             (4096, 1, 32)):
        n_k = T // bn
        m_lo = [n * bn // bm for n in range(n_k)]
        plan = dkg.chunk_plan(m_lo, hi, T, n_k, item, budget, bm, bn)
        assert len(plan) == count
        assert [p[0] for p in plan[1:]] == [p[1] for p in plan[:-1]]
        assert plan[0][0] == 0 and plan[-1][1] == n_k
        for lo, hi_, r0 in plan:
            assert r0 == min(m_lo[lo] * bm, T - bm)
            assert hi * (T - r0) * (hi_ - lo) * bn * item <= budget or hi_ - lo == 1
        widths = [p[1] - p[0] for p in plan][:-1]  # the last: what is left
        assert widths == sorted(widths)
    # key tiles no query tile reads (m_lo = the number of query tiles): r0 stays a real row
    assert dkg.chunk_plan([0, 2, 2], 1, 128, 3, 2, 64 * 128 * 2, 64, 128) == [
        (0, 1, 0), (1, 2, 64), (2, 3, 64)]


def test_chunk_plan_rows_hold_every_program_of_every_layout():
    """Every pass-A program with key tiles in a chunk, and every query tile pass B reads for
    it, starts at or after the chunk's first buffer row ``r0`` (packed documents, every CP rank
    of megatron-core's split, arbitrary rows with ``pos = -1`` and ``Tq != Tk``; several tiles
    and budgets)."""
    import random

    rnd, gen = random.Random(0), torch.Generator().manual_seed(0)
    layouts = []
    for _ in range(20):
        cp = rnd.choice([1, 2, 4])
        lens = [rnd.randint(0, 60) * 2 * cp for _ in range(rnd.randint(1, 4))]
        if sum(lens) == 0:
            continue
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        if cp == 1:
            layouts.append((*query_layout(cu, sum(lens), "cpu"), sum(lens)))
        else:
            for r in range(cp):
                lay = build_cp_layout(cu, cp, r, 1, torch.device("cpu"))
                layouts.append((lay.q_pos, lay.q_kbase, sum(lens)))
    for tq, tk in ((37, 100), (130, 61), (5, 3), (200, 1000)):
        kb = torch.randint(0, tk, (tq,), generator=gen)
        pos = torch.minimum(torch.randint(-1, tk, (tq,), generator=gen), tk - 1 - kb)
        layouts.append((pos.int(), kb.int(), tk))
    for qp, qk, tk in layouts:
        for bm, bn in ((16, 32), (64, 128), (64, 16)):
            n_lo, n_hi, m_lo, m_hi = (x.tolist() for x in dkg.key_tile_ranges(qp, qk, tk, bm, bn))
            tq_pad = len(n_lo) * bm
            for budget in (1, 2 * tq_pad * bn * 6, 1 << 30):
                plan = dkg.chunk_plan(m_lo, 2, tq_pad, len(m_lo), 2, budget, bm, bn)
                assert plan[0][0] == 0 and plan[-1][1] == len(m_lo)
                for lo, hi, r0 in plan:
                    assert 0 <= r0 <= tq_pad - bm and r0 % bm == 0
                    assert all(m * bm >= r0 for m in range(len(n_lo))
                               if max(n_lo[m], lo) < min(n_hi[m], hi))
                    assert all(m * bm >= r0 for n in range(lo, hi)
                               for m in range(m_lo[n], m_hi[n]))


def test_chunk_columns():
    assert dkg.chunk_columns(4, 1000, 5000, 2, 4 * 1000 * 2 * 300, 128) == 256
    assert dkg.chunk_columns(4, 1000, 5000, 2, 1, 128) == 128  # at least one tile
    assert dkg.chunk_columns(4, 1000, 300, 2, 1 << 40, 128) == 384  # at most the keys


@pytest.mark.skipif(not os.path.isdir(T36), reason=f"Triton 3.6 not at {T36} (sm_90 compile)")
def test_gluon_pass_a_compiles_for_sm90():
    env = dict(os.environ, PYTHONPATH=f"{T36}:{ROOT}")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gluon_probe.py"),
                           "compile", "kl", "kls"], capture_output=True, text=True, env=env,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("wgmma serialised no") == 2, done.stdout


@pytest.mark.parametrize("value,want", [(None, "onepass"), ("auto", "onepass"),
                                        ("onepass", "onepass"), ("twopass", "twopass")])
def test_dispatch_on_cpu(value, want, monkeypatch):
    from msa_megatron.ops import triton as backend

    x = _case([8], (4, 1, 1, 1))
    if value is None:
        monkeypatch.delenv(backend.DENSE_KL_ENV, raising=False)
    else:
        monkeypatch.setenv(backend.DENSE_KL_ENV, value)
    assert backend.DENSE_KL_DEFAULT in backend.DENSE_KL_CHOICES
    assert backend.dense_kl_choice(x[0], x[1], x[2], x[3]) == want


def test_dispatch_errors(monkeypatch):
    from msa_megatron.ops import triton as backend

    x = _case([8], (4, 1, 1, 1))
    monkeypatch.setenv(backend.DENSE_KL_ENV, "gluon")
    with pytest.raises(ValueError, match="MSA_DENSE_KL=gluon: .*needs a CUDA device"):
        backend.dense_kl_choice(x[0], x[1], x[2], x[3])
    lse = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="MSA_DENSE_KL=gluon"):
        backend._kl(x[0], x[1], lse, x[2], x[3], None, x[4], x[5], 16, 0.25, 0.25, 1.0, True)
    monkeypatch.setenv(backend.DENSE_KL_ENV, "fast")
    with pytest.raises(ValueError, match="MSA_DENSE_KL must be one of auto, gluon, onepass, "
                                         "twopass, got 'fast'"):
        backend.dense_kl_choice(x[0], x[1], x[2], x[3])


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # interpreter: NaN -> int
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("tensor", ["q", "k", "lse", "q_idx", "k_idx"])
def test_nonfinite_inputs_go_to_the_triton_dense_kl(monkeypatch, tensor, value):
    """NaN/Inf anywhere in q, k, lse, q_idx, k_idx: dense_kl.py's answer (MSA_SPEC 7), whatever
    the Gluon passes made of them; finite inputs: the chunked passes with the Gluon pass A (both
    with supported() forced true)."""
    q, k, q_idx, k_idx, q_pos, q_kbase = _case([9, 14], (4, 1, 2, 1), seed=7)
    x = dict(q=q, k=k, lse=_lse(q, k, q_pos, q_kbase, q.shape[2] ** -0.5).float(),
             q_idx=q_idx, k_idx=k_idx)
    calls = []
    monkeypatch.setattr(dkg, "gluon_kl_supported", lambda *a: (True, ""))
    monkeypatch.setattr(dkg, "dense_kl_chunked",
                        lambda *a, pass_a: calls.append(pass_a) or "chunked")
    args = (q_pos, q_kbase, 0.25, 0.25, 1.0, True)
    names = ("q", "k", "lse", "q_idx", "k_idx")
    assert dkg.dense_kl_loss_gluon(*(x[n] for n in names), *args) == "chunked"
    assert calls == [dkg.pass_a_gluon]
    x[tensor][12].view(-1)[1] = value  # row 12: the second sequence
    if tensor == "q":  # lse is the attention's of this q (the contract): not summed itself
        x["lse"] = _lse(x["q"], x["k"], q_pos, q_kbase, q.shape[2] ** -0.5).float()
        assert not torch.isfinite(x["lse"]).all()
    got = dkg.dense_kl_loss_gluon(*(x[n] for n in names), *args)
    want = dkg.dense_kl_loss(*(x[n] for n in names), *args)
    # the Gluon passes were queued before the flag was read (no idle GPU during the host's
    # launches); their result is dropped for the Triton pass's
    assert len(calls) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)


@pytest.mark.parametrize("shape,reason", [
    (dict(), ""),  # the paper heads: run
    (dict(dtype=torch.float32), "fp16/bf16"),
    (dict(d=64, di=64), ""),
    (dict(di=64), "D = Di only"),
    (dict(hq=12), "power of two"),  # Hq / Hi = 3: the kernel's row ranges need a power of two
    (dict(hq=8), "Hq / Hi in (4, 16)"),  # 2: not yet run on a GPU
    (dict(hi=8, hkv=1, hq=32), "Hi / Hkv <= 4"),
    (dict(di=96), "D and Di in"),
    (dict(hik=2), ""),
    (dict(hkv=2), ""),  # Hi 4, Hkv 2: two index heads per KV group
    (dict(hkv=3), "Hkv and Hik to divide Hi"),
    (dict(hq=128), "a power of two in 1..16"),
    (dict(tk=96), ""),  # the CP layout (checked on the H200 in session 13)
])
def test_shape_support_is_what_the_gpu_check_ran(shape, reason):
    """The Gluon pass takes the shapes it is written for and, while ``_VERIFIED_ONLY``, only
    the shapes the H200 checks ran (the standard and the CP layout); the rest go to the Triton
    pass with a reason naming what differs."""
    s = dict(dict(hq=64, hkv=4, hi=4, hik=1, d=128, di=128, tq=64, tk=64,
                  dtype=torch.bfloat16), **shape)
    q = torch.empty(s["tq"], s["hq"], s["d"], dtype=s["dtype"], device="meta")
    k = torch.empty(s["tk"], s["hkv"], s["d"], dtype=s["dtype"], device="meta")
    q_idx = torch.empty(s["tq"], s["hi"], s["di"], dtype=s["dtype"], device="meta")
    k_idx = torch.empty(s["tk"], s["hik"], s["di"], dtype=s["dtype"], device="meta")
    ok, why = dkg.shape_support(q, k, q_idx, k_idx)
    assert ok == (reason == "") and reason in why, why


@pytest.mark.parametrize("rings,G,match", [
    ({"q_stages": 1}, 4, "q_stages"),  # the teacher would wait for head 1's tile in slot 0
    ({"q_stages": 1}, 2, "q_stages"),
    ({"q_stages": 0}, 1, "q_stages"),
    ({"kv_stages": 0}, 4, "kv_stages"),
    ({"q_stages": 2.0}, 4, "q_stages"),
    ({"dz_in_p": 1}, 4, "dz_in_p"),
])
def test_split_rings_refuse_a_ring_that_hangs(monkeypatch, rings, G, match):
    """One Q slot with G >= 2 deadlocks the split kernel's head loop on the GPU (head jj + 1's
    tile is awaited before head jj's slot is released): refused before any launch."""
    monkeypatch.setattr(dkg, "PASS_A", dict(dkg.PASS_A, **rings))
    with pytest.raises(ValueError, match=match):
        dkg.split_rings(G)


def test_split_rings_accept_the_checked_configs(monkeypatch):
    assert dkg.split_rings(16) == (dkg.PASS_A["q_stages"], dkg.PASS_A["kv_stages"],
                                   dkg.PASS_A["dz_in_p"])
    monkeypatch.setattr(dkg, "PASS_A", dict(dkg.PASS_A, q_stages=1, kv_stages=2, dz_in_p=True))
    assert dkg.split_rings(1) == (1, 2, True)


def _ftz(x):
    """Subnormal fp32 values flushed to (signed) zero, as ``.ftz`` does."""
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(x), x)


def test_split_epilogue_arithmetic_equals_the_natural_log_form():
    """The split kernel's epilogue arithmetic (``_epilogue_split``: log2 units, the mask as
    ``T = 0`` and ``lg2 Qs = -1e30`` outside, ``max(T, 1e-37)`` instead of a ``T != 0`` select,
    ftz ``lg2`` / ``ex2``, KL times ln 2 at the end) against :func:`pass_a_torch`'s
    natural-log form, on a tile holding teachers that underflow to 0 or are subnormal inside
    the support, student logits far below the row's LSE, and masked entries of any value."""
    gen = torch.Generator().manual_seed(5)
    bm, bn = 16, 32
    p = torch.rand(bm, bn, generator=gen) * 0.2
    p[0, :8] = 0.0  # underflowed teacher inside the support
    p[1, :8] = 1e-40  # subnormal teacher
    p[2, :8] = 3e-38
    z = torch.randn(bm, bn, generator=gen) * 30  # log Qs from 0 down to about -150
    iscale = 0.7
    lse_z = (z * iscale).amax(1) + torch.rand(bm, generator=gen) * 5
    cols = torch.arange(bn)
    kb = torch.randint(0, bn, (bm,), generator=gen)
    ke = kb + torch.randint(-1, bn, (bm,), generator=gen)  # some rows empty (ke = kb - 1)
    inside = (cols[None] >= kb[:, None]) & (cols[None] <= ke[:, None])
    inside[:3, :8] = True
    # pass_a_torch's form (natural log), float64 for the reference
    t64 = torch.where(inside, p, 0.0).double()
    log_qs = z.double() * iscale - lse_z.double()[:, None]
    has_t = t64 != 0
    want_kl = torch.where(has_t, t64 * (torch.log(torch.where(has_t, t64, 1.0)) - log_qs),
                          0.0).sum()
    want_dz = torch.where(inside, torch.exp(log_qs) - t64, 0.0)
    # the kernel's form (fp32)
    log2e = 1.4426950408889634
    teacher = torch.where(inside, p, 0.0)
    l2qs = torch.where(inside, z * (iscale * log2e) - (lse_z * log2e)[:, None],
                       torch.tensor(-1e30))
    lg2t = _ftz(torch.log2(_ftz(torch.clamp(teacher, min=1e-37))))
    kl = (teacher * (lg2t - l2qs)).sum(1).sum() * 0.6931471805599453
    dz = _ftz(torch.exp2(_ftz(l2qs))) - teacher
    assert torch.isfinite(kl) and torch.isfinite(dz).all()
    assert abs(kl.item() - want_kl.item()) <= 1e-5 * abs(want_kl.item()) + 1e-30
    assert (dz.double() - want_dz).abs().max().item() < 1e-6
    assert (dz[~inside] == 0).all()

