"""A megatron-core GPTModel with MSA layers trains under context parallelism exactly like CP=1.

CP=2, CP=4, TP=2 x CP=2 and TP=2 x CP=2 with one KV group (the two TP ranks share the index
head) on gloo, several SGD steps alternating SBHD / padded THD batches and the two K/V exchange
modes: LM losses, KL metrics and every parameter gradient equal the single-rank run (MSA_SPEC
section 6). Batches are split with megatron-core's load-balanced layout; gradients are summed
over the CP group, as megatron's DP x CP gradient all-reduce does. The CP bytes reported by
``get_msa_metrics`` equal the mean of each rank's own (read with a one-rank group), and the
closed forms of ``allgather``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from msa_megatron.parallel.cp_layout import split_for_cp_rank
from tests.dist_utils import run_distributed, selected_device
from tests.support.gpt_harness import (BATCH, LR, SEQ, VOCAB, Setup, full_grads,
                                       recompute_config, sum_qk_norm_grads)
from tests.support.devices import skip_without_gpus
from tests.support.spies import count_selections

pytestmark = pytest.mark.slow

# THD documents, padded to multiples of 2*CP = 8 as megatron pads THD sequences for CP: one of
# length 0, one shorter than a block, documents crossing chunk boundaries; sums to BATCH * SEQ.
THD_LENGTHS = [40, 8, 72, 0, 72]
# Their real lengths (cu_seqlens_q; the padded ones are cu_seqlens_q_padded).
REAL_LENGTHS = [37, 5, 72, 0, 66]
# (format, exchange) of each SGD step: both formats in both modes.
STEPS = [("sbhd", "allgather"), ("thd", "selective"), ("sbhd", "selective"), ("thd", "allgather")]
PROBE_STEP = 1  # the selection probe measures recall in this step (THD, padded documents)
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
KL_TOL = dict(rtol=1e-4, atol=1e-7)
GRAD_TOL = dict(rtol=1e-4, atol=2e-6)


def _build(setup: Setup, tp: int, cp: int):
    """GPTModel with the MSA spec and CP-aware config; identical initial weights for any TP/CP."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from msa_megatron import MSAConfig
    from msa_megatron.megatron import get_gpt_layer_msa_spec

    config = TransformerConfig(
        num_layers=setup.layers, hidden_size=setup.hidden, num_attention_heads=setup.heads,
        num_query_groups=setup.groups, kv_channels=setup.kv_channels,
        ffn_hidden_size=2 * setup.hidden, tensor_model_parallel_size=tp,
        context_parallel_size=cp, cp_comm_type="p2p", use_cpu_initialization=True,
        params_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm",
        qk_layernorm=setup.qk_layernorm, **recompute_config(setup.recompute),
    )
    model_parallel_cuda_manual_seed(setup.seed)
    torch.manual_seed(setup.seed)
    msa = MSAConfig(block_size=setup.block_size, top_k=setup.top_k,
                    index_head_dim=setup.index_head_dim, index_heads=setup.index_heads,
                    backend=setup.backend, kl_coeff=setup.kl_coeff, mode=setup.mode)
    spec = get_gpt_layer_msa_spec(msa, qk_layernorm=setup.qk_layernorm, normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                     max_sequence_length=SEQ * BATCH, position_embedding_type="rope")
    return model.to(selected_device()), msa


def _sbhd_on_this_cp_rank(tokens: torch.Tensor, cp_group):
    """This CP rank's share of an SBHD batch ``[BATCH, SEQ]`` (tokens, positions, no packing)."""
    from msa_megatron.megatron.compat import get_batch_on_this_cp_rank

    positions = torch.arange(SEQ).expand(BATCH, SEQ).contiguous()
    local = get_batch_on_this_cp_rank({"tokens": tokens, "position_ids": positions},
                                      cp_group=cp_group)
    device = selected_device()
    return local["tokens"].to(device), local["position_ids"].to(device), None


