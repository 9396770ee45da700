"""Context parallelism (CP) for the MSA core attention (MSA_SPEC section 6).

Transformer Engine is not required: the MSA core does its own CP with the process group it is
given. Data flow on every CP rank (megatron-core's load-balanced layout, see
:mod:`msa_megatron.parallel.cp_layout`):

1. index keys ``k_idx`` are all-gathered (they are small) into the global THD order;
2. the rank selects blocks for its own queries only, with their global positions
   (``q_pos``) against the gathered keys (``q_kbase`` = global row of the sequence start);
   the selection is returned and reused for backward and recomputation, never recomputed;
3. K/V reach the rank by one of two exchanges (``kv_exchange``):

   - ``"allgather"``: K and V all-gathered; in backward dK/dV are reduce-scattered back.
   - ``"selective"``: per KV head, the rank sends every owner the global ids of the blocks its
     queries selected (union over the index heads of that KV group) that hold rows of that
     owner, receives only those rows of that KV head and places them in zero-filled
     global-length K/V buffers (so the unchanged backend kernels run on them: selective mode
     saves bandwidth, not memory). In backward the dK/dV of those entries go back to their
     owners, which add the contributions in ascending source-rank order (deterministic).

4. the backend's attention and KL cores run on the local queries; the KL is
   ``kl_scale * sum over this rank's queries`` with a global ``kl_scale = 1/(N*Hi_total)``,
   N = tokens of the whole sequence over all CP ranks, so summing the ranks' KL gives the KL of
   one device holding everything. Gradients of gathered index keys return to their owners.

Bytes (and fetched rows) are counted per rank in a :data:`STAT_KEYS` dict, fresh per call or
the caller's accumulator (``stats=``), as the payload this rank hands to / gets from other
ranks (copies of its own rows are not counted; wire-level algorithm overheads of the
collectives are not modelled). With ``R`` = CP-1 peers, ``T_l`` local tokens, ``e`` the element size:

- index keys (both modes): forward sent = recv = ``R * T_l * Hik * Di * e``; backward the same.
- allgather K/V: forward sent = recv = ``R * T_l * 2 * Hkv * D * e``; backward (dK/dV
  reduce-scatter) the same.
- selective K/V: one 4-byte id per (KV head, block) requested plus one 8-byte count per peer;
  forward recv = ``F * 2 * D * e`` where F (``kv_head_rows_fetched``) counts the (row, KV head)
  pairs of other ranks inside the blocks selected for that KV head (union over the local
  queries and the KV group's index heads); backward sends exactly those entries' dK/dV back.
  Never more K/V bytes than allgather (F <= ``R * T_l * Hkv``); more in total only when nearly
  every block is selected (the ids then cost 4 bytes per block and KV head extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ..config import CP_KV_EXCHANGES
from ..ops.backends import get_backend, resolve_backend
from ..ops.validation import (
    check_backend_limits,
    check_main_inputs,
    check_options,
    check_scale,
)
from .cp_layout import CPLayout, build_cp_layout
from .tensor import (
    all_gather_rows,
    kl_of_rows,
    real_token_rows,
    shared_index_msa_attention,
    token_slices,
)

BLOCK_ID_DTYPE = torch.int32
COUNT_DTYPE = torch.int64

# megatron-core TransformerConfig.cp_comm_type -> MSA K/V exchange (types that map).
CP_COMM_TYPE_TO_KV_EXCHANGE = {"all_gather": "allgather", "p2p": "selective"}

STAT_KEYS = (
    "index_k_fwd_bytes_sent", "index_k_fwd_bytes_recv",
    "index_k_bwd_bytes_sent", "index_k_bwd_bytes_recv",
    "kv_ids_bytes_sent", "kv_ids_bytes_recv",
    "kv_fwd_bytes_sent", "kv_fwd_bytes_recv",
    "kv_bwd_bytes_sent", "kv_bwd_bytes_recv",
    "kv_head_rows_fetched", "kv_head_rows_remote",
)


def new_cp_stats() -> Dict[str, int]:
    """A zeroed statistics dict with every key of :data:`STAT_KEYS` (bytes and row counts)."""
    return {key: 0 for key in STAT_KEYS}


def cp_bytes_moved(stats: Dict[str, int]) -> int:
    """Total bytes this rank received over CP in one layer's forward and backward."""
    return sum(value for key, value in stats.items() if key.endswith("_bytes_recv"))


