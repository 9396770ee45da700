"""Pretrain a tiny GPT whose attention layers are MSA, on megatron-core alone (no Megatron-LM).

What it does, in one invocation:

1. Builds a byte-level corpus from the Python standard library's own ``*.py`` files (every
   machine with Python has them; nothing is downloaded). Files are sorted; every
   ``HELD_OUT_EVERY``-th file is held out for evaluation, the rest are shuffled with the seed.
   Documents (files) are packed into windows of ``--seq-len`` tokens in Megatron's THD layout:
   one row of tokens plus ``cu_seqlens`` marking document starts (``PackedSeqParams``).
2. Trains a megatron-core ``GPTModel`` whose attention is MSA (``get_gpt_layer_msa_spec``):
   dense warmup for ``--warmup-steps``, then sparse MSA (``set_msa_mode``), with the index
   branch learning from the main branch through the KL loss.
3. Trains the same model from the same seed with attention kept dense for every step (the
   baseline; in dense mode the main branch is exact causal attention and the index branch reads
   a detached input, so the backbone trains exactly like a dense-attention GPT).
4. Prints held-out LM loss of both, writes ``metrics.json`` and a PNG plot to ``--out-dir``.

Tensor parallel (``--tp``) and context parallel (``--cp``) come from megatron-core's process
groups; the remaining ranks are data parallel. Launch with torchrun::

    torchrun --standalone --nproc-per-node 4 examples/pretrain_tiny.py --tp 2 --cp 2

gloo on CPU, NCCL on CUDA (``--device``). ``examples/run_tiny.sh`` creates a venv and runs this.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import sys
import sysconfig
import time
import types
import unittest.mock
import warnings
import zipfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

# megatron-core warns about Transformer Engine / Apex / CUDA settings this run does not use.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")

from megatron.core import parallel_state  # noqa: E402 (after the warning filter)
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer import TransformerConfig

from msa_megatron import MSAConfig
from msa_megatron.diagnostics import distance_histogram, sample_rows
from msa_megatron.megatron import (
    add_msa_arguments,
    arm_selection_probe,
    get_gpt_layer_msa_spec,
    get_msa_metrics,
    MSACoreAttention,
    index_branch_parameters,
    msa_config_from_args,
    set_kl_loss_scale,
    set_msa_mode,
)
from msa_megatron.megatron.index import build_head_layout, reduce_index_grads_over_tp
from msa_megatron.parallel.tensor import index_head_layout

import retrieval_report  # noqa: E402  (examples/retrieval_report.py, beside this script)
import retrieval_task  # noqa: E402  (examples/retrieval_task.py, beside this script)

VOCAB_SIZE = 256  # byte-level tokens
PAD_TOKEN = 0  # NUL never occurs in Python source; padded positions carry no loss
PAD_MULTIPLE = 16  # every packed document is padded to this, so any CP <= 8 can split it
HELD_OUT_EVERY = 10  # every 10th file (in sorted order) is held out for evaluation
EXCLUDED_DIRS = ("site-packages", "dist-packages")
MAX_CP = PAD_MULTIPLE // 2


# ----------------------------------------------------------------------------- data


def stdlib_files() -> List[Path]:
    """Sorted ``*.py`` files of this interpreter's standard library (third-party dirs excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(EXCLUDED_DIRS)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def split_files(files: Sequence[Path], seed: int) -> Dict[str, List[Path]]:
    """Deterministic split: every ``HELD_OUT_EVERY``-th sorted file is held out; train is shuffled."""
    held_out = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
    random.Random(seed).shuffle(train)
    return {"train": train, "held_out": held_out}


def iter_documents(files: Sequence[Path]) -> Iterator[bytes]:
    """Bytes of each non-empty file, cycling over the list forever."""
    if not files:
        raise ValueError("no Python files found in the standard library directory")
    while True:
        for path in files:
            data = path.read_bytes()
            if data:
                yield data


@dataclass
class Answers:
    """Where a retrieval window's answers are (rows of the whole window, all sequences).

    ``rows``: rows whose label is an answer byte; ``query``: the window-wide question number of
    each such row; ``first_rows``: per question, the row predicting its first value byte (the
    row that must find the record); ``record_blocks``: per question, ``[first, last]`` key block
    (relative to its sequence's start) of the asked record; ``value_set_chance``: per question,
    the exact match of guessing uniformly among its sequence's distinct record values.
    """

    rows: List[int]
    query: List[int]
    first_rows: List[int]
    record_blocks: List[List[int]]
    value_set_chance: List[float] = field(default_factory=list)


@dataclass
class Window:
    """One packed micro-batch row: ``tokens [S]`` int64 and the packed sequence lengths.

    ``seq_lens`` sum to S; each is a multiple of ``PAD_MULTIPLE``; ``real_lens[i] <= seq_lens[i]``
    is the unpadded length of sequence i (pads sit at the end of their sequence). ``answers``:
    the retrieval task's answer positions (None for plain text).
    """

    tokens: torch.Tensor
    seq_lens: List[int]
    real_lens: List[int]
    answers: Optional[Answers] = None


