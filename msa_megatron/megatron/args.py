"""Command-line flags -> :class:`~msa_megatron.MSAConfig`, written once for every entry point.

Megatron-LM (the ``--msa-*`` flags of the patch and ``examples/megatron_lm``), the tiny example
(``examples/pretrain_tiny.py``, unprefixed flags) and the ``MSA_CONFIG`` environment variable of
:mod:`.spec` all build their config here::

    parser = argparse.ArgumentParser()
    add_msa_arguments(parser)            # --msa-block-size, ..., --msa-warmup-steps
    args = parser.parse_args()
    config = msa_config_from_args(args)  # dense first when --msa-warmup-steps > 0

Nothing here imports megatron-core.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Dict, Mapping, Optional

from ..config import BACKENDS, CP_KV_EXCHANGES, MSAConfig

# MSAConfig field -> (type, choices, help). ``mode`` is not a flag: it follows the warmup.
MSA_FLAG_FIELDS: Dict[str, tuple] = {
    "block_size": (int, None, "key block size in tokens"),
    "top_k": (int, None, "selected blocks per query token and index head"),
    "init_blocks": (int, None, "first blocks of each sequence that are always selected"),
    "local_blocks": (int, None, "last blocks up to the query's own block always selected"),
    "softmax_scale": (float, None, "main-branch logit scale (default: head_dim ** -0.5)"),
    "index_scale": (float, None, "index-branch logit scale (default: index_head_dim ** -0.5)"),
    "index_heads": (int, None, "index query heads (default: one per query group)"),
    "index_key_heads": (int, None, "index key heads"),
    "index_head_dim": (int, None, "head dim of the index branch"),
    "kl_coeff": (float, None, "weight of the summed per-layer index-branch KL losses"),
    "backend": (str, BACKENDS, "kernel backend (default: triton on CUDA, torch otherwise)"),
    "cp_kv_exchange": (str, CP_KV_EXCHANGES,
                       "context-parallel K/V exchange (default: allgather)"),
}
WARMUP_FIELD = "warmup_steps"
GROUP_TITLE = "MiniMax Sparse Attention (msa-megatron)"


def add_msa_arguments(parser: argparse.ArgumentParser, *, prefix: str = "msa",
                      defaults: Optional[MSAConfig] = None,
                      warmup: bool = True) -> argparse.ArgumentParser:
    """Add one argument group with a flag per :data:`MSA_FLAG_FIELDS` field.

    Flags the parser already defines (e.g. by an earlier call: megatron.training patched with
    ``patches/0001-msa-arguments.patch`` calls this function, and the Megatron-LM kit calls it
    again as ``extra_args_provider``) are not added again. The flags join the parser's group
    titled :data:`GROUP_TITLE` when it has one (the patch's ``--msa``), else a new one.

    Args:
        parser: the parser to extend (returned, for Megatron-LM's ``extra_args_provider``).
        prefix: flag prefix: ``"msa"`` gives ``--msa-block-size`` (attribute
            ``msa_block_size``); ``""`` gives ``--block-size`` (attribute ``block_size``).
        defaults: the config whose values are the flags' defaults (``MSAConfig()`` when None).
        warmup: also add ``--<prefix>-warmup-steps`` (dense steps before sparse, default 0).

    Returns:
        ``parser``.
    """
    defaults = defaults or MSAConfig()
    present = {option for action in parser._actions for option in action.option_strings}
    wanted = [field for field in MSA_FLAG_FIELDS if _flag(prefix, field) not in present]
    if warmup and _flag(prefix, WARMUP_FIELD) in present:
        warmup = False
    if not wanted and not warmup:
        return parser
    group = next((g for g in parser._action_groups if g.title == GROUP_TITLE), None)
    if group is None:
        group = parser.add_argument_group(title=GROUP_TITLE)
    for field in wanted:
        kind, choices, text = MSA_FLAG_FIELDS[field]
        default = getattr(defaults, field)  # None: the text says what stands in for it
        group.add_argument(_flag(prefix, field), dest=_dest(prefix, field), type=kind,
                           choices=choices, default=default,
                           help=f"MSA: {text}"
                                + ("" if default is None else " (default: %(default)s)"))
    if warmup:
        group.add_argument(_flag(prefix, WARMUP_FIELD), dest=_dest(prefix, WARMUP_FIELD),
                           type=_steps, default=0,
                           help="MSA: dense-attention steps before switching to sparse "
                                "(iterations, counted from the start of training; "
                                "default: %(default)s)")
    return parser


def msa_config_from_args(args: argparse.Namespace, *, prefix: str = "msa",
                         mode: Optional[str] = None) -> MSAConfig:
    """The :class:`MSAConfig` of the flags of :func:`add_msa_arguments`.

    Args:
        args: parsed arguments; fields whose attribute is missing or None keep MSAConfig's
            default (a parser may leave unset flags at None).
        prefix: as given to :func:`add_msa_arguments`.
        mode: ``"sparse"`` / ``"dense"``; None: dense when ``<prefix>_warmup_steps > 0``.

    Raises:
        ValueError / TypeError: invalid values (MSAConfig's checks); a negative
            ``<prefix>_warmup_steps``.
    """
    fields = {field: getattr(args, _dest(prefix, field)) for field in MSA_FLAG_FIELDS
              if getattr(args, _dest(prefix, field), None) is not None}
    warmup = getattr(args, _dest(prefix, WARMUP_FIELD), 0) or 0
    if warmup < 0:
        raise ValueError(f"{_flag(prefix, WARMUP_FIELD)} {warmup} must be >= 0 (dense steps "
                         "before sparse; 0: sparse from the start)")
    if mode is None:
        mode = "dense" if warmup > 0 else "sparse"
    return MSAConfig(mode=mode, **fields)


def msa_config_from_mapping(fields: Mapping[str, Any], source: str = "the mapping") -> MSAConfig:
    """:class:`MSAConfig` from a mapping of its field names (e.g. parsed JSON).

    Raises:
        ValueError: ``fields`` is not a mapping or names unknown fields; MSAConfig's own
            ValueError / TypeError for invalid values, its message prefixed with ``source``.
    """
    if not isinstance(fields, Mapping):
        raise ValueError(f"{source} must be a JSON object of MSAConfig fields, got {fields!r}")
    known = {f.name for f in dataclasses.fields(MSAConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{source} has unknown MSAConfig fields {unknown}")
    try:
        return MSAConfig(**dict(fields))
    except (TypeError, ValueError) as error:
        raise type(error)(f"{source}: {error}") from error


def _steps(text: str) -> int:
    """argparse type of ``--<prefix>-warmup-steps``: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 (dense steps before sparse)")
    return value


def _flag(prefix: str, field: str) -> str:
    return "--" + (f"{prefix}-" if prefix else "") + field.replace("_", "-")


def _dest(prefix: str, field: str) -> str:
    return (f"{prefix}_" if prefix else "") + field
