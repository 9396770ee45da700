"""benchmarks/gpu_ncu.sh and bench_kernels.py --profile-only on CPU: the profiled step runs (tiny
shapes, Triton's interpreter) and the profiler is called as documented. A stand-in ``ncu`` on
PATH records its arguments; the real one runs on the GPU machine only."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_NCU = """#!/usr/bin/env bash
echo "ncu $*"
"""


def _env(tmp_path: Path, **extra) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ncu = bin_dir / "ncu"
    ncu.write_text(FAKE_NCU)
    ncu.chmod(0o755)
    py = bin_dir / "python3"  # the script calls python3: the interpreter running the tests
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TRITON_INTERPRET="1",
               OUT=str(tmp_path / "out"), PROFILE_ARGS="--dry-run", CONFIG="paper-8k")
    env.update(extra)
    (tmp_path / "out").mkdir(exist_ok=True)
    return env


@pytest.mark.parametrize("mode", ["sparse", "dense"])
def test_profile_only_runs_one_whole_op(tmp_path, mode):
    res = subprocess.run(
        [sys.executable, "benchmarks/bench_kernels.py", str(tmp_path / "x.json"), "--dry-run",
         "--profile-only", "paper-8k", "--profile-mode", mode, "--profile-dist", "coherent"],
        cwd=REPO, env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True, text=True,
        timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]


def test_every_launch_mode_asks_ncu_for_the_named_kernels(tmp_path):
    env = _env(tmp_path, LAUNCHES="all")
    res = subprocess.run(["bash", "benchmarks/gpu_ncu.sh", "_k_one", "_k_two"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "all launches: rc 0" in res.stdout
    args = (tmp_path / "out" / "ncu_launches_paper-8k_sparse_iid.csv").read_text()
    assert "--clock-control none" in args and "--csv" in args
    assert "regex:^(_k_one|_k_two)$" in args
    assert "--profile-only paper-8k --profile-mode sparse --profile-dist iid --dry-run" in args


def test_one_launch_mode_profiles_each_kernel_once_and_archives(tmp_path):
    env = _env(tmp_path, MODE="dense", SKIP="3")
    res = subprocess.run(["bash", "benchmarks/gpu_ncu.sh", "_dense_kl_kernel"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "warm step:" in res.stdout and "_dense_kl_kernel: rc 0" in res.stdout
    archive = tmp_path / "out" / "ncu_paper-8k_dense_iid.tgz"
    with tarfile.open(archive) as tar:
        log = tar.extractfile("./ncu__dense_kl_kernel.log").read().decode()
    assert "--set full" in log and "--launch-skip 3 -c 1" in log
    assert "regex:^_dense_kl_kernel$" in log and "--profile-mode dense" in log


def test_missing_out_is_refused(tmp_path):
    env = _env(tmp_path)
    del env["OUT"]
    res = subprocess.run(["bash", "benchmarks/gpu_ncu.sh"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "set OUT" in res.stderr
