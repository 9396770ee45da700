"""msa-megatron: MiniMax Sparse Attention (MSA) training for megatron-core.

Public API: :func:`msa_attention`, :func:`select_blocks`, :class:`MSAConfig`.
"""

from .config import MSAConfig
from .api import msa_attention, select_blocks

__all__ = ["MSAConfig", "msa_attention", "select_blocks"]
__version__ = "0.1.0"
