"""Dense (warm-up) mode KL with a warp-specialised Gluon pass over Q K^T (sm_90).

The contract, math and scales of :func:`.dense_kl.dense_kl_loss` (read its docstring): per
index head ``i`` the teacher ``T = mean_h exp(s_h - lse_h)``, the student
``log Qs = z - lse_z``, ``KL = sum_u T (log T - log Qs)``, ``dz = Qs - T``,
``dq_idx = sum_u dz k_idx``, ``dk_idx = sum_t dz q_idx`` (times ``index_scale * kl_scale``).
Finite inputs only (non-finite ones go to :mod:`.dense_kl`, which implements MSA_SPEC 7).

Two passes per **key chunk** ``[c0, c0 + C)`` (``C`` bounds the ``dz`` buffer, default budget
:data:`DZ_BUDGET_BYTES`), launched in order:

- **pass A** (query-tile-outer; Gluon on the GPU, :mod:`._dense_kl_gluon_kernels`; a torch
  emulation for CPU tests): program (index head ``i``, query tile ``m`` of ``BM`` rows; the
  heads of a tile side by side, the last tiles first) walks
  its key tiles ``[n_lo[m], n_hi[m])`` met with the chunk; adds its KL partial, adds ``dz k_idx``
  to the fp32 ``dq_idx`` (load + add + store; one program per rows and head per launch) and
  stores ``dz`` (times :data:`~.dense_kl._DZ_SCALE`, input dtype) into ``dz_buf [Hi, Tq_pad, C]``.
- **pass B** (key-tile-outer, plain Triton: :func:`_dk_pass_kernel`): program (key tile ``n`` of
  the chunk, index head ``i``) sums ``dz^T q_idx`` over the query tiles ``m`` with
  ``n_lo[m] <= n < n_hi[m]`` (the very arrays pass A used: it reads only tiles pass A wrote).

``n_lo`` / ``n_hi`` (:func:`key_tile_ranges`) are monotone in ``m`` (running min / max of the
tiles' key bounds, device tensors, no host sync), so each key tile's query tiles are one range
too. Every sum has a fixed order and no atomics: the result is bitwise repeatable.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import triton
import triton.language as tl

from ..host_reads import FiniteCheck, to_host
from ._common import dot_flags, interpreting, launch_options, mma
from .dense_kl import _DZ_SCALE, _LOG2E, dense_kl_loss, student_lse, tile_key_bounds
from .dense_lse_z import student_lse_finite

# the dz buffer of one key chunk: Hi x Tq x C elements of the input dtype
DZ_BUDGET_BYTES = 2 << 30
# pass A's tiles (the Gluon kernel's: one consumer warpgroup of 64 rows, key tiles of 128)
BLOCK_M, BLOCK_N = 64, 128
_HEAD_DIMS = (64, 128)
_MAX_HPI = 16
# only the layouts the H200 checks have run (results/dense_kl_gluon*_h200_s1[23].json: D, Di 64
# and 128, Hq / Hi 4 and 16, Hi / Hkv 1, 2 and 4, Hik 1 and 2, packed documents, and the CP
# layout: one CP rank's rows against all keys, gluon_probe.py --kl-child check_cp, run with the
# split pass A in session 13); False: all the kernel is written for
_VERIFIED_ONLY = True
# The launches of the two plain-Triton kernels, read at each call (a tuning run may set them:
# benchmarks/tune_dense_kl_aux.py). lse_z: (BM, BN, num_warps, num_stages or None for Triton's).
LSE_Z_TILES = (64, 64, 4, None)
# which lse_z kernel: "finite" (dense_lse_z.student_lse_finite: finite inputs, fewer
# instructions per logit; its own tiles, dense_lse_z.TILES) or "general" (dense_kl.student_lse
# with LSE_Z_TILES: NaN/Inf carried through)
LSE_Z_KERNEL = "finite"
_LSE_Z_DEFAULT = LSE_Z_TILES
# (under the interpreter while LSE_Z_TILES is the default: small tiles, CPU time)
_LSE_Z_INTERPRETED = (16, 16, 4, None)
# pass B: programs aimed at per chunk (its query tiles split into segments to reach it); warps
# (None: 8 for tiles of 64 x 128 or more, else 4); stages (None: Triton's); ALIGN: the chunk
# width is passed as a multiple of this (1: no hint; 16 lets the dz loads be 16-byte vectors);
# RANGE_CHECK: re-test n_lo[m] <= n < n_hi[m] per query tile (always true in [m_lo, m_hi): the
# ranges are monotone; the branch keeps the loads out of Triton's software pipeline)
PASS_B_PROGRAMS = 528
PASS_B_WARPS = 4
PASS_B_STAGES = None
PASS_B_ALIGN = 16
PASS_B_RANGE_CHECK = False
# pass A's Gluon kernel: "fused" (dense_kl_pass_a: one consumer warpgroup runs the heads and
# each key step's epilogue) or "split" (dense_kl_pass_a_split: teacher and epilogue
# warpgroups), and its Q / K ring depths. Measured slower on the H200 and removed (session 14,
# benchmarks/NOTES.md; in git history): part of the exp2 by an FMA-pipe polynomial, and two
# teacher warpgroups on the even and odd heads.
PASS_A = {"kernel": "split", "q_stages": 4, "kv_stages": 1, "dz_in_p": False}


def gluon_kl_supported(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                       k_idx: torch.Tensor) -> tuple:
    """``(True, "")`` when :func:`dense_kl_loss_gluon` runs these inputs, else ``(False,
    reason)``: a CUDA device of compute capability 9.x, Gluon's Hopper modules importable,
    fp16/bf16, ``D`` and ``Di`` in {64, 128}, ``Hq / Hi`` a power of two in 1..16, ``Hkv``
    and ``Hik`` dividing ``Hi``; while :data:`_VERIFIED_ONLY`, also only what the GPU checks
    have run: ``Hq / Hi`` 4 or 16, ``D = Di``, ``Hi / Hkv <= 4``, ``Hik <= 2`` (the standard
    and the CP layout both). (Finiteness is checked by the call itself, which hands non-finite
    inputs to :mod:`.dense_kl`.)"""
    if q.device.type != "cuda":
        return False, f"needs a CUDA device, inputs are on {q.device.type}"
    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return False, f"needs compute capability 9.x (sm_90), device has {major}.{minor}"
    try:
        from . import _dense_kl_gluon_kernels  # noqa: F401
    except ImportError as err:
        return False, f"triton.experimental.gluon (Hopper) not importable: {err}"
    return shape_support(q, k, q_idx, k_idx)


def shape_support(q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                  k_idx: torch.Tensor) -> tuple:
    """The dtype and shape half of :func:`gluon_kl_supported` (no device needed):
    ``(True, "")`` or ``(False, reason)``."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False, f"needs fp16/bf16 inputs, got {q.dtype}"
    if any(x.dtype != q.dtype for x in (k, q_idx, k_idx)):
        return False, "q, k, q_idx, k_idx must share a dtype"
    hq, d = q.shape[1], q.shape[2]
    hkv, hi, di, hik = k.shape[1], q_idx.shape[1], q_idx.shape[2], k_idx.shape[1]
    if d not in _HEAD_DIMS or di not in _HEAD_DIMS:
        return False, f"needs D and Di in {_HEAD_DIMS}, got D {d}, Di {di}"
    if hq % hi or not 1 <= hq // hi <= _MAX_HPI or (hq // hi) & (hq // hi - 1):
        return False, (f"needs Hq / Hi a power of two in 1..{_MAX_HPI} (the kernel's row "
                       f"ranges), got Hq {hq}, Hi {hi}")
    if hi % hkv or hi % hik:
        return False, f"needs Hkv and Hik to divide Hi, got Hkv {hkv}, Hik {hik}, Hi {hi}"
    if not _VERIFIED_ONLY:
        return True, ""
    # what the H200 checks (benchmarks/gluon_probe.py kl, --kl-child check_wide, check_cp: one
    # CP rank's rows of megatron-core's load-balanced split against all keys) have run
    g = hq // hi
    if g not in (4, 16) or d != di:
        return False, (f"Hq / Hi in (4, 16) and D = Di only until others are checked on a GPU "
                       f"(Hq / Hi {g}, D {d}, Di {di})")
    if hi // hkv > 4 or hik > 2:
        return False, (f"Hi / Hkv <= 4 and Hik <= 2 only until others are checked on a GPU "
                       f"(Hi / Hkv {hi // hkv}, Hik {hik})")
    return True, ""


