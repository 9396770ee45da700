"""Dense-mode dispatch of ``backend="triton"`` to a vendor dense attention (ops/dense.py).

On a CPU no vendor route applies, so the real routes are replaced by fakes built on PyTorch's
fused CPU attention (``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the
LSE), and ``_supported`` is widened to CPU float32. The tests check which route runs forward
and backward under each setting, that results equal our own kernels' (the route only swaps the
main branch; the KL reads its LSE), that the general (CP) layout keeps our kernels, and that a
route failing its probe is skipped. The real cuDNN / FlashAttention routes are checked on the
GPU by benchmarks/bench_compile.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron.ops import dense  # noqa: E402
from msa_megatron.api import msa_attention  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from tests.support.inputs import assert_close, make_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU dispatch tests (GPU: benchmarks/bench_compile.py)")

NAMES = ("q", "k", "v", "q_idx", "k_idx")
OPTIONS = dict(block_size=16, top_k=2, init_blocks=1, local_blocks=1, mode="dense",
               backend="triton")


def _cpu_attention(q, k, v, seqs, scale):
    """Per sequence through PyTorch's fused CPU attention: out, LSE as ``[1, Hq, S]``."""
    G = q.shape[1] // k.shape[1]
    outs, lses = [], []
    bounds = seqs.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        q4, k4, v4 = (t[a:b].transpose(0, 1).unsqueeze(0) for t in
                      (q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k4, v4, 0.0, True, scale=scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs).contiguous(), torch.cat(lses, dim=1).unsqueeze(0)


def _cpu_attention_backward(dout, q, k, v, out, lse, seqs, scale):
    G = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    grads = ([], [], [])
    bounds = seqs.cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        four = [t[a:b].transpose(0, 1).unsqueeze(0).contiguous() for t in (dout, q, ke, ve, out)]
        got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *four, lse[:, :, a:b].contiguous(), 0.0, True, scale=scale)
        for store, g in zip(grads, got):
            store.append(g[0].transpose(0, 1))
    dq, dk, dv = (torch.cat(g) for g in grads)
    T, Hkv, D = k.shape
    return dq, dk.view(T, Hkv, G, D).sum(2), dv.view(T, Hkv, G, D).sum(2)


class Recorder:
    """Fake routes ``cudnn`` (non-deterministic backward) and ``flash`` (deterministic)."""

    def __init__(self, fail=()):
        self.calls = []
        self.fail = set(fail)

    def route(self, name, deterministic_backward):
        def forward(q, k, v, seqs, scale):
            if name in self.fail:
                raise RuntimeError("not on this machine")
            self.calls.append((name, "fwd"))
            out, lse = _cpu_attention(q, k, v, seqs, scale)
            return out, dense._lse_to_th(name, lse, q.shape[0], q.shape[1])

        def backward(dout, q, k, v, out, lse, seqs, scale, deterministic):
            self.calls.append((name, "bwd", deterministic))
            return _cpu_attention_backward(dout, q, k, v, out, dense._lse_from_th(name, lse),
                                           seqs, scale)

        return dense.Route(name, forward, backward, deterministic_backward)


@pytest.fixture
def fake_routes(monkeypatch):
    def install(fail=()):
        rec = Recorder(fail)
        monkeypatch.setattr(dense, "ROUTES", {"cudnn": rec.route("cudnn", False),
                                              "flash": rec.route("flash", True)})
        monkeypatch.setattr(dense, "_PROBED", {})
        monkeypatch.setattr(dense, "_LSE_GUARDS", {})
        monkeypatch.setattr(dense, "_supported", lambda q, k: q.dtype == torch.float32)
        monkeypatch.setitem(dense._PROBE_TOL, torch.float32, 1e-4)
        return rec

    monkeypatch.delenv(dense.BACKEND_ENV, raising=False)
    monkeypatch.delenv(dense.DETERMINISTIC_ENV, raising=False)
    return install


def _inputs(seed, lengths=(23, 0, 41)):
    return make_inputs(lengths, heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                       dtype=torch.float32, seed=seed)


def _run(x):
    leaves = [x[n] for n in NAMES]
    out, kl = msa_attention(*leaves, x["cu_seqlens"], **OPTIONS)
    grads = torch.autograd.grad((out * out).sum() + 3.0 * kl, leaves)
    return [out, kl, *grads]


@pytest.mark.parametrize("det_env, expect_bwd", [(None, ("flash", "bwd", True)),
                                                 ("0", ("cudnn", "bwd", False))])
def test_dense_mode_runs_the_routes_and_matches_our_kernels(fake_routes, monkeypatch, seed,
                                                            det_env, expect_bwd):
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    x = _inputs(seed)
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    if det_env is not None:
        monkeypatch.setenv(dense.DETERMINISTIC_ENV, det_env)
    rec = fake_routes()
    for name in ("cudnn", "flash"):  # the one-time probes, on their own small problem
        assert dense._probe(dense.ROUTES[name], x["q"], x["k"]) is None
    rec.calls.clear()
    routed = _run(x)
    assert rec.calls == [("cudnn", "fwd"), expect_bwd]
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert_close(a, b, 1e-5, name)


