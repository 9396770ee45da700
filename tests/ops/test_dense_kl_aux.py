"""The launches of the dense KL's plain-Triton kernels (``lse_z``, pass B) and their sweep script
(benchmarks/tune_dense_kl_aux.py), on the CPU.

Other launches than the default give the same ``lse_z`` (to rounding; and the float64
logsumexp) and the same ``dk`` (bitwise when only the alignment hint, the range re-test, warps
or stages change); ``dense_kl_chunked`` launches as the module constants say; pass B without
its range re-test reads no tile pass A did not write; the script's dry run; and the sm_90
load kinds of the pass-B variants when Triton 3.6 is at /tmp/t36site.
"""

import importlib.util
import json
import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops.triton import dense_kl_gluon as dkg  # noqa: E402
from msa_megatron.ops.triton.dense_kl import student_lse  # noqa: E402
from msa_megatron.ops.triton.dense_lse_z import student_lse_finite  # noqa: E402
from tests.ops.test_dense_kl_gluon import _case, _chunked  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T36 = "/tmp/t36site"
SCRIPT = os.path.join(ROOT, "benchmarks", "tune_dense_kl_aux.py")


def _lse_z_float64(q_idx, k_idx, q_pos, q_kbase, scale):
    """``[Tq, Hi]`` float64 logsumexp of ``scale q_idx k_idx^T`` over each causal row."""
    hi, hik = q_idx.shape[1], k_idx.shape[1]
    kk = k_idx.double().repeat_interleave(hi // hik, dim=1)
    z = torch.einsum("tid,uid->tiu", q_idx.double(), kk) * scale
    u = torch.arange(k_idx.shape[0])
    inside = (u[None] >= q_kbase.long()[:, None]) & (u[None] <= (q_kbase + q_pos).long()[:, None])
    return torch.logsumexp(z.masked_fill(~inside[:, None], -float("inf")), dim=2)


@pytest.mark.parametrize("lens,dim,dtype", [([300], 32, torch.float32),
                                            ([61, 7, 90], 16, torch.float16)],
                         ids=["T300-fp32", "packed-fp16"])
def test_student_lse_launches_agree(lens, dim, dtype):
    x = _case(lens, (4, 1, 2, 1), dims=(dim, dim), dtype=dtype, seed=2)
    q_idx, k_idx, q_pos, q_kbase = x[2], x[3], x[4], x[5]
    scale = dim ** -0.5
    default = student_lse(q_idx, k_idx, q_pos, q_kbase, scale, 16, 16)
    want = _lse_z_float64(q_idx, k_idx, q_pos, q_kbase, scale)
    assert (default.double() - want).abs().max() <= 1e-5 * want.abs().max()
    for launch in [(32, 16, 8, 2), (16, 64, 2, 1)]:
        got = student_lse(q_idx, k_idx, q_pos, q_kbase, scale, *launch)
        assert got.shape == default.shape and got.dtype == torch.float32
        assert (got - default).abs().max() <= 1e-5 * default.abs().max(), launch
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max(), launch


@pytest.mark.parametrize("kw,match", [
    (dict(bm=24), "student_lse: bm must be a power of two >= 16, got 24"),
    (dict(bn=8), "student_lse: bn must be a power of two >= 16, got 8"),
    (dict(num_warps=3), "student_lse: num_warps must be a power of two in 1..16, got 3"),
    (dict(num_stages=0), "student_lse: num_stages must be None or an int >= 1, got 0"),
])
def test_student_lse_rejects_bad_launches(kw, match):
    x = _case([8], (4, 1, 1, 1))
    args = {"bm": 16, "bn": 16, **kw}
    with pytest.raises(ValueError, match=match):
        student_lse(x[2], x[3], x[4], x[5], 0.25, **args)


def _ranges_case(lens, bm=16, bn=32):
    q_pos, q_kbase = query_layout(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                               dtype=torch.int32), sum(lens), "cpu")
    return dkg.key_tile_ranges(q_pos, q_kbase, sum(lens), bm, bn)


