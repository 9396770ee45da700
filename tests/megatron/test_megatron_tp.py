"""TP=2 (Hkv divisible) and TP=4 with 2 query groups (TP > Hkv, ranks share an index head) train
exactly like TP=1: same LM losses, KL values and gradients over several SGD steps in SBHD and THD,
and no selection is computed twice (MSA_SPEC section 6). With Hik % TP == 0 the index key
projection is split over TP (each rank holds the key heads its index heads read), and still
trains like TP=1."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed, selected_device
from tests.support.gpt_harness import Setup, tolerance, train_worker

pytestmark = pytest.mark.slow

GRAD_TOL = tolerance(rtol=1e-4, atol=2e-6)
KL_TOL = tolerance(rtol=1e-3, atol=2e-6)
LOSS_TOL = tolerance(rtol=1e-5, atol=1e-6)


def _compare(reference: dict, record: dict) -> None:
    for step, (loss_ref, loss) in enumerate(zip(reference["loss"], record["loss"])):
        torch.testing.assert_close(loss, loss_ref, **LOSS_TOL, msg=f"loss step {step}")
    for step, (kl_ref, kl) in enumerate(zip(reference["kl"], record["kl"])):
        assert kl.keys() == kl_ref.keys()
        assert kl_ref["msa/kl"] > 0
        for key in kl_ref:
            torch.testing.assert_close(torch.tensor(kl[key]), torch.tensor(kl_ref[key]),
                                       **KL_TOL, msg=f"{key} step {step}")
    for step, (grads_ref, grads) in enumerate(zip(reference["grads"], record["grads"])):
        assert grads.keys() == grads_ref.keys()
        for name, grad_ref in grads_ref.items():
            torch.testing.assert_close(grads[name], grad_ref, **GRAD_TOL,
                                       msg=f"grad of {name} at step {step}")
            if "_idx" in name:
                assert grad_ref.abs().max() > 0, f"{name} got no KL gradient"


def _selected_rows(records: list) -> list:
    return [sum(r["selections"][step]["rows"] for r in records)
            for step in range(len(records[0]["selections"]))]


@pytest.fixture(scope="module")
def reference():
    return run_distributed(train_worker, 1, args=(Setup(), 1), tp=1)[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_single_rank(reference, tp):
    """tp=2: 2 groups, one per rank; tp=4: 2 groups, each index head shared by 2 ranks."""
    records = run_distributed(train_worker, tp, args=(Setup(), tp), tp=tp)
    for record in records:
        _compare(reference, record)
    # Selection is split, never repeated: the ranks together select exactly TP=1's rows, and
    # every rank runs one selection per layer and step.
    assert _selected_rows(records) == _selected_rows([reference])
    for record in records:
        assert [s["calls"] for s in record["selections"]] == [Setup().layers] * 3


def test_tp_above_groups_with_one_index_head_per_rank():
    """TP=4 > Hkv=2 with Hi=4 index heads: megatron's TP > groups layout for q/k/v (gathered by
    the MSA layer), but every rank owns a whole index head, so nothing is shared."""
    setup = Setup(index_heads=4)
    reference = run_distributed(train_worker, 1, args=(setup, 1), tp=1)[0]
    records = run_distributed(train_worker, 4, args=(setup, 4), tp=4)
    for record in records:
        _compare(reference, record)
    assert _selected_rows(records) == _selected_rows([reference])


def _build_error_worker(rank: int, world_size: int, setup: Setup) -> str:
    """The message of the error the model build raises on this rank ("" when none)."""
    from tests.support.gpt_harness import build_model

    try:
        build_model(setup, world_size)
    except (ValueError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


@pytest.mark.parametrize("extra,tp,needle", [
    (dict(attention_output_gate=True), 2,
     "attention_output_gate=True with TP 2 > num_query_groups 1"),
    (dict(fused_single_qkv_rope=True), 1, "fused_single_qkv_rope"),
])
def test_unsupported_attention_options_are_refused_at_build(extra, tp, needle):
    """Options the MSA layer cannot run are refused when the model is built, not at its first
    forward (adversarial check 2026-12-07 s23: the output gate under TP > groups was refused
    only inside forward)."""
    setup = Setup(groups=1, config_extra=extra)
    messages = run_distributed(_build_error_worker, tp, args=(setup,), tp=tp)
    assert all(m.startswith("ValueError") and needle in m for m in messages), messages


def _norm_supports_sequence_parallel() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None
               for name in ("transformer_engine", "apex"))


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_matches_single_rank(reference, tp):
    """Sequence parallelism: megatron-core's own SP linears gather on CUDA only, so this runs in
    the GPU check (``MSA_TEST_DEVICE=cuda``)."""
    if selected_device() != "cuda":
        pytest.skip("megatron-core's sequence-parallel gathers allocate on CUDA")
    if not _norm_supports_sequence_parallel():
        pytest.skip("megatron-core's local spec without Transformer Engine or Apex uses torch "
                    "norms, which reject sequence parallelism")
    setup = Setup(sequence_parallel=True)
    for record in run_distributed(train_worker, tp, args=(setup, tp), tp=tp):
        _compare(reference, record)


def _index_key_worker(rank: int, world_size: int, setup: Setup) -> dict:
    """train_worker plus the local index key projection's shape and TP attributes."""
    from tests.support.gpt_harness import build_model, train

    model = build_model(setup, world_size)
    weight = model.decoder.layers[0].self_attention.index.linear_k_idx.weight
    record = train(model, setup)
    record["k_idx_weight"] = (tuple(weight.shape), getattr(weight, "tensor_model_parallel", False))
    return record


def test_tp_splits_index_key_heads():
    """Hik=2 at TP=2: each rank holds the one index key head its index head reads (a TP-sharded
    weight); at TP=4 (Hik % TP != 0) the projection is replicated."""
    setup = Setup(index_key_heads=2, index_heads=4)
    reference = run_distributed(_index_key_worker, 1, args=(setup,), tp=1)[0]
    width = setup.index_head_dim
    for tp, expected in ((2, ((width, setup.hidden), True)),
                         (4, ((2 * width, setup.hidden), False))):
        records = run_distributed(_index_key_worker, tp, args=(setup,), tp=tp)
        for record in records:
            assert record["k_idx_weight"] == expected, f"TP={tp}"
            _compare(reference, record)
        assert _selected_rows(records) == _selected_rows([reference])
