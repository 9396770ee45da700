"""Dense (warmup) mode KL: value and both index gradients in one pass over Q K^T.

MSA_SPEC sections 4-5 with the whole causal row as the support. Per index head ``i`` (query
heads ``h`` of ``i``, KV group ``g``, index key head ``j``), token ``t`` and key ``u``:
teacher ``T = mean_h exp(s_h - lse_h)`` with the main LSE given (from cuDNN, FlashAttention or
our forward), student ``log Qs = z - lse_z``, ``KL = sum_u T (log T - log Qs)``,
``dz = Qs - T``, ``dq_idx = sum_u dz k_idx``, ``dk_idx = sum_t dz q_idx`` (times
``index_scale * kl_scale``).

Two kernels:

1. ``_lse_z_kernel`` (query-tile-outer, index heads only, 1/(Hq/Hi) of the main work): the
   student's log-normaliser ``lse_z [Tq, Hi]``.
2. ``_dense_kl_kernel`` (key-tile-outer): one program per (key tile, index head) loads its K and
   index-key tiles once and walks the query tiles that can see them. Per query tile it
   recomputes the teacher from the ``Hq/Hi`` main heads (one ``[BM, BN]`` product each, the only
   pass over Q K^T; the support mask is applied once per tile, not per head, and the head mean
   is folded into the exponent), the student from the index product, adds the KL and
   ``dz^T q_idx`` (the index-key gradient of its own rows, in registers: deterministic), and
   adds ``dz k_idx`` to the index-query gradient. Tiles come by bulk tensor copies (host
   ``TensorDescriptor``). Several programs add to one query row, so that sum is kept in
   **packed fixed point**: two signed 32-bit fields per int64 (columns ``2c`` and ``2c + 1``),
   in units of ``bound / 2^28`` with ``bound`` the power of two at or above the index key
   head's largest finite ``|k_idx|`` (:func:`_head_bounds`; ``|dq_idx| <= 2 bound`` keeps every
   partial sum below ``2^29``, so the fields never carry into each other), each contribution
   rounded to the nearest unit. Integer addition is associative, so the result is bitwise the
   same whatever the order (deterministic). On the GPU a tile's int64 block is added by one
   bulk tensor reduction (``desc.atomic_add``); the interpreter adds the same integers with
   element atomics.

Non-finite inputs (MSA_SPEC section 7, issue 15's scheme of :mod:`._isolation`): both gradient
products are :func:`~._isolation.support_mma` (NaN exactly where a row's support meets a NaN/Inf
index row), in the ``ISO`` variant the device flag selects when ``q_idx`` or ``k_idx`` holds
NaN/Inf (:func:`~._isolation.launch_both`; finite inputs run the plain products), supports
are applied with ``where``, never by multiplying, ``lse_z`` is :func:`~._isolation.log_sum_exp`
(NaN/+inf kept) and a NaN teacher entry counts in the KL (``T != 0``), so the KL is NaN as soon
as one row's is. A NaN/Inf ``dq_idx`` entry cannot be held in fixed point: its row's tile adds 0
there and the row receives NaN by a float atomic add (only NaN is added, by the tiles that hold
one: deterministic).

Tile sizes: ``MSA_DENSE_KL_TILES="BM,BN,warps,stages"`` (default ``128,64,8,2``; sm_90 resources
of the candidates in benchmarks/NOTES.md); key tiles are dealt in order, the earliest (with the
most query tiles) first.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ._common import (
    dot_flags, interpreting, launch_options, mma, student_row_stats, support_mask, tile_rows,
)
from ._isolation import launch_both, log_sum_exp, nonfinite, nonfinite_flag, skip, support_mma

TILES_ENV = "MSA_DENSE_KL_TILES"
_DEFAULT_TILES = (128, 64, 8, 2)
# dq_idx fixed point: two signed 32-bit fields per int64 (columns 2c and 2c + 1), one unit is
# bound / _FIELD_RANGE with bound the power of two at or above the index key head's largest
# finite |k_idx| (_head_bounds). |dq_idx| before scaling is at most sum_u |dz| max |k_idx| <=
# 2 bound (teacher and student rows each sum to 1), so every partial sum stays below 2^29, a
# quarter of a field.
_FIELD_RANGE = tl.constexpr(2.0 ** 28)
# dz = Qs - T lies in [-1, 1]; scaled by a power of two (exact) before it is rounded to fp16/bf16
# for the matrix products, so small differences keep their precision in fp16.
_DZ_SCALE = 4096.0
_LOG2E = 1.4426950408889634
_LOG2E_C = tl.constexpr(_LOG2E)


def tiles() -> tuple:
    """``(BM, BN, num_warps, num_stages)`` of the main kernel (``MSA_DENSE_KL_TILES``)."""
    raw = os.environ.get(TILES_ENV, "")
    if not raw:
        return _DEFAULT_TILES
    try:
        bm, bn, warps, stages = (int(x) for x in raw.split(","))
    except ValueError as err:
        raise ValueError(f"{TILES_ENV} must be 'BM,BN,warps,stages', got {raw!r}") from err
    for name, v in (("BM", bm), ("BN", bn)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{TILES_ENV}: {name} must be a power of two >= 16, got {v}")
    return bm, bn, warps, stages


@triton.jit(do_not_specialize=("Tq", "Tk"))
def _lse_z_kernel(qi_ptr, ki_ptr, qpos_ptr, qkb_ptr, lsez_ptr, Tq, Tk, iscale,
                  s_it, s_ih, s_jt, s_jh, s_zt,
                  HPK: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``lse_z[t, i]`` (natural log) over the causal row, one program per (query tile, i);
    the last query tiles (longest rows) first."""
    m = tl.num_programs(0) - 1 - tl.program_id(0)
    i = tl.program_id(1)
    j = i // HPK
    t = m * BM + tl.arange(0, BM)
    valid = t < Tq
    t64 = t.to(tl.int64)
    di = tl.arange(0, DI)
    pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
    kb = tl.load(qkb_ptr + t, mask=valid, other=0)
    qi = tl.load(qi_ptr + t64[:, None] * s_it + i * s_ih + di[None, :], mask=valid[:, None],
                 other=0.0)
    k_lo = tl.min(tl.where(valid, kb, Tk))
    k_hi = tl.max(tl.where(valid, kb + pos, -1))
    mz, lz = student_row_stats(qi, ki_ptr, j, s_jt, s_jh, kb, pos, valid, k_lo, k_hi, iscale,
                               BN, DI, UPCAST, IEEE)
    lse = log_sum_exp(mz, lz)  # NaN / +inf kept (MSA_SPEC 7)
    tl.store(lsez_ptr + t64 * s_zt + i, lse, mask=valid)


