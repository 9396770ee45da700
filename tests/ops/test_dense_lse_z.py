"""The finite-input student LSE of the Gluon dense KL (msa_megatron/ops/triton/dense_lse_z.py),
on the CPU under the Triton interpreter: against the float64 logsumexp and the general kernel
(:func:`.dense_kl.student_lse`), over one sequence, packed documents, rows shorter than a tile,
several tile shapes (the masked-tile skip) and grouped index key heads; bad input raises."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops.triton.dense_kl import student_lse  # noqa: E402
from msa_megatron.ops.triton.dense_lse_z import student_lse_finite  # noqa: E402

# CUDA where there is a GPU (the kernels then run compiled), else the CPU (interpreter)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(lens, hi, hik, di, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q_pos, q_kbase = query_layout(cu.to(DEVICE), tokens, DEVICE)
    q_idx = (torch.randn(tokens, hi, di, generator=gen) * 2).to(dtype).to(DEVICE)
    k_idx = (torch.randn(tokens, hik, di, generator=gen) * 2).to(dtype).to(DEVICE)
    return q_idx, k_idx, q_pos.contiguous(), q_kbase.contiguous()


def _oracle(q_idx, k_idx, q_pos, q_kbase, scale):
    hi, hik = q_idx.shape[1], k_idx.shape[1]
    z = torch.einsum("thd,uhd->thu", q_idx.double(),
                     k_idx.double().repeat_interleave(hi // hik, dim=1)) * scale
    u = torch.arange(k_idx.shape[0], device=k_idx.device)
    lo, last = q_kbase.long(), (q_kbase + q_pos).long()
    inside = (u[None] >= lo[:, None]) & (u[None] <= last[:, None])
    return torch.logsumexp(z.masked_fill(~inside[:, None], -float("inf")), dim=2)


@pytest.mark.parametrize("lens,hi,hik,dtype,tiles", [
    ([300], 2, 1, torch.float32, None),
    ([100, 7, 93, 1], 4, 2, torch.float16, None),
    ([5], 2, 2, torch.float32, (16, 32, 4)),  # shorter than one tile
    ([70, 150], 2, 1, torch.float32, (32, 16, 4)),  # documents cut tiles
    ([257], 1, 1, torch.float16, (16, 64, 4)),  # not a multiple of the tile
])
def test_matches_the_float64_oracle_and_the_general_kernel(lens, hi, hik, dtype, tiles):
    x = _inputs(lens, hi, hik, 32, dtype, seed=len(lens) + hi)
    got = student_lse_finite(*x, 0.3, tiles)
    want = _oracle(*x, 0.3)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max().item() < 2e-5 * want.abs().max().item() + 1e-5
    general = student_lse(*x, 0.3, 16, 16)
    assert (got - general).abs().max().item() < 1e-5 * general.abs().max().item() + 1e-5


def test_large_logits_stay_finite():
    """Logits of ~1e3 (the running max must rescale, never give inf - inf)."""
    q_idx, k_idx, q_pos, q_kbase = _inputs([90], 2, 1, 16, torch.float32, seed=3)
    got = student_lse_finite(q_idx * 30, k_idx * 30, q_pos, q_kbase, 1.0)
    want = _oracle(q_idx * 30, k_idx * 30, q_pos, q_kbase, 1.0)
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() < 1e-6 * want.abs().max().item()


def test_empty_and_bad_input():
    q_idx, k_idx, q_pos, q_kbase = _inputs([10], 2, 1, 16, torch.float32, seed=0)
    assert student_lse_finite(q_idx[:0], k_idx, q_pos[:0], q_kbase[:0], 1.0).shape == (0, 2)
    with pytest.raises(ValueError, match="share Di"):
        student_lse_finite(q_idx, k_idx[..., :8], q_pos, q_kbase, 1.0)
    with pytest.raises(ValueError, match="must divide Hi"):
        student_lse_finite(q_idx[:, :1], torch.cat([k_idx, k_idx], 1), q_pos, q_kbase, 1.0)
    with pytest.raises(ValueError, match=r"q_pos and q_kbase must be \[Tq\]"):
        student_lse_finite(q_idx, k_idx, q_pos[:5], q_kbase, 1.0)
    with pytest.raises(ValueError, match="unit last stride"):
        student_lse_finite(q_idx.transpose(0, 2).contiguous().transpose(0, 2), k_idx, q_pos,
                           q_kbase, 1.0)


@pytest.mark.parametrize("lens,cp_size,cp_rank", [([64, 8, 56], 2, 1), ([96], 4, 2)])
def test_cp_layout_rows_against_all_keys(lens, cp_size, cp_rank):
    """One CP rank's rows (fewer query rows than keys, rows starting mid-document, per-row key
    bases; megatron-core's load-balanced split): the tile skip and the TMA loads past Tq / Tk
    against the float64 oracle."""
    from msa_megatron.parallel.cp_layout import build_cp_layout

    q_idx, k_idx, _, _ = _inputs(lens, 2, 1, 16, torch.float32, seed=cp_rank)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    layout = build_cp_layout(cu.to(DEVICE), cp_size, cp_rank, 1, DEVICE)
    x = (q_idx[layout.local_rows].contiguous(), k_idx, layout.q_pos.contiguous(),
         layout.q_kbase.contiguous())
    assert x[0].shape[0] < x[1].shape[0]
    for tiles in (None, (16, 32, 4)):
        got = student_lse_finite(*x, 0.4, tiles)
        want = _oracle(*x, 0.4)
        assert (got.double() - want).abs().max().item() < 2e-5 * want.abs().max().item() + 1e-5
