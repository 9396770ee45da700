"""``backend="torch"``: memory-lean PyTorch MSA (MSA_SPEC sections 2-5) for CPU and any device.

The three cores of :mod:`msa_megatron.ops.backends`, registered as ``msa_megatron::torch_*``
custom ops (:mod:`msa_megatron.ops.custom_ops`) so models using them compile with
``torch.compile(fullgraph=True)``.

How the work is cut (nothing of size ``T x T`` or ``T x T/B`` per head is ever allocated):

- Queries are split into chunks that lie in one sequence (one ``q_kbase``) and whose score
  tensor ``[heads, queries, keys]`` holds at most :data:`CHUNK_ELEMENTS` elements.
- Selection: a chunk's index scores against its sequence's causal keys, a block max, then one
  stable sort per (query, index head) of an integer key that orders forced blocks first, then
  eligible blocks by fp32 score (fp64 for fp64 inputs; NaN ranks first, as in the oracle), ties
  to the lower block, ineligible blocks last.
- Attention and KL: a chunk gathers the key rows of the *union* of the blocks its queries select
  (all causal blocks in dense mode) once, computes dense scores against them with one GEMM per
  KV group and masks each (query, head) to its own support. Neighbouring queries share most
  blocks, so this reads far less memory than gathering ``top_k * B`` keys per query, and the
  products are GEMMs instead of matrix-vector products.
- Off the support, scores get a large finite negative bias instead of ``-inf`` (so ``0 * score``
  is 0, not NaN), and probabilities come from PyTorch's fused softmax over the chunk's whole
  support row; rows with an empty support (impossible with a valid selection) give 0.
- Backward recomputes P with the forward's own chunked softmax (bitwise the forward's P and, on
  a CPU, cheaper than ``exp(S - lse)``, whose masked entries hit slow paths), so the saved LSE is
  returned for the interface but not read. dK, dV (and dk_idx) are accumulated chunk by chunk
  with ``index_put_(accumulate=True)`` on rows that are unique within a chunk: deterministic on
  every device. The KL is a scalar, so its gradients to q_idx, k_idx are computed in the same
  pass as the value (``dz = (Qs - T) * kl_scale`` on the support) and only scaled in backward.

Accumulation is float32 (float64 for float64 inputs); outputs are in the input dtype, the LSE
float32 (float64 for float64 inputs), the KL a 0-dim float32. Chunks never mix sequences, and a
chunk whose inputs hold NaN/Inf runs one (query, index head) at a time over that row's own
support (attention forward, backward and KL), so a non-finite value reaches exactly the rows
that read it (MSA_SPEC section 7).
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from .custom_ops import BackendKernels, accumulation_dtype, register_backend_ops

CHUNK_ELEMENTS = 1 << 20  # elements of one chunk's [heads, queries, keys] score tensor
MAX_CHUNK_QUERIES = 256  # more queries per chunk widen the union of selected blocks
_KEY_FORCED = torch.iinfo(torch.int64).max
_KEY_INELIGIBLE = torch.iinfo(torch.int64).min
_NEG_INF = float("-inf")


class _Chunk(NamedTuple):
    """Queries ``start:stop`` of one sequence whose position 0 is key row ``kbase``."""

    start: int
    stop: int
    kbase: int
    max_pos: int


def _plan_chunks(q_pos: torch.Tensor, q_kbase: torch.Tensor, heads: int) -> List[_Chunk]:
    """Cut the queries into runs of one sequence, then into chunks within the element budget."""
    total = q_pos.shape[0]
    if total == 0:
        return []
    pos = q_pos.tolist()
    base = q_kbase.tolist()
    cuts = ((q_kbase[1:] != q_kbase[:-1]).nonzero().flatten() + 1).tolist()
    chunks = []
    for run_start, run_stop in zip([0] + cuts, cuts + [total]):
        width = max(pos[run_start:run_stop]) + 1
        size = max(1, min(MAX_CHUNK_QUERIES, CHUNK_ELEMENTS // (heads * width)))
        for start in range(run_start, run_stop, size):
            stop = min(start + size, run_stop)
            chunks.append(_Chunk(start, stop, base[start], max(pos[start:stop])))
    return chunks


def _group_major(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[C, H, F]`` -> ``[groups, C * H / groups, F]`` (head h in group h // (H / groups))."""
    C, H, feat = x.shape
    return x.reshape(C, groups, H // groups, feat).transpose(0, 1).reshape(groups, -1, feat)


def _token_major(x: torch.Tensor, tokens: int) -> torch.Tensor:
    """Inverse of :func:`_group_major`: ``[groups, C * H / groups, F]`` -> ``[C, H, F]``."""
    groups, _, feat = x.shape
    return x.reshape(groups, tokens, -1, feat).transpose(0, 1).reshape(tokens, -1, feat)


def _gather_rows(t: torch.Tensor, rows: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """Rows ``[W]`` of ``t [Tk, H, F]`` as ``[H, W, F]`` in ``acc``."""
    return t.index_select(0, rows).to(acc).transpose(0, 1).contiguous()


def _masked_value(dtype: torch.dtype) -> float:
    """Score added for each reason a key is off the support (block not selected, key after the
    query): finite, so ``0 * score`` stays 0, two of them still sum to a finite value, and the
    softmax gives exactly 0 there."""
    return torch.finfo(dtype).min / 2


# ---------------------------------------------------------------------------------------------
# Selection (MSA_SPEC section 2)
# ---------------------------------------------------------------------------------------------


def _ordered_key(s: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of the float scores ``s``: -0 == +0, every NaN above +inf."""
    d = s.to(torch.float64) + 0.0
    d = torch.where(torch.isnan(d), float("nan"), d)
    bits = d.view(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ _KEY_FORCED)


def _rank_blocks(
    s: torch.Tensor, pos: torch.Tensor, block_size: int, top_k: int, init_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """Chosen blocks ``[C, Hi, min(top_k, nblk)]`` from block scores ``s [C, Hi, nblk]``."""
    nblk = s.shape[2]
    blocks = torch.arange(nblk, device=s.device)[None, :]
    own = (pos // block_size)[:, None]
    eligible = blocks <= own
    forced = eligible & ((blocks > own - local_blocks) | (blocks < init_blocks))
    key = torch.where(eligible[:, None, :], _ordered_key(s), _KEY_INELIGIBLE)
    key = torch.where(forced[:, None, :], _KEY_FORCED, key)
    kk = min(top_k, nblk)
    chosen = torch.sort(key, dim=2, descending=True, stable=True).indices[:, :, :kk]
    slot = torch.arange(kk, device=s.device)[None, None, :]
    chosen = torch.where(slot <= own[:, :, None], chosen, nblk)
    chosen = torch.sort(chosen, dim=2).values
    return torch.where(chosen == nblk, -1, chosen).to(torch.int32)


def select_kernel(
    q_idx: torch.Tensor, k_idx: torch.Tensor, q_pos: torch.Tensor, q_kbase: torch.Tensor,
    block_size: int, top_k: int, init_blocks: int, local_blocks: int, index_scale: float,
) -> torch.Tensor:
    """Top-k blocks per query token and index head (MSA_SPEC section 2).

    Args:
        q_idx: ``[Tq, Hi, Di]``; k_idx: ``[Tk, Hik, Di]``; q_pos, q_kbase: ``[Tq]`` int32 layout.

    Returns:
        ``[Tq, Hi, top_k]`` int32, ascending block numbers relative to the sequence, ``-1`` pad.
    """
    Tq, Hi, _ = q_idx.shape
    Hik = k_idx.shape[1]
    acc = accumulation_dtype(q_idx.dtype)
    block_idx = torch.full((Tq, Hi, top_k), -1, dtype=torch.int32, device=q_idx.device)
    for ch in _plan_chunks(q_pos, q_kbase, Hi):
        C, width = ch.stop - ch.start, ch.max_pos + 1
        nblk = ch.max_pos // block_size + 1
        pos = q_pos[ch.start:ch.stop].to(torch.int64)
        qi = _group_major(q_idx[ch.start:ch.stop].to(acc), Hik)
        ki = k_idx[ch.kbase:ch.kbase + width].to(acc).permute(1, 2, 0)
        z = torch.bmm(qi, ki).mul_(index_scale).view(Hik, C, Hi // Hik, width)
        future = torch.arange(width, device=z.device)[None, :] > pos[:, None]
        z = torch.where(future[None, :, None, :], _NEG_INF, z)
        z = F.pad(z, (0, nblk * block_size - width), value=_NEG_INF)
        s = z.view(Hik, C, Hi // Hik, nblk, block_size).amax(dim=-1)
        s = s.transpose(0, 1).reshape(C, Hi, nblk)
        chosen = _rank_blocks(s, pos, block_size, top_k, init_blocks, local_blocks)
        block_idx[ch.start:ch.stop, :, :chosen.shape[2]] = chosen
    return block_idx


# ---------------------------------------------------------------------------------------------
# Support of a chunk: the key rows it reads and the per-(query, index head) score bias
# ---------------------------------------------------------------------------------------------


class _Support(NamedTuple):
    rows: torch.Tensor  # [W] int64 key rows, ascending, unique, all in the chunk's sequence
    bias: torch.Tensor  # [C, Hi or 1, W] acc dtype, 0 on the support, _masked_value off it


def _chunk_support(
    ch: _Chunk, q_pos: torch.Tensor, block_idx: Optional[torch.Tensor], block_size: int,
    acc: torch.dtype,
) -> _Support:
    """Union of the blocks selected in the chunk (dense: the whole causal range) and its mask."""
    device = q_pos.device
    pos = q_pos[ch.start:ch.stop].to(torch.int64)
    if block_idx is None:
        u = torch.arange(ch.max_pos + 1, device=device)
        off = (u[None, :] > pos[:, None])[:, None, :]
        return _Support(ch.kbase + u, off.to(acc).mul_(_masked_value(acc)))
    C = ch.stop - ch.start
    nblk = ch.max_pos // block_size + 1
    chosen = block_idx[ch.start:ch.stop].to(torch.int64)
    chosen = torch.where((chosen >= 0) & (chosen < nblk), chosen, nblk)
    selected = torch.zeros(C, chosen.shape[1], nblk + 1, dtype=torch.bool, device=device)
    selected.scatter_(2, chosen, True)
    blocks = selected[:, :, :nblk].any(dim=1).any(dim=0).nonzero().flatten()
    u = (blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()
    width = int((u <= ch.max_pos).sum())  # u ascends; the last block may pass max_pos
    # Bias of whole blocks (block not selected) plus bias of keys after the query, then cut
    # the partial last block.
    masked = _masked_value(acc)
    block_bias = (~selected[:, :, blocks]).to(acc).mul_(masked).unsqueeze(-1)
    future = (u.view(-1, block_size) > pos[:, None, None]).to(acc).mul_(masked)
    bias = (block_bias + future[:, None]).view(C, -1, u.numel())[:, :, :width]
    return _Support(ch.kbase + u[:width], bias)


def _add_head_bias(s: torch.Tensor, bias: torch.Tensor, heads: int) -> torch.Tensor:
    """Add ``bias [C, Hi or 1, W]`` in place to group-major scores ``s [groups, C * heads /
    groups, W]``, each head meeting the bias of its index head (head h -> h // (heads / Hi))."""
    groups, _, W = s.shape
    C = bias.shape[0]
    per_group = max(bias.shape[1] // groups, 1)
    sv = s.view(groups, C, per_group, heads // (groups * per_group), W)
    sv.add_(bias.view(C, -1, per_group, 1, W).transpose(0, 1))
    return s


def _support_softmax(s: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax of biased scores over the last dim and the row max; rows whose support is empty
    (max at the masked value) get probabilities 0 instead of a uniform row."""
    m = s.amax(dim=-1, keepdim=True)
    p = torch.softmax(s, dim=-1)
    empty = m < _masked_value(s.dtype) / 2  # every key of the row carries the masked value
    if bool(empty.any()):
        p.masked_fill_(empty, 0.0)
    return p, m


def _row_lse(p: torch.Tensor, m: torch.Tensor, empty_value: float) -> torch.Tensor:
    """Row log-sum-exp ``[..., 1]`` from softmax ``p`` and row max ``m``: the largest probability
    is ``exp(0) / sum``, so ``lse = m + log(sum) = m - log(max p)``; ``empty_value`` where the
    support is empty."""
    p_max = p.amax(dim=-1, keepdim=True)
    return torch.where(p_max == 0, empty_value, m - torch.log(p_max))


def _main_probabilities(
    qs: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, heads: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention probabilities ``[Hkv, C * G, W]`` of scaled group-major queries ``qs
    [Hkv, C * G, D]`` over gathered ``keys [Hkv, W, D]`` (0 off the support) and the row max."""
    s = _add_head_bias(torch.bmm(qs, keys.transpose(1, 2)), bias, heads)
    return _support_softmax(s)


# ---------------------------------------------------------------------------------------------
# Main branch (MSA_SPEC sections 3 and 5)
# ---------------------------------------------------------------------------------------------


def _all_finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _exp_normalised(s: torch.Tensor) -> torch.Tensor:
    """``exp(s - logsumexp(s))`` over the last dim, entry by entry as the oracle and the
    kernels do (with an Inf score, ``torch.softmax`` makes the whole row NaN; this keeps 0
    where ``s = -inf``)."""
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))


def _own_support(ch: _Chunk, sup: _Support, heads: int, kv_heads: int, index_heads: int):
    """Yield ``(token, query-head slice, KV group, key rows)`` for every (query, index head) of
    the chunk, the key rows being that row's own support only."""
    hpi, group = heads // index_heads, heads // kv_heads
    for c in range(ch.stop - ch.start):
        for i in range(index_heads):
            bias = sup.bias[c, i if sup.bias.shape[1] > 1 else 0]
            heads = slice(i * hpi, (i + 1) * hpi)
            yield ch.start + c, heads, (i * hpi) // group, sup.rows[bias == 0]


def _isolated_forward(q, k, v, ch, sup, softmax_scale, index_heads, acc, out, lse) -> None:
    """Forward of a chunk whose inputs hold NaN/Inf, one (query, index head) at a time over its
    own support: a GEMM over the chunk's union would multiply the non-finite values by the zero
    probabilities of rows that never read them (MSA_SPEC section 7: affected rows only)."""
    for t, heads, g, rows in _own_support(ch, sup, q.shape[1], k.shape[1], index_heads):
        s = (q[t, heads].to(acc) * softmax_scale) @ k[rows, g].to(acc).T
        row_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        out[t, heads] = (torch.exp(s - row_lse) @ v[rows, g].to(acc)).to(out.dtype)
        lse[t, heads] = row_lse.squeeze(-1)


def _isolated_backward(dout, q, k, v, out, ch, sup, softmax_scale, index_heads, acc,
                       dq, dk, dv) -> None:
    """Backward twin of :func:`_isolated_forward` (fixed loop order: deterministic)."""
    for t, heads, g, rows in _own_support(ch, sup, q.shape[1], k.shape[1], index_heads):
        qs = q[t, heads].to(acc) * softmax_scale
        kk, vv = k[rows, g].to(acc), v[rows, g].to(acc)
        p = _exp_normalised(qs @ kk.T)
        do = dout[t, heads].to(acc)
        delta = (do * out[t, heads].to(acc)).sum(dim=-1, keepdim=True)
        ds = p * (do @ vv.T - delta)
        dq[t, heads] = (ds @ kk * softmax_scale).to(dq.dtype)
        dk[rows, g] += ds.T @ qs
        dv[rows, g] += p.T @ do


def _isolated_kl(q, k, q_idx, k_idx, ch, sup, softmax_scale, index_scale, kl_scale, acc,
                 dq_idx, dk_idx) -> torch.Tensor:
    """KL of a chunk whose inputs hold NaN/Inf, one (query, index head) at a time over its own
    support, in the oracle's formulation (a NaN teacher or student makes the KL NaN); adds
    that row's gradients to ``dq_idx`` / ``dk_idx`` (unscaled by ``kl_scale`` for dk_idx, as
    the chunked path) unless they are None. Returns the chunk's KL sum."""
    Hq, Hkv, Hi, Hik = q.shape[1], k.shape[1], q_idx.shape[1], k_idx.shape[1]
    total = torch.zeros((), dtype=acc, device=q.device)
    for t, heads, g, rows in _own_support(ch, sup, Hq, Hkv, Hi):
        i = heads.start // (Hq // Hi)
        j = i // (Hi // Hik)
        s = (q[t, heads].to(acc) * softmax_scale) @ k[rows, g].to(acc).T
        teacher = _exp_normalised(s).mean(dim=0)  # [W]
        qi = q_idx[t, i].to(acc) * index_scale
        ki = k_idx[rows, j].to(acc)
        z = ki @ qi
        log_qs = z - torch.logsumexp(z, dim=0)
        kept = teacher != 0  # 0 log 0 = 0; NaN is kept
        total += torch.where(kept, teacher * (torch.log(teacher) - log_qs), 0.0).sum()
        if dq_idx is not None:
            dz = torch.exp(log_qs) - teacher
            dq_idx[t, i] = dz @ ki * (kl_scale * index_scale)
            dk_idx[rows, j] += dz[:, None] * qi[None, :]
    return total


def attention_forward_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: Optional[torch.Tensor],
    q_pos: torch.Tensor, q_kbase: torch.Tensor, block_size: int, softmax_scale: float,
    index_heads: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the selected blocks (dense causal if ``block_idx`` is None).

    Args:
        q: ``[Tq, Hq, D]``; k, v: ``[Tk, Hkv, D]``; block_idx: ``[Tq, Hi, top_k]`` int32 or None.
        index_heads: Hi (the support is shared by all heads in dense mode, so unused there).

    Returns:
        out ``[Tq, Hq, D]`` in q.dtype; lse ``[Tq, Hq]`` float32 (float64 for float64 inputs),
        ``-inf`` with a zero output for a query whose support is empty.
    """
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros((Tq, Hq, D))
    lse = torch.full((Tq, Hq), _NEG_INF, dtype=acc, device=q.device)
    for ch in _plan_chunks(q_pos, q_kbase, Hq):
        sup = _chunk_support(ch, q_pos, block_idx, block_size, acc)
        if sup.rows.numel() == 0:
            continue
        C = ch.stop - ch.start
        kc, vc = _gather_rows(k, sup.rows, acc), _gather_rows(v, sup.rows, acc)
        if not _all_finite(q[ch.start:ch.stop], kc, vc):
            _isolated_forward(q, k, v, ch, sup, softmax_scale, index_heads, acc, out, lse)
            continue
        qs = _group_major(q[ch.start:ch.stop].to(acc) * softmax_scale, Hkv)
        p, m = _main_probabilities(qs, kc, sup.bias, Hq)
        o = torch.bmm(p, vc)
        out[ch.start:ch.stop] = _token_major(o, C).to(q.dtype)
        lse[ch.start:ch.stop] = _token_major(_row_lse(p, m, _NEG_INF), C).squeeze(-1)
    return out, lse


def attention_backward_kernel(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, block_idx: Optional[torch.Tensor], q_pos: torch.Tensor,
    q_kbase: torch.Tensor, block_size: int, softmax_scale: float, index_heads: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`attention_forward_kernel`: ``(dq, dk, dv)`` in the input dtypes.

    ``dS = P * (dP - rowsum(dO * O))``. P is recomputed chunk by chunk with the forward's own
    fused softmax over the chunk's full support row (bitwise the forward's P, and on a CPU
    cheaper than ``exp(S - lse)``), so ``lse`` is not read.
    """
    del lse
    Tq, Hq, D = q.shape
    Hkv = k.shape[1]
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros_like(q)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for ch in _plan_chunks(q_pos, q_kbase, Hq):
        sup = _chunk_support(ch, q_pos, block_idx, block_size, acc)
        if sup.rows.numel() == 0:
            continue
        C = ch.stop - ch.start
        rows = slice(ch.start, ch.stop)
        qs = _group_major(q[rows].to(acc) * softmax_scale, Hkv)
        kc = _gather_rows(k, sup.rows, acc)
        vc = _gather_rows(v, sup.rows, acc)
        if not _all_finite(q[rows], kc, vc, dout[rows], out[rows]):
            _isolated_backward(dout, q, k, v, out, ch, sup, softmax_scale, index_heads, acc,
                               dq, dk, dv)
            continue
        p, _ = _main_probabilities(qs, kc, sup.bias, Hq)
        do = _group_major(dout[rows].to(acc), Hkv)
        delta = (do * _group_major(out[rows].to(acc), Hkv)).sum(dim=-1, keepdim=True)
        ds = torch.baddbmm(delta, do, vc.transpose(1, 2), beta=-1.0).mul_(p)
        dq[rows] = _token_major(torch.bmm(ds, kc).mul_(softmax_scale), C).to(q.dtype)
        dk.index_put_((sup.rows,), torch.bmm(ds.transpose(1, 2), qs).transpose(0, 1),
                      accumulate=True)
        dv.index_put_((sup.rows,), torch.bmm(p.transpose(1, 2), do).transpose(0, 1),
                      accumulate=True)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------------------------------
# Index-branch KL (MSA_SPEC sections 4 and 5)
# ---------------------------------------------------------------------------------------------


def kl_kernel(
    q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, q_idx: torch.Tensor, k_idx: torch.Tensor,
    block_idx: Optional[torch.Tensor], q_pos: torch.Tensor, q_kbase: torch.Tensor,
    block_size: int, softmax_scale: float, index_scale: float, kl_scale: float,
    compute_grad: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kl_scale * sum_{i,p} KL(T[i,p] || Qs[i,p])`` and its gradients to q_idx, k_idx.

    Teacher ``T[i,p,u]``: mean over the query heads h of index head i of the main branch's
    probabilities ``P_h[p,u] = exp(softmax_scale * q[p,h].k[u,g] - lse[p,h])``, recomputed with
    the attention forward's fused softmax (so ``lse`` is not read). Student
    ``Qs = softmax_u(z)``, ``z = index_scale * q_idx[p,i].k_idx[u,i']``. Both on the support
    (``block_idx=None``: the whole causal row); ``0 log 0 = 0``;
    ``KL = sum T (log T - log Qs)`` with ``log Qs = z - logsumexp(z)`` per key, as the oracle.

    Returns:
        ``(kl, dq_idx, dk_idx)``: kl 0-dim float32; ``d kl / d q_idx [Tq, Hi, Di]`` and
        ``d kl / d k_idx [Tk, Hik, Di]`` in the index dtype (empty ``[0]`` unless
        ``compute_grad``), from ``d kl / d z = kl_scale * (Qs - T)`` on the support.
    """
    del lse
    Tq, Hq, _ = q.shape
    Hkv = k.shape[1]
    Hi, Hik = q_idx.shape[1], k_idx.shape[1]
    acc = accumulation_dtype(q.dtype)
    tiny = torch.finfo(acc).tiny  # log(T + tiny): 0 log 0 = 0 with no NaN and no branch
    total = torch.zeros((), dtype=acc, device=q.device)
    if compute_grad:
        dq_idx = torch.zeros(q_idx.shape, dtype=acc, device=q_idx.device)
        dk_idx = torch.zeros(k_idx.shape, dtype=acc, device=k_idx.device)
    for ch in _plan_chunks(q_pos, q_kbase, Hq):
        sup = _chunk_support(ch, q_pos, block_idx, block_size, acc)
        if sup.rows.numel() == 0:
            continue
        C, W = ch.stop - ch.start, sup.rows.numel()
        rows = slice(ch.start, ch.stop)
        kc, ki = _gather_rows(k, sup.rows, acc), _gather_rows(k_idx, sup.rows, acc)
        if not _all_finite(q[rows], q_idx[rows], kc, ki):
            total += _isolated_kl(q, k, q_idx, k_idx, ch, sup, softmax_scale, index_scale,
                                  kl_scale, acc, dq_idx if compute_grad else None,
                                  dk_idx if compute_grad else None)
            continue
        qs = _group_major(q[rows].to(acc) * softmax_scale, Hkv)
        p, _ = _main_probabilities(qs, kc, sup.bias, Hq)
        teacher = p.view(Hkv, C, -1, Hq // Hi, W).mean(dim=3).transpose(0, 1).reshape(C, Hi, W)
        qi = _group_major(q_idx[rows].to(acc) * index_scale, Hik)
        z = _token_major(torch.bmm(qi, ki.transpose(1, 2)), C)
        student, _ = _support_softmax(z + sup.bias)
        # The oracle's formulation: log Qs = z - logsumexp(z) per key, then T (log T - log Qs)
        # summed; never sum(T z) - lse_z sum(T), which cancels at large |z| (|z| ~ 7000 loses
        # four digits in fp32). An empty row has teacher mass 0: no contribution.
        lse_z = torch.logsumexp(z + sup.bias, dim=-1, keepdim=True)
        log_qs = z - torch.where(lse_z < _masked_value(acc) / 2, 0.0, lse_z)
        terms = teacher * (torch.log(teacher + tiny) - log_qs)
        total += torch.where(teacher != 0, terms, 0.0).sum()  # 0 log 0 = 0; NaN is kept
        if compute_grad:
            dz = _group_major(student.sub_(teacher), Hik)
            dq_idx[rows] = _token_major(torch.bmm(dz, ki).mul_(kl_scale * index_scale), C)
            dk_idx.index_put_((sup.rows,), torch.bmm(dz.transpose(1, 2), qi).transpose(0, 1),
                              accumulate=True)
    value = (total * kl_scale).to(torch.float32)
    if not compute_grad:
        return value, q_idx.new_empty((0,)), k_idx.new_empty((0,))
    return value, dq_idx, dk_idx.mul_(kl_scale)


_OPS = register_backend_ops(
    "torch",
    BackendKernels(select=select_kernel, attention_fwd=attention_forward_kernel,
                   attention_bwd=attention_backward_kernel, kl=kl_kernel),
)
select = _OPS.select
attention = _OPS.attention
kl = _OPS.kl
ops = _OPS.ops
