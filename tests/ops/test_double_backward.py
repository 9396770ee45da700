"""Second-order gradients (double backward) of :func:`msa_megatron.msa_attention`.

A gradient taken with ``create_graph=True`` is fine and equals the plain one; differentiating it
raises :class:`NotImplementedError` naming the op, on every backend whose gradients are not
plain autograd (the ``torch`` and ``triton`` custom ops, the oracle's KL). The oracle's main
branch is plain autograd, so its second-order gradients exist and are checked numerically.
"""

from __future__ import annotations

import os

import pytest
import torch

from msa_megatron import msa_attention
from tests.support.inputs import make_inputs

TRITON_ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if TRITON_ON_CPU else "cuda"
needs_triton = pytest.mark.skipif(
    TRITON_ON_CPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
# (backend, dtype): fp32/fp16 only for Triton, whose CPU interpreter has no bf16.
CASES = [("torch", torch.float32), ("torch", torch.float64),
         pytest.param("triton", torch.float32, marks=needs_triton),
         pytest.param("triton", torch.float16, marks=needs_triton)]
OPTIONS = dict(block_size=16, top_k=2)


def _run(x, backend, mode):
    return msa_attention(x["q"], x["k"], x["v"], x["q_idx"], x["k_idx"], x["cu_seqlens"],
                         mode=mode, backend=backend, **OPTIONS)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("backend,dtype", CASES)
def test_double_backward_of_attention_names_the_op(backend, dtype, mode, seed):
    x = make_inputs((20, 12), dtype=dtype, seed=seed, device=DEVICE)
    out, _ = _run(x, backend, mode)
    dout = torch.randn_like(out)
    main = (x["q"], x["k"], x["v"])
    grads = torch.autograd.grad(out, main, dout, create_graph=True)
    plain = torch.autograd.grad(_run(x, backend, mode)[0], main, dout)
    for got, want in zip(grads, plain):
        assert got.requires_grad and torch.equal(got.detach(), want)
    with pytest.raises(NotImplementedError,
                       match=rf"double backward \(second-order gradients\) of MSA is not "
                             rf"supported: msa_megatron::{backend}_attention_fwd"):
        sum(g.float().square().sum() for g in grads).backward()


@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("backend,dtype", CASES)
def test_double_backward_of_kl_names_the_op(backend, dtype, mode, seed):
    x = make_inputs((20, 12), dtype=dtype, seed=seed, device=DEVICE)
    index = (x["q_idx"], x["k_idx"])
    grads = torch.autograd.grad(_run(x, backend, mode)[1], index, create_graph=True)
    plain = torch.autograd.grad(_run(x, backend, mode)[1], index)
    for got, want in zip(grads, plain):
        # Before: the gradient was a constant (no grad_fn), so a second-order term was lost.
        assert got.requires_grad and torch.equal(got.detach(), want)
    with pytest.raises(NotImplementedError, match=rf"of MSA is not supported: "
                                                  rf"msa_megatron::{backend}_kl"):
        sum(g.float().square().sum() for g in grads).backward()


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_reference_kl_refuses_double_backward(mode, seed):
    """The oracle's KL gradient is computed outside autograd (MSA_SPEC 4: Qs - T): it used to
    come back as a constant under create_graph=True, dropping the second-order term."""
    x = make_inputs((20, 12), dtype=torch.float64, seed=seed)
    kl = _run(x, "reference", mode)[1]
    grads = torch.autograd.grad(kl, (x["q_idx"], x["k_idx"]), create_graph=True)
    with pytest.raises(NotImplementedError, match=r"of MSA is not supported: the reference KL"):
        sum(g.square().sum() for g in grads).backward()


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_reference_attention_second_order_gradients_are_exact(mode, seed):
    """The oracle's main branch is plain autograd: gradgradcheck passes (float64)."""
    x = make_inputs((20, 12), heads=2, kv_heads=1, index_heads=1, head_dim=2, index_head_dim=2,
                    dtype=torch.float64, seed=seed)

    def out(q, k, v):
        return msa_attention(q, k, v, x["q_idx"], x["k_idx"], x["cu_seqlens"], mode=mode,
                             backend="reference", block_size=16, top_k=1)[0]

    assert torch.autograd.gradgradcheck(out, (x["q"], x["k"], x["v"]), fast_mode=True)
