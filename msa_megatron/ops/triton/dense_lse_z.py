"""The student's log-normaliser ``lse_z`` over whole causal rows, for finite inputs (dense KL).

``lse_z[t, i] = log sum_{u in row t} exp(index_scale q_idx[t, i] . k_idx[u, j(i)])`` (natural
log, fp32), the same quantity as :func:`.dense_kl.student_lse`, which also carries NaN/Inf
through as MSA_SPEC 7 asks. This kernel is for the Gluon dense KL (:mod:`.dense_kl_gluon`),
whose inputs are checked finite first, and spends fewer instructions per logit:

- log2 domain: ``z2 = (index_scale log2 e) q k^T``, ``exp2`` (``ex2.approx.ftz`` on the GPU);
- the running max starts at ``-1e30`` (finite) and masked logits are ``-inf``, so every
  ``exp2`` argument is ``-inf`` or finite: no NaN, no ``-inf - -inf`` guard per element;
- the support mask only on key tiles that are not inside every row's support (a query tile's
  rows share the keys ``[max kbase, min (kbase + pos)]``; most tiles of a long row lie there).

Program = (query tile of ``BM`` rows, index head ``i``), longest rows first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ._common import dot_flags, interpreting, mma, stage_options

_LOG2E = 1.4426950408889634
# (BM, BN, num_warps) on the GPU; the interpreter runs small tiles
TILES = (128, 64, 8)


@triton.jit
def _exp2(x, FTZ: tl.constexpr):
    """``2^x``: ``ex2.approx.ftz`` on the GPU (no subnormal fix-up instructions); the
    interpreter, which runs no inline assembly, uses ``tl.exp2``."""
    if FTZ:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        y = tl.exp2(x)
    return y


@triton.jit(do_not_specialize=("Tq", "Tk"))
def _lse_z_finite_kernel(qi_desc, ki_desc, qpos_ptr, qkb_ptr, lsez_ptr, Tq, Tk, c2, s_zt,
                         HPK: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         FTZ: tl.constexpr):
    """``lse_z`` of query tile ``num_programs(0) - 1 - program_id(0)``, index head
    ``program_id(1)`` (module docstring); ``c2 = index_scale log2 e``."""
    m = tl.num_programs(0) - 1 - tl.program_id(0)
    i = tl.program_id(1)
    j = i // HPK
    t = m * BM + tl.arange(0, BM)
    valid = t < Tq
    t64 = t.to(tl.int64)
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kb = tl.load(qkb_ptr + t, mask=valid, other=0)
    ke = kb + pos  # the row's last key; rows past Tq: kb - 1 (empty)
    qi = qi_desc.load([m * BM, i * DI])  # rows past Tq read as zeros
    k_lo = tl.min(tl.where(valid, kb, Tk))
    k_hi = tl.max(tl.where(valid, ke, -1))
    in_lo = tl.max(tl.where(valid, kb, 0))  # keys in every valid row's support
    in_hi = tl.min(tl.where(valid, ke, Tk))
    mx = tl.full([BM], -1e30, tl.float32)
    sm = tl.zeros([BM], tl.float32)
    for k0 in range(k_lo // BN * BN, k_hi + 1, BN):
        krow = k0 + tl.arange(0, BN)
        kit = ki_desc.load([k0, j * DI])  # rows past Tk read as zeros (and are masked)
        z = mma(qi, tl.trans(kit), UPCAST, IEEE) * c2
        if (k0 < in_lo) | (k0 + BN - 1 > in_hi):  # a tile the support cuts
            inside = (krow[None, :] >= kb[:, None]) & (krow[None, :] <= ke[:, None])
            z = tl.where(inside, z, float("-inf"))
        new = tl.maximum(mx, tl.max(z, axis=1))  # >= -1e30: finite
        sm = sm * _exp2(mx - new, FTZ) + tl.sum(_exp2(z - new[:, None], FTZ), axis=1)
        mx = new
    lse = (mx + tl.log2(tl.where(valid, sm, 1.0))) * 0.6931471805599453
    tl.store(lsez_ptr + t64 * s_zt + i, lse, mask=valid)


def student_lse_finite(q_idx: torch.Tensor, k_idx: torch.Tensor, q_pos: torch.Tensor,
                       q_kbase: torch.Tensor, index_scale: float,
                       tiles: tuple | None = None) -> torch.Tensor:
    """``lse_z [Tq, Hi]`` fp32 (natural log) of finite inputs (module docstring).

    Args:
        q_idx: ``[Tq, Hi, Di]``, k_idx: ``[Tk, Hik, Di]`` (one dtype of fp16/bf16/fp32, unit
            last stride, finite; ``Hik`` divides ``Hi``; read as contiguous copies if not).
        q_pos, q_kbase: ``[Tq]`` int32 query layout (:mod:`msa_megatron.layout`): row ``t``
            reads keys ``q_kbase[t] .. q_kbase[t] + q_pos[t]``.
        index_scale: the logits' scale.
        tiles: ``(BM, BN, num_warps)``; default :data:`TILES` (the interpreter: 16 x 16).

    Raises:
        ValueError: non-matching shapes or a non-unit last stride.
        TypeError: q_idx and k_idx of different dtypes.
    """
    if q_idx.dim() != 3 or k_idx.dim() != 3 or q_idx.shape[2] != k_idx.shape[2]:
        raise ValueError(f"q_idx [Tq, Hi, Di] and k_idx [Tk, Hik, Di] must share Di, got "
                         f"{tuple(q_idx.shape)} and {tuple(k_idx.shape)}")
    Tq, Hi, Di = q_idx.shape
    Tk, Hik = k_idx.shape[0], k_idx.shape[1]
    if Hik < 1 or Hi % Hik:
        raise ValueError(f"Hik ({Hik}) must divide Hi ({Hi})")
    if q_idx.stride(2) != 1 or k_idx.stride(2) != 1:
        raise ValueError("q_idx and k_idx need a unit last stride")
    if q_idx.dtype != k_idx.dtype:
        raise TypeError(f"q_idx and k_idx must share a dtype, got {q_idx.dtype} and "
                        f"{k_idx.dtype}")
    if tuple(q_pos.shape) != (Tq,) or tuple(q_kbase.shape) != (Tq,):
        raise ValueError(f"q_pos and q_kbase must be [Tq] = [{Tq}], got {tuple(q_pos.shape)} "
                         f"and {tuple(q_kbase.shape)}")
    lse_z = torch.empty((Tq, Hi), dtype=torch.float32, device=q_idx.device)
    if Tq == 0:
        return lse_z
    interp = interpreting()
    bm, bn, warps = tiles or ((16, 16, 4) if interp else TILES)
    upcast, ieee = dot_flags(q_idx.dtype)
    # 2-D views [T, heads Di] for bulk tensor (TMA) loads: contiguous, 16-byte aligned bases
    q2, k2 = (x.contiguous() if x.contiguous().data_ptr() % 16 == 0 else x.contiguous().clone()
              for x in (q_idx, k_idx))
    qi_desc = TensorDescriptor.from_tensor(q2.view(Tq, Hi * Di), [bm, Di])
    ki_desc = TensorDescriptor.from_tensor(k2.view(Tk, Hik * Di), [bn, Di])
    _lse_z_finite_kernel[(triton.cdiv(Tq, bm), Hi)](
        qi_desc, ki_desc, q_pos, q_kbase, lse_z, Tq, Tk, float(index_scale) * _LOG2E,
        lse_z.stride(0), HPK=Hi // Hik, DI=Di, BM=bm, BN=bn, UPCAST=upcast, IEEE=ieee, FTZ=not interp,
        num_warps=warps, **stage_options(q_idx.dtype),
    )
    return lse_z
