"""The oracle: MSA_SPEC.md sections 2-5 in plain, vectorised PyTorch.

Dense ``[Tq, Tk]`` masks, any float dtype (float64 included), autograd for every gradient.
O(T^2) memory: for tests and small shapes only (T = 2048 runs on a CPU in seconds).
Scores are computed in float32 (float64 for float64 inputs), as the spec asks for ranking.

The ``*_core`` functions take the general query layout of :mod:`msa_megatron.layout`
(``q_pos``, ``q_kbase``); :func:`select_blocks_reference` and :func:`msa_attention_reference`
take ``cu_seqlens`` like the public API.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .layout import query_layout


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def key_geometry(
    q_pos: torch.Tensor, q_kbase: torch.Tensor, num_keys: int, block_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Causal mask and block numbers of every (query, key row) pair.

    Returns:
        causal: ``[Tq, Tk]`` bool, key row ``r`` is in the query's sequence and ``u <= p``.
        blk: ``[Tq, Tk]`` int64, the key's block number in its sequence (0 where not causal).
    """
    rows = torch.arange(num_keys, device=q_pos.device, dtype=torch.int64)
    u = rows[None, :] - q_kbase.to(torch.int64)[:, None]
    causal = (u >= 0) & (u <= q_pos.to(torch.int64)[:, None])
    blk = torch.where(causal, u // block_size, torch.zeros_like(u))
    return causal, blk


def index_scores(q_idx, k_idx, index_scale: Optional[float]) -> torch.Tensor:
    """Token scores ``z [Hi, Tq, Tk]`` (MSA_SPEC 2.1), unmasked, in the accumulation dtype."""
    Hi, Hik, Di = q_idx.shape[1], k_idx.shape[1], q_idx.shape[2]
    scale = Di ** -0.5 if index_scale is None else index_scale
    acc = _acc_dtype(q_idx.dtype)
    qi = q_idx.to(acc).transpose(0, 1)  # [Hi, Tq, Di]
    ki = k_idx.to(acc).transpose(0, 1).repeat_interleave(Hi // Hik, dim=0)  # [Hi, Tk, Di]
    return scale * torch.matmul(qi, ki.transpose(1, 2))


def block_scores_reference(
    q_idx, k_idx, q_pos, q_kbase, *, block_size: int, index_scale: Optional[float] = None
) -> torch.Tensor:
    """Block scores ``s [Hi, Tq, nblk]`` (MSA_SPEC 2.2); ``-inf`` for blocks after ``blk(p)``."""
    z = index_scores(q_idx, k_idx, index_scale)
    causal, blk = key_geometry(q_pos, q_kbase, k_idx.shape[0], block_size)
    nblk = int(q_pos.max().item()) // block_size + 1 if q_pos.numel() else 1
    z = z.masked_fill(~causal, float("-inf"))
    s = torch.full((z.shape[0], z.shape[1], nblk), float("-inf"), dtype=z.dtype, device=z.device)
    index = blk.unsqueeze(0).expand_as(z)
    return s.scatter_reduce(2, index, z, reduce="amax", include_self=True)


def select_core_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    q_pos: torch.Tensor,
    q_kbase: torch.Tensor,
    *,
    block_size: int,
    top_k: int,
    init_blocks: int = 0,
    local_blocks: int = 1,
    index_scale: Optional[float] = None,
) -> torch.Tensor:
    """Block selection (MSA_SPEC section 2) for queries in a general layout.

    Args:
        q_idx: ``[Tq, Hi, Di]`` index queries.
        k_idx: ``[Tk, Hik, Di]`` index keys.
        q_pos, q_kbase: ``[Tq]`` int32 query layout (see :mod:`msa_megatron.layout`).

    Returns:
        ``[Tq, Hi, top_k]`` int32 block numbers relative to the sequence start, ascending,
        ``-1`` in unused slots.
    """
    Tq, Hi = q_idx.shape[0], q_idx.shape[1]
    s = block_scores_reference(q_idx, k_idx, q_pos, q_kbase, block_size=block_size,
                               index_scale=index_scale)
    nblk = s.shape[2]
    b = torch.arange(nblk, device=s.device, dtype=torch.int64)[None, :]
    own = (q_pos.to(torch.int64) // block_size)[:, None]
    eligible = b <= own  # [Tq, nblk]
    forced = eligible & ((b > own - local_blocks) | (b < init_blocks))
    # Rank (MSA_SPEC 2.4): forced first, then eligible by score with NaN above every number
    # (a descending sort puts NaN first), ties to the lower block index (stable sorts),
    # ineligible last.
    klass = eligible.to(torch.int64) + forced.to(torch.int64)  # 2 forced, 1 eligible, 0 not
    order = torch.sort(s, dim=2, descending=True, stable=True).indices
    klass_sorted = torch.gather(klass.unsqueeze(0).expand(Hi, -1, -1), 2, order)
    order = torch.gather(order, 2, torch.sort(klass_sorted, dim=2, descending=True, stable=True).indices)
    kk = min(top_k, nblk)
    chosen = order[:, :, :kk]
    n_eligible = eligible.sum(dim=1)  # [Tq]
    slot = torch.arange(kk, device=s.device)[None, None, :]
    chosen = torch.where(slot < n_eligible[None, :, None], chosen, torch.full_like(chosen, nblk))
    chosen = torch.sort(chosen, dim=2).values
    chosen = torch.where(chosen == nblk, torch.full_like(chosen, -1), chosen)
    out = torch.full((Hi, Tq, top_k), -1, dtype=torch.int64, device=s.device)
    out[:, :, :kk] = chosen
    return out.permute(1, 0, 2).contiguous().to(torch.int32)


def support_mask(
    block_idx: Optional[torch.Tensor], q_pos, q_kbase, num_keys: int, block_size: int, num_heads: int
) -> torch.Tensor:
    """Support of each index head ``[Hi, Tq, Tk]`` bool (MSA_SPEC section 3).

    ``block_idx=None`` is dense (warmup) mode: the whole causal row; ``num_heads`` is then Hi.
    """
    causal, blk = key_geometry(q_pos, q_kbase, num_keys, block_size)
    if block_idx is None:
        return causal.unsqueeze(0).expand(num_heads, -1, -1)
    Tq, Hi, _ = block_idx.shape
    nblk = int(blk.max().item()) + 1 if blk.numel() else 1
    sel = torch.zeros(Hi, Tq, nblk + 1, dtype=torch.bool, device=block_idx.device)
    idx = block_idx.to(torch.int64).permute(1, 0, 2)
    idx = torch.where((idx >= 0) & (idx < nblk), idx, torch.full_like(idx, nblk))
    sel.scatter_(2, idx, True)
    sel = sel[:, :, :nblk]
    return causal.unsqueeze(0) & torch.gather(sel, 2, blk.unsqueeze(0).expand(Hi, -1, -1))


def _nonfinite_rows(x: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: row ``n`` of ``x [H, N, F]`` holds a NaN or an Inf in some head."""
    return ~torch.isfinite(x).all(dim=2).all(dim=0)


def _support_scores(a: torch.Tensor, b: torch.Tensor, supp: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``scale * <a[h, p], b[h, u]>`` on the support, ``-inf`` off it (``[H, Tq, Tk]``).

    ``a [H, Tq, F]``, ``b [H, Tk, F]``, ``supp [H, Tq, Tk]`` bool. Rows holding NaN/Inf enter
    the GEMM as zeros and are added back pair by pair on the support only, with both factors
    masked before the product: neither the value nor any gradient ever multiplies a non-finite
    number by a zero from outside the support (MSA_SPEC section 7: affected rows only).
    """
    bad_a, bad_b = _nonfinite_rows(a), _nonfinite_rows(b)
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    s = scale * torch.matmul(a.masked_fill(bad_a[None, :, None], 0.0),
                             b.masked_fill(bad_b[None, :, None], 0.0).transpose(1, 2))
    if bool(bad_a.any()):
        r = bad_a.nonzero().flatten()
        m = supp[:, r, :, None]  # [H, R, Tk, 1]
        exact = scale * (torch.where(m, a[:, r, None, :], zero)
                         * torch.where(m, b[:, None, :, :], zero)).sum(dim=3)
        s = s.index_copy(1, r, torch.where(supp[:, r], exact, s.index_select(1, r)))
    if bool(bad_b.any()):
        c = bad_b.nonzero().flatten()
        m = supp[:, :, c, None]  # [H, Tq, C, 1]
        exact = scale * (torch.where(m, a[:, :, None, :], zero)
                         * torch.where(m, b[:, None, c, :], zero)).sum(dim=3)
        s = s.index_copy(2, c, torch.where(supp[:, :, c], exact, s.index_select(2, c)))
    return s.masked_fill(~supp, float("-inf"))


def _support_matmul(p: torch.Tensor, v: torch.Tensor, supp: torch.Tensor) -> torch.Tensor:
    """``p @ v`` for ``p [H, Tq, Tk]`` that is exactly 0 off ``supp``, ``v [H, Tk, D]``: rows of
    ``v`` holding NaN/Inf are added pair by pair on the support only (no ``0 * NaN``, in the
    value or in a gradient)."""
    bad = _nonfinite_rows(v)
    out = torch.matmul(p, v.masked_fill(bad[None, :, None], 0.0))
    if bool(bad.any()):
        c = bad.nonzero().flatten()
        m = supp[:, :, c, None]  # [H, Tq, C, 1]
        zero = torch.zeros((), dtype=p.dtype, device=p.device)
        out = out + (torch.where(m, p[:, :, c, None], zero)
                     * torch.where(m, v[:, None, c, :], zero)).sum(dim=2)
    return out


def attention_core_reference(
    q, k, v, block_idx, q_pos, q_kbase, *, block_size: int, softmax_scale: Optional[float] = None,
    index_heads: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Main branch (MSA_SPEC section 3; dense causal when ``block_idx`` is None).

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``; block_idx: ``[Tq, Hi, k]`` int32 or None.
        index_heads: Hi, needed only in dense mode (defaults to Hkv).

    Returns:
        out ``[Tq, Hq, D]`` in ``q.dtype`` (differentiable), lse ``[Tq, Hq]`` accumulation dtype.
    """
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    Hi = block_idx.shape[1] if block_idx is not None else (index_heads or Hkv)
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    acc = _acc_dtype(q.dtype)
    supp = support_mask(block_idx, q_pos, q_kbase, k.shape[0], block_size, Hi)
    supp = supp.repeat_interleave(Hq // Hi, dim=0)  # [Hq, Tq, Tk]
    qh = q.to(acc).transpose(0, 1)
    kh = k.to(acc).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
    vh = v.to(acc).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
    logits = _support_scores(qh, kh, supp, scale)
    lse = torch.logsumexp(logits, dim=2)  # [Hq, Tq]
    p = torch.where(supp, torch.exp(logits - lse.unsqueeze(2)), logits.new_zeros(()))
    out = _support_matmul(p, vh, supp)
    out = out.transpose(0, 1).to(q.dtype)
    return out, lse.transpose(0, 1).contiguous()


def kl_core_reference(
    q, k, q_idx, k_idx, block_idx, q_pos, q_kbase, *, block_size: int,
    softmax_scale: Optional[float] = None, index_scale: Optional[float] = None, kl_scale: float = 1.0,
) -> torch.Tensor:
    """``kl_scale * sum_{i,p} KL[i,p]`` (MSA_SPEC section 4; whole causal row if block_idx None).

    The teacher is computed from detached q, k; the result is differentiable with respect to
    q_idx and k_idx only.

    Returns: 0-dim tensor in the accumulation dtype (float32, float64 for float64 inputs).
    """
    Tq, Hq, D = q.shape
    Hi = q_idx.shape[1]
    Hkv = k.shape[1]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    acc = _acc_dtype(q.dtype)
    supp = support_mask(block_idx, q_pos, q_kbase, k.shape[0], block_size, Hi)  # [Hi, Tq, Tk]
    with torch.no_grad():
        qh = q.detach().to(acc).transpose(0, 1)
        kh = k.detach().to(acc).transpose(0, 1).repeat_interleave(Hq // Hkv, dim=0)
        logits = scale * torch.matmul(qh, kh.transpose(1, 2))
        logits = logits.masked_fill(~supp.repeat_interleave(Hq // Hi, dim=0), float("-inf"))
        p = torch.exp(logits - torch.logsumexp(logits, dim=2, keepdim=True))
        teacher = p.reshape(Hi, Hq // Hi, Tq, k.shape[0]).mean(dim=1)  # [Hi, Tq, Tk]
        # 0 log 0 = 0; a NaN teacher (non-finite inputs in the row's support) stays NaN.
        log_teacher = torch.where(teacher == 0, torch.zeros_like(teacher), torch.log(teacher))
    Hik, Di = k_idx.shape[1], q_idx.shape[2]
    qi = q_idx.to(acc).transpose(0, 1)
    ki = k_idx.to(acc).transpose(0, 1).repeat_interleave(Hi // Hik, dim=0)
    z = _support_scores(qi, ki, supp, Di ** -0.5 if index_scale is None else index_scale)
    with torch.no_grad():
        log_qs = z - torch.logsumexp(z, dim=2, keepdim=True)
        log_qs = torch.where(supp, log_qs, torch.zeros_like(log_qs))
        kl = torch.where(teacher == 0, torch.zeros_like(teacher), teacher * (log_teacher - log_qs))
        # MSA_SPEC section 4: dKL/dz = Qs - T on the support. (Autograd of the value would give
        # Qs * sum(T) - T, the same number when T sums to 1, but NaN on the whole row as soon as
        # one teacher entry is NaN, where the kernels give NaN on that entry only.)
        dz = torch.where(supp, torch.exp(log_qs) - teacher, torch.zeros_like(teacher))
    value, _ = _WithGradient.apply(kl.sum() * kl_scale, z, dz * kl_scale)
    return value


class _WithGradient(torch.autograd.Function):
    """``value`` (a 0-dim tensor) whose gradient with respect to ``x`` is ``grad_x``.

    ``grad_x`` is computed outside autograd, so its own derivative is unknown here: it is also
    returned as a differentiable output, so that under ``create_graph=True`` the gradient leads
    back to this node, where differentiating it raises (a second-order gradient would otherwise
    pass as a constant and silently lose the ``d grad_x / d x`` term).
    """

    @staticmethod
    def forward(ctx, value, x, grad_x):  # noqa: D102
        grad_x = grad_x.clone()
        ctx.save_for_backward(grad_x)
        ctx.set_materialize_grads(False)
        return value.clone(), grad_x

    @staticmethod
    def backward(ctx, grad, grad_of_grad_x):  # noqa: D102
        if grad_of_grad_x is not None:
            raise NotImplementedError(
                "double backward (second-order gradients) of MSA is not supported: the "
                "reference KL (msa_megatron.reference.kl_core_reference) has first-order "
                "gradients only")
        if grad is None:
            return None, None, None
        (grad_x,) = ctx.saved_tensors
        return None, grad * grad_x, None


def select_blocks_reference(
    q_idx, k_idx, cu_seqlens=None, *, block_size=128, top_k=16, init_blocks=0, local_blocks=1,
    index_scale=None,
) -> torch.Tensor:
    """:func:`msa_megatron.select_blocks` by the oracle (THD with ``cu_seqlens``)."""
    q_pos, q_kbase = query_layout(cu_seqlens, q_idx.shape[0], q_idx.device)
    return select_core_reference(
        q_idx, k_idx, q_pos, q_kbase, block_size=block_size, top_k=top_k,
        init_blocks=init_blocks, local_blocks=local_blocks, index_scale=index_scale,
    )


def msa_attention_reference(
    q, k, v, q_idx, k_idx, cu_seqlens=None, *, block_size=128, top_k=16, init_blocks=0,
    local_blocks=1, softmax_scale=None, index_scale=None, mode="sparse", block_idx=None,
    kl_scale=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`msa_megatron.msa_attention` by the oracle.

    ``block_idx`` may be given to reuse a selection; ``kl_scale`` defaults to ``1 / (T * Hi)``.

    Returns: ``(out [T, Hq, D] in q.dtype, kl 0-dim float32)``.
    """
    T, Hi = q_idx.shape[0], q_idx.shape[1]
    q_pos, q_kbase = query_layout(cu_seqlens, T, q.device)
    if mode == "sparse" and block_idx is None:
        with torch.no_grad():
            block_idx = select_core_reference(
                q_idx, k_idx, q_pos, q_kbase, block_size=block_size, top_k=top_k,
                init_blocks=init_blocks, local_blocks=local_blocks, index_scale=index_scale,
            )
    if mode == "dense":
        block_idx = None
    out, _ = attention_core_reference(q, k, v, block_idx, q_pos, q_kbase, block_size=block_size,
                                      softmax_scale=softmax_scale, index_heads=Hi)
    if kl_scale is None:
        kl_scale = 1.0 / (max(T, 1) * Hi)
    kl = kl_core_reference(q, k, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size=block_size,
                           softmax_scale=softmax_scale, index_scale=index_scale, kl_scale=kl_scale)
    return out, kl.to(torch.float32)


__all__ = [
    "key_geometry", "index_scores", "block_scores_reference", "select_core_reference",
    "support_mask", "attention_core_reference", "kl_core_reference",
    "select_blocks_reference", "msa_attention_reference",
]
