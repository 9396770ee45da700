"""benchmarks/long_check.py on CPU (interpreter, tiny shapes): a correct step passes against the
row-by-row float64 oracle, and a wrong selection is caught (the check can fail)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import msa_megatron

from tests.support.scripts import load_script

TINY = ["--tokens", "80", "--rows", "5", "--dtype", "float16", "--heads", "2,1,1,1",
        "--head-dim", "16", "--block", "16", "--top-k", "2"]


def _load():
    return load_script("benchmarks/long_check.py")


@pytest.fixture
def interpret(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter")


def test_tiny_step_matches_the_oracle_on_sampled_rows(tmp_path, monkeypatch, interpret):
    out = tmp_path / "l.json"
    monkeypatch.setattr(sys, "argv", ["long_check.py", str(out), *TINY, "--commit", "02a3f76"])
    assert _load().main() == 0
    result = json.loads(out.read_text())
    assert result["commit"] == "02a3f76"  # as given, not the copy's git metadata
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
    script = _load()
    monkeypatch.setattr(script, "git_commit", lambda: "abc1234+dirty")
    assert script.main() == 1
    result = json.loads(out.read_text())
    assert not result["ok"] and result["select"]["not_near_tie"] > 0
    assert result["commit"] == "abc1234+dirty"  # without --commit: provenance.git_commit()


@pytest.mark.parametrize("flags,needle", [
    (["--heads", "64,4"], "--heads must be four positive integers"),
    (["--block", "100"], "block_size must be a power of two"),
    (["--top-k", "0"], "top_k"),
    (["--head-dim", "20"], "backend='triton' supports D"),
    (["--heads", "6,4,4,1"], "must be a multiple of"),
])
def test_bad_flags_are_refused_before_any_work(tmp_path, monkeypatch, capsys, flags, needle):
    out = tmp_path / "l.json"
    monkeypatch.setattr(sys, "argv", ["long_check.py", str(out), "--tokens", "64", *flags])
    with pytest.raises(SystemExit) as exit_info:
        _load().main()
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    assert not out.exists()  # refused before the output was even opened


def test_unwritable_output_is_refused_before_the_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["long_check.py", str(tmp_path / "no" / "l.json"), *TINY])
    with pytest.raises(SystemExit):
        _load().main()
    assert "cannot write the result" in capsys.readouterr().err


def test_sampled_rows_keep_the_last_row_and_report_their_number():
    sample = _load().sample_rows
    gen = torch.Generator().manual_seed(0)
    assert sample(1000, 3, 128, gen).tolist() == [0, 127, 999]
    rows = sample(1000, 10, 128, gen).tolist()
    assert len(rows) == len(set(rows)) == 10 and rows[0] == 0 and rows[-1] == 999
    assert sample(5, 10, 128, gen).tolist() == [0, 1, 2, 3, 4]
