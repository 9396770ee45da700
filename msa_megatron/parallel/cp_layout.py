"""megatron-core's load-balanced context-parallel (CP) layout, as index maths (MSA_SPEC section 6).

Each packed sequence of global (padded) length ``L`` is cut into ``2*CP`` chunks of ``L/(2*CP)``
tokens; CP rank ``r`` holds chunks ``r`` and ``2*CP-1-r``. A rank's local THD tensor is, for every
sequence in order, its two chunks concatenated (megatron-core ``get_batch_on_this_cp_rank`` for
SBHD, Transformer Engine ``thd_get_partitioned_indices`` for THD). SBHD with ``b`` samples of
length ``S`` is the THD case with ``b`` sequences of length ``S`` once the caller has flattened
``[s, b, h, d]`` to ``[b*s, h, d]`` (see :func:`sbhd_cu_seqlens`).

A "global row" is the row of a token in the un-split packed sequence (THD order, all ranks);
a "local row" is its row on the rank that holds it. Block numbers follow MSA_SPEC section 2
(per sequence, from its start); a "global block id" numbers all blocks of all sequences in order.
No communication happens here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class CPLayout:
    """Where every token of a CP-split packed micro-batch lives.

    Attributes:
        cp_size, cp_rank: CP world size and this rank.
        block_size: B.
        total_global: T_global, tokens of the whole packed micro-batch (padded lengths).
        total_local: T_local = T_global / cp_size.
        row_owner: ``[T_global]`` int64, CP rank holding each global row.
        row_local: ``[T_global]`` int64, the row's local row on its owner.
        rank_rows: ``[cp_size, T_local]`` int64, global row of every rank's local rows.
        gathered_to_global: ``[T_global]`` int64, for each global row its position in a rank-major
            all-gather buffer (``owner * T_local + local``).
        row_block: ``[T_global]`` int64, global block id of each global row.
        num_blocks: total number of blocks over all sequences.
        block_seq: ``[num_blocks]`` int64, sequence index of each global block.
        block_first_id: ``[n]`` int64, global block id of block 0 of each sequence.
        q_pos: ``[T_local]`` int32, position of this rank's tokens in their sequence.
        q_kbase: ``[T_local]`` int32, global row of their sequence's start.
        q_seq: ``[T_local]`` int64, sequence index of this rank's tokens.
    """

    cp_size: int
    cp_rank: int
    block_size: int
    total_global: int
    total_local: int
    row_owner: torch.Tensor
    row_local: torch.Tensor
    rank_rows: torch.Tensor
    gathered_to_global: torch.Tensor
    row_block: torch.Tensor
    num_blocks: int
    block_seq: torch.Tensor
    block_first_id: torch.Tensor
    q_pos: torch.Tensor
    q_kbase: torch.Tensor
    q_seq: torch.Tensor

    @property
    def local_rows(self) -> torch.Tensor:
        """``[T_local]`` int64 global rows of this rank's tokens, in local order."""
        return self.rank_rows[self.cp_rank]


def check_cp_cu_seqlens(
    cu_seqlens_global: torch.Tensor, cp_size: int, total_local: Optional[int] = None
) -> list:
    """Validate global packed boundaries for CP and return them as a Python list.

    ``total_local`` (the rank's T_local), when given, must equal ``cu_seqlens_global[-1] / CP``.

    Raises:
        TypeError: not an int32 tensor.
        ValueError: not 1-D, first != 0, decreasing, a sequence length not divisible by
            ``2*cp_size``, or ``cu_seqlens_global[-1] != cp_size * total_local``.
    """
    if not isinstance(cu_seqlens_global, torch.Tensor):
        raise TypeError(
            f"cu_seqlens_global must be a torch.Tensor, got {type(cu_seqlens_global).__name__}"
        )
    if cu_seqlens_global.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_global must be int32, got {cu_seqlens_global.dtype}")
    if cu_seqlens_global.dim() != 1 or cu_seqlens_global.numel() < 1:
        raise ValueError(f"cu_seqlens_global must be 1-D with >= 1 entry, got shape "
                         f"{list(cu_seqlens_global.shape)}")
    host = cu_seqlens_global.tolist()
    if host[0] != 0:
        raise ValueError(f"cu_seqlens_global[0] must be 0, got {host[0]}")
    for a, b in zip(host[:-1], host[1:]):
        if b < a:
            raise ValueError(f"cu_seqlens_global must be non-decreasing, got {host}")
        if (b - a) % (2 * cp_size):
            raise ValueError(
                f"every global sequence length must be a multiple of 2*CP={2 * cp_size} "
                f"(megatron-core pads THD sequences for CP), got cu_seqlens_global={host}"
            )
    if total_local is not None and host[-1] != cp_size * total_local:
        raise ValueError(
            f"cu_seqlens_global[-1]={host[-1]} must equal CP * T_local = {cp_size} * {total_local}"
        )
    return host


