"""Pretrain a GPT with MiniMax Sparse Attention on Megatron's training loop (megatron-core 0.19.x).

Our own entry point on ``megatron.training.pretrain`` (shipped inside the megatron-core >= 0.17
wheel, Python >= 3.12), so no Megatron-LM checkout and no patch is needed:

- MSA flags come in through ``extra_args_provider`` (:func:`add_msa_args`: ``--dense-gpt`` and
  the library's ``--msa-*`` flags, :func:`msa_megatron.megatron.add_msa_arguments`);
- every attention layer is MSA: the GPT model config gets ``get_gpt_layer_msa_spec``;
- the dense-warmup-to-sparse switch happens in :func:`forward_step` (``--msa-warmup-steps``);
- the MSA metrics are gathered once per log interval, on every rank after the logged step's last
  backward (:func:`install_metrics_log`, :class:`msa_gpt_setup.MSAMetricsLog`: no host sync or
  collective per micro-batch), and printed as one ``msa-megatron | iteration N |`` line after
  Megatron's: ``msa kl`` (mean over all layers of the interval), ``msa kl layer_NN``, ``msa
  blocks`` (share of causal key blocks attended), ``msa recall`` / ``msa recall layer_NN``
  (selection recall of ``--probe-rows`` sampled rows, measured every
  ``--probe-interval`` iterations, by default on the logged ones) and the throughput with
  the MSA layers counted sparse (Megatron's own TFLOP/s counts them as dense attention); also
  to TensorBoard / W&B when Megatron writes there;
- what needs Transformer Engine or Apex is turned off when they are absent, and the LR warmup
  kept below the decay, with one printed line (:func:`parse_msa_gpt_args`);
- ``--dense-gpt`` trains megatron-core's plain GPT instead (the dense start of
  ``convert_dense_to_msa.py``).

With a megatron.training patched by ``patches/`` the flags come from the patch (which adds them
with the same library function; :func:`add_msa_args` then adds only ``--dense-gpt``) and the
patched loop does the warmup switch and KL logging; this entry point then leaves both to it.

Data: Megatron's indexed GPT datasets (``--data-path``, ``--split``, tokenizer flags) or
``--mock-data``. Sequences are fixed windows (SBHD); context parallelism splits them in
Megatron's load-balanced layout. Every tensor-parallel rank reads its own copy of the batch
(the dataset is memory-mapped), so no TP broadcast is needed.

Launch: ``train_single_node.sh`` / ``train_multi_node.sh`` / ``train_slurm.sbatch`` next to this
file; documentation: the ``megatron_lm/`` section of ``examples/README.md``.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Dict, Optional, Tuple

import torch


from msa_gpt_setup import require_megatron_training  # noqa: E402

require_megatron_training(__file__)

from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.utils import get_attr_wrapped_model, get_model_config
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.utils import (get_blend_and_blend_per_split,
                                     is_first_or_last_pipeline_stage, print_rank_last)

from msa_gpt_setup import (MSAMetricsLog, adapt_to_installed_kernels, add_msa_args,
                           attended_block_fraction, fit_lr_schedule, installed_kernels,
                           msa_config_from_args, msa_flops_delta, msa_mode_at, notice)
from msa_megatron.megatron import (arm_selection_probe, get_gpt_layer_msa_spec, get_msa_metrics,
                                   set_msa_mode)
from msa_megatron.megatron.compat import get_batch_on_this_cp_rank

_current_mode: Optional[str] = None
_metrics_log: Optional[MSAMetricsLog] = None


def package_is_patched(args: argparse.Namespace) -> bool:
    """True when megatron.training carries ``patches/`` (its parser has ``--msa``, which
    :func:`parse_msa_gpt_args` turns on unless ``--dense-gpt``): the patched training loop then
    switches the warmup and logs the KL itself, so the entry point leaves both to it (no double
    switching, no KL counted twice)."""
    return bool(getattr(args, "msa", False))


def get_batch(data_iterator, vp_stage: Optional[int] = None) -> Dict[str, Optional[torch.Tensor]]:
    """Next micro-batch on this rank, sliced for its CP rank (``[b, s / CP]`` tensors)."""
    empty = dict.fromkeys(("tokens", "labels", "loss_mask", "position_ids"))
    if not is_first_or_last_pipeline_stage(vp_stage):
        return empty
    sample = next(data_iterator)
    batch = {key: sample[key].cuda(non_blocking=True) for key in empty}
    batch["cu_seqlens"] = None  # fixed windows: per-sequence load balancing
    return get_batch_on_this_cp_rank(batch, cp_group=parallel_state.get_context_parallel_group())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, torch.Tensor]]:
    """Summed masked LM loss, token count, and Megatron's report (``lm loss``). The MSA metrics
    are not reported per micro-batch (that would sync and reduce every micro-batch, and
    Megatron averages report keys over every iteration of the interval): they have their own
    line per log interval (:func:`install_metrics_log`)."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    report = {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}
    return loss, num_tokens, report


def _flops_per_iteration(args: argparse.Namespace):
    """``mode -> FLOPs`` of one iteration with the MSA layers counted sparse (Megatron's count
    plus :func:`msa_flops_delta`), or None when Megatron's count is not importable."""
    try:
        from megatron.training.training import num_floating_point_operations
    except ImportError:
        return None
    batch = args.global_batch_size
    try:
        dense = num_floating_point_operations(args, batch)
    except (AttributeError, TypeError, AssertionError) as err:  # another Megatron's signature
        print_rank_0(f"msa-megatron: no sparse-count throughput ({err!r})")
        return None
    deltas = {mode: msa_flops_delta(args, batch, mode) for mode in ("sparse", "dense")}
    return lambda mode: dense + deltas[mode]


