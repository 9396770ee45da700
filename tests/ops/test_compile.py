"""torch.compile support of ``backend="torch"`` (custom ops ``msa_megatron::torch_*``).

A function calling :func:`msa_megatron.msa_attention` compiles with ``fullgraph=True`` and gives
the eager outputs and gradients; the custom ops pass ``torch.library.opcheck`` (schema, fake
implementation, autograd registration).
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron import msa_attention  # noqa: E402
from msa_megatron.ops import torch_backend  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from tests.support.inputs import assert_close, make_inputs  # noqa: E402

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


@pytest.mark.parametrize("bad", ["k", "q_idx"])
def test_fullgraph_compile_of_bad_shapes_carries_the_message(bad):
    """Under ``fullgraph=True`` dynamo turns any raise into its ``Unsupported`` error; the shape
    checks are traceable, so that error carries the ValueError and its message (shapes named),
    and without fullgraph the plain ValueError comes through."""
    torch._dynamo.reset()
    x = make_inputs((32, 32), heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    dtype=torch.float32, seed=0, requires_grad=False)
    good = [x[n] for n in NAMES]
    x[bad] = x[bad][:, :, :8] if bad == "k" else x[bad][:40]
    leaves = [x[n] for n in NAMES]

    def layer(*args):
        return msa_attention(*args, backend="torch", **OPTIONS)

    # After a good call the changed size is traced as a symbol (automatic dynamic shapes),
    # where str() of each size could not be traced.
    # (torch 2.13 formats the message, 2.11 prints its parts: match what both keep)
    want = r"k .* and v .*must have the same shape" if bad == "k" else r"q_idx .*disagree on T"
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(*good, x["cu_seqlens"])
    with pytest.raises(RuntimeError, match=r"raised exception ValueError\(.*" + want):
        compiled(*leaves, x["cu_seqlens"])
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    compiled(*good, x["cu_seqlens"])
    with pytest.raises(ValueError, match=r"k \[64, 2, 8\]" if bad == "k" else r"q_idx \[40"):
        compiled(*leaves, x["cu_seqlens"])


@pytest.mark.parametrize("bad", [[0, 40, 20, 64], [0, 32, 60], [5, 32, 64]],
                         ids=["decreasing", "short", "not_at_zero"])
def test_compiled_op_refuses_bad_cu_seqlens_values(bad):
    """Inside torch.compile the eager host-side value checks cannot run; a traced device-side
    assertion refuses the same inputs (never a silent wrong answer)."""
    def layer(q, k, v, q_idx, k_idx, cu_seqlens):
        return msa_attention(q, k, v, q_idx, k_idx, cu_seqlens, backend="torch", **OPTIONS)

    torch._dynamo.reset()
    x = make_inputs((32, 32), heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    dtype=torch.float32, seed=0, requires_grad=False)
    leaves = [x[n] for n in NAMES]
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(*leaves, x["cu_seqlens"])  # the good layout runs
    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
        compiled(*leaves, torch.tensor(bad, dtype=torch.int32))


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


# --- backend="triton": registration at import, fake implementations, compile (issue 12) ---
#
# On a CPU the Triton kernels run in the interpreter (TRITON_INTERPRET=1, fp32 shapes kept
# tiny); on a GPU the same tests run the compiled kernels.

TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def test_importing_the_package_registers_every_backend():
    """A compiled function may call a backend first: nothing is imported while tracing."""
    code = ("import sys, msa_megatron\n"
            "from msa_megatron.ops.backends import _MODULES\n"
            "missing = [m for m in _MODULES.values() if m not in sys.modules]\n"
            "assert not missing, missing\n"
            "assert 'triton' not in sys.modules, 'importing the package must not import Triton'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_query_layout_never_passes_a_view_to_searchsorted():
    """Inductor's GPU lowering of searchsorted cannot take a slice view (torch 2.11 raised
    ``NotImplementedError: SliceView`` when compiling with cu_seqlens)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    cu = torch.tensor([0, 0, 5, 5, 9, 12], dtype=torch.int32)
    graph = make_fx(lambda c: query_layout(c, 12, c.device))(cu).graph
    calls = [n for n in graph.nodes if n.target == torch.ops.aten.searchsorted.Tensor]
    assert calls, "query_layout is expected to use searchsorted"
    for node in calls:
        boundaries = node.args[0]
        assert boundaries.op == "placeholder" or "slice" not in str(boundaries.target), (
            f"searchsorted reads a view: {boundaries.format_node()}")
    q_pos, q_kbase = query_layout(cu, 12, cu.device)
    assert q_kbase.tolist() == [0] * 5 + [5] * 4 + [9] * 3
    assert q_pos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]


