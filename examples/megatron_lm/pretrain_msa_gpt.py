"""Pretrain a GPT with MiniMax Sparse Attention on Megatron's training loop (megatron-core 0.19.x).

Our own entry point on ``megatron.training.pretrain`` (shipped inside the megatron-core >= 0.17
wheel, Python >= 3.12), so no Megatron-LM checkout and no patch is needed:

- MSA flags come in through ``extra_args_provider`` (:func:`add_msa_args`);
- every attention layer is MSA: the GPT model config gets ``get_gpt_layer_msa_spec``;
- the dense-warmup-to-sparse switch happens in :func:`forward_step` (``--msa-warmup-steps``);
- the index-branch KL is reported next to ``lm loss`` in Megatron's training log by
  :func:`loss_func` (as ``msa kl``, averaged like the LM loss).

Data: Megatron's indexed GPT datasets (``--data-path``, ``--split``, tokenizer flags) or
``--mock-data``. Sequences are fixed windows (SBHD); context parallelism splits them in
Megatron's load-balanced layout. Every tensor-parallel rank reads its own copy of the batch
(the dataset is memory-mapped), so no TP broadcast is needed.

Launch: see ``examples/megatron_lm/README`` section of ``examples/README.md``, or
``train_single_node.sh`` / ``train_multi_node.sh`` / ``train_slurm.sbatch`` next to this file.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Dict, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model, get_batch_on_this_cp_rank
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage

from msa_megatron import MSAConfig
from msa_megatron.config import BACKENDS, CP_KV_EXCHANGES
from msa_megatron.megatron import get_gpt_layer_msa_spec, get_msa_metrics, set_msa_mode

KL_REPORT_KEY = "msa kl"
_current_mode: Optional[str] = None


def add_msa_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """MSA flags (``extra_args_provider`` of ``parse_and_validate_args``); defaults: MSAConfig."""
    defaults = MSAConfig()
    group = parser.add_argument_group(title="MiniMax Sparse Attention (msa-megatron)")
    group.add_argument("--msa-block-size", type=int, default=defaults.block_size,
                       help="key block size in tokens")
    group.add_argument("--msa-top-k", type=int, default=defaults.top_k,
                       help="selected blocks per query token and index head (forced included)")
    group.add_argument("--msa-init-blocks", type=int, default=defaults.init_blocks,
                       help="first blocks of every sequence always selected")
    group.add_argument("--msa-local-blocks", type=int, default=defaults.local_blocks,
                       help="last blocks up to the query's own block always selected")
    group.add_argument("--msa-index-heads", type=int, default=defaults.index_heads,
                       help="index query heads of the layer (default: one per query group)")
    group.add_argument("--msa-index-key-heads", type=int, default=defaults.index_key_heads,
                       help="index key heads (default 1, shared)")
    group.add_argument("--msa-index-head-dim", type=int, default=defaults.index_head_dim)
    group.add_argument("--msa-kl-coeff", type=float, default=defaults.kl_coeff,
                       help="weight of the summed per-layer index-branch KL losses")
    group.add_argument("--msa-warmup-steps", type=int, default=0,
                       help="iterations of dense attention before switching to sparse MSA")
    group.add_argument("--msa-backend", choices=BACKENDS, default=defaults.backend,
                       help="kernel backend (default: triton on CUDA)")
    group.add_argument("--msa-cp-kv-exchange", choices=CP_KV_EXCHANGES,
                       default=defaults.cp_kv_exchange,
                       help="how context-parallel ranks exchange the selected K/V blocks")
    return parser


def msa_config_from_args(args: argparse.Namespace) -> MSAConfig:
    """MSAConfig of the ``--msa-*`` flags, starting dense when there is a warmup."""
    return MSAConfig(
        block_size=args.msa_block_size,
        top_k=args.msa_top_k,
        init_blocks=args.msa_init_blocks,
        local_blocks=args.msa_local_blocks,
        index_heads=args.msa_index_heads,
        index_key_heads=args.msa_index_key_heads,
        index_head_dim=args.msa_index_head_dim,
        kl_coeff=args.msa_kl_coeff,
        mode="dense" if args.msa_warmup_steps > 0 else "sparse",
        backend=args.msa_backend,
        cp_kv_exchange=args.msa_cp_kv_exchange,
    )


def msa_mode_at(iteration: int, warmup_steps: int) -> str:
    """``"dense"`` for the first ``warmup_steps`` iterations, then ``"sparse"``."""
    return "dense" if iteration < warmup_steps else "sparse"


def get_batch(data_iterator, vp_stage: Optional[int] = None) -> Dict[str, Optional[torch.Tensor]]:
    """Next micro-batch on this rank, sliced for its CP rank (``[b, s / CP]`` tensors)."""
    empty = dict.fromkeys(("tokens", "labels", "loss_mask", "position_ids"))
    if not is_first_or_last_pipeline_stage(vp_stage):
        return empty
    sample = next(data_iterator)
    batch = {key: sample[key].cuda(non_blocking=True) for key in empty}
    batch["cu_seqlens"] = None  # fixed windows: per-sequence load balancing
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Summed masked LM loss, token count, and the report Megatron logs (``lm loss``, ``msa kl``).

    The KL is the mean over this pipeline stage's MSA layers of their index-branch KL for this
    micro-batch (TP and CP shares added; Megatron then averages it over data-parallel ranks
    weighted by tokens, like the LM loss). With pipeline parallelism it covers the last stage's
    layers; ``patches/`` logs every layer from the training loop instead.
    """
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    metrics = get_msa_metrics(group=parallel_state.get_tensor_and_context_parallel_group())
    if "msa/kl" in metrics:
        kl = torch.tensor([metrics["msa/kl"]], device=loss.device) * num_tokens
        report[KL_REPORT_KEY] = torch.cat([kl.view(1), num_tokens.view(1).float()])
    return loss, num_tokens, report


