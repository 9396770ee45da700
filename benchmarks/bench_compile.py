"""torch.compile and dense (warmup) mode on one GPU, correctness first, then speed (issue 12).

Usage (one H200, from the repository root; megatron-core from ``.whl/`` if present)::

    python benchmarks/bench_compile.py benchmarks/results/compile_dense_h200.json [--budget 300]

CPU dry run of the script itself (interpreter, tiny shapes, no baselines)::

    TRITON_INTERPRET=1 python benchmarks/bench_compile.py /tmp/c.json --dry-run

Sections (``--sections``, run in the order given; each records into the JSON as it finishes;
a failing section is recorded and the run goes on; ``--budget`` seconds for all, every step
skips what no longer fits; ``--sizes`` / ``--dists`` for the dense rows):

1. ``compile_op``: the public ``msa_attention(..., backend="triton")`` compiled by inductor
   with ``fullgraph=True``, **first called inside the compiled function** (the lazy-import
   failure), packed documents (``cu_seqlens``: the SliceView failure), sparse and dense modes:
   out, KL and the five gradients against eager. Then eager vs compiled fwd+bwd at 32K.
2. ``compile_layer``: a megatron-core GPTModel built from ``get_gpt_layer_msa_spec`` (local
   spec, sbhd), the whole forward + loss compiled by inductor with ``fullgraph=True``: loss and
   every parameter gradient against eager, in fp32 and in bf16 (each recorded on its own; a
   graph break is recorded with the last 6000 characters of its trace: the user-code stack of
   the break), then eager vs compiled step time (bf16).
3. ``dense_checks``: route chosen for the paper config (``msa_megatron.ops.dense``); dense mode
   at T=4096 (packed, paper heads, bf16) routed vs our kernels vs the fp32 oracle (out, KL, five
   gradients); one-pass KL vs the two-pass kernels; bitwise-equal gradients over two runs.
4. ``dense_rows``: paper config at 32K and 128K, iid and coherent index inputs: dense mode
   whole op fwd+bwd (deterministic default and ``MSA_DENSE_DETERMINISTIC=0``), its forward,
   the KL alone, against dense cuDNN / FLASH SDPA fwd and fwd+bwd (and FLASH deterministic),
   then the route the rows ran on per size (``name="route"``).
   A KL tile sweep at 32K picks ``MSA_DENSE_KL_TILES`` first.

Prints a table last; JSON holds every number, GPU name, versions and the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # provenance.py, beside this

from msa_megatron import msa_attention  # noqa: E402
from msa_megatron import reference as ref  # noqa: E402
from msa_megatron.ops import dense  # noqa: E402
from msa_megatron.layout import query_layout  # noqa: E402
from provenance import git_commit  # noqa: E402,F401  (gpu_dense_route imports it from here)

NAMES = ("q", "k", "v", "q_idx", "k_idx")
PAPER = dict(hq=64, hkv=4, hi=4, hik=1, d=128, di=128, block=128, top_k=16)
DRY = dict(hq=4, hkv=2, hi=2, hik=1, d=16, di=16, block=16, top_k=2)
COHERENT_STRIDE = 256
# dense KL tiles "BM,BN,warps,stages" (sm_90 compile with Triton 3.6, bf16 paper heads, plain
# variant: shared bytes / spill bytes per thread): 128,64,8,2 163856 / 80, 64,64,8,2 98320 / 204,
# 64,64,4,2 98320 / 260 (two programs per SM)
KL_TILE_CANDIDATES = ("128,64,8,2", "64,64,8,2", "64,64,4,2")


class Run:
    def __init__(self, path: str, budget: float, meta: dict):
        self.path = path
        self.deadline = time.time() + budget
        self.data = dict(meta=meta, sections={}, rows=[])

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)

    def section(self, name: str, entry: dict) -> None:
        self.data["sections"][name] = entry
        self.save()
        print(f"== {name}: {json.dumps(entry, default=str)[:3000]}", flush=True)

    def row(self, entry: dict) -> None:
        self.data["rows"].append(entry)
        self.save()
        print(json.dumps(entry, default=str), flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_ms(fn, iters: int = 5) -> dict:
    """One warm-up call, then ``iters`` calls timed with CUDA events: median and min (ms)."""
    fn()
    sync()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.time()
            fn()
            times.append(1e3 * (time.time() - t0))
    return dict(median=statistics.median(times), min=min(times), n=len(times))


L2_FLUSH_BYTES = 256 << 20  # triton.testing.do_bench's cache buffer (zeroed before each call)


def paired_ms(base, other, pairs: int = 8, queued: bool = False) -> dict:
    """``base`` and ``other`` timed in ``pairs`` interleaved pairs (the order alternates; one
    warm-up call each): medians (ms) and the median, min and max of the per-pair ratios
    ``other / base`` (clock or thermal drift between the two cancels within a pair), and the
    ratio of the two medians (BENCHMARK.md's statistic; the two can differ by ~2% when single
    calls scatter). CUDA only.

    ``queued=False``: the host waits for the GPU after every call, so each call's time includes
    the host's latency to its first kernel (stricter than training, where the host runs ahead).
    ``queued=True``: BENCHMARK.md's method, ``triton.testing.do_bench``'s loop: a
    :data:`L2_FLUSH_BYTES` buffer zeroed before each call outside its events, no wait between
    calls, one synchronisation at the end; a call's time is then the GPU's, plus any idle the
    call itself causes (a host read inside it)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if queued else None

    def event_ms(fn):
        if flush is not None:
            flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        if flush is None:
            torch.cuda.synchronize()
        return a, b

    base()
    other()
    sync()
    tb, to = [], []
    for i in range(pairs):
        order = ((base, tb), (other, to)) if i % 2 == 0 else ((other, to), (base, tb))
        for fn, store in order:
            store.append(event_ms(fn))
    sync()
    tb = [a.elapsed_time(b) for a, b in tb]
    to = [a.elapsed_time(b) for a, b in to]
    ratios = [o / b for b, o in zip(tb, to)]
    base_ms, other_ms = statistics.median(tb), statistics.median(to)
    return dict(base_ms=base_ms, other_ms=other_ms, ratio=statistics.median(ratios),
                ratio_of_medians=other_ms / base_ms, ratio_min=min(ratios),
                ratio_max=max(ratios), pairs=pairs, queued=queued)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


