"""patches/ apply cleanly to megatron-core 0.19.2's ``megatron/training`` and stay consistent.

The tree comes from the megatron-core 0.19.2 wheel (``megatron.training`` ships inside it). The
wheel is looked up in ``$MSA_MEGATRON_CACHE/wheels`` (``.ci/run`` pre-downloads it there), else
downloaded with pip; the tests skip, saying why, only when neither works (offline machine).
The wheel needs Python >= 3.12, so it is unpacked, never installed: the checks are textual
(``git apply --check``, ``patch --dry-run``), syntactic (the patched files compile) and, for the
argument flags, functional (the patched flag parser, which calls the library's
``add_msa_arguments``, is run on its own, alone and under the launch kit's).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import List

import pytest

from msa_megatron import MSAConfig
from msa_megatron.megatron import add_msa_arguments, msa_config_from_args

REPO = Path(__file__).resolve().parents[2]
PATCHES = sorted((REPO / "patches").glob("*.patch"))
BASE_VERSION = "0.19.2"
TREE_PREFIX = "megatron/training/"
DOWNLOAD_TIMEOUT_S = 300
MSA_ARG_NODES = ("_add_msa_args",)
KIT = REPO / "examples" / "megatron_lm"


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "msa-megatron"
    return Path(os.environ.get("MSA_MEGATRON_CACHE", default)) / "wheels"


def _find_wheel(directory: Path) -> List[Path]:
    return sorted(directory.glob(f"megatron_core-{BASE_VERSION}-*.whl"))


@pytest.fixture(scope="module")
def base_wheel() -> Path:
    cache = _cache_dir()
    if not _find_wheel(cache):
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", f"megatron-core=={BASE_VERSION}", "-d", str(cache)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"megatron-core {BASE_VERSION} wheel not cached in {cache} and the "
                        f"download timed out (offline?)")
        if proc.returncode != 0 or not _find_wheel(cache):
            pytest.skip(f"megatron-core {BASE_VERSION} wheel not cached in {cache} and pip could "
                        f"not download it (offline?): {proc.stderr.strip()[-300:]}")
    return _find_wheel(cache)[0]


@pytest.fixture()
def training_tree(base_wheel: Path, tmp_path: Path) -> Path:
    """A fresh copy of the wheel's megatron/training; returns the directory holding megatron/."""
    with zipfile.ZipFile(base_wheel) as wheel:
        members = [m for m in wheel.namelist() if m.startswith(TREE_PREFIX)]
        assert members, f"{base_wheel.name} has no {TREE_PREFIX}"
        wheel.extractall(tmp_path, members)
    return tmp_path


def test_patches_exist():
    assert [p.name for p in PATCHES] == [
        "0001-msa-arguments.patch",
        "0002-msa-layer-spec.patch",
        "0003-msa-warmup-and-kl-logging.patch",
    ]


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_git_apply_check(training_tree: Path):
    proc = subprocess.run(["git", "apply", "--check", "-v", *map(str, PATCHES)],
                          cwd=training_tree, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patch_applies_without_fuzz(training_tree: Path):
    for patch in PATCHES:
        proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(patch)],
                              cwd=training_tree, capture_output=True, text=True)
        assert proc.returncode == 0, f"{patch.name}:\n{proc.stdout}{proc.stderr}"
        assert "fuzz" not in proc.stdout, f"{patch.name} needed fuzz:\n{proc.stdout}"
    assert not list(training_tree.rglob("*.rej"))


def _apply_all(tree: Path) -> None:
    for patch in PATCHES:
        subprocess.run(["patch", "-p1", "--forward", "--batch", "--quiet", "-i", str(patch)],
                       cwd=tree, check=True)


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patched_files_compile(training_tree: Path):
    _apply_all(training_tree)
    for name in ("arguments.py", "argument_utils.py", "training.py"):
        path = training_tree / TREE_PREFIX / name
        compile(path.read_text(), str(path), "exec")


def _enclosing_tests(tree: ast.AST, target: ast.AST) -> List[str]:
    """Source of the ``if`` tests around ``target`` (outermost first)."""
    found: List[str] = []

    def visit(node: ast.AST, tests: List[str]) -> bool:
        if node is target:
            found.extend(tests)
            return True
        inner = tests + [ast.unparse(node.test)] if isinstance(node, ast.If) else tests
        if isinstance(node, ast.If):  # the test itself is not inside the branch
            return any(visit(child, inner) for child in node.body) or any(
                visit(child, tests) for child in node.orelse)
        return any(visit(child, tests) for child in ast.iter_child_nodes(node))

    visit(tree, [])
    return found


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patched_training_log_gathers_msa_metrics_at_the_log_interval(training_tree: Path):
    """get_msa_metrics (a world all-reduce) runs only on the iterations Megatron prints, like
    the entry point's MSAMetricsLog, never every iteration."""
    _apply_all(training_tree)
    tree = ast.parse((training_tree / TREE_PREFIX / "training.py").read_text())
    log = next(node for node in ast.walk(tree)
               if isinstance(node, ast.FunctionDef) and node.name == "training_log")
    calls = [node for node in ast.walk(log) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Name) and node.func.id == "get_msa_metrics"]
    assert len(calls) == 1
    tests = _enclosing_tests(log, calls[0])
    assert any("args.log_interval" in test and "args.msa" in test for test in tests), tests


