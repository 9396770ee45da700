"""Launch sweeps of the Gluon dense KL's two plain-Triton kernels: ``lse_z`` and pass B.

``dense_kl_gluon.dense_kl_chunked`` runs, besides its Gluon pass A, the student's log-normaliser
(``dense_kl_gluon.LSE_Z_KERNEL``: since session 13 the finite-input
:func:`msa_megatron.ops.triton.dense_lse_z.student_lse_finite`, swept as ``("finite", BM, BN,
warps)`` rows; the general :func:`msa_megatron.ops.triton.dense_kl.student_lse` launched as
``dense_kl_gluon.LSE_Z_TILES``) and pass B (:func:`dense_kl_gluon.pass_b` per key chunk,
launched as the ``dense_kl_gluon.PASS_B_*`` constants). This script times each alone at the
paper heads (Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, bf16, one sequence;
``gluon_probe._kl_inputs``) over a grid of launches and checks each result against the default
launch's. Usage, one H200, from the repository root::

    . benchmarks/gpu_env.sh; python benchmarks/tune_dense_kl_aux.py OUT.json [--tokens 32768 131072]
    PYTHONPATH=/tmp/t36site:$PWD python benchmarks/tune_dense_kl_aux.py compile [pass_b]  # CPU
    TRITON_INTERPRET=1 python benchmarks/tune_dense_kl_aux.py OUT.json --dry-run  # CPU, tiny

- ``lse_z``: BM x BN x warps x stages (:data:`LSE_BM` ...); each result against the default's
  (max abs difference over max ``|lse_z|``: only the summation order changes, so within
  :data:`LSE_TOL`).
- pass B: warps x programs aimed at x dz budget x variant (``(align, range_check)``,
  :data:`PASS_B_VARIANTS`), the chunk loop of ``dense_kl_chunked`` on a dz buffer of random
  values (the same value for a key column whatever the budget: the buffer of a larger budget
  repeats the smallest one's); ``dk`` against the default launch at the first budget (relative
  norm within :data:`PASS_B_TOL`; ``bitwise`` says whether it is the same bits) and, for the
  default launch, the time of the segment sum and copy alone (``reduce_ms``).

CUDA-event medians (bench_compile.time_ms, one warm-up: the compile) of :data:`REPS` calls at
the first token count, :data:`REPS_LONG` later. At the first token count every launch runs; at
later ones the default and the :data:`KEEP` fastest correct ones of the first. A launch that
fails (no compile, shared memory) is a row with its error. The JSON (git commit, GPU, versions)
is rewritten after each row; past ``--time-limit`` seconds (:data:`FIRST_SHARE` of it for the
first token count) the remaining rows are recorded as skipped. ``compile`` prints the sm_90
registers, spills, shared bytes and load kinds of every launch (Triton 3.6 at /tmp/t36site, no
GPU needed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_compile import time_ms  # noqa: E402
from gluon_probe import _kl_inputs  # noqa: E402
from provenance import git_commit  # noqa: E402

from msa_megatron.ops.triton import dense_kl_gluon as dkg  # noqa: E402
from msa_megatron.ops.triton.dense_kl import _lse_z_kernel, student_lse  # noqa: E402
from msa_megatron.ops.triton.dense_lse_z import student_lse_finite  # noqa: E402

HEADS = (64, 4, 4, 1)  # Hq, Hkv, Hi, Hik (paper)
DIM = 128
LSE_BM, LSE_BN, LSE_WARPS, LSE_STAGES = (64, 128), (32, 64, 128), (4, 8), (2, 3, 4)
PASS_B_WARPS, PASS_B_PROGRAMS, PASS_B_BUDGETS = (4, 8), (264, 528, 1056, 2112), (2 << 30, 8 << 30)
# (align, range_check, num_stages) of _dk_pass_kernel: session 12's launch; 16-byte dz loads; no range
# re-test (lets Triton pipeline the loads: sm_90 PTX of ``compile`` has cp.async then) at 2, 3
# (Triton's default) and 4 stages
PASS_B_VARIANTS = ((1, True, None), (16, True, None), (16, False, None), (16, False, 2),
                   (16, False, 4))
# the finite-input kernel (dense_lse_z.student_lse_finite): ("finite", BM, BN, warps)
LSE_FINITE = (("finite", 128, 64, 8), ("finite", 128, 128, 8), ("finite", 64, 128, 4),
              ("finite", 64, 64, 4), ("finite", 128, 32, 4), ("finite", 128, 64, 4))
LSE_TOL, PASS_B_TOL = 1e-5, 1e-5
REPS, REPS_LONG, KEEP = 5, 3, 4
TIME_LIMIT_S = 140.0
FIRST_SHARE = 0.7  # of the time limit, for the first token count (the rest for the later ones)
# --dry-run: tiny shapes under the interpreter (the orchestration, not the timings)
DRY = dict(tokens=[300], heads=(4, 1, 2, 1), dim=16, dtype=torch.float32, tiles=(16, 32),
           lse=dict(bms=(16, 32), bns=(16,), warps=(4,), stages=(None, 1),
                    finite=(("finite", 16, 16, 4),)),
           pass_b=dict(warps=(4,), programs=(2, 528), budgets=(2 * 320 * 4 * 64, 1 << 20),
                       variants=((1, True, None), (16, False, None))))


def lse_configs(bms=LSE_BM, bns=LSE_BN, warps=LSE_WARPS, stages=LSE_STAGES,
                default=dkg.LSE_Z_TILES, finite=LSE_FINITE) -> list:
    """``(BM, BN, warps, stages)`` launches of ``lse_z``, ``default`` first, then the finite
    kernel's ``("finite", BM, BN, warps)``."""
    grid = [(m, n, w, s) for m in bms for n in bns for w in warps for s in stages]
    return [tuple(default)] + [c for c in grid if c != tuple(default)] + list(finite)


