"""Context-parallel MSA: correctness on the devices first, then step times and bytes moved.

Run on 2 or 4 GPUs (writes JSON to the path given)::

    torchrun --nproc-per-node 4 benchmarks/bench_cp.py benchmarks/results/cp_h200x4.json \
        [--backend triton|torch] [--seqlens 131072 262144 524288] [--dists iid coherent] \
        [--cp-sizes 2 4] [--overlap on off]

(``--backend`` defaults to the automatic choice: triton on CUDA; ``--cp-sizes`` to every
power of two from 2 to the world size: on 4 GPUs CP=2 runs as two concurrent pairs.)

CPU dry run of the whole script on tiny shapes (gloo)::

    torchrun --nproc-per-node 4 benchmarks/bench_cp.py /tmp/cp.json --device cpu \
        --seqlens 2048 --check-tokens 1024 --iters 1

What it does, in one run:

1. Correctness, for every CP size: one packed THD batch (several documents, one of length zero,
   documents crossing the CP chunk boundaries) in fp32; every rank computes the single-device
   result (:func:`msa_megatron.core.msa_layer`, CP=1) and its CP result (a CP group) in both K/V
   exchange modes; compares outputs, KL (summed over ranks), selections and the five gradients;
   ``allgather`` with the K/V all-gather overlapped with the selection must equal it without
   bitwise. The script stops (exit code 1) before timing when a check fails.
2. Timing: one MSA core attention layer (select + sparse attention + KL value + all gradients,
   "paper" config of ``docs/BENCHMARK.md``: Hq 64, Hkv 4, Hi 4, Hik 1, D = Di = 128, B 128, k 16,
   bf16), one sequence of S tokens, fwd+bwd, median over ``--iters`` wall-timed steps (device
   synchronised) after one warm-up; for CP=1 (each rank runs the whole sequence on its own GPU)
   and every CP size in: ``allgather`` with the overlap on and off
   (:class:`msa_megatron.core.MSAOptions` ``overlap_kv_exchange``) and ``selective``; index
   inputs iid and coherent (as ``docs/BENCHMARK.md``). The time of a step is the slowest rank's
   (all ranks of the world, concurrent CP groups included). Each CP row records its speed-up
   over CP=1 and the issue's target, ``ms <= 1.05 * CP=1 ms / CP``. Bytes moved per rank come
   from the layer's statistics. A "compute only" row per CP size times what a rank computes
   without any exchange (its queries against global K/V it already holds): what overlap alone
   could reach.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msa_megatron.core import MSAOptions, attention_and_kl, msa_layer  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops.backends import get_backend, resolve_backend  # noqa: E402
from msa_megatron.parallel.context import cp_bytes_moved  # noqa: E402
from msa_megatron.parallel.cp_layout import build_cp_layout, split_for_cp_rank  # noqa: E402
from msa_megatron.parallel.groups import ParallelGroups  # noqa: E402

PAPER = dict(hq=64, hkv=4, hi=4, hik=1, d=128, di=128)
OPTIONS = dict(block_size=128, top_k=16, init_blocks=0, local_blocks=1, softmax_scale=None,
               index_scale=None)
EXCHANGES = ("allgather", "selective")
# (exchange, overlap_kv_exchange) timed per CP size; the overlap applies to allgather only.
TIMED_MODES = (("allgather", True), ("allgather", False), ("selective", True))
TARGET_SLACK = 1.05  # CP=c must take at most 1.05 * (CP=1 time / c)
NAMES = ("q", "k", "v", "q_idx", "k_idx")
COHERENT_STRIDE = 256  # coherent index queries: randn every 256th token, linearly interpolated
CHECK_DOC_FRACTIONS = (0.37, 0.0, 0.25, 0.38)  # of the check batch; one zero-length document
CHECK_HEADS = dict(hq=16, hkv=2, hi=2, hik=1, d=64, di=64)
CHECK_MIN_SELECTION_MATCH = 0.999  # fp32 near-ties may swap a block; anything more fails
CHECK_MAX_REL_ERR = 2e-2  # norm-relative, fp32 inputs (TF32 matmuls on the GPU)


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
    """CP vs CP=1 on one packed fp32 batch, both exchange modes (the CP size is the group's);
    allgather also without the overlap, which must give bitwise the same outputs and gradients.
    Returns the measured errors."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    quantum = 2 * cp
    total = args.check_tokens
    lengths = [int(f * total) // quantum * quantum for f in CHECK_DOC_FRACTIONS]
    lengths[-1] += total - sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                      device=device)
    x = _inputs(total, CHECK_HEADS, torch.float32, device, seed=1, coherent=False)
    w_out = torch.randn((total, CHECK_HEADS["hq"], CHECK_HEADS["d"]), device=device,
                        generator=torch.Generator(device=device).manual_seed(2))
    kl_scale = 1.0 / (total * CHECK_HEADS["hi"])
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
    ((out_ref * w_out).sum() + kl_ref).backward()
    rows = split_for_cp_rank(torch.arange(total, device=device), cu, cp, rank)
    report = {"cp": cp, "tokens": total, "lengths": lengths}

    def run(exchange, overlap):
        local = _local(x, cu, cp, rank)
        res = msa_layer(
            *(local[n] for n in NAMES), cu_seqlens=cu, groups=ParallelGroups(cp=group),
            options=MSAOptions(kv_exchange=exchange, overlap_kv_exchange=overlap,
                               backend=args.backend, **OPTIONS),
            kl_scale=kl_scale)
        ((res.out * w_out[rows]).sum() + res.kl).backward()
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


def _time_steps(step, iters: int, device) -> List[float]:
    """Per-step wall times in ms (the slowest rank of the world's), after one warm-up step."""
    step()
    times = []
    for _ in range(iters):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        step()
        _sync(device)
        elapsed = torch.tensor([1e3 * (time.perf_counter() - start)], dtype=torch.float64,
                               device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    return times


def _time_compute_only(args, device, x, local, cu, cp: int, rank: int, kl_scale: float,
                       cp1_ms: float, seqlen: int, dist_name: str, rows: list) -> None:
    """Time what one CP rank computes, without any CP collective or copy: select, attention and
    KL of its local queries against the global K/V and index keys every rank already holds
    (``x``), fwd+bwd. The gap to a CP row is the exchange's cost not hidden; the gap between
    this row and ``CP=1 / cp`` is the work CP adds (global-length key buffers, load imbalance).
    """
    backend = resolve_backend(args.backend, device)
    options = MSAOptions(backend=backend, **OPTIONS)
    impl = get_backend(backend)
    layout = build_cp_layout(cu, cp, rank, OPTIONS["block_size"], device,
                             total_local=local["q"].shape[0])
    keys = {n: x[n].detach().requires_grad_(True) for n in ("k", "v", "k_idx")}

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

    times = _time_steps(step, args.iters, device)
    ms = statistics.median(times)
    rows.append({"seqlen": seqlen, "index_inputs": dist_name, "cp": cp,
                 "exchange": "none (compute only)", "overlap": None, "ms_median": ms,
                 "ms": times, "speedup_vs_cp1": cp1_ms / ms,
                 "target_ms": TARGET_SLACK * cp1_ms / cp})
    if dist.get_rank() == 0:
        print(f"S={seqlen} {dist_name} CP={cp} compute only (no exchange): {ms:.1f} ms "
              f"({cp1_ms / ms:.2f}x CP=1)", flush=True)
    for t in keys.values():
        t.grad = None


def bench(args, device, groups: Dict[int, dist.ProcessGroup], result: dict) -> None:
    """Time every configuration; appends rows to ``result["results"]`` and rewrites the JSON
    after each row (rank 0), so a run cut short by a time limit keeps what it measured.

    ``groups``: CP size -> this rank's CP group of that size."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = resolve_backend(args.backend, device)
    modes = [(e, o) for e, o in TIMED_MODES if e == "selective" or ("on" if o else "off")
             in args.overlap]
    rows = result.setdefault("results", [])
    is_logger = dist.get_rank() == 0
    for seqlen in args.seqlens:
        for dist_name in args.dists:
            x = _inputs(seqlen, PAPER, dtype, device, seed=3, coherent=dist_name == "coherent")
            cu = torch.tensor([0, seqlen], dtype=torch.int32, device=device)
            kl_scale = 1.0 / (seqlen * PAPER["hi"])
            full = {n: t.requires_grad_(True) for n, t in x.items()}

            def step_cp1():
                for t in full.values():
                    t.grad = None
                res = msa_layer(*(full[n] for n in NAMES), cu_seqlens=cu, kl_scale=kl_scale,
                                options=MSAOptions(backend=backend, **OPTIONS))
                out, kl = res.out, res.kl
                (out.float().sum() + kl).backward()

            times = _time_steps(step_cp1, args.iters, device)
            cp1_ms = statistics.median(times)
            rows.append({"seqlen": seqlen, "index_inputs": dist_name, "cp": 1, "exchange": None,
                         "ms_median": cp1_ms, "ms": times})
            if is_logger:
                print(f"S={seqlen} {dist_name} CP=1: {cp1_ms:.1f} ms", flush=True)
                _write(args.output, result)
            for t in x.values():  # free the CP=1 gradients before the CP runs
                t.grad = None
                t.requires_grad_(False)
            del full
            for cp, group in sorted(groups.items()):
                rank = dist.get_rank(group)
                local = _local(x, cu, cp, rank)
                for exchange, overlap in modes:
                    last = {}

                    def step_cp():
                        for t in local.values():
                            t.grad = None
                        res = msa_layer(
                            *(local[n] for n in NAMES), cu_seqlens=cu,
                            groups=ParallelGroups(cp=group),
                            options=MSAOptions(kv_exchange=exchange, overlap_kv_exchange=overlap,
                                               backend=backend, **OPTIONS),
                            kl_scale=kl_scale)
                        out, kl, stats = res.out, res.kl, res.stats
                        (out.float().sum() + kl).backward()
                        last["stats"] = stats

                    times = _time_steps(step_cp, args.iters, device)
                    ms = statistics.median(times)
                    per_rank = [None] * cp
                    dist.all_gather_object(per_rank, dict(last["stats"]), group=group)
                    target = TARGET_SLACK * cp1_ms / cp
                    rows.append({"seqlen": seqlen, "index_inputs": dist_name, "cp": cp,
                                 "exchange": exchange, "overlap": overlap if exchange ==
                                 "allgather" else None, "ms_median": ms, "ms": times,
                                 "speedup_vs_cp1": cp1_ms / ms, "target_ms": target,
                                 "meets_target": ms <= target, "stats_per_rank": per_rank,
                                 "bytes_recv_per_rank": [cp_bytes_moved(s) for s in per_rank]})
                    if is_logger:
                        label = exchange + ("" if exchange != "allgather" else
                                            " overlap" if overlap else " blocking")
                        print(f"S={seqlen} {dist_name} CP={cp} {label}: {ms:.1f} ms "
                              f"({cp1_ms / ms:.2f}x CP=1; target <= {target:.1f} ms "
                              f"{'met' if ms <= target else 'missed'}), bytes recv/rank "
                              f"{[cp_bytes_moved(s) for s in per_rank]}", flush=True)
                        _write(args.output, result)
                _time_compute_only(args, device, x, local, cu, cp, rank, kl_scale, cp1_ms,
                                   seqlen, dist_name, rows)
                if is_logger:
                    _write(args.output, result)
                del local
            del x
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


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
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                           text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["git_commit"] = None
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", help="JSON file to write (rank 0)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", default=None, help="MSA backend (default: automatic)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[131072, 262144, 524288])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=None,
                        help="CP sizes to check and time (default: 2, 4, ... up to the world "
                             "size; each must divide the world size)")
    parser.add_argument("--overlap", nargs="+", choices=("on", "off"), default=["on", "off"],
                        help="allgather with the K/V all-gather overlapped with the selection "
                             "(on), blocking after it (off), or both")
    parser.add_argument("--dists", nargs="+", choices=("iid", "coherent"),
                        default=["iid", "coherent"])
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--check-tokens", type=int, default=8192)
    parser.add_argument("--check-only", action="store_true")
    args = parser.parse_args()

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    cp_sizes = args.cp_sizes or [2 ** i for i in range(1, world.bit_length())
                                 if world % 2 ** i == 0]
    if not cp_sizes or any(c < 2 or world % c for c in cp_sizes):
        parser.error(f"--cp-sizes {cp_sizes}: each must be >= 2 and divide the world size "
                     f"{world}")
    groups = {}
    for cp in cp_sizes:  # every rank creates every group (a collective), keeps its own
        for first in range(0, world, cp):
            group = dist.new_group(list(range(first, first + cp)))
            if first <= dist.get_rank() < first + cp:
                groups[cp] = group
    result = {"environment": _environment(device), "config": {**PAPER, **OPTIONS},
              "cp_sizes": cp_sizes,
              "check": {str(cp): check_correctness(args, device, groups[cp]) for cp in cp_sizes}}
    checks = [result["check"][str(cp)][e] for cp in cp_sizes for e in EXCHANGES]
    ok = all(c["ok"] for c in checks)
    if dist.get_rank() == 0:
        print("correctness:", json.dumps(result["check"], indent=1), flush=True)
    if dist.get_rank() == 0:
        _write(args.output, result)
    if ok and not args.check_only:
        bench(args, device, groups, result)
    if dist.get_rank() == 0:
        _write(args.output, result)
        print(f"wrote {args.output}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