def test_kernels_setting_and_general_layout_keep_our_kernels(fake_routes, monkeypatch, seed):
    rec = fake_routes()
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    _run(_inputs(seed))
    assert rec.calls == []
    monkeypatch.delenv(dense.BACKEND_ENV)
    # CP-like layout: queries are the second half of a sequence whose keys are all present.
    q_pos = torch.arange(8, 16, dtype=torch.int32)
    assert dense.standard_sequences(q_pos, torch.zeros(8, dtype=torch.int32), 16) is None
    assert dense.standard_sequences(q_pos, torch.zeros(8, dtype=torch.int32), 8) is None


def test_torch_deterministic_mode_forces_a_deterministic_backward(fake_routes, monkeypatch):
    monkeypatch.setenv(dense.DETERMINISTIC_ENV, "0")
    assert dense.deterministic_setting() is False
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert dense.deterministic_setting() is True
    finally:
        torch.use_deterministic_algorithms(before)


def test_a_route_failing_its_probe_is_skipped(fake_routes, seed):
    rec = fake_routes(fail=("cudnn",))
    x = _inputs(seed)
    with pytest.warns(RuntimeWarning, match="'cudnn' not used"):
        route = dense.forward_route(x["q"], x["k"])
    assert route.name == "flash"
    assert dense.route_report(x["q"], x["k"])["forward"] == "flash"
    rec.calls.clear()
    _run(x)
    assert rec.calls == [("flash", "fwd"), ("flash", "bwd", True)]


def test_probe_checks_against_fp32_math(fake_routes):
    """The probe itself (fake flash route, GQA, a zero-length and a length-1 sequence)."""
    fake_routes()
    q = torch.zeros(4, 4, 16)
    k = torch.zeros(4, 2, 16)
    assert dense._probe(dense.ROUTES["flash"], q, k) is None
    wrong = dense.Route("wrong", lambda q, k, v, s, sc: dense.ROUTES["flash"].forward(
        q, k, v * 1.01, s, sc), dense.ROUTES["flash"].backward, True)
    with pytest.warns(RuntimeWarning, match="'wrong' not used"):
        assert "out relative error" in dense._probe(wrong, q, k)


def test_standard_sequences_of_packed_layouts():
    cu = torch.tensor([0, 5, 5, 6, 12], dtype=torch.int32)
    q_pos, q_kbase = query_layout(cu, 12, cu.device)
    seqs = dense.standard_sequences(q_pos, q_kbase, 12)
    assert seqs.cu_seqlens.tolist() == [0, 5, 6, 12] and seqs.max_len == 6
    assert seqs.cu_seqlens.dtype == torch.int32


def test_sequences_are_read_once_per_layout_tensor(monkeypatch, seed):
    """dense.sequences_of reads the layout on the host once per q_pos tensor: the backward and
    later calls with the same tensors reuse it; a new q_kbase object, an in-place change of
    either tensor, or another key count read it again (and get the new layout)."""
    from msa_megatron.layout import query_layout

    reads = []
    real = dense.standard_sequences
    monkeypatch.setattr(dense, "standard_sequences",
                        lambda *a: reads.append(1) or real(*a))
    cu = torch.tensor([0, 23, 23, 64], dtype=torch.int32)
    q_pos, q_kbase = query_layout(cu, 64, torch.device("cpu"))
    first = dense.sequences_of(q_pos, q_kbase, 64)
    assert first.cu_seqlens.tolist() == [0, 23, 64] and (first.max_len, first.min_len) == (41, 23)
    assert dense.sequences_of(q_pos, q_kbase, 64) is first and len(reads) == 1
    fresh = dense.sequences_of(q_pos, q_kbase.clone(), 64)
    assert fresh is not first and fresh.cu_seqlens.tolist() == [0, 23, 64] and len(reads) == 2
    assert dense.sequences_of(q_pos, q_kbase, 63) is None and len(reads) == 3  # not standard
    other_pos, other_kbase = query_layout(torch.tensor([0, 30, 64], dtype=torch.int32), 64,
                                          torch.device("cpu"))
    q_pos.copy_(other_pos)  # in place: the version moves
    q_kbase.copy_(other_kbase)
    again = dense.sequences_of(q_pos, q_kbase, 64)
    assert again.cu_seqlens.tolist() == [0, 30, 64] and len(reads) == 4
    assert dense.sequences_of(q_pos, q_kbase, 64) is again and len(reads) == 4


