"""examples/retrieval_report.py reads the directories a user has: here the ``--out-dir`` of one
``examples/pretrain_tiny.py --task retrieval`` run, which holds ``metrics.json`` itself (every
variant of that run in one record) rather than ``<run>/metrics.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _report_module():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import retrieval_report
    finally:
        sys.path.remove(str(REPO / "examples"))
    return retrieval_report


def _run(name, exact):
    return {"name": name, "steps": [1, 2], "loss": [3.0, 2.0], "tokens_per_s": [10.0, 12.0],
            "held_out_loss": 2.0, "eval_steps": [2], "eval_exact_match": [exact],
            "retrieval": {"exact_match": exact, "answer_loss": 1.0, "recall": 0.5}}


def test_report_reads_one_pretrain_tiny_out_dir(tmp_path):
    """Fresh-user check 2026-12-01 s10: ``retrieval_report.py <pretrain_tiny --out-dir>`` said
    "no metrics under ..." although the run's metrics.json was there."""
    report = _report_module()
    (tmp_path / "metrics.json").write_text(json.dumps(
        {"args": {"warmup_steps": 1, "runs": ["msa", "dense"]},
         "runs": [_run("msa", 0.75), _run("dense", 0.5)]}))
    runs = report.load_runs(tmp_path)
    assert list(runs) == ["dense", "msa"]
    assert runs["msa"]["retrieval"]["exact_match"] == 0.75
    assert report.main([str(tmp_path)]) == 0
    table = (tmp_path / "retrieval.md").read_text()
    assert "| MSA, KL-trained index | 0.750 |" in table
    assert "| dense attention | 0.500 |" in table
