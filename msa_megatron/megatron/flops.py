"""FLOPs of an MSA layer, to correct Megatron's TFLOP/s (which counts every layer as dense).

Megatron-LM's ``num_floating_point_operations`` counts, per attention layer and sequence of
``L`` tokens, a core-attention term of ``3 * 2 * Hq * D * L**2 / 2 * 2 = 6 * Hq * D * L**2``
(forward + backward = 3x forward, 2 FLOPs per multiply-add, causal half, ``QK^T`` and ``PV``)
and the projections (``linear_qkv``, ``linear_proj``). :func:`msa_layer_flops` counts what an
MSA layer computes instead, with the same conventions; :func:`megatron_dense_core_flops` is
Megatron's term, so ``total - layers * (dense_core - msa)`` is the sparse count of a model.

Terms of one MSA layer for one causal sequence of ``L`` tokens (``pairs`` = (query, key) pairs
a query head attends: in sparse mode the query's own block up to itself plus ``top_k - 1``
earlier blocks, or all of its prefix when it is shorter; dense mode or the selection's dense
scan: ``L (L + 1) / 2``):

- ``attention``: ``3 * 2 * 2 * Hq * D * pairs`` (as Megatron's dense term, on the pairs attended);
- ``selection``: ``2 * Hi * Di * dense_pairs`` (index scores over the whole causal prefix,
  forward only: the selection takes no gradient);
- ``kl``: teacher ``2 * Hq * D * pairs`` (main scores recomputed on the support, no gradient)
  plus student ``3 * 2 * Hi * Di * pairs`` (index scores, forward and their two gradients), over
  the support in sparse mode and the whole prefix in dense mode;
- ``index_projections``: ``2 * 2 * L * hidden * (Hi + Hik) * Di`` (forward and weight gradient;
  the index branch reads its input with gradient stopped, so there is no input gradient).

Nothing here imports megatron-core.
"""

from __future__ import annotations

from typing import Dict

from ..config import check_int

FWD_BWD = 3  # forward + backward, Megatron's convention
FMA = 2  # FLOPs per multiply-add


def attended_pairs(seq_len: int, block_size: int, top_k: int) -> int:
    """(query, key) pairs one query head attends in sparse mode over a causal sequence.

    A query at position ``p`` (block ``b = p // block_size``) attends its own block up to
    itself (``p - b * block_size + 1`` keys) and ``min(b, top_k - 1)`` earlier full blocks
    (MSA_SPEC section 2: the own block is always selected).

    Raises:
        ValueError: a non-positive ``block_size`` / ``top_k`` or a negative ``seq_len``.
    """
    seq_len, block_size, top_k = _check(seq_len=seq_len, block_size=block_size, top_k=top_k)
    total = 0
    for start in range(0, seq_len, block_size):
        block = start // block_size
        tokens = min(block_size, seq_len - start)
        own = tokens * (tokens + 1) // 2
        total += own + tokens * block_size * min(block, top_k - 1)
    return total


def dense_pairs(seq_len: int) -> int:
    """(query, key) pairs of full causal attention over ``seq_len`` tokens."""
    (seq_len,) = _check(seq_len=seq_len)
    return seq_len * (seq_len + 1) // 2


def msa_layer_flops(seq_len: int, *, hidden_size: int, num_heads: int, head_dim: int,
                    index_heads: int, index_key_heads: int, index_head_dim: int,
                    block_size: int, top_k: int, mode: str = "sparse") -> Dict[str, int]:
    """FLOPs (forward + backward) of one MSA layer's attention for one causal sequence.

    Args:
        seq_len: tokens of the sequence; hidden_size: model width; num_heads: Hq; head_dim: D;
        index_heads: Hi; index_key_heads: Hik; index_head_dim: Di; block_size, top_k: the
        selection; mode: ``"sparse"`` or ``"dense"`` (warmup: dense attention and KL).

    Returns:
        ``{"attention", "selection", "kl", "index_projections", "total"}`` (module docstring).
        The main projections (``linear_qkv``, ``linear_proj``) are not included: Megatron
        counts them already.

    Raises:
        ValueError: a non-positive size or an unknown mode.
    """
    (hidden_size, num_heads, head_dim, index_heads, index_key_heads, index_head_dim, block_size,
     top_k) = _check(hidden_size=hidden_size, num_heads=num_heads, head_dim=head_dim,
                     index_heads=index_heads, index_key_heads=index_key_heads,
                     index_head_dim=index_head_dim, block_size=block_size, top_k=top_k)
    (seq_len,) = _check(seq_len=seq_len)
    if mode not in ("sparse", "dense"):
        raise ValueError(f"mode must be 'sparse' or 'dense', got {mode!r}")
    full = dense_pairs(seq_len)
    pairs = full if mode == "dense" else attended_pairs(seq_len, block_size, top_k)
    main, index = num_heads * head_dim, index_heads * index_head_dim
    terms = {
        "attention": FWD_BWD * FMA * 2 * main * pairs,
        "selection": FMA * index * full if mode == "sparse" else 0,
        "kl": FMA * main * pairs + FWD_BWD * FMA * index * pairs,
        "index_projections": 2 * FMA * seq_len * hidden_size * (index_heads + index_key_heads)
        * index_head_dim,
    }
    terms["total"] = sum(terms.values())
    return terms


def megatron_dense_core_flops(seq_len: int, *, num_heads: int, head_dim: int) -> float:
    """Megatron-LM's core-attention FLOPs of one layer and sequence: ``6 * Hq * D * L**2``
    (``standard_self_attn_core_term * seqlen_squared_sum`` of ``num_floating_point_operations``,
    0.16-0.19)."""
    seq_len, num_heads, head_dim = _check(seq_len=seq_len, num_heads=num_heads,
                                          head_dim=head_dim)
    return FWD_BWD * FMA * num_heads * head_dim / 2 * 2 * seq_len * seq_len


def _check(**values: int) -> tuple:
    """The values as ints, in order (numpy integers accepted, bool not); seq_len >= 0, the
    others > 0."""
    checked = []
    for name, value in values.items():
        value = check_int(name, value)
        if value < (0 if name == "seq_len" else 1):
            raise ValueError(f"{name} must be {'>= 0' if name == 'seq_len' else '> 0'}, "
                             f"got {value}")
        checked.append(value)
    return tuple(checked)
