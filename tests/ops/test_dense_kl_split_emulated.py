"""The split Gluon pass A (``_dense_kl_gluon_kernels.dense_kl_pass_a_split``) run from its own
source on the CPU by a thread-per-partition emulation of Gluon's mbarriers, TMA and async
wgmma (:mod:`tests.support.gluon_emu`): its mbarrier protocol completes (no deadlock, no
over-arrival) for Hq / Hi 1..16, Q rings 1..4, K rings 1..2, dz in or out of the p slot, with and
without gradients, chunks whose ranges are empty for some query tiles; and the orchestration
with it equals the torch stand-in (:func:`.dense_kl_gluon.pass_a_torch`); the fused kernel
(``dense_kl_pass_a``) too, and the host's own launches (:func:`.dense_kl_gluon.pass_a_gluon`)
of each. Two controls: a one-slot Q ring deadlocks, a slot freed early gives wrong numbers.
Products and TMA stores read shared memory only when waited for, so a slot released before its
reader finished gives wrong numbers. Warps inside one partition are not modelled (one thread
per partition)."""

import inspect
import os
import textwrap
import types

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from msa_megatron.ops.triton import dense_kl_gluon as dkg  # noqa: E402
from tests.support import gluon_emu  # noqa: E402
from tests.support.inputs import rel_err  # noqa: E402

from .test_dense_kl_gluon import _case, _cp_case, _lse  # noqa: E402


def _mutate(env, fn, edits):
    """Re-define ``fn`` (a ``@gluon.jit`` function of the kernel module) in ``env`` from its
    source with ``edits`` ((old, new) text replacements): a deliberately broken kernel."""
    src = textwrap.dedent(inspect.getsource(fn.fn))
    src = "\n".join(line for line in src.splitlines() if not line.startswith("@"))
    for old, new in edits:
        if old not in src:
            raise ValueError(f"mutant edit not found in {fn.fn.__name__}: {old!r}")
        src = src.replace(old, new)
    exec(compile(src, f"<mutant {fn.fn.__name__}>", "exec"), env)


def _emulated_pass_a(qs, ks, dz_in_p, seed=0, timeout=10.0, mutant=None, fused=False):
    """A ``pass_a`` for :func:`.dense_kl_gluon.dense_kl_chunked`: the split kernel's source
    under :class:`gluon_emu.Emulator`, launched as :func:`.dense_kl_gluon.pass_a_gluon` does;
    ``mutant``: ``(function name, edits)`` for :func:`_mutate`; ``fused``: the fused kernel
    (``dense_kl_pass_a``, ``PASS_A["kernel"] = "fused"``) instead."""
    from msa_megatron.ops.triton import _dense_kl_gluon_kernels as kern

    def run(a):
        emu = gluon_emu.Emulator(seed=seed, timeout=timeout)
        env = emu.bind(kern, dict(gluon_emu.MATH_OVERRIDES, LN2=0.6931471805599453,
                                  LOG2E=1.4426950408889634))
        if mutant is not None:
            _mutate(env, getattr(kern, mutant[0]), mutant[1])

        def desc(x, block):
            return gluon_emu.Desc(x.view(x.shape[0], -1), block)

        D, Di = a.q.shape[2], a.q_idx.shape[2]
        G = a.Hq // a.Hi
        P = gluon_emu.Ptr
        grid = (a.Hi, len(a.n_lo))
        args = (desc(a.q, [a.bm, D]), desc(a.k, [a.bn, D]), desc(a.q_idx, [a.bm, Di]),
                desc(a.k_idx, [a.bn, Di]),
                desc(a.dz_buf.view(-1, a.dz_buf.shape[-1]), [a.bm, a.bn]),
                P(a.lse2), P(a.lse_z), P(a.q_pos), P(a.q_kbase), P(a.n_lo), P(a.n_hi),
                P(a.dq), P(a.kl_part), a.Tq, a.dz_buf.shape[1], a.r0, a.ch_lo, a.ch_hi,
                a.scale2, a.iscale)
        common = dict(HI=a.Hi, G=G, IPG=a.Hi // a.Hkv, HPK=a.Hi // a.Hik, BM=a.bm, BN=a.bn,
                      D=D, DI=Di, QS=qs, KS=ks, GRAD=a.grad, DZS=dkg._DZ_SCALE,
                      PRODUCER_REGS=kern.PRODUCER_REGS, num_warps=kern.WARPS)
        for p0 in range(grid[0]):
            for p1 in range(grid[1]):
                emu.program = (p0, p1, *grid)
                if fused:
                    env["dense_kl_pass_a"](*args, KI_AT=min(2, G - 1), **common)
                else:
                    env["dense_kl_pass_a_split"](*args, DZ_IN_P=dz_in_p,
                                                 EPILOGUE_REGS=kern.EPILOGUE_REGS, **common)
    return run


