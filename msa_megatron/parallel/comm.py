"""Collectives of the MSA layer, each written once (plain ``torch.distributed``, any device).

Autograd is attached where a collective carries gradients (:func:`gather_last_dim`,
:func:`register_grad_sum`; the CP row exchanges of :mod:`.context`). Everything else is read
with the gradient stopped. ``group=None`` (or a one-rank group) makes every helper an identity.

torch.distributed's collectives are used directly where they run on both gloo (CPU) and NCCL
(megatron-core's own gathers allocate on CUDA). The one exception is the list all-to-all, which
some gloo builds lack (torch 2.11: ``Backend gloo does not support alltoall``):
:func:`all_to_all_equal` falls back to an all-gather on every backend that lacks it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup

# torch >= 2.10 names the flat collectives *_single; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Backend name -> whether its list all-to-all works (learnt on first use).
_ALL_TO_ALL_SUPPORTED: Dict[str, bool] = {}


def group_size(group: Optional[ProcessGroup]) -> int:
    """Size of ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """Rank inside ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: Optional[ProcessGroup]) -> None:
    """``out [size * n, ...]`` <- the ``x [n, ...]`` of every rank, rank-major (no autograd)."""
    _all_gather_flat(out, x.contiguous(), group=group)


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor,
                        group: Optional[ProcessGroup]) -> None:
    """``out [n, ...]`` <- rows ``[rank*n, (rank+1)*n)`` of the sum over ranks of ``x``."""
    _reduce_scatter_flat(out, x.contiguous(), group=group)


def start_all_gather_flat(out: torch.Tensor, x: torch.Tensor,
                          group: Optional[ProcessGroup]) -> dist.Work:
    """:func:`all_gather_flat` launched asynchronously (gloo and NCCL alike).

    Returns the collective's ``Work``: ``out`` holds the result after ``work.wait()`` (on NCCL
    ``wait`` makes the current CUDA stream wait; the host does not block). Keep ``x`` unchanged
    until then.
    """
    return _all_gather_flat(out, x.contiguous(), group=group, async_op=True)


def start_reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor,
                              group: Optional[ProcessGroup]) -> dist.Work:
    """:func:`reduce_scatter_flat` launched asynchronously; ``out`` is valid after ``wait()``."""
    return _reduce_scatter_flat(out, x.contiguous(), group=group, async_op=True)


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
    out = x.new_empty((x.shape[0] * size,) + tuple(x.shape[1:]))
    all_gather_flat(out, x, group)
    return out


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim; backward: sum the gradients of all ranks, keep own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        parts = all_gather_first_dim(x, group)
        return torch.cat(parts.chunk(size, dim=0), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        stacked = torch.cat(grad.chunk(size, dim=-1), dim=0)
        out = grad.new_empty((stacked.shape[0] // size,) + tuple(stacked.shape[1:]))
        reduce_scatter_flat(out, stacked, ctx.group)
        return out, None


def gather_last_dim(x: torch.Tensor, group: Optional[ProcessGroup]) -> torch.Tensor:
    """Differentiable all-gather along the last dim.

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


def register_grad_sum(param: torch.Tensor, group: Optional[ProcessGroup]) -> None:
    """Make a tensor replicated over ``group`` (each rank computing a partial gradient) receive
    the gradient summed over the group in backward (a tensor hook; no-op for one rank)."""
    if group_size(group) == 1:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return grad

    param.register_hook(hook)


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
    parts = x.new_empty((len(slices) * rows,) + tuple(x.shape[1:]))
    all_gather_flat(parts, padded, group)
    parts = parts.view(len(slices), rows, *x.shape[1:])
    return torch.cat([parts[i, : end - start] for i, (start, end) in enumerate(slices)], dim=0)


def _all_to_all_by_gather(recv: List[torch.Tensor], send: List[torch.Tensor],
                          group: ProcessGroup) -> None:
    """:func:`all_to_all_equal` through one all-gather (``size`` times the traffic)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = torch.stack(send)  # [size, rows, ...]
    gathered = all_gather_first_dim(flat.unsqueeze(0), group)  # [size(src), size(dst), rows, ...]
    for src in range(size):
        recv[src].copy_(gathered[src, rank])


def all_to_all_equal(recv: List[torch.Tensor], send: List[torch.Tensor],
                     group: ProcessGroup) -> None:
    """``recv[j]`` <- the ``send[rank]`` of rank ``j``: all tensors of one shape (no autograd).

    Uses ``torch.distributed.all_to_all`` where the group's backend has it; a backend without it
    (gloo of some torch releases) gets the same result through an all-gather. What a backend
    supports is learnt on its first call and remembered.
    """
    backend = str(dist.get_backend(group))
    if _ALL_TO_ALL_SUPPORTED.get(backend, True):
        try:
            dist.all_to_all(recv, send, group=group)
            _ALL_TO_ALL_SUPPORTED[backend] = True
            return
        except (RuntimeError, NotImplementedError) as error:
            # Raised before any data moves, on every rank alike.
            if "support" not in str(error).lower():
                raise
            _ALL_TO_ALL_SUPPORTED[backend] = False
    _all_to_all_by_gather(recv, send, group)


def heads_to_tokens(x: torch.Tensor, slices: Sequence[Tuple[int, int]],
                    group: ProcessGroup) -> torch.Tensor:
    """Head <-> token exchange: ``x [T, h, ...]`` (all tokens, this rank's heads) ->
    ``[T_slice, size*h, ...]`` (this rank's token slice, the heads of every rank in rank order).

    No autograd (read with the gradient stopped). Slices are padded to the longest one.

    Args:
        x: ``[T, h, ...]``, the same shape on every rank.
        slices: ``[(start, end), ...]`` token slice of each rank (:func:`token_slices`).
        group: the ranks, in slice order.
    """
    rank = dist.get_rank(group)
    rows = max(end - start for start, end in slices)
    send = []
    for start, end in slices:
        part = x.new_zeros((rows,) + tuple(x.shape[1:]))
        part[: end - start] = x[start:end]
        send.append(part)
    recv = [x.new_empty((rows,) + tuple(x.shape[1:])) for _ in slices]
    all_to_all_equal(recv, send, group)
    own_rows = slices[rank][1] - slices[rank][0]
    return torch.cat([part[:own_rows] for part in recv], dim=1)
