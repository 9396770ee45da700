"""Context parallelism (CP) exchanges of the MSA layer (MSA_SPEC section 6): tensors move, no
kernel runs here.

Transformer Engine is not required: the MSA layer does its own CP with the process group it is
given. The composer (:func:`msa_megatron.core.msa_layer`) runs, on every CP rank
(megatron-core's load-balanced layout, see :mod:`msa_megatron.parallel.cp_layout`):

1. index keys ``k_idx`` are all-gathered (they are small) into the global THD order
   (:func:`gather_rows`);
2. the rank selects blocks for its own queries only, with their global positions
   (``q_pos``) against the gathered keys (``q_kbase`` = global row of the sequence start);
   the selection is returned and reused for backward and recomputation, never recomputed;
3. K/V reach the rank by one of two exchanges (``kv_exchange``, :func:`exchange_kv`):

   - ``"allgather"``: K and V all-gathered; in backward dK/dV are reduce-scattered back.
   - ``"selective"``: per KV head, the rank sends every owner the global ids of the blocks its
     queries selected (union over the index heads of that KV group) that hold rows of that
     owner, receives only those rows of that KV head and places them in zero-filled
     global-length K/V buffers (so the unchanged backend kernels run on them: selective mode
     saves bandwidth, not memory). In backward the dK/dV of those entries go back to their
     owners, which add the contributions in ascending source-rank order (deterministic).

4. the backend's attention and KL cores run on the local queries (in the composer); the KL is
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
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import CP_KV_EXCHANGES, DEFAULT_CP_KV_EXCHANGE
from .comm import start_all_gather_flat, start_reduce_scatter_flat
from .cp_layout import CPLayout

BLOCK_ID_DTYPE = torch.int32
COUNT_DTYPE = torch.int64

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


def resolve_cp_kv_exchange(cp_kv_exchange: Optional[str]) -> str:
    """The K/V exchange of a layer: ``cp_kv_exchange``, or :data:`DEFAULT_CP_KV_EXCHANGE`
    (``"allgather"``) when None.

    megatron-core's ``cp_comm_type`` is not read: its default (``"p2p"``) used to select
    ``"selective"``, which moved 22% fewer bytes but was 2-5% slower than ``"allgather"`` on
    4 H200s (docs/DESIGN.md, context parallelism); ``"selective"`` is chosen explicitly.

    Raises:
        ValueError: ``cp_kv_exchange`` not in ``("allgather", "selective")`` and not None.
    """
    if cp_kv_exchange is None:
        return DEFAULT_CP_KV_EXCHANGE
    if cp_kv_exchange not in CP_KV_EXCHANGES:
        raise ValueError(
            f"cp_kv_exchange must be one of {CP_KV_EXCHANGES} or None, got {cp_kv_exchange!r}"
        )
    return cp_kv_exchange


def _row_bytes(x: torch.Tensor) -> int:
    return x[0].numel() * x.element_size() if x.shape[0] else 0


class _StartedGather:
    """All-gathers of local rows, launched (asynchronously) and not yet waited on."""

    def __init__(self, layout: CPLayout, group, xs: Tuple[torch.Tensor, ...]) -> None:
        self.buffers, self.works = [], []
        with torch.no_grad():
            for x in xs:
                gathered = x.new_empty((layout.cp_size * x.shape[0],) + tuple(x.shape[1:]))
                self.works.append(start_all_gather_flat(gathered, x.detach(), group))
                self.buffers.append(gathered)

    def wait(self) -> List[torch.Tensor]:
        """The rank-major gathered buffers, once every collective has completed (handed over:
        this object keeps no reference, so they are freed as soon as the caller drops them)."""
        for work in self.works:
            work.wait()
        buffers, self.works, self.buffers = self.buffers, [], []
        return buffers


class _GatherRows(torch.autograd.Function):
    """All-gather local rows into the global THD order; backward reduce-scatters to owners.

    The gathers are launched before (``started``); forward waits on them. Backward launches the
    reduce-scatters of every input together and waits once."""

    @staticmethod
    def forward(ctx, layout: CPLayout, group, stats: Dict[str, int], prefix: str,
                started: _StartedGather, *xs: torch.Tensor):
        ctx.layout, ctx.group, ctx.stats, ctx.prefix = layout, group, stats, prefix
        peers = layout.cp_size - 1
        outs = []
        buffers = started.wait()
        for x in xs:
            gathered = buffers.pop(0)  # each rank-major buffer is freed once reordered
            outs.append(gathered.index_select(0, layout.gathered_to_global))
            del gathered
            stats[f"{prefix}_fwd_bytes_sent"] += peers * x.shape[0] * _row_bytes(x)
            stats[f"{prefix}_fwd_bytes_recv"] += peers * x.shape[0] * _row_bytes(x)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        layout, stats, prefix = ctx.layout, ctx.stats, ctx.prefix
        peers = layout.cp_size - 1
        order = layout.rank_rows.reshape(-1)
        local_grads, sends, works = [], [], []
        for g in grads:
            rank_major = g.index_select(0, order).contiguous()
            local = g.new_empty((layout.total_local,) + tuple(g.shape[1:]))
            works.append(start_reduce_scatter_flat(local, rank_major, ctx.group))
            sends.append(rank_major)  # alive until the collective completes
            local_grads.append(local)
            stats[f"{prefix}_bwd_bytes_sent"] += peers * layout.total_local * _row_bytes(g)
            stats[f"{prefix}_bwd_bytes_recv"] += peers * layout.total_local * _row_bytes(g)
        for work in works:
            work.wait()
        return (None, None, None, None, None) + tuple(local_grads)


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


def gather_rows(layout: CPLayout, group, stats: Dict[str, int], prefix: str,
                *xs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """All-gather this rank's rows of each ``x`` into the global THD order (differentiable: the
    gradients of the gathered rows are reduce-scattered back to their owners).

    Args:
        layout: the CP layout (:func:`~msa_megatron.parallel.cp_layout.build_cp_layout`).
        group: the CP group.
        stats: a :data:`STAT_KEYS` dict; ``<prefix>_fwd_*`` / ``<prefix>_bwd_*`` bytes are added.
        prefix: ``"index_k"`` or ``"kv"``.
        xs: ``[T_local, ...]`` tensors.

    Returns:
        One ``[T_global, ...]`` tensor per input.
    """
    return _GatherRows.apply(layout, group, stats, prefix, _StartedGather(layout, group, xs),
                             *xs)


class KVExchange:
    """A K/V exchange started by :func:`start_kv_exchange`; :meth:`finish` completes it.

    ``allgather`` launches its two all-gathers (K, V) asynchronously on construction, so they
    run while the caller selects blocks; ``selective`` needs the selection and starts nothing
    until :meth:`finish`.
    """

    def __init__(self, layout: CPLayout, k: torch.Tensor, v: torch.Tensor, kv_exchange: str,
                 group, stats: Dict[str, int]) -> None:
        if kv_exchange not in CP_KV_EXCHANGES:
            raise ValueError(
                f"kv_exchange must be one of {CP_KV_EXCHANGES}, got {kv_exchange!r}")
        self.layout, self.k, self.v, self.kv_exchange = layout, k, v, kv_exchange
        self.group, self.stats = group, stats
        self._started = (_StartedGather(layout, group, (k, v)) if kv_exchange == "allgather"
                         else None)
        self._done = False

    def finish(self, block_idx: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Wait for (``allgather``) or run (``selective``) the exchange.

        Args:
            block_idx: ``[T_local, Hi_local, top_k]`` int32 selection of the local queries, or
                None (dense mode: every causal block); read by ``selective`` only.

        Returns:
            ``(k_global, v_global)`` ``[T_global, Hkv_local, D]``, differentiable (dK/dV reach
            the owner ranks). ``selective`` leaves rows nobody selected at zero.

        Raises:
            RuntimeError: called twice.
        """
        if self._done:
            raise RuntimeError("KVExchange.finish was already called")
        self._done = True
        layout, k, v, stats = self.layout, self.k, self.v, self.stats
        self.k = self.v = None
        remote_rows = (layout.cp_size - 1) * layout.total_local * k.shape[1]
        stats["kv_head_rows_remote"] += remote_rows
        if self.kv_exchange == "allgather":
            started, self._started = self._started, None
            k_global, v_global = _GatherRows.apply(layout, self.group, stats, "kv", started,
                                                   k, v)
            stats["kv_head_rows_fetched"] += remote_rows
            return k_global, v_global
        plan = build_selective_plan(layout, needed_blocks(layout, block_idx, k.shape[1]),
                                    self.group, stats)
        return _SelectiveKV.apply(layout, plan, self.group, stats, k, v)


