"""Communication of one MSA layer under tensor parallelism (issue 16, CPU with gloo).

- Sequence parallelism: the hidden states are all-gathered once per layer forward for the main
  QKV projection and both index projections (was three times), and once again in backward
  (was twice);
  outputs and gradients equal the TP=1 layer's.
- Replicated index parameters (the index key projection when ``Hik % TP != 0``, the index norms)
  get their partial gradients summed over TP once per step by megatron-core's
  ``finalize_model_grads`` step, not by a hook each micro-batch: with 2 micro-batches the
  gradients equal TP=1's, and no all-reduce of them runs during forward / backward.
"""

from __future__ import annotations

import contextlib

import megatron.core.tensor_parallel  # noqa: F401  imported once: forked ranks inherit it
import pytest
import torch
import torch.distributed as dist

import msa_megatron.megatron  # noqa: F401
from tests.dist_utils import cuda_device_as_cpu, run_distributed, selected_device
from tests.support.gpt_harness import (
    Setup,
    batch,
    build_model,
    full_grads,
    full_tensor,
    sum_qk_norm_grads,
    tolerance,
)

pytestmark = pytest.mark.slow

SEQ, BATCH, HIDDEN = 64, 2, 64
TOL = tolerance(rtol=1e-4, atol=2e-6)


@contextlib.contextmanager
def count_all_gathers():
    """Count every all-gather call of torch.distributed, megatron-core's and msa_megatron's
    aliases included. Yields ``{"calls": n}``."""
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.tensor_parallel.mappings as mappings

    from msa_megatron.parallel import comm

    counts = {"calls": 0}
    targets = [(dist, name) for name in ("all_gather", "all_gather_into_tensor",
                                         "all_gather_single") if hasattr(dist, name)]
    targets += [(module, "dist_all_gather_func") for module in (layers, mappings)
                if hasattr(module, "dist_all_gather_func")]
    targets.append((comm, "_all_gather_flat"))
    originals = [(module, name, getattr(module, name)) for module, name in targets]

    def spy(original):
        def wrapped(*args, **kwargs):
            counts["calls"] += 1
            return original(*args, **kwargs)
        return wrapped

    for module, name, original in originals:
        setattr(module, name, spy(original))
    try:
        yield counts
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def _build_attention(tp: int, sequence_parallel: bool):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import get_gpt_layer_msa_spec

    config = TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=8, num_query_groups=2,
        kv_channels=16, ffn_hidden_size=2 * HIDDEN, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0,
        hidden_dropout=0.0, normalization="RMSNorm", sequence_parallel=sequence_parallel)
    model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    msa = MSAConfig(block_size=16, top_k=2, index_head_dim=16, backend="torch")
    spec = get_gpt_layer_msa_spec(msa, use_te=False, normalization="RMSNorm")
    layer = build_module(spec.submodules.self_attention, config=config, layer_number=1)
    return layer.to(selected_device())


