"""examples/run_retrieval.sh's PACK=1 (for the device tool, which returns at most 8 files from
its $OUT): the report's three files and one tarball of everything else remain. CPU, tiny."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--dtype", "fp32", "--layers", "1", "--hidden", "64", "--ffn-hidden",
        "128", "--heads", "2", "--index-head-dim", "32", "--pairs", "8", "--queries", "4",
        "--key-vocab", "8", "--task-len", "256", "--task-len-min", "64", "--min-distance", "64",
        "--eval-windows", "1", "--eval-interval", "2", "--log-interval", "1",
        "--probe-interval", "2", "--probe-rows", "16"]


def _run(env_extra, *flags, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", DEVICE="cpu", LEN="512", STEPS="4", WARMUP="2",
               TOPK="3", BLOCK="16", PYTHON=sys.executable,
               MASTER_PORT=str(23000 + random.randrange(2000)))
    env.update(env_extra)
    return subprocess.run(["bash", "examples/run_retrieval.sh", *flags], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_pack_must_be_0_or_1(tmp_path):
    proc = _run({"PACK": "yes", "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and "PACK=yes: use PACK=1 or PACK=0" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize("value", ["yes", "2", "true", " 1"])
def test_parallel_must_be_0_or_1(tmp_path, value):
    """Any PARALLEL other than 1 used to run the variants one after the other, as PARALLEL=0."""
    proc = _run({"PARALLEL": value, "OUT": str(tmp_path / "out")}, *TINY)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"PARALLEL={value}: use PARALLEL=1 or PARALLEL=0" in proc.stderr
    assert not (tmp_path / "out").exists()  # nothing was started


@pytest.mark.parametrize("env,needle", [
    ({"LEN": "100"}, "must divide --seq-len (100)"),
    ({"RUNS": "msa,foo"}, "--runs takes distinct names"),
    ({"STEPS": "1"}, "--warmup-steps 2 must be in [0, --steps 1]"),
    # PARALLEL=1 saves a warm-up: the warm-up process's flags are checked too (this one used
    # to fail after OUT was cleared, exit 1 "warm-up failed")
    ({"PARALLEL": "1", "WARMUP": "0"}, "--save-warmup needs a dense warm-up"),
    ({"PARALLEL": "1", "WARMUP": "0", "RUNS": "msa"}, "--warmup-until 0 must be in [1, "),
])
def test_bad_settings_are_refused_before_out_is_touched(tmp_path, env, needle):
    """Fresh-user check 2026-12-01 s10: a refused setting used to delete the earlier run's
    report and metrics in OUT first, exit 1 and add "no metrics under ..."; now exit 2 with
    pretrain_tiny.py's one message, OUT as it was."""
    out = tmp_path / "out"
    (out / "msa").mkdir(parents=True)
    kept = [out / "msa" / "metrics.json", out / "retrieval.md", out / "retrieval.json"]
    for path in kept:
        path.write_text("{}")
    proc = _run({"OUT": str(out), **env}, *TINY)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert needle in proc.stderr and "no metrics" not in proc.stderr, proc.stderr
    assert all(path.is_file() for path in kept)
    assert sorted(p.name for p in out.iterdir()) == ["msa", "retrieval.json", "retrieval.md"]


def _count_out_files(directory, script="some_script.sh"):
    """examples/out_files.sh sourced by bash: (count printed, stderr of the warning check)."""
    proc = subprocess.run(["bash", "-c", "set -euo pipefail; source examples/out_files.sh; "
                           'msa_out_files "$1"; msa_warn_out_files "$2" "$1"', "-",
                           str(directory), script], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.strip()), proc.stderr


def test_out_files_warns_above_the_device_limit(tmp_path):
    """The one rule of run_retrieval.sh (PACK=1) and gpu_retrieval_chain.sh: files under $OUT
    (sub-folders included) are counted, and more than 8 draw one warning naming the script."""
    assert _count_out_files(tmp_path / "missing") == (0, "")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for i in range(7):
        (out / f"f{i}").write_text("x")
    (out / "sub" / "g").write_text("x")
    assert _count_out_files(out) == (8, "")
    (out / "sub" / "h").write_text("x")
    count, warning = _count_out_files(out, "run_retrieval.sh")
    assert count == 9
    assert warning.startswith(f"run_retrieval.sh: WARNING: 9 files under {out}: the device tool "
                              "returns at most 8")
    for script in ("examples/run_retrieval.sh", "benchmarks/gpu_retrieval_chain.sh"):
        text = (REPO / script).read_text()
        assert "out_files.sh" in text and "msa_warn_out_files" in text
        assert "-gt 8" not in text  # the limit lives in examples/out_files.sh only


@pytest.mark.slow
def test_pack_leaves_the_report_and_one_tarball(tmp_path):
    """PARALLEL=1 PACK=1 into a sub-folder of the device's $OUT (the 2026-12-01 text8k run wrote
    15 files there and lost three variants' metrics): 4 files remain, the warm-up is saved in
    WARMUP_DIR, and the tarball unpacks into a directory the report reads again."""
    out = tmp_path / "OUT" / "text8k"
    proc = _run({"PACK": "1", "PARALLEL": "1", "RUNS": "msa,random,dense", "OUT": str(out),
                 "WARMUP_DIR": str(tmp_path / "warmup")}, *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    left = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    assert left == ["retrieval.json", "retrieval.md", "retrieval.png", "retrieval_logs.tgz"]
    assert "WARNING" not in proc.stderr and "PACK=1: " in proc.stdout
    assert sorted(p.name for p in (tmp_path / "warmup").iterdir()) == ["warmup_rank000_of001.pt"]
    with tarfile.open(out / "retrieval_logs.tgz") as archive:
        names = {name.removeprefix("./") for name in archive.getnames()}
        archive.extractall(tmp_path / "unpacked", filter="data")
    assert {"msa.log", "random.log", "dense.log", "msa/metrics.json", "random/metrics.json",
            "dense/metrics.json", "msa/pretrain_tiny.png"} <= names, names
    summary = json.loads((out / "retrieval.json").read_text())
    assert sorted(summary) == ["dense", "msa", "random"]
    again = subprocess.run([sys.executable, "examples/retrieval_report.py",
                            str(tmp_path / "unpacked")], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((tmp_path / "unpacked" / "retrieval.json").read_text()) == summary


@pytest.mark.slow
def test_parallel_trains_only_the_variants_of_runs(tmp_path):
    """PARALLEL=1 with RUNS=msa,random: a process of its own trains the warm-up and saves it
    (--warmup-until: no dense variant after it), then msa and random start from it; dense used
    to be trained and reported whatever RUNS said."""
    out = tmp_path / "out"
    proc = _run({"PARALLEL": "1", "RUNS": "msa,random", "OUT": str(out)}, *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(json.loads((out / "retrieval.json").read_text())) == ["msa", "random"]
    assert not (out / "dense").exists() and not (out / "dense.log").exists()
    assert "saved the warm-up (step 2 of 2)" in (out / "warmup.log").read_text()
    assert sorted(p.name for p in (out / "warmup").iterdir()) == ["warmup_rank000_of001.pt"]
    for run in ("msa", "random"):
        assert (out / run / "metrics.json").is_file()
