"""Selection quality: does the index branch pick the blocks the main heads attend to?

Two measurements on a small sample of query rows, cheap enough to run every few hundred steps:

- :func:`selection_recall`: the share of the *dense* teacher's attention mass (mean over the
  query heads of an index head, softmax over the whole causal prefix, as in dense mode) that
  lies inside the blocks the index branch selects (MSA_SPEC section 2) for that row. 1.0 means
  sparse attention loses nothing for that row; the MSA paper reports 0.90-0.94 for a trained
  index. Works in sparse and dense mode (the selection is computed for the sampled rows only).
  With it comes the ceiling ``best_recall``: the share held by the best selection the rules
  allow (forced blocks, then the blocks of most teacher mass), which a diffuse teacher keeps
  below 1 at a small ``top_k`` whatever the index does.
- :func:`distance_histogram`: where the selected blocks lie, as the distance in blocks from the
  query's own block (own, neighbour, sink = block 0, then powers of two).

Both run on the general query layout (``q_pos``, ``q_kbase``) of
:mod:`msa_megatron.layout` and take plain tensors; the Megatron layer arms them through
:mod:`msa_megatron.megatron.probe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .config import check_block_size, check_selection_budget
from .ops.backends import get_backend, resolve_backend
from .ops.validation import check_backend_limits
from .layout import query_layout

# Bytes per chunk of the teacher computation (fp32 scores [rows, Hq, prefix] and gathered keys
# [rows, prefix, Hkv, D]).
_TEACHER_BYTES = 256 << 20


@dataclass
class SelectionSample:
    """Selection quality of sampled query rows of one layer.

    Attributes:
        rows: ``[R]`` int64 token rows (into the layer's THD tokens) that were sampled.
        q_pos: ``[R]`` int64 position of each row in its own sequence.
        block_idx: ``[R, Hi, top_k]`` int32 selection of those rows (MSA_SPEC 2.5).
        recall: ``[R, Hi]`` float32 share of the dense teacher's attention mass inside the
            selected blocks.
        best_recall: ``[R, Hi]`` float32 the largest share any selection under the same rules
            could hold (the forced blocks plus the ``top_k - #forced`` eligible blocks of most
            teacher mass): the ceiling of ``recall``. ``recall / best_recall`` says how close
            the index comes to the best selection; ``best_recall`` itself says how concentrated
            the teacher is at this ``top_k``. None where not measured.
    """

    rows: torch.Tensor
    q_pos: torch.Tensor
    block_idx: torch.Tensor
    recall: torch.Tensor
    best_recall: Optional[torch.Tensor] = None


def sample_rows(num_tokens: int, num_rows: int, generator: Optional[torch.Generator] = None,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """``min(num_rows, num_tokens)`` distinct token rows, sorted, int64 (uniform sample)."""
    if num_rows <= 0 or num_tokens <= 0:
        raise ValueError(f"num_rows ({num_rows}) and num_tokens ({num_tokens}) must be positive")
    count = min(num_rows, num_tokens)
    rows = torch.randperm(num_tokens, generator=generator)[:count].sort().values
    return rows.to(device) if device is not None else rows


@torch.no_grad()
def selection_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    rows: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    *,
    block_size: int,
    top_k: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    softmax_scale: Optional[float] = None,
    index_scale: Optional[float] = None,
    backend: Optional[str] = None,
    positions: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> SelectionSample:
    """Recall of the dense teacher's attention mass by the index selection, for sampled rows.

    For each sampled row ``p`` and index head ``i``: ``recall[p, i] = sum over u in the
    selected blocks (u <= p) of T[i, p, u]``, with ``T`` the mean over the index head's query
    heads of the dense causal softmax of ``softmax_scale * <q[p, h], k[u, g]>`` over the whole
    prefix of the sequence (MSA_SPEC sections 3-4, dense support). Inputs are packed THD as in
    :func:`msa_megatron.msa_attention` (already validated by the caller's forward).

    Args:
        q: ``[T, Hq, D]`` main queries; k: ``[T, Hkv, D]`` main keys (RoPE applied).
        q_idx: ``[T, Hi, Di]``; k_idx: ``[T, Hik, Di]`` index queries / keys.
        rows: ``[R]`` int64 token rows to measure (``0 <= rows < T``).
        cu_seqlens: ``[n+1]`` int32 sequence starts, or None for one sequence.
        block_size, top_k, init_blocks, local_blocks, index_scale: the layer's selection.
        softmax_scale: main logit scale, default ``D ** -0.5``.
        backend: backend of the selection (default: triton on CUDA, torch elsewhere).
        positions: ``(q_pos, q_kbase)`` ``[T]`` int32 of the query rows against the rows of
            ``k`` / ``k_idx`` (position in the sequence, row of the sequence's start), for keys
            that are not the queries' own rows, e.g. the CP-gathered keys of a context-parallel
            rank (:func:`msa_megatron.parallel.cp_layout.build_cp_layout`); None: from
            ``cu_seqlens`` (``k`` holds the same ``T`` rows as ``q``).

    Returns:
        :class:`SelectionSample` with the rows, their positions, selection, recall and its
        ceiling ``best_recall`` (same teacher, best selection under the same rules).

    Raises:
        ValueError: ``rows`` not 1-D integer or out of ``[0, T)``; ``block_size`` not positive,
            ``local_blocks < 1`` or ``top_k < init_blocks + local_blocks`` (MSA_SPEC 2.3, as the
            layer checks them); meta tensors (a recall is a value: they have none); a backend
            that cannot run these inputs (e.g. triton: CPU tensors without the interpreter, an
            unsupported index head dim or block size), the same check as the layer's forward.
        TypeError: a dtype the backend does not run.
    """
    T, Hq, D = q.shape
    Hkv, Hi = k.shape[1], q_idx.shape[1]
    block_size = check_block_size(block_size)
    top_k, init_blocks, local_blocks = check_selection_budget(top_k, init_blocks, local_blocks)
    meta = [name for name, t in (("q", q), ("k", k), ("q_idx", q_idx), ("k_idx", k_idx),
                                 ("rows", rows)) if t.is_meta]
    if meta:
        raise ValueError(f"selection_recall measures values, and {', '.join(meta)} "
                         "on the meta device have none")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be a 1-D integer tensor, got {tuple(rows.shape)} {rows.dtype}")
    rows = rows.to(device=q.device, dtype=torch.int64)
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= T):
        raise ValueError(f"rows must lie in [0, {T}), got [{int(rows.min())}, {int(rows.max())}]")
    if positions is None:
        q_pos, q_kbase = query_layout(cu_seqlens, T, q.device)
    else:
        q_pos, q_kbase = (t.to(q.device) for t in positions)
        if q_pos.shape != (T,) or q_kbase.shape != (T,):
            raise ValueError(f"positions must be two [T={T}] tensors, got "
                             f"{tuple(q_pos.shape)} and {tuple(q_kbase.shape)}")
    pos, base = q_pos[rows], q_kbase[rows]
    name = resolve_backend(backend, q.device)
    check_backend_limits(name, q_idx.dtype, {"Di": q_idx.shape[-1]}, block_size, q.device)
    block_idx = get_backend(name).select(
        q_idx[rows].detach().contiguous(), k_idx.detach(), pos.contiguous(), base.contiguous(),
        block_size=block_size, top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
        index_scale=index_scale)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    heads_per_index = Hq // Hi
    recall = torch.zeros(rows.numel(), Hi, dtype=torch.float32, device=q.device)
    best = torch.zeros_like(recall)
    pos64, base64 = pos.to(torch.int64), base.to(torch.int64)
    # Rows of one sequence share its keys: per sequence start, the keys of the longest sampled
    # prefix are read once (a slice, no per-row gather) and the rows go through in chunks of
    # fp32 scores [R_c, Hq, L] within _TEACHER_BYTES.
    for b in torch.unique(base64).tolist():
        members = (base64 == b).nonzero().flatten()
        length = int(pos64[members].max()) + 1
        keys = k[b:b + length].float()  # [L, Hkv, D]
        u = torch.arange(length, device=q.device)
        per_chunk = max(1, _TEACHER_BYTES // (4 * 3 * Hq * length))
        for start in range(0, members.numel(), per_chunk):
            idx = members[start:start + per_chunk]
            p, sel = pos64[idx], block_idx[idx].to(torch.int64)
            causal = u[None, :] <= p[:, None]  # [R_c, L]
            queries = q[rows[idx]].float().view(-1, Hkv, Hq // Hkv, D)  # query heads by KV group
            logits = torch.einsum("rgjd,lgd->rgjl", queries, keys).reshape(-1, Hq, length) * scale
            logits = logits.masked_fill(~causal[:, None, :], float("-inf"))
            probs = torch.softmax(logits, dim=-1)  # [R_c, Hq, L]
            teacher = probs.view(probs.shape[0], Hi, heads_per_index, length).mean(dim=2)
            # Teacher mass per key block [R_c, Hi, nb] (zero past each row: causal softmax);
            # the selection's blocks are distinct and unused slots are -1.
            num_blocks = -(-length // block_size)
            mass = torch.nn.functional.pad(teacher, (0, num_blocks * block_size - length))
            mass = mass.view(*teacher.shape[:2], num_blocks, block_size).sum(dim=-1)
            recall[idx] = (mass.gather(-1, sel.clamp(min=0)) * (sel >= 0)).sum(dim=-1)
            best[idx] = _best_share(mass, p // block_size, top_k, init_blocks, local_blocks)
    return SelectionSample(rows=rows, q_pos=pos64, block_idx=block_idx, recall=recall,
                           best_recall=best)


def _best_share(mass: torch.Tensor, own_block: torch.Tensor, top_k: int, init_blocks: int,
                local_blocks: int) -> torch.Tensor:
    """Teacher mass ``[R, Hi]`` held by the best selection MSA_SPEC 2.3-2.4 allows.

    ``mass [R, Hi, nb]``: the teacher's mass per block (zero after each row's own block
    ``own_block [R]``). The forced blocks (first ``init_blocks``, last ``local_blocks`` up to the
    own block) count whole, then the ``top_k - #forced`` other eligible blocks of largest mass.
    A row with at most ``top_k`` eligible blocks selects them all (1.0 up to rounding)."""
    b = torch.arange(mass.shape[-1], device=mass.device)[None, :]
    own = own_block[:, None]
    eligible = b <= own  # [R, nb]
    forced = eligible & ((b < init_blocks) | (b > own - local_blocks))
    held = (mass * forced[:, None, :]).sum(dim=-1)
    others = mass.masked_fill(~(eligible & ~forced)[:, None, :], 0.0)
    slots = (top_k - forced.sum(dim=-1)).clamp(min=0)  # [R]
    ranked = others.sort(dim=-1, descending=True).values
    take = b < slots[:, None]  # [R, nb]
    return held + (ranked * take[:, None, :]).sum(dim=-1)


def distance_bins(max_distance: int) -> List[str]:
    """Labels of :func:`distance_histogram`'s bins for distances up to ``max_distance`` blocks."""
    labels = ["own", "neighbour", "sink"]
    lo = 2
    while lo <= max(max_distance, 2):
        labels.append(f"{lo}-{2 * lo - 1}")
        lo *= 2
    return labels


def distance_histogram(block_idx: torch.Tensor, q_pos: torch.Tensor, block_size: int,
                       max_distance: int) -> Dict[str, int]:
    """Count selected blocks by distance from the query's own block.

    Args:
        block_idx: ``[R, Hi, k]`` int32 selection (``-1`` unused).
        q_pos: ``[R]`` positions of the rows in their sequences.
        block_size: B.
        max_distance: the largest distance (in blocks) to make bins for.

    Returns:
        ``{label: count}`` over :func:`distance_bins`: ``own`` (distance 0), ``neighbour``
        (distance 1), ``sink`` (block 0 of the sequence, distance >= 2), then ``"2-3"``,
        ``"4-7"``, ... for the other blocks.
    """
    labels = distance_bins(max_distance)
    own = (q_pos.to(torch.int64) // block_size)[:, None, None]
    sel = block_idx.to(torch.int64)
    valid = sel >= 0
    dist_ = (own - sel)[valid]
    blocks = sel[valid]
    counts = {label: 0 for label in labels}
    counts["own"] = int((dist_ == 0).sum())
    counts["neighbour"] = int((dist_ == 1).sum())
    far = dist_ >= 2
    counts["sink"] = int((far & (blocks == 0)).sum())
    rest = dist_[far & (blocks != 0)]
    if rest.numel():
        octave = torch.floor(torch.log2(rest.double())).to(torch.int64)  # 2-3 -> 1, 4-7 -> 2
        for level, n in zip(*torch.unique(octave, return_counts=True)):
            index = 2 + int(level)
            label = labels[index] if index < len(labels) else labels[-1]
            counts[label] += int(n)
    return counts