def _sp_worker(rank: int, world_size: int, shared_gather: bool) -> dict:
    from msa_megatron.megatron import attention, reduce_index_grads_over_tp, set_kl_loss_scale
    from tests.support.gpt_harness import tp_group

    set_kl_loss_scale(1.0)
    sp = world_size > 1
    if not shared_gather:  # the fallback: linear_qkv gathers itself (as with TE userbuffers)
        attention.can_run_local = lambda linear: False
    layer = _build_attention(world_size, sp)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(selected_device())
    weights = torch.randn(SEQ, BATCH, HIDDEN, generator=gen).to(selected_device())
    rows = slice(rank * SEQ // world_size, (rank + 1) * SEQ // world_size) if sp else slice(None)
    x = hidden[rows].clone().requires_grad_(True)
    with cuda_device_as_cpu():
        with count_all_gathers() as forward:
            out, _ = layer(x, None)
        with count_all_gathers() as backward:
            (out * weights[rows]).sum().backward()
    reduce_index_grads_over_tp(layer, tp_group())
    grads = {}
    for name, param in layer.named_parameters():
        if param.grad is None:  # linear_proj's bias: returned apart (skip_bias_add)
            continue
        holder = param.grad.detach()
        holder.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
        holder.partition_dim = getattr(param, "partition_dim", 0)
        grads[name] = full_tensor(holder)
    return {"out": out.detach(), "x_grad": x.grad, "grads": grads, "rows": rows,
            "forward_gathers": forward["calls"], "backward_gathers": backward["calls"]}


def test_sequence_parallel_gathers_once_per_layer():
    reference = run_distributed(_sp_worker, 1, args=(True,), tp=1)[0]
    shared = run_distributed(_sp_worker, 2, args=(True,), tp=2)
    fallback = run_distributed(_sp_worker, 2, args=(False,), tp=2)
    for result in shared:
        assert result["forward_gathers"] == 1, result["forward_gathers"]
        # backward: the shard gathered again once for the three weight gradients, plus the
        # gather of linear_proj's output gradient (its forward reduce-scatters)
        assert result["backward_gathers"] == 2, result["backward_gathers"]
    for result in fallback:  # linear_qkv's own gather + one for both index projections
        assert result["forward_gathers"] == 2, result["forward_gathers"]
    for results in (shared, fallback):
        for result in results:
            rows = result["rows"]
            torch.testing.assert_close(result["out"], reference["out"][rows], **TOL)
            torch.testing.assert_close(result["x_grad"], reference["x_grad"][rows], **TOL)
            assert result["grads"].keys() == reference["grads"].keys()
            for name, grad in reference["grads"].items():
                torch.testing.assert_close(result["grads"][name], grad, **TOL, msg=name)
                if "_idx" in name:
                    assert grad.abs().max() > 0, name


@contextlib.contextmanager
def record_all_reduces():
    """Record ``(shape, group size)`` of every torch.distributed.all_reduce call."""
    calls = []
    original = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        calls.append((tuple(tensor.shape), dist.get_world_size(group)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = spy
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _micro_batch_worker(rank: int, world_size: int, micro_batches: int) -> dict:
    """2 layers with index norms and a replicated index key projection; gradients of
    ``micro_batches`` micro-batches accumulated, then megatron-core's finalize step."""
    from msa_megatron.megatron import set_kl_loss_scale
    from msa_megatron.megatron.index import TP_PARTIAL_GRAD_ATTR

    set_kl_loss_scale(1.0 / micro_batches)
    setup = Setup()
    model = build_model(setup, world_size)
    replicated = {tuple(p.shape) for p in model.parameters()
                  if getattr(p, TP_PARTIAL_GRAD_ATTR, False)}
    with record_all_reduces() as step_calls:
        for micro in range(micro_batches):
            tokens, positions, packed = batch(micro, "sbhd")
            loss = model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean()
            (loss / micro_batches).backward()
    with record_all_reduces() as finalize_calls:
        sum_qk_norm_grads(model)  # megatron-core's _allreduce_non_tensor_model_parallel_grads
    return {"grads": full_grads(model), "replicated": replicated,
            "step_calls": step_calls, "finalize_calls": finalize_calls}


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_replicated_index_grads_reduced_once_per_step(micro_batches):
    reference = run_distributed(_micro_batch_worker, 1, args=(micro_batches,), tp=1)[0]
    results = run_distributed(_micro_batch_worker, 2, args=(micro_batches,), tp=2)
    for result in results:
        # k_idx weight [16, 64] and the index q/k norms [16] are replicated at TP=2
        assert result["replicated"] >= {(16, 64), (16,)}
        # no all-reduce of a replicated index gradient during forward / backward
        tp_shapes = {shape for shape, size in result["step_calls"] if size == 2}
        assert not tp_shapes & result["replicated"], tp_shapes
        # finalize: one coalesced all-reduce per reduction kind (sum: main q/k norms; average:
        # the MSA index parameters), whatever the number of micro-batches
        assert len([c for c in result["finalize_calls"] if c[1] == 2]) == 2
        for name, grad in reference["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, **TOL, msg=name)
            if "_idx" in name:
                assert grad.abs().max() > 0, name


def _te_extension_source() -> str:
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("megatron.core.extensions.transformer_engine")
    return Path(spec.origin).read_text()


def test_index_projection_keeps_tp_comm_overlap_on():
    """megatron-core's TELinear turns ``tp_comm_overlap`` off on the config it gets for a buffer
    name outside qkv/proj/fc1/fc2 (read from the installed source here); the index projection
    is built with a private config without overlap, so the shared config keeps it."""
    import re

    from megatron.core.transformer import TransformerConfig

    from msa_megatron.megatron.index import (
        TE_OVERLAP_BUFFER_NAMES,
        index_projection_comm,
        te_disables_overlap,
    )

    source = _te_extension_source()
    rule = re.search(r"tp_comm_buffer_name not in \[([^\]]*)\]\s*\):\s*self\.config\."
                     r"tp_comm_overlap = False", source)
    assert rule, "megatron-core's TELinear overlap rule changed: check index_projection_comm"
    assert tuple(re.findall(r'"(\w+)"', rule.group(1))) == TE_OVERLAP_BUFFER_NAMES

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               use_cpu_initialization=True)
    assert index_projection_comm(config) == (config, None)
    config.tp_comm_overlap = True  # set after construction: its checks want TE and SP
    private, name = index_projection_comm(config)
    assert config.tp_comm_overlap and private is not config and not private.tp_comm_overlap
    assert private.hidden_size == config.hidden_size
    assert not te_disables_overlap(private, name)
    assert te_disables_overlap(config, "q_idx")  # the name the projection was built with before


def _overlap_worker(rank: int, world_size: int) -> dict:
    layer_config = {}
    from megatron.core.transformer import TransformerConfig  # noqa: F401

    layer = _build_attention(world_size, False)
    config = layer.config
    layer_config["same_config"] = layer.index.linear_q_idx.config is config
    return layer_config


def test_index_projection_config_is_shared_without_overlap():
    """Without overlap the projection is built with the layer's own config (no copy)."""
    result = run_distributed(_overlap_worker, 1, tp=1)[0]
    assert result["same_config"]
