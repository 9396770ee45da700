"""``examples/pretrain_tiny.py --init-weights DIR`` (length extension): a run's dense warm-up
starts from the weights of another warm-up (saved by ``--save-warmup`` at another length), with
a fresh optimizer, step 0 and its own data; the ``random`` variant still gets a random index.

The weight tests run ``run_variants`` in one gloo rank with the training steps replaced by a
recorder (what the model and optimizer hold when each training phase starts); nothing trains.
The flag checks run in-process (``check_settings``) and once as a ``--check-only`` process.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "pretrain_tiny.py"
GUARD_S = 300  # subprocess guard only

# The 32K-like run (here 512 tokens) and the 8K-like source (256 tokens, another RoPE base,
# learning rate and schedule): the same model shape, so the source's weights serve.
_RUN = ["--device", "cpu", "--task", "retrieval", "--record-format", "fused", "--steps", "8",
        "--warmup-steps", "6", "--seq-len", "512", "--task-len", "512", "--layers", "1",
        "--hidden", "64", "--ffn-hidden", "128", "--heads", "2", "--query-groups", "2",
        "--block-size", "16", "--top-k", "3", "--index-head-dim", "32", "--pairs", "8",
        "--queries", "4", "--key-vocab", "8", "--min-distance", "64", "--dtype", "fp32"]
_SOURCE_CHANGES = ["--seq-len", "256", "--task-len", "256", "--rotary-base", "500000",
                   "--lr", "0.003", "--steps", "5", "--warmup-steps", "3"]


def _load_example():
    spec = importlib.util.spec_from_file_location("pretrain_tiny_init_weights_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    if str(EXAMPLE.parent) not in sys.path:
        sys.path.insert(0, str(EXAMPLE.parent))  # its sibling modules, as when run as a script
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    module = _load_example()
    yield module
    sys.modules.pop(module.__name__, None)


def _errors(tiny, argv, world=1):
    return tiny.check_settings(tiny.parse_args(argv), world)


def _fake_warmup(tiny, directory, argv=(), step=3, **settings):
    """A warm-up directory as save_warmup writes it (settings and step; no weights)."""
    saved = tiny.warmup_settings(tiny.parse_args(_RUN + list(argv)))
    saved.update(settings)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"settings": saved, "model": {}, "optimizer": {}, "history": {}, "step": step,
                "data": None}, directory / "warmup_rank000_of001.pt")
    return directory


# --- the weights, in one gloo rank -----------------------------------------------------------


def _same(a, b) -> bool:
    """Lists of tensors (or of the None / bytes values of ``_extra_state`` entries) alike."""
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _init_weights_worker(rank, world_size, tmp: str):
    tiny = _load_example()
    cpu = torch.device("cpu")
    tmp = Path(tmp)
    # The source: a partial warm-up (step 2 of 3) at another length, whose weights and optimizer
    # state differ from a fresh build's (one AdamW step on random gradients).
    source_args = tiny.parse_args(_RUN + _SOURCE_CHANGES + ["--save-warmup", str(tmp / "8k")])
    source = tiny.build_model(source_args, cpu)
    source_optimizer = torch.optim.AdamW(source.parameters(), lr=0.1)
    torch.manual_seed(7)
    for param in source.parameters():
        param.grad = torch.randn_like(param)
    source_optimizer.step()
    tiny.save_warmup(source_args, source, source_optimizer, tiny.History("warmup"), 2, [])
    source_state = copy.deepcopy(source.state_dict())
    source_index = [p.detach().clone() for p in tiny.index_branch_parameters(source)]

    calls = []

    def record(history, model, optimizer, args, device, steps, mode, *rest, **kwargs):
        state = model.state_dict()
        calls.append({
            "mode": mode, "steps": list(steps), "history_steps": list(history.steps),
            "optimizer_state": len(optimizer.state),
            "equals_source": sorted(state) == sorted(source_state)
            and _same([state[k] for k in sorted(state)],
                      [source_state[k] for k in sorted(state)]),
            "index": [p.detach().clone() for p in tiny.index_branch_parameters(model)]})
        return steps.stop

    tiny.train_steps = record  # run_variants looks both up in the module
    tiny.finish = lambda *args, **kwargs: None
    argv = _RUN + ["--init-weights", str(tmp / "8k"), "--runs", "msa,random"]
    args = tiny.parse_args(argv)
    errors = tiny.check_settings(args, world_size)
    fresh_index = [p.detach().clone()
                   for p in tiny.index_branch_parameters(tiny.build_model(args, cpu))]
    tiny.run_variants(args, cpu, [], [])
    result = {"errors": errors, "source_index_trained": not _same(source_index, fresh_index)}
    for call, name in zip(calls, ("warmup", "msa", "random")):
        result[name] = {k: v for k, v in call.items() if k != "index"}
        result[name]["index_is_fresh"] = _same(call["index"], fresh_index)
        result[name]["index_is_source"] = _same(call["index"], source_index)
    result["calls"] = len(calls)

    # One link of the 32K warm-up saved, then resumed with and without --init-weights.
    calls.clear()
    link = tiny.parse_args(argv + ["--save-warmup", str(tmp / "32k"), "--warmup-until", "2"])
    tiny.run_variants(link, cpu, [], [])
    saved = torch.load(tmp / "32k" / "warmup_rank000_of001.pt", weights_only=True)
    result["saved_init"] = saved["settings"]["init_weights"]
    resumed = tiny.parse_args(_RUN + ["--resume-warmup", str(tmp / "32k"), "--save-warmup",
                                      str(tmp / "32k"), "--warmup-until", "4"])
    result["resume_errors"] = tiny.check_settings(resumed, world_size)
    model = tiny.build_model(resumed, cpu)
    optimizer = torch.optim.AdamW(model.parameters())
    tiny.load_warmup(resumed, model, optimizer)
    result["resumed_init"] = str(resumed.init_weights)
    result["metrics_init"] = tiny.metrics_record(resumed, [])["args"]["init_weights"]
    return result


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("init_weights")
    return run_distributed(_init_weights_worker, 1, args=(str(tmp),), tp=1, device="cpu")[0], tmp


def test_warmup_starts_from_the_source_weights_with_a_fresh_optimizer(worker):
    result, _ = worker
    assert result["errors"] == []  # another length, RoPE base, lr and schedule: accepted
    assert result["calls"] == 3
    warmup = result["warmup"]
    assert warmup["mode"] == "dense" and warmup["steps"] == list(range(6))  # step 0, own run
    assert warmup["equals_source"]  # every weight, before the first step
    assert warmup["optimizer_state"] == 0  # the source's AdamW moments were not loaded
    assert warmup["history_steps"] == []


def test_random_variant_gets_a_fresh_index_and_msa_the_trained_one(worker):
    result, _ = worker
    assert result["source_index_trained"]  # else the comparisons below could not tell
    assert result["msa"]["index_is_source"] and not result["msa"]["index_is_fresh"]
    assert result["random"]["index_is_fresh"] and not result["random"]["index_is_source"]


def test_init_source_is_saved_and_passed_on_by_a_resume_without_the_flag(worker):
    result, tmp = worker
    assert result["saved_init"] == str(tmp / "8k")
    assert result["resume_errors"] == []  # resumed without repeating --init-weights
    assert result["resumed_init"] == str(tmp / "8k") == result["metrics_init"]


# --- the checks before any process starts ----------------------------------------------------


def test_init_weights_accepts_any_task_length_or_schedule_of_the_same_shape(tiny, tmp_path):
    source = _fake_warmup(tiny, tmp_path / "8k", _SOURCE_CHANGES + ["--key-vocab", "9"], step=1)
    assert _errors(tiny, _RUN + ["--init-weights", str(source)]) == []
    args = tiny.parse_args(_RUN + ["--init-weights", str(source)])
    assert tiny.metrics_record(args, [])["args"]["init_weights"] == str(source)


@pytest.mark.parametrize("argv,differ", [
    (["--hidden", "128", "--ffn-hidden", "256"], "ffn_hidden=256/128, hidden=128/64"),
    (["--layers", "2"], "layers=2/1"),
    (["--index-head-dim", "64"], "index_head_dim=64/32"),
    (["--value-vocab", "300"], "vocab_size=3072/640; vocab_size (the embedding and output rows) "
     "follows --task and, for --task retrieval, --key-vocab, --value-vocab and --record-format"),
])
def test_another_model_shape_is_refused_naming_the_settings(tiny, tmp_path, argv, differ):
    source = _fake_warmup(tiny, tmp_path / "other", argv)
    errors = _errors(tiny, _RUN + ["--init-weights", str(source)])
    assert errors == [f"--init-weights {source} holds a model of another shape (saved, now): "
                      f"{differ}"]


def test_another_layout_is_refused(tiny, tmp_path):
    source = _fake_warmup(tiny, tmp_path / "tp", cp=2)  # the settings of a CP 2 save
    assert any("cp=2/1" in e for e in _errors(tiny, _RUN + ["--init-weights", str(source)]))
    two = _errors(tiny, _RUN + ["--cp", "2", "--init-weights", str(source)], world=2)
    assert any("saved by 1 process (warmup_rank*_of001.pt), not by 2" in e for e in two), two


def test_init_weights_with_load_warmup_or_its_own_save_dir_is_refused(tiny, tmp_path):
    source = _fake_warmup(tiny, tmp_path / "8k")
    complete = _fake_warmup(tiny, tmp_path / "complete", step=6)
    errors = _errors(tiny, _RUN + ["--init-weights", str(source), "--load-warmup", str(complete)])
    assert any("--init-weights and --load-warmup exclude each other" in e for e in errors), errors
    errors = _errors(tiny, _RUN + ["--init-weights", str(source), "--save-warmup", str(source)])
    assert any("would overwrite the one it starts from" in e for e in errors), errors
    errors = _errors(tiny, _RUN + ["--init-weights", str(tmp_path / "none")])
    assert errors == [f"--init-weights {tmp_path / 'none'} is not a directory"]


def test_resume_checks_the_recorded_init_source(tiny, tmp_path):
    source = tmp_path / "8k"  # need not exist any more: a resume does not read it
    started = _fake_warmup(tiny, tmp_path / "32k", ["--init-weights", str(source)])
    scratch = _fake_warmup(tiny, tmp_path / "scratch")
    resume = ["--resume-warmup", str(started), "--save-warmup", str(started)]
    assert _errors(tiny, _RUN + resume + ["--init-weights", str(source)]) == []
    assert _errors(tiny, _RUN + resume) == []
    other = _errors(tiny, _RUN + resume + ["--init-weights", str(tmp_path / "16k")])
    assert other == [f"--resume-warmup {started} was saved with other settings (saved, now): "
                     f"init_weights={str(source)!r}/{str(tmp_path / '16k')!r}"]
    fresh = _errors(tiny, _RUN + ["--resume-warmup", str(scratch), "--init-weights", str(source)])
    assert any(f"init_weights=None/{str(source)!r}" in e for e in fresh), fresh


def test_check_only_reports_a_shape_mismatch(tiny, tmp_path):
    source = _fake_warmup(tiny, tmp_path / "wide", ["--hidden", "128", "--ffn-hidden", "256"])
    env = dict(os.environ, WORLD_SIZE="1", RANK="0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(EXAMPLE), *_RUN, "--init-weights", str(source),
                           "--check-only", "--out-dir", str(tmp_path / "out")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "holds a model of another shape (saved, now): ffn_hidden=256/128" in proc.stderr
    assert "settings OK" not in proc.stdout and "Traceback" not in proc.stderr


# --- what is compared: the resolved values, not the flags as spelt -----------------------------


def test_init_weights_spelt_otherwise_is_the_same_directory(tiny, tmp_path, monkeypatch):
    """``8k``, ``./8k`` and the absolute path name one directory: a resume that repeats
    --init-weights in another spelling is accepted; what is saved stays as given."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "8k").mkdir()
    for saved_as, given in (("8k", "./8k"), ("8k", str(tmp_path / "8k")),
                            (str(tmp_path / "8k"), "8k"), ("./8k", "8k/")):
        started = _fake_warmup(tiny, tmp_path / "32k", ["--init-weights", saved_as])
        resume = ["--resume-warmup", str(started), "--save-warmup", str(started)]
        assert _errors(tiny, _RUN + resume + ["--init-weights", given]) == [], (saved_as, given)
    saved = torch.load(started / "warmup_rank000_of001.pt", weights_only=True)
    assert saved["settings"]["init_weights"] == "8k"  # readable: as given (pathlib's "./8k")
    other = _errors(tiny, _RUN + resume + ["--init-weights", "16k"])
    assert other == [f"--resume-warmup {started} was saved with other settings (saved, now): "
                     "init_weights='8k'/'16k'"]