def test_dense_mode_reads_the_layout_once_per_call(fake_routes, monkeypatch, seed):
    """Forward and backward through the routes read the layout on the host once (the
    forward's; the backward gets the same tensors back), and a second call with the same
    cu_seqlens tensor reads nothing."""
    reads = []
    real = dense.standard_sequences
    monkeypatch.setattr(dense, "standard_sequences",
                        lambda *a: reads.append(1) or real(*a))
    rec = fake_routes()
    x = _inputs(seed)
    _run(x)
    assert [c[1] for c in rec.calls][-2:] == ["fwd", "bwd"]
    assert len(reads) == 1
    _run(x)  # the same cu_seqlens tensor: the same layout tensors (layout.shared_query_layout)
    assert [c[1] for c in rec.calls][-2:] == ["fwd", "bwd"]
    assert len(reads) == 1


def test_finite_check_reads_sums_of_every_tensor():
    """host_reads.FiniteCheck: True for finite tensors (empty ones skipped, none at all
    included), False for a NaN, an Inf, or a finite tensor whose fp32 sum overflows."""
    from msa_megatron.ops.host_reads import FiniteCheck, to_host

    a, b = torch.randn(5, 3), torch.randn(4, dtype=torch.float16)
    assert FiniteCheck(a, b).ok() and FiniteCheck().ok() and FiniteCheck(a[:0]).ok()
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = b.clone()
        bad[2] = value
        assert not FiniteCheck(a, bad).ok()
    assert not FiniteCheck(torch.full((4,), 3e38)).ok()  # overflows: the slow exact path
    host, event = to_host(a)
    assert host is a and event is None


def test_settings_are_validated(monkeypatch):
    monkeypatch.setenv(dense.BACKEND_ENV, "fastest")
    with pytest.raises(ValueError, match=dense.BACKEND_ENV):
        dense.backend_setting()
    monkeypatch.setenv(dense.BACKEND_ENV, "FLASH")
    assert dense.backend_setting() == "flash"


def test_cpu_tensors_never_take_a_vendor_route(seed):
    x = _inputs(seed)
    assert dense.forward_route(x["q"], x["k"]) is None
    assert dense.backward_route(x["q"], x["k"]) == (None, True)
    assert dense.dense_forward(x["q"], x["k"], x["v"], *query_layout(
        x["cu_seqlens"], x["q"].shape[0], x["q"].device), 0.25) is None


def test_a_route_failing_on_a_real_problem_falls_back(fake_routes, monkeypatch, seed):
    """A route that passed its probe but raises later (e.g. a size limit) is refused with a
    warning and the next route (here: our kernels for the backward) takes over."""
    rec = fake_routes()
    x = _inputs(seed)
    for name in ("cudnn", "flash"):
        assert dense._probe(dense.ROUTES[name], x["q"], x["k"]) is None
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    flash = dense.ROUTES["flash"]

    def broken(*args):
        raise RuntimeError("too long for this kernel")

    monkeypatch.setitem(dense.ROUTES, "flash", flash._replace(backward=broken))
    rec.calls.clear()
    with pytest.warns(RuntimeWarning, match="'flash' failed"):
        routed = _run(x)
    assert rec.calls == [("cudnn", "fwd")]
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert_close(a, b, 1e-5, name)
    assert dense.backward_route(x["q"], x["k"]) == (None, True)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("tensor", ["q", "k", "v"])
def test_non_finite_inputs_keep_our_kernels(fake_routes, monkeypatch, seed, tensor):
    """MSA_SPEC section 7: a vendor kernel spreads a NaN key/value row to the earlier rows of
    its tile (0 * NaN), so inputs holding NaN get our kernels' results, forward and
    backward."""
    x = _inputs(seed)
    with torch.no_grad():
        x[tensor][30, 1, 2] = float("nan")  # second sequence (23 + 0 + 41 tokens)
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    rec = fake_routes()
    for name in ("cudnn", "flash"):
        assert dense._probe(dense.ROUTES[name], x["q"], x["k"]) is None
    rec.calls.clear()
    routed = _run(x)
    # both vendor calls are queued before their check is read, and their results dropped
    assert [c[1] for c in rec.calls] == ["fwd", "bwd"]
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert name == "kl" or torch.isfinite(a[:23]).all(), name  # first sequence
        assert_close(a.nan_to_num(), b.nan_to_num(), 1e-5, name)


def _guarded(route):
    """``route`` whose forward marks every query row holding NaN/Inf with a NaN LSE (PyTorch's
    CPU attention gives a row whose scores are all -Inf the LSE 0: not guarded)."""
    def forward(q, k, v, seqs, scale):
        out, lse = route.forward(q, k, v, seqs, scale)
        return out, torch.where(torch.isfinite(q).all(-1), lse, float("nan"))

    return route._replace(forward=forward)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("tensor", ["q", "q_row_minus_inf", "k", "v", "none"])
