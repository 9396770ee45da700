"""Turn a text corpus into Megatron's indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``), byte-level.

The tokenizer needs no download: a document's tokens are its UTF-8 bytes (ids 0-255), followed
by one end-of-document id, 256. Train on the result with megatron's null tokenizer set to match::

    --data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 257 --null-tokenizer-eod-id 256

(``msa_gpt_args.sh`` uses exactly these flags when ``DATA_PATH`` is set.) One file is one
document. Default corpus: the ``*.py`` files of this Python's standard library (third-party
``site-packages`` excluded), as ``examples/pretrain_tiny.py`` uses.

Usage::

    python examples/megatron_lm/prepare_data.py --output-prefix /data/stdlib_bytes
    python examples/megatron_lm/prepare_data.py --output-prefix /data/docs --input ~/docs \\
        --pattern '*.md' --pattern '*.txt'

The files are written with megatron-core's own ``IndexedDatasetBuilder`` (token dtype uint16) and
read back with ``IndexedDataset`` to check the document count. Needs only megatron-core (any
version from 0.16 on) and numpy; no GPU, no ``megatron.training``.
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence

import numpy

VOCAB_SIZE = 257  # 256 byte values + end of document
EOD_ID = 256
TOKENIZER_FLAGS = (f"--tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE} "
                   f"--null-tokenizer-eod-id {EOD_ID}")


def stdlib_dir() -> Path:
    """This Python's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(inputs: Sequence[Path], patterns: Sequence[str]) -> List[Path]:
    """Files under ``inputs`` (files are taken as given, directories searched recursively for
    ``patterns``), sorted, ``site-packages`` / ``dist-packages`` excluded.

    Raises:
        FileNotFoundError: an input does not exist.
    """
    files = set()
    for root in inputs:
        if root.is_file():
            files.add(root)
            continue
        if not root.is_dir():
            raise FileNotFoundError(f"--input {root} does not exist")
        for pattern in patterns:
            for path in root.rglob(pattern):
                parts = set(path.relative_to(root).parts)
                if path.is_file() and not parts & {"site-packages", "dist-packages"}:
                    files.add(path)
    return sorted(files)


def byte_tokens(text: bytes) -> numpy.ndarray:
    """Token ids of one document: its bytes, then :data:`EOD_ID` (uint16)."""
    tokens = numpy.empty(len(text) + 1, dtype=numpy.uint16)
    tokens[:-1] = numpy.frombuffer(text, dtype=numpy.uint8)
    tokens[-1] = EOD_ID
    return tokens


def write_indexed_dataset(documents: Iterable[bytes], output_prefix: str) -> int:
    """Write byte-level documents as ``output_prefix.bin`` / ``.idx`` with megatron-core's
    ``IndexedDatasetBuilder``; one sequence per document, empty documents skipped.

    Returns:
        The number of documents written.

    Raises:
        ValueError: no non-empty document.
    """
    from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, get_bin_path,
                                                        get_idx_path)

    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=numpy.uint16)
    count = 0
    for text in documents:
        if not text:
            continue
        tokens = byte_tokens(text)
        builder.add_document(tokens, [len(tokens)])
        count += 1
    if count == 0:
        builder.data_file.close()
        os.remove(get_bin_path(output_prefix))
        raise ValueError("no non-empty document in the corpus")
    builder.finalize(get_idx_path(output_prefix))
    return count


def _read(files: Iterable[Path]) -> Iterator[bytes]:
    for path in files:
        yield path.read_bytes()


def main(argv: Sequence[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output-prefix", required=True,
                        help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.idx")
    parser.add_argument("--input", type=Path, action="append",
                        help="file or directory (repeatable); default: the standard library")
    parser.add_argument("--pattern", action="append",
                        help="file name pattern inside directories (repeatable; default *.py)")
    parser.add_argument("--max-files", type=int, default=None,
                        help="use only the first N files (sorted), for quick runs")
    args = parser.parse_args(argv)
    files = corpus_files(args.input or [stdlib_dir()], args.pattern or ["*.py"])
    if args.max_files is not None:
        files = files[:args.max_files]
    if not files:
        raise SystemExit("no input files found")
    count = write_indexed_dataset(_read(files), args.output_prefix)

    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(args.output_prefix)
    if len(dataset) != count:
        raise SystemExit(f"read back {len(dataset)} documents, wrote {count}")
    tokens = int(dataset.sequence_lengths.sum())
    print(f"wrote {args.output_prefix}.bin/.idx: {count} documents, {tokens} tokens "
          f"(bytes + end-of-document) from {len(files)} files")
    print(f"train with: --data-path {os.path.abspath(args.output_prefix)} {TOKENIZER_FLAGS}")


if __name__ == "__main__":
    main()