def start_kv_exchange(layout: CPLayout, k: torch.Tensor, v: torch.Tensor, kv_exchange: str,
                      group, stats: Dict[str, int]) -> KVExchange:
    """Start the K/V exchange of step 3 above before the selection is known.

    ``allgather`` launches its all-gathers now (asynchronous on gloo and NCCL: the selection
    runs while they move; on NCCL they are queued behind the index-key gather, which the
    selection waits for); :meth:`KVExchange.finish` waits right before the attention needs K/V.
    ``selective`` only records its arguments (its request depends on the selection).

    Args:
        layout: the CP layout; k, v: ``[T_local, Hkv_local, D]`` this rank's rows (left
            unchanged until ``finish``).
        kv_exchange: ``"allgather"`` or ``"selective"``.
        group: the CP group; stats: a :data:`STAT_KEYS` dict the bytes are added to.

    Returns:
        The started :class:`KVExchange`; call its ``finish(block_idx)`` exactly once, on every
        rank (the collectives must complete).

    Raises:
        ValueError: unknown ``kv_exchange``.
    """
    return KVExchange(layout, k, v, kv_exchange, group, stats)


def exchange_kv(layout: CPLayout, k: torch.Tensor, v: torch.Tensor,
                block_idx: Optional[torch.Tensor], kv_exchange: str, group,
                stats: Dict[str, int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """K/V of every key row the local queries read, in global-length buffers (step 3 above),
    exchanged at once: ``start_kv_exchange(...).finish(block_idx)``.

    Args:
        layout: the CP layout; k, v: ``[T_local, Hkv_local, D]`` this rank's rows.
        block_idx: ``[T_local, Hi_local, top_k]`` int32 selection of the local queries, or None
            (dense mode: every causal block).
        kv_exchange: ``"allgather"`` or ``"selective"``.
        group: the CP group; stats: a :data:`STAT_KEYS` dict the bytes are added to.

    Returns:
        ``(k_global, v_global)`` ``[T_global, Hkv_local, D]``, differentiable (dK/dV reach the
        owner ranks). ``selective`` leaves rows nobody selected at zero.

    Raises:
        ValueError: unknown ``kv_exchange``.
    """
    return start_kv_exchange(layout, k, v, kv_exchange, group, stats).finish(block_idx)