def test_index_heads_left_at_the_default_equals_its_resolved_value(tiny, tmp_path):
    """No --index-heads resolves to one index head per KV group (here 2): a warm-up saved with
    --index-heads 2 serves a run without it, and the other way round; 4 does not."""
    given = _fake_warmup(tiny, tmp_path / "given", ["--index-heads", "2"], step=6)
    default = _fake_warmup(tiny, tmp_path / "default", step=6)
    assert _errors(tiny, _RUN + ["--init-weights", str(given)]) == []
    assert _errors(tiny, _RUN + ["--load-warmup", str(given)]) == []
    assert _errors(tiny, _RUN + ["--index-heads", "2", "--init-weights", str(default)]) == []
    assert _errors(tiny, _RUN + ["--index-heads", "2", "--load-warmup", str(default)]) == []
    four = _fake_warmup(tiny, tmp_path / "four", step=6, index_heads=4)
    assert _errors(tiny, _RUN + ["--load-warmup", str(four)]) == [
        f"--load-warmup {four} was saved with other settings (saved, now): index_heads=4/2"]


def test_unset_index_heads_follow_the_config_rule(tiny, monkeypatch):
    """The default number of index heads is MSAConfig.resolved_index_heads' rule, read from
    there (not restated by the example): a changed rule changes what a saved warm-up's unset
    index_heads compares as."""
    settings = {"index_heads": None, "query_groups": 2}
    assert tiny.resolved_setting(settings, "index_heads") == 2
    assert tiny.resolved_setting({"index_heads": 4, "query_groups": 2}, "index_heads") == 4
    monkeypatch.setattr(tiny.MSAConfig, "resolved_index_heads",
                        lambda self, groups: 3 * groups)
    assert tiny.resolved_setting(settings, "index_heads") == 6


