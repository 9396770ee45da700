"""Run-time dense/sparse switching, the KL gradient plumbing (coefficient, loss scale,
stop-gradient into the backbone) and the KL metrics' reduction over ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.support.gpt_harness import SEQ, Setup, batch, build_model, tolerance
from tests.support.spies import count_selections

pytestmark = pytest.mark.slow


def _loss_and_grads(model, fmt="sbhd"):
    tokens, positions, packed = batch(0, fmt)
    model.zero_grad(set_to_none=True)
    loss = model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _modes_worker(rank: int, world_size: int) -> dict:
    from msa_megatron.megatron import (
        apply_msa_warmup,
        get_msa_metrics,
        set_kl_loss_scale,
        set_msa_mode,
    )

    out = {}
    setup = Setup()
    model = build_model(setup, 1)
    out["sparse_loss"], sparse_grads = _loss_and_grads(model)
    assert set_msa_mode(model, "dense") == setup.layers
    with count_selections(setup.backend) as counts:
        out["dense_loss"], dense_grads = _loss_and_grads(model)
    out["dense_selections"] = counts["calls"]
    out["dense_kl"] = get_msa_metrics(reset=True)
    with pytest.raises(ValueError, match="mode"):
        set_msa_mode(model, "warm")
    out["warmup_modes"] = [apply_msa_warmup([model], step, dense_steps=2) for step in range(4)]

    # With every block selected, sparse attention is dense attention.
    all_blocks = build_model(dataclasses.replace(setup, top_k=SEQ // setup.block_size), 1)
    out["all_blocks_loss"], all_blocks_grads = _loss_and_grads(all_blocks)
    out["max_grad_diff_all_blocks_vs_dense"] = max(
        (all_blocks_grads[n] - dense_grads[n]).abs().max().item() for n in dense_grads)

    # The KL trains the index branch only; its gradient scales with kl_coeff * loss scale.
    no_kl = build_model(dataclasses.replace(setup, kl_coeff=0.0), 1)
    _, no_kl_grads = _loss_and_grads(no_kl)
    out["backbone_diff"] = max((no_kl_grads[n] - sparse_grads[n]).abs().max().item()
                               for n in no_kl_grads if "_idx" not in n)
    out["index_grads_without_kl"] = sorted(
        n for n, g in no_kl_grads.items() if "_idx" in n and not torch.any(g))
    set_kl_loss_scale(0.25)
    _, scaled = _loss_and_grads(build_model(setup, 1))
    set_kl_loss_scale(1.0)
    out["index_scale_ratio"] = [
        (scaled[n] / sparse_grads[n])[sparse_grads[n].abs() > 1e-8].tolist()
        for n in sparse_grads if "_idx" in n]
    return out


def test_modes_and_kl_plumbing():
    out = run_distributed(_modes_worker, 1, tp=1)[0]
    assert out["dense_selections"] == 0
    assert out["dense_kl"]["msa/kl"] > 0
    assert not torch.allclose(out["dense_loss"], out["sparse_loss"])
    assert out["warmup_modes"] == ["dense", "dense", "sparse", "sparse"]
    torch.testing.assert_close(out["all_blocks_loss"], out["dense_loss"],
                               **tolerance(rtol=1e-6, atol=1e-6))
    assert out["max_grad_diff_all_blocks_vs_dense"] < tolerance(0, 1e-6)["atol"]
    assert out["backbone_diff"] <= tolerance(0, 1e-9)["atol"]  # exact on CPU
    assert out["index_grads_without_kl"] == sorted(
        f"decoder.layers.{i}.self_attention.index.{p}" for i in range(2)
        for p in ("linear_q_idx.weight", "linear_k_idx.weight", "q_idx_norm.weight",
                  "k_idx_norm.weight"))
    for ratios in out["index_scale_ratio"]:
        assert ratios and all(abs(r - 0.25) < tolerance(0, 1e-4)["atol"] for r in ratios)


def _metrics_worker(rank: int, world_size: int) -> dict:
    """2 pipeline stages x 2 DP replicas (synthetic shares): stage s holds layer s+1; the layer's
    KL of a micro-batch is split into 2 TP shares."""
    from megatron.core import parallel_state

    from msa_megatron.megatron import get_msa_metrics
    from msa_megatron.megatron.metrics import record_kl

    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    layer = stage + 1
    for micro in range(2):
        full = torch.tensor(float(10 * layer + 2 * dp + micro))
        record_kl(layer, full / 2, parts=2)  # this rank's TP share
    return get_msa_metrics(reset=True)


def test_metrics_reduction_over_tp_dp_pp():
    results = run_distributed(_metrics_worker, 8, tp=2, pp=2)
    # layer 1: values 10 + 2*dp + micro over dp, micro in {0, 1} -> mean 11.5; layer 2: 21.5
    expected = {"msa/kl/layer_01": 11.5, "msa/kl/layer_02": 21.5, "msa/kl": 16.5}
    for metrics in results:
        assert metrics == pytest.approx(expected)


@pytest.mark.parametrize("step, dense_steps, error, match", [
    ("3", 5, TypeError, "step must be an int"),
    (2.5, 5, TypeError, "step must be an int"),
    (True, 5, TypeError, "step must be an int"),
    (2, None, TypeError, "dense_steps must be an int"),
    (-1, 5, ValueError, "step must be >= 0"),
    (2, -5, ValueError, "dense_steps must be >= 0"),
])
def test_warmup_refuses_bad_steps(step, dense_steps, error, match):
    """A negative dense_steps, or a float step, silently picked a mode; a string or None failed
    with a bare comparison error that named neither argument."""
    from msa_megatron.megatron import apply_msa_warmup

    with pytest.raises(error, match=match):
        apply_msa_warmup(torch.nn.Linear(2, 2), step, dense_steps)


@pytest.mark.parametrize("call", ["set_msa_mode", "apply_msa_warmup", "clear_selection_cache",
                                  "index_branch_parameters"])
@pytest.mark.parametrize("model", [None, "model", [torch.nn.Linear(2, 2), 3]])
def test_model_walkers_refuse_non_modules(call, model):
    """Every function that walks the model's MSA layers names ``model`` when it is not a module
    or an iterable of modules (it failed with "'NoneType' object is not iterable", or with an
    AttributeError of a string's characters)."""
    import msa_megatron.megatron as mm

    args = {"set_msa_mode": ("sparse",), "apply_msa_warmup": (0, 1)}.get(call, ())
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        list(getattr(mm, call)(model, *args) or ())


def test_model_walkers_accept_modules_and_chunk_lists():
    from msa_megatron.megatron import apply_msa_warmup, set_msa_mode

    plain = torch.nn.Linear(2, 2)
    assert set_msa_mode(plain, "sparse") == 0
    assert set_msa_mode((plain, plain), "dense") == 0
    assert [apply_msa_warmup([plain], s, dense_steps=2) for s in range(3)] == \
        ["dense", "dense", "sparse"]
    assert apply_msa_warmup(plain, 0, dense_steps=0) == "sparse"
