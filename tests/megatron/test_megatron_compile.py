"""torch.compile(fullgraph=True) of a megatron-core GPT with MSA layers (issue 12).

A tiny GPTModel built from ``get_gpt_layer_msa_spec`` (sbhd: megatron-core's THD rope reads
``cu_seqlens`` on the host and does not compile fullgraph) gives the eager loss, gradients and
KL metrics when compiled, and is not recompiled from one step to the next (the KL metrics kept
in the traced code must not become guards that change every step). The GPU run of the same
(triton backend, inductor, eager vs compiled time) is benchmarks/bench_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.support.gpt_harness import Setup, batch, build_model

pytestmark = pytest.mark.slow


def _quiet_megatron_tp_group_warning() -> None:
    """megatron-core 0.16's linear layers call ``warnings.warn`` inside forward when built
    without a TP group (dynamo cannot trace it); same group, no warning."""
    import megatron.core.tensor_parallel.layers as layers
    from megatron.core import parallel_state

    def group_if_none(tp_group=None, *args, **kwargs):
        return tp_group if tp_group is not None else \
            parallel_state.get_tensor_model_parallel_group()

    if hasattr(layers, "get_tensor_model_parallel_group_if_none"):
        layers.get_tensor_model_parallel_group_if_none = group_if_none


def _compile_worker(rank: int, world_size: int, mode: str) -> dict:
    import torch._dynamo

    from msa_megatron.megatron import get_msa_metrics

    _quiet_megatron_tp_group_warning()
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
