"""benchmarks/bench_cp.py on CPU (gloo, 2 processes, tiny shapes, torch backend): the check
passes, rows come most important first with a line each, the JSON says what ran, and a spent
``--budget-s`` skips every row cleanly and says so (no timing assertions: only the structure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_cp.py"
TINY = ["--device", "cpu", "--heads", "small", "--block-size", "16", "--top-k", "4",
        "--seqlens", "256", "--dists", "iid", "coherent", "--check-tokens", "256", "--iters", "1"]

pytestmark = pytest.mark.slow


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the torch backend: fast, and no kernel to interpret
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(SCRIPT), str(out), *TINY, *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_rows_most_important_first_with_a_line_each(tmp_path):
    proc = _run(tmp_path / "cp.json")
    result = json.loads((tmp_path / "cp.json").read_text())
    check = result["check"]["2"]
    assert check["allgather"]["ok"] and check["selective"]["ok"]
    assert check["allgather"]["overlap_bitwise_equal"]
    order = [(r["index_inputs"], r["cp"], r["exchange"], r.get("overlap"))
             for r in result["results"]]
    per_dist = [(1, None, None), (2, "allgather", True), (2, "allgather", False),
                (2, "selective", None)]
    assert order == [("iid", *m) for m in per_dist] + [("coherent", *m) for m in per_dist]
    assert result["stopped"] is None and result["skipped"] == [] and result["in_progress"] is None
    assert [p["phase"].split(" (")[0] for p in result["phases"]] == [
        "process groups", "correctness check CP=2", "timing"]
    for row in result["results"]:
        assert row["iters_done"] == 1 and not row["cut_by_budget"]
        assert row["compiles"] == 0 and row["first_step_s"] >= 0 and row["row_s"] >= 0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert sum(" ms " in line or " ms (" in line for line in lines) == len(order)
    assert any("S=256 iid CP=2 selective:" in line for line in lines)


def test_spent_budget_skips_every_row_and_says_so(tmp_path):
    proc = _run(tmp_path / "cp.json", "--budget-s", "0.001", "--compute-only")
    result = json.loads((tmp_path / "cp.json").read_text())
    assert result["check"]["2"]["allgather"]["ok"]  # the check is not cut by the budget
    assert "results" not in result or result["results"] == []
    assert result["stopped"] == "budget spent"
    skipped = [s["what"] for s in result["skipped"]]
    assert skipped[0] == "S=256 iid CP=1" and len(skipped) == 10  # 8 rows + 2 compute only
    assert skipped[-1] == "S=256 coherent CP=2 compute only (no exchange)"
    assert "stopping: budget spent" in proc.stdout


def test_compile_watch_counts_triton_keys_under_the_interpreter(monkeypatch):
    """CompileWatch on CPU: the Triton JIT keys a GPU would compile, new ones only, for the
    whole run (a watch that ended early counted 0: its context must stay referenced)."""
    import gc
    import importlib.util

    from tests.support.jit_keys import interpreting

    if not interpreting():
        pytest.skip("the interpreter's count (on a GPU, Triton's JIT hooks count)")
    import msa_megatron

    spec = importlib.util.spec_from_file_location("bench_cp_under_test", SCRIPT)
    bench_cp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_cp)
    watch = bench_cp.CompileWatch()
    gc.collect()
    gen = torch.Generator().manual_seed(0)
    q_idx = torch.randn(40, 2, 16, generator=gen, dtype=torch.float16)
    k_idx = torch.randn(40, 1, 16, generator=gen, dtype=torch.float16)
    snap = watch.snapshot()
    msa_megatron.select_blocks(q_idx, k_idx, block_size=16, top_k=2, backend="triton")
    first = watch.since(snap)
    assert first["compiles"] > 0 and first["kernels"]
    snap = watch.snapshot()
    msa_megatron.select_blocks(q_idx, k_idx, block_size=16, top_k=2, backend="triton")
    assert watch.since(snap)["compiles"] == 0
