"""benchmarks/long_context_report.py: the long-context table's numbers from pretrain_tiny's
metrics files (issue 16 item 4)."""

from __future__ import annotations

import json

import pytest

from tests.support.scripts import load_script

lcr = load_script("benchmarks/long_context_report.py")

ARGS = {"seq_len": 1000, "warmup_steps": 2, "tp": 1, "cp": 1, "top_k": 4, "block_size": 128}


def _run(name, losses, rates, recall):
    steps = list(range(1, len(losses) + 1))
    return {"name": name, "steps": steps, "loss": losses, "tokens_per_s": rates,
            "held_out_loss": 2.0 if name == "msa" else 2.5, "probe_steps": [1, 3, 5],
            "recall_per_layer": recall, "attended_fraction": [1.0, 1.0, 0.5, 0.25, 0.25]}


def _write(tmp_path, name, runs, **args):
    path = tmp_path / name
    path.write_text(json.dumps({"args": dict(ARGS, **args), "runs": runs}))
    return str(path)


def test_numbers_of_one_row(tmp_path):
    msa = _run("msa", [5.0, 4.0, 3.0, 2.5, 2.0], [1e3, 1e3, 1.0, 2000.0, 500.0],
               [[0.4, 0.4], [0.8, 1.0], [0.6, 0.8]])
    dense = _run("dense", [5.0, 4.0, 3.5, 3.0, 2.5], [1e3, 1e3, 1e3, 1000.0, 1000.0],
                 [[0.4, 0.4], [0.9, 0.9], [1.0, 1.0]])
    row = lcr.row_record("r", [_write(tmp_path, "m.json", [msa, dense])])
    m = row["msa"]
    # steps 4 and 5 count (step 3, the first after the switch, compiles): 2000 tokens in 2.5 s
    assert m["tokens_per_s"] == pytest.approx(800.0)
    assert row["dense"]["tokens_per_s"] == pytest.approx(1000.0)
    assert m["recall_first_after_switch"] == pytest.approx(0.9)  # probe at step 3
    assert m["recall_last_probes"] == pytest.approx(0.8)  # mean of probes 3 and 5
    assert m["attended_fraction"] == pytest.approx(0.25)
    assert row["train_loss_gap_last_steps"] == pytest.approx(-0.3)  # mean of 0, 0, -.5 x3
    assert m["held_out_loss"] == 2.0 and row["dense"]["held_out_loss"] == 2.5


def test_variants_from_two_files_and_their_mismatch(tmp_path):
    msa = _run("msa", [5.0] * 5, [1e3] * 5, [[0.5]] * 3)
    dense = _run("dense", [5.0] * 5, [1e3] * 5, [[0.5]] * 3)
    a = _write(tmp_path, "a.json", [msa])
    b = _write(tmp_path, "b.json", [dense])
    assert lcr.row_record("two", [a, b])["train_loss_gap_last_steps"] == 0.0
    other = _write(tmp_path, "c.json", [dense], seq_len=2000)
    with pytest.raises(ValueError, match="not one comparison"):
        lcr.row_record("bad", [a, other])
    with pytest.raises(ValueError, match="no \\['dense'\\] variant"):
        lcr.row_record("half", [a])
    with pytest.raises(ValueError, match="appears twice"):
        lcr.row_record("twice", [a, a])


def test_main_writes_json_table_and_plot(tmp_path, capsys):
    runs = [_run(n, [5.0, 4.0, 3.0, 2.5, 2.0], [1e3] * 5, [[0.5]] * 3) for n in ("msa", "dense")]
    path = _write(tmp_path, "m.json", runs)
    out = tmp_path / "out" / "summary"
    assert lcr.main([str(out), "--row", f"64K={path}"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["rows"][0]["speedup_tokens_per_s"] == pytest.approx(1.0)
    assert "| 64K | 5 (2) |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").stat().st_size > 0
    with pytest.raises(SystemExit):
        lcr.main([str(out), "--row", "no-files"])