@pytest.mark.parametrize("seed", range(6))
def test_the_range_recheck_of_pass_b_is_always_true(seed):
    """Every query tile m in [m_lo[n], m_hi[n]) has n_lo[m] <= n < n_hi[m]: pass B may drop the
    re-test (PASS_B_RANGE_CHECK False) and walk the same tiles."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 120, (int(torch.randint(1, 6, (1,), generator=gen)),),
                         generator=gen).tolist()
    for bm, bn in [(16, 32), (64, 16), (16, 16)]:
        n_lo, n_hi, m_lo, m_hi = (x.tolist() for x in _ranges_case(lens, bm, bn))
        for n in range(len(m_lo)):
            for m in range(m_lo[n], m_hi[n]):
                assert n_lo[m] <= n < n_hi[m], (lens, bm, bn, n, m)


def _pass_b_inputs(lens=(61, 7, 90), bm=16, bn=32, cols=64):
    """q_idx, ranges and a dz buffer holding NaN in every tile pass A would not write."""
    x = _case(list(lens), (4, 1, 2, 1), seed=4)
    q_idx, q_pos, q_kbase = x[2], x[4], x[5]
    tq, hi, _ = q_idx.shape
    ranges = dkg.key_tile_ranges(q_pos, q_kbase, tq, bm, bn)
    n_lo, n_hi = ranges[0].tolist(), ranges[1].tolist()
    tq_pad = len(n_lo) * bm
    dz = torch.full((hi, tq_pad, cols), float("nan"))
    gen = torch.Generator().manual_seed(5)
    return q_idx, ranges, dz, n_lo, n_hi, gen


def _written(dz, n_lo, n_hi, ch_lo, bm, bn, gen):
    """Random values in the tiles of key tiles ``ch_lo ..`` that pass A writes."""
    cols = dz.shape[2]
    for m in range(len(n_lo)):
        for n in range(max(n_lo[m], ch_lo), min(n_hi[m], ch_lo + cols // bn)):
            c = (n - ch_lo) * bn
            dz[:, m * bm:(m + 1) * bm, c:c + bn] = torch.randn(dz.shape[0], bm, bn, generator=gen)


def test_pass_b_launches_agree_and_read_only_written_tiles():
    bm, bn = 16, 32
    q_idx, ranges, dz, n_lo, n_hi, gen = _pass_b_inputs(bm=bm, bn=bn)
    tq, hi, di = q_idx.shape
    n_k = len(ranges[2])
    chunks = [(c, min(c + dz.shape[2] // bn, n_k)) for c in range(0, n_k, dz.shape[2] // bn)]
    bufs = []
    for ch_lo, _ in chunks:
        buf = dz.clone()
        _written(buf, n_lo, n_hi, ch_lo, bm, bn, gen)
        bufs.append(buf)

    def run(**launch):
        dk = torch.full((hi, n_k * bn, di), float("nan"))
        for buf, (ch_lo, ch_hi) in zip(bufs, chunks):
            dkg.pass_b(buf, q_idx, ranges, dk, tq, ch_lo, ch_hi, bm, bn, **launch)
        return dk

    default = run()
    assert torch.isfinite(default).all()
    for launch in [dict(align=16, range_check=False), dict(align=32, range_check=True),
                   dict(num_warps=8, num_stages=2, range_check=False)]:
        assert torch.equal(run(**launch), default), launch
    for programs in (1, 5, 10 ** 6):  # other segments: another order of the sums
        got = run(programs=programs, range_check=False)
        torch.testing.assert_close(got, default, rtol=1e-5, atol=1e-5)
    want = torch.zeros_like(default)  # torch: sum over the written tiles
    for buf, (ch_lo, ch_hi) in zip(bufs, chunks):
        for n in range(ch_lo, ch_hi):
            c = (n - ch_lo) * bn
            for m in range(len(n_lo)):
                if n_lo[m] <= n < n_hi[m]:
                    t = torch.arange(m * bm, min(m * bm + bm, tq))
                    want[:, n * bn:(n + 1) * bn] += torch.einsum(
                        "itu,tid->iud", buf[:, t, c:c + bn], q_idx[t])
    torch.testing.assert_close(default, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(align=3), "pass_b: align must be an int >= 1 dividing the chunk width 64, got 3"),
    (dict(align=128), "pass_b: align must be an int >= 1 dividing the chunk width 64, got 128"),
    (dict(programs=0), "pass_b: programs must be an int >= 1, got 0"),
    (dict(num_warps=6), "pass_b: num_warps must be a power of two in 1..16, got 6"),
])
def test_pass_b_rejects_bad_launches(kw, match):
    q_idx, ranges, dz, *_ = _pass_b_inputs()
    dk = torch.zeros(q_idx.shape[1], len(ranges[2]) * 32, q_idx.shape[2])
    with pytest.raises(ValueError, match=match):
        dkg.pass_b(dz, q_idx, ranges, dk, q_idx.shape[0], 0, 2, 16, 32, **kw)


class _Spy:
    """A kernel stand-in recording each launch's grid and keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid, kw))
            return self.kernel[grid](*args, **kw)
        return launch