def key_tile_ranges(q_pos: torch.Tensor, q_kbase: torch.Tensor, Tk: int, bm: int, bn: int):
    """``(n_lo, n_hi)`` int32 ``[cdiv(Tq, bm)]``: query tile ``m`` reads key tiles
    ``[n_lo[m], n_hi[m])``; and ``(m_lo, m_hi)`` int32 ``[cdiv(Tk, bn)]``: key tile ``n`` is read
    by query tiles in ``[m_lo[n], m_hi[n])`` (exactly those with ``n_lo[m] <= n < n_hi[m]``).

    The tiles' key bounds are :func:`.dense_kl.tile_key_bounds` (monotone in ``m``), so both
    ranges are non-decreasing: a superset of the keys each tile's rows see (the kernels mask
    per element). No host sync."""
    n_k = triton.cdiv(Tk, bn)
    lo_t, hi_t = tile_key_bounds(q_pos, q_kbase, Tk, bm)
    n_lo = torch.div(lo_t, bn, rounding_mode="floor").clamp(0, n_k)
    n_hi = torch.maximum((torch.div(hi_t, bn, rounding_mode="floor") + 1).clamp(0, n_k), n_lo)
    tiles = torch.arange(n_k, device=q_pos.device, dtype=torch.int64)
    m_lo = torch.searchsorted(n_hi.contiguous(), tiles, right=True)  # first m with n_hi > n
    m_hi = torch.maximum(torch.searchsorted(n_lo.contiguous(), tiles, right=True), m_lo)
    return tuple(x.to(torch.int32).contiguous() for x in (n_lo, n_hi, m_lo, m_hi))