def test_forward_checks_lse_after_a_guarded_route(fake_routes, monkeypatch, seed, tensor):
    """A route whose LSE marks bad query rows (dense.lse_guards_q) runs before the check, q is
    not summed, and its result is dropped when lse, k or v is non-finite: the layer equals our
    kernels' and no vendor backward runs. An unguarded route (the plain fakes: LSE 0 for a row
    of -Inf scores) keeps the check before the call."""
    x = _inputs(seed)
    with torch.no_grad():
        if tensor == "q_row_minus_inf":  # row 30, head 1 (KV head 0): every score -Inf
            x["k"][:, 0, 2] = x["k"][:, 0, 2].abs() + 0.5
            x["q"][30, 1, 2] = float("-inf")
        elif tensor != "none":
            x[tensor][30, 1, 2] = float("nan")
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    rec = fake_routes()
    assert not dense.lse_guards_q(dense.ROUTES["cudnn"], x["q"], x["k"])
    monkeypatch.setattr(dense, "_LSE_GUARDS", {})
    monkeypatch.setattr(dense, "ROUTES", {n: _guarded(r) for n, r in dense.ROUTES.items()})
    for name in ("cudnn", "flash"):
        assert dense._probe(dense.ROUTES[name], x["q"], x["k"]) is None
        assert dense.lse_guards_q(dense.ROUTES[name], x["q"], x["k"])
    T, Hq = x["q"].shape[:2]
    for where in ("auto", "before"):
        monkeypatch.setattr(dense, "FORWARD_CHECK", where)
        rec.calls.clear()
        checks = _record_checks(monkeypatch)
        routed = _run(x)
        # the forward's check: lse's after the call ("auto"), q's before it ("before")
        assert checks[0][0] == ((T, Hq) if where == "auto" else tuple(x["q"].shape))
        assert rec.calls[0] == ("cudnn", "fwd")
        if tensor != "none":
            # both results dropped (the backward's check is read after its call is queued)
            assert [c[1] for c in rec.calls] == ["fwd", "bwd"]
        for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
            assert torch.equal(a.isnan(), b.isnan()), (where, name)
            assert_close(a.nan_to_num(), b.nan_to_num(), 1e-4, f"{where} {name}")


def _record_checks(monkeypatch) -> list:
    """Replace dense.FiniteCheck by one that records the shapes it checks (a list, filled as
    checks are made)."""
    seen = []
    real = dense.FiniteCheck

    def check(*tensors):
        seen.append([tuple(t.shape) for t in tensors])
        return real(*tensors)

    monkeypatch.setattr(dense, "FiniteCheck", check)
    return seen


@pytest.mark.parametrize("tensor,value", [("lse", float("nan")), ("k", float("nan")),
                                          ("k", float("-inf")), ("v", float("nan")),
                                          ("dout", float("inf"))])
def test_backward_route_checks_lse_k_v_and_dout(fake_routes, seed, tensor, value):
    """The backward's finiteness check reads lse (which covers q: a NaN/Inf in a query row
    makes its lse non-finite), k (an Inf key can leave every lse finite), v and dout: a
    non-finite value in any of them keeps our kernels (None: the vendor result, already
    queued, is dropped), finite ones take a route."""
    from msa_megatron.layout import query_layout

    x = _inputs(seed)
    rec = fake_routes()
    q, k, v = (x[n].detach() for n in ("q", "k", "v"))
    T = q.shape[0]
    q_pos, q_kbase = query_layout(x["cu_seqlens"], T, q.device)
    out, lse = dense.dense_forward(q, k, v, q_pos, q_kbase, 0.25)
    t = dict(lse=lse.clone(), k=k.clone(), v=v.clone(), dout=torch.randn_like(out))
    assert dense.dense_backward(t["dout"], q, t["k"], t["v"], out, t["lse"], q_pos, q_kbase,
                                0.25) is not None
    rec.calls.clear()
    t[tensor].view(-1)[7] = value
    assert dense.dense_backward(t["dout"], q, t["k"], t["v"], out, t["lse"], q_pos, q_kbase,
                                0.25) is None
    # the check is read after the vendor backward is queued; its result is dropped
    assert [call[1] for call in rec.calls] == ["bwd"]


# Query entries that no key can turn finite (feature: (value, the sign every key's entry gets;
# None: random)): all the row's scores -Inf (two ways), NaN (Inf * 0), mixed +-Inf, NaN.
_POISON = {0: (float("-inf"), 1.0), 1: (float("inf"), -1.0), 2: (float("inf"), 0.0),
           3: (float("inf"), None), 4: (float("nan"), None)}


