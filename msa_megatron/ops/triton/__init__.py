"""``backend="triton"``: fused Triton kernels behind the three backend cores.

``select``, ``attention`` and ``kl`` (interface: :mod:`msa_megatron.ops.backends`) are custom ops
``msa_megatron::triton_*`` registered through :mod:`msa_megatron.ops.custom_ops` (autograd,
shape-only fake implementations for ``torch.compile(fullgraph=True)``). Triton itself is
imported on the first call, so importing this package never imports Triton (set
``TRITON_INTERPRET=1`` before that first call to run the kernels on a CPU).

Kernels: :mod:`.selection` (fused selection), :mod:`.forward` (sparse / dense forward),
:mod:`.backward` (dQ query-outer, dK/dV key-block-outer, deterministic), :mod:`.kl_loss`
(KL value and index-branch gradients), :mod:`.reverse_index` (block -> selecting queries).
Dense mode takes the main output and LSE (and dQ, dK, dV) from cuDNN or FlashAttention where
:mod:`msa_megatron.ops.dense` finds one that applies, and runs these kernels otherwise; its KL
is one key-tile-outer pass over Q K^T (:mod:`.dense_kl`), or on sm_90 a warp-specialised Gluon
query-tile pass plus a Triton key-tile pass (:mod:`.dense_kl_gluon`), chosen by
``MSA_DENSE_KL`` (:func:`dense_kl_choice`).
"""

from __future__ import annotations

import os

from ..custom_ops import BackendKernels, register_backend_ops
from ..dense import dense_backward, dense_forward

# Dense-mode KL (MSA_DENSE_KL): "auto" (Gluon where gluon_kl_supported says so, else onepass),
# "gluon" (:mod:`.dense_kl_gluon`, or an error saying why not), "onepass" (:mod:`.dense_kl`) or
# "twopass" (the query-outer rows kernel plus the key-outer index-key kernel of :mod:`.kl_loss`).
DENSE_KL_ENV = "MSA_DENSE_KL"
DENSE_KL_CHOICES = ("auto", "gluon", "onepass", "twopass")
# the choice when MSA_DENSE_KL is unset: "onepass" until the Gluon kernel's GPU check
# (benchmarks/gluon_probe.py kl) has passed on an H200, then "auto"
DENSE_KL_DEFAULT = "auto"


def dense_kl_choice(q, k, q_idx, k_idx) -> str:
    """The dense-mode KL implementation for these inputs: ``"gluon"``, ``"onepass"`` or
    ``"twopass"``, from ``MSA_DENSE_KL`` (:data:`DENSE_KL_CHOICES`; unset:
    :data:`DENSE_KL_DEFAULT`). ``auto`` takes Gluon where
    :func:`.dense_kl_gluon.gluon_kl_supported` says so, else ``onepass``; ``gluon`` raises
    ValueError naming the reason when it does not apply; an unknown value raises ValueError."""
    raw = os.environ.get(DENSE_KL_ENV, "") or DENSE_KL_DEFAULT
    if raw not in DENSE_KL_CHOICES:
        raise ValueError(f"{DENSE_KL_ENV} must be one of {', '.join(DENSE_KL_CHOICES)}, "
                         f"got {raw!r}")
    if raw in ("onepass", "twopass"):
        return raw
    from .dense_kl_gluon import gluon_kl_supported

    ok, why = gluon_kl_supported(q, k, q_idx, k_idx)
    if ok:
        return "gluon"
    if raw == "gluon":
        raise ValueError(f"{DENSE_KL_ENV}=gluon: the Gluon dense KL does not apply: {why}")
    return "onepass"


def _select(q_idx, k_idx, q_pos, q_kbase, block_size, top_k, init_blocks, local_blocks,
            index_scale):
    from .selection import select_blocks_triton

    return select_blocks_triton(q_idx, k_idx, q_pos, q_kbase, block_size, top_k, init_blocks,
                                local_blocks, index_scale)


def _attention_fwd(q, k, v, block_idx, q_pos, q_kbase, block_size, softmax_scale, index_heads):
    if block_idx is None:  # dense mode: a vendor dense attention where one applies
        routed = dense_forward(q, k, v, q_pos, q_kbase, softmax_scale)
        if routed is not None:
            return routed
    from .forward import attention_forward

    return attention_forward(q, k, v, block_idx, q_pos, q_kbase, block_size, softmax_scale,
                             index_heads)


def _attention_bwd(dout, q, k, v, out, lse, block_idx, q_pos, q_kbase, block_size,
                   softmax_scale, index_heads):
    if block_idx is None:
        routed = dense_backward(dout, q, k, v, out, lse, q_pos, q_kbase, softmax_scale)
        if routed is not None:
            return routed
    from .backward import attention_backward

    return attention_backward(dout, q, k, v, out, lse, block_idx, q_pos, q_kbase, block_size,
                              softmax_scale, index_heads)


def _kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size, softmax_scale,
        index_scale, kl_scale, compute_grad):
    choice = dense_kl_choice(q, k, q_idx, k_idx) if block_idx is None else None
    if choice == "gluon":
        from .dense_kl_gluon import dense_kl_loss_gluon

        return dense_kl_loss_gluon(q, k, lse, q_idx, k_idx, q_pos, q_kbase, softmax_scale,
                                   index_scale, kl_scale, compute_grad)
    if choice == "onepass":
        from .dense_kl import dense_kl_loss

        return dense_kl_loss(q, k, lse, q_idx, k_idx, q_pos, q_kbase, softmax_scale,
                             index_scale, kl_scale, compute_grad)
    from .kl_loss import kl_loss

    return kl_loss(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, block_size, softmax_scale,
                   index_scale, kl_scale, compute_grad)


_OPS = register_backend_ops(
    "triton",
    BackendKernels(select=_select, attention_fwd=_attention_fwd, attention_bwd=_attention_bwd,
                   kl=_kl),
)
select, attention, kl = _OPS.select, _OPS.attention, _OPS.kl
ops = _OPS.ops

__all__ = ["select", "attention", "kl", "ops"]
