"""Context-parallel MSA: correctness on the devices first, then step times and bytes moved.

Run on 2 or 4 GPUs (writes JSON to the path given)::

    torchrun --nproc-per-node 4 benchmarks/bench_cp.py benchmarks/results/cp_h200x4.json \
        [--backend triton|torch] [--seqlens 131072 262144 524288] [--dists iid coherent] \
        [--cp-sizes 2 4] [--overlap on off] [--budget-s 300] [--compute-only]

(``--backend`` defaults to the automatic choice: triton on CUDA; ``--cp-sizes`` to every
power of two from 2 to the world size: on 4 GPUs CP=2 runs as two concurrent pairs.)

CPU dry run of the whole script on tiny shapes (gloo; ``--heads small`` for speed; with
``--backend triton`` under ``TRITON_INTERPRET=1`` each phase also reports the kernel
specialisations the GPU's Triton JIT would compile there)::

    torchrun --nproc-per-node 2 benchmarks/bench_cp.py /tmp/cp.json --device cpu \
        --seqlens 2048 --check-tokens 1024 --iters 1 --heads small

(``--block-size 16 --top-k 4`` makes the Triton interpreter's dry run fast enough to reach
the sparse kernels at a few hundred tokens: rows past ``top_k * block_size`` tokens.)

Rank 0 prints one line per phase and per timed row as it completes, each prefixed with the
seconds since the start (``[  12.3 s]``), and rewrites the JSON after every row and before
each phase or row starts (``in_progress`` names what is running: a run killed from outside
leaves a JSON that says what it measured and where it stopped). ``--budget-s``: no row starts
once the budget is spent or when the row's predicted time (``iters + 1`` steps of the CP=1
row at that length) no longer fits; a row stops timing after the step that crosses the budget
(at least one timed step); the JSON lists what was skipped (``skipped``) and why the run
stopped (``stopped``). Every phase and row records its wall time, its first step's time (the
warm-up: the first call of a shape compiles its Triton kernels) and the Triton kernels
compiled in it with their compile seconds (``compiles``, ``compile_s``, ``kernels``).

What it does, in one run:

1. Correctness, for every CP size: one packed THD batch (several documents, one of length zero,
   documents crossing the CP chunk boundaries), by default with the timing's heads and dtype
   (so the check also compiles the kernels the timing runs; ``--check-heads small
   --check-dtype float32`` is the former fp32 check, a separate set of kernels to compile:
   fp32 products run on the CUDA cores and spill heavily); every rank computes the
   single-device result (:func:`msa_megatron.core.msa_layer`, CP=1) and its CP result (a CP
   group) in both K/V exchange modes; compares outputs, KL (summed over ranks), selections and
   the five gradients; ``allgather`` with the K/V all-gather overlapped with the selection must
   equal it without bitwise. The script stops (exit code 1) before timing when a check fails.
2. Timing, the most important rows first: for each length (in the order given) and each index
   distribution (in the order given): CP=1 (each rank runs the whole sequence on its own GPU),
   then every CP size in ``allgather`` with the overlap on and off
   (:class:`msa_megatron.core.MSAOptions` ``overlap_kv_exchange``) and ``selective``. One MSA
   core attention layer (select + sparse attention + KL value + all gradients, "paper" config
   of ``docs/BENCHMARK.md``: Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, B 128, k 16, bf16), one
   sequence of S tokens, fwd+bwd, median over ``--iters`` wall-timed steps (device
   synchronised) after one warm-up step. The time of a step is the slowest rank's (all ranks
   of the world, concurrent CP groups included). Each CP row records its speed-up over CP=1
   and the issue's target, ``ms <= 1.05 * CP=1 ms / CP``. Bytes moved per rank come from the
   layer's statistics.
3. With ``--compute-only``, after all the rows above: a "compute only" row per length,
   distribution and CP size times what a rank computes without any exchange (its queries
   against global K/V it already holds): what overlap alone could reach.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msa_megatron.core import MSAOptions, attention_and_kl, msa_layer  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops.backends import get_backend, resolve_backend  # noqa: E402
from msa_megatron.parallel.context import cp_bytes_moved  # noqa: E402
from msa_megatron.parallel.cp_layout import build_cp_layout, split_for_cp_rank  # noqa: E402
from msa_megatron.parallel.groups import ParallelGroups  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # provenance.py, beside this
from compile_watch import CompileWatch  # noqa: E402,F401  (tests load it from here)
from provenance import git_commit  # noqa: E402

PAPER = dict(hq=64, hkv=4, hi=4, hik=1, d=128, di=128)
SMALL = dict(hq=16, hkv=2, hi=2, hik=1, d=64, di=64)  # the former fp32 check's heads; dry runs
HEADS = {"paper": PAPER, "small": SMALL}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
OPTIONS = dict(block_size=128, top_k=16, init_blocks=0, local_blocks=1, softmax_scale=None,
               index_scale=None)
EXCHANGES = ("allgather", "selective")
# (exchange, overlap_kv_exchange) timed per CP size, in this order; the overlap applies to
# allgather only.
TIMED_MODES = (("allgather", True), ("allgather", False), ("selective", True))
TARGET_SLACK = 1.05  # CP=c must take at most 1.05 * (CP=1 time / c)
NAMES = ("q", "k", "v", "q_idx", "k_idx")
COHERENT_STRIDE = 256  # coherent index queries: randn every 256th token, linearly interpolated
CHECK_DOC_FRACTIONS = (0.37, 0.0, 0.25, 0.38)  # of the check batch; one zero-length document
CHECK_MIN_SELECTION_MATCH = 0.999  # near-ties may swap a block; anything more fails
# Norm-relative; fp32 inputs run TF32 matmuls on the GPU; 16-bit inputs: CP and CP=1 differ by
# the order of the dK/dV/dk_idx sums (one rounding of each), far below this.
CHECK_MAX_REL_ERR = 2e-2


class Clock:
    """Seconds since the run started; rank 0 prints timestamped lines."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def s(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        if dist.get_rank() == 0:
            print(f"[{self.s():7.1f} s] {msg}", flush=True)