@pytest.mark.parametrize("flag,step,extra", [
    ("--init-weights", 3, []), ("--load-warmup", 6, []),
    ("--resume-warmup", 3, ["--save-warmup", "{dir}"])])
def test_another_vocabulary_is_refused_for_every_flag(tiny, tmp_path, flag, step, extra):
    source = _fake_warmup(tiny, tmp_path / "vocab", ["--value-vocab", "300"], step=step)
    errors = _errors(tiny, _RUN + [flag, str(source)]
                     + [e.format(dir=source) for e in extra])
    assert len(errors) == 1 and "vocab_size=3072/640" in errors[0], errors
    assert errors[0].startswith(f"{flag} {source} "), errors
    assert "follows --task and, for --task retrieval, --key-vocab, --value-vocab" in errors[0]


# --- tensors that do not fit, found when the file is loaded -------------------------------------


def _misfit_worker(rank, world_size, tmp: str):
    tiny = _load_example()
    cpu = torch.device("cpu")
    tmp = Path(tmp)
    result = {}
    # A warm-up of --index-head-dim 32 whose saved settings claim 64 (what no settings check can
    # catch: an edited or mislabelled file): the tensors of the index branch do not fit.
    narrow = tiny.parse_args(_RUN + ["--save-warmup", str(tmp / "narrow")])
    model = tiny.build_model(narrow, cpu)
    tiny.save_warmup(narrow, model, torch.optim.AdamW(model.parameters()),
                     tiny.History("warmup"), 6, [])
    path = tmp / "narrow" / "warmup_rank000_of001.pt"
    state = torch.load(path, weights_only=True)
    state["settings"]["index_head_dim"] = 64
    torch.save(state, path)
    wide = tiny.parse_args(_RUN + ["--index-head-dim", "64", "--init-weights",
                                   str(tmp / "narrow")])
    result["init_check"] = tiny.check_settings(wide, world_size)
    for flag in ("--init-weights", "--load-warmup"):
        args = tiny.parse_args(_RUN + ["--index-head-dim", "64", flag, str(tmp / "narrow")])
        model = tiny.build_model(args, cpu)
        try:
            if flag == "--init-weights":
                tiny.load_init_weights(args, model)
            else:
                tiny.load_warmup(args, model, torch.optim.AdamW(model.parameters()))
            result[flag] = None
        except Exception as error:  # noqa: BLE001 -- the test names the type
            result[flag] = (type(error).__name__, isinstance(error, ValueError), str(error))
    # Another vocabulary, saved honestly: refused by the settings, before any tensor.
    vocab = tiny.parse_args(_RUN + ["--value-vocab", "300", "--save-warmup", str(tmp / "vocab")])
    model = tiny.build_model(vocab, cpu)
    tiny.save_warmup(vocab, model, torch.optim.AdamW(model.parameters()),
                     tiny.History("warmup"), 6, [])
    args = tiny.parse_args(_RUN + ["--init-weights", str(tmp / "vocab")])
    try:
        tiny.load_init_weights(args, tiny.build_model(args, cpu))
        result["vocab"] = None
    except Exception as error:  # noqa: BLE001
        result["vocab"] = (type(error).__name__, isinstance(error, ValueError), str(error))
    return result


