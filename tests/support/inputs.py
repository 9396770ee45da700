"""Shared test helpers for the op tests (``from tests.support.inputs import make_inputs``).

- :func:`make_cu_seqlens`, :func:`make_inputs`: fresh random MSA inputs (never zeros) for given
  sequence lengths, head counts, dims, dtype and seed.
- :func:`seed_from` (behind the ``seed`` fixture of ``tests/conftest.py``): a stable per-test
  seed (from the test id), so every parametrisation gets its own inputs and a failure
  reproduces.
- :func:`rel_err`, :func:`assert_close`: norm-wise relative error, with :data:`TOLERANCES` per
  dtype (fp32 reference, bf16 within ~1e-2).
- :func:`check_selection_structure`, :func:`assert_selection_equal`: the selection contract of
  MSA_SPEC section 2 and the near-tie-tolerant comparison of section 2.6.
"""

from __future__ import annotations

import zlib
from typing import Dict, Optional, Sequence

import torch

from msa_megatron.layout import query_layout
from msa_megatron.reference import block_scores_reference

# Norm-wise relative tolerance of a backend against the oracle, by input dtype.
TOLERANCES: Dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 2e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
}
# Score gap below which two blocks count as tied (MSA_SPEC 2.6), relative to max(1, |score|).
SELECTION_TIE_TOLERANCES: Dict[torch.dtype, float] = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-3,
}


def seed_from(text: str) -> int:
    """A stable 31-bit seed from any string (e.g. a pytest node id)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def make_cu_seqlens(lengths: Sequence[int], device: str | torch.device = "cpu") -> torch.Tensor:
    """``[n+1]`` int32 sequence starts for packed sequences of ``lengths`` (zeros allowed)."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + int(n))
    return torch.tensor(starts, dtype=torch.int32, device=device)


def padded_real_rows(padded_lengths: Sequence[int], real_lengths: Sequence[int]) -> torch.Tensor:
    """``[R]`` int64 rows of the real tokens of packed sequences padded at their ends (sequence
    ``s`` takes ``padded_lengths[s]`` rows, its first ``real_lengths[s]`` real)."""
    starts = make_cu_seqlens(padded_lengths).tolist()
    return torch.cat([torch.arange(s, s + int(n)) for s, n in zip(starts, real_lengths)])


