"""Selections kept from a checkpoint's first forward for its recomputation (MSA_SPEC section 6).

Under activation checkpointing the core attention of a micro-batch runs twice: without grad in
the checkpoint's forward, then again in backward. The second run must reuse the blocks the first
one chose. Backwards do not always come in the order of their forwards: ``(l0 + l1).backward()``
runs the later micro-batch's layers first, a user may call the backwards in reverse, and a
forward whose backward never comes (a forward-only pass in training mode) leaves its entry
behind. So each stored selection carries a fingerprint of the inputs it was chosen from, and the
recomputation takes the entry whose fingerprint matches its own, not simply the oldest one.

The fingerprint of a pass is, per feature of the index queries and the index keys, the sum over
tokens weighted by fixed pseudo-random signs (one sign per token position), in fp32, plus the
THD boundaries; under CP the key part of every CP rank (a rank's selection reads them all).
Recomputation reproduces the index q/k bitwise under megatron-core's checkpointing (distance
0); the match allows a relative L2 distance of :data:`MATCH_RTOL` for fp32-level differences
(another GEMM algorithm), and is tight on purpose: when a micro-batch's own entry is missing, a
similar micro-batch's must not be taken (different micro-batches differ by about 1.4 in that
measure, one changed token of T by about ``1/sqrt(T)``). When no entry matches (its entry was
dropped, or a recomputation was not bitwise), the recomputation selects again from its inputs,
which gives the same blocks for the same index q/k, and a warning says so once per layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

MATCH_RTOL = 1e-3
"""Largest relative L2 distance between fingerprints of one micro-batch's two passes."""

MAX_STORED = 64
"""Selections kept per layer; beyond it the oldest is dropped (its recomputation selects again).
Megatron's pipeline schedules keep far fewer micro-batches in flight per layer."""

_CHUNK_ELEMENTS = 1 << 23  # elements per fp32 chunk of the fingerprint (32 MiB)

_SIGNS: Dict[Tuple[str, Optional[int]], torch.Tensor] = {}


def token_signs(tokens: int, device: torch.device) -> torch.Tensor:
    """Fixed pseudo-random ``+-1`` weights ``[tokens]`` (fp32): the sign of token position ``t``
    depends on ``t`` only (an integer hash), so any prefix is the same for every length."""
    key = (device.type, device.index)
    signs = _SIGNS.get(key)
    if signs is None or signs.numel() < tokens:
        length = 1 << max(int(tokens) - 1, 0).bit_length()
        t = torch.arange(length, dtype=torch.int64)
        x = (t * 2654435761) % (1 << 32)  # t < 2**31 keeps every product inside int64
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) % (1 << 32)
        x = x ^ (x >> 16)
        signs = ((x & 1) * 2 - 1).to(torch.float32).to(device)
        _SIGNS[key] = signs
    return signs[:tokens]


