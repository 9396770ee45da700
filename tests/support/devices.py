"""Device switches and tolerances shared by the multi-rank tests (no megatron-core import)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import selected_device

BACKEND_ENV = "MSA_TEST_BACKEND"  # e.g. "triton" on GPUs; default "torch"


def skip_without_gpus(world_size: int) -> None:
    """NCCL runs one rank per GPU (``MSA_TEST_DEVICE=cuda``); gloo on CPU runs any size."""
    if selected_device() == "cuda" and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} ranks need {world_size} GPUs under NCCL")


def tolerance(rtol: float, atol: float) -> dict:
    """Comparison tolerances: as given for the exact fp32 backends; x100 for the Triton backend,
    whose fp32 dots run in TF32 on GPUs."""
    scale = 100.0 if os.environ.get(BACKEND_ENV) == "triton" else 1.0
    return dict(rtol=rtol * scale, atol=atol * scale)
