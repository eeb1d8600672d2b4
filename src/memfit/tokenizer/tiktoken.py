"""The ``tiktoken`` kind: a tiktoken ranks file read as Llama 3's tokenizer (Meta's ``tokenizer.model`` for Llama
3, 3.1, 3.2) with Llama 3's split pattern and its 256 special tokens (:class:`TiktokenTokenizer`); and what the
tokenizers run on a ``tiktoken.Encoding`` share (``gpt2`` is the other).
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from types import EllipsisType
from typing import Any

from memfit.errors import TokenizerError
from memfit.tokenizer.base import Tokenizer

# Llama 3's pre-tokenizer split pattern (meta-llama/llama-models, llama3 tokenizer.py).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_NUM_SPECIAL = 256
# Llama 3's special tokens, in id order from base = number of ranks (128000 for Llama 3): <|begin_of_text|> =
# base + 0, <|end_of_text|> = base + 1, <|start_header_id|> = base + 6, <|end_header_id|> = base + 7,
# <|eom_id|> = base + 8, <|eot_id|> = base + 9, <|python_tag|> = base + 10, reserved tokens up to base + 255.
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS += [f"<|reserved_special_token_{2 + i}|>" for i in range(LLAMA3_NUM_SPECIAL - 11)]
# tiktoken's regex engine overflows its stack on very long runs of whitespace or of non-whitespace; Meta encodes
# at most 400k characters at a time and cuts such runs every 25k characters. Done here the same way, so ids
# equal Meta's and torchtune's.
_TIKTOKEN_MAX_ENCODE_CHARS = 400_000
_TIKTOKEN_MAX_RUN_CHARS = 25_000
_LONG_RUN = re.compile(rf"\s{{{_TIKTOKEN_MAX_RUN_CHARS + 1}}}|\S{{{_TIKTOKEN_MAX_RUN_CHARS + 1}}}")


def _tiktoken_encoding(name: str, pattern: str, ranks: dict[bytes, int], specials: dict[str, int]) -> Any:
    import tiktoken  # deferred: each backend is imported only when it is used

    return tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)


def parse_tiktoken_ranks(data: bytes, source: str = "<bytes>") -> dict[bytes, int]:
    """Parse a tiktoken ranks file: one ``<base64 token> <rank>`` per line.

    Args:
        data: The file's bytes.
        source: Where the bytes came from, for error messages.

    Returns:
        Token bytes -> rank.

    Raises:
        TokenizerError: A line is malformed, a token repeats, the ranks are not 0..n-1, or a single byte is
            missing (some text could then not be encoded).
    """
    ranks: dict[bytes, int] = {}
    lines = 0
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        lines += 1
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError("not two fields")
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise TokenizerError(
                f"'{source}' line {lineno} is not '<base64 token> <rank>' as a tiktoken ranks file has: "
                f"{line[:80]!r} (truncated or corrupt file?)"
            ) from None
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(
            f"'{source}' is empty; expected a tiktoken ranks file ('<base64 token> <rank>' lines)"
        )
    if len(ranks) != lines:
        raise TokenizerError(f"'{source}': a token appears on more than one line of the tiktoken ranks file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(
            f"'{source}': tiktoken ranks are not 0..{len(ranks) - 1} (truncated or corrupt file?)"
        )
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"'{source}': the tiktoken ranks lack {len(missing)} of the 256 single bytes")
    return ranks


class _TiktokenBacked(Tokenizer):
    """Shared by the tokenizers that run on a ``tiktoken.Encoding`` (``self._enc``) with ``self._specials``."""

    _enc: Any  # tiktoken.Encoding (imported lazily)
    _specials: dict[str, int]

    @property
    def vocab_size(self) -> int:
        """Largest id + 1: ranks plus special tokens (128,256 for Llama 3, 50,257 for GPT-2)."""
        return self._enc.n_vocab

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token -> id (Llama 3's 256, or GPT-2's ``<|endoftext|>``)."""
        return dict(self._specials)