def fingerprint(q_idx: torch.Tensor, k_idx: torch.Tensor, cp_group=None) -> torch.Tensor:
    """Signed token sums of the THD index queries ``[T, Hi, Di]`` and keys ``[T, Hik, Di]``:
    a fp32 vector of ``Hi*Di + Hik*Di`` entries on their device. Under CP (``cp_group`` of
    size > 1) the key part of every CP rank is all-gathered (``Hi*Di + CP*Hik*Di`` entries):
    a rank's selection reads every rank's index keys, so a micro-batch that differs only in
    another rank's tokens must not match. A collective: call on every rank of the group."""
    signs = token_signs(q_idx.shape[0], q_idx.device)
    parts = []
    for t in (q_idx, k_idx):
        flat = t.reshape(t.shape[0], -1)
        step = max(1, _CHUNK_ELEMENTS // max(flat.shape[1], 1))  # bounds the fp32 copy
        acc = torch.zeros(flat.shape[1], dtype=torch.float32, device=flat.device)
        for start in range(0, flat.shape[0], step):
            acc += signs[start:start + step] @ flat[start:start + step].float()
        parts.append(acc)
    if cp_group is not None and dist.get_world_size(cp_group) > 1:  # None or size 1: no CP
        keys = [torch.empty_like(parts[1]) for _ in range(dist.get_world_size(cp_group))]
        dist.all_gather(keys, parts[1], group=cp_group)
        parts[1:] = keys
    return torch.cat(parts)


@dataclass
class _Entry:
    block_idx: torch.Tensor
    print_: torch.Tensor
    cu_seqlens: Optional[torch.Tensor]
    cu_real: Optional[torch.Tensor]


def _boundaries(cu: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if cu is None else cu.detach().to(torch.int64).clone()


def _may_match(old: Optional[torch.Tensor], new: Optional[torch.Tensor]) -> bool:
    """Whether stored and current boundaries agree in presence and length (values are compared
    on the device)."""
    if old is None or new is None:
        return old is None and new is None
    return old.shape == new.shape


class SelectionStore:
    """A layer's stored selections, found again by fingerprint (see the module docstring)."""

    def __init__(self, layer_number: int = 0) -> None:
        self.layer_number = layer_number
        self._entries: List[_Entry] = []
        self._warned = False

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Drop every stored selection."""
        self._entries.clear()

    def put(self, block_idx: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
            cu_seqlens: Optional[torch.Tensor], cu_real: Optional[torch.Tensor],
            cp_group=None) -> None:
        """Keep ``block_idx`` of a checkpoint's first forward with the fingerprint of its THD
        index q/k and its boundaries (``cu_seqlens``/``cu_real`` None for SBHD/unpadded).
        Under CP (``cp_group``) a collective, as :meth:`take`: every CP rank calls both."""
        if q_idx.is_meta:
            return
        if len(self._entries) >= MAX_STORED:
            self._entries.pop(0)
            self._warn(f"more than {MAX_STORED} selections were stored and not reused; the "
                       "oldest was dropped (call clear_selection_cache after forward-only passes "
                       "in training mode with activation checkpointing)")
        self._entries.append(_Entry(block_idx, fingerprint(q_idx, k_idx, cp_group),
                                    _boundaries(cu_seqlens), _boundaries(cu_real)))

    def take(self, q_idx: torch.Tensor, k_idx: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
             cu_real: Optional[torch.Tensor], cp_group=None) -> Optional[torch.Tensor]:
        """Remove and return the stored ``block_idx`` chosen from these inputs, or None when
        nothing is stored or nothing matches (the caller then selects again). Of several
        matches the closest, then the oldest, is taken. One host read when any entry is a
        candidate."""
        if not self._entries or q_idx.is_meta:  # alike on every CP rank: puts are
            return None
        now = fingerprint(q_idx, k_idx, cp_group)  # before any test a rank could answer alone
        candidates = [i for i, e in enumerate(self._entries)
                      if e.block_idx.shape[0] == q_idx.shape[0] and e.print_.shape == now.shape
                      and _may_match(e.cu_seqlens, cu_seqlens) and _may_match(e.cu_real, cu_real)]
        best = None
        if candidates:
            rows = []
            for i in candidates:
                e = self._entries[i]
                same = torch.ones((), dtype=torch.bool, device=now.device)
                for old, new in ((e.cu_seqlens, cu_seqlens), (e.cu_real, cu_real)):
                    if old is not None:
                        same = same & (old == new.to(old.device, torch.int64)).all().to(now.device)
                rows.append(torch.stack([torch.linalg.vector_norm(e.print_ - now),
                                         torch.linalg.vector_norm(e.print_),
                                         same.to(torch.float32)]))
            best_distance = None
            for i, (distance, norm, same) in zip(candidates, torch.stack(rows).tolist()):
                if same and distance <= MATCH_RTOL * norm and (
                        best is None or distance < best_distance):
                    best, best_distance = i, distance
        if best is None:
            self._warn_unmatched()
            return None
        return self._entries.pop(best).block_idx

    def _warn_unmatched(self) -> None:
        self._warn(f"{len(self._entries)} stored selection(s), none chosen from the inputs of "
                   "this recomputation; selecting again (same blocks for the same index q/k)")

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"MSA layer {self.layer_number}: {message}", stacklevel=3)
