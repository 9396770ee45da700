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
    (["--tp", "2", "--cp", "2"], 6, "6 processes (NPROC / --nproc-per-node): not a multiple of"),
    (["--tp", "2"], 1, "1 process (NPROC / --nproc-per-node): not a multiple of TP x CP"),
    (["--tp", "3"], 3, "--heads 4 must be a multiple of --tp 3"),
    (["--seq-len", "1000"], 1, "multiple of 16"),
    (["--seq-len", "32", "--block-size", "64"], 1, "larger than --seq-len"),
    (["--block-size", "48"], 1, "block_size must be a power of two"),
    (["--top-k", "0"], 1, "top_k"),
    (["--steps", "10", "--warmup-steps", "20"], 1, "--warmup-steps 20"),
    (["--lr-warmup", "-1"], 1, "--lr-warmup -1"),
    (["--heads", "3"], 1, "multiple of --heads 3"),
    (["--index-head-dim", "16"], 1, "--index-head-dim 16 is smaller than the RoPE dims"),
    (["--warmup-until", "5"], 1, "--warmup-until needs --save-warmup"),
    (["--warmup-seconds", "60"], 1, "--warmup-seconds needs --save-warmup"),
    (["--warmup-until", "5", "--warmup-seconds", "6"], 1,
     "--warmup-until and --warmup-seconds need --save-warmup"),
    (["--warmup-seconds", "0", "--save-warmup", "w"], 1, "--warmup-seconds 0.0 must be a finite"),
    (["--warmup-until", "0", "--save-warmup", "w"], 1, "--warmup-until 0 must be in [1, "),
    (["--resume-warmup", "/nonexistent/w"], 1, "--resume-warmup /nonexistent/w is not a dir"),
    (["--resume-warmup", ".", "--load-warmup", "."], 1, "exclude each other"),
    (["--quick", "--index-heads", "3"], 1, "index heads (--index-heads 3"),
    (["--quick", "--backend", "triton"], 1, "set TRITON_INTERPRET=1"),
    # adversarial check 2026-12-07 s23: both passed --check-only, then megatron-core asserted
    (["--tp", "2", "--ffn-hidden", "33"], 2, "--ffn-hidden 33 must be a multiple of --tp 2"),
    (["--tp", "3", "--heads", "3", "--query-groups", "3", "--hidden", "48", "--ffn-hidden", "96",
      "--index-head-dim", "16"], 3, "the vocabulary of 256 rows (--task text) is split over TP"),
])
def test_bad_layouts_and_sizes_are_named(tiny, argv, world, needle, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    errors = _errors(tiny, ["--device", "cpu", *argv], world)
    assert any(needle in e for e in errors), errors


@pytest.mark.parametrize("argv,needle", [
    # fresh-user check 2026-12-01 s10: each of these passed --check-only and then trained
    # wrongly (a negative --clip-grad or --lr flips the update) or failed inside the run
    (["--quick", "--layers", "0"], "--layers 0 must be >= 1"),
    (["--quick", "--hidden", "0"], "--hidden 0 must be >= 1"),
    (["--quick", "--ffn-hidden", "0"], "--ffn-hidden 0 must be >= 1"),
    (["--quick", "--lr", "-1"], "--lr -1.0 must be a finite number > 0"),
    (["--quick", "--lr", "nan"], "--lr nan must be a finite number > 0"),
    (["--quick", "--clip-grad", "-1"], "--clip-grad -1.0 must be a finite number > 0"),
    (["--quick", "--rotary-base", "0"], "--rotary-base 0 must be >= 1"),
    (["--quick", "--probe-interval", "-1"], "--probe-interval -1 must be >= 0"),
    (["--quick", "--probe-rows", "0"], "--probe-rows 0 must be >= 1"),
    (["--quick", "--task", "retrieval", "--answer-weight", "-1"],
     "--answer-weight -1.0 must be a finite number > 0"),
    (["--quick", "--task", "retrieval", "--answer-weight", "nan"],
     "--answer-weight nan must be a finite number > 0"),
    (["--quick", "--task", "retrieval", "--min-distance", "-5"], "--min-distance -5 must be >= 0"),
    (["--quick", "--task", "retrieval", "--eval-interval", "-1"],
     "--eval-interval -1 must be >= 0"),
    (["--quick", "--log-interval", "0"], "--log-interval 0 must be >= 1"),
])
def test_bad_numbers_are_named(tiny, argv, needle):
    errors = _errors(tiny, ["--device", "cpu", *argv])
    assert any(needle in e for e in errors), errors
    if "--log-interval" in argv:  # only the flag at fault is named
        assert not any("--eval-windows" in e for e in errors), errors


def test_no_baseline_with_other_runs_is_refused(tiny, capsys):
    assert tiny.parse_args(["--no-baseline", "--runs", "msa"]).runs == ["msa"]
    with pytest.raises(SystemExit) as exit_info:
        tiny.parse_args(["--no-baseline", "--runs", "msa,dense"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--no-baseline (same as --runs msa) contradicts " \
        "--runs msa,dense" in err, err


def test_task_len_zero_is_refused_not_a_traceback(tiny, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tiny.parse_args(["--quick", "--task", "retrieval", "--task-len", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--task-len (0) must divide --seq-len" in err, err


@pytest.mark.parametrize("value", ["1", "0", "-3"])
def test_value_vocab_below_two_is_refused(tiny, capsys, value):
    """One value token: every answer is right by chance (chance level 1.0)."""
    with pytest.raises(SystemExit) as exit_info:
        tiny.parse_args(["--quick", "--task", "retrieval", "--value-vocab", value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and f"--value-vocab ({value}) must be >= 2" in err, err
    assert tiny.parse_args(["--quick", "--task", "retrieval", "--value-vocab", "2"]).value_vocab == 2


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
    one = _run_example("--device", "cpu", "--quick", "--check-only", world="1")
    assert one.returncode == 0 and "settings OK for 1 process:" in one.stdout, one.stdout


def test_run_tiny_rejects_a_bad_environment_before_installing():
    env = dict(os.environ, TP="x", VENV="/nonexistent/venv-never-created")
    proc = subprocess.run(["bash", str(RUN_TINY)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=GUARD_S)
    assert proc.returncode == 2 and "TP=x must be a positive integer" in proc.stderr
    assert not Path("/nonexistent/venv-never-created").exists()


@pytest.mark.parametrize("mode", ["--check-only", "--help"])
def test_run_tiny_refuses_a_python_that_cannot_run_the_script(mode):
    """A mistyped PYTHON would otherwise skip the check of pretrain_tiny.py's flags."""
    env = dict(os.environ, PYTHON="/nonexistent/python3", VENV="/nonexistent/venv")
    proc = subprocess.run(["bash", str(RUN_TINY), mode, "--heads", "3"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 2, (proc.stdout[-1000:], proc.stderr[-1000:])
    assert "PYTHON=/nonexistent/python3 cannot import torch and megatron-core" in proc.stderr


# --- chained warm-up: the saved files are checked before any process group starts -------------

_RETRIEVAL = ["--device", "cpu", "--task", "retrieval", "--record-format", "fused",
              "--steps", "8", "--warmup-steps", "6", "--seq-len", "512", "--task-len", "256",
              "--task-len-min", "32", "--task-curriculum-gate", "3.0",
              "--task-curriculum-span", "2", "--layers", "1",
              "--hidden", "64", "--ffn-hidden", "128", "--heads", "2", "--query-groups", "2",
              "--block-size", "16", "--top-k", "3", "--index-head-dim", "32", "--pairs", "8",
              "--queries", "4", "--key-vocab", "8", "--min-distance", "64", "--dtype", "fp32"]


def _fake_warmup(tiny, directory, step, world=1, argv=(), **settings):
    """A warm-up directory as save_warmup writes it (settings and step; no weights)."""
    args = tiny.parse_args(_RETRIEVAL + list(argv))
    saved = {k: getattr(args, k, None) for k in tiny.WARMUP_KEYS}
    saved.update(settings)
    directory.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        torch.save({"settings": saved, "model": {}, "optimizer": {}, "history": {},
                    "step": step, "data": None},
                   directory / f"warmup_rank{rank:03d}_of{world:03d}.pt")
    return directory


@pytest.mark.parametrize("argv,needle", [
    (["--save-warmup", "w", "--warmup-until", "7"], "--warmup-until 7 must be in [1, "
                                                    "--warmup-steps 6]"),
    (["--save-warmup", "w", "--warmup-seconds", "nan"], "--warmup-seconds nan must be a finite"),
    (["--save-warmup", "w", "--warmup-seconds", "inf"], "--warmup-seconds inf must be a finite"),
    (["--save-warmup", "w", "--warmup-steps", "0", "--task-curriculum-gate", "0",
      "--task-curriculum-span", "50"],
     "--save-warmup needs a dense warm-up, but --warmup-steps is 0"),
])
def test_chained_warmup_edge_values_are_named(tiny, argv, needle):
    errors = _errors(tiny, _RETRIEVAL + argv)
    assert any(needle in e for e in errors), errors


def test_warmup_directories_are_checked_before_starting(tiny, tmp_path):
    partial = _fake_warmup(tiny, tmp_path / "partial", 3)
    complete = _fake_warmup(tiny, tmp_path / "complete", 6)
    cp2 = _fake_warmup(tiny, tmp_path / "cp2", 3, world=2, cp=2)
    other = _fake_warmup(tiny, tmp_path / "other", 3, lr=0.01)
    empty = tmp_path / "empty"
    empty.mkdir()
    cut = tmp_path / "cut"
    cut.mkdir()
    data = (partial / "warmup_rank000_of001.pt").read_bytes()
    (cut / "warmup_rank000_of001.pt").write_bytes(data[: len(data) // 2])
    cases = [
        (["--resume-warmup", str(empty)], f"--resume-warmup {empty} has no "
                                          "warmup_rank000_of001.pt (not a --save-warmup "
                                          "directory of 1 process, or"),
        (["--resume-warmup", str(cp2)], "saved by 2 processes (warmup_rank*_of002.pt), not by 1"),
        (["--resume-warmup", str(cut)], "warmup_rank000_of001.pt is not a whole torch.save file"),
        (["--resume-warmup", str(other)], "saved with other settings (saved, now): lr=0.01/0.002"),
        (["--load-warmup", str(partial)], f"--load-warmup {partial} holds a partial warm-up "
                                          "(step 3 of 6): continue it with --resume-warmup"),
        (["--resume-warmup", str(complete), "--save-warmup", str(complete), "--warmup-until",
          "6"], "holds the complete warm-up (step 6 of 6): nothing is left for --warmup-until"),
        (["--resume-warmup", str(complete), "--save-warmup", str(complete), "--warmup-seconds",
          "9"], "nothing is left for --warmup-seconds; start the variants with --load-warmup"),
        (["--resume-warmup", str(partial), "--save-warmup", str(partial), "--warmup-until", "3"],
         "--warmup-until 3 is not past the step of --resume-warmup"),
        (["--save-warmup", str(partial), "--warmup-until", "2"],
         f"--save-warmup {partial} holds a partial warm-up (step 3 of 6) that this run would "
         "overwrite"),
    ]
    for argv, needle in cases:
        errors = _errors(tiny, _RETRIEVAL + argv)
        assert any(needle in e for e in errors), (argv, errors)
    # what the chain does is accepted
    for argv in (["--resume-warmup", str(partial), "--save-warmup", str(partial),
                  "--warmup-until", "4"],
                 ["--resume-warmup", str(partial), "--save-warmup", str(partial)],
                 ["--resume-warmup", str(complete)],  # a complete one: loaded, the variants run
                 ["--load-warmup", str(complete)],
                 ["--save-warmup", str(complete), "--warmup-until", "2"]):  # complete: replaced
        assert _errors(tiny, _RETRIEVAL + argv) == [], argv
    assert _errors(tiny, _RETRIEVAL + ["--cp", "2", "--resume-warmup", str(cp2)], world=2) == []
    tp2 = _errors(tiny, _RETRIEVAL + ["--tp", "2", "--resume-warmup", str(cp2)], world=2)
    assert any("cp=2/1, tp=1/2" in e for e in tp2), tp2


def test_bad_warmup_directory_exits_with_one_line_and_no_traceback(tmp_path):
    """Not --check-only: the real start refuses before any process group (was: a traceback
    from inside the run after the model was built)."""
    (tmp_path / "empty").mkdir()
    proc = _run_example(*_RETRIEVAL, "--resume-warmup", str(tmp_path / "empty"), "--out-dir",
                        str(tmp_path / "out"), world="1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "has no warmup_rank000_of001.pt" in proc.stderr and "Traceback" not in proc.stderr
    assert "world " not in proc.stdout


@pytest.mark.parametrize("argv,needle", [
    (["--task", "text", "--task-curriculum-gate", "1.0", "--task-len-min", "32"],
     "--task-len-min 32, --task-curriculum-gate 1.0: flags of the retrieval task, which --task "
     "text does not read"),
    (["--task", "text", "--task-curriculum-span", "9"], "--task-curriculum-span 9: flags of "),
    (["--task", "text", "--pairs", "8", "--value-vocab", "8"],
     "--pairs 8, --value-vocab 8: flags of the retrieval task"),
    (["--task", "text", "--record-format", "fused"], "--record-format fused: flags of the "),
    (["--task", "text", "--eval-interval", "100"], "--eval-interval 100: flags of the "),
    ([*_RETRIEVAL, "--task-curriculum-gate", "nan"], "--task-curriculum-gate (nan) must be a "
                                                     "finite number"),
    ([*_RETRIEVAL, "--task-len-min", "256"], "but both are 256"),
    ([*_RETRIEVAL, "--warmup-steps", "0"], "--task-curriculum-gate (3.0) grows the training "
                                           "length during the dense warm-up, but "
                                           "--warmup-steps is 0"),
    ([*_RETRIEVAL, "--task-curriculum-span", "6"], "--task-curriculum-span (6) must be shorter "
                                                   "than --warmup-steps (6)"),
    ([*_RETRIEVAL, "--task-curriculum-gate", "0", "--task-curriculum-span", "10"],
     "--task-curriculum-span (10) is the window of --task-curriculum-gate, which is not given"),
])
def test_curriculum_flags_that_would_do_nothing_are_refused(tiny, capsys, argv, needle):
    with pytest.raises(SystemExit) as exit_info:
        tiny.parse_args(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and needle in err, err
    assert err.count("\n") == 1 and "usage:" not in err  # one line, not the usage block


def test_every_retrieval_flag_is_refused_or_read_by_the_text_task(tiny):
    """A flag added to the retrieval group is either refused with --task text (RETRIEVAL_ONLY)
    or read by the text task too; none is silently ignored."""
    parser = tiny.build_parser()
    group = next(g for g in parser._action_groups if g.title.startswith("retrieval task"))
    dests = {a.dest for a in group._group_actions}
    shared = {"probe_rows"}  # the text task's recall probe reads it
    assert dests - shared == set(tiny.retrieval_task.RETRIEVAL_ONLY)


def test_quick_retrieval_sizes_fit_and_explicit_flags_win(tiny):
    """--quick shrinks the retrieval task to its 256-token windows (it was always refused);
    flags given explicitly win; --task text leaves the retrieval sizes unset."""
    args = tiny.parse_args(["--device", "cpu", "--quick", "--task", "retrieval"])
    assert (args.pairs, args.queries, args.key_vocab, args.min_distance) == (8, 4, 8, 64)
    assert tiny.check_settings(args, 1) == []
    args = tiny.parse_args(["--device", "cpu", "--quick", "--task", "retrieval", "--pairs", "6"])
    assert args.pairs == 6 and args.queries == 4
    full = tiny.parse_args(["--device", "cpu", "--task", "retrieval", "--seq-len", "8192"])
    assert (full.pairs, full.queries, full.key_vocab, full.min_distance) == (64, 32, 256, 1024)
    assert tiny.parse_args(["--device", "cpu", "--quick"]).pairs is None


@pytest.mark.parametrize("extra,forced", [([], 1), (["--init-blocks", "1"], 2),
                                          (["--init-blocks", "1", "--local-blocks", "2"], 3)])
def test_local_variant_keeps_the_forced_blocks(tiny, extra, forced):
    """``local`` selects the forced blocks only: with a sink or more local blocks its top-k is
    theirs (a top-k of 1 below them made MSAConfig refuse after the warm-up had trained)."""
    args = tiny.parse_args(["--top-k", "4", *extra])
    assert tiny.variant_args(args, "local").top_k == forced
    assert tiny.variant_args(args, "msa").top_k == 4
    config = tiny.msa_config(tiny.variant_args(args, "local"))  # accepted by MSAConfig
    assert config.top_k == config.init_blocks + config.local_blocks == forced
