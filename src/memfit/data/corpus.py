"""Pretraining corpus: text files -> token ids in numpy memmap files -> random-window batches.

The text is split into a training part and a validation part *by characters, before tokenization*, at a line
boundary, so the two never overlap and a tokenizer trained on the training part has never seen validation text.
Token ids are written as a flat ``uint16`` array when the vocabulary fits in 16 bits, else ``uint32``
(the same ``train.bin`` / ``val.bin`` layout as nanoGPT), with a JSON header beside them.

Batches are windows of ``seq_len + 1`` tokens starting at uniformly random offsets drawn from a
``numpy.random.Generator`` seeded by ``(seed, split, step, micro_step)``: the batches of a step depend only on the
step, so a resumed run sees exactly the batches the uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from memfit.errors import DataError

TRAIN, VAL = 0, 1
_ENCODE_CHUNK_CHARS = 1 << 20  # encode ~1 MiB of text at a time, cut at line boundaries


def default_corpus_path() -> Path:
    """Path of the Tiny Shakespeare text shipped inside the package (1,115,394 bytes, public domain)."""
    return Path(str(resources.files("memfit") / "assets" / "tinyshakespeare.txt"))


def corpus_files(path: str | Path | None) -> list[Path]:
    """The text files a ``data.path`` names, in reading order.

    Args:
        path: a text file, a directory (its ``*.txt`` files, sorted), or ``None`` for Tiny Shakespeare.

    Raises:
        DataError: the path does not exist or a directory holds no ``*.txt`` file.
    """
    if path is None:
        return [default_corpus_path()]
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.txt"))
        if not files:
            raise DataError(
                f"corpus directory '{p}' holds no *.txt file; point data.path at a UTF-8 text file"
            )
        return files
    if not p.exists():
        raise DataError(
            f"corpus file '{p}' does not exist; point data.path at a UTF-8 text file or a directory of them"
        )
    return [p]


def read_utf8(path: Path, what: str = "corpus file", encoding: str = "utf-8") -> str:
    """Read a file as strict UTF-8 (``encoding="utf-8-sig"`` also drops a byte-order mark).

    Args:
        path: the file.
        what: how errors name it ("corpus file", "data file").
        encoding: ``utf-8`` or ``utf-8-sig``.

    Raises:
        DataError: the file is unreadable or not valid UTF-8 (the message gives line and column).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {what} '{path}': {exc.strerror}") from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        col = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DataError(
            f"{what} '{path}' is not valid UTF-8: byte 0x{raw[exc.start]:02x} at line {line}, column {col} "
            f"(byte offset {exc.start}). Convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8) and run again."
        ) from None


def read_text(path: Path) -> str:
    """Read a corpus file as strict UTF-8.

    Raises:
        DataError: the file is unreadable, empty, or not valid UTF-8 (the message gives line and column).
    """
    text = read_utf8(path, "corpus file")
    if not text.strip():
        raise DataError(f"corpus file '{path}' is empty; give a file with text in it")
    return text


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """Cut ``text`` into (train, val) at the line boundary nearest ``1 - val_fraction`` of its characters.

    Raises:
        DataError: the text is too short to leave both parts non-empty.
    """
    cut = int(len(text) * (1.0 - val_fraction))
    nl = text.rfind("\n", 0, cut)
    if nl > 0:
        cut = nl + 1
    train, val = text[:cut], text[cut:]
    if not train.strip() or not val.strip():
        raise DataError(
            f"corpus of {len(text)} characters is too short to split into training and validation parts "
            f"(data.val_fraction={val_fraction}); give more text"
        )
    return train, val


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits in 16 bits, else ``uint32``."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _chunks(text: str, size: int) -> list[str]:
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            nl = text.rfind("\n", start, end)
            end = nl + 1 if nl > start else end
        out.append(text[start:end])
        start = end
    return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tokens(text: str, tokenizer, path: Path) -> int:
    """Tokenize ``text`` and write the ids to ``path`` (flat array; header in ``path`` + ``.json``), atomically.

    Returns:
        The number of tokens written.
    """
    dtype = token_dtype(tokenizer.vocab_size)
    ids: list[np.ndarray] = [
        np.asarray(tokenizer.encode(chunk), dtype=np.int64) for chunk in _chunks(text, _ENCODE_CHUNK_CHARS)
    ]
    arr = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= tokenizer.vocab_size):
        raise DataError(f"tokenizer produced ids outside [0, {tokenizer.vocab_size}) while writing '{path}'")
    _atomic_write_bytes(path, arr.astype(dtype).tobytes())
    header = {"dtype": dtype.name, "num_tokens": int(arr.size), "vocab_size": tokenizer.vocab_size}
    _atomic_write_bytes(path.with_suffix(path.suffix + ".json"), json.dumps(header).encode())
    return int(arr.size)