def chunk_columns(Hi: int, Tq: int, Tk: int, itemsize: int, budget: int, bn: int) -> int:
    """Key columns ``C`` of one chunk: ``budget / (Hi Tq itemsize)`` rounded down to a multiple
    of ``bn``, at least ``bn``, at most the key tiles' span."""
    cols = budget // max(Hi * Tq * itemsize, 1) // bn * bn
    return min(max(cols, bn), triton.cdiv(Tk, bn) * bn)


def chunk_plan(m_lo: list, Hi: int, Tq_pad: int, n_k: int, itemsize: int, budget: int, bm: int,
               bn: int) -> list:
    """The key chunks ``[(ch_lo, ch_hi, r0)]`` (key tiles ``[ch_lo, ch_hi)``, in order, covering
    ``[0, n_k)``) whose ``dz`` buffers ``[Hi, Tq_pad - r0, (ch_hi - ch_lo) bn]`` fit ``budget``
    bytes (at least one key tile each): ``r0 = m_lo[ch_lo] bm`` is the first query row whose
    tile reads the chunk (``m_lo`` of :func:`key_tile_ranges`, non-decreasing, so no earlier
    tile reads any key tile of the chunk), at most ``Tq_pad - bm``. Rows before ``r0`` take no
    room: under causal attention the later chunks are wider (at 32K, 2 GiB, paper heads: 3
    chunks instead of 4; at 128K 35 instead of 64)."""
    plan, n = [], 0
    while n < n_k:
        r0 = min(m_lo[n] * bm, Tq_pad - bm)
        width = chunk_columns(Hi, Tq_pad - r0, (n_k - n) * bn, itemsize, budget, bn) // bn
        plan.append((n, n + width, r0))
        n += width
    return plan


