"""Dense-mode vendor routes on one GPU (issue 12): which cuDNN call is right, and what it costs.

Usage (one H200, from the repository root, < 4 minutes; ``benchmarks/gpu_dense_route.sh``)::

    python benchmarks/gpu_dense_route.py $OUT/dense_route_h200.json [--budget 200]

CPU dry run of the script itself (tiny shapes; the vendor calls fail there, which is recorded;
the cuDNN route runs on the fake operators of tests/ops/test_dense_route.py)::

    TRITON_INTERPRET=1 python benchmarks/gpu_dense_route.py /tmp/r.json --dry-run

Sections (each recorded into the JSON as it finishes; a failing step is recorded, the run goes
on):

1. ``probes``: every route of ``msa_megatron.ops.dense`` probed afresh for the paper heads
   (bf16, D=128, GQA 64/4), with the refusal reason; the routes chosen for one 32K sequence
   and for packed sequences of unequal lengths, deterministic and not.
2. ``variants``: call variants of cuDNN (and FlashAttention) at T=2048 against fp32 math
   (``dense._math_reference``): out, LSE, dQ, dK, dV relative errors, ``ok`` under the probe's
   tolerance. ``route_*`` are the routes as shipped; ``sdpa_pair_*`` the pair PyTorch's
   autograd uses for cuDNN SDPA (forward's own LSE and philox tensors passed back), on BSHD
   views, on BHSD-contiguous copies, with K/V expanded to all heads; ``cudnn_op_bhsd`` the
   lower-level ``_cudnn_attention_forward/backward`` dense entry; ``autograd_sdpa_cudnn``
   ``F.scaled_dot_product_attention`` under autograd. Then whether each backward is bitwise
   repeatable (two runs), at 2K and (section 4) at 32K.
3. ``thd_variants`` (a subprocess: may end the CUDA context with an illegal address): the
   previous call, ``_cudnn_attention_forward/backward`` on packed THD with ``cum_seq``, for one
   2K sequence, for sequences all <= 128 tokens (= head dim) and for the old probe lengths.
   PyTorch 2.11's THD backward sizes cuDNN's dQ accumulator from ``query.size(2)`` (the head
   dim) instead of ``max_q``: expected wrong dQ for sequences longer than 128, right ones
   below (that confirms the diagnosis).
4. ``op_check``: the public op in dense mode at T=2048 (one sequence, and two of 1024) with
   ``MSA_DENSE_BACKEND=cudnn MSA_DENSE_DETERMINISTIC=0`` and with the default settings, against
   the fp32 oracle (out, KL, five gradients), with the route calls counted.
5. ``timing_<T>`` at 32K (``--t-time``; one sequence, paper config, bf16): cuDNN SDPA fwd+bwd (the baseline),
   the cuDNN route's fwd+bwd alone, dense mode default (deterministic) and
   ``MSA_DENSE_DETERMINISTIC=0``, FlashAttention routes, the KL pass alone; ratios to the
   baseline; route calls per row; the cuDNN route's backward bitwise repeatability at 32K.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_compile import (DRY, NAMES, PAPER, Run, env, failure, git_commit,  # noqa: E402
                           kl_only_fn, loss_and_grads, make_inputs, op_fn, rel, run_sections,
                           sdpa_fn, time_ms)
from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from msa_megatron.ops import dense  # noqa: E402

GRADS = ("out", "lse", "dq", "dk", "dv")
CALLS = collections.Counter()  # (route, "fwd"/"bwd") -> calls, probes included


def count_route_calls() -> None:
    """Wrap every route of ``dense.ROUTES`` so that its calls are counted in CALLS."""
    def counted(route):
        def fwd(*a, **kw):
            CALLS[(route.name, "fwd")] += 1
            return route.forward(*a, **kw)

        def bwd(*a, **kw):
            CALLS[(route.name, "bwd")] += 1
            return route.backward(*a, **kw)

        return route._replace(forward=fwd, backward=bwd)

    dense.ROUTES = {name: counted(route) for name, route in dense.ROUTES.items()}


def calls_since(before: collections.Counter) -> dict:
    return {f"{r}_{d}": n - before.get((r, d), 0) for (r, d), n in CALLS.items()
            if n != before.get((r, d), 0)}


def thd_inputs(cfg, lengths, device, dtype, seed=0):
    """Packed q, k, v, dout ``[T, H, D]`` and ``cu`` (list, zero lengths kept) for a check."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lengths)
    q, dout = (torch.randn(T, cfg["hq"], cfg["d"], generator=gen).to(device, dtype)
               for _ in range(2))
    k, v = (torch.randn(T, cfg["hkv"], cfg["d"], generator=gen).to(device, dtype)
            for _ in range(2))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, dout, cu


