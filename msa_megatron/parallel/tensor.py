"""Tensor parallelism (TP) for MSA: who holds which index head, and the exchanges between ranks.

MSA_SPEC section 6. Query heads, KV groups and index query heads are split over the TP group so
that a rank owns whole index heads. Two layouts follow from ``Hi`` (index heads of the layer)
and the TP size:

- ``Hi % TP == 0``: rank ``r`` owns index heads ``[r*Hi/TP, (r+1)*Hi/TP)``, exactly the index
  heads of its query heads. Selection, attention and KL run locally; nothing is exchanged.
- ``TP % Hi == 0`` with ``Hi < TP`` (e.g. the paper's 64 query / 4 KV / 4 index heads at TP 8):
  ``share = TP / Hi`` consecutive ranks hold the query heads of one index head. They form a
  *share group* (:func:`share_group`). :func:`shared_index_msa_attention` then

  1. splits the query tokens into ``share`` slices; each rank selects for its slice only and the
     int32 block indices are all-gathered in the share group (the selection of an index head
     is computed once, not ``share`` times);
  2. runs the main attention of its own query heads over all tokens with the full selection;
  3. exchanges ``q`` and the LSE head<->token (an all-to-all in the share group) so each rank
     holds, for its token slice, ALL query heads of the index head: the KL teacher (mean over
     those heads) is exact, and each rank computes the KL of its token slice.

  The KL gradient reaches ``q_idx`` rows of the rank's slice and its ``k_idx``; the index
  projections sum these partial gradients (:func:`gather_last_dim` backward,
  :func:`sum_grad_over_group`).

Padded packed sequences (megatron-core's ``cu_seqlens_q_padded``): both layouts take
``kl_rows`` (:func:`real_token_rows`), the rows whose queries count in the KL; padding rows get
outputs but no KL term.

Everything here is plain ``torch.distributed``: any device, gloo or NCCL, no Triton, no Megatron.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..ops.api import msa_attention_core
from ..ops.backends import get_backend

ProcessGroup = dist.ProcessGroup
# torch >= 2.10 names the flat collectives *_single; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_SHARE_GROUPS: Dict[Tuple[int, ...], ProcessGroup] = {}


def group_size(group: Optional[ProcessGroup]) -> int:
    """Size of ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """Rank inside ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


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


def all_gather_first_dim(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """All-gather ``x`` along dim 0 (no autograd: for inputs read with gradient stopped).

    Args:
        x: ``[n, ...]``, the same shape on every rank.

    Returns:
        ``[n * size, ...]``, rank order.
    """
    size = group_size(group)
    if size == 1:
        return x
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_flat(out, x.contiguous(), group=group)
    return out


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim; backward: sum the gradients of all ranks, keep own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = torch.empty((size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                            device=x.device)
        _all_gather_flat(parts, x.contiguous(), group=group)
        return torch.cat(parts.chunk(size, dim=0), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        stacked = torch.cat(grad.chunk(size, dim=-1), dim=0).contiguous()
        out = torch.empty((stacked.shape[0] // size,) + tuple(stacked.shape[1:]),
                          dtype=grad.dtype, device=grad.device)
        _reduce_scatter_flat(out, stacked, group=ctx.group)
        return out, None


def gather_last_dim(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Differentiable all-gather along the last dim (any device; megatron-core's own
    ``_gather_along_last_dim`` allocates on CUDA).

    Args:
        x: ``[..., n]``, the same shape on every rank.

    Returns:
        ``[..., n * size]`` in rank order. Backward sums the gradients of all ranks and returns
        each rank its own slice (reduce-scatter), so a tensor used by several ranks gets its
        full gradient.
    """
    if group_size(group) == 1:
        return x
    return _GatherLastDim.apply(x, group)


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over_group(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Identity in forward; in backward the gradient is summed over ``group``.

    Applied to a weight that is replicated over the TP ranks (the index key projection, the index
    norms), every rank ends with the gradient of the whole layer after ``loss.backward()``.
    """
    if group_size(group) == 1:
        return x
    return _SumGrad.apply(x, group)


def token_slices(total: int, parts: int) -> List[Tuple[int, int]]:
    """Split ``total`` rows into ``parts`` contiguous slices of ``ceil(total/parts)`` rows (the
    last ones shorter or empty). Returns ``[(start, end), ...]``."""
    step = -(-total // parts) if total else 0
    return [(min(i * step, total), min((i + 1) * step, total)) for i in range(parts)]


def all_gather_rows(x: torch.Tensor, slices: Sequence[Tuple[int, int]],
                    group: ProcessGroup) -> torch.Tensor:
    """All-gather row slices of uneven length (no autograd).

    Args:
        x: ``[end - start, ...]`` this rank's slice ``slices[rank]`` (rows of one global tensor).
        slices: ``[(start, end), ...]`` per rank of ``group`` (:func:`token_slices`).
        group: the ranks holding the slices, in slice order.

    Returns:
        ``[slices[-1][1] - slices[0][0], ...]``: the slices concatenated in rank order (each is
        padded to the longest for the collective, the padding is dropped).
    """
    rows = max(end - start for start, end in slices)
    padded = x.new_zeros((rows,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = torch.empty((len(slices) * rows,) + tuple(x.shape[1:]), dtype=x.dtype,
                        device=x.device)
    _all_gather_flat(parts, padded, group=group)
    parts = parts.view(len(slices), rows, *x.shape[1:])
    return torch.cat([parts[i, : end - start] for i, (start, end) in enumerate(slices)], dim=0)


def _heads_to_tokens(x: torch.Tensor, slices: Sequence[Tuple[int, int]],
                     group: ProcessGroup) -> torch.Tensor:
    """All-to-all: ``x [T, h, ...]`` (all tokens, this rank's heads) -> ``[T_slice, share*h, ...]``
    (this rank's token slice, the heads of every rank in rank order). No autograd. Slices are
    padded to the longest one (gloo's all-to-all needs equal sizes)."""
    rank = dist.get_rank(group)
    rows = max(end - start for start, end in slices)
    send = []
    for start, end in slices:
        part = x.new_zeros((rows,) + tuple(x.shape[1:]))
        part[: end - start] = x[start:end]
        send.append(part)
    recv = [x.new_empty((rows,) + tuple(x.shape[1:])) for _ in slices]
    dist.all_to_all(recv, send, group=group)
    own_rows = slices[rank][1] - slices[rank][0]
    return torch.cat([part[:own_rows] for part in recv], dim=1)


def shared_index_msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
    q_pos: torch.Tensor, q_kbase: torch.Tensor, *, share_group: ProcessGroup, backend: str,
    block_size: int, top_k: int, init_blocks: int, local_blocks: int,
    softmax_scale: Optional[float], index_scale: Optional[float], mode: str, kl_scale: float,
    block_idx: Optional[torch.Tensor] = None, kl_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """MSA core of one TP rank whose index head is shared by the ranks of ``share_group``.

    Args:
        q: ``[T, Hq_local, D]`` this rank's query heads, all of one index head; k, v:
            ``[T, 1, D]`` the group's KV head; q_idx: ``[T, 1, Di]`` the shared index head
            (equal on the share ranks); k_idx: ``[T, 1, Di]`` its index key head.
        q_pos, q_kbase: ``[T]`` int32 query layout (:mod:`msa_megatron.ops.layout`).
        share_group: the ranks holding the same index head (:func:`share_group`), in TP order.
        backend: a resolved backend name. Other options as in
            :func:`msa_megatron.ops.api.msa_attention_core`.
        kl_scale: ``1 / (N * Hi_total)``.
        block_idx: ``[T, 1, top_k]`` int32 selection of an earlier call (reused), or None.
        kl_rows: ``[R]`` int64 ascending rows whose queries count in the KL (the real tokens of
            padded sequences, :func:`real_token_rows`), or None for all rows. The other rows
            get outputs but add nothing to the KL (``kl_scale`` should count ``R`` tokens).

    Returns:
        ``(out, kl, block_idx, selected_rows)``: ``out [T, Hq_local, D]``; ``kl`` 0-dim fp32,
        ``kl_scale * sum`` of the KL of this rank's token slice with the exact teacher (summing
        over the share group gives the index head's KL); ``block_idx [T, 1, top_k]`` (None in
        dense mode); ``selected_rows`` = (token, index head) rows this call selected (0 when
        ``block_idx`` was given).
    """
    impl = get_backend(backend)
    total = q.shape[0]
    slices = token_slices(total, dist.get_world_size(share_group))
    start, end = slices[dist.get_rank(share_group)]
    selected_rows = 0
    if mode == "sparse" and block_idx is None:
        with torch.no_grad():
            own = impl.select(q_idx[start:end].detach(), k_idx.detach(), q_pos[start:end],
                              q_kbase[start:end], block_size=block_size, top_k=top_k,
                              init_blocks=init_blocks, local_blocks=local_blocks,
                              index_scale=index_scale)
            block_idx = all_gather_rows(own, slices, share_group)
        selected_rows = (end - start) * q_idx.shape[1]
    if mode == "dense":
        block_idx = None
    out, lse = impl.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=block_size,
                              softmax_scale=softmax_scale, index_heads=1)
    with torch.no_grad():
        q_slice = _heads_to_tokens(q.detach(), slices, share_group)
        lse_slice = _heads_to_tokens(lse.detach(), slices, share_group)
    slice_rows = None
    if kl_rows is not None:
        inside = (kl_rows >= start) & (kl_rows < end)
        slice_rows = kl_rows[inside] - start
    kl = kl_of_rows(impl, slice_rows, q_slice, k.detach(), lse_slice, q_idx[start:end], k_idx,
                    None if block_idx is None else block_idx[start:end], q_pos[start:end],
                    q_kbase[start:end], block_size=block_size, softmax_scale=softmax_scale,
                    index_scale=index_scale, kl_scale=kl_scale)
    return out, kl, block_idx, selected_rows


def local_msa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
    q_pos: torch.Tensor, q_kbase: torch.Tensor, *, backend: str, block_size: int, top_k: int,
    init_blocks: int, local_blocks: int, softmax_scale: Optional[float],
    index_scale: Optional[float], mode: str, kl_scale: float,
    block_idx: Optional[torch.Tensor] = None, kl_rows: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """MSA core of a rank that owns whole index heads (``Hi % TP == 0``): same arguments and
    results as :func:`shared_index_msa_attention`, shapes ``q [T, Hq_local, D]``,
    ``k, v [T, Hkv_local, D]``, ``q_idx [T, Hi_local, Di]``, ``k_idx [T, Hik_local, Di]``."""
    selected_rows = 0
    if mode == "sparse" and block_idx is None:
        with torch.no_grad():
            block_idx = get_backend(backend).select(
                q_idx.detach(), k_idx.detach(), q_pos, q_kbase, block_size=block_size,
                top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
                index_scale=index_scale,
            )
        selected_rows = q_idx.shape[0] * q_idx.shape[1]
    if mode == "dense":
        block_idx = None
    if kl_rows is None:
        out, kl = msa_attention_core(
            q, k, v, q_idx, k_idx, q_pos, q_kbase, backend=backend, block_size=block_size,
            top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
            softmax_scale=softmax_scale, index_scale=index_scale, mode=mode, kl_scale=kl_scale,
            block_idx=block_idx,
        )
        return out, kl, block_idx, selected_rows
    impl = get_backend(backend)
    out, lse = impl.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=block_size,
                              softmax_scale=softmax_scale, index_heads=q_idx.shape[1])
    kl = kl_of_rows(impl, kl_rows, q.detach(), k.detach(), lse.detach(), q_idx, k_idx, block_idx,
                    q_pos, q_kbase, block_size=block_size, softmax_scale=softmax_scale,
                    index_scale=index_scale, kl_scale=kl_scale)
    return out, kl, block_idx, selected_rows


def real_token_rows(cu_seqlens_padded: torch.Tensor, cu_seqlens_real: Optional[torch.Tensor],
                    q_pos: torch.Tensor, q_kbase: torch.Tensor) -> Optional[torch.Tensor]:
    """Rows of real (non-padding) query tokens of padded packed sequences (megatron-core's THD
    ``cu_seqlens_q_padded`` next to ``cu_seqlens_q``).

    A token at position ``p`` of sequence ``s`` is padding when ``p >= real length of s``
    (megatron pads each sequence at its end).

    Args:
        cu_seqlens_padded: ``[n+1]`` int32 padded boundaries (those the tokens are laid out by).
        cu_seqlens_real: ``[n+1]`` int32 real boundaries, or None (no padding).
        q_pos, q_kbase: ``[T]`` int32 query layout against the padded boundaries
            (:mod:`msa_megatron.ops.layout`): position in the sequence, row of its start.

    Returns:
        ``[R]`` int64 ascending rows of real tokens, or None when no sequence is padded.

    Raises:
        TypeError: ``cu_seqlens_real`` not an int32 tensor.
        ValueError: shapes differ, or a real length is negative or above its padded length.
    """
    if cu_seqlens_real is None:
        return None
    if not isinstance(cu_seqlens_real, torch.Tensor) or cu_seqlens_real.dtype != torch.int32:
        raise TypeError("the real (unpadded) cu_seqlens must be an int32 torch.Tensor or None")
    if cu_seqlens_real.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"the real (unpadded) cu_seqlens has shape {list(cu_seqlens_real.shape)} but the "
            f"padded cu_seqlens has shape {list(cu_seqlens_padded.shape)}"
        )
    real = torch.diff(cu_seqlens_real.to(device=q_pos.device, dtype=torch.int64))
    padded = torch.diff(cu_seqlens_padded.to(device=q_pos.device, dtype=torch.int64))
    if bool((real < 0).any()) or bool((real > padded).any()):
        raise ValueError(
            f"the real (unpadded) cu_seqlens {cu_seqlens_real.tolist()} must have non-negative "
            f"lengths no larger than those of the padded cu_seqlens {cu_seqlens_padded.tolist()}"
        )
    if bool((real == padded).all()):
        return None
    starts = cu_seqlens_padded.to(device=q_pos.device, dtype=torch.int64)
    # The last boundary <= the start row: skips zero-length sequences that share the start.
    seq = torch.searchsorted(starts, q_kbase.to(torch.int64), right=True) - 1
    keep = q_pos.to(torch.int64) < real[seq]
    return torch.nonzero(keep).flatten()


def kl_of_rows(impl, rows: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               lse: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
               block_idx: Optional[torch.Tensor], q_pos: torch.Tensor, q_kbase: torch.Tensor,
               **options) -> torch.Tensor:
    """The backend's KL core (:mod:`msa_megatron.ops.backends`) over the query ``rows`` only.

    Args:
        impl: a backend; rows: ``[R]`` int64 query rows, or None for all; q ``[T, Hq, D]``
            (detached), k ``[Tk, Hkv, D]`` (detached), lse ``[T, Hq]`` (detached), q_idx
            ``[T, Hi, Di]``, k_idx ``[Tk, Hik, Di]``, block_idx ``[T, Hi, top_k]`` or None,
            q_pos / q_kbase ``[T]``; options: ``block_size``, ``softmax_scale``,
            ``index_scale``, ``kl_scale``.

    Returns:
        0-dim fp32 KL, differentiable in q_idx and k_idx (an exact zero, with zero gradients,
        when ``rows`` is empty).
    """
    if rows is not None and rows.numel() == 0:
        return (q_idx[:0].sum() + k_idx[:0].sum()).float()
    if rows is not None:
        q, lse, q_idx, q_pos, q_kbase = (t.index_select(0, rows)
                                         for t in (q, lse, q_idx, q_pos, q_kbase))
        block_idx = None if block_idx is None else block_idx.index_select(0, rows)
    return impl.kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, **options)