@triton.jit
def _nearest(x):
    """``x`` (fp32, ``|x| < 2^30``) rounded to the nearest integer (halves away from 0), int32
    (int64 only once packed: half the registers)."""
    return (x + tl.where(x >= 0, 0.5, -0.5)).to(tl.int32)


@triton.jit(do_not_specialize=("Tq", "Tk"))
def _dense_kl_kernel(
    q_desc, k_desc, qi_desc, ki_desc, lse_ptr, lsez_ptr, qpos_ptr, qkb_ptr, mlo_ptr, mhi_ptr,
    dqunit_ptr, dqfix_ptr, dqfix_desc, dqnan_ptr, dkpart_ptr, klpart_ptr,
    Tq, Tk, scale2, lse_shift, iscale, s_lt, s_zt,
    HI: tl.constexpr, HPI: tl.constexpr, IPG: tl.constexpr, HPK: tl.constexpr,
    D: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    GRAD: tl.constexpr, DZS: tl.constexpr, TMA_REDUCE: tl.constexpr,
    UPCAST: tl.constexpr, IEEE: tl.constexpr, ISO: tl.constexpr, bad_ptr,
):
    """Key-tile-outer pass: KL partial per program, ``dk_idx`` partial per index head, packed
    fixed-point ``dq_idx`` (module docstring). ``ISO``: the isolating products (``launch_both``);
    ``TMA_REDUCE``: ``dq_idx`` added by one bulk tensor reduction per tile (GPU), else by
    element atomics (interpreter)."""
    if skip(bad_ptr, ISO):
        return
    n = tl.program_id(0)
    i = tl.program_id(1)
    g = i // IPG
    j = i // HPK
    DH: tl.constexpr = DI // 2
    di = tl.arange(0, DI)
    krow = n * BN + tl.arange(0, BN)
    kmask = krow < Tk
    k64 = krow.to(tl.int64)
    kt = k_desc.load([n * BN, g * D])  # rows past Tk read as 0 (and are masked)
    kit = ki_desc.load([n * BN, j * DI])
    # Gradient products go through support_mma (MSA_SPEC 7): a 0 weight times a NaN/Inf index
    # row would otherwise reach every row of the tile, across sequences (ISO variant only).
    kit_bad = nonfinite(kit)
    dk = tl.zeros([BN, DI], tl.float32)
    kl_rows = tl.zeros([BM], tl.float32)
    # fixed-point units per unit of dz k_idx (x DZS): _FIELD_RANGE / bound_j (dense_kl_loss)
    dq_units = tl.load(dqunit_ptr + j)
    m_lo = tl.load(mlo_ptr + n)
    m_hi = tl.load(mhi_ptr + n)
    for m in range(m_lo, m_hi):
        t = m * BM + tl.arange(0, BM)
        valid = t < Tq
        t64 = t.to(tl.int64)
        # The teacher T = mean_h exp(s_h - lse_h) over the HPI main heads of index head i: one
        # [BM, BN] product per head, the only pass over Q K^T. No mask inside the loop: entries
        # outside a row's support (finite, +inf at worst, never NaN for finite inputs) are
        # dropped once below; the mean is folded into the exponent (lse_shift = log2 HPI).
        teacher = tl.zeros([BM, BN], tl.float32)
        for hl in range(HPI):
            h = i * HPI + hl
            qh = q_desc.load([m * BM, h * D])  # rows past Tq read as 0
            lse2 = tl.load(lse_ptr + t64 * s_lt + h, mask=valid, other=0.0) * _LOG2E_C
            teacher += tl.exp2(mma(qh, tl.trans(kt), UPCAST, IEEE) * scale2
                               - (lse2 + lse_shift)[:, None])
        pos = tl.load(qpos_ptr + t, mask=valid, other=-1)
        kb = tl.load(qkb_ptr + t, mask=valid, other=0)
        inside = support_mask(krow, kmask, kb, pos, valid)
        teacher = tl.where(inside, teacher, 0.0)
        qi = qi_desc.load([m * BM, i * DI])
        lse_z = tl.load(lsez_ptr + t64 * s_zt + i, mask=valid, other=0.0)
        # natural units, the very z of _lse_z_kernel: z - lse_z cancels exactly at large |z|
        log_qs = mma(qi, tl.trans(kit), UPCAST, IEEE) * iscale - lse_z[:, None]
        # != 0 (not > 0): a NaN teacher (non-finite q/k/lse in the row's support) makes the KL NaN
        has_t = teacher != 0  # (0 outside the support)
        log_t = tl.log(tl.where(has_t, teacher, 1.0))
        kl_rows += tl.sum(tl.where(has_t, teacher * (log_t - log_qs), 0.0), axis=1)
        if GRAD:
            dz = (tl.where(inside, tl.exp(log_qs) - teacher, 0.0) * DZS).to(qi.dtype)
            dk += support_mma(tl.trans(dz), qi, nonfinite(qi), tl.trans(inside), UPCAST, IEEE,
                              ISO)
            dq = support_mma(dz, kit, kit_bad, inside, UPCAST, IEEE, ISO)
            # (dz itself may be NaN/Inf where q, k or lse is: not isolated, MSA_SPEC 7 lets it
            # reach the row and key it belongs to; both variants keep it out of fixed point.)
            # a row holding NaN/Inf (its sum is not finite; a finite row's sum stays far below
            # the fp32 range) adds 0 here and NaN through the float channel below
            row_bad = nonfinite(tl.sum(dq, axis=1))
            x = tl.where(row_bad[:, None], 0.0, dq) * dq_units
            lo, hi = tl.split(tl.reshape(x, [BM, DH, 2]))  # columns 2c and 2c + 1
            packed = _nearest(hi).to(tl.int64) * 4294967296 + _nearest(lo).to(tl.int64)
            if TMA_REDUCE:
                dqfix_desc.atomic_add([m * BM, i * DH], packed.to(tl.uint64, bitcast=True))
            else:
                c = tl.arange(0, DH)
                tl.atomic_add(dqfix_ptr + (t64[:, None] * HI + i) * DH + c[None, :], packed,
                              mask=valid[:, None], sem="relaxed")
            # only NaN is added there, by the tiles that hold one: order-independent
            if tl.max(row_bad.to(tl.int32), axis=0) > 0:
                tl.atomic_add(dqnan_ptr + t64 * HI + i, float("nan"), mask=valid & row_bad,
                              sem="relaxed")
    tl.store(klpart_ptr + n * HI + i, tl.sum(kl_rows, axis=0))
    if GRAD:
        tl.store(dkpart_ptr + (i * Tk + k64[:, None]) * DI + di[None, :], dk * (1.0 / DZS),
                 mask=kmask[:, None])


