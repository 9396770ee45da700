"""One input checker shared by every entry point (MSA_SPEC section 7).

Everything here runs before any kernel is launched and raises ``ValueError`` / ``TypeError``
naming the argument and its shape.

Meta tensors (``device="meta"``: shapes and dtypes, no values) get every check that needs no
values, and the ``torch`` and ``triton`` backends then infer the output shapes, as with the fake
tensors of ``torch.compile``; what depends on values (the ``cu_seqlens`` values, the
``reference`` backend, which computes with them) is skipped or refused with a ``ValueError``.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch

from ..config import (TRITON_BLOCK_SIZES, TRITON_HEAD_DIMS, check_backend, check_block_size,
                      check_mode, check_selection_budget)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Backend-specific limits (the references accept any head dim and any power-of-two block >= 16;
# the triton head dims and block sizes live in config.py, which checks them without tensors).
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _shape(t: torch.Tensor) -> str:
    # an f-string of a list, which torch.compile can trace: under fullgraph=True its
    # Unsupported error then carries this message ("raised exception ValueError(...)")
    return f"{list(t.shape)}"


def check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    """Raise TypeError unless ``t`` is a float tensor with ``ndim`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has unsupported dtype {t.dtype}; expected one of {FLOAT_DTYPES}")
    if t.dim() != ndim:
        hint = ""
        if t.dim() == ndim + 1:
            B, S = t.shape[0], t.shape[1]
            hint = (f"; a batch [B, S, H, D] is packed as one row of T = B * S tokens: pass "
                    f"{name}.reshape(B * S, H, D) and cu_seqlens = torch.arange(B + 1, "
                    f"dtype=torch.int32) * S (here B={B}, S={S}), which keeps the sequences "
                    "apart")
        raise ValueError(f"{name} must have {ndim} dims [T, H, D], got shape {_shape(t)}{hint}")
    return t


def check_same_dtype_device(named: dict) -> None:
    """Raise TypeError/ValueError if the tensors in ``named`` differ in dtype or device."""
    items = [(n, t) for n, t in named.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {first_name} has dtype {first.dtype}; "
                "all inputs must share one dtype"
            )
        if t.device != first.device:
            raise ValueError(
                f"{name} is on {t.device} but {first_name} is on {first.device}; "
                "all inputs must be on one device"
            )


def check_cu_seqlens(cu_seqlens: Optional[torch.Tensor], total: int, device: torch.device
                     ) -> Optional[Tuple[int, ...]]:
    """Validate packed-sequence boundaries (MSA_SPEC section 1).

    Args:
        cu_seqlens: ``[n+1]`` int32, non-decreasing, first 0, last ``total``; or None.
            On the meta device only its type, dtype, shape and device are checked (it has no
            values).
        total: T, the number of packed tokens.
        device: the device of the other inputs.

    Returns:
        The values read on the host (a tuple of ints; one device sync on CUDA), or None when
        there are none to read: ``cu_seqlens`` None, on the meta device or under
        ``torch.compile`` tracing.

    Raises:
        TypeError: not a tensor or not int32.
        ValueError: not 1-D, empty, first != 0, last != T, decreasing, or on another device.
    """
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D with >= 1 entry, got shape {_shape(cu_seqlens)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {device}")
    if cu_seqlens.is_meta:  # no values to check: shape inference only
        return None
    if torch.compiler.is_compiling():
        # The eager checks below read the tensor on the host, which torch.compile cannot trace
        # (fullgraph=True). Traced instead: one device-side assertion over the same conditions
        # (a RuntimeError on CPU; on CUDA a device-side assert, which ends the process): never
        # a silent wrong answer, but not the ValueError of eager mode.
        ok = ((cu_seqlens[0] == 0) & (cu_seqlens[-1] == total)
              & (cu_seqlens[1:] >= cu_seqlens[:-1]).all())
        torch._assert_async(ok, "cu_seqlens must start at 0, end at T and never decrease "
                                "(checked inside torch.compile)")
        return None
    host = cu_seqlens.tolist()
    if host[0] != 0:
        raise ValueError(f"cu_seqlens[0] must be 0, got {host[0]}")
    if host[-1] != total:
        raise ValueError(f"cu_seqlens[-1] must equal T={total}, got {host[-1]}")
    for a, b in zip(host[:-1], host[1:]):
        if b < a:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {host}")
    return tuple(host)


def check_index_inputs(q_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple:
    """Validate the index branch. Returns ``(T, Hi, Hik, Di)``."""
    check_tensor("q_idx", q_idx, 3)
    check_tensor("k_idx", k_idx, 3)
    check_same_dtype_device({"q_idx": q_idx, "k_idx": k_idx})
    T, Hi, Di = q_idx.shape
    if k_idx.shape[0] != T:
        raise ValueError(
            f"q_idx {_shape(q_idx)} and k_idx {_shape(k_idx)} disagree on T (dim 0)"
        )
    if k_idx.shape[2] != Di:
        raise ValueError(
            f"q_idx {_shape(q_idx)} and k_idx {_shape(k_idx)} disagree on the index head dim Di"
        )
    Hik = k_idx.shape[1]
    if Hi < 1 or Hik < 1 or Di < 1:
        raise ValueError(f"empty head or feature dim: q_idx {_shape(q_idx)}, k_idx {_shape(k_idx)}")
    if Hi % Hik:
        raise ValueError(
            f"index heads Hi={Hi} (q_idx {_shape(q_idx)}) must be a multiple of index key heads "
            f"Hik={Hik} (k_idx {_shape(k_idx)})"
        )
    return T, Hi, Hik, Di


def check_main_inputs(q, k, v, q_idx, k_idx) -> tuple:
    """Validate q/k/v against the index branch. Returns ``(T, Hq, Hkv, D, Hi, Hik, Di)``."""
    for name, t in (("q", q), ("k", k), ("v", v), ("q_idx", q_idx), ("k_idx", k_idx)):
        check_tensor(name, t, 3)
    check_same_dtype_device({"q": q, "k": k, "v": v, "q_idx": q_idx, "k_idx": k_idx})
    T, Hi, Hik, Di = check_index_inputs(q_idx, k_idx)
    Tq, Hq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {_shape(k)} and v {_shape(v)} must have the same shape")
    if k.shape[0] != Tq or q_idx.shape[0] != Tq:
        raise ValueError(
            f"T disagrees: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}, q_idx {_shape(q_idx)}, "
            f"k_idx {_shape(k_idx)}"
        )
    Hkv = k.shape[1]
    if k.shape[2] != D:
        raise ValueError(f"q {_shape(q)} and k {_shape(k)} disagree on the head dim D")
    if Hq < 1 or Hkv < 1 or D < 1:
        raise ValueError(f"empty head or feature dim: q {_shape(q)}, k {_shape(k)}")
    if Hq % Hkv:
        raise ValueError(f"query heads Hq={Hq} (q {_shape(q)}) must be a multiple of KV heads Hkv={Hkv}")
    if Hq % Hi:
        raise ValueError(
            f"query heads Hq={Hq} (q {_shape(q)}) must be a multiple of index heads Hi={Hi} "
            f"(q_idx {_shape(q_idx)})"
        )
    if Hi % Hkv:
        raise ValueError(
            f"index heads Hi={Hi} (q_idx {_shape(q_idx)}) must be a multiple of KV heads Hkv={Hkv} "
            f"(k {_shape(k)}), so each index head lies in one query group"
        )
    return Tq, Hq, Hkv, D, Hi, Hik, Di


def check_backend_limits(backend: str, dtype: torch.dtype, head_dims: dict, block_size: int,
                         device: Optional[torch.device] = None,
                         selection: Optional[tuple] = None) -> None:
    """Raise if ``backend`` cannot run this dtype / head dim / block size (/ device / size).

    Args:
        backend: the resolved backend name.
        dtype, head_dims, block_size, device: of the inputs (``head_dims``: name -> size).
        selection: ``(T, Hi, top_k)`` of a sparse attention call, or None (selection alone):
            the Triton attention numbers the ``T * Hi * top_k`` selected entries with int32.

    Raises:
        TypeError: a dtype the backend does not run.
        ValueError: a head dim, block size or device it does not run (``reference`` on meta
            tensors: it computes with the values; ``triton`` off CUDA and off the meta device
            without ``TRITON_INTERPRET=1``).
    """
    if backend == "reference" and device is not None and device.type == "meta":
        raise ValueError(
            "backend='reference' cannot run on meta tensors (the inputs are on the meta "
            "device): it computes the result from their values; backend='torch' or 'triton' "
            "infer the output shapes of meta inputs")
    if backend != "triton":
        return
    if (device is not None and device.type not in ("cuda", "meta")
            and os.environ.get("TRITON_INTERPRET") != "1"):
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got tensors on {device}; use backend='torch', "
            "or set TRITON_INTERPRET=1 before triton is imported to run the kernels in Triton's "
            "CPU interpreter"
        )
    other = "; backend='torch' runs any head dim, block size and float dtype (slower)"
    if dtype not in TRITON_DTYPES:
        raise TypeError(f"backend='triton' supports dtypes {TRITON_DTYPES}, got {dtype}{other}")
    for name, dim in head_dims.items():
        if dim not in TRITON_HEAD_DIMS:
            raise ValueError(
                f"backend='triton' supports {name} in {TRITON_HEAD_DIMS}, got {dim}{other}")
    if block_size not in TRITON_BLOCK_SIZES:
        raise ValueError(f"backend='triton' supports block_size in {TRITON_BLOCK_SIZES}, got "
                         f"{block_size}{other}")
    if selection is not None and math.prod(selection) >= 2 ** 31:
        t, hi, top_k = selection
        raise ValueError(
            f"backend='triton' numbers the T * Hi * top_k selected entries with int32, got "
            f"T={t} tokens x Hi={hi} index heads x top_k={top_k} = {math.prod(selection)} "
            f">= 2^31; split the batch (fewer tokens per call) or lower top_k")


def check_options(block_size, top_k, init_blocks, local_blocks, backend,
                  mode="sparse") -> tuple:
    """Validate the scalar options shared by ``select_blocks`` and ``msa_attention``.

    Returns:
        ``(block_size, top_k, init_blocks, local_blocks)`` as ints (numpy integers accepted).
    """
    block_size = check_block_size(block_size)
    selection = check_selection_budget(top_k, init_blocks, local_blocks)
    check_backend(backend)
    check_mode(mode)
    return (block_size,) + selection
