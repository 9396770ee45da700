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
  ``--train-iters >= 1``;
- :class:`MSAMetricsLog`: the MSA metrics (KL per layer, attended share, selection recall,
  throughput with MSA layers counted sparse, :func:`msa_flops_delta`) gathered once per log
  interval, on every rank after the step's last backward, as one log line.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional

from msa_megatron.megatron.args import (MSA_FLAG_FIELDS, WARMUP_FIELD, add_msa_arguments,
                                        msa_config_from_args)
from msa_megatron.megatron.flops import megatron_dense_core_flops, msa_layer_flops

__all__ = ["MSA_CONFIG_FLAGS", "MSAMetricsLog", "add_msa_args", "adapt_to_installed_kernels",
           "attended_block_fraction", "fit_lr_schedule", "installed_kernels", "msa_flops_delta",
           "msa_config_from_args", "msa_mode_at", "notice", "parser_has_msa_flags",
           "require_megatron_training"]

def require_megatron_training(script: str) -> None:
    """Exit with a message naming the megatron-core the launch kit needs when
    ``megatron.training`` is missing (it ships inside megatron-core >= 0.17, Python >= 3.12);
    any other missing module is raised as is. ``script``: the caller's ``__file__``."""
    try:
        import megatron.training  # noqa: F401
    except ModuleNotFoundError as error:
        if error.name not in ("megatron", "megatron.training"):
            raise
        import megatron.core as mc
        raise SystemExit(f"{script}: needs megatron.training, which megatron-core ships from "
                         f"0.17 on (Python >= 3.12); installed: megatron-core {mc.__version__}. "
                         "Install megatron-core 0.19.x, or use examples/pretrain_tiny.py, which "
                         "needs megatron-core alone.") from None


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
    kit.add_argument("--probe-interval", type=int, default=None,
                     help="measure the selection recall every N iterations (default: every log "
                          "interval, on the logged iteration; 0: never)")
    kit.add_argument("--probe-rows", type=int, default=256,
                     help="query rows sampled per MSA layer for the recall")
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


def msa_flops_delta(args: argparse.Namespace, batch_size: int, mode: str) -> float:
    """FLOPs to add to Megatron's ``num_floating_point_operations(args, batch_size)`` so that
    the MSA layers count what they compute (:mod:`msa_megatron.megatron.flops`) instead of dense
    attention: per layer and sequence of ``args.seq_length`` tokens, the MSA layer's count minus
    Megatron's dense core-attention term. Negative in sparse mode at length.

    Args:
        args: Megatron's arguments (``num_layers``, ``seq_length``, ``hidden_size``,
            ``num_attention_heads``, ``kv_channels``, ``num_query_groups`` /
            ``group_query_attention`` and the ``--msa-*`` flags).
        batch_size: sequences per iteration (global batch).
        mode: ``"sparse"`` or ``"dense"``.
    """
    config = msa_config_from_args(args)
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    head_dim = args.kv_channels or args.hidden_size // heads
    msa = msa_layer_flops(
        args.seq_length, hidden_size=args.hidden_size, num_heads=heads, head_dim=head_dim,
        index_heads=config.resolved_index_heads(groups), index_key_heads=config.index_key_heads,
        index_head_dim=config.index_head_dim, block_size=config.block_size, top_k=config.top_k,
        mode=mode)["total"]
    dense = megatron_dense_core_flops(args.seq_length, num_heads=heads, head_dim=head_dim)
    return float(args.num_layers * batch_size * (msa - dense))


def _label(key: str) -> str:
    """``msa/kl/layer_01`` -> ``msa kl layer_01``."""
    return key.replace("/", " ").replace("_bytes", " bytes")


