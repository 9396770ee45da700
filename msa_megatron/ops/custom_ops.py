"""PyTorch custom ops for MSA backends: one autograd and torch.compile wrapper for every backend.

A backend writes four plain kernels (:class:`BackendKernels`, no autograd inside) and calls
:func:`register_backend_ops` once at import time. The helper registers them as custom ops in the
``msa_megatron`` namespace (``msa_megatron::<prefix>_select``, ``<prefix>_attention_fwd``,
``<prefix>_attention_bwd``, ``<prefix>_kl``) with shape-only fake implementations and the
autograd formulas, and returns the three cores of :mod:`msa_megatron.ops.backends`. The ops are
opaque to ``torch.compile``: a model calling :func:`msa_megatron.msa_attention` compiles with
``fullgraph=True`` and the kernels may read host values (``.tolist()``) inside.

Use from a backend module (this is how ``torch_backend.py`` does it; the Triton backend does the
same with its own kernels and ``prefix="triton"``)::

    from .custom_ops import BackendKernels, register_backend_ops

    _OPS = register_backend_ops("triton", BackendKernels(
        select=my_select, attention_fwd=my_fwd, attention_bwd=my_bwd, kl=my_kl))
    select, attention, kl = _OPS.select, _OPS.attention, _OPS.kl

Kernel contracts (all scales are already resolved floats; ``block_idx=None`` is dense mode):

- ``select(q_idx, k_idx, q_pos, q_kbase, block_size, top_k, init_blocks, local_blocks,
  index_scale) -> block_idx [Tq, Hi, top_k] int32``.
- ``attention_fwd(q, k, v, block_idx, q_pos, q_kbase, block_size, softmax_scale, index_heads)
  -> (out [Tq, Hq, D] q.dtype, lse [Tq, Hq])``; ``lse`` is float32 (float64 for float64 inputs,
  so float64 tests keep their precision).
- ``attention_bwd(dout, q, k, v, out, lse, block_idx, q_pos, q_kbase, block_size, softmax_scale,
  index_heads) -> (dq, dk, dv)`` in the dtypes of q, k, v.
- ``kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size, softmax_scale,
  index_scale, kl_scale, compute_grad) -> (kl 0-dim float32, dq_idx, dk_idx)``. The KL is a
  scalar, so its input gradients are computed in the same pass as the value (no second pass
  over the support): ``dq_idx`` / ``dk_idx`` are ``d kl / d q_idx`` and ``d kl / d k_idx`` in the
  accumulation dtype (float32; float64 for float64 inputs: they are tiny, ~1/(N*Hi), and would
  underflow in fp16) when ``compute_grad`` is true, and empty ``[0]`` tensors otherwise.
  The backward only multiplies them by the incoming gradient. q, k and lse get no gradient.

Second-order gradients (double backward, e.g. ``torch.autograd.grad(..., create_graph=True)``
then a backward through the result) are not supported: differentiating either op's gradient
raises :class:`NotImplementedError` naming the op (:func:`double_backward_error`), instead of
torch's generic "no autograd formula" error or, for the KL, a silently constant gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Optional

import torch

NAMESPACE = "msa_megatron"

_SELECT_SCHEMA = (
    "(Tensor q_idx, Tensor k_idx, Tensor q_pos, Tensor q_kbase, int block_size, int top_k, "
    "int init_blocks, int local_blocks, float index_scale) -> Tensor"
)
_ATTENTION_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? block_idx, Tensor q_pos, Tensor q_kbase, "
    "int block_size, float softmax_scale, int index_heads) -> (Tensor, Tensor)"
)
_ATTENTION_BWD_SCHEMA = (
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? block_idx, "
    "Tensor q_pos, Tensor q_kbase, int block_size, float softmax_scale, int index_heads) "
    "-> (Tensor, Tensor, Tensor)"
)
_KL_SCHEMA = (
    "(Tensor q, Tensor k, Tensor lse, Tensor q_idx, Tensor k_idx, Tensor? block_idx, "
    "Tensor q_pos, Tensor q_kbase, int block_size, float softmax_scale, float index_scale, "
    "float kl_scale, bool compute_grad) -> (Tensor, Tensor, Tensor)"
)


@dataclass(frozen=True)
class BackendKernels:
    """The four plain kernels a backend provides (contracts in the module docstring)."""

    select: Callable
    attention_fwd: Callable
    attention_bwd: Callable
    kl: Callable


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the kernels and dtype of the LSE: float64 for float64 inputs,
    float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def double_backward_error(op: str) -> NotImplementedError:
    """The error raised when the gradient of ``op`` (a custom op name) is differentiated."""
    return NotImplementedError(
        f"double backward (second-order gradients) of MSA is not supported: {op} has "
        "first-order gradients only (create_graph=True is fine; differentiating its gradient "
        "is not)")


class _FirstOrderGradient(torch.autograd.Function):
    """``(grad * scale).to(dtype)``, a gradient computed outside autograd, tied to ``anchor`` (a
    differentiable output of ``op``) so that differentiating it raises :func:`double_backward_error`
    instead of passing it as a constant (which would silently drop its second-order term)."""

    @staticmethod
    def forward(ctx, grad, scale, dtype, anchor, op):  # noqa: D102
        ctx.op = op
        return (grad * scale).to(dtype)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        raise double_backward_error(ctx.op)


def _grad_or_empty(t: torch.Tensor, compute_grad: bool) -> torch.Tensor:
    if not compute_grad:
        return t.new_empty((0,))
    return t.new_empty(t.shape, dtype=accumulation_dtype(t.dtype))


def _contiguous_strides(shape) -> tuple:
    """Row-major strides of ``shape``, size-1 dimensions included (what ``new_empty`` gives)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _fresh_outputs(kernel: Callable) -> Callable:
    """Wrap ``kernel`` so that every output is a new contiguous tensor.

    The fake implementations below return contiguous tensors, and inductor plans buffers from
    them; an output that is a strided view, or that shares memory with an input or another
    output, would disagree with its fake (and custom ops must not alias their inputs). Strides
    are compared exactly, size-1 dimensions included (``[1, T, D].transpose(0, 1).contiguous()``
    keeps stride ``T*D`` on its size-1 dimension). Outputs that already satisfy this (the normal
    case) are returned unchanged, with no copy.
    """

    def run(*args):
        result = kernel(*args)
        single = isinstance(result, torch.Tensor)
        outputs = [result] if single else list(result)
        taken = {a.untyped_storage().data_ptr() for a in args
                 if isinstance(a, torch.Tensor) and a.numel() > 0}
        for n, out in enumerate(outputs):
            ptr = out.untyped_storage().data_ptr() if out.numel() > 0 else None
            if ptr in taken or out.stride() != _contiguous_strides(out.shape) or (
                    out.storage_offset() != 0):
                out = out.clone(memory_format=torch.contiguous_format)
                ptr = out.untyped_storage().data_ptr() if out.numel() > 0 else None
            if ptr is not None:
                taken.add(ptr)
            outputs[n] = out
        return outputs[0] if single else tuple(outputs)

    run.__name__ = getattr(kernel, "__name__", "kernel")
    run.__doc__ = kernel.__doc__
    return run


