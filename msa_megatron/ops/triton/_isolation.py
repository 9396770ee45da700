"""Keeping NaN/Inf inside the rows whose support holds them (MSA_SPEC section 7).

A tile's matrix product multiplies every row of one operand by every row of the other: a NaN or
Inf in a key, value, query or gradient row would reach, through ``0 * NaN``, every row of the
tile, also rows whose support does not hold it (rows of the same tile in another sequence, rows
before it in its own block, key rows past a sequence's end). :func:`support_mma` is the product
the kernels use wherever one operand is masked to a support and the other may be non-finite:
the same ``tl.dot`` when the tile is finite (one reduction extra), else the product over the
finite part with NaN written exactly where the support meets a non-finite entry.

The checks cost registers and a block-wide reduction per tile, and the branch keeps ``acc +=
tl.dot`` from fusing into the MMA accumulator (v5 on the H200: 2-3x slower than v4, spills
1.8 -> 0.4 KB per thread in the forward item kernel without them). So every kernel that uses
:func:`support_mma` has an ``ISO`` constexpr and a ``bad_ptr`` flag: :func:`nonfinite_flag`
sets the flag on the device (one fp32 sum per operand tensor, no host sync) and
:func:`launch_both` launches the plain variant (``ISO=False``) and the isolating one
(``ISO=True``); the variant that does not match the flag returns at once (:func:`skip`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..host_reads import sum_of_sums
from ._common import mma


@triton.jit
def nonfinite(x):
    """Bool mask of the NaN / Inf entries of ``x``."""
    xf = x.to(tl.float32)
    return (xf != xf) | (tl.abs(xf) == float("inf"))


@triton.jit
def support_mma(a, b, b_bad, on, UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr):
    """``a @ b`` (fp32) for ``a [M, K]`` that is exactly 0 wherever ``on [M, K]`` is False and
    ``b [K, N]`` that may hold NaN/Inf (``b_bad = nonfinite(b)``).

    Entry ``[m, n]`` is NaN where some ``k`` with ``on[m, k]`` meets a non-finite ``b[k, n]``
    (where the oracle, which adds non-finite terms on the support only, is NaN or +-Inf);
    elsewhere it is the product with the finite part of ``b``: a non-finite ``b`` row never
    reaches a row ``m`` whose support does not hold it. ``ISO`` False (every operand of the
    launch is finite, :func:`nonfinite_flag`): the plain product.
    """
    if ISO:
        if tl.max(tl.max(b_bad.to(tl.int32), axis=1), axis=0) > 0:
            c = mma(a, tl.where(b_bad, tl.zeros_like(b), b), UPCAST, IEEE)
            hits = tl.dot(on.to(tl.float16), b_bad.to(tl.float16))
            c = tl.where(hits > 0, float("nan"), c)
        else:
            c = mma(a, b, UPCAST, IEEE)
    else:
        c = mma(a, b, UPCAST, IEEE)
    return c


@triton.jit
def log_sum_exp(m, l):
    """``m + log(l)`` of an online softmax (running max ``m``, sum ``l`` of ``exp(s - m)``),
    as ``torch.logsumexp`` gives it for non-finite rows: ``+inf`` when the max is ``+inf``,
    NaN when ``l`` is NaN (never replaced by a finite value); ``l = 0`` (no key) counts as 1."""
    return tl.where(m == float("inf"), m, m + tl.log(tl.where(l == 0, 1.0, l)))


@triton.jit
def skip(bad_ptr, ISO: tl.constexpr):
    """True when this launch's variant does not match the flag (:func:`launch_both`)."""
    return (tl.load(bad_ptr) != 0) != ISO


def nonfinite_flag(*tensors: torch.Tensor) -> torch.Tensor:
    """``[1]`` int32 on the device: 1 when some tensor holds NaN/Inf (no host sync).

    One fp32 sum per tensor (no temporary of the tensor's size); a finite tensor whose sum
    overflows also sets the flag, which only selects the slower, equally exact variant.
    """
    return (~torch.isfinite(sum_of_sums(*tensors))).to(torch.int32).reshape(1)


def launch_both(kernel, grid, *args, **kwargs) -> None:
    """Launch ``kernel`` with ``ISO=False`` and ``ISO=True`` (pass ``bad_ptr`` in ``kwargs``):
    the variant not selected by the flag returns at once."""
    for iso in (False, True):
        kernel[grid](*args, ISO=iso, **kwargs)