def test_dense_kl_chunked_launches_as_the_module_constants_say(monkeypatch):
    x = _case([61, 7, 90], (8, 2, 2, 1), seed=6)
    # chunk_plan: key tiles [0, 2) from row 0, then [2, 5) from row 64 (the first query tile
    # reading key tile 2: the chunk's rows start there, so three tiles fit)
    kw = dict(bm=16, bn=32, budget=2 * 10 * 16 * 4 * 64)
    lse_calls = []

    def lse_spy(*args):
        lse_calls.append(args[5:])
        return student_lse(*args)

    finite_calls = []

    def finite_spy(*args):
        finite_calls.append(args)
        return student_lse_finite(*args)

    monkeypatch.setattr(dkg, "student_lse", lse_spy)
    monkeypatch.setattr(dkg, "student_lse_finite", finite_spy)
    monkeypatch.setattr(dkg, "_dk_pass_kernel", _Spy(dkg._dk_pass_kernel))
    default = _chunked(*x, kl_scale=1.0, **kw)
    # the default lse_z kernel is the finite-input one (dense_lse_z), launched once
    assert dkg.LSE_Z_KERNEL == "finite" and len(finite_calls) == 1 and lse_calls == []
    # pass B's defaults: 16-byte dz rows, no per-tile range re-test, 4 warps
    launches = dkg._dk_pass_kernel.launches
    assert [g[0] for g, _ in launches] == [2, 3]
    assert all(k["ALIGN"] == 16 and not k["RANGE_CHECK"] and k["num_warps"] == 4
               for _, k in launches)
    assert [g[2] for g, _ in launches] == [10] * 2  # cdiv(528, ...) > 10 query tiles
    launches.clear()
    monkeypatch.setattr(dkg, "LSE_Z_KERNEL", "general")
    general = _chunked(*x, kl_scale=1.0, **kw)
    assert lse_calls == [dkg._LSE_Z_INTERPRETED]  # interpreter, default tiles: small ones
    for a, b in zip(general, default):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    launches.clear()
    monkeypatch.setattr(dkg, "LSE_Z_TILES", (32, 16, 8, 2))
    monkeypatch.setattr(dkg, "PASS_B_PROGRAMS", 8)
    monkeypatch.setattr(dkg, "PASS_B_WARPS", 2)
    monkeypatch.setattr(dkg, "PASS_B_STAGES", 4)
    monkeypatch.setattr(dkg, "PASS_B_ALIGN", 16)
    monkeypatch.setattr(dkg, "PASS_B_RANGE_CHECK", False)
    tuned = _chunked(*x, kl_scale=1.0, **kw)
    assert lse_calls[-1] == (32, 16, 8, 2)
    assert all(k["ALIGN"] == 16 and not k["RANGE_CHECK"] and k["num_warps"] == 2 and
               k["num_stages"] == 4 for _, k in launches)
    # cdiv(8, key tiles x 2 heads): chunks of 2 and 3 key tiles
    assert [g[2] for g, _ in launches] == [2, 2]
    for a, b in zip(tuned, default):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _script():
    spec = importlib.util.spec_from_file_location("tune_dense_kl_aux", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_orders_put_the_default_launch_first():
    tune = _script()
    lse = tune.lse_configs()
    assert lse[0] == dkg.LSE_Z_TILES and len(set(lse)) == len(lse)
    assert len(lse) == 1 + 2 * 3 * 2 * 3 + len(tune.LSE_FINITE)
    pb = tune.pass_b_configs()
    per_budget = len(pb) // len(tune.PASS_B_BUDGETS)
    for i, budget in enumerate(tune.PASS_B_BUDGETS):
        first = pb[i * per_budget]
        assert first == dict(budget=budget, num_warps=dkg.PASS_B_WARPS,
                             programs=dkg.PASS_B_PROGRAMS, align=dkg.PASS_B_ALIGN,
                             range_check=dkg.PASS_B_RANGE_CHECK, num_stages=dkg.PASS_B_STAGES)
    # today's launch is in the grid: listed once, first
    assert len(pb) == 2 * 2 * 4 * len(tune.PASS_B_VARIANTS)
    assert len({json.dumps(c, sort_keys=True) for c in pb}) == len(pb)


def test_sweep_dry_run(tmp_path):
    """The whole sweep on tiny shapes under the interpreter: rows for every launch, a bad launch
    recorded as an error, results checked against the default's, the JSON rewritten."""
    tune = _script()
    path = str(tmp_path / "sweep.json")
    data = tune.run(path, [100], dry=True,
                    lse_grid=dict(bms=(16, 24), bns=(32,), warps=(4,), stages=(None,),
                                  default=(16, 16, 4, None), finite=()),
                    pass_b_grid=dict(warps=(4,), programs=(528, 2), budgets=(1 << 20,),
                                     variants=((1, True, None),), default_warps=4))
    with open(path) as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(data["rows"], default=str))
    lse = [r for r in data["rows"] if r["kernel"] == "lse_z"]
    assert [tuple(r["config"].values()) for r in lse] == [(16, 16, 4, None), (16, 32, 4, None),
                                                         (24, 32, 4, None)]
    assert lse[0]["bitwise"] and all(r["ok"] for r in lse[:2])
    assert "bm must be a power of two" in lse[2]["error"]
    pb = [r for r in data["rows"] if r["kernel"] == "pass_b"]
    assert len(pb) == 3 and all(r["ok"] and r["ref"] == "first" for r in pb)
    assert "reduce_ms" in pb[0] and pb[0]["bitwise"]
    assert pb[1]["config"]["programs"] == 528 and pb[1]["bitwise"]  # only align / range_check
    assert data["summary"]["pass_b_100"]["default_ms"] > 0
    assert data["commit"] and data["gpu"] == "cpu (dry run)"


