"""Observe the library from tests without test-only hooks in it: spies on public seams."""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator

from msa_megatron.ops.backends import get_backend


@contextlib.contextmanager
def count_selections(backend: str) -> Iterator[Dict[str, int]]:
    """Count the calls of a backend's ``select`` core while the context is open.

    Yields a dict ``{"calls", "rows"}`` updated in place: selection calls, and selected
    (query token, index head) rows (``q_idx.shape[0] * q_idx.shape[1]`` per call). The composer
    looks the backend up at every call, so replacing the module attribute is seen.
    """
    module = get_backend(backend)
    original = module.select
    counts = {"calls": 0, "rows": 0}

    def spy(q_idx, *args, **kwargs):
        counts["calls"] += 1
        counts["rows"] += q_idx.shape[0] * q_idx.shape[1]
        return original(q_idx, *args, **kwargs)

    module.select = spy
    try:
        yield counts
    finally:
        module.select = original
