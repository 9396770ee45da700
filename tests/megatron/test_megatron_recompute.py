"""Activation recomputation (selective ``core_attn`` and full layer) reuses the selection made in
the first forward of each micro-batch: same gradients as without recomputation, one selection per
layer and micro-batch, also when two micro-batches are in flight (pipeline-style 2 forwards,
then 2 backwards), whatever order the backwards come in (in order, reversed, one summed
backward) and after a forward whose backward never comes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.support.gpt_harness import (
    Setup,
    batch,
    build_model,
    full_grads,
    sum_qk_norm_grads,
    tolerance,
)
from tests.support.devices import skip_without_gpus
from tests.support.spies import count_selections

pytestmark = pytest.mark.slow

MICRO_BATCHES = 2


ORDERS = ("in_order", "reverse", "sum", "orphan")


def _two_micro_batches(rank: int, world_size: int, setup: Setup, tp: int,
                       order: str = "in_order") -> dict:
    """Two forwards, then their backwards in ``order``; ``"orphan"`` first runs a forward of a
    third micro-batch whose backward never comes (its loss is dropped), then in order."""
    from msa_megatron.megatron import get_msa_metrics

    model = build_model(setup, tp)
    with count_selections(setup.backend) as counts:
        if order == "orphan":
            tokens, positions, packed = batch(2, setup.formats[0])  # micro-batch 0's shape
            model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean()
            get_msa_metrics(reset=True)  # its KL is not part of the compared steps
        orphan_counts = dict(counts)
        losses = []
        for micro in range(MICRO_BATCHES):
            tokens, positions, packed = batch(micro, setup.formats[micro])
            losses.append(model(tokens, positions, None, labels=tokens,
                                packed_seq_params=packed).mean())
        forward_counts = {key: value - orphan_counts[key] for key, value in counts.items()}
        stored_after_forward = sum(len(core._selections) for core in _cores(model))
        if order == "sum":
            (losses[0] + losses[1]).backward()
        else:
            for loss in (reversed(losses) if order == "reverse" else losses):
                loss.backward()
        backward_counts = {key: value - orphan_counts[key] for key, value in counts.items()}
    sum_qk_norm_grads(model)
    stored = sum(len(core._selections) for core in _cores(model))
    return {"loss": torch.stack(losses).detach().cpu(), "grads": full_grads(model),
            "kl": get_msa_metrics(reset=True), "forward_counts": forward_counts,
            "counts": backward_counts, "stored_after_forward": stored_after_forward,
            "stored_after_backward": stored}


def _cores(model):
    from msa_megatron.megatron import MSACoreAttention

    return [m for m in model.modules() if isinstance(m, MSACoreAttention)]


@pytest.mark.parametrize("tp", [1, 4])
def test_recompute_reuses_selection(tp):
    skip_without_gpus(tp)
    base = Setup(formats=["sbhd", "thd"])
    runs = {}
    for recompute in (None, "selective", "full"):
        setup = dataclasses.replace(base, recompute=recompute)
        runs[recompute] = run_distributed(_two_micro_batches, tp, args=(setup, tp), tp=tp)
    layers = base.layers
    for recompute in ("selective", "full"):
        for ref, rec in zip(runs[None], runs[recompute]):
            torch.testing.assert_close(rec["loss"], ref["loss"], **tolerance(rtol=1e-6, atol=1e-6))
            for key, value in ref["kl"].items():
                tol = tolerance(rtol=1e-5, atol=1e-8)
                assert rec["kl"][key] == pytest.approx(value, rel=tol["rtol"], abs=tol["atol"])
            for name, grad in ref["grads"].items():
                torch.testing.assert_close(rec["grads"][name], grad,
                                           **tolerance(rtol=1e-5, atol=1e-7),
                                           msg=f"{recompute}: grad of {name}")
            # One selection per layer and micro-batch, made in the forward, none in backward.
            assert rec["forward_counts"]["calls"] == layers * MICRO_BATCHES
            assert rec["counts"] == rec["forward_counts"]
            # The recomputation really happened: each first forward stored its selection.
            assert rec["stored_after_forward"] == layers * MICRO_BATCHES
            assert rec["stored_after_backward"] == 0
    for ref in runs[None]:
        assert ref["counts"]["calls"] == layers * MICRO_BATCHES
        assert ref["stored_after_forward"] == 0


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_matches_its_own_micro_batch(recompute):
    """Backwards out of forward order, and a forward left without backward, still recompute
    with each micro-batch's own selection (the stored one is found by its inputs, not by
    position): the gradients of in-order backward without recomputation, no new selection."""
    base = Setup(formats=["sbhd", "sbhd"])  # same shape: only the values tell them apart
    ref = run_distributed(_two_micro_batches, 1, args=(base, 1), tp=1)[0]
    layers = base.layers
    for order in ORDERS[1:]:
        setup = dataclasses.replace(base, recompute=recompute)
        rec = run_distributed(_two_micro_batches, 1, args=(setup, 1, order), tp=1)[0]
        torch.testing.assert_close(rec["loss"], ref["loss"], **tolerance(rtol=1e-6, atol=1e-6))
        for name, grad in ref["grads"].items():
            torch.testing.assert_close(rec["grads"][name], grad,
                                       **tolerance(rtol=1e-5, atol=1e-7),
                                       msg=f"{recompute}, {order}: grad of {name}")
        assert rec["forward_counts"]["calls"] == layers * MICRO_BATCHES, order
        assert rec["counts"] == rec["forward_counts"], f"{order}: selected again in backward"
        orphans = layers if order == "orphan" else 0
        assert rec["stored_after_forward"] == layers * MICRO_BATCHES + orphans, order
        assert rec["stored_after_backward"] == orphans, order