def pass_b_configs(warps=PASS_B_WARPS, programs=PASS_B_PROGRAMS, budgets=PASS_B_BUDGETS,
                   variants=PASS_B_VARIANTS, default_warps: int = 8) -> list:
    """Pass-B launches (dicts of ``budget``, ``num_warps``, ``programs``, ``align``,
    ``range_check``, ``num_stages``), budget-major; per budget the default launch
    (``default_warps`` unless the module says, the module's other ``PASS_B_*``) first."""
    first = dict(num_warps=dkg.PASS_B_WARPS or default_warps, programs=dkg.PASS_B_PROGRAMS,
                 align=dkg.PASS_B_ALIGN, range_check=dkg.PASS_B_RANGE_CHECK,
                 num_stages=dkg.PASS_B_STAGES)
    out = []
    for b in budgets:
        grid = [dict(num_warps=w, programs=p, align=a, range_check=r, num_stages=st)
                for (a, r, st) in variants for w in warps for p in programs]
        out += [dict(first, budget=b)] + [dict(c, budget=b) for c in grid if c != first]
    return out


class Sweep:
    """The JSON being written: header, rows; :meth:`row` rewrites it (a crash keeps the rows)."""

    def __init__(self, path: str, header: dict):
        self.path, self.deadline = path, float("inf")
        self.data = dict(header, rows=[])

    def expired(self) -> bool:
        return time.time() > self.deadline

    def row(self, entry: dict) -> None:
        self.data["rows"].append(entry)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        ms = entry.get("ms")
        cfg = _fmt(entry["config"])
        what = (f"{ms['median']:9.3f} ms (min {ms['min']:.3f})" if ms else
                f"{'':>9s} -- {entry.get('error') or entry.get('skipped')}"[:120])
        check = ""
        if "rel_diff" in entry:
            check = (f" diff {entry['rel_diff']:.1e}{' bitwise' if entry.get('bitwise') else ''}"
                     f" {'ok' if entry['ok'] else 'MISMATCH'}")
        extra = f" reduce {entry['reduce_ms']:.3f} ms" if "reduce_ms" in entry else ""
        print(f"{entry['kernel']:6s} T {entry['tokens']:6d} {cfg:75s} {what}{check}{extra}",
              flush=True)


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"[:600]


