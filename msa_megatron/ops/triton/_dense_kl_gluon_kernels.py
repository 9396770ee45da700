"""Pass A of the Gluon dense KL (:mod:`.dense_kl_gluon`): the warp-specialised sm_90 kernel.

Imported only when Gluon's Hopper modules are importable
(:func:`.dense_kl_gluon.gluon_kl_supported`).
Program = (index head ``i``, query tile ``m`` of ``BM = 64`` rows) over the key tiles
``[lo, hi)`` of its range met with the current key chunk. Built on the probe kernel
``gluon_bn128`` of ``benchmarks/gluon_probe.py`` (its traps apply: heads unrolled by
``static_range``, no product in flight across the key loop's back edge, a thread barrier before
each slot release, the heads' LSE rows staged in shared memory):

- producer (1 warp): the ``q_idx`` tile once; per key step the K and ``k_idx`` tiles into ring
  slot ``c % KS``, then the ``G = Hq / Hi`` heads' Q tiles into the Q ring (TMA, mbarriers);
- consumer (one warpgroup): per key step the ``G`` products ``S_h = Q_h K^T`` as async wgmma,
  each issued before the previous head's exp2, the student product ``z = q_idx k_idx^T`` issued
  before the last head's exp2; then the support mask, the KL partial, ``dz = Qs - T`` (times
  ``DZS``, rounded to the input dtype) stored to the chunk's ``dz`` buffer and
  ``acc += dz k_idx`` (``acc`` in shared memory between key steps). At the end the tile's
  ``dq_idx`` partial is added to the global fp32 ``dq_idx`` by load + add + store (one program
  per (rows, head) per launch: deterministic).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_M, BLOCK_N, Q_STAGES, KV_STAGES, WARPS, PRODUCER_REGS = 64, 128, 3, 2, 4, 40
# the split kernel (dense_kl_pass_a_split): registers of its epilogue warpgroup (the teacher
# warpgroup, the default partition, gets what the launch's 12 warps leave)
EPILOGUE_REGS = 232


@gluon.jit
def _log2_approx(x):
    """``log2 x`` by ``lg2.approx`` (MUFU; relative error ~2^-22): ``gl.log`` lowers to the
    libdevice routine, whose temporaries over a [64, 128] tile exhausted the registers."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _log2_ftz(x):
    """``log2 x`` by ``lg2.approx.ftz`` (normal inputs: no subnormal fix-up instructions)."""
    return gl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _exp2_ftz(x):
    """``2^x`` by ``ex2.approx.ftz`` (``gl.exp2`` outside the head loop came out without ftz:
    a compare and two multiplies more per element)."""
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _barriers(N: gl.constexpr):
    """``N`` mbarriers in shared memory (``[N, 1]``), each initialised with count 1."""
    bars = gl.allocate_shared_memory(gl.int64, [N, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(N):
        mbarrier.init(bars.index(s), count=1)
    return bars


@gluon.jit
def _program(nlo_ptr, nhi_ptr, ch_lo, ch_hi):
    """``(i, m, lo, hi)`` of this program: index head ``i`` and query tile ``m`` of the grid
    ``(Hi, query tiles)`` (a query tile's index heads side by side, the longest tiles, the
    causal triangle's last rows, first: the launch's tail is its shortest), and its key tiles
    ``[lo, hi)`` met with the chunk ``[ch_lo, ch_hi)``."""
    i = gl.program_id(0)
    m = gl.num_programs(1) - 1 - gl.program_id(1)
    lo = gl.maximum(gl.load(nlo_ptr + m), ch_lo)
    hi = gl.minimum(gl.load(nhi_ptr + m), ch_hi)
    return i, m, lo, hi


@gluon.jit
def _producer(q_desc, k_desc, qi_desc, ki_desc, q_smem, k_smem, ki_smem, qi_smem, q_ready,
              q_empty, kv_ready, kv_empty, ki_ready, ki_empty, qi_ready, m, i, g, j, lo, hi,
              G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
              DI: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr, KI_AT: gl.constexpr):
    """Producer partition (1 warp): TMA loads into the rings, each once its slot is free. The
    ``k_idx`` tile has one slot (shared memory), loaded before Q tile ``KI_AT`` of the step: the
    fused kernel loads it after the step's first two Q tiles (so those are not held up by the
    previous step's end, which frees it), the split kernel before the last one (its slot frees
    when the epilogue of the previous step ends)."""
    if hi > lo:
        mbarrier.expect(qi_ready.index(0), qi_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(qi_desc, [m * BM, i * DI], qi_ready.index(0), qi_smem)
    qc = 0
    for n in range(lo, hi):
        c = n - lo
        slot = c % KS
        mbarrier.wait(kv_empty.index(slot), ((c // KS) & 1) ^ 1)  # first round: passes
        mbarrier.expect(kv_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [n * BN, g * D], kv_ready.index(slot),
                                        k_smem.index(slot))
        for jj in range(G):
            if jj == KI_AT:
                mbarrier.wait(ki_empty.index(0), (c & 1) ^ 1)
                mbarrier.expect(ki_ready.index(0), ki_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(ki_desc, [n * BN, j * DI], ki_ready.index(0),
                                                ki_smem)
            qs = qc % QS
            mbarrier.wait(q_empty.index(qs), ((qc // QS) & 1) ^ 1)
            mbarrier.expect(q_ready.index(qs), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [m * BM, (i * G + jj) * D],
                                            q_ready.index(qs), q_smem.index(qs))
            qc += 1


@gluon.jit
def _consumer(dz_desc, lse2_ptr, lsez_ptr, qpos_ptr, qkb_ptr, dq_ptr, klpart_ptr, q_smem,
              k_smem, ki_smem, qi_smem, dz_smem, q_ready, q_empty, kv_ready, kv_empty, ki_ready,
              ki_empty, qi_ready, m, i, lo, hi, ch_lo, Tq, Tq_pad, r0, HI, scale2, iscale,
              G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, DI: gl.constexpr,
              QS: gl.constexpr, KS: gl.constexpr, GRAD: gl.constexpr, DZS: gl.constexpr,
              WARPS: gl.constexpr):
    """Consumer partition (the default one, one warpgroup): teacher, student, KL, dz, dq."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, DI, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows = m * BM + gl.arange(0, BM, layout=row_l)
    valid = rows < Tq
    pos = gl.load(qpos_ptr + rows, mask=valid, other=-1)
    kb = gl.load(qkb_ptr + rows, mask=valid, other=0)
    ke = kb + pos  # the row's last key
    lse_z = gl.load(lsez_ptr + rows * HI + i, mask=valid, other=0.0)
    # the G heads' lse2 rows ([Hq, Tq]: lse log2e + log2 G) staged once in shared memory
    flat = gl.arange(0, G * BM, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    lr = m * BM + flat % BM
    lse_tile = gl.load(lse2_ptr + (i * G + flat // BM) * Tq + lr, mask=lr < Tq, other=0.0)
    lse_smem = gl.allocate_shared_memory(gl.float32, [G * BM],
                                         gl.SwizzledSharedLayout(1, 1, 1, [0]), lse_tile)
    gl.thread_barrier()
    zero_s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    kl_rows = gl.zeros([BM], gl.float32, layout=row_l)
    if GRAD:
        acc_smem = gl.allocate_shared_memory(gl.float32, [BM, DI],
                                             gl.SwizzledSharedLayout(1, 1, 1, [1, 0]),
                                             gl.zeros([BM, DI], gl.float32, layout=o_layout))
    if hi > lo:
        mbarrier.wait(qi_ready.index(0), 0)
    qc = 0
    for n in range(lo, hi):
        c = n - lo
        slot = c % KS
        mbarrier.wait(kv_ready.index(slot), (c // KS) & 1)
        kt = k_smem.index(slot).permute((1, 0))  # [D, BN]
        mbarrier.wait(q_ready.index(qc % QS), (qc // QS) & 1)
        s_next = warpgroup_mma(q_smem.index(qc % QS), kt, zero_s, use_acc=False, is_async=True)
        p = zero_s
        for jj in gl.static_range(G):
            s_now = s_next
            if jj + 1 < G:  # issue head jj + 1's product before head jj's exp2
                qn = qc + 1
                mbarrier.wait(q_ready.index(qn % QS), (qn // QS) & 1)
                s_next = warpgroup_mma(q_smem.index(qn % QS), kt, zero_s, use_acc=False,
                                       is_async=True)
            else:  # the student product runs under the last head's exp2
                mbarrier.wait(ki_ready.index(0), c & 1)
                s_next = warpgroup_mma(qi_smem, ki_smem.permute((1, 0)), zero_s, use_acc=False,
                                       is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_now, ))
            gl.thread_barrier()  # every warp's reads of the Q slot done: the arrive is thread 0's
            mbarrier.arrive(q_empty.index(qc % QS), count=1)
            lse2 = lse_smem.slice(jj * BM, BM).load(row_l)
            p += gl.exp2(s * scale2 - lse2[:, None])
            qc += 1
        z = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))
        cols = n * BN + gl.arange(0, BN, layout=col_l)
        inside = ((cols[None, :] >= kb[:, None]) & (cols[None, :] <= ke[:, None])
                  & valid[:, None])
        teacher = gl.where(inside, p, 0.0)
        log_qs = z * iscale - lse_z[:, None]  # natural units, as dense_kl.py
        has_t = teacher != 0
        log_t = _log2_approx(gl.where(has_t, teacher, 1.0)) * LN2
        kl_rows += gl.sum(gl.where(has_t, teacher * (log_t - log_qs), 0.0), axis=1)
        if GRAD:
            dz = (gl.where(inside, gl.exp(log_qs) - teacher, 0.0) * DZS).to(qi_smem.dtype)
            # dz through shared memory: the A operand of dz k_idx and a TMA store to the chunk
            # buffer (a [BM, BN] pointer tensor would be hoisted out of the loop: 128 registers)
            tma.store_wait(0)  # the previous step's store has read dz_smem
            gl.thread_barrier()
            dz_smem.store(dz)
            fence_async_shared()
            gl.thread_barrier()
            # the chunk's buffer holds rows [r0, r0 + Tq_pad) of each index head
            tma.async_copy_shared_to_global(dz_desc,
                                            [i * Tq_pad + m * BM - r0, (n - ch_lo) * BN],
                                            dz_smem)
            acc = acc_smem.load(o_layout)  # each thread reads back what it wrote
            acc = warpgroup_mma(dz_smem, ki_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            acc_smem.store(acc)
        gl.thread_barrier()
        mbarrier.arrive(kv_empty.index(slot), count=1)
        mbarrier.arrive(ki_empty.index(0), count=1)
    gl.store(klpart_ptr + m * HI + i, gl.sum(kl_rows, axis=0))
    if GRAD:
        tma.store_wait(0)
        if hi > lo:
            acc = acc_smem.load(o_layout)
            out_rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
            out_cols = gl.arange(0, DI, layout=gl.SliceLayout(0, o_layout))
            ptrs = dq_ptr + (out_rows.to(gl.int64)[:, None] * HI + i) * DI + out_cols[None, :]
            keep = out_rows[:, None] < Tq
            gl.store(ptrs, gl.load(ptrs, mask=keep, other=0.0) + acc, mask=keep)


# one compile per shape class
@gluon.jit(do_not_specialize=("Tq", "Tq_pad", "r0", "ch_lo", "ch_hi"))
def dense_kl_pass_a(q_desc, k_desc, qi_desc, ki_desc, dz_desc, lse2_ptr, lsez_ptr, qpos_ptr,
                    qkb_ptr, nlo_ptr, nhi_ptr, dq_ptr, klpart_ptr, Tq, Tq_pad, r0, ch_lo, ch_hi,
                    scale2, iscale, HI: gl.constexpr, G: gl.constexpr, IPG: gl.constexpr,
                    HPK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                    DI: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr, KI_AT: gl.constexpr,
                    GRAD: gl.constexpr,
                    DZS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Program (query tile ``m``, index head ``i``; the last query tiles first): key tiles
    ``[max(n_lo[m], ch_lo), min(n_hi[m], ch_hi))``; rings and barriers, then the consumer
    (default partition) and the producer (1 worker warp). The chunk's ``dz`` buffer is
    ``[HI Tq_pad, C]``: rows ``[r0, r0 + Tq_pad)`` of each index head (every program with a key
    tile in the chunk has ``m BM >= r0``)."""
    i, m, lo, hi = _program(nlo_ptr, nhi_ptr, ch_lo, ch_hi)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QS, BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KS, BN, D], k_desc.layout)
    ki_smem = gl.allocate_shared_memory(ki_desc.dtype, [BN, DI], ki_desc.layout)
    qi_smem = gl.allocate_shared_memory(qi_desc.dtype, [BM, DI], qi_desc.layout)
    dz_smem = gl.allocate_shared_memory(dz_desc.dtype, [BM, BN], dz_desc.layout)
    q_ready, q_empty = _barriers(QS), _barriers(QS)
    kv_ready, kv_empty = _barriers(KS), _barriers(KS)
    ki_ready, ki_empty, qi_ready = _barriers(1), _barriers(1), _barriers(1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (dz_desc, lse2_ptr, lsez_ptr, qpos_ptr, qkb_ptr, dq_ptr, klpart_ptr, q_smem,
                     k_smem, ki_smem, qi_smem, dz_smem, q_ready, q_empty, kv_ready, kv_empty,
                     ki_ready, ki_empty, qi_ready, m, i, lo, hi, ch_lo, Tq, Tq_pad, r0, HI,
                     scale2, iscale, G, BM, BN, DI, QS, KS, GRAD, DZS, num_warps)),
        (_producer, (q_desc, k_desc, qi_desc, ki_desc, q_smem, k_smem, ki_smem, qi_smem,
                     q_ready, q_empty, kv_ready, kv_empty, ki_ready, ki_empty, qi_ready, m, i,
                     i // IPG, i // HPK, lo, hi, G, BM, BN, D, DI, QS, KS, KI_AT)),
    ], [1], [PRODUCER_REGS])


# --- pass A, split: the teacher loop and the per-key-step epilogue in two warpgroups -------------
#
# The fused kernel above runs each key step's epilogue (student product, support mask, KL, dz,
# its TMA store and ``dz k_idx``) after the G heads' products in the same warpgroup: the tensor
# pipe idles through it (pass A 31.8 ms at paper 32K against 21.1 for the teacher loop alone).
# Here the teacher warpgroup (default partition) only runs the head loop and hands the step's
# unmasked teacher sum ``p`` (fp32, one shared slot) to an epilogue warpgroup (worker), which
# runs the rest of step ``n`` while the teacher computes step ``n + 1``; ``dq_idx``'s partial
# stays in the epilogue's registers. The producer warp (``_producer``, ``KI_AT = G - 1``) loads
# ``k_idx`` of step ``n`` just before the step's last Q tile: its one slot frees when the
# epilogue of step ``n - 1`` ends.


@gluon.jit
def _q_slot(c, jj: gl.constexpr, G: gl.constexpr, QS: gl.constexpr):
    """``(slot, phase)`` of head ``jj``'s Q tile in key step ``c`` (the ring's ``c G + jj``-th
    tile): compile-time constants when ``QS`` divides ``G`` (and ``G / QS`` is even)."""
    if G % QS == 0:
        if (G // QS) % 2 == 0:
            return jj % QS, (jj // QS) & 1
        return jj % QS, (c + jj // QS) & 1
    qc = c * G + jj
    return qc % QS, (qc // QS) & 1


@gluon.jit
def _teacher_split(lse2_ptr, q_smem, k_smem, p_smem, q_ready, q_empty, kv_ready, kv_empty,
                   p_ready, p_empty, m, i, lo, hi, Tq, scale2, G: gl.constexpr,
                   BM: gl.constexpr, BN: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr,
                   WARPS: gl.constexpr):
    """Teacher warpgroup (default partition): per key step ``p = sum_h exp2(S_h scale2 -
    lse2_h)`` over the G heads (each product issued before the previous head's exp2), then
    ``p`` into the hand-off slot once the epilogue has read the previous one."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    # the G heads' lse2 rows ([Hq, Tq]: lse log2e + log2 G) staged once in shared memory
    flat = gl.arange(0, G * BM, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    lr = m * BM + flat % BM
    lse_tile = gl.load(lse2_ptr + (i * G + flat // BM) * Tq + lr, mask=lr < Tq, other=0.0)
    lse_smem = gl.allocate_shared_memory(gl.float32, [G * BM],
                                         gl.SwizzledSharedLayout(1, 1, 1, [0]), lse_tile)
    gl.thread_barrier()
    zero_s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    for n in range(lo, hi):
        c = n - lo
        slot = c % KS
        mbarrier.wait(kv_ready.index(slot), (c // KS) & 1)
        kt = k_smem.index(slot).permute((1, 0))  # [D, BN]
        qs, ph = _q_slot(c, 0, G, QS)
        mbarrier.wait(q_ready.index(qs), ph)
        s_next = warpgroup_mma(q_smem.index(qs), kt, zero_s, use_acc=False, is_async=True)
        p = zero_s
        for jj in gl.static_range(G):
            s_now = s_next
            if jj + 1 < G:  # issue head jj + 1's product before head jj's exp2
                qs, ph = _q_slot(c, jj + 1, G, QS)
                mbarrier.wait(q_ready.index(qs), ph)
                s_next = warpgroup_mma(q_smem.index(qs), kt, zero_s, use_acc=False,
                                       is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_now, ))
            else:
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s_now, ))
            gl.thread_barrier()  # every warp's reads of the slots done: the arrive is thread 0's
            qs, ph = _q_slot(c, jj, G, QS)
            mbarrier.arrive(q_empty.index(qs), count=1)
            if jj + 1 == G:
                mbarrier.arrive(kv_empty.index(slot), count=1)
            lse2 = lse_smem.slice(jj * BM, BM).load(row_l)
            p += gl.exp2(s * scale2 - lse2[:, None])
        mbarrier.wait(p_empty.index(0), (c & 1) ^ 1)  # the epilogue has read step c - 1's p
        p_smem.store(p)
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(0), count=1)


@gluon.jit
def _epilogue_split(dz_desc, lsez_ptr, qpos_ptr, qkb_ptr, dq_ptr, klpart_ptr, ki_smem, qi_smem,
                    dz_smem, p_smem, p_ready, p_empty, ki_ready, ki_empty, qi_ready, m, i, lo,
                    hi, ch_lo, Tq, Tq_pad, r0, HI, iscale2, BM: gl.constexpr, BN: gl.constexpr,
                    DI: gl.constexpr, GRAD: gl.constexpr, DZS: gl.constexpr,
                    DZ_IN_P: gl.constexpr, WARPS: gl.constexpr):
    """Epilogue warpgroup (worker): per key step the student product ``z = q_idx k_idx^T``, the
    support mask, the KL partial (log2 units, times ln 2 at the end), ``dz = Qs - T`` (times
    ``DZS``, rounded to the input dtype) stored to the chunk's buffer by TMA and ``acc += dz
    k_idx`` (registers); at the end the KL partial and the tile's ``dq_idx`` added."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, DI, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows = m * BM + gl.arange(0, BM, layout=row_l)
    valid = rows < Tq
    pos = gl.load(qpos_ptr + rows, mask=valid, other=-1)
    kb = gl.load(qkb_ptr + rows, mask=valid, other=0)
    ke = kb + pos  # the row's last key (rows past Tq: kb - 1, an empty support)
    lse_z2 = gl.load(lsez_ptr + rows * HI + i, mask=valid, other=0.0) * LOG2E
    zero_s = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    kl_rows = gl.zeros([BM], gl.float32, layout=row_l)
    acc = gl.zeros([BM, DI], gl.float32, layout=o_layout)
    if hi > lo:
        mbarrier.wait(qi_ready.index(0), 0)
    for n in range(lo, hi):
        c = n - lo
        mbarrier.wait(ki_ready.index(0), c & 1)
        z = warpgroup_mma(qi_smem, ki_smem.permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        mbarrier.wait(p_ready.index(0), c & 1)
        p = p_smem.load(s_layout)
        gl.thread_barrier()
        if not DZ_IN_P:
            mbarrier.arrive(p_empty.index(0), count=1)
        z = warpgroup_mma_wait(num_outstanding=0, deps=(z, ))
        # the support mask applied once, to both (its 64 predicates per thread not kept): T = 0
        # and log2 Qs = -1e30 outside, so Qs = 0 there and T (lg2 T - lg2 Qs) = 0 * 1e30 = 0
        cols = n * BN + gl.arange(0, BN, layout=col_l)
        inside = (cols[None, :] >= kb[:, None]) & (cols[None, :] <= ke[:, None])
        teacher = gl.where(inside, p, 0.0)
        l2qs = gl.where(inside, z * iscale2 - lse_z2[:, None], -1e30)  # log2 Qs
        # T = 0 inside the support (underflow) adds 0 too: 0 * lg2(tiny) is 0
        kl_rows += gl.sum(teacher * (_log2_ftz(gl.maximum(teacher, 1e-37)) - l2qs), axis=1)
        if GRAD:
            dz = ((_exp2_ftz(l2qs) - teacher) * DZS).to(qi_smem.dtype)
            tma.store_wait(0)  # the previous step's store has read dz_smem
            gl.thread_barrier()
            dz_smem.store(dz)
            fence_async_shared()
            gl.thread_barrier()
            # the chunk's buffer holds rows [r0, r0 + Tq_pad) of each index head
            tma.async_copy_shared_to_global(dz_desc,
                                            [i * Tq_pad + m * BM - r0, (n - ch_lo) * BN],
                                            dz_smem)
            acc = warpgroup_mma(dz_smem, ki_smem, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if DZ_IN_P:  # dz lives in the p slot: free it once the store has read it
                tma.store_wait(0)
        gl.thread_barrier()
        mbarrier.arrive(ki_empty.index(0), count=1)
        if DZ_IN_P:
            mbarrier.arrive(p_empty.index(0), count=1)
    gl.store(klpart_ptr + m * HI + i, gl.sum(kl_rows, axis=0) * LN2)
    if GRAD:
        tma.store_wait(0)
        if hi > lo:
            out_rows = m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, o_layout))
            out_cols = gl.arange(0, DI, layout=gl.SliceLayout(0, o_layout))
            ptrs = dq_ptr + (out_rows.to(gl.int64)[:, None] * HI + i) * DI + out_cols[None, :]
            keep = out_rows[:, None] < Tq
            gl.store(ptrs, gl.load(ptrs, mask=keep, other=0.0) + acc, mask=keep)


# one compile per shape class
@gluon.jit(do_not_specialize=("Tq", "Tq_pad", "r0", "ch_lo", "ch_hi"))
def dense_kl_pass_a_split(q_desc, k_desc, qi_desc, ki_desc, dz_desc, lse2_ptr, lsez_ptr,
                          qpos_ptr, qkb_ptr, nlo_ptr, nhi_ptr, dq_ptr, klpart_ptr, Tq, Tq_pad,
                          r0, ch_lo, ch_hi, scale2, iscale, HI: gl.constexpr, G: gl.constexpr,
                          IPG: gl.constexpr, HPK: gl.constexpr, BM: gl.constexpr,
                          BN: gl.constexpr, D: gl.constexpr, DI: gl.constexpr,
                          QS: gl.constexpr, KS: gl.constexpr, GRAD: gl.constexpr,
                          DZS: gl.constexpr, DZ_IN_P: gl.constexpr, EPILOGUE_REGS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Pass A with the teacher loop and the epilogue in two warpgroups (section comment above);
    program, arguments and results as :func:`dense_kl_pass_a` (``KI_AT`` fixed: ``G - 1``)."""
    i, m, lo, hi = _program(nlo_ptr, nhi_ptr, ch_lo, ch_hi)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QS, BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KS, BN, D], k_desc.layout)
    ki_smem = gl.allocate_shared_memory(ki_desc.dtype, [BN, DI], ki_desc.layout)
    qi_smem = gl.allocate_shared_memory(qi_desc.dtype, [BM, DI], qi_desc.layout)
    # the hand-off of p: rows of 128 fp32, 32-byte units swizzled by row (no bank conflicts for
    # the accumulator layout's 8-byte pieces)
    p_smem = gl.allocate_shared_memory(gl.float32, [BM, BN],
                                       gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    if DZ_IN_P:  # dz staged in the p slot's first half (the slot is freed after dz's store)
        dz_smem = p_smem._reinterpret(dz_desc.dtype, [2 * BM, BN], dz_desc.layout).slice(0, BM)
    else:
        dz_smem = gl.allocate_shared_memory(dz_desc.dtype, [BM, BN], dz_desc.layout)
    q_ready, q_empty = _barriers(QS), _barriers(QS)
    kv_ready, kv_empty = _barriers(KS), _barriers(KS)
    ki_ready, ki_empty, qi_ready = _barriers(1), _barriers(1), _barriers(1)
    p_ready, p_empty = _barriers(1), _barriers(1)
    fence_async_shared()
    gl.warp_specialize([
        (_teacher_split, (lse2_ptr, q_smem, k_smem, p_smem, q_ready, q_empty, kv_ready,
                          kv_empty, p_ready, p_empty, m, i, lo, hi, Tq, scale2, G, BM, BN, QS,
                          KS, num_warps)),
        (_epilogue_split, (dz_desc, lsez_ptr, qpos_ptr, qkb_ptr, dq_ptr, klpart_ptr, ki_smem,
                           qi_smem, dz_smem, p_smem, p_ready, p_empty, ki_ready, ki_empty,
                           qi_ready, m, i, lo, hi, ch_lo, Tq, Tq_pad, r0, HI, iscale * LOG2E, BM,
                           BN, DI, GRAD, DZS, DZ_IN_P, 4)),
        (_producer, (q_desc, k_desc, qi_desc, ki_desc, q_smem, k_smem, ki_smem, qi_smem,
                     q_ready, q_empty, kv_ready, kv_empty, ki_ready, ki_empty, qi_ready, m, i,
                     i // IPG, i // HPK, lo, hi, G, BM, BN, D, DI, QS, KS, G - 1)),
    ], [4, 1], [EPILOGUE_REGS, PRODUCER_REGS])

