"""The layer's THD RoPE (``msa_megatron.megatron.index.apply_rope``) gathers the table rows of
all packed tokens at once instead of megatron-core's per-sequence loop; it must give
megatron-core's values bitwise, under CP too (every rank of the load-balanced layout)."""

import pytest
import torch

pytest.importorskip("megatron.core")
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from msa_megatron.megatron.index import apply_rope, thd_rope_positions  # noqa: E402


class _Group:
    """The two methods megatron-core's THD RoPE asks of a CP group."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                             use_cpu_initialization=True, **kw)


def _freqs(rows: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(rows, dtype=torch.float32), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]  # [rows, 1, 1, dim], megatron's layout


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize("packed_table", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_thd_rope_matches_megatron_core_bitwise(cp_size, packed_table, interleaved):
    gen = torch.Generator().manual_seed(7 * cp_size + packed_table + 3 * interleaved)
    # many documents of uneven lengths, each a multiple of 2 * cp_size (megatron's CP layout)
    lens = (torch.randint(1, 9, (37,), generator=gen) * 2 * cp_size).tolist()
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    total, heads, dim, rot = int(cu[-1]), 3, 16, 12  # partial rotary: the last 4 dims pass
    freqs = _freqs(total if packed_table else max(lens), rot)
    config = _config(rotary_interleaved=interleaved)
    for rank in range(cp_size):
        group = _Group(cp_size, rank)
        t = torch.randn(total // cp_size, heads, dim, generator=gen)
        want = apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu, cp_group=group)
        got = apply_rope(t, freqs, config, cu, group)
        assert torch.equal(got, want), (cp_size, rank, (got - want).abs().max())


def test_thd_rope_positions_restart_per_sequence_and_follow_the_cp_chunks():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    assert thd_rope_positions(cu, 12, 1, 0, False).tolist() == list(range(8)) + list(range(4))
    assert thd_rope_positions(cu, 12, 1, 0, True).tolist() == list(range(12))
    # CP 2: sequence 0 (8 tokens) is chunks [0,1][2,3][4,5][6,7]; rank 0 holds 0 and 3
    assert thd_rope_positions(cu, 6, 2, 0, False).tolist() == [0, 1, 6, 7, 0, 3]
    assert thd_rope_positions(cu, 6, 2, 1, False).tolist() == [2, 3, 4, 5, 1, 2]
    assert thd_rope_positions(cu, 6, 2, 1, True).tolist() == [2, 3, 4, 5, 9, 10]


def test_bshd_and_no_freqs_unchanged():
    config = _config()
    t = torch.randn(10, 2, 3, 16)
    freqs = _freqs(10, 16)
    assert torch.equal(apply_rope(t, freqs, config, None, _Group(1, 0)),
                       apply_rotary_pos_emb(t, freqs, config=config, cp_group=_Group(1, 0)))
    assert apply_rope(t, None, config, None, None) is t


@pytest.mark.parametrize("lens,cp_size,rows", [([6, 4], 2, 5), ([8, 6], 2, 7), ([8, 4], 4, 3),
                                               ([8, 4], 1, 11)])
def test_thd_rope_refuses_what_megatron_core_cannot_lay_out(lens, cp_size, rows):
    """Lengths not divisible by 2 * CP, or rows that are not cu_seqlens[-1] / CP: a clear
    ValueError, never rotations read from the wrong table rows."""
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    t = torch.randn(rows, 2, 16)
    with pytest.raises(ValueError, match="THD RoPE"):
        apply_rope(t, _freqs(2048, 16), _config(), cu, _Group(cp_size, 0))


def test_thd_rope_on_meta_tensors_infers_the_shape():
    cu = torch.tensor([0, 8, 12], dtype=torch.int32, device="meta")
    t = torch.empty(12, 2, 16, device="meta", dtype=torch.bfloat16)
    out = apply_rope(t, _freqs(16, 16).to("meta"), _config(), cu, _Group(1, 0))
    assert out.is_meta and out.shape == t.shape and out.dtype == t.dtype


@pytest.mark.parametrize("cp_size", [1, 2])
def test_one_layer_forward_builds_the_table_rows_once(monkeypatch, cp_size):
    """q, k, q_idx and k_idx of one layer forward share a cache: the positions are built (and
    the layout checked) once per cu_seqlens and the table rows gathered once per (freqs,
    cu_seqlens), each rotation still megatron-core's bitwise; other freqs get their own rows."""
    from msa_megatron.megatron import index

    built = []
    original = index.thd_rope_positions
    monkeypatch.setattr(index, "thd_rope_positions",
                        lambda *a, **k: built.append(a) or original(*a, **k))
    lens = [8 * cp_size, 4 * cp_size, 12 * cp_size]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    config, group = _config(), _Group(cp_size, cp_size - 1)
    freqs = _freqs(64, 12)
    rows = int(cu[-1]) // cp_size
    cache = {}
    for heads, dim in ((4, 16), (2, 16), (3, 32), (1, 32)):  # q, k, q_idx, k_idx
        t = torch.randn(rows, heads, dim)
        want = apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu, cp_group=group)
        assert torch.equal(apply_rope(t, freqs, config, cu, group, cache), want)
    assert len(built) == 1
    tables = [v for k, v in cache.items() if k[0] == "table"]
    assert len(tables) == 1
    other = _freqs(64, 12, base=500.0)  # a different table (e.g. the k side's) on the same cu
    t = torch.randn(rows, 2, 16)
    want = apply_rotary_pos_emb(t, other, config=config, cu_seqlens=cu, cp_group=group)
    assert torch.equal(apply_rope(t, other, config, cu, group, cache), want)
    assert len(built) == 1 and len([k for k in cache if k[0] == "table"]) == 2
