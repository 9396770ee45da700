"""Parallel layouts of the MSA layer: collectives and layout maths only (tensors move here, no
kernel runs here; nothing is imported from :mod:`msa_megatron.ops`).

- :mod:`.comm`: the collectives, each written once (with autograd where gradients cross ranks);
- :mod:`.groups`: :class:`ParallelGroups`, the process groups of one layer;
- :mod:`.tensor`: tensor parallelism, which rank holds which index head;
- :mod:`.cp_layout`: megatron-core's load-balanced context-parallel layout as index maths;
- :mod:`.context`: the context-parallel row exchanges (index keys, K/V) and their byte counts.

The composer that runs them in order is :func:`msa_megatron.core.msa_layer`.
"""

from .comm import (
    all_gather_first_dim,
    all_gather_rows,
    all_to_all_equal,
    gather_last_dim,
    heads_to_tokens,
    register_grad_sum,
    token_slices,
)
from .context import (
    KVExchange,
    cp_bytes_moved,
    cp_bytes_received,
    exchange_kv,
    gather_rows,
    resolve_cp_kv_exchange,
    start_kv_exchange,
)
from .cp_layout import build_cp_layout, sbhd_cu_seqlens, split_for_cp_rank
from .groups import NO_GROUPS, ParallelGroups
from .tensor import index_head_layout, share_group

__all__ = [
    "KVExchange",
    "NO_GROUPS",
    "ParallelGroups",
    "all_gather_first_dim",
    "all_gather_rows",
    "all_to_all_equal",
    "build_cp_layout",
    "cp_bytes_moved",
    "cp_bytes_received",
    "exchange_kv",
    "gather_last_dim",
    "gather_rows",
    "heads_to_tokens",
    "index_head_layout",
    "register_grad_sum",
    "resolve_cp_kv_exchange",
    "sbhd_cu_seqlens",
    "share_group",
    "split_for_cp_rank",
    "start_kv_exchange",
    "token_slices",
]