def _msa_argument_functions(arguments_py: Path) -> dict:
    """Execute only the MSA flag definitions of the patched arguments.py (megatron.training
    itself needs Python >= 3.12 and CUDA-era imports)."""
    tree = ast.parse(arguments_py.read_text())
    nodes = [n for n in tree.body
             if (isinstance(n, ast.FunctionDef) and n.name in MSA_ARG_NODES)
             or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in MSA_ARG_NODES
                                                   for t in n.targets))]
    assert len(nodes) == len(MSA_ARG_NODES), [getattr(n, "name", None) for n in nodes]
    namespace: dict = {}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(arguments_py), "exec"), namespace)
    return namespace


def _msa_flags(parser: argparse.ArgumentParser) -> set:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--msa")}


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patched_flags_build_msa_config(training_tree: Path):
    """The patched parser's --msa-* flags are the library's (add_msa_arguments), and the
    library's msa_config_from_args builds the config the patched code uses."""
    _apply_all(training_tree)
    fns = _msa_argument_functions(training_tree / TREE_PREFIX / "arguments.py")
    parser = fns["_add_msa_args"](argparse.ArgumentParser())
    library = add_msa_arguments(argparse.ArgumentParser())
    assert _msa_flags(parser) == _msa_flags(library) | {"--msa"}
    titles = [g.title for g in parser._action_groups]
    assert titles.count("MiniMax Sparse Attention (msa-megatron)") == 1

    defaults = msa_config_from_args(parser.parse_args([]))
    assert defaults == dataclasses.replace(MSAConfig(), mode="sparse")
    args = parser.parse_args(["--msa", "--msa-top-k", "8", "--msa-block-size", "64",
                              "--msa-index-head-dim", "64", "--msa-kl-coeff", "0.5",
                              "--msa-warmup-steps", "100", "--msa-cp-kv-exchange", "selective"])
    assert args.msa
    config = msa_config_from_args(args)
    assert (config.top_k, config.block_size, config.index_head_dim, config.kl_coeff) == (8, 64, 64, 0.5)
    assert (config.mode, config.cp_kv_exchange) == ("dense", "selective")
    with pytest.raises(ValueError, match="top_k"):
        msa_config_from_args(parser.parse_args(["--msa-top-k", "0"]))


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patched_code_calls_the_library(training_tree: Path):
    """No flag -> MSAConfig mapping of its own in the patched megatron.training: the layer spec
    takes msa_megatron.megatron.msa_config_from_args."""
    _apply_all(training_tree)
    arguments = (training_tree / TREE_PREFIX / "arguments.py").read_text()
    argument_utils = (training_tree / TREE_PREFIX / "argument_utils.py").read_text()
    assert "from msa_megatron.megatron import add_msa_arguments" in arguments
    assert not re.search(r"add_argument\(\s*'--msa-", arguments)
    assert "def msa_config_from_args" not in arguments
    assert "from msa_megatron.megatron import get_gpt_layer_msa_spec, msa_config_from_args" in \
        argument_utils


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_patched_parser_without_msa_megatron_has_only_msa(training_tree: Path, monkeypatch):
    """megatron.training patched but msa-megatron not installed: --msa only, no import error."""
    _apply_all(training_tree)
    fns = _msa_argument_functions(training_tree / TREE_PREFIX / "arguments.py")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "msa_megatron" else find_spec(name, *a))
    assert _msa_flags(fns["_add_msa_args"](argparse.ArgumentParser())) == {"--msa"}


@pytest.mark.skipif(shutil.which("patch") is None, reason="GNU patch is not installed")
def test_kit_on_the_patched_parser_adds_no_flag_twice(training_tree: Path):
    """The launch kit's extra_args_provider on top of the patched parser: only its --dense-gpt
    is new (argparse would raise on a second --msa-top-k)."""
    _apply_all(training_tree)
    fns = _msa_argument_functions(training_tree / TREE_PREFIX / "arguments.py")
    parser = fns["_add_msa_args"](argparse.ArgumentParser())
    before = _msa_flags(parser)
    sys.path.insert(0, str(KIT))
    try:
        import msa_gpt_setup
    finally:
        sys.path.remove(str(KIT))
    assert msa_gpt_setup.parser_has_msa_flags(parser)
    msa_gpt_setup.add_msa_args(parser)
    assert _msa_flags(parser) == before
    args = parser.parse_args(["--dense-gpt", "--msa-top-k", "3"])
    assert args.dense_gpt and msa_gpt_setup.msa_config_from_args(args).top_k == 3
