"""MSA self-attention for megatron-core: index projections, core attention, TP and CP wiring.

Two modules, plugged in through megatron-core's ``ModuleSpec`` (see :mod:`.spec`):

- :class:`MSASelfAttention` (a ``SelfAttention``): the main q/k/v exactly as megatron-core
  computes them, plus the index branch (MSA_SPEC section 4) read from the attention input with
  gradient stopped: ``linear_q_idx`` (hidden -> Hi*Di, column-parallel: split over TP with the
  query heads its index heads serve) and ``linear_k_idx`` (hidden -> Hik*Di,
  :class:`IndexKeyLinear`: split over TP by index key head when ``Hik % TP == 0``, each rank
  holding the key heads its index heads read; otherwise, e.g. the default Hik = 1, replicated
  on every TP rank with its gradient summed over TP inside autograd, like the index norms'
  gradients, so ``loss.backward()`` alone leaves correct gradients). The index q/k get the
  transforms of the main q/k: the ``q_layernorm`` class of the spec (own weights, when
  ``qk_layernorm``) and the layer's RoPE.
- :class:`MSACoreAttention`: the core attention that megatron-core calls (and recomputes under
  selective ``core_attn`` recomputation). It converts SBHD / THD (``packed_seq_params``) to the
  op layout, selects blocks (or reuses the selection of the step, see below), runs the MSA op,
  attaches the KL to the output (:mod:`.loss`) and records the KL metric.

Parallel layouts (MSA_SPEC section 6, :mod:`msa_megatron.parallel.tensor`):

- ``Hi % TP == 0``: a rank owns whole index heads; everything is local.
- ``TP % Hi == 0``, ``Hi < TP`` (TP > Hkv, e.g. 64 query / 4 KV heads at TP 8): megatron-core
  spreads one group's query heads over ``TP/Hkv`` ranks. The MSA layer gathers the projections
  itself (megatron-core's gather is CUDA-only), the ranks sharing an index head select once
  (split tokens, exchange indices) and compute an exact KL teacher from heads held on several
  ranks (:func:`~msa_megatron.parallel.tensor.shared_index_msa_attention`).
- CP > 1: one call, in :meth:`MSACoreAttention._context_parallel`, to
  ``msa_megatron.parallel.context.context_parallel_msa_attention(q, k, v, q_idx, k_idx, *,
  cu_seqlens_global, cp_group, kv_exchange, block_size, top_k, init_blocks, local_blocks,
  softmax_scale, index_scale, mode, backend, kl_scale, block_idx, tp_share_group,
  cu_seqlens_global_unpadded, stats) -> (out, kl, block_idx, stats)`` with THD tensors of this
  rank's tokens, the global (padded) ``cu_seqlens`` (SBHD: ``b`` sequences of the global
  length) and ``kl_scale = 1 / (N_global * Hi_total)``. The K/V exchange is
  ``MSAConfig.cp_kv_exchange``, or when None the one megatron-core's ``cp_comm_type`` of the
  layer maps to (``"p2p"`` -> ``"selective"``, ``"all_gather"`` -> ``"allgather"``, others
  -> ``"allgather"``). The bytes moved accumulate per layer in
  :func:`~msa_megatron.megatron.loss.cp_stats_accumulator` (reported by ``get_msa_metrics``);
  ``core.cp_stats`` is the dict the last CP call added to.

Padded THD (``packed_seq_params.cu_seqlens_q_padded`` set, as megatron-core pads sequences for
CP): the tokens are laid out by the padded boundaries; a sequence's padding tokens (positions at
or past its real length ``cu_seqlens_q``) get finite outputs but are not part of the KL: they
add no KL term and do not count in N (``kl_scale = 1 / (N_real * Hi_total)``), with or without
CP, TP sharing included. Real tokens never read padding (causal; it trails the sequence).

Selection reuse (MSA_SPEC section 6): under megatron-core activation checkpointing (selective
``core_attn`` or full layer recompute) the core attention runs twice per micro-batch: once
without grad inside the checkpoint's forward, once in backward. The first run stores its
``block_idx`` in a per-layer FIFO; the recomputation takes the oldest entry (megatron's
schedules run each layer's backwards in the order of its forwards) and frees it. Without
checkpointing the selection lives in the autograd graph only. A checkpoint whose first pass is
not megatron-core's (``is_checkpointing()`` false, e.g. Transformer Engine's fp8 checkpoint)
stores nothing; its recomputation then selects again from bitwise-identical index q/k: the same
blocks, only slower. :func:`selection_counts` counts selection calls and selected
(token, index head) rows for tests.

With a replicated index key projection each rank slices the key heads its index heads read.
"""

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import MSAConfig, check_mode
from ..ops.backends import resolve_backend
from ..ops.layout import query_layout
from ..ops.validation import check_backend_limits, check_main_inputs
from ..parallel.context import context_parallel_msa_attention, resolve_cp_kv_exchange
from ..parallel.cp_layout import sbhd_cu_seqlens
from ..parallel.tensor import (
    all_gather_first_dim,
    gather_last_dim,
    group_rank,
    group_size,
    index_head_layout,
    local_msa_attention,
    real_token_rows,
    share_group,
    shared_index_msa_attention,
    token_slices,
)
from . import compat
from .probe import warn_probe_under_cp
from .loss import attach_kl_loss, cp_stats_accumulator, record_kl, set_kl_loss_scale