@pytest.fixture(scope="module")
def misfit(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misfit")
    return run_distributed(_misfit_worker, 1, args=(str(tmp),), tp=1, device="cpu")[0], tmp


@pytest.mark.parametrize("flag", ["--init-weights", "--load-warmup"])
def test_tensors_that_do_not_fit_name_the_flag_directory_and_shapes(misfit, flag):
    result, tmp = misfit
    assert result["init_check"] == []  # the (edited) settings agree: only the tensors tell
    kind, is_value_error, message = result[flag]
    assert is_value_error, result[flag]
    assert message.startswith(f"{flag} {tmp / 'narrow'}: "), message
    assert "do not fit the model" in message and "size mismatch" not in message
    # a parameter of the index branch, with the saved and the model's shapes
    assert "(32, 64)/(64, 64)" in message, message
    assert message.count("/(") <= 4 + message.count("missing")  # the first few only


def test_another_vocabulary_is_refused_by_the_loader_before_the_tensors(misfit):
    result, tmp = misfit
    kind, is_value_error, message = result["vocab"]
    assert is_value_error and "vocab_size=3072/640" in message, message
    assert message.startswith(f"--init-weights {tmp / 'vocab'} "), message


def test_the_script_reports_tensors_that_do_not_fit_like_the_settings_checks(misfit, tmp_path):
    """Run as a script: the misfit found on load ends the run with the invalid-settings lines
    and exit status 2, not a load_state_dict traceback."""
    import socket

    result, tmp = misfit
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, str(EXAMPLE), *_RUN, "--index-head-dim", "64",
                           "--load-warmup", str(tmp / "narrow"), "--out-dir",
                           str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=GUARD_S)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("pretrain_tiny.py: invalid settings, nothing was started:\n  - --load-warmup "
            f"{tmp / 'narrow'}: ") in proc.stderr, proc.stderr[-2000:]
    assert "do not fit the model" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "metrics.json").exists()