def sweep_lse(sweep: Sweep, x: tuple, tokens: int, configs: list, reps: int) -> list:
    """One row per ``lse_z`` launch in ``configs`` (the first is the reference)."""
    q_idx, k_idx, q_pos, q_kbase = x[3], x[4], x[5], x[6]
    iscale = q_idx.shape[2] ** -0.5
    ref, rows = None, []
    for cfg in configs:
        finite = cfg[0] == "finite"
        keys = ("kernel", "bm", "bn", "warps") if finite else ("bm", "bn", "warps", "stages")
        row = dict(kernel="lse_z", tokens=tokens, config=dict(zip(keys, cfg)))
        if sweep.expired():
            row["skipped"] = "time limit"
        else:
            try:
                def call(cfg=cfg):
                    if finite:
                        return student_lse_finite(q_idx, k_idx, q_pos, q_kbase, iscale,
                                                  tuple(cfg[1:]))
                    return student_lse(q_idx, k_idx, q_pos, q_kbase, iscale, *cfg)
                row["ms"] = time_ms(call, reps)
                out = call()
                if ref is None:
                    ref = out
                diff = (out - ref).abs().max().item()
                row["max_abs_diff"] = diff
                row["rel_diff"] = diff / max(ref.abs().max().item(), 1e-30)
                row["bitwise"] = bool(torch.equal(out, ref))
                row["ok"] = row["rel_diff"] <= LSE_TOL
            except Exception as err:  # a launch that does not compile or fit is a finding
                row["error"] = _error(err)
        sweep.row(row)
        rows.append(row)
    return rows