@triton.jit(do_not_specialize=("Tq", "Tq_pad", "r0", "C", "ch_lo"))
def _dk_pass_kernel(dz_ptr, qi_ptr, nlo_ptr, nhi_ptr, mlo_ptr, mhi_ptr, dkpart_ptr, Tq, Tq_pad,
                    r0, C, ch_lo, s_it, s_ih, HI: tl.constexpr, DI: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                    ALIGN: tl.constexpr, RANGE_CHECK: tl.constexpr):
    """Pass B: program (key tile ``ch_lo + program_id(0)``, index head ``i``, segment ``sg`` of
    ``num_programs(2)``): ``part[sg, i, u - c0] = sum_t dz_buf[i, t, u - c0] q_idx[t, i]`` over
    the ``sg``-th equal share of the query tiles that pass A gave this key tile (fp32, in
    query-tile order; the segments are summed in order by the host); ``dz_buf`` holds rows
    ``[r0, r0 + Tq_pad)`` of each index head. ``C`` is a multiple of
    ``ALIGN``; ``RANGE_CHECK``: skip query tiles outside ``[n_lo[m], n_hi[m])`` (none are)."""
    if ALIGN > 1:
        C = C // ALIGN * ALIGN  # the same value, known to the compiler as a multiple of ALIGN
    nn = tl.program_id(0)
    i = tl.program_id(1)
    sg = tl.program_id(2)
    n = ch_lo + nn
    di = tl.arange(0, DI)
    cols = nn * BN + tl.arange(0, BN)
    acc = tl.zeros([BN, DI], tl.float32)
    m_lo = tl.load(mlo_ptr + n)
    m_hi = tl.load(mhi_ptr + n)
    share = tl.cdiv(m_hi - m_lo, tl.num_programs(2))
    m_end = tl.minimum(m_lo + (sg + 1) * share, m_hi)
    for m in range(m_lo + sg * share, m_end):
        if (not RANGE_CHECK) or ((tl.load(nlo_ptr + m) <= n) & (n < tl.load(nhi_ptr + m))):
            t = m * BM + tl.arange(0, BM)
            valid = t < Tq
            rows = (i * Tq_pad + t - r0).to(tl.int64)
            dz = tl.load(dz_ptr + rows[:, None] * C + cols[None, :], mask=valid[:, None],
                         other=0.0)
            qi = tl.load(qi_ptr + t.to(tl.int64)[:, None] * s_it + i * s_ih + di[None, :],
                         mask=valid[:, None], other=0.0)
            acc += mma(tl.trans(dz), qi, UPCAST, IEEE)
    part = (sg * HI + i).to(tl.int64) * C
    tl.store(dkpart_ptr + (part + cols[:, None]) * DI + di[None, :], acc)


def pass_b_segments(n_m: int, key_tiles: int, Hi: int, programs: int) -> int:
    """Query-tile segments of one pass-B launch: enough that ``key_tiles * Hi * segments``
    reaches ``programs`` (at least 1, at most the ``n_m`` query tiles)."""
    return max(1, min(n_m, triton.cdiv(programs, key_tiles * Hi)))


def pass_b(dz_buf: torch.Tensor, q_idx: torch.Tensor, ranges: tuple, dk_part: torch.Tensor,
           Tq: int, ch_lo: int, ch_hi: int, bm: int, bn: int, programs: int | None = None,
           num_warps: int | None = None, num_stages: int | None = None,
           align: int | None = None, range_check: bool | None = None, r0: int = 0) -> None:
    """Pass B of the chunk of key tiles ``[ch_lo, ch_hi)``: ``dk_part[i, u] = sum_t
    dz_buf[i, t, u - ch_lo bn] q_idx[t, i]`` (:func:`_dk_pass_kernel`, then its segments added
    in order) for the chunk's key columns ``u``.

    dz_buf ``[Hi, R, C]``: rows ``[r0, r0 + R)`` of each index head (``C`` a multiple of
    ``bn``; the chunk's key tiles are read by no query tile before ``r0 / bm``), q_idx
    ``[Tq, Hi, Di]`` (unit last stride), ranges ``(n_lo, n_hi, m_lo, m_hi)`` of :func:`key_tile_ranges`, dk_part
    ``[Hi, >= ch_hi bn, Di]`` fp32. The launch options default to the module's ``PASS_B_*``
    constants (read at each call); ``programs`` changes the order of the sums, the others do
    not change the result."""
    programs = PASS_B_PROGRAMS if programs is None else programs
    num_warps = PASS_B_WARPS if num_warps is None else num_warps
    num_stages = PASS_B_STAGES if num_stages is None else num_stages
    align = PASS_B_ALIGN if align is None else align
    range_check = PASS_B_RANGE_CHECK if range_check is None else range_check
    Hi, Tq_pad, cols = dz_buf.shape
    Di = q_idx.shape[2]
    if num_warps is None:
        num_warps = 8 if bm * bn >= 64 * 128 else 4
    options = launch_options("pass_b", None, {"bm": bm, "bn": bn}, num_warps, num_stages)
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"pass_b: programs must be an int >= 1, got {programs!r}")
    if not isinstance(align, int) or align < 1 or cols % align:
        raise ValueError(f"pass_b: align must be an int >= 1 dividing the chunk width {cols}, "
                         f"got {align!r}")
    n_lo, n_hi, m_lo, m_hi = ranges
    segs = pass_b_segments(len(n_lo), ch_hi - ch_lo, Hi, programs)
    part = torch.empty((segs, Hi, cols, Di), dtype=torch.float32, device=dz_buf.device)
    upcast, ieee = dot_flags(q_idx.dtype)
    _dk_pass_kernel[(ch_hi - ch_lo, Hi, segs)](
        dz_buf, q_idx, n_lo, n_hi, m_lo, m_hi, part, Tq, Tq_pad, r0, cols, ch_lo,
        q_idx.stride(0), q_idx.stride(1), HI=Hi, DI=Di, BM=bm, BN=bn, UPCAST=upcast,
        IEEE=ieee, ALIGN=align, RANGE_CHECK=bool(range_check), **options,
    )
    width = (ch_hi - ch_lo) * bn
    dk_part[:, ch_lo * bn:ch_lo * bn + width] = part[:, :, :width].sum(0)


