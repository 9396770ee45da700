"""Padded THD without context parallelism: padding tokens are not part of the index-branch KL
(nor of the selection probe's recall).

megatron-core pads each packed sequence at its end (``cu_seqlens_q_padded`` next to the real
``cu_seqlens_q``). The MSA layer then computes the KL over real tokens only and normalises it by
the real token count, so a padded batch gives the KL metric and the index-branch gradients of the
same documents packed without padding (the index projections learn from the KL alone), and the
same LM losses on the real tokens. Checked at TP=1 and at TP=2 with one KV group (the two TP
ranks share the index head and split its KL).
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed, selected_device
from tests.support.inputs import make_cu_seqlens, padded_real_rows
from tests.support.gpt_harness import (VOCAB, Setup, build_model, full_grads, sum_qk_norm_grads,
                                      tolerance)

pytestmark = pytest.mark.slow

PADDED_LENGTHS = [40, 8, 80, 0, 64]
REAL_LENGTHS = [37, 5, 80, 0, 50]  # one block-aligned, one shorter than a block, one empty
TOL = tolerance(rtol=1e-5, atol=1e-7)


def _real_rows() -> torch.Tensor:
    return padded_real_rows(PADDED_LENGTHS, REAL_LENGTHS)


def _run(model, tokens: torch.Tensor, packed) -> dict:
    from msa_megatron.megatron import arm_selection_probe, get_msa_metrics

    device = selected_device()
    arm_selection_probe(model, num_rows=10_000)  # every row: the recall of all real tokens
    positions = torch.cat([torch.arange(n) for n in torch.diff(
        packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None
        else packed.cu_seqlens_q).tolist()])
    model.zero_grad(set_to_none=True)
    losses = model(tokens.view(1, -1).to(device), positions.view(1, -1).to(device), None,
                   labels=tokens.view(1, -1).to(device), packed_seq_params=packed)
    losses.sum().backward()
    sum_qk_norm_grads(model)  # megatron's finalize step: replicated index grads summed over TP
    metrics = get_msa_metrics(reset=True)
    grads = {n: g for n, g in full_grads(model).items() if "_idx" in n}
    return {"losses": losses.detach().view(-1).cpu(), "kl": metrics, "grads": grads}


def _worker(rank: int, world_size: int, groups: int) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    from msa_megatron.megatron import get_msa_metrics

    device = selected_device()
    model = build_model(Setup(groups=groups, formats=["thd"]), world_size)
    get_msa_metrics(reset=True)
    tokens = torch.randint(0, VOCAB, (sum(PADDED_LENGTHS),),
                           generator=torch.Generator().manual_seed(3))
    padded_cu = make_cu_seqlens(PADDED_LENGTHS, device)
    real_cu = make_cu_seqlens(REAL_LENGTHS, device)
    padded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real_cu, cu_seqlens_kv=real_cu,
                             cu_seqlens_q_padded=padded_cu, cu_seqlens_kv_padded=padded_cu,
                             max_seqlen_q=max(PADDED_LENGTHS), max_seqlen_kv=max(PADDED_LENGTHS))
    unpadded = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real_cu, cu_seqlens_kv=real_cu,
                               max_seqlen_q=max(REAL_LENGTHS), max_seqlen_kv=max(REAL_LENGTHS))
    return {"padded": _run(model, tokens, padded),
            "unpadded": _run(model, tokens[_real_rows()], unpadded)}


@pytest.mark.parametrize("tp,groups", [(1, 2), (2, 1)], ids=["tp1", "tp2-shared-index-head"])
def test_padding_tokens_do_not_count_in_the_kl(tp, groups):
    for result in run_distributed(_worker, tp, args=(groups,), tp=tp):
        padded, unpadded = result["padded"], result["unpadded"]
        torch.testing.assert_close(padded["losses"][_real_rows()], unpadded["losses"], **TOL)
        assert padded["kl"].keys() == unpadded["kl"].keys() and unpadded["kl"]["msa/kl"] > 0
        assert 0 < unpadded["kl"]["msa/recall"] < 1  # padding rows are out of the recall too
        for key, value in unpadded["kl"].items():
            torch.testing.assert_close(torch.tensor(padded["kl"][key]), torch.tensor(value),
                                       **TOL, msg=key)
        assert padded["grads"].keys() == unpadded["grads"].keys() and unpadded["grads"]
        for name, grad in unpadded["grads"].items():
            assert grad.abs().max() > 0, f"{name} got no KL gradient"
            torch.testing.assert_close(padded["grads"][name], grad, **TOL, msg=name)
