"""The MSA index branch of a megatron-core layer: index projections, their norms and RoPE.

:class:`MSAIndexBranch` computes ``q_idx`` / ``k_idx`` from the attention input with gradient
stopped (MSA_SPEC section 4) and hands them to the caller, which passes them to the core
attention explicitly (:meth:`msa_megatron.megatron.attention.MSASelfAttention.forward`).

- ``linear_q_idx`` (hidden -> Hi*Di): column-parallel, split over TP with the query heads its
  index heads serve (gathered and sliced when TP > Hi,
  :func:`~msa_megatron.parallel.comm.gather_last_dim`).
- ``linear_k_idx`` (hidden -> Hik*Di, :class:`IndexKeyLinear`): split over TP by index key head
  when ``Hik % TP == 0``; otherwise (e.g. the default Hik = 1) replicated on every TP rank with
  its gradient summed over TP inside autograd, like the index norms' gradients, so
  ``loss.backward()`` alone leaves correct gradients.
- The index q/k get the transforms of the main q/k: the ``q_layernorm`` class of the spec (own
  weights, when ``qk_layernorm``) and the layer's RoPE (:func:`apply_rope`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from ..config import MSAConfig
from ..parallel.comm import (
    all_gather_first_dim,
    gather_last_dim,
    group_rank,
    group_size,
    register_grad_sum,
)
from ..parallel.tensor import index_head_layout


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


def sum_grad_over_tp(param: torch.nn.Parameter, tp_group: Optional[dist.ProcessGroup]) -> None:
    """Make ``param`` (replicated over TP, each rank computing a partial gradient) receive the
    TP-summed gradient in backward, and keep megatron's finalize step from summing it again."""
    param.sequence_parallel = False
    register_grad_sum(param, tp_group)


