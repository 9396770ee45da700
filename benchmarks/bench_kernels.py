"""Correctness, then speed, of ``backend="triton"`` on one GPU (docs/BENCHMARK.md), one run.

Usage (writes JSON to the path given; prints a short table last)::

    python benchmarks/bench_kernels.py benchmarks/results/kernels_h200.json [--budget 380]
        [--configs paper-8k,peer-16k,...] [--flex-configs paper-8k,...] [--skip-checks]
        [--commit SHA]

CPU dry run of the script itself (Triton interpreter, tiny shapes, no baselines)::

    TRITON_INTERPRET=1 python benchmarks/bench_kernels.py /tmp/k.json --dry-run --flex-configs ""

1. Checks on the GPU: triton vs the oracle (fp32 reference on the same inputs) at T = 4096 for
   the paper, peer and tp-shard heads in bf16 and the paper heads in fp16 (packed documents, one
   of length zero): selection (equal up to near-ties), output, LSE, KL and all five gradients;
   bitwise equal gradients over two backward runs. Then the paper config at 8K against the
   torch backend. Timing still runs when a check fails; the JSON and table say FAIL.
2. Ceilings: bf16 matmul 8192^3 and a device copy.
3. For every configuration and both index distributions (iid; coherent = randn every 256th
   token, linearly interpolated): select, main sparse forward and forward+backward, the main
   backward alone (``main_bwd``), the KL value + index gradients alone (``kl``), the whole
   op forward+backward (select + attention + KL value + five gradients), dense warmup mode
   whole op, dense cuDNN and FLASH SDPA (causal, GQA), FlexAttention on the same per-token
   selection (union BlockMask per 128-query tile + membership mask_mod; timed last, for the
   ``--flex-configs``), torch select (chunked PyTorch: index-score matmul, block max, topk;
   what a user writes) and peak memory. Each row is timed separately (median of
   CUDA-event timings after a warm-up, L2 flushed before each); a failing row is recorded and
   the run goes on; rows that would not fit in ``--budget`` seconds are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # provenance.py, beside this

from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.ops import torch_backend  # noqa: E402
from msa_megatron.ops import triton as tri  # noqa: E402
from msa_megatron.api import msa_attention  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from provenance import git_commit  # noqa: E402

HEADS = {
    "paper": dict(hq=64, hkv=4, hi=4, hik=1),
    "tp-shard": dict(hq=16, hkv=1, hi=1, hik=1),
    "peer": dict(hq=16, hkv=2, hi=4, hik=1),
}
DIMS = dict(d=128, di=128, block=128, top_k=16)
# name -> (heads, tokens, packed documents)
CONFIGS = {
    "paper-8k": ("paper", 8192, False),
    "peer-16k": ("peer", 16384, False),
    "paper-32k": ("paper", 32768, False),
    "tp-shard-32k": ("tp-shard", 32768, False),
    "peer-32k": ("peer", 32768, False),
    "packed-32k": ("paper", 32768, True),
    "paper-128k": ("paper", 131072, False),
    "tp-shard-128k": ("tp-shard", 131072, False),
}
DISTS = ("iid", "coherent")
COHERENT_STRIDE = 256
DOC_LENGTHS = (100, 8192)
CHECK_TOKENS = 4096
CHECK_DOCS = (2500, 0, 1100, 496)
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Incoming gradient of the KL in the checks: fp16 training multiplies the loss by a loss scale;
# without it the index gradients (~1e-7..1e-5 at kl_scale = 1/(N Hi)) are fp16 subnormals and
# their mere rounding to fp16 is 2.5% (dq_idx) / 0.6% (dk_idx) off (GPU 2026-12-01: 0.027 /
# 0.0062, the same as the exact gradient rounded to fp16). The kernels return them in fp32; the
# op rounds once, after the multiply.
KL_GRAD = {torch.float16: 2.0 ** 12}
FLUSH_BYTES = 256 << 20
DRY_HEADS = dict(hq=4, hkv=2, hi=2, hik=1)
DRY_DIMS = dict(d=16, di=16, block=16, top_k=3)


class Run:
    """Results, the time budget and the JSON file, written after every row."""

    def __init__(self, path: str, budget: float, meta: dict):
        self.path = path
        self.deadline = time.time() + budget
        self.data = dict(meta=meta, ceilings={}, checks=[], rows=[])

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1)

    def record(self, kind: str, entry: dict) -> None:
        self.data[kind].append(entry)
        self.save()
        print(json.dumps(entry), flush=True)


# ------------------------------------------------------------------ timing
_flush = None


def time_ms(fn, rep_ms: float = 300.0, max_iters: int = 20) -> dict:
    """Median / min of CUDA-event timings of ``fn`` after one warm-up call (L2 flushed)."""
    global _flush
    if not torch.cuda.is_available():
        t0 = time.time()
        fn()
        return dict(median=1e3 * (time.time() - t0), min=1e3 * (time.time() - t0), n=1)
    if _flush is None:
        _flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    times = []
    n = 1
    while len(times) < n:
        _flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if len(times) == 1:
            n = int(max(3, min(max_iters, rep_ms / max(times[0], 1e-3))))
    return dict(median=statistics.median(times), min=min(times), n=len(times))


def peak_mib(fn) -> float:
    """Peak allocated memory (MiB) while ``fn`` runs, inputs included."""
    if not torch.cuda.is_available():
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


# ------------------------------------------------------------------ inputs
def doc_lengths(total: int, gen: torch.Generator) -> list:
    lens = []
    while sum(lens) < total:
        lens.append(int(torch.randint(DOC_LENGTHS[0], DOC_LENGTHS[1] + 1, (1,), generator=gen)))
    lens[-1] -= sum(lens) - total
    return lens


def index_input(t: int, heads: int, dim: int, dist: str, device, dtype) -> torch.Tensor:
    """iid randn, or coherent: randn every COHERENT_STRIDE tokens, linearly interpolated."""
    if dist == "iid":
        return torch.randn(t, heads, dim, device=device).to(dtype)
    anchors = torch.randn(t // COHERENT_STRIDE + 2, heads, dim, device=device)
    pos = torch.arange(t, device=device, dtype=torch.float32) / COHERENT_STRIDE
    lo = pos.floor().long()
    frac = (pos - lo)[:, None, None]
    return ((1 - frac) * anchors[lo] + frac * anchors[lo + 1]).to(dtype)


def make_inputs(heads: dict, dims: dict, t: int, lens, dist: str, device, dtype) -> dict:
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32,
                      device=device)
    q_pos, q_kbase = query_layout(cu, t, device)
    mk = lambda h, dd: torch.randn(t, h, dd, device=device).to(dtype)  # noqa: E731
    return dict(q=mk(heads["hq"], dims["d"]), k=mk(heads["hkv"], dims["d"]),
                v=mk(heads["hkv"], dims["d"]),
                q_idx=index_input(t, heads["hi"], dims["di"], dist, device, dtype),
                k_idx=index_input(t, heads["hik"], dims["di"], dist, device, dtype),
                cu=cu, q_pos=q_pos, q_kbase=q_kbase, lens=list(lens))


NAMES = ("q", "k", "v", "q_idx", "k_idx")


def whole_op(x: dict, dims: dict, mode: str, backend: str = "triton", grads: bool = True,
             kl_grad: float = 1.0):
    """The public op: select + attention + KL, then all five gradients (``kl_grad``: the KL's
    incoming gradient, a loss scale)."""
    leaves = [x[n].detach().requires_grad_(grads) for n in NAMES]
    out, kl = msa_attention(*leaves, x["cu"], block_size=dims["block"], top_k=dims["top_k"],
                            mode=mode, backend=backend)
    if not grads:
        return out, kl, None
    dout = x.setdefault("dout", torch.randn_like(out))
    g = torch.autograd.grad((out, kl), leaves, (dout, torch.full_like(kl, kl_grad)))
    return out, kl, g


# ------------------------------------------------------------------ useful FLOPs
def support_size(block_idx: torch.Tensor, q_pos: torch.Tensor, block: int) -> int:
    """Sum over (token, index head) of the number of keys in the support."""
    b = block_idx.long()
    n = (q_pos.long()[:, None, None] - b * block + 1).clamp(0, block)
    return int(torch.where(b >= 0, n, 0).sum())


def flops(heads: dict, dims: dict, q_pos: torch.Tensor, block_idx: torch.Tensor) -> dict:
    hpi = heads["hq"] // heads["hi"]
    supp = support_size(block_idx, q_pos, dims["block"])  # per (token, index head)
    causal = int((q_pos.long() + 1).sum())
    main_fwd = 4 * dims["d"] * hpi * supp
    kl = supp * (2 * dims["d"] * hpi + 8 * dims["di"])  # teacher recompute, z, dq_idx, dk_idx
    select = 2 * heads["hi"] * dims["di"] * causal
    dense_fwd = 4 * heads["hq"] * dims["d"] * causal
    return dict(select=select, main_fwd=main_fwd, main_fwd_bwd=3.5 * main_fwd, kl=kl,
                whole=select + 3.5 * main_fwd + kl, dense_fwd=dense_fwd,
                dense_fwd_bwd=3.5 * dense_fwd, support_per_token_head=supp / max(1, q_pos.numel()
                                                                               * heads["hi"]))


# ------------------------------------------------------------------ checks
def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def near_tie(got, want, scores, own_block: int) -> bool:
    """Whether a selection ``got [k]`` that differs from the oracle's ``want [k]`` is still
    right (MSA_SPEC section 2, ties): as many distinct blocks, the own block (forced) among
    them, and none scoring more than 1e-3 below the oracle's worst chosen block (``scores``:
    the row's oracle block scores)."""
    kept = got[got >= 0].long()
    worst = scores[want[want >= 0].long()].min()
    return (kept.numel() == int((want >= 0).sum()) and kept.unique().numel() == kept.numel()
            and bool((kept == own_block).any()) and bool((scores[kept] >= worst - 1e-3).all()))


