"""Query layouts: where each query sits in its sequence and where its keys start.

Every backend core takes two int32 vectors instead of ``cu_seqlens`` (MSA_SPEC sections 2-3):

- ``q_pos [Tq]``: the query's position ``p`` counted from the start of its own sequence;
- ``q_kbase [Tq]``: the row of ``k`` / ``v`` / ``k_idx`` holding position 0 of that sequence.

The keys of query ``p`` are rows ``q_kbase[p] + u`` for ``u <= q_pos[p]``; block ``b`` is rows
``q_kbase[p] + b*B .. + min((b+1)*B, q_pos[p]+1) - 1``. With ``cu_seqlens`` this is
``q_pos = t - cu_seqlens[seq(t)]``, ``q_kbase = cu_seqlens[seq(t)]``. Context parallelism passes
the local queries' global positions against a gathered key buffer, with no other change.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def query_layout(
    cu_seqlens: Optional[torch.Tensor], total: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Return ``(q_pos, q_kbase)``, both int32 ``[T]``, for packed THD sequences.

    Args:
        cu_seqlens: ``[n+1]`` int32 sequence starts (validated by the caller) or None for one
            sequence of length ``total``.
        total: T.
        device: device of the result.
    """
    t = torch.arange(total, device=device, dtype=torch.int64)
    if cu_seqlens is None:
        return t.to(torch.int32), torch.zeros(total, device=device, dtype=torch.int32)
    starts = cu_seqlens.to(device=device, dtype=torch.int64)
    # seq(t) = the last sequence whose start is <= t (zero-length sequences are skipped).
    seq = torch.searchsorted(starts[1:], t, right=True)
    base = starts[seq]
    return (t - base).to(torch.int32), base.to(torch.int32)
