"""pytest configuration: Triton's interpreter on machines without a GPU, and the ``seed``
fixture. The shared helpers live in :mod:`tests.support` (``tests/support/inputs.py`` for the op
tests)."""

from __future__ import annotations

import os
import shutil

# Triton kernels run in Triton's CPU interpreter when there is no GPU. The variable must be set
# before anything imports triton, so it is set here, first. (nvidia-smi is checked instead of
# torch.cuda so that torch is not imported before the variable is set.)
if shutil.which("nvidia-smi") is None and os.environ.get("MSA_TEST_DEVICE") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.support.inputs import seed_from


def pytest_sessionstart(session) -> None:
    """CUDA runs: start the multi-rank tests' fork server at once (tests/dist_utils.py), so that
    its imports overlap collection."""
    if os.environ.get("MSA_TEST_DEVICE") == "cuda":
        from tests.dist_utils import start_fork_server

        start_fork_server()


@pytest.fixture
def seed(request) -> int:
    """Per-test seed derived from the test id: fresh inputs per parametrisation, reproducible."""
    return seed_from(request.node.nodeid)
