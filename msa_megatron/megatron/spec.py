"""``ModuleSpec`` of a GPT layer with MSA self-attention, for megatron-core 0.16.x to 0.19.x.

In Python::

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import get_gpt_layer_msa_spec
    spec = get_gpt_layer_msa_spec(MSAConfig(top_k=16), qk_layernorm=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, ...)

With Megatron-LM's ``pretrain_gpt.py``: ``--spec msa_megatron.megatron.spec gpt_layer_msa_spec``.
:data:`gpt_layer_msa_spec` is a ``ModuleSpec`` (what 0.16's builder passes to ``GPTModel``) that
is also callable with the ``TransformerConfig`` (builders that call the spec object get a spec
matching ``config.qk_layernorm`` / ``config.transformer_impl``); its layer class,
:class:`ConfigMatchedMSALayer`, builds its submodules from its own config, so the flags are
honoured either way (0.19.2's builder passes a ``ModuleSpec`` on uncalled). Its MSA options
come from the environment variable ``MSA_CONFIG``, a JSON object of
:class:`msa_megatron.MSAConfig` fields, e.g.
``MSA_CONFIG='{"top_k": 16, "block_size": 128, "kl_coeff": 1.0, "mode": "dense"}'``, read
where the layers are built; an invalid one raises there (a ValueError / TypeError naming
``$MSA_CONFIG``), not at import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Optional

from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import MSAConfig
from . import compat
from .args import msa_config_from_mapping
from .attention import MSACoreAttention, MSASelfAttention, MSASelfAttentionSubmodules

MSA_CONFIG_ENV = "MSA_CONFIG"
_INPUT_NORM_KEY_MAP = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}


def get_gpt_layer_msa_spec(
    msa_config: Optional[MSAConfig] = None,
    *,
    use_te: Optional[bool] = None,
    qk_layernorm: bool = False,
    normalization: Optional[str] = None,
) -> ModuleSpec:
    """A megatron-core GPT ``TransformerLayer`` spec whose self-attention is MSA.

    Everything but the attention is megatron-core's own GPT layer spec. The attention is
    :class:`~msa_megatron.megatron.attention.MSASelfAttention` with
    :class:`~msa_megatron.megatron.attention.MSACoreAttention`; ``linear_q_idx`` is the spec's
    column-parallel linear. With Transformer Engine the input norm is kept as its own module
    (the index projections read the normalised input), with a checkpoint key map that keeps
    checkpoints interchangeable with the fused dense TE layer.

    Args:
        msa_config: MSA options (default ``MSAConfig()``).
        use_te: Transformer Engine layers; None means "when transformer_engine imports".
        qk_layernorm: norm the main q/k (and the index q/k with their own weights).
        normalization: passed to megatron-core's local spec (``"RMSNorm"`` / ``"LayerNorm"``).

    Returns:
        ModuleSpec of ``TransformerLayer``.

    Raises:
        TypeError: ``msa_config`` is not an :class:`MSAConfig` (or None), ``use_te`` not a bool
            or None, ``qk_layernorm`` not a bool.
        ImportError: ``use_te=True`` without Transformer Engine.
    """
    if msa_config is None:
        msa_config = MSAConfig()
    if not isinstance(msa_config, MSAConfig):
        raise TypeError(f"msa_config must be an MSAConfig or None, got "
                        f"{type(msa_config).__name__} (from a dict of fields: MSAConfig(**fields))")
    if use_te is not None and not isinstance(use_te, bool):
        raise TypeError(f"use_te must be a bool or None, got {type(use_te).__name__}")
    if not isinstance(qk_layernorm, bool):
        raise TypeError(f"qk_layernorm must be a bool, got {type(qk_layernorm).__name__}")
    if use_te is None:
        use_te = compat.HAVE_TE
    if use_te and not compat.HAVE_TE:
        raise ImportError("use_te=True but transformer_engine cannot be imported")
    base = compat.gpt_layer_base_spec(use_te, qk_layernorm, normalization)
    layer = base.submodules
    attention = layer.self_attention.submodules
    linear_qkv = attention.linear_qkv
    input_layernorm = layer.input_layernorm
    key_map = dict(layer.sharded_state_dict_keys_map or {})
    if use_te:
        input_layernorm, linear_qkv = compat.te_unfused_input_modules()
        key_map.update(_INPUT_NORM_KEY_MAP)
    q_norm = attention.q_layernorm if attention.q_layernorm is not None else IdentityOp
    k_norm = attention.k_layernorm if attention.k_layernorm is not None else IdentityOp
    self_attention = ModuleSpec(
        module=MSASelfAttention,
        params={**(layer.self_attention.params or {}), "msa_config": msa_config},
        submodules=MSASelfAttentionSubmodules(
            linear_qkv=linear_qkv,
            core_attention=MSACoreAttention,
            linear_proj=attention.linear_proj,
            q_layernorm=q_norm,
            k_layernorm=k_norm,
            linear_q_idx=linear_qkv,
        ),
    )
    submodules = dataclasses.replace(layer, input_layernorm=input_layernorm,
                                     self_attention=self_attention,
                                     sharded_state_dict_keys_map=key_map)
    # megatron-core's row-parallel linears warn inside forward (a torch.compile graph break):
    # the spec's get their own TP group handed to the linear function (compat module).
    return compat.with_tp_group_linears(
        ModuleSpec(module=base.module, params=dict(base.params or {}), submodules=submodules))


def msa_config_from_env() -> MSAConfig:
    """:class:`MSAConfig` from the JSON in ``$MSA_CONFIG`` (defaults when unset).

    Raises:
        ValueError: the variable is not a JSON object of MSAConfig fields.
    """
    text = os.environ.get(MSA_CONFIG_ENV, "").strip()
    if not text:
        return MSAConfig()
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"${MSA_CONFIG_ENV} is not valid JSON: {error}") from error
    if not isinstance(fields, dict):
        raise ValueError(f"${MSA_CONFIG_ENV} must be a JSON object, got {text!r}")
    return msa_config_from_mapping(fields, f"${MSA_CONFIG_ENV}")


def spec_for_config(config: TransformerConfig) -> ModuleSpec:
    """The MSA GPT layer spec matching ``config``: its ``qk_layernorm``, ``normalization`` and
    ``transformer_impl`` (``"local"``: megatron-core's layers; ``"transformer_engine"``,
    megatron's default: Transformer Engine's, or megatron-core's with a warning when Transformer
    Engine is not installed), MSA options from ``$MSA_CONFIG``.

    Raises:
        ValueError: a ``transformer_impl`` MSA has no layers for (e.g. ``inference_optimized``).
    """
    impl = getattr(config, "transformer_impl", None)
    if impl not in (None, "local", "transformer_engine"):
        raise ValueError(f"MSA layers support transformer_impl 'local' or 'transformer_engine', "
                         f"got {impl!r}")
    use_te = None if impl is None else impl == "transformer_engine"
    if use_te and not compat.HAVE_TE:
        warnings.warn("transformer_impl='transformer_engine' (Megatron's default) but Transformer "
                      "Engine is not installed: the MSA layers use megatron-core's local layers "
                      "(pass --transformer-impl local to say so)", stacklevel=2)
        use_te = False
    return get_gpt_layer_msa_spec(
        msa_config_from_env(), use_te=use_te, qk_layernorm=bool(config.qk_layernorm),
        normalization=getattr(config, "normalization", None),
    )


class ConfigMatchedMSALayer(TransformerLayer):
    """megatron-core's ``TransformerLayer`` built from :func:`spec_for_config` of its own config
    instead of the submodules it is handed: the layer class of the ``--spec`` object, so that
    ``--qk-layernorm``, ``--normalization`` and ``--transformer-impl`` are honoured whichever way
    the builder uses the spec (0.16 and 0.19 pass the ``ModuleSpec`` on unchanged)."""

    def __init__(self, config: TransformerConfig, submodules: Any = None, *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(config, spec_for_config(config).submodules, *args, **kwargs)


class MSALayerSpec(ModuleSpec):
    """A GPT layer MSA spec that is also a spec factory: ``spec(config)`` returns the spec for
    that ``TransformerConfig`` (:func:`spec_for_config`), for builders that call the object
    named by ``--spec``. Its module, :class:`ConfigMatchedMSALayer`, matches the config itself
    when the builder uses the object as it is."""

    def __call__(self, config: Optional[TransformerConfig] = None, *args: Any,
                 **kwargs: Any) -> ModuleSpec:
        if config is None:
            return self
        return spec_for_config(config)


def _default_layer_spec() -> MSALayerSpec:
    # $MSA_CONFIG is read again where the layers are built (spec_for_config), and an invalid
    # one is refused there: at import it must not break `import msa_megatron.megatron` for
    # routes that never read it (pretrain_tiny, the patched entry point).
    try:
        msa_config = msa_config_from_env()
    except (TypeError, ValueError):
        msa_config = MSAConfig()
    spec = get_gpt_layer_msa_spec(msa_config)
    return MSALayerSpec(module=ConfigMatchedMSALayer, params=spec.params,
                        submodules=spec.submodules)


gpt_layer_msa_spec = _default_layer_spec()