class Run:
    """The run's state: clock, compile watch, budget, JSON (rank 0 writes it)."""

    def __init__(self, args, result: dict) -> None:
        self.args = args
        self.result = result
        self.clock = Clock()
        self.watch = CompileWatch()
        self.is_logger = dist.get_rank() == 0
        result.update({"budget_s": args.budget_s, "stopped": None, "skipped": [],
                       "in_progress": None, "phases": [], "compile_watch": self.watch.mode})

    def write(self) -> None:
        if self.is_logger:
            self.result["elapsed_s"] = round(self.clock.s(), 1)
            _write(self.args.output, self.result)

    def starting(self, label: str) -> None:
        """Record what runs now (in the JSON too, for a run killed from outside)."""
        self.result["in_progress"] = {"what": label, "since_s": round(self.clock.s(), 1)}
        self.write()

    def remaining(self) -> float:
        """Seconds left of the budget, the least over all ranks (inf without a budget); a
        collective, so every rank takes the same decision."""
        if self.args.budget_s is None:
            return float("inf")
        left = torch.tensor([self.args.budget_s - self.clock.s()], dtype=torch.float64,
                            device=self.args.sync_device)
        dist.all_reduce(left, op=dist.ReduceOp.MIN)
        return left.item()

    def over_budget(self, seconds: float) -> bool:
        """This rank's own view (no collective): is the budget spent?"""
        return self.args.budget_s is not None and seconds >= self.args.budget_s

    def skip(self, label: str, reason: str) -> None:
        self.result["skipped"].append({"what": label, "reason": reason})
        if self.result["stopped"] is None:
            self.result["stopped"] = reason
            self.clock.log(f"stopping: {reason}; skipping what is left")
        self.write()

    @contextmanager
    def phase(self, name: str):
        """Time a phase (wall seconds, Triton compiles) into ``result["phases"]``."""
        self.starting(name)
        self.clock.log(f"{name} ...")
        snap, start = self.watch.snapshot(), self.clock.s()
        record = {"phase": name, "start_s": round(start, 1)}
        yield record
        record.update(seconds=round(self.clock.s() - start, 2), **self.watch.since(snap))
        self.result["phases"].append(record)
        self.result["in_progress"] = None
        self.clock.log(f"{name}: {record['seconds']:.1f} s, {record['compiles']} Triton "
                       f"compiles ({record['compile_s']:.1f} s)")
        self.write()


