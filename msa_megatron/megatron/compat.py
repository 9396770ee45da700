"""Every difference between the supported megatron-core versions (0.16.x to 0.19.x), in one place.

What differs and how it is handled:

- The pipeline schedule hands auxiliary losses their loss scale through
  ``TransformerConfig.experimental_attention_variant_loss_scale_func`` from 0.19 on; 0.16 has no
  hook (:func:`install_kl_loss_scale_hook`, :func:`has_loss_scale_hook`).
- ``SelfAttention.__init__`` gained ``pp_layer_offset`` and ``name`` keyword arguments in 0.19:
  :class:`~msa_megatron.megatron.attention.MSASelfAttention` passes unknown keyword arguments
  through unchanged, so both signatures work.
- ``Attention._checkpointed_attention_forward`` gained ``core_attention_extra_kwargs`` in 0.19:
  the MSA layer does not use it; its own ``forward`` calls the core attention (checkpointed or
  not) with the index q/k as explicit arguments, with megatron-core's ``apply_rotary_pos_emb``
  for the main and index q/k.
- Megatron-LM's ``--spec <module> <name>``: on 0.16 the named object must be a ``ModuleSpec``;
  0.19 builders may call it with the ``TransformerConfig``.
  :class:`~msa_megatron.megatron.spec.MSALayerSpec` is both.
- The Transformer Engine / local layer sets are taken from megatron-core's own GPT layer specs,
  called with keyword arguments only (their positional order changed in 0.19).

Not a difference but a CPU limit of both versions: megatron-core's TP > num_query_groups path
gathers with a CUDA-only helper, so the MSA layer gathers with
:func:`msa_megatron.parallel.comm.gather_last_dim`.
"""

from __future__ import annotations

from typing import Callable, Optional

import megatron.core
from megatron.core.transformer.transformer_config import TransformerConfig

try:  # the same import guard megatron-core uses
    import transformer_engine  # noqa: F401

    HAVE_TE = True
except ImportError:
    HAVE_TE = False

LOSS_SCALE_HOOK_FIELD = "experimental_attention_variant_loss_scale_func"


def megatron_core_version() -> tuple:
    """``(major, minor)`` of the installed megatron-core."""
    major, minor = megatron.core.__version__.split(".")[:2]
    return int(major), int(minor)


def has_loss_scale_hook(config: TransformerConfig) -> bool:
    """True when the pipeline schedule calls ``config``'s auxiliary-loss scale hook (>= 0.19)."""
    return hasattr(config, LOSS_SCALE_HOOK_FIELD)


def install_kl_loss_scale_hook(config: TransformerConfig, setter: Callable) -> bool:
    """Let the pipeline schedule set the MSA KL loss scale (megatron-core >= 0.19).

    Args:
        config: the model's TransformerConfig (the schedule reads the hook from it).
        setter: :func:`msa_megatron.megatron.loss.set_kl_loss_scale`.

    Returns:
        True when the hook is installed; False on versions without it (call
        ``set_kl_loss_scale`` yourself, see :mod:`msa_megatron.megatron.loss`; inside
        Megatron-LM's training loop the layers fall back to the schedule's scale,
        :func:`msa_megatron.megatron.loss.use_schedule_default`).

    Raises:
        ValueError: the config already carries a different hook (another attention variant).
    """
    if not has_loss_scale_hook(config):
        from .loss import use_schedule_default

        if hasattr(config, "grad_scale_func"):
            use_schedule_default(config)
        return False
    current = getattr(config, LOSS_SCALE_HOOK_FIELD)
    if current is not None and current is not setter:
        raise ValueError(
            f"config.{LOSS_SCALE_HOOK_FIELD} is already set to {current!r}; the MSA layers need "
            "it to receive the pipeline loss scale"
        )
    setattr(config, LOSS_SCALE_HOOK_FIELD, setter)
    return True


def is_checkpointing() -> bool:
    """True inside megatron-core's activation-checkpoint forward or recomputation."""
    from megatron.core.tensor_parallel.random import is_checkpointing as _is_checkpointing

    return _is_checkpointing()


def gpt_layer_base_spec(use_te: bool, qk_layernorm: bool, normalization: Optional[str]):
    """megatron-core's dense GPT layer spec (TE or local layers), keyword arguments only."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm,
                                                    normalization=normalization)


def te_unfused_input_modules():
    """``(TENorm, TEColumnParallelLinear)``: the MSA index projections read the normalised
    attention input, so the TE spec keeps the input norm as its own module instead of fusing it
    into ``linear_qkv``."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    return TENorm, TEColumnParallelLinear
