"""Backend registry: every backend provides the same three cores.

A backend is a module with:

``select(q_idx, k_idx, q_pos, q_kbase, *, block_size, top_k, init_blocks, local_blocks,
index_scale) -> block_idx [Tq, Hi, top_k] int32`` (not differentiable);

``attention(q, k, v, block_idx, q_pos, q_kbase, *, block_size, softmax_scale, index_heads)
-> (out [Tq, Hq, D] q.dtype, lse [Tq, Hq] float32)``, differentiable in q, k, v
(``block_idx=None``: dense causal warmup mode; ``lse`` carries no gradient);

``kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, *, block_size, softmax_scale,
index_scale, kl_scale) -> 0-dim float32`` equal to ``kl_scale * sum_{i,p} KL[i,p]``,
differentiable in q_idx and k_idx only (q, k, lse are read as constants).

``q_pos`` / ``q_kbase`` are the query layout of :mod:`msa_megatron.layout`; k, v and k_idx
may hold more rows than there are queries (context parallelism).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Optional

import torch

_MODULES = {
    "reference": "msa_megatron.ops.reference_backend",
    "torch": "msa_megatron.ops.torch_backend",
    "triton": "msa_megatron.ops.triton",
}


def resolve_backend(backend: Optional[str], device: torch.device) -> str:
    """``None`` means triton for CUDA tensors and torch otherwise."""
    if backend is not None:
        return backend
    return "triton" if device.type == "cuda" else "torch"


def get_backend(name: str) -> ModuleType:
    """Import and return the backend module called ``name``.

    A module imported before is taken from ``sys.modules``, which torch.compile can trace
    (it cannot trace ``importlib.import_module``).
    """
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {tuple(_MODULES)}, got {name!r}")
    module = sys.modules.get(_MODULES[name])
    return module if module is not None else importlib.import_module(_MODULES[name])
