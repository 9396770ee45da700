"""Public op entry points: keyword options -> :class:`msa_megatron.core.MSAOptions`, then the
composer (:mod:`msa_megatron.core`), which validates, dispatches and composes the three cores."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import core
from .ops import torch_backend  # noqa: F401  imported here so torch.compile never has to import it


def select_blocks(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    *,
    block_size: int = 128,
    top_k: int = 16,
    init_blocks: int = 0,
    local_blocks: int = 1,
    index_scale: Optional[float] = None,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Select the top-k key blocks of every query token and index head (MSA_SPEC section 2).

    Args:
        q_idx: ``[T, Hi, Di]`` index queries (fp16/bf16/fp32/fp64), RoPE already applied.
        k_idx: ``[T, Hik, Di]`` index keys, same dtype and device; ``Hi % Hik == 0``.
        cu_seqlens: ``[n+1]`` int32 packed-sequence starts (THD), or None for one sequence.
        block_size: B, key block size in tokens.
        top_k: selected blocks per (token, index head), forced blocks included.
        init_blocks / local_blocks: forced first blocks / forced last blocks up to the own block.
        index_scale: logit scale, default ``Di ** -0.5`` (does not change the ranking).
        backend: ``"reference"``, ``"torch"``, ``"triton"`` or None (triton on CUDA, else torch).

    Returns:
        ``[T, Hi, top_k]`` int32: block numbers relative to each sequence's start, ascending,
        ``-1`` in unused slots. Scores are ranked in fp32; ties go to the lower block.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, options or ``cu_seqlens`` (MSA_SPEC section 7).
    """
    options = core.MSAOptions(block_size=block_size, top_k=top_k, init_blocks=init_blocks,
                              local_blocks=local_blocks, index_scale=index_scale, backend=backend)
    return core.select_blocks(q_idx, k_idx, options=options, cu_seqlens=cu_seqlens)


def msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor] = None,
    *,
    block_size: int = 128,
    top_k: int = 16,
    init_blocks: int = 0,
    local_blocks: int = 1,
    softmax_scale: Optional[float] = None,
    index_scale: Optional[float] = None,
    mode: str = "sparse",
    backend: Optional[str] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MiniMax Sparse Attention with its index-branch KL loss (MSA_SPEC sections 2-5).

    Args:
        q: ``[T, Hq, D]`` main queries (RoPE applied); k, v: ``[T, Hkv, D]``; ``Hq % Hkv == 0``.
        q_idx: ``[T, Hi, Di]`` index queries; k_idx: ``[T, Hik, Di]`` index keys;
            ``Hq % Hi == 0``, ``Hi % Hkv == 0``, ``Hi % Hik == 0``. All five share dtype
            (fp16/bf16/fp32/fp64) and device.
        cu_seqlens: ``[n+1]`` int32 packed-sequence starts (THD), or None for one sequence.
        block_size, top_k, init_blocks, local_blocks: selection (see :func:`select_blocks`).
        softmax_scale: main logit scale, default ``D ** -0.5``.
        index_scale: index logit scale, default ``Di ** -0.5``.
        mode: ``"sparse"`` (selected blocks) or ``"dense"`` (warmup: full causal attention, KL
            over the whole causal row).
        backend: ``"reference"``, ``"torch"``, ``"triton"`` or None (triton on CUDA, else torch).

    Returns:
        ``(out, kl)``: ``out [T, Hq, D]`` in ``q.dtype``, differentiable in q, k, v;
        ``kl`` 0-dim fp32, ``(1 / (T * Hi)) * sum_{p,i} KL[i,p]`` (forward KL, teacher = mean
        attention of the index head's query heads), differentiable in q_idx and k_idx only.

    Raises:
        TypeError / ValueError: bad dtypes, shapes, options or ``cu_seqlens`` (MSA_SPEC section 7).
    """
    options = core.MSAOptions(block_size=block_size, top_k=top_k, init_blocks=init_blocks,
                              local_blocks=local_blocks, softmax_scale=softmax_scale,
                              index_scale=index_scale, mode=mode, backend=backend)
    result = core.msa_layer(q, k, v, q_idx, k_idx, options=options, cu_seqlens=cu_seqlens,
                            kl_scale=_kl_scale(q_idx))
    return result.out, result.kl


def _kl_scale(q_idx: torch.Tensor) -> float:
    """``1 / (T * Hi)`` (1 for an empty batch); shapes are read before validation, so a bad
    ``q_idx`` is reported by the composer's checks."""
    shape = getattr(q_idx, "shape", ())
    if len(shape) != 3:
        return 1.0
    return 1.0 / (max(int(shape[0]), 1) * max(int(shape[1]), 1))