def _inputs(total: int, heads: dict, dtype, device, seed: int,
            coherent: bool) -> Dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = {"q": heads["hq"], "k": heads["hkv"], "v": heads["hkv"], "q_idx": heads["hi"],
              "k_idx": heads["hik"]}
    x = {}
    for name, h in shapes.items():
        dim = heads["di"] if name.endswith("idx") else heads["d"]
        x[name] = torch.randn((total, h, dim), generator=gen, device=device, dtype=dtype)
    if coherent:
        anchors = torch.randn((total // COHERENT_STRIDE + 2, heads["hi"], heads["di"]),
                              generator=gen, device=device, dtype=torch.float32)
        t = torch.arange(total, device=device, dtype=torch.float32) / COHERENT_STRIDE
        lo = t.floor().long()
        frac = (t - lo)[:, None, None]
        x["q_idx"] = ((1 - frac) * anchors[lo] + frac * anchors[lo + 1]).to(dtype)
    return x


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _local(x: Dict[str, torch.Tensor], cu: torch.Tensor, cp: int, rank: int):
    return {n: split_for_cp_rank(t.detach(), cu, cp, rank).contiguous().requires_grad_(True)
            for n, t in x.items()}


def check_correctness(args, device, group) -> dict:
    """CP vs CP=1 on one packed batch (``args.check_heads`` / ``args.check_dtype``), both
    exchange modes (the CP size is the group's); allgather also without the overlap, which must
    give bitwise the same outputs and gradients. Returns the measured errors."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, dtype = HEADS[args.check_heads], DTYPES[args.check_dtype]
    quantum = 2 * cp
    total = args.check_tokens
    lengths = [int(f * total) // quantum * quantum for f in CHECK_DOC_FRACTIONS]
    lengths[-1] += total - sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    x = _inputs(total, heads, dtype, device, seed=1, coherent=False)
    w_out = torch.randn((total, heads["hq"], heads["d"]), device=device,
                        generator=torch.Generator(device=device).manual_seed(2))
    kl_scale = 1.0 / (total * heads["hi"])
    ref = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    q_pos, q_kbase = query_layout(cu, total, device)
    backend = resolve_backend(args.backend, device)
    ref_idx = get_backend(backend).select(ref["q_idx"], ref["k_idx"], q_pos, q_kbase,
                                          block_size=OPTIONS["block_size"], top_k=OPTIONS["top_k"],
                                          init_blocks=OPTIONS["init_blocks"],
                                          local_blocks=OPTIONS["local_blocks"], index_scale=None)
    res = msa_layer(*(ref[n] for n in NAMES), options=MSAOptions(backend=backend, **OPTIONS),
                    cu_seqlens=cu, kl_scale=kl_scale, block_idx=ref_idx)
    out_ref, kl_ref = res.out, res.kl
    ((out_ref.float() * w_out).sum() + kl_ref).backward()
    rows = split_for_cp_rank(torch.arange(total, device=device), cu, cp, rank)
    report = {"cp": cp, "tokens": total, "lengths": lengths, "heads": args.check_heads,
              "dtype": args.check_dtype}

    def run(exchange, overlap):
        local = _local(x, cu, cp, rank)
        res = msa_layer(
            *(local[n] for n in NAMES), cu_seqlens=cu, groups=ParallelGroups(cp=group),
            options=MSAOptions(kv_exchange=exchange, overlap_kv_exchange=overlap,
                               backend=backend, **OPTIONS),
            kl_scale=kl_scale)
        ((res.out.float() * w_out[rows]).sum() + res.kl).backward()
        return local, res

    for exchange in EXCHANGES:
        local, res = run(exchange, True)
        out, kl, block_idx, stats = res.out, res.kl, res.block_idx, res.stats
        kl_sum = kl.detach().clone()
        dist.all_reduce(kl_sum, group=group)
        same = (torch.sort(block_idx, -1).values == torch.sort(ref_idx[rows], -1).values).all(-1)
        errs = {"out": _rel_err(out, out_ref[rows]), "kl": _rel_err(kl_sum, kl_ref)}
        errs.update({f"d{n}": _rel_err(local[n].grad, ref[n].grad[rows]) for n in NAMES})
        errs["selection_match"] = float(same.float().mean())
        bitwise = 1.0
        if exchange == "allgather":
            blocking, res_blocking = run(exchange, False)
            bitwise = float(torch.equal(res_blocking.out, out) and torch.equal(res_blocking.kl, kl)
                            and all(torch.equal(blocking[n].grad, local[n].grad) for n in NAMES))
        worst = torch.tensor([max(v for k, v in errs.items() if k != "selection_match"),
                              -errs["selection_match"], -bitwise], device=device,
                             dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        ok = (worst[0].item() < CHECK_MAX_REL_ERR
              and -worst[1].item() >= CHECK_MIN_SELECTION_MATCH and -worst[2].item() == 1.0)
        report[exchange] = {"rank0_errors": errs, "worst_rel_err": worst[0].item(),
                            "worst_selection_match": -worst[1].item(), "ok": ok,
                            "bytes_recv": cp_bytes_moved(stats)}
        if exchange == "allgather":
            report[exchange]["overlap_bitwise_equal"] = -worst[2].item() == 1.0
    return report


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_steps(run: Run, step: Callable[[], None], device) -> dict:
    """One warm-up step, then up to ``--iters`` timed steps; each step's time is the slowest
    rank's of the world (ms). Timing stops after the step that crosses the budget (at least one
    timed step); the decision travels with the step time (one collective per step)."""
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    first = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    times, cut = [], False
    for _ in range(run.args.iters):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        sample = torch.tensor([1e3 * (time.perf_counter() - start),
                               float(run.over_budget(run.clock.s()))], dtype=torch.float64,
                              device=device)
        dist.all_reduce(sample, op=dist.ReduceOp.MAX)
        times.append(sample[0].item())
        if sample[1].item() and len(times) < run.args.iters:
            cut = True
            break
    return {"ms_median": statistics.median(times), "ms": times, "first_step_s": first.item(),
            "iters_done": len(times), "cut_by_budget": cut}


def _row(run: Run, label: str, fields: dict, step: Callable[[], None], device,
         predicted_s: Optional[float]) -> Optional[dict]:
    """Time one row (unless the budget says no): appends it to ``result["results"]``, prints
    it, rewrites the JSON. Returns the row, None when skipped."""
    left = run.remaining()
    if left <= 0 or (predicted_s is not None and predicted_s > left):
        run.skip(label, "budget spent" if left <= 0 else
                 f"budget: {left:.0f} s left, row predicted {predicted_s:.0f} s")
        return None
    run.starting(label)
    snap, start = run.watch.snapshot(), run.clock.s()
    timing = _time_steps(run, step, device)
    row = {**fields, **timing, "row_s": round(run.clock.s() - start, 2), **run.watch.since(snap),
           "elapsed_s": round(run.clock.s(), 1)}
    run.result.setdefault("results", []).append(row)
    run.result["in_progress"] = None
    return row


def _report(run: Run, label: str, row: dict, extra: str = "") -> None:
    cut = f", cut by the budget after {row['iters_done']} steps" if row["cut_by_budget"] else ""
    run.clock.log(f"{label}: {row['ms_median']:.1f} ms{extra} (row {row['row_s']:.1f} s, first "
                  f"step {row['first_step_s']:.1f} s, {row['compiles']} Triton compiles "
                  f"{row['compile_s']:.1f} s{cut})")
    run.write()


def _predicted_s(run: Run, seqlen: int) -> Optional[float]:
    """A row's predicted seconds: ``iters + 1`` steps of the CP=1 row at ``seqlen`` (a CP row
    takes less), compiles not counted; None before that row ran."""
    for row in run.result.get("results", []):
        if row["seqlen"] == seqlen and row["cp"] == 1:
            return (run.args.iters + 1) * row["ms_median"] / 1e3
    return None


def _cp_step(x_local, cu, group, exchange, overlap, backend, kl_scale, last: dict):
    def step():
        for t in x_local.values():
            t.grad = None
        res = msa_layer(
            *(x_local[n] for n in NAMES), cu_seqlens=cu, groups=ParallelGroups(cp=group),
            options=MSAOptions(kv_exchange=exchange, overlap_kv_exchange=overlap,
                               backend=backend, **OPTIONS),
            kl_scale=kl_scale)
        (res.out.float().sum() + res.kl).backward()
        last["stats"] = res.stats
    return step


def bench(run: Run, device, groups: Dict[int, dist.ProcessGroup]) -> None:
    """Time every configuration, most important first (module docstring); each row is appended
    to ``result["results"]`` and the JSON rewritten (rank 0).

    ``groups``: CP size -> this rank's CP group of that size."""
    args = run.args
    heads, dtype = HEADS[args.heads], DTYPES[args.dtype]
    backend = resolve_backend(args.backend, device)
    modes = [(e, o) for e, o in TIMED_MODES if e == "selective" or ("on" if o else "off")
             in args.overlap]
    cp1_ms: Dict[tuple, float] = {}
    for seqlen in args.seqlens:
        for dist_name in args.dists:
            tag = f"S={seqlen} {dist_name}"
            x = _inputs(seqlen, heads, dtype, device, seed=3, coherent=dist_name == "coherent")
            cu = torch.tensor([0, seqlen], dtype=torch.int32, device=device)
            kl_scale = 1.0 / (seqlen * heads["hi"])
            full = {n: t.requires_grad_(True) for n, t in x.items()}

            def step_cp1():
                for t in full.values():
                    t.grad = None
                res = msa_layer(*(full[n] for n in NAMES), cu_seqlens=cu, kl_scale=kl_scale,
                                options=MSAOptions(backend=backend, **OPTIONS))
                (res.out.float().sum() + res.kl).backward()

            fields = {"seqlen": seqlen, "index_inputs": dist_name, "cp": 1, "exchange": None}
            row = _row(run, f"{tag} CP=1", fields, step_cp1, device, _predicted_s(run, seqlen))
            if row is not None:
                cp1_ms[seqlen, dist_name] = row["ms_median"]
                _report(run, f"{tag} CP=1", row)
            for t in x.values():  # free the CP=1 gradients before the CP runs
                t.grad = None
                t.requires_grad_(False)
            full = None  # noqa: F841  (frees the CP=1 leaves)
            base = cp1_ms.get((seqlen, dist_name))
            for cp, group in sorted(groups.items()):
                local = _local(x, cu, cp, dist.get_rank(group))
                for exchange, overlap in modes:
                    label = f"{tag} CP={cp} " + (exchange if exchange != "allgather" else
                                                 "allgather " + ("overlap" if overlap
                                                                 else "blocking"))
                    last: dict = {}
                    fields = {"seqlen": seqlen, "index_inputs": dist_name, "cp": cp,
                              "exchange": exchange,
                              "overlap": overlap if exchange == "allgather" else None}
                    step = _cp_step(local, cu, group, exchange, overlap, backend, kl_scale, last)
                    row = _row(run, label, fields, step, device, _predicted_s(run, seqlen))
                    if row is None:
                        continue
                    per_rank = [None] * cp
                    dist.all_gather_object(per_rank, dict(last["stats"]), group=group)
                    row.update(stats_per_rank=per_rank,
                               bytes_recv_per_rank=[cp_bytes_moved(s) for s in per_rank])
                    extra = f", bytes recv/rank {row['bytes_recv_per_rank']}"
                    if base is not None:
                        target = TARGET_SLACK * base / cp
                        row.update(speedup_vs_cp1=base / row["ms_median"], target_ms=target,
                                   meets_target=row["ms_median"] <= target)
                        extra = (f" ({base / row['ms_median']:.2f}x CP=1; target <= "
                                 f"{target:.1f} ms {'met' if row['meets_target'] else 'missed'})"
                                 + extra)
                    _report(run, label, row, extra)
                del local
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.compute_only:
        for seqlen in args.seqlens:
            for dist_name in args.dists:
                _compute_only_rows(run, device, groups, seqlen, dist_name,
                                   cp1_ms.get((seqlen, dist_name)))