def _poisoned_queries(Tq, Tk, Hq, Hkv, D, rows, dtype, seed):
    """``q [Tq, Hq, D]``, ``k``, ``v [Tk, Hkv, D]`` with query row ``rows[f]`` (head ``f % Hq``)
    holding :data:`_POISON`'s value at feature ``f`` and every key's feature ``f`` its sign."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=gen) for s in ((Tq, Hq, D), (Tk, Hkv, D),
                                                         (Tk, Hkv, D)))
    for f, (value, sign) in _POISON.items():
        if sign is not None:
            k[:, :, f] = sign * (k[:, :, f].abs() + 0.5)
        q[rows[f], f % Hq, f] = value
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["packed", "cp"])
def test_our_attention_gives_a_query_row_holding_inf_or_nan_a_non_finite_lse(layout, dtype):
    """What lets the backward's check and the Gluon KL's flag skip q, on the LSE our own dense
    attention computes (the Triton kernel; the torch backend): a query row holding +-Inf or NaN
    gets a non-finite lse whatever the keys' signs (all its scores -Inf, NaN from Inf * 0,
    mixed +-Inf), also a sequence's first row (one key) beside a zero-length sequence, and in a
    CP rank's rows against all keys; every other (row, head) keeps a finite lse."""
    from msa_megatron.ops.backends import get_backend
    from msa_megatron.ops.triton.forward import attention_forward
    from msa_megatron.parallel.cp_layout import build_cp_layout

    lens = [7, 0, 9, 16]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    Tk = int(cu[-1])
    if layout == "packed":
        q_pos, q_kbase = query_layout(cu, Tk, torch.device("cpu"))
        rows = [7, 6, 0, 15, 31]  # 7: first row of the sequence after the empty one
    else:  # rank 1 of 2: rows 4..11 and 20..27 of the 32-token problem (per document)
        cp = build_cp_layout(torch.tensor([0, 16, 32], dtype=torch.int32), 2, 1, 1,
                             torch.device("cpu"))
        q_pos, q_kbase = cp.q_pos.contiguous(), cp.q_kbase.contiguous()
        rows = [0, 3, 5, 8, 15]
    q, k, v = _poisoned_queries(q_pos.shape[0], Tk, 4, 2, 16, rows, dtype, seed=Tk)
    bad = ~torch.isfinite(q.float()).all(-1)  # [Tq, Hq]
    assert int(bad.sum()) == len(_POISON)
    scale = 16 ** -0.5
    lses = {"triton": attention_forward(q, k, v, None, q_pos, q_kbase, 16, scale, 2)[1]}
    if dtype != torch.float16:  # the torch backend on a CPU: fp32 and bf16
        lses["torch"] = get_backend("torch").attention(
            q, k, v, None, q_pos, q_kbase, block_size=16, softmax_scale=scale,
            index_heads=2)[1]
    for name, lse in lses.items():
        assert torch.equal(~torch.isfinite(lse), bad), (name, lse[bad])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("tensor", NAMES)
def test_non_finite_inputs_never_reach_the_kl_result(fake_routes, monkeypatch, seed, tensor):
    """Dense mode checks finiteness twice: the vendor route (ops/dense.py, q k v: a vendor
    kernel would spread a NaN row) and the Gluon KL (dense_kl_gluon.py, q k lse q_idx k_idx: its
    pass A has no NaN isolation). With the Gluon KL forced on (its pass A the torch stand-in)
    a NaN in q, k, q_idx or k_idx gives the layer of our kernels with the Triton KL (MSA_SPEC
    7), whatever pass A made of it; a NaN in v (which the KL does not read) keeps the Gluon
    KL."""
    from msa_megatron.ops import triton as backend
    from msa_megatron.ops.triton import dense_kl_gluon as dkg

    x = _inputs(seed)
    with torch.no_grad():
        x[tensor][30, 1 % x[tensor].shape[1], 2] = float("nan")  # second sequence
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    monkeypatch.setenv(backend.DENSE_KL_ENV, "onepass")
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    monkeypatch.delenv(backend.DENSE_KL_ENV)
    fake_routes()
    seen = []

    def pass_a(a):
        seen.append(all(bool(torch.isfinite(t).all())
                        for t in (a.q, a.k, a.lse2, a.q_idx, a.k_idx)))
        dkg.pass_a_torch(a)

    monkeypatch.setattr(dkg, "gluon_kl_supported", lambda *args: (True, ""))
    monkeypatch.setattr(dkg, "pass_a_gluon", pass_a)
    routed = _run(x)
    if tensor == "v":  # the KL does not read v: the Gluon pass A's result is the KL
        assert seen and all(seen), seen
    # otherwise the Gluon passes may have run (they are queued before the finiteness flag is
    # read) but their result is dropped for the Triton KL's: the layer equals ours
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert_close(a.nan_to_num(), b.nan_to_num(), 1e-4, name)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("value,key_entry", [(float("-inf"), 1.0), (float("inf"), 0.0)],
                         ids=["all-scores-minus-inf", "inf-times-zero"])
