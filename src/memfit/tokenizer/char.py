"""The ``char`` kind: one id per character seen at build time, then ``<unk>``, ``<bos>``, ``<eos>``
(:class:`CharTokenizer`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.errors import TokenizerError
from memfit.tokenizer.base import Tokenizer, log


class CharTokenizer(Tokenizer):
    """One id per character: the characters in the given order, then ``<unk>``, ``<bos>``, ``<eos>``.

    A character not in the vocabulary encodes to ``<unk>`` (logged once per tokenizer). Character ids are those
    of nanoGPT's ``shakespeare_char`` for the same text (sorted characters from 0).

    Args:
        chars: The vocabulary, distinct single characters.

    Raises:
        TokenizerError: An entry is not a single character, or appears twice.
    """

    kind = "char"
    UNK, BOS, EOS = "<unk>", "<bos>", "<eos>"

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise TokenizerError(f"a char vocabulary holds single characters, got {bad[:5]!r}")
        if len(set(chars)) != len(chars):
            raise TokenizerError("a char vocabulary holds distinct characters; got duplicates")
        self._itos = chars + [self.UNK, self.BOS, self.EOS]
        self._stoi = {c: i for i, c in enumerate(chars)}
        n = len(chars)
        self._specials = {self.UNK: n, self.BOS: n + 1, self.EOS: n + 2}
        self._bos_token, self._eos_token = self.BOS, self.EOS
        self._warned_unknown = False

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Build the vocabulary from the sorted set of characters of ``text``.

        Args:
            text: The training text.

        Returns:
            The tokenizer.
        """
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """Characters + 3 specials."""
        return len(self._itos)

    @property
    def special_tokens(self) -> dict[str, int]:
        """``{"<unk>": n, "<bos>": n + 1, "<eos>": n + 2}`` for ``n`` characters."""
        return dict(self._specials)

    @property
    def unk_id(self) -> int:
        """Id that characters unseen at build time encode to."""
        return self._specials[self.UNK]

    @property
    def chars(self) -> list[str]:
        """The character vocabulary, in id order, without the specials."""
        return self._itos[: -len(self._specials)]

    def _encode(self, text: str) -> list[int]:
        unk = self.unk_id
        ids = [self._stoi.get(c, unk) for c in text]
        if not self._warned_unknown and unk in ids:
            unseen = sorted({c for c in text if c not in self._stoi})
            log.warning(
                "char tokenizer: %d character(s) not in its vocabulary encode to <unk>: %r",
                len(unseen),
                unseen[:20],
            )
            self._warned_unknown = True
        return ids

    def _decode(self, ids: list[int]) -> str:
        return "".join(self._itos[i] for i in ids)

    def cut(self, text: str, offset: int = 0) -> int:
        """Anywhere: one id per character (see :meth:`Tokenizer.cut`)."""
        return len(text)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        return {"unk_token": self.UNK, "vocab": self.chars}
