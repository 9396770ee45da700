"""The MSA core attention's context-parallel call site: CP=2 ranks holding megatron-core's
load-balanced halves of an SBHD batch give the outputs, KL and gradients of one rank holding it
all (the CP exchange itself is tested in tests/parallel); the K/V exchange follows
``MSAConfig.cp_kv_exchange``, ``allgather`` when it is None whatever megatron-core's
``cp_comm_type``."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed, selected_device
from tests.support.devices import tolerance

pytestmark = pytest.mark.slow

SEQ, BATCH, HEADS, GROUPS, DIM, INDEX_DIM = 128, 2, 4, 2, 16, 16


def _core(cp_group, cp_kv_exchange=None, cp_comm_type=None):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import MSACoreAttention
    from msa_megatron.megatron.attention import build_head_layout
    from msa_megatron.parallel.groups import ParallelGroups

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, kv_channels=DIM, attention_dropout=0.0,
                               use_cpu_initialization=True)
    msa = MSAConfig(block_size=16, top_k=3, index_head_dim=INDEX_DIM, backend="torch",
                    cp_kv_exchange=cp_kv_exchange)
    core = MSACoreAttention(config, 1, AttnMaskType.causal, cp_comm_type=cp_comm_type,
                            pg_collection=ProcessGroupCollection(tp=None, cp=cp_group))
    core.bind(msa, build_head_layout(config, msa, 1, 0), 1, ParallelGroups(cp=cp_group),
              tp_size=1)
    return core


def _inputs():
    gen = torch.Generator().manual_seed(5)
    shapes = {"q": HEADS, "k": GROUPS, "v": GROUPS, "q_idx": GROUPS, "k_idx": 1}
    return {name: torch.randn(SEQ, BATCH, heads, INDEX_DIM if "idx" in name else DIM,
                              generator=gen, dtype=torch.float64)
            for name, heads in shapes.items()}


def _local_half(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=0)


def _run(core, tensors: dict, out_weights: torch.Tensor) -> dict:
    """Forward + backward of one core; a collective (the KL metric is reduced over the world)."""
    from msa_megatron.megatron import get_msa_metrics

    device = selected_device()
    leaves = {n: t.detach().to(device).requires_grad_() for n, t in tensors.items()}
    out = core(leaves["q"], leaves["k"], leaves["v"], None, q_idx=leaves["q_idx"],
               k_idx=leaves["k_idx"])
    # The KL rides on the output's backward (coefficient 1): one backward trains both branches.
    (out * out_weights.to(device)).sum().backward()
    kl = torch.tensor(get_msa_metrics(reset=True)["msa/kl/layer_01"], dtype=torch.float64)
    return {"out": out.detach().cpu(), "kl": kl,
            **{f"grad_{n}": t.grad.cpu() for n, t in leaves.items()}}


def _cp_worker(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state

    tensors = _inputs()
    out_weights = torch.linspace(-1, 1, SEQ * BATCH * HEADS * DIM, dtype=torch.float64)
    out_weights = out_weights.view(SEQ, BATCH, HEADS * DIM)
    reference = _run(_core(None), tensors, out_weights)
    cp = parallel_state.get_context_parallel_world_size()
    local = {n: _local_half(t, cp, rank) for n, t in tensors.items()}
    result = _run(_core(parallel_state.get_context_parallel_group()), local,
                  _local_half(out_weights, cp, rank))
    return {"reference": reference, "result": result, "rank": rank, "cp": cp}


def test_context_parallel_core_matches_single_rank():
    for res in run_distributed(_cp_worker, 2, tp=1, cp=2):
        ref, got = res["reference"], res["result"]
        # the KL is an fp32 scalar (MSA_SPEC section 4) even for fp64 inputs
        torch.testing.assert_close(got["kl"], ref["kl"], **tolerance(rtol=1e-6, atol=1e-9))
        for name in ("out", "grad_q", "grad_k", "grad_v", "grad_q_idx", "grad_k_idx"):
            expected = _local_half(ref[name], res["cp"], res["rank"])
            torch.testing.assert_close(got[name], expected, **tolerance(rtol=1e-9, atol=1e-11),
                                       msg=name)


# (MSAConfig.cp_kv_exchange, megatron cp_comm_type of the layer, K/V exchange the layer uses)
EXCHANGE_CASES = [
    (None, "p2p", "allgather"),  # megatron's default: allgather, the faster mode measured
    (None, "all_gather", "allgather"),
    (None, "a2a", "allgather"),  # head-scattering types MSA does not implement
    (None, None, "allgather"),
    ("selective", "p2p", "selective"),  # an explicit choice wins
    ("selective", "all_gather", "selective"),
    ("allgather", "p2p", "allgather"),
]


def _exchange_worker(rank: int, world_size: int) -> list:
    from megatron.core import parallel_state

    from unittest import mock

    from msa_megatron.megatron import get_msa_metrics
    from msa_megatron.parallel import context

    cp = parallel_state.get_context_parallel_world_size()
    device = selected_device()  # NCCL exchanges device tensors only
    local = {n: _local_half(t, cp, rank).to(device) for n, t in _inputs().items()}
    used = []
    for cp_kv_exchange, cp_comm_type, _ in EXCHANGE_CASES:
        core = _core(parallel_state.get_context_parallel_group(), cp_kv_exchange, cp_comm_type)
        # only the selective exchange plans which blocks to send
        with torch.no_grad(), mock.patch.object(context, "build_selective_plan",
                                                wraps=context.build_selective_plan) as plan:
            core(local["q"], local["k"], local["v"], None, q_idx=local["q_idx"],
                 k_idx=local["k_idx"])
        used.append("selective" if plan.called else "allgather")
        get_msa_metrics(reset=True)
    return used


def test_kv_exchange_from_config_not_cp_comm_type():
    from msa_megatron import MSAConfig

    assert MSAConfig().cp_kv_exchange is None
    expected = [case[-1] for case in EXCHANGE_CASES]
    for used in run_distributed(_exchange_worker, 2, tp=1, cp=2):
        assert used == expected


THD_LENGTHS = [72, 0, 136, 40]  # multiples of 2*CP (8), documents crossing chunk boundaries


def _split_worker(rank: int, world_size: int) -> bool:
    """Our THD split equals megatron-core's get_batch_on_this_cp_rank applied per sequence."""
    from megatron.core import parallel_state
    from msa_megatron.megatron.compat import get_batch_on_this_cp_rank

    from msa_megatron.parallel.cp_layout import split_for_cp_rank

    cp_group = parallel_state.get_context_parallel_group()
    cu = torch.tensor([0] + THD_LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    tokens = torch.arange(int(cu[-1]))
    ours = split_for_cp_rank(tokens, cu, world_size, rank)
    bounds = cu.tolist()
    theirs = [get_batch_on_this_cp_rank({"tokens": tokens[a:b].view(1, -1)}, cp_group=cp_group)
              ["tokens"].view(-1) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return bool(torch.equal(ours, torch.cat(theirs)))


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_split_matches_megatron(cp):
    assert all(run_distributed(_split_worker, cp, tp=1, cp=cp))
