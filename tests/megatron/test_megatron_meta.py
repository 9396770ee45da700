"""The MSA GPT layer on the meta device: forward and backward infer shapes (SBHD, THD, padded
THD; fp32 / bf16 / fp16; torch and triton backends) and record no metrics; the reference
backend is refused with a ValueError. One rank (megatron-core needs its process groups)."""

from __future__ import annotations

import megatron.core.models.gpt  # noqa: F401  imported once here: forked ranks inherit it
import pytest
import torch

from tests.dist_utils import run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
S, HIDDEN = 64, 64


def _layer(backend: str, dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import get_gpt_layer_msa_spec

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4,
                               num_query_groups=2, kv_channels=16, use_cpu_initialization=True,
                               params_dtype=dtype, attention_dropout=0.0, hidden_dropout=0.0)
    spec = get_gpt_layer_msa_spec(
        MSAConfig(block_size=16, top_k=2, index_head_dim=16, backend=backend), use_te=False)
    return build_module(spec, config=config, layer_number=1).to("meta")


def _inputs(fmt: str, dtype: torch.dtype):
    from megatron.core.packed_seq_params import PackedSeqParams

    if fmt == "sbhd":
        return torch.empty(S, 2, HIDDEN, dtype=dtype, device="meta", requires_grad=True), None
    x = torch.empty(2 * S, 1, HIDDEN, dtype=dtype, device="meta", requires_grad=True)
    cu = torch.empty(3, dtype=torch.int32, device="meta")
    fields = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=S,
                  max_seqlen_kv=S)
    if fmt == "thd-padded":
        padded = torch.empty(3, dtype=torch.int32, device="meta")
        fields.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    return x, PackedSeqParams(**fields)


def _meta_worker(rank: int, world_size: int) -> dict:
    from msa_megatron.megatron import get_msa_metrics

    results = {}
    for backend in ("torch", "triton"):
        for dtype in DTYPES:
            for fmt in ("sbhd", "thd", "thd-padded"):
                for training in (True, False):
                    layer = _layer(backend, dtype).train(training)
                    x, packed = _inputs(fmt, dtype)
                    out = layer(x, attention_mask=None, packed_seq_params=packed)
                    out = out[0] if isinstance(out, tuple) else out
                    if training:
                        out.float().sum().backward()
                    results[(backend, str(dtype), fmt, training)] = (
                        tuple(out.shape), out.dtype == dtype, out.device.type,
                        None if x.grad is None else tuple(x.grad.shape))
    results["metrics"] = get_msa_metrics(reset=True)
    layer = _layer("reference", torch.float32)
    x, _ = _inputs("sbhd", torch.float32)
    try:
        layer(x, attention_mask=None)
        results["reference"] = "no error"
    except Exception as error:  # noqa: BLE001 - the test compares the kind and message
        results["reference"] = f"{type(error).__name__}: {error}"
    return results


@pytest.fixture(scope="module")
def results():
    return run_distributed(_meta_worker, 1, tp=1)[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt", ["sbhd", "thd", "thd-padded"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_layer_infers_shapes_on_meta(results, backend, dtype, fmt, training):
    shape, same_dtype, device, grad = results[(backend, str(dtype), fmt, training)]
    expected = (S, 2, HIDDEN) if fmt == "sbhd" else (2 * S, 1, HIDDEN)
    assert (shape, same_dtype, device) == (expected, True, "meta")
    assert grad == (expected if training else None)


def test_meta_forwards_record_no_metrics(results):
    assert not any("kl" in key for key in results["metrics"]), results["metrics"]


def test_layer_refuses_meta_on_the_reference_backend(results):
    assert results["reference"].startswith(
        "ValueError: backend='reference' cannot run on meta tensors"), results["reference"]
