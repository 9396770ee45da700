"""Helpers shared by the Triton kernels: interpreter flags, tile sizes, the one matmul wrapper.

Importing this module imports Triton; :mod:`msa_megatron.ops.triton` imports it lazily, so
``import msa_megatron`` never pulls Triton in (``TRITON_INTERPRET`` must be set before that).

Glossary of the kernels' constexpr names (shapes as in MSA_SPEC: Hq query heads, Hkv KV groups,
Hi index heads, Hik index key heads):

- ``D``, ``DI``: head dims of the main branch and of the index branch.
- ``HI``: index heads Hi; ``HPI``: query heads per index head (Hq / Hi); ``IPG``: index heads
  per KV group (Hi / Hkv); ``HPK``: index heads per index key head (Hi / Hik).
- ``TOK``, ``HR``: a gathered row tile holds ``TOK`` tokens x ``HR`` rows per token (``HR``: the
  power of two >= ``HPI`` the heads are padded to; :func:`..forward.query_tiling`).
- ``BN``: key rows per key tile (the block size B in the sparse kernels, ``DENSE_KEY_TILE`` in
  the dense ones); ``KS``: key rows per program of the key-outer kernels (``KEY_SUBTILE`` in
  the KL kernels, ``backward.ITEM_KEYS`` in the backward);
  ``NSUB = BN // KS``; ``BM``: query rows per tile of the dense KL kernels.
- ``TOPK``: selected blocks per row; ``SUB``: token sub-chunks of the reverse index;
  ``ITEM``: (token, index head) pairs per work item; ``UNIT``: the KL pass B's work unit, the
  index heads of one KV group that read one index key head (gcd(IPG, HPK)); ``UPG``: units per
  KV group (IPG // UNIT).
- ``FULL``: which rows a kernel serves (``ALL_ROWS``, ``FULL_ROWS``: rows whose selection is
  their whole causal prefix, ``SPARSE_ROWS``: the others); ``SPARSE``: sparse vs dense variant.
- ``UPCAST``/``IEEE``: dot-product precision flags of :func:`dot_flags`; ``GRAD``: also write
  gradients.
- ``ISO``: the variant with NaN/Inf isolation (``_isolation.support_mma``); both variants are
  launched, the one the device flag ``bad_ptr`` does not select returns at once.
- ``ROWS``: rows per tile of the KL kernels, one per (token, index head) pair (the teacher
  loops over the ``HPI`` query heads of the pair);
  ``FIXED``, ``DZS``: the dense KL's fixed-point scale of ``dq_idx`` and the scale of ``dz``.

Ints that change with the token chunk or the length (chunk starts ``sc0``/``sc1``/``t0``/``t1``,
chunk index ``ci``, ``Tq``, ``Tk``, counts) are ``do_not_specialize``, and per-chunk rows of a
tensor are reached through ``ci`` in the kernel, not passed as slices: Triton would compile a
variant per value class (1, divisible by 16, other) and per pointer alignment
(``tests/ops/test_specialisation.py``, ``benchmarks/count_specialisations.py``).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

# Rows (token x head pairs) packed into one tile by the kernels that gather queries (tl.dot needs
# >= 16 rows; a Hopper warpgroup MMA wants 64).
GATHER_ROWS = 64
# Rows of the KL kernels' gathered tiles (measured on H200, paper 32K: 128 rows cut the KL from
# 62 to 39 ms, while the attention kernels are faster with GATHER_ROWS; benchmarks/NOTES.md).
KL_ROWS = 128
# Rows of one query tile of the dense (warmup) kernels: more tokens share each K/V tile load.
DENSE_ROWS = 128
# Key-tile width of the dense (warmup) kernels.
DENSE_KEY_TILE = 64
# Key rows per program of the KL's key-outer kernels: a selected block is split in sub-tiles
# of this many rows so the fp32 accumulators stay in registers (the main backward's own:
# backward.ITEM_KEYS).
KEY_SUBTILE = 64
# Per-(pair, head) partial results of one chunk of query tokens may take PARTIAL_QS times the
# bytes of q, but at most PARTIAL_MAX_BYTES and at least PARTIAL_MIN_BYTES (partial_budget);
# larger selections are processed in up to 16 chunks of query tokens (BENCHMARK.md: a partial
# per (token, head, block) for all 128K tokens would be 32 GiB, 16x q). Each chunk's launches
# end on a tail of idle multiprocessors (ncu, paper 32K: 11-16% of the item kernels' time), so
# fewer chunks are faster: on the H200 (paper, whole op fwd+bwd iid / coherent, ms;
# benchmarks/NOTES.md "Chunk count (session 11)") 2 / 4 / 8 x q gave 52.4 / 49.6 / 47.6 at 32K,
# 195.8 / 194.4 / 191.5 at 128K, 22.6 -> 17.9 (2 -> 4) at 8K, with the op's peak at 0.75x /
# 0.95x / 1.34x dense cuDNN's at 32K: 4 is the largest that keeps it under cuDNN's. But at 1M
# tokens (q 16 GiB) 4x q asked for a 64 GiB buffer and ran out of memory on one H200 (2x q:
# 109 GiB peak), hence the byte cap. Chunks per consumer (reverse_index.chunk_count: the next
# power of two >= partials / budget, at most 16), paper config (Hq 64, D 128, bf16, k 16,
# B 128: q is 16 KiB per token; partials per token: backward Hq k D 2 = 256 KiB = 16x q,
# forward Hq k (2 D + 4) = 260 KiB, KL Hi k (B / 64) (Di + 1) 4 = 64.5 KiB):
#   tokens  q        budget (4x q, cap 8 GiB)  chunks fwd / bwd / KL  largest buffer (bwd)
#   8K      128 MiB  512 MiB                   8 / 4 / 2              512 MiB
#   32K     512 MiB  2 GiB                     8 / 4 / 2              2 GiB
#   128K    2 GiB    8 GiB (4x q = the cap)    8 / 4 / 2              8 GiB
#   1M      16 GiB   8 GiB (capped)            16 / 16 / 16           16 GiB (1x q: 16 chunks
#                                              are not enough for the cap, the count's limit)
# At 1M, 2x q gave 16 / 8 / 4 chunks with buffers of 16.25 / 32 / 16.1 GiB; capped: 16.25 / 16 /
# 4.0 GiB, so the backward's and the KL's peaks drop by 16 and 12 GiB (4x q: 32.5 / 64 / 32.3).
# The count is a function of the shapes only (it sets the fp32 order of the dK/dV sums across
# chunks; never of free memory).
PARTIAL_QS = 4
PARTIAL_MAX_BYTES = 8 << 30
PARTIAL_MIN_BYTES = 64 << 20
# Programs per multiprocessor of the persistent key-block-outer kernels.
PROGRAMS_PER_SM = 4
# Programs of a persistent kernel under the interpreter (runs them one after the other).
INTERPRETER_PROGRAMS = 4


def interpreting() -> bool:
    """True when Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def partial_budget(q_bytes: int) -> int:
    """Bytes the per-pair partials of one chunk of queries may take: ``PARTIAL_QS`` times
    ``q_bytes`` (the bytes of q), capped at ``PARTIAL_MAX_BYTES``, at least
    ``PARTIAL_MIN_BYTES`` (a function of the shapes only; see PARTIAL_QS)."""
    return max(min(PARTIAL_QS * int(q_bytes), PARTIAL_MAX_BYTES), PARTIAL_MIN_BYTES)


