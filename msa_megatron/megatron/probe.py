"""Selection-quality probe for MSA layers in megatron-core models.

Arm it before a training (or evaluation) forward; every MSA layer then measures, for a small
sample of its query rows, the share of the dense teacher's attention mass that lies inside the
blocks its index branch selects (:func:`msa_megatron.diagnostics.selection_recall`), and where
those blocks lie. The recall reaches :func:`msa_megatron.megatron.get_msa_metrics` as
``msa/recall/layer_NN`` and ``msa/recall`` (and the ceilings ``msa/recall_best/...``: the share
the best allowed selection would hold); the raw samples stay on the probe for tools that want
more (the tiny example's retrieval task checks whether the block holding the needed key was
chosen).

Usage, every N steps::

    probe = arm_selection_probe(model, num_rows=256)   # before the forward of the step
    loss = forward(...); loss.backward()
    metrics = get_msa_metrics()                        # holds msa/recall/... for that step
    probe.samples[layer_number]                        # SelectionSample of each layer

Cost: one selection for the sampled rows plus one dense score row per sampled row and query
head: about ``2 * rows * Hq * D * S`` FLOPs per layer (256 rows, 64 heads, D 128 at 64K:
0.27 TFLOP, under a millisecond on an H200).

Padded THD: the sample holds real tokens only (padding rows are out of the KL too).

Context parallelism: each CP rank measures rows of its own (the sample is drawn among its local
rows); the prefixes of those rows span ranks, so the rank gathers the main and index keys of
the whole micro-batch over the CP group (two all-gathers, gradient stopped; in megatron-core's
load-balanced order, :func:`msa_megatron.parallel.cp_layout.build_cp_layout`) and measures
its rows against them at their global positions. Every CP rank records its mean, so
``msa/recall`` is the mean over the CP ranks' samples. Extra cost per probed layer: the
all-gather of K (``T_global * Hkv * D`` elements) and of the index keys.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, Optional, Union

import torch

from ..diagnostics import SelectionSample, sample_rows, selection_recall
from ..layout import query_layout, real_token_rows
from ..parallel.comm import all_gather_first_dim, group_rank, group_size
from ..parallel.cp_layout import build_cp_layout
from .metrics import record_recall


class SelectionProbe:
    """Measures selection recall of each MSA layer in the next forward it sees.

    Args:
        num_rows: rows sampled uniformly per layer when ``rows`` is None.
        rows: ``[R]`` int64 THD token rows to measure (this rank's local rows), or None.
        seed: seed of the row sample (the same rows for every layer of one forward).

    Attributes:
        samples: ``{layer_number: SelectionSample}`` filled by the forward.
    """

    def __init__(self, num_rows: int = 256, rows: Optional[torch.Tensor] = None,
                 seed: int = 0) -> None:
        if rows is None and num_rows <= 0:
            raise ValueError(f"num_rows must be positive, got {num_rows}")
        if rows is not None and (rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"rows must be a 1-D integer tensor, got {tuple(rows.shape)} "
                             f"{rows.dtype}")
        self.num_rows = num_rows
        self.rows = rows
        self.seed = seed
        self.samples: Dict[int, SelectionSample] = {}

    def rows_for(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The rows to measure among ``num_tokens`` local tokens."""
        if self.rows is not None:
            return self.rows.to(device)
        generator = torch.Generator().manual_seed(self.seed)
        return sample_rows(num_tokens, self.num_rows, generator, device)

    def observe(self, layer_number: int, q: torch.Tensor, k: torch.Tensor, q_idx: torch.Tensor,
                k_idx: torch.Tensor, cu_seqlens: Optional[torch.Tensor], *, block_size: int,
                top_k: int, init_blocks: int, local_blocks: int,
                softmax_scale: Optional[float], index_scale: Optional[float],
                backend: Optional[str], cp_group=None, share_group=None,
                cu_seqlens_real: Optional[torch.Tensor] = None) -> SelectionSample:
        """Measure one layer and record it.

        Args:
            q ``[T, Hq, D]``, k ``[T, Hkv, D]``, q_idx ``[T, Hi, Di]``, k_idx ``[T, Hik, Di]``:
                this rank's THD tensors (RoPE applied).
            cu_seqlens: ``[n+1]`` int32 boundaries (padded ones where padded); under CP the
                global boundaries of the un-split micro-batch (required then).
            block_size ... backend: the layer's selection and scales.
            cp_group: the context-parallel group (None / one rank: no CP).
            share_group: the TP ranks sharing this rank's one index head (TP > Hkv), each with
                some of its query heads: the sampled rows' q are all-gathered over it, so the
                teacher is the mean over all of the index head's query heads.
            cu_seqlens_real: the real boundaries of padded THD (global under CP), or None:
                a sample drawn here (``rows`` None) then holds real tokens only, as the KL does
                (a rank whose rows are all padding records nothing); given ``rows`` are kept.

        Returns:
            The :class:`~msa_megatron.diagnostics.SelectionSample` (rows are local rows).

        Raises:
            ValueError: CP without ``cu_seqlens``; bad rows (see ``selection_recall``).
        """
        positions = None
        k, k_idx = k.detach(), k_idx.detach()
        padded = cu_seqlens
        if group_size(cp_group) > 1:
            if cu_seqlens is None:
                raise ValueError("the selection probe under context parallelism needs the "
                                 "global cu_seqlens")
            layout = build_cp_layout(cu_seqlens, group_size(cp_group), group_rank(cp_group),
                                     block_size, q.device, total_local=q.shape[0])
            with torch.no_grad():
                k = all_gather_first_dim(k, cp_group)[layout.gathered_to_global]
                k_idx = all_gather_first_dim(k_idx, cp_group)[layout.gathered_to_global]
            positions = (layout.q_pos, layout.q_kbase)
            cu_seqlens = None
        elif group_size(share_group) > 1 or (self.rows is None and cu_seqlens_real is not None):
            # the sample of real rows and the shared head's gathered rows need the layout:
            # built once here, and selection_recall reads it instead of building its own
            positions = query_layout(cu_seqlens, q.shape[0], q.device)
            cu_seqlens = None
        rows = self._rows(q.shape[0], q.device, padded, cu_seqlens_real, positions)
        q, q_idx = q.detach(), q_idx.detach()
        if group_size(share_group) > 1:
            positions = tuple(t[rows] for t in positions)
            with torch.no_grad():  # [R, h, D] of every sharing rank -> [R, share * h, D]
                heads = all_gather_first_dim(q[rows].transpose(0, 1).contiguous(), share_group)
            q, q_idx = heads.transpose(0, 1), q_idx[rows]
            local_rows, rows = rows, torch.arange(rows.numel(), device=q.device)
        else:
            local_rows = None
        sample = selection_recall(
            q, k, q_idx, k_idx, rows, cu_seqlens, block_size=block_size,
            top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
            softmax_scale=softmax_scale, index_scale=index_scale, backend=backend,
            positions=positions)
        if local_rows is not None:
            sample = dataclasses.replace(sample, rows=local_rows)
        self.samples[layer_number] = sample
        record_recall(layer_number, sample.recall, sample.best_recall)
        return sample

    def _rows(self, num_tokens: int, device: torch.device, cu_seqlens: Optional[torch.Tensor],
              cu_seqlens_real: Optional[torch.Tensor], positions) -> torch.Tensor:
        """The local rows to measure: the given ones, else a sample of the real tokens."""
        real = None
        if self.rows is None and cu_seqlens_real is not None and cu_seqlens is not None:
            q_pos, q_kbase = positions  # observe built them (no CP) or took the CP layout's
            real = real_token_rows(cu_seqlens, cu_seqlens_real, q_pos, q_kbase)
        if real is None:
            return self.rows_for(num_tokens, device)
        return real[self.rows_for(real.numel(), device)] if real.numel() else real


def arm_selection_probe(model: Union[torch.nn.Module, Iterable[torch.nn.Module]],
                        num_rows: int = 256, rows: Optional[torch.Tensor] = None,
                        seed: int = 0) -> SelectionProbe:
    """Make every MSA layer of ``model`` measure its selection recall in its next forward.

    Each layer measures once (the first forward after arming; an activation recomputation of
    that forward is skipped) and then disarms itself.

    Args:
        model: a module or megatron's list of model chunks.
        num_rows: rows sampled per layer (when ``rows`` is None).
        rows: explicit ``[R]`` local THD token rows to measure.
        seed: seed of the sample.

    Returns:
        The :class:`SelectionProbe`; its ``samples`` fill in during the forward.
    """
    from .attention import _msa_cores

    probe = SelectionProbe(num_rows=num_rows, rows=rows, seed=seed)
    for core in _msa_cores(model):
        core.probe = probe
    return probe
