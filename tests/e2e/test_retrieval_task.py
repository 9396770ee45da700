"""The retrieval task of the tiny example: generator invariants, and a CPU smoke run of
``examples/pretrain_tiny.py --task retrieval`` (it runs and reports its metrics; no accuracy
bar: learning the task takes a GPU, see README's GPU section)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import retrieval_task  # noqa: E402

SPEC = retrieval_task.RetrievalSpec(length=512, pairs=12, queries=5, min_distance=200,
                                    key_vocab=40, value_vocab=9)


def test_sequences_hold_records_and_questions():
    seqs = retrieval_task.sequences(SPEC, iter([b"x" * 10 ** 6]), seed=3)
    for _ in range(5):
        s = next(seqs)
        tokens = s.tokens.tolist()
        assert len(tokens) == SPEC.length
        keys = [t for t in tokens if 256 <= t < 256 + SPEC.key_vocab]
        assert len(keys) == SPEC.pairs + SPEC.queries  # every record, then every question
        record_keys = keys[:SPEC.pairs]
        assert len(set(record_keys)) == SPEC.pairs  # distinct keys
        assert len(s.answer_pos) == SPEC.queries * SPEC.value_len
        for q, (first, last) in enumerate(s.record_span):
            answer = s.answer_pos[q * SPEC.value_len]
            assert tokens[answer] == tokens[first]  # the question repeats the record's key
            assert tokens[answer + 1:answer + 1 + SPEC.value_len] == tokens[first + 1:last + 1]
            assert answer - last >= SPEC.min_distance
            assert all(256 + SPEC.key_vocab <= t < SPEC.vocab_size
                       for t in tokens[first + 1:last + 1])


def test_fused_records_answer_in_one_hop():
    """Fused format: each record is one token naming (key, value); the question's key and its
    label (the value) are determined by exactly one earlier record token of the sequence."""
    spec = retrieval_task.RetrievalSpec(**{**SPEC.__dict__, "record_format": "fused"})
    assert spec.vocab_size == 256 + 40 + 9 + 40 * 9 and spec.record_len == 1
    first_record = 256 + spec.key_vocab + spec.value_vocab
    seqs = retrieval_task.sequences(spec, iter([b"x" * 10 ** 6]), seed=5)
    for _ in range(5):
        s = next(seqs)
        tokens = s.tokens.tolist()
        records = {(t - first_record) // spec.value_vocab: (t - first_record) % spec.value_vocab
                   for t in tokens if first_record <= t < spec.vocab_size}
        assert len(records) == spec.pairs
        assert sum(first_record <= t for t in tokens) == spec.pairs  # one token per record
        for q, (first, last) in enumerate(s.record_span):
            answer = s.answer_pos[q]
            assert first == last and first_record <= tokens[first] < spec.vocab_size
            key = tokens[answer] - 256
            assert 0 <= key < spec.key_vocab
            assert tokens[first] == spec.record_token(key, records[key])
            assert tokens[answer + 1] == 256 + spec.key_vocab + records[key]  # the label
            assert answer - last >= spec.min_distance
    with pytest.raises(ValueError, match="one value token"):
        retrieval_task.RetrievalSpec(**{**SPEC.__dict__, "record_format": "fused",
                                        "value_len": 2}).check()
    with pytest.raises(ValueError, match="record-format"):
        retrieval_task.RetrievalSpec(**{**SPEC.__dict__, "record_format": "triple"}).check()


def test_generator_is_seeded():
    a = next(retrieval_task.sequences(SPEC, iter([b"y" * 10 ** 5]), seed=7))
    b = next(retrieval_task.sequences(SPEC, iter([b"y" * 10 ** 5]), seed=7))
    c = next(retrieval_task.sequences(SPEC, iter([b"y" * 10 ** 5]), seed=8))
    assert a.tokens.tolist() == b.tokens.tolist() and a.tokens.tolist() != c.tokens.tolist()


@pytest.mark.parametrize("change,message", [
    (dict(queries=13), "must not exceed"),
    (dict(pairs=41, queries=5), "distinct keys"),
    (dict(min_distance=600), "cannot hold"),
    (dict(value_vocab=1), r"--value-vocab \(1\) must be >= 2"),  # chance level 1.0
])
def test_spec_rejects_what_cannot_fit(change, message):
    spec = retrieval_task.RetrievalSpec(**{**SPEC.__dict__, **change})
    with pytest.raises(ValueError, match=message):
        spec.check()


@pytest.mark.slow
def test_example_runs_retrieval_task_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(29000 + random.randrange(900)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # pretrain_tiny's main with its metrics records counted: one per variant (metrics.json is
    # written after each), and none more for the printed table (it reuses the last one)
    counted = ("import sys; sys.path.insert(0, 'examples'); import pretrain_tiny as tiny\n"
               "built, record = [], tiny.metrics_record\n"
               "tiny.metrics_record = lambda *a: built.append(1) or record(*a)\n"
               "status = tiny.main(sys.argv[1:])\n"
               "print(f'metrics records built: {len(built)}'); sys.exit(status)")
    cmd = [sys.executable, "-c", counted, "--device", "cpu",
           "--task", "retrieval", "--runs", "msa,random", "--steps", "4", "--warmup-steps", "2",
           "--seq-len", "512", "--task-len", "256", "--layers", "2", "--hidden", "64",
           "--ffn-hidden", "128", "--heads", "2", "--query-groups", "2", "--block-size", "16",
           "--top-k", "3", "--index-head-dim", "32", "--pairs", "8", "--queries", "4",
           "--min-distance", "64", "--eval-windows", "1", "--eval-interval", "2",
           "--log-interval", "1", "--probe-rows", "16", "--task-len-min", "64",
           "--task-curriculum", "2", "--rotary-base", "500000", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((tmp_path / "metrics.json").read_text())
    runs = {run["name"]: run for run in record["runs"]}
    assert set(runs) == {"msa", "random"}
    for run in runs.values():
        r = run["retrieval"]
        assert r["questions"] == 2 * 4  # two sequences of 256 tokens per window
        assert 0.0 <= r["exact_match"] <= 1.0 and math.isfinite(r["answer_loss"])
        assert 0.0 < r["recall"] <= 1.0 + 1e-6 and 0.0 <= r["key_hit"] <= 1.0
        assert len(r["recall_per_layer"]) == 2 and set(r["distance_histogram"]) == {
            "layer_01", "layer_02"}
        assert run["probe_steps"] == [1, 2, 3, 4] and run["eval_steps"] == [2, 4]
        assert all(len(v) == 2 for v in run["key_hit_per_layer"])
        assert len(run["answer_loss"]) == 4 and all(0 < v < 20 for v in run["answer_loss"])
    assert record["args"]["rotary_base"] == 500000 and "answer loss" in proc.stdout
    # the table of examples/retrieval_report.py (pretrain_tiny keeps no twin of it)
    assert "| MSA, KL-trained index |" in proc.stdout and "| exact match |" in proc.stdout
    assert "| MSA, frozen random index |" in proc.stdout and "L2 best" in proc.stdout
    assert "metrics records built: 2" in proc.stdout


@pytest.mark.slow
def test_variant_from_a_saved_warmup_continues_the_same_run(tmp_path):
    """--save-warmup then --load-warmup in a second process: the variant's steps equal those of
    the variant trained in the saving process; other settings are refused."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    common = [sys.executable, str(REPO / "examples" / "pretrain_tiny.py"), "--device", "cpu",
              "--task", "retrieval", "--record-format", "fused", "--steps", "5",
              "--warmup-steps", "3", "--seq-len", "256", "--task-len", "256", "--layers", "1",
              "--hidden", "64", "--ffn-hidden", "128", "--heads", "2", "--query-groups", "2",
              "--block-size", "16", "--top-k", "3", "--index-head-dim", "32", "--pairs", "8",
              "--queries", "4", "--key-vocab", "8", "--min-distance", "64", "--eval-windows", "1",
              "--log-interval", "1", "--probe-interval", "0", "--dtype", "fp32"]

    def run(*extra, port):
        env["MASTER_PORT"] = str(port)
        return subprocess.run(common + list(extra), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)

    port = 29000 + random.randrange(800)
    saved = tmp_path / "warmup"
    first = run("--runs", "msa,random", "--save-warmup", str(saved), "--out-dir",
                str(tmp_path / "a"), port=port)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = run("--runs", "random", "--load-warmup", str(saved), "--out-dir",
                 str(tmp_path / "b"), port=port + 1)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    a = {r["name"]: r for r in json.loads((tmp_path / "a" / "metrics.json").read_text())["runs"]}
    b = {r["name"]: r for r in json.loads((tmp_path / "b" / "metrics.json").read_text())["runs"]}
    assert b["random"]["steps"] == a["random"]["steps"] == [1, 2, 3, 4, 5]
    assert b["random"]["loss"] == a["random"]["loss"]  # the same run, bitwise (CPU, fp32)
    assert a["msa"]["loss"][3:] != a["random"]["loss"][3:]  # the variants do differ
    other = run("--runs", "random", "--load-warmup", str(saved), "--steps", "6", "--lr", "1e-2",
                "--out-dir", str(tmp_path / "c"), port=port + 2)
    assert other.returncode != 0 and "saved with other settings" in other.stderr
    assert "lr=" in other.stderr and "steps=" in other.stderr  # --steps sets the lr schedule