TRACE_CHARS = 6000  # dynamo's "from user code" stack (the graph-break location) ends the trace


def failure(err: Exception, prefix: str = "") -> dict:
    """A failed check as JSON: the error's head and the last TRACE_CHARS characters of the
    traceback (for a dynamo graph break, its message with the user-code stack of the break)."""
    return {f"{prefix}error": f"{type(err).__name__}: {err}"[:2000],
            f"{prefix}trace": traceback.format_exc()[-TRACE_CHARS:]}


def index_input(t, heads, dim, dist, device, dtype, gen):
    if dist == "iid":
        return torch.randn(t, heads, dim, generator=gen, device=device).to(dtype)
    anchors = torch.randn(t // COHERENT_STRIDE + 2, heads, dim, generator=gen, device=device)
    pos = torch.arange(t, device=device, dtype=torch.float32) / COHERENT_STRIDE
    lo = pos.floor().long()
    frac = (pos - lo)[:, None, None]
    return ((1 - frac) * anchors[lo] + frac * anchors[lo + 1]).to(dtype)


def make_inputs(cfg, t, lens, dist, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    mk = lambda h, dd: torch.randn(t, h, dd, generator=gen, device=device).to(dtype)  # noqa
    x = dict(q=mk(cfg["hq"], cfg["d"]), k=mk(cfg["hkv"], cfg["d"]), v=mk(cfg["hkv"], cfg["d"]),
             q_idx=index_input(t, cfg["hi"], cfg["di"], dist, device, dtype, gen),
             k_idx=index_input(t, cfg["hik"], cfg["di"], dist, device, dtype, gen))
    x["cu"] = None if lens is None else torch.tensor(
        [0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    x["dout"] = torch.randn(t, cfg["hq"], cfg["d"], generator=gen, device=device).to(dtype)
    return x


def packed_lengths(t: int) -> list:
    """Documents of a fixed pattern (one empty, one of length 1), summing to t."""
    lens, pattern, n = [], [t // 3, 0, 1, t // 5, t // 7 + 3], 0
    for p in pattern:
        lens.append(min(p, t - n))
        n += lens[-1]
    lens.append(t - n)
    return lens


def op_fn(cfg, mode):
    def fn(q, k, v, q_idx, k_idx, cu):
        return msa_attention(q, k, v, q_idx, k_idx, cu, block_size=cfg["block"],
                             top_k=cfg["top_k"], mode=mode, backend="triton")
    return fn


def loss_and_grads(fn, x):
    leaves = [x[n].detach().requires_grad_() for n in NAMES]
    out, kl = fn(*leaves, x["cu"])
    grads = torch.autograd.grad((out, kl), leaves, (x["dout"], torch.ones_like(kl)))
    return [out, kl, *grads]


# ------------------------------------------------------------------ 1. public op
def compile_op(run: Run, cfg, device, dtype, t_check, t_time):
    """Check at ``t_check`` (None: skip), then time at ``t_time`` (None: skip)."""
    if t_check is not None:
        compile_op_check(run, cfg, device, dtype, t_check)
    if t_time is not None:
        compile_op_timing(run, cfg, device, dtype, t_time)


def compile_op_check(run: Run, cfg, device, dtype, t_check):
    import torch._dynamo

    result = {}
    x = make_inputs(cfg, t_check, packed_lengths(t_check), "iid", device, dtype)
    for mode in ("sparse", "dense"):
        torch._dynamo.reset()
        fn = op_fn(cfg, mode)
        entry = {}
        try:
            compiled = torch.compile(fn, fullgraph=True)  # inductor
            t0 = time.time()
            got = loss_and_grads(compiled, x)  # first triton call of the process is traced
            entry["compile_s"] = round(time.time() - t0, 2)
            want = loss_and_grads(fn, x)
            entry["rel_err"] = {n: rel(a, b) for n, a, b in
                                zip(("out", "kl") + NAMES, got, want)}
            entry["bitwise"] = all(torch.equal(a, b) for a, b in zip(got, want))
            entry["ok"] = max(entry["rel_err"].values()) < 1e-6
        except Exception as err:  # noqa: BLE001
            entry.update(ok=False, **failure(err))
        result[mode] = entry
    run.section("compile_op_check", result)


def compile_op_timing(run: Run, cfg, device, dtype, t_time):
    import torch._dynamo

    timing = {}
    for mode in ("sparse", "dense"):
        if run.left() < 60:
            timing[mode] = "skipped (budget)"
            continue
        try:
            torch._dynamo.reset()
            x = make_inputs(cfg, t_time, None, "iid", device, dtype)
            fn = op_fn(cfg, mode)
            compiled = torch.compile(fn, fullgraph=True)
            timing[mode] = dict(eager=time_ms(lambda: loss_and_grads(fn, x), 3),
                                compiled=time_ms(lambda: loss_and_grads(compiled, x), 3), T=t_time)
            timing[mode]["compiled_over_eager"] = (timing[mode]["compiled"]["median"]
                                                   / timing[mode]["eager"]["median"])
        except Exception as err:  # noqa: BLE001
            timing[mode] = failure(err)
    run.section("compile_op_timing", timing)


# ------------------------------------------------------------------ 2. megatron layer
def _init_megatron(device):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29561")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0,
                                world_size=1)
    if device.type != "cuda":
        from tests.dist_utils import install_megatron_cpu_shims

        install_megatron_cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(123)


def _gpt(device, dtype, mode, small):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import get_gpt_layer_msa_spec

    hidden, heads, groups, kv = (64, 4, 2, 16) if small else (1024, 16, 4, 128)
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=kv, ffn_hidden_size=4 * hidden, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, attention_dropout=0.0,
        hidden_dropout=0.0, normalization="RMSNorm", qk_layernorm=True)
    torch.manual_seed(7)
    msa = MSAConfig(block_size=16 if small else 128, top_k=2 if small else 16,
                    index_head_dim=16 if small else 128, backend="triton", mode=mode)
    spec = get_gpt_layer_msa_spec(msa, use_te=False, qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=512,
                     max_sequence_length=8192, position_embedding_type="rope")
    return model.to(device)


class quiet_megatron_warnings:
    """Diagnostic only: megatron-core's ``get_tensor_model_parallel_group_if_none`` in
    ``tensor_parallel.layers`` without its ``warnings.warn`` (same group), restored on exit.
    The MSA spec no longer needs it (its row-parallel linears pass their TP group,
    ``msa_megatron.megatron.compat.RowParallelLinearWithGroup``); the layer check uses it only
    after a plain attempt failed with a graph break, to see whether anything else breaks."""

    def __enter__(self):
        import megatron.core.tensor_parallel.layers as layers
        from megatron.core import parallel_state

        self.layers = layers
        self.saved = getattr(layers, "get_tensor_model_parallel_group_if_none", None)

        def group_if_none(tp_group=None, *args, **kwargs):
            return tp_group if tp_group is not None else \
                parallel_state.get_tensor_model_parallel_group()

        if self.saved is not None:
            layers.get_tensor_model_parallel_group_if_none = group_if_none
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.layers.get_tensor_model_parallel_group_if_none = self.saved


def compile_layer(run: Run, device, small, seq_check, seq_time):
    """Check (fp32 and bf16) at ``seq_check`` (None: skip), then time (bf16) at ``seq_time``."""
    _init_megatron(device)
    if seq_check is not None:
        compile_layer_check(run, device, small, seq_check)
    if seq_time is not None:
        compile_layer_timing(run, device, small, seq_time)


# compiled vs eager: (loss, worst parameter gradient) relative error bounds per dtype
LAYER_TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (2e-2, 1e-1)}
# dtypes of the layer check, in order (--layer-dtypes)
LAYER_DTYPES = [torch.float32, torch.bfloat16]


def _is_graph_break(err: Exception) -> bool:
    return type(err).__name__ in ("Unsupported", "UserError") or "graph break" in str(err)


def compile_layer_check(run: Run, device, small, seq_check):
    """fp32 and bf16, sparse and dense, each recorded on its own (one failure hides nothing):
    the whole GPT forward + loss compiled with ``fullgraph=True`` against eager. A graph break
    is recorded with its location (:func:`failure`); the check then retries under
    :class:`quiet_megatron_warnings` to see what comes next (``attempt`` says which passed)."""
    import torch._dynamo

    result = {}
    for dtype in LAYER_DTYPES:
        for mode in ("sparse", "dense"):
            key = f"{mode}_{str(dtype).replace('torch.', '')}"
            entry = dict(dtype=str(dtype), mode=mode)
            result[key] = entry
            if run.left() < 45:
                entry.update(ok=False, skipped="budget")
                continue
            for attempt in ("plain", "quiet_megatron_warnings"):
                torch._dynamo.reset()
                shim = quiet_megatron_warnings() if attempt != "plain" else None
                try:
                    if shim is not None:
                        shim.__enter__()
                    entry.update(_layer_check_once(device, dtype, mode, small, seq_check),
                                 attempt=attempt)
                    break
                except Exception as err:  # noqa: BLE001
                    entry.update(ok=False, **failure(err, f"{attempt}_"))
                    if attempt != "plain" or not _is_graph_break(err) or run.left() < 45:
                        break
                finally:
                    if shim is not None:
                        shim.__exit__(None, None, None)
            run.section("compile_layer_check", result)  # saved after every entry
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _layer_check_once(device, dtype, mode, small, seq_check) -> dict:
    model = _gpt(device, dtype, mode, small)
    gen = torch.Generator(device="cpu").manual_seed(3)
    tokens = torch.randint(0, 512, (1, seq_check), generator=gen).to(device)
    positions = torch.arange(seq_check, device=device)[None]

    def step(tokens, positions):
        return model(tokens, positions, None, labels=tokens).float().mean()

    def grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(tokens, positions)
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                               if p.grad is not None}

    compiled = torch.compile(step, fullgraph=True)
    t0 = time.time()
    c_loss, c_grads = grads(compiled)
    compile_s = round(time.time() - t0, 2)
    e_loss, e_grads = grads(step)
    errs = {n: rel(c_grads[n], e_grads[n]) for n in e_grads if n in c_grads}
    worst = max(errs, key=errs.get)
    loss_tol, grad_tol = LAYER_TOL[dtype]
    missing = sorted(set(e_grads) - set(c_grads))
    return dict(compile_s=compile_s, loss_rel_err=rel(c_loss, e_loss), grads=len(errs),
                missing=missing, worst_grad=worst, worst_grad_rel_err=errs[worst],
                index_grads={n: errs[n] for n in errs if "index" in n or "idx" in n},
                ok=(rel(c_loss, e_loss) < loss_tol and errs[worst] < grad_tol and not missing))


def compile_layer_timing(run: Run, device, small, seq_time):
    import torch._dynamo

    timing = {}
    for mode in ("sparse", "dense"):
        if run.left() < 60:
            timing[mode] = "skipped (budget)"
            continue
        try:
            torch._dynamo.reset()
            model = _gpt(device, torch.bfloat16, mode, small)
            tokens = torch.randint(0, 512, (1, seq_time), device=device)
            positions = torch.arange(seq_time, device=device)[None]

            def step(tokens, positions):
                return model(tokens, positions, None, labels=tokens).float().mean()

            def train(fn):
                model.zero_grad(set_to_none=True)
                fn(tokens, positions).backward()

            compiled = torch.compile(step, fullgraph=True)
            train(compiled)
            train(compiled)  # the KL metric tensors exist from here on: at most one retrace
            with torch._dynamo.config.patch(error_on_recompile=True):  # steady state
                timing[mode] = dict(eager=time_ms(lambda: train(step), 3),
                                    compiled=time_ms(lambda: train(compiled), 3), seq=seq_time)
            timing[mode]["compiled_over_eager"] = (timing[mode]["compiled"]["median"]
                                                   / timing[mode]["eager"]["median"])
        except Exception as err:  # noqa: BLE001
            timing[mode] = failure(err)
    run.section("compile_layer_timing", timing)


# ------------------------------------------------------------------ 3. dense checks
class env:
    """Set environment variables inside a block."""

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        for k, v in self.values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dense_checks(run: Run, cfg, device, dtype, t):
    result = {}
    x = make_inputs(cfg, t, packed_lengths(t), "iid", device, dtype)
    result["route"] = dense.route_report(x["q"], x["k"])
    with env(MSA_DENSE_DETERMINISTIC="0"):
        result["route_nondeterministic"] = dense.route_report(x["q"], x["k"])
    fn = op_fn(cfg, "dense")
    routed = loss_and_grads(fn, x)
    again = loss_and_grads(fn, x)
    result["bitwise_repeat"] = {n: torch.equal(a, b)
                                for n, a, b in zip(("out", "kl") + NAMES, routed, again)}
    with env(MSA_DENSE_BACKEND="kernels"):
        ours = loss_and_grads(fn, x)
    with env(MSA_DENSE_KL="twopass"):
        twopass = loss_and_grads(fn, x)
    with env(MSA_DENSE_DETERMINISTIC="0"):
        fastest = loss_and_grads(fn, x)
    names = ("out", "kl") + NAMES
    result["routed_vs_kernels"] = {n: rel(a, b) for n, a, b in zip(names, routed, ours)}
    result["onepass_vs_twopass_kl"] = {n: rel(a, b) for n, a, b in zip(names, routed, twopass)
                                       if n in ("kl", "q_idx", "k_idx")}
    result["nondeterministic_vs_default"] = {n: rel(a, b)
                                             for n, a, b in zip(names, fastest, routed)}
    leaves = [x[n].detach().float().requires_grad_() for n in NAMES]
    want_out, want_kl = ref.msa_attention_reference(*leaves, x["cu"], block_size=cfg["block"],
                                                    top_k=cfg["top_k"], mode="dense")
    want = [want_out, want_kl, *torch.autograd.grad((want_out, want_kl), leaves,
                                                   (x["dout"].float(), torch.ones_like(want_kl)))]
    del leaves
    for label, got in (("routed", routed), ("kernels", ours)):
        result[f"{label}_vs_oracle"] = {n: rel(a, b) for n, a, b in zip(names, got, want)}
    tol = 3e-2 if dtype == torch.bfloat16 else 3e-3
    result["cp_layout_kl_vs_oracle"] = cp_layout_kl_check(x, cfg, device)
    result["ok"] = (all(result["bitwise_repeat"].values())
                    and max(result["routed_vs_oracle"].values()) < 2 * tol
                    and max(result["onepass_vs_twopass_kl"].values()) < tol
                    and max(result["cp_layout_kl_vs_oracle"].values()) < 2 * tol)
    # the two routes' LSE against our forward's (through the raw custom op: our kernels)
    q_pos, q_kbase = query_layout(x["cu"], t, device)
    from msa_megatron.ops import triton as triton_backend

    with env(MSA_DENSE_BACKEND="kernels"):
        _, lse_ours = triton_backend.ops.attention_fwd(x["q"], x["k"], x["v"], None, q_pos,
                                                       q_kbase, cfg["block"], cfg["d"] ** -0.5,
                                                       cfg["hi"])
    for name, route in dense.ROUTES.items():
        try:
            seqs = dense.standard_sequences(q_pos, q_kbase, t)
            if not route.takes(seqs):  # cuDNN: equal lengths only (gpu_dense_route.py checks it)
                result[f"lse_{name}"] = "route does not take this layout (unequal lengths)"
                continue
            _, lse = route.forward(x["q"], x["k"], x["v"], seqs, cfg["d"] ** -0.5)
            result[f"lse_{name}_vs_ours_max_abs"] = float((lse - lse_ours).abs().max())
        except Exception as err:  # noqa: BLE001
            result[f"lse_{name}"] = f"{type(err).__name__}: {err}"[:500]
    run.section("dense_checks", result)


def cp_layout_kl_check(x, cfg, device) -> dict:
    """Dense KL in the general (context-parallel) layout: the last half of every document as
    queries, with their positions, against all keys; triton vs the fp32 oracle."""
    from msa_megatron.ops import triton as triton_backend

    t = x["q"].shape[0]
    q_pos, q_kbase = query_layout(x["cu"], t, device)
    lengths = (x["cu"][1:] - x["cu"][:-1]).long()
    seq = torch.searchsorted(x["cu"].long(), torch.arange(t, device=device), right=True) - 1
    keep = q_pos.long() >= lengths[seq] // 2
    q, q_idx = x["q"][keep], x["q_idx"][keep].detach().requires_grad_()
    k_idx = x["k_idx"].detach().requires_grad_()
    q_pos, q_kbase = q_pos[keep].contiguous(), q_kbase[keep].contiguous()
    _, lse = triton_backend.attention(q, x["k"], x["v"], None, q_pos, q_kbase,
                                      block_size=cfg["block"], index_heads=cfg["hi"])
    value = triton_backend.kl(q, x["k"], lse, q_idx, k_idx, None, q_pos, q_kbase,
                              block_size=cfg["block"], kl_scale=1e-3)
    got = [value, *torch.autograd.grad(value, (q_idx, k_idx))]
    leaves = [y.detach().float().requires_grad_() for y in (q_idx, k_idx)]
    want = ref.kl_core_reference(q.float(), x["k"].float(), *leaves, None, q_pos, q_kbase,
                                 block_size=cfg["block"], kl_scale=1e-3)
    want = [want, *torch.autograd.grad(want, leaves)]
    return {n: rel(a, b) for n, a, b in zip(("kl", "q_idx", "k_idx"), got, want)}


# ------------------------------------------------------------------ 4. dense rows
def sdpa_fn(x, backend_name, grads, deterministic=False):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)
    q, k, v = (x[n].detach().transpose(0, 1).unsqueeze(0) for n in ("q", "k", "v"))
    q, k, v = (y.requires_grad_(grads) for y in (q, k, v))
    dout = x["dout"].transpose(0, 1).unsqueeze(0)

    def fn():
        before = torch.are_deterministic_algorithms_enabled()
        if deterministic:
            torch.use_deterministic_algorithms(True)
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            if grads:
                torch.autograd.grad(out, (q, k, v), dout)
        finally:
            torch.use_deterministic_algorithms(before)
        return out

    return fn


