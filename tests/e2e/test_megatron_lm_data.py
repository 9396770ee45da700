"""The data step of the Megatron-LM kit: a byte-level corpus written with megatron-core's
IndexedDatasetBuilder reads back, token for token, through megatron-core's IndexedDataset."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples" / "megatron_lm"))
import prepare_data  # noqa: E402


def test_byte_tokens():
    tokens = prepare_data.byte_tokens("é!".encode())
    assert tokens.dtype == numpy.uint16
    assert tokens.tolist() == [0xC3, 0xA9, ord("!"), prepare_data.EOD_ID]
    assert prepare_data.VOCAB_SIZE == prepare_data.EOD_ID + 1 == 257


def test_corpus_files_skip_site_packages(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "sub" / "c.txt").write_text("text\n")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "d.py").write_text("z = 3\n")
    files = prepare_data.corpus_files([tmp_path], ["*.py"])
    assert [f.relative_to(tmp_path).as_posix() for f in files] == ["a.py", "sub/b.py"]
    both = prepare_data.corpus_files([tmp_path], ["*.py", "*.txt"])
    assert len(both) == 3
    with pytest.raises(FileNotFoundError, match="missing"):
        prepare_data.corpus_files([tmp_path / "missing"], ["*.py"])


def test_written_dataset_reads_back(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = [b"def f():\n    return 1\n", b"", "# ünïcode\n".encode(), b"x" * 1000]
    prefix = str(tmp_path / "out" / "corpus")
    assert prepare_data.write_indexed_dataset(docs, prefix) == 3  # the empty one is skipped
    dataset = IndexedDataset(prefix)
    assert len(dataset) == 3
    kept = [d for d in docs if d]
    for i, doc in enumerate(kept):
        tokens = dataset[i]
        assert tokens.dtype == numpy.uint16
        assert bytes(tokens[:-1].astype(numpy.uint8)) == doc
        assert tokens[-1] == prepare_data.EOD_ID
    assert dataset.sequence_lengths.tolist() == [len(d) + 1 for d in kept]
    assert dataset.document_indices.tolist() == [0, 1, 2, 3]


def test_empty_corpus_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no non-empty document"):
        prepare_data.write_indexed_dataset([b""], str(tmp_path / "empty"))
    assert not (tmp_path / "empty.bin").exists()


def test_command_line_on_the_standard_library(tmp_path, capsys):
    prefix = str(tmp_path / "stdlib")
    prepare_data.main(["--output-prefix", prefix, "--max-files", "5"])
    out = capsys.readouterr().out
    first = prepare_data.corpus_files([prepare_data.stdlib_dir()], ["*.py"])[:5]
    expected = sum(1 for f in first if f.stat().st_size > 0)  # empty files are skipped
    assert f": {expected} documents," in out
    assert prepare_data.TOKENIZER_FLAGS in out
    assert Path(prefix + ".bin").stat().st_size > 0 and Path(prefix + ".idx").exists()
