"""Parallel layouts of the MSA core: tensor parallelism (:mod:`.tensor`) and context
parallelism (:mod:`.context`). Plain ``torch.distributed``; never imports Triton or Megatron."""

from .context import (
    context_parallel_msa_attention,
    cp_bytes_moved,
    cp_bytes_received,
    resolve_cp_kv_exchange,
)
from .cp_layout import build_cp_layout, sbhd_cu_seqlens, split_for_cp_rank
from .tensor import (
    all_gather_rows,
    gather_last_dim,
    index_head_layout,
    local_msa_attention,
    real_token_rows,
    share_group,
    shared_index_msa_attention,
    sum_grad_over_group,
)

__all__ = [
    "all_gather_rows",
    "build_cp_layout",
    "context_parallel_msa_attention",
    "cp_bytes_moved",
    "cp_bytes_received",
    "resolve_cp_kv_exchange",
    "sbhd_cu_seqlens",
    "split_for_cp_rank",
    "gather_last_dim",
    "index_head_layout",
    "local_msa_attention",
    "real_token_rows",
    "share_group",
    "shared_index_msa_attention",
    "sum_grad_over_group",
]