def cp_bytes_received(stats: Dict[str, int]) -> Tuple[int, int]:
    """``(forward, backward)`` bytes this rank received over CP (the block-id exchange of
    ``selective`` mode counts as forward); they add up to :func:`cp_bytes_moved`."""
    backward = sum(value for key, value in stats.items() if key.endswith("_bwd_bytes_recv"))
    return cp_bytes_moved(stats) - backward, backward


def resolve_cp_kv_exchange(
    cp_kv_exchange: Optional[str], cp_comm_type: Optional[Union[str, List[str]]] = None,
    layer_number: int = 1,
) -> str:
    """The K/V exchange of one layer.

    An explicit ``cp_kv_exchange`` wins. Otherwise megatron-core's ``cp_comm_type`` (a string,
    or a per-layer list indexed by the 1-based ``layer_number``) maps ``"all_gather"`` to
    ``"allgather"`` and ``"p2p"`` to ``"selective"``; other types (``"a2a"``, ``"a2a+p2p"``:
    head-scattering schemes that MSA does not implement) and ``None`` give ``"allgather"``.

    Raises:
        ValueError: ``cp_kv_exchange`` not in ``("allgather", "selective")``.
    """
    if cp_kv_exchange is not None:
        if cp_kv_exchange not in CP_KV_EXCHANGES:
            raise ValueError(
                f"cp_kv_exchange must be one of {CP_KV_EXCHANGES} or None, got {cp_kv_exchange!r}"
            )
        return cp_kv_exchange
    if isinstance(cp_comm_type, (list, tuple)):
        cp_comm_type = cp_comm_type[layer_number - 1]
    return CP_COMM_TYPE_TO_KV_EXCHANGE.get(cp_comm_type, "allgather")


def _row_bytes(x: torch.Tensor) -> int:
    return x[0].numel() * x.element_size() if x.shape[0] else 0


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, inp, group=group)


class _GatherRows(torch.autograd.Function):
    """All-gather local rows into the global THD order; backward reduce-scatters to owners."""

    @staticmethod
    def forward(ctx, layout: CPLayout, group, stats: Dict[str, int], prefix: str,
                *xs: torch.Tensor):
        ctx.layout, ctx.group, ctx.stats, ctx.prefix = layout, group, stats, prefix
        peers = layout.cp_size - 1
        outs = []
        for x in xs:
            gathered = x.new_empty((layout.cp_size * x.shape[0],) + tuple(x.shape[1:]))
            _all_gather(gathered, x.contiguous(), group)
            outs.append(gathered.index_select(0, layout.gathered_to_global))
            stats[f"{prefix}_fwd_bytes_sent"] += peers * x.shape[0] * _row_bytes(x)
            stats[f"{prefix}_fwd_bytes_recv"] += peers * x.shape[0] * _row_bytes(x)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        layout, stats, prefix = ctx.layout, ctx.stats, ctx.prefix
        peers = layout.cp_size - 1
        order = layout.rank_rows.reshape(-1)
        local_grads = []
        for g in grads:
            rank_major = g.index_select(0, order).contiguous()
            local = g.new_empty((layout.total_local,) + tuple(g.shape[1:]))
            _reduce_scatter(local, rank_major, ctx.group)
            local_grads.append(local)
            stats[f"{prefix}_bwd_bytes_sent"] += peers * layout.total_local * _row_bytes(g)
            stats[f"{prefix}_bwd_bytes_recv"] += peers * layout.total_local * _row_bytes(g)
        return (None, None, None, None) + tuple(local_grads)


@dataclass
class SelectivePlan:
    """Who sends which K/V rows of which KV head to whom in ``selective`` mode.

    Entries are flat indices ``row * Hkv + g`` (row ``row``, KV head ``g``) into ``[rows * Hkv]``
    views of K and V; per peer they are ordered by KV head, then row (ascending).

    Attributes:
        send_local: per peer rank ``j``, flat indices into this rank's local K/V that ``j``
            asked for (empty for ``j`` = this rank).
        recv_global: per peer rank ``j``, flat indices into the global K/V buffers of the
            entries received from ``j``.
        send_counts, recv_counts: their lengths, per rank.
    """

    send_local: List[torch.Tensor]
    recv_global: List[torch.Tensor]
    send_counts: List[int]
    recv_counts: List[int]


