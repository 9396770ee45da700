"""Dense-mode KL in one pass over Q K^T (msa_megatron/ops/triton/dense_kl.py).

Against the oracle in the context-parallel query layout (queries hold global positions against
a longer key buffer), against the two-pass kernels of kl_loss.py, bitwise determinism, NaN
reaching only the rows that read it, and the query-tile ranges of each key tile. The standard
layout is covered by tests/ops/test_triton.py (``test_kl_matches_reference[...-dense]``).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from tests.support.inputs import rel_err  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)


def _case(seed, cp, hq=8, hkv=2, hi=2, hik=1, d=16, di=16, dtype=torch.float32):
    """Inputs of the KL core: standard layout of 3 packed sequences, or (cp) the second half of
    each sequence as queries against all keys, with their global positions."""
    gen = torch.Generator().manual_seed(seed)
    lens = [37, 0, 52]
    cu = torch.tensor([0, 37, 37, 89], dtype=torch.int32, device=DEVICE)
    tk = sum(lens)
    q_pos, q_kbase = query_layout(cu, tk, DEVICE)
    rows = torch.arange(tk, device=DEVICE)
    if cp:
        keep = q_pos.long() >= torch.tensor([18, 0, 26], device=DEVICE)[
            torch.searchsorted(cu[1:].long(), rows, right=True).clamp(max=2)]
        rows, q_pos, q_kbase = rows[keep], q_pos[keep], q_kbase[keep]
    tq = rows.shape[0]
    q = _randn(tq, hq, d, gen=gen, dtype=dtype)
    k = _randn(tk, hkv, d, gen=gen, dtype=dtype)
    v = _randn(tk, hkv, d, gen=gen, dtype=dtype)
    q_idx = _randn(tq, hi, di, gen=gen, dtype=dtype).requires_grad_()
    k_idx = _randn(tk, hik, di, gen=gen, dtype=dtype).requires_grad_()
    return q, k, v, q_idx, k_idx, q_pos.contiguous(), q_kbase.contiguous()


def _triton_kl(q, k, v, q_idx, k_idx, q_pos, q_kbase, kl_scale=0.3):
    from msa_megatron.ops import triton as backend

    _, lse = backend.attention(q, k, v, None, q_pos, q_kbase, block_size=16,
                               index_heads=q_idx.shape[1])
    value = backend.kl(q, k, lse, q_idx, k_idx, None, q_pos, q_kbase, block_size=16,
                       kl_scale=kl_scale)
    return (value, *torch.autograd.grad(value, (q_idx, k_idx)))


@pytest.mark.parametrize("heads", [(8, 2, 2, 1), (4, 2, 4, 4), (16, 1, 1, 1)],
                         ids=["paper-like", "Hik=Hi", "G16"])
def test_matches_the_oracle_in_the_cp_layout(heads, seed):
    hq, hkv, hi, hik = heads
    q, k, v, q_idx, k_idx, q_pos, q_kbase = _case(seed, True, hq, hkv, hi, hik)
    got = _triton_kl(q, k, v, q_idx, k_idx, q_pos, q_kbase)
    leaves = [x.detach().double().requires_grad_() for x in (q_idx, k_idx)]
    want = ref.kl_core_reference(q.double(), k.double(), *leaves, None, q_pos, q_kbase,
                                 block_size=16, kl_scale=0.3)
    want_grads = torch.autograd.grad(want, leaves)
    assert abs(got[0].item() - want.item()) <= 1e-4 * abs(want.item()) + 1e-7
    for name, a, b in zip(("dq_idx", "dk_idx"), got[1:], want_grads):
        assert rel_err(a, b) < 2e-5, name


@pytest.mark.parametrize("cp", [False, True], ids=["standard", "cp"])
def test_equals_the_two_pass_kernels_and_is_deterministic(cp, seed, monkeypatch):
    x = _case(seed, cp)
    first = _triton_kl(*x)
    again = _triton_kl(*x)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    monkeypatch.setenv("MSA_DENSE_KL", "twopass")
    two = _triton_kl(*x)
    assert abs(first[0].item() - two[0].item()) <= 1e-5 * abs(two[0].item())
    for a, b in zip(first[1:], two[1:]):
        assert rel_err(a, b) < 1e-5


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # interpreter: NaN -> int
def test_nan_reaches_only_the_rows_that_read_it(seed):
    """A NaN index query of one token: its dq_idx row is NaN, every other row stays finite
    (fixed-point sums cannot hold NaN: the float side channel carries it)."""
    q, k, v, q_idx, k_idx, q_pos, q_kbase = _case(seed, False)
    bad = 50  # second sequence
    with torch.no_grad():
        q_idx[bad, 0, 3] = float("nan")
    value, dq_idx, dk_idx = _triton_kl(q, k, v, q_idx, k_idx, q_pos, q_kbase)
    assert torch.isnan(value)
    assert torch.isnan(dq_idx[bad, 0]).all()
    rows = torch.ones(dq_idx.shape[:2], dtype=torch.bool, device=DEVICE)
    rows[bad, 0] = False
    assert torch.isfinite(dq_idx[rows]).all()
    assert torch.isfinite(dk_idx[:37]).all(), "keys of the first sequence never meet the NaN"


def test_query_tile_ranges_cover_every_reader():
    from msa_megatron.ops.triton.dense_kl import _query_tile_ranges

    for cp in (False, True):
        _, k, _, _, _, q_pos, q_kbase = _case(0, cp)
        tk, bm, bn = k.shape[0], 8, 16
        m_lo, m_hi = _query_tile_ranges(q_pos, q_kbase, tk, bm, bn)
        first, last = q_kbase.long(), (q_kbase + q_pos).long()
        for n in range(m_lo.shape[0]):
            keys = torch.arange(n * bn, min((n + 1) * bn, tk), device=DEVICE)
            reads = ((keys[None, :] >= first[:, None]) & (keys[None, :] <= last[:, None])).any(1)
            tiles = torch.nonzero(reads).flatten() // bm
            if tiles.numel():
                assert m_lo[n] <= tiles.min() and tiles.max() < m_hi[n], (cp, n)
            # and the range is tight in the standard layout
            if not cp and tiles.numel():
                assert m_lo[n] == tiles.min() and m_hi[n] == tiles.max() + 1, n


def test_tile_setting_is_validated(monkeypatch):
    from msa_megatron.ops.triton import dense_kl

    monkeypatch.setenv(dense_kl.TILES_ENV, "64,100,8,2")
    with pytest.raises(ValueError, match="BN"):
        dense_kl.tiles()
    monkeypatch.setenv(dense_kl.TILES_ENV, "128,64,8,3")
    assert dense_kl.tiles() == (128, 64, 8, 3)


def test_packed_fields_unpack_exactly():
    """Two signed 32-bit fields per int64 (column 2c low, 2c + 1 high): sums of packed values
    unpack to the sums of each field, whatever the signs, up to |field sum| < 2^31."""
    from msa_megatron.ops.triton.dense_kl import _unpack_fixed

    gen = torch.Generator().manual_seed(3)
    fields = torch.randint(-(2 ** 24), 2 ** 24, (64, 5, 6, 2), generator=gen, dtype=torch.int64)
    fields[:, 0, 0] = torch.tensor([-(2 ** 24), 2 ** 24 - 1])  # both sums near +-2^30
    packed = fields[..., 1] * 2 ** 32 + fields[..., 0]  # what the kernel adds
    got = _unpack_fixed(packed.sum(0))
    assert torch.equal(got, fields.sum(0).flatten(-2))
    assert got[0, :2].tolist() == [-(2 ** 30), 64 * (2 ** 24 - 1)]


def test_head_bounds_are_powers_of_two_over_finite_values():
    from msa_megatron.ops.triton.dense_kl import _head_bounds

    k_idx = torch.zeros(5, 3, 4)
    k_idx[1, 0, 2] = -3.0  # bound 4
    k_idx[2, 1, 0] = 0.25  # exactly a power of two: bound 0.25
    k_idx[3, 1, 1] = float("inf")  # ignored
    k_idx[4, 1, 3] = float("nan")  # ignored
    assert _head_bounds(k_idx).tolist() == [4.0, 0.25, 1.0]  # head 2 all zero: 1


# student logits outside a row's support may overflow exp before the support drops them
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("spread", [1.0, 1e3], ids=["unit", "outlier-column"])
def test_fixed_point_keeps_small_gradients(spread, seed):
    """dq_idx in units of 2^-28 of the head's largest |k_idx|: one column a thousand times larger
    than the rest leaves the others' gradients as exact as with unit columns."""
    q, k, v, q_idx, k_idx, q_pos, q_kbase = _case(seed, False)
    with torch.no_grad():
        k_idx[:, :, 0] *= spread
    got = _triton_kl(q, k, v, q_idx, k_idx, q_pos, q_kbase)
    leaves = [x.detach().double().requires_grad_() for x in (q_idx, k_idx)]
    want = ref.kl_core_reference(q.double(), k.double(), *leaves, None, q_pos, q_kbase,
                                 block_size=16, kl_scale=0.3)
    want_dq = torch.autograd.grad(want, leaves)[0]
    rest = (slice(None), slice(None), slice(1, None))  # the columns that were not scaled
    assert rel_err(got[1][rest], want_dq[rest]) < 2e-5
    assert rel_err(got[1], want_dq) < 2e-5