def _compute_only_rows(run: Run, device, groups, seqlen: int, dist_name: str,
                       cp1_ms: Optional[float]) -> None:
    """Time what one CP rank computes, without any CP collective or copy: select, attention and
    KL of its local queries against the global K/V and index keys every rank already holds,
    fwd+bwd. The gap to a CP row is the exchange's cost not hidden; the gap between this row
    and ``CP=1 / cp`` is the work CP adds (global-length key buffers, load imbalance)."""
    args = run.args
    heads, dtype = HEADS[args.heads], DTYPES[args.dtype]
    backend = resolve_backend(args.backend, device)
    options = MSAOptions(backend=backend, **OPTIONS)
    impl = get_backend(backend)
    x = _inputs(seqlen, heads, dtype, device, seed=3, coherent=dist_name == "coherent")
    cu = torch.tensor([0, seqlen], dtype=torch.int32, device=device)
    kl_scale = 1.0 / (seqlen * heads["hi"])
    keys = {n: x[n].detach().requires_grad_(True) for n in ("k", "v", "k_idx")}
    for cp, group in sorted(groups.items()):
        rank = dist.get_rank(group)
        local = _local(x, cu, cp, rank)
        layout = build_cp_layout(cu, cp, rank, OPTIONS["block_size"], device,
                                 total_local=local["q"].shape[0])

        def step():
            for t in list(local.values()) + list(keys.values()):
                t.grad = None
            with torch.no_grad():
                block_idx = impl.select(local["q_idx"].detach(), keys["k_idx"].detach(),
                                        layout.q_pos, layout.q_kbase, **options.select_kwargs())
            out, kl = attention_and_kl(impl, options, local["q"], keys["k"], keys["v"],
                                       local["q_idx"], keys["k_idx"], block_idx, layout.q_pos,
                                       layout.q_kbase, kl_scale=kl_scale)
            (out.float().sum() + kl).backward()

        label = f"S={seqlen} {dist_name} CP={cp} compute only (no exchange)"
        fields = {"seqlen": seqlen, "index_inputs": dist_name, "cp": cp,
                  "exchange": "none (compute only)", "overlap": None}
        row = _row(run, label, fields, step, device, _predicted_s(run, seqlen))
        if row is None:
            continue
        extra = ""
        if cp1_ms is not None:
            row.update(speedup_vs_cp1=cp1_ms / row["ms_median"],
                       target_ms=TARGET_SLACK * cp1_ms / cp)
            extra = f" ({cp1_ms / row['ms_median']:.2f}x CP=1)"
        _report(run, label, row, extra)
        local = None  # noqa: F841
    for t in keys.values():
        t.grad = None