def register_backend_ops(prefix: str, kernels: BackendKernels) -> SimpleNamespace:
    """Register ``kernels`` as ``msa_megatron::<prefix>_*`` custom ops with autograd.

    Args:
        prefix: backend name used in the op names (``"torch"``, ``"triton"``); each prefix may
            be registered once per process.
        kernels: the backend's plain kernels.

    Returns:
        A namespace with ``select``, ``attention``, ``kl`` (the core interface of
        :mod:`msa_megatron.ops.backends`, default scales resolved here) and ``ops`` (the raw
        custom ops, e.g. for tests: ``ops.attention_fwd``).
    """

    def op_name(piece: str) -> str:
        return f"{NAMESPACE}::{prefix}_{piece}"

    # Fake implementations give contiguous outputs, and so do the real ones (_fresh_outputs).
    select_op = torch.library.custom_op(
        op_name("select"), _fresh_outputs(kernels.select), mutates_args=(),
        schema=_SELECT_SCHEMA,
    )
    attention_fwd_op = torch.library.custom_op(
        op_name("attention_fwd"), _fresh_outputs(kernels.attention_fwd), mutates_args=(),
        schema=_ATTENTION_FWD_SCHEMA,
    )
    attention_bwd_op = torch.library.custom_op(
        op_name("attention_bwd"), _fresh_outputs(kernels.attention_bwd), mutates_args=(),
        schema=_ATTENTION_BWD_SCHEMA,
    )
    kl_op = torch.library.custom_op(op_name("kl"), _fresh_outputs(kernels.kl), mutates_args=(),
                                    schema=_KL_SCHEMA)

    @select_op.register_fake
    def _(q_idx, k_idx, q_pos, q_kbase, block_size, top_k, init_blocks, local_blocks, index_scale):
        return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], top_k), dtype=torch.int32)

    @attention_fwd_op.register_fake
    def _(q, k, v, block_idx, q_pos, q_kbase, block_size, softmax_scale, index_heads):
        return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=accumulation_dtype(q.dtype))

    @attention_bwd_op.register_fake
    def _(dout, q, k, v, out, lse, block_idx, q_pos, q_kbase, block_size, softmax_scale,
          index_heads):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    @kl_op.register_fake
    def _(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size, softmax_scale,
          index_scale, kl_scale, compute_grad):
        return (q.new_empty((), dtype=torch.float32), _grad_or_empty(q_idx, compute_grad),
                _grad_or_empty(k_idx, compute_grad))

    def attention_setup(ctx, inputs, output):
        q, k, v, block_idx, q_pos, q_kbase, block_size, softmax_scale, index_heads = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, block_idx, q_pos, q_kbase)
        ctx.options = (block_size, softmax_scale, index_heads)
        ctx.mark_non_differentiable(lse)

    def attention_backward(ctx, dout, dlse):
        q, k, v, out, lse, block_idx, q_pos, q_kbase = ctx.saved_tensors
        dq, dk, dv = attention_bwd_op(dout.contiguous(), q, k, v, out, lse, block_idx, q_pos,
                                      q_kbase, *ctx.options)
        return dq, dk, dv, None, None, None, None, None, None

    attention_fwd_op.register_autograd(attention_backward, setup_context=attention_setup)

    def attention_double_backward(ctx, ddq, ddk, ddv):
        raise double_backward_error(op_name("attention_fwd"))

    # Reached only through a gradient taken with create_graph=True.
    attention_bwd_op.register_autograd(attention_double_backward)

    def kl_setup(ctx, inputs, output):
        value, dq_idx, dk_idx = output
        ctx.save_for_backward(dq_idx, dk_idx, value)
        ctx.mark_non_differentiable(dq_idx, dk_idx)
        ctx.dtypes = (inputs[3].dtype, inputs[4].dtype)

    def kl_backward(ctx, dkl, ddq_idx, ddk_idx):
        # The saved gradients are kept in the accumulation dtype: with kl_scale = 1/(N*Hi) they
        # sit near 1e-7, below fp16's normal range, so they are scaled first and cast last.
        dq_idx, dk_idx, value = ctx.saved_tensors
        q_dtype, k_dtype = ctx.dtypes
        if torch.is_grad_enabled():  # create_graph=True: the gradients must refuse a backward
            return (None, None, None,
                    _FirstOrderGradient.apply(dq_idx, dkl, q_dtype, value, op_name("kl")),
                    _FirstOrderGradient.apply(dk_idx, dkl, k_dtype, value, op_name("kl")),
                    None, None, None, None, None, None, None, None)
        return (None, None, None, (dq_idx * dkl).to(q_dtype), (dk_idx * dkl).to(k_dtype),
                None, None, None, None, None, None, None, None)

    kl_op.register_autograd(kl_backward, setup_context=kl_setup)

    def select(q_idx, k_idx, q_pos, q_kbase, *, block_size: int, top_k: int, init_blocks: int = 0,
               local_blocks: int = 1, index_scale: Optional[float] = None) -> torch.Tensor:
        scale = q_idx.shape[2] ** -0.5 if index_scale is None else float(index_scale)
        return select_op(q_idx.detach(), k_idx.detach(), q_pos, q_kbase, block_size, top_k,
                         init_blocks, local_blocks, scale)

    def attention(q, k, v, block_idx, q_pos, q_kbase, *, block_size: int,
                  softmax_scale: Optional[float] = None, index_heads: Optional[int] = None):
        scale = q.shape[2] ** -0.5 if softmax_scale is None else float(softmax_scale)
        heads = block_idx.shape[1] if block_idx is not None else (index_heads or k.shape[1])
        return attention_fwd_op(q, k, v, block_idx, q_pos, q_kbase, block_size, scale, heads)

    def kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, *, block_size: int,
           softmax_scale: Optional[float] = None, index_scale: Optional[float] = None,
           kl_scale: float = 1.0) -> torch.Tensor:
        main_scale = q.shape[2] ** -0.5 if softmax_scale is None else float(softmax_scale)
        idx_scale = q_idx.shape[2] ** -0.5 if index_scale is None else float(index_scale)
        compute_grad = torch.is_grad_enabled() and (q_idx.requires_grad or k_idx.requires_grad)
        value, _, _ = kl_op(q.detach(), k.detach(), lse.detach(), q_idx, k_idx, block_idx, q_pos,
                            q_kbase, block_size, main_scale, idx_scale, float(kl_scale),
                            compute_grad)
        return value

    ops = SimpleNamespace(select=select_op, attention_fwd=attention_fwd_op,
                          attention_bwd=attention_bwd_op, kl=kl_op)
    return SimpleNamespace(select=select, attention=attention, kl=kl, ops=ops)