def selection_mismatch(got, want, x, dims) -> dict:
    """Rows whose selection differs, and how many of them are not near-ties."""
    diff = (got != want).any(dim=2)
    rows = diff.nonzero().tolist()
    bad = 0
    if rows:
        s = ref.block_scores_reference(x["q_idx"].float(), x["k_idx"].float(), x["q_pos"],
                                       x["q_kbase"], block_size=dims["block"])
        for t, i in rows[:2000]:
            own = int(x["q_pos"][t]) // dims["block"]
            bad += 0 if near_tie(got[t, i], want[t, i], s[i, t], own) else 1
    return dict(rows_differing=len(rows), rows_not_near_tie=bad, rows=int(diff.numel()))


def check_vs_reference(run: Run, heads_name: str, heads: dict, dims: dict, dtype, device):
    torch.manual_seed(0)
    t = sum(CHECK_DOCS) if device.type == "cuda" else 80
    lens = list(CHECK_DOCS) if device.type == "cuda" else [50, 0, 30]
    x = make_inputs(heads, dims, t, lens, "iid", device, dtype)
    opts = dict(block_size=dims["block"], top_k=dims["top_k"])
    entry = dict(check=f"reference-{heads_name}-{str(dtype)[6:]}", tokens=t)
    got_sel = tri.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"], **opts)
    want_sel = ref.select_core_reference(x["q_idx"].float(), x["k_idx"].float(), x["q_pos"],
                                         x["q_kbase"], **opts)
    entry["select"] = selection_mismatch(got_sel, want_sel, x, dims)
    kl_grad = KL_GRAD.get(dtype, 1.0)
    entry["kl_grad"] = kl_grad
    for mode in ("sparse", "dense"):
        try:
            out, kl, grads = whole_op(x, dims, mode, kl_grad=kl_grad)
            leaves = [x[n].detach().float().requires_grad_() for n in NAMES]
            r_out, r_kl = ref.msa_attention_reference(*leaves, x["cu"], mode=mode, block_idx=(
                got_sel if mode == "sparse" else None), **opts)
            r_grads = torch.autograd.grad((r_out, r_kl), leaves, (x["dout"].float(),
                                                                   torch.full_like(r_kl, kl_grad)))
            errs = dict(out=rel(out, r_out), kl=abs(kl.item() - r_kl.item()) / abs(r_kl.item()))
            errs.update({f"d{n}": rel(g, rg) for n, g, rg in zip(NAMES, grads, r_grads)})
            # The error of the reference itself rounded to the input dtype (the best possible).
            entry[f"{mode}_dtype_floor"] = {f"d{n}": rel(rg.to(dtype), rg)
                                            for n, rg in zip(NAMES, r_grads)}
            _, _, again = whole_op(x, dims, mode, kl_grad=kl_grad)
            errs["bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(grads, again))
            del r_out, r_grads
        except Exception as e:
            errs = dict(error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc()
        entry[mode] = errs
    tol = TOL.get(dtype, 1e-4)
    entry["ok"] = (entry["select"]["rows_not_near_tie"] == 0 and all(
        (v < tol if isinstance(v, float) else v is True) for m in ("sparse", "dense")
        for v in entry[m].values()))
    run.record("checks", entry)


def check_vs_torch_backend(run: Run, device, dims: dict, heads: dict, t: int):
    torch.manual_seed(1)
    x = make_inputs(heads, dims, t, [t], "iid", device, torch.bfloat16)
    opts = dict(block_size=dims["block"], top_k=dims["top_k"])
    sel = tri.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"], **opts)
    sel_t = torch_backend.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"], **opts)
    entry = dict(check=f"torch-backend-paper-{t}", select=selection_mismatch(sel, sel_t, x, dims))
    out, kl, grads = whole_op(x, dims, "sparse")
    out_t, kl_t, grads_t = whole_op(x, dims, "sparse", backend="torch")
    entry["errors"] = dict(out=rel(out, out_t), kl=abs(kl.item() - kl_t.item()) / abs(kl_t.item()),
                           **{f"d{n}": rel(a, b) for n, a, b in zip(NAMES, grads, grads_t)})
    entry["ok"] = entry["select"]["rows_not_near_tie"] == 0 and all(
        v < TOL[torch.bfloat16] for v in entry["errors"].values())
    run.record("checks", entry)


# ------------------------------------------------------------------ baselines
def torch_select_chunked(x: dict, dims: dict, chunk: int = 1024) -> torch.Tensor:
    """What a user writes without this project: per sequence and chunk of queries, index scores
    by one matmul, causal mask, block max, forced own block, topk, sort."""
    q_idx, k_idx = x["q_idx"], x["k_idx"]
    t, hi, di = q_idx.shape
    block, top_k = dims["block"], dims["top_k"]
    out = torch.full((t, hi, top_k), -1, dtype=torch.int32, device=q_idx.device)
    start = 0
    for length in x["lens"]:
        nblk = -(-length // block)
        keys = k_idx[start:start + length].transpose(0, 1)  # [Hik, L, Di]
        for a in range(0, length, chunk):
            b = min(a + chunk, length)
            qc = q_idx[start + a:start + b].transpose(0, 1)  # [Hi, n, Di]
            s = torch.matmul(qc.reshape(keys.shape[0], -1, di), keys[:, :b].transpose(1, 2))
            s = s.view(hi, b - a, b).float() * di ** -0.5
            pos = torch.arange(a, b, device=s.device)
            future = torch.arange(b, device=s.device)[None, :] > pos[:, None]
            s = s.masked_fill(future, float("-inf"))
            s = torch.nn.functional.pad(s, (0, -(-b // block) * block - b), value=float("-inf"))
            s = s.view(hi, b - a, -1, block).amax(-1)
            own = (pos // block)[None, :, None]
            s = s.masked_fill(torch.arange(s.shape[2], device=s.device)[None, None, :] == own,
                              float("inf"))
            kk = min(top_k, s.shape[2])
            val, idx = s.topk(kk, dim=2)
            idx = torch.where(val > float("-inf"), idx, nblk).sort(dim=2).values
            idx = torch.where(idx == nblk, -1, idx)
            out[start + a:start + b, :, :kk] = idx.transpose(0, 1).to(torch.int32)
        start += length
    return out


def sdpa_fn(x: dict, backend_name: str, grads: bool):
    """Dense causal SDPA on one backend; GQA through ``enable_gqa``, else K/V expanded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = getattr(SDPBackend, backend_name)
    q, k, v = (x[n].detach().transpose(0, 1).unsqueeze(0) for n in ("q", "k", "v"))
    group = q.shape[1] // k.shape[1]
    try:
        with sdpa_kernel([backend]), torch.no_grad():
            F.scaled_dot_product_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256],
                                           is_causal=True, enable_gqa=True)
        gqa = True
    except RuntimeError:
        gqa = False
        k, v = (y.repeat_interleave(group, dim=1) for y in (k, v))
    q, k, v = (y.requires_grad_(grads) for y in (q, k, v))

    def fn():
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if grads:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return out

    return fn


def flex_fn(x: dict, heads: dict, dims: dict, block_idx: torch.Tensor, grads: bool):
    """FlexAttention on the same per-token selection: union of the blocks selected by the 128
    queries of each tile (BlockMask.from_kv_blocks) + per-token membership ``mask_mod``."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    t, hq = x["q"].shape[0], heads["hq"]
    hpi, block, tile = hq // heads["hi"], dims["block"], 128
    dev = x["q"].device
    n_tiles = -(-t // tile)
    nblk = int(x["q_pos"].max()) // block + 1
    b = block_idx.long()
    ok = b >= 0
    first_row = x["q_kbase"].long()[:, None, None] + b.clamp_min(0) * block
    qt = (torch.arange(t, device=dev) // tile)[:, None, None].expand_as(b)
    head = torch.arange(heads["hi"], device=dev)[None, :, None].expand_as(b)
    bits = torch.zeros(heads["hi"], n_tiles, n_tiles, dtype=torch.bool, device=dev)
    for row in (first_row, (first_row + block - 1).clamp_max(t - 1)):
        bits.index_put_((head[ok], qt[ok], (row // tile)[ok]), torch.ones_like(qt[ok],
                                                                           dtype=torch.bool))
    bits = bits.repeat_interleave(hpi, dim=0)[None]
    kv_num = bits.sum(-1).to(torch.int32)
    kv_idx = torch.argsort(bits.to(torch.int8), dim=-1, descending=True, stable=True)
    member = torch.zeros(t, heads["hi"], nblk + 1, dtype=torch.bool, device=dev)
    member.scatter_(2, torch.where(ok, b, nblk), True)
    q_pos, q_kbase = x["q_pos"].long(), x["q_kbase"].long()

    def mask_mod(bb, h, qi, ki):
        u = ki - q_kbase[qi]
        return (u >= 0) & (u <= q_pos[qi]) & member[qi, h // hpi, u.clamp(0, nblk * block - 1)
                                                    // block]

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx.to(torch.int32), BLOCK_SIZE=tile,
                                    mask_mod=mask_mod, seq_lengths=(t, t))
    flex = torch.compile(flex_attention, dynamic=False)
    q, k, v = (x[n].detach().transpose(0, 1).unsqueeze(0).requires_grad_(grads)
               for n in ("q", "k", "v"))

    def fn():
        out = flex(q, k, v, block_mask=mask, enable_gqa=True)
        if grads:
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        return out

    return fn


# ------------------------------------------------------------------ timing rows
def config_inputs(heads_name: str, t: int, packed: bool, dims: dict, dist: str, device):
    """Inputs and triton selection of one configuration (same seeds every time)."""
    heads = HEADS[heads_name] if device.type == "cuda" else DRY_HEADS
    lens = doc_lengths(t, torch.Generator().manual_seed(2)) if packed else [t]
    torch.manual_seed(3 + DISTS.index(dist))
    x = make_inputs(heads, dims, t, lens, dist, device, torch.bfloat16)
    block_idx = tri.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"],
                           block_size=dims["block"], top_k=dims["top_k"])
    return heads, lens, x, block_idx


def time_flex(run: Run, name: str, heads_name: str, t: int, packed: bool, dims: dict, device,
              dists=DISTS):
    """FlexAttention rows, added to the rows of ``name`` (run last: it compiles per mask)."""
    for dist in dists:
        row = next((r for r in run.data["rows"] if r.get("config") == name
                    and r.get("dist") == dist), None)
        if row is None or run.left() < 60 + 30 * t / 32768:
            continue
        heads, _, x, block_idx = config_inputs(heads_name, t, packed, dims, dist, device)
        for key, grads in (("flex_fwd_bwd", True), ("flex_fwd", False)):
            try:
                ctx = torch.enable_grad() if grads else torch.no_grad()
                with ctx:
                    row["ms"][key] = time_ms(flex_fn(x, heads, dims, block_idx, grads))
            except Exception as e:
                row["errors"][key] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
        run.save()
        print(json.dumps(dict(config=name, dist=dist, flex={k: v for k, v in row["ms"].items()
                                                              if k.startswith("flex")})))
        del x, block_idx


def time_config(run: Run, name: str, heads_name: str, t: int, packed: bool, dims: dict,
                device, only=None):
    """Time every row of one configuration (``only``: the row keys to time, None = all)."""
    dense_done = False
    for dist in DISTS:
        heads, lens, x, block_idx = config_inputs(heads_name, t, packed, dims, dist, device)
        base = dict(config=name, heads=heads_name, tokens=t, docs=len(lens))
        opts = dict(block_size=dims["block"], top_k=dims["top_k"])
        sel_ref = torch_select_chunked(x, dims)
        fl = flops(heads, dims, x["q_pos"], block_idx)
        row = dict(base, dist=dist, flops=fl, ms={}, peak_mib={}, errors={},
                   select_vs_torch_rows_differing=int((sel_ref != block_idx).any(2).sum()))
        del sel_ref

        def attempt(key, fn, est_s, peak=False, **kw):
            if only is not None and key not in only:
                return
            if run.left() < est_s:
                row["errors"][key] = "skipped (budget)"
                return
            try:
                row["ms"][key] = time_ms(fn, **kw)
                if peak:
                    row["peak_mib"][key] = peak_mib(fn)
            except Exception as e:  # a failing row must not lose the run
                row["errors"][key] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None

        scale = t / 32768
        attempt("select", lambda: tri.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"],
                                             **opts), 1 + scale ** 2)
        attempt("torch_select", lambda: torch_select_chunked(x, dims), 1 + 4 * scale ** 2)
        q, k, v = (x[n].detach().requires_grad_() for n in ("q", "k", "v"))

        def main(grads):
            def fn():
                out, _ = tri.attention(q, k, v, block_idx, x["q_pos"], x["q_kbase"],
                                       block_size=dims["block"])
                if grads:
                    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            return fn

        with torch.no_grad():
            attempt("main_fwd", main(False), 1 + scale)
        attempt("main_fwd_bwd", main(True), 1 + 3 * scale)
        if only is None or {"main_bwd", "kl"} & only:
            out, lse = tri.attention(q, k, v, block_idx, x["q_pos"], x["q_kbase"],
                                     block_size=dims["block"])
            dout = torch.ones_like(out)
            # the main backward alone (forward done once above, its graph kept)
            attempt("main_bwd", lambda: torch.autograd.grad(out, (q, k, v), dout,
                                                            retain_graph=True), 1 + 2 * scale)
            qi, ki = (x[n].detach().requires_grad_() for n in ("q_idx", "k_idx"))
            lse = lse.detach()

            def kl_part():  # KL value + index gradients on the same selection and LSE
                value = tri.kl(q.detach(), k.detach(), lse, qi, ki, block_idx, x["q_pos"],
                               x["q_kbase"], block_size=dims["block"],
                               kl_scale=1.0 / (x["q_idx"].shape[0] * heads["hi"]))
                torch.autograd.grad(value, (qi, ki))

            attempt("kl", kl_part, 1 + 2 * scale)
            del out, lse, dout, qi, ki
        attempt("whole_fwd_bwd", lambda: whole_op(x, dims, "sparse"), 2 + 6 * scale, peak=True)
        if not dense_done:
            if not packed and device.type == "cuda":
                for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
                    tag = be.split("_")[0].lower()
                    attempt(f"{tag}_fwd", sdpa_fn(x, be, False), 1 + 0.3 * scale ** 2)
                    attempt(f"{tag}_fwd_bwd", sdpa_fn(x, be, True), 2 + scale ** 2,
                            peak=(tag == "cudnn"))
            attempt("dense_mode_fwd_bwd", lambda: whole_op(x, dims, "dense"), 3 + 3 * scale ** 2)
            dense_done = True
        run.record("rows", row)
        del x, q, k, v, block_idx


def ceilings(run: Run):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, rep_ms=500)["median"]
    run.data["ceilings"]["matmul_bf16_tflops"] = 2 * 8192**3 / ms / 1e9
    src = torch.empty(2 << 30, dtype=torch.int8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep_ms=200)["median"]
    run.data["ceilings"]["copy_tb_per_s"] = 2 * src.numel() / ms / 1e9
    run.save()
    del a, b, src, dst


def sweep(run: Run, dims: dict, device):
    """Tile-size variants of the gather kernels and of selection, paper 32K iid."""
    from msa_megatron.ops.triton import backward, forward, kl_loss, selection

    heads, _, x, block_idx = config_inputs("paper", 32768, False, dims, "iid", device)
    opts = dict(block_size=dims["block"], top_k=dims["top_k"])
    q, k, v = (x[n].detach().requires_grad_() for n in ("q", "k", "v"))
    saved = {m: m.GATHER_ROWS for m in (backward,)}
    saved_fwd = forward.FWD_ROWS, forward.FWD_WARPS
    saved_kl = kl_loss.KL_ROWS
    saved_select = selection.SELECT_ROWS
    for rows in (64, 128):
        for m in saved:
            m.GATHER_ROWS = rows
        forward.FWD_ROWS, forward.FWD_WARPS = rows, forward.warps_for(rows)
        kl_loss.KL_ROWS = rows
        selection.SELECT_ROWS = rows
        entry = dict(sweep="gather_rows", rows=rows, ms={}, errors={})

        def main(grads):
            def fn():
                out, _ = tri.attention(q, k, v, block_idx, x["q_pos"], x["q_kbase"],
                                       block_size=dims["block"])
                if grads:
                    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            return fn

        fns = dict(select=lambda: tri.select(x["q_idx"], x["k_idx"], x["q_pos"], x["q_kbase"],
                                             **opts),
                   main_fwd_bwd=main(True), whole_fwd_bwd=lambda: whole_op(x, dims, "sparse"))
        for key, fn in fns.items():
            if run.left() < 15:
                break
            try:
                entry["ms"][key] = time_ms(fn)
            except Exception as e:
                entry["errors"][key] = f"{type(e).__name__}: {e}"[:300]
        try:
            with torch.no_grad():
                entry["ms"]["main_fwd"] = time_ms(main(False))
        except Exception as e:
            entry["errors"]["main_fwd"] = f"{type(e).__name__}: {e}"[:300]
        run.record("rows", entry)
    for m, value in saved.items():
        m.GATHER_ROWS = value
    forward.FWD_ROWS, forward.FWD_WARPS = saved_fwd
    kl_loss.KL_ROWS = saved_kl
    selection.SELECT_ROWS = saved_select


# ------------------------------------------------------------------ table
def table(data: dict) -> str:
    rate = data["ceilings"].get("matmul_bf16_tflops", float("nan"))
    lines = [f"GPU {data['meta']['gpu']}  matmul {rate:.0f} TFLOP/s  "
             f"copy {data['ceilings'].get('copy_tb_per_s', float('nan')):.2f} TB/s",
             "checks: " + ", ".join(f"{c['check']}={'ok' if c.get('ok') else 'FAIL'}"
                                    for c in data["checks"])]
    head = ("config", "dist", "select", "sel/gemm", "tsel", "fwd", "fwd+bwd", "bwd", "kl", "whole",
            "floor",
            "dense", "cudnn f/fb", "flex f/fb", "x cudnn", "x flex", "MiB op/cudnn",
            "fwd/bwd %mm")
    lines.append(" | ".join(head))
    dense = {}
    nan = float("nan")
    for r in data["rows"]:
        if "sweep" in r:
            lines.append(f"sweep rows={r['rows']}: " + ", ".join(
                f"{k} {v['median']:.2f}" for k, v in r["ms"].items()))
            continue
        if "ms" not in r:
            lines.append(f"{r.get('config')} | ERROR {r.get('error', '')[:80]}")
            continue
        ms = {k: v["median"] for k, v in r["ms"].items()}
        d = dense.setdefault(r["config"], dict(ms, **{"peak_" + k: v
                                                     for k, v in r["peak_mib"].items()}))
        whole = ms.get("whole_fwd_bwd", nan)
        flex_fb = ms.get("flex_fwd_bwd", nan)
        gemm = r["flops"]["select"] / rate / 1e9  # bare causal index GEMM at the matmul rate
        # Useful rates (BENCHMARK.md): forward 4 Hq D |supp|, backward 2.5x that.
        fwd_rate = r["flops"]["main_fwd"] / ms.get("main_fwd", nan) / 1e9
        bwd_rate = 2.5 * r["flops"]["main_fwd"] / (ms.get("main_fwd_bwd", nan)
                                                    - ms.get("main_fwd", nan)) / 1e9
        cells = (r["config"], r["dist"], f"{ms.get('select', nan):.2f}",
                 f"{ms.get('select', nan) / gemm:.2f}", f"{ms.get('torch_select', nan):.1f}",
                 f"{ms.get('main_fwd', nan):.2f}",
                 f"{ms.get('main_fwd_bwd', nan):.2f}", f"{ms.get('main_bwd', nan):.2f}",
                 f"{ms.get('kl', nan):.2f}", f"{whole:.2f}",
                 f"{r['flops']['whole'] / rate / 1e9:.2f}",
                 f"{d.get('dense_mode_fwd_bwd', nan):.1f}",
                 f"{d.get('cudnn_fwd', nan):.1f}/{d.get('cudnn_fwd_bwd', nan):.1f}",
                 f"{ms.get('flex_fwd', nan):.1f}/{flex_fb:.1f}",
                 f"{d.get('cudnn_fwd_bwd', nan) / whole:.2f}",
                 f"{(ms.get('torch_select', nan) + flex_fb) / whole:.2f}",
                 f"{r['peak_mib'].get('whole_fwd_bwd', nan):.0f}/"
                 f"{d.get('peak_cudnn_fwd_bwd', nan):.0f}",
                 f"{100 * fwd_rate / rate:.0f}/{100 * bwd_rate / rate:.0f}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--budget", type=float, default=380.0, help="seconds for the whole run")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma list of configs")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--quick-checks", action="store_true",
                        help="only the paper bf16 oracle check and the torch-backend check")
    parser.add_argument("--check-list", default=None,
                        help="oracle checks to run, e.g. paper-bfloat16,paper-float16 (default: "
                             "all, or the first with --quick-checks); the torch-backend check "
                             "always runs")
    parser.add_argument("--rows", default=None,
                        help="row keys to time, e.g. select,main_fwd,main_fwd_bwd,main_bwd,kl,"
                             "whole_fwd_bwd (default: all; kl = KL value + index gradients "
                             "alone, main_bwd = the main backward alone)")
    parser.add_argument("--flex-configs", default="paper-8k,paper-32k",
                        help="configs that also time FlexAttention (last; '' for none)")
    parser.add_argument("--flex-dists", default=",".join(DISTS),
                        help="index distributions timed with FlexAttention")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also time tile-size variants")
    parser.add_argument("--profile-only", default=None,
                        help="run the whole op once for this config and exit (for ncu)")
    parser.add_argument("--profile-mode", default="sparse", choices=("sparse", "dense"),
                        help="the op's mode for --profile-only")
    parser.add_argument("--profile-dist", default="iid", choices=DISTS,
                        help="the index inputs for --profile-only")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton

    meta = dict(gpu=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                torch=torch.__version__, triton=triton.__version__,
                commit=args.commit or git_commit(), python=platform.python_version(),
                argv=sys.argv[1:], started=time.strftime("%Y-%m-%d %H:%M:%S"))
    run = Run(args.out, args.budget, meta)
    dims = DRY_DIMS if args.dry_run else DIMS
    if args.profile_only:
        heads_name, t, packed = CONFIGS[args.profile_only]
        _, _, x, _ = config_inputs(heads_name, 48 if args.dry_run else t, packed, dims,
                                   args.profile_dist, device)
        whole_op(x, dims, args.profile_mode)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 0
    if device.type == "cuda":
        ceilings(run)
    if not args.skip_checks:
        checks = [("paper", torch.bfloat16), ("peer", torch.bfloat16), ("tp-shard", torch.bfloat16),
                  ("paper", torch.float16)]
        if args.check_list is not None:
            wanted = set(filter(None, args.check_list.split(",")))
            checks = [c for c in checks if f"{c[0]}-{str(c[1])[6:]}" in wanted]
        elif args.dry_run or args.quick_checks:
            checks = checks[:1]
        for heads_name, dtype in checks:
            try:
                check_vs_reference(run, heads_name, HEADS[heads_name] if not args.dry_run
                                   else DRY_HEADS, dims, dtype, device)
            except Exception as e:
                run.record("checks", dict(check=f"reference-{heads_name}", ok=False,
                                          error=f"{type(e).__name__}: {e}"[:400]))
                traceback.print_exc()
        try:
            check_vs_torch_backend(run, device, dims, HEADS["paper"] if not args.dry_run
                                   else DRY_HEADS, 8192 if not args.dry_run else 40)
        except Exception as e:
            run.record("checks", dict(check="torch-backend", ok=False,
                                      error=f"{type(e).__name__}: {e}"[:400]))
            traceback.print_exc()
    for name in args.configs.split(","):
        heads_name, t, packed = CONFIGS[name]
        if args.dry_run:
            t = 48
        if run.left() < 10:
            print(f"budget: skipping {name}", flush=True)
            continue
        try:
            time_config(run, name, heads_name, t, packed, dims, device,
                        None if args.rows is None else set(args.rows.split(",")))
        except Exception as e:
            run.record("rows", dict(config=name, error=f"{type(e).__name__}: {e}"[:400]))
            traceback.print_exc()
    if args.sweep and device.type == "cuda":
        try:
            sweep(run, dims, device)
        except Exception as e:
            print(f"sweep: {type(e).__name__}: {e}", flush=True)
    for name in filter(None, args.flex_configs.split(",")):
        heads_name, t, packed = CONFIGS[name]
        try:
            time_flex(run, name, heads_name, 48 if args.dry_run else t, packed, dims, device,
                      tuple(filter(None, args.flex_dists.split(","))))
        except Exception as e:
            print(f"flex {name}: {type(e).__name__}: {e}", flush=True)
    run.data["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    run.save()
    print(table(run.data), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