def needed_blocks(layout: CPLayout, block_idx: Optional[torch.Tensor], num_kv_heads: int
                  ) -> torch.Tensor:
    """``[Hkv, num_blocks]`` bool: global blocks some local query reads, per KV head (the union
    over the index heads of that KV group).

    ``block_idx=None`` is dense mode: every block up to the own block of a local query.
    """
    device = layout.row_block.device
    need = torch.zeros(num_kv_heads, layout.num_blocks, dtype=torch.bool, device=device)
    if layout.total_local == 0 or layout.num_blocks == 0:
        return need
    first = layout.block_first_id[layout.q_seq]  # [T_local]
    if block_idx is None:
        own = first + layout.q_pos.to(torch.int64) // layout.block_size
        last = torch.full((layout.block_first_id.numel(),), -1, dtype=torch.int64, device=device)
        last = last.scatter_reduce(0, layout.q_seq, own, reduce="amax")
        causal = torch.arange(layout.num_blocks, device=device) <= last[layout.block_seq]
        return causal.unsqueeze(0).expand(num_kv_heads, -1).clone()
    hi = block_idx.shape[1]
    blocks = block_idx.to(torch.int64)
    group = torch.arange(hi, device=device) // (hi // num_kv_heads)  # KV head of index head
    flat = group[None, :, None] * layout.num_blocks + first[:, None, None] + blocks
    need.view(-1)[flat[blocks >= 0]] = True
    return need


def build_selective_plan(
    layout: CPLayout, need: torch.Tensor, group, stats: Dict[str, int]
) -> SelectivePlan:
    """Exchange requested block ids with every owner and derive the K/V entries to move.

    Each rank sends owner ``j`` the ids ``g * num_blocks + block`` (ascending) of the blocks
    needed for KV head ``g`` that hold rows of ``j`` (a block cut by a chunk boundary is asked of
    both owners; each sends its rows). Both sides derive the same ordered entry lists from the
    ids and the layout.
    """
    me, cp = layout.cp_rank, layout.cp_size
    num_kv_heads, num_blocks = need.shape
    device = need.device
    recv, request = [], []
    for j in range(cp):
        rows_j = layout.rank_rows[j][:0] if j == me else layout.rank_rows[j]
        mask = need[:, layout.row_block[rows_j]]  # [Hkv, rows of j]
        head, col = torch.nonzero(mask, as_tuple=True)  # head-major, rows ascending
        rows = rows_j[col]
        recv.append(rows * num_kv_heads + head)
        request.append(torch.unique_consecutive(head * num_blocks + layout.row_block[rows]))
    req_counts = torch.tensor([r.numel() for r in request], dtype=COUNT_DTYPE, device=device)
    their_counts = torch.empty_like(req_counts)
    dist.all_to_all_single(their_counts, req_counts, group=group)
    their_counts_host = their_counts.tolist()
    ids_out = torch.cat(request).to(BLOCK_ID_DTYPE)
    ids_in = torch.empty(sum(their_counts_host), dtype=BLOCK_ID_DTYPE, device=device)
    dist.all_to_all_single(ids_in, ids_out, their_counts_host, req_counts.tolist(), group=group)
    id_bytes = torch.empty((), dtype=BLOCK_ID_DTYPE).element_size()
    count_bytes = torch.empty((), dtype=COUNT_DTYPE).element_size()
    stats["kv_ids_bytes_sent"] += ids_out.numel() * id_bytes + (cp - 1) * count_bytes
    stats["kv_ids_bytes_recv"] += ids_in.numel() * id_bytes + (cp - 1) * count_bytes

    my_blocks = layout.row_block[layout.local_rows]  # ascending: local order = global order
    send = []
    for ids in ids_in.to(torch.int64).split(their_counts_host):
        wanted = torch.zeros(num_kv_heads * num_blocks, dtype=torch.bool, device=device)
        wanted[ids] = True
        wanted = wanted.view(num_kv_heads, num_blocks)[:, my_blocks]  # [Hkv, T_local]
        head, local = torch.nonzero(wanted, as_tuple=True)
        send.append(local * num_kv_heads + head)
    return SelectivePlan(send_local=send, recv_global=recv,
                         send_counts=[r.numel() for r in send],
                         recv_counts=[r.numel() for r in recv])


