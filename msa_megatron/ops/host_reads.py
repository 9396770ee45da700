"""Host reads of device values that do not drain the GPU's queue.

``bool(t)`` or ``t.tolist()`` on a CUDA tensor waits for every kernel queued before it on the
stream, so the GPU idles from the end of that work until the host has queued the next kernel.
Here the value is copied into pinned host memory as soon as it is computed (an asynchronous
copy and an event recorded right after it); the caller queues more work and only then waits on
the event, which completes when the copy has, not when the later kernels have. On a CPU tensor
both are immediate.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


def to_host(t: torch.Tensor) -> Tuple[torch.Tensor, Optional["torch.cuda.Event"]]:
    """``(host copy, event)``: an asynchronous copy of a CUDA tensor into pinned memory and the
    event to wait on before reading it (a CPU tensor: itself and None). Any shape and dtype."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return host, event


def sum_of_sums(*tensors: torch.Tensor) -> torch.Tensor:
    """0-d fp32 on the tensors' device: the sum of one fp32 sum per tensor (no temporary of a
    tensor's size; empty tensors add 0). Finite exactly when every entry is finite, except
    that a finite total may overflow fp32 (reads as not finite). No host sync."""
    sums = [t.sum(dtype=torch.float32) for t in tensors if t.numel()]
    if not sums:
        return torch.zeros((), dtype=torch.float32, device=tensors[0].device if tensors else None)
    return torch.stack(sums).sum()


class FiniteCheck:
    """Whether every entry of some tensors is finite, computed on the device when created (one
    fp32 sum per tensor, no temporary of a tensor's size) and read by :meth:`ok` later, after the
    caller has queued the work the answer decides about (that work must only write fresh
    tensors, so that a ``False`` can drop its result). A finite tensor whose sum overflows fp32
    reads as not finite (the caller then takes its slower, equally exact path).

    Args:
        *tensors: tensors of one device, any shape, float dtypes; empty ones are skipped.
    """

    def __init__(self, *tensors: torch.Tensor):
        if not any(t.numel() for t in tensors):
            self._host, self._event = torch.ones((), dtype=torch.bool), None
            return
        self._host, self._event = to_host(torch.isfinite(sum_of_sums(*tensors)))

    def ok(self) -> bool:
        """True when every entry was finite; waits for the device's answer only."""
        if self._event is not None:
            self._event.synchronize()
        return bool(self._host)


__all__ = ["FiniteCheck", "sum_of_sums", "to_host"]
