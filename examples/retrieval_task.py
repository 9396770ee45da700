"""Multi-query associative recall in long filler text: a task that needs long-range attention.

Each sequence of ``length`` tokens is filler (the standard library's source text, byte tokens
0-255) with ``pairs`` key -> value records placed at random positions, and ``queries``
questions at the end that repeat a key and must be answered with its value::

    ...filler... K17 V302 ...filler... K5 V41 ...filler... K9 V77 ...filler...   K5 V41 K17 V302
                 (records, at least min_distance tokens before the questions)     (questions)

Keys and values are tokens of their own, outside the byte range: keys ``256 ..
256 + key_vocab - 1``, values after them (``value_len`` tokens each). The value tokens after a
question's key are the *answer tokens*: they can only be predicted by attending back to the
record, at least ``min_distance`` tokens (many key blocks) earlier; filler never holds a key,
so the match is exact (the standard multi-query associative recall probe, in long filler).
Loss and exact match (every value token right, teacher-forced argmax) are measured on the
answer tokens only. Everything is generated from a seed, with no download.

Two record formats (``--record-format``):

- ``pair`` (above): the record is the key token followed by the value token(s). Answering
  needs a two-step circuit (a previous-token head that copies the key into the value's
  position, then a head that matches the question's key there), which small models form only
  after very many answered questions, in a sudden phase change.
- ``fused``: the record is *one* token that names both, ``(key, value)``, from a vocabulary of
  ``key_vocab * value_vocab`` record tokens after the value tokens; questions stay
  ``key value``. One attention hop from the question's key to the record token answers it, so
  the gradient teaches the match from the first step. This is the format for judging the index
  branch: the question's attention must land on one token many blocks back, and the index must
  select that token's block.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
from dataclasses import dataclass
from typing import Iterator, List, Sequence

import torch

BYTE_VOCAB = 256  # filler tokens are bytes; keys and values come after them


@dataclass(frozen=True)
class RetrievalSpec:
    """Generator parameters (command-line flags of the tiny example)."""

    length: int  # tokens per sequence
    pairs: int  # key -> value records per sequence
    queries: int  # questions per sequence (each asks a distinct record)
    min_distance: int  # tokens between a record and its question, at least
    key_vocab: int = 256  # distinct key tokens
    value_vocab: int = 32  # distinct value tokens
    value_len: int = 1  # value tokens per record
    record_format: str = "pair"  # "pair": key token, value token(s); "fused": one (key, value) token

    @property
    def record_len(self) -> int:
        """Tokens of one record in the filler."""
        return 1 if self.record_format == "fused" else 1 + self.value_len

    @property
    def question_len(self) -> int:
        """Tokens of one question (the key, then the value tokens it is answered with)."""
        return 1 + self.value_len

    @property
    def vocab_size(self) -> int:
        """Tokens the model must know: bytes, keys, values (and fused record tokens)."""
        fused = self.key_vocab * self.value_vocab if self.record_format == "fused" else 0
        return BYTE_VOCAB + self.key_vocab + self.value_vocab + fused

    def record_token(self, key: int, value: int) -> int:
        """The fused record token of ``key`` (0-based) holding ``value`` (0-based)."""
        return BYTE_VOCAB + self.key_vocab + self.value_vocab + key * self.value_vocab + value

    def check(self) -> None:
        """Raise ValueError when the records and questions cannot fit as asked."""
        if self.record_format not in ("pair", "fused"):
            raise ValueError(f"--record-format must be 'pair' or 'fused', got "
                             f"{self.record_format!r}")
        if self.record_format == "fused" and self.value_len != 1:
            raise ValueError(f"--record-format fused needs one value token per record, "
                             f"got value_len={self.value_len}")
        if self.value_vocab < 2:
            raise ValueError(f"--value-vocab ({self.value_vocab}) must be >= 2: with one value "
                             "every answer is right by chance (chance level 1.0), and exact "
                             "match measures nothing")
        if min(self.pairs, self.queries, self.value_len, self.key_vocab) < 1:
            raise ValueError("--pairs, --queries, value length and --key-vocab must be >= 1")
        if self.queries > self.pairs:
            raise ValueError(f"--queries ({self.queries}) must not exceed --pairs ({self.pairs})")
        if self.pairs > self.key_vocab:
            raise ValueError(f"--pairs ({self.pairs}) needs as many distinct keys; "
                             f"--key-vocab is {self.key_vocab}")
        room = self.length - self.queries * self.question_len - self.min_distance
        if room < self.pairs * self.record_len:
            raise ValueError(
                f"a {self.length}-token sequence cannot hold {self.pairs} records and "
                f"{self.queries} questions {self.min_distance} tokens apart; lower --pairs, "
                f"--queries or --min-distance, or raise the sequence length")


@dataclass
class RetrievalSequence:
    """One generated sequence and where its answers and records are (positions in it)."""

    tokens: torch.Tensor  # [length] int64
    answer_pos: List[int]  # positions whose *label* (next token) is an answer token
    answer_query: List[int]  # question number of each answer position
    record_span: List[List[int]]  # per question: [first, last] position of the asked record
    # Exact match of the value-set guess (uniform over the distinct record values of this
    # sequence, no retrieval): 1 / number of distinct values. A model that stops there has
    # learned which values occur, not which key holds which value.
    value_set_chance: float = 0.0


def filler_stream(documents: Iterator[bytes]) -> Iterator[int]:
    """Bytes of ``documents`` one by one."""
    for doc in documents:
        yield from doc


def make_sequence(spec: RetrievalSpec, filler: Iterator[int], rng: random.Random) -> RetrievalSequence:
    """Generate one sequence of ``spec.length`` tokens (see the module docstring). ``filler``
    hands out the filler bytes; one with a ``take(n)`` method (a list of the next ``n``) is
    read through it, which is faster and gives the same bytes."""
    keys = rng.sample(range(spec.key_vocab), spec.pairs)
    value_base = BYTE_VOCAB + spec.key_vocab
    values = [[value_base + rng.randrange(spec.value_vocab) for _ in range(spec.value_len)]
              for _ in keys]
    take = getattr(filler, "take", None)  # a cursor that hands out many bytes at once
    tokens = take(spec.length) if take is not None else list(itertools.islice(filler,
                                                                              spec.length))
    if len(tokens) < spec.length:
        raise ValueError(f"the filler ran out after {len(tokens)} of {spec.length} tokens")
    rl, ql = spec.record_len, spec.question_len
    # Questions fill the end; records go at distinct, non-overlapping random slots before
    # ``limit``, so every question is at least min_distance tokens after its record.
    query_start = spec.length - spec.queries * ql
    limit = query_start - spec.min_distance
    starts = [slot * rl for slot in sorted(rng.sample(range(limit // rl), spec.pairs))]
    for start, key, value in zip(starts, keys, values):
        tokens[start:start + rl] = ([spec.record_token(key, value[0] - value_base)]
                                    if spec.record_format == "fused" else [BYTE_VOCAB + key] + value)
    answer_pos: List[int] = []
    answer_query: List[int] = []
    spans: List[List[int]] = []
    for q, record in enumerate(rng.sample(range(spec.pairs), spec.queries)):
        start = query_start + q * ql
        tokens[start:start + ql] = [BYTE_VOCAB + keys[record]] + values[record]
        answer_pos.extend(range(start, start + spec.value_len))  # key predicts value 0, ...
        answer_query.extend([q] * spec.value_len)
        spans.append([starts[record], starts[record] + rl - 1])
    return RetrievalSequence(torch.tensor(tokens, dtype=torch.int64), answer_pos, answer_query,
                             spans, 1.0 / len({tuple(v) for v in values}))


def scaled(spec: RetrievalSpec, length: int, question_every: int = 16) -> RetrievalSpec:
    """The task at a shorter ``length``: distance in proportion, records and questions in
    proportion too but at least one question per ``question_every`` tokens (up to
    ``spec.queries``), so that short sequences, where attention starts less diluted, carry many
    answers. Raises ValueError when the result cannot fit (``RetrievalSpec.check``)."""
    if question_every < 1:
        raise ValueError(f"question_every must be >= 1, got {question_every}")
    ratio = length / spec.length
    queries = max(1, round(spec.queries * ratio), min(length // question_every, spec.queries))
    short = RetrievalSpec(length=length, pairs=max(queries, round(spec.pairs * ratio)),
                          queries=queries, min_distance=round(spec.min_distance * ratio),
                          key_vocab=spec.key_vocab, value_vocab=spec.value_vocab,
                          value_len=spec.value_len, record_format=spec.record_format)
    short.check()
    return short


def mixed_lengths(total: int, shortest: int, longest: int, multiple: int,
                  rng: random.Random) -> List[int]:
    """Sequence lengths that fill ``total`` tokens: log-uniform in ``[shortest, longest]``,
    multiples of ``multiple``; the last one takes what is left (at least ``shortest``)."""
    lengths: List[int] = []
    left = total
    while left >= 2 * shortest:
        draw = math.exp(rng.uniform(math.log(shortest), math.log(longest)))
        length = min(left - shortest, max(shortest, int(draw) // multiple * multiple))
        lengths.append(length)
        left -= length
    lengths.append(left)
    return lengths


def curriculum_length(step: int, steps: int, shortest: int, longest: int, multiple: int) -> int:
    """The longest training sequence at ``step`` of a length curriculum of ``steps`` steps:
    geometric growth from ``shortest`` (step 0) to ``longest`` (step ``steps`` and after),
    rounded down to a multiple of ``multiple`` and never below ``shortest``.

    Raises ValueError when ``steps`` < 1 or ``shortest`` > ``longest``."""
    if steps < 1:
        raise ValueError(f"curriculum steps must be >= 1, got {steps}")
    if not 0 < shortest <= longest:
        raise ValueError(f"need 0 < shortest ({shortest}) <= longest ({longest})")
    progress = min(max(step, 0) / steps, 1.0)
    length = shortest * (longest / shortest) ** progress
    return max(shortest, min(longest, int(length + 1e-6) // multiple * multiple))


def sequences(spec: RetrievalSpec, documents: Iterator[bytes], seed: int) -> Iterator[RetrievalSequence]:
    """An endless, seeded stream of sequences over the filler ``documents``."""
    spec.check()
    rng = random.Random(seed)
    filler = filler_stream(documents)
    while True:
        yield make_sequence(spec, filler, rng)


# Flags of :func:`add_arguments` that only the retrieval task reads (``--probe-rows`` serves the
# text task's recall probe too); pretrain_tiny refuses them with ``--task text``.
RETRIEVAL_ONLY = ("task_len", "task_len_min", "task_curriculum", "task_curriculum_gate",
                  "task_curriculum_span", "task_question_every", "pairs", "queries", "key_vocab",
                  "value_vocab", "record_format", "min_distance", "answer_weight", "eval_interval")


# Sizes of the task, full and ``--quick`` (the tiny example's 256-token quick windows hold 8
# records and 4 questions 64 tokens apart): pretrain_tiny fills the flags left unset from
# these beside its own FULL_SIZES / QUICK_SIZES; flags given explicitly win.
FULL_SIZES = dict(pairs=64, queries=32, key_vocab=256, min_distance=1024)
QUICK_SIZES = dict(pairs=8, queries=4, key_vocab=8, min_distance=64)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The task's flags (``--task retrieval`` selects it in the tiny example)."""
    group = parser.add_argument_group("retrieval task (--task retrieval)")

    def size(flag: str, help_text: str) -> None:  # a flag whose default depends on --quick
        key = flag[2:].replace("-", "_")
        group.add_argument(flag, type=int, default=None, help=f"{help_text} (default "
                           f"{FULL_SIZES[key]}; with --quick {QUICK_SIZES[key]})")

    group.add_argument("--task-len", type=int, default=None,
                       help="tokens per retrieval sequence (default: --seq-len; a window packs "
                            "--seq-len / --task-len sequences)")
    group.add_argument("--task-len-min", type=int, default=None,
                       help="train on sequences of mixed lengths, log-uniform from this to "
                            "--task-len (records, questions and distance in proportion), which "
                            "teaches retrieval in far fewer steps; evaluation always uses "
                            "--task-len (default: --task-len only)")
    group.add_argument("--task-curriculum", type=int, default=0,
                       help="with --task-len-min: the longest training sequence grows "
                            "geometrically from --task-len-min to --task-len over this many "
                            "steps (0: mixed lengths up to --task-len from the start)")
    group.add_argument("--task-curriculum-gate", type=float, default=0.0,
                       help="with --task-len-min, instead of --task-curriculum: the warm-up "
                            "starts with sequences of --task-len-min tokens and doubles the "
                            "longest length whenever the training answer loss (mean of the "
                            "last --task-curriculum-span steps) is below this many nats; short "
                            "sequences stay in the mix; after the warm-up, all lengths (0: off)")
    group.add_argument("--task-curriculum-span", type=int, default=50,
                       help="steps of training answer loss the gate averages")
    group.add_argument("--task-question-every", type=int, default=16,
                       help="mixed-length training: a sequence shorter than --task-len asks at "
                            "least one question per this many tokens (up to --queries)")
    size("--pairs", "key -> value records per sequence")
    size("--queries", "questions per sequence")
    size("--key-vocab", "distinct key tokens")
    group.add_argument("--value-vocab", type=int, default=32, help="distinct value tokens")
    group.add_argument("--record-format", choices=("pair", "fused"), default="pair",
                       help="pair: a record is a key token then a value token (answering needs a "
                            "two-step induction circuit); fused: one token names key and value "
                            "(one attention hop answers; see the module docstring)")
    size("--min-distance", "tokens between a record and its question, at least")
    group.add_argument("--answer-weight", type=float, default=64.0,
                       help="training-loss weight of an answer token (filler tokens weigh 1)")
    group.add_argument("--eval-interval", type=int, default=0,
                       help="steps between held-out exact-match measurements (0: at the end only)")
    group.add_argument("--probe-rows", type=int, default=256,
                       help="query rows sampled per layer for the selection recall")


def spec_from_args(args: argparse.Namespace) -> RetrievalSpec:
    return RetrievalSpec(length=args.task_len, pairs=args.pairs, queries=args.queries,
                         min_distance=args.min_distance, key_vocab=args.key_vocab,
                         value_vocab=args.value_vocab,
                         record_format=getattr(args, "record_format", "pair"))


def exact_match(correct_per_query: Sequence[int], value_len: int) -> float:
    """Share of questions whose every value byte was predicted right."""
    if not correct_per_query:
        return 0.0
    return sum(int(c == value_len) for c in correct_per_query) / len(correct_per_query)
