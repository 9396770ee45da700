"""Load a repository script (``benchmarks/*.py``, not a package module) as a module, for tests
of its functions without running it as a program."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(relpath: str, register: bool = False) -> ModuleType:
    """The module of the script at ``REPO / relpath``, named after the file's stem.

    ``register`` also puts it in ``sys.modules`` under that name (dataclasses and pickling look
    their module up there)."""
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
