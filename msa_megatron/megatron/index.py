"""The MSA index branch of a megatron-core layer: index projections, their norms and RoPE.

:class:`MSAIndexBranch` computes ``q_idx`` / ``k_idx`` from the attention input with gradient
stopped (MSA_SPEC section 4) and hands them to the caller, which passes them to the core
attention explicitly (:meth:`msa_megatron.megatron.attention.MSASelfAttention.forward`).

- ``linear_q_idx`` (hidden -> Hi*Di): column-parallel, split over TP with the query heads its
  index heads serve (gathered and sliced when TP > Hi,
  :func:`~msa_megatron.parallel.comm.gather_last_dim`).
- ``linear_k_idx`` (hidden -> Hik*Di, :class:`IndexKeyLinear`): split over TP by index key head
  when ``Hik % TP == 0``; otherwise (e.g. the default Hik = 1) replicated on every TP rank.
  Its gradient, like the index norms', is this rank's partial one; it is summed over TP once
  per step where megatron-core reduces TP-replicated parameters (``finalize_model_grads``, see
  :func:`mark_tp_partial_grad`), or by :func:`reduce_index_grads_over_tp` in a training loop of
  one's own.
- The index q/k get the transforms of the main q/k: the ``q_layernorm`` class of the spec (own
  weights, when ``qk_layernorm``) and the layer's RoPE (:func:`apply_rope`).
"""

from __future__ import annotations

import copy
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
)
from ..parallel.tensor import index_head_layout
from .sequence_parallel import local_projection


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


TP_PARTIAL_GRAD_ATTR = "msa_tp_partial_grad"
"""Marks a TP-replicated parameter whose per-rank gradient is a partial one (summed over TP)."""


