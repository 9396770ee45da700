"""Argument handling of the Megatron-LM launch kit, importable without ``megatron.training``.

Shared by ``pretrain_msa_gpt.py`` and ``convert_dense_to_msa.py`` (which need megatron-core
0.19.x, Python >= 3.12) and tested on any Python by ``tests/e2e/test_megatron_lm_kit.py``:

- :func:`add_msa_args`: the kit's ``--dense-gpt`` plus the library's ``--msa-*`` flags
  (:func:`msa_megatron.megatron.add_msa_arguments`, added once even on a patched
  megatron.training); :func:`msa_config_from_args` is the library's
  (:func:`msa_megatron.megatron.msa_config_from_args`: the flags' MSAConfig, dense first when
  ``--msa-warmup-steps > 0``);
- :func:`msa_mode_at`: the dense-warmup switch, keyed on the iteration counter (restored from
  the checkpoint on resume);
- :func:`adapt_to_installed_kernels`: turns off what needs Transformer Engine or Apex when they
  are absent (fusions, persistent layer norm, sequence parallelism with torch norms);
- :func:`fit_lr_schedule`: keeps the learning-rate warmup shorter than the decay for any
  ``--train-iters >= 1``.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Dict, Iterable, List, Optional

from msa_megatron.megatron.args import (MSA_FLAG_FIELDS, WARMUP_FIELD, add_msa_arguments,
                                        msa_config_from_args)

__all__ = ["MSA_CONFIG_FLAGS", "add_msa_args", "adapt_to_installed_kernels",
           "attended_block_fraction", "fit_lr_schedule", "installed_kernels",
           "msa_config_from_args", "msa_mode_at", "notice", "parser_has_msa_flags"]

# MSAConfig fields set by --msa-<field> flags (dashes for underscores): the library's.
MSA_CONFIG_FLAGS = tuple(MSA_FLAG_FIELDS)


def parser_has_msa_flags(parser: argparse.ArgumentParser) -> bool:
    """True when ``parser`` already defines every ``--msa-*`` flag (a patched megatron.training,
    ``patches/0001-msa-arguments.patch``, or an earlier :func:`add_msa_args`)."""
    present = {option for action in parser._actions for option in action.option_strings}
    wanted = [*MSA_CONFIG_FLAGS, WARMUP_FIELD]
    return all("--msa-" + field.replace("_", "-") in present for field in wanted)


def add_msa_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The kit's flags (``extra_args_provider`` of megatron's argument parser).

    Adds ``--dense-gpt`` (train megatron-core's plain GPT, e.g. the dense start of
    ``convert_dense_to_msa.py``) and the ``--msa-*`` flags of
    :func:`msa_megatron.megatron.add_msa_arguments` (defaults :class:`~msa_megatron.MSAConfig`'s,
    plus ``--msa-warmup-steps``, default 0). Flags the parser already has (megatron.training
    patched with ``patches/``, which adds them through the same library function) are not
    added again, so the two never clash.

    Returns:
        ``parser``.
    """
    kit = parser.add_argument_group(title="msa-megatron launch kit")
    kit.add_argument("--dense-gpt", action="store_true",
                     help="train a plain dense GPT (megatron-core's layer spec, no MSA layers): "
                          "the starting point of convert_dense_to_msa.py")
    return add_msa_arguments(parser, prefix="msa", warmup=True)


def msa_mode_at(iteration: int, warmup_steps: int) -> str:
    """``"dense"`` for iterations ``0 .. warmup_steps - 1`` (0-based, Megatron's
    ``args.curr_iteration``), then ``"sparse"``."""
    return "dense" if iteration < warmup_steps else "sparse"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def installed_kernels() -> Dict[str, bool]:
    """Which optional fused-kernel packages import here.

    Returns:
        ``transformer_engine``, ``apex``, ``fused_weight_gradient_mlp_cuda`` (Apex's gradient
        accumulation fusion), ``scaled_masked_softmax_cuda`` (megatron's fused softmax).
    """
    return {name: _importable(name) for name in (
        "transformer_engine", "apex", "fused_weight_gradient_mlp_cuda",
        "scaled_masked_softmax_cuda")}