def _cp_batch(step: int, fmt: str, cp_group):
    """This CP rank's share of the step's global batch (tokens = labels, positions, packing)."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from msa_megatron.megatron.compat import get_batch_on_this_cp_rank

    device = selected_device()
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    cp_size, cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
    if fmt == "sbhd":
        return _sbhd_on_this_cp_rank(tokens, cp_group)
    cu = torch.tensor([0] + THD_LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    real = torch.tensor([0] + REAL_LENGTHS, dtype=torch.int32).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n) for n in THD_LENGTHS])
    tokens, positions = (split_for_cp_rank(t.reshape(-1), cu, cp_size, cp_rank).reshape(1, -1)
                         for t in (tokens, positions))
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=real.to(device),
                             cu_seqlens_kv=real.to(device), cu_seqlens_q_padded=cu.to(device),
                             cu_seqlens_kv_padded=cu.to(device), max_seqlen_q=max(THD_LENGTHS),
                             max_seqlen_kv=max(THD_LENGTHS))
    return tokens.to(device), positions.to(device), packed


def _pos_emb_on_this_cp_rank_cpu(pos_emb, seq_dim, cp_group):
    """megatron-core's ``get_pos_emb_on_this_cp_rank`` without its pinned-memory CUDA copy."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    shape = pos_emb.shape
    pos_emb = pos_emb.view(*shape[:seq_dim], 2 * cp_size, -1, *shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*shape[:seq_dim], -1, *shape[seq_dim + 1:])