_SELECTION_COUNTS = {"calls": 0, "rows": 0}


def selection_counts() -> Dict[str, int]:
    """Selections run by this process since the last reset: ``{"calls", "rows"}`` where rows
    are selected (query token, index head) pairs."""
    return dict(_SELECTION_COUNTS)


def reset_selection_counts() -> None:
    """Zero :func:`selection_counts`."""
    _SELECTION_COUNTS.update(calls=0, rows=0)


@dataclass
class MSASelfAttentionSubmodules(SelfAttentionSubmodules):
    """megatron-core's self-attention submodules plus the index query projection.

    ``linear_q_idx``: a column-parallel linear class or ModuleSpec (megatron-core's
    ``ColumnParallelLinear`` or Transformer Engine's ``TEColumnParallelLinear``).
    """

    linear_q_idx: Union[ModuleSpec, type, None] = None


@dataclass(frozen=True)
class MSAHeadLayout:
    """Heads of one TP rank (MSA_SPEC sections 1 and 6).

    Attributes:
        num_index_heads: Hi of the whole layer; index_key_heads: Hik; index_head_dim: Di.
        index_first, index_count: this rank's index heads ``[first, first + count)``.
        key_first, key_count: the index key heads they read.
        share: ranks holding each of this rank's index heads (``TP / Hi`` when ``Hi < TP``).
    """

    num_index_heads: int
    index_key_heads: int
    index_head_dim: int
    index_first: int
    index_count: int
    key_first: int
    key_count: int
    share: int


def build_head_layout(config: TransformerConfig, msa_config: MSAConfig, tp_size: int,
                      tp_rank: int) -> MSAHeadLayout:
    """Split the index heads of a layer over TP (raises ValueError for impossible splits)."""
    hq, hkv = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    hi = msa_config.resolved_index_heads(hkv)
    hik, di = msa_config.index_key_heads, msa_config.index_head_dim
    if hq % hi or hi % hkv or hi % hik:
        raise ValueError(
            f"MSA needs Hq % Hi == 0, Hi % Hkv == 0 and Hi % Hik == 0; got Hq={hq} "
            f"(num_attention_heads), Hkv={hkv} (num_query_groups), Hi={hi} (index_heads), "
            f"Hik={hik} (index_key_heads)"
        )
    first, count, share = index_head_layout(hi, tp_size, tp_rank)
    per_key = hi // hik
    if count % per_key == 0:
        key_first, key_count = first // per_key, count // per_key
    elif per_key % count == 0:
        key_first, key_count = first // per_key, 1
    else:
        raise ValueError(
            f"the {count} index heads of a TP rank must read whole index key heads: Hi={hi}, "
            f"Hik={hik}, TP={tp_size}"
        )
    if share > 1 and (hi * di) % tp_size:
        raise ValueError(f"Hi*Di={hi * di} must be divisible by the tensor-parallel size {tp_size}")
    return MSAHeadLayout(hi, hik, di, first, count, key_first, key_count, share)


