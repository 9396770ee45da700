"""examples/pretrain_tiny.py and run_tiny.sh reject bad settings before any process starts.

Nothing here trains: the checks run in-process (``parse_args``, ``check_settings``) or as one
``--check-only`` / bad-flag process that must exit non-zero with one message.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pretrain_tiny.py"
RUN_TINY = REPO / "examples" / "run_tiny.sh"
GUARD_S = 300  # subprocess guard only (the import of megatron-core takes a few seconds)


@pytest.fixture(scope="module")
def tiny():
    spec = importlib.util.spec_from_file_location("pretrain_tiny_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    sys.path.insert(0, str(EXAMPLE.parent))  # its sibling modules, as when run as a script
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(str(EXAMPLE.parent))


def _errors(tiny, argv, world=1):
    return tiny.check_settings(tiny.parse_args(argv), world)


def test_default_and_quick_settings_are_valid(tiny):
    assert _errors(tiny, ["--device", "cpu", "--tp", "2", "--cp", "2"], world=4) == []
    assert _errors(tiny, ["--device", "cpu", "--quick", "--cp", "2"], world=2) == []


@pytest.mark.parametrize("argv,world,needle", [
    (["--tp", "1", "--cp", "3"], 3, "2 x CP = 6"),  # the TP=1 CP=3
    (["--cp", "16"], 16, "CP must be 1, 2, 4 or 8"),
    (["--tp", "2", "--cp", "2"], 6, "not a multiple of TP x CP"),
    (["--tp", "3"], 3, "--heads 4 must be a multiple of --tp 3"),
    (["--seq-len", "1000"], 1, "multiple of 16"),
    (["--seq-len", "32", "--block-size", "64"], 1, "larger than --seq-len"),
    (["--block-size", "48"], 1, "block_size must be a power of two"),
    (["--top-k", "0"], 1, "top_k"),
    (["--steps", "10", "--warmup-steps", "20"], 1, "--warmup-steps 20"),
    (["--lr-warmup", "-1"], 1, "--lr-warmup -1"),
    (["--heads", "3"], 1, "multiple of --heads 3"),
    (["--index-head-dim", "16"], 1, "--index-head-dim 16 is smaller than the RoPE dims"),
    (["--warmup-until", "5"], 1, "--warmup-until need --save-warmup"),
    (["--warmup-seconds", "60"], 1, "--warmup-seconds need --save-warmup"),
    (["--warmup-seconds", "0", "--save-warmup", "w"], 1, "--warmup-seconds 0.0 must be > 0"),
    (["--warmup-until", "0", "--save-warmup", "w"], 1, "--warmup-until 0 must be >= 1"),
    (["--resume-warmup", "/nonexistent/w"], 1, "--resume-warmup /nonexistent/w is not a dir"),
    (["--resume-warmup", ".", "--load-warmup", "."], 1, "exclude each other"),
])
def test_bad_layouts_and_sizes_are_named(tiny, argv, world, needle):
    errors = _errors(tiny, ["--device", "cpu", *argv], world)
    assert any(needle in e for e in errors), errors


def test_cuda_without_a_gpu_says_so(tiny, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    errors = _errors(tiny, ["--device", "cuda"])
    assert any("no CUDA device is visible" in e for e in errors), errors


def test_quick_keeps_explicit_flags(tiny):
    args = tiny.parse_args(["--quick", "--block-size", "32", "--heads", "4", "--steps", "5"])
    assert (args.block_size, args.heads, args.steps) == (32, 4, 5)
    assert (args.seq_len, args.layers) == (tiny.QUICK_SIZES["seq_len"], tiny.QUICK_SIZES["layers"])
    full = tiny.parse_args([])
    assert all(getattr(full, k) == v for k, v in tiny.FULL_SIZES.items())
    assert (full.tp, full.cp) == (1, 1)


def test_help_shows_defaults_and_quick_sizes(tiny):
    text = tiny.build_parser().format_help()
    assert "training steps of each run (default 120; with --quick 8)" in " ".join(text.split())
    assert "(default: 0.002)" in text  # --lr: every option shows its default
    assert "run_tiny.sh always passes --tp $TP" in " ".join(text.split())
    assert "default: None" not in text


def test_metrics_json_keeps_numbers(tiny):
    args = tiny.parse_args(["--quick", "--out-dir", "somewhere"])
    history = tiny.History("msa", steps=[1], loss=[2.5])
    record = json.loads(json.dumps(tiny.metrics_record(args, [history])))
    assert record["args"]["steps"] == 8 and record["args"]["lr"] == 0.002
    assert record["args"]["quick"] is True and record["args"]["out_dir"] == "somewhere"
    assert record["runs"][0]["loss"] == [2.5]


def test_plot_title_fits_the_runs(tiny):
    one = [tiny.History("msa")]
    assert "same data order" not in tiny.loss_title(one)
    assert "msa run only" in tiny.loss_title(one)
    assert "same data order" in tiny.loss_title(one + [tiny.History("dense")])


def test_layouts_do_not_overwrite_earlier_runs(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "DEFAULT_OUT_ROOT", tmp_path)
    args = tiny.parse_args(["--tp", "2", "--cp", "1"])
    first, note = tiny.resolve_out_dir(args)
    assert (first, note) == (tmp_path / "tp2-cp1", "")
    first.mkdir()
    (first / "metrics.json").write_text("{}")
    second, note = tiny.resolve_out_dir(args)
    assert second == tmp_path / "tp2-cp1-2" and "holds an earlier run" in note
    assert tiny.resolve_out_dir(tiny.parse_args(["--cp", "2"]))[0] == tmp_path / "tp1-cp2"
    explicit, note = tiny.resolve_out_dir(tiny.parse_args(["--out-dir", str(first)]))
    assert explicit == first and "replaces the earlier run" in note


def _run_example(*argv, world="3"):
    env = dict(os.environ, WORLD_SIZE=world, RANK="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(EXAMPLE), *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=GUARD_S)


def test_bad_layout_exits_before_any_process_group():
    proc = _run_example("--tp", "1", "--cp", "3", "--device", "cpu")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("invalid settings") == 1 and "2 x CP = 6" in proc.stderr
    assert "world " not in proc.stdout  # the process group never started
    assert "Traceback" not in proc.stderr


def test_check_only_accepts_a_good_layout(tmp_path):
    proc = _run_example("--tp", "1", "--cp", "2", "--device", "cpu", "--quick", "--check-only",
                        "--out-dir", str(tmp_path / "out"), world="2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "settings OK for 2 processes" in proc.stdout
    assert not (tmp_path / "out").exists()


def test_run_tiny_rejects_a_bad_environment_before_installing():
    env = dict(os.environ, TP="x", VENV="/nonexistent/venv-never-created")
    proc = subprocess.run(["bash", str(RUN_TINY)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=GUARD_S)
    assert proc.returncode == 2 and "TP=x must be a positive integer" in proc.stderr
    assert not Path("/nonexistent/venv-never-created").exists()