class _SelectiveKV(torch.autograd.Function):
    """Fetch only the planned K/V entries into global-length buffers; backward returns dK/dV."""

    @staticmethod
    def forward(ctx, layout: CPLayout, plan: SelectivePlan, group, stats: Dict[str, int],
                k: torch.Tensor, v: torch.Tensor):
        ctx.layout, ctx.plan, ctx.group, ctx.stats = layout, plan, group, stats
        d = k.shape[2]
        send_index = torch.cat(plan.send_local)
        recv_index = torch.cat(plan.recv_global)
        payload = torch.stack([k.reshape(-1, d), v.reshape(-1, d)], dim=1).index_select(
            0, send_index)  # [entries, 2, D]
        received = payload.new_empty((recv_index.numel(), 2, d))
        dist.all_to_all_single(received, payload.contiguous(), plan.recv_counts,
                               plan.send_counts, group=group)
        ctx.recv_index = recv_index
        shape = (layout.total_global,) + tuple(k.shape[1:])
        k_buf, v_buf = k.new_zeros(shape), v.new_zeros(shape)
        for buf, local, part in ((k_buf, k, 0), (v_buf, v, 1)):
            buf.index_copy_(0, layout.local_rows, local)
            buf.view(-1, d).index_copy_(0, recv_index, received[:, part])
        stats["kv_fwd_bytes_sent"] += payload.numel() * payload.element_size()
        stats["kv_fwd_bytes_recv"] += received.numel() * received.element_size()
        stats["kv_head_rows_fetched"] += recv_index.numel()
        return k_buf, v_buf

    @staticmethod
    def backward(ctx, grad_k: torch.Tensor, grad_v: torch.Tensor):
        layout, plan = ctx.layout, ctx.plan
        d = grad_k.shape[2]
        back = torch.stack([grad_k.reshape(-1, d).index_select(0, ctx.recv_index),
                            grad_v.reshape(-1, d).index_select(0, ctx.recv_index)], dim=1)
        returned = back.new_empty((sum(plan.send_counts), 2, d))
        dist.all_to_all_single(returned, back.contiguous(), plan.send_counts, plan.recv_counts,
                               group=ctx.group)
        acc = torch.float32 if grad_k.dtype in (torch.float16, torch.bfloat16) else grad_k.dtype
        dk = grad_k.index_select(0, layout.local_rows).to(acc)
        dv = grad_v.index_select(0, layout.local_rows).to(acc)
        dk_flat, dv_flat = dk.view(-1, d), dv.view(-1, d)
        # Owners add the peers' contributions in ascending source-rank order: deterministic
        # (entries are unique within one peer's contribution).
        for index, part in zip(plan.send_local, returned.split(plan.send_counts)):
            dk_flat.index_add_(0, index, part[:, 0].to(acc))
            dv_flat.index_add_(0, index, part[:, 1].to(acc))
        ctx.stats["kv_bwd_bytes_sent"] += back.numel() * back.element_size()
        ctx.stats["kv_bwd_bytes_recv"] += returned.numel() * returned.element_size()
        return None, None, None, None, dk.to(grad_k.dtype), dv.to(grad_v.dtype)


def _check_block_idx(block_idx: torch.Tensor, t_local: int, hi: int, top_k: int) -> None:
    if not isinstance(block_idx, torch.Tensor) or block_idx.dtype != torch.int32:
        raise TypeError("block_idx must be an int32 torch.Tensor [T_local, Hi_local, top_k]")
    if tuple(block_idx.shape) != (t_local, hi, top_k):
        raise ValueError(
            f"block_idx has shape {list(block_idx.shape)}, expected [T_local, Hi_local, top_k] = "
            f"{[t_local, hi, top_k]}"
        )


