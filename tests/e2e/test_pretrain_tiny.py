"""End to end: examples/pretrain_tiny.py trains for a few steps under torchrun (CPU, gloo).

The example runs twice at its ``--quick`` size, once with TP=2 and once with CP=2 (two processes
each). Every run trains an MSA model (dense warmup, then sparse) and a dense baseline from the
same seed; the checks read the ``metrics.json`` it writes.
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
LAYOUTS = {"tp2": ("--tp", "2", "--cp", "1"), "cp2": ("--tp", "1", "--cp", "2")}
NPROC = 2
RUN_TIMEOUT_S = 600
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_LOSS_DROP = 0.5  # nats/byte over the quick run; the first step's loss is ~ln(256) = 5.5
LAYOUT_LOSS_ATOL = 5e-3  # TP and CP runs differ only by floating-point reordering (and near-ties)

pytestmark = pytest.mark.slow


def _run_example(layout: str, out_dir: Path) -> Dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={NPROC}", str(EXAMPLE), "--quick", "--device", "cpu",
           *LAYOUTS[layout], "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n"
                    f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    record = json.loads((out_dir / "metrics.json").read_text())
    record["stdout"] = proc.stdout
    record["out_dir"] = out_dir
    return record


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Dict[str, Dict]:
    return {layout: _run_example(layout, tmp_path_factory.mktemp(layout)) for layout in LAYOUTS}


def _runs(record: Dict) -> Dict[str, Dict]:
    return {run["name"]: run for run in record["runs"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_losses_finite_and_decreasing(results, layout):
    for name, run in _runs(results[layout]).items():
        assert len(run["loss"]) == int(results[layout]["args"]["steps"]), name
        assert all(math.isfinite(v) for v in run["loss"]), (name, run["loss"])
        assert run["loss"][-1] < run["loss"][0] - MIN_LOSS_DROP, (name, run["loss"])
        assert math.isfinite(run["held_out_loss"]), name
        assert run["held_out_loss"] < run["loss"][0] - MIN_LOSS_DROP, (name, run["held_out_loss"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_warmup_is_dense_then_sparse(results, layout):
    runs = _runs(results[layout])
    msa, dense = runs["msa"], runs["dense"]
    warmup = int(results[layout]["args"]["warmup_steps"])
    assert msa["mode"] == ["dense"] * warmup + ["sparse"] * (len(msa["mode"]) - warmup)
    assert set(dense["mode"]) == {"dense"}
    # Same seed, data and dense attention: the two runs are the same computation until the switch.
    for step in range(warmup):
        assert msa["loss"][step] == pytest.approx(dense["loss"][step], rel=1e-6, abs=1e-6)
    assert all(f < 1.0 for f in msa["attended_fraction"][warmup:]), msa["attended_fraction"]
    assert all(f == 1.0 for f in dense["attended_fraction"])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kl_logged_per_layer(results, layout):
    layers = int(results[layout]["args"]["layers"])
    for name, run in _runs(results[layout]).items():
        for per_layer in run["kl_per_layer"]:
            assert len(per_layer) == layers, name
            assert all(math.isfinite(v) and v > 0 for v in per_layer), (name, per_layer)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_plot_written(results, layout):
    png = results[layout]["out_dir"] / "pretrain_tiny.png"
    assert png.read_bytes()[:len(PNG_SIGNATURE)] == PNG_SIGNATURE


def test_tp_and_cp_layouts_agree(results):
    tp, cp = _runs(results["tp2"]), _runs(results["cp2"])
    for name in ("msa", "dense"):
        assert tp[name]["loss"] == pytest.approx(cp[name]["loss"], abs=LAYOUT_LOSS_ATOL), name
        assert tp[name]["held_out_loss"] == pytest.approx(cp[name]["held_out_loss"],
                                                          abs=LAYOUT_LOSS_ATOL), name
