"""The process groups one MSA layer talks to, in one object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .comm import group_size


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups of one MSA layer on this rank.

    Attributes:
        cp: the context-parallel group (None or one rank: no context parallelism).
        tp_share: the tensor-parallel ranks holding this rank's single index head when
            ``Hi < TP`` (TP > Hkv, :func:`msa_megatron.parallel.tensor.share_group`); None or one
            rank when the rank owns whole index heads.
    """

    cp: Optional[dist.ProcessGroup] = None
    tp_share: Optional[dist.ProcessGroup] = None

    @property
    def cp_size(self) -> int:
        """Context-parallel size (1 without CP)."""
        return group_size(self.cp)

    @property
    def share_size(self) -> int:
        """Ranks sharing this rank's index head (1 unless TP > Hkv)."""
        return group_size(self.tp_share)


NO_GROUPS = ParallelGroups()