def tile_rows(rows: int, dtype: torch.dtype) -> int:
    """Rows of a kernel's row tiles for inputs of ``dtype``: ``rows`` for 2-byte elements, half
    for fp32 (every tile takes twice the shared memory; sm_90 allows 227 KiB per block)."""
    return rows if dtype.itemsize <= 2 else max(16, rows // 2)


def stage_options(dtype: torch.dtype) -> dict:
    """Launch options by input dtype: fp32 tiles are not software-pipelined (one stage: the
    pipeline's buffers of fp32 tiles exceed sm_90's shared memory; fp32 products run on the
    CUDA cores, where the pipeline gains little)."""
    return {} if dtype.itemsize <= 2 else {"num_stages": 1}


def launch_options(caller: str, dtype: torch.dtype | None, tiles: dict, num_warps: int,
                   num_stages: int | None) -> dict:
    """``num_warps`` / ``num_stages`` launch options of a kernel with the tile sizes ``tiles``
    (``{"bm": 64, ...}``) for inputs of ``dtype``; ``num_stages=None``: :func:`stage_options`'s
    choice (Triton's default when ``dtype`` is None). ValueError naming the argument unless each
    tile is a power of two >= 16, ``num_warps`` a power of two in 1..16 and ``num_stages`` None
    or >= 1."""
    for name, v in tiles.items():
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"{caller}: {name} must be a power of two >= 16, got {v!r}")
    if not isinstance(num_warps, int) or not 1 <= num_warps <= 16 or num_warps & (num_warps - 1):
        raise ValueError(f"{caller}: num_warps must be a power of two in 1..16, got {num_warps!r}")
    if num_stages is None:
        return {"num_warps": num_warps, **(stage_options(dtype) if dtype is not None else {})}
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"{caller}: num_stages must be None or an int >= 1, got {num_stages!r}")
    return {"num_warps": num_warps, "num_stages": num_stages}


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return triton.next_power_of_2(max(int(n), 1))


