"""Dense (warmup) mode main branch through the fastest dense attention the machine has.

In dense mode (MSA_SPEC section 5) the main branch is ordinary causal attention per sequence.
The Triton backend takes its output and LSE from a vendor kernel when one applies, and keeps
its own kernels otherwise (CPU, the general query layout of context parallelism, unsupported
dtypes or head dims). The KL pass then reads that LSE unchanged.

Routes (CUDA only, tried in this order; ``MSA_DENSE_BACKEND`` picks one):

- ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its ``_backward`` (the pair
  PyTorch's own autograd uses for ``F.scaled_dot_product_attention`` on cuDNN) on a
  ``[B, H, S, D]`` view of the packed ``[T, H, D]`` tensors (BSHD memory, no copy), native GQA.
  Only for layouts whose sequences all have the same length (``B`` sequences of ``S`` tokens;
  one sequence is the common case); other layouts take the next route. Not the varlen (THD,
  ``cum_seq``) entry: in PyTorch 2.11 ``aten._cudnn_attention_backward`` sizes cuDNN's dQ
  accumulator from ``query.size(2)``, the head dim of a THD tensor, instead of ``max_q``
  (pytorch/pytorch PR 186142), so dQ is garbage (or an illegal address) once a sequence is
  longer than the head dim. Its backward is not deterministic (PyTorch says so when
  deterministic algorithms are enabled, and offers no deterministic mode).
- ``flash``: ``aten._flash_attention_forward/backward`` (FlashAttention-2, varlen, native GQA).
  Its backward is deterministic when asked (the dQ accumulation is split and summed in a fixed
  order; PyTorch enables that under ``torch.use_deterministic_algorithms(True)``, which this
  module sets around the call only).

Backward: deterministic by default (the project's rule), so the default backward is ``flash``
in its deterministic mode, else our own kernels; ``MSA_DENSE_DETERMINISTIC=0`` lets the backward
use the forward's route (cuDNN's, the fastest). ``torch.use_deterministic_algorithms(True)``
always forces the deterministic choice. docs/DENSE_MODE.md gives the cost of each.

Every route is checked once per (device, dtype, head dim, GQA or not) on a small packed problem
against a float32 computation before it is used; a route that raises or disagrees is skipped
(with a warning), so a PyTorch version with different operator conventions falls back instead
of giving wrong results. :func:`route_report` says what was chosen. Inputs holding NaN/Inf
take our kernels (MSA_SPEC section 7: a vendor kernel's ``0 * NaN`` inside a tile reaches rows
whose support does not hold the value).
"""

from __future__ import annotations

import os
import warnings
import weakref
from contextlib import contextmanager
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from .host_reads import FiniteCheck

BACKEND_ENV = "MSA_DENSE_BACKEND"  # auto (default) | cudnn | flash | kernels
DETERMINISTIC_ENV = "MSA_DENSE_DETERMINISTIC"  # 1 (default) | 0
_CHOICES = ("auto", "cudnn", "flash", "kernels")
_DTYPES = (torch.float16, torch.bfloat16)
_PROBE_TOL = {torch.float16: 2e-2, torch.bfloat16: 5e-2}  # relative (norm) error vs fp32
# Where the vendor forward's finiteness check sits (dense_forward): "before" (q, k, v summed
# before it, always; the host runs ahead by the whole forward) or "auto" (after the forward, on
# its LSE, for a route whose LSE marks bad query rows: no 0.5 GB sum of q at 32K, but the host
# waits for the forward; before it otherwise). Both give the same results; docs/DENSE_MODE.md
# has what each cost on an H100.
FORWARD_CHECK = "before"
_SEQS_ATTR = "_msa_dense_sequences"  # sequences_of's memo on q_pos


class Sequences(NamedTuple):
    """Packed THD layout of a standard (non-CP) call: ``cu_seqlens [n+1]`` int32 on the device
    (zero-length sequences dropped), the longest and the shortest sequence (``min_len`` 0:
    unknown)."""

    cu_seqlens: torch.Tensor
    max_len: int
    min_len: int = 0

    @property
    def uniform(self) -> bool:
        """All sequences have the same length (``max_len``), so the packed tensors are
        ``[B, S, ...]`` with ``S = max_len``."""
        return self.min_len == self.max_len > 0


