"""Public op entry points: validation, backend dispatch, composition of the three cores."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import torch_backend  # noqa: F401  imported here so torch.compile never has to import it
from .backends import get_backend, resolve_backend
from .layout import query_layout
from .validation import (
    check_backend_limits,
    check_cu_seqlens,
    check_index_inputs,
    check_main_inputs,
    check_options,
    check_scale,
)


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
    check_options(block_size, top_k, init_blocks, local_blocks, backend)
    check_scale("index_scale", index_scale)
    T, Hi, Hik, Di = check_index_inputs(q_idx, k_idx)
    check_cu_seqlens(cu_seqlens, T, q_idx.device)
    name = resolve_backend(backend, q_idx.device)
    check_backend_limits(name, q_idx.dtype, {"Di": Di}, block_size, q_idx.device)
    q_pos, q_kbase = query_layout(cu_seqlens, T, q_idx.device)
    return get_backend(name).select(
        q_idx, k_idx, q_pos, q_kbase, block_size=block_size, top_k=top_k,
        init_blocks=init_blocks, local_blocks=local_blocks, index_scale=index_scale,
    )


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
    check_options(block_size, top_k, init_blocks, local_blocks, backend, mode)
    check_scale("softmax_scale", softmax_scale)
    check_scale("index_scale", index_scale)
    T, Hq, Hkv, D, Hi, Hik, Di = check_main_inputs(q, k, v, q_idx, k_idx)
    check_cu_seqlens(cu_seqlens, T, q.device)
    name = resolve_backend(backend, q.device)
    check_backend_limits(name, q.dtype, {"D": D, "Di": Di}, block_size, q.device)
    q_pos, q_kbase = query_layout(cu_seqlens, T, q.device)
    return msa_attention_core(
        q, k, v, q_idx, k_idx, q_pos, q_kbase, backend=name, block_size=block_size,
        top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
        softmax_scale=softmax_scale, index_scale=index_scale, mode=mode,
        kl_scale=1.0 / (max(T, 1) * Hi),
    )


def msa_attention_core(
    q, k, v, q_idx, k_idx, q_pos, q_kbase, *, backend: str, block_size: int, top_k: int,
    init_blocks: int, local_blocks: int, softmax_scale: Optional[float],
    index_scale: Optional[float], mode: str, kl_scale: float,
    block_idx: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Validated-input composition used by the public op and the parallel layers.

    Same as :func:`msa_attention` but in the general query layout (``q_pos``, ``q_kbase``),
    with the KL normaliser given (``kl_scale = 1 / (N * Hi_total)``) and an optional
    precomputed ``block_idx`` (reused, never recomputed). No validation: callers validate.
    """
    impl = get_backend(backend)
    if mode == "sparse":
        if block_idx is None:
            block_idx = impl.select(
                q_idx.detach(), k_idx.detach(), q_pos, q_kbase, block_size=block_size,
                top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
                index_scale=index_scale,
            )
    else:
        block_idx = None
    out, lse = impl.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=block_size,
                              softmax_scale=softmax_scale, index_heads=q_idx.shape[1])
    kl = impl.kl(q.detach(), k.detach(), lse.detach(), q_idx, k_idx, block_idx, q_pos, q_kbase,
                 block_size=block_size, softmax_scale=softmax_scale, index_scale=index_scale,
                 kl_scale=kl_scale)
    return out, kl