def context_parallel_msa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    *,
    cu_seqlens_global: torch.Tensor,
    cp_group,
    kv_exchange: str,
    block_size: int,
    top_k: int,
    init_blocks: int,
    local_blocks: int,
    softmax_scale: Optional[float],
    index_scale: Optional[float],
    mode: str,
    backend: Optional[str],
    kl_scale: float,
    block_idx: Optional[torch.Tensor] = None,
    tp_share_group=None,
    cu_seqlens_global_unpadded: Optional[torch.Tensor] = None,
    stats: Optional[Dict[str, int]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Dict[str, int]]:
    """MSA core attention of this CP rank's queries (MSA_SPEC sections 2-4 and 6).

    Args:
        q: ``[T_local, Hq_local, D]`` main queries (RoPE applied), this rank's tokens in
            megatron-core's CP order (per packed sequence: chunks ``r`` and ``2*CP-1-r``).
        k, v: ``[T_local, Hkv_local, D]``; q_idx: ``[T_local, Hi_local, Di]``;
            k_idx: ``[T_local, Hik, Di]``. One dtype and device for all five.
        cu_seqlens_global: ``[n+1]`` int32 boundaries of the full, un-split packed sequences
            (megatron's padded boundaries: ``cu_seqlens_q_padded`` when set, else
            ``cu_seqlens_q``), every length divisible by ``2*CP``; zero-length sequences
            allowed. SBHD: ``b`` sequences of the global length, see
            :func:`msa_megatron.parallel.cp_layout.sbhd_cu_seqlens`.
        cp_group: the CP process group.
        kv_exchange: ``"allgather"`` or ``"selective"`` (module docstring).
        block_size, top_k, init_blocks, local_blocks, softmax_scale, index_scale, mode,
            backend: as in :func:`msa_megatron.msa_attention`.
        kl_scale: ``1 / (N * Hi_total)``, N = tokens of the whole micro-batch over all CP ranks.
        block_idx: ``[T_local, Hi_local, top_k]`` int32 selection of an earlier call (reused,
            e.g. by activation recomputation); None selects.
        tp_share_group: the TP ranks sharing this rank's single index head (TP > Hkv, see
            :func:`msa_megatron.parallel.tensor.share_group`) or None. The ranks split the
            selection of their local queries and exchange it, then the KL teacher is exact
            (:func:`msa_megatron.parallel.tensor.shared_index_msa_attention`, run on the CP
            buffers).
        cu_seqlens_global_unpadded: ``[n+1]`` int32 boundaries of the real sequences when
            ``cu_seqlens_global`` holds padded ones (megatron's ``cu_seqlens_q`` next to
            ``cu_seqlens_q_padded``), or None (no padding). Positions at or past a sequence's
            real length are padding: their outputs are computed (finite; causal, so real
            tokens never read them) but they add nothing to the KL. ``kl_scale`` should then
            count real tokens only. Works with ``tp_share_group`` too.
        stats: a :data:`STAT_KEYS` dict to add this call's counters to (e.g. a layer's
            per-step accumulator), or None for a fresh one.

    Returns:
        ``(out, kl, block_idx, stats)``: ``out [T_local, Hq_local, D]`` in q.dtype,
        differentiable in q, k, v (dK/dV reach the owner ranks); ``kl`` 0-dim fp32 =
        ``kl_scale * sum`` of this rank's queries' KL, differentiable in q_idx and k_idx (the
        gradients of gathered index keys reach their owners); ``block_idx`` ``[T_local,
        Hi_local, top_k]`` int32 block numbers relative to the sequence start (None in dense
        mode); ``stats`` the :data:`STAT_KEYS` counters (the ``stats`` argument when given, with
        this call's counts added; backward entries are added when backward runs).

    Raises:
        TypeError / ValueError: bad inputs (MSA_SPEC section 7) or CP boundaries.
    """
    check_options(block_size, top_k, init_blocks, local_blocks, backend, mode)
    check_scale("softmax_scale", softmax_scale)
    check_scale("index_scale", index_scale)
    t_local, _, _, D, hi, _, di = check_main_inputs(q, k, v, q_idx, k_idx)
    if kv_exchange not in CP_KV_EXCHANGES:
        raise ValueError(f"kv_exchange must be one of {CP_KV_EXCHANGES}, got {kv_exchange!r}")
    name = resolve_backend(backend, q.device)
    check_backend_limits(name, q.dtype, {"D": D, "Di": di}, block_size)
    if isinstance(cu_seqlens_global, torch.Tensor) and cu_seqlens_global.device != q.device:
        raise ValueError(
            f"cu_seqlens_global is on {cu_seqlens_global.device} but the inputs are on {q.device}"
        )
    if mode == "dense":
        block_idx = None
    elif block_idx is not None:
        _check_block_idx(block_idx, t_local, hi, top_k)
    layout = build_cp_layout(cu_seqlens_global, dist.get_world_size(cp_group),
                             dist.get_rank(cp_group), block_size, q.device, total_local=t_local)
    if stats is None:
        stats = new_cp_stats()
    impl = get_backend(name)

    shared = tp_share_group is not None and dist.get_world_size(tp_share_group) > 1
    if shared and hi != 1:
        raise ValueError(
            f"with a tp_share_group the rank holds exactly one index head, got q_idx with Hi={hi}"
        )
    kl_rows = real_token_rows(cu_seqlens_global, cu_seqlens_global_unpadded, layout.q_pos,
                              layout.q_kbase)
    select = dict(block_size=block_size, top_k=top_k, init_blocks=init_blocks,
                  local_blocks=local_blocks, index_scale=index_scale)

    (k_idx_global,) = _GatherRows.apply(layout, cp_group, stats, "index_k", k_idx)
    if mode == "sparse" and block_idx is None:
        if shared:
            block_idx = _shared_selection(impl, q_idx, k_idx_global, layout, tp_share_group,
                                          select)
        else:
            block_idx = impl.select(q_idx.detach(), k_idx_global.detach(), layout.q_pos,
                                    layout.q_kbase, **select)
    remote_rows = (layout.cp_size - 1) * t_local * k.shape[1]
    stats["kv_head_rows_remote"] += remote_rows
    if kv_exchange == "allgather":
        k_global, v_global = _GatherRows.apply(layout, cp_group, stats, "kv", k, v)
        stats["kv_head_rows_fetched"] += remote_rows
    else:
        plan = build_selective_plan(layout, needed_blocks(layout, block_idx, k.shape[1]),
                                    cp_group, stats)
        k_global, v_global = _SelectiveKV.apply(layout, plan, cp_group, stats, k, v)

    if shared:
        # Attention of this rank's heads; the KL of its token slice with the exact teacher
        # (the share group's heads exchanged head <-> token), as without CP.
        out, kl, _, _ = shared_index_msa_attention(
            q, k_global, v_global, q_idx, k_idx_global, layout.q_pos, layout.q_kbase,
            share_group=tp_share_group, backend=name, softmax_scale=softmax_scale, mode=mode,
            kl_scale=kl_scale, block_idx=block_idx, kl_rows=kl_rows, **select)
        return out, kl, block_idx, stats
    out, lse = impl.attention(q, k_global, v_global, block_idx, layout.q_pos, layout.q_kbase,
                              block_size=block_size, softmax_scale=softmax_scale,
                              index_heads=hi)
    # Padding queries (kl_rows) add nothing to the KL.
    kl = kl_of_rows(impl, kl_rows, q.detach(), k_global.detach(), lse.detach(), q_idx,
                    k_idx_global, block_idx, layout.q_pos, layout.q_kbase, block_size=block_size,
                    softmax_scale=softmax_scale, index_scale=index_scale, kl_scale=kl_scale)
    return out, kl, block_idx, stats


def _shared_selection(impl, q_idx: torch.Tensor, k_idx_global: torch.Tensor, layout: CPLayout,
                      share_group, select: dict) -> torch.Tensor:
    """Selection of an index head shared by the TP ranks of ``share_group``: each selects a
    slice of the local queries against the gathered index keys; the slices are all-gathered."""
    slices = token_slices(layout.total_local, dist.get_world_size(share_group))
    start, end = slices[dist.get_rank(share_group)]
    with torch.no_grad():
        own = impl.select(q_idx[start:end].detach(), k_idx_global.detach(),
                          layout.q_pos[start:end], layout.q_kbase[start:end], **select)
        return all_gather_rows(own, slices, share_group)