class PassBState:
    """What pass B reads at one token count and budget: the tile ranges, one chunk's dz buffer
    (``base`` repeated along the columns when it fits, else fresh random values), dk_part."""

    def __init__(self, x: tuple, budget: int, bm: int, bn: int, base: torch.Tensor | None):
        q_idx, q_pos, q_kbase = x[3], x[5], x[6]
        self.q_idx, self.bm, self.bn = q_idx, bm, bn
        self.Tq, self.Hi, Di = q_idx.shape
        Tk = x[4].shape[0]
        self.ranges = dkg.key_tile_ranges(q_pos, q_kbase, Tk, bm, bn)
        self.n_m, n_k = triton.cdiv(self.Tq, bm), triton.cdiv(Tk, bn)
        self.cols = dkg.chunk_columns(self.Hi, self.n_m * bm, Tk, q_idx.element_size(), budget,
                                      bn)
        self.chunks = [(c0 // bn, min((c0 + self.cols) // bn, n_k))
                       for c0 in range(0, n_k * bn, self.cols)]
        self.tiled = base is not None and self.cols % base.shape[2] == 0
        if self.tiled:
            self.dz = base.repeat(1, 1, self.cols // base.shape[2])
        else:
            gen = torch.Generator(device=q_idx.device).manual_seed(1)
            self.dz = torch.randn((self.Hi, self.n_m * bm, self.cols), generator=gen,
                                  device=q_idx.device).to(q_idx.dtype)
        self.dk = torch.empty((self.Hi, n_k * bn, Di), dtype=torch.float32, device=q_idx.device)

    def run(self, **launch) -> None:
        """The chunk loop of ``dense_kl_chunked``'s pass B with these launch options."""
        for ch_lo, ch_hi in self.chunks:
            dkg.pass_b(self.dz, self.q_idx, self.ranges, self.dk, self.Tq, ch_lo, ch_hi,
                       self.bm, self.bn, **launch)

    def reduce_only(self, programs: int) -> None:
        """Only the segment sums and copies of :meth:`run` (buffers of the same shapes)."""
        Di = self.q_idx.shape[2]
        for ch_lo, ch_hi in self.chunks:
            segs = dkg.pass_b_segments(self.n_m, ch_hi - ch_lo, self.Hi, programs)
            part = torch.empty((segs, self.Hi, self.cols, Di), dtype=torch.float32,
                               device=self.dk.device)
            width = (ch_hi - ch_lo) * self.bn
            self.dk[:, ch_lo * self.bn:ch_lo * self.bn + width] = part[:, :, :width].sum(0)


def sweep_pass_b(sweep: Sweep, x: tuple, tokens: int, configs: list, reps: int,
                 tiles: tuple) -> list:
    """One row per pass-B launch in ``configs`` (dicts of :func:`pass_b_configs`). Each ``dk``
    is compared with the first row's (``ref: "first"``), or, at a budget whose dz buffer could
    not repeat the first's, with that budget's first row (``ref: "budget"``). The first row of
    each budget also times the segment sums and copies alone (``reduce_ms``)."""
    bm, bn = tiles
    rows, state, base, ref, budget_ref = [], None, None, None, None
    for cfg in configs:
        launch = {k: v for k, v in cfg.items() if k != "budget"}
        row = dict(kernel="pass_b", tokens=tokens, config=dict(cfg))
        if sweep.expired():
            row["skipped"] = "time limit"
            sweep.row(row)
            rows.append(row)
            continue
        try:
            if state is None or state.budget != cfg["budget"]:
                state = budget_ref = None
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                state = PassBState(x, cfg["budget"], bm, bn, base)
                state.budget = cfg["budget"]
                base = state.dz if base is None else base
            row["chunks"], row["cols"] = len(state.chunks), state.cols
            row["ms"] = time_ms(lambda: state.run(**launch), reps)
            state.dk.fill_(float("nan"))
            state.run(**launch)
            dk = state.dk.clone()
            if budget_ref is None:  # the first row of this budget
                ref = dk if ref is None else ref
                budget_ref = ref if state.tiled or ref is dk else dk
                row["reduce_ms"] = time_ms(lambda: state.reduce_only(launch["programs"]),
                                           reps)["median"]
            row["ref"] = "first" if budget_ref is ref else "budget"
            err = ((dk.double() - budget_ref.double()).norm()
                   / budget_ref.double().norm().clamp_min(1e-30))
            row["rel_diff"] = err.item()
            row["bitwise"] = bool(torch.equal(dk, budget_ref))
            row["ok"] = bool(torch.isfinite(dk).all()) and row["rel_diff"] <= PASS_B_TOL
        except Exception as err:  # a launch that does not compile or fit is a finding
            row["error"] = _error(err)
        sweep.row(row)
        rows.append(row)
    return rows


def _best(rows: list, keep: int) -> list:
    """The configs of the ``keep`` fastest correct rows."""
    good = sorted((r for r in rows if r.get("ok") and r.get("ms")),
                  key=lambda r: r["ms"]["median"])
    return [r["config"] for r in good[:keep]]


def _lse_tuple(c: dict) -> tuple:
    if c.get("kernel") == "finite":
        return ("finite", c["bm"], c["bn"], c["warps"])
    return (c["bm"], c["bn"], c["warps"], c["stages"])


def _fmt(config: dict) -> str:
    return " ".join(f"{k} {v / 2 ** 20:g}MiB" if k == "budget" else f"{k} {v}"
                    for k, v in config.items())


def run(path: str, token_counts, dry: bool = False, time_limit: float = TIME_LIMIT_S,
        lse_grid: dict | None = None, pass_b_grid: dict | None = None) -> dict:
    """Both sweeps at each token count (module docstring); the JSON at ``path``. ``dry``: the
    interpreter's tiny shapes (:data:`DRY`; ``lse_grid`` / ``pass_b_grid`` override its grids:
    keyword arguments of :func:`lse_configs` / :func:`pass_b_configs`)."""
    device = "cpu" if dry else "cuda"
    heads, dim, dtype = (DRY["heads"], DRY["dim"], DRY["dtype"]) if dry else \
        (HEADS, DIM, torch.bfloat16)
    tiles = DRY["tiles"] if dry else (dkg.BLOCK_M, dkg.BLOCK_N)
    lse_grid = lse_grid if lse_grid is not None else (
        dict(DRY["lse"], default=dkg._LSE_Z_INTERPRETED) if dry else {})
    pass_b_grid = pass_b_grid if pass_b_grid is not None else (
        dict(DRY["pass_b"], default_warps=4) if dry else {})
    header = dict(gpu="cpu (dry run)" if dry else torch.cuda.get_device_name(0),
                  torch=torch.__version__, triton=triton.__version__, commit=git_commit(),
                  tokens=list(token_counts), heads=heads, dim=dim, dtype=str(dtype),
                  pass_b_tiles=tiles, lse_tol=LSE_TOL, pass_b_tol=PASS_B_TOL,
                  defaults=dict(lse_z=dkg.LSE_Z_TILES, pass_b_programs=dkg.PASS_B_PROGRAMS,
                                pass_b_warps=dkg.PASS_B_WARPS, pass_b_align=dkg.PASS_B_ALIGN,
                                pass_b_range_check=dkg.PASS_B_RANGE_CHECK))
    sweep = Sweep(path, header)
    start = time.time()
    lse_all, pass_b_all = lse_configs(**lse_grid), pass_b_configs(**pass_b_grid)
    best = {}
    for n, tokens in enumerate(token_counts):
        last = n == len(token_counts) - 1
        sweep.deadline = start + time_limit * (1.0 if last or n else FIRST_SHARE)
        x = _kl_inputs([tokens], heads, dtype, device, dim=dim)
        reps = 1 if dry else (REPS if n == 0 else REPS_LONG)
        lse_cfgs = lse_all if n == 0 else [lse_all[0]] + [
            _lse_tuple(c) for c in best["lse_z"] if _lse_tuple(c) != lse_all[0]]
        rows = sweep_lse(sweep, x, tokens, lse_cfgs, reps)
        pb_cfgs = pass_b_all if n == 0 else [pass_b_all[0]] + sorted(
            (c for c in best["pass_b"] if c != pass_b_all[0]), key=lambda c: c["budget"])
        pb_rows = sweep_pass_b(sweep, x, tokens, pb_cfgs, reps, tiles)
        if n == 0:
            best = dict(lse_z=_best(rows, KEEP), pass_b=_best(pb_rows, KEEP))
        _summary(sweep, tokens, rows + pb_rows)
        del x
        if device == "cuda":
            torch.cuda.empty_cache()
    return sweep.data


def _summary(sweep: Sweep, tokens: int, rows: list) -> None:
    """Prints and stores the default and the fastest correct launch per kernel."""
    out = sweep.data.setdefault("summary", {})
    for kernel in ("lse_z", "pass_b"):
        mine = [r for r in rows if r["kernel"] == kernel and r.get("ms")]
        good = [r for r in mine if r.get("ok")]
        if not mine or not good:
            continue
        default, fastest = mine[0], min(good, key=lambda r: r["ms"]["median"])
        out[f"{kernel}_{tokens}"] = dict(default=default["config"],
                                         default_ms=default["ms"]["median"],
                                         best=fastest["config"], best_ms=fastest["ms"]["median"])
        print(f"== {kernel} T {tokens}: default {default['ms']['median']:.3f} ms, best "
              f"{fastest['ms']['median']:.3f} ms ({_fmt(fastest['config'])})", flush=True)
    with open(sweep.path, "w") as f:
        json.dump(sweep.data, f, indent=1, default=str)


# --- CPU: sm_90 resources of every launch (Triton 3.6) ---
def _sm90(kernel, signature: dict, constants: dict, divisible: tuple, options: dict) -> dict:
    """Compile ``kernel`` for sm_90: registers, spill bytes, shared bytes and the global load
    kinds of its PTX (``cp.async``: pipelined; ``ld.global.b16``: 2-byte loads)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gluon_probe import ptxas_resources

    names = list(signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    source = ASTSource(kernel, dict(signature, **{c: "constexpr" for c in constants}), constants,
                       attrs)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    loads = collections.Counter(re.findall(r"(?:ld\.global|cp\.async\.c[ag])[\w.]*",
                                           compiled.asm["ptx"]))
    return dict(ptxas_resources(log.getvalue()), shared=compiled.metadata.shared,
                loads=dict(loads))


def run_compile(kernels=("lse_z", "pass_b")) -> int:
    """``compile [lse_z] [pass_b]``: one line per launch of the GPU sweep of those kernels (both
    by default); exit status 1 if any fails."""
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    hi, hik = HEADS[2], HEADS[3]
    bad = 0
    print(f"triton {triton.__version__}, sm_90, bf16, Hi {hi} Hik {hik} Di {DIM}")
    lse_sig = dict(qi_ptr="*bf16", ki_ptr="*bf16", qpos_ptr="*i32", qkb_ptr="*i32",
                   lsez_ptr="*fp32", Tq="i32", Tk="i32", iscale="fp32", s_it="i32", s_ih="i32",
                   s_jt="i32", s_jh="i32", s_zt="i32")
    lse_div = ("qi_ptr", "ki_ptr", "qpos_ptr", "qkb_ptr", "lsez_ptr", "s_it", "s_ih", "s_jt",
               "s_jh")
    jobs = [(f"lse_z bm {m} bn {n} warps {w} stages {s}", _lse_z_kernel, lse_sig,
             dict(HPK=hi // hik, DI=DIM, BM=m, BN=n, UPCAST=False, IEEE=False), lse_div,
             dict(num_warps=w, **({} if s is None else {"num_stages": s})))
            for m, n, w, s in lse_configs()]
    pb_sig = dict(dz_ptr="*bf16", qi_ptr="*bf16", nlo_ptr="*i32", nhi_ptr="*i32",
                  mlo_ptr="*i32", mhi_ptr="*i32", dkpart_ptr="*fp32", Tq="i32", Tq_pad="i32",
                  r0="i32", C="i32", ch_lo="i32", s_it="i32", s_ih="i32")
    pb_div = ("dz_ptr", "qi_ptr", "nlo_ptr", "nhi_ptr", "mlo_ptr", "mhi_ptr", "dkpart_ptr",
              "s_it", "s_ih")
    jobs += [(f"pass_b align {a} range_check {r} stages {st} warps {w}", dkg._dk_pass_kernel,
              pb_sig, dict(HI=hi, DI=DIM, BM=dkg.BLOCK_M, BN=dkg.BLOCK_N, UPCAST=False,
                           IEEE=False, ALIGN=a, RANGE_CHECK=r), pb_div,
              dict(num_warps=w, **({} if st is None else {"num_stages": st})))
             for a, r, st in PASS_B_VARIANTS for w in PASS_B_WARPS]
    for name, kernel, sig, constants, div, options in jobs:
        if name.split()[0] not in kernels:
            continue
        try:
            r = _sm90(kernel, sig, constants, div, options)
        except Exception as err:  # a launch that does not compile is a finding
            bad += 1
            print(f"{name:52s} FAILED: {_error(err)}", flush=True)
            continue
        print(f"{name:52s} regs {r['registers']} spill {r['spill_stores']}/{r['spill_loads']} "
              f"shared {r['shared']} loads {r['loads']}", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile"]:
        return run_compile(argv[1:] or ("lse_z", "pass_b"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON path")
    parser.add_argument("--tokens", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help="seconds; later rows are recorded as skipped")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, TRITON_INTERPRET=1, tiny shapes (checks the script only)")
    args = parser.parse_args(argv)
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--dry-run needs TRITON_INTERPRET=1")
        run(args.out, DRY["tokens"], dry=True, time_limit=args.time_limit)
        return 0
    if not torch.cuda.is_available():
        parser.error("no CUDA device: the sweep needs the GPU (see --dry-run, compile)")
    run(args.out, args.tokens, time_limit=args.time_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