class TiktokenTokenizer(_TiktokenBacked):
    """A tiktoken ranks file read as Llama 3's tokenizer (Meta's ``tokenizer.model`` for Llama 3, 3.1, 3.2).

    Llama 3's split pattern, and its 256 special tokens at ids ``n`` .. ``n + 255`` after the ``n`` ranks. The
    file holds no names for them: ``special_tokens`` gives them (a Hugging Face file beside it, see
    :func:`load_tokenizer`), else they are named as Meta's llama-models names Llama 3.1's
    (:data:`LLAMA3_SPECIAL_TOKENS`): ``<|begin_of_text|>`` (BOS) = n, ``<|end_of_text|>`` (EOS) = n + 1,
    ``<|finetune_right_pad_id|>`` = n + 4, ``<|step_id|>`` = n + 5, ``<|start_header_id|>`` = n + 6,
    ``<|end_header_id|>`` = n + 7, ``<|eom_id|>`` = n + 8, ``<|eot_id|>`` = n + 9, ``<|python_tag|>`` = n + 10,
    ``<|reserved_special_token_{k}|>`` for the others. ``vocab_size`` = n + 256 (128256 for Llama 3).

    Args:
        ranks_file: The bytes of the ranks file.
        source: Where the bytes came from, for error messages.
        special_tokens: Names of special ids, ``{id: text}`` (a file's; ids it leaves out keep Llama 3.1's
            names).
        special_tokens_from: The file ``special_tokens`` comes from, for error messages.
        bos_token, eos_token: Texts of BOS and EOS among the special tokens, or ``None`` for none; ``...``: the
            tokens at ids n and n + 1.
        bos_eos_from: The file ``bos_token`` / ``eos_token`` come from, for error messages.
        add_bos: Whether the model reads a text with BOS first (Llama 3 does, as Meta's reference encodes it).

    Raises:
        TokenizerError: The bytes are not a tiktoken ranks file; ``special_tokens`` names an id outside n ..
            n + 255 or one text twice; ``bos_token`` or ``eos_token`` is not a special token.
    """

    kind = "tiktoken"

    def __init__(
        self,
        ranks_file: bytes,
        source: str = "<bytes>",
        *,
        special_tokens: dict[int, str] | None = None,
        special_tokens_from: str = "",
        bos_token: str | None | EllipsisType = ...,
        eos_token: str | None | EllipsisType = ...,
        bos_eos_from: str = "",
        add_bos: bool = True,
    ):
        ranks = parse_tiktoken_ranks(ranks_file, source)
        n = len(ranks)
        names = list(LLAMA3_SPECIAL_TOKENS)
        if special_tokens:
            names = _name_specials(names, n, special_tokens, special_tokens_from or source)
        self._specials = {t: n + i for i, t in enumerate(names)}
        self._enc = _tiktoken_encoding(Path(source).name, LLAMA3_PATTERN, ranks, self._specials)
        self._data = ranks_file
        self._bos_token = names[0] if bos_token is ... else bos_token
        self._eos_token = names[1] if eos_token is ... else eos_token
        for what, token in (("bos_token", self._bos_token), ("eos_token", self._eos_token)):
            if token is not None and token not in self._specials:
                raise TokenizerError(
                    f"'{bos_eos_from or source}': {what} {token!r} is not one of the special tokens of "
                    f"'{source}' (ids {n}..{n + LLAMA3_NUM_SPECIAL - 1})"
                )
        self._add_bos = add_bos

    def cut(self, text: str, offset: int = 0) -> int:
        """Every 400,000 characters of the document, where :meth:`encode` cuts it too (:meth:`Tokenizer.cut`)."""
        n = _TIKTOKEN_MAX_ENCODE_CHARS
        return max(0, (offset + len(text)) // n * n - offset)

    def _encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for start in range(0, len(text), _TIKTOKEN_MAX_ENCODE_CHARS):
            chunk = text[start : start + _TIKTOKEN_MAX_ENCODE_CHARS]
            pieces = _split_long_runs(chunk) if _LONG_RUN.search(chunk) else [chunk]
            for piece in pieces:
                ids.extend(self._enc.encode_ordinary(piece))
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        (directory / "tokenizer.model").write_bytes(self._data)
        return {"special_tokens": self.special_tokens}


def _name_specials(names: list[str], n: int, named: dict[int, str], where: str) -> list[str]:
    """Llama 3's special names (``names``, for ids n, n + 1, ...) with those a file gives (``named``, id -> text)
    in their place."""
    out = list(names)
    for i, text in sorted(named.items()):
        if not n <= i < n + len(names):
            raise TokenizerError(
                f"'{where}' names token id {i} ({text!r}), but the tiktoken ranks hold {n} tokens and the special "
                f"ids are {n}..{n + len(names) - 1}: does the file belong to this tokenizer.model?"
            )
        out[i - n] = text
    seen: dict[str, int] = {}
    for i, text in enumerate(out, n):
        if text in seen:
            raise TokenizerError(
                f"'{where}' names {len(named)} of the special ids {n}..{n + len(names) - 1}, and {text!r} is then "
                f"both id {seen[text]} and id {i} (a name of the file's, or Llama 3.1's name of an id it leaves "
                "out); name each special id once"
            )
        seen[text] = i
    return out


def _split_long_runs(s: str) -> list[str]:
    """Cut ``s`` so that no piece holds more than 25k consecutive whitespace or non-whitespace characters.

    The same cuts as Meta's ``_split_whitespaces_or_nonwhitespaces``.
    """
    pieces, start, run, run_is_space = [], 0, 0, s[0].isspace() if s else False
    for i, c in enumerate(s):
        is_space = c.isspace()
        if is_space != run_is_space:
            run, run_is_space = 1, is_space
        else:
            run += 1
            if run > _TIKTOKEN_MAX_RUN_CHARS:
                pieces.append(s[start:i])
                start, run = i, 1
    pieces.append(s[start:])
    return pieces