def mark_tp_partial_grad(param: torch.nn.Parameter, tp_group: Optional[dist.ProcessGroup]) -> None:
    """Let megatron-core's ``finalize_model_grads`` sum ``param``'s gradient over TP, once per step.

    ``param`` is replicated over the TP group and each rank computes a partial gradient (its own
    index heads' KL). megatron-core 0.16-0.19 all-reduce, after the last micro-batch, the
    gradients of parameters marked ``average_gradients_across_tp_domain`` with ``AVG`` (one
    coalesced all-reduce for all of them, ``_allreduce_non_tensor_model_parallel_grads``).
    The mark is set here, and a local tensor hook multiplies each micro-batch's gradient by the
    TP size (no communication), so that the average is the sum. ``sequence_parallel`` is set
    False so the parameter is not also summed as a sequence-parallel one.

    Raises:
        TypeError: ``param`` is not a tensor.
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"param must be a torch.Tensor, got {type(param).__name__}")
    param.sequence_parallel = False
    size = group_size(tp_group)
    if size == 1:
        return
    param.average_gradients_across_tp_domain = True
    setattr(param, TP_PARTIAL_GRAD_ATTR, True)
    param.register_hook(lambda grad: grad * size)


def reduce_index_grads_over_tp(model, tp_group: Optional[dist.ProcessGroup]) -> int:
    """Sum the partial gradients of TP-replicated index parameters over TP, once per step.

    For training loops without megatron-core's ``finalize_model_grads`` (which does this for
    every parameter marked by :func:`mark_tp_partial_grad`): call after the last backward of the
    step. One all-reduce (``AVG`` of the TP-scaled gradients, i.e. the sum of the partial ones)
    over the coalesced gradients; ``main_grad`` is used where a parameter has one.

    Args:
        model: a module or a list of model chunks.
        tp_group: the tensor-parallel group.

    Returns:
        The number of gradients reduced.
    """
    if group_size(tp_group) == 1:
        return 0
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    grads = []
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, TP_PARTIAL_GRAD_ATTR, False):
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                if grad is not None:
                    grads.append(grad)
    if grads:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=tp_group)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return len(grads)


class IndexKeyLinear(torch.nn.Module):
    """The index key projection ``k_idx = x W^T`` (no bias), hidden -> Hik*Di (MSA_SPEC
    section 6).

    ``Hik % TP == 0``: split over TP by key head, rank ``r`` holding key heads
    ``[r*Hik/TP, (r+1)*Hik/TP)`` (those its index heads read: index head ``i`` reads key head
    ``i // (Hi/Hik)``), a TP-sharded parameter (partition dim 0) with per-rank gradients.
    Otherwise replicated on every TP rank; each rank's gradient of ``W`` is partial and summed
    over TP once per step by megatron-core's ``finalize_model_grads``
    (:func:`mark_tp_partial_grad`). Initialised as the full ``[Hik*Di, hidden]`` matrix on every
    rank, then sliced: the weights are the same for every TP size. Checkpointed as one global tensor in both layouts
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
            mark_tp_partial_grad(self.weight, tp_group)

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


# Userbuffer names Transformer Engine overlaps; megatron-core's TELinear turns
# ``config.tp_comm_overlap`` off, on the config it was given, for any other name.
TE_OVERLAP_BUFFER_NAMES = ("qkv", "proj", "fc1", "fc2")


def index_projection_comm(config: TransformerConfig) -> Tuple[TransformerConfig, Optional[str]]:
    """The config and ``tp_comm_buffer_name`` to build the index query projection with.

    megatron-core 0.16-0.19's ``TELinear.__init__`` sets ``config.tp_comm_overlap = False``
    (on the config object, shared by every layer built after it) when TP communication overlap
    is on and the buffer name is not one of :data:`TE_OVERLAP_BUFFER_NAMES`; with overlap on and
    no name, Transformer Engine asserts. The index projection has no communication to overlap
    (its input is the layer's gathered hidden states, :meth:`MSASelfAttention.forward
    <msa_megatron.megatron.attention.MSASelfAttention.forward>`, and no input gradient), so with
    overlap on it gets a private copy of the config with overlap off, and no buffer name; the
    shared config keeps overlap on for the layers' own projections.

    Args:
        config: the layer's TransformerConfig (not modified).

    Returns:
        ``(config_for_the_projection, buffer_name)``: ``(config, None)`` without overlap, else
        ``(copy with tp_comm_overlap=False, None)``.
    """
    if not getattr(config, "tp_comm_overlap", False):
        return config, None
    private = copy.copy(config)
    private.tp_comm_overlap = False
    return private, None


def te_disables_overlap(config: TransformerConfig, tp_comm_buffer_name: Optional[str]) -> bool:
    """Whether megatron-core's ``TELinear`` would turn ``config.tp_comm_overlap`` off when built
    with this buffer name (its rule, 0.16-0.19; for checks without Transformer Engine)."""
    return bool(getattr(config, "tp_comm_overlap", False) and tp_comm_buffer_name
                and tp_comm_buffer_name not in TE_OVERLAP_BUFFER_NAMES)


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


def thd_rope_positions(cu_seqlens: torch.Tensor, local_tokens: int, cp_size: int, cp_rank: int,
                       packed_freqs: bool) -> torch.Tensor:
    """Row of the RoPE table each local THD token reads, as megatron-core's unfused THD RoPE
    picks it (``_get_thd_freqs_on_this_cp_rank``), built with tensor ops on ``cu_seqlens``'s
    device: no host synchronisation and no loop over the sequences.

    Under CP every sequence's local part is its chunks ``cp_rank`` and ``2 cp_size - 1 -
    cp_rank`` of ``2 cp_size`` equal chunks (megatron-core's load-balanced THD layout).

    Args:
        cu_seqlens: [B + 1] int32/int64, boundaries of the *global* sequences (padded ones when
            megatron-core would pick those).
        local_tokens: this rank's THD rows, ``cu_seqlens[-1] / cp_size``.
        cp_size, cp_rank: the CP group's size and this rank's place in it.
        packed_freqs: the table holds one row per packed position (``freqs.size(0) ==
            cu_seqlens[-1]``): positions are offset by each sequence's start, as megatron-core does.

    Returns:
        [local_tokens] int64 row indices.
    """
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.int64)
    local_lens = (cu[1:] - cu[:-1]) // cp_size
    seq = torch.repeat_interleave(torch.arange(local_lens.numel(), device=device), local_lens,
                                  output_size=local_tokens)
    local_start = torch.cumsum(local_lens, 0) - local_lens
    j = torch.arange(local_tokens, device=device) - local_start[seq]
    if cp_size > 1:
        seg = (local_lens // 2)[seq]
        full = local_lens[seq] * cp_size
        pos = torch.where(j < seg, cp_rank * seg + j, full - (cp_rank + 1) * seg + (j - seg))
    else:
        pos = j
    if packed_freqs:
        pos = pos + cu[:-1][seq]
    return pos


def apply_rope(t: torch.Tensor, freqs: Optional[torch.Tensor], config: TransformerConfig,
               cu_seqlens: Optional[torch.Tensor], cp_group,
               cache: Optional[dict] = None) -> torch.Tensor:
    """megatron-core's RoPE (``apply_rotary_pos_emb`` with the layer's YaRN mscale), as its
    attention applies it to q and k; identity when ``freqs`` is None.

    THD without RoPE fusion: megatron-core's unfused THD path walks the packed sequences one by
    one in Python (one ``.item()`` / slice / rotation per sequence), which made a window of
    thousands of short documents host-bound (8K tokens/s on an H200, issue 19). Here the
    table rows are gathered for all tokens at once (:func:`thd_rope_positions`) and
    megatron-core's rotation is applied once, as to one ``[T, 1, h, d]`` sequence: the same
    values bitwise (``tests/megatron/test_rope_thd.py``). With ``apply_rope_fusion`` (Transformer
    Engine) megatron-core's fused THD kernel is used as is.

    Args:
        t: ``[t, h, d]`` (THD, ``cu_seqlens`` given) or ``[s, b, h, d]``.
        freqs: megatron-core's table ``[rows, 1, 1, rot]`` or None.
        config: the layer's TransformerConfig (YaRN mscale, interleaving, fusion).
        cu_seqlens: ``[B + 1]`` global boundaries (THD) or None (SBHD).
        cp_group: the CP group (None: megatron-core's global one).
        cache: a dict shared by the calls of one layer forward (q, k, q_idx, k_idx; a new
            dict per forward): the THD layout is checked (two host syncs) and the position
            rows built once per ``cu_seqlens``, the table rows gathered once per ``(freqs,
            cu_seqlens)``; tensors are matched by identity. None: nothing is kept.

    Raises:
        ValueError: THD under CP with a sequence length not divisible by ``2 * CP``, or ``t``'s
            rows are not ``cu_seqlens[-1] / CP``.
    """
    if freqs is None:
        return t
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )

    mscale = _yarn_get_concentration_factor_from_config(config)
    if cu_seqlens is not None and (t.is_meta or cu_seqlens.is_meta):
        return torch.empty_like(t)  # shape inference: RoPE keeps shape and dtype (no values)
    if cu_seqlens is None or config.apply_rope_fusion:
        return apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu_seqlens,
                                    mscale=mscale, cp_group=cp_group)
    if cp_group is None:  # as megatron-core's apply_rotary_pos_emb resolves it
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    table = _thd_rope_table(freqs, cu_seqlens, t.size(0), cp_group,
                            {} if cache is None else cache)
    return apply_rotary_pos_emb(t.unsqueeze(1), table, config=config, cu_seqlens=None,
                                mscale=mscale, cp_group=cp_group).squeeze(1)


