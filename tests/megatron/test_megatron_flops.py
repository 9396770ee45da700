"""The FLOPs count of an MSA layer (issue 16: Megatron's TFLOP/s counts MSA layers as dense)."""

from __future__ import annotations

import numpy as np
import pytest

from msa_megatron.megatron.flops import (
    attended_pairs,
    dense_pairs,
    megatron_dense_core_flops,
    msa_layer_flops,
)

SHAPE = dict(hidden_size=16, num_heads=2, head_dim=4, index_heads=1, index_key_heads=1,
             index_head_dim=4, block_size=2, top_k=2)


def test_pairs_by_hand():
    # L=8, B=2, top_k=2: query p sees its own block up to itself and one earlier full block.
    # p:     0  1  2  3  4  5  6  7
    # keys:  1  2  3  4  3  4  3  4   -> 24
    assert attended_pairs(8, 2, 2) == 24
    assert dense_pairs(8) == 36
    # top_k covering every block: dense
    assert attended_pairs(8, 2, 4) == dense_pairs(8)
    # a last block of 1 token: L=5, B=2, top_k=3 -> 1 2 3 4 5
    assert attended_pairs(5, 2, 3) == 15
    assert attended_pairs(5, 2, 1) == 1 + 2 + 1 + 2 + 1


def test_layer_flops_by_hand():
    terms = msa_layer_flops(8, **SHAPE)
    assert terms["attention"] == 3 * 2 * 2 * (2 * 4) * 24 == 2304
    assert terms["selection"] == 2 * (1 * 4) * 36 == 288
    assert terms["kl"] == 2 * 8 * 24 + 3 * 2 * 4 * 24 == 960
    assert terms["index_projections"] == 2 * 2 * 8 * 16 * (1 + 1) * 4 == 4096
    assert terms["total"] == 2304 + 288 + 960 + 4096
    dense = msa_layer_flops(8, **{**SHAPE}, mode="dense")
    assert dense["attention"] == 3 * 2 * 2 * 8 * 36 and dense["selection"] == 0
    assert dense["kl"] == 2 * 8 * 36 + 3 * 2 * 4 * 36


def test_megatron_dense_term():
    # Megatron: 3 (fwd+bwd) * 2 (FMA) * Hq*D / 2 (causal) * 2 (QK^T, PV) * L^2
    assert megatron_dense_core_flops(8, num_heads=2, head_dim=4) == 3 * 2 * 8 / 2 * 2 * 64


def test_sparse_is_cheaper_at_length():
    long = msa_layer_flops(65536, hidden_size=6144, num_heads=64, head_dim=128, index_heads=4,
                           index_key_heads=1, index_head_dim=128, block_size=128, top_k=16)
    dense = megatron_dense_core_flops(65536, num_heads=64, head_dim=128)
    assert long["attention"] < dense / 10


def test_bad_arguments():
    with pytest.raises(ValueError, match="block_size"):
        attended_pairs(8, 0, 2)
    with pytest.raises(ValueError, match="mode"):
        msa_layer_flops(8, **SHAPE, mode="fast")
    with pytest.raises(TypeError, match="seq_len"):
        dense_pairs(8.0)


def test_numpy_integers_are_ints_and_bool_is_not():
    shape = {k: np.int64(v) for k, v in SHAPE.items()}
    assert msa_layer_flops(np.int32(8), **shape) == msa_layer_flops(8, **SHAPE)
    assert attended_pairs(np.int64(8), np.int64(2), np.int16(2)) == 24
    assert type(attended_pairs(np.int64(8), np.int64(2), np.int64(2))) is int
    assert megatron_dense_core_flops(np.int64(8), num_heads=np.int64(2), head_dim=4) == \
        megatron_dense_core_flops(8, num_heads=2, head_dim=4)
    with pytest.raises(TypeError, match="top_k"):
        attended_pairs(8, 2, True)