class Route(NamedTuple):
    """A vendor dense attention: ``forward(q, k, v, seqs, scale) -> (out [T, Hq, D],
    lse [T, Hq] fp32)`` and ``backward(dout, q, k, v, out, lse, seqs, scale, deterministic)
    -> (dq, dk, dv)``; ``deterministic_backward``: whether ``backward(..., True)`` is;
    ``accepts(seqs) -> bool``: the layouts it takes (None: every standard layout)."""

    name: str
    forward: Callable
    backward: Callable
    deterministic_backward: bool
    accepts: Optional[Callable[[Sequences], bool]] = None

    def takes(self, seqs: Optional[Sequences]) -> bool:
        """Whether this route takes the layout ``seqs`` (None: not known yet, assume so)."""
        return seqs is None or self.accepts is None or bool(self.accepts(seqs))


_NATIVE_LSE: Dict[str, tuple] = {}  # route -> (leading 1, heads first, trailing 1s) seen


def _lse_to_th(route: str, lse: torch.Tensor, total: int, heads: int) -> torch.Tensor:
    """A vendor LSE (``[Hq, T]``, ``[T, Hq]``, a leading 1, trailing 1s) as ``[T, Hq]`` fp32;
    remembers the vendor layout so :func:`_lse_from_th` can give it back to the backward."""
    trailing = 0
    while lse.dim() > 2 and lse.shape[-1] == 1:
        lse, trailing = lse.squeeze(-1), trailing + 1
    leading = lse.dim() == 3 and lse.shape[0] == 1
    if leading:
        lse = lse[0]
    heads_first = tuple(lse.shape) == (heads, total) and heads != total
    if heads_first:
        lse = lse.t()
    if tuple(lse.shape) != (total, heads):
        raise RuntimeError(f"unexpected LSE shape {tuple(lse.shape)} for T={total}, Hq={heads}")
    _NATIVE_LSE[route] = (leading, heads_first, trailing)
    return lse.float().contiguous()


def _lse_from_th(route: str, lse: torch.Tensor) -> torch.Tensor:
    leading, heads_first, trailing = _NATIVE_LSE.get(route, (False, True, 0))
    out = lse.t() if heads_first else lse
    if leading:
        out = out.unsqueeze(0)
    for _ in range(trailing):
        out = out.unsqueeze(-1)
    return out.contiguous()


@contextmanager
def _deterministic_algorithms(enabled: bool):
    if not enabled:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def _seed_pair(device) -> Tuple[torch.Tensor, torch.Tensor]:
    # dropout is 0: the kernels never read the seed/offset, but the schemas want tensors.
    return (torch.zeros(2, dtype=torch.int64, device=device),
            torch.zeros((), dtype=torch.int64, device=device))


def _cudnn_ops():
    """The cuDNN route's two ATen operators: PyTorch's cuDNN SDPA forward and backward (dense
    ``[B, H, S, D]`` entry, ``cum_seq`` undefined). Looked up per call (tests replace this)."""
    return (torch.ops.aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default)


def _cudnn_takes(seqs: Sequences) -> bool:
    return seqs.uniform


