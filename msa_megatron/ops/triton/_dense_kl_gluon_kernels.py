"""Pass A of the Gluon dense KL (:mod:`.dense_kl_gluon`): the warp-specialised sm_90 kernel.

Imported only when Gluon's Hopper modules are importable
(:func:`.dense_kl_gluon.gluon_kl_supported`).
Program = (query tile ``m`` of ``BM = 64`` rows, index head ``i``) over the key tiles
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
BLOCK_M, BLOCK_N, Q_STAGES, KV_STAGES, WARPS, PRODUCER_REGS = 64, 128, 3, 2, 4, 40


@gluon.jit
def _log2_approx(x):
    """``log2 x`` by ``lg2.approx`` (MUFU; relative error ~2^-22): ``gl.log`` lowers to the
    libdevice routine, whose temporaries over a [64, 128] tile exhausted the registers."""
    return gl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _producer(q_desc, k_desc, qi_desc, ki_desc, q_smem, k_smem, ki_smem, qi_smem, q_ready,
              q_empty, kv_ready, kv_empty, ki_ready, ki_empty, qi_ready, m, i, g, j, lo, hi,
              G: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
              DI: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr, KI_AT: gl.constexpr):
    """Producer partition (1 warp): TMA loads into the rings, each once its slot is free. The
    ``k_idx`` tile has one slot (shared memory), loaded after the step's first two Q tiles (so
    those are not held up by the previous step's end, which frees it)."""
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
              ki_empty, qi_ready, m, i, lo, hi, ch_lo, Tq, Tq_pad, HI, scale2, iscale,
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
            tma.async_copy_shared_to_global(dz_desc, [i * Tq_pad + m * BM, (n - ch_lo) * BN],
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


@gluon.jit(do_not_specialize=("Tq", "Tq_pad", "ch_lo", "ch_hi"))  # one compile per shape class
def dense_kl_pass_a(q_desc, k_desc, qi_desc, ki_desc, dz_desc, lse2_ptr, lsez_ptr, qpos_ptr,
                    qkb_ptr, nlo_ptr, nhi_ptr, dq_ptr, klpart_ptr, Tq, Tq_pad, ch_lo, ch_hi,
                    scale2, iscale, HI: gl.constexpr, G: gl.constexpr, IPG: gl.constexpr,
                    HPK: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                    DI: gl.constexpr, QS: gl.constexpr, KS: gl.constexpr, KI_AT: gl.constexpr,
                    GRAD: gl.constexpr,
                    DZS: gl.constexpr, PRODUCER_REGS: gl.constexpr, num_warps: gl.constexpr):
    """Program (query tile ``m``, index head ``i``; the last query tiles first): key tiles
    ``[max(n_lo[m], ch_lo), min(n_hi[m], ch_hi))``; rings and barriers, then the consumer
    (default partition) and the producer (1 worker warp)."""
    m = gl.num_programs(0) - 1 - gl.program_id(0)
    i = gl.program_id(1)
    lo = gl.maximum(gl.load(nlo_ptr + m), ch_lo)
    hi = gl.minimum(gl.load(nhi_ptr + m), ch_hi)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [QS, BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [KS, BN, D], k_desc.layout)
    ki_smem = gl.allocate_shared_memory(ki_desc.dtype, [BN, DI], ki_desc.layout)
    qi_smem = gl.allocate_shared_memory(qi_desc.dtype, [BM, DI], qi_desc.layout)
    dz_smem = gl.allocate_shared_memory(dz_desc.dtype, [BM, BN], dz_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [QS, 1], mbarrier.MBarrierLayout())
    kv_ready = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [KS, 1], mbarrier.MBarrierLayout())
    ki_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    ki_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    qi_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(QS):
        mbarrier.init(q_ready.index(s), count=1)
        mbarrier.init(q_empty.index(s), count=1)
    for s in gl.static_range(KS):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=1)
    mbarrier.init(ki_ready.index(0), count=1)
    mbarrier.init(ki_empty.index(0), count=1)
    mbarrier.init(qi_ready.index(0), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (dz_desc, lse2_ptr, lsez_ptr, qpos_ptr, qkb_ptr, dq_ptr, klpart_ptr, q_smem,
                     k_smem, ki_smem, qi_smem, dz_smem, q_ready, q_empty, kv_ready, kv_empty,
                     ki_ready, ki_empty, qi_ready, m, i, lo, hi, ch_lo, Tq, Tq_pad, HI, scale2,
                     iscale, G, BM, BN, DI, QS, KS, GRAD, DZS, num_warps)),
        (_producer, (q_desc, k_desc, qi_desc, ki_desc, q_smem, k_smem, ki_smem, qi_smem,
                     q_ready, q_empty, kv_ready, kv_empty, ki_ready, ki_empty, qi_ready, m, i,
                     i // IPG, i // HPK, lo, hi, G, BM, BN, D, DI, QS, KS, KI_AT)),
    ], [1], [PRODUCER_REGS])
