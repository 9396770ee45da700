"""MSAConfig: every knob of MiniMax Sparse Attention in one validated dataclass.

Source: MSA_SPEC.md sections 1-6. Defaults are the paper / production defaults.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Tuple

# The triton backend's limits (ops/validation.py adds its dtypes, which need torch).
TRITON_HEAD_DIMS = (16, 32, 64, 128)
TRITON_BLOCK_SIZES = (16, 32, 64, 128)

MODES = ("sparse", "dense")
BACKENDS = ("reference", "torch", "triton")
CP_KV_EXCHANGES = ("allgather", "selective")
# The CP K/V exchange when none is chosen (the faster one measured; docs/DESIGN.md).
DEFAULT_CP_KV_EXCHANGE = "allgather"


@dataclass(frozen=True)
class MSAConfig:
    """Hyper-parameters of one MSA attention layer (immutable, validated on construction).

    Fields cannot be assigned after construction (``cfg.top_k = 4`` raises
    ``dataclasses.FrozenInstanceError``), so a config can never hold an unchecked value; derive
    a changed copy with ``dataclasses.replace(cfg, top_k=4)``, which validates again. The
    current mode of a model is set with :func:`msa_megatron.megatron.set_msa_mode`, not here.

    Attributes:
        block_size: key block size B in tokens (power of two >= 16; Triton: 16 to 128).
        top_k: selected blocks per query token and index head (forced blocks included).
        init_blocks: the first ``init_blocks`` blocks of each sequence are always selected.
        local_blocks: the last ``local_blocks`` blocks up to and including the query's own
            block are always selected (>= 1 so the support is never empty).
        softmax_scale: main-branch logit scale; ``None`` means ``D ** -0.5``.
        index_scale: index-branch logit scale; ``None`` means ``Di ** -0.5``.
        index_heads: Hi, index query heads of the whole layer (``None``: one per query group).
        index_key_heads: Hik, index key heads (default 1, shared).
        index_head_dim: Di.
        kl_coeff: weight of the summed per-layer KL losses in the training loss.
        mode: ``"sparse"`` or ``"dense"`` (warmup, MSA_SPEC section 5).
        backend: ``"reference"``, ``"torch"``, ``"triton"`` or ``None`` (automatic).
        cp_kv_exchange: context-parallel K/V exchange, ``"allgather"``, ``"selective"`` or
            ``None`` for the default, ``"allgather"`` (whatever megatron-core's
            ``cp_comm_type``: :func:`msa_megatron.parallel.context.resolve_cp_kv_exchange`).

    Raises:
        ValueError / TypeError on construction (and in ``dataclasses.replace``) for any
        inconsistent value (MSA_SPEC section 7).
    """

    block_size: int = 128
    top_k: int = 16
    init_blocks: int = 0
    local_blocks: int = 1
    softmax_scale: Optional[float] = None
    index_scale: Optional[float] = None
    index_heads: Optional[int] = None
    index_key_heads: int = 1
    index_head_dim: int = 128
    kl_coeff: float = 1.0
    mode: str = "sparse"
    backend: Optional[str] = None
    cp_kv_exchange: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("block_size", "top_k", "init_blocks", "local_blocks",
                     "index_key_heads", "index_head_dim"):
            self._normalise(name, check_int(f"MSAConfig.{name}", getattr(self, name)))
        if self.index_heads is not None:
            self._normalise("index_heads", check_int("MSAConfig.index_heads", self.index_heads))
        check_block_size(self.block_size)
        check_selection_budget(self.top_k, self.init_blocks, self.local_blocks)
        if self.index_key_heads < 1:
            raise ValueError(f"MSAConfig.index_key_heads must be >= 1, got {self.index_key_heads}")
        if self.index_heads is not None:
            if self.index_heads < 1:
                raise ValueError(f"MSAConfig.index_heads must be >= 1, got {self.index_heads}")
            if self.index_heads % self.index_key_heads:
                raise ValueError(
                    f"MSAConfig.index_heads ({self.index_heads}) must be a multiple of "
                    f"index_key_heads ({self.index_key_heads})"
                )
        if self.index_head_dim < 1:
            raise ValueError(f"MSAConfig.index_head_dim must be >= 1, got {self.index_head_dim}")
        for name in ("softmax_scale", "index_scale"):
            self._normalise(name, check_scale(f"MSAConfig.{name}", getattr(self, name)))
        self._normalise("kl_coeff", check_real("MSAConfig.kl_coeff", self.kl_coeff))
        if not (math.isfinite(self.kl_coeff) and self.kl_coeff >= 0):
            raise ValueError(
                f"MSAConfig.kl_coeff must be a finite number >= 0, got {self.kl_coeff!r}")
        check_mode(self.mode)
        check_backend(self.backend)
        if self.backend == "triton":  # what needs no tensor is refused here, before any run
            if self.block_size not in TRITON_BLOCK_SIZES:
                raise ValueError(f"MSAConfig: backend='triton' supports block_size in "
                                 f"{TRITON_BLOCK_SIZES}, got {self.block_size}; backend='torch' "
                                 "runs any block size (slower)")
            if self.index_head_dim not in TRITON_HEAD_DIMS:
                raise ValueError(f"MSAConfig: backend='triton' supports index_head_dim in "
                                 f"{TRITON_HEAD_DIMS}, got {self.index_head_dim}; "
                                 "backend='torch' runs any head dim (slower)")
        if self.cp_kv_exchange is not None:
            check_choice("MSAConfig.cp_kv_exchange", self.cp_kv_exchange, CP_KV_EXCHANGES,
                         none_ok=True)

    def _normalise(self, name: str, value: object) -> None:
        """Store a checked value in its plain Python type (e.g. a numpy integer as an int)."""
        if type(value) is not type(getattr(self, name)):
            object.__setattr__(self, name, value)

    def resolved_index_heads(self, num_query_groups: int) -> int:
        """Hi for a layer with ``num_query_groups`` KV groups (default: one per group)."""
        return num_query_groups if self.index_heads is None else self.index_heads


def check_int(name: str, value: object) -> int:
    """``value`` as an int; TypeError naming ``name`` unless it is an integral number
    (``numbers.Integral``: int, numpy integers; bool is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_real(name: str, value: object) -> float:
    """``value`` as a float; TypeError naming ``name`` unless it is a real number
    (``numbers.Real``: int, float, numpy numbers; bool is refused). Values are not checked."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    return float(value)


def check_scale(name: str, value: object) -> Optional[float]:
    """None, or ``value`` as a float: TypeError unless a real number (not bool), ValueError
    unless positive and finite."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
    return value


def check_choice(name: str, value: object, choices: tuple, none_ok: bool = False) -> None:
    """TypeError unless ``value`` is a str (or None with ``none_ok``), ValueError unless it is
    one of ``choices``."""
    if value is None and none_ok:
        return
    allowed = f"{'None or ' if none_ok else ''}one of {choices}"
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_block_size(block_size: int) -> int:
    """``block_size`` as an int; TypeError unless integral, ValueError unless a power of two
    >= 16 (MSA_SPEC section 1)."""
    block_size = check_int("block_size", block_size)
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    return block_size


def check_selection_budget(top_k: int, init_blocks: int,
                           local_blocks: int) -> Tuple[int, int, int]:
    """``(top_k, init_blocks, local_blocks)`` as ints; TypeError unless integral, ValueError
    unless ``top_k >= init_blocks + local_blocks``, init_blocks >= 0 and local_blocks >= 1."""
    top_k = check_int("top_k", top_k)
    init_blocks = check_int("init_blocks", init_blocks)
    local_blocks = check_int("local_blocks", local_blocks)
    if init_blocks < 0:
        raise ValueError(f"init_blocks must be >= 0, got {init_blocks}")
    if local_blocks < 1:
        raise ValueError(
            f"local_blocks must be >= 1 (the query's own block keeps the support non-empty), "
            f"got {local_blocks}"
        )
    if top_k < init_blocks + local_blocks:
        raise ValueError(
            f"top_k ({top_k}) must be >= init_blocks + local_blocks "
            f"({init_blocks} + {local_blocks})"
        )
    return top_k, init_blocks, local_blocks


def check_mode(mode: str) -> None:
    """TypeError unless ``mode`` is a str, ValueError unless ``"sparse"`` or ``"dense"``."""
    check_choice("mode", mode, MODES)


def check_backend(backend: Optional[str]) -> None:
    """TypeError unless ``backend`` is None or a str, ValueError unless a known name."""
    check_choice("backend", backend, BACKENDS, none_ok=True)