def text_fingerprint(files: list[Path]) -> str:
    """sha256 over the corpus files' bytes, to tell whether cached token files still match their source."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()


class TokenWindows:
    """Random windows over a token file opened as a read-only memmap.

    Args:
        path: a token file written by :func:`write_tokens`.
        seq_len: tokens per input sequence ``T``; each window holds ``T + 1`` tokens.

    Raises:
        DataError: the file or its header is missing, or it holds fewer than ``seq_len + 1`` tokens.
    """

    def __init__(self, path: str | Path, seq_len: int):
        self.path = Path(path)
        header_path = self.path.with_suffix(self.path.suffix + ".json")
        try:
            header = json.loads(header_path.read_text())
        except (OSError, ValueError):
            raise DataError(
                f"token file header '{header_path}' is missing or unreadable; delete '{self.path.parent}' to "
                f"re-tokenize"
            ) from None
        self.num_tokens = int(header["num_tokens"])
        if self.path.stat().st_size != self.num_tokens * np.dtype(header["dtype"]).itemsize:
            raise DataError(
                f"token file '{self.path}' is truncated; delete '{self.path.parent}' to re-tokenize"
            )
        if self.num_tokens < seq_len + 1:
            fix = "a larger data.val_fraction" if self.path.stem == "val" else "a smaller data.val_fraction"
            raise DataError(
                f"'{self.path.name}' holds {self.num_tokens} tokens, fewer than one sequence of seq_len + 1 = "
                f"{seq_len + 1}; give a longer corpus, a smaller seq_len, or {fix}"
            )
        self.seq_len = seq_len
        self.tokens = np.memmap(
            self.path, dtype=np.dtype(header["dtype"]), mode="r", shape=(self.num_tokens,)
        )

    def batch(self, batch_size: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``batch_size`` windows at random offsets.

        Returns:
            ``(inputs, targets)``, both int64 of shape ``(B, T)``; ``targets`` is ``inputs`` shifted left by one.
        """
        T = self.seq_len
        starts = rng.integers(0, self.num_tokens - T, size=batch_size)
        windows = np.stack(
            [np.asarray(self.tokens[s : s + T + 1], dtype=np.int64) for s in starts]
        )  # (B, T+1)
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def batch_rng(seed: int, split: int, step: int, micro_step: int = 0, rank: int = 0) -> np.random.Generator:
    """The generator for one micro-batch: a pure function of its coordinates (so resume is exact)."""
    return np.random.default_rng([seed, split, step, micro_step, rank])


@dataclass
class Corpus:
    """Token files of one prepared corpus."""

    train_path: Path
    val_path: Path
    train_tokens: int
    val_tokens: int


def prepare_corpus(
    data_path: str | Path | None,
    val_fraction: float,
    make_tokenizer,
    data_dir: Path,
    load_saved_tokenizer,
    tokenizer_key: dict | None = None,
) -> tuple[object, Corpus]:
    """Read, split and tokenize a corpus into ``data_dir``, reusing earlier token files when they still match.

    Args:
        data_path: ``data.path`` (see :func:`corpus_files`).
        val_fraction: held-out fraction (see :func:`split_text`).
        make_tokenizer: ``f(train_text) -> Tokenizer``; called only when nothing reusable is in ``data_dir``.
        data_dir: where ``train.bin``, ``val.bin``, their headers, ``tokenizer/`` and ``prepared.json`` go.
        load_saved_tokenizer: ``f(directory) -> Tokenizer`` to reload ``data_dir/tokenizer``.
        tokenizer_key: the tokenizer settings; cached token files are reused only for the same settings.

    Returns:
        ``(tokenizer, corpus)``.

    Raises:
        DataError: a file is missing, empty, not UTF-8, or too short to split.
    """
    files = corpus_files(data_path)
    texts = [read_text(f) for f in files]  # validates every file before anything is written
    fingerprint = text_fingerprint(files)
    marker = data_dir / "prepared.json"
    key = {
        "fingerprint": fingerprint,
        "val_fraction": val_fraction,
        "files": [str(f) for f in files],
        "tokenizer": tokenizer_key,
    }
    if marker.is_file():
        try:
            saved = json.loads(marker.read_text())
        except ValueError:
            saved = None
        if saved is not None and saved.get("key") == key:
            tokenizer = load_saved_tokenizer(data_dir / "tokenizer")
            return tokenizer, Corpus(
                data_dir / "train.bin", data_dir / "val.bin", saved["train_tokens"], saved["val_tokens"]
            )
    train_text, val_text = split_text("\n".join(t.rstrip("\n") for t in texts) + "\n", val_fraction)
    tokenizer = make_tokenizer(train_text)
    data_dir.mkdir(parents=True, exist_ok=True)
    if marker.exists():
        marker.unlink()  # the old files no longer match; invalidate before rewriting
    tokenizer.save(data_dir / "tokenizer")
    n_train = write_tokens(train_text, tokenizer, data_dir / "train.bin")
    n_val = write_tokens(val_text, tokenizer, data_dir / "val.bin")
    _atomic_write_bytes(
        marker, json.dumps({"key": key, "train_tokens": n_train, "val_tokens": n_val}).encode()
    )
    return tokenizer, Corpus(data_dir / "train.bin", data_dir / "val.bin", n_train, n_val)
