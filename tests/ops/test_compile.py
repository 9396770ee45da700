"""torch.compile support of ``backend="torch"`` (custom ops ``msa_megatron::torch_*``).

A function calling :func:`msa_megatron.msa_attention` compiles with ``fullgraph=True`` and gives
the eager outputs and gradients; the custom ops pass ``torch.library.opcheck`` (schema, fake
implementation, autograd registration).
"""

from __future__ import annotations

import pytest
import torch

from msa_megatron import msa_attention
from msa_megatron.ops import torch_backend
from msa_megatron.layout import query_layout
from tests.support.inputs import assert_close, make_inputs

NAMES = ("q", "k", "v", "q_idx", "k_idx")
OPTIONS = dict(block_size=16, top_k=2, init_blocks=1, local_blocks=1)


def _inputs(seed: int):
    return make_inputs((23, 0, 41), heads=8, kv_heads=2, index_heads=4, index_key_heads=2,
                       dtype=torch.float32, seed=seed)


def _loss_and_grads(fn, x):
    leaves = [x[n] for n in NAMES]
    out, kl = fn(*leaves, x["cu_seqlens"])
    grads = torch.autograd.grad((out * out).sum() + 2.0 * kl, leaves)
    return [out, kl, *grads]


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_fullgraph_compile_matches_eager(mode, seed):
    def layer(q, k, v, q_idx, k_idx, cu_seqlens):
        return msa_attention(q, k, v, q_idx, k_idx, cu_seqlens, mode=mode, backend="torch",
                             **OPTIONS)

    torch._dynamo.reset()
    x = _inputs(seed)
    eager = _loss_and_grads(layer, x)
    compiled = _loss_and_grads(torch.compile(layer, fullgraph=True, backend="aot_eager"), x)
    for name, a, b in zip(("out", "kl") + NAMES, compiled, eager):
        assert_close(a, b, 1e-6, name)


def test_fullgraph_inductor_compile_of_a_layer_matches_eager(seed):
    """Projections around the op, compiled by the default backend (inductor, C++ on CPU)."""
    torch.manual_seed(seed)
    hidden, Hq, Hkv, Hi, D, Di = 32, 4, 2, 2, 8, 8
    proj = torch.nn.Linear(hidden, (Hq + 2 * Hkv) * D + (Hi + 1) * Di, dtype=torch.float32)
    x = torch.randn(40, hidden, requires_grad=True)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)

    def layer(x, cu_seqlens):
        q, k, v, q_idx, k_idx = proj(x).split([Hq * D, Hkv * D, Hkv * D, Hi * Di, Di], dim=-1)
        out, kl = msa_attention(q.reshape(-1, Hq, D), k.reshape(-1, Hkv, D),
                                v.reshape(-1, Hkv, D), q_idx.reshape(-1, Hi, Di),
                                k_idx.reshape(-1, 1, Di), cu_seqlens, backend="torch", **OPTIONS)
        return out.square().mean() + kl

    torch._dynamo.reset()
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        loss = fn(x, cu)
        results.append([loss] + list(torch.autograd.grad(loss, [x, proj.weight])))
    for name, a, b in zip(("loss", "dx", "dweight"), results[1], results[0]):
        assert_close(a, b, 1e-5, name)


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_custom_ops_pass_opcheck(mode, seed):
    x = _inputs(seed)
    T, Hi = x["q_idx"].shape[:2]
    q_pos, q_kbase = query_layout(x["cu_seqlens"], T, x["q"].device)
    ops = torch_backend.ops
    block_idx = ops.select(x["q_idx"].detach(), x["k_idx"].detach(), q_pos, q_kbase, 16, 2, 1, 1,
                           0.25)
    if mode == "dense":
        block_idx = None
    main = (x["q"], x["k"], x["v"], block_idx, q_pos, q_kbase, 16, 0.3, Hi)
    out, lse = ops.attention_fwd(*main)
    torch.library.opcheck(ops.select, (x["q_idx"].detach(), x["k_idx"].detach(), q_pos, q_kbase,
                                       16, 2, 1, 1, 0.25))
    torch.library.opcheck(ops.attention_fwd, main)
    torch.library.opcheck(ops.attention_bwd, (torch.randn_like(out), x["q"].detach(),
                                              x["k"].detach(), x["v"].detach(), out.detach(),
                                              lse, block_idx, q_pos, q_kbase, 16, 0.3, Hi))
    torch.library.opcheck(ops.kl, (x["q"].detach(), x["k"].detach(), lse, x["q_idx"],
                                   x["k_idx"], block_idx, q_pos, q_kbase, 16, 0.3, 0.25, 0.01,
                                   True))