def test_a_query_row_no_key_makes_finite_keeps_our_kernels(fake_routes, monkeypatch, seed,
                                                          value, key_entry):
    """The layer end to end, with q read by the checks only through our attention's lse: a query
    row whose every score is -Inf (lse -Inf) or NaN takes no vendor route, forward or
    backward, and the Gluon KL (pass A the torch stand-in) gives way to the Triton KL: the
    layer equals our kernels' (a vendor backward would put 0 * Inf into the keys of the row's
    tiles outside its support). The -Inf row is the case only lse guards: our forward gives it
    out = 0 (l = 0 counts as 1), so dout, and the other tests' NaN, stay finite there."""
    from msa_megatron.ops import triton as backend
    from msa_megatron.ops.triton import dense_kl_gluon as dkg

    x = _inputs(seed)
    with torch.no_grad():  # row 30 (second sequence), head 1 (KV head 0)
        x["k"][:, 0, 2] = key_entry * (x["k"][:, 0, 2].abs() + 0.5) if key_entry else 0.0
        x["q"][30, 1, 2] = value
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    monkeypatch.setenv(backend.DENSE_KL_ENV, "onepass")
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    monkeypatch.delenv(backend.DENSE_KL_ENV)
    rec = fake_routes()
    for name in ("cudnn", "flash"):
        assert dense._probe(dense.ROUTES[name], x["q"], x["k"]) is None
    rec.calls.clear()
    monkeypatch.setattr(dkg, "gluon_kl_supported", lambda *args: (True, ""))
    monkeypatch.setattr(dkg, "pass_a_gluon", dkg.pass_a_torch)
    routed = _run(x)
    # the vendor calls are queued before their checks are read, and their results dropped
    assert [c[1] for c in rec.calls] == ["fwd", "bwd"]
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert_close(a.nan_to_num(), b.nan_to_num(), 1e-4, name)


def _autograd_reference(q, k, v, dout, cu, scale):
    """The same math as ``dense._math_reference``, by autograd (plain eager context)."""
    qf, kf, vf = (t.detach().double().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        s = torch.einsum("qhd,khd->hqk", qf[a:b], kf[a:b].repeat_interleave(G, 1)) * scale
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), float("-inf"))
        lses.append(torch.logsumexp(s, -1).t())
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vf[a:b].repeat_interleave(G, 1)))
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) + torch.autograd.grad(out, (qf, kf, vf), dout.double())


@pytest.mark.parametrize("context", ["below_autograd", "no_grad", "plain"])
def test_probe_reference_needs_no_autograd(context):
    """The probe's fp32 reference runs inside the custom op, below the Autograd dispatch key,
    where autograd records nothing (not even under enable_grad): its gradients must be written
    out. GQA (G = 3), a zero-length and a length-1 sequence."""
    gen = torch.Generator().manual_seed(5)
    lengths = [9, 0, 1, 14]
    T, D = sum(lengths), 8
    q, dout = torch.randn(T, 6, D, generator=gen), torch.randn(T, 6, D, generator=gen)
    k, v = torch.randn(T, 2, D, generator=gen), torch.randn(T, 2, D, generator=gen)
    cu = [0, 9, 9, 10, 24]
    guard = {"below_autograd": torch._C._AutoDispatchBelowAutograd, "no_grad": torch.no_grad,
             "plain": torch.enable_grad}[context]
    with guard():
        got = dense._math_reference(q, k, v, dout, cu, D ** -0.5)
    want = _autograd_reference(q, k, v, dout, cu, D ** -0.5)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.dtype == torch.float32, name
        assert_close(a.double(), b, 1e-5, name)


def test_probe_inside_the_custom_op_accepts_the_routes(fake_routes, monkeypatch, seed):
    """The first dense call probes the routes from inside the custom op (below autograd);
    correct routes must pass there: cuDNN forward, FlashAttention deterministic backward, no
    refusal warning, results equal to our kernels'."""
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    x = _inputs(seed)
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    rec = fake_routes()
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dense route", category=RuntimeWarning)
        routed = _run(x)
    # each probe: the checked forward and backward, then the forward on bad query rows
    # (dense.lse_guards_q)
    probe_cudnn = [("cudnn", "fwd"), ("cudnn", "bwd", False), ("cudnn", "fwd")]
    probe_flash = [("flash", "fwd"), ("flash", "bwd", True), ("flash", "fwd")]
    assert rec.calls == probe_cudnn + [("cudnn", "fwd")] + probe_flash + [("flash", "bwd", True)]
    assert dense.route_report(x["q"], x["k"])["refused"] == {}
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert_close(a, b, 1e-5, name)


