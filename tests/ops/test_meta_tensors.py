"""Meta tensors (``device="meta"``: shapes and dtypes, no values) through the public ops.

The ``torch`` and ``triton`` backends infer the output shapes and dtypes (forward and
backward), with or without ``cu_seqlens``, in every float dtype they run; what needs values
(the ``reference`` backend, the selection-recall diagnostic) is refused with a ``ValueError``
that says so. Never a raw ``RuntimeError`` / ``NotImplementedError`` from deep inside.
"""

from __future__ import annotations

import pytest
import torch

from msa_megatron import msa_attention, select_blocks
from msa_megatron.diagnostics import selection_recall
from msa_megatron.ops.validation import check_cu_seqlens

T, HQ, HKV, D, HI, DI, B, K = 200, 4, 2, 32, 2, 32, 32, 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(dtype, requires_grad=False):
    def make(*shape):
        return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=requires_grad)

    return make(T, HQ, D), make(T, HKV, D), make(T, HKV, D), make(T, HI, DI), make(T, 1, DI)


def _cu(with_cu):
    return torch.empty(3, dtype=torch.int32, device="meta") if with_cu else None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton", None])
@pytest.mark.parametrize("mode", ["sparse", "dense"])
@pytest.mark.parametrize("with_cu", [False, True], ids=["one-seq", "cu_seqlens"])
def test_msa_attention_infers_shapes(dtype, backend, mode, with_cu):
    q, k, v, q_idx, k_idx = _inputs(dtype, requires_grad=True)
    out, kl = msa_attention(q, k, v, q_idx, k_idx, _cu(with_cu), block_size=B, top_k=K,
                            mode=mode, backend=backend)
    assert (out.shape, out.dtype, out.device.type) == ((T, HQ, D), dtype, "meta")
    assert (kl.shape, kl.dtype, kl.device.type) == ((), torch.float32, "meta")
    (out.sum() + kl).backward()
    for t in (q, k, v, q_idx, k_idx):
        assert t.grad is not None and t.grad.shape == t.shape and t.grad.device.type == "meta"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("with_cu", [False, True], ids=["one-seq", "cu_seqlens"])
def test_select_blocks_infers_shapes(backend, with_cu):
    _, _, _, q_idx, k_idx = _inputs(torch.float32)
    blocks = select_blocks(q_idx, k_idx, _cu(with_cu), block_size=B, top_k=K, backend=backend)
    assert (blocks.shape, blocks.dtype, blocks.device.type) == ((T, HI, K), torch.int32, "meta")


def test_triton_meta_needs_no_interpreter(monkeypatch):
    """Shape inference launches no kernel, so meta inputs pass the triton device check
    without ``TRITON_INTERPRET=1`` (CPU inputs still do not)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, _, _, q_idx, k_idx = _inputs(torch.bfloat16)
    blocks = select_blocks(q_idx, k_idx, block_size=B, top_k=K, backend="triton")
    assert blocks.shape == (T, HI, K)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        select_blocks(torch.zeros(T, HI, DI), torch.zeros(T, 1, DI), block_size=B, top_k=K,
                      backend="triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_cu", [False, True], ids=["one-seq", "cu_seqlens"])
def test_reference_backend_refuses_meta_clearly(dtype, with_cu):
    q, k, v, q_idx, k_idx = _inputs(dtype)
    with pytest.raises(ValueError, match=r"backend='reference' cannot run on meta tensors"):
        msa_attention(q, k, v, q_idx, k_idx, _cu(with_cu), block_size=B, top_k=K,
                      backend="reference")
    with pytest.raises(ValueError, match=r"backend='reference' cannot run on meta tensors"):
        select_blocks(q_idx, k_idx, _cu(with_cu), block_size=B, top_k=K, backend="reference")


def test_meta_cu_seqlens_still_checks_what_it_can():
    meta = torch.device("meta")
    check_cu_seqlens(torch.empty(4, dtype=torch.int32, device=meta), T, meta)  # values unknown
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        check_cu_seqlens(torch.empty(4, dtype=torch.int64, device=meta), T, meta)
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):
        check_cu_seqlens(torch.empty(2, 2, dtype=torch.int32, device=meta), T, meta)
    with pytest.raises(ValueError, match="cu_seqlens is on meta but the inputs are on cpu"):
        check_cu_seqlens(torch.empty(3, dtype=torch.int32, device=meta), T, torch.device("cpu"))
    q, k, v, q_idx, k_idx = _inputs(torch.float32)
    with pytest.raises(ValueError, match="all inputs must be on one device"):
        msa_attention(q, torch.zeros(k.shape), v, q_idx, k_idx, block_size=B, top_k=K)


def test_selection_recall_refuses_meta_clearly():
    q, k, _, q_idx, k_idx = _inputs(torch.float32)
    rows = torch.arange(0, T, 7, device="meta")
    with pytest.raises(ValueError, match="meta"):
        selection_recall(q, k, q_idx, k_idx, rows, block_size=B, top_k=K, backend="torch")
