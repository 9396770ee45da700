"""benchmarks/long_check.py on CPU (interpreter, tiny shapes): a correct step passes against the
row-by-row float64 oracle, and a wrong selection is caught (the check can fail)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import msa_megatron

REPO = Path(__file__).resolve().parents[2]
TINY = ["--tokens", "80", "--rows", "5", "--dtype", "float16", "--heads", "2,1,1,1",
        "--head-dim", "16", "--block", "16", "--top-k", "2"]


def _load():
    spec = importlib.util.spec_from_file_location("long_check", REPO / "benchmarks" / "long_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter")


def test_tiny_step_matches_the_oracle_on_sampled_rows(tmp_path, monkeypatch, interpret):
    out = tmp_path / "l.json"
    monkeypatch.setattr(sys, "argv", ["long_check.py", str(out), *TINY])
    assert _load().main() == 0
    result = json.loads(out.read_text())
    assert result["ok"] and all(result["finite"].values())
    assert result["select"] == dict(row_heads_differing=0, not_near_tie=0, row_heads=5)
    assert max(result["errors"].values()) < 2e-3
    assert result["sampled_rows"][0] == 0 and result["sampled_rows"][-1] == 79


def test_a_wrong_selection_fails_the_check(tmp_path, monkeypatch, interpret):
    real = msa_megatron.select_blocks

    def shifted(*args, **kwargs):  # every block but block 0 moved one block down
        sel = real(*args, **kwargs)
        return torch.where(sel > 0, sel - 1, sel)

    out = tmp_path / "l.json"
    monkeypatch.setattr(msa_megatron, "select_blocks", shifted)
    monkeypatch.setattr(sys, "argv", ["long_check.py", str(out), *TINY])
    assert _load().main() == 1
    result = json.loads(out.read_text())
    assert not result["ok"] and result["select"]["not_near_tie"] > 0


def test_bad_heads_flag_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["long_check.py", str(tmp_path / "l.json"), "--heads", "64,4"])
    with pytest.raises(ValueError, match="--heads"):
        _load().main()
