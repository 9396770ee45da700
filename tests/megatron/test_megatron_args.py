"""Command-line flags -> MSAConfig, written once (:mod:`msa_megatron.megatron.args`): the
``--msa-*`` flags of Megatron-LM, the unprefixed flags of the tiny example and the JSON of
``MSA_CONFIG`` all give the same config."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from msa_megatron import MSAConfig
from msa_megatron.megatron import add_msa_arguments, msa_config_from_args
from msa_megatron.megatron.args import GROUP_TITLE, msa_config_from_mapping

REPO = Path(__file__).resolve().parents[2]


def _parse(argv, **kwargs):
    parser = argparse.ArgumentParser()
    add_msa_arguments(parser, **kwargs)
    return parser.parse_args(argv)


def test_defaults_are_msa_config_defaults():
    assert msa_config_from_args(_parse([])) == MSAConfig()


def test_flags_set_fields_and_warmup_starts_dense():
    args = _parse(["--msa-block-size", "64", "--msa-top-k", "4", "--msa-init-blocks", "1",
                   "--msa-index-heads", "4", "--msa-kl-coeff", "0.5", "--msa-backend", "torch",
                   "--msa-cp-kv-exchange", "selective", "--msa-softmax-scale", "0.2",
                   "--msa-warmup-steps", "3"])
    assert msa_config_from_args(args) == MSAConfig(
        block_size=64, top_k=4, init_blocks=1, index_heads=4, kl_coeff=0.5, backend="torch",
        cp_kv_exchange="selective", softmax_scale=0.2, mode="dense")
    assert args.msa_warmup_steps == 3
    assert msa_config_from_args(args, mode="sparse").mode == "sparse"
    assert msa_config_from_args(_parse(["--msa-warmup-steps", "0"])).mode == "sparse"


def test_unprefixed_flags_with_other_defaults():
    defaults = MSAConfig(block_size=64, top_k=8, index_head_dim=64)
    args = _parse(["--top-k", "6"], prefix="", defaults=defaults, warmup=False)
    assert not hasattr(args, "warmup_steps")
    assert msa_config_from_args(args, prefix="", mode="dense") == dataclasses.replace(
        defaults, top_k=6, mode="dense")


def test_flags_left_at_none_keep_defaults_and_are_not_added_twice():
    """A parser that already has the flags, defaulting to None (the patched megatron.training):
    they are not added again, and None means MSAConfig's default."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--msa-top-k", type=int, default=None)
    parser.add_argument("--msa-warmup-steps", type=int, default=0)
    add_msa_arguments(parser)
    args = parser.parse_args([])
    assert args.msa_top_k is None
    assert msa_config_from_args(args) == MSAConfig()
    assert msa_config_from_args(parser.parse_args(["--msa-top-k", "3"])).top_k == 3


def test_invalid_values_raise():
    with pytest.raises(SystemExit):  # argparse: a backend that does not exist
        _parse(["--msa-backend", "cuda"])
    with pytest.raises(ValueError, match="top_k"):
        msa_config_from_args(_parse(["--msa-top-k", "0"]))


def test_mapping():
    assert msa_config_from_mapping({"top_k": 5}) == MSAConfig(top_k=5)
    from_numpy = msa_config_from_mapping({"top_k": np.int64(5), "block_size": np.int32(64)})
    assert from_numpy == MSAConfig(top_k=5, block_size=64) and type(from_numpy.top_k) is int
    with pytest.raises(ValueError, match="unknown MSAConfig fields"):
        msa_config_from_mapping({"topk": 5})
    with pytest.raises(ValueError, match="JSON object"):
        msa_config_from_mapping([1])


def test_megatron_lm_patch_calls_the_library():
    """The Megatron-LM patch adds only ``--msa``; the ``--msa-*`` flags and the config they
    build come from this module."""
    patch = (REPO / "patches" / "0001-msa-arguments.patch").read_text()
    assert set(re.findall(r"'(--msa[a-z-]*)'", patch)) == {"--msa"}
    assert "from msa_megatron.megatron import add_msa_arguments" in patch
    spec = (REPO / "patches" / "0002-msa-layer-spec.patch").read_text()
    assert "from msa_megatron.megatron import get_gpt_layer_msa_spec, msa_config_from_args" in spec


def test_flags_join_an_existing_group_of_the_same_title():
    parser = argparse.ArgumentParser()
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument("--msa", action="store_true")
    add_msa_arguments(parser)
    assert [g.title for g in parser._action_groups].count(GROUP_TITLE) == 1
    assert "--msa-top-k" in {s for a in group._group_actions for s in a.option_strings}


def test_negative_warmup_steps_are_refused_at_parse_time(capsys):
    """A negative ``--msa-warmup-steps`` used to parse into a sparse config and fail only at
    the patched loop's first iteration (adversarial check 2026-12-07 s23)."""
    with pytest.raises(SystemExit):
        _parse(["--msa-warmup-steps", "-3"])
    assert "--msa-warmup-steps: -3 must be >= 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--msa-warmup-steps -1 must be >= 0"):
        msa_config_from_args(argparse.Namespace(msa_warmup_steps=-1))