def pack_windows(documents: Iterator[bytes], seq_len: int) -> Iterator[Window]:
    """Pack documents into windows of ``seq_len`` tokens (a document may continue in the next one)."""
    if seq_len % PAD_MULTIPLE:
        raise ValueError(f"--seq-len must be a multiple of {PAD_MULTIPLE}, got {seq_len}")
    pending = b""
    while True:
        tokens = torch.full((seq_len,), PAD_TOKEN, dtype=torch.int64)
        seq_lens: List[int] = []
        real_lens: List[int] = []
        used = 0
        while used < seq_len:
            if not pending:
                pending = next(documents)
            piece = pending[: seq_len - used]
            pending = pending[len(piece):]
            padded = -(-len(piece) // PAD_MULTIPLE) * PAD_MULTIPLE
            tokens[used:used + len(piece)] = torch.frombuffer(bytearray(piece), dtype=torch.uint8)
            seq_lens.append(padded)
            real_lens.append(len(piece))
            used += padded
        yield Window(tokens, seq_lens, real_lens)


def take_windows(files: Sequence[Path], seq_len: int, count: int) -> List[Window]:
    """The first ``count`` packed windows of ``files`` (same on every rank)."""
    stream = pack_windows(iter_documents(files), seq_len)
    return [next(stream) for _ in range(count)]


def take_retrieval_windows(files: Sequence[Path], args: argparse.Namespace, count: int,
                           seed: int, mixed: bool = False) -> "LazyWindows":
    """``count`` windows of retrieval sequences (filler from ``files``), the same on every rank:
    ``--seq-len / --task-len`` sequences of ``--task-len`` tokens each, or with ``mixed`` and
    ``--task-len-min``, sequences of mixed lengths up to ``--task-len``; with
    ``--task-curriculum N`` too, the longest length of window ``i`` (training step
    ``i // data-parallel size``) grows from ``--task-len-min`` to ``--task-len`` over N steps
    (:func:`retrieval_task.curriculum_length`). Windows are generated in order when first
    indexed (:class:`LazyWindows`): a run that stops early never builds the rest, and a resumed
    run restarts the generator where a saved state left it (:meth:`LazyWindows.resume`)."""
    return LazyWindows(RetrievalWindowStream(files, args, count, seed, mixed), count)


class FillerCursor:
    """The bytes of the non-empty ``files``, cycled forever, one int at a time (the same
    sequence as ``retrieval_task.filler_stream(iter_documents(files))``), with a position that
    :meth:`state` returns and :meth:`restore` puts back: ``(file counter, byte offset)``."""

    def __init__(self, files: Sequence[Path]):
        if not files:
            raise ValueError("no Python files found in the standard library directory")
        self._files = list(files)
        self._counter = -1  # files opened so far, minus one (counting every cycle)
        self._data = b""
        self._offset = 0

    def __iter__(self) -> "FillerCursor":
        return self

    def __next__(self) -> int:
        return self.take(1)[0]

    def take(self, count: int) -> List[int]:
        """The next ``count`` bytes (fewer only if every file is empty: then ValueError)."""
        out: List[int] = []
        while len(out) < count:
            if self._offset >= len(self._data):
                self._open(self._counter + 1, 0)
            piece = self._data[self._offset:self._offset + count - len(out)]
            out.extend(piece)
            self._offset += len(piece)
        return out

    def _open(self, counter: int, offset: int) -> None:
        empty = 0
        while True:  # empty files hold no bytes: skip them (a list of only empty files fails)
            data = self._files[counter % len(self._files)].read_bytes()
            if data or offset:
                break
            counter, empty = counter + 1, empty + 1
            if empty > len(self._files):
                raise ValueError("every filler file is empty")
        self._counter, self._data, self._offset = counter, data, offset

    def state(self) -> Tuple[int, int]:
        """``(file counter, byte offset)``: where the next byte comes from."""
        return self._counter, self._offset

    def restore(self, state: Sequence[int]) -> None:
        """Continue from a :meth:`state` of a cursor over the same files."""
        counter, offset = int(state[0]), int(state[1])
        if counter < 0:
            self._counter, self._data, self._offset = -1, b"", 0
        else:
            self._open(counter, offset)


class RetrievalWindowStream:
    """The windows of :func:`take_retrieval_windows`, one per ``next()``; its generator state
    (window number, Python RNG state, filler position) can be saved (:meth:`state`) and put
    back (:meth:`restore`), so a resumed run reads exactly the windows it would have read."""

    def __init__(self, files: Sequence[Path], args: argparse.Namespace, count: int, seed: int,
                 mixed: bool):
        self.args, self.count = args, count
        self.spec = retrieval_task.spec_from_args(args)
        self.rng = random.Random(seed)
        self.filler = FillerCursor(files)
        self.shortest = args.task_len_min if mixed and args.task_len_min else self.spec.length
        self.curriculum = (getattr(args, "task_curriculum", 0)
                           if self.shortest < self.spec.length else 0)
        self.per_step = max(1, count // max(args.steps, 1)) if mixed else 1
        self.index = 0  # number of the next window
        # Gated curriculum (--task-curriculum-gate): the longest length of the warm-up's windows
        # grows only when the training answer loss says the current lengths are learned.
        gated = mixed and self.curriculum == 0 and self.shortest < self.spec.length
        self.gate = getattr(args, "task_curriculum_gate", 0.0) if gated else 0.0
        self.gated_longest = self.shortest
        self.recent: List[float] = []  # answer losses since the last growth

    def __iter__(self) -> "RetrievalWindowStream":
        return self

    def state(self) -> Dict[str, object]:
        """Everything the next window depends on (plain Python values, ``torch.save``-able)."""
        version, internal, gauss = self.rng.getstate()
        return {"index": self.index, "rng": [version, list(internal), gauss],
                "filler": list(self.filler.state()), "gated_longest": self.gated_longest,
                "recent": list(self.recent)}

    def restore(self, state: Dict[str, object]) -> None:
        """Continue from :meth:`state` of a stream with the same files, settings and seed."""
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.filler.restore(state["filler"])
        self.index = int(state["index"])
        self.gated_longest = int(state.get("gated_longest", self.shortest))
        self.recent = [float(v) for v in state.get("recent", [])]

    def observe(self, step: int, answer_loss: float) -> Optional[int]:
        """Gated curriculum: take the training answer loss of warm-up ``step`` (the same value
        on every rank). When the mean of the last ``--task-curriculum-span`` steps since the
        longest length last grew is below ``--task-curriculum-gate``, the longest length of
        the following windows doubles (up to ``--task-len``). Returns the new longest length
        when it grew, else None. After the warm-up every window has the full range of lengths
        (the variants train on the same data, whatever their losses)."""
        if not self.gate or step >= self.args.warmup_steps or \
                self.gated_longest >= self.spec.length:
            return None
        span = max(1, getattr(self.args, "task_curriculum_span", 50))
        self.recent = (self.recent + [answer_loss])[-span:]
        if len(self.recent) < span or sum(self.recent) / span >= self.gate:
            return None
        self.gated_longest = min(self.spec.length,
                                 self.gated_longest * 2 // PAD_MULTIPLE * PAD_MULTIPLE)
        self.recent = []
        return self.gated_longest

    def __next__(self) -> Window:
        if self.index >= self.count:
            raise StopIteration
        spec, args, i = self.spec, self.args, self.index
        longest = (retrieval_task.curriculum_length(i // self.per_step, self.curriculum,
                                                    self.shortest, spec.length, PAD_MULTIPLE)
                   if self.curriculum else spec.length)
        if self.gate and i // self.per_step < args.warmup_steps:
            longest = self.gated_longest
        lengths = ([spec.length] * (args.seq_len // spec.length) if self.shortest == spec.length
                   else retrieval_task.mixed_lengths(args.seq_len, self.shortest, longest,
                                                     PAD_MULTIPLE, self.rng))
        parts = [retrieval_task.make_sequence(
            retrieval_task.scaled(spec, n, getattr(args, "task_question_every", 16)),
            self.filler, self.rng) for n in lengths]
        answers = Answers([], [], [], [])
        offset = 0
        for length, part in zip(lengths, parts):
            base_query = len(answers.first_rows)
            answers.rows.extend(offset + p for p in part.answer_pos)
            answers.query.extend(base_query + q for q in part.answer_query)
            answers.first_rows.extend(offset + p for p in part.answer_pos[::spec.value_len])
            answers.record_blocks.extend([first // args.block_size, last // args.block_size]
                                         for first, last in part.record_span)
            answers.value_set_chance.extend([part.value_set_chance] * len(part.record_span))
            offset += length
        self.index += 1
        return Window(torch.cat([p.tokens for p in parts]), lengths, lengths, answers)


class LazyWindows(Sequence):
    """A read-only list of ``count`` windows drawn from ``stream`` in order on first access
    (and kept: the variants of one run train on the same windows). After :meth:`resume` the
    windows before the resumed position are gone (indexing them raises IndexError)."""

    def __init__(self, stream: Iterator[Window], count: int):
        self._stream, self._count, self._built = stream, count, []
        self._first = 0  # index of self._built[0]

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._count))]
        if index < 0:
            index += self._count
        if not self._first <= index < self._count:
            raise IndexError(f"window {index} of {self._count}"
                             + (f" (resumed at {self._first})" if self._first else ""))
        while self._first + len(self._built) <= index:
            self._built.append(next(self._stream))
        return self._built[index - self._first]

    def state_at(self, index: int) -> Optional[Dict[str, object]]:
        """The stream's state before window ``index`` (None when the stream cannot save one).
        Builds the windows up to ``index``; raises ValueError when more were built already."""
        if not hasattr(self._stream, "state"):
            return None
        if self._first + len(self._built) > index:
            raise ValueError(f"window {index} was built already; its state is gone")
        if index > 0:
            self[index - 1]
        return self._stream.state()

    def observe(self, step: int, answer_loss: float) -> Optional[int]:
        """Pass a training step's answer loss to the stream (gated curriculum; see
        :meth:`RetrievalWindowStream.observe`); None when nothing changed."""
        observe = getattr(self._stream, "observe", None)
        return observe(step, answer_loss) if observe is not None else None

    def resume(self, index: int, state: Optional[Dict[str, object]]) -> None:
        """Continue at window ``index`` from a :meth:`state_at` ``state`` (None: build and drop
        the windows before ``index``, the slow way to the same place)."""
        if state is not None and hasattr(self._stream, "restore"):
            if int(state["index"]) != index:
                raise ValueError(f"stream state of window {state['index']}, not {index}")
            self._stream.restore(state)
        else:
            for _ in range(index - self._first - len(self._built)):
                next(self._stream)
        self._built, self._first = [], index


@dataclass
class Batch:
    """The part of one window that this CP rank holds, ready for ``GPTModel.forward``."""

    input_ids: torch.Tensor  # [1, S / CP]
    position_ids: torch.Tensor  # [1, S / CP] position inside the token's own document
    labels: torch.Tensor  # [1, S / CP] next byte of the same document
    loss_mask: torch.Tensor  # [1, S / CP] 1.0 where a label exists, 0.0 on pads and last tokens
    packed_seq_params: PackedSeqParams
    num_tokens_global: float  # summed loss weights of the whole window (all CP ranks)
    attended_fraction: float  # attended key blocks / causal key blocks at top_k (whole window)
    rows: torch.Tensor  # [S / CP] window rows this rank holds, in local order
    answer_mask: Optional[torch.Tensor] = None  # [1, S / CP] bool: the label is an answer token
    answers_global: int = 0  # answer tokens in the whole window (all CP ranks)


def attended_block_fraction(seq_lens: Sequence[int], block_size: int, top_k: int) -> float:
    """Mean over queries of ``min(top_k, own_block + 1) / (own_block + 1)`` weighted by keys.

    Returns the share of causal key blocks that sparse MSA attends to in this window (1.0 for
    dense attention): ``sum_p min(k, blk(p)+1) / sum_p (blk(p)+1)``.
    """
    attended = causal = 0
    for length in seq_lens:
        blocks = torch.arange(length) // block_size + 1
        attended += int(torch.clamp(blocks, max=top_k).sum())
        causal += int(blocks.sum())
    return attended / max(causal, 1)


def cp_partition(seq_lens: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """Row indices this CP rank holds in Megatron's load-balanced THD layout.

    Each sequence is cut into ``2 * cp_size`` equal chunks; rank r keeps chunks r and
    ``2 * cp_size - 1 - r`` (MSA_SPEC section 6). Returns ``[S / cp_size]`` int64 indices.
    """
    pieces = []
    start = 0
    for length in seq_lens:
        chunk = length // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        start += length
    return torch.cat(pieces)


def make_batch(window: Window, cp_group: Optional[dist.ProcessGroup], block_size: int,
               top_k: int, device: torch.device, answer_weight: float = 1.0) -> Batch:
    """Labels, loss weights and packed-sequence metadata of ``window``, sliced for this CP rank.

    Every labelled token weighs 1 in the loss, a retrieval answer token ``answer_weight``."""
    tokens = window.tokens
    labels = torch.full_like(tokens, PAD_TOKEN)
    loss_mask = torch.zeros(tokens.shape, dtype=torch.float32)
    positions = torch.zeros_like(tokens)
    start = 0
    for length, real in zip(window.seq_lens, window.real_lens):
        labels[start:start + real - 1] = tokens[start + 1:start + real]
        loss_mask[start:start + real - 1] = 1.0
        positions[start:start + length] = torch.arange(length)
        start += length
    answer_mask = torch.zeros(tokens.shape, dtype=torch.bool)
    if window.answers is not None:
        loss_mask[window.answers.rows] = answer_weight
        answer_mask[window.answers.rows] = True
    cu_seqlens = torch.zeros(len(window.seq_lens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(window.seq_lens), 0)
    cp_size = 1 if cp_group is None else cp_group.size()
    rows = cp_partition(window.seq_lens, cp_size, 0 if cp_group is None else cp_group.rank())
    cu_seqlens = cu_seqlens.to(device)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(window.seq_lens), max_seqlen_kv=max(window.seq_lens),
    )
    return Batch(
        input_ids=tokens[rows][None].to(device),
        position_ids=positions[rows][None].to(device),
        labels=labels[rows][None].to(device),
        loss_mask=loss_mask[rows][None].to(device),
        packed_seq_params=params,
        num_tokens_global=float(loss_mask.sum()),
        attended_fraction=attended_block_fraction(window.seq_lens, block_size, top_k),
        rows=rows,
        answer_mask=answer_mask[rows][None].to(device),
        answers_global=int(answer_mask.sum()),
    )


# ----------------------------------------------------------------------------- model


def model_config(args: argparse.Namespace) -> TransformerConfig:
    """A small Llama-style GPT: RMSNorm, SwiGLU, RoPE, GQA, no biases, no dropout."""
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn_hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.query_groups,
        kv_channels=args.hidden // args.heads,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=args.tp,
        context_parallel_size=args.cp,
        # Full weights are drawn on CPU from one seed and then sliced: the initial model is the
        # same for every TP / CP layout, so runs of different layouts are comparable.
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        bf16=args.dtype == "bf16",
    )


def msa_config(args: argparse.Namespace) -> MSAConfig:
    """MSA hyper-parameters from the command line (warmup starts dense)."""
    return msa_config_from_args(args, prefix="", mode="dense")


def keep_rope_on_cpu(model: GPTModel) -> None:
    """CPU-only workaround: megatron-core's ``RotaryEmbedding.get_emb`` (0.16-0.19) moves its
    frequencies to ``torch.cuda.current_device()`` on first use. On a CPU run, let that move
    target the CPU; nothing else changes."""
    rope = model.rotary_pos_emb
    cuda_get_emb = rope.get_emb

    def get_emb(*args, **kwargs):
        with unittest.mock.patch.object(torch.cuda, "current_device", return_value="cpu"):
            return cuda_get_emb(*args, **kwargs)

    rope.get_emb = get_emb


def build_model(args: argparse.Namespace, device: torch.device) -> GPTModel:
    """GPTModel with MSA attention in every layer, identical initial weights for a given seed."""
    torch.manual_seed(args.seed)
    config = model_config(args)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_msa_spec(msa_config(args), use_te=False,
                                                      normalization="RMSNorm"),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_len,
        position_embedding_type="rope",
        rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=False,
    )
    if device.type == "cpu":
        keep_rope_on_cpu(model)
    return model.to(device)


# ----------------------------------------------------------------------------- training


@dataclass
class History:
    """Per-step training log of one run (rank 0 keeps it)."""

    name: str
    steps: List[int] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    kl: List[float] = field(default_factory=list)
    kl_per_layer: List[List[float]] = field(default_factory=list)
    attended_fraction: List[float] = field(default_factory=list)
    answer_loss: List[float] = field(default_factory=list)  # retrieval: mean over answer tokens
    mode: List[str] = field(default_factory=list)
    tokens_per_s: List[float] = field(default_factory=list)
    held_out_loss: Optional[float] = None
    seconds: float = 0.0
    # Selection probe (every --probe-interval steps): per probed step, one value per layer.
    probe_steps: List[int] = field(default_factory=list)
    recall_per_layer: List[List[float]] = field(default_factory=list)
    recall_answer_per_layer: List[List[float]] = field(default_factory=list)
    # the recall's ceiling (best selection the rules allow) over the same uniform rows
    recall_best_per_layer: List[List[float]] = field(default_factory=list)
    key_hit_per_layer: List[List[float]] = field(default_factory=list)
    # record block chosen per probed step, per layer and index head: [step][layer][head]
    key_hit_per_head: List[List[List[float]]] = field(default_factory=list)
    # share of questions whose record block some layer's some index head selected, per probe
    key_hit_any: List[float] = field(default_factory=list)
    retrieval: Optional[Dict[str, object]] = None  # held-out retrieval metrics
    eval_steps: List[int] = field(default_factory=list)  # retrieval: --eval-interval
    eval_exact_match: List[float] = field(default_factory=list)
    curriculum: List[List[int]] = field(default_factory=list)  # gated: [step, longest length]


def layer_kls(metrics: Dict[str, float]) -> List[float]:
    """Per-layer KL values, in layer order, from :func:`get_msa_metrics`' dictionary."""
    prefix = "msa/kl/layer_"
    return [metrics[k] for k in sorted(metrics) if k.startswith(prefix)]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over ``--lr-warmup`` steps, then cosine decay to 10% of ``--lr``."""
    if step < args.lr_warmup:
        return args.lr * (step + 1) / args.lr_warmup
    progress = (step - args.lr_warmup) / max(args.steps - args.lr_warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0))))


def all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum gradients over the data-parallel x context-parallel group (ranks with equal shards).

    Each rank's loss is its own tokens' share of the global mean, so the sum is the gradient of
    the global mean loss.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if dist.get_world_size(group) == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm(model: torch.nn.Module, max_norm: float, tp_group: dist.ProcessGroup) -> float:
    """Clip by the global gradient norm; TP-sharded weights count on every TP rank, replicated
    ones once (megatron-core's ``param_is_not_tensor_parallel_duplicate``). Returns the norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
    for p in params:
        if param_is_not_tensor_parallel_duplicate(p):
            squares += p.grad.float().pow(2).sum()
    dist.all_reduce(squares, group=tp_group)
    norm = float(squares.sqrt())
    if norm > max_norm:
        for p in params:
            p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


def lm_loss(model: GPTModel, batch: Batch, autocast: bool, answers: bool = False):
    """This rank's share of the window's mean next-byte loss: ``sum(local losses) / N_global``.

    With ``answers``, returns ``(loss, answer_share)``: the second is this rank's share of the
    mean (unweighted, detached) loss over the window's answer tokens (0.0 without answers)."""
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        per_token = model(batch.input_ids, batch.position_ids, None, labels=batch.labels,
                          packed_seq_params=batch.packed_seq_params)
    loss = (per_token.float() * batch.loss_mask).sum() / max(batch.num_tokens_global, 1)
    if not answers:
        return loss
    answer_share = 0.0
    if batch.answer_mask is not None and batch.answers_global:
        answer_share = float(per_token.detach().float()[batch.answer_mask].sum()) \
            / batch.answers_global
    return loss, answer_share


VARIANTS = {
    # name: (sparse after the warm-up, index trained by the KL, top-k override)
    "msa": (True, True, None),
    "random": (True, False, None),
    "local": (True, False, "forced"),  # the forced blocks only: the own block by default
    "dense": (False, True, None),
}
VARIANT_HELP = ("msa: KL-trained index; random: index frozen at its random initialisation; "
                "local: own block only (top-k = the forced blocks, --init-blocks + --local-blocks, "
                "1 by default); dense: dense attention every step")


def variant_args(args: argparse.Namespace, variant: str) -> argparse.Namespace:
    """``args`` with the variant's top-k (``local``: the forced blocks only, ``init_blocks +
    local_blocks``: the own block by default)."""
    top_k = VARIANTS[variant][2]
    if top_k == "forced":
        config = msa_config(args)
        top_k = config.init_blocks + config.local_blocks
    return argparse.Namespace(**{**vars(args), "top_k": top_k or args.top_k})


def probe_due(step: int, args: argparse.Namespace) -> bool:
    """Selection recall is measured every ``--probe-interval`` steps and at the last step."""
    return args.probe_interval > 0 and ((step + 1) % args.probe_interval == 0 or step == 0
                                        or step + 1 == args.steps)


def arm_probe(model: GPTModel, window: Window, batch: Batch, args: argparse.Namespace,
              step: int):
    """Arm the selection probe on ``--probe-rows`` uniform local rows plus, for the retrieval
    task, the rows that must find a record among those this CP rank holds (answer rows are
    rows of the whole window; under CP each question's row lives on one rank).

    Returns ``(probe, uniform_count, questions)``: ``questions`` ``[Q_local]`` int64 indexes
    ``window.answers`` for the probed answer rows, in the order they follow the uniform rows.
    """
    generator = torch.Generator().manual_seed(args.seed + step)
    uniform = sample_rows(batch.rows.numel(), args.probe_rows, generator)
    rows = [uniform]
    questions = torch.zeros(0, dtype=torch.int64)
    if window.answers is not None:
        local = torch.full((window.tokens.numel(),), -1, dtype=torch.int64)
        local[batch.rows] = torch.arange(batch.rows.numel())
        at = local[torch.tensor(window.answers.first_rows, dtype=torch.int64)]
        questions = torch.nonzero(at >= 0).flatten()
        rows.append(at[questions])
    return arm_selection_probe(model, rows=torch.cat(rows)), uniform.numel(), questions


def summarize_probe(probe, uniform_count: int, questions: torch.Tensor, window: Window,
                    device: torch.device, num_index_heads: int = 0) -> Dict[str, list]:
    """Per-layer recall over uniform rows, recall over the answer rows and the share of (question,
    index head) whose selection holds the asked record's block ("record block chosen"), pooled
    over every rank's (row, index head) samples (a collective over the world; under CP the ranks
    hold different rows, under TP different heads). ``questions``: from :func:`arm_probe`.

    "Record block chosen" also comes per index head: ``key_hit_per_head[layer][head]`` over the
    layer's ``num_index_heads`` (Hi of the whole layer; 0: this rank's count, right without TP),
    each TP rank's heads at their global numbers (``index_head_layout``); a head with no answer
    row sampled reads 0. ``recall_best``: the recall's ceiling over the uniform rows (the share
    the best selection the rules allow would hold, ``SelectionSample.best_recall``). Returns
    ``key_hit_any``: share of questions whose record block at least one (layer, index head)
    selected: the main heads can read the key somewhere (0 without questions). Returns
    ``{"recall", "recall_answer", "key_hit", "recall_best": [L] floats, "key_hit_per_head":
    [L][Hi] floats, "key_hit_any": float}``."""
    layers = sorted(probe.samples)
    # rows: recall, answer-row recall, record block chosen, best recall; sums then counts
    stats = torch.zeros(8, len(layers), dtype=torch.float64, device=device)
    local_heads = (int(probe.samples[layers[0]].block_idx.shape[1])
                   if layers and probe.samples[layers[0]].block_idx.dim() == 3 else 1)
    heads = num_index_heads or local_heads
    first, _, _ = (index_head_layout(heads, parallel_state.get_tensor_model_parallel_world_size(),
                                     parallel_state.get_tensor_model_parallel_rank())
                   if heads != local_heads else (0, local_heads, 1))
    per_head = torch.zeros(2, len(layers), heads, dtype=torch.float64, device=device)
    any_hit = torch.zeros(questions.numel(), dtype=torch.float64, device=device)
    for j, layer in enumerate(layers):
        sample = probe.samples[layer]
        uniform = sample.recall[:uniform_count].double()
        stats[0, j], stats[4, j] = float(uniform.sum()), uniform.numel()
        best = sample.best_recall[:uniform_count].double()
        stats[3, j], stats[7, j] = float(best.sum()), best.numel()
        if window.answers is not None and questions.numel():
            answer = sample.recall[uniform_count:].double()
            stats[1, j], stats[5, j] = float(answer.sum()), answer.numel()
            chosen = sample.block_idx[uniform_count:].to(torch.int64)  # [Q, Hi_local, k]
            spans = torch.tensor(window.answers.record_blocks, dtype=torch.int64)[questions]
            spans = spans.to(chosen.device)
            inside = (chosen >= spans[:, None, None, 0]) & (chosen <= spans[:, None, None, 1])
            hit = inside.any(dim=-1)  # [Q, Hi_local]
            stats[2, j], stats[6, j] = float(hit.double().sum()), hit.numel()
            per_head[0, j, first:first + hit.shape[1]] = hit.double().sum(0).to(device)
            per_head[1, j, first:first + hit.shape[1]] = hit.shape[0]
            any_hit = torch.maximum(any_hit, hit.any(dim=1).double().to(device))
    # TP ranks hold the same questions and other heads: union over them first; then every rank
    # counts (TP duplicates cancel in the share, CP ranks hold other questions).
    dist.all_reduce(any_hit, op=dist.ReduceOp.MAX,
                    group=parallel_state.get_tensor_model_parallel_group())
    any_counts = torch.tensor([float(any_hit.sum()), float(any_hit.numel())],
                              dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    dist.all_reduce(per_head)
    dist.all_reduce(any_counts)
    means = stats[:4] / stats[4:].clamp(min=1)
    return {"recall": means[0].tolist(), "recall_answer": means[1].tolist(),
            "key_hit": means[2].tolist(), "recall_best": means[3].tolist(),
            "key_hit_per_head": (per_head[0] / per_head[1].clamp(min=1)).tolist(),
            "key_hit_any": float(any_counts[0] / any_counts[1].clamp(min=1))}


def per_head_text(values: Sequence[Sequence[float]]) -> str:
    """``[layer][head]`` shares as text: heads of a layer side by side, layers split by ``|``."""
    return " | ".join(" ".join(f"{v:.2f}" for v in layer) for layer in values)


def index_heads_of(args: argparse.Namespace) -> int:
    """Index heads of a whole layer (Hi) for these settings."""
    return msa_config(args).resolved_index_heads(args.query_groups)


def set_top_k(model: GPTModel, top_k: int) -> None:
    """Change the selected blocks per query of every MSA layer (the forced blocks only:
    ``init_blocks + local_blocks``)."""
    for module in model.modules():
        if isinstance(module, MSACoreAttention):
            module.msa_config = dataclasses.replace(module.msa_config, top_k=top_k)


def run_variants(args: argparse.Namespace, device: torch.device, train_windows: List[Window],
                 eval_windows: List[Window],
                 on_variant: Callable[[List[History]], None] = lambda histories: None
                 ) -> List[History]:
    """Train the shared dense warm-up once, then every ``--runs`` variant from its end.

    All variants start from the same weights and optimizer state at step ``--warmup-steps`` and
    read the same windows afterwards, so they differ only by what the variant changes: the
    ``random`` variant puts the index branch back to its initial (random) weights and freezes it,
    ``local`` keeps only the own block, ``dense`` stays dense. (Equivalent to training each from
    scratch with the same seed: the index branch does not touch the backbone in dense mode.)

    With ``--init-weights`` the warm-up starts from the weights of another warm-up
    (:func:`load_init_weights`), trained index branch included; the ``random`` variant still
    gets the random index branch of a fresh :func:`build_model`, taken before that load.
    """
    dp_size = parallel_state.get_data_parallel_world_size()
    model = build_model(args, device)
    initial_index = [p.detach().clone() for p in index_branch_parameters(model)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    # The KL gradient is injected inside each layer; scale it like the LM loss, whose gradient
    # is summed over data-parallel ranks (CP ranks already share one KL normaliser).
    set_kl_loss_scale(1.0 / dp_size)
    set_msa_mode(model, "dense")
    model.train()
    warmup, done = History("warmup"), 0
    if args.load_warmup is not None or args.resume_warmup is not None:
        warmup, done = load_warmup(args, model, optimizer, train_windows)
    elif args.init_weights is not None:  # after initial_index: the random variant stays random
        load_init_weights(args, model)
    if done < args.warmup_steps:  # a fresh warm-up, or the rest of a resumed one
        stop = min(args.warmup_steps, args.warmup_until or args.warmup_steps)
        deadline = (time.perf_counter() + args.warmup_seconds
                    if args.warmup_seconds is not None else None)
        done = train_steps(warmup, model, optimizer, args, device, range(done, stop), "dense",
                           train_windows, eval_windows, deadline)
        if args.save_warmup is not None:
            save_warmup(args, model, optimizer, warmup, done, train_windows)
    if args.warmup_until is not None or args.warmup_seconds is not None:
        return []  # one link of a chained warm-up: saved, no variants
    snapshot = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    histories = []
    for name in args.runs:
        sparse, index_trained, _ = VARIANTS[name]
        run_args = variant_args(args, name)
        model.load_state_dict(snapshot[0])
        optimizer.load_state_dict(copy.deepcopy(snapshot[1]))
        for param, initial in zip(index_branch_parameters(model), initial_index):
            if not index_trained:
                param.data.copy_(initial)
            param.requires_grad_(index_trained)
        set_top_k(model, run_args.top_k)
        mode = "sparse" if sparse else "dense"
        set_msa_mode(model, mode)
        model.train()
        history = copy.deepcopy(warmup)
        history.name = name
        train_steps(history, model, optimizer, run_args, device,
                    range(args.warmup_steps, args.steps), mode, train_windows, eval_windows)
        finish(history, model, run_args, device, mode, eval_windows)
        histories.append(history)
        on_variant(histories)
    return histories


# Arguments that must agree between the run that saved a warm-up and the run that loads it
# (model, data, warm-up); what a variant may change (--runs, --steps, logging, output) is not here.
WARMUP_KEYS = ("tp", "cp", "seq_len", "layers", "hidden", "ffn_hidden", "heads", "query_groups",
               "block_size", "index_head_dim", "index_heads", "index_key_heads", "rotary_base",
               "softmax_scale", "index_scale", "kl_coeff", "lr", "lr_warmup", "clip_grad",
               "seed", "dtype", "task", "task_len", "task_len_min", "task_curriculum",
               "task_curriculum_gate", "task_curriculum_span", "task_question_every", "pairs",
               "queries", "key_vocab", "value_vocab", "record_format", "min_distance",
               "answer_weight", "warmup_steps", "backend", "vocab_size",
               "steps")  # --steps: the learning-rate schedule depends on it
# (Not here, free to differ between the links of a chained warm-up: --warmup-until,
# --warmup-seconds, --runs, logging, evaluation and output flags. --init-weights is saved
# beside them and compared only when given: see warmup_settings_differ.)

# The settings that fix the shapes of the saved weights and how they are split into the per-rank
# files: what --init-weights requires of the warm-up it starts from (a subset of WARMUP_KEYS;
# --seq-len, --rotary-base, the task and the schedule may differ).
SHAPE_KEYS = ("tp", "cp", "layers", "hidden", "ffn_hidden", "heads", "query_groups",
              "index_head_dim", "index_heads", "index_key_heads", "vocab_size")


def _processes(count: int) -> str:
    """``"1 process"`` or ``"<count> processes"``, for messages."""
    return f"{count} process{'' if count == 1 else 'es'}"


def _warmup_file(directory: Path, rank: Optional[int] = None,
                 world_size: Optional[int] = None) -> Path:
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    return directory / f"warmup_rank{rank:03d}_of{world_size:03d}.pt"


class WarmupLoadError(ValueError):
    """A saved warm-up (``--load-warmup``, ``--resume-warmup``, ``--init-weights``) that cannot
    be loaded into this run; :func:`main` reports it like the start-up checks."""


def warmup_settings(args: argparse.Namespace) -> Dict[str, object]:
    """The settings :func:`save_warmup` records: :data:`WARMUP_KEYS` and ``init_weights`` (the
    ``--init-weights`` directory the warm-up started from, as a string; None: random weights)."""
    settings = {k: getattr(args, k, None) for k in WARMUP_KEYS}
    settings["init_weights"] = None if args.init_weights is None else str(args.init_weights)
    return settings


def warmup_settings_differ(saved: Dict[str, object], args: argparse.Namespace,
                           keys: Optional[Sequence[str]] = None) -> str:
    """``"key=saved/now, ..."`` for every setting of a saved warm-up (``saved``, what
    :func:`warmup_settings` recorded) that differs from ``args`` (empty string: they agree).

    ``keys``: compare only these (:data:`SHAPE_KEYS` for ``--init-weights``). Default: every
    saved setting; ``init_weights`` only when ``args`` gives ``--init-weights`` (a warm-up
    resumed or loaded without it keeps the weights it started from)."""
    now = {**vars(args), **warmup_settings(args)}
    if keys is None:
        keys = [k for k in saved if k != "init_weights"]
        keys += ["init_weights"] if args.init_weights is not None else []
    differ = []
    for k in sorted(keys):
        if resolved_setting(saved, k) != resolved_setting(now, k):
            shown = ((saved.get(k), now.get(k)) if k == "init_weights" else
                     (resolved_setting(saved, k), resolved_setting(now, k)))
            differ.append(f"{k}={shown[0]!r}/{shown[1]!r}")
    return ", ".join(differ)


def resolved_setting(settings: Dict[str, object], key: str) -> object:
    """The value of setting ``key`` that the run actually uses, from ``settings`` (a
    :func:`warmup_settings` dictionary, or ``vars(args)`` with it): ``index_heads`` left unset
    (None) is one index head per KV group (``query_groups``, as
    :meth:`MSAConfig.resolved_index_heads`); ``init_weights`` is the resolved directory
    (``runs/r8192``, ``./runs/r8192`` and its absolute path are one; a relative path resolves
    against the working directory, where the chained runs start). Other keys: as saved."""
    value = settings.get(key)
    if key == "index_heads" and value is None:  # the config's own default, not restated here
        return MSAConfig(index_heads=None).resolved_index_heads(settings.get("query_groups"))
    if key == "init_weights" and value is not None:
        return str(Path(value).resolve())
    return value


def saved_warmup_problem(flag: str, directory: Path, settings: Dict[str, object], step: int,
                         args: argparse.Namespace) -> Optional[str]:
    """Why the warm-up saved in ``directory`` (its ``settings`` and ``step``) cannot serve
    ``flag`` (``--load-warmup``, ``--resume-warmup`` or ``--init-weights``) with these ``args``:
    other settings (for ``--init-weights`` only those of :data:`SHAPE_KEYS`: any step, task,
    length or schedule serves), a partial warm-up to load, a complete one or a step at or past
    ``--warmup-until`` to resume for a chained link. None: it can. Checked at start-up
    (:func:`check_warmup_dirs`) and again by :func:`read_warmup` on the file it loads."""
    vocab = ("; vocab_size (the embedding and output rows) follows --task and, for --task "
             "retrieval, --key-vocab, --value-vocab and --record-format")
    if flag == "--init-weights":
        differ = warmup_settings_differ(settings, args, SHAPE_KEYS)
        return (f"--init-weights {directory} holds a model of another shape (saved, now): "
                f"{differ}{vocab if 'vocab_size=' in differ else ''}" if differ else None)
    differ = warmup_settings_differ(settings, args)
    differ += vocab if "vocab_size=" in differ else ""
    if differ:
        return f"{flag} {directory} was saved with other settings (saved, now): " + differ
    if flag == "--load-warmup" and step < args.warmup_steps:
        return (f"--load-warmup {directory} holds a partial warm-up (step {step} of "
                f"{args.warmup_steps}): continue it with --resume-warmup {directory}")
    chained = " and ".join(f for f, v in (("--warmup-until", args.warmup_until),
                                           ("--warmup-seconds", args.warmup_seconds))
                           if v is not None)
    if flag == "--resume-warmup" and chained and step >= args.warmup_steps:
        return (f"--resume-warmup {directory} holds the complete warm-up (step {step} of "
                f"{args.warmup_steps}): nothing is left for {chained}; start the variants with "
                f"--load-warmup {directory}")
    if flag == "--resume-warmup" and args.warmup_until is not None and args.warmup_until <= step:
        return (f"--warmup-until {args.warmup_until} is not past the step of --resume-warmup "
                f"{directory} ({step} of {args.warmup_steps})")
    return None


def check_warmup_dirs(args: argparse.Namespace, world_size: int) -> List[str]:
    """The problems of the warm-up flags (``--save-warmup``, ``--load-warmup``,
    ``--resume-warmup``, ``--warmup-until``, ``--warmup-seconds``, ``--init-weights``) that need
    the saved files: missing or unreadable files (another world size, not a warm-up directory, a
    cut copy), other settings (``--init-weights``: another model shape or TP / CP layout), a
    partial warm-up given to ``--load-warmup``, a complete one or a step at or past
    ``--warmup-until`` given to ``--resume-warmup``, a resumed warm-up that started from
    another ``--init-weights``, and a ``--save-warmup`` directory that holds a partial warm-up
    which this run would overwrite instead of continuing it. (``--init-weights`` with
    ``--resume-warmup`` reads no file of its own: the resumed state holds the weights.)

    Reads only the small header of each file (settings and step; the tensors are memory-mapped,
    not read). Returns one message per problem (empty: all good)."""
    errors: List[str] = []

    def header(directory: Path, flag: str, errors: List[str]) -> Optional[Dict[str, object]]:
        """Settings and step of the warm-up in ``directory`` for ``world_size`` processes;
        None (with the problem appended to ``errors``) when its files are missing or
        unreadable."""
        paths = [_warmup_file(directory, r, world_size) for r in range(world_size)]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            others = sorted({p.name.rsplit("_of", 1)[-1][:-3]
                             for p in directory.glob("warmup_rank*_of*.pt")})
            if others and len(missing) == len(paths):
                counts = [int(o) for o in others if o.isdigit()]
                saved_by = (_processes(counts[0]) if len(counts) == 1 else
                            f"{' / '.join(map(str, counts))} processes")
                errors.append(f"{flag} {directory} holds a warm-up saved by {saved_by} "
                              f"(warmup_rank*_of{others[0]}.pt), not by "
                              f"{world_size} (WORLD_SIZE): run with the world size, TP and CP "
                              "that saved it")
            else:
                errors.append(f"{flag} {directory} has no {', '.join(missing[:3])}"
                              f"{' ...' if len(missing) > 3 else ''} (not a --save-warmup "
                              f"directory of {_processes(world_size)}, or an incomplete copy)")
            return None
        first = None
        for path in paths:
            if not zipfile.is_zipfile(path):
                errors.append(f"{flag} {directory}: {path.name} is not a whole torch.save file "
                              "(cut short, or not a warm-up); save the warm-up again or copy "
                              "it whole")
                return None
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                settings, step = state["settings"], int(state.get("step", args.warmup_steps))
            except Exception as error:  # noqa: BLE001 -- any unreadable file, one message
                text = str(error).split(". ")[0].splitlines()[0][:120] if str(error) else ""
                errors.append(f"{flag} {directory}: {path.name} cannot be read "
                              f"({type(error).__name__}: {text}); save the warm-up again or "
                              "copy it whole")
                return None
            first = first or {"settings": settings, "step": step}
        return first

    init = args.init_weights if args.resume_warmup is None else None
    for flag, directory in (("--load-warmup", args.load_warmup),
                            ("--resume-warmup", args.resume_warmup), ("--init-weights", init)):
        if directory is None or not directory.is_dir():
            continue  # not given, or named by check_settings already
        saved = header(directory, flag, errors)
        if saved is None:
            continue
        problem = saved_warmup_problem(flag, directory, saved["settings"], saved["step"], args)
        if problem:
            errors.append(problem)
    save = args.save_warmup
    resumed = args.resume_warmup
    if (save is not None and save.is_dir()
            and (resumed is None or save.resolve() != resumed.resolve())
            and _warmup_file(save, 0, world_size).is_file()):
        saved = header(save, "--save-warmup", [])  # an unreadable old one is overwritten
        total = int((saved or {}).get("settings", {}).get("warmup_steps") or 0)
        if saved is not None and saved["step"] < total:
            errors.append(f"--save-warmup {save} holds a partial warm-up (step {saved['step']} "
                          f"of {total}) that this run would overwrite: continue it with "
                          f"--resume-warmup {save}, or remove it first")
    return errors


def save_warmup(args: argparse.Namespace, model: GPTModel, optimizer: torch.optim.Optimizer,
                warmup: "History", step: int, train_windows: Sequence[Window]) -> None:
    """Write this rank's model and optimizer state, the warm-up history, the settings of
    :data:`WARMUP_KEYS`, the number of warm-up steps done (``step``; fewer than
    ``--warmup-steps`` for one link of a chained warm-up) and the training-data generator's
    state before window ``step x DP`` (retrieval task; the text windows are a plain list) to
    ``--save-warmup`` (one file per rank; written to a temporary name first, then renamed).
    The settings (:func:`warmup_settings`) include the ``--init-weights`` directory, if any."""
    dp_size = parallel_state.get_data_parallel_world_size()
    data = (train_windows.state_at(step * dp_size)
            if isinstance(train_windows, LazyWindows) else None)
    args.save_warmup.mkdir(parents=True, exist_ok=True)
    path = _warmup_file(args.save_warmup)
    partial = path.with_name(path.name + ".tmp")
    torch.save({"settings": warmup_settings(args),
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "history": dataclasses.asdict(warmup), "step": step, "data": data}, partial)
    partial.replace(path)
    dist.barrier()
    if dist.get_rank() == 0:
        what = ("the warm-up" if step >= args.warmup_steps else
                f"a partial warm-up (continue it with --resume-warmup {args.save_warmup})")
        print(f"saved {what} (step {step} of {args.warmup_steps}) to {args.save_warmup}",
              flush=True)


def load_warmup(args: argparse.Namespace, model: GPTModel, optimizer: torch.optim.Optimizer,
                train_windows: Optional[Sequence[Window]] = None) -> Tuple["History", int]:
    """Load what :func:`save_warmup` wrote (``--load-warmup`` or ``--resume-warmup``) into
    ``model`` and ``optimizer``, and move ``train_windows`` (a :class:`LazyWindows`) to the
    saved step's window without rebuilding the earlier ones. Returns ``(history, step)``: the
    warm-up history and the number of warm-up steps it holds.

    A warm-up that started from ``--init-weights`` passes that directory on: when ``args``
    has none, ``args.init_weights`` is set to it, so ``metrics.json`` and the next link's save
    record it.

    Raises :class:`WarmupLoadError` (a ValueError) when the file is missing, the saved warm-up
    cannot serve the flag (:func:`saved_warmup_problem`: other :data:`WARMUP_KEYS` settings, a
    partial warm-up given to ``--load-warmup``, nothing left to resume for a chained link) or
    its tensors do not fit ``model`` (:func:`load_saved_model`)."""
    directory = args.load_warmup if args.load_warmup is not None else args.resume_warmup
    flag = "--load-warmup" if args.load_warmup is not None else "--resume-warmup"
    state, step = read_warmup(flag, directory, args)
    if args.init_weights is None and state["settings"].get("init_weights") is not None:
        args.init_weights = Path(state["settings"]["init_weights"])
    load_saved_model(flag, directory, model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if isinstance(train_windows, LazyWindows):
        dp_size = parallel_state.get_data_parallel_world_size()
        train_windows.resume(step * dp_size, state.get("data"))
    if dist.get_rank() == 0:
        print(f"loaded the warm-up (step {step} of {args.warmup_steps}) from {directory}",
              flush=True)
    return History(**state["history"]), step


def read_warmup(flag: str, directory: Path, args: argparse.Namespace
                ) -> Tuple[Dict[str, object], int]:
    """This rank's file of the warm-up saved in ``directory`` (by :func:`save_warmup`), for
    ``flag`` (``--load-warmup``, ``--resume-warmup`` or ``--init-weights``): ``(state, step)``,
    the saved dictionary (tensors on the CPU) and the number of warm-up steps it holds.

    Raises :class:`WarmupLoadError` (a ValueError) when the file is missing (another world
    size, not a warm-up directory) or the warm-up cannot serve ``flag``
    (:func:`saved_warmup_problem`, checked at start-up and here again on the file actually
    read)."""
    path = _warmup_file(directory)
    if not path.is_file():
        raise WarmupLoadError(f"{flag} {directory}: no {path.name} (saved with another "
                              f"world size, or not a --save-warmup directory)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    step = int(state.get("step", args.warmup_steps))  # older saves: complete warm-ups only
    problem = saved_warmup_problem(flag, directory, state["settings"], step, args)
    if problem:
        raise WarmupLoadError(problem)
    return state, step


def load_saved_model(flag: str, directory: Path, model: torch.nn.Module,
                     saved: Dict[str, object], show: int = 4) -> None:
    """Load ``saved`` (the ``"model"`` state dict of a warm-up file, read for ``flag`` from
    ``directory``) into ``model``, after checking that its tensors fit: the same parameter and
    buffer names, each with the shape of ``model``'s (``_extra_state`` entries: names only).
    The check runs on every rank, and every rank stops when one rank's file does not fit (no
    rank is left waiting in a collective).

    Raises :class:`WarmupLoadError` (a ValueError) naming ``flag``, ``directory`` and the first
    ``show`` names that do not fit, with the saved and the model's shapes."""
    own = model.state_dict()
    problems = []
    for name, tensor in own.items():
        value = saved.get(name)
        if name not in saved:
            problems.append(f"{name} missing (model {tuple(tensor.shape)})"
                            if isinstance(tensor, torch.Tensor) else f"{name} missing")
        elif (not name.endswith("_extra_state") and isinstance(tensor, torch.Tensor)
              and isinstance(value, torch.Tensor) and value.shape != tensor.shape):
            problems.append(f"{name} {tuple(value.shape)}/{tuple(tensor.shape)}")
    for name in saved:
        if name not in own:
            value = saved[name]
            problems.append(f"{name} not in the model (saved {tuple(value.shape)})"
                            if isinstance(value, torch.Tensor) else f"{name} not in the model")
    failed = torch.tensor([float(bool(problems))])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            failed = failed.cuda()
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if problems:
        more = f" (and {len(problems) - show} more)" if len(problems) > show else ""
        raise WarmupLoadError(
            f"{flag} {directory}: {len(problems)} saved tensors do not fit the model (saved/now "
            f"shapes): {'; '.join(problems[:show])}{more}; run with the model settings that "
            "saved it")
    if failed.item():
        raise WarmupLoadError(f"{flag} {directory}: another rank's saved tensors do not fit "
                              "the model (that rank names them)")
    model.load_state_dict(saved)


def load_init_weights(args: argparse.Namespace, model: GPTModel) -> None:
    """``--init-weights``: copy the model weights of the warm-up saved in that directory
    (complete or partial, any task, length, step or schedule; same shapes and TP / CP layout,
    :data:`SHAPE_KEYS`) into ``model``, this rank's shard from this rank's file. Weights only:
    the optimizer, step, learning-rate schedule, data stream and history stay those of a fresh
    run. The index branch comes trained with the rest.

    Raises :class:`WarmupLoadError` (a ValueError) when the file is missing, was saved with
    another shape (:func:`read_warmup`) or its tensors do not fit ``model``
    (:func:`load_saved_model`)."""
    state, step = read_warmup("--init-weights", args.init_weights, args)
    load_saved_model("--init-weights", args.init_weights, model, state["model"])
    if dist.get_rank() == 0:
        saved = state["settings"]
        print(f"initialised the weights from --init-weights {args.init_weights} (a warm-up at "
              f"step {step} of {saved.get('warmup_steps')}, --seq-len {saved.get('seq_len')}); "
              "fresh optimizer, step 0", flush=True)


def train_steps(history: History, model: GPTModel, optimizer: torch.optim.Optimizer,
                args: argparse.Namespace, device: torch.device, steps: range, mode: str,
                train_windows: Sequence[Window], eval_windows: Sequence[Window],
                deadline: Optional[float] = None) -> int:
    """Train ``steps`` (global step numbers, for the data order and the learning rate) in
    ``mode``, appending to ``history`` on rank 0. With ``deadline`` (a ``time.perf_counter()``
    value), stop after the first step that ends past it (every rank stops at the same step).
    Returns the number of the next step (``steps.stop`` when all ran)."""
    name = history.name
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    dp_group = parallel_state.get_data_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
    is_logger = dist.get_rank() == 0
    autocast = args.dtype == "bf16"
    start = time.perf_counter()
    next_step = steps.start
    for step in steps:
        if deadline is not None and step > steps.start:
            late = torch.tensor([float(time.perf_counter() > deadline)], device=device)
            dist.all_reduce(late, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            if late.item():
                break
        next_step = step + 1
        step_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        train_windows[step * dp_size + dp_size - 1]  # all of the step's windows, built now
        window = train_windows[step * dp_size + dp_rank]
        batch = make_batch(window, cp_group, args.block_size, args.top_k, device,
                           args.answer_weight)
        probe = arm_probe(model, window, batch, args, step) if probe_due(step, args) else None
        optimizer.zero_grad(set_to_none=True)
        loss, answer_share = lm_loss(model, batch, autocast, answers=True)
        loss.backward()
        reduce_index_grads_over_tp(model, tp_group)  # replicated index weights: partial grads
        all_reduce_gradients(model, dp_cp_group)
        clip_grad_norm(model, args.clip_grad, tp_group)
        optimizer.step()

        logged = torch.tensor([loss.item(), batch.attended_fraction if mode == "sparse" else 1.0,
                               answer_share], dtype=torch.float64, device=device)
        dist.all_reduce(logged, group=dp_cp_group)  # loss: sum of shares; fraction: mean below
        kl_per_layer = layer_kls(get_msa_metrics())  # collective: every rank calls it
        grown = (train_windows.observe(step, float(logged[2]) / dp_size)
                 if isinstance(train_windows, LazyWindows) and window.answers is not None
                 else None)
        probed = (summarize_probe(*probe, window, device, index_heads_of(args))
                  if probe is not None else None)
        accuracy = None
        if (window.answers is not None and args.eval_interval > 0
                and (step + 1) % args.eval_interval == 0):
            accuracy = evaluate_retrieval(model, eval_windows, args, device, False)["exact_match"]
            model.train()
        elapsed = time.perf_counter() - step_start
        if is_logger:
            history.steps.append(step + 1)
            history.loss.append(float(logged[0]) / dp_size)
            history.attended_fraction.append(float(logged[1]) / dist.get_world_size(dp_cp_group))
            if window.answers is not None:
                history.answer_loss.append(float(logged[2]) / dp_size)
            history.kl_per_layer.append(kl_per_layer)
            history.kl.append(sum(kl_per_layer) / len(kl_per_layer))
            history.mode.append(mode)
            history.tokens_per_s.append(args.seq_len * dp_size / elapsed)
            if grown is not None:
                history.curriculum.append([step + 1, grown])
                print(f"[{name}] step {step + 1:4d} curriculum: longest training sequence now "
                      f"{grown} tokens", flush=True)
            if accuracy is not None:
                history.eval_steps.append(step + 1)
                history.eval_exact_match.append(accuracy)
                print(f"[{name}] step {step + 1:4d} held-out exact match {accuracy:.3f}",
                      flush=True)
            if probed is not None:
                history.probe_steps.append(step + 1)
                history.key_hit_any.append(probed.pop("key_hit_any"))
                for key, values in probed.items():
                    field_name = key if key.endswith("_per_head") else f"{key}_per_layer"
                    getattr(history, field_name).append(values)
            if (step + 1) % args.log_interval == 0 or step == 0 or step + 1 == args.steps:
                extra = ""
                if history.probe_steps and history.probe_steps[-1] == step + 1:
                    extra = (f"  recall {mean(history.recall_per_layer[-1]):.3f}"
                             f" (best {mean(history.recall_best_per_layer[-1]):.3f})")
                    if window.answers is not None:
                        extra += (f" (answers {mean(history.recall_answer_per_layer[-1]):.3f},"
                                  f" record block chosen {mean(history.key_hit_per_layer[-1]):.2f}"
                                  f" [layer | head: {per_head_text(history.key_hit_per_head[-1])}])")
                if history.answer_loss:
                    recent = history.answer_loss[-args.log_interval:]
                    extra = f"  answer loss {mean(recent):.3f} (mean of {len(recent)})" + extra
                print(f"[{name}] step {step + 1:4d}/{args.steps} {mode:6s} "
                      f"loss {history.loss[-1]:.4f}  kl {history.kl[-1]:.4f} "
                      f"(layers {' '.join(f'{v:.3f}' for v in kl_per_layer)})  "
                      f"blocks {history.attended_fraction[-1]:.2f}{extra}  "
                      f"{history.tokens_per_s[-1]:,.0f} tok/s", flush=True)
    history.seconds += time.perf_counter() - start
    return next_step


def finish(history: History, model: GPTModel, args: argparse.Namespace, device: torch.device,
           mode: str, eval_windows: List[Window]) -> None:
    """Held-out LM loss (and retrieval metrics) of a trained variant, into ``history``."""
    name = history.name
    is_logger = dist.get_rank() == 0
    held_out = evaluate(model, eval_windows, args, device)
    retrieval = (evaluate_retrieval(model, eval_windows, args, device, True)
                 if eval_windows and eval_windows[0].answers is not None else None)
    if is_logger:
        history.held_out_loss = held_out
        print(f"[{name}] held-out loss {held_out:.4f} ({mode} attention, {len(eval_windows)} "
              f"windows of {args.seq_len} tokens); {history.seconds:.0f} s for {args.steps} steps",
              flush=True)
        if retrieval is not None:
            history.retrieval = retrieval
            print(f"[{name}] held-out retrieval: exact match {retrieval['exact_match']:.3f} "
                  f"({retrieval['questions']} questions; value-set guess "
                  f"{retrieval['value_set_chance']:.3f}), answer loss "
                  f"{retrieval['answer_loss']:.4f}, record block chosen "
                  f"{retrieval.get('key_hit', float('nan')):.2f} (per layer | index head: "
                  f"{per_head_text(retrieval.get('key_hit_per_head', []))}; by some layer and "
                  f"head {retrieval.get('key_hit_any', float('nan')):.2f})", flush=True)


def mean(values: Sequence[float]) -> float:
    return sum(values) / max(len(values), 1)


@torch.no_grad()
def evaluate(model: GPTModel, windows: List[Window], args: argparse.Namespace,
             device: torch.device) -> float:
    """Mean next-byte loss over held-out windows (token-weighted), in the model's current mode."""
    cp_group = parallel_state.get_context_parallel_group()
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = 0
    for window in windows:
        batch = make_batch(window, cp_group, args.block_size, args.top_k, device)
        loss_sum += float(lm_loss(model, batch, args.dtype == "bf16")) * batch.num_tokens_global
        tokens += batch.num_tokens_global
    dist.all_reduce(loss_sum, group=cp_group)  # each CP rank holds its tokens' share
    return float(loss_sum) / max(tokens, 1)


@torch.no_grad()
def evaluate_retrieval(model: GPTModel, windows: List[Window], args: argparse.Namespace,
                       device: torch.device, probing: bool) -> Dict[str, object]:
    """Answer-token loss and exact match (teacher-forced argmax of every value byte) over the
    held-out retrieval windows, in the model's current mode; with the probe, also the selection
    recall, the share of questions whose record block is selected and the distance histogram of
    the selected blocks, per layer (first window)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    cp_group = parallel_state.get_context_parallel_group()
    model.eval()
    value_len = retrieval_task.spec_from_args(args).value_len
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    answers = 0
    correct: List[int] = []
    set_chance: List[float] = []
    result: Dict[str, object] = {}
    for w, window in enumerate(windows):
        batch = make_batch(window, cp_group, args.block_size, args.top_k, device)
        probe = arm_probe(model, window, batch, args, -1) if probing and w == 0 else None
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bf16"):
            logits = model(batch.input_ids, batch.position_ids, None,
                           packed_seq_params=batch.packed_seq_params)
        with unittest.mock.patch.object(torch.cuda, "current_device", return_value="cpu") \
                if device.type == "cpu" else contextlib.nullcontext():
            # megatron-core's gather allocates on torch.cuda.current_device(): on CPU, the CPU
            logits = gather_from_tensor_model_parallel_region(logits)[0].float()  # [S/CP, V]
        local = torch.full((window.tokens.numel(),), -1, dtype=torch.int64)
        local[batch.rows] = torch.arange(batch.rows.numel())
        rows = torch.tensor(window.answers.rows, dtype=torch.int64)
        query = torch.tensor(window.answers.query, dtype=torch.int64)
        held = local[rows] >= 0
        at = local[rows][held].to(device)
        labels = batch.labels[0, at]
        log_probs = torch.log_softmax(logits[at], dim=-1)
        loss_sum += -log_probs.gather(1, labels[:, None]).sum().double()
        hits = torch.zeros(len(window.answers.first_rows), dtype=torch.float64, device=device)
        hits.index_add_(0, query[held].to(device), (log_probs.argmax(-1) == labels).double())
        dist.all_reduce(hits, group=cp_group)
        correct.extend(int(h) for h in hits.tolist())
        set_chance.extend(window.answers.value_set_chance)
        answers += rows.numel()
        if probe is not None:
            probed = summarize_probe(*probe, window, device, index_heads_of(args))
            result["key_hit_per_head"] = probed.pop("key_hit_per_head")
            result["key_hit_any"] = probed.pop("key_hit_any")
            result.update({key: mean(values) for key, values in probed.items()})
            result.update({f"{key}_per_layer": values for key, values in probed.items()})
            uniform = probe[1]
            histograms = {
                f"layer_{layer:02d}": distance_histogram(
                    sample.block_idx[:uniform], sample.q_pos[:uniform], args.block_size,
                    max(window.seq_lens) // args.block_size)
                for layer, sample in sorted(probe[0].samples.items())}
            # every CP rank sampled rows of its own: the counts of all of them (this TP rank's
            # heads)
            counts = torch.tensor([[float(n) for n in h.values()] for h in histograms.values()],
                                  dtype=torch.float64, device=device)
            dist.all_reduce(counts, group=cp_group)
            result["distance_histogram"] = {
                layer: {label: int(n) for label, n in zip(h, row.tolist())}
                for (layer, h), row in zip(histograms.items(), counts)}
    dist.all_reduce(loss_sum, group=cp_group)
    result.update({"exact_match": retrieval_task.exact_match(correct, value_len),
                   "answer_loss": float(loss_sum) / max(answers, 1), "questions": len(correct),
                   "value_set_chance": mean(set_chance) if set_chance else 0.0})
    return result


# ----------------------------------------------------------------------------- output


def metrics_record(args: argparse.Namespace, histories: List[History]) -> Dict:
    """What ``metrics.json`` holds: the arguments (numbers as JSON numbers, paths as strings)
    and every run's per-step history."""
    return {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "runs": [vars(h) for h in histories]}


def loss_title(histories: List[History]) -> str:
    """Title of the training-loss panel (the "same data order" remark needs two runs)."""
    if len(histories) > 1:
        return "training loss, same data order for every run"
    return f"training loss ({histories[0].name} run only)" if histories else "training loss"


def plot(histories: List[History], path: Path, warmup_steps: int) -> None:
    """One PNG: training loss of every run, the MSA-minus-dense loss gap (when both ran) and the
    index-branch KL."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {h.name: h for h in histories}
    with_gap = "msa" in runs and "dense" in runs
    with_recall = any(h.probe_steps for h in histories)
    panels = 2 + with_gap + with_recall
    fig, axes = plt.subplots(1, panels, figsize=(5.4 * panels, 4))
    ax_loss, ax_kl = axes[0], axes[1 + with_gap]
    styles = {"msa": dict(color="tab:red"), "dense": dict(color="tab:blue", linestyle="--"),
              "random": dict(color="tab:green"), "local": dict(color="tab:gray")}
    for h in histories:
        label = f"{h.name} (held-out {h.held_out_loss:.3f})" if h.held_out_loss else h.name
        ax_loss.plot(h.steps, h.loss, label=label, **styles.get(h.name, {}))
        ax_kl.plot(h.steps, h.kl, label=f"{h.name}: mean KL over layers", **styles.get(h.name, {}))
    if with_recall:
        ax_recall = axes[-1]
        for h in histories:
            if h.probe_steps and h.name != "local":
                ax_recall.plot(h.probe_steps, [mean(v) for v in h.recall_per_layer],
                               label=f"{h.name}: recall", **styles.get(h.name, {}))
                if any(h.recall_best_per_layer):
                    ax_recall.plot(h.probe_steps, [mean(v) for v in h.recall_best_per_layer],
                                   label=f"{h.name}: best selection's recall", linewidth=0.8,
                                   **{**styles.get(h.name, {}), "linestyle": "--"})
                if any(h.key_hit_per_layer) and h.key_hit_per_layer[0]:
                    ax_recall.plot(h.probe_steps, [mean(v) for v in h.key_hit_per_layer],
                                   label=f"{h.name}: record block chosen", marker=".",
                                   **{**styles.get(h.name, {}), "linestyle": ":"})
        ax_recall.set_ylim(0, 1.02)
        ax_recall.set_ylabel("share")
        ax_recall.set_title("selection recall of the dense attention mass")
    if with_gap:
        gap = [m - d for m, d in zip(runs["msa"].loss, runs["dense"].loss)]
        axes[1].plot(runs["msa"].steps, gap, color="tab:purple", label="msa - dense")
        axes[1].axhline(0.0, color="black", linewidth=0.6)
        axes[1].set_ylabel("loss difference (nats / byte)")
        axes[1].set_title("cost of sparse attention, step by step")
    for ax in axes:
        ax.axvline(warmup_steps + 0.5, color="gray", linewidth=0.8, label="msa: dense -> sparse")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    ax_loss.set_ylabel("LM loss (nats / byte)")
    ax_loss.set_title(loss_title(histories))
    ax_kl.set_ylabel("KL(main attention || index branch)")
    ax_kl.set_yscale("log")
    ax_kl.set_title("index-branch KL per token and index head")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- entry point


# Sizes whose default depends on --quick: an explicit flag always wins over both columns.
FULL_SIZES = dict(steps=120, warmup_steps=30, seq_len=2048, layers=4, hidden=256, ffn_hidden=704,
                  heads=4, query_groups=2, block_size=64, top_k=8, index_head_dim=64,
                  eval_windows=4, lr_warmup=10, log_interval=5)
QUICK_SIZES = dict(steps=8, warmup_steps=3, seq_len=256, layers=2, hidden=128, ffn_hidden=256,
                   heads=2, query_groups=2, block_size=16, top_k=4, index_head_dim=64,
                   eval_windows=2, lr_warmup=2, log_interval=1)
DEFAULT_OUT_ROOT = Path("runs/pretrain_tiny")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` except for options whose default is None (their help says)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (plus a pointer to ``--help``), not the
    40-line usage block above it."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    """The command line; sizes default to ``None`` and are filled in by :func:`parse_args`."""
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)

    def size(flag: str, kind, help_text: str = "") -> None:
        key = flag[2:].replace("-", "_")
        sizes = f"default {FULL_SIZES[key]}; with --quick {QUICK_SIZES[key]}"
        p.add_argument(flag, type=kind, default=None,
                       help=f"{help_text} ({sizes})" if help_text else f"({sizes})")

    size("--steps", int, "training steps of each run")
    size("--warmup-steps", int, "dense-attention steps before switching MSA to sparse")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (1 unless given; examples/run_tiny.sh always "
                        "passes --tp $TP, whose own default is 2)")
    p.add_argument("--cp", type=int, default=None,
                   help=f"context-parallel size: 1, 2, 4 or 8, documents being padded to "
                        f"{PAD_MULTIPLE} tokens (1 unless given; examples/run_tiny.sh always "
                        f"passes --cp $CP, whose own default is 2)")
    size("--seq-len", int, f"tokens per packed window, a multiple of {PAD_MULTIPLE}")
    size("--layers", int, "transformer layers")
    size("--hidden", int, "hidden size")
    size("--ffn-hidden", int, "MLP hidden size")
    size("--heads", int, "query heads (head dim = hidden / heads)")
    size("--query-groups", int, "GQA KV groups")
    size("--block-size", int, "MSA key block size")
    size("--top-k", int, "MSA selected blocks per query")
    size("--index-head-dim", int, "MSA index head dim Di")
    # The other MSAConfig fields (--kl-coeff, --init-blocks, ...); the three above are kept.
    add_msa_arguments(p, prefix="", warmup=False,
                      defaults=MSAConfig(block_size=64, top_k=8, index_head_dim=64))
    p.add_argument("--rotary-base", type=int, default=10000,
                   help="RoPE base; long-range retrieval at 8K-32K tokens wants a larger one "
                        "(1000000), so that low-frequency dims still match keys far away")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate")
    size("--lr-warmup", int, "linear learning-rate warmup steps")
    p.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip")
    size("--eval-windows", int, "held-out windows")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the dense-attention run (same as --runs msa)")
    p.add_argument("--runs", default=None,
                   help="comma-separated model variants to train, in order, same weights and "
                        f"data: {VARIANT_HELP} (default: msa,dense; retrieval: "
                        "msa,random,local,dense)")
    p.add_argument("--save-warmup", type=Path, default=None,
                   help="after the dense warm-up, save model, optimizer and history here (one "
                        "file per rank), so that variants can later run as separate processes; "
                        "a partial warm-up there is continued (--resume-warmup), not replaced")
    p.add_argument("--load-warmup", type=Path, default=None,
                   help="skip the warm-up: start the variants from a --save-warmup directory "
                        "written by a run with the same model, data and warm-up settings")
    p.add_argument("--resume-warmup", type=Path, default=None,
                   help="continue the (partial) warm-up saved in this --save-warmup directory "
                        "exactly where it stopped: model, optimizer, step, learning-rate "
                        "schedule, data position and length curriculum (same settings); a "
                        "complete one is loaded like --load-warmup")
    p.add_argument("--init-weights", type=Path, default=None,
                   help="length extension: start this run's dense warm-up from the model weights "
                        "of a --save-warmup directory (complete or partial; its task, lengths, "
                        "steps and lr may differ, the model shape and TP / CP layout may not), "
                        "trained index branch included (the random variant still resets it to "
                        "random weights); fresh optimizer, step 0, lr schedule and data. "
                        "Recorded in the saved warm-up: --resume-warmup of it accepts the same "
                        "--init-weights or none (not read again), and refuses another")
    p.add_argument("--warmup-until", type=int, default=None,
                   help="chained warm-up: train the warm-up only up to this global step (at "
                        "most --warmup-steps), save it to --save-warmup and exit without the "
                        "variants")
    p.add_argument("--warmup-seconds", type=float, default=None,
                   help="chained warm-up: train the warm-up for at most this many seconds "
                        "(stopping at a step boundary; start-up not counted), save it to "
                        "--save-warmup and exit without the variants")
    p.add_argument("--task", choices=("text", "retrieval"), default="text",
                   help="text: next-byte prediction on stdlib sources; retrieval: key -> value "
                        "recall in long filler text (examples/retrieval_task.py)")
    p.add_argument("--probe-interval", type=int, default=None,
                   help="steps between selection-recall measurements (0: never; default: "
                        "--log-interval)")
    p.add_argument("--seed", type=int, default=1234, help="weights, data order")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   default="cuda" if torch.cuda.is_available() else "cpu",
                   help="gloo on cpu, NCCL on cuda; the default is cuda where a GPU is visible")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default=None,
                   help="compute dtype (default: bf16 autocast on CUDA, fp32 on CPU)")
    size("--log-interval", int, "steps between log lines")
    p.add_argument("--out-dir", type=Path, default=None,
                   help=f"output directory (default: {DEFAULT_OUT_ROOT}/tp<TP>-cp<CP>, or the "
                        "next free -2, -3, ... if that one holds an earlier run; the run says "
                        "which at its start)")
    p.add_argument("--quick", action="store_true",
                   help="a few steps at a tiny size (CI smoke run); explicit flags still win")
    p.add_argument("--check-only", action="store_true",
                   help="check the settings for WORLD_SIZE processes (env, default 1), then exit")
    retrieval_task.add_arguments(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse the command line; options left unset take the full or the ``--quick`` size."""
    p = build_parser()
    args = p.parse_args(argv)
    sizes = dict(QUICK_SIZES if args.quick else FULL_SIZES)
    if args.task == "retrieval":  # unset for --task text, which refuses them when given
        sizes.update(retrieval_task.QUICK_SIZES if args.quick else retrieval_task.FULL_SIZES)
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.tp = 1 if args.tp is None else args.tp
    args.cp = 1 if args.cp is None else args.cp
    if args.dtype is None:
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    if args.probe_interval is None:
        args.probe_interval = args.log_interval
    if args.no_baseline and args.runs is not None and args.runs.strip() != "msa":
        p.error(f"--no-baseline (same as --runs msa) contradicts --runs {args.runs}: give one "
                "of them")
    if args.runs is None:
        args.runs = ("msa" if args.no_baseline else
                     "msa,random,local,dense" if args.task == "retrieval" else "msa,dense")
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in VARIANTS]
    if unknown or not args.runs or len(set(args.runs)) != len(args.runs):
        p.error(f"--runs takes distinct names among {', '.join(VARIANTS)}; got {args.runs}")
    if args.task == "retrieval":
        if args.task_len is None:
            args.task_len = args.seq_len
        if (args.task_len < PAD_MULTIPLE or args.seq_len % args.task_len
                or args.task_len % PAD_MULTIPLE):
            p.error(f"--task-len ({args.task_len}) must divide --seq-len ({args.seq_len}) and be "
                    f"a multiple of {PAD_MULTIPLE}")
        if args.task_len_min is not None and not (
                PAD_MULTIPLE <= args.task_len_min <= args.task_len
                and args.task_len_min % PAD_MULTIPLE == 0):
            p.error(f"--task-len-min must be a multiple of {PAD_MULTIPLE} in "
                    f"[{PAD_MULTIPLE}, --task-len]")
        if args.task_question_every < 1:
            p.error(f"--task-question-every ({args.task_question_every}) must be >= 1")
        if args.task_curriculum < 0 or (args.task_curriculum and args.task_len_min is None):
            p.error(f"--task-curriculum ({args.task_curriculum}) must be >= 0 and needs "
                    "--task-len-min")
        gate = args.task_curriculum_gate
        if not math.isfinite(gate) or gate < 0 or (gate and (
                args.task_len_min is None or args.task_curriculum)):
            p.error(f"--task-curriculum-gate ({gate}) must be a finite number >= 0 and "
                    "needs --task-len-min, without --task-curriculum")
        if gate and args.task_len_min == args.task_len:
            p.error(f"--task-curriculum-gate ({gate}) grows the training length from "
                    f"--task-len-min to --task-len, but both are {args.task_len}")
        if gate and args.warmup_steps == 0:
            p.error(f"--task-curriculum-gate ({gate}) grows the training length during the "
                    "dense warm-up, but --warmup-steps is 0")
        if args.task_curriculum_span < 1:
            p.error(f"--task-curriculum-span ({args.task_curriculum_span}) must be >= 1")
        if gate and args.task_curriculum_span >= args.warmup_steps:
            p.error(f"--task-curriculum-span ({args.task_curriculum_span}) must be shorter than "
                    f"--warmup-steps ({args.warmup_steps}): the gate averages that many warm-up "
                    "steps before the length can first grow")
        if not gate and args.task_curriculum_span != p.get_default("task_curriculum_span"):
            p.error(f"--task-curriculum-span ({args.task_curriculum_span}) is the window of "
                    "--task-curriculum-gate, which is not given")
        try:
            spec = retrieval_task.spec_from_args(args)
            spec.check()
        except ValueError as error:
            p.error(str(error))
        args.vocab_size = -(-spec.vocab_size // 128) * 128  # divisible by any TP size <= 128
    else:
        given = [f"--{dest.replace('_', '-')} {getattr(args, dest)}"
                 for dest in retrieval_task.RETRIEVAL_ONLY
                 if getattr(args, dest) != p.get_default(dest)]
        if given:
            p.error(f"{', '.join(given)}: flags of the retrieval task, which --task {args.task} "
                    "does not read (add --task retrieval, or drop them)")
        args.vocab_size = VOCAB_SIZE
    return args


def check_settings(args: argparse.Namespace, world_size: int) -> List[str]:
    """Every problem of the layout and sizes that would otherwise surface later (inside
    torchrun, megatron-core or the MSA layers); checked before any process group starts.

    Returns one message per problem (empty: all good).
    """
    errors: List[str] = []
    tp, cp = args.tp, args.cp
    if tp < 1 or cp < 1:
        errors.append(f"--tp {tp} and --cp {cp} must be >= 1")
    elif world_size % (tp * cp):
        errors.append(f"{_processes(world_size)} (NPROC / --nproc-per-node): not a multiple of "
                      f"TP x CP = {tp} x {cp} = {tp * cp}; the rest of the world is data parallel")
    if cp >= 1 and (cp > MAX_CP or PAD_MULTIPLE % (2 * cp)):
        errors.append(f"--cp {cp}: context parallelism splits every packed document into "
                      f"2 x CP = {2 * cp} equal chunks and documents are padded to "
                      f"{PAD_MULTIPLE} tokens, so CP must be 1, 2, 4 or 8")
    if args.seq_len < PAD_MULTIPLE or args.seq_len % PAD_MULTIPLE:
        errors.append(f"--seq-len {args.seq_len} must be a positive multiple of {PAD_MULTIPLE}")
    try:
        config = msa_config(args)
    except (TypeError, ValueError) as e:
        config = None
        errors.append(f"MSA options (--block-size {args.block_size}, --top-k {args.top_k}, "
                      f"--index-head-dim {args.index_head_dim}): {e}")
    if (config is not None and tp >= 1 and args.heads >= 1 and args.query_groups >= 1
            and args.heads % args.query_groups == 0):
        heads = types.SimpleNamespace(num_attention_heads=args.heads,
                                      num_query_groups=args.query_groups)
        try:  # the layers' own split of the index heads over TP, every rank
            for rank in range(tp):
                build_head_layout(heads, config, tp, rank)
        except ValueError as e:
            errors.append(f"index heads (--index-heads {args.index_heads}, --heads {args.heads}, "
                          f"--query-groups {args.query_groups}, --tp {tp}): {e}")
    if (args.backend == "triton" and args.device == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        errors.append("--backend triton with --device cpu runs the kernels in Triton's CPU "
                      "interpreter: set TRITON_INTERPRET=1 (slow), or use --backend torch")
    if args.block_size > args.seq_len:
        errors.append(f"--block-size {args.block_size} is larger than --seq-len {args.seq_len}: "
                      "every query would attend to its whole causal row")
    if args.heads < 1 or args.hidden % args.heads:
        errors.append(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    elif args.index_head_dim < args.hidden // args.heads:
        errors.append(f"--index-head-dim {args.index_head_dim} is smaller than the RoPE dims "
                      f"(head dim {args.hidden // args.heads} = --hidden / --heads): the index "
                      "branch gets the layer's RoPE, which rotates every head dim")
    if args.query_groups < 1 or args.heads % args.query_groups:
        errors.append(f"--heads {args.heads} must be a multiple of --query-groups "
                      f"{args.query_groups}")
    if tp >= 1 and args.heads % tp:
        errors.append(f"--heads {args.heads} must be a multiple of --tp {tp}")
    if tp >= 1 and args.query_groups >= 1 and args.query_groups % tp and tp % args.query_groups:
        errors.append(f"--query-groups {args.query_groups} and --tp {tp}: one must divide the "
                      "other")
    for flag, value in (("--layers", args.layers), ("--hidden", args.hidden),
                        ("--ffn-hidden", args.ffn_hidden), ("--rotary-base", args.rotary_base)):
        if value < 1:
            errors.append(f"{flag} {value} must be >= 1")
    if tp > 1:  # megatron-core's column-parallel linears split these output sizes over TP
        if args.ffn_hidden >= 1 and args.ffn_hidden % tp:
            errors.append(f"--ffn-hidden {args.ffn_hidden} must be a multiple of --tp {tp} (the "
                          "MLP's first linear is split over TP)")
        if args.vocab_size % tp:
            errors.append(f"--tp {tp}: the vocabulary of {args.vocab_size} rows (--task "
                          f"{args.task}) is split over TP, so TP must divide it")
    for flag, value in (("--lr", args.lr), ("--clip-grad", args.clip_grad)):
        if not (math.isfinite(value) and value > 0):  # a negative clip would flip the gradient
            errors.append(f"{flag} {value} must be a finite number > 0")
    if args.probe_interval < 0:
        errors.append(f"--probe-interval {args.probe_interval} must be >= 0 (0: never)")
    if args.probe_rows < 1:
        errors.append(f"--probe-rows {args.probe_rows} must be >= 1")
    if args.task == "retrieval":
        if not (math.isfinite(args.answer_weight) and args.answer_weight > 0):
            errors.append(f"--answer-weight {args.answer_weight} must be a finite number > 0")
        if args.min_distance < 0:
            errors.append(f"--min-distance {args.min_distance} must be >= 0")
        if args.eval_interval < 0:
            errors.append(f"--eval-interval {args.eval_interval} must be >= 0 (0: at the end "
                          "only)")
    if args.steps < 1:
        errors.append(f"--steps {args.steps} must be >= 1")
    if not 0 <= args.warmup_steps <= args.steps:
        errors.append(f"--warmup-steps {args.warmup_steps} must be in [0, --steps {args.steps}]")
    if args.lr_warmup < 0:  # longer than --steps is allowed: the peak is then never reached
        errors.append(f"--lr-warmup {args.lr_warmup} must be >= 0")
    if args.save_warmup is not None and args.load_warmup is not None:
        errors.append("--save-warmup and --load-warmup exclude each other (continue a saved "
                      "warm-up with --resume-warmup)")
    if args.load_warmup is not None and args.resume_warmup is not None:
        errors.append("--load-warmup and --resume-warmup exclude each other")
    if args.init_weights is not None and args.load_warmup is not None:
        errors.append("--init-weights and --load-warmup exclude each other (--load-warmup "
                      "starts the variants from a saved warm-up's weights; --init-weights starts "
                      "a new warm-up from them)")
    if (args.init_weights is not None and args.save_warmup is not None
            and args.init_weights.resolve() == args.save_warmup.resolve()):
        errors.append(f"--init-weights and --save-warmup are both {args.init_weights}: the new "
                      "warm-up would overwrite the one it starts from; save it elsewhere")
    init = args.init_weights if args.resume_warmup is None else None  # resumed: not read
    for flag, directory in (("--load-warmup", args.load_warmup),
                            ("--resume-warmup", args.resume_warmup), ("--init-weights", init)):
        if directory is not None and not directory.is_dir():
            errors.append(f"{flag} {directory} is not a directory")
    chained = [f for f, v in (("--warmup-until", args.warmup_until),
                              ("--warmup-seconds", args.warmup_seconds)) if v is not None]
    if chained and args.save_warmup is None:
        errors.append(f"{' and '.join(chained)} need{'s' if len(chained) == 1 else ''} "
                      "--save-warmup (where the warm-up goes)")
    if args.warmup_until is not None and not 1 <= args.warmup_until <= args.warmup_steps:
        errors.append(f"--warmup-until {args.warmup_until} must be in [1, --warmup-steps "
                      f"{args.warmup_steps}]")
    if args.warmup_seconds is not None and not (math.isfinite(args.warmup_seconds)
                                                and args.warmup_seconds > 0):
        errors.append(f"--warmup-seconds {args.warmup_seconds} must be a finite number > 0")
    if args.warmup_steps == 0 and (args.save_warmup is not None or chained
                                   or args.resume_warmup is not None):
        flags = [f for f, v in (("--save-warmup", args.save_warmup),
                                ("--resume-warmup", args.resume_warmup)) if v is not None]
        flags += chained
        errors.append(f"{' and '.join(flags)} need{'s' if len(flags) == 1 else ''} a dense "
                      "warm-up, but --warmup-steps is 0")
    for flag, value in (("--eval-windows", args.eval_windows),
                        ("--log-interval", args.log_interval)):
        if value < 1:
            errors.append(f"{flag} {value} must be >= 1")
    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            errors.append(f"--device cuda (DEVICE=cuda): no CUDA device is visible (torch "
                          f"{torch.__version__}, {build}); use --device cpu")
        elif torch.cuda.device_count() < local:
            errors.append(f"--device cuda: {_processes(local)} on this node but only "
                          f"{torch.cuda.device_count()} CUDA devices are visible")
    if not errors:  # the saved warm-up files, once the flags themselves make sense
        errors.extend(check_warmup_dirs(args, world_size))
    return errors


def resolve_out_dir(args: argparse.Namespace) -> Tuple[Path, str]:
    """``(directory, note)``: ``--out-dir`` as given (the note says when it replaces an earlier
    run there), else ``runs/pretrain_tiny/tp<TP>-cp<CP>``, or its next free ``-2``, ``-3``, ...
    when an earlier run is there: a layout never overwrites another run's results unannounced."""
    if args.out_dir is not None:
        earlier = (args.out_dir / "metrics.json").exists()
        return args.out_dir, " (replaces the earlier run there)" if earlier else ""
    base = DEFAULT_OUT_ROOT / f"tp{args.tp}-cp{args.cp}"
    candidate, n = base, 1
    while (candidate / "metrics.json").exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    note = f" ({base} holds an earlier run; pass --out-dir to choose)" if n > 1 else ""
    return candidate, note


def init_distributed(args: argparse.Namespace) -> torch.device:
    """Join torchrun's process group (or a one-rank group when run without torchrun)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores; oversubscription is slow
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=rank,
                            world_size=world, timeout=timedelta(minutes=10))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp,
                                             context_parallel_size=args.cp)
    if args.device == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(args.seed)
    return device


def report_invalid(errors: Sequence[str]) -> None:
    """Print ``errors`` (settings or a saved warm-up this run cannot use) to stderr, one per
    line under the script's "nothing was started" header."""
    print("pretrain_tiny.py: invalid settings, nothing was started:\n  - "
          + "\n  - ".join(errors), file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    errors = check_settings(args, world)
    if errors:
        if int(os.environ.get("RANK", 0)) == 0:  # one message, not one per rank
            report_invalid(errors)
        return 2
    out_dir, out_note = resolve_out_dir(args)
    if args.check_only:
        print(f"settings OK for {_processes(world)}: TP {args.tp} x CP {args.cp} x DP "
              f"{world // (args.tp * args.cp)}; output to {out_dir}{out_note}", flush=True)
        return 0
    args.out_dir = out_dir
    device = init_distributed(args)
    dp_size = parallel_state.get_data_parallel_world_size()
    is_logger = dist.get_rank() == 0
    if is_logger:
        print(f"world {dist.get_world_size()} = TP {args.tp} x CP {args.cp} x DP {dp_size} "
              f"on {device.type} ({args.dtype}); {args.layers} layers, hidden {args.hidden}, "
              f"{args.heads} heads / {args.query_groups} groups; seq {args.seq_len}, "
              f"MSA block {args.block_size} top-k {args.top_k}; {args.steps} steps, "
              f"dense warmup {args.warmup_steps}", flush=True)
        print(f"output: {args.out_dir}{out_note}", flush=True)

    split = split_files(stdlib_files(), args.seed)
    if args.task == "retrieval":
        train_windows = take_retrieval_windows(split["train"], args, args.steps * dp_size,
                                               args.seed, mixed=True)
        eval_windows = take_retrieval_windows(split["held_out"], args, args.eval_windows,
                                              args.seed + 1)
    else:
        train_windows = take_windows(split["train"], args.seq_len, args.steps * dp_size)
        eval_windows = take_windows(split["held_out"], args.seq_len, args.eval_windows)
    if is_logger:
        print(f"data: {len(split['train'])} train / {len(split['held_out'])} held-out stdlib files "
              f"({sysconfig.get_paths()['stdlib']}); {len(train_windows)} train windows, "
              f"{len(eval_windows)} held-out windows", flush=True)

    record: Dict = {}  # the last metrics.json written: the final table reads it

    def save(histories: List[History]) -> None:  # after every variant: a cut run keeps some
        nonlocal record
        if is_logger:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            record = metrics_record(args, histories)
            (args.out_dir / "metrics.json").write_text(json.dumps(record, indent=1))

    try:
        histories = run_variants(args, device, train_windows, eval_windows, save)
    except WarmupLoadError as error:  # before any training step: reported like the checks
        report_invalid([(f"rank {dist.get_rank()}: " if dist.get_world_size() > 1 else "")
                        + str(error)])
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        return 2

    if is_logger and histories:
        plot(histories, args.out_dir / "pretrain_tiny.png", args.warmup_steps)
        print("held-out loss: " + ", ".join(f"{h.name} {h.held_out_loss:.4f}" for h in histories))
        if args.task == "retrieval":
            # the table of examples/retrieval_report.py (one table for both scripts)
            print(retrieval_report.report_text(retrieval_report.runs_of_record(record), []),
                  flush=True)
        print(f"wrote {args.out_dir / 'metrics.json'} and {args.out_dir / 'pretrain_tiny.png'}",
              flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
