"""The index-branch KL loss inside megatron-core training: gradient plumbing (the metrics are in
:mod:`.metrics`).

MSA_SPEC section 4: ``L = L_lm + kl_coeff * sum_layers L_kl``. Megatron's loss function only sees
the LM loss, so each MSA layer attaches its KL to its attention output with an identity autograd
function (:class:`KLLossAutoScaler`, the pattern megatron-core uses for MoE auxiliary losses):
the forward returns the output unchanged, the backward passes the output gradient through and
feeds ``kl_coeff * loss_scale`` to the KL, so ``loss.backward()`` trains the index branch.

``loss_scale`` is what the pipeline schedule multiplies the LM loss by (``1 / num_microbatches``,
times the fp16 loss scale, times the CP size when megatron scales the LM loss by it):

- megatron-core >= 0.19: :func:`msa_megatron.megatron.compat.install_kl_loss_scale_hook` sets
  ``config.experimental_attention_variant_loss_scale_func = set_kl_loss_scale``; the schedule
  calls it every micro-batch.
- megatron-core 0.16: the schedule has no hook. Before every ``forward_backward_func`` call
  ``set_kl_loss_scale(schedule_loss_scale(config, num_microbatches, cp_size))``, the value
  0.16's schedule gives MoE auxiliary losses (``cp_size / num_microbatches`` times the mixed
  precision grad scale). Without the call, layers built on 0.16 use that same value on their
  own when megatron's global micro-batch calculator is set up (Megatron-LM's training loop,
  e.g. ``--spec`` on a 0.16-era ``pretrain_gpt.py``: :func:`use_schedule_default`), else 1.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Union

import torch

_loss_scale: Optional[torch.Tensor] = None
_schedule_config = None  # 0.16: the config whose schedule scale applies when none was set


def use_schedule_default(config) -> None:
    """Megatron-core without the schedule's loss-scale hook (0.16): when no scale was set with
    :func:`set_kl_loss_scale`, scale the KL like 0.16's schedule scales the LM loss,
    ``schedule_loss_scale(config, get_num_microbatches(), cp_size)``, read at each backward from
    megatron's global micro-batch calculator (set up by Megatron-LM's training loop; without it
    the scale stays 1). Called by the MSA layers at construction on such versions.

    Args:
        config: the model's TransformerConfig (its ``grad_scale_func`` is read at backward).
    """
    global _schedule_config
    _schedule_config = config


def _schedule_default_scale() -> Optional[torch.Tensor]:
    if _schedule_config is None:
        return None
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        num_microbatches = get_num_microbatches()
    except Exception:  # noqa: BLE001 - no calculator: not inside Megatron-LM's training loop
        return None
    from megatron.core import parallel_state

    cp_size = (parallel_state.get_context_parallel_world_size()
               if parallel_state.model_parallel_is_initialized() else 1)
    return schedule_loss_scale(_schedule_config, num_microbatches, cp_size)


def _current_scale() -> Optional[torch.Tensor]:
    return _loss_scale if _loss_scale is not None else _schedule_default_scale()


def set_kl_loss_scale(scale: Union[float, torch.Tensor]) -> None:
    """Set the factor the KL gradient is multiplied by (besides ``kl_coeff``).

    Args:
        scale: the pipeline schedule's loss scale (a 1-element tensor or a finite number >= 0),
            e.g. ``1 / num_microbatches``. On megatron-core >= 0.19 the schedule calls this
            itself. A tensor's value is not read here (that would wait for the device).

    Raises:
        TypeError: neither a number nor a tensor.
        ValueError: a tensor of more than one element, or a number that is negative or not
            finite.
    """
    global _loss_scale
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must be a 1-element tensor, got shape {list(scale.shape)}")
        _loss_scale = scale.detach().clone()
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or a 1-element tensor, got "
                        f"{type(scale).__name__}")
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"scale must be a finite number >= 0, got {scale}")
    _loss_scale = torch.tensor(float(scale))


def schedule_loss_scale(config, num_microbatches: int, cp_size: int = 1) -> torch.Tensor:
    """The auxiliary-loss scale megatron-core's pipeline schedule uses (for 0.16, which does not
    hand it to the MSA layers itself).

    Args:
        config: the model's TransformerConfig (``grad_scale_func``, ``calculate_per_token_loss``).
        num_microbatches: micro-batches per step; cp_size: context-parallel size.

    Returns:
        1-element float tensor: ``grad_scale`` if ``calculate_per_token_loss`` else
        ``grad_scale * cp_size / num_microbatches``.
    """
    ones = torch.ones(1)
    scale = config.grad_scale_func(ones) if config.grad_scale_func is not None else ones
    if config.calculate_per_token_loss:
        return scale
    return scale * cp_size / num_microbatches


def get_kl_loss_scale() -> float:
    """The current KL loss scale: the last :func:`set_kl_loss_scale`, else the 0.16 schedule
    default (:func:`use_schedule_default`), else 1.0."""
    scale = _current_scale()
    return 1.0 if scale is None else float(scale)


class KLLossAutoScaler(torch.autograd.Function):
    """Identity on the attention output; in backward it feeds ``kl_coeff * loss_scale`` to the
    KL (the MoE auxiliary-loss pattern of megatron-core)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, kl: torch.Tensor, kl_coeff: float) -> torch.Tensor:
        ctx.save_for_backward(kl)
        ctx.kl_coeff = kl_coeff
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (kl,) = ctx.saved_tensors
        scale = torch.ones_like(kl) * ctx.kl_coeff
        loss_scale = _current_scale()
        if loss_scale is not None:
            scale = scale * loss_scale.to(device=kl.device, dtype=kl.dtype)
        return grad_output, scale, None


def attach_kl_loss(output: torch.Tensor, kl: torch.Tensor, kl_coeff: float) -> torch.Tensor:
    """Return ``output`` unchanged with ``kl`` attached to its backward (no-op without grad).

    With ``kl_coeff == 0`` the index branch still gets (zero) gradients, so every trainable
    parameter has a gradient, as megatron-core's DDP buckets expect.

    Args:
        output: the attention output (any shape).
        kl: 0-dim fp32 KL of this rank's share of the layer (``kl_scale`` already applied).
        kl_coeff: MSAConfig.kl_coeff.
    """
    if not (torch.is_grad_enabled() and kl.requires_grad):
        return output
    return KLLossAutoScaler.apply(output, kl, kl_coeff)