@pytest.mark.slow
def test_chained_warmup_equals_an_uninterrupted_one(tmp_path):
    """A warm-up split over three processes (--warmup-seconds, then --warmup-until, then the
    rest with the variant) trains exactly the steps of an uninterrupted run: same losses
    bitwise (CPU, fp32), through a length curriculum and mixed-length windows, so the model,
    optimizer, learning-rate schedule, data position and curriculum all continue."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    common = [sys.executable, str(REPO / "examples" / "pretrain_tiny.py"), "--device", "cpu",
              "--task", "retrieval", "--record-format", "fused", "--steps", "8",
              "--warmup-steps", "6", "--seq-len", "512", "--task-len", "256",
              "--task-len-min", "32", "--task-curriculum", "5", "--layers", "1",
              "--hidden", "64", "--ffn-hidden", "128", "--heads", "2", "--query-groups", "2",
              "--block-size", "16", "--top-k", "3", "--index-head-dim", "32", "--pairs", "8",
              "--queries", "4", "--key-vocab", "8", "--min-distance", "64", "--eval-windows",
              "1", "--eval-interval", "2", "--log-interval", "1", "--probe-interval", "0",
              "--dtype", "fp32", "--lr-warmup", "2", "--runs", "dense"]
    port = 29000 + random.randrange(800)

    def run(*extra):
        nonlocal port
        port += 1
        env["MASTER_PORT"] = str(port)
        proc = subprocess.run(common + list(extra), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        return proc

    whole = run("--save-warmup", str(tmp_path / "whole"), "--out-dir", str(tmp_path / "a"))
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    chain = tmp_path / "chain"
    first = run("--save-warmup", str(chain), "--warmup-seconds", "1e-6", "--out-dir",
                str(tmp_path / "b"))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "step 1 of 6" in first.stdout and not (tmp_path / "b" / "metrics.json").exists()
    partial = run("--runs", "dense", "--load-warmup", str(chain), "--out-dir",
                  str(tmp_path / "x"))
    assert partial.returncode != 0 and "--resume-warmup" in partial.stderr
    second = run("--resume-warmup", str(chain), "--save-warmup", str(chain), "--warmup-until",
                 "4", "--out-dir", str(tmp_path / "b"))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "loaded the warm-up (step 1 of 6)" in second.stdout and "step 4 of 6" in second.stdout
    last = run("--resume-warmup", str(chain), "--save-warmup", str(chain), "--out-dir",
               str(tmp_path / "b"))
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    a = json.loads((tmp_path / "a" / "metrics.json").read_text())["runs"][0]
    b = json.loads((tmp_path / "b" / "metrics.json").read_text())["runs"][0]
    assert a["steps"] == b["steps"] == list(range(1, 9))
    assert b["loss"] == a["loss"] and b["answer_loss"] == a["answer_loss"]  # bitwise
    assert b["eval_steps"] == a["eval_steps"] == [2, 4, 6, 8]
    assert b["eval_exact_match"] == a["eval_exact_match"]
    assert b["retrieval"] == a["retrieval"]
    # the completed chain is a warm-up like any other: the variants start from it
    variant = run("--runs", "random", "--load-warmup", str(chain), "--out-dir",
                  str(tmp_path / "c"))
    reference = run("--runs", "random", "--load-warmup", str(tmp_path / "whole"), "--out-dir",
                    str(tmp_path / "d"))
    assert variant.returncode == 0 and reference.returncode == 0, variant.stderr[-3000:]
    c = json.loads((tmp_path / "c" / "metrics.json").read_text())["runs"][0]
    d = json.loads((tmp_path / "d" / "metrics.json").read_text())["runs"][0]
    assert c["loss"] == d["loss"] and c["loss"][6:] != a["loss"][6:]


def test_window_stream_resumes_where_its_state_was_taken():
    """The retrieval window generator restarts from a saved state (no earlier window built)
    with exactly the windows it would have produced; the slow way (no state) agrees."""
    import torch

    tiny = _load_example()
    try:
        args = tiny.parse_args(["--device", "cpu", "--task", "retrieval", "--steps", "30",
                                "--seq-len", "2048", "--task-len", "1024", "--task-len-min",
                                "32", "--task-curriculum", "12", "--pairs", "16", "--queries",
                                "16", "--key-vocab", "16", "--record-format", "fused",
                                "--min-distance", "128", "--block-size", "32"])
        files = tiny.split_files(tiny.stdlib_files(), args.seed)["train"][:6]  # cycles often
        reference = tiny.take_retrieval_windows(files, args, 30, seed=7, mixed=True)
        expected = [reference[i] for i in range(30)]
        saver = tiny.take_retrieval_windows(files, args, 30, seed=7, mixed=True)
        state = saver.state_at(17)
        with pytest.raises(ValueError, match="built already"):
            saver.state_at(3)
        for how in (state, None):
            resumed = tiny.take_retrieval_windows(files, args, 30, seed=7, mixed=True)
            resumed.resume(17, how)
            with pytest.raises(IndexError, match="resumed at 17"):
                resumed[16]
            for i in range(17, 30):
                assert torch.equal(resumed[i].tokens, expected[i].tokens)
                assert resumed[i].seq_lens == expected[i].seq_lens
                assert resumed[i].answers == expected[i].answers
        assert len({tuple(w.seq_lens) for w in expected[17:]}) > 1
    finally:
        sys.modules.pop("pretrain_tiny_retrieval_test", None)


def test_gated_curriculum_grows_only_when_the_answers_are_learned():
    """--task-curriculum-gate: the warm-up's longest length starts at --task-len-min and
    doubles only after --task-curriculum-span steps of answer loss below the gate; the state
    survives a save / restore; after the warm-up every window has the full range."""
    tiny = _load_example()
    try:
        argv = ["--device", "cpu", "--task", "retrieval", "--steps", "40", "--warmup-steps",
                "30", "--seq-len", "4096", "--task-len", "1024", "--task-len-min", "64",
                "--task-curriculum-gate", "1.0", "--task-curriculum-span", "3", "--pairs", "32",
                "--queries", "32", "--key-vocab", "32", "--record-format", "fused",
                "--min-distance", "256", "--block-size", "32"]
        args = tiny.parse_args(argv)
        files = tiny.split_files(tiny.stdlib_files(), args.seed)["train"][:30]
        windows = tiny.take_retrieval_windows(files, args, 40, seed=3, mixed=True)

        def longest(step):
            return max(windows[step].seq_lens[:-1])  # the last one takes what is left

        grown = []
        for step, loss in enumerate([3.0] * 5 + [0.9, 0.8, 0.5] + [0.5, 2.0, 0.5, 0.5, 0.5]):
            windows[step]
            grown.append(windows.observe(step, loss))
        assert longest(0) == 64 and longest(7) == 64
        assert grown[7] == 128 and grown[12] == 256 and grown.count(None) == len(grown) - 2
        assert 64 < longest(8) <= 128 and 128 < longest(13) <= 256
        state = windows.state_at(14)
        again = tiny.take_retrieval_windows(files, args, 40, seed=3, mixed=True)
        again.resume(14, state)
        assert again[14].seq_lens == windows[14].seq_lens and longest(14) <= 256
        assert all(windows.observe(step, 0.1) is None for step in range(30, 34))  # after warm-up
        assert max(max(windows[step].seq_lens[:-1] or [0]) for step in range(30, 40)) > 256
        for bad in (["--task-curriculum-gate", "-1"], ["--task-curriculum", "5"],
                    ["--task-curriculum-span", "0"]):
            with pytest.raises(SystemExit):
                tiny.parse_args(argv + bad)
    finally:
        sys.modules.pop("pretrain_tiny_retrieval_test", None)


def test_mixed_lengths_fill_the_window():
    rng = random.Random(5)
    for total in (512, 4096, 32768):
        lengths = retrieval_task.mixed_lengths(total, 32, 2048, 16, rng)
        assert sum(lengths) == total and all(n % 16 == 0 for n in lengths)
        assert all(32 <= n for n in lengths) and all(n <= 2048 for n in lengths[:-1])


def test_scaled_short_sequences_keep_many_questions():
    spec = retrieval_task.RetrievalSpec(length=8192, pairs=256, queries=128, min_distance=1024,
                                        key_vocab=512, value_vocab=32)
    for length in (32, 64, 256, 1024, 4096, 8192):
        short = retrieval_task.scaled(spec, length)
        short.check()
        assert short.queries >= min(length // 16, spec.queries)
        assert short.min_distance == round(spec.min_distance * length / spec.length)
    assert retrieval_task.scaled(spec, 8192) == spec


def test_curriculum_length_grows_from_shortest_to_longest():
    lengths = [retrieval_task.curriculum_length(s, 100, 256, 8192, 16) for s in range(0, 131, 10)]
    assert lengths[0] == 256 and lengths[10:] == [8192] * 4
    assert all(a <= b for a, b in zip(lengths, lengths[1:])) and len(set(lengths)) > 8
    assert all(n % 16 == 0 for n in lengths)
    assert retrieval_task.curriculum_length(50, 100, 256, 8192, 16) == 1440  # sqrt(256 * 8192)
    with pytest.raises(ValueError, match="curriculum steps"):
        retrieval_task.curriculum_length(0, 0, 256, 8192, 16)
    with pytest.raises(ValueError, match="shortest"):
        retrieval_task.curriculum_length(0, 10, 512, 256, 16)


def _load_example():
    import importlib.util

    path = REPO / "examples" / "pretrain_tiny.py"
    spec = importlib.util.spec_from_file_location("pretrain_tiny_retrieval_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    return module


def test_example_windows_follow_the_length_curriculum():
    tiny = _load_example()
    try:
        argv = ["--device", "cpu", "--task", "retrieval", "--steps", "40", "--seq-len", "4096",
                "--task-len", "2048", "--task-len-min", "128", "--task-curriculum", "20",
                "--pairs", "64", "--queries", "32", "--min-distance", "256",
                "--key-vocab", "128", "--block-size", "32"]
        args = tiny.parse_args(argv)
        files = tiny.split_files(tiny.stdlib_files(), args.seed)["train"][:50]
        windows = tiny.take_retrieval_windows(files, args, 40, seed=3, mixed=True)
        for step, window in enumerate(windows):
            limit = retrieval_task.curriculum_length(step, 20, 128, 2048, 16)
            assert sum(window.seq_lens) == 4096
            assert max(window.seq_lens[:-1] or [0]) <= limit  # the last one takes what is left
            assert len(window.answers.first_rows) == len(window.answers.record_blocks)
        assert max(windows[0].seq_lens[:-1]) == 128  # step 0: the shortest length only
        assert max(max(w.seq_lens[:-1]) for w in windows[20:]) > 1024  # full range later
        plain = tiny.take_retrieval_windows(
            files, tiny.parse_args([a for a in argv if a not in ("--task-curriculum", "20")]),
            40, seed=3, mixed=True)
        assert max(max(w.seq_lens[:-1]) for w in plain[:5]) > 256  # no curriculum: all lengths
        with pytest.raises(SystemExit):  # negative
            tiny.parse_args(argv + ["--task-curriculum", "-1"])
        no_min = argv[:argv.index("--task-len-min")] + argv[argv.index("--task-len-min") + 2:]
        with pytest.raises(SystemExit):  # a curriculum needs a shortest length
            tiny.parse_args(no_min)
    finally:
        sys.modules.pop("pretrain_tiny_retrieval_test", None)


def test_scaled_question_density_is_a_parameter():
    spec = retrieval_task.RetrievalSpec(length=8192, pairs=128, queries=128, min_distance=1024,
                                        key_vocab=128, value_vocab=32)
    assert retrieval_task.scaled(spec, 256).queries == 16  # default: one per 16 tokens
    dense = retrieval_task.scaled(spec, 256, question_every=8)
    assert dense.queries == 32 and dense.pairs >= 32
    dense.check()
    assert retrieval_task.scaled(spec, 4096, question_every=8).queries == 128  # capped
    with pytest.raises(ValueError, match="question_every"):
        retrieval_task.scaled(spec, 256, question_every=0)


def test_every_answer_label_is_determined_by_its_own_sequence():
    """Brute-force solver over the example's packed training batches: at every answer row the
    input is a key seen exactly once earlier in the same packed sequence, and the label is the
    token right after that earlier key; no other row's label is a value except a record's own
    (unpredictable) value; positions restart at every sequence; filler holds no key or value."""
    import torch

    tiny = _load_example()
    try:
        args = tiny.parse_args(["--device", "cpu", "--task", "retrieval", "--steps", "6",
                                "--seq-len", "2048", "--task-len", "2048", "--task-len-min",
                                "128", "--task-curriculum", "3", "--task-question-every", "8",
                                "--pairs", "64", "--queries", "32", "--min-distance", "256",
                                "--key-vocab", "96", "--block-size", "32",
                                "--answer-weight", "7"])
        files = tiny.split_files(tiny.stdlib_files(), args.seed)["train"][:50]
        windows = tiny.take_retrieval_windows(files, args, 6, seed=5, mixed=True)
        first_value = retrieval_task.BYTE_VOCAB + args.key_vocab
        answers = 0
        for window in windows:
            batch = tiny.make_batch(window, None, args.block_size, args.top_k,
                                    torch.device("cpu"), args.answer_weight)
            x, y = batch.input_ids[0].tolist(), batch.labels[0].tolist()
            pos, asked = batch.position_ids[0].tolist(), batch.answer_mask[0].tolist()
            weight = batch.loss_mask[0].tolist()
            start = 0
            for length in window.seq_lens:
                assert pos[start:start + length] == list(range(length))
                for row in range(start, start + length - 1):
                    if not asked[row]:
                        assert y[row] < first_value or retrieval_task.BYTE_VOCAB <= x[row]
                        continue
                    answers += 1
                    earlier = [p for p in range(start, row) if x[p] == x[row]]
                    assert retrieval_task.BYTE_VOCAB <= x[row] < first_value  # a key
                    assert len(earlier) == 1, (row, earlier)
                    assert y[row] == x[earlier[0] + 1] >= first_value  # its record's value
                    assert weight[row] == 7.0
                assert not asked[start + length - 1]
                start += length
        assert answers == sum(len(w.answers.rows) for w in windows) > 500
    finally:
        sys.modules.pop("pretrain_tiny_retrieval_test", None)


def test_value_set_chance_is_one_over_the_distinct_record_values():
    rng = random.Random(4)
    filler = iter(range(10 ** 9))
    filler = (b % 200 + 1 for b in filler)
    for vocab in (1, 3, 32):
        spec = retrieval_task.RetrievalSpec(length=256, pairs=8, queries=4, min_distance=16,
                                            key_vocab=16, value_vocab=vocab)
        seq = retrieval_task.make_sequence(spec, filler, rng)
        tokens = seq.tokens.tolist()
        first_value = retrieval_task.BYTE_VOCAB + spec.key_vocab
        query_start = spec.length - spec.queries * spec.record_len
        record_values = {tokens[p + 1] for p in range(query_start)
                         if retrieval_task.BYTE_VOCAB <= tokens[p] < first_value}
        assert seq.value_set_chance == pytest.approx(1.0 / len(record_values))
    assert retrieval_task.make_sequence(
        retrieval_task.RetrievalSpec(256, 8, 4, 16, 16, 1), filler, rng).value_set_chance == 1.0


def test_report_breaks_record_block_chosen_down_per_layer_and_index_head(tmp_path):
    """examples/retrieval_report.py: the per-head table has one column per (layer, index head)
    and the best head per layer; retrieval.json keeps the per-head values."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import retrieval_report
    finally:
        sys.path.remove(str(REPO / "examples"))
    runs = {}
    for name, per_head in (("msa", [[0.9, 0.1], [0.25, 0.5]]),
                           ("random", [[0.0, 0.2], [0.1, 0.0]])):
        run = {"name": name, "steps": [1, 2], "loss": [3.0, 2.0], "tokens_per_s": [10.0, 12.0],
               "held_out_loss": 2.0, "probe_steps": [2], "recall_per_layer": [[0.5, 0.6]],
               "key_hit_per_layer": [[0.5, 0.375]], "key_hit_per_head": [per_head],
               "eval_steps": [2], "eval_exact_match": [0.5], "answer_loss": [3.0, 2.5],
               "retrieval": {"exact_match": 0.5, "answer_loss": 1.0, "recall": 0.55,
                             "recall_answer": 0.4, "key_hit": sum(map(sum, per_head)) / 4,
                             "key_hit_per_head": per_head}}
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(
            {"args": {"warmup_steps": 1}, "runs": [run]}))
    table = retrieval_report.head_table(retrieval_report.load_runs(tmp_path))
    lines = table.splitlines()
    assert lines[0] == "| run | L1 h1 | L1 h2 | L2 h1 | L2 h2 | L1 best | L2 best |"
    assert lines[2] == "| MSA, KL-trained index | 0.900 | 0.100 | 0.250 | 0.500 | 0.900 | 0.500 |"
    assert lines[3].startswith("| MSA, frozen random index | 0.000 | 0.200 |")
    assert retrieval_report.main([str(tmp_path)]) == 0
    assert "L2 best" in (tmp_path / "retrieval.md").read_text()
    summary = json.loads((tmp_path / "retrieval.json").read_text())
    assert summary["msa"]["key_hit_per_head"] == [[[0.9, 0.1], [0.25, 0.5]]]
    assert retrieval_report.head_table({"dense": {"retrieval": {}}}) == ""
    # newer runs add the recall's ceiling and the union over layers and heads
    runs = retrieval_report.load_runs(tmp_path)
    runs["msa"]["retrieval"].update(recall_best=0.8, key_hit_any=0.75)
    lines = retrieval_report.table(runs).splitlines()
    assert lines[0] == ("| run | exact match | answer loss | recall | best recall | recall, answer "
                        "rows | record block chosen | by some layer and head | held-out LM loss "
                        "| tokens/s |")
    assert lines[1] == "|---" * 10 + "|"
    assert lines[2].startswith("| MSA, KL-trained index | 0.500 | 1.000 | 0.550 | 0.800 | 0.400 |"
                               " 0.438 | 0.750 | 2.000 |")
    assert lines[3].startswith("| MSA, frozen random index | 0.500 | 1.000 | 0.550 | - | 0.400 |")