class _Launch:
    """What one pass-A launch sees: the inputs, the tile ranges and the chunk's buffers."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def pass_a_torch(a: _Launch) -> None:
    """Pass A of one chunk in torch (fp32 math, the kernel's tile ranges and rounding): the CPU
    stand-in of the Gluon kernel; adds to ``a.dq``, stores ``a.dz_buf`` tiles and ``a.kl_part``."""
    bm, bn, hpi = a.bm, a.bn, a.Hq // a.Hi
    n_lo, n_hi = a.n_lo.tolist(), a.n_hi.tolist()
    for m in range(len(n_lo)):
        lo, hi = max(n_lo[m], a.ch_lo), min(n_hi[m], a.ch_hi)
        t = torch.arange(m * bm, m * bm + bm, device=a.q.device)
        valid = t < a.Tq
        tv = t.clamp(max=a.Tq - 1)
        if hi <= lo:
            a.kl_part[m * a.Hi:(m + 1) * a.Hi] = 0.0
            continue
        u = torch.arange(lo * bn, hi * bn, device=a.q.device)
        uv = u.clamp(max=a.Tk - 1)
        uin = u < a.Tk
        kb, last = a.q_kbase[tv].long(), a.q_kbase[tv].long() + a.q_pos[tv].long()
        inside = (u[None] >= kb[:, None]) & (u[None] <= last[:, None]) & valid[:, None]
        for i in range(a.Hi):
            g, j = i // (a.Hi // a.Hkv), i // (a.Hi // a.Hik)
            kt = torch.where(uin[:, None], a.k[uv, g].float(), 0.0)
            kit = torch.where(uin[:, None], a.k_idx[uv, j].float(), 0.0)
            p = torch.zeros(bm, u.numel(), device=a.q.device)
            for h in range(i * hpi, (i + 1) * hpi):
                qh = torch.where(valid[:, None], a.q[tv, h].float(), 0.0)
                lse2 = torch.where(valid, a.lse2[h, tv], 0.0)
                p += torch.exp2(qh @ kt.T * a.scale2 - lse2[:, None])
            teacher = torch.where(inside, p, 0.0)
            qi = torch.where(valid[:, None], a.q_idx[tv, i].float(), 0.0)
            log_qs = qi @ kit.T * a.iscale - torch.where(valid, a.lse_z[tv, i], 0.0)[:, None]
            has_t = teacher != 0
            log_t = torch.log(torch.where(has_t, teacher, 1.0))
            kl = torch.where(has_t, teacher * (log_t - log_qs), 0.0).sum()
            a.kl_part[m * a.Hi + i] = kl
            if a.grad:
                dz = (torch.where(inside, torch.exp(log_qs) - teacher, 0.0) * _DZ_SCALE)
                dz = dz.to(a.q.dtype)
                c = slice((lo - a.ch_lo) * bn, (hi - a.ch_lo) * bn)
                # (TMA drops rows outside the buffer; a slice would wrap a negative one)
                assert a.r0 <= m * bm and (m + 1) * bm - a.r0 <= a.dz_buf.shape[1]
                a.dz_buf[i, m * bm - a.r0:(m + 1) * bm - a.r0, c] = dz
                rows = t[valid]
                a.dq[rows, i] += (dz.float() @ kit)[valid]


def split_rings(G: int) -> tuple:
    """``(QS, KS, DZ_IN_P)`` of the split pass A (:data:`PASS_A`, read at each call) for ``G``
    query heads per index head. ValueError naming the key unless ``q_stages`` and
    ``kv_stages`` are ints >= 1, ``q_stages >= 2`` when ``G >= 2`` (the teacher waits for
    head ``jj + 1``'s Q tile before it releases head ``jj``'s slot: one slot would hang the
    GPU) and ``dz_in_p`` a bool."""
    qs, ks, dz_in_p = PASS_A["q_stages"], PASS_A["kv_stages"], PASS_A["dz_in_p"]
    if not isinstance(qs, int) or qs < (2 if G >= 2 else 1):
        raise ValueError(f"PASS_A['q_stages'] must be an int >= {2 if G >= 2 else 1} for "
                         f"Hq / Hi = {G} (one Q slot deadlocks the head loop), got {qs!r}")
    if not isinstance(ks, int) or ks < 1:
        raise ValueError(f"PASS_A['kv_stages'] must be an int >= 1, got {ks!r}")
    if not isinstance(dz_in_p, bool):
        raise ValueError(f"PASS_A['dz_in_p'] must be a bool, got {dz_in_p!r}")
    return qs, ks, dz_in_p


def pass_a_gluon(a: _Launch) -> None:
    """Pass A of one chunk by the Gluon kernel (:mod:`._dense_kl_gluon_kernels`)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from . import _dense_kl_gluon_kernels as kern

    gdt = gl.bfloat16 if a.q.dtype == torch.bfloat16 else gl.float16

    def desc(x, block):
        view = x.view(x.shape[0], -1)
        layout = gl.NVMMASharedLayout.get_default_for(block, gdt)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), block, layout)

    D, Di = a.q.shape[2], a.q_idx.shape[2]
    G = a.Hq // a.Hi
    if PASS_A["kernel"] == "split":
        qs, ks, dz_in_p = split_rings(G)
        kern.dense_kl_pass_a_split[(a.Hi, len(a.n_lo))](
            desc(a.q, [a.bm, D]), desc(a.k, [a.bn, D]), desc(a.q_idx, [a.bm, Di]),
            desc(a.k_idx, [a.bn, Di]), desc(a.dz_buf.view(-1, a.dz_buf.shape[-1]), [a.bm, a.bn]),
            a.lse2, a.lse_z, a.q_pos, a.q_kbase, a.n_lo, a.n_hi, a.dq, a.kl_part, a.Tq,
            a.dz_buf.shape[1], a.r0, a.ch_lo, a.ch_hi, a.scale2, a.iscale, HI=a.Hi, G=G,
            IPG=a.Hi // a.Hkv, HPK=a.Hi // a.Hik, BM=a.bm, BN=a.bn, D=D, DI=Di, QS=qs, KS=ks,
            GRAD=a.grad, DZS=_DZ_SCALE, DZ_IN_P=dz_in_p,
            EPILOGUE_REGS=kern.EPILOGUE_REGS, PRODUCER_REGS=kern.PRODUCER_REGS,
            num_warps=kern.WARPS,
        )
        return
    if PASS_A["kernel"] != "fused":
        raise ValueError(f"PASS_A['kernel'] must be 'fused' or 'split', got {PASS_A['kernel']!r}")
    kern.dense_kl_pass_a[(a.Hi, len(a.n_lo))](
        desc(a.q, [a.bm, D]), desc(a.k, [a.bn, D]), desc(a.q_idx, [a.bm, Di]),
        desc(a.k_idx, [a.bn, Di]), desc(a.dz_buf.view(-1, a.dz_buf.shape[-1]), [a.bm, a.bn]),
        a.lse2, a.lse_z, a.q_pos, a.q_kbase, a.n_lo, a.n_hi, a.dq, a.kl_part, a.Tq,
        a.dz_buf.shape[1], a.r0, a.ch_lo, a.ch_hi, a.scale2, a.iscale, HI=a.Hi, G=G,
        IPG=a.Hi // a.Hkv, HPK=a.Hi // a.Hik, BM=a.bm, BN=a.bn, D=D, DI=Di, QS=kern.Q_STAGES, KS=kern.KV_STAGES,
        KI_AT=min(2, G - 1), GRAD=a.grad, DZS=_DZ_SCALE,
        PRODUCER_REGS=kern.PRODUCER_REGS, num_warps=kern.WARPS,
    )


