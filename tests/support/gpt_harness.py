"""A tiny megatron-core GPT with MSA layers, trained for a few SGD steps on every rank.

Used by the multi-rank tests (run through :func:`tests.dist_utils.run_distributed`) and by
``gpu_check.py``. Every tensor that leaves a worker is on the CPU and, for TP-sharded parameters,
gathered to the full (TP=1) shape, so results of different TP sizes compare directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import megatron.core.models.gpt  # noqa: F401  imported once here: forked ranks inherit it
import torch
import torch.distributed as dist

import msa_megatron.megatron  # noqa: F401
from tests.dist_utils import selected_device
from tests.support.devices import BACKEND_ENV, tolerance  # noqa: F401  (re-exported)
from tests.support.spies import count_selections

VOCAB = 256
SEQ = 96
BATCH = 2
LR = 0.5


@dataclass
class Setup:
    """Model and run options of one worker."""

    heads: int = 8
    groups: int = 2
    hidden: int = 64
    kv_channels: int = 16
    layers: int = 2
    index_heads: Optional[int] = None
    index_key_heads: int = 1
    index_head_dim: int = 16
    block_size: int = 16
    top_k: int = 3
    qk_layernorm: bool = True
    recompute: Optional[str] = None  # None, "selective" (core_attn) or "full"
    formats: List[str] = field(default_factory=lambda: ["sbhd", "thd", "sbhd"])
    mode: str = "sparse"
    backend: str = field(default_factory=lambda: os.environ.get(BACKEND_ENV, "torch"))
    seq: int = SEQ
    sequence_parallel: bool = False
    use_te: Optional[bool] = None  # None: Transformer Engine layers when TE imports
    kl_coeff: float = 1.0
    seed: int = 1234
    config_extra: Dict[str, object] = field(default_factory=dict)  # more TransformerConfig fields


def recompute_config(recompute: Optional[str]) -> dict:
    """TransformerConfig keywords for ``Setup.recompute``: None, ``"selective"`` (core attention
    only) or ``"full"`` (uniform, one layer per checkpoint). Raises ValueError for any other."""
    if recompute is None:
        return {}
    if recompute == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform",
                    recompute_num_layers=1)
    raise ValueError(f"recompute must be None, 'selective' or 'full', got {recompute!r}")


def build_model(setup: Setup, tp: int):
    """GPTModel with the MSA spec; identical initial weights for every TP size."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import get_gpt_layer_msa_spec

    config = TransformerConfig(
        num_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
        num_query_groups=setup.groups, kv_channels=setup.kv_channels,
        ffn_hidden_size=2 * setup.hidden, tensor_model_parallel_size=tp,
        use_cpu_initialization=True, params_dtype=torch.float32, attention_dropout=0.0,
        hidden_dropout=0.0, normalization="RMSNorm", qk_layernorm=setup.qk_layernorm,
        sequence_parallel=setup.sequence_parallel,
        **recompute_config(setup.recompute), **setup.config_extra,
    )
    model_parallel_cuda_manual_seed(setup.seed)
    torch.manual_seed(setup.seed)
    msa = MSAConfig(block_size=setup.block_size, top_k=setup.top_k,
                    index_head_dim=setup.index_head_dim, index_heads=setup.index_heads,
                    index_key_heads=setup.index_key_heads, backend=setup.backend,
                    kl_coeff=setup.kl_coeff, mode=setup.mode)
    spec = get_gpt_layer_msa_spec(msa, use_te=setup.use_te, qk_layernorm=setup.qk_layernorm,
                                  normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=setup.seq * BATCH, position_embedding_type="rope")
    return model.to(selected_device())


def batch(step: int, fmt: str, seq: int = SEQ):
    """Tokens, positions and packing of one step (the same on every rank)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device = selected_device()
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, seq), generator=gen)
    if fmt == "sbhd":
        positions = torch.arange(seq).expand(BATCH, seq)
        return tokens.to(device), positions.to(device), None
    total = BATCH * seq  # documents: odd lengths, one shorter than a block, one empty
    lengths = [total // 5, 5, total // 2, 0]
    lengths.append(total - sum(lengths))
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(device),
                             cu_seqlens_kv=cu.to(device), max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    return tokens.reshape(1, -1).to(device), positions.reshape(1, -1).to(device), packed


def tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def sum_qk_norm_grads(model) -> None:
    """megatron-core's own finalize step for TP-replicated parameters with partial gradients
    (``finalize_model_grads``' ``_allreduce_non_tensor_model_parallel_grads``, the same in 0.16
    and 0.19): the main q/k norms, ``sequence_parallel`` parameters under sequence parallelism,
    and the MSA index parameters marked ``average_gradients_across_tp_domain``. The raw model
    stands in for megatron's DDP wrapper (only its ``ddp_config`` is read)."""
    import types

    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    if dist.get_world_size(tp_group()) == 1:
        return
    had = hasattr(model, "ddp_config")
    if not had:
        model.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    try:
        _allreduce_non_tensor_model_parallel_grads([model], model.config, tp_group())
    finally:
        if not had:
            del model.ddp_config


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """Gather a TP-sharded parameter (or its grad) to the TP=1 shape."""
    group = tp_group()
    size = dist.get_world_size(group)
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return param.detach().cpu().clone()
    parts = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(parts, param.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim).cpu()


def full_grads(model) -> Dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        holder = grad.detach()
        holder.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
        holder.partition_dim = getattr(param, "partition_dim", 0)
        out[name] = full_tensor(holder)
    return out


def train(model, setup: Setup, steps: Optional[int] = None) -> Dict[str, list]:
    """SGD steps; returns per-step losses, KL metrics, full grads and selection counts
    (``{"calls", "rows"}`` of this rank, :func:`tests.support.spies.count_selections`)."""
    from msa_megatron.megatron import get_msa_metrics

    with count_selections(setup.backend) as counts:
        return _train(model, setup, steps, counts, get_msa_metrics)


def _train(model, setup: Setup, steps: Optional[int], counts: Dict[str, int],
           get_msa_metrics) -> Dict[str, list]:
    get_msa_metrics(reset=True)
    record: Dict[str, list] = {"loss": [], "kl": [], "grads": [], "selections": []}
    formats = setup.formats[:steps] if steps else setup.formats
    for step, fmt in enumerate(formats):
        tokens, positions, packed = batch(step, fmt, setup.seq)
        model.zero_grad(set_to_none=True)
        loss = model(tokens, positions, None, labels=tokens, packed_seq_params=packed).mean()
        loss.backward()
        sum_qk_norm_grads(model)
        record["loss"].append(loss.detach().cpu())
        record["kl"].append(get_msa_metrics(reset=True))
        record["grads"].append(full_grads(model))
        record["selections"].append(dict(counts))
        counts.update(calls=0, rows=0)
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-LR)
    return record


def train_worker(rank: int, world_size: int, setup: Setup, tp: int) -> Dict[str, list]:
    """Entry point for run_distributed: build, train, return the record of rank 0's view
    (plus this rank's selection counts)."""
    model = build_model(setup, tp)
    return train(model, setup)