def _descriptor(t: torch.Tensor, block) -> "TensorDescriptor":
    """A host tensor descriptor of a contiguous 2-D view (bulk tensor loads / reductions)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, list(block))


def _head_bounds(k_idx: torch.Tensor) -> torch.Tensor:
    """``[Hik]`` float64: per index key head, the smallest power of two at or above
    ``max |k_idx[:, j, :]|`` over finite entries (1 when all are 0), within ``[2^-100, 2^100]``;
    no host sync. Index head ``i``'s ``dq_idx`` is held in units of
    ``bound[i // (Hi / Hik)] / _FIELD_RANGE``."""
    mag = torch.where(torch.isfinite(k_idx), k_idx.abs(), 0).amax((0, 2)).double()  # [Hik]
    bound = torch.exp2(torch.ceil(torch.log2(mag))).clamp(2.0 ** -100, 2.0 ** 100)
    return torch.where(mag > 0, bound, torch.ones_like(bound)).contiguous()


def _unpack_fixed(packed: torch.Tensor) -> torch.Tensor:
    """``[..., Di]`` int64 sums of the two 32-bit fields of ``packed [..., Di / 2]`` (low field:
    column 2c, high field: column 2c + 1); exact while each field's sum stays below 2^31."""
    low = ((packed + 2 ** 31) & 0xFFFFFFFF) - 2 ** 31
    high = (packed - low) >> 32
    return torch.stack([low, high], dim=-1).flatten(-2)


def tile_key_bounds(q_pos: torch.Tensor, q_kbase: torch.Tensor, Tk: int, bm: int) -> tuple:
    """``(lo, hi)`` int64 ``[cdiv(Tq, bm)]``: query tile ``m`` reads key rows ``[lo[m],
    hi[m]]``, the min ``kbase`` and max ``kbase + pos`` over its rows made monotone in ``m``
    (reverse running min, running max), so each key tile is read by one contiguous range of
    query tiles, a superset of those that see it (the kernels mask per element). No host sync.
    """
    Tq = q_pos.shape[0]
    n_m = triton.cdiv(Tq, bm)
    pad = n_m * bm - Tq
    kb = q_kbase.to(torch.int64)
    last = kb + q_pos.to(torch.int64)
    lo_t = torch.nn.functional.pad(kb, (0, pad), value=Tk).view(n_m, bm).amin(1)
    hi_t = torch.nn.functional.pad(last, (0, pad), value=-1).view(n_m, bm).amax(1)
    hi_t = torch.cummax(hi_t, 0).values
    lo_t = torch.flip(torch.cummin(torch.flip(lo_t, (0,)), 0).values, (0,))
    return lo_t, hi_t


def _query_tile_ranges(q_pos: torch.Tensor, q_kbase: torch.Tensor, Tk: int, bm: int, bn: int):
    """Per key tile ``n``: the query tiles ``[m_lo, m_hi)`` that may see one of its keys
    (:func:`tile_key_bounds`). No host sync."""
    lo_t, hi_t = tile_key_bounds(q_pos, q_kbase, Tk, bm)
    starts = torch.arange(0, triton.cdiv(Tk, bn), device=q_pos.device, dtype=torch.int64) * bn
    # first m with hi_t >= start; first m with lo_t > last key of the tile
    m_lo = torch.searchsorted(hi_t.contiguous(), starts, right=False)
    m_hi = torch.searchsorted(lo_t.contiguous(), starts + (bn - 1), right=True)
    m_hi = torch.maximum(m_hi, m_lo)
    return m_lo.to(torch.int32).contiguous(), m_hi.to(torch.int32).contiguous()


def student_lse(q_idx: torch.Tensor, k_idx: torch.Tensor, q_pos: torch.Tensor,
                q_kbase: torch.Tensor, index_scale: float, bm: int, bn: int, num_warps: int = 4,
                num_stages: int | None = None) -> torch.Tensor:
    """``lse_z [Tq, Hi]`` fp32 (natural log): the student's log-normaliser over each causal row
    (:func:`_lse_z_kernel`, query tiles of ``bm`` rows, key tiles of ``bn``, ``num_warps`` warps,
    ``num_stages`` pipeline stages: None for :func:`._common.stage_options`'s); q_idx
    ``[Tq, Hi, Di]`` and k_idx ``[Tk, Hik, Di]`` with unit last stride. The launch options
    change only the order of the row sums (results agree to rounding)."""
    options = launch_options("student_lse", q_idx.dtype, {"bm": bm, "bn": bn}, num_warps,
                             num_stages)
    Tq, Hi, Di = q_idx.shape
    Tk, Hik = k_idx.shape[0], k_idx.shape[1]
    upcast, ieee = dot_flags(q_idx.dtype)
    lse_z = torch.empty((Tq, Hi), dtype=torch.float32, device=q_idx.device)
    _lse_z_kernel[(triton.cdiv(Tq, bm), Hi)](
        q_idx, k_idx, q_pos, q_kbase, lse_z, Tq, Tk, float(index_scale),
        q_idx.stride(0), q_idx.stride(1), k_idx.stride(0), k_idx.stride(1), lse_z.stride(0),
        HPK=Hi // Hik, DI=Di, BM=bm, BN=bn, UPCAST=upcast, IEEE=ieee, **options,
    )
    return lse_z


def dense_kl_loss(q, k, lse, q_idx, k_idx, q_pos, q_kbase, softmax_scale: float,
                  index_scale: float, kl_scale: float, compute_grad: bool) -> tuple:
    """``kl_scale * sum_{p,i} KL[i,p]`` over the whole causal row, and its index gradients.

    Args:
        q: ``[Tq, Hq, D]``, k: ``[Tk, Hkv, D]`` main queries / keys (read only).
        lse: ``[Tq, Hq]`` fp32 main LSE (natural log) of the dense forward.
        q_idx: ``[Tq, Hi, Di]``, k_idx: ``[Tk, Hik, Di]``; same dtype as q.
        q_pos, q_kbase: ``[Tq]`` int32 query layout (:mod:`msa_megatron.layout`).
        softmax_scale, index_scale, kl_scale: resolved floats.
        compute_grad: also return the gradients.

    Returns:
        ``(kl 0-dim fp32, dq_idx [Tq, Hi, Di] fp32 or [0], dk_idx [Tk, Hik, Di] fp32 or [0])``:
        the contract of the backend ``kl`` kernel with ``block_idx=None``.
    """
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    Hi, Di = q_idx.shape[1], q_idx.shape[2]
    Hik = k_idx.shape[1]
    dev = q.device
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if Tq == 0:
        grads = ((torch.zeros(q_idx.shape, dtype=acc, device=dev),
                  torch.zeros(k_idx.shape, dtype=acc, device=dev)) if compute_grad
                 else (q_idx.new_empty((0,)), k_idx.new_empty((0,))))
        return torch.zeros((), dtype=torch.float32, device=dev), *grads
    # bulk tensor loads want 16-byte aligned bases (a contiguous view may start anywhere)
    q, k, q_idx, k_idx = (x.contiguous() if x.contiguous().data_ptr() % 16 == 0
                          else x.contiguous().clone() for x in (q, k, q_idx, k_idx))
    lse = lse.float().contiguous()
    upcast, ieee = dot_flags(q.dtype)
    bm, bn, warps, stages = tiles()
    if interpreting() and not os.environ.get(TILES_ENV):  # small tiles: CPU time
        bm, bn, warps, stages = 16, 16, 4, 1
    elif q.dtype.itemsize > 2:  # fp32 tiles: twice the bytes (sm_90 shared memory)
        bm, bn, stages = tile_rows(bm, q.dtype), tile_rows(bn, q.dtype), 1
    scale2 = float(softmax_scale) * _LOG2E
    iscale = float(index_scale)
    lse_z = student_lse(q_idx, k_idx, q_pos, q_kbase, iscale, bm, bn)
    m_lo, m_hi = _query_tile_ranges(q_pos, q_kbase, Tk, bm, bn)
    n_tiles = triton.cdiv(Tk, bn)
    kl_part = torch.empty(n_tiles * Hi, dtype=torch.float32, device=dev)
    dh = Di // 2
    if compute_grad:
        dq_fixed = torch.zeros((Tq, Hi, dh), dtype=torch.int64, device=dev)
        dq_nan = torch.zeros((Tq, Hi), dtype=torch.float32, device=dev)
        dk_part = torch.empty((Hi, Tk, Di), dtype=torch.float32, device=dev)
        bound = _head_bounds(k_idx)  # [Hik] float64, powers of two
        dq_units = (_FIELD_RANGE.value / _DZ_SCALE / bound).float().contiguous()
    else:
        dq_fixed = torch.zeros((1, Hi, dh), dtype=torch.int64, device=dev)  # placeholders
        dq_nan = dk_part = dq_units = kl_part
    tma_reduce = not interpreting()  # the interpreter has no bulk tensor reduction
    # (bulk reductions add u64; two's complement: the same bits as the int64 sum)
    dq_desc = _descriptor(dq_fixed.view(dq_fixed.shape[0], Hi * dh).view(torch.uint64), (bm, dh))
    bad = nonfinite_flag(q_idx, k_idx)  # the operands support_mma isolates
    launch_both(
        _dense_kl_kernel, (n_tiles, Hi),
        _descriptor(q.view(Tq, Hq * D), (bm, D)), _descriptor(k.view(Tk, Hkv * D), (bn, D)),
        _descriptor(q_idx.view(Tq, Hi * Di), (bm, Di)),
        _descriptor(k_idx.view(Tk, Hik * Di), (bn, Di)),
        lse, lse_z, q_pos, q_kbase, m_lo, m_hi, dq_units, dq_fixed, dq_desc, dq_nan, dk_part,
        kl_part, Tq, Tk, scale2, math.log2(Hq // Hi), iscale, lse.stride(0), lse_z.stride(0),
        HI=Hi, HPI=Hq // Hi, IPG=Hi // Hkv, HPK=Hi // Hik, D=D, DI=Di, BM=bm, BN=bn,
        GRAD=compute_grad, DZS=_DZ_SCALE, TMA_REDUCE=tma_reduce, UPCAST=upcast, IEEE=ieee,
        bad_ptr=bad, num_warps=warps, num_stages=stages,
    )
    value = kl_part.sum() * kl_scale
    if not compute_grad:
        return value, q_idx.new_empty((0,)), k_idx.new_empty((0,))
    out_scale = float(index_scale) * float(kl_scale)
    unit = (bound / _FIELD_RANGE.value).repeat_interleave(Hi // Hik)  # [Hi]
    dq_idx = _unpack_fixed(dq_fixed).to(torch.float64) * (unit * out_scale)[None, :, None]
    dq_idx = dq_idx.to(acc) + dq_nan.to(acc)[:, :, None]
    # index heads reading one index key head, summed in a fixed order
    dk_idx = dk_part.view(Hik, Hi // Hik, Tk, Di).sum(1).transpose(0, 1) * out_scale
    return value, dq_idx.contiguous(), dk_idx.to(acc).contiguous()