def _run(x, pass_a, grad=True, **kw):
    lse = _lse(x[0], x[1], x[4], x[5], x[0].shape[2] ** -0.5).float()
    return dkg.dense_kl_chunked(x[0], x[1], lse, x[2], x[3], x[4], x[5], x[0].shape[2] ** -0.5,
                                x[2].shape[2] ** -0.5, 0.5, grad, pass_a=pass_a, **kw)


def _close(got, want, grad):
    assert abs(got[0].item() - want[0].item()) <= 1e-5 * abs(want[0].item()) + 1e-6
    if grad:
        for a, b in zip(got[1:], want[1:]):
            assert torch.isfinite(a).all()
            assert rel_err(a, b) < 1e-4


# (G, QS, KS, DZ_IN_P): every G with the smallest legal Q ring, the default rings, both dz homes
RINGS = [(1, 1, 1, False), (1, 2, 2, True), (2, 2, 1, False), (2, 3, 2, True),
         (4, 4, 1, False), (4, 2, 2, True), (4, 3, 1, True), (8, 4, 1, False),
         (8, 3, 2, True), (8, 2, 1, False), (16, 4, 1, False), (16, 3, 2, True)]


@pytest.mark.parametrize("G,qs,ks,dz_in_p", RINGS)
def test_split_kernel_source_matches_the_torch_pass_a(G, qs, ks, dz_in_p):
    """Packed documents (some query tiles' key ranges empty in a chunk), two key chunks, with
    gradients, fp16 (dz in the p slot needs a 2-byte dz): the emulated kernel equals the torch
    stand-in (the same fp16 rounding of dz; the KL's log2 form to fp32 rounding)."""
    x = _case([40, 5, 70], (2 * G, 2, 2, 1), dtype=torch.float16, seed=G + qs)
    kw = dict(bm=16, bn=32, budget=2 * 128 * 4 * 64, dz_fill=float("nan"))
    want = _run(x, dkg.pass_a_torch, **kw)
    got = _run(x, _emulated_pass_a(qs, ks, dz_in_p, seed=G * 10 + qs), **kw)
    _close(got, want, True)


class _EmulatedLaunch:
    """Stands in for a ``@gluon.jit`` kernel in :func:`.dense_kl_gluon.pass_a_gluon`:
    ``kernel[grid](*args, **kwargs)`` runs every program of ``grid`` from the kernel's source
    under the emulation (tensor arguments as pointers) and records ``(name, grid)``."""

    def __init__(self, source, name, launched):
        self.source, self.name, self.launched = source, name, launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((self.name, tuple(grid)))
            emu = gluon_emu.Emulator(seed=len(self.launched))
            env = emu.bind(self.source, dict(gluon_emu.MATH_OVERRIDES, LN2=0.6931471805599453,
                                             LOG2E=1.4426950408889634))
            args = [gluon_emu.Ptr(x) if isinstance(x, torch.Tensor) else x for x in args]
            for p0 in range(grid[0]):
                for p1 in range(grid[1]):
                    emu.program = (p0, p1, *grid)
                    env[self.name](*args, **kwargs)
        return launch


@pytest.mark.parametrize("kernel,G,want", [("split", 4, "dense_kl_pass_a_split"),
                                           ("split", 1, "dense_kl_pass_a_split"),
                                           ("fused", 2, "dense_kl_pass_a")])