def forward_step(data_iterator, model):
    """One micro-batch forward: the MSA warmup switch, then the GPT forward with labels."""
    global _current_mode
    args = get_args()
    mode = msa_mode_at(getattr(args, "curr_iteration", 0), args.msa_warmup_steps)
    if mode != _current_mode:
        set_msa_mode(model, mode)
        print_rank_0(f"MSA attention mode: {mode} (iteration {getattr(args, 'curr_iteration', 0)})")
        _current_mode = mode
    batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
    output_tensor = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                          loss_mask=batch["loss_mask"])
    return output_tensor, partial(loss_func, batch["loss_mask"])


def is_dataset_built_on_rank(vp_stage: Optional[int] = None) -> bool:
    """Every TP rank of the first and last pipeline stages reads the data itself."""
    return is_first_or_last_pipeline_stage(vp_stage)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron indexed GPT datasets (or mock data) from the usual data flags."""
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=False,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building {dataset_type.__name__} train / valid / test splits")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        partial(is_dataset_built_on_rank, vp_stage=vp_stage), config,
    ).build()


# Data loaders are built on every rank that reads data, not only on TP rank 0.
train_valid_test_datasets_provider.is_distributed = True


def _use_prebuilt_dataset_helpers() -> None:
    """megatron.training compiles the dataset index helpers with ``make`` on rank 0; the
    megatron-core wheel ships them prebuilt and without a Makefile, so skip the build then."""
    import importlib.util

    import megatron.core.datasets.utils as dataset_utils

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
        dataset_utils.compile_helpers = lambda: None


def main() -> None:
    _use_prebuilt_dataset_helpers()
    args = parse_and_validate_args(extra_args_provider=add_msa_args,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    model_cfg = gpt_config_from_args(args)
    transformer = model_cfg.transformer
    model_cfg.transformer_layer_spec = get_gpt_layer_msa_spec(
        msa_config_from_args(args),
        use_te=transformer.transformer_impl == "transformer_engine",
        qk_layernorm=transformer.qk_layernorm,
        normalization=transformer.normalization,
    )
    pretrain(
        pretrain_cfg_container_from_args(args, model_cfg),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )


if __name__ == "__main__":
    main()
