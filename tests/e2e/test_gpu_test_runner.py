"""benchmarks/gpu_tests.py, the parallel pytest runner of the GPU integration run: which units it
plans, how it reads pytest's summary, and that it runs, reports and interrupts units (on CPU
here, with tiny generated test files)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.support.scripts import load_script


@pytest.fixture(scope="module")
def runner():
    return load_script("benchmarks/gpu_tests.py", register=True)  # dataclasses look it up


def _write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def test_plan_orders_units_and_covers_every_file_once(runner, tmp_path):
    for name in ("test_a.py", "test_b.py", "test_c.py"):
        _write(tmp_path / name, "def test_one():\n    pass\n\ndef test_two(x=1):\n    pass\n")
    units = runner.plan_units([str(tmp_path / "test_c.py"), str(tmp_path)], "torch",
                              split=["test_b.py"], extra=["triton=x.py::t y.py"])
    assert [(u.backend, u.node_ids) for u in units] == [
        ("triton", ["x.py::t", "y.py"]),
        ("torch", [f"{tmp_path}/test_b.py::test_one"]),
        ("torch", [f"{tmp_path}/test_b.py::test_two"]),
        ("torch", [str(tmp_path / "test_c.py")]),  # named first, not repeated by the directory
        ("torch", [str(tmp_path / "test_a.py")]),
    ]
    with pytest.raises(ValueError, match="BACKEND=NODEID"):
        runner.plan_units([], "torch", [], ["tests/x.py"])
    with pytest.raises(FileNotFoundError, match="no test file"):
        runner.plan_units([str(tmp_path / "missing.py")], "torch", [], [])


@pytest.mark.parametrize("text,expected", [
    ("..s\n3 passed, 1 skipped, 2 warnings in 9.12s\n", {"passed": 3, "skipped": 1,
                                                       "warnings": None}),
    ("=== 1 failed, 2 passed, 1 error in 3.0s ===\n", {"failed": 1, "passed": 2, "errors": 1}),
    ("!!! KeyboardInterrupt !!!\n4 passed in 20.00s\n", {"passed": 4}),
    ("collected 0 items\n", {}),
])
def test_summary_counts(runner, text, expected):
    expected = {k: v for k, v in expected.items() if v is not None}
    assert runner.summary_counts(text) == expected


def test_runs_reports_and_interrupts_units(runner, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_START_S", 1.0)
    monkeypatch.setattr(runner, "GRACE_S", 5.0)
    good = _write(tmp_path / "test_good.py", """
        import os

        def test_backend():
            assert os.environ["MSA_TEST_BACKEND"] == "triton"
            assert os.environ["MSA_TEST_DEVICE"] == "cpu"
        """)
    bad = _write(tmp_path / "test_bad.py", "def test_fails():\n    assert 1 == 2\n")
    slow = _write(tmp_path / "test_slow.py", "import time\n\ndef test_sleeps():\n"
                                             "    time.sleep(300)\n")
    log = tmp_path / "log.txt"
    status = runner.main([str(log), "--device", "cpu", "--jobs", "3", "--deadline-s", "12",
                          "--unit", f"triton={good}", str(bad), str(slow)])
    assert status == 1
    text = log.read_text()
    summary = text[text.index("=== summary"):]
    lines = summary.splitlines()
    assert lines[1].startswith("PASS") and "test_good.py" in lines[1]
    assert lines[2].startswith("FAIL") and "test_bad.py" in lines[2] and "'failed': 1" in lines[2]
    assert lines[3].startswith("FAIL") and "test_slow.py" in lines[3]
    assert "timed out" in text  # the slow unit was interrupted at the deadline
    assert lines[-1].startswith("TESTS FAIL: 1 failed, 1 passed")
    good_only = runner.main([str(log), "--device", "cpu", "--unit", f"triton={good}"])
    assert good_only == 0 and log.read_text().splitlines()[-1].startswith("TESTS PASS: 1 passed")
