"""MSA_SPEC sections 2-5 as plain per-token, per-head Python loops (float64, slow, tiny shapes).

Written from the spec text alone, independently of :mod:`msa_megatron.reference`, to check
the oracle itself. Sequences are given as a list of lengths (packed THD order). Every function
works on float64 tensors and keeps autograd, so gradients come from ``torch.autograd``.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch


def _sequences(lengths: Sequence[int]) -> List[Tuple[int, int]]:
    """``(start row, length)`` of every sequence."""
    out, start = [], 0
    for n in lengths:
        out.append((start, int(n)))
        start += int(n)
    return out


def spec_select(
    q_idx: torch.Tensor, k_idx: torch.Tensor, lengths: Sequence[int], *, block_size: int,
    top_k: int, init_blocks: int = 0, local_blocks: int = 1, index_scale: Optional[float] = None,
) -> torch.Tensor:
    """MSA_SPEC section 2: ``[T, Hi, top_k]`` int32 selected blocks per token and index head."""
    T, Hi, Di = q_idx.shape
    Hik = k_idx.shape[1]
    scale = Di ** -0.5 if index_scale is None else index_scale
    result = torch.full((T, Hi, top_k), -1, dtype=torch.int32)
    for start, n in _sequences(lengths):
        for p in range(n):
            own = p // block_size
            for i in range(Hi):
                key_head = i // (Hi // Hik)
                block_score = {}
                for b in range(own + 1):
                    best = -math.inf
                    for u in range(b * block_size, min((b + 1) * block_size, p + 1)):
                        dot = torch.dot(q_idx[start + p, i], k_idx[start + u, key_head])
                        z = scale * float(dot)
                        best = max(best, z)
                    block_score[b] = best
                forced = [b for b in range(own + 1) if b > own - local_blocks or b < init_blocks]
                others = [b for b in range(own + 1) if b not in forced]
                others.sort(key=lambda b: (-block_score[b], b))  # ties to the lower block
                chosen = sorted(forced + others[: top_k - len(forced)])
                for slot, b in enumerate(chosen):
                    result[start + p, i, slot] = b
    return result


def _support(
    block_idx: Optional[torch.Tensor], row: int, index_head: int, p: int, block_size: int
) -> List[int]:
    """Key positions ``u <= p`` of the support (every ``u <= p`` in dense mode)."""
    if block_idx is None:
        return list(range(p + 1))
    blocks = {int(b) for b in block_idx[row, index_head] if b >= 0}
    return [u for u in range(p + 1) if u // block_size in blocks]


def spec_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: Optional[torch.Tensor],
    lengths: Sequence[int], *, block_size: int, index_heads: int,
    softmax_scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MSA_SPEC sections 3 and 5: ``(out [T, Hq, D], lse [T, Hq])``; dense if block_idx None."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    out_rows, lse_rows = [], []
    for start, n in _sequences(lengths):
        for p in range(n):
            out_heads, lse_heads = [], []
            for h in range(Hq):
                g = h // (Hq // Hkv)
                i = h // (Hq // index_heads)
                support = _support(block_idx, start + p, i, p, block_size)
                logits = [scale * torch.dot(q[start + p, h], k[start + u, g]) for u in support]
                top = max(float(x.detach()) for x in logits)
                weights = [torch.exp(x - top) for x in logits]
                total = sum(weights)
                out_heads.append(sum(w * v[start + u, g] for w, u in zip(weights, support)) / total)
                lse_heads.append(top + torch.log(total))
            out_rows.append(torch.stack(out_heads))
            lse_rows.append(torch.stack(lse_heads))
    return torch.stack(out_rows), torch.stack(lse_rows)


def spec_kl(
    q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
    block_idx: Optional[torch.Tensor], lengths: Sequence[int], *, block_size: int,
    softmax_scale: Optional[float] = None, index_scale: Optional[float] = None,
    kl_scale: Optional[float] = None,
) -> torch.Tensor:
    """MSA_SPEC section 4: ``kl_scale * sum_{p,i} KL(T || Qs)``, default ``1 / (N * Hi)``.

    The teacher is built from detached q, k; the value is differentiable in q_idx, k_idx.
    """
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    Hi, Di = q_idx.shape[1], q_idx.shape[2]
    Hik = k_idx.shape[1]
    main_scale = D ** -0.5 if softmax_scale is None else softmax_scale
    idx_scale = Di ** -0.5 if index_scale is None else index_scale
    norm = 1.0 / (T * Hi) if kl_scale is None else kl_scale
    q, k = q.detach(), k.detach()
    total = torch.zeros((), dtype=q_idx.dtype)
    for start, n in _sequences(lengths):
        for p in range(n):
            for i in range(Hi):
                support = _support(block_idx, start + p, i, p, block_size)
                heads = range(i * (Hq // Hi), (i + 1) * (Hq // Hi))
                teacher = [0.0] * len(support)
                for h in heads:
                    g = h // (Hq // Hkv)
                    logits = [main_scale * float(torch.dot(q[start + p, h], k[start + u, g]))
                              for u in support]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    z_sum = sum(weights)
                    for j, w in enumerate(weights):
                        teacher[j] += w / z_sum / len(heads)
                key_head = i // (Hi // Hik)
                z = [idx_scale * torch.dot(q_idx[start + p, i], k_idx[start + u, key_head])
                     for u in support]
                log_norm = torch.logsumexp(torch.stack(z), dim=0)
                for t_u, z_u in zip(teacher, z):
                    if t_u > 0.0:  # 0 log 0 = 0
                        total = total + t_u * (math.log(t_u) - (z_u - log_norm))
    return total * norm
