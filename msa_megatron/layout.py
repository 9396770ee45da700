"""Query layouts: where each query sits in its sequence and where its keys start.

Every backend core takes two int32 vectors instead of ``cu_seqlens`` (MSA_SPEC sections 2-3):

- ``q_pos [Tq]``: the query's position ``p`` counted from the start of its own sequence;
- ``q_kbase [Tq]``: the row of ``k`` / ``v`` / ``k_idx`` holding position 0 of that sequence.

The keys of query ``p`` are rows ``q_kbase[p] + u`` for ``u <= q_pos[p]``; block ``b`` is rows
``q_kbase[p] + b*B .. + min((b+1)*B, q_pos[p]+1) - 1``. With ``cu_seqlens`` this is
``q_pos = t - cu_seqlens[seq(t)]``, ``q_kbase = cu_seqlens[seq(t)]``. Context parallelism passes
the local queries' global positions against a gathered key buffer, with no other change
(:func:`msa_megatron.parallel.cp_layout.build_cp_layout`).

This module is plain index maths shared by the oracle (:mod:`msa_megatron.reference`), the
composer (:mod:`msa_megatron.core`) and the parallel layouts; it imports nothing of the package.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence, Tuple

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
    # seq(t) = the last sequence whose start is <= t (zero-length sequences are skipped); since
    # starts[0] = 0 <= t, that is (number of starts <= t) - 1. The boundaries passed to
    # searchsorted are the whole tensor, never a slice: inductor's GPU lowering of searchsorted
    # needs a strided buffer and fails on a slice view (torch 2.11: NotImplementedError SliceView).
    seq = torch.searchsorted(starts, t, right=True) - 1
    base = starts[seq]
    return (t - base).to(torch.int32), base.to(torch.int32)


_SHARED_ATTR = "_msa_query_layout"  # shared_query_layout's memo on a cu_seqlens tensor
_SHARED_SINGLE: "OrderedDict[tuple, tuple]" = OrderedDict()  # (T, device) -> memo, cu None
_SHARED_SINGLE_MAX = 8


def shared_query_layout(
    cu_seqlens: Optional[torch.Tensor], total: int, device: torch.device,
    values: Optional[Sequence[int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`query_layout`, the same tensor objects again for the same layout: remembered on
    the ``cu_seqlens`` tensor (an attribute, living as long as it; a hit needs the same values,
    the same ``total`` and device), or for ``cu_seqlens=None`` per ``(total, device)`` (the last
    8). Every layer of a micro-batch, and every step of one shape, then hands the backends the
    same ``q_pos`` / ``q_kbase``, so what a backend derives from them on the host (the dense
    routes' sequence lengths, ``ops.dense.sequences_of``) is read once.

    A hit compares the values themselves, not the tensor's autograd version counter: writes
    that do not move ``_version`` (a numpy buffer shared by ``torch.from_numpy`` and refilled,
    ``.data`` writes, ``torch.distributed.broadcast`` into a kept buffer, DLPack) change the
    layout too. The results must not be modified in place (a modified one is rebuilt: the memo
    keeps their versions). Not remembered under ``torch.compile`` tracing, in inference mode
    (inference tensors cannot be saved for a later backward) or on the meta device.

    Args:
        cu_seqlens, total, device: as :func:`query_layout`.
        values: ``cu_seqlens`` read on the host (what
            :func:`msa_megatron.ops.validation.check_cu_seqlens` returns), so that the memo
            costs no second read; read here when None.
    """
    if (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
            or torch.device(device).type == "meta"
            or (cu_seqlens is not None and (cu_seqlens.is_inference() or cu_seqlens.is_meta))):
        return query_layout(cu_seqlens, total, device)
    key = (total, str(device))
    if cu_seqlens is None:
        memo = _SHARED_SINGLE.get(key)
        values = None
    else:
        memo = getattr(cu_seqlens, _SHARED_ATTR, None)
        values = tuple(int(x) for x in (cu_seqlens.tolist() if values is None else values))
    if memo is not None:
        memo_key, memo_values, q_pos, q_kbase, pos_version, kbase_version = memo
        if (memo_key == key and memo_values == values and q_pos._version == pos_version
                and q_kbase._version == kbase_version):
            if cu_seqlens is None:
                _SHARED_SINGLE.move_to_end(key)
            return q_pos, q_kbase
    q_pos, q_kbase = query_layout(cu_seqlens, total, device)
    memo = (key, values, q_pos, q_kbase, q_pos._version, q_kbase._version)
    if cu_seqlens is None:
        _SHARED_SINGLE[key] = memo
        _SHARED_SINGLE.move_to_end(key)
        while len(_SHARED_SINGLE) > _SHARED_SINGLE_MAX:
            _SHARED_SINGLE.popitem(last=False)
    else:
        try:
            setattr(cu_seqlens, _SHARED_ATTR, memo)
        except (AttributeError, TypeError, RuntimeError):  # a tensor type without attributes
            pass
    return q_pos, q_kbase