@pytest.mark.skipif(not os.path.isdir(T36), reason=f"Triton 3.6 not at {T36} (sm_90 compile)")
def test_pass_b_variants_load_as_intended_on_sm90():
    """Today's pass B loads dz two bytes at a time (its chunk width is not known to be a
    multiple of 8); ALIGN 16 makes them 16-byte loads; without the range re-test Triton
    pipelines both operands (cp.async)."""
    env = dict(os.environ, PYTHONPATH=f"{T36}:{ROOT}")
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, SCRIPT, "compile", "pass_b"], capture_output=True,
                          text=True, env=env, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("pass_b")]
    assert len(lines) == 2 * 5
    for ln in lines:
        assert "spill 0/0" in ln, ln
        assert ("ld.global.b16" in ln) == ("align 1 " in ln), ln
        assert ("cp.async" in ln) == ("range_check False" in ln), ln


@pytest.mark.parametrize("seed", range(4))
def test_the_range_recheck_is_true_for_cp_ranks_and_arbitrary_rows(seed):
    """The same as above for the layouts the Gluon KL now takes: one CP rank's rows
    (megatron-core's load-balanced split: a rank's rows jump between two chunks of each
    document), and arbitrary rows (key bases in any order, empty rows ``pos = -1``, ``Tk`` not
    a multiple of the key tile, fewer or more query rows than keys): pass B without the
    re-test walks exactly the tiles pass A writes."""
    from msa_megatron.parallel.cp_layout import build_cp_layout

    gen = torch.Generator().manual_seed(seed)
    layouts = []
    for cp in (2, 4):
        lens = (torch.randint(1, 40, (3,), generator=gen) * 2 * cp).tolist()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        for rank in range(cp):
            lay = build_cp_layout(cu, cp, rank, 1, torch.device("cpu"))
            layouts.append((lay.q_pos, lay.q_kbase, sum(lens)))
    for tq, tk in ((37, 100), (130, 61), (5, 3)):
        kb = torch.randint(0, tk, (tq,), generator=gen)
        pos = torch.minimum(torch.randint(-1, tk, (tq,), generator=gen), tk - 1 - kb)
        layouts.append((pos.to(torch.int32), kb.to(torch.int32), tk))
    for q_pos, q_kbase, tk in layouts:
        for bm, bn in [(16, 32), (64, 16), (16, 128)]:
            ranges = dkg.key_tile_ranges(q_pos, q_kbase, tk, bm, bn)
            n_lo, n_hi, m_lo, m_hi = (x.tolist() for x in ranges)
            assert len(m_lo) == -(-tk // bn)
            walked = {(m, n) for n in range(len(m_lo)) for m in range(m_lo[n], m_hi[n])}
            written = {(m, n) for m in range(len(n_lo)) for n in range(n_lo[m], n_hi[m])}
            assert walked == written, (bm, bn)
            # every key a row reads lies in a tile its query tile walks
            for t in range(len(q_pos)):
                if q_pos[t] >= 0:
                    m = t // bm
                    first, last = int(q_kbase[t]), int(q_kbase[t] + q_pos[t])
                    assert n_lo[m] <= first // bn and last // bn < n_hi[m]


@pytest.mark.parametrize("bn", [16, 32, 64, 128])
def test_the_chunk_width_always_takes_16_byte_dz_rows(bn):
    """PASS_B_ALIGN 16 divides every chunk width dense_kl_chunked makes (a multiple of the key
    tile, a power of two >= 16 as launch_options requires), at any Tq, Tk and budget, tiny
    inputs included."""
    for hi, tq, tk, budget in [(1, 1, 1, 1), (4, 5, 3, 10), (2, 1000, 77, 1 << 20),
                               (16, 4096, 4099, 2 << 30), (4, 64, 100000, 12345)]:
        cols = dkg.chunk_columns(hi, tq, tk, 2, budget, bn)
        assert cols % bn == 0 and cols % dkg.PASS_B_ALIGN == 0 and cols >= bn
