"""The TP > Hkv exchange at the op level: ranks sharing an index head (each with some of its query
heads) select once between them and compute the exact KL teacher, for token counts that do not
split evenly (padded gathers, an empty slice) and packed sequences, in sparse and dense mode.
No megatron-core: plain gloo ranks calling the composer with a ``tp_share`` group."""

from __future__ import annotations

import pytest
import torch

from msa_megatron.core import MSAOptions, msa_layer
from msa_megatron.parallel.groups import ParallelGroups
from msa_megatron.parallel.tensor import share_group
from tests.dist_utils import run_distributed, selected_device
from tests.support.devices import tolerance
from tests.support.spies import count_selections

pytestmark = pytest.mark.slow

HEADS, DIM = 4, 16  # query heads of the one index head / KV group
OPTIONS = dict(block_size=16, top_k=3, init_blocks=1, local_blocks=1, softmax_scale=None,
               index_scale=None, backend="torch")


def _inputs(total: int):
    gen = torch.Generator().manual_seed(total)
    heads = {"q": HEADS, "k": 1, "v": 1, "q_idx": 1, "k_idx": 1}
    return {name: torch.randn(total, h, DIM, generator=gen, dtype=torch.float64)
            for name, h in heads.items()}


def _run(tensors, lengths, mode, out_weights, groups=ParallelGroups()):
    device = selected_device()
    leaves = {n: t.detach().to(device).requires_grad_() for n, t in tensors.items()}
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    with count_selections(OPTIONS["backend"]) as counts:
        result = msa_layer(leaves["q"], leaves["k"], leaves["v"], leaves["q_idx"],
                           leaves["k_idx"], options=MSAOptions(mode=mode, **OPTIONS),
                           cu_seqlens=cu, groups=groups,
                           kl_scale=1.0 / max(leaves["q"].shape[0], 1))
    ((result.out * out_weights.to(device)).sum() + result.kl).backward()
    block_idx = result.block_idx
    return {"out": result.out.detach().cpu(), "kl": result.kl.detach().cpu(),
            "rows": counts["rows"], "block_idx": None if block_idx is None else block_idx.cpu(),
            **{f"grad_{n}": t.grad.cpu() for n, t in leaves.items()}}


def _worker(rank: int, world_size: int, lengths: list, mode: str) -> dict:
    import torch.distributed as dist

    tensors = _inputs(sum(lengths))
    weights = torch.linspace(-1, 1, tensors["q"].numel(), dtype=torch.float64)
    weights = weights.view_as(tensors["q"])
    reference = _run(tensors, lengths, mode, weights)
    heads = HEADS // world_size
    own = slice(rank * heads, (rank + 1) * heads)
    mine = dict(tensors, q=tensors["q"][:, own])
    group = share_group(dist.group.WORLD, world_size)
    result = _run(mine, lengths, mode, weights[:, own], ParallelGroups(tp_share=group))
    for name in ("kl", "grad_q_idx", "grad_k_idx"):  # partial on each rank: summed by the layer
        partial = result[name].to(selected_device())  # NCCL reduces device tensors only
        dist.all_reduce(partial)
        result[name] = partial.cpu()
    return {"reference": reference, "result": result, "heads": heads}


@pytest.mark.parametrize("lengths, mode", [
    ([21, 0, 40, 6], "sparse"),  # uneven slices, packed docs, an empty doc
    ([3], "sparse"),             # shorter than a block
    ([1], "sparse"),             # one rank's token slice is empty
    ([50, 17], "dense"),
])
def test_shared_index_head_matches_one_rank(lengths, mode):
    world = 2
    results = run_distributed(_worker, world, args=(lengths, mode))
    total_rows = sum(r["result"]["rows"] for r in results)
    assert total_rows == results[0]["reference"]["rows"]  # selection split, never repeated
    for rank, res in enumerate(results):
        ref, got, heads = res["reference"], res["result"], res["heads"]
        if mode == "sparse":
            assert torch.equal(got["block_idx"], ref["block_idx"])
        else:
            assert got["block_idx"] is None and got["rows"] == 0
        own = slice(rank * heads, (rank + 1) * heads)
        torch.testing.assert_close(got["out"], ref["out"][:, own], **tolerance(1e-10, 1e-12))
        torch.testing.assert_close(got["grad_q"], ref["grad_q"][:, own], **tolerance(1e-9, 1e-11))
        torch.testing.assert_close(got["kl"], ref["kl"], **tolerance(1e-6, 1e-9))  # fp32 KL
        for name in ("grad_q_idx", "grad_k_idx"):
            torch.testing.assert_close(got[name], ref[name], **tolerance(1e-9, 1e-11), msg=name)


def test_shared_index_head_rejects_several_index_heads():
    """With a share group the rank holds one index head (checked before any collective)."""
    results = run_distributed(_several_heads_worker, 2)
    assert all(results)


def _several_heads_worker(rank: int, world_size: int) -> bool:
    import torch.distributed as dist

    x = {n: torch.randn(8, 2 if n != "k_idx" else 1, 16) for n in ("q", "k", "v", "q_idx",
                                                                    "k_idx")}
    groups = ParallelGroups(tp_share=share_group(dist.group.WORLD, world_size))
    try:
        msa_layer(*x.values(), options=MSAOptions(**OPTIONS), kl_scale=1.0, groups=groups)
    except ValueError as error:
        return "one index head" in str(error)
    return False
