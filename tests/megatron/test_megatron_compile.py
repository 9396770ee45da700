"""torch.compile(fullgraph=True) of a megatron-core GPT with MSA layers (issue 12).

A tiny GPTModel built from ``get_gpt_layer_msa_spec`` (sbhd: megatron-core's THD rope reads
``cu_seqlens`` on the host and does not compile fullgraph) gives the eager loss, gradients and
KL metrics when compiled (with no shim around megatron-core: the MSA spec's row-parallel linears
pass their TP group, so megatron-core's ``warnings.warn`` never runs), and is not recompiled from one step to the next (the KL metrics kept
in the traced code must not become guards that change every step). The GPU run of the same
(triton backend, inductor, eager vs compiled time) is benchmarks/bench_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.support.gpt_harness import Setup, batch, build_model

pytestmark = pytest.mark.slow


def _compile_worker(rank: int, world_size: int, mode: str) -> dict:
    import torch._dynamo

    from msa_megatron.megatron import get_msa_metrics

    torch._dynamo.reset()
    model = build_model(Setup(layers=2, mode=mode), 1)
    tokens, positions, _ = batch(0, "sbhd")

    def step(tokens, positions):
        return model(tokens, positions, None, labels=tokens).mean()

    def run(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(tokens, positions)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, get_msa_metrics(reset=True)

    out = {"eager": run(step)}
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out["compiled"] = run(compiled)
    run(compiled)  # a layer's metric tensors exist from here on: one more trace at most
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            out["steady"] = run(compiled)
        model.zero_grad(set_to_none=True)
        for _ in range(2):  # micro-batches accumulated before the metrics are read
            compiled(tokens, positions).backward()
        out["accumulated"] = get_msa_metrics(reset=True)
    return out


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_gpt_with_msa_compiles_fullgraph_and_matches_eager(mode):
    out = run_distributed(_compile_worker, 1, args=(mode,), tp=1)[0]
    loss, grads, metrics = out["eager"]
    assert metrics and all(v > 0 for k, v in metrics.items() if k.startswith("msa/kl"))
    for name in ("compiled", "steady"):
        c_loss, c_grads, c_metrics = out[name]
        torch.testing.assert_close(c_loss, loss, rtol=1e-5, atol=1e-6)
        assert set(c_grads) == set(grads)
        for key, grad in grads.items():
            torch.testing.assert_close(c_grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)
        assert c_metrics.keys() == metrics.keys()
        for key, value in metrics.items():
            assert c_metrics[key] == pytest.approx(value, rel=1e-5), key
    for key, value in metrics.items():  # two identical micro-batches: the same mean KL
        assert out["accumulated"][key] == pytest.approx(value, rel=1e-5), key


def _warnings_worker(rank: int, world_size: int) -> dict:
    import warnings

    from megatron.core.tensor_parallel.layers import RowParallelLinear

    model = build_model(Setup(layers=1), 1)
    tokens, positions, _ = batch(0, "sbhd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(tokens, positions, None, labels=tokens).mean().backward()
    linears = {name: (type(m).__name__, getattr(m, "tp_group", None) is not None)
               for name, m in model.named_modules() if hasattr(m, "tp_group")
               and isinstance(m, torch.nn.Module) and "linear" in name}
    return {"messages": [f"{w.category.__name__}: {w.message}" for w in caught],
            "linears": linears,
            "row_parallel": sorted(name for name, m in model.named_modules()
                                   if isinstance(m, RowParallelLinear))}


def test_msa_gpt_forward_raises_no_tp_group_warning():
    """megatron-core's RowParallelLinear (0.16 and 0.19) hands ``tp_group=None`` to its linear
    function, which warns on rank 0 in every forward: a graph break under
    ``torch.compile(fullgraph=True)``. The MSA spec's linears must pass their group (no such
    warning in forward or backward) and every linear must hold a TP group."""
    out = run_distributed(_warnings_worker, 1, tp=1)[0]
    tp_warnings = [m for m in out["messages"] if "tp_group" in m]
    assert tp_warnings == []
    assert out["row_parallel"] == ["decoder.layers.0.mlp.linear_fc2",
                                   "decoder.layers.0.self_attention.linear_proj"]
    assert out["linears"] and all(has for _, has in out["linears"].values()), out["linears"]
