"""The composer of one MSA layer: the only place that runs select -> attention -> KL.

Every entry point calls :func:`msa_layer` (or :func:`select_blocks` for the selection alone):
the public op (:func:`msa_megatron.msa_attention`), the Megatron core attention
(:class:`msa_megatron.megatron.attention.MSACoreAttention`), tests and benchmarks. In data-path
order, each step names the function that owns it:

1. validate once (:meth:`MSAOptions.__post_init__`, :mod:`msa_megatron.ops.validation`);
2. query layout ``(q_pos, q_kbase)`` and the KL rows of padded sequences
   (:func:`msa_megatron.layout.query_layout`, or under CP
   :func:`msa_megatron.parallel.cp_layout.build_cp_layout`;
   :func:`msa_megatron.layout.real_token_rows`);
3. CP: gather the index keys (:func:`msa_megatron.parallel.context.gather_rows`) and start
   the K/V exchange (:func:`msa_megatron.parallel.context.start_kv_exchange`: ``allgather``'s
   all-gathers run asynchronously while step 4 selects);
4. select once (the backend's ``select``); ranks sharing an index head (TP > Hkv) select a
   token slice each and all-gather it (:func:`msa_megatron.parallel.comm.all_gather_rows`);
5. CP: finish the K/V exchange, allgather (wait) or selective (run)
   (:meth:`msa_megatron.parallel.context.KVExchange.finish`);
6. attention (the backend's ``attention``);
7. TP > Hkv: head <-> token exchange of q and LSE
   (:func:`msa_megatron.parallel.comm.heads_to_tokens`);
8. KL over the real query rows (the backend's ``kl``, :func:`kl_of_rows`).

Steps 6-8 are one function (:func:`attention_and_kl`): a backend that computes attention and KL
with one fused backward replaces the two calls there. :class:`MSAResult` carries the selection
and the query layout with the outputs, so a metric (e.g. the teacher mass inside the selected
blocks) can be computed from q, ``result.keys`` and them.

``parallel/`` only moves tensors; ``ops/`` only computes on one device; this module puts them
in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .config import CP_KV_EXCHANGES, DEFAULT_CP_KV_EXCHANGE, MSAConfig, check_choice, check_scale
from .layout import query_layout, real_token_rows, shared_query_layout
from .ops.backends import get_backend, resolve_backend
from .ops.validation import (
    check_backend_limits,
    check_cu_seqlens,
    check_index_inputs,
    check_main_inputs,
    check_options,
)
from .parallel.comm import all_gather_rows, group_rank, heads_to_tokens, token_slices
from .parallel.context import gather_rows, new_cp_stats, start_kv_exchange
from .parallel.cp_layout import build_cp_layout
from .parallel.groups import NO_GROUPS, ParallelGroups


@dataclass(frozen=True)
class MSAOptions:
    """The options of one MSA call, validated on construction.

    Attributes:
        block_size, top_k, init_blocks, local_blocks: selection (MSA_SPEC section 2).
        softmax_scale: main logit scale, None for ``D ** -0.5``.
        index_scale: index logit scale, None for ``Di ** -0.5``.
        mode: ``"sparse"`` or ``"dense"`` (warmup, MSA_SPEC section 5).
        backend: ``"reference"``, ``"torch"``, ``"triton"`` or None (triton on CUDA, else torch).
        kv_exchange: CP K/V exchange, ``"allgather"`` (default) or ``"selective"`` (read only
            under CP).
        overlap_kv_exchange: under CP ``allgather``, launch the K/V all-gathers before the
            selection and wait on them right before the attention (True, default), or exchange
            after the selection (False: the selection's memory peak does not hold the gathered
            K/V). Results are bitwise the same.

    Raises:
        TypeError / ValueError: an invalid option (MSA_SPEC section 7).
    """

    block_size: int = 128
    top_k: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    softmax_scale: Optional[float] = None
    index_scale: Optional[float] = None
    mode: str = "sparse"
    backend: Optional[str] = None
    kv_exchange: str = DEFAULT_CP_KV_EXCHANGE
    overlap_kv_exchange: bool = True

    def __post_init__(self) -> None:
        checked = dict(zip(("block_size", "top_k", "init_blocks", "local_blocks"), check_options(
            self.block_size, self.top_k, self.init_blocks, self.local_blocks, self.backend,
            self.mode)))
        checked.update((name, check_scale(name, getattr(self, name)))
                       for name in ("softmax_scale", "index_scale"))
        for name, value in checked.items():  # plain int / float (e.g. from numpy integers)
            if type(value) is not type(getattr(self, name)):
                object.__setattr__(self, name, value)
        check_choice("kv_exchange", self.kv_exchange, CP_KV_EXCHANGES)
        if not isinstance(self.overlap_kv_exchange, bool):
            raise TypeError("overlap_kv_exchange must be a bool, got "
                            f"{type(self.overlap_kv_exchange).__name__}")

    @classmethod
    def from_config(cls, config: MSAConfig, **overrides: Any) -> "MSAOptions":
        """The options of ``config`` (an :class:`~msa_megatron.MSAConfig`), with ``overrides``.

        ``kv_exchange`` is ``config.cp_kv_exchange`` (``"allgather"`` when None) unless
        overridden; a ``softmax_scale`` override applies only when ``config.softmax_scale`` is
        None (it is the layer's default, e.g. megatron-core's).
        """
        fields = dict(
            block_size=config.block_size, top_k=config.top_k, init_blocks=config.init_blocks,
            local_blocks=config.local_blocks, softmax_scale=config.softmax_scale,
            index_scale=config.index_scale, mode=config.mode, backend=config.backend,
            kv_exchange=config.cp_kv_exchange or DEFAULT_CP_KV_EXCHANGE,
        )
        if config.softmax_scale is not None:
            overrides.pop("softmax_scale", None)
        fields.update(overrides)
        return cls(**fields)

    def select_kwargs(self) -> Dict[str, Any]:
        """Keyword arguments of a backend's ``select`` core."""
        return dict(block_size=self.block_size, top_k=self.top_k, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks, index_scale=self.index_scale)