def _install_cp_rope_shim() -> None:
    """Test-only: megatron-core's SBHD RoPE under CP copies an index through pinned memory to
    CUDA; on CPU use the same slicing on the host."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    if selected_device() == "cpu":
        rope_utils.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank_cpu
        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank_cpu


def _cp_worker(rank: int, world_size: int, tp: int, cp: int, recompute=None,
               groups: int = Setup().groups) -> dict:
    from megatron.core import parallel_state

    from msa_megatron.megatron import MSACoreAttention, arm_selection_probe, get_msa_metrics

    _install_cp_rope_shim()
    setup = Setup(recompute=recompute, groups=groups)
    model, msa = _build(setup, tp, cp)
    cp_group = parallel_state.get_context_parallel_group()
    own_group = [dist.new_group([r]) for r in range(world_size)][rank]  # unreduced metrics
    counts = {"calls": 0}
    get_msa_metrics(reset=True)
    record = {"loss": [], "kl": [], "recall": [], "grads": [], "bytes": [], "cp_bytes": [],
              "selection_calls": [], "core_calls": []}
    cores = [m for m in model.modules() if isinstance(m, MSACoreAttention)]
    core_calls = [0]
    for module in model.modules():
        if isinstance(module, MSACoreAttention):
            module.register_forward_hook(lambda *_: core_calls.__setitem__(0, core_calls[0] + 1))
    n_global = BATCH * SEQ
    for step, (fmt, exchange) in enumerate(STEPS):
        # Read by every MSA layer at its next forward; None is the default exchange
        # (allgather, whatever megatron's cp_comm_type "p2p"). MSAConfig is immutable: each
        # core gets a changed copy.
        msa = dataclasses.replace(msa, cp_kv_exchange=None if exchange == "allgather"
                                  else exchange)
        for core in cores:
            core.msa_config = msa
        tokens, positions, packed = _cp_batch(step, fmt, cp_group)
        if step == PROBE_STEP:  # every local row: the mean over CP ranks is the global mean
            arm_selection_probe(model, rows=torch.arange(tokens.numel()))
        model.zero_grad(set_to_none=True)
        core_calls[0] = 0
        with count_selections(setup.backend) as counts:
            losses = model(tokens, positions, None, labels=tokens, packed_seq_params=packed)
            (losses.sum() / n_global).backward()
        sum_qk_norm_grads(model)
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=cp_group)
        loss = losses.detach().sum()
        dist.all_reduce(loss, group=cp_group)
        record["loss"].append(loss / n_global)
        # (forward, backward) bytes this rank received per layer, read before the reset
        own = get_msa_metrics(reset=False, group=own_group)
        record["bytes"].append([
            (own.get(f"msa/cp_bytes_fwd/layer_{layer:02d}", 0.0),
             own.get(f"msa/cp_bytes_bwd/layer_{layer:02d}", 0.0))
            for layer in range(1, len(cores) + 1)])
        metrics = get_msa_metrics(reset=True)
        record["kl"].append({k: v for k, v in metrics.items() if k.startswith("msa/kl")})
        record["recall"].append({k: v for k, v in metrics.items()
                                 if k.startswith("msa/recall")})
        record["cp_bytes"].append({k: v for k, v in metrics.items()
                                   if k.startswith("msa/cp_bytes")})
        record["grads"].append(full_grads(model))
        record["selection_calls"].append(counts["calls"])
        record["core_calls"].append(core_calls[0])
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.add_(param.grad, alpha=-LR)
    return record


@pytest.fixture(scope="module")
def references():
    """Single-rank records, per number of query groups (computed on first use)."""
    cache = {}

    def get(groups: int) -> dict:
        if groups not in cache:
            cache[groups] = run_distributed(_cp_worker, 1, args=(1, 1, None, groups), tp=1,
                                            cp=1)[0]
        return cache[groups]

    return get


def _check_cp_bytes(records: list, tp: int, cp: int, recompute, groups: int) -> None:
    """``get_msa_metrics``' CP bytes: the mean over ranks of the per-rank counters; allgather
    steps move exactly the closed-form bytes (context.py docstring), selective steps no more
    K/V than allgather."""
    setup = Setup()
    element = torch.empty((), dtype=torch.float32).element_size()
    peers, t_local = cp - 1, BATCH * SEQ // cp
    kv_heads = max(groups // tp, 1)
    index_k = peers * t_local * 1 * setup.index_head_dim * element  # Hik = 1, per direction
    kv_allgather = peers * t_local * 2 * kv_heads * setup.kv_channels * element
    passes = 2 if recompute else 1  # the recomputation exchanges again in forward
    for step, (fmt, exchange) in enumerate(STEPS):
        metrics = records[0]["cp_bytes"][step]
        assert all(r["cp_bytes"][step] == metrics for r in records)  # reduced over all ranks
        total = 0.0
        for layer in range(setup.layers):
            suffix = f"layer_{layer + 1:02d}"
            fwd, bwd = metrics[f"msa/cp_bytes_fwd/{suffix}"], metrics[f"msa/cp_bytes_bwd/{suffix}"]
            per_rank = [r["bytes"][step][layer] for r in records]
            assert fwd == pytest.approx(sum(f for f, _ in per_rank) / len(records))
            assert bwd == pytest.approx(sum(b for _, b in per_rank) / len(records))
            assert metrics[f"msa/cp_bytes/{suffix}"] == pytest.approx(fwd + bwd)
            if exchange == "allgather":
                assert fwd == passes * (index_k + kv_allgather), f"step {step} {suffix}"
                assert bwd == index_k + kv_allgather, f"step {step} {suffix}"
            else:
                assert passes * index_k < fwd and index_k < bwd <= index_k + kv_allgather
            total += fwd + bwd
        assert metrics["msa/cp_bytes"] == pytest.approx(total)


@pytest.mark.parametrize("tp,cp,recompute,groups", [
    (1, 2, None, 2), (1, 4, None, 2), (2, 2, None, 2), (2, 2, None, 1), (1, 2, "selective", 2)],
    ids=["cp2", "cp4", "tp2xcp2", "tp2xcp2-shared-index-head", "cp2-recompute-core-attn"])
def test_gpt_context_parallel_matches_single_rank(references, tp, cp, recompute, groups):
    """Under selective core_attn recomputation the kept selection is reused: one selection per
    layer and step, never a second one in the recomputation. With one KV group at TP=2 both TP
    ranks hold the one index head (TP > Hkv) and split its selection."""
    skip_without_gpus(tp * cp)
    reference = references(groups)
    records = run_distributed(_cp_worker, tp * cp, args=(tp, cp, recompute, groups), tp=tp,
                              cp=cp)
    for rank, record in enumerate(records):
        for step, (fmt, exchange) in enumerate(STEPS):
            where = f"rank {rank} step {step} ({fmt}, {exchange})"
            torch.testing.assert_close(record["loss"][step], reference["loss"][step], **LOSS_TOL,
                                       msg=f"loss {where}")
            kl, kl_ref = record["kl"][step], reference["kl"][step]
            assert kl.keys() == kl_ref.keys() and kl_ref["msa/kl"] > 0
            for key in kl_ref:
                torch.testing.assert_close(torch.tensor(kl[key]), torch.tensor(kl_ref[key]),
                                           **KL_TOL, msg=f"{key} {where}")
            grads, grads_ref = record["grads"][step], reference["grads"][step]
            assert grads.keys() == grads_ref.keys()
            for name, grad_ref in grads_ref.items():
                torch.testing.assert_close(grads[name], grad_ref, **GRAD_TOL,
                                           msg=f"grad of {name} {where}")
                if "_idx" in name:
                    assert grad_ref.abs().max() > 0, f"{name} got no KL gradient"
        # Selection recall under CP: each rank's rows against the gathered prefixes (with a
        # shared index head, TP > Hkv, the sampled rows' q gathered over the sharing ranks).
        recall, recall_ref = record["recall"][PROBE_STEP], reference["recall"][PROBE_STEP]
        assert recall.keys() == recall_ref.keys() and "msa/recall" in recall_ref
        for key in recall_ref:
            assert recall[key] == pytest.approx(recall_ref[key], rel=1e-4), key
        assert all(not r for i, r in enumerate(record["recall"]) if i != PROBE_STEP)
        # one selection per layer and step (plus the probe's own, for its rows)
        assert record["selection_calls"] == [Setup().layers * (2 if i == PROBE_STEP else 1)
                                             for i in range(len(STEPS))]
        runs_per_step = 2 if recompute else 1  # the core attention ran again in backward
        assert record["core_calls"] == [runs_per_step * Setup().layers] * len(STEPS)
    assert all(not metrics for metrics in reference["cp_bytes"])  # no CP, no CP bytes
    _check_cp_bytes(records, tp, cp, recompute, groups)
    for step, (fmt, exchange) in enumerate(STEPS):
        print(f"TP={tp} CP={cp} step {step} {fmt} {exchange}: CP bytes received per rank "
              f"(fwd, bwd) per layer: {records[0]['cp_bytes'][step]}")


def _sbhd_differing_on_rank_1(micro: int, cp_group):
    """Micro-batch 1 is micro-batch 0 with only the tokens CP rank 1 holds (chunks 1 and 2 of
    4 in megatron's load-balanced split) changed: rank 0's own index q/k are identical in the
    first layer, but its selection reads rank 1's index keys."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100))
    if micro == 1:
        tokens[:, SEQ // 4: 3 * SEQ // 4] = torch.randint(
            0, VOCAB, (BATCH, SEQ // 2), generator=torch.Generator().manual_seed(7))
    return _sbhd_on_this_cp_rank(tokens, cp_group)


def _reversed_backwards_worker(rank: int, world_size: int, cp: int, recompute, batches: str,
                               order: str) -> dict:
    """Two micro-batches forward, then their backwards reversed or summed. ``batches``:
    ``"sbhd_thd"`` (an SBHD and a padded THD one) or ``"rank_1_differs"``."""
    from megatron.core import parallel_state

    _install_cp_rope_shim()
    setup = Setup(recompute=recompute)
    model, _ = _build(setup, 1, cp)
    cp_group = parallel_state.get_context_parallel_group()
    with count_selections(setup.backend) as counts:
        losses = []
        for micro, fmt in enumerate(("sbhd", "thd")):
            tokens, positions, packed = (_cp_batch(micro, fmt, cp_group) if batches == "sbhd_thd"
                                         else _sbhd_differing_on_rank_1(micro, cp_group))
            losses.append(model(tokens, positions, None, labels=tokens,
                                packed_seq_params=packed).sum() / (BATCH * SEQ))
        forward_calls = counts["calls"]
        if order == "sum":
            (losses[0] + losses[1]).backward()
        else:
            for loss in reversed(losses):
                loss.backward()
    sum_qk_norm_grads(model)
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=cp_group)
    return {"grads": full_grads(model), "forward_calls": forward_calls,
            "calls": counts["calls"]}


@pytest.mark.parametrize("batches,order,recompute", [
    ("sbhd_thd", "reverse", "selective"), ("rank_1_differs", "sum", "selective"),
    ("rank_1_differs", "sum", "full")])
def test_gpt_context_parallel_recompute_backwards_out_of_order(batches, order, recompute):
    """CP=2 with selective (core_attn) or full recomputation, backwards out of forward order: each
    recomputation finds its own micro-batch's selection (no new selection) and the gradients
    equal those without recomputation. With ``rank_1_differs`` rank 0's local index q/k are
    the same in both micro-batches; only the CP-gathered part of the fingerprint tells them
    apart (a local-only fingerprint took the wrong one: gradients off by 18%)."""
    skip_without_gpus(2)
    args = (2, None, batches, order)
    ref = run_distributed(_reversed_backwards_worker, 2, args=args, tp=1, cp=2)
    rec = run_distributed(_reversed_backwards_worker, 2, args=(2, recompute, batches, order),
                          tp=1, cp=2)
    for rank, (r, g) in enumerate(zip(rec, ref)):
        assert r["forward_calls"] == 2 * Setup().layers and r["calls"] == r["forward_calls"]
        for name, grad in g["grads"].items():
            torch.testing.assert_close(r["grads"][name], grad, **GRAD_TOL,
                                       msg=f"rank {rank}: grad of {name}")