def kl_only_fn(x, cfg):
    """The dense-mode KL alone (value and index gradients), through the triton backend's
    dispatch (``MSA_DENSE_KL``: the Gluon pass where it applies), as dense mode runs it."""
    from msa_megatron.ops import triton as triton_backend

    t = x["q"].shape[0]
    q_pos, q_kbase = query_layout(x["cu"], t, x["q"].device)
    _, lse = triton_backend.ops.attention_fwd(x["q"], x["k"], x["v"], None, q_pos, q_kbase,
                                              cfg["block"], cfg["d"] ** -0.5, cfg["hi"])

    def fn():
        return triton_backend._kl(x["q"], x["k"], lse, x["q_idx"], x["k_idx"], None, q_pos,
                                  q_kbase, cfg["block"], cfg["d"] ** -0.5, cfg["di"] ** -0.5,
                                  1.0 / (t * cfg["hi"]), True)

    return fn


def kl_tile_sweep(run: Run, cfg, device, dtype, t):
    from msa_megatron.ops.triton import dense_kl

    x = make_inputs(cfg, t, None, "iid", device, dtype)
    results, best = {}, None
    for tiles in KL_TILE_CANDIDATES:
        if run.left() < 120:  # one compile (~10-20 s) and 4 calls (~0.1 s each at 32K)
            break
        with env(MSA_DENSE_KL_TILES=tiles):
            try:
                fn = kl_only_fn(x, cfg)
                results[tiles] = time_ms(fn, 3)["median"]
                if best is None or results[tiles] < results[best]:
                    best = tiles
            except Exception as err:  # noqa: BLE001
                results[tiles] = f"{type(err).__name__}: {err}"[:500]
    if best is not None:
        os.environ[dense_kl.TILES_ENV] = best
    run.section("kl_tile_sweep", dict(T=t, ms=results, chosen=best))


