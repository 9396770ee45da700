"""Context-parallel MSA core against one process holding everything (MSA_SPEC section 6).

Real gloo ranks on CPU (CP=2, CP=4, TP=2 x CP=2); no megatron-core (the layout's agreement with
megatron-core's split is tested in ``tests/megatron/test_megatron_cp.py``). Each case builds one global packed batch,
splits it with megatron-core's load-balanced CP layout, runs
:func:`msa_megatron.core.msa_layer` with a CP group on every rank and compares with the
single-process ``msa_layer``: outputs, KL (summed over ranks), selections (as sets, per query and
index head), and the gradients of q, k, v, q_idx, k_idx of one loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from msa_megatron.core import MSAOptions, kl_of_rows, msa_layer
from msa_megatron.layout import query_layout, real_token_rows
from msa_megatron.ops.backends import get_backend
from msa_megatron.parallel.context import cp_bytes_moved, resolve_cp_kv_exchange
from msa_megatron.parallel.cp_layout import (
    build_cp_layout,
    sbhd_cu_seqlens,
    split_for_cp_rank,
)
from msa_megatron.parallel.groups import ParallelGroups
from tests.dist_utils import run_distributed, selected_device
from tests.support.devices import skip_without_gpus
from tests.support.inputs import padded_real_rows

REFERENCE_BACKEND = "reference"  # the single-process side always runs the oracle
DTYPE = torch.float64
TOL = dict(rtol=1e-9, atol=1e-11)
KL_TOL = dict(rtol=1e-6, atol=1e-9)  # the KL is returned in fp32 (MSA_SPEC section 4)
HEADS = dict(hq=4, hkv=2, hi=2, hik=1, d=16, di=8)
# TP=2 > Hkv=1: the two TP ranks share one KV head and one index head (MSA_SPEC section 6).
SHARED_HEADS = dict(hq=4, hkv=1, hi=1, hik=1, d=16, di=8)
HEAD_KEYS = {"q": "hq", "k": "hkv", "v": "hkv", "q_idx": "hi", "k_idx": "hik"}
OPTIONS = dict(block_size=16, top_k=3, init_blocks=1, local_blocks=1, softmax_scale=None,
               index_scale=None)
SELECT_OPTIONS = {n: OPTIONS[n] for n in ("block_size", "top_k", "init_blocks", "local_blocks",
                                          "index_scale")}


def _options(**changes):
    return MSAOptions(**dict(OPTIONS, **changes))
KL_WEIGHT = 50.0  # makes the KL gradient comparable in size to the output gradient
# THD: lengths multiples of 2*CP (8) but not of the block, a zero-length document, documents
# crossing chunk boundaries (chunk = length / (2*CP)).
THD_LENGTHS = [72, 0, 136, 40]
# Padded THD (megatron pads each sequence to a multiple of 2*CP): the real lengths.
REAL_LENGTHS = [70, 0, 131, 33]
SBHD_BATCH, SBHD_SEQ = 2, 96
NAMES = ("q", "k", "v", "q_idx", "k_idx")


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


def _case_cu(case):
    if case["layout"] == "sbhd":
        return sbhd_cu_seqlens(SBHD_BATCH, SBHD_SEQ, torch.device("cpu"))
    return _cu(THD_LENGTHS)


def _kl_tokens(case):
    """N of the KL normaliser: real tokens only."""
    return sum(REAL_LENGTHS) if case.get("padded") else int(_case_cu(case)[-1])


def _real_rows():
    """Global rows of the real tokens of the padded THD batch."""
    return padded_real_rows(THD_LENGTHS, REAL_LENGTHS)


def _global_inputs(case, h):
    """Fresh random global inputs (same on every rank: seeded generator)."""
    gen = torch.Generator().manual_seed(case["seed"])
    total = int(_case_cu(case)[-1])
    shapes = {"q": (h["hq"], h["d"]), "k": (h["hkv"], h["d"]), "v": (h["hkv"], h["d"]),
              "q_idx": (h["hi"], h["di"]), "k_idx": (h["hik"], h["di"])}
    x = {n: torch.randn((total,) + s, generator=gen, dtype=DTYPE) for n, s in shapes.items()}
    if case.get("coherent"):
        # Every query prefers the same two "hot" blocks of each sequence: a coherent selection.
        direction = torch.randn(h["di"], generator=gen, dtype=DTYPE)
        x["q_idx"] = 0.2 * x["q_idx"] + direction
        cu = _case_cu(case).tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            for hot in (1, 3):
                rows = slice(start + hot * OPTIONS["block_size"],
                             min(end, start + (hot + 1) * OPTIONS["block_size"]))
                x["k_idx"][rows] += 3.0 * direction
    w_out = torch.randn((total, h["hq"], h["d"]), generator=gen, dtype=DTYPE)
    return x, w_out


def _single_process(case, heads):
    """Reference: one process, the whole batch. Returns out, kl, block_idx, grads."""
    x, w_out = _global_inputs(case, heads)
    x = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    cu = _case_cu(case)
    total = int(cu[-1])
    q_pos, q_kbase = query_layout(cu, total, torch.device("cpu"))
    block_idx = None
    if case["mode"] == "sparse":
        block_idx = get_backend(REFERENCE_BACKEND).select(
            x["q_idx"], x["k_idx"], q_pos, q_kbase, **SELECT_OPTIONS)
    options = _options(backend=REFERENCE_BACKEND, mode=case["mode"])
    result = msa_layer(*(x[n] for n in NAMES), options=options, cu_seqlens=cu,
                       kl_scale=1.0 / (total * heads["hi"]), block_idx=block_idx)
    out, kl = result.out, result.kl
    if case.get("padded"):
        # The KL of the real tokens alone: the batch packed without its padding.
        rows = _real_rows()
        kl = msa_layer(*(x[n].index_select(0, rows) for n in NAMES), options=options,
                       cu_seqlens=_cu(REAL_LENGTHS),
                       kl_scale=1.0 / (_kl_tokens(case) * heads["hi"]),
                       block_idx=None if block_idx is None else block_idx[rows]).kl
    ((out * w_out).sum() + KL_WEIGHT * kl).backward()
    return {"out": out.detach(), "kl": kl.detach(), "block_idx": block_idx,
            "grads": {n: t.grad for n, t in x.items()}}


def _replicated(name, tp_size, heads):
    """Heads fewer than TP ranks are replicated over TP (index keys with Hik = 1; KV and index
    heads when TP > Hkv); their gradient is the sum over the TP ranks."""
    return heads[HEAD_KEYS[name]] % tp_size != 0


def _head_slice(name, tp_rank, tp_size, heads):
    if _replicated(name, tp_size, heads):
        return slice(None)
    n = heads[HEAD_KEYS[name]] // tp_size
    return slice(tp_rank * n, (tp_rank + 1) * n)


def _worker(rank, world_size, cases, tp_size, backend, heads):
    cp_size = world_size // tp_size
    tp_rank, cp_rank = rank % tp_size, rank // tp_size
    cp_groups = [dist.new_group([c * tp_size + t for c in range(cp_size)]) for t in range(tp_size)]
    tp_groups = [dist.new_group([c * tp_size + t for t in range(tp_size)]) for c in range(cp_size)]
    cp_group = cp_groups[tp_rank]
    share = tp_groups[cp_rank] if heads["hi"] < tp_size else None
    device = torch.device("cuda", rank) if selected_device() == "cuda" else torch.device("cpu")
    results = [_bad_inputs_raise(cp_group, device)]
    for case in cases:
        cu = _case_cu(case).to(device)
        x, w_out = _global_inputs(case, heads)
        local = {n: split_for_cp_rank(t.to(device), cu, cp_size, cp_rank)
                 [:, _head_slice(n, tp_rank, tp_size, heads)].contiguous().requires_grad_(True)
                 for n, t in x.items()}
        w_local = split_for_cp_rank(w_out.to(device), cu, cp_size, cp_rank)[
            :, _head_slice("q", tp_rank, tp_size, heads)]
        kwargs = dict(cu_seqlens=cu, groups=ParallelGroups(cp=cp_group, tp_share=share),
                      options=_options(kv_exchange=case["exchange"], mode=case["mode"],
                                       backend=backend),
                      kl_scale=1.0 / (_kl_tokens(case) * heads["hi"]))
        if case.get("padded"):
            kwargs["cu_seqlens_real"] = _cu(REAL_LENGTHS).to(device)
        res = msa_layer(*(local[n] for n in NAMES), **kwargs)
        out, kl, block_idx, stats = res.out, res.kl, res.block_idx, res.stats
        ((out * w_local).sum() + KL_WEIGHT * kl).backward()
        result = {"out": out.detach(), "kl": kl.detach(), "block_idx": block_idx,
                  "grads": {n: t.grad for n, t in local.items()}, "stats": dict(stats),
                  "rows": build_cp_layout(cu.cpu(), cp_size, cp_rank, OPTIONS["block_size"],
                                          torch.device("cpu")).local_rows}
        if case["mode"] == "sparse":
            # Recomputation reuses the kept selection: with other index keys the output is the
            # same and the selection is not recomputed.
            again_res = msa_layer(
                *(local[n].detach() for n in ("q", "k", "v", "q_idx")), -local["k_idx"].detach(),
                block_idx=block_idx, **kwargs)
            again, idx_again = again_res.out, again_res.block_idx
            result["recompute_equal"] = bool(torch.equal(again, out.detach())
                                             and torch.equal(idx_again, block_idx))
        results.append(result)
    return results


def _bad_inputs_raise(cp_group, device):
    """Bad CP inputs raise ValueError/TypeError naming the argument (before any collective)."""
    cp_size = dist.get_world_size(cp_group)
    t_local = 2 * 8 * 3  # three sequences of 16 tokens per rank
    x = {n: torch.randn(t_local, 2 if n != "k_idx" else 1, 8, device=device) for n in NAMES}
    good = dict(cu_seqlens=_cu([16 * cp_size] * 3).to(device),
                groups=ParallelGroups(cp=cp_group), options=dict(backend="torch"), kl_scale=1.0)
    bad = {
        "kv_exchange": dict(good, options=dict(backend="torch", kv_exchange="ring")),
        "cu_seqlens_global": dict(good, cu_seqlens=_cu([16 * cp_size, 2, 16 * cp_size - 2])
                                  .to(device)),
        "CP * T_local": dict(good, cu_seqlens=_cu([16 * cp_size] * 2).to(device)),
        "block_idx": dict(good, block_idx=torch.zeros(t_local, 2, 2, dtype=torch.int32,
                                                      device=device)),
    }
    raised = {}
    for needle, kwargs in bad.items():
        try:
            # The options are built inside the try: an invalid option raises on construction.
            kwargs = dict(kwargs, options=_options(**kwargs["options"]))
            msa_layer(*(x[n] for n in NAMES), **kwargs)
            raised[needle] = False
        except (TypeError, ValueError) as error:
            raised[needle] = needle in str(error)
    return raised


def _assert_same_selection(got, want):
    """Selections equal as sets per (query, index head) (fp64 inputs: no near-ties)."""
    got_sorted = torch.sort(got.to(torch.int64), dim=-1).values
    want_sorted = torch.sort(want.to(torch.int64), dim=-1).values
    assert torch.equal(got_sorted, want_sorted)


def _compare(case, ranks, tp_size, heads):
    ref = _single_process(case, heads)
    kl_total = sum(r["kl"] for r in ranks)  # each rank's KL covers distinct (token, head) rows
    torch.testing.assert_close(kl_total, ref["kl"], **KL_TOL)
    summed = {}
    for rank, r in enumerate(ranks):
        tp_rank, cp_rank = rank % tp_size, rank // tp_size
        rows = r["rows"]
        torch.testing.assert_close(r["out"], ref["out"][rows][:, _head_slice("q", tp_rank, tp_size,
                                                                           heads)], **TOL)
        if case["mode"] == "sparse":
            _assert_same_selection(r["block_idx"], ref["block_idx"][rows][
                :, _head_slice("q_idx", tp_rank, tp_size, heads)])
            assert r["recompute_equal"]
        for n in NAMES:
            if _replicated(n, tp_size, heads):
                summed[n, cp_rank] = summed.get((n, cp_rank), 0) + r["grads"][n]
                continue
            want = ref["grads"][n][rows][:, _head_slice(n, tp_rank, tp_size, heads)]
            torch.testing.assert_close(r["grads"][n], want, **TOL, msg=f"grad {n} rank {rank}")
    for (n, cp_rank), grad in summed.items():
        rows = ranks[cp_rank * tp_size]["rows"]
        torch.testing.assert_close(grad, ref["grads"][n][rows], **TOL,
                                   msg=f"grad {n} summed over TP, cp rank {cp_rank}")


CASES = [
    dict(layout=layout, exchange=exchange, mode="sparse", seed=10 + i)
    for i, (layout, exchange) in enumerate(
        (lay, ex) for lay in ("thd", "sbhd") for ex in ("allgather", "selective"))
] + [
    dict(layout="thd", exchange=exchange, mode="dense", seed=20)
    for exchange in ("allgather", "selective")
] + [
    dict(layout="thd", exchange=exchange, mode="sparse", seed=30, coherent=True)
    for exchange in ("allgather", "selective")
] + [
    dict(layout="thd", exchange="selective", mode="sparse", seed=40, padded=True),
    dict(layout="thd", exchange="allgather", mode="dense", seed=41, padded=True),
]


def _check_all(cases, ranks_by_case, tp_size, cp_size, heads):
    for case, ranks in zip(cases, ranks_by_case):
        _compare(case, ranks, tp_size, heads)
    by_exchange = {c["exchange"]: [cp_bytes_moved(r["stats"]) for r in ranks]
                   for c, ranks in zip(cases, ranks_by_case) if c.get("coherent")}
    print(f"\nCP={cp_size} TP={tp_size} coherent selection, bytes received per rank "
          f"(fwd+bwd, one layer): allgather={by_exchange['allgather']} "
          f"selective={by_exchange['selective']}")
    for sel, ag in zip(by_exchange["selective"], by_exchange["allgather"]):
        assert sel < ag


@pytest.mark.slow
@pytest.mark.parametrize("world_size,tp_size,backend,heads", [
    (2, 1, "reference", HEADS), (2, 1, "torch", HEADS), (4, 1, "torch", HEADS),
    (4, 2, "torch", HEADS), (4, 2, "torch", SHARED_HEADS)],
    ids=["cp2-reference", "cp2-torch", "cp4-torch", "tp2xcp2-torch", "tp2xcp2-shared-torch"])
def test_context_parallel_matches_single_process(world_size, tp_size, backend, heads):
    skip_without_gpus(world_size)
    cases = CASES
    results = run_distributed(_worker, world_size, args=(cases, tp_size, backend, heads))
    for rank in range(world_size):
        assert all(results[rank][0].values()), f"bad inputs not rejected: {results[rank][0]}"
    ranks_by_case = [[results[rank][i + 1] for rank in range(world_size)]
                     for i in range(len(cases))]
    _check_all(cases, ranks_by_case, tp_size, world_size // tp_size, heads)


def _call_order_worker(rank, world_size):
    """Run one allgather layer with and without overlap, recording (through mocks of the CP
    collectives and of the backend's cores) the order of launches, waits, selection and
    attention."""
    from unittest import mock

    from msa_megatron.parallel import context

    backend = get_backend("torch")
    device = torch.device("cuda", rank) if selected_device() == "cuda" else torch.device("cpu")
    case = dict(layout="thd", seed=50, mode="sparse")
    cu = _case_cu(case).to(device)
    x, w_out = _global_inputs(case, HEADS)
    x, w_out = {n: t.to(device) for n, t in x.items()}, w_out.to(device)
    group = dist.new_group(list(range(world_size)))
    runs = {}
    for overlap in (True, False):
        events = []

        def spy(label, function):
            def call(*args, **kwargs):
                events.append(label)
                return function(*args, **kwargs)
            return call

        def collective(kind, function):
            def start(out, inp, grp):
                # K/V rows have D = 16 features, index keys Di = 8.
                label = f"{'kv' if inp.shape[-1] == HEADS['d'] else 'index_k'}_{kind}"
                events.append(f"{label}_start")
                work = function(out, inp, grp)
                return mock.Mock(wait=spy(f"{label}_wait", work.wait))
            return start

        local = {n: split_for_cp_rank(t, cu, world_size, rank).contiguous().requires_grad_(True)
                 for n, t in x.items()}
        with mock.patch.object(context, "start_all_gather_flat",
                               collective("gather", context.start_all_gather_flat)), \
                mock.patch.object(context, "start_reduce_scatter_flat",
                                  collective("scatter", context.start_reduce_scatter_flat)), \
                mock.patch.object(backend, "select", spy("select", backend.select)), \
                mock.patch.object(backend, "attention", spy("attention", backend.attention)):
            res = msa_layer(*(local[n] for n in NAMES), cu_seqlens=cu,
                            groups=ParallelGroups(cp=group),
                            options=_options(backend="torch", overlap_kv_exchange=overlap),
                            kl_scale=1.0 / (int(cu[-1]) * HEADS["hi"]))
            events.append("backward")
            w_local = split_for_cp_rank(w_out, cu, world_size, rank)
            ((res.out * w_local).sum() + KL_WEIGHT * res.kl).backward()
        runs[overlap] = {"events": events, "out": res.out.detach(), "kl": res.kl.detach(),
                         "grads": {n: t.grad for n, t in local.items()}}
    return runs


def _kv_overlaps_selection(events):
    """Both K/V all-gathers start before the selection; their waits come after it, before the
    attention."""
    select, attention = events.index("select"), events.index("attention")
    starts = [i for i, e in enumerate(events) if e == "kv_gather_start"]
    waits = [i for i, e in enumerate(events) if e == "kv_gather_wait"]
    return (len(starts) == len(waits) == 2 and max(starts) < select
            and select < min(waits) and max(waits) < attention)


@pytest.mark.slow
def test_kv_allgather_starts_before_selection_and_is_waited_before_attention():
    skip_without_gpus(2)
    for runs in run_distributed(_call_order_worker, 2):
        on, off = runs[True], runs[False]
        assert _kv_overlaps_selection(on["events"]), on["events"]
        assert not _kv_overlaps_selection(off["events"]), off["events"]  # the check can fail
        # the index keys are gathered (and waited on) before the selection reads them
        events = on["events"]
        assert events.index("index_k_gather_wait") < events.index("select")
        # backward: dK and dV reduce-scatters launched together, then waited
        back = events[events.index("backward"):]
        kv = [e for e in back if e.startswith("kv_scatter")]
        assert kv == ["kv_scatter_start"] * 2 + ["kv_scatter_wait"] * 2, back
        # overlap changes the order only: bitwise the same results
        assert torch.equal(on["out"], off["out"]) and torch.equal(on["kl"], off["kl"])
        for name in NAMES:
            assert torch.equal(on["grads"][name], off["grads"][name]), name


def test_resolve_cp_kv_exchange():
    """allgather unless chosen (the faster mode measured, docs/DESIGN.md); selective stays."""
    assert resolve_cp_kv_exchange(None) == "allgather"
    assert resolve_cp_kv_exchange("selective") == "selective"
    assert resolve_cp_kv_exchange("allgather") == "allgather"
    assert MSAOptions().kv_exchange == "allgather"
    with pytest.raises(ValueError, match="cp_kv_exchange"):
        resolve_cp_kv_exchange("ring")
    assert MSAOptions().overlap_kv_exchange is True
    with pytest.raises(TypeError, match="overlap_kv_exchange"):
        MSAOptions(overlap_kv_exchange=1)


def test_layout_rejects_lengths_not_divisible_by_2cp():
    with pytest.raises(ValueError, match="multiple of 2\\*CP=4"):
        build_cp_layout(_cu([8, 6]), 2, 0, 16, torch.device("cpu"))


def test_layout_rank_rows_partition_the_batch():
    cu = _cu(THD_LENGTHS)
    for cp in (2, 4):
        rows = torch.cat([build_cp_layout(cu, cp, r, 16, torch.device("cpu")).local_rows
                          for r in range(cp)])
        assert torch.equal(torch.sort(rows).values, torch.arange(int(cu[-1])))


def test_real_token_rows():
    """Padding trails each sequence; zero-length sequences sharing a start row are skipped."""
    padded, real = _cu([8, 0, 4, 8]), _cu([5, 0, 4, 1])
    q_pos, q_kbase = query_layout(padded, 20, torch.device("cpu"))
    rows = real_token_rows(padded, real, q_pos, q_kbase)
    assert rows.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    assert real_token_rows(padded, padded, q_pos, q_kbase) is None
    assert real_token_rows(padded, None, q_pos, q_kbase) is None
    with pytest.raises(ValueError, match="no larger"):
        real_token_rows(padded, _cu([9, 0, 4, 7]), q_pos, q_kbase)
    with pytest.raises(TypeError, match="int32"):
        real_token_rows(padded, real.to(torch.int64), q_pos, q_kbase)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_kl_of_no_rows_is_zero(backend):
    """A rank or token slice holding only padding adds an exact zero KL with zero gradients."""
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 1, 8, generator=gen)
    q_idx = torch.randn(6, 1, 8, generator=gen, requires_grad=True)
    k_idx = torch.randn(6, 1, 8, generator=gen, requires_grad=True)
    q_pos, q_kbase = query_layout(_cu([6]), 6, torch.device("cpu"))
    kl = kl_of_rows(get_backend(backend), torch.zeros(0, dtype=torch.int64), q,
                    k, torch.zeros(6, 2), q_idx, k_idx, None, q_pos, q_kbase, block_size=16,
                    softmax_scale=None, index_scale=None, kl_scale=1.0)
    kl.backward()
    assert kl.dtype == torch.float32 and kl.item() == 0.0
    assert torch.equal(q_idx.grad, torch.zeros_like(q_idx))
    assert torch.equal(k_idx.grad, torch.zeros_like(k_idx))
