"""The package's import rules (docs/DESIGN.md, "Map"), read from the source with ``ast``:
``parallel/`` imports nothing of ``ops/`` or megatron-core, the oracle imports nothing it checks,
``ops/`` knows nothing of the composer, Megatron or the parallel layer."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Set

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "msa_megatron"


def _imports(path: Path) -> Set[str]:
    """Absolute dotted names of every module ``path`` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _files(folder: str) -> Iterator[Path]:
    yield from sorted((PACKAGE / folder).rglob("*.py"))


def _offending(paths, *prefixes: str):
    return {str(p.relative_to(PACKAGE)): sorted(n for n in _imports(p)
                                                if any(n == x or n.startswith(x + ".")
                                                       for x in prefixes))
            for p in paths}


@pytest.mark.parametrize("folder, forbidden", [
    ("parallel", ("msa_megatron.ops", "msa_megatron.core", "msa_megatron.megatron", "megatron",
                  "triton")),
    ("ops", ("msa_megatron.core", "msa_megatron.api", "msa_megatron.megatron",
             "msa_megatron.parallel", "megatron")),
])
def test_folder_imports(folder, forbidden):
    bad = {k: v for k, v in _offending(_files(folder), *forbidden).items() if v}
    assert not bad


def test_oracle_imports_nothing_it_checks():
    allowed = {"msa_megatron.layout", "msa_megatron.layout.query_layout"}
    names = {n for n in _imports(PACKAGE / "reference.py") if n.startswith("msa_megatron")}
    assert names <= allowed


def test_rule_reader_sees_relative_imports():
    """The reader itself: core.py's relative imports resolve to absolute names."""
    names = _imports(PACKAGE / "core.py")
    assert "msa_megatron.parallel.context" in names and "msa_megatron.ops.backends" in names