# --rows essential: what the 1.25x target needs, per size class (big: T > 32K)
ESSENTIAL_ROWS = {
    False: {"dense_mode_fwd_bwd", "dense_mode_fwd_bwd_nondeterministic", "dense_mode_fwd",
            "kl_only_fwd_bwd", "cudnn_fwd_bwd", "cudnn_fwd", "flash_fwd",
            "flash_fwd_bwd_deterministic"},
    True: {"dense_mode_fwd_bwd", "dense_mode_fwd_bwd_nondeterministic", "kl_only_fwd_bwd",
           "cudnn_fwd_bwd"},
}
# seconds per call at 128K (H200, 2026-12-01 or predicted with the vendor routes), for budgeting
ROW_SECONDS_128K = {"dense_mode_fwd_bwd": 5.5, "dense_mode_fwd_bwd_nondeterministic": 3.5,
                    "flash_fwd_bwd_deterministic": 4.0, "dense_mode_fwd_bwd_ours_kernels": 15.0,
                    "dense_mode_fwd_bwd_before_issue12": 21.0}


def dense_rows(run: Run, cfg, device, dtype, sizes, dists, baselines, essential=False):
    """Rows per (T, dist); at 128K the iid rows and the two dense-mode rows of the other dists
    (the budget).
    ``essential``: only :data:`ESSENTIAL_ROWS` (a short GPU call)."""
    for t in sizes:
        big = t > 32768
        for dist in dists:
            x = make_inputs(cfg, t, None, dist, device, dtype)
            fn = op_fn(cfg, "dense")
            whole = lambda: loss_and_grads(fn, x)  # noqa: E731
            # the non-deterministic row is the 1.25x target's: every (T, dist)
            rows = [("dense_mode_fwd_bwd", whole, {}),
                    ("dense_mode_fwd_bwd_nondeterministic", whole,
                     dict(MSA_DENSE_DETERMINISTIC="0"))]
            if dist == "iid":
                rows += [("dense_mode_fwd", lambda: fn(*[x[n] for n in NAMES], x["cu"]), {}),
                         ("kl_only_fwd_bwd", kl_only_fn(x, cfg), {})]
                if not big:
                    rows += [("dense_mode_fwd_bwd_ours_kernels", whole,
                              dict(MSA_DENSE_BACKEND="kernels")),
                             ("dense_mode_fwd_bwd_before_issue12", whole,
                              dict(MSA_DENSE_BACKEND="kernels", MSA_DENSE_KL="twopass"))]
                if baselines:
                    rows += [("cudnn_fwd_bwd", sdpa_fn(x, "CUDNN_ATTENTION", True), {}),
                             ("cudnn_fwd", sdpa_fn(x, "CUDNN_ATTENTION", False), {}),
                             ("flash_fwd", sdpa_fn(x, "FLASH_ATTENTION", False), {}),
                             ("flash_fwd_bwd_deterministic",
                              sdpa_fn(x, "FLASH_ATTENTION", True, True), {})]
                    if not big:
                        rows.append(("flash_fwd_bwd", sdpa_fn(x, "FLASH_ATTENTION", True), {}))
            if essential:
                rows = [r for r in rows if r[0] in ESSENTIAL_ROWS[big]]
            for name, call, env_values in rows:
                calls = 3 if big else 5
                est = calls * ROW_SECONDS_128K.get(name, 2.5) * (t / 131072) ** 2
                if run.left() < est + 5:
                    run.row(dict(name=name, T=t, dist=dist, skipped="budget"))
                    continue
                try:
                    with env(**env_values):
                        timing = time_ms(call, 2 if big else 4)
                    run.row(dict(name=name, T=t, dist=dist, **timing))
                except Exception as err:  # noqa: BLE001
                    run.row(dict(name=name, T=t, dist=dist,
                                 error=f"{type(err).__name__}: {err}"[:1000]))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            # the 1.25x target's ratio, dense mode (non-deterministic) and cuDNN in
            # interleaved pairs: drift between two separately timed rows cancels. "_queued" is
            # BENCHMARK.md's do_bench loop (no wait between calls); the other waits after each
            # call (each call's host latency to its first kernel counted)
            pairs = 4 if big else 8
            est = pairs * 1.05 * 2 * ROW_SECONDS_128K["dense_mode_fwd_bwd_nondeterministic"] \
                * (t / 131072) ** 2
            for queued in (False, True):
                name = ("dense_mode_nondeterministic_vs_cudnn_paired"
                        + ("_queued" if queued else ""))
                if torch.cuda.is_available() and run.left() < est + 5:
                    run.row(dict(name=name, T=t, dist=dist, skipped="budget"))
                elif torch.cuda.is_available():
                    try:
                        with env(MSA_DENSE_DETERMINISTIC="0"):
                            pair = paired_ms(sdpa_fn(x, "CUDNN_ATTENTION", True), whole, pairs,
                                             queued=queued)
                        run.row(dict(name=name, T=t, dist=dist, **pair))
                    except Exception as err:  # noqa: BLE001
                        run.row(dict(name=name, T=t, dist=dist,
                                     error=f"{type(err).__name__}: {err}"[:1000]))
                    torch.cuda.empty_cache()
            if dist == dists[0]:  # what the rows above ran on (a route refused at this size
                # by a real call shows under "refused")
                run.row(dict(name="route", T=t, dist=dist, **dense.route_report(x["q"], x["k"])))