def install_metrics_log(model, args: argparse.Namespace) -> MSAMetricsLog:
    """Create the metrics log and gather it after the step's last backward on every rank.

    The gather runs inside ``config.finalize_model_grads_func`` (called once per step on every
    rank, pipeline stages included, after the last backward; Megatron's ``train`` sets it before
    the first step), wrapped here at the first forward step. On log iterations that is one
    all-reduce over the world (:func:`msa_megatron.megatron.get_msa_metrics`); the line is
    printed by the last rank, like Megatron's.
    """
    log = MSAMetricsLog(args.log_interval, args.probe_interval, args.probe_rows,
                        _flops_per_iteration(args), args.world_size)
    config = get_model_config(model)
    finalize = config.finalize_model_grads_func
    if finalize is None or getattr(finalize, "msa_metrics_log", None) is not None:
        return log

    def finalize_and_log(*f_args, **f_kwargs):
        result = finalize(*f_args, **f_kwargs)
        iteration = getattr(get_args(), "curr_iteration", 0)
        mode = _current_mode or "sparse"
        share = attended_block_fraction(args.seq_length, args.msa_block_size, args.msa_top_k)
        values = log.after_step(iteration, get_msa_metrics, mode, share)
        if values is not None:
            print_rank_last(log.line(iteration, values))
            _write_scalars(values, iteration + 1)
        return result

    finalize_and_log.msa_metrics_log = log
    config.finalize_model_grads_func = finalize_and_log
    return log


def _write_scalars(values: Dict[str, float], iteration: int) -> None:
    """The logged values to Megatron's TensorBoard / W&B writers, where they exist."""
    from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer

    writer, wandb_writer = get_tensorboard_writer(), get_wandb_writer()
    for label, value in values.items():
        if writer is not None:
            writer.add_scalar(label, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log({label: value}, iteration)


def forward_step(data_iterator, model):
    """One micro-batch forward: the MSA warmup switch (and the selection probe on recall
    iterations), then the GPT forward with labels.

    The switch reads ``args.curr_iteration``, the 0-based iteration Megatron's loop sets from
    its counter, which a resumed run restores from the checkpoint: a run stopped after N
    iterations continues at N + 1 in the mode that iteration has.
    """
    global _current_mode, _metrics_log
    args = get_args()
    patched = package_is_patched(args)
    if not (patched or args.dense_gpt):  # the patched loop switches and logs itself
        iteration = getattr(args, "curr_iteration", 0)
        mode = msa_mode_at(iteration, args.msa_warmup_steps)
        if mode != _current_mode:
            set_msa_mode(model, mode)
            print_rank_0(f"MSA attention mode: {mode} (iteration {iteration + 1})")
            _current_mode = mode
        if _metrics_log is None:
            _metrics_log = install_metrics_log(model, args)
        _metrics_log.before_forward(iteration, model, model.training,
                                    lambda chunk, rows: arm_selection_probe(chunk, num_rows=rows))
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


def parse_msa_gpt_args(extra_args_provider=add_msa_args) -> argparse.Namespace:
    """Megatron's arguments plus the MSA flags, adapted to this machine, validated and set as
    megatron's globals (``parse_and_validate_args`` with one step added before validation).

    The step (:func:`msa_gpt_setup.adapt_to_installed_kernels`, :func:`fit_lr_schedule`) turns
    off what needs Transformer Engine / Apex when they are absent and keeps the learning-rate
    warmup shorter than the decay; it prints one line saying what it changed.
    """
    import sys

    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    _use_prebuilt_dataset_helpers()
    args = parse_args(extra_args_provider)
    if args.use_checkpoint_args:
        from megatron.training.checkpointing import load_args_from_checkpoint

        load_args_from_checkpoint(args, load_arg="pretrained_checkpoint")
        load_args_from_checkpoint(args)
    if hasattr(args, "msa"):  # patched megatron.training: its loop does the MSA warmup and logs
        args.msa = not args.dense_gpt
    kernels = installed_kernels()
    changed = adapt_to_installed_kernels(args, sys.argv[1:], kernels) + fit_lr_schedule(args)
    if changed and args.rank == 0:
        print(notice(kernels, changed), flush=True)
    validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    set_global_variables(args)
    return args


def msa_model_config(args: argparse.Namespace):
    """Megatron's GPT model config of ``args`` with every attention layer MSA (unchanged, a
    plain GPT, with ``--dense-gpt``)."""
    model_cfg = gpt_config_from_args(args)
    if args.dense_gpt:
        return model_cfg
    transformer = model_cfg.transformer
    model_cfg.transformer_layer_spec = get_gpt_layer_msa_spec(
        msa_config_from_args(args),
        use_te=transformer.transformer_impl == "transformer_engine",
        qk_layernorm=transformer.qk_layernorm,
        normalization=transformer.normalization,
    )
    return model_cfg


def main() -> None:
    args = parse_msa_gpt_args()
    pretrain(
        pretrain_cfg_container_from_args(args, msa_model_config(args)),
        train_valid_test_datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
    )
    if torch.cuda.is_available():
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"msa-megatron: rank {rank} peak GPU memory allocated {peak:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
