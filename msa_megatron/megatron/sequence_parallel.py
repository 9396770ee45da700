"""Sequence parallelism in the MSA layer: the hidden states are all-gathered once per layer.

megatron-core's column-parallel linears each all-gather their sequence-parallel input
(``[s/TP, b, h]`` -> ``[s, b, h]``) in forward and again in backward (for the weight gradient,
saving only the shard). An MSA layer has three projections of the same input (``linear_qkv``,
the index ``linear_q_idx`` and ``linear_k_idx``), so it would gather it three times. Instead
:func:`gather_once` gathers it once (backward: one reduce-scatter of the input gradient) and
the projections run as local GEMMs on the gathered tensor (:func:`local_projection`). The
gathered tensor is not kept for backward: the projections save the local shard in its place
and the first of them to need it in backward gathers it again, once for all three
(:class:`SharedGather`; memory as megatron-core's own sequence-parallel linears).

Per layer and micro-batch: 1 all-gather in forward (was 3), 1 in backward (was 2) and one
reduce-scatter (the index projections' input is detached, so it needs none).

A linear whose Transformer Engine userbuffer overlap is on (``tp_comm_overlap``) keeps its own
gather: the overlap hides it in the GEMM. :func:`can_run_local` says which linears qualify.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import ColumnParallelLinear

from ..parallel.comm import all_gather_flat, group_size, reduce_scatter_flat

# Transformer Engine attributes that mean a userbuffer communication overlap (TE 1.x and 2.x).
_UB_ATTRS = ("ub_overlap_ag", "ub_overlap_ag_fprop", "ub_overlap_rs", "ub_overlap_rs_dgrad",
             "ub_bulk_dgrad", "ub_bulk_wgrad", "ub_split_ag", "ub_atomic_gemm_ag")


def _is_te_linear(linear: torch.nn.Module) -> bool:
    return hasattr(linear, "parallel_mode") and not isinstance(linear, ColumnParallelLinear)


def can_run_local(linear: torch.nn.Module) -> bool:
    """Whether :func:`local_projection` can run ``linear`` as a local GEMM on gathered input:
    megatron-core's ``ColumnParallelLinear``, or a Transformer Engine column-parallel linear
    without userbuffer overlap."""
    if isinstance(linear, ColumnParallelLinear):
        return True
    if _is_te_linear(linear):
        return getattr(linear, "parallel_mode", None) == "column" and not any(
            getattr(linear, attr, False) for attr in _UB_ATTRS)
    return False


@contextlib.contextmanager
def local_projection(linear: torch.nn.Module) -> Iterator[None]:
    """Run a column-parallel ``linear`` without its own TP communication inside the block.

    For megatron-core's ``ColumnParallelLinear`` (0.16-0.19): ``sequence_parallel`` and
    ``allreduce_dgrad`` off, ``disable_grad_reduce`` on (no input gather, no input-gradient
    reduction). For Transformer Engine linears: ``sequence_parallel`` off and ``parallel_mode``
    None. The attributes are restored on exit.

    Raises:
        TypeError: a linear :func:`can_run_local` refuses.
    """
    if not can_run_local(linear):
        raise TypeError(f"{type(linear).__name__} cannot run as a local projection")
    if isinstance(linear, ColumnParallelLinear):
        changes = dict(sequence_parallel=False, allreduce_dgrad=False, disable_grad_reduce=True)
    else:
        changes = dict(sequence_parallel=False, parallel_mode=None)
    saved = {name: getattr(linear, name) for name in changes}
    for name, value in changes.items():
        setattr(linear, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(linear, name, value)


def _gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * group_size(group),) + tuple(x.shape[1:]))
    all_gather_flat(out, x, group)
    return out


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0; backward: reduce-scatter along dim 0."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = group_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        reduce_scatter_flat(out, grad, ctx.group)
        return out, None


class SharedGather:
    """The gathered hidden states of one layer call, saved for backward as the local shard.

    Use :meth:`saving` around the projections: every tensor they save for backward that is the
    gathered tensor (the same storage) is replaced by a reference to the shard, and gathered
    again when backward first unpacks it; the other projections' unpacks reuse that tensor, which
    is dropped after the last of them.

    Attributes:
        full: ``[s, b, h]`` the gathered tensor (differentiable in the shard).
        gathers: all-gathers run so far (forward and backward).
    """

    def __init__(self, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
        self.shard = shard
        self.group = group
        self.full = _GatherSequence.apply(shard, group)
        self.gathers = 1
        self._packed = 0
        self._regathered: Optional[torch.Tensor] = None

    def _pack(self, tensor: torch.Tensor):
        full = self.full
        if (tensor.data_ptr() == full.data_ptr() and tensor.shape == full.shape
                and tensor.dtype == full.dtype and tensor.stride() == full.stride()):
            self._packed += 1
            return self
        return tensor

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        owner = packed
        if owner._regathered is None:
            with torch.no_grad():
                owner._regathered = _gather(owner.shard.detach(), owner.group)
            owner.gathers += 1
        full = owner._regathered
        owner._packed -= 1
        if owner._packed == 0:
            owner._regathered = None
        return full

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Save the gathered tensor as the shard inside the block (module docstring)."""
        # The differentiable output itself is not saved by anyone; drop our reference to the
        # storage only after the block (the projections hold it while they run).
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self.full = None
