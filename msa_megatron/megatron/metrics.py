"""Metrics of the MSA layers, reduced over every rank by :func:`get_msa_metrics`.

Per-layer KL values are accumulated on the device without host synchronisation
(:func:`record_kl`, called by each layer's core attention) and read with
:func:`get_msa_metrics`, which reduces them over every rank (TP/CP partial sums added, DP
replicas and micro-batches averaged, pipeline stages gathered).

Under context parallelism each layer also adds the bytes its CP exchanges moved (MSA_SPEC
section 6) to a per-layer accumulator (:func:`cp_stats_accumulator`, handed to the composer
:func:`msa_megatron.core.msa_layer` as ``stats=``, whose backward adds its entries when it runs).
:func:`get_msa_metrics` reports them, read after backward, as bytes received per rank and
micro-batch: the mean over every rank that runs the layer (CP, TP and DP ranks) and over the
micro-batches since the last reset. Per rank, because that is what loads one device's links (the
sum over the CP group is this value times CP). Recomputation traffic (activation checkpointing
runs the exchange again in backward) is included: it is moved. Pass a one-rank ``group`` to
read this rank's own values unreduced.

The selection recall of an armed probe (:mod:`.probe`, ``msa/recall``) and its ceiling
(``msa/recall_best``) are reduced here too.
A further per-layer metric is added the same way: a tracker, a ``record_*`` call in
``MSACoreAttention._attention`` (which has the composer's :class:`msa_megatron.core.MSAResult`:
selection, query layout, keys), one more row in :func:`get_msa_metrics`' reduction.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..parallel.context import cp_bytes_received, new_cp_stats

METRIC_PREFIX = "msa/kl"
CP_BYTES_PREFIX = "msa/cp_bytes"
CP_BYTES_FWD_PREFIX = "msa/cp_bytes_fwd"
CP_BYTES_BWD_PREFIX = "msa/cp_bytes_bwd"
RECALL_PREFIX = "msa/recall"
BEST_RECALL_PREFIX = "msa/recall_best"


class _MetricTracker:
    """Per-layer sums of KL shares and of their weights, as tensors on the KL's device.

    Compiled models (torch.compile) read this state while tracing: a layer's tensors are
    created once and then only updated and zeroed in place, so the traced graph (and its guards)
    stays the same from one micro-batch or step to the next instead of recompiling each time.
    Layers whose weight is 0 (reset, not run since) report nothing.
    """

    def __init__(self) -> None:
        self.values: Dict[int, torch.Tensor] = {}
        self.weights: Dict[int, torch.Tensor] = {}

    def record(self, layer_number: int, kl: torch.Tensor, weight: float) -> None:
        if kl.is_meta:  # a shape-inference forward has no value to record
            return
        value = kl.detach().float()
        if layer_number not in self.values:
            # Shape [1], not 0-dim: torch.compile drops in-place updates of captured 0-dim
            # float64 tensors (torch 2.13, CPU).
            self.values[layer_number] = torch.zeros(1, dtype=torch.float32, device=kl.device)
            self.weights[layer_number] = torch.zeros(1, dtype=torch.float64, device=kl.device)
        self.values[layer_number].add_(value)
        self.weights[layer_number].add_(weight)

    def reset(self) -> None:
        for tensor in (*self.values.values(), *self.weights.values()):
            tensor.zero_()


_TRACKER = _MetricTracker()
_RECALL = _MetricTracker()  # selection-probe recall: one weight-1 record per probed forward
_BEST_RECALL = _MetricTracker()  # its ceiling (the best allowed selection), recorded alongside


class _CPBytesTracker:
    """Per-layer CP counters (:data:`msa_megatron.parallel.context.STAT_KEYS` dicts, added to
    in place by forwards and backwards) and the micro-batches they cover."""

    def __init__(self) -> None:
        self.stats: Dict[int, Dict[str, int]] = {}
        self.micro_batches: Dict[int, int] = {}

    def accumulator(self, layer_number: int) -> Dict[str, int]:
        if layer_number not in self.stats:
            self.stats[layer_number] = new_cp_stats()
        return self.stats[layer_number]

    def reset(self) -> None:
        # Zeroed in place: a backward still to run adds to the dict it was given.
        for stats in self.stats.values():
            for key in stats:
                stats[key] = 0
        self.micro_batches.clear()


_CP_BYTES = _CPBytesTracker()


def cp_stats_accumulator(layer_number: int, new_micro_batch: bool) -> Dict[str, int]:
    """The CP counters of a layer since the last :func:`get_msa_metrics` reset.

    Args:
        layer_number: the layer's global 1-based number.
        new_micro_batch: True for the first CP call of a micro-batch (False for its
            recomputation), so the bytes are averaged per micro-batch.

    Returns:
        The layer's :data:`~msa_megatron.parallel.context.STAT_KEYS` dict, to pass as
        ``stats=`` to :func:`msa_megatron.core.msa_layer`.
    """
    if new_micro_batch:
        _CP_BYTES.micro_batches[layer_number] = _CP_BYTES.micro_batches.get(layer_number, 0) + 1
    return _CP_BYTES.accumulator(layer_number)


def record_kl(layer_number: int, kl: torch.Tensor, parts: int) -> None:
    """Record one micro-batch's KL share of a layer.

    Args:
        layer_number: the layer's global 1-based number.
        kl: this rank's 0-dim KL share (the layer's KL is the sum of the ``parts`` shares).
        parts: number of ranks whose shares add up to the layer's KL (TP size x CP size).
    """
    # Each share is weighted 1/parts in the count, so after summing over all ranks the count is
    # (micro-batches x DP replicas) while the values hold the full KL of each of them.
    _TRACKER.record(layer_number, kl, 1.0 / parts)


def record_recall(layer_number: int, recall: torch.Tensor,
                  best_recall: Optional[torch.Tensor] = None) -> None:
    """Record one probed forward's selection recall of a layer (``recall [rows, Hi]``, its mean
    counts once; see :mod:`msa_megatron.megatron.probe`) and, when given, its ceiling
    ``best_recall [rows, Hi]`` (:class:`msa_megatron.diagnostics.SelectionSample`)."""
    if recall.numel():
        _RECALL.record(layer_number, recall.mean(), 1.0)
    if best_recall is not None and best_recall.numel():
        _BEST_RECALL.record(layer_number, best_recall.mean(), 1.0)


def _metrics_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_msa_metrics(reset: bool = True,
                    group: Optional[dist.ProcessGroup] = None) -> Dict[str, float]:
    """Mean KL per MSA layer since the last reset, and the CP bytes moved, reduced over all ranks.

    A collective over ``group`` (default: the whole world) when torch.distributed is
    initialised: every rank must call it. TP and CP shares of a layer's KL are added, DP
    replicas and micro-batches averaged, pipeline stages combined. Call it after the backward
    of the step (the backward bytes are counted when it runs).

    Args:
        reset: clear the accumulated values afterwards.
        group: the process group to reduce over.

    Returns:
        ``{"msa/kl/layer_01": ..., ..., "msa/kl": mean over layers}`` (floats, KL in nats per
        token and index head, before ``kl_coeff``); with context parallelism also
        ``"msa/cp_bytes/layer_NN"`` (bytes received per rank and micro-batch by that layer's
        CP exchanges, forward + backward), its parts ``"msa/cp_bytes_fwd/layer_NN"`` (index
        keys, K/V and selective mode's block ids; under activation recomputation the
        recomputed forward's exchange too, as it moves those bytes again) and
        ``"msa/cp_bytes_bwd/layer_NN"`` (their gradients), and ``"msa/cp_bytes"``: the sum
        over layers; when a selection probe was armed
        (:func:`msa_megatron.megatron.arm_selection_probe`), ``"msa/recall/layer_NN"`` (share
        of the dense teacher's attention mass inside the selected blocks, mean over the
        sampled rows, index heads and ranks) and ``"msa/recall"``, their mean over layers, with
        their ceilings ``"msa/recall_best/layer_NN"`` and ``"msa/recall_best"`` (the share the
        best selection the rules allow would hold: how far the index is from it).
        Empty when no MSA layer ran.
    """
    local_max = max(max(_TRACKER.values, default=0), max(_CP_BYTES.micro_batches, default=0),
                    max(_RECALL.values, default=0), max(_BEST_RECALL.values, default=0))
    device = _metrics_device()
    distributed = dist.is_initialized()
    num_layers = torch.tensor([local_max], dtype=torch.int64, device=device)
    if distributed:
        dist.all_reduce(num_layers, op=dist.ReduceOp.MAX, group=group)
    count = int(num_layers.item())
    values = torch.zeros(9, count, dtype=torch.float64, device=device)
    for row, tracker in ((0, _TRACKER), (5, _RECALL), (7, _BEST_RECALL)):
        for layer, value in tracker.values.items():
            values[row, layer - 1] = value.to(device=device, dtype=torch.float64).reshape(())
            values[row + 1, layer - 1] = tracker.weights[layer].to(device=device).reshape(())
    host_bytes = torch.zeros(3, count, dtype=torch.float64)
    for layer, micro_batches in _CP_BYTES.micro_batches.items():
        host_bytes[0:2, layer - 1] = torch.tensor(cp_bytes_received(_CP_BYTES.stats[layer]),
                                                  dtype=torch.float64)
        host_bytes[2, layer - 1] = micro_batches
    values[2:5] = host_bytes.to(device)
    if distributed:
        dist.all_reduce(values, group=group)
    if reset:
        _TRACKER.reset()
        _CP_BYTES.reset()
        _RECALL.reset()
        _BEST_RECALL.reset()
    metrics = _layer_means(METRIC_PREFIX, values[0], values[1])
    total_bytes = None
    for layer in range(count):
        micro_batches = float(values[4, layer])
        if micro_batches > 0:
            fwd, bwd = (float(values[row, layer]) / micro_batches for row in (2, 3))
            metrics[f"{CP_BYTES_PREFIX}/layer_{layer + 1:02d}"] = fwd + bwd
            metrics[f"{CP_BYTES_FWD_PREFIX}/layer_{layer + 1:02d}"] = fwd
            metrics[f"{CP_BYTES_BWD_PREFIX}/layer_{layer + 1:02d}"] = bwd
            total_bytes = (total_bytes or 0.0) + fwd + bwd
    if total_bytes is not None:
        metrics[CP_BYTES_PREFIX] = total_bytes
    metrics.update(_layer_means(RECALL_PREFIX, values[5], values[6]))
    metrics.update(_layer_means(BEST_RECALL_PREFIX, values[7], values[8]))
    return metrics


def _layer_means(prefix: str, sums: torch.Tensor, weights: torch.Tensor) -> Dict[str, float]:
    """``{prefix/layer_NN: sum / weight}`` for the layers with weight > 0, and ``{prefix: mean
    over those layers}``."""
    metrics: Dict[str, float] = {}
    for layer, (total, weight) in enumerate(zip(sums.tolist(), weights.tolist())):
        if weight > 0:
            metrics[f"{prefix}/layer_{layer + 1:02d}"] = total / weight
    if metrics:
        metrics[prefix] = sum(metrics.values()) / len(metrics)
    return metrics
