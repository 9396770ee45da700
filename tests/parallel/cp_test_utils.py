"""Helpers shared by the context-parallel tests."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import selected_device


def skip_without_gpus(world_size: int) -> None:
    """NCCL runs one rank per GPU (``MSA_TEST_DEVICE=cuda``); gloo on CPU runs any size."""
    if selected_device() == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs under NCCL")
