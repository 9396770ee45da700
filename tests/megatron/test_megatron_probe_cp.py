"""The selection probe under context parallelism (issue 16): each CP rank measures its own rows
against the keys of the whole micro-batch (gathered over CP), so CP=2 gives the CP=1 recall of
the same rows, in packed THD with several sequences."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from msa_megatron.parallel.cp_layout import build_cp_layout, split_for_cp_rank
from tests.dist_utils import run_distributed, selected_device
from tests.support.inputs import make_cu_seqlens, padded_real_rows

pytestmark = pytest.mark.slow

LENGTHS = [64, 32, 96]  # each divisible by 2 * CP
OPTIONS = dict(block_size=16, top_k=2, init_blocks=0, local_blocks=1, softmax_scale=None,
               index_scale=None, backend="torch")


def _inputs():
    gen = torch.Generator().manual_seed(11)
    total = sum(LENGTHS)
    cu = torch.tensor([0] + LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = torch.randn(total, 4, 16, generator=gen)
    k = torch.randn(total, 2, 16, generator=gen)
    q_idx = torch.randn(total, 2, 16, generator=gen)
    k_idx = torch.randn(total, 1, 16, generator=gen)
    return cu, q, k, q_idx, k_idx


def _probe_worker(rank: int, world_size: int) -> dict:
    from msa_megatron.megatron import SelectionProbe, get_msa_metrics

    cu, q, k, q_idx, k_idx = (t.to(selected_device()) for t in _inputs())
    group = dist.group.WORLD if world_size > 1 else None
    if world_size > 1:
        q, k, q_idx, k_idx = (split_for_cp_rank(t, cu, world_size, rank)
                              for t in (q, k, q_idx, k_idx))
    probe = SelectionProbe(rows=torch.arange(q.shape[0], device=q.device))
    sample = probe.observe(1, q, k, q_idx, k_idx, cu, cp_group=group, **OPTIONS)
    global_rows = build_cp_layout(cu, world_size, rank, 16, q.device).local_rows
    return {"recall": sample.recall, "block_idx": sample.block_idx, "q_pos": sample.q_pos,
            "global_rows": global_rows, "metrics": get_msa_metrics(reset=True)}


def test_probe_under_cp_matches_cp1():
    one = run_distributed(_probe_worker, 1)[0]
    two = run_distributed(_probe_worker, 2)
    assert 0.0 < one["metrics"]["msa/recall"] < 1.0  # the selection leaves mass out
    covered = torch.cat([r["global_rows"] for r in two])
    assert torch.equal(covered.sort().values, torch.arange(sum(LENGTHS)))
    for result in two:
        rows = result["global_rows"]
        torch.testing.assert_close(result["recall"], one["recall"][rows], rtol=1e-5, atol=1e-6)
        assert torch.equal(result["block_idx"], one["block_idx"][rows])
        assert torch.equal(result["q_pos"], one["q_pos"][rows])
        # equal row counts per rank: the mean over ranks is the CP=1 mean
        assert result["metrics"]["msa/recall"] == pytest.approx(one["metrics"]["msa/recall"],
                                                                rel=1e-5)


PADDED = [64, 32, 96]  # the padded lengths (divisible by 2 * CP) ...
REAL = [50, 0, 81]  # ... and the real ones: padding rows at each sequence's end, one all padding


def _padded_probe_worker(rank: int, world_size: int) -> dict:
    from msa_megatron.megatron import SelectionProbe, get_msa_metrics

    device = selected_device()
    _, q, k, q_idx, k_idx = (t.to(device) for t in _inputs())
    cu, cu_real = make_cu_seqlens(PADDED, device), make_cu_seqlens(REAL, device)
    group = dist.group.WORLD if world_size > 1 else None
    if world_size > 1:
        q, k, q_idx, k_idx = (split_for_cp_rank(t, cu, world_size, rank)
                              for t in (q, k, q_idx, k_idx))
    global_rows = build_cp_layout(cu, world_size, rank, 16, q.device).local_rows
    sample = SelectionProbe(num_rows=10_000).observe(
        1, q, k, q_idx, k_idx, cu, cp_group=group, cu_seqlens_real=cu_real, **OPTIONS)
    return {"rows": global_rows[sample.rows.cpu()], "recall": sample.recall,
            "metrics": get_msa_metrics(reset=True)}


def test_probe_samples_real_tokens_of_padded_thd():
    """Padded THD: the probe's own sample holds only real tokens (padding rows are out of the
    KL, so they are out of the recall too; they used to count), under CP 1 and 2, and each
    rank's recall of a row is the CP=1 one (adversarial check 2026-12-07 s23)."""
    real = padded_real_rows(PADDED, REAL)
    one = run_distributed(_padded_probe_worker, 1)[0]
    assert torch.equal(one["rows"], real)
    two = run_distributed(_padded_probe_worker, 2)
    assert torch.equal(torch.cat([r["rows"] for r in two]).sort().values, real)
    by_row = dict(zip(one["rows"].tolist(), one["recall"]))
    for result in two:
        for row, recall in zip(result["rows"].tolist(), result["recall"]):
            torch.testing.assert_close(recall, by_row[row], rtol=1e-5, atol=1e-6)
        assert 0.0 < result["metrics"]["msa/recall"] <= 1.0 + 1e-6


def test_probe_of_a_rank_with_only_padding_records_nothing():
    from msa_megatron.megatron import SelectionProbe, get_msa_metrics

    _, q, k, q_idx, k_idx = _inputs()
    cu = torch.tensor([0, 64], dtype=torch.int32)
    sample = SelectionProbe().observe(1, q[:64], k[:64], q_idx[:64], k_idx[:64], cu,
                                      cu_seqlens_real=torch.tensor([0, 0], dtype=torch.int32),
                                      **OPTIONS)
    assert sample.rows.numel() == 0 and sample.recall.numel() == 0
    assert "msa/recall" not in get_msa_metrics(reset=True)