class IndexKeyLinear(torch.nn.Module):
    """The index key projection ``k_idx = x W^T`` (no bias), hidden -> Hik*Di (MSA_SPEC
    section 6).

    ``Hik % TP == 0``: split over TP by key head, rank ``r`` holding key heads
    ``[r*Hik/TP, (r+1)*Hik/TP)`` (those its index heads read: index head ``i`` reads key head
    ``i // (Hi/Hik)``), a TP-sharded parameter (partition dim 0) with per-rank gradients.
    Otherwise replicated on every TP rank; the gradient of ``W`` is summed over the TP group
    inside autograd (:func:`sum_grad_over_tp`), so each rank ends with the gradient of the whole
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


def rope_cu_seqlens(packed_seq_params) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``(cu_q, cu_kv)`` boundaries RoPE positions follow (padded ones when given; None for
    SBHD), as megatron-core's attention picks them."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return None, None
    cu_q = (packed_seq_params.cu_seqlens_q_padded
            if packed_seq_params.cu_seqlens_q_padded is not None
            else packed_seq_params.cu_seqlens_q)
    cu_k = (packed_seq_params.cu_seqlens_kv_padded
            if packed_seq_params.cu_seqlens_kv_padded is not None
            else packed_seq_params.cu_seqlens_kv)
    return cu_q, cu_k


def apply_rope(t: torch.Tensor, freqs: Optional[torch.Tensor], config: TransformerConfig,
               cu_seqlens: Optional[torch.Tensor], cp_group) -> torch.Tensor:
    """megatron-core's RoPE (``apply_rotary_pos_emb`` with the layer's YaRN mscale), as its
    attention applies it to q and k; identity when ``freqs`` is None."""
    if freqs is None:
        return t
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    return apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu_seqlens,
                                mscale=_yarn_get_concentration_factor_from_config(config),
                                cp_group=cp_group)


class MSAIndexBranch(MegatronModule):
    """Index projections, their norms and RoPE of one MSA layer (module docstring).

    Args:
        config: the layer's TransformerConfig.
        layout: this rank's heads (:func:`build_head_layout`).
        linear_q_idx: the column-parallel linear class or spec of ``linear_q_idx``.
        q_norm, k_norm: the norm specs of the main q/k (``None`` / ``IdentityOp``: no norm).
        pg_collection: the layer's process groups (``tp``, ``cp``).
    """

    def __init__(self, config: TransformerConfig, layout: MSAHeadLayout, linear_q_idx,
                 q_norm, k_norm, pg_collection) -> None:
        super().__init__(config=config)
        self.layout = layout
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        self.linear_q_idx = build_module(
            linear_q_idx, config.hidden_size, layout.num_index_heads * layout.index_head_dim,
            config=config, init_method=config.init_method, gather_output=False, bias=False,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="q_idx",
            tp_group=self.tp_group,
        )
        self.linear_k_idx = IndexKeyLinear(config.hidden_size, layout.index_key_heads,
                                           layout.index_head_dim, config, self.tp_group)
        self.q_idx_norm = self._norm(q_norm)
        self.k_idx_norm = self._norm(k_norm)

    def _norm(self, norm_spec) -> Optional[torch.nn.Module]:
        """The index branch's own norm, of the class the main q/k use (None without one)."""
        if norm_spec is None or norm_spec is IdentityOp:
            return None
        norm = build_module(norm_spec, hidden_size=self.layout.index_head_dim,
                            config=self.config, eps=self.config.layernorm_epsilon)
        if isinstance(norm, IdentityOp):
            return None
        for param in norm.parameters():
            sum_grad_over_tp(param, self.tp_group)
        return norm

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb, packed_seq_params
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Index q/k from the attention input with gradient stopped (MSA_SPEC section 4).

        Args:
            hidden_states: ``[s, b, hidden]`` (``[s/TP, b, hidden]`` with sequence parallelism).
            rotary_pos_emb: the layer's RoPE frequencies as a ``(q, k)`` pair, or None.
            packed_seq_params: THD boundaries or None.

        Returns:
            ``q_idx [s, b, Hi_local, Di]``, ``k_idx [s, b, Hik_local, Di]`` (``[t, H, Di]`` for
            THD), normed and rotated like the main q/k.

        Raises:
            ValueError: RoPE rotates more dims than the index head dim.
        """
        layout = self.layout
        x = hidden_states.detach()
        q_idx, _ = self.linear_q_idx(x)
        if layout.share > 1:
            q_idx = gather_last_dim(q_idx, self.tp_group)
            width = layout.index_head_dim
            q_idx = q_idx[..., layout.index_first * width:(layout.index_first + 1) * width]
        q_idx = q_idx.reshape(*q_idx.shape[:2], layout.index_count, layout.index_head_dim)
        if self.config.sequence_parallel:
            x = all_gather_first_dim(x, self.tp_group)
        k_idx = self.linear_k_idx(x)
        k_idx = k_idx.reshape(*k_idx.shape[:2], self.linear_k_idx.num_heads,
                              layout.index_head_dim)
        first = layout.key_first - self.linear_k_idx.first_head
        k_idx = k_idx[:, :, first:first + layout.key_count]
        if self.q_idx_norm is not None:
            q_idx = self.q_idx_norm(q_idx)
        if self.k_idx_norm is not None:
            k_idx = self.k_idx_norm(k_idx)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            q_idx, k_idx = q_idx.squeeze(1), k_idx.squeeze(1)
        if rotary_pos_emb is not None:
            cu_q, cu_k = rope_cu_seqlens(packed_seq_params)
            for freqs in rotary_pos_emb:
                if freqs is not None and freqs.shape[-1] > layout.index_head_dim:
                    raise ValueError(
                        f"RoPE rotates {freqs.shape[-1]} dims but the index head dim Di is "
                        f"{layout.index_head_dim}; use index_head_dim >= the rotary dim "
                        "(kv_channels * rotary_percent)"
                    )
            q_idx = apply_rope(q_idx, rotary_pos_emb[0], self.config, cu_q, self.cp_group)
            k_idx = apply_rope(k_idx, rotary_pos_emb[1], self.config, cu_k, self.cp_group)
        return q_idx, k_idx