def _bhsd(t: torch.Tensor, S: int) -> torch.Tensor:
    """A contiguous packed ``[B*S, H, D]`` tensor as the ``[B, H, S, D]`` view cuDNN takes
    (BSHD memory: strides ``(S*H*D, D, H*D, 1)``, the layout PyTorch's SDPA passes for
    ``x.transpose(1, 2)`` of ``[B, S, H, D]``); no copy."""
    T, H, D = t.shape
    return t.view(T // S, S, H, D).transpose(1, 2)


def _from_bhsd(t: torch.Tensor, shape) -> torch.Tensor:
    """A ``[B, H, S, D]`` result back to packed ``[T, H, D]`` (a view when it has BSHD memory,
    which cuDNN gives outputs and gradients of BSHD inputs)."""
    return t.transpose(1, 2).reshape(shape).contiguous()


def _cudnn_forward(q, k, v, seqs: Sequences, scale: float):
    if not seqs.uniform:
        raise ValueError(f"cuDNN route: sequences of unequal lengths (max {seqs.max_len}, "
                         f"min {seqs.min_len}) are not taken")
    fwd, _ = _cudnn_ops()
    S = seqs.max_len
    res = fwd(_bhsd(q, S), _bhsd(k, S), _bhsd(v, S), None, True, 0.0, True, False, scale=scale)
    out, lse = _from_bhsd(res[0], q.shape), res[1]
    trailing = 0
    while lse.dim() > 3 and lse.shape[-1] == 1:  # [B, Hq, S] or [B, Hq, S, 1]
        lse, trailing = lse.squeeze(-1), trailing + 1
    B, Hq = q.shape[0] // S, q.shape[1]
    if tuple(lse.shape) != (B, Hq, S):
        raise RuntimeError(f"cuDNN route: unexpected LSE shape {tuple(res[1].shape)} for "
                           f"B={B}, Hq={Hq}, S={S}")
    _NATIVE_LSE["cudnn"] = (False, True, trailing)
    return out, lse.transpose(1, 2).reshape(q.shape[0], Hq).float().contiguous()


def _cudnn_backward(dout, q, k, v, out, lse, seqs: Sequences, scale: float, deterministic):
    """cuDNN SDPA backward on the ``[B, H, S, D]`` views, as PyTorch's autograd calls it: the
    forward's LSE layout back (``[B, Hq, S]`` fp32 contiguous, plus the trailing 1s the forward
    had), ``grad_out`` and ``out`` in the same memory layout as the forward's output, no
    attn_bias (None: undefined), ``cum_seq`` undefined (the dense entry), ``max_q = max_k = S``
    (the dense entry reads s_q/s_kv from them), dropout 0 (seed/offset never read).
    Not deterministic (``deterministic`` cannot change that)."""
    if not seqs.uniform:
        raise ValueError(f"cuDNN route: sequences of unequal lengths (max {seqs.max_len}, "
                         f"min {seqs.min_len}) are not taken")
    _, bwd = _cudnn_ops()
    S = seqs.max_len
    T, Hq = lse.shape
    native = lse.view(T // S, S, Hq).transpose(1, 2).contiguous()
    for _ in range(_NATIVE_LSE.get("cudnn", (False, True, 0))[2]):
        native = native.unsqueeze(-1)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = bwd(_bhsd(dout.contiguous(), S), _bhsd(q, S), _bhsd(k, S), _bhsd(v, S),
                     _bhsd(out, S), native, seed, offset, None, None, None, S, S, 0.0, True,
                     scale=scale)
    return _from_bhsd(dq, q.shape), _from_bhsd(dk, k.shape), _from_bhsd(dv, v.shape)


def _flash_forward(q, k, v, seqs: Sequences, scale: float):
    res = torch.ops.aten._flash_attention_forward(
        q, k, v, seqs.cu_seqlens, seqs.cu_seqlens, seqs.max_len, seqs.max_len, 0.0, True, False,
        scale=scale)
    return res[0], _lse_to_th("flash", res[1], q.shape[0], q.shape[1])


def _flash_backward(dout, q, k, v, out, lse, seqs: Sequences, scale: float, deterministic):
    seed, offset = _seed_pair(q.device)
    native = _lse_from_th("flash", lse)  # varlen FlashAttention-2: [Hq, T]
    with _deterministic_algorithms(deterministic):
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, native, seqs.cu_seqlens, seqs.cu_seqlens,
            seqs.max_len, seqs.max_len, 0.0, True, seed, offset, scale=scale)
    return dq, dk, dv


ROUTES: Dict[str, Route] = {
    "cudnn": Route("cudnn", _cudnn_forward, _cudnn_backward, deterministic_backward=False,
                   accepts=_cudnn_takes),
    "flash": Route("flash", _flash_forward, _flash_backward, deterministic_backward=True),
}
_PROBED: Dict[tuple, Optional[str]] = {}  # (route, device, dtype, D, gqa) -> None if ok else why
# (route, device, dtype, D, gqa) -> whether the route's LSE marks every bad query row
_LSE_GUARDS: Dict[tuple, bool] = {}


def backend_setting() -> str:
    """``MSA_DENSE_BACKEND`` (``auto`` unless set). Raises ValueError for an unknown name."""
    name = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if name not in _CHOICES:
        raise ValueError(f"{BACKEND_ENV} must be one of {_CHOICES}, got {name!r}")
    return name


def deterministic_setting() -> bool:
    """Deterministic backward wanted: ``MSA_DENSE_DETERMINISTIC`` (default 1) or PyTorch's
    deterministic-algorithms mode."""
    flag = os.environ.get(DETERMINISTIC_ENV, "1").strip().lower() not in ("0", "false", "no")
    return flag or torch.are_deterministic_algorithms_enabled()


def standard_sequences(q_pos: torch.Tensor, q_kbase: torch.Tensor, total_k: int
                       ) -> Optional[Sequences]:
    """The packed sequences of a standard layout, or None for the general (CP) layout.

    Standard: as many query rows as key rows and query ``t`` at key row ``t``
    (``q_kbase + q_pos == t``). Reads the layout on the host (two synchronisations); the
    result carries the longest and the shortest sequence.
    """
    total = q_pos.shape[0]
    if total != total_k or total == 0:
        return None
    rows = torch.arange(total, device=q_pos.device, dtype=torch.int64)
    if not bool(torch.equal(q_kbase.to(torch.int64) + q_pos.to(torch.int64), rows)):
        return None
    starts = torch.nonzero(q_pos == 0).flatten()
    bounds = torch.cat([starts, starts.new_tensor([total])])
    lengths = bounds[1:] - bounds[:-1]
    max_len, min_len = (int(n) for n in torch.stack([lengths.max(), lengths.min()]).tolist())
    return Sequences(bounds.to(torch.int32).contiguous(), max_len, min_len)


def sequences_of(q_pos: torch.Tensor, q_kbase: torch.Tensor, total_k: int
                 ) -> Optional[Sequences]:
    """:func:`standard_sequences`, remembered on the ``q_pos`` tensor object (an attribute, so
    it lives as long as the tensor): the backward, which gets the forward's ``q_pos`` and
    ``q_kbase`` back, and later layers given the same tensors read the layout without a host
    sync. A hit needs the same ``q_kbase`` object, both tensors unmodified since
    (``_version``) and the same ``total_k``; anything else reads the layout again."""
    memo = getattr(q_pos, _SEQS_ATTR, None)
    if memo is not None:
        version, kbase_ref, kbase_version, memo_total, seqs = memo
        if (version == q_pos._version and kbase_ref() is q_kbase
                and kbase_version == q_kbase._version and memo_total == total_k):
            return seqs
    seqs = standard_sequences(q_pos, q_kbase, total_k)
    try:
        setattr(q_pos, _SEQS_ATTR, (q_pos._version, weakref.ref(q_kbase), q_kbase._version,
                                    total_k, seqs))
    except (AttributeError, TypeError, RuntimeError):  # a tensor subclass without attributes
        pass
    return seqs


def _supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    D = q.shape[-1]
    return (q.is_cuda and q.dtype in _DTYPES and D % 8 == 0 and D <= 256
            and q.shape[1] % k.shape[1] == 0)


def _probe(route: Route, q: torch.Tensor, k: torch.Tensor) -> Optional[str]:
    """Run ``route`` once on a small packed GQA problem; None if it matches fp32 math."""
    key = (route.name, str(q.device), q.dtype, q.shape[-1], q.shape[1] != k.shape[1])
    if key in _PROBED:
        return _PROBED[key]
    why = None
    try:
        why = _check_route(route, q.device, q.dtype, q.shape[-1], 2 if key[-1] else 1)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this route
        why = f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"
    if why is None:  # what dense_forward may skip for this route (lse_guards_q)
        lse_guards_q(route, q, k)
    if why is not None:
        warnings.warn(f"msa_megatron dense route {route.name!r} not used on {q.device} "
                      f"({q.dtype}, D={q.shape[-1]}): {why}", RuntimeWarning, stacklevel=3)
    _PROBED[key] = why
    return why


def _lse_guards_q(route: Route, device, dtype, D: int, group: int) -> bool:
    """Whether ``route``'s forward gives every query row holding NaN/Inf a non-finite LSE (so
    its forward can skip summing ``q`` and check its LSE afterwards, :func:`dense_forward`).

    Two sequences of 316 tokens (equal lengths: every route takes them) with bad query rows: a
    NaN entry, ``+inf`` against keys of both signs, and ``-inf`` against keys that are all
    positive in that dimension (every score of the row ``-inf``: the case a vendor kernel may
    give a finite sentinel LSE), in the first key tile, past the second 128-key tile (a
    kernel's unmasked key loop) and at a sequence start; the good rows must keep a finite LSE.
    Any exception: False."""
    try:
        gen = torch.Generator(device="cpu").manual_seed(13)
        S, Hkv = 316, 2
        T, Hq = 2 * S, Hkv * group
        q, k, v = (torch.randn(T, h, D, generator=gen) for h in (Hq, Hkv, Hkv))
        k[:, 0, 0] = k[:, 0, 0].abs() + 0.5
        bad = {(20, 0): float("-inf"), (50, 0): float("nan"), (80, Hq - 1): float("inf"),
               (290, 0): float("-inf"), (300, Hq - 1): float("nan"), (S, 0): float("-inf"),
               (S + 270, 0): float("inf")}
        for (row, head), value in bad.items():
            q[row, head, 0] = value
        q, k, v = (t.to(device, dtype) for t in (q, k, v))
        seqs = Sequences(torch.tensor([0, S, T], dtype=torch.int32, device=device), S, S)
        _, lse = route.forward(q, k, v, seqs, D ** -0.5)
        want = torch.zeros(T, Hq, dtype=torch.bool)
        for row, head in bad:
            want[row, head] = True
        return bool(torch.equal(~torch.isfinite(lse.float().cpu()), want))
    except Exception:  # noqa: BLE001 - any failure: keep summing q before the vendor call
        return False


def _probe_lengths(route: Route, D: int) -> list:
    """The probe's packed sequences: a zero-length and a length-1 one among others, the longest
    longer than the head dim (a vendor call that confuses the two fails), odd lengths (partial
    tiles); equal lengths for a route that takes only those."""
    longest = max(186, D + 61)
    varlen = [70, 1, 0, longest]
    seqs = Sequences(torch.zeros(4, dtype=torch.int32), longest, 1)
    return varlen if route.takes(seqs) else [longest, longest]


def _check_route(route: Route, device, dtype, D: int, group: int) -> Optional[str]:
    gen = torch.Generator(device="cpu").manual_seed(12)
    lengths = _probe_lengths(route, D)
    T, Hkv = sum(lengths), 2
    Hq = Hkv * group
    q, k, v, dout = (torch.randn(T, h, D, generator=gen).to(device, dtype)
                     for h in (Hq, Hkv, Hkv, Hq))
    cu = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
    present = [n for n in lengths if n > 0]
    seqs = Sequences(torch.unique_consecutive(cu).to(device, torch.int32), max(present),
                     min(present))
    scale = D ** -0.5
    out, lse = route.forward(q, k, v, seqs, scale)
    dq, dk, dv = route.backward(dout, q, k, v, out, lse, seqs, scale, route.deterministic_backward)
    want = _math_reference(q, k, v, dout, cu.tolist(), scale)
    got = (out, lse, dq, dk, dv)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if tuple(a.shape) != tuple(b.shape):
            return f"{name} shape {tuple(a.shape)} != {tuple(b.shape)}"
        err = (a.float() - b).norm() / b.norm().clamp_min(1e-30)
        if not bool(torch.isfinite(err)) or float(err) > _PROBE_TOL[dtype]:
            return f"{name} relative error {float(err):.3g}"
    return None


def _math_reference(q, k, v, dout, cu, scale):
    """fp32 dense causal attention per sequence and its gradients, written out (no autograd):
    ``(out [T, Hq, D], lse [T, Hq], dq, dk [T, Hkv, D], dv)``, all fp32.

    The probe runs inside the custom op's implementation, below the Autograd dispatch key,
    where autograd records nothing even under ``torch.enable_grad()``; so the backward is the
    explicit softmax-attention backward. Per sequence and query head ``h`` (KV head ``h // G``):
    ``P = softmax(S)``, ``S = scale Q K^T`` causal; ``dV = P^T dO``, ``dP = dO V^T``,
    ``dS = P (dP - rowsum(dO * O))``, ``dQ = scale dS K``, ``dK = scale dS^T Q``; dK and dV are
    summed over the ``G`` query heads of a group. Zero-length sequences are skipped.
    """
    qf, kf, vf, of = (t.detach().float() for t in (q, k, v, dout))
    T, Hq, D = qf.shape
    Hkv = kf.shape[1]
    G = Hq // Hkv
    out = qf.new_zeros(T, Hq, D)
    lse = qf.new_zeros(T, Hq)
    dq = qf.new_zeros(T, Hq, D)
    dk = qf.new_zeros(T, Hkv, D)
    dv = qf.new_zeros(T, Hkv, D)
    for a, b in zip(cu[:-1], cu[1:]):
        if b == a:
            continue
        qs = qf[a:b].transpose(0, 1)  # [Hq, n, D]
        ks = kf[a:b].repeat_interleave(G, 1).transpose(0, 1)
        vs = vf[a:b].repeat_interleave(G, 1).transpose(0, 1)
        do = of[a:b].transpose(0, 1)
        s = torch.matmul(qs, ks.transpose(1, 2)) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
        row_lse = torch.logsumexp(s, -1)  # [Hq, n]
        p = torch.exp(s - row_lse[..., None])
        o = torch.matmul(p, vs)
        dp = torch.matmul(do, vs.transpose(1, 2))
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        out[a:b] = o.transpose(0, 1)
        lse[a:b] = row_lse.t()
        dq[a:b] = (torch.matmul(ds, ks) * scale).transpose(0, 1)
        dk_h = torch.matmul(ds.transpose(1, 2), qs) * scale  # [Hq, n, D]
        dv_h = torch.matmul(p.transpose(1, 2), do)
        dk[a:b] = dk_h.view(Hkv, G, b - a, D).sum(1).transpose(0, 1)
        dv[a:b] = dv_h.view(Hkv, G, b - a, D).sum(1).transpose(0, 1)
    return out, lse, dq, dk, dv


def forward_route(q: torch.Tensor, k: torch.Tensor, seqs: Optional[Sequences] = None
                  ) -> Optional[Route]:
    """The route for the dense forward of these inputs (None: use our kernels); with ``seqs``,
    only a route that takes that layout (:attr:`Route.accepts`)."""
    setting = backend_setting()
    if setting == "kernels" or not _supported(q, k):
        return None
    names = ("cudnn", "flash") if setting == "auto" else (setting,)
    for name in names:
        if ROUTES[name].takes(seqs) and _probe(ROUTES[name], q, k) is None:
            return ROUTES[name]
    return None


def backward_route(q: torch.Tensor, k: torch.Tensor, seqs: Optional[Sequences] = None
                   ) -> Tuple[Optional[Route], bool]:
    """``(route, deterministic)`` for the dense backward (route None: use our kernels, which
    are deterministic). With a deterministic backward wanted, only a route whose backward can
    be deterministic is taken; with ``seqs``, only a route that takes that layout."""
    setting = backend_setting()
    if setting == "kernels" or not _supported(q, k):
        return None, True
    deterministic = deterministic_setting()
    names = ("cudnn", "flash") if setting == "auto" else (setting,)
    for name in names:
        route = ROUTES[name]
        if deterministic and not route.deterministic_backward:
            continue
        if route.takes(seqs) and _probe(route, q, k) is None:
            return route, deterministic
    return None, True


def _refuse(route: Route, q, k, err: Exception) -> None:
    """A route that passed its probe failed on a real problem (e.g. a size limit): warn once
    and never use it again for this (device, dtype, D, GQA); the caller falls back."""
    key = (route.name, str(q.device), q.dtype, q.shape[-1], q.shape[1] != k.shape[1])
    first_line = str(err).splitlines()[0][:200] if str(err) else ""
    why = f"{type(err).__name__} at T={q.shape[0]}: {first_line}"
    _PROBED[key] = why
    warnings.warn(f"msa_megatron dense route {route.name!r} failed, using the next one: {why}",
                  RuntimeWarning, stacklevel=3)


def lse_guards_q(route: Route, q: torch.Tensor, k: torch.Tensor) -> bool:
    """:func:`_lse_guards_q` for inputs like ``q``/``k``, run once per (route, device, dtype,
    head dim, GQA or not) and remembered."""
    key = (route.name, str(q.device), q.dtype, q.shape[-1], q.shape[1] != k.shape[1])
    if key not in _LSE_GUARDS:
        _LSE_GUARDS[key] = _lse_guards_q(route, q.device, q.dtype, q.shape[-1],
                                         q.shape[1] // k.shape[1])
    return _LSE_GUARDS[key]


def dense_forward(q, k, v, q_pos, q_kbase, softmax_scale: float):
    """``(out [T, Hq, D], lse [T, Hq] fp32)`` from a vendor route, or None when none applies
    (caller runs its own kernels). Inputs as in the backend contract (``block_idx=None``);
    inputs holding NaN/Inf never get a vendor route's result.

    The finiteness check (:class:`~msa_megatron.ops.host_reads.FiniteCheck`) never drains the
    GPU's queue. With :data:`FORWARD_CHECK` ``"auto"`` and a route whose LSE marks every query
    row holding NaN/Inf (:func:`lse_guards_q`, checked once per route and input kind), ``q`` is
    not summed (0.5 GB at the paper's 32K): the vendor forward runs and its LSE, ``k`` and ``v``
    are checked afterwards (the host waits for the forward). Otherwise (``"before"``, the
    default) ``q``, ``k`` and ``v`` are summed before the vendor forward is queued and read
    after it, so the host runs ahead of the GPU by the whole forward. A non-finite result
    drops the vendor's output (fresh tensors) for our kernels. The layout read on the host is
    remembered on ``q_pos`` for the backward (:func:`sequences_of`)."""
    if forward_route(q, k) is None:  # nothing to use whatever the layout: no host sync
        return None
    seqs = sequences_of(q_pos, q_kbase, k.shape[0])
    if seqs is None:
        return None
    before = None
    while True:
        route = forward_route(q, k, seqs)
        if route is None:
            return None
        after = FORWARD_CHECK == "auto" and lse_guards_q(route, q, k)
        if not after and before is None:
            before = FiniteCheck(q, k, v)
        try:
            out, lse = route.forward(q.contiguous(), k.contiguous(), v.contiguous(), seqs,
                                     float(softmax_scale))
        except RuntimeError as err:
            _refuse(route, q, k, err)
            continue
        check = before if before is not None else FiniteCheck(lse, k, v)
        return (out, lse) if check.ok() else None


def dense_backward(dout, q, k, v, out, lse, q_pos, q_kbase, softmax_scale: float):
    """``(dq, dk, dv)`` from a vendor route, or None (caller runs its own kernels, which take
    any route's ``out`` and ``lse``); NaN/Inf in q, k, v or dout never take a vendor route's
    result (q through ``lse``, the forward's of the same q: see the body). No host read drains
    the GPU's queue: the layout comes from the forward (:func:`sequences_of`), and the
    finiteness check is queued before the vendor backward and read after it is queued."""
    if backward_route(q, k)[0] is None:  # nothing to use whatever the layout: no host sync
        return None
    seqs = sequences_of(q_pos, q_kbase, k.shape[0])
    if seqs is None:
        return None
    # q not summed again (0.5 GB at 32K): lse is the forward's of this q, and a NaN/Inf in
    # query row p makes every score of the row NaN or +-Inf (all -Inf: lse -Inf), so lse[p] is
    # non-finite. k is summed: an Inf key can give -Inf scores only, leaving lse finite, and a
    # vendor kernel would spread it (0 * Inf) to earlier rows of its tiles.
    check = FiniteCheck(lse, k, v, dout)
    while True:
        route, deterministic = backward_route(q, k, seqs)
        if route is None:
            return None
        try:
            grads = route.backward(dout, q.contiguous(), k.contiguous(), v.contiguous(),
                                   out.contiguous(), lse, seqs, float(softmax_scale),
                                   deterministic)
        except RuntimeError as err:
            _refuse(route, q, k, err)
            continue
        return grads if check.ok() else None


def route_report(q: torch.Tensor, k: torch.Tensor) -> dict:
    """What the dense mode uses for inputs like ``q``/``k``: forward and backward route names
    (``"kernels"`` = ours), the deterministic flag, why any probed route was refused, and
    whether the forward skips summing ``q`` (:func:`lse_guards_q`)."""
    fwd = forward_route(q, k)
    bwd, deterministic = backward_route(q, k)
    refused = {f"{k_[0]} {k_[2]} D={k_[3]} gqa={k_[4]}": why
               for k_, why in _PROBED.items() if why is not None}
    return {"forward": fwd.name if fwd else "kernels", "backward": bwd.name if bwd else "kernels",
            "deterministic": deterministic, "setting": backend_setting(), "refused": refused,
            "forward_reads_q_through_lse": bool(fwd is not None and FORWARD_CHECK == "auto"
                                                and lse_guards_q(fwd, q, k))}


__all__ = ["ROUTES", "Route", "Sequences", "backward_route", "dense_backward", "dense_forward",
           "forward_route", "lse_guards_q", "route_report", "sequences_of", "standard_sequences"]
