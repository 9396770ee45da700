"""The collectives of :mod:`msa_megatron.parallel.comm` on real gloo ranks (no megatron-core):
uneven row gathers, the head <-> token exchange (native all-to-all and the all-gather fallback
for backends without one), the differentiable last-dim gather and the gradient-sum hook."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from msa_megatron.parallel import comm
from tests.dist_utils import run_distributed, selected_device
from tests.support.devices import skip_without_gpus

WORLD = 3  # odd, so token slices are uneven


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL (``MSA_TEST_DEVICE=cuda``), else the CPU."""
    if selected_device() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(total: int, heads: int) -> torch.Tensor:
    """``[total, heads, 2]`` with entries naming (token, head): the same on every rank."""
    t = torch.arange(total, dtype=torch.float64)[:, None, None]
    h = torch.arange(heads, dtype=torch.float64)[None, :, None]
    return torch.cat([t.expand(total, heads, 1), h.expand(total, heads, 1)], dim=2).to(_device())


def _heads_to_tokens_worker(rank: int, world_size: int, total: int) -> dict:
    group = dist.group.WORLD
    full = _global(total, 2 * world_size)
    mine = full[:, 2 * rank:2 * rank + 2].contiguous()  # this rank's 2 heads, all tokens
    slices = comm.token_slices(total, world_size)
    start, end = slices[rank]
    out = {"want": full[start:end].cpu()}
    comm._ALL_TO_ALL_SUPPORTED.clear()
    out["native"] = comm.heads_to_tokens(mine, slices, group).cpu()
    out["native_supported"] = dict(comm._ALL_TO_ALL_SUPPORTED)
    # A backend without the list all-to-all (gloo of torch 2.11): the fallback is used, and
    # remembered for the next call.
    comm._ALL_TO_ALL_SUPPORTED.clear()
    missing = RuntimeError("Backend gloo does not support alltoall")
    with mock.patch.object(dist, "all_to_all", side_effect=missing) as native:
        out["fallback"] = comm.heads_to_tokens(mine, slices, group).cpu()
        out["fallback_again"] = comm.heads_to_tokens(mine, slices, group).cpu()
        out["native_calls"] = native.call_count
    out["fallback_supported"] = dict(comm._ALL_TO_ALL_SUPPORTED)
    # Any other error is not mistaken for a missing collective.
    comm._ALL_TO_ALL_SUPPORTED.clear()
    with mock.patch.object(dist, "all_to_all", side_effect=RuntimeError("connection reset")):
        try:
            comm.heads_to_tokens(mine, slices, group)
            out["other_error_raised"] = False
        except RuntimeError:
            out["other_error_raised"] = True
    comm._ALL_TO_ALL_SUPPORTED.clear()
    return out


@pytest.mark.parametrize("total", [7, 2, 0])
def test_heads_to_tokens_native_and_fallback(total):
    """7 tokens over 3 ranks: slices 3, 3, 1; 2 tokens: one empty slice; 0 tokens: all empty."""
    skip_without_gpus(WORLD)
    for res in run_distributed(_heads_to_tokens_worker, WORLD, args=(total,)):
        assert torch.equal(res["native"], res["want"])
        assert torch.equal(res["fallback"], res["want"])
        assert torch.equal(res["fallback_again"], res["want"])
        assert res["native_calls"] == 1  # tried once, then the fallback is remembered
        assert list(res["fallback_supported"].values()) == [False]
        assert list(res["native_supported"].values()) in ([True], [False])
        assert res["other_error_raised"]


def _gather_worker(rank: int, world_size: int) -> dict:
    group, device = dist.group.WORLD, _device()
    slices = comm.token_slices(8, world_size)  # 3, 3, 2
    start, end = slices[rank]
    rows = comm.all_gather_rows(torch.arange(start, end, dtype=torch.int32, device=device),
                                slices, group)
    first = comm.all_gather_first_dim(torch.full((2, 1), float(rank), device=device), group)
    # gather_last_dim: every rank uses the whole gathered tensor; each gets the summed gradient
    # of its own slice.
    x = torch.full((2, 3), float(rank + 1), device=device, requires_grad=True)
    gathered = comm.gather_last_dim(x, group)
    weights = torch.arange(gathered.numel(), dtype=torch.float32,
                           device=device).view_as(gathered)
    (gathered * weights * (rank + 1)).sum().backward()
    # register_grad_sum: a replicated tensor gets the gradient summed over the ranks.
    w = torch.ones(2, device=device, requires_grad=True)
    comm.register_grad_sum(w, group)
    (w * (rank + 1)).sum().backward()
    return {"rows": rows, "first": first, "gathered": gathered.detach(), "x_grad": x.grad,
            "w_grad": w.grad, "weights": weights}


def test_gathers_and_gradient_sums():
    skip_without_gpus(WORLD)
    results = run_distributed(_gather_worker, WORLD)
    ranks_total = sum(r + 1 for r in range(WORLD))
    for rank, res in enumerate(results):
        assert res["rows"].tolist() == list(range(8))
        assert res["first"].flatten().tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        row = sum(([float(r + 1)] * 3 for r in range(WORLD)), [])  # rank order, last dim
        assert res["gathered"].tolist() == [row, row]
        own = res["weights"][:, 3 * rank:3 * rank + 3]
        torch.testing.assert_close(res["x_grad"], own * ranks_total)
        assert res["w_grad"].tolist() == [float(ranks_total)] * 2


def test_token_slices():
    assert comm.token_slices(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert comm.token_slices(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert comm.token_slices(0, 2) == [(0, 0), (0, 0)]
    assert comm.token_slices(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert comm.token_slices(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_single_rank_helpers_are_identities():
    x = torch.randn(4, 2)
    assert comm.gather_last_dim(x, None) is x
    assert comm.all_gather_first_dim(x, None) is x
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