class MSAMetricsLog:
    """The MSA metrics of the Megatron-LM entry point, gathered once per log interval.

    Every micro-batch the MSA layers only add their KL to device accumulators (no host sync, no
    collective; :func:`msa_megatron.megatron.get_msa_metrics`). On the iterations Megatron logs
    (``(iteration + 1) % log_interval == 0``, ``iteration`` 0-based as ``args.curr_iteration``),
    :meth:`after_step` runs one gather on every rank after the step's last backward and returns
    the line to print: the interval's mean KL per layer and overall, the attended share of
    causal key blocks, the recall (:meth:`before_forward` arms the selection probe on recall
    iterations) and the throughput with MSA layers counted sparse. Recall is the mean over the
    iterations it was measured on (never averaged with unmeasured ones); a line without a
    measurement repeats the last one, marked with its iteration.

    Args:
        log_interval: Megatron's ``--log-interval``.
        recall_interval: iterations between recall measurements (None: the log interval, on the
            logged iterations; 0: never).
        recall_rows: query rows sampled per layer.
        flops_per_iteration: ``mode -> FLOPs`` of one iteration with MSA layers counted sparse
            (None: no throughput).
        world_size: ranks (the throughput is per rank).
        clock: seconds (``time.perf_counter``).

    Raises:
        ValueError: a non-positive ``log_interval`` or ``recall_rows``, a negative
            ``recall_interval``.
    """

    def __init__(self, log_interval: int, recall_interval: Optional[int] = None,
                 recall_rows: int = 256,
                 flops_per_iteration: Optional[Callable[[str], float]] = None,
                 world_size: int = 1, clock: Callable[[], float] = time.perf_counter) -> None:
        if log_interval <= 0:
            raise ValueError(f"log_interval must be positive, got {log_interval}")
        if recall_interval is not None and recall_interval < 0:
            raise ValueError(f"recall_interval must be >= 0, got {recall_interval}")
        if recall_rows <= 0:
            raise ValueError(f"recall_rows must be positive, got {recall_rows}")
        self.log_interval = log_interval
        self.recall_interval = recall_interval
        self.recall_rows = recall_rows
        self.flops_per_iteration = flops_per_iteration
        self.world_size = world_size
        self.clock = clock
        self.last_recall: Dict[str, float] = {}
        self.last_recall_iteration: Optional[int] = None
        self._armed: set = set()
        self._flops = 0.0
        self._since: Optional[float] = None

    def log_due(self, iteration: int) -> bool:
        """Megatron logs the step of 0-based ``iteration``."""
        return (iteration + 1) % self.log_interval == 0

    def recall_due(self, iteration: int) -> bool:
        """The step of 0-based ``iteration`` measures the recall."""
        if self.recall_interval is None:
            return self.log_due(iteration)
        return self.recall_interval > 0 and (iteration + 1) % self.recall_interval == 0

    def before_forward(self, iteration: int, chunk: Any, training: bool,
                       arm: Callable[[Any, int], Any]) -> bool:
        """Call at every forward step: arms the probe (``arm(chunk, rows)``) at the first
        training forward of each model chunk on recall iterations. Returns whether it armed."""
        if self._since is None:
            self._since = self.clock()
        key = (iteration, id(chunk))
        if not training or key in self._armed or not self.recall_due(iteration):
            return False
        self._armed = {k for k in self._armed if k[0] == iteration}
        self._armed.add(key)
        arm(chunk, self.recall_rows)
        return True

    def after_step(self, iteration: int, gather: Callable[[], Mapping[str, float]],
                   mode: str, blocks_share: float) -> Optional[Dict[str, float]]:
        """Call on every rank after the step's last backward (a collective on log iterations).

        Args:
            iteration: 0-based iteration of the step.
            gather: :func:`msa_megatron.megatron.get_msa_metrics` (reduces over all ranks and
                resets).
            mode: the step's attention mode; blocks_share: share of causal key blocks attended.

        Returns:
            None off log iterations; else the values to log, ``{label: value}`` with labels
            ``msa kl``, ``msa kl layer_NN``, ``msa blocks``, ``msa recall``,
            ``msa recall layer_NN``, ``msa recall_best`` / ``msa recall_best layer_NN`` (the
            recall's ceiling) (and ``msa cp bytes ...`` under CP), plus
            ``throughput per GPU, MSA counted sparse (TFLOP/s/GPU)``.
        """
        if self.flops_per_iteration is not None:
            self._flops += self.flops_per_iteration(mode)
        if not self.log_due(iteration):
            return None
        metrics = dict(gather())
        values: Dict[str, float] = {}
        recall = {k: v for k, v in metrics.items() if k.startswith("msa/recall")}
        if recall:
            self.last_recall, self.last_recall_iteration = recall, iteration
        for key, value in sorted(metrics.items()):
            if not key.startswith("msa/recall"):
                values[_label(key)] = value
        values["msa blocks"] = 1.0 if mode == "dense" else blocks_share
        for key, value in sorted(self.last_recall.items()):
            values[_label(key)] = value
        now = self.clock()
        if self.flops_per_iteration is not None and self._since is not None and now > self._since:
            values["throughput per GPU, MSA counted sparse (TFLOP/s/GPU)"] = (
                self._flops / (now - self._since) / self.world_size / 1e12)
        self._flops, self._since = 0.0, now
        return values

    def line(self, iteration: int, values: Mapping[str, float]) -> str:
        """The log line of :meth:`after_step`'s values (``iteration`` 0-based). Recall values
        measured on an earlier logged iteration say which."""
        parts = [f"msa-megatron | iteration {iteration + 1:8d} |"]
        for label, value in values.items():
            text = f" {label}: {value:.6E} |"
            if (label in ("msa recall", "msa recall_best")
                    and self.last_recall_iteration not in (None, iteration)):
                text = f" {label}: {value:.6E} (iteration {self.last_recall_iteration + 1}) |"
            parts.append(text)
        return "".join(parts)