def _thd_rope_table(freqs: torch.Tensor, cu_seqlens: torch.Tensor, local_tokens: int, cp_group,
                    cache: dict) -> torch.Tensor:
    """``freqs``' rows for this rank's THD tokens (:func:`apply_rope`), from ``cache`` when
    the same ``freqs`` and ``cu_seqlens`` were seen (identity), else built and kept there."""
    key = ("table", id(freqs), id(cu_seqlens), local_tokens)
    hit = cache.get(key)
    if hit is not None and hit[0] is freqs and hit[1] is cu_seqlens:
        return hit[2]
    layout_key = ("layout", id(cu_seqlens), local_tokens)
    layout = cache.get(layout_key)
    cp_size = cp_group.size()
    if layout is None or layout[0] is not cu_seqlens:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if cp_size > 1 and bool((lengths % (2 * cp_size) != 0).any()):
            raise ValueError(f"THD RoPE under CP {cp_size}: every sequence length must be "
                             f"divisible by 2 * CP = {2 * cp_size} (megatron-core's "
                             f"load-balanced layout); cu_seqlens {cu_seqlens.tolist()}")
        total = int(cu_seqlens[-1])
        if local_tokens * cp_size != total:
            raise ValueError(f"THD RoPE: t has {local_tokens} rows on this rank but "
                             f"cu_seqlens[-1] / CP = {total} / {cp_size}")
        layout = (cu_seqlens, total, {})  # rows per packed-table flag
        cache[layout_key] = layout
    _, total, rows_by_packing = layout
    packed = freqs.dim() >= 1 and freqs.size(0) == total
    rows = rows_by_packing.get(packed)
    if rows is None:
        rows = thd_rope_positions(cu_seqlens, local_tokens, cp_size, cp_group.rank(), packed)
        rows_by_packing[packed] = rows
    table = freqs[rows]
    cache[key] = (freqs, cu_seqlens, table)
    return table


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
        q_idx_config, buffer_name = index_projection_comm(config)
        self.linear_q_idx = build_module(
            linear_q_idx, config.hidden_size, layout.num_index_heads * layout.index_head_dim,
            config=q_idx_config, init_method=config.init_method, gather_output=False, bias=False,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name=buffer_name,
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
            mark_tp_partial_grad(param, self.tp_group)
        return norm

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb, packed_seq_params,
                gathered: bool = False,
                rope_cache: Optional[dict] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Index q/k from the attention input with gradient stopped (MSA_SPEC section 4).

        Args:
            hidden_states: ``[s, b, hidden]`` (``[s/TP, b, hidden]`` with sequence parallelism
                unless ``gathered``).
            gathered: the caller passes the sequence-parallel input already all-gathered
                (:mod:`.sequence_parallel`); otherwise it is gathered here, once for both
                projections.
            rotary_pos_emb: the layer's RoPE frequencies as a ``(q, k)`` pair, or None.
            packed_seq_params: THD boundaries or None.
            rope_cache: the layer forward's RoPE cache (:func:`apply_rope` ``cache``), shared
                with the main q/k; None: none.

        Returns:
            ``q_idx [s, b, Hi_local, Di]``, ``k_idx [s, b, Hik_local, Di]`` (``[t, H, Di]`` for
            THD), normed and rotated like the main q/k.

        Raises:
            ValueError: RoPE rotates more dims than the index head dim.
        """
        layout = self.layout
        x = hidden_states.detach()
        if self.config.sequence_parallel and group_size(self.tp_group) > 1 and not gathered:
            x = all_gather_first_dim(x, self.tp_group)
            gathered = True
        if gathered:
            with local_projection(self.linear_q_idx):
                q_idx, _ = self.linear_q_idx(x)
        else:
            q_idx, _ = self.linear_q_idx(x)
        if layout.share > 1:
            q_idx = gather_last_dim(q_idx, self.tp_group)
            width = layout.index_head_dim
            q_idx = q_idx[..., layout.index_first * width:(layout.index_first + 1) * width]
        q_idx = q_idx.reshape(*q_idx.shape[:2], layout.index_count, layout.index_head_dim)
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
            q_idx = apply_rope(q_idx, rotary_pos_emb[0], self.config, cu_q, self.cp_group,
                               rope_cache)
            k_idx = apply_rope(k_idx, rotary_pos_emb[1], self.config, cu_k, self.cp_group,
                               rope_cache)
        return q_idx, k_idx