def test_pass_a_gluon_launches_what_the_emulated_kernels_run(monkeypatch, kernel, G, want):
    """The host side itself (:func:`.dense_kl_gluon.pass_a_gluon`: the grid (index head, query
    tile) each kernel reads, its arguments), its TMA descriptors and launches handed to the
    emulation: equals the torch stand-in (the tests above launch the kernels as
    :func:`_emulated_pass_a` writes it, so they cannot see the host and a kernel disagree)."""
    from triton.experimental.gluon.nvidia import hopper

    from msa_megatron.ops.triton import _dense_kl_gluon_kernels as kern

    source = types.SimpleNamespace(**vars(kern))
    launched = []
    for name in ("dense_kl_pass_a", "dense_kl_pass_a_split"):
        monkeypatch.setattr(kern, name, _EmulatedLaunch(source, name, launched))
    monkeypatch.setattr(hopper, "TensorDescriptor",
                        lambda view, shape, strides, block, layout: gluon_emu.Desc(view, block))
    monkeypatch.setattr(dkg, "PASS_A", dict(dkg.PASS_A, kernel=kernel, q_stages=2 if G > 1 else 1,
                                            kv_stages=1, dz_in_p=False))
    x = _case([40, 5, 70], (2 * G, 2, 2, 1), dtype=torch.float16, seed=G + 11)
    kw = dict(bm=16, bn=32, budget=2 * 128 * 4 * 64, dz_fill=float("nan"))
    want_result = _run(x, dkg.pass_a_torch, **kw)
    _close(_run(x, dkg.pass_a_gluon, **kw), want_result, True)
    tiles = -(-x[0].shape[0] // 16)
    assert launched and all(launch == (want, (2, tiles)) for launch in launched), launched


@pytest.mark.parametrize("dz_in_p", [False, True])
def test_split_kernel_source_forward_only_and_cp_layout(dz_in_p):
    """No gradients (no dz stores: the p slot freed on read or at the step's end), and one CP
    rank's rows against all keys with gradients."""
    x = _case([70, 30], (8, 2, 2, 1), dtype=torch.float16, seed=3)
    got = _run(x, _emulated_pass_a(4, 1, dz_in_p), grad=False, bm=16, bn=32)
    want = _run(x, dkg.pass_a_torch, grad=False, bm=16, bn=32)
    _close(got, want, False)
    x = _cp_case([64, 8, 56], (8, 2, 2, 1), 2, 1, dtype=torch.float16, seed=4)
    kw = dict(bm=16, bn=32, budget=2 * 64 * 4 * 32)
    _close(_run(x, _emulated_pass_a(2, 2, dz_in_p), **kw), _run(x, dkg.pass_a_torch, **kw), True)


@pytest.mark.parametrize("heads,dims", [((8, 1, 4, 2), (16, 16)), ((16, 2, 4, 4), (32, 16)),
                                        ((4, 4, 4, 1), (16, 32))])
def test_split_kernel_source_head_layouts(heads, dims):
    """The head maps the kernel takes (one KV head for all index heads, index key heads per
    index head, D != Di): key head ``i // IPG``, index key head ``i // HPK``, query heads
    ``i G .. i G + G - 1`` of each index head."""
    x = _case([50, 30], heads, dims=dims, dtype=torch.float16, seed=sum(heads))
    kw = dict(bm=16, bn=32)
    _close(_run(x, _emulated_pass_a(2, 2, True), **kw), _run(x, dkg.pass_a_torch, **kw), True)


@pytest.mark.parametrize("G", [1, 2, 4])
def test_fused_kernel_source_matches_the_torch_pass_a(G):
    """The fused kernel (PASS_A "fused", its own rings: 3 Q, 2 K slots) under the same
    emulation."""
    x = _case([40, 5, 70], (2 * G, 2, 2, 1), dtype=torch.float16, seed=G)
    kw = dict(bm=16, bn=32, budget=2 * 128 * 4 * 64, dz_fill=float("nan"))
    got = _run(x, _emulated_pass_a(3, 2, False, fused=True), **kw)
    _close(got, _run(x, dkg.pass_a_torch, **kw), True)


def test_the_emulation_reports_a_hanging_ring():
    """Control: one Q slot with G = 2 (what dense_kl_gluon.split_rings refuses) deadlocks."""
    x = _case([40], (4, 2, 2, 1), dtype=torch.float16, seed=1)
    with pytest.raises(gluon_emu.Deadlock):
        _run(x, _emulated_pass_a(1, 1, False, timeout=1.0), bm=16, bn=32)


def test_the_emulation_sees_a_slot_released_too_early():
    """Control: an epilogue that frees the k_idx slot before its ``dz k_idx`` product has read
    it lets the producer load the next step's k_idx under it: the numbers come out wrong."""
    x = _case([100], (8, 2, 2, 1), dtype=torch.float16, seed=2)
    mutant = ("_epilogue_split", [
        ("            acc = warpgroup_mma(dz_smem, ki_smem, acc, is_async=True)\n",
         "            mbarrier.arrive(ki_empty.index(0), count=1)\n"
         "            acc = warpgroup_mma(dz_smem, ki_smem, acc, is_async=True)\n"),
        ("        gl.thread_barrier()\n        mbarrier.arrive(ki_empty.index(0), count=1)\n",
         "        gl.thread_barrier()\n")])
    want = _run(x, dkg.pass_a_torch, bm=16, bn=32)
    _close(_run(x, _emulated_pass_a(4, 1, False), bm=16, bn=32), want, True)
    with pytest.raises(AssertionError):
        _close(_run(x, _emulated_pass_a(4, 1, False, mutant=mutant), bm=16, bn=32), want, True)