def seqs_of(cu: list, device) -> dense.Sequences:
    present = [b - a for a, b in zip(cu[:-1], cu[1:]) if b > a]
    bounds = torch.tensor(sorted(set(cu)), dtype=torch.int32, device=device)
    return dense.Sequences(bounds, max(present), min(present))


def lse_to_th(lse: torch.Tensor, T: int, Hq: int) -> torch.Tensor:
    """A ``[B, Hq, S]`` (or trailing-1) dense LSE as ``[T, Hq]``."""
    while lse.dim() > 3 and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    return lse.transpose(1, 2).reshape(T, Hq)


def sdpa_pair(q, k, v, dout, S, scale, layout="bshd", expand=False, ops="sdpa"):
    """The cuDNN dense-entry pair as PyTorch's autograd calls it, on ``[B, H, S, D]`` inputs:
    ``layout`` ``bshd`` (views of the packed tensors) or ``bhsd`` (contiguous copies);
    ``expand``: K/V repeated to all query heads (dK/dV summed over each group after);
    ``ops``: ``sdpa`` (``_scaled_dot_product_cudnn_attention``) or ``cudnn``
    (``_cudnn_attention_forward``, ``cum_seq`` None, ``max_q = max_k = S``)."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    if expand:
        k, v = (t.repeat_interleave(G, 1) for t in (k, v))

    def four(t):
        x = t.contiguous().view(T // S, S, t.shape[1], D).transpose(1, 2)
        return x.contiguous() if layout == "bhsd" else x

    q4, k4, v4 = four(q), four(k), four(v)
    if ops == "sdpa":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q4, k4, v4, None, True, 0.0, True, False, scale=scale)
        bwd = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
    else:
        res = torch.ops.aten._cudnn_attention_forward(
            q4, k4, v4, None, None, None, S, S, True, 0.0, True, False, scale=scale)
        bwd = torch.ops.aten._cudnn_attention_backward
    o4, lse = res[0], res[1]
    do4 = torch.empty_like(o4).copy_(four(dout))  # grad_out laid out like out
    dq4, dk4, dv4 = bwd(do4, q4, k4, v4, o4, lse, res[6], res[7], None, None, None, S, S, 0.0,
                        True, scale=scale)
    back = lambda t: t.transpose(1, 2).reshape(T, t.shape[1], D)  # noqa: E731
    out, dq, dk, dv = back(o4), back(dq4), back(dk4).float(), back(dv4).float()
    if expand:
        dk, dv = (t.view(T, Hkv, G, D).sum(2) for t in (dk, dv))
    return out, lse_to_th(lse, T, Hq), dq, dk, dv, dict(lse_shape=list(lse.shape),
                                                        out_stride=list(o4.stride()),
                                                        dq_stride=list(dq4.stride()))


def autograd_sdpa(q, k, v, dout, S, scale):
    """``F.scaled_dot_product_attention`` on cuDNN under autograd (no LSE)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    T, Hq, D = q.shape
    four = lambda t: t.view(T // S, S, t.shape[1], D).transpose(1, 2)  # noqa: E731
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        o4 = F.scaled_dot_product_attention(*[four(t) for t in leaves], is_causal=True,
                                            scale=scale, enable_gqa=True)
    out = o4.transpose(1, 2).reshape(T, Hq, D)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    return out, None, dq, dk, dv, {}


def route_call(name):
    def call(q, k, v, dout, cu, scale, deterministic):
        route = dense.ROUTES[name]
        seqs = seqs_of(cu, q.device)
        out, lse = route.forward(q, k, v, seqs, scale)
        return (out, lse) + tuple(route.backward(dout, q, k, v, out, lse, seqs, scale,
                                                 deterministic)) + ({},)
    return call


def compare(got, want, tol) -> dict:
    errs = {n: (None if a is None else rel(a, b)) for n, a, b in zip(GRADS, got, want)}
    finite = [e for e in errs.values() if e is not None]
    return dict(rel=errs, ok=all(e == e and e < tol for e in finite))


# ------------------------------------------------------------------ 1. probes
def probes(run: Run, cfg, device, dtype):
    q = torch.zeros(8, cfg["hq"], cfg["d"], device=device, dtype=dtype)
    k = torch.zeros(8, cfg["hkv"], cfg["d"], device=device, dtype=dtype)
    dense._PROBED.clear()
    result = {}
    for name, route in dense.ROUTES.items():
        t0 = time.time()
        try:
            why = dense._probe(route, q, k)
        except Exception as err:  # noqa: BLE001
            why = f"probe raised {type(err).__name__}: {err}"[:500]
        result[name] = dict(ok=why is None, why=why, seconds=round(time.time() - t0, 2),
                            probe_lengths=dense._probe_lengths(route, cfg["d"]))
        print(f"probe {name}: {'OK' if why is None else 'REFUSED: ' + why}", flush=True)
    one = seqs_of([0, 32768], device)
    packed = seqs_of([0, 10000, 10001, 32768], device)
    for det in ("1", "0"):
        with env(MSA_DENSE_DETERMINISTIC=det):
            for label, seqs in (("one_sequence", one), ("unequal_lengths", packed)):
                fwd = dense.forward_route(q, k, seqs)
                bwd, deterministic = dense.backward_route(q, k, seqs)
                result[f"route_{label}_det{det}"] = dict(
                    forward=fwd.name if fwd else "kernels",
                    backward=bwd.name if bwd else "kernels", deterministic=deterministic)
            result[f"route_report_det{det}"] = dense.route_report(q, k)
    run.section("probes", result)


# ------------------------------------------------------------------ 2. variants
def variants(run: Run, cfg, device, dtype, t):
    scale = cfg["d"] ** -0.5
    tol = dense._PROBE_TOL.get(dtype, 1e-4)
    result = dict(T=t, tol=tol)
    for label, lengths in (("1x", [t]), ("2x", [t // 2, t // 2])):
        q, k, v, dout, cu = thd_inputs(cfg, lengths, device, dtype)
        want = dense._math_reference(q, k, v, dout, cu, scale)
        S = lengths[0]
        cases = [(f"route_cudnn_{label}", lambda: route_call("cudnn")(q, k, v, dout, cu, scale,
                                                                     False)),
                 (f"route_flash_det_{label}", lambda: route_call("flash")(q, k, v, dout, cu,
                                                                         scale, True))]
        if label == "1x":
            cases += [
                ("sdpa_pair_bshd", lambda: sdpa_pair(q, k, v, dout, S, scale)),
                ("sdpa_pair_bhsd_contiguous", lambda: sdpa_pair(q, k, v, dout, S, scale,
                                                                layout="bhsd")),
                ("sdpa_pair_expanded_kv", lambda: sdpa_pair(q, k, v, dout, S, scale,
                                                            expand=True)),
                ("cudnn_op_bhsd", lambda: sdpa_pair(q, k, v, dout, S, scale, ops="cudnn")),
                ("autograd_sdpa_cudnn", lambda: autograd_sdpa(q, k, v, dout, S, scale)),
            ]
        for name, fn in cases:
            try:
                got = fn()
                result[name] = dict(compare(got[:5], want, tol), **got[5])
                if name.startswith(("route_cudnn", "route_flash", "sdpa_pair_bshd")):
                    again = fn()
                    result[name]["bitwise_repeat"] = {
                        n: bool(torch.equal(a, b)) for n, a, b in zip(GRADS, got[:5], again[:5])
                        if a is not None}
            except Exception as err:  # noqa: BLE001
                result[name] = failure(err)
            entry = result[name]
            print(f"variant {name}: ok={entry.get('ok')} rel={entry.get('rel')} "
                  f"bitwise={entry.get('bitwise_repeat')} {entry.get('error', '')[:300]}",
                  flush=True)
        del want
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run.section("variants", result)


# ------------------------------------------------------------------ 3. THD (subprocess)
# the short set first: a later set may end the CUDA context (illegal address)
THD_SETS = {"all_le_128": [100, 128, 60, 128], "old_probe": [70, 1, 186], "one_2048": [2048]}


def thd_child(cfg, device, dtype) -> dict:
    """The previous call (THD entry, ``cum_seq``) on each of THD_SETS; prints JSON."""
    scale = cfg["d"] ** -0.5
    tol = dense._PROBE_TOL.get(dtype, 1e-4)
    result = {}
    for name, lengths in THD_SETS.items():
        try:
            q, k, v, dout, cu = thd_inputs(cfg, lengths, device, dtype)
            cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
            m = max(lengths)
            res = torch.ops.aten._cudnn_attention_forward(
                q, k, v, None, cu_t, cu_t, m, m, True, 0.0, True, False, scale=scale)
            out, lse = res[0], res[1]
            dq, dk, dv = torch.ops.aten._cudnn_attention_backward(
                dout, q, k, v, out, lse, res[6], res[7], None, cu_t, cu_t, m, m, 0.0, True,
                scale=scale)
            torch.cuda.synchronize()
            lse_th = lse.reshape(lse.shape[0], -1) if lse.shape[0] == q.shape[0] else None
            want = dense._math_reference(q, k, v, dout, cu, scale)
            result[name] = dict(compare((out, lse_th, dq, dk, dv), want, tol),
                                lse_shape=list(lse.shape), lengths=lengths)
        except Exception as err:  # noqa: BLE001
            result[name] = dict(error=f"{type(err).__name__}: {err}"[:800], lengths=lengths)
    return result


def thd_variants(run: Run, dry: bool):
    cmd = [sys.executable, os.path.abspath(__file__), "-", "--thd-child"] + (
        ["--dry-run"] if dry else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("THD_JSON ")]
        entry = json.loads(lines[-1][9:]) if lines else {}
        entry.update(returncode=proc.returncode, stderr_tail=proc.stderr[-1500:])
    except subprocess.TimeoutExpired as err:
        entry = dict(error=f"timeout: {err}")
    for name in THD_SETS:
        e = entry.get(name, {})
        print(f"thd {name}: ok={e.get('ok')} rel={e.get('rel')} {e.get('error', '')[:200]}",
              flush=True)
    run.section("thd_variants", entry)


# ------------------------------------------------------------------ 4. the public op
def op_check(run: Run, cfg, device, dtype, t):
    result = {}
    names = ("out", "kl") + NAMES
    tol = 3e-2 if dtype == torch.bfloat16 else 3e-3
    for label, lens in (("one_sequence", None), ("two_equal", [t // 2, t // 2])):
        x = make_inputs(cfg, t, lens, "iid", device, dtype)
        leaves = [x[n].detach().float().requires_grad_() for n in NAMES]
        want_out, want_kl = ref.msa_attention_reference(
            *leaves, x["cu"], block_size=cfg["block"], top_k=cfg["top_k"], mode="dense")
        want = [want_out, want_kl, *torch.autograd.grad(
            (want_out, want_kl), leaves, (x["dout"].float(), torch.ones_like(want_kl)))]
        del leaves, want_out, want_kl
        fn = op_fn(cfg, "dense")
        for setting, values in (("cudnn_nondeterministic",
                                 dict(MSA_DENSE_BACKEND="cudnn", MSA_DENSE_DETERMINISTIC="0")),
                                ("default", {})):
            before = collections.Counter(CALLS)
            try:
                with env(**values):
                    got = loss_and_grads(fn, x)
                    report = dense.route_report(x["q"], x["k"])
                errs = {n: rel(a, b) for n, a, b in zip(names, got, want)}
                result[f"{label}_{setting}"] = dict(
                    rel=errs, ok=max(errs.values()) < 2 * tol, calls=calls_since(before),
                    route=report)
            except Exception as err:  # noqa: BLE001
                result[f"{label}_{setting}"] = failure(err)
            e = result[f"{label}_{setting}"]
            print(f"op {label} {setting}: ok={e.get('ok')} calls={e.get('calls')} "
                  f"{e.get('error', '')[:300]}", flush=True)
        del want, x
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run.section("op_check", result)


# ------------------------------------------------------------------ 5. timing
def timing(run: Run, cfg, device, dtype, t, baselines: bool):
    x = make_inputs(cfg, t, None, "iid", device, dtype)
    fn = op_fn(cfg, "dense")
    whole = lambda: loss_and_grads(fn, x)  # noqa: E731
    scale = cfg["d"] ** -0.5
    cu = [0, t]

    def route_fwd_bwd():
        return route_call("cudnn")(x["q"], x["k"], x["v"], x["dout"], cu, scale, False)

    rows = [("cudnn_fwd_bwd", sdpa_fn(x, "CUDNN_ATTENTION", True), {}) if baselines else None,
            ("route_cudnn_fwd_bwd", route_fwd_bwd, {}),
            ("dense_mode_fwd_bwd", whole, {}),
            ("dense_mode_fwd_bwd_nondeterministic", whole, dict(MSA_DENSE_DETERMINISTIC="0")),
            ("dense_mode_fwd_bwd_flash_nondeterministic", whole,
             dict(MSA_DENSE_BACKEND="flash", MSA_DENSE_DETERMINISTIC="0")),
            ("kl_only_fwd_bwd", kl_only_fn(x, cfg), {}),
            ("flash_fwd_bwd_deterministic", sdpa_fn(x, "FLASH_ATTENTION", True, True), {})
            if baselines else None]
    times = {}
    for row in [r for r in rows if r is not None]:
        name, call, values = row
        if run.left() < 20:
            run.row(dict(name=name, T=t, skipped="budget"))
            continue
        before = collections.Counter(CALLS)
        try:
            with env(**values):
                timing_ = time_ms(call, 5)
            times[name] = timing_["median"]
            run.row(dict(name=name, T=t, calls_per_6=calls_since(before), **timing_))
        except Exception as err:  # noqa: BLE001
            run.row(dict(name=name, T=t, **failure(err)))
        print(f"row {name}: {times.get(name)} ms", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    base = times.get("cudnn_fwd_bwd")
    summary = dict(T=t, ms=times, vs_cudnn_fwd_bwd={n: round(v / base, 3) for n, v in
                                                    times.items()} if base else None)
    try:  # the cuDNN route's backward: bitwise repeatable at this size?
        first, second = route_fwd_bwd(), route_fwd_bwd()
        summary["route_cudnn_bitwise_repeat"] = {
            n: bool(torch.equal(a, b)) for n, a, b in zip(GRADS, first[:5], second[:5])}
    except Exception as err:  # noqa: BLE001
        summary["route_cudnn_bitwise_repeat"] = f"{type(err).__name__}: {err}"[:500]
    print(f"summary T={t}: vs cudnn_fwd_bwd {summary['vs_cudnn_fwd_bwd']}", flush=True)
    print(f"cudnn backward bitwise repeat at T={t}: {summary['route_cudnn_bitwise_repeat']}",
          flush=True)
    run.section(f"timing_{t}", summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON result path ('-' with --thd-child)")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for the run")
    parser.add_argument("--t-check", type=int, default=2048)
    parser.add_argument("--t-time", default="32768", help="timing sizes, comma-separated")
    parser.add_argument("--sections", default="probes,variants,thd_variants,op_check,timing")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes")
    parser.add_argument("--thd-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dense._supported = lambda q, k: q.dtype == torch.float32  # noqa: E731 (dry run only)
        dense._PROBE_TOL[torch.float32] = 1e-4
        from tests.ops.test_dense_route import FakeCudnn

        fake = FakeCudnn()
        dense._cudnn_ops = lambda: (fake.forward, fake.backward)  # noqa: E731 (dry run only)
    cfg = PAPER if cuda else dict(DRY, d=32, di=32)
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.thd_child:
        print("THD_JSON " + json.dumps(thd_child(cfg, device, dtype)), flush=True)
        return 0
    t_check = args.t_check if cuda else 128
    t_times = [int(n) for n in args.t_time.split(",")] if cuda else [256]
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                cudnn=torch.backends.cudnn.version() if cuda else None, commit=git_commit(),
                cfg=cfg, dtype=str(dtype), argv=sys.argv,
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    run = Run(args.out, args.budget, meta)
    print(f"meta: {json.dumps(meta, default=str)}", flush=True)
    count_route_calls()
    steps = dict(probes=lambda: probes(run, cfg, device, dtype),
                 variants=lambda: variants(run, cfg, device, dtype, t_check),
                 op_check=lambda: op_check(run, cfg, device, dtype, t_check),
                 timing=lambda: [timing(run, cfg, device, dtype, t, cuda) for t in t_times],
                 thd_variants=lambda: thd_variants(run, not cuda))
    run_sections(run, steps, args.sections.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
