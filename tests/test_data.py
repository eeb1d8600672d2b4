import json

import numpy as np
import pytest
import torch

from memfit.data.corpus import (
    TokenWindows,
    batch_rng,
    corpus_files,
    default_corpus_path,
    prepare_corpus,
    read_text,
    split_text,
    token_dtype,
    write_tokens,
)
from memfit.errors import DataError
from memfit.tokenizer import CharTokenizer, load_tokenizer


def test_shakespeare_ships_inside_the_package():
    path = default_corpus_path()
    assert path.stat().st_size == 1_115_394
    assert read_text(path).startswith("First Citizen:")
    assert corpus_files(None) == [path]


def test_token_dtype_follows_vocabulary_size():
    assert token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.uint32
    assert token_dtype(128_256) == np.uint32


def test_split_is_at_a_line_boundary_and_never_overlaps():
    text = read_text(default_corpus_path())
    train, val = split_text(text, 0.1)
    assert train + val == text
    assert train.endswith("\n")
    assert abs(len(val) / len(text) - 0.1) < 0.001


def test_prepared_corpus_tokenizer_sees_training_text_only(tmp_path):
    text = "abc\n" * 90 + "xyz\n" * 10  # the last 10% holds characters the training part never has
    src = tmp_path / "c.txt"
    src.write_text(text)
    tok, corpus = prepare_corpus(src, 0.1, CharTokenizer.from_text, tmp_path / "data", load_tokenizer)
    assert "x" not in tok.decode(list(range(tok.vocab_size)))
    train_ids = np.fromfile(corpus.train_path, dtype=np.uint16)
    assert corpus.train_tokens == len(train_ids) == 360
    assert tok.decode(train_ids.tolist()) == "abc\n" * 90
    header = json.loads((tmp_path / "data" / "train.bin.json").read_text())
    assert header == {"dtype": "uint16", "num_tokens": 360, "vocab_size": tok.vocab_size}


def test_prepared_corpus_is_reused_when_source_unchanged(tmp_path, small_corpus):
    calls = []

    def make(text):
        calls.append(1)
        return CharTokenizer.from_text(text)

    prepare_corpus(small_corpus, 0.1, make, tmp_path / "d", load_tokenizer)
    prepare_corpus(small_corpus, 0.1, make, tmp_path / "d", load_tokenizer)
    assert len(calls) == 1
    prepare_corpus(small_corpus, 0.2, make, tmp_path / "d", load_tokenizer)
    assert len(calls) == 2


def test_uint32_tokens_round_trip(tmp_path):
    class Big:
        vocab_size = 100_000

        def encode(self, text):
            return [99_999, 70_000, 1]

    n = write_tokens("x", Big(), tmp_path / "t.bin")
    assert n == 3
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint32).tolist() == [99_999, 70_000, 1]


def test_windows_are_shifted_pairs_and_seeded(tmp_path):
    tok = CharTokenizer.from_text("abcdefghij")
    write_tokens("abcdefghij" * 20, tok, tmp_path / "t.bin")
    w = TokenWindows(tmp_path / "t.bin", seq_len=8)
    x, y = w.batch(5, batch_rng(1, 0, 3))
    assert x.shape == y.shape == (5, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = w.batch(5, batch_rng(1, 0, 3))
    x3, _ = w.batch(5, batch_rng(1, 0, 4))
    assert torch.equal(x, x2) and not torch.equal(x, x3)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(DataError, match="nope.txt.*does not exist"):
        corpus_files(tmp_path / "nope.txt")


def test_empty_directory_and_empty_file(tmp_path):
    with pytest.raises(DataError, match="no \\*.txt"):
        corpus_files(tmp_path)
    (tmp_path / "e.txt").write_text("  \n")
    with pytest.raises(DataError, match="e.txt' is empty"):
        read_text(tmp_path / "e.txt")


def test_invalid_utf8_names_file_line_and_column(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes(b"first line\nsecond caf" + b"\xe9 au lait\n")
    with pytest.raises(DataError, match=r"latin1.txt' is not valid UTF-8: byte 0xe9 at line 2, column 11"):
        read_text(p)


def test_corpus_shorter_than_one_sequence(tmp_path):
    tok = CharTokenizer.from_text("abc")
    write_tokens("abcabc", tok, tmp_path / "t.bin")
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenWindows(tmp_path / "t.bin", seq_len=16)


def test_truncated_token_file_is_detected(tmp_path):
    tok = CharTokenizer.from_text("abc")
    write_tokens("abc" * 100, tok, tmp_path / "t.bin")
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(101)
    with pytest.raises(DataError, match="truncated"):
        TokenWindows(tmp_path / "t.bin", seq_len=16)