def _write(path: str, result: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, path)  # a kill mid-write leaves the previous JSON whole


def _environment(device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": device.type, "world_size": dist.get_world_size()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    env["git_commit"] = git_commit()
    return env


def _on_sigterm(run: Run):
    """SIGTERM (``timeout``, torchrun shutting down): rank 0 records it in the JSON, then the
    signal's default action ends the process."""
    def handler(signum, frame):
        run.result["stopped"] = f"signal {signal.Signals(signum).name}"
        run.write()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    return handler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", help="JSON file to write (rank 0)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", default=None, help="MSA backend (default: automatic)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288],
                        help="timed in the order given")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=None,
                        help="CP sizes to check and time (default: 2, 4, ... up to the world "
                             "size; each must divide the world size)")
    parser.add_argument("--overlap", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="allgather with the K/V all-gather overlapped with the selection "
                             "(on), blocking after it (off), or both")
    parser.add_argument("--dists", nargs="+", choices=("iid", "coherent"),
                        default=["iid", "coherent"], help="timed in the order given")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--heads", choices=tuple(HEADS), default="paper",
                        help="heads of the timed rows (small: CPU dry runs)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="dtype of the timed rows (default bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--check-tokens", type=int, default=8192)
    parser.add_argument("--check-heads", choices=tuple(HEADS), default=None,
                        help="heads of the check (default: --heads)")
    parser.add_argument("--check-dtype", choices=tuple(DTYPES), default=None,
                        help="dtype of the check (default: --dtype; float32 compiles a second "
                             "set of kernels, spill-heavy on the GPU)")
    parser.add_argument("--block-size", type=int, default=OPTIONS["block_size"],
                        help="MSA block size (default 128; smaller only for CPU dry runs: "
                             "sparse rows start past top_k * block_size tokens)")
    parser.add_argument("--top-k", type=int, default=OPTIONS["top_k"], help="default 16")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--skip-check", action="store_true",
                        help="time without the correctness check (recorded in the JSON)")
    parser.add_argument("--compute-only", action="store_true",
                        help="also time the compute-only rows, after all the others")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the whole run: no row starts past them (module "
                             "docstring); launch it under a `timeout` a minute or two longer")
    args = parser.parse_args()
    if args.iters < 1:
        parser.error(f"--iters {args.iters}: must be >= 1")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: must be > 0")
    OPTIONS.update(block_size=args.block_size, top_k=args.top_k)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.check_heads = args.check_heads or args.heads
    args.check_dtype = args.check_dtype or args.dtype

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    args.sync_device = device
    world = dist.get_world_size()
    cp_sizes = args.cp_sizes or [2 ** i for i in range(1, world.bit_length())
                                 if world % 2 ** i == 0]
    if not cp_sizes or any(c < 2 or world % c for c in cp_sizes):
        parser.error(f"--cp-sizes {cp_sizes}: each must be >= 2 and divide the world size "
                     f"{world}")
    result = {"environment": _environment(device),
              "config": {**HEADS[args.heads], **OPTIONS, "dtype": args.dtype},
              "argv": sys.argv[1:], "cp_sizes": cp_sizes}
    run = Run(args, result)
    if run.is_logger:
        signal.signal(signal.SIGTERM, _on_sigterm(run))
    with run.phase("process groups"):
        groups = {}
        for cp in cp_sizes:  # every rank creates every group (a collective), keeps its own
            for first in range(0, world, cp):
                group = dist.new_group(list(range(first, first + cp)))
                if first <= dist.get_rank() < first + cp:
                    groups[cp] = group
        dist.barrier()
    ok = True
    if args.skip_check:
        result["check"] = "skipped (--skip-check)"
    else:
        result["check"] = {}
        for cp in cp_sizes:
            with run.phase(f"correctness check CP={cp} ({args.check_heads} heads, "
                           f"{args.check_dtype}, {args.check_tokens} tokens)"):
                report = check_correctness(args, device, groups[cp])
            result["check"][str(cp)] = report
            for e in EXCHANGES:
                run.clock.log(f"check CP={cp} {e}: {'ok' if report[e]['ok'] else 'FAILED'}, "
                              f"worst rel err {report[e]['worst_rel_err']:.2e}, selection match "
                              f"{report[e]['worst_selection_match']:.4f}"
                              + (f", overlap bitwise equal {report[e]['overlap_bitwise_equal']}"
                                 if e == "allgather" else ""))
            ok = ok and all(report[e]["ok"] for e in EXCHANGES)
        run.write()
    if ok and not args.check_only:
        with run.phase("timing"):
            bench(run, device, groups)
    result["in_progress"] = None
    run.write()
    run.clock.log(f"wrote {args.output}" + ("" if ok else " (correctness check FAILED)"))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