def test_report_reads_stored_metrics_and_names_what_is_missing(tmp_path):
    """retrieval_report.py on a benchmarks/results-style directory (metrics_<run>.json.gz,
    written before key_hit_per_head existed), with a failed run (its log, no metrics), a run
    that the record's --runs lists but that never finished, and an unreadable file: it still
    writes the table and names each missing piece; an empty directory says where it looked."""
    import gzip

    sys.path.insert(0, str(REPO / "examples"))
    try:
        import retrieval_report
    finally:
        sys.path.remove(str(REPO / "examples"))
    for name in ("dense", "msa"):
        run = {"name": name, "steps": [1, 2], "loss": [3.0, 2.0], "held_out_loss": 2.5,
               "probe_steps": [2], "recall_per_layer": [[0.5, 0.6]],
               "eval_steps": [2], "eval_exact_match": [0.5], "answer_loss": [3.0, 2.5],
               "retrieval": {"exact_match": 0.75, "answer_loss": 1.0, "recall": 0.55,
                             "recall_answer": 0.4, "key_hit": 0.3}}
        if name == "dense":
            run["tokens_per_s"] = [10.0, 12.0]
        runs = ["msa", "random"] if name == "msa" else ["dense"]
        with gzip.open(tmp_path / f"metrics_{name}.json.gz", "wt") as handle:
            json.dump({"args": {"warmup_steps": 1, "runs": runs}, "runs": [run]}, handle)
    (tmp_path / "local.log").write_text("Traceback ...\n")
    (tmp_path / "metrics_bad.json.gz").write_bytes(b"not gzip")
    assert retrieval_report.main([str(tmp_path)]) == 0
    text = (tmp_path / "retrieval.md").read_text()
    assert "| dense attention | 0.750 | 1.000 | 0.550 | 0.400 | 0.300 | 2.500 | 12 |" in text
    assert "best recall" not in text  # stored before the ceiling was measured: same columns
    assert "| MSA, KL-trained index | 0.750 |" in text and "| 2.500 | - |" in text
    assert "no metrics for random, local (see local.log)" in text
    assert "no run has key_hit_per_head" in text and "metrics_bad.json.gz cannot be read" in text
    assert (tmp_path / "retrieval.png").is_file()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "msa.log").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        retrieval_report.main([str(empty)])
    message = str(exit_info.value)
    assert "no metrics under" in message and "metrics_*.json.gz" in message
    assert "no metrics for msa (see msa.log)" in message