# ---------------------------------------------------------------- the cuDNN route's call
class FakeCudnn:
    """Stand-ins for ``aten._scaled_dot_product_cudnn_attention`` and its ``_backward`` that
    check what PyTorch 2.11's cuDNN SDPA needs (so a wrong call fails here, not silently on the
    GPU) and compute the attention in fp32 on the CPU:

    - q/k/v/out/grad_out 4-D ``[B, H, S, D]`` views with BSHD memory (strides
      ``(S*H*D, D, H*D, 1)``), native GQA (fewer K/V heads), grad_out and out laid out alike;
    - forward: no attn_bias, ``compute_log_sumexp=True``, dropout 0, causal, the scale given;
      returns out in BSHD memory (as cuDNN allocates it) and the LSE ``[B, Hq, S]`` fp32 (with
      ``trailing`` extra 1s);
    - backward: the forward's LSE layout back (same shape, contiguous fp32), attn_bias and
      ``cum_seq_q/k`` undefined (None: the dense entry; the THD entry is broken in 2.11),
      ``max_q = max_k = S``, dropout 0, causal; the gradients use the LSE it is given, so an
      LSE in the wrong order gives wrong gradients.
    """

    def __init__(self, trailing=0, dq_factor=1.0):
        self.trailing, self.dq_factor = trailing, dq_factor
        self.calls = []
        self.lse_shape = None

    @staticmethod
    def _check_bshd(name, t, heads=None):
        B, H, S, D = t.shape
        assert t.dim() == 4, name
        assert t.stride() == (S * H * D, D, H * D, 1), (name, t.shape, t.stride())
        if heads is not None:
            assert H == heads, (name, H, heads)

    @staticmethod
    def _scores(q, k, scale):
        G = q.shape[1] // k.shape[1]
        s = torch.matmul(q.float(), k.float().repeat_interleave(G, 1).transpose(-1, -2)) * scale
        S = q.shape[2]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        return s.masked_fill(~causal, float("-inf")), G

    def forward(self, query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                is_causal=False, return_debug_mask=False, *, scale=None):
        self.calls.append("fwd")
        for name, t in (("query", query), ("key", key), ("value", value)):
            self._check_bshd(name, t)
        assert key.shape[1] == value.shape[1] < query.shape[1] or key.shape[1] == query.shape[1]
        assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0
        assert is_causal is True and return_debug_mask is False and scale is not None
        s, G = self._scores(query, key, scale)
        lse = torch.logsumexp(s, -1)  # [B, Hq, S]
        o = torch.matmul(torch.exp(s - lse[..., None]),
                         value.float().repeat_interleave(G, 1))
        B, H, S, D = query.shape
        out = torch.empty(B, S, H, D, dtype=query.dtype).transpose(1, 2)
        out.copy_(o)
        for _ in range(self.trailing):
            lse = lse.unsqueeze(-1)
        self.lse_shape = tuple(lse.shape)
        empty = torch.empty(0)
        return (out, lse.contiguous(), empty, empty, S, S, torch.zeros((), dtype=torch.int64),
                torch.zeros((), dtype=torch.int64), empty)

    def backward(self, grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset,
                 attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *,
                 scale=None):
        self.calls.append("bwd")
        for name, t in (("grad_out", grad_out), ("query", query), ("key", key),
                        ("value", value), ("out", out)):
            self._check_bshd(name, t)
        assert grad_out.stride() == out.stride()
        assert tuple(logsumexp.shape) == self.lse_shape, (logsumexp.shape, self.lse_shape)
        assert logsumexp.dtype == torch.float32 and logsumexp.is_contiguous()
        assert attn_bias is None and cum_seq_q is None and cum_seq_k is None
        B, H, S, D = query.shape
        assert max_q == max_k == S and dropout_p == 0.0 and is_causal is True
        assert scale is not None
        lse = logsumexp
        for _ in range(self.trailing):
            lse = lse.squeeze(-1)
        s, G = self._scores(query, key, scale)
        p = torch.exp(s - lse[..., None])
        ke, ve = (t.float().repeat_interleave(G, 1) for t in (key, value))
        do, o = grad_out.float(), out.float()
        dv = torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, ve.transpose(-1, -2)) - (do * o).sum(-1, keepdim=True))
        dq = torch.matmul(ds, ke) * scale * self.dq_factor
        dk = torch.matmul(ds.transpose(-1, -2), query.float()) * scale
        Hkv = key.shape[1]
        dk, dv = (g.view(B, Hkv, G, S, D).sum(2) for g in (dk, dv))
        grads = []
        for g, like in ((dq, query), (dk, key), (dv, value)):  # empty_like keeps BSHD memory
            res = torch.empty(B, S, like.shape[1], D, dtype=like.dtype).transpose(1, 2)
            grads.append(res.copy_(g))
        return tuple(grads)


def _packed(lengths, hq=4, hkv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, dout = (torch.randn(T, hq, d, generator=gen) for _ in range(2))
    k, v = (torch.randn(T, hkv, d, generator=gen) for _ in range(2))
    cu = torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0).to(torch.int32)
    seqs = dense.standard_sequences(*query_layout(cu, T, cu.device), T)
    return q, k, v, dout, cu, seqs


