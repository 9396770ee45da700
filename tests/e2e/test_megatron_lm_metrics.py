"""The Megatron-LM entry point's MSA metrics log (``msa_gpt_setup.MSAMetricsLog``): gathered
once per log interval, never per micro-batch; recall reported only where measured (the last
measurement kept, never averaged with unmeasured iterations); the sparse FLOPs correction."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from msa_megatron.megatron.flops import megatron_dense_core_flops, msa_layer_flops

KIT = Path(__file__).resolve().parents[2] / "examples" / "megatron_lm"
sys.path.insert(0, str(KIT))
import msa_gpt_setup as setup  # noqa: E402


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(log: "setup.MSAMetricsLog", iterations: int, micro_batches: int, measured: dict,
         clock: FakeClock):
    """A training loop's calls: forward per micro-batch, one after_step per iteration."""
    gathers, armed, lines = [], [], {}
    chunk = object()
    for iteration in range(iterations):
        probed = False
        for _ in range(micro_batches):
            if log.before_forward(iteration, chunk, True, lambda c, rows: armed.append(
                    (iteration, rows))):
                probed = True
        clock.now += 2.0

        def gather(iteration=iteration, probed=probed):
            gathers.append(iteration)
            out = {"msa/kl": 0.5, "msa/kl/layer_01": 0.4, "msa/kl/layer_02": 0.6}
            if probed:
                out.update({"msa/recall": measured[iteration], "msa/recall/layer_01": 0.1,
                            "msa/recall_best": 0.95})
            return out

        values = log.after_step(iteration, gather, "sparse", 0.25)
        if values is not None:
            lines[iteration] = (values, log.line(iteration, values))
    return gathers, armed, lines


def test_gathers_only_on_log_iterations_and_keeps_recall():
    clock = FakeClock()
    log = setup.MSAMetricsLog(log_interval=2, recall_interval=4, recall_rows=16,
                              flops_per_iteration=lambda mode: 4e12, world_size=2, clock=clock)
    gathers, armed, lines = _run(log, 8, 3, {3: 0.9, 7: 0.8}, clock)
    assert gathers == [1, 3, 5, 7]  # once per log interval, not per micro-batch or iteration
    assert armed == [(3, 16), (7, 16)]  # once per recall iteration, at its first micro-batch
    assert "msa recall" not in lines[1][0]  # nothing measured yet: nothing reported
    assert lines[3][0]["msa recall"] == 0.9
    assert lines[5][0]["msa recall"] == 0.9  # the last measurement, not averaged with zeros
    assert "(iteration 4)" in lines[5][1]
    # the ceiling is kept and labelled like the recall
    assert lines[5][0]["msa recall_best"] == 0.95
    assert lines[5][1].count("(iteration 4)") == 2
    assert lines[7][0]["msa recall"] == 0.8 and "(iteration" not in lines[7][1]
    values, text = lines[5]
    assert values["msa kl layer_02"] == 0.6 and values["msa blocks"] == 0.25
    # 2 iterations of 4e12 FLOPs in 4 s on 2 ranks
    assert values["throughput per GPU, MSA counted sparse (TFLOP/s/GPU)"] == pytest.approx(1.0)
    assert text.startswith("msa-megatron | iteration        6 |")
    assert "msa kl: 5.000000E-01" in text


def test_default_recall_on_log_iterations_and_off():
    clock = FakeClock()
    log = setup.MSAMetricsLog(log_interval=3, clock=clock)
    gathers, armed, lines = _run(log, 6, 2, {2: 0.7, 5: 0.6}, clock)
    assert gathers == [2, 5] and [a[0] for a in armed] == [2, 5]
    assert lines[5][0]["msa recall"] == 0.6
    off = setup.MSAMetricsLog(log_interval=3, recall_interval=0, clock=clock)
    assert _run(off, 6, 2, {}, clock)[1] == []
    with pytest.raises(ValueError, match="log_interval"):
        setup.MSAMetricsLog(log_interval=0)
    with pytest.raises(ValueError, match="recall_interval"):
        setup.MSAMetricsLog(log_interval=1, recall_interval=-1)


def test_flags_and_flops_delta():
    parser = setup.add_msa_args(argparse.ArgumentParser())
    args = parser.parse_args(["--msa-block-size", "64", "--msa-top-k", "4",
                              "--probe-interval", "10"])
    assert args.probe_interval == 10 and args.probe_rows == 256
    args.num_layers, args.seq_length, args.hidden_size = 2, 8192, 256
    args.num_attention_heads, args.kv_channels = 8, 32
    args.group_query_attention, args.num_query_groups = True, 2
    msa = msa_layer_flops(8192, hidden_size=256, num_heads=8, head_dim=32, index_heads=2,
                          index_key_heads=1, index_head_dim=128, block_size=64, top_k=4)
    dense = megatron_dense_core_flops(8192, num_heads=8, head_dim=32)
    assert setup.msa_flops_delta(args, 3, "sparse") == pytest.approx(
        2 * 3 * (msa["total"] - dense))
    assert setup.msa_flops_delta(args, 3, "sparse") < 0 < setup.msa_flops_delta(args, 3, "dense")
