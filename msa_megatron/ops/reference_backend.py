"""``backend="reference"``: the oracle of :mod:`msa_megatron.reference` behind the core interface."""

from __future__ import annotations

from ..reference import attention_core_reference, kl_core_reference, select_core_reference

import torch


def select(q_idx, k_idx, q_pos, q_kbase, **options):
    with torch.no_grad():
        return select_core_reference(q_idx.detach(), k_idx.detach(), q_pos, q_kbase, **options)


def attention(q, k, v, block_idx, q_pos, q_kbase, *, block_size, softmax_scale=None,
              index_heads=None):
    out, lse = attention_core_reference(q, k, v, block_idx, q_pos, q_kbase, block_size=block_size,
                                        softmax_scale=softmax_scale, index_heads=index_heads)
    return out, lse.detach().float()


def kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, *, block_size, softmax_scale=None,
       index_scale=None, kl_scale=1.0):
    del lse  # the oracle recomputes the teacher from q and k
    return kl_core_reference(q, k, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=block_size,
                             softmax_scale=softmax_scale, index_scale=index_scale,
                             kl_scale=kl_scale).to(torch.float32)
