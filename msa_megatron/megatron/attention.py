"""MSA self-attention for megatron-core: the layer, its core attention, and mode switching.

Three modules, plugged in through megatron-core's ``ModuleSpec`` (see :mod:`.spec`):

- :class:`MSASelfAttention` (a ``SelfAttention``): the main q/k/v exactly as megatron-core
  computes them (projections, q/k norms, RoPE), the index branch
  (:class:`~msa_megatron.megatron.index.MSAIndexBranch`), and one explicit call
  ``core_attention(query, key, value, mask, q_idx=..., k_idx=...)`` (as megatron-core's own
  sparse attention variant receives its indexer inputs). Training only: inference contexts
  raise.
- :class:`MSACoreAttention`: converts SBHD / THD (``packed_seq_params``) to the op layout, keeps
  the selection for activation recomputation, calls the composer
  (:func:`msa_megatron.core.msa_layer`), attaches the KL to the output (:mod:`.loss`) and
  records the metrics (:mod:`.metrics`).

Sequence parallelism: the hidden states are all-gathered once for the main QKV projection and
both index projections (:mod:`.sequence_parallel`).

Parallel layouts (MSA_SPEC section 6; the composer runs the exchanges):

- ``Hi % TP == 0``: a rank owns whole index heads; everything is local.
- ``TP % Hi == 0``, ``Hi < TP`` (TP > Hkv, e.g. 64 query / 4 KV heads at TP 8): megatron-core
  spreads one group's query heads over ``TP/Hkv`` ranks. The MSA layer gathers the projections
  itself (megatron-core's gather is CUDA-only); the ranks sharing an index head
  (``ParallelGroups.tp_share``) select once and compute an exact KL teacher.
- CP > 1: the composer gets the CP group and the global (padded) ``cu_seqlens`` (SBHD: ``b``
  sequences of the global length). The K/V exchange is ``MSAConfig.cp_kv_exchange``, or when
  None ``"allgather"``, whatever megatron-core's ``cp_comm_type``
  (:func:`~msa_megatron.parallel.context.resolve_cp_kv_exchange`). The bytes moved accumulate
  per layer (:func:`~msa_megatron.megatron.metrics.cp_stats_accumulator`, reported by
  ``get_msa_metrics``).

Padded THD (``packed_seq_params.cu_seqlens_q_padded`` set, as megatron-core pads sequences for
CP): the tokens are laid out by the padded boundaries; a sequence's padding tokens get finite
outputs but are not part of the KL (no KL term, not counted in N), with or without CP.

Selection reuse (MSA_SPEC section 6): under megatron-core activation checkpointing (selective
``core_attn`` or full layer recompute) the core attention runs twice per micro-batch: once
without grad inside the checkpoint's forward, once in backward. The first run stores its
``block_idx`` in a per-layer :class:`~msa_megatron.megatron.selection_store.SelectionStore` with a
fingerprint of the index q/k it was chosen from; the recomputation takes the entry whose
fingerprint matches its own and frees it, so backwards may come in any order (``(l0 +
l1).backward()``, reversed, or never for a forward-only pass). Without
checkpointing the selection lives in the autograd graph only. A checkpoint whose first pass is
not megatron-core's (``is_checkpointing()`` false, e.g. Transformer Engine's fp8 checkpoint)
stores nothing; its recomputation then selects again from bitwise-identical index q/k: the same
blocks, only slower.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import MSAConfig, check_int, check_mode
from ..core import MSAOptions, msa_layer
from ..parallel.comm import gather_last_dim, group_rank, group_size
from ..parallel.context import resolve_cp_kv_exchange
from ..parallel.cp_layout import sbhd_cu_seqlens
from ..parallel.groups import ParallelGroups
from ..parallel.tensor import share_group
from . import compat
from .index import (  # noqa: F401  (build_head_layout, MSAHeadLayout: public here too)
    MSAHeadLayout,
    MSAIndexBranch,
    apply_rope,
    build_head_layout,
    rope_cu_seqlens,
)
from .loss import attach_kl_loss, set_kl_loss_scale
from .metrics import cp_stats_accumulator, record_kl
from .selection_store import SelectionStore
from .sequence_parallel import SharedGather, can_run_local, local_projection


@dataclass
class MSASelfAttentionSubmodules(SelfAttentionSubmodules):
    """megatron-core's self-attention submodules plus the index query projection.

    ``linear_q_idx``: a column-parallel linear class or ModuleSpec (megatron-core's
    ``ColumnParallelLinear`` or Transformer Engine's ``TEColumnParallelLinear``).
    """

    linear_q_idx: Union[ModuleSpec, type, None] = None


# Fine-grained activation offloading flags of megatron-core's attention (not supported).
_OFFLOAD_FLAGS = ("offload_qkv_linear", "offload_core_attention", "offload_attn_proj")


class MSASelfAttention(SelfAttention):
    """megatron-core ``SelfAttention`` with the MSA index branch (module docstring).

    Args:
        config, submodules, layer_number, attn_mask_type: as for ``SelfAttention`` (causal only);
            ``submodules`` is :class:`MSASelfAttentionSubmodules` whose ``core_attention`` is
            :class:`MSACoreAttention`.
        msa_config: the MSA options (:class:`msa_megatron.MSAConfig`).
        **kwargs: passed to ``SelfAttention`` unchanged (``cp_comm_type``, ``pg_collection``,
            and 0.19's ``pp_layer_offset`` / ``name``).

    Raises:
        ValueError: non-causal mask type, head counts MSA cannot split over TP,
            ``attention_output_gate`` with TP > ``num_query_groups``, ``fused_single_qkv_rope``.
    """

    def __init__(self, config: TransformerConfig, submodules: MSASelfAttentionSubmodules,
                 layer_number: int, attn_mask_type: AttnMaskType = AttnMaskType.causal,
                 msa_config: Optional[MSAConfig] = None, **kwargs: Any) -> None:
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MSA attention is causal; got attn_mask_type={attn_mask_type}")
        super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type,
                         **kwargs)
        if not isinstance(self.core_attention, MSACoreAttention):
            raise TypeError(
                f"submodules.core_attention must be MSACoreAttention, got "
                f"{type(self.core_attention).__name__}"
            )
        self.msa_config = msa_config or MSAConfig()
        tp_group = self.pg_collection.tp
        if (config.num_query_groups < group_size(tp_group)
                and getattr(config, "attention_output_gate", False)):
            raise ValueError(
                f"attention_output_gate=True with TP {group_size(tp_group)} > num_query_groups "
                f"{config.num_query_groups}: MSA's split of a query group over TP ranks does "
                "not support the output gate; use TP <= num_query_groups or no gate")
        if getattr(config, "fused_single_qkv_rope", False):
            raise ValueError("MSA attention does not support fused_single_qkv_rope=True")
        self.head_layout = build_head_layout(config, self.msa_config, group_size(tp_group),
                                             group_rank(tp_group))
        layout = self.head_layout

        def has_norm(norm: Optional[torch.nn.Module]) -> bool:
            return norm is not None and not isinstance(norm, IdentityOp)

        self.index = MSAIndexBranch(
            config, layout, submodules.linear_q_idx,
            submodules.q_layernorm if has_norm(self.q_layernorm) else None,
            submodules.k_layernorm if has_norm(self.k_layernorm) else None,
            self.pg_collection,
        )
        groups = ParallelGroups(
            cp=getattr(self.pg_collection, "cp", None),
            tp_share=share_group(tp_group, layout.share) if layout.share > 1 else None)
        self.core_attention.bind(self.msa_config, layout, layer_number, groups,
                                 tp_size=group_size(tp_group))
        compat.install_kl_loss_scale_hook(config, set_kl_loss_scale)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate: bool = False, split_qkv: bool = True, **kwargs):
        """Main q/k/v as megatron-core computes them; for TP > num_query_groups with a gather that
        runs on any device (megatron-core's is CUDA-only). Returns ``(query, key, value)``."""
        if self.config.num_query_groups >= self.world_size:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv,
                **kwargs)
        if output_gate or not split_qkv:
            raise NotImplementedError(
                "MSA with TP > num_query_groups supports neither attention_output_gate nor the "
                "fused single-QKV RoPE"
            )
        tp_group = self.pg_collection.tp
        groups = self.config.num_query_groups
        share = self.world_size // groups
        rank = group_rank(tp_group)
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        # Columns interleave per group: [q heads of group g, k_g, v_g] for g = 0..groups-1.
        mixed_qkv = gather_last_dim(mixed_qkv, tp_group)
        width = mixed_qkv.shape[-1] // groups
        mixed_qkv = mixed_qkv[..., (rank // share) * width:(rank // share + 1) * width]
        dim = self.hidden_size_per_attention_head
        heads_in_group = self.config.num_attention_heads // groups
        query, key, value = torch.split(mixed_qkv, [heads_in_group * dim, dim, dim], dim=-1)
        heads = heads_in_group // share
        query = query.reshape(*query.shape[:2], heads_in_group, dim)
        query = query[:, :, (rank % share) * heads:(rank % share + 1) * heads]
        key = key.reshape(*key.shape[:2], 1, dim)
        value = value.reshape(*value.shape[:2], 1, dim)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        return query, key, value

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                key_value_states=None, inference_context=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                attention_bias=None, packed_seq_params=None, sequence_len_offset=None,
                **kwargs: Any):
        """The layer's forward (training): main q/k/v with RoPE as megatron-core computes them,
        the index q/k (:class:`~msa_megatron.megatron.index.MSAIndexBranch`), the core attention
        called with both explicitly (checkpointed under selective ``core_attn`` recompute), the
        output projection. Returns ``(output [s, b, hidden], bias)``.

        Raises:
            ValueError: cross-attention inputs or an attention bias.
            NotImplementedError: inference (KV cache), fused single-QKV RoPE, activation
                offloading.
        """
        if key_value_states is not None:
            raise ValueError("MSASelfAttention is self-attention: key_value_states must be None")
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("MSA attention does not support inference contexts")
        if attention_bias is not None:
            raise ValueError("MSA attention does not take an attention_bias")
        if rotary_pos_cos is not None or rotary_pos_sin is not None:
            raise NotImplementedError("MSA attention takes rotary_pos_emb, not cos/sin tables")
        if getattr(self.config, "fused_single_qkv_rope", False):
            raise NotImplementedError("MSA attention does not support fused_single_qkv_rope")
        if any(getattr(self, flag, False) for flag in _OFFLOAD_FLAGS):
            raise NotImplementedError("MSA attention does not support activation offloading")
        no_rope = (self.config.no_rope_freq[self.layer_number - 1]
                   if self.config.no_rope_freq else False)
        if no_rope:
            rotary_pos_emb = None
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb,) * 2

        # THD RoPE table rows: built once for q, k, q_idx and k_idx (index.apply_rope).
        rope_cache: dict = {}
        gated = bool(getattr(self.config, "attention_output_gate", False))
        if (self.config.sequence_parallel and self.world_size > 1
                and can_run_local(self.linear_qkv)):
            # One all-gather of the hidden states for the three projections
            # (megatron/sequence_parallel.py).
            shared = SharedGather(hidden_states, self.pg_collection.tp)
            with shared.saving():
                q_idx, k_idx = self.index(shared.full, rotary_pos_emb, packed_seq_params,
                                          gathered=True, rope_cache=rope_cache)
                with local_projection(self.linear_qkv):
                    qkv = self.get_query_key_value_tensors(shared.full, None, output_gate=gated,
                                                           split_qkv=True)
        else:
            q_idx, k_idx = self.index(hidden_states, rotary_pos_emb, packed_seq_params,
                                      rope_cache=rope_cache)
            qkv = self.get_query_key_value_tensors(hidden_states, None, output_gate=gated,
                                                   split_qkv=True)
        query, key, value = qkv[:3]
        gate = qkv[3] if gated else None
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            query, key, value = query.squeeze(1), key.squeeze(1), value.squeeze(1)
        if rotary_pos_emb is not None:
            cu_q, cu_k = rope_cu_seqlens(packed_seq_params)
            cp_group = getattr(self.pg_collection, "cp", None)
            query = apply_rope(query, rotary_pos_emb[0], self.config, cu_q, cp_group, rope_cache)
            key = apply_rope(key, rotary_pos_emb[1], self.config, cu_k, cp_group, rope_cache)

        if self.checkpoint_core_attention and self.training:
            core_out = self._checkpointed_core_attention(query, key, value, q_idx, k_idx,
                                                         attention_mask, packed_seq_params)
        else:
            core_out = self.core_attention(query, key, value, attention_mask, q_idx=q_idx,
                                           k_idx=k_idx, packed_seq_params=packed_seq_params)
        if thd:
            core_out = core_out.reshape(core_out.size(0), 1, -1)
        if gate is not None:
            core_out = self._apply_output_gate(core_out, gate)
        return self.linear_proj(core_out)

    def _checkpointed_core_attention(self, query, key, value, q_idx, k_idx, attention_mask,
                                     packed_seq_params):
        """Selective ``core_attn`` recomputation with the index q/k as checkpoint inputs (so the
        recomputation reads this micro-batch's index tensors)."""

        def run_core(query, key, value, q_idx, k_idx):
            return self.core_attention(query, key, value, attention_mask, q_idx=q_idx,
                                       k_idx=k_idx, packed_seq_params=packed_seq_params)

        return tensor_parallel.checkpoint(run_core, False, query, key, value, q_idx, k_idx)


class MSACoreAttention(MegatronModule):
    """Core attention computing MSA (MSA_SPEC sections 2-6) in megatron-core's layer.

    Built by ``SelfAttention`` with megatron's core-attention arguments, then configured by
    :class:`MSASelfAttention` (:meth:`bind`). ``forward(query, key, value, attention_mask, *,
    q_idx, k_idx, packed_seq_params)`` takes SBHD ``[s, b, h, d]`` or THD ``[t, h, d]``
    (``packed_seq_params.qkv_format == "thd"``) and returns ``[s, b, Hq_local * d]`` /
    ``[t, Hq_local * d]``. MSA is causal within each sequence (SBHD: each sample; THD: the
    ``packed_seq_params`` boundaries, padded ones when given); ``attention_mask`` is not read,
    like Transformer Engine with a causal mask type. Attention dropout is not applied. SBHD
    inputs are copied to THD order (``[b*s, h, d]``).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type: Optional[str] = None,
                 softmax_scale: Optional[float] = None, pg_collection=None, **kwargs: Any) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MSA attention is causal; got attn_mask_type={attn_mask_type}")
        self.layer_number = layer_number
        self.megatron_softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type  # kept like megatron-core's; MSA does not read it
        self.groups = ParallelGroups(
            cp=None if pg_collection is None else getattr(pg_collection, "cp", None))
        self.msa_config: Optional[MSAConfig] = None
        self.layout: Optional[MSAHeadLayout] = None
        self.tp_size = 1
        self.mode = "sparse"
        self._selections = SelectionStore(layer_number)
        self.probe = None  # a SelectionProbe armed for the next forward (megatron/probe.py)
        if config.attention_dropout:
            warnings.warn("MSA attention applies no attention dropout "
                          f"(config.attention_dropout={config.attention_dropout} is ignored)")

    def bind(self, msa_config: MSAConfig, layout: MSAHeadLayout, layer_number: int,
             groups: ParallelGroups, tp_size: int) -> None:
        """Set the MSA options, this rank's heads and process groups (called by
        :class:`MSASelfAttention`)."""
        self.msa_config = msa_config
        self.layout = layout
        self.layer_number = layer_number
        self._selections.layer_number = layer_number
        self.groups = groups
        self.tp_size = tp_size
        self.set_mode(msa_config.mode)

    def set_mode(self, mode: str) -> None:
        """``"sparse"`` or ``"dense"`` (warmup, MSA_SPEC section 5); drops stored selections."""
        check_mode(mode)
        self.mode = mode
        self._selections.clear()

    def clear_selections(self) -> None:
        """Drop stored selections (see :func:`clear_selection_cache`)."""
        self._selections.clear()

    def options(self) -> MSAOptions:
        """The composer options of the next call: the MSAConfig with this layer's mode, its
        megatron-core softmax scale when the config sets none, and its K/V exchange."""
        return MSAOptions.from_config(
            self.msa_config, mode=self.mode, softmax_scale=self.megatron_softmax_scale,
            kv_exchange=resolve_cp_kv_exchange(self.msa_config.cp_kv_exchange))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, *,
                q_idx: Optional[torch.Tensor] = None, k_idx: Optional[torch.Tensor] = None,
                **kwargs: Any) -> torch.Tensor:
        """MSA of this rank's heads; ``q_idx [s, b, Hi_local, Di]`` / ``k_idx [s, b, Hik_local,
        Di]`` (THD: ``[t, H, Di]``) come from :class:`MSASelfAttention` (required).

        Raises:
            TypeError: no index q/k given. ValueError: a non-causal mask type or a bias.
        """
        if self.msa_config is None:
            raise RuntimeError("MSACoreAttention.bind was not called (use MSASelfAttention)")
        if q_idx is None or k_idx is None:
            raise TypeError(
                "MSACoreAttention needs the index q/k (q_idx=, k_idx=): it must be the core "
                "attention of an MSASelfAttention (msa_megatron.megatron.get_gpt_layer_msa_spec)"
            )
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MSA attention is causal; got attn_mask_type={attn_mask_type}")
        if attention_bias is not None:
            raise ValueError("MSA attention does not take an attention_bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cu_seqlens = cu_real = seq_len = batch = None
        if thd:
            q, k, v, qi, ki = query, key, value, q_idx, k_idx
            cu_seqlens = packed_seq_params.cu_seqlens_q.to(torch.int32)
            if packed_seq_params.cu_seqlens_q_padded is not None:
                cu_seqlens, cu_real = (packed_seq_params.cu_seqlens_q_padded.to(torch.int32),
                                       cu_seqlens)
        else:
            seq_len, batch = query.shape[:2]
            q, k, v, qi, ki = (_sbhd_to_thd(t) for t in (query, key, value, q_idx, k_idx))
        out, kl = self._attention(q, k, v, qi, ki, cu_seqlens, cu_real, batch, seq_len)
        if thd:
            out = out.reshape(out.shape[0], -1)
        else:
            out = out.view(batch, seq_len, -1).transpose(0, 1).contiguous()
        return attach_kl_loss(out, kl, float(self.msa_config.kl_coeff))

    def _attention(self, q, k, v, q_idx, k_idx, cu_seqlens, cu_real, batch, seq_len):
        """THD MSA of this rank with selection reuse and metrics; returns ``(out, kl)``.

        ``cu_seqlens``: the (padded) THD boundaries, None for SBHD; ``cu_real``: the real
        boundaries of padded THD, else None (global ones under CP)."""
        cp_size = self.groups.cp_size
        recomputing = torch.is_grad_enabled() and compat.is_checkpointing()
        first_of_checkpoint = (not torch.is_grad_enabled() and compat.is_checkpointing()
                               and self.training)
        if cu_seqlens is None:
            cu_seqlens = (torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seq_len
                          if cp_size == 1 else sbhd_cu_seqlens(batch, seq_len * cp_size, q.device))
        block_idx = None
        if self.mode == "sparse" and recomputing:
            block_idx = self._selections.take(q_idx, k_idx, cu_seqlens, cu_real, self.groups.cp)
        # N of the KL normaliser: the real tokens of the micro-batch over all CP ranks.
        # (Meta tensors have no values: their KL, a meta tensor, does not depend on this.)
        tokens_global = (q.shape[0] * cp_size if cu_real is None or cu_real.is_meta
                         else int(cu_real[-1] - cu_real[0]))
        stats = None
        if cp_size > 1 and self.training:
            stats = cp_stats_accumulator(self.layer_number, new_micro_batch=not recomputing)
        options = self.options()
        result = msa_layer(
            q, k, v, q_idx, k_idx, options=options, cu_seqlens=cu_seqlens,
            cu_seqlens_real=cu_real, groups=self.groups, block_idx=block_idx, stats=stats,
            kl_scale=1.0 / (max(tokens_global, 1) * self.layout.num_index_heads),
        )
        if self.probe is not None and not recomputing:  # after msa_layer checked the inputs
            self._observe_selection(q, k, q_idx, k_idx, cu_seqlens, cu_real, cp_size, options)
        if first_of_checkpoint and result.block_idx is not None:
            self._selections.put(result.block_idx, q_idx, k_idx, cu_seqlens, cu_real,
                                 self.groups.cp)
        if self.training and not recomputing:
            record_kl(self.layer_number, result.kl, self.tp_size * cp_size)
        return result.out, result.kl

    def _observe_selection(self, q, k, q_idx, k_idx, cu_seqlens, cu_real, cp_size,
                           options: MSAOptions) -> None:
        """Hand this forward's inputs to the armed selection probe, once, then disarm."""
        probe, self.probe = self.probe, None
        probe.observe(self.layer_number, q, k, q_idx, k_idx, cu_seqlens,
                      block_size=options.block_size, top_k=options.top_k,
                      init_blocks=options.init_blocks, local_blocks=options.local_blocks,
                      softmax_scale=options.softmax_scale, index_scale=options.index_scale,
                      backend=options.backend, cp_group=self.groups.cp if cp_size > 1 else None,
                      share_group=self.groups.tp_share, cu_seqlens_real=cu_real)


