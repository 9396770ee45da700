"""The README, pyproject.toml and the example's launcher say the same, measured things."""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _megatron_requirement() -> str:
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(r'"megatron-core([^"]*)"', text)
    assert match, "pyproject.toml names no megatron-core requirement"
    return match.group(1).replace(" ", "")


def test_megatron_core_bound_is_the_tested_range_everywhere():
    assert _megatron_requirement() == ">=0.16.1,<0.20"
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "megatron-core >= 0.16.1, < 0.20" in readme
    assert "0.15" not in _megatron_requirement()


def test_torch_build_choice_is_documented_and_supported():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "CUDA build" in readme and "TORCH_SPEC" in readme
    launcher = (REPO / "examples" / "run_tiny.sh").read_text()
    assert "TORCH_SPEC=${TORCH_SPEC:-" in launcher
    assert re.search(r"pip install -q \$TORCH_SPEC", launcher)  # unquoted: options pass


def test_readme_quotes_the_measured_gaps():
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "averages 0.005" not in readme and "the gap does not" not in readme
    for measured in ("0.011", "0.014", "0.018"):
        assert measured in readme, measured


def test_torch_build_claims_match_ci_and_the_launcher():
    """Which torch build pip installs is the index's choice: the README says so, and says that
    ``.ci/run`` names no index (true only while ``.ci/run`` passes none)."""
    readme = " ".join((REPO / "README.md").read_text().split())
    ci = (REPO / ".ci" / "run").read_text()
    assert "on a machine with CUDA" not in readme  # the old claim: pip does not look at GPUs
    assert "whether or not the machine has a GPU" in readme
    assert "`.ci/run` names no index either" in readme
    assert "--index-url" not in ci and "TORCH_SPEC=torch==2.13.0" in ci
    launcher = (REPO / "examples" / "run_tiny.sh").read_text()
    assert "TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}" in launcher
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme


def _speed_table():
    text = (REPO / "README.md").read_text()
    start = text.index("Kernel speed against the targets")
    rows = []
    for line in text[start:].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| paper") or line.startswith("| peer"):
            rows.append(cells)
        elif rows and not line.startswith("|"):
            break
    return text, rows


def _pair(cell: str):
    return [float(x) for x in re.findall(r"[0-9.]+", cell)[:2]]


def test_readme_speed_gap_is_computed_from_its_own_numbers():
    text, rows = _speed_table()
    assert [r[0] for r in rows] == ["paper 8K", "peer 16K", "paper 32K", "paper 128K"]
    shortfalls = []
    for name, whole, dense, ratio, target, short in rows:
        whole_ms, (dense_ms,) = _pair(whole), _pair(dense)
        ratios = [dense_ms / w for w in whole_ms]
        assert _pair(ratio) == [round(r, 2) for r in ratios], name
        (goal,) = _pair(target)
        if target.startswith("<="):  # a time: how many times too slow
            expected = [w / goal for w in whole_ms]
        else:  # a speed-up over cuDNN
            expected = [goal / r for r in ratios]
        assert _pair(short) == [round(e, 2) for e in expected], name
        shortfalls += expected
    summary = f"{min(shortfalls):.1f}x to {max(shortfalls):.1f}x short of the speed targets"
    assert summary in " ".join(text.split())


def test_readme_speed_table_quotes_the_results_json_it_names():
    """The whole-op column is the named run's ``whole_fwd_bwd`` medians, iid / coherent."""
    text, rows = _speed_table()
    start = text.index("Kernel speed against the targets")
    name = re.search(r"`(benchmarks/results/[^`]+\.json)`", text[start:]).group(1)
    run = json.loads((REPO / name).read_text())
    whole = {(r["config"], r["dist"]): r["ms"]["whole_fwd_bwd"]["median"] for r in run["rows"]}
    for cells in rows:
        config = cells[0].replace(" ", "-").lower()
        measured = [round(whole[(config, dist)], 1) for dist in ("iid", "coherent")]
        assert _pair(cells[1]) == measured, cells[0]