class IndexKeyLinear(torch.nn.Module):
    """The index key projection ``k_idx = x W^T`` (no bias), hidden -> Hik*Di (MSA_SPEC
    section 6).

    ``Hik % TP == 0``: split over TP by key head, rank ``r`` holding key heads
    ``[r*Hik/TP, (r+1)*Hik/TP)`` (those its index heads read: index head ``i`` reads key head
    ``i // (Hi/Hik)``), a TP-sharded parameter (partition dim 0) with per-rank gradients.
    Otherwise replicated on every TP rank; the gradient of ``W`` is summed over the TP group
    inside autograd (a hook on the parameter), so each rank ends with the gradient of the whole
    layer. Initialised as the full ``[Hik*Di, hidden]`` matrix on every rank, then sliced: the
    weights are the same for every TP size. Checkpointed as one global tensor in both layouts
    (:meth:`sharded_state_dict`), so checkpoints reshard between them.

    Attributes:
        sharded: whether the weight is split over TP; first_head: global index of the first
            key head this rank holds; num_heads: key heads this rank holds.
    """

    def __init__(self, input_size: int, num_key_heads: int, head_dim: int,
                 config: TransformerConfig, tp_group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        tp_size, tp_rank = group_size(tp_group), group_rank(tp_group)
        self.tp_group = tp_group
        self.sharded = num_key_heads % tp_size == 0
        self.num_heads = num_key_heads // tp_size if self.sharded else num_key_heads
        self.first_head = tp_rank * self.num_heads if self.sharded else 0
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        master = torch.empty(num_key_heads * head_dim, input_size, dtype=config.params_dtype,
                             device=device)
        if config.perform_initialization:
            config.init_method(master)
        rows = slice(self.first_head * head_dim, (self.first_head + self.num_heads) * head_dim)
        self.weight = torch.nn.Parameter(master[rows].clone())
        if self.sharded:
            tensor_parallel.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        else:
            sum_grad_over_tp(self.weight, tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` (the full sequence) -> ``[..., num_heads * Di]``."""
        return F.linear(x, self.weight)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """megatron-core distributed checkpoint entries: the weight as a TP-sharded (dim 0) or
        a replicated tensor of the same global shape."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix,
            {"weight": 0} if self.sharded else {}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=(metadata or {}).get("dp_cp_group"))


def sum_grad_over_tp(param: torch.nn.Parameter, tp_group: Optional[dist.ProcessGroup]) -> None:
    """Make ``param`` (replicated over TP, each rank computing a partial gradient) receive the
    TP-summed gradient in backward, and keep megatron's finalize step from summing it again."""
    param.sequence_parallel = False
    if group_size(tp_group) == 1:
        return

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=tp_group)
        return grad

    param.register_hook(hook)


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
        ValueError: non-causal mask type, head counts MSA cannot split over TP.
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
        self.head_layout = build_head_layout(config, self.msa_config, group_size(tp_group),
                                             group_rank(tp_group))
        layout = self.head_layout
        self.linear_q_idx = build_module(
            submodules.linear_q_idx, config.hidden_size, layout.num_index_heads *
            layout.index_head_dim, config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name="q_idx", tp_group=tp_group,
        )
        self.linear_k_idx = IndexKeyLinear(config.hidden_size, layout.index_key_heads,
                                           layout.index_head_dim, config, tp_group)
        self.q_idx_norm = self._index_norm(submodules.q_layernorm, self.q_layernorm, tp_group)
        self.k_idx_norm = self._index_norm(submodules.k_layernorm, self.k_layernorm, tp_group)
        self.core_attention.bind(self.msa_config, layout, layer_number,
                                 share_group(tp_group, layout.share) if layout.share > 1 else None,
                                 tp_size=group_size(tp_group))
        compat.install_kl_loss_scale_hook(config, set_kl_loss_scale)

    def _index_norm(self, norm_spec, main_norm, tp_group) -> Optional[torch.nn.Module]:
        """The index branch's own norm, of the class the main q/k use (None without one)."""
        if main_norm is None or isinstance(main_norm, IdentityOp):
            return None
        norm = build_module(norm_spec, hidden_size=self.head_layout.index_head_dim,
                            config=self.config, eps=self.config.layernorm_epsilon)
        for param in norm.parameters():
            sum_grad_over_tp(param, tp_group)
        return norm

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

    def index_query_key(self, hidden_states: torch.Tensor, rotary_pos_emb,
                        packed_seq_params) -> Tuple[torch.Tensor, torch.Tensor]:
        """Index q/k from the attention input with gradient stopped (MSA_SPEC section 4).

        Args:
            hidden_states: ``[s, b, hidden]`` (``[s/TP, b, hidden]`` with sequence parallelism).
            rotary_pos_emb: the layer's RoPE frequencies (or a (q, k) pair, or None).
            packed_seq_params: THD boundaries or None.

        Returns:
            ``q_idx [s, b, Hi_local, Di]``, ``k_idx [s, b, Hik_local, Di]`` (``[t, H, Di]`` for
            THD), normed and rotated like the main q/k.
        """
        layout = self.head_layout
        tp_group = self.pg_collection.tp
        x = hidden_states.detach()
        q_idx, _ = self.linear_q_idx(x)
        if layout.share > 1:
            q_idx = gather_last_dim(q_idx, tp_group)
            width = layout.index_head_dim
            q_idx = q_idx[..., layout.index_first * width:(layout.index_first + 1) * width]
        q_idx = q_idx.reshape(*q_idx.shape[:2], layout.index_count, layout.index_head_dim)
        if self.config.sequence_parallel:
            x = all_gather_first_dim(x, tp_group)
        k_idx = self.linear_k_idx(x)
        k_idx = k_idx.reshape(*k_idx.shape[:2], self.linear_k_idx.num_heads,
                              layout.index_head_dim)
        first = layout.key_first - self.linear_k_idx.first_head
        k_idx = k_idx[:, :, first:first + layout.key_count]
        if self.q_idx_norm is not None:
            q_idx = self.q_idx_norm(q_idx)
        if self.k_idx_norm is not None:
            k_idx = self.k_idx_norm(k_idx)
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:
            q_idx, k_idx = q_idx.squeeze(1), k_idx.squeeze(1)
        no_rope = (self.config.no_rope_freq[self.layer_number - 1]
                   if self.config.no_rope_freq else False)
        if rotary_pos_emb is not None and not no_rope:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
            cu_q = cu_k = None
            if thd:
                cu_q = (packed_seq_params.cu_seqlens_q_padded
                        if packed_seq_params.cu_seqlens_q_padded is not None
                        else packed_seq_params.cu_seqlens_q)
                cu_k = (packed_seq_params.cu_seqlens_kv_padded
                        if packed_seq_params.cu_seqlens_kv_padded is not None
                        else packed_seq_params.cu_seqlens_kv)
            q_idx = self._rope(q_idx, rotary_pos_emb[0], cu_q)
            k_idx = self._rope(k_idx, rotary_pos_emb[1], cu_k)
        return q_idx, k_idx

    def _rope(self, t: torch.Tensor, freqs: Optional[torch.Tensor], cu_seqlens) -> torch.Tensor:
        if freqs is None:
            return t
        if freqs.shape[-1] > t.shape[-1]:
            raise ValueError(
                f"RoPE rotates {freqs.shape[-1]} dims but the index head dim Di is {t.shape[-1]}; "
                "use index_head_dim >= the rotary dim (kv_channels * rotary_percent)"
            )
        from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
            _yarn_get_concentration_factor_from_config,
        )

        return apply_rotary_pos_emb(t, freqs, config=self.config, cu_seqlens=cu_seqlens,
                                    mscale=_yarn_get_concentration_factor_from_config(self.config),
                                    cp_group=self.pg_collection.cp)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                key_value_states=None, inference_context=None, rotary_pos_emb=None,
                *args: Any, packed_seq_params=None, **kwargs: Any):
        """``SelfAttention.forward`` with the index q/k computed first and handed to the core
        attention. Returns ``(output [s, b, hidden], bias)``. Inference (KV cache) is not
        supported."""
        if key_value_states is not None:
            raise ValueError("MSASelfAttention is self-attention: key_value_states must be None")
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise NotImplementedError("MSA attention does not support inference contexts")
        if args:
            raise TypeError("pass the optional arguments of MSASelfAttention.forward by keyword")
        q_idx, k_idx = self.index_query_key(hidden_states, rotary_pos_emb, packed_seq_params)
        self.core_attention.set_index_inputs(q_idx, k_idx)
        try:
            return super().forward(hidden_states, attention_mask, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self.core_attention.clear_index_inputs()

    def _checkpointed_attention_forward(self, query, key, value, attention_mask,
                                        rotary_pos_emb=None, attn_mask_type=None,
                                        attention_bias=None, packed_seq_params=None, **kwargs):
        """Selective ``core_attn`` recomputation with the index q/k as checkpoint inputs (so the
        recomputation reads this micro-batch's index tensors)."""
        q_idx, k_idx = self.core_attention.take_index_inputs()

        def run_core(query, key, value, q_idx, k_idx):
            return self.core_attention(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                q_idx=q_idx, k_idx=k_idx,
            )

        return tensor_parallel.checkpoint(run_core, False, query, key, value, q_idx, k_idx)


class MSACoreAttention(MegatronModule):
    """Core attention computing MSA (MSA_SPEC sections 2-6) in megatron-core's layer.

    Built by ``SelfAttention`` with megatron's core-attention arguments, then configured by
    :class:`MSASelfAttention` (:meth:`bind`). ``forward(query, key, value, attention_mask, ...)``
    takes SBHD ``[s, b, h, d]`` or THD ``[t, h, d]`` (``packed_seq_params.qkv_format == "thd"``)
    and returns ``[s, b, Hq_local * d]`` / ``[t, Hq_local * d]``. MSA is causal within each
    sequence (SBHD: each sample; THD: the ``packed_seq_params`` boundaries, padded ones when
    given); ``attention_mask`` is not read, like Transformer Engine with a causal mask type.
    Attention dropout is not applied. SBHD inputs are copied to THD order (``[b*s, h, d]``).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", cp_comm_type: Optional[str] = None,
                 softmax_scale: Optional[float] = None, pg_collection=None, **kwargs: Any) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MSA attention is causal; got attn_mask_type={attn_mask_type}")
        self.layer_number = layer_number
        self.megatron_softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type
        self.cp_group = None if pg_collection is None else getattr(pg_collection, "cp", None)
        self.msa_config: Optional[MSAConfig] = None
        self.layout: Optional[MSAHeadLayout] = None
        self.share_group = None
        self.tp_size = 1
        self.mode = "sparse"
        self.cp_stats: Dict[str, int] = {}
        self._pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self._selection_fifo: Deque[torch.Tensor] = collections.deque()
        self.probe = None  # a SelectionProbe armed for the next forward (megatron/probe.py)
        if config.attention_dropout:
            warnings.warn("MSA attention applies no attention dropout "
                          f"(config.attention_dropout={config.attention_dropout} is ignored)")

    def bind(self, msa_config: MSAConfig, layout: MSAHeadLayout, layer_number: int,
             share_group_: Optional[dist.ProcessGroup], tp_size: int) -> None:
        """Set the MSA options and this rank's heads (called by :class:`MSASelfAttention`)."""
        self.msa_config = msa_config
        self.layout = layout
        self.layer_number = layer_number
        self.share_group = share_group_
        self.tp_size = tp_size
        self.set_mode(msa_config.mode)

    def set_mode(self, mode: str) -> None:
        """``"sparse"`` or ``"dense"`` (warmup, MSA_SPEC section 5); drops stored selections."""
        check_mode(mode)
        self.mode = mode
        self._selection_fifo.clear()

    def set_index_inputs(self, q_idx: torch.Tensor, k_idx: torch.Tensor) -> None:
        """Hand over this forward's index q/k (``[s, b, Hi_local, Di]`` / ``[s, b, Hik_local,
        Di]``, THD without the batch dim); megatron-core calls the core without them."""
        self._pending = (q_idx, k_idx)

    def take_index_inputs(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return and forget the index q/k of :meth:`set_index_inputs` (RuntimeError if none)."""
        if self._pending is None:
            raise RuntimeError(
                "MSACoreAttention got no index q/k: it must be the core attention of an "
                "MSASelfAttention (see msa_megatron.megatron.get_gpt_layer_msa_spec)"
            )
        pending, self._pending = self._pending, None
        return pending

    def clear_index_inputs(self) -> None:
        """Forget index q/k that were not consumed (e.g. after an exception)."""
        self._pending = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, q_idx: Optional[torch.Tensor] = None,
                k_idx: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        if self.msa_config is None:
            raise RuntimeError("MSACoreAttention.bind was not called (use MSASelfAttention)")
        if attn_mask_type is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"MSA attention is causal; got attn_mask_type={attn_mask_type}")
        if attention_bias is not None:
            raise ValueError("MSA attention does not take an attention_bias")
        if q_idx is None:
            q_idx, k_idx = self.take_index_inputs()
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
        msa = self.msa_config
        check_main_inputs(q, k, v, q_idx, k_idx)
        backend = resolve_backend(msa.backend, q.device)
        check_backend_limits(backend, q.dtype, {"D": q.shape[-1], "Di": q_idx.shape[-1]},
                             msa.block_size)
        cp_size = group_size(self.cp_group)
        recomputing = torch.is_grad_enabled() and compat.is_checkpointing()
        first_of_checkpoint = (not torch.is_grad_enabled() and compat.is_checkpointing()
                               and self.training)
        block_idx = None
        if self.mode == "sparse" and recomputing and self._selection_fifo:
            block_idx = self._selection_fifo.popleft()
            if block_idx.shape[0] != q.shape[0]:
                raise RuntimeError(
                    f"layer {self.layer_number}: stored selection of {block_idx.shape[0]} tokens "
                    f"does not match the recomputed micro-batch of {q.shape[0]} tokens"
                )
        if cu_seqlens is None:
            cu_seqlens = (torch.arange(batch + 1, dtype=torch.int32, device=q.device) * seq_len
                          if cp_size == 1 else sbhd_cu_seqlens(batch, seq_len * cp_size, q.device))
        # N of the KL normaliser: the real tokens of the micro-batch over all CP ranks.
        tokens_global = q.shape[0] * cp_size if cu_real is None else int(cu_real[-1] - cu_real[0])
        options = dict(
            block_size=msa.block_size, top_k=msa.top_k, init_blocks=msa.init_blocks,
            local_blocks=msa.local_blocks, softmax_scale=self._softmax_scale(),
            index_scale=msa.index_scale, mode=self.mode,
            kl_scale=1.0 / (max(tokens_global, 1) * self.layout.num_index_heads),
            block_idx=block_idx,
        )
        if self.probe is not None and not recomputing:
            self._observe_selection(q, k, q_idx, k_idx, cu_seqlens, cp_size, backend, options)
        if cp_size > 1:
            out, kl, block_idx, rows = self._context_parallel(
                q, k, v, q_idx, k_idx, cu_seqlens, cu_real, backend, options,
                new_micro_batch=not recomputing)
        else:
            q_pos, q_kbase = query_layout(cu_seqlens, q.shape[0], q.device)
            kl_rows = real_token_rows(cu_seqlens, cu_real, q_pos, q_kbase)
            if self.share_group is not None:
                out, kl, block_idx, rows = shared_index_msa_attention(
                    q, k, v, q_idx, k_idx, q_pos, q_kbase, share_group=self.share_group,
                    backend=backend, kl_rows=kl_rows, **options)
            else:
                out, kl, block_idx, rows = local_msa_attention(
                    q, k, v, q_idx, k_idx, q_pos, q_kbase, backend=backend, kl_rows=kl_rows,
                    **options)
        if rows:
            _SELECTION_COUNTS["calls"] += 1
            _SELECTION_COUNTS["rows"] += rows
        if first_of_checkpoint and block_idx is not None:
            self._selection_fifo.append(block_idx)
        if self.training and not recomputing:
            record_kl(self.layer_number, kl, self.tp_size * cp_size)
        return out, kl

    def _observe_selection(self, q, k, q_idx, k_idx, cu_seqlens, cp_size, backend, options):
        """Hand this forward's inputs to the armed selection probe, once, then disarm."""
        probe, self.probe = self.probe, None
        if cp_size > 1:
            warn_probe_under_cp()
            return
        probe.observe(self.layer_number, q, k, q_idx, k_idx, cu_seqlens,
                      block_size=options["block_size"], top_k=options["top_k"],
                      init_blocks=options["init_blocks"], local_blocks=options["local_blocks"],
                      softmax_scale=options["softmax_scale"], index_scale=options["index_scale"],
                      backend=backend)

    def _softmax_scale(self) -> Optional[float]:
        if self.msa_config.softmax_scale is not None:
            return self.msa_config.softmax_scale
        return self.megatron_softmax_scale

    def _context_parallel(self, q, k, v, q_idx, k_idx, cu_seqlens, cu_real, backend, options,
                          new_micro_batch: bool):
        """The single call site of the context-parallel MSA core (``cu_seqlens``: global)."""
        given = options["block_idx"]
        stats = (cp_stats_accumulator(self.layer_number, new_micro_batch) if self.training
                 else None)
        out, kl, block_idx, stats = context_parallel_msa_attention(
            q, k, v, q_idx, k_idx, cu_seqlens_global=cu_seqlens, cp_group=self.cp_group,
            kv_exchange=resolve_cp_kv_exchange(self.msa_config.cp_kv_exchange,
                                               self.cp_comm_type, self.layer_number),
            backend=backend, tp_share_group=self.share_group,
            cu_seqlens_global_unpadded=cu_real, stats=stats, **options,
        )
        self.cp_stats = stats
        rows = 0
        if block_idx is not None and given is None:
            rows = q_idx.shape[0] * q_idx.shape[1]
            if self.share_group is not None:  # the share ranks each selected a token slice
                start, end = token_slices(q_idx.shape[0], group_size(self.share_group))[
                    group_rank(self.share_group)]
                rows = end - start
        return out, kl, block_idx, rows


def _sbhd_to_thd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, h, d]`` -> ``[b*s, h, d]`` (sequence-major per batch entry)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _msa_cores(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
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
    """
    mode = "dense" if step < dense_steps else "sparse"
    for core in _msa_cores(model):
        if core.mode != mode:
            core.set_mode(mode)
    return mode


def clear_selection_cache(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> None:
    """Drop stored selections (e.g. after a forward-only pass run in training mode with
    activation checkpointing, whose recomputation will never come)."""
    for core in _msa_cores(model):
        core._selection_fifo.clear()


def index_branch_parameters(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
    """Yield the parameters of every MSA layer's index branch (index projections and norms).

    Used to freeze the index (a "random index" baseline) or to give it its own optimizer group.
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MSASelfAttention):
                for part in (module.linear_q_idx, module.linear_k_idx, module.q_idx_norm,
                             module.k_idx_norm):
                    if part is not None:
                        yield from part.parameters()
