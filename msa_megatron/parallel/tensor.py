"""Tensor parallelism (TP) for MSA: who holds which index head (MSA_SPEC section 6).

Query heads, KV groups and index query heads are split over the TP group so that a rank owns
whole index heads. Two layouts follow from ``Hi`` (index heads of the layer) and the TP size:

- ``Hi % TP == 0``: rank ``r`` owns index heads ``[r*Hi/TP, (r+1)*Hi/TP)``, exactly the index
  heads of its query heads. Selection, attention and KL run locally; nothing is exchanged.
- ``TP % Hi == 0`` with ``Hi < TP`` (e.g. the paper's 64 query / 4 KV / 4 index heads at TP 8):
  ``share = TP / Hi`` consecutive ranks hold the query heads of one index head. They form a
  *share group* (:func:`share_group`). The composer (:func:`msa_megatron.core.msa_layer`)
  then splits the selection over the share ranks by token slice
  (:func:`~msa_megatron.parallel.comm.all_gather_rows`) and exchanges q and the LSE
  head <-> token (:func:`~msa_megatron.parallel.comm.heads_to_tokens`) so the KL teacher is
  exact.

Only layout maths and group construction here; the collectives are in :mod:`.comm`.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

_SHARE_GROUPS: Dict[Tuple[int, ...], ProcessGroup] = {}


def index_head_layout(num_index_heads: int, tp_size: int, tp_rank: int) -> Tuple[int, int, int]:
    """Index heads held by one TP rank (MSA_SPEC section 6).

    Args:
        num_index_heads: Hi of the whole layer.
        tp_size, tp_rank: the TP group.

    Returns:
        ``(first, count, share)``: the rank holds index heads ``[first, first + count)``;
        ``share`` ranks hold each of them (1 unless ``Hi < TP``).

    Raises:
        ValueError: neither ``Hi % TP == 0`` nor ``TP % Hi == 0``.
    """
    if num_index_heads % tp_size == 0:
        count = num_index_heads // tp_size
        return tp_rank * count, count, 1
    if tp_size % num_index_heads == 0:
        share = tp_size // num_index_heads
        return tp_rank // share, 1, share
    raise ValueError(
        f"index heads Hi={num_index_heads} and the tensor-parallel size {tp_size} must divide "
        "one another (a rank owns whole index heads, or TP/Hi ranks share one)"
    )


def share_group(tp_group: ProcessGroup, share: int) -> Optional[ProcessGroup]:
    """The process group of the ``share`` consecutive TP ranks holding this rank's index head.

    Built once per (TP group, share) and cached. Only the member ranks take part in creating it
    (``use_local_synchronization``), so pipeline stages may build layers in any order.

    Returns:
        None when ``share == 1``.
    """
    if share == 1:
        return None
    tp_ranks = dist.get_process_group_ranks(tp_group)
    first = (dist.get_rank(tp_group) // share) * share
    members = tuple(tp_ranks[first:first + share])
    if members not in _SHARE_GROUPS:
        _SHARE_GROUPS[members] = dist.new_group(list(members), use_local_synchronization=True)
    return _SHARE_GROUPS[members]
