"""Selection-quality probe for MSA layers in megatron-core models.

Arm it before a training (or evaluation) forward; every MSA layer then measures, for a small
sample of its query rows, the share of the dense teacher's attention mass that lies inside the
blocks its index branch selects (:func:`msa_megatron.diagnostics.selection_recall`), and where
those blocks lie. The recall reaches :func:`msa_megatron.megatron.get_msa_metrics` as
``msa/recall/layer_NN`` and ``msa/recall``; the raw samples stay on the probe for tools that want
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

Context parallelism: the sampled rows' prefixes span ranks, which this probe does not gather
yet; under CP it records nothing (and says so once).
"""

from __future__ import annotations

import warnings
from typing import Dict, Iterable, Optional, Union

import torch

from ..diagnostics import SelectionSample, sample_rows, selection_recall
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
                backend: Optional[str]) -> SelectionSample:
        """Measure one layer (THD tensors of this rank, no context parallelism) and record it."""
        sample = selection_recall(
            q.detach(), k.detach(), q_idx.detach(), k_idx.detach(),
            self.rows_for(q.shape[0], q.device), cu_seqlens, block_size=block_size,
            top_k=top_k, init_blocks=init_blocks, local_blocks=local_blocks,
            softmax_scale=softmax_scale, index_scale=index_scale, backend=backend)
        self.samples[layer_number] = sample
        record_recall(layer_number, sample.recall)
        return sample


_CP_WARNED = False


def warn_probe_under_cp() -> None:
    """Say once that the probe records nothing under context parallelism."""
    global _CP_WARNED
    if not _CP_WARNED:
        warnings.warn("selection probe: context parallelism is not supported yet; "
                      "msa/recall is not measured for context-parallel layers")
        _CP_WARNED = True


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