def _sbhd_to_thd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` -> ``[b*s, h, d]`` (sequence-major per batch entry)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def model_chunks(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> list:
    """``[model]`` for a module, the chunks of megatron's list of model chunks otherwise.

    Raises:
        TypeError: ``model`` is neither a module nor an iterable of modules.
    """
    if isinstance(model, torch.nn.Module):
        return [model]
    try:
        chunks = list(model)
    except TypeError:  # not iterable
        chunks = None
    if chunks is None or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TypeError(f"model must be a torch.nn.Module or a list of them (model chunks), got "
                        f"{type(model).__name__}"
                        + ("" if chunks is None else f" of {[type(c).__name__ for c in chunks]}"))
    return chunks


def _msa_cores(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
    for chunk in model_chunks(model):
        for module in chunk.modules():
            if isinstance(module, MSACoreAttention):
                yield module


def set_msa_mode(model: Union[torch.nn.Module, Iterable[torch.nn.Module]], mode: str) -> int:
    """Switch every MSA layer of ``model`` (a module or a list of model chunks) to ``mode``.

    Args:
        model: the model (megatron's list of model chunks is accepted).
        mode: ``"dense"`` (warmup: full causal attention, KL over the causal row) or
            ``"sparse"`` (MSA_SPEC section 5). Takes effect at the next forward; no rebuild.

    Returns:
        The number of MSA layers switched.

    Raises:
        ValueError: unknown mode.
    """
    check_mode(mode)
    count = 0
    for core in _msa_cores(model):
        core.set_mode(mode)
        count += 1
    return count


def apply_msa_warmup(model: Union[torch.nn.Module, Iterable[torch.nn.Module]], step: int,
                     dense_steps: int) -> str:
    """Dense for the first ``dense_steps`` training steps, sparse afterwards.

    Call at the start of every step (``step`` counted from 0). Returns the mode in force.

    Raises:
        TypeError: ``step`` or ``dense_steps`` is not an int; ``model`` is not a module or a
            list of them.
        ValueError: ``step`` or ``dense_steps`` is negative.
    """
    for name, value in (("step", step), ("dense_steps", dense_steps)):
        if check_int(name, value) < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    mode = "dense" if step < dense_steps else "sparse"
    for core in _msa_cores(model):
        if core.mode != mode:
            core.set_mode(mode)
    return mode


def clear_selection_cache(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> None:
    """Drop stored selections, e.g. after a forward-only pass run in training mode with
    activation checkpointing, whose recomputation will never come. Not needed for correctness
    (a recomputation takes only the selection made from its own inputs); it frees their memory
    (``[T, G, top_k]`` int32 per layer) and keeps them from filling the per-layer cap."""
    for core in _msa_cores(model):
        core.clear_selections()


def index_branch_parameters(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
    """Yield the parameters of every MSA layer's index branch (index projections and norms).

    Used to freeze the index (a "random index" baseline) or to give it its own optimizer group.
    """
    for chunk in model_chunks(model):
        for module in chunk.modules():
            if isinstance(module, MSASelfAttention):
                yield from module.index.parameters()