def dot_flags(dtype: torch.dtype) -> tuple:
    """``(UPCAST, IEEE)`` constexprs of :func:`mma` for inputs of ``dtype``.

    The interpreter multiplies bf16 operands as raw bits, so they are upcast there; fp32 inputs
    use exact fp32 products (not tf32) so fp32 runs match the fp32 oracle.
    """
    return interpreting() and dtype == torch.bfloat16, dtype == torch.float32


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, work_items: int,
                        per_sm: int = PROGRAMS_PER_SM) -> int:
    """Program count of a persistent kernel over ``work_items`` items (>= 1): ``per_sm`` per
    multiprocessor (the kernel's occupancy, or more for a strided item loop)."""
    if device.type != "cuda":
        return max(1, min(work_items, INTERPRETER_PROGRAMS))
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(work_items, per_sm * _sm_count(index)))


@triton.jit
def mma(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """``a @ b`` with fp32 accumulation (see :func:`dot_flags`)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


# Row filters of the kernels that serve both paths of a sparse call (FULL constexpr): rows whose
# selection holds every block of their causal prefix go through the dense kernels.
ALL_ROWS, FULL_ROWS, SPARSE_ROWS = 0, 1, 2


@triton.jit
def row_filter(valid, t, i, full_ptr, HI: tl.constexpr, FULL: tl.constexpr):
    """``valid`` restricted by ``FULL``: all rows, rows (token ``t``, index head ``i``) marked
    in ``full [Tq, HI]`` int8 (FULL_ROWS), or the unmarked ones (SPARSE_ROWS)."""
    if FULL == 0:
        out = valid
    else:
        f = tl.load(full_ptr + t.to(tl.int64) * HI + i, mask=valid, other=0)
        if FULL == 1:
            out = valid & (f != 0)
        else:
            out = valid & (f == 0)
    return out


@triton.jit
def support_mask(krow, kmask, kbase, pos, valid):
    """``[R, N]`` bool: key row ``krow[n]`` lies in row ``r``'s causal row (same sequence, u <= p).

    ``kbase``/``pos``/``valid`` are per row ``[R]``; ``kmask [N]`` marks loaded key rows.
    """
    u = krow[None, :] - kbase[:, None]
    return (u >= 0) & (u <= pos[:, None]) & valid[:, None] & kmask[None, :]


@triton.jit
def student_row_stats(qi, ki_ptr, j, s_jt, s_jh, kbase, pos, rows, k_lo, k_hi, iscale,
                      BN: tl.constexpr, DI: tl.constexpr, UPCAST: tl.constexpr,
                      IEEE: tl.constexpr):
    """Online softmax statistics of the student logits ``z = iscale * q_idx k_idx^T`` over each
    row's causal keys: ``(m, l)``, the running max and the sum of ``exp(z - m)``, over key rows
    ``k_lo .. k_hi`` of index key head ``j`` in tiles of ``BN`` (``qi [R, DI]``, per-row
    ``kbase``/``pos``/``rows``). The row's ``lse_z`` is ``_isolation.log_sum_exp(m, l)``."""
    R: tl.constexpr = qi.shape[0]
    di = tl.arange(0, DI)
    mz = tl.full([R], float("-inf"), tl.float32)
    lz = tl.zeros([R], tl.float32)
    for k0 in range(k_lo, k_hi + 1, BN):
        krow = k0 + tl.arange(0, BN)
        kmask = krow <= k_hi
        kit = tl.load(ki_ptr + krow.to(tl.int64)[:, None] * s_jt + j * s_jh + di[None, :],
                      mask=kmask[:, None], other=0.0)
        z = mma(qi, tl.trans(kit), UPCAST, IEEE) * iscale
        z = tl.where(support_mask(krow, kmask, kbase, pos, rows), z, float("-inf"))
        m_new = tl.maximum(mz, tl.max(z, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        lz = lz * tl.exp(mz - m_use) + tl.sum(tl.exp(z - m_use[:, None]), axis=1)
        mz = m_new
    return mz, lz