def _triton_case(seed, mode, contiguous):
    """Raw-op arguments of the four triton custom ops; non-contiguous inputs if asked."""
    x = make_inputs((13, 0, 20), heads=4, kv_heads=2, index_heads=2, index_key_heads=1,
                    head_dim=16, index_head_dim=16, dtype=torch.float32, seed=seed,
                    device=TRITON_DEVICE)
    if not contiguous:  # same values, permuted storage ([H, T, D] memory order)
        for n in NAMES:
            x[n] = x[n].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    T, Hi = x["q_idx"].shape[:2]
    q_pos, q_kbase = query_layout(x["cu_seqlens"], T, TRITON_DEVICE)
    from msa_megatron.ops import triton as triton_backend

    ops = triton_backend.ops
    qi, ki = x["q_idx"].detach(), x["k_idx"].detach()
    select_args = (qi, ki, q_pos, q_kbase, 16, 2, 1, 1, 0.25)
    block_idx = ops.select(*select_args) if mode == "sparse" else None
    fwd_args = (x["q"], x["k"], x["v"], block_idx, q_pos, q_kbase, 16, 0.3, Hi)
    out, lse = ops.attention_fwd(*fwd_args)
    dout = torch.randn_like(out)
    if not contiguous:
        dout = dout.transpose(0, 1).contiguous().transpose(0, 1)
    bwd_args = (dout, x["q"].detach(), x["k"].detach(), x["v"].detach(), out.detach(), lse,
                block_idx, q_pos, q_kbase, 16, 0.3, Hi)
    kl_args = (x["q"].detach(), x["k"].detach(), lse, x["q_idx"], x["k_idx"], block_idx, q_pos,
               q_kbase, 16, 0.3, 0.25, 0.01, True)
    return ops, {"select": select_args, "attention_fwd": fwd_args, "attention_bwd": bwd_args,
                 "kl": kl_args}


def _metadata(t):
    return tuple(t.shape), t.dtype, t.stride(), t.storage_offset()


@needs_triton
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("contiguous", [True, False])
def test_triton_fake_implementations_match_the_kernels(mode, contiguous, seed):
    """Every output of every triton op: the fake gives the real shape, dtype and strides, and
    real outputs are fresh contiguous tensors (no view of an input or of another output)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops, cases = _triton_case(seed, mode, contiguous)
    for name, args in cases.items():
        op = getattr(ops, name)
        real = op(*args)
        real = (real,) if isinstance(real, torch.Tensor) else real
        with FakeTensorMode(allow_non_fake_inputs=False) as mode_:
            fake_args = [mode_.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = op(*fake_args)
        fake = (fake,) if isinstance(fake, torch.Tensor) else fake
        assert len(fake) == len(real), name
        inputs = {a.untyped_storage().data_ptr() for a in args
                  if isinstance(a, torch.Tensor) and a.numel()}
        seen = set()
        for n, (r, f) in enumerate(zip(real, fake)):
            assert _metadata(f) == _metadata(r), (name, n, _metadata(f), _metadata(r))
            assert r.is_contiguous(), (name, n, r.stride())
            if r.numel():
                ptr = r.untyped_storage().data_ptr()
                assert ptr not in inputs and ptr not in seen, f"{name} output {n} aliases"
                seen.add(ptr)


@needs_triton
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_triton_custom_ops_pass_opcheck(mode, seed):
    ops, cases = _triton_case(seed, mode, contiguous=False)
    for name, args in cases.items():
        torch.library.opcheck(getattr(ops, name), args)


@needs_triton
@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_triton_fullgraph_inductor_compile_matches_eager(mode, seed):
    """Projections + the public op with backend="triton", compiled by inductor (fullgraph),
    first called inside the compiled function; cu_seqlens given (searchsorted in the graph)."""
    torch.manual_seed(seed)
    hidden, Hq, Hkv, Hi, D, Di = 32, 4, 2, 2, 16, 16
    proj = torch.nn.Linear(hidden, (Hq + 2 * Hkv) * D + (Hi + 1) * Di, dtype=torch.float32,
                           device=TRITON_DEVICE)
    x = torch.randn(40, hidden, requires_grad=True, device=TRITON_DEVICE)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=TRITON_DEVICE)

    def layer(x, cu_seqlens):
        q, k, v, q_idx, k_idx = proj(x).split([Hq * D, Hkv * D, Hkv * D, Hi * Di, Di], dim=-1)
        out, kl = msa_attention(q.reshape(-1, Hq, D), k.reshape(-1, Hkv, D),
                                v.reshape(-1, Hkv, D), q_idx.reshape(-1, Hi, Di),
                                k_idx.reshape(-1, 1, Di), cu_seqlens, backend="triton",
                                mode=mode, **OPTIONS)
        return out.square().mean() + kl

    torch._dynamo.reset()
    results = []
    for fn in (torch.compile(layer, fullgraph=True), layer):
        loss = fn(x, cu)
        results.append([loss] + list(torch.autograd.grad(loss, [x, proj.weight])))
    for name, a, b in zip(("loss", "dx", "dweight"), results[0], results[1]):
        assert_close(a, b, 1e-5, name)
