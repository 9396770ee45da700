"""The selection probe in a megatron-core GPT: msa/recall metrics, TP invariance, one shot."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.support.gpt_harness import Setup, batch, build_model

pytestmark = pytest.mark.slow


def _probe_worker(rank: int, world_size: int, tp: int, mode: str, groups: int = 2) -> dict:
    from msa_megatron.megatron import arm_selection_probe, get_msa_metrics, set_msa_mode

    setup = Setup(heads=8, groups=groups, index_heads=groups)
    model = build_model(setup, tp)
    set_msa_mode(model, mode)
    tokens, positions, packed = batch(0, "thd")
    rows = torch.arange(0, tokens.shape[1], 7)
    probe = arm_selection_probe(model, rows=rows)
    loss = model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean()
    loss.backward()
    armed = get_msa_metrics(reset=True)
    samples = {layer: (s.recall.clone(), s.block_idx.clone()) for layer, s in probe.samples.items()}
    # Disarmed after one forward: the next step reports no recall.
    model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean().backward()
    later = get_msa_metrics(reset=True)
    return {"armed": armed, "later": later, "samples": samples}


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_probe_reports_recall_equal_over_tp(mode):
    one = run_distributed(_probe_worker, 1, args=(1, mode), tp=1)[0]
    two = run_distributed(_probe_worker, 2, args=(2, mode), tp=2)
    keys = {"msa/recall/layer_01", "msa/recall/layer_02", "msa/recall"}
    keys |= {key.replace("msa/recall", "msa/recall_best") for key in keys}
    assert keys <= set(one["armed"])
    for key in ("msa/recall/layer_01", "msa/recall/layer_02", "msa/recall"):
        assert one["armed"][key] <= one["armed"][key.replace("recall", "recall_best")] + 1e-6
    assert not keys & set(one["later"])
    for key in keys:
        assert 0.0 < one["armed"][key] <= 1.0 + 1e-6
        for result in two:  # per-rank means over half the index heads, averaged over TP
            assert result["armed"][key] == pytest.approx(one["armed"][key], rel=1e-4, abs=1e-5)
    # Each TP rank measured its own index head: together they are the TP=1 sample.
    for layer, (recall, block_idx) in one["samples"].items():
        recall_tp = torch.cat([r["samples"][layer][0] for r in two], dim=1)
        sel_tp = torch.cat([r["samples"][layer][1] for r in two], dim=1)
        assert torch.equal(sel_tp, block_idx)
        torch.testing.assert_close(recall_tp, recall, rtol=1e-4, atol=1e-5)


def test_probe_with_a_shared_index_head():
    """TP=2 > Hkv=1: both ranks hold the one index head, each with half its query heads; the
    sampled rows' q are gathered over them, so every rank's samples are the TP=1 ones (the
    teacher is the mean over all the index head's query heads, not over the rank's own)."""
    one = run_distributed(_probe_worker, 1, args=(1, "sparse", 1), tp=1)[0]
    two = run_distributed(_probe_worker, 2, args=(2, "sparse", 1), tp=2)
    for result in two:
        assert result["armed"]["msa/recall"] == pytest.approx(one["armed"]["msa/recall"],
                                                              rel=1e-4, abs=1e-5)
        for layer, (recall, block_idx) in one["samples"].items():
            assert torch.equal(result["samples"][layer][1], block_idx)
            torch.testing.assert_close(result["samples"][layer][0], recall, rtol=1e-4,
                                       atol=1e-5)