@dataclass
class MSAResult:
    """What :func:`msa_layer` returns.

    Attributes:
        out: ``[T, Hq, D]`` in q.dtype, differentiable in q, k, v.
        kl: 0-dim fp32 ``kl_scale * sum`` of the KL of this rank's share of the (real) query
            rows, differentiable in q_idx and k_idx.
        block_idx: ``[T, Hi, top_k]`` int32 selection (block numbers from each sequence's start,
            ascending, -1 unused), None in dense mode. Reuse it by passing it back.
        q_pos, q_kbase: ``[T]`` int32 query layout against ``keys``.
        keys: ``[Tk, Hkv, D]`` the key rows the attention read (all of them under CP
            ``allgather``; under ``selective`` only the selected blocks are filled).
        kl_rows: ``[R]`` int64 query rows that count in the KL, None for all.
        stats: CP byte counters (:data:`msa_megatron.parallel.context.STAT_KEYS`), None
            without CP.
    """

    out: torch.Tensor
    kl: torch.Tensor
    block_idx: Optional[torch.Tensor]
    q_pos: torch.Tensor
    q_kbase: torch.Tensor
    keys: torch.Tensor
    kl_rows: Optional[torch.Tensor] = None
    stats: Optional[Dict[str, int]] = None


def select_blocks(q_idx: torch.Tensor, k_idx: torch.Tensor, *, options: MSAOptions,
                  cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Selection alone, one device (:func:`msa_megatron.select_blocks` with typed options).

    Args:
        q_idx: ``[T, Hi, Di]``; k_idx: ``[T, Hik, Di]``; cu_seqlens: ``[n+1]`` int32 or None.
        options: the selection options (mode, softmax_scale and the CP exchange options are not
            read).

    Returns:
        ``[T, Hi, top_k]`` int32.

    Raises:
        TypeError / ValueError: bad inputs (MSA_SPEC section 7).
    """
    T, _, _, Di = check_index_inputs(q_idx, k_idx)
    check_cu_seqlens(cu_seqlens, T, q_idx.device)
    name = resolve_backend(options.backend, q_idx.device)
    check_backend_limits(name, q_idx.dtype, {"Di": Di}, options.block_size, q_idx.device)
    q_pos, q_kbase = query_layout(cu_seqlens, T, q_idx.device)
    return get_backend(name).select(q_idx, k_idx, q_pos, q_kbase, **options.select_kwargs())


def msa_layer(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
    *, options: MSAOptions, kl_scale: float, cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_real: Optional[torch.Tensor] = None, groups: ParallelGroups = NO_GROUPS,
    block_idx: Optional[torch.Tensor] = None, stats: Optional[Dict[str, int]] = None,
) -> MSAResult:
    """MSA of this rank's queries: selection, sparse attention and the index KL (MSA_SPEC 2-6).

    Args:
        q: ``[T, Hq, D]`` main queries (RoPE applied); k, v: ``[T, Hkv, D]``; q_idx:
            ``[T, Hi, Di]``; k_idx: ``[T, Hik, Di]``; one dtype and device. Under CP, T is this
            rank's tokens in megatron-core's CP order; with ``groups.tp_share`` the rank holds
            exactly one index head (``Hi == 1``) and some of its query heads.
        options: :class:`MSAOptions`.
        kl_scale: the KL normaliser ``1 / (N * Hi_total)``, N = real tokens of the whole
            micro-batch (over all CP ranks), Hi_total = index heads of the layer.
        cu_seqlens: ``[n+1]`` int32 packed-sequence boundaries (padded ones when sequences are
            padded), or None for one sequence. Under CP the *global* boundaries of the un-split
            batch (every length divisible by ``2*CP``; SBHD:
            :func:`msa_megatron.parallel.cp_layout.sbhd_cu_seqlens`); required then.
        cu_seqlens_real: ``[n+1]`` int32 real boundaries when ``cu_seqlens`` holds padded ones
            (megatron's ``cu_seqlens_q`` next to ``cu_seqlens_q_padded``), or None. Padding
            queries get finite outputs but no KL term.
        groups: :class:`~msa_megatron.parallel.groups.ParallelGroups` (CP group, TP share group).
        block_idx: ``[T, Hi, top_k]`` int32 selection of an earlier call (reused, e.g. by
            activation recomputation; never recomputed), or None to select. Its reverse index
            (the Triton backend's) is remembered on the tensor by its autograd version: refill
            a kept buffer through ordinary in-place ops (``copy_``), not ones that bypass the
            version counter (``.data``, ``torch.distributed.broadcast``, DLPack), or pass a
            new tensor. ``cu_seqlens`` has no such rule (its memo compares values).
        stats: a :data:`~msa_megatron.parallel.context.STAT_KEYS` dict the CP bytes are added
            to (backward entries when backward runs), or None for a fresh one.

    Returns:
        :class:`MSAResult`. Summing ``kl`` over the CP and share ranks gives the layer's KL.

    Raises:
        TypeError / ValueError: bad inputs, options, boundaries or ``block_idx``.
    """
    T, _, _, D, hi, _, di = check_main_inputs(q, k, v, q_idx, k_idx)
    name = resolve_backend(options.backend, q.device)
    check_backend_limits(name, q.dtype, {"D": D, "Di": di}, options.block_size, q.device,
                         selection=(T, hi, options.top_k) if options.mode == "sparse" else None)
    cp = groups.cp_size > 1
    shared = groups.share_size > 1
    if shared and hi != 1:
        raise ValueError(
            f"with a tp_share group the rank holds exactly one index head, got q_idx with Hi={hi}")
    if options.mode == "dense":
        block_idx = None
    elif block_idx is not None:
        _check_block_idx(block_idx, T, hi, options.top_k, q.device)
    impl = get_backend(name)

    # 2. Query layout.
    layout = None
    if cp:
        if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device != q.device:
            raise ValueError(
                f"cu_seqlens_global is on {cu_seqlens.device} but the inputs are on {q.device}")
        layout = build_cp_layout(cu_seqlens, groups.cp_size, group_rank(groups.cp),
                                 options.block_size, q.device, total_local=T)
        q_pos, q_kbase = layout.q_pos, layout.q_kbase
    else:
        values = check_cu_seqlens(cu_seqlens, T, q.device)
        q_pos, q_kbase = shared_query_layout(cu_seqlens, T, q.device, values)
    if block_idx is not None:
        _check_block_values(block_idx, q_pos, options.block_size)
    kl_rows = None
    if cu_seqlens_real is not None:
        padded = cu_seqlens if cu_seqlens is not None else torch.tensor(
            [0, T], dtype=torch.int32, device=q.device)
        kl_rows = real_token_rows(padded, cu_seqlens_real, q_pos, q_kbase)

    # 3. CP: the index keys of every rank; the K/V exchange starts (allgather: its collectives
    # run during the selection, queued behind the index-key gather the selection waits for).
    exchange = None
    if cp:
        stats = new_cp_stats() if stats is None else stats
        (k_idx_all,) = gather_rows(layout, groups.cp, stats, "index_k", k_idx)
        if options.overlap_kv_exchange:
            exchange = start_kv_exchange(layout, k, v, options.kv_exchange, groups.cp, stats)
    else:
        stats, k_idx_all = None, k_idx

    # 4. Select once (split over the ranks sharing the index head).
    slices = token_slices(T, groups.share_size) if shared else None
    if options.mode == "sparse" and block_idx is None:
        with torch.no_grad():
            if shared:
                start, end = slices[group_rank(groups.tp_share)]
                own = impl.select(q_idx[start:end].detach(), k_idx_all.detach(),
                                  q_pos[start:end], q_kbase[start:end], **options.select_kwargs())
                block_idx = all_gather_rows(own, slices, groups.tp_share)
            else:
                block_idx = impl.select(q_idx.detach(), k_idx_all.detach(), q_pos, q_kbase,
                                        **options.select_kwargs())

    # 5. CP: K/V of the rows the local queries read (waited on only now).
    if cp:
        if exchange is None:
            exchange = start_kv_exchange(layout, k, v, options.kv_exchange, groups.cp, stats)
        k_all, v_all = exchange.finish(block_idx)
    else:
        k_all, v_all = k, v

    # 6-8. Attention, head <-> token exchange (shared index head), KL.
    out, kl = attention_and_kl(impl, options, q, k_all, v_all, q_idx, k_idx_all, block_idx,
                               q_pos, q_kbase, kl_scale=kl_scale, kl_rows=kl_rows,
                               share_slices=slices, share_group=groups.tp_share)
    return MSAResult(out=out, kl=kl, block_idx=block_idx, q_pos=q_pos, q_kbase=q_kbase,
                     keys=k_all, kl_rows=kl_rows, stats=stats)


def attention_and_kl(
    impl, options: MSAOptions, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_idx: torch.Tensor, k_idx: torch.Tensor, block_idx: Optional[torch.Tensor],
    q_pos: torch.Tensor, q_kbase: torch.Tensor, *, kl_scale: float,
    kl_rows: Optional[torch.Tensor] = None,
    share_slices: Optional[Sequence[Tuple[int, int]]] = None, share_group=None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Steps 6-8 of :func:`msa_layer` on inputs already in place (no validation).

    Args:
        impl: a backend module (:mod:`msa_megatron.ops.backends`); options: the call's options.
        q ``[T, Hq, D]``; k, v ``[Tk, Hkv, D]``; q_idx ``[T, Hi, Di]``; k_idx ``[Tk, Hik, Di]``;
        block_idx ``[T, Hi, top_k]`` or None (dense); q_pos, q_kbase ``[T]``.
        kl_scale: KL normaliser; kl_rows: ``[R]`` int64 rows counting in the KL, or None.
        share_slices, share_group: token slices and group of the ranks sharing one index head
            (TP > Hkv), or None.

    Returns:
        ``(out, kl)``. A backend with a fused attention + KL backward would replace the two core
        calls here (the KL reads the attention's LSE).
    """
    out, lse = impl.attention(q, k, v, block_idx, q_pos, q_kbase, block_size=options.block_size,
                              softmax_scale=options.softmax_scale, index_heads=q_idx.shape[1])
    kl_options = dict(block_size=options.block_size, softmax_scale=options.softmax_scale,
                      index_scale=options.index_scale, kl_scale=kl_scale)
    if share_group is None or share_slices is None:
        kl = kl_of_rows(impl, kl_rows, q.detach(), k.detach(), lse.detach(), q_idx, k_idx,
                        block_idx, q_pos, q_kbase, **kl_options)
        return out, kl
    # Each sharing rank gets all query heads of the index head for its token slice: the teacher
    # (mean over those heads) is exact; the rank computes the KL of its slice.
    start, end = share_slices[group_rank(share_group)]
    with torch.no_grad():
        q_slice = heads_to_tokens(q.detach(), share_slices, share_group)
        lse_slice = heads_to_tokens(lse.detach(), share_slices, share_group)
    slice_rows = None
    if kl_rows is not None:
        inside = (kl_rows >= start) & (kl_rows < end)
        slice_rows = kl_rows[inside] - start
    kl = kl_of_rows(impl, slice_rows, q_slice, k.detach(), lse_slice, q_idx[start:end], k_idx,
                    None if block_idx is None else block_idx[start:end], q_pos[start:end],
                    q_kbase[start:end], **kl_options)
    return out, kl


def kl_of_rows(impl, rows: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
               lse: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
               block_idx: Optional[torch.Tensor], q_pos: torch.Tensor, q_kbase: torch.Tensor,
               **options: Any) -> torch.Tensor:
    """The backend's KL core (:mod:`msa_megatron.ops.backends`) over the query ``rows`` only.

    Args:
        impl: a backend; rows: ``[R]`` int64 query rows, or None for all; q ``[T, Hq, D]``
            (detached), k ``[Tk, Hkv, D]`` (detached), lse ``[T, Hq]`` (detached), q_idx
            ``[T, Hi, Di]``, k_idx ``[Tk, Hik, Di]``, block_idx ``[T, Hi, top_k]`` or None,
            q_pos / q_kbase ``[T]``; options: ``block_size``, ``softmax_scale``,
            ``index_scale``, ``kl_scale``.

    Returns:
        0-dim fp32 KL, differentiable in q_idx and k_idx (an exact zero, with zero gradients,
        when ``rows`` is empty).
    """
    if rows is not None and rows.numel() == 0:
        return (q_idx[:0].sum() + k_idx[:0].sum()).float()
    if rows is not None:
        q, lse, q_idx, q_pos, q_kbase = (t.index_select(0, rows)
                                         for t in (q, lse, q_idx, q_pos, q_kbase))
        block_idx = None if block_idx is None else block_idx.index_select(0, rows)
    return impl.kl(q, k, lse, q_idx, k_idx, block_idx, q_pos, q_kbase, **options)


def _check_block_idx(block_idx: torch.Tensor, total: int, hi: int, top_k: int,
                     device: torch.device) -> None:
    if not isinstance(block_idx, torch.Tensor) or block_idx.dtype != torch.int32:
        raise TypeError("block_idx must be an int32 torch.Tensor [T_local, Hi_local, top_k]")
    if tuple(block_idx.shape) != (total, hi, top_k):
        raise ValueError(
            f"block_idx has shape {list(block_idx.shape)}, expected [T_local, Hi_local, top_k] = "
            f"{[total, hi, top_k]}"
        )
    if block_idx.device != device:
        raise ValueError(f"block_idx is on {block_idx.device} but the inputs are on {device}")


def _check_block_values(block_idx: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> None:
    """A given selection must be one :func:`select_blocks` could return (MSA_SPEC section 2.5):
    per row, strictly ascending block numbers in ``[0, blk(p)]`` that include the query's own
    block ``blk(p) = q_pos // block_size``, then ``-1`` slots. Anything else would read past the
    sequence, count a block twice or leave a row with nothing to attend to. One host read."""
    if block_idx.is_meta or block_idx.numel() == 0:
        return
    own = (q_pos.to(torch.int64) // block_size).view(-1, 1, 1)
    b = block_idx.to(torch.int64)
    used = b >= 0
    out_of_range = (b < -1) | (b > own)
    after_unused = used[..., 1:] & ~used[..., :-1]
    not_ascending = used[..., 1:] & (b[..., 1:] <= b[..., :-1])
    bad = (out_of_range.flatten(1).any(1) | after_unused.flatten(1).any(1)
           | not_ascending.flatten(1).any(1) | ~(b == own).any(2).all(1))
    if bool(bad.any()):
        row = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"block_idx row {row} (query position {int(q_pos[row])}, own block "
            f"{int(own[row])}) holds {block_idx[row].tolist()}: each row must list strictly "
            "ascending block numbers in [0, own block], including the own block, then -1 "
            "slots, as select_blocks returns"
        )


__all__: List[str] = ["MSAOptions", "MSAResult", "attention_and_kl", "kl_of_rows", "msa_layer",
                      "select_blocks"]
