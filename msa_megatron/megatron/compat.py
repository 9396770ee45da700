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
- ``megatron.core.utils.get_batch_on_this_cp_rank`` gained a required ``is_hybrid_cp`` argument
  in 0.19 (0.16 has none): :func:`get_batch_on_this_cp_rank` calls either with plain CP.
- The Transformer Engine / local layer sets are taken from megatron-core's own GPT layer specs,
  called with keyword arguments only (their positional order changed in 0.19).

Not a difference but a defect of both versions: ``RowParallelLinear.forward`` hands
``tp_group=None`` to ``linear_with_grad_accumulation_and_async_allreduce``, which then calls
``warnings.warn`` (a DeprecationWarning on rank 0, every forward) before looking the default TP
group up; dynamo cannot trace ``warnings.warn``, so ``torch.compile(fullgraph=True)`` of a GPT
built from the local spec breaks at the attention's ``linear_proj`` and the MLP's
``linear_fc2``. The MSA layer spec uses :class:`RowParallelLinearWithGroup` there
(:func:`with_tp_group_linears`), which passes the layer's own group: no warning, no graph break.
Checked on CPU with both versions: after this, a forward at TP 1 raises no warning; at TP > 1
megatron-core's column-parallel linear warns once per process unless
``CUDA_DEVICE_MAX_CONNECTIONS=1`` (Megatron-LM's launchers set it; set it before compiling).

Also a CPU limit of both versions: megatron-core's TP > num_query_groups path
gathers with a CUDA-only helper, so the MSA layer gathers with
:func:`msa_megatron.parallel.comm.gather_last_dim`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import megatron.core
from megatron.core.tensor_parallel.layers import RowParallelLinear
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


class RowParallelLinearWithGroup(RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` that hands its own TP group to the linear function.

    ``RowParallelLinear.forward`` (0.16 and 0.19) calls ``_forward_impl(..., tp_group=None)``;
    the linear function then warns and looks up the default TP group, and the warning is a
    graph break under ``torch.compile(fullgraph=True)``. The function uses the group only for
    sequence-parallel gathers and the dgrad all-reduce, both off in a row-parallel linear, so
    passing ``self.tp_group`` (set at construction) changes no result. Everything else, the
    state dict and checkpoint layout included, is ``RowParallelLinear``'s.
    """

    def _forward_impl(self, *args: Any, **kwargs: Any):
        if "tp_group" in kwargs and kwargs["tp_group"] is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(*args, **kwargs)


def with_tp_group_linears(spec: Any) -> Any:
    """``spec`` (a ``ModuleSpec``, submodules dataclass or ``functools.partial`` of a module
    builder, walked recursively) with every
    ``RowParallelLinear`` class replaced by :class:`RowParallelLinearWithGroup`; other values
    (Transformer Engine layers, params, None) unchanged. Returns a new object when anything
    changed, else ``spec`` itself."""
    if spec is RowParallelLinear:
        return RowParallelLinearWithGroup
    if isinstance(spec, functools.partial):  # 0.19: mlp=partial(MLP.as_mlp_submodule, ...)
        args = tuple(with_tp_group_linears(a) for a in spec.args)
        keywords = {k: with_tp_group_linears(v) for k, v in spec.keywords.items()}
        if all(a is b for a, b in zip(args, spec.args)) and all(
                keywords[k] is v for k, v in spec.keywords.items()):
            return spec
        return functools.partial(spec.func, *args, **keywords)
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    changes = {}
    for field in dataclasses.fields(spec):
        if not field.init:
            continue
        value = getattr(spec, field.name)
        new = with_tp_group_linears(value)
        if new is not value:
            changes[field.name] = new
    return dataclasses.replace(spec, **changes) if changes else spec


def get_batch_on_this_cp_rank(batch: dict, cp_group: Any = None) -> dict:
    """megatron-core's per-sequence CP split of an SBHD batch, on every supported version.

    Args:
        batch: ``{name: tensor [b, s, ...] or None}``; tensors are split along dim 1 into
            ``2 * cp`` chunks, this rank keeping chunks ``r`` and ``2 * cp - 1 - r``.
        cp_group: the context-parallel group (default: megatron-core's).

    Returns:
        The batch with this rank's share (megatron-core's result, unchanged).

    Source: ``megatron.core.utils.get_batch_on_this_cp_rank``; from 0.19 on it takes
    ``is_hybrid_cp`` (hybrid CP is not used by MSA layers: always ``False``).
    """
    from megatron.core import utils as mcore_utils

    fn = mcore_utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in _parameters(fn):
        return fn(batch, is_hybrid_cp=False, cp_group=cp_group)
    return fn(batch, cp_group=cp_group)


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable) -> tuple:
    """Names of ``fn``'s parameters (cached: signatures do not change within a process)."""
    import inspect

    return tuple(inspect.signature(fn).parameters)
