"""The Megatron-LM launch kit stays consistent with MSAConfig and with patches/.

``examples/megatron_lm/pretrain_msa_gpt.py`` imports ``megatron.training`` (megatron-core >= 0.17,
Python >= 3.12), which CI's Python cannot import; its MSA flag functions are therefore executed
on their own (taken from the file's syntax tree), like the patched flags in test_patches.py.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from msa_megatron import MSAConfig
from msa_megatron.config import BACKENDS, CP_KV_EXCHANGES

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "examples" / "megatron_lm"
ENTRY_POINT = KIT / "pretrain_msa_gpt.py"
ARGS_SCRIPT = KIT / "msa_gpt_args.sh"
ARGUMENTS_PATCH = REPO / "patches" / "0001-msa-arguments.patch"
FUNCTIONS = ("add_msa_args", "msa_config_from_args", "msa_mode_at")


@pytest.fixture(scope="module")
def kit() -> dict:
    tree = ast.parse(ENTRY_POINT.read_text())
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in FUNCTIONS]
    assert sorted(n.name for n in nodes) == sorted(FUNCTIONS)
    namespace = {"argparse": argparse, "MSAConfig": MSAConfig, "BACKENDS": BACKENDS,
                 "CP_KV_EXCHANGES": CP_KV_EXCHANGES}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), str(ENTRY_POINT), "exec"), namespace)
    namespace["parser"] = namespace["add_msa_args"](argparse.ArgumentParser())
    return namespace


def _flags(parser: argparse.ArgumentParser) -> set:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--msa")}


def test_defaults_are_msa_config_defaults(kit):
    config = kit["msa_config_from_args"](kit["parser"].parse_args([]))
    assert config == MSAConfig()
    warm = kit["msa_config_from_args"](kit["parser"].parse_args(["--msa-warmup-steps", "10"]))
    assert warm == dataclasses.replace(MSAConfig(), mode="dense")


def test_flags_reach_the_config(kit):
    args = kit["parser"].parse_args([
        "--msa-block-size", "64", "--msa-top-k", "8", "--msa-init-blocks", "1",
        "--msa-local-blocks", "2", "--msa-index-heads", "4", "--msa-index-key-heads", "2",
        "--msa-index-head-dim", "64", "--msa-kl-coeff", "0.25", "--msa-backend", "torch",
        "--msa-cp-kv-exchange", "selective"])
    assert kit["msa_config_from_args"](args) == MSAConfig(
        block_size=64, top_k=8, init_blocks=1, local_blocks=2, index_heads=4, index_key_heads=2,
        index_head_dim=64, kl_coeff=0.25, backend="torch", cp_kv_exchange="selective")
    with pytest.raises(ValueError, match="top_k"):
        kit["msa_config_from_args"](kit["parser"].parse_args(["--msa-top-k", "0"]))


def test_warmup_switch(kit):
    assert [kit["msa_mode_at"](i, 2) for i in range(4)] == ["dense", "dense", "sparse", "sparse"]
    assert kit["msa_mode_at"](0, 0) == "sparse"


def test_patch_offers_the_same_flags(kit):
    patch_flags = set(re.findall(r"^\+.*add_argument\('(--msa[a-z-]*)'", ARGUMENTS_PATCH.read_text(),
                                 flags=re.MULTILINE))
    assert patch_flags - {"--msa"} == _flags(kit["parser"])


def test_launch_scripts_use_known_msa_flags(kit):
    used = set(re.findall(r"(--msa-[a-z-]+)", ARGS_SCRIPT.read_text()))
    assert used and used <= _flags(kit["parser"])