def make_inputs(
    lengths: Sequence[int],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    index_heads: int = 2,
    index_key_heads: int = 1,
    head_dim: int = 16,
    index_head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    requires_grad: bool = True,
    index_spread: float = 1.0,
) -> Dict[str, torch.Tensor]:
    """Random packed MSA inputs: ``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]``,
    ``q_idx [T, Hi, Di]``, ``k_idx [T, Hik, Di]`` (standard normal, scaled index inputs by
    ``index_spread``) and ``cu_seqlens [n+1]`` int32.

    The tensors are leaves (``requires_grad`` as asked) in ``dtype``; values are drawn in
    float64 from a generator seeded with ``seed`` and then cast, so the same seed gives the
    same values in every dtype (up to rounding).
    """
    total = sum(int(n) for n in lengths)
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, spread=1.0):
        t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * spread).to(dtype)
        return t.to(device).requires_grad_(requires_grad)

    return {
        "q": draw(total, heads, head_dim),
        "k": draw(total, kv_heads, head_dim),
        "v": draw(total, kv_heads, head_dim),
        "q_idx": draw(total, index_heads, index_head_dim, spread=index_spread),
        "k_idx": draw(total, index_key_heads, index_head_dim, spread=index_spread),
        "cu_seqlens": make_cu_seqlens(lengths, device),
    }


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (absolute error if expected is 0)."""
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    denom = e.norm().item()
    diff = (a - e).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "") -> None:
    """Assert equal shapes, finite values where expected is finite, and ``rel_err <= tol``."""
    assert actual.shape == expected.shape, \
        f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    finite = torch.isfinite(expected.detach())
    assert torch.equal(torch.isfinite(actual.detach()), finite), f"{name}: non-finite values differ"
    err = rel_err(actual.detach()[finite], expected.detach()[finite])
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def check_selection_structure(
    block_idx: torch.Tensor, q_pos: torch.Tensor, *, block_size: int, top_k: int,
    init_blocks: int, local_blocks: int,
) -> None:
    """Assert the MSA_SPEC 2.3-2.5 contract row by row (vectorised).

    ``[T, Hi, top_k]`` int32; valid entries strictly ascending, then ``-1`` only; every entry
    ``<= blk(p)``; ``min(top_k, blk(p) + 1)`` entries; all forced blocks present.
    """
    assert block_idx.dtype == torch.int32 and block_idx.dim() == 3 and block_idx.shape[2] == top_k
    b = block_idx.to(torch.int64)
    own = (q_pos.to(torch.int64) // block_size)[:, None, None]
    valid = b >= 0
    assert torch.all(b >= -1), "entries below -1"
    assert torch.all(~valid[..., 1:] | valid[..., :-1]), "-1 padding before a valid entry"
    pairs = valid[..., 1:] & valid[..., :-1]
    assert torch.all(~pairs | (b[..., 1:] > b[..., :-1])), "valid entries not strictly ascending"
    assert torch.all(~valid | (b <= own)), "a block after the query's own block"
    count = valid.sum(dim=2)
    assert torch.equal(count, torch.clamp(own[..., 0] + 1, max=top_k).expand_as(count)), \
        "wrong number of selected blocks"
    nblk = int(own.max().item()) + 1 if own.numel() else 1
    blocks = torch.arange(nblk)[None, None, :]
    forced = (blocks <= own) & ((blocks > own - local_blocks) | (blocks < init_blocks))
    member = torch.zeros(b.shape[0], b.shape[1], nblk + 1, dtype=torch.bool)
    member.scatter_(2, torch.where(valid, b, nblk), True)
    assert torch.all(~forced | member[..., :nblk]), "a forced block is missing"


def assert_selection_equal(
    actual: torch.Tensor,
    expected: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor],
    *,
    block_size: int,
    top_k: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    index_scale: Optional[float] = None,
    tol: Optional[float] = None,
    max_tie_fraction: float = 0.01,
) -> None:
    """Selections equal as sets, except near-ties (MSA_SPEC 2.6).

    Rows (token, index head) that differ are accepted when ``actual`` satisfies the structure
    contract and every non-forced block it selected has an oracle score
    (:func:`msa_megatron.reference.block_scores_reference`, from the same inputs) of at least
    the oracle's k-th (worst selected non-forced) score minus ``tol * max(1, |k-th score|)``.
    At most ``max_tie_fraction`` of the rows may differ (ties are rare with random inputs).

    Args:
        actual, expected: ``[T, Hi, top_k]`` int32 selections (``expected`` from the oracle).
        q_idx, k_idx, cu_seqlens: the inputs both were computed from.
        tol: tie tolerance; default from :data:`SELECTION_TIE_TOLERANCES` by ``q_idx.dtype``.
    """
    T = q_idx.shape[0]
    q_pos, q_kbase = query_layout(cu_seqlens, T, q_idx.device)
    options = dict(block_size=block_size, top_k=top_k, init_blocks=init_blocks,
                   local_blocks=local_blocks)
    check_selection_structure(actual.cpu(), q_pos.cpu(), **options)
    assert actual.shape == expected.shape
    if torch.equal(actual.cpu(), expected.cpu()):
        return
    tol = SELECTION_TIE_TOLERANCES[q_idx.dtype] if tol is None else tol
    with torch.no_grad():
        scores = block_scores_reference(q_idx.detach(), k_idx.detach(), q_pos, q_kbase,
                                        block_size=block_size, index_scale=index_scale)
    scores = scores.to(torch.float64).cpu()  # [Hi, T, nblk]
    differing = (actual.cpu() != expected.cpu()).any(dim=2).nonzero().tolist()
    assert len(differing) <= max(1, max_tie_fraction * actual.shape[0] * actual.shape[1]), \
        f"{len(differing)} (token, head) rows differ: more than near-ties explain"
    for t, i in differing:
        own = int(q_pos[t]) // block_size
        forced = {b for b in range(own + 1) if b > own - local_blocks or b < init_blocks}
        got = {int(b) for b in actual[t, i] if b >= 0} - forced
        want = {int(b) for b in expected[t, i] if b >= 0} - forced
        assert want, f"token {t} head {i}: rows differ though every block is forced"
        kth = min(float(scores[i, t, b]) for b in want)
        floor = kth - tol * max(1.0, abs(kth))
        worst = min(float(scores[i, t, b]) for b in got)
        assert worst >= floor, (
            f"token {t} head {i}: selected {sorted(got)} vs oracle {sorted(want)}; "
            f"score {worst:.6g} < k-th {kth:.6g} - tol"
        )