def table(data: dict) -> str:
    lines = ["| T | dist | row | ms (median) | vs cuDNN fwd+bwd |", "|---|---|---|---|---|"]
    base = {(r["T"]): r["median"] for r in data["rows"]
            if r.get("name") == "cudnn_fwd_bwd" and "median" in r}
    for r in data["rows"]:
        if "median" not in r:
            continue
        ratio = r["median"] / base[r["T"]] if r["T"] in base else float("nan")
        lines.append(f"| {r['T']} | {r['dist']} | {r['name']} | {r['median']:.1f} | "
                     f"{ratio:.2f}x |")
    for r in data["rows"]:
        if "ratio" in r:
            lines.append(f"paired at T={r['T']} {r['dist']}: {r['name']} {r['other_ms']:.1f} ms "
                         f"vs cuDNN {r['base_ms']:.1f} ms: {r['ratio']:.3f}x (pairs "
                         f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}, n {r['pairs']}; "
                         f"ratio of medians {r['other_ms'] / r['base_ms']:.3f})")

    def verdict(v: dict) -> str:
        if v.get("skipped"):
            return f"skipped ({v['skipped']})"
        if not v.get("ok"):
            return "FAIL"
        return "ok" if v.get("attempt", "plain") == "plain" else f"ok only with {v['attempt']}"

    for name in ("compile_op_check", "compile_layer_check"):
        sec = data["sections"].get(name, {})
        lines.append(f"{name}: " + ", ".join(f"{m}={verdict(v)}"
                                              for m, v in sec.items() if isinstance(v, dict)))
    for name in ("compile_op_timing", "compile_layer_timing"):
        sec = data["sections"].get(name, {})
        lines.append(f"{name}: " + ", ".join(
            f"{m}: eager {v['eager']['median']:.1f} ms, compiled {v['compiled']['median']:.1f} ms"
            if isinstance(v, dict) else f"{m}: {v}" for m, v in sec.items()))
    for r in data["rows"]:
        if r.get("name") == "route":
            lines.append(f"route at T={r['T']}: forward {r.get('forward')}, backward "
                         f"{r.get('backward')} (deterministic {r.get('deterministic')}), "
                         f"refused {r.get('refused')}")
    checks = data["sections"].get("dense_checks", {})
    if checks:
        lines.append(f"dense_checks ok={checks.get('ok')} route={checks.get('route')}")
    return "\n".join(lines)