def _given(argv: Iterable[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def adapt_to_installed_kernels(args: argparse.Namespace, argv: Iterable[str],
                               kernels: Optional[Dict[str, bool]] = None) -> List[str]:
    """Turn off, in place, what needs Transformer Engine or Apex when they are absent.

    Call between megatron's ``parse_args`` and ``validate_args``.

    Args:
        args: megatron's parsed arguments (``transformer_impl``, ``gradient_accumulation_fusion``,
            ``no_persist_layer_norm``, ``apply_rope_fusion``, ``masked_softmax_fusion``,
            ``sequence_parallel``, ``tensor_model_parallel_size``, ``normalization``,
            ``use_distributed_optimizer``, ``save``, ``load``).
        argv: the command line (to tell an explicit ``--transformer-impl`` from the default).
        kernels: :func:`installed_kernels` (computed when None).

    Returns:
        What was turned off, one short phrase each (empty when nothing was).

    Raises:
        ValueError: ``--transformer-impl transformer_engine`` given explicitly without
            Transformer Engine.
    """
    kernels = installed_kernels() if kernels is None else kernels
    argv = list(argv)
    off: List[str] = []
    if args.transformer_impl == "transformer_engine" and not kernels["transformer_engine"]:
        if _given(argv, "--transformer-impl"):
            raise ValueError("--transformer-impl transformer_engine but transformer_engine "
                             "cannot be imported: install it or pass --transformer-impl local")
        args.transformer_impl = "local"
        off.append("Transformer Engine layers (--transformer-impl local)")
    local = args.transformer_impl == "local"
    if local and args.gradient_accumulation_fusion and not kernels["fused_weight_gradient_mlp_cuda"]:
        args.gradient_accumulation_fusion = False
        off.append("gradient accumulation fusion")
    if local and not args.no_persist_layer_norm and not kernels["apex"]:
        args.no_persist_layer_norm = True
        off.append("persistent layer norm")
    if getattr(args, "apply_rope_fusion", False) and not kernels["transformer_engine"]:
        args.apply_rope_fusion = False
        off.append("RoPE fusion")
    if (local and getattr(args, "masked_softmax_fusion", False)
            and not kernels["scaled_masked_softmax_cuda"]):
        args.masked_softmax_fusion = False
        off.append("masked softmax fusion")
    torch_norms = local and (not kernels["apex"] or args.normalization == "RMSNorm")
    if torch_norms and args.sequence_parallel:
        args.sequence_parallel = False
        off.append("sequence parallel (torch norms)")
    # Without TE or Apex megatron-core falls back to torch's Adam, whose (lazily created) state
    # its distributed optimizer cannot load: resuming fails in DistribOptimizer.state_dict
    # (`assert len(steps) == 1`, seen with 0.19.2 on GPUs). Keep checkpoints resumable.
    checkpointing = getattr(args, "save", None) or getattr(args, "load", None)
    if (getattr(args, "use_distributed_optimizer", False) and checkpointing
            and not (kernels["transformer_engine"] or kernels["apex"])):
        args.use_distributed_optimizer = False
        off.append("distributed optimizer (torch's Adam state cannot be resumed by it)")
    return off


def fit_lr_schedule(args: argparse.Namespace) -> List[str]:
    """Keep ``--lr-warmup-iters`` below the decay length (``--lr-decay-iters``, else
    ``--train-iters``), as megatron's ``OptimizerParamScheduler`` asserts; in place.

    Returns:
        One phrase when the warmup was shortened, else nothing.
    """
    train_iters = getattr(args, "train_iters", None)
    if not train_iters:
        return []
    decay = args.lr_decay_iters or train_iters
    if args.lr_warmup_iters and args.lr_warmup_iters >= decay:
        old = args.lr_warmup_iters
        args.lr_warmup_iters = max(0, decay - 1) if decay < 10 else decay // 10
        return [f"lr warmup {old} -> {args.lr_warmup_iters} iterations (decay is {decay})"]
    return []


def notice(kernels: Dict[str, bool], off: List[str]) -> str:
    """The one-line notice of what :func:`adapt_to_installed_kernels` turned off."""
    absent = [label for name, label in (("transformer_engine", "Transformer Engine"),
                                        ("apex", "Apex")) if not kernels.get(name)]
    why = f" ({', '.join(absent)} not installed)" if absent else ""
    return f"msa-megatron: turned off{why}: {'; '.join(off)}"


def attended_block_fraction(seq_len: int, block_size: int, top_k: int) -> float:
    """Share of causal key blocks a query attends in sparse mode, over a window of ``seq_len``
    tokens (one causal sequence): query block ``i`` (0-based) sees ``i + 1`` blocks and attends
    ``min(i + 1, top_k)`` of them; weighted by the tokens of each query block.

    Raises:
        ValueError: a non-positive argument.
    """
    if min(seq_len, block_size, top_k) <= 0:
        raise ValueError(f"seq_len, block_size, top_k must be positive, got "
                         f"{seq_len}, {block_size}, {top_k}")
    attended = causal = 0
    for start in range(0, seq_len, block_size):
        tokens = min(block_size, seq_len - start)
        visible = start // block_size + 1
        attended += tokens * min(visible, top_k)
        causal += tokens * visible
    return attended / causal