def dense_kl_chunked(q, k, lse, q_idx, k_idx, q_pos, q_kbase, softmax_scale: float,
                     index_scale: float, kl_scale: float, compute_grad: bool,
                     pass_a: Callable[[_Launch], None], bm: int = BLOCK_M, bn: int = BLOCK_N,
                     budget: int | None = None, dz_fill: float | None = None) -> tuple:
    """The key-chunk orchestration (module docstring) with pass A swappable
    (:func:`pass_a_gluon` on the GPU, :func:`pass_a_torch` in CPU tests); pass B
    (:func:`pass_b`, launched as the ``PASS_B_*`` constants say) and ``lse_z`` (as
    :data:`LSE_Z_KERNEL` says: :func:`.dense_lse_z.student_lse_finite` with its own tiles, or
    :func:`.dense_kl.student_lse` with :data:`LSE_Z_TILES`) are the Triton kernels. Arguments
    and result as :func:`.dense_kl.dense_kl_loss`; ``bm``, ``bn``: pass A's tiles (pass B's
    too); ``budget``: bytes of the ``dz`` buffer (None: :data:`DZ_BUDGET_BYTES`, read at each
    call); ``dz_fill``: fill the buffer with this value
    first (tests: unwritten tiles show)."""
    Tq, Hq, D = q.shape
    Tk, Hkv, _ = k.shape
    Hi, Di = q_idx.shape[1], q_idx.shape[2]
    Hik = k_idx.shape[1]
    dev = q.device
    budget = DZ_BUDGET_BYTES if budget is None else budget
    q, k, q_idx, k_idx = (x.contiguous() if x.contiguous().data_ptr() % 16 == 0
                          else x.contiguous().clone() for x in (q, k, q_idx, k_idx))
    lse = lse.float().contiguous()
    lse_tiles = (_LSE_Z_INTERPRETED if interpreting() and LSE_Z_TILES == _LSE_Z_DEFAULT
                 else LSE_Z_TILES)
    ranges = key_tile_ranges(q_pos, q_kbase, Tk, bm, bn)
    n_lo, n_hi = ranges[:2]
    n_m, n_k = triton.cdiv(Tq, bm), triton.cdiv(Tk, bn)
    Tq_pad = n_m * bm
    if compute_grad:  # the chunk plan reads m_lo on the host, copied while lse_z runs
        m_lo_host, copied = to_host(ranges[2])
    if LSE_Z_KERNEL == "finite":  # the callers hand finite inputs only
        lse_z = student_lse_finite(q_idx, k_idx, q_pos, q_kbase, index_scale)
    elif LSE_Z_KERNEL == "general":
        lse_z = student_lse(q_idx, k_idx, q_pos, q_kbase, index_scale, *lse_tiles)
    else:
        raise ValueError(f"LSE_Z_KERNEL must be 'finite' or 'general', got {LSE_Z_KERNEL!r}")
    if compute_grad:
        if copied is not None:
            copied.synchronize()
        plan = chunk_plan(m_lo_host.tolist(), Hi, Tq_pad, n_k, q.element_size(), budget, bm, bn)
    else:
        plan = [(0, n_k, 0)]
    # per program of a launch; added into kl_total after each chunk (fixed order), so the KL
    # buffers stay [n_m Hi] whatever the chunk count (a [chunks, n_m Hi] one grows as T^3)
    kl_part = torch.empty(n_m * Hi, dtype=torch.float32, device=dev)
    kl_total = torch.zeros(n_m * Hi, dtype=torch.float32, device=dev)
    dq = torch.zeros((Tq, Hi, Di) if compute_grad else (1,), dtype=torch.float32, device=dev)
    dk_part = torch.empty((Hi, n_k * bn, Di) if compute_grad else (1,), dtype=torch.float32,
                          device=dev)
    if compute_grad:  # one buffer, viewed per chunk as [Hi, rows, columns]
        flat = torch.empty(max(Hi * (Tq_pad - r0) * (hi - lo) * bn for lo, hi, r0 in plan),
                           dtype=q.dtype, device=dev)
    # the head mean folded into the exponent: lse log2e + log2 G, [Hq, Tq]
    lse2 = (lse * _LOG2E + math.log2(Hq // Hi)).t().contiguous()
    for ch_lo, ch_hi, r0 in plan:
        cols = (ch_hi - ch_lo) * bn
        if compute_grad:
            dz_buf = flat[:Hi * (Tq_pad - r0) * cols].view(Hi, Tq_pad - r0, cols)
            if dz_fill is not None:  # every chunk's unwritten tiles show
                dz_buf.fill_(dz_fill)
        else:
            dz_buf = q.new_empty((1, bm, bn))  # unused (descriptor)
        kl_part.zero_()  # programs with no key tile in the chunk add nothing
        pass_a(_Launch(q=q, k=k, q_idx=q_idx, k_idx=k_idx, lse2=lse2, lse_z=lse_z, q_pos=q_pos,
                       q_kbase=q_kbase, n_lo=n_lo, n_hi=n_hi, dz_buf=dz_buf, dq=dq,
                       kl_part=kl_part, Tq=Tq, Tk=Tk, Tq_pad=Tq_pad, r0=r0, C=cols,
                       ch_lo=ch_lo, ch_hi=ch_hi, Hq=Hq, Hkv=Hkv, Hi=Hi, Hik=Hik, bm=bm, bn=bn,
                       scale2=float(softmax_scale) * _LOG2E, iscale=float(index_scale),
                       grad=compute_grad))
        if compute_grad:
            pass_b(dz_buf, q_idx, ranges, dk_part, Tq, ch_lo, ch_hi, bm, bn, r0=r0)
        kl_total += kl_part
    value = kl_total.sum() * kl_scale
    if not compute_grad:
        return value, q_idx.new_empty((0,)), k_idx.new_empty((0,))
    out_scale = float(index_scale) * float(kl_scale) / _DZ_SCALE
    # index heads reading one index key head, summed in a fixed order
    dk_idx = dk_part[:, :Tk].reshape(Hik, Hi // Hik, Tk, Di).sum(1).transpose(0, 1) * out_scale
    return value, dq * out_scale, dk_idx.contiguous()


def dense_kl_loss_gluon(q, k, lse, q_idx, k_idx, q_pos, q_kbase, softmax_scale: float,
                        index_scale: float, kl_scale: float, compute_grad: bool) -> tuple:
    """:func:`.dense_kl.dense_kl_loss` with pass A in Gluon (module docstring); same arguments,
    result and scales; deterministic. Raises ValueError naming the reason when
    :func:`gluon_kl_supported` says no. Inputs holding NaN/Inf get the result of
    :func:`.dense_kl.dense_kl_loss`, which implements MSA_SPEC 7: the finiteness flag (one fp32
    sum per tensor of ``lse``, ``k``, ``q_idx``, ``k_idx``, on the device; ``lse`` must be the
    attention's of these ``q``, ``k``: its finiteness covers ``q``'s) is copied to the host as
    soon as it is computed and read only after the Gluon passes are queued
    (:class:`~msa_megatron.ops.host_reads.FiniteCheck`): the host waits for the sums, not for
    the passes, and goes on queuing the backward while they run. When it is set, the Gluon
    result (which only wrote fresh buffers) is dropped and the Triton pass runs. (Reading it
    before queuing the passes cost ~2.5 ms at 32K: the GPU idled while the host launched them;
    reading it with a stream sync after them left the GPU idle from the last pass until the
    backward's first launch.)"""
    ok, why = gluon_kl_supported(q, k, q_idx, k_idx)
    if not ok:
        raise ValueError(f"dense_kl_loss_gluon: unsupported inputs: {why}")
    args = (q, k, lse, q_idx, k_idx, q_pos, q_kbase, softmax_scale, index_scale, kl_scale,
            compute_grad)
    if q.shape[0] == 0:
        return dense_kl_loss(*args)
    # one fp32 sum per tensor, no temporary of its size (isfinite would make ~5 bytes/element).
    # q is not summed (0.5 GB at 32K, ~0.17 ms): lse is its attention's (the contract), and a
    # NaN/Inf in query row p makes every score of the row NaN or +-Inf (all -Inf: lse -Inf), so
    # lse[p] is non-finite. k is: an Inf key can give -Inf scores only, leaving lse finite.
    check = FiniteCheck(lse, k, q_idx, k_idx)
    result = dense_kl_chunked(*args, pass_a=pass_a_gluon)
    if not check.ok():  # waits for the sums only: the passes keep the GPU busy
        return dense_kl_loss(*args)
    return result