def run_sections(run: "Run", steps: Dict[str, Callable[[], object]],
                 names: Sequence[str]) -> None:
    """Run ``steps[name]()`` for each of ``names`` in order; a section that raises is recorded as
    ``<name>_error`` and the run goes on. Prints each section's time, then saves ``run``."""
    for name in names:
        t0 = time.time()
        try:
            steps[name]()
        except Exception as err:  # noqa: BLE001
            run.section(f"{name}_error", failure(err))
        print(f"-- {name} took {time.time() - t0:.1f} s, {run.left():.0f} s left", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run.data["meta"]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    run.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSON result path")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds for the whole run")
    parser.add_argument("--sections",
                        default="op,dense_checks,dense_rows,op_timing,layer,layer_timing")
    parser.add_argument("--sizes", default="32768,131072")
    parser.add_argument("--dists", default="iid,coherent",
                        help="index input distributions of the dense rows")
    parser.add_argument("--rows", choices=("all", "essential"), default="all",
                        help="essential: only the rows the 1.25x target needs")
    parser.add_argument("--no-kl-sweep", dest="kl_sweep", action="store_false",
                        help="keep the default MSA_DENSE_KL_TILES (no tile sweep at 32K)")
    parser.add_argument("--layer-dtypes", default="fp32,bf16",
                        help="dtypes of the layer check (fp32,bf16; bf16 alone halves its time)")
    parser.add_argument("--dry-run", action="store_true", help="CPU: tiny shapes, no baselines")
    args = parser.parse_args()
    names = {"fp32": torch.float32, "bf16": torch.bfloat16}
    bad = sorted(set(args.layer_dtypes.split(",")) - set(names))
    if bad:
        parser.error(f"--layer-dtypes: unknown {bad}; choose from {sorted(names)}")
    LAYER_DTYPES[:] = [names[v] for v in args.layer_dtypes.split(",")]
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cfg = PAPER if cuda else DRY
    dtype = torch.bfloat16 if cuda else torch.float32
    import triton

    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                triton=triton.__version__, commit=git_commit(), cfg=cfg, dtype=str(dtype),
                argv=sys.argv, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    try:
        import megatron.core as mc

        meta["megatron_core"] = mc.__version__
    except Exception:  # noqa: BLE001
        meta["megatron_core"] = None
    run = Run(args.out, args.budget, meta)
    sections = args.sections.split(",")
    sizes = [int(v) for v in args.sizes.split(",")] if cuda else [64]
    # Run in the order of --sections (default: the compile checks, the dense checks and rows
    # (the targets), then the Megatron layer, then eager-vs-compiled timings); every step
    # watches the budget.
    steps = [
        ("op", lambda: compile_op(run, cfg, device, dtype, 4096 if cuda else 64, None)),
        ("dense_checks", lambda: dense_checks(run, cfg, device, dtype, 4096 if cuda else 64)),
        ("dense_rows", lambda: (kl_tile_sweep(run, cfg, device, dtype, 32768)
                                if cuda and args.kl_sweep else None,
                                dense_rows(run, cfg, device, dtype, sizes,
                                           args.dists.split(","), cuda,
                                           essential=args.rows == "essential"))),
        ("op_timing", lambda: compile_op(run, cfg, device, dtype, None,
                                         32768 if cuda else None)),
        ("layer", lambda: compile_layer(run, device, not cuda, 1024 if cuda else 48, None)),
        ("layer_timing", lambda: compile_layer(run, device, not cuda, None,
                                               8192 if cuda else None)),
    ]
    unknown = sorted(set(sections) - {name for name, _ in steps})
    if unknown:
        parser.error(f"unknown --sections {unknown}; choose from {[n for n, _ in steps]}")
    run_sections(run, dict(steps), sections)
    print(table(run.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