@pytest.mark.parametrize("lengths", [(77,), (40, 40, 40)])
@pytest.mark.parametrize("trailing", [0, 1])
def test_cudnn_route_call_matches_fp32_math(monkeypatch, lengths, trailing):
    """The cuDNN route builds the dense-entry call (BSHD views, LSE layout back, no cum_seq,
    max_q = max_k = S): its out, LSE and gradients equal fp32 math, one sequence or several of
    equal length, GQA, whether the LSE has a trailing 1 or not."""
    fake = FakeCudnn(trailing=trailing)
    monkeypatch.setattr(dense, "_cudnn_ops", lambda: (fake.forward, fake.backward))
    q, k, v, dout, cu, seqs = _packed(lengths)
    assert seqs.uniform and seqs.max_len == lengths[0]
    route = dense.ROUTES["cudnn"]
    scale = 0.3
    out, lse = route.forward(q, k, v, seqs, scale)
    dq, dk, dv = route.backward(dout, q, k, v, out, lse, seqs, scale, False)
    assert fake.calls == ["fwd", "bwd"]
    want = dense._math_reference(q, k, v, dout, cu.tolist(), scale)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), want):
        assert a.shape == b.shape and a.is_contiguous(), name
        assert_close(a, b, 1e-5, name)


def test_cudnn_route_takes_equal_lengths_only(monkeypatch):
    """Sequences of unequal lengths never reach cuDNN (its THD entry is broken in PyTorch
    2.11); the route says so and raises if called anyway."""
    fake = FakeCudnn()
    monkeypatch.setattr(dense, "_cudnn_ops", lambda: (fake.forward, fake.backward))
    route = dense.ROUTES["cudnn"]
    q, k, v, dout, cu, seqs = _packed((30, 1, 50))
    assert not seqs.uniform and (seqs.max_len, seqs.min_len) == (50, 1)
    assert not route.takes(seqs) and route.takes(None)
    with pytest.raises(ValueError, match="unequal lengths"):
        route.forward(q, k, v, seqs, 0.25)
    assert fake.calls == []
    assert dense.ROUTES["flash"].takes(seqs)
    # the probe gives the route equal lengths, longer than the head dim
    assert dense._probe_lengths(route, 128) == [189, 189]
    assert dense._probe_lengths(dense.ROUTES["flash"], 128) == [70, 1, 0, 189]


def test_cudnn_route_probe_accepts_it_and_refuses_a_wrong_dq(monkeypatch):
    """The probe runs the cuDNN route on equal lengths and passes it; a backward with a wrong
    dQ (what PyTorch 2.11's THD entry gives) is refused with the reason."""
    monkeypatch.setitem(dense._PROBE_TOL, torch.float32, 1e-4)
    monkeypatch.setattr(dense, "_PROBED", {})
    fake = FakeCudnn()
    monkeypatch.setattr(dense, "_cudnn_ops", lambda: (fake.forward, fake.backward))
    q, k = torch.zeros(4, 4, 16), torch.zeros(4, 2, 16)
    assert dense._probe(dense.ROUTES["cudnn"], q, k) is None
    assert fake.calls == ["fwd", "bwd", "fwd"]  # the last: dense.lse_guards_q's bad rows
    monkeypatch.setattr(dense, "_PROBED", {})
    wrong = FakeCudnn(dq_factor=1e6)
    monkeypatch.setattr(dense, "_cudnn_ops", lambda: (wrong.forward, wrong.backward))
    with pytest.warns(RuntimeWarning, match="'cudnn' not used"):
        why = dense._probe(dense.ROUTES["cudnn"], q, k)
    assert why.startswith("dq relative error")


@pytest.mark.parametrize("lengths, cudnn_used", [((48, 48), True), ((23, 0, 41), False)])
def test_dense_mode_takes_cudnn_for_equal_lengths(fake_routes, monkeypatch, seed, lengths,
                                                  cudnn_used):
    """Through the public op (the probes and calls inside the custom op): equal lengths run
    the cuDNN call forward (and backward when non-deterministic is allowed), unequal lengths
    the next route; results equal our kernels' either way."""
    x = make_inputs(lengths, heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    dtype=torch.float32, seed=seed)
    monkeypatch.setenv(dense.BACKEND_ENV, "kernels")
    ours = _run(x)
    monkeypatch.delenv(dense.BACKEND_ENV)
    rec = fake_routes()
    fake = FakeCudnn()
    monkeypatch.setattr(dense, "_cudnn_ops", lambda: (fake.forward, fake.backward))
    monkeypatch.setitem(dense.ROUTES, "cudnn", dense.Route(
        "cudnn", dense._cudnn_forward, dense._cudnn_backward, False, dense._cudnn_takes))
    monkeypatch.setenv(dense.DETERMINISTIC_ENV, "0")
    routed = _run(x)
    probe = ["fwd", "bwd", "fwd"]  # the checked pair, then dense.lse_guards_q's bad rows
    assert fake.calls == probe + (["fwd", "bwd"] if cudnn_used else [])
    flash_calls = [c for c in rec.calls if c[0] == "flash"]
    assert (flash_calls == []) == cudnn_used, rec.calls
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert_close(a, b, 1e-5, name)
