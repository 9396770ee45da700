"""One compile per kernel: a second token chunk or a second sequence length makes the GPU's JIT
compile no new variant of a Triton kernel.

Triton specialises a kernel on its int arguments (equal to 1, divisible by 16) and on the
16-byte alignment of its pointers. The chunked kernels take whole tensors plus the chunk's
index and mark the per-chunk and per-length ints ``do_not_specialize``, so the first step
compiles everything a run needs. The keys are Triton's own (sm_90 binder,
:class:`tests.support.jit_keys.JitKeys`); on CPU the launches are recorded without running the
kernels (the host code picks them from the shapes alone).
"""

from __future__ import annotations

import pytest
import torch

import triton
import triton.language as tl

from msa_megatron.core import MSAOptions, msa_layer
from tests.support.jit_keys import JitKeys, interpreting

HEADS = (8, 2, 2, 1)  # Hq, Hkv, Hi, Hik
D = 32
OPTIONS = dict(block_size=16, top_k=4)
# Kernels launched once per token chunk.
CHUNKED = {"_block_keys_kernel", "_topk_kernel", "_attn_fwd_blocks_kernel",
           "_attn_merge_kernel", "_attn_bwd_blocks_kernel", "sum_partials_kernel",
           "_kl_keys_kernel"}


def _device() -> torch.device:
    return torch.device("cpu" if interpreting() else "cuda")


def _step(keys: JitKeys, lengths, mode: str = "sparse") -> dict:
    """One fwd+bwd over documents of ``lengths``; returns the kernels' new keys."""
    dev = _device()
    total = sum(lengths)
    hq, hkv, hi, hik = HEADS
    leaves = [torch.zeros((total, h, D), device=dev, dtype=torch.float16).requires_grad_(True)
              for h in (hq, hkv, hkv, hi, hik)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=dev)
    snap = keys.snapshot()
    with keys.watch(execute=not interpreting()):
        res = msa_layer(*leaves, cu_seqlens=cu, kl_scale=1.0 / total,
                        options=MSAOptions(backend="triton", mode=mode, **OPTIONS))
        torch.autograd.grad((res.out, res.kl), leaves,
                            (torch.ones_like(res.out), torch.ones_like(res.kl)))
    return keys.added(snap)


def _many_chunks(monkeypatch) -> None:
    """Token chunks at their most: 16 in the forward, backward and KL, one selection chunk
    per tile of query tokens."""
    from msa_megatron.ops.triton import _common, selection

    monkeypatch.setattr(_common, "PARTIAL_QS", 0)
    monkeypatch.setattr(_common, "PARTIAL_MIN_BYTES", 1)
    monkeypatch.setattr(selection, "KEY_BUFFER_BYTES", 1)
    monkeypatch.setattr(selection, "MIN_CHUNK_TOKENS", 1)


def test_second_chunk_and_second_length_compile_nothing(monkeypatch):
    keys = JitKeys()
    first = _step(keys, [256])  # one chunk everywhere
    assert CHUNKED <= set(first), f"chunked kernels not launched: {CHUNKED - set(first)}"
    _many_chunks(monkeypatch)
    # 16 chunks (sc0 = 0, 1, ..., 15; sc1 = 1 once), selection chunks with starts 0, 32, ...
    assert _step(keys, [256]) == {}
    assert keys.launches["_topk_kernel"] > 2 and keys.launches["_attn_merge_kernel"] >= 17
    # Lengths not divisible by 16, packed documents, a document of one token.
    for lengths in ([333], [1, 150, 77], [513]):
        assert _step(keys, lengths) == {}, lengths
    chunked = {name: n for name, n in keys.counts().items() if name in CHUNKED}
    # One variant per kernel and constexpr set: the ISO pair, the KL's dense and sparse keys
    # kernel, sum_partials for dQ and dq_idx.
    assert max(chunked.values()) <= 4, chunked


def test_dense_mode_second_length_compiles_nothing():
    keys = JitKeys()
    assert _step(keys, [256], mode="dense")
    for lengths in ([333], [7, 250]):
        assert _step(keys, lengths, mode="dense") == {}, lengths


@triton.jit
def _toy_kernel(x_ptr, n):
    tl.store(x_ptr, n)


@triton.jit(do_not_specialize=("n",))
def _toy_plain_kernel(x_ptr, n):
    tl.store(x_ptr, n)


def test_keys_see_int_and_alignment_specialisation():
    """The recorder sees what Triton specialises on (else the tests above could not fail)."""
    x = torch.zeros(8, dtype=torch.int32, device=_device())
    keys = JitKeys()
    with keys.watch():
        for n in (16, 17, 1, 33):
            _toy_kernel[(1,)](x, n)
            _toy_plain_kernel[(1,)](x, n)
        _toy_plain_kernel[(1,)](x[1:], 5)  # a slice 4 bytes off the 16-byte alignment
    assert keys.counts() == {"_toy_kernel": 3, "_toy_plain_kernel": 2}


@pytest.mark.parametrize("kind", ["interpreter"] if interpreting() else ["jit"])
def test_unexecuted_launches_need_the_interpreter(kind):
    if kind == "jit":
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            with JitKeys().watch(execute=False):
                pass
    else:
        x = torch.zeros(1, dtype=torch.int32)
        with JitKeys().watch(execute=False) as keys:
            _toy_kernel[(1,)](x, 5)
        assert int(x[0]) == 0 and keys.launches["_toy_kernel"] == 1