def build_cp_layout(
    cu_seqlens_global: torch.Tensor, cp_size: int, cp_rank: int, block_size: int,
    device: torch.device, total_local: Optional[int] = None,
) -> CPLayout:
    """Index maps of megatron-core's load-balanced CP layout.

    Args:
        cu_seqlens_global: ``[n+1]`` int32 boundaries of the full (un-split, padded) sequences;
            every length divisible by ``2*cp_size``.
        cp_size, cp_rank: CP world size and rank.
        block_size: B.
        device: device of the index tensors.
        total_local: T_local of the rank's tensors, checked against the boundaries (None:
            derived from them).

    Raises:
        ValueError / TypeError: see :func:`check_cp_cu_seqlens`.
    """
    starts_host = check_cp_cu_seqlens(cu_seqlens_global, cp_size, total_local)
    total_global = starts_host[-1]
    total_local = total_global // cp_size
    i64 = dict(device=device, dtype=torch.int64)
    starts = torch.tensor(starts_host, **i64)
    lengths = starts[1:] - starts[:-1]
    rows = torch.arange(total_global, **i64)
    # The last sequence whose start is <= the row (zero-length sequences hold no row); starts[0]
    # is 0, so that is (number of starts <= row) - 1. The whole tensor, never a slice, goes to
    # searchsorted (inductor's GPU lowering fails on a slice view: see layout.query_layout).
    seq = torch.searchsorted(starts, rows, right=True) - 1
    pos = rows - starts[seq]
    chunk_len = lengths[seq] // (2 * cp_size)
    chunk = pos // chunk_len.clamp(min=1)
    within = pos - chunk * chunk_len
    first_half = chunk < cp_size
    row_owner = torch.where(first_half, chunk, 2 * cp_size - 1 - chunk)
    local_seq_start = starts[seq] // cp_size
    row_local = local_seq_start + torch.where(first_half, within, chunk_len + within)
    gathered_to_global = row_owner * total_local + row_local
    rank_rows = torch.empty(cp_size * total_local, **i64)
    rank_rows[gathered_to_global] = rows
    rank_rows = rank_rows.view(cp_size, total_local)

    blocks_per_seq = (lengths + block_size - 1) // block_size
    block_first_id = torch.cumsum(blocks_per_seq, 0) - blocks_per_seq
    num_blocks = int(blocks_per_seq.sum().item()) if blocks_per_seq.numel() else 0
    row_block = block_first_id[seq] + pos // block_size
    block_seq = torch.repeat_interleave(torch.arange(lengths.numel(), **i64), blocks_per_seq)

    mine = rank_rows[cp_rank]
    return CPLayout(
        cp_size=cp_size, cp_rank=cp_rank, block_size=block_size, total_global=total_global,
        total_local=total_local, row_owner=row_owner, row_local=row_local, rank_rows=rank_rows,
        gathered_to_global=gathered_to_global, row_block=row_block, num_blocks=num_blocks,
        block_seq=block_seq, block_first_id=block_first_id,
        q_pos=pos[mine].to(torch.int32), q_kbase=starts[seq[mine]].to(torch.int32),
        q_seq=seq[mine],
    )


def sbhd_cu_seqlens(batch: int, seq_len_global: int, device: torch.device) -> torch.Tensor:
    """``[batch+1]`` int32 global boundaries of ``batch`` SBHD samples of ``seq_len_global`` tokens.

    With these, a CP rank's SBHD tensor ``[s_local, b, h, d]`` is passed to the CP core as
    ``x.transpose(0, 1).reshape(b * s_local, h, d)`` (each sample's two chunks are contiguous).
    """
    return torch.arange(batch + 1, device=device, dtype=torch.int32) * seq_len_global


def split_for_cp_rank(
    x_global: torch.Tensor, cu_seqlens_global: torch.Tensor, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """This rank's local rows ``[T_local, ...]`` of a global THD tensor ``[T_global, ...]``.

    The THD equivalent of megatron-core's ``get_batch_on_this_cp_rank``; used by tests and
    benchmarks to build the per-rank inputs of a global batch.
    """
    layout = build_cp_layout(cu_seqlens_global, cp_size, cp_rank, 1, x_global.device)  # any B
    return x_global.index_select(0, layout.local_rows)