def test_report_speed_counts_only_the_variants_own_steps():
    """A variant that loaded the shared warm-up carries the warm-up's step history: its tokens/s
    is the median over the steps after the warm-up only (the 2026-12-01 GPU report showed the
    warm-up's speed for every variant); without a warm-up, the second half of the steps."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import retrieval_report
    finally:
        sys.path.remove(str(REPO / "examples"))
    run = {"steps": [1, 2, 3, 4, 5], "tokens_per_s": [5.0, 5.0, 5.0, 100.0, 300.0],
           "args": {"warmup_steps": 3}}
    assert retrieval_report.own_speeds(run) == [100.0, 300.0]
    run["args"] = {"warmup_steps": 0}
    assert retrieval_report.own_speeds(run) == [5.0, 100.0, 300.0]
    assert retrieval_report.own_speeds({"steps": [], "tokens_per_s": []}) == []


def _report_module():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import retrieval_report
    finally:
        sys.path.remove(str(REPO / "examples"))
    return retrieval_report


def _text_run(name, recall, best):
    """A --task text run's record as pretrain_tiny writes it: probes, no questions (zeros for
    the record block), no held-out retrieval metrics."""
    return {"name": name, "steps": [1, 2, 3, 4], "loss": [3.0, 2.5, 2.2, 2.0],
            "tokens_per_s": [10.0, 10.0, 20.0, 30.0], "held_out_loss": 2.1, "retrieval": None,
            "probe_steps": [2, 4], "recall_per_layer": [[0.1, 0.2], recall],
            "recall_best_per_layer": [[0.3, 0.4], best], "recall_answer_per_layer": [[0, 0]] * 2,
            "key_hit_per_layer": [[0.0, 0.0]] * 2, "key_hit_per_head": [[[0.0], [0.0]]] * 2,
            "key_hit_any": [0.0, 0.0], "eval_steps": [], "eval_exact_match": [],
            "answer_loss": []}


def test_report_shows_the_probe_recall_of_text_runs(tmp_path):
    """--task text (no questions): recall and best recall are the last probe's (means over
    layers; the 2026-12-01 text8k report showed '-' although the runs had them), the
    retrieval-only columns read '-', never 0, and a note says where the recall comes from."""
    retrieval_report = _report_module()
    for name, recall, best in (("msa", [0.5, 0.75], [0.75, 1.0]),
                               ("random", [0.25, 0.5], [0.5, 1.0])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps(
            {"args": {"task": "text", "warmup_steps": 2, "steps": 4, "runs": [name]},
             "runs": [_text_run(name, recall, best)]}))
    assert retrieval_report.main([str(tmp_path)]) == 0
    lines = (tmp_path / "retrieval.md").read_text().splitlines()
    assert lines[0] == ("| run | exact match | answer loss | recall | recall, mean of last 4 "
                        "probes | best recall | recall, answer rows | record block chosen | "
                        "held-out LM loss | tokens/s |")
    # one probe after the warm-up (step 4): its mean is the last probe's recall
    assert lines[2] == ("| MSA, KL-trained index | - | - | 0.625 | 0.625 | 0.875 | - | - | 2.100 "
                        "| 25 |")
    assert lines[3] == ("| MSA, frozen random index | - | - | 0.375 | 0.375 | 0.750 | - | - | "
                        "2.100 | 25 |")
    note = lines[5]
    assert note.startswith("msa, random: no questions (--task text)") and "(step 4)" in note
    assert "(1 probe, step 4:" in note
    assert "Record block chosen per layer" not in "\n".join(lines)  # no per-head table of zeros


def test_report_averages_the_last_probes_of_text_runs():
    """Text runs: "recall, mean of last 4 probes" is the mean (over probes, of the means over
    layers) of the last 4 probes after the dense warm-up; probes of the warm-up never count,
    fewer probes after it give a mean over those; retrieval runs have no such column."""
    retrieval_report = _report_module()
    run = _text_run("msa", [0.5, 0.5], [1.0, 1.0])
    run["args"] = {"task": "text", "warmup_steps": 20}
    run["probe_steps"] = [10, 20, 30, 40, 50, 60, 70]
    run["recall_per_layer"] = [[0.0, 0.0], [0.1, 0.1], [0.2, 0.4], [0.5, 0.5], [0.6, 0.6],
                               [0.25, 0.75], [1.0, 0.8]]
    run["recall_best_per_layer"] = [[1.0, 1.0]] * 7
    assert retrieval_report.last_probes(run) == [(40, 0.5), (50, 0.6), (60, 0.5),
                                                 (70, pytest.approx(0.9))]
    values = retrieval_report.final_values(run)
    assert values["recall"] == pytest.approx(0.9)
    assert values["recall_last_probes"] == pytest.approx((0.5 + 0.6 + 0.5 + 0.9) / 4)
    run["args"]["warmup_steps"] = 55  # two probes after the switch
    assert retrieval_report.final_values(run)["recall_last_probes"] == pytest.approx(0.7)
    assert "(2 probes, steps 60-70:" in retrieval_report.probe_note({"msa": run})
    run["args"]["warmup_steps"] = 70  # none after it: the last ones of all
    assert [step for step, _ in retrieval_report.last_probes(run, 2)] == [60, 70]
    with pytest.raises(ValueError, match="count must be at least 1"):
        retrieval_report.last_probes(run, 0)
    header = retrieval_report.table({"msa": run}).splitlines()[0]
    assert "| recall | recall, mean of last 4 probes | best recall |" in header
    held_out = {"args": {"task": "retrieval"}, "retrieval": {"recall": 0.5, "exact_match": 1.0},
                "recall_per_layer": [[0.1], [0.2]], "probe_steps": [1, 2]}
    assert "last 4 probes" not in retrieval_report.table({"msa": held_out})
    assert "recall_last_probes" not in retrieval_report.final_values(held_out)


def test_pretrain_tiny_prints_the_reports_table():
    """examples/pretrain_tiny.py has no table of its own: it prints retrieval_report's
    report_text of its metrics record (runs_of_record), the same rows a report of its
    metrics.json shows."""
    tiny = _load_example()
    try:
        assert not hasattr(tiny, "retrieval_table")
        report = tiny.retrieval_report
        args = tiny.parse_args(["--device", "cpu", "--task", "retrieval", "--runs", "msa,dense",
                                "--quick"])
        histories = []
        for name, match in (("msa", 0.75), ("dense", 1.0)):
            history = tiny.History(name=name, steps=[1, 2], tokens_per_s=[10.0, 30.0],
                                   held_out_loss=1.5)
            history.retrieval = {"exact_match": match, "answer_loss": 0.25, "recall": 0.5,
                                 "recall_answer": 0.125, "key_hit": 0.375,
                                 "key_hit_per_head": [[0.5, 0.25]]}
            histories.append(history)
        record = tiny.metrics_record(args, histories)
        runs = report.runs_of_record(record)
        assert list(runs) == ["dense", "msa"] and runs["msa"]["args"]["task"] == "retrieval"
        text = report.report_text(runs, [])
        assert "| MSA, KL-trained index | 0.750 | 0.250 | 0.500 | 0.125 | 0.375 | 1.500 |" in text
        assert "| dense attention | 1.000 |" in text and "L1 best" in text
        with pytest.raises(TypeError, match="list 'runs'"):
            report.runs_of_record({"args": {}})
    finally:
        sys.modules.pop("pretrain_tiny_retrieval_test", None)


def test_report_from_json_reproduces_the_table_and_plot(tmp_path):
    """--from-json: a retrieval.json alone (a committed one) gives the same table as the
    directory it was written from, beside it as <stem>.md / <stem>.png or in --out-dir; the
    JSON is left as it was; what is not such a summary is refused."""
    retrieval_report = _report_module()
    runs_dir = tmp_path / "runs"
    for name in ("dense", "msa"):
        per_head = [[0.5, 0.25]]
        run = {"name": name, "steps": [1, 2, 3], "loss": [3.0, 2.0, 1.5],
               "tokens_per_s": [10.0, 40.0, 60.0], "held_out_loss": 1.25,
               "probe_steps": [3], "recall_per_layer": [[0.5]], "recall_best_per_layer": [[0.75]],
               "key_hit_per_layer": [[0.375]], "key_hit_per_head": [per_head],
               "key_hit_any": [0.5], "eval_steps": [2], "eval_exact_match": [0.5],
               "answer_loss": [3.0, 2.5, 2.0],
               "retrieval": {"exact_match": 0.75, "answer_loss": 0.5, "recall": 0.625,
                             "recall_best": 0.875, "recall_answer": 0.25, "key_hit": 0.375,
                             "key_hit_any": 0.5, "key_hit_per_head": per_head,
                             "distance_histogram": {"layer_01": {"own": 3, "2-3": 1}}}}
        (runs_dir / name).mkdir(parents=True)
        (runs_dir / name / "metrics.json").write_text(json.dumps(
            {"args": {"warmup_steps": 1, "steps": 3, "runs": [name]}, "runs": [run]}))
    assert retrieval_report.main([str(runs_dir)]) == 0
    direct = (runs_dir / "retrieval.md").read_text()
    assert "| MSA, KL-trained index | 0.750 | 0.500 | 0.625 | 0.875 | 0.250 | 0.375 | 0.500 |" \
        " 1.250 | 50 |" in direct
    stored = tmp_path / "stored"
    stored.mkdir()
    summary = stored / "retrieval_r8.json"
    summary.write_bytes((runs_dir / "retrieval.json").read_bytes())
    before = summary.read_bytes()
    assert retrieval_report.main(["--from-json", str(summary)]) == 0
    assert (stored / "retrieval_r8.md").read_text() == direct
    assert (stored / "retrieval_r8.png").stat().st_size > 0
    assert summary.read_bytes() == before
    assert retrieval_report.main(["--from-json", str(summary), "--out-dir",
                                  str(tmp_path / "elsewhere")]) == 0
    assert (tmp_path / "elsewhere" / "retrieval_r8.md").read_text() == direct
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"args": {}, "runs": []}))  # a metrics.json, not a summary
    with pytest.raises(SystemExit) as exit_info:
        retrieval_report.main(["--from-json", str(bad)])
    assert "is not a retrieval.json of this script" in str(exit_info.value)
    with pytest.raises(SystemExit):  # a directory and --from-json: one of them
        retrieval_report.main([str(runs_dir), "--from-json", str(summary)])


def test_readme_quotes_the_s10_gpu_results():
    """README.md's GPU rows of 2026-12-01 s10 (32K top-k 32 and 64; real text 8K seed 2) are the
    committed JSONs' values, formatted as the tables print them; the table by top-k (s9's top-k
    16, s10's 32 and 64) quotes the trained and random index's exact match, recall, best recall
    and their ratio."""
    readme = " ".join((REPO / "README.md").read_text().split())
    results = REPO / "benchmarks" / "results" / "retrieval" / "gpu_2026-12-01_s10"
    report = _report_module()
    labels = {"dense": "dense attention", "msa": "**MSA, KL-trained index**",
              "random": "MSA, frozen random index", "local": "own block only"}
    by_top_k = {16: REPO / "benchmarks" / "results" / "retrieval" / "gpu_2026-12-01_s9"
                / "r32768" / "retrieval_r32768.json"}
    for top_k in (32, 64):
        path = results / f"r32768_top{top_k}" / "retrieval_r32768.json"
        by_top_k[top_k] = path
        runs = report.load_summary(path)
        assert set(runs) == set(labels)
        dense = runs["dense"]["retrieval"]["exact_match"]
        for name, run in runs.items():
            assert run["args"]["top_k"] == top_k, (path, name)
            r = run["retrieval"]
            match = f"{r['exact_match']:.3f}"
            if name == "msa":
                match = f"**{match}** ({100 * r['exact_match'] / dense:.1f}% of dense)"
            if name == "local":
                match += f" (chance {r['value_set_chance']:.3f})"
            cells = [match] + [f"{r[key]:.3f}" for key in ("answer_loss", "recall", "recall_best",
                                                           "key_hit", "key_hit_any")]
            row = " | ".join(cells + [f"{run['held_out_loss']:.3f}"]) + " |"
            row = f"| {1 if name == 'local' else top_k} | {labels[name]} | {row}"
            assert row in readme, row
    for top_k, path in by_top_k.items():
        runs = report.load_summary(path)
        cells = [f"{top_k} (s9)" if top_k == 16 else str(top_k)]
        for name in ("msa", "random"):
            r = runs[name]["retrieval"]
            cells += [f"{r['exact_match']:.3f}", f"{r['recall']:.3f}", f"{r['recall_best']:.3f}",
                      f"{100 * r['recall'] / r['recall_best']:.1f}%"]
        row = "| " + " | ".join(cells) + " |"
        assert row in readme, row
    runs = report.load_summary(results / "text8k_seed2" / "retrieval.json")
    for name, run in runs.items():
        values = report.final_values(run)
        last = " ".join(f"{v:.2f}" for v in run["recall_per_layer"][-1])
        cells = [f"{run['held_out_loss']:.3f}", f"{values['recall']:.3f} ({last})",
                 f"{values['recall_last_probes']:.3f}"]
        if name == "msa":
            cells = [f"**{cells[0]}**", f"**{values['recall']:.3f}** ({last})", f"**{cells[2]}**"]
        assert " | ".join(cells) in readme, cells
        assert f"| {values['recall_best']:.3f} |" in readme


def _one_run(name, exact):
    return {"name": name, "steps": [1, 2], "loss": [3.0, 2.0], "tokens_per_s": [10.0, 12.0],
            "held_out_loss": 2.0, "eval_steps": [2], "eval_exact_match": [exact],
            "retrieval": {"exact_match": exact, "answer_loss": 1.0, "recall": 0.5}}


def test_report_reads_one_pretrain_tiny_out_dir(tmp_path):
    """Fresh-user check 2026-12-01 s10: ``retrieval_report.py <pretrain_tiny --out-dir>`` said
    "no metrics under ..." although the run's metrics.json was there."""
    report = _report_module()
    (tmp_path / "metrics.json").write_text(json.dumps(
        {"args": {"warmup_steps": 1, "runs": ["msa", "dense"]},
         "runs": [_one_run("msa", 0.75), _one_run("dense", 0.5)]}))
    runs = report.load_runs(tmp_path)
    assert list(runs) == ["dense", "msa"]
    assert runs["msa"]["retrieval"]["exact_match"] == 0.75
    assert report.main([str(tmp_path)]) == 0
    table = (tmp_path / "retrieval.md").read_text()
    assert "| MSA, KL-trained index | 0.750 |" in table
    assert "| dense attention | 0.500 |" in table