def real_token_rows(cu_seqlens_padded: torch.Tensor, cu_seqlens_real: Optional[torch.Tensor],
                    q_pos: torch.Tensor, q_kbase: torch.Tensor) -> Optional[torch.Tensor]:
    """Rows of real (non-padding) query tokens of padded packed sequences (megatron-core's THD
    ``cu_seqlens_q_padded`` next to ``cu_seqlens_q``).

    A token at position ``p`` of sequence ``s`` is padding when ``p >= real length of s``
    (megatron pads each sequence at its end).

    Args:
        cu_seqlens_padded: ``[n+1]`` int32 padded boundaries (those the tokens are laid out by).
        cu_seqlens_real: ``[n+1]`` int32 real boundaries, or None (no padding).
        q_pos, q_kbase: ``[T]`` int32 query layout against the padded boundaries: position in
            the sequence, row of its start.

    Returns:
        ``[R]`` int64 ascending rows of real tokens, or None when no sequence is padded (and
        for meta tensors, whose rows are unknown: the KL is a 0-dim tensor either way).

    Raises:
        TypeError: ``cu_seqlens_real`` not an int32 tensor.
        ValueError: shapes differ, the real boundaries do not start at 0, or a real length is
            negative or above its padded length.
    """
    if cu_seqlens_real is None:
        return None
    if not isinstance(cu_seqlens_real, torch.Tensor) or cu_seqlens_real.dtype != torch.int32:
        raise TypeError("the real (unpadded) cu_seqlens must be an int32 torch.Tensor or None")
    if cu_seqlens_real.shape != cu_seqlens_padded.shape:
        raise ValueError(
            f"the real (unpadded) cu_seqlens has shape {list(cu_seqlens_real.shape)} but the "
            f"padded cu_seqlens has shape {list(cu_seqlens_padded.shape)}"
        )
    if q_pos.is_meta:  # shape inference: R depends on the values
        return None
    real_bounds = cu_seqlens_real.to(device=q_pos.device, dtype=torch.int64)
    real = torch.diff(real_bounds)
    padded = torch.diff(cu_seqlens_padded.to(device=q_pos.device, dtype=torch.int64))
    if bool((real < 0).any() | (real > padded).any() | (real_bounds[:1] != 0).any()):
        raise ValueError(
            f"the real (unpadded) cu_seqlens {cu_seqlens_real.tolist()} must start at 0 and have "
            f"non-negative lengths no larger than those of the padded cu_seqlens "
            f"{cu_seqlens_padded.tolist()}"
        )
    if bool((real == padded).all()):
        return None
    starts = cu_seqlens_padded.to(device=q_pos.device, dtype=torch.int64)
    # The last boundary <= the start row: skips zero-length sequences that share the start.
    seq = torch.searchsorted(starts, q_kbase.to(torch.int64), right=True) - 1
    keep = q_pos.to(torch.int64) < real[seq]
    return torch.nonzero(keep).flatten()
