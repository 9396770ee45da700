"""Multi-query associative recall in long filler text: a task that needs long-range attention.

Each sequence of ``length`` bytes is filler (the standard library's source text) with
``pairs`` key -> value records placed at random positions, and ``queries`` questions near the
end that repeat a key and must be answered with its value::

    ...filler...  \\x01KEYS\\x03vals\\x04  ...filler...  \\x01QWER\\x03abcd\\x04  ...filler...
    ...           \\x02QWER\\x03abcd\\x04 \\x02KEYS\\x03vals\\x04            (queries at the end)

The value bytes after a query's separator (``abcd``) are the *answer tokens*: they can only be
predicted by attending back to the record, at least ``min_distance`` tokens (many key blocks)
earlier. Loss and exact match (all value bytes right, teacher-forced argmax) are measured on the
answer tokens only. Keys are distinct upper-case strings; values random lower-case strings; the
marker bytes 0x01-0x04 never occur in the filler. Everything is generated from a seed, with no
download.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from typing import Iterator, List, Sequence

import torch

RECORD, QUERY, SEPARATOR, END = 1, 2, 3, 4
KEY_ALPHABET = bytes(range(ord("A"), ord("Z") + 1))
VALUE_ALPHABET = bytes(range(ord("a"), ord("z") + 1))


@dataclass(frozen=True)
class RetrievalSpec:
    """Generator parameters (command-line flags of the tiny example)."""

    length: int  # bytes per sequence
    pairs: int  # key -> value records per sequence
    queries: int  # questions per sequence (each asks a distinct record)
    min_distance: int  # tokens between a record and its question, at least
    key_len: int = 4
    value_len: int = 4

    @property
    def record_len(self) -> int:
        return self.key_len + self.value_len + 3  # marker, separator, end

    def check(self) -> None:
        """Raise ValueError when the records and questions cannot fit as asked."""
        if min(self.pairs, self.queries, self.key_len, self.value_len) < 1:
            raise ValueError("--pairs, --queries, key and value lengths must be >= 1")
        if self.queries > self.pairs:
            raise ValueError(f"--queries ({self.queries}) must not exceed --pairs ({self.pairs})")
        if self.pairs > len(KEY_ALPHABET) ** self.key_len // 2:
            raise ValueError(f"--pairs {self.pairs} is too many for distinct {self.key_len}-byte keys")
        room = self.length - self.queries * self.record_len - self.min_distance
        if room < self.pairs * self.record_len:
            raise ValueError(
                f"a {self.length}-token sequence cannot hold {self.pairs} records and "
                f"{self.queries} questions {self.min_distance} tokens apart; lower --pairs, "
                f"--queries or --min-distance, or raise the sequence length")


@dataclass
class RetrievalSequence:
    """One generated sequence and where its answers and records are (positions in it)."""

    tokens: torch.Tensor  # [length] int64
    answer_pos: List[int]  # positions whose *label* (next token) is an answer byte
    answer_query: List[int]  # question number of each answer position
    record_span: List[List[int]]  # per question: [first, last] position of the asked record


def filler_stream(documents: Iterator[bytes]) -> Iterator[int]:
    """Bytes of ``documents`` one by one, marker bytes removed (they never occur in Python
    source, but a stray one would make a fake record)."""
    for doc in documents:
        for byte in doc:
            if byte > END:
                yield byte


def make_sequence(spec: RetrievalSpec, filler: Iterator[int], rng: random.Random) -> RetrievalSequence:
    """Generate one sequence of ``spec.length`` tokens (see the module docstring)."""
    keys = set()
    while len(keys) < spec.pairs:
        keys.add(bytes(rng.choice(KEY_ALPHABET) for _ in range(spec.key_len)))
    keys = sorted(keys)
    rng.shuffle(keys)
    values = [bytes(rng.choice(VALUE_ALPHABET) for _ in range(spec.value_len)) for _ in keys]
    tokens = bytearray(next(filler) for _ in range(spec.length))
    rl = spec.record_len
    # Questions fill the end; records go at distinct, non-overlapping random slots before
    # ``limit``, so every question is at least min_distance tokens after its record.
    query_start = spec.length - spec.queries * rl
    limit = query_start - spec.min_distance
    slots = sorted(rng.sample(range(limit // rl), spec.pairs))
    starts = [s * rl for s in slots]
    for start, key, value in zip(starts, keys, values):
        tokens[start:start + rl] = bytes([RECORD]) + key + bytes([SEPARATOR]) + value + bytes([END])
    asked = rng.sample(range(spec.pairs), spec.queries)
    answer_pos: List[int] = []
    answer_query: List[int] = []
    spans: List[List[int]] = []
    for q, record in enumerate(asked):
        start = query_start + q * rl
        tokens[start:start + rl] = (bytes([QUERY]) + keys[record] + bytes([SEPARATOR])
                                   + values[record] + bytes([END]))
        sep = start + 1 + spec.key_len
        answer_pos.extend(range(sep, sep + spec.value_len))  # sep predicts value byte 0, ...
        answer_query.extend([q] * spec.value_len)
        spans.append([starts[record], starts[record] + rl - 1])
    return RetrievalSequence(torch.tensor(list(tokens), dtype=torch.int64), answer_pos,
                             answer_query, spans)


def sequences(spec: RetrievalSpec, documents: Iterator[bytes], seed: int) -> Iterator[RetrievalSequence]:
    """An endless, seeded stream of sequences over the filler ``documents``."""
    spec.check()
    rng = random.Random(seed)
    filler = filler_stream(documents)
    while True:
        yield make_sequence(spec, filler, rng)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The task's flags (``--task retrieval`` selects it in the tiny example)."""
    group = parser.add_argument_group("retrieval task (--task retrieval)")
    group.add_argument("--task-len", type=int, default=None,
                       help="tokens per retrieval sequence (default: --seq-len; a window packs "
                            "--seq-len / --task-len sequences)")
    group.add_argument("--pairs", type=int, default=32, help="key -> value records per sequence")
    group.add_argument("--queries", type=int, default=16, help="questions per sequence")
    group.add_argument("--min-distance", type=int, default=1024,
                       help="tokens between a record and its question, at least")
    group.add_argument("--answer-weight", type=float, default=32.0,
                       help="training-loss weight of an answer token (filler tokens weigh 1)")
    group.add_argument("--eval-interval", type=int, default=0,
                       help="steps between held-out exact-match measurements (0: at the end only)")
    group.add_argument("--probe-rows", type=int, default=256,
                       help="query rows sampled per layer for the selection recall")


def spec_from_args(args: argparse.Namespace) -> RetrievalSpec:
    return RetrievalSpec(length=args.task_len, pairs=args.pairs, queries=args.queries,
                         min_distance=args.min_distance)


def exact_match(correct_per_query: Sequence[int], value_len: int) -> float:
    """Share of questions whose every value byte was predicted right."""
    if not correct_per_query:
        return 0.0
    return sum(int(c == value_len) for c in correct_per_query) / len(correct_per_query)
