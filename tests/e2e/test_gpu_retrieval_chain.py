"""benchmarks/gpu_retrieval_chain.sh on CPU at a tiny size: its PHASE flow (a warm-up link
returned as pieces with a checksum, carried into the next call, the variants and the report),
and its refusals (an unknown PHASE, pieces of two calls mixed). No GPU: the tiny example falls
back to CPU when no CUDA device is visible and EXTRA shrinks the recipe."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "benchmarks/gpu_retrieval_chain.sh"
TINY = ("--device cpu --dtype fp32 --layers 1 --hidden 64 --ffn-hidden 128 --heads 2 "
        "--index-head-dim 32 --block-size 16 --top-k 3 --pairs 8 --queries 4 --key-vocab 8 "
        "--task-curriculum-gate 3.0 --task-curriculum-span 2 --eval-windows 1 --log-interval 1 "
        "--probe-interval 0")


@pytest.fixture
def tree(tmp_path):
    """A working directory that looks like the repository root (the script's paths are
    relative to it), with its own runs/."""
    root = tmp_path / "repo"
    root.mkdir()
    for name in ("benchmarks", "examples", "msa_megatron"):
        (root / name).symlink_to(REPO / name)
    return root


def _chain(root, out, **env):
    full = dict(os.environ, OMP_NUM_THREADS="1", OUT=str(out), LEN_TASK="256", WINDOW="512",
                WARMUP="6", STEPS="8", TAG="_t", EXTRA=TINY, CUDA_VISIBLE_DEVICES="",
                MASTER_PORT=str(20000 + random.randrange(15000)))  # not the fixed default:
    full.update(env)                                                # other runs on the host
    return subprocess.run(["bash", SCRIPT], cwd=root, env=full, capture_output=True, text=True,
                          timeout=600)


def test_unknown_phase_is_refused(tree, tmp_path):
    proc = _chain(tree, tmp_path / "out", PHASE="variant")
    assert proc.returncode == 2 and "PHASE=variant: use PHASE=warmup or PHASE=variants" in (
        proc.stderr)
    assert not (tree / "runs").exists()  # nothing was started
    proc = _chain(tree, tmp_path / "out", PHASE="warmup", WARMUP_S="1.5")
    assert proc.returncode == 2 and "WARMUP_S=1.5 must be a whole number" in proc.stderr
    proc = _chain(tree, tmp_path / "out", PHASE="warmup", MASTER_PORT="port")
    assert proc.returncode == 2 and "MASTER_PORT=port must be a whole number" in proc.stderr
    assert not (tree / "runs").exists()


@pytest.mark.parametrize("phase", ["warmup", "variants"])
def test_no_warmup_is_refused_up_front(tree, tmp_path, phase):
    """WARMUP=0 (2026-12-01: "the warm-up is complete (step 0 of 0)", then a failure packing a
    warm-up that was never saved) and a WARMUP that is no whole number stop before anything
    starts, exit 2, saying what to give."""
    for value in ("0", "00"):
        proc = _chain(tree, tmp_path / "out", PHASE=phase, WARMUP=value)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"WARMUP={value}: the variants start from the end of a dense warm-up of at " \
               "least 1 step: give WARMUP >= 1" in " ".join(proc.stderr.split())
        assert "complete" not in proc.stdout
    for value in ("1.5", "-3", "x"):
        proc = _chain(tree, tmp_path / "out", PHASE=phase, WARMUP=value)
        assert proc.returncode == 2 and f"WARMUP={value} must be a whole number" in proc.stderr
    assert not (tree / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("phase", ["warmup", "variants"])
def test_steps_not_past_warmup_are_refused_up_front(tree, tmp_path, phase):
    """STEPS <= WARMUP leaves the variants no step to train: refused before anything starts,
    exit 2, naming both (also with WARMUP left at its default 9000)."""
    for env in (dict(WARMUP="6", STEPS="6"), dict(WARMUP="6", STEPS="5"),
                dict(WARMUP="", STEPS="9000")):
        proc = _chain(tree, tmp_path / "out", PHASE=phase, **env)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"STEPS={env['STEPS']} must exceed WARMUP={env['WARMUP'] or 9000}" in " ".join(
            proc.stderr.split())
    assert not (tree / "runs").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("phase", ["warmup", "variants"])
@pytest.mark.parametrize("env,needle", [
    (dict(WINDOW="384"), "--task-len (256) must divide --seq-len (384)"),
    (dict(EXTRA=TINY + " --lr -1"), "--lr -1.0 must be a finite number > 0"),
])
def test_recipe_refused_by_pretrain_tiny_stops_before_anything_starts(tree, tmp_path, phase,
                                                                     env, needle):
    """pretrain_tiny.py --check-only on the recipe comes first (it used to show only in the
    warm-up link's log, after runs/ and $OUT were set up): exit 2 with its message, no runs/,
    no $OUT."""
    proc = _chain(tree, tmp_path / "out", PHASE=phase, **env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert needle in proc.stderr and "refuses the recipe" in proc.stderr, proc.stderr
    assert "warm-up link" not in proc.stdout
    assert not (tree / "runs").exists() and not (tmp_path / "out").exists()


def test_lane_b_flags_refused_by_pretrain_tiny_stop_before_anything_starts(tree, tmp_path):
    """B_FLAGS (lane B, PHASE=warmup) go through pretrain_tiny.py --check-only with the recipe
    up front: a bad one used to show only in lane B's log, on a second GPU, after the main
    link had started."""
    proc = _chain(tree, tmp_path / "out", PHASE="warmup", B_FLAGS="--lr -1")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "--lr -1.0 must be a finite number > 0" in proc.stderr, proc.stderr
    assert "refuses lane B's recipe (B_FLAGS=--lr -1)" in proc.stderr
    assert "warm-up link" not in proc.stdout
    assert not (tree / "runs").exists() and not (tmp_path / "out").exists()


def test_pieces_of_two_calls_mixed_are_refused(tree, tmp_path):
    carry = tree / "runs" / "carry"
    carry.mkdir(parents=True)
    (carry / "r256_t.tgz.part-00").write_bytes(b"piece of one call")
    (carry / "r256_t.tgz.part-01").write_bytes(b"piece of another")
    (carry / "r256_t.tgz.sha256").write_text("0" * 64 + "  warmup.tgz\n")
    proc = _chain(tree, tmp_path / "out", PHASE="variants")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "do not match" in proc.stderr and "carry exactly the files of one call" in proc.stderr
    assert not (tree / "runs" / "r256_t" / "msa.log").exists()  # no variant started


@pytest.mark.slow
def test_warmup_link_carried_into_the_variants(tree, tmp_path):
    out = tmp_path / "out"
    first = _chain(tree, out, PHASE="warmup", WARMUP_S="5")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    pieces = sorted(p.name for p in out.glob("r256_t.tgz.*"))
    assert pieces == ["r256_t.tgz.part-00", "r256_t.tgz.sha256"], pieces
    # a fresh machine: only the carried pieces
    shutil.rmtree(tree / "runs")
    carry = tree / "runs" / "carry"
    carry.mkdir(parents=True)
    for name in pieces:
        shutil.copy(out / name, carry / name)
    second = _chain(tree, tmp_path / "out2", PHASE="variants", FINISH_S="30")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "warm-up unpacked from runs/carry (1 pieces)" in second.stdout
    # the carried pieces are used once: a later call on this machine does not unpack them again
    assert not list(carry.iterdir())
    # at most 8 files come back (the device tool's limit): the finished warm-up (to seed a
    # longer run), the JSON, the table and one tarball of the plot, logs and metrics
    returned = sorted(p.name for p in (tmp_path / "out2").rglob("*") if p.is_file())
    assert returned == ["r256_t.tgz.part-00", "r256_t.tgz.sha256", "retrieval_r256_t.json",
                        "retrieval_r256_t.md", "retrieval_r256_t_logs.tgz"], returned
    assert "WARNING" not in second.stderr
    report = (tmp_path / "out2" / "retrieval_r256_t.md").read_text()
    for label in ("dense attention", "MSA, KL-trained index", "MSA, frozen random index",
                  "own block only"):
        assert label in report
    with tarfile.open(tmp_path / "out2" / "retrieval_r256_t_logs.tgz") as archive:
        names = set(archive.getnames())
    assert {"retrieval.png", "msa.log", "random.log", "local.log", "dense.log",
            "msa/metrics.json", "random/metrics.json", "local/metrics.json",
            "dense/metrics.json"} <= names, names
    again = _chain(tree, tmp_path / "out3", PHASE="warmup", WARMUP_S="5")
    assert again.returncode == 0 and "the warm-up is complete (step 6 of 6)" in again.stdout
    # a warm-up kept on this machine with other settings is refused up front, naming the fix
    # (2026-12-01: STEPS=1700 saved, STEPS=2100 asked: "complete", then the variants refused it)
    for phase in ("warmup", "variants"):
        other = _chain(tree, tmp_path / f"out_{phase}", PHASE=phase, STEPS="9")
        assert other.returncode == 2, other.stdout[-3000:] + other.stderr[-3000:]
        assert "steps=8/9" in other.stderr and "rm -rf runs/r256_t runs/carry" in other.stderr
        assert "run PHASE=variants" not in other.stdout and "=== msa" not in other.stdout
    # more than 8 files under $OUT: a warning on stderr
    crowded = tmp_path / "crowded"
    crowded.mkdir()
    for i in range(8):
        (crowded / f"old_{i}.txt").write_text("x")
    # (8 + the piece and its checksum: no warm-up log on this machine, which only unpacked it)
    warned = _chain(tree, crowded, PHASE="warmup", WARMUP_S="5")
    assert warned.returncode == 0, warned.stdout[-3000:] + warned.stderr[-3000:]
    assert "WARNING: 10 files under" in warned.stderr and "at most 8" in warned.stderr


def test_init_names_a_warmup_to_start_from(tree, tmp_path):
    """INIT: the run's own warm-up is refused; without the other warm-up's pieces (or a kept
    copy) the link stops before training and says what to carry."""
    proc = _chain(tree, tmp_path / "out", PHASE="warmup", INIT="r256_t")
    assert proc.returncode == 2 and "INIT=r256_t is this run's own warm-up" in proc.stderr
    proc = _chain(tree, tmp_path / "out", PHASE="warmup", INIT="r128")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "INIT=r128: no runs/r128/warmup" in proc.stderr and "runs/carry_init" in proc.stderr
    assert not (tree / "runs" / "r256_t" / "warmup.log").exists()  # no link started


@pytest.mark.slow
def test_length_extension_from_a_carried_warmup(tree, tmp_path):
    """A 128-token warm-up's pieces carried in runs/carry_init seed the 256-token warm-up
    (pretrain_tiny --init-weights): the saved warm-up records its source, and the next link
    resumes it with INIT still set and the source gone."""
    import torch

    short = _chain(tree, tmp_path / "short", PHASE="warmup", WARMUP_S="3", LEN_TASK="128",
                   WINDOW="256", TAG="")
    assert short.returncode == 0, short.stdout[-3000:] + short.stderr[-3000:]
    shutil.rmtree(tree / "runs")
    carry_init = tree / "runs" / "carry_init"
    carry_init.mkdir(parents=True)
    for piece in (tmp_path / "short").glob("r128.tgz.*"):
        shutil.copy(piece, carry_init / piece.name)
    long = dict(PHASE="warmup", WARMUP_S="2", INIT="r128", WARMUP="400", STEPS="402")
    saved_file = tree / "runs" / "r256_t" / "warmup" / "warmup_rank000_of001.pt"
    first = _chain(tree, tmp_path / "out", **long)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "warm-up unpacked from runs/carry_init (1 pieces)" in first.stdout
    saved = torch.load(saved_file, weights_only=True, mmap=True)
    assert saved["settings"]["init_weights"] == "runs/r128/warmup"
    assert 0 < saved["step"] < 400  # a partial warm-up: the next link resumes it
    shutil.rmtree(tree / "runs" / "r128")
    shutil.rmtree(carry_init)
    second = _chain(tree, tmp_path / "out2", **long)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "warm-up kept on this machine" in second.stdout
    resumed = torch.load(saved_file, weights_only=True, mmap=True)
    assert resumed["step"] > saved["step"]
    assert resumed["settings"]["init_weights"] == "runs/r128/warmup"
