"""examples/pretrain_tiny.py measures selection recall under context parallelism (CPU, gloo).

The retrieval task's answer rows are rows of the whole window; under CP=2 each rank probes the
ones it holds. The same tiny run at CP=1 and CP=2 (same seed and data, so the same weights up to
floating-point reordering) must report the same recall on the answer rows and the same share of
questions whose record block is selected, at every probed training step and held out. Uniform
rows are sampled per rank, so their recall is only checked to be a share.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pretrain_tiny.py"
TINY_RETRIEVAL = ["--task", "retrieval", "--runs", "msa", "--steps", "2", "--warmup-steps", "1",
                  "--seq-len", "512", "--task-len", "256", "--layers", "2", "--hidden", "64",
                  "--ffn-hidden", "128", "--heads", "2", "--query-groups", "2",
                  "--block-size", "16", "--top-k", "3", "--index-head-dim", "32", "--pairs", "8",
                  "--queries", "4", "--min-distance", "64", "--eval-windows", "1",
                  "--eval-interval", "2", "--log-interval", "1", "--probe-rows", "16",
                  "--task-len-min", "64", "--task-curriculum", "2"]
RECALL_ATOL = 1e-5  # fp32, CP=2 reorders the attention sums

pytestmark = pytest.mark.slow


def _run(cp: int, out_dir: Path, tp: int = 1) -> Dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={cp * tp}", str(EXAMPLE), "--device", "cpu", "--cp", str(cp),
           "--tp", str(tp), *TINY_RETRIEVAL, "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out_dir / "metrics.json").read_text())["runs"][0]


def test_answer_row_recall_under_cp_matches_one_rank(tmp_path):
    one, two = _run(1, tmp_path / "cp1"), _run(2, tmp_path / "cp2")
    assert two["probe_steps"] == one["probe_steps"] == [1, 2]
    for key in ("recall_answer_per_layer", "key_hit_per_layer", "key_hit_per_head"):
        for got, want in zip(two[key], one[key]):
            assert _flat(got) == pytest.approx(_flat(want), abs=RECALL_ATOL), key
    for key in ("recall_answer", "key_hit", "key_hit_per_head", "key_hit_any"):
        assert _flat(two["retrieval"][key]) == pytest.approx(_flat(one["retrieval"][key]),
                                                             abs=RECALL_ATOL)
    assert two["key_hit_any"] == pytest.approx(one["key_hit_any"], abs=RECALL_ATOL)
    for run in (one, two):  # a question counts when any (layer, head) chose its record block
        for any_hit, per_layer in zip(run["key_hit_any"], run["key_hit_per_layer"]):
            assert max(per_layer) - 1e-9 <= any_hit <= 1.0
    _check_per_head(one)
    for per_layer in two["recall_per_layer"]:
        assert all(0.0 < v <= 1.0 + 1e-6 and math.isfinite(v) for v in per_layer), per_layer
    assert 0.0 < two["recall_answer_per_layer"][0][0] < 1.0  # a measurement, not a default
    for run in (one, two):  # the recall's ceiling: measured beside it, never below it
        for recall, best in zip(run["recall_per_layer"], run["recall_best_per_layer"]):
            assert len(best) == len(recall) == 2
            assert all(r <= b + 1e-6 <= 1.0 + 2e-6 for r, b in zip(recall, best)), (recall, best)
        assert run["retrieval"]["recall"] <= run["retrieval"]["recall_best"] + 1e-6
    histogram = two["retrieval"]["distance_histogram"]
    assert set(histogram) == {"layer_01", "layer_02"}
    # the uniform rows of both CP ranks are counted: each of the 16 rows per rank selects its
    # own block in both index heads
    assert all(h["own"] == 2 * 16 * 2 for h in histogram.values()), histogram


def _flat(value) -> list:
    """Nested lists of numbers as one flat list (pytest.approx takes no nesting)."""
    return ([v for item in value for v in _flat(item)] if isinstance(value, list)
            else [value])


def _check_per_head(run: Dict) -> None:
    """"record block chosen" per layer and index head: 2 layers x 2 index heads, shares whose
    mean over the heads is the per-layer value (every head sees the same answer rows)."""
    for per_head, per_layer in zip(run["key_hit_per_head"] + [run["retrieval"]["key_hit_per_head"]],
                                   run["key_hit_per_layer"] + [run["retrieval"]["key_hit_per_layer"]]):
        assert [len(layer) for layer in per_head] == [2, 2]
        assert all(0.0 <= v <= 1.0 for layer in per_head for v in layer)
        assert [sum(layer) / 2 for layer in per_head] == pytest.approx(per_layer, abs=1e-12)


def test_record_block_chosen_per_index_head_under_tp_matches_one_rank(tmp_path):
    """Under TP 2 each rank holds one of the two index heads: the per-head values land at the
    heads' global numbers (head 2 is not left empty, nor written over head 1)."""
    one, two = _run(1, tmp_path / "tp1"), _run(1, tmp_path / "tp2", tp=2)
    _check_per_head(two)
    assert _flat(two["key_hit_per_head"]) == pytest.approx(_flat(one["key_hit_per_head"]),
                                                           abs=RECALL_ATOL)
    assert _flat(two["retrieval"]["key_hit_per_head"]) == pytest.approx(
        _flat(one["retrieval"]["key_hit_per_head"]), abs=RECALL_ATOL)
    heads = [v for step in one["key_hit_per_head"] for layer in step for v in layer]
    assert len(set(heads)) > 1  # not one value copied to every head
    # "by some layer and head": the union over both TP ranks' heads, as on one rank
    assert two["key_hit_any"] == pytest.approx(one["key_hit_any"], abs=RECALL_ATOL)
    assert two["retrieval"]["key_hit_any"] == pytest.approx(one["retrieval"]["key_hit_any"],
                                                            abs=RECALL_ATOL)
