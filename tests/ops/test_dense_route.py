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
    its tile (0 * NaN), so inputs holding NaN take our kernels, forward and backward."""
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
    assert rec.calls == []
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert torch.equal(a.isnan(), b.isnan()), name
        assert name == "kl" or torch.isfinite(a[:23]).all(), name  # first sequence
        assert_close(a.nan_to_num(), b.nan_to_num(), 1e-5, name)


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
    probe_cudnn, probe_flash = [("cudnn", "fwd"), ("cudnn", "bwd", False)], [
        ("flash", "fwd"), ("flash", "bwd", True)]
    assert rec.calls == probe_cudnn + [("cudnn", "fwd")] + probe_flash + [("flash", "bwd", True)]
    assert dense.route_report(x["q"], x["k"])["refused"] == {}
    for name, a, b in zip(("out", "kl") + NAMES, routed, ours):
        assert_close(a, b, 1e-5, name)
