"""The interface every kind of tokenizer implements (:class:`Tokenizer`), and what the kinds share: the name of
the config file a saved tokenizer writes, the kinds' names, a model's chat template as its directory holds it
(:class:`ChatTemplateSource`), and the places a long text may be cut (:meth:`Tokenizer.cut`).

The kinds themselves are in the modules beside this one (:mod:`memfit.tokenizer.char`, ``bpe``, ``sentencepiece``,
``tiktoken``, ``gpt2``); :mod:`memfit.tokenizer.load` recognises and loads them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memfit.errors import TokenizerError

log = logging.getLogger("memfit.tokenizer")
"""The one logger of every kind (:meth:`Tokenizer.fingerprint` silences it while it encodes its probe)."""

CONFIG_NAME = "tokenizer_config.json"
"""The file :meth:`Tokenizer.save` writes beside the model files: ``{"kind", "bos_token", "eos_token",
"vocab_size", ...}``. Hugging Face uses the same name; memfit's is recognised by its ``kind`` key."""

KINDS = ("char", "bpe", "sentencepiece", "tiktoken", "gpt2")

_FINGERPRINT_PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{} \"quotes\" 'x'\n\tTabs   and    "
    "runs\n\ndef f(x):\n    return x ** 2  # code\nÉté, naïve café, Straße, Ελληνικά, русский, 日本語, 한국어, 🙂"
)

CHAT_TEMPLATE_NAME = "chat_template.jinja"
"""The file a chat template is kept in (transformers 5 writes it; 4.x kept the template in tokenizer_config.json)."""
TEMPLATE_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens a chat template sees as variables, as transformers passes them
(``PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES``)."""


@dataclass(frozen=True)
class ChatTemplateSource:
    """A model's own chat template as its tokenizer directory holds it (not yet compiled).

    Attributes:
        text: The Jinja source.
        path: The file it was read from (``chat_template.jinja`` or ``tokenizer_config.json``), for messages.
        tokens: The named special tokens the template sees (``bos_token``, ``eos_token``, ... as in
            :data:`TEMPLATE_TOKEN_NAMES`, and a ``tokenizer_config.json``'s named ``extra_special_tokens``) -> their
            text; names the tokenizer does not set are absent (the template sees them undefined).
    """

    text: str
    path: str
    tokens: dict[str, str] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------------------------
# The interface


class Tokenizer(ABC):
    """Text <-> token ids.

    Attributes:
        kind: ``"char"``, ``"bpe"``, ``"sentencepiece"``, ``"tiktoken"`` or ``"gpt2"``.
    """

    kind: str = ""
    chat_template: ChatTemplateSource | None = None
    """The model's own chat template, where the directory the tokenizer was loaded from has one (see
    :func:`load_tokenizer`); written back by :meth:`save`."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must hold: every id ``encode`` can return, specials included."""

    @property
    @abstractmethod
    def special_tokens(self) -> dict[str, int]:
        """Special token text -> id (BOS, EOS, chat and reserved tokens). Plain text never encodes to these."""

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token, or ``None`` when the tokenizer has none."""
        return None if self._bos_token is None else self._specials[self._bos_token]

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence token, or ``None`` when the tokenizer has none."""
        return None if self._eos_token is None else self._specials[self._eos_token]

    @property
    def add_bos(self) -> bool:
        """Whether the model reads a text with BOS first, as the tokenizer's own library encodes it: ``memfit
        prepare`` writes each document as ``[BOS] ids [EOS]`` and ``memfit generate`` feeds ``[BOS] prompt``
        exactly when this is true (else ``ids [EOS]`` and ``prompt``). False without a BOS token.

        True for memfit's own tokenizers (char, a trained BPE), Meta's ``tokenizer.model`` files (Llama 2 and 3
        are trained and sampled with BOS) and GPT-2's files (``<|endoftext|>``, the separator GPT-2 saw before
        every document); a Hugging Face ``tokenizer.json`` says by its post-processor, a ``tokenizer_config.json``
        beside a ``tokenizer.model`` by ``add_bos_token`` (see :func:`load_tokenizer`).
        """
        return self._add_bos and self.bos_id is not None

    # Set by every subclass: special token text -> id, and the texts of BOS/EOS (keys of _specials) or None.
    _specials: dict[str, int]
    _bos_token: str | None = None
    _eos_token: str | None = None
    _add_bos: bool = True

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Encode text to ids.

        Special-token text inside ``text`` is encoded as ordinary text, never as the special id.

        Args:
            text: The text.
            bos: Put the BOS id first.
            eos: Put the EOS id last.

        Returns:
            The ids.

        Raises:
            TokenizerError: ``bos`` or ``eos`` is asked for and this tokenizer has no such token.
        """
        ids = self._encode(text)
        if bos:
            if self.bos_id is None:
                raise TokenizerError(f"this {self.kind} tokenizer has no BOS token; encode with bos=False")
            ids = [self.bos_id, *ids]
        if eos:
            if self.eos_id is None:
                raise TokenizerError(f"this {self.kind} tokenizer has no EOS token; encode with eos=False")
            ids.append(self.eos_id)
        return ids

    def encode_markup(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Encode a rendered chat template, in which special tokens' texts stand for their ids.

        Unlike :meth:`encode`, the text of every added token (``"<|im_start|>"``) becomes its id, and no BOS/EOS
        is added: what transformers' ``apply_chat_template(..., tokenize=True)`` does with the rendered string
        (``tokenizer(text, add_special_tokens=False)``).

        Args:
            text: The rendered text.

        Returns:
            ``(ids, offsets)``: the ids and each token's ``(start, end)`` character span in ``text``.

        Raises:
            TokenizerError: This kind of tokenizer cannot (only a Hugging Face ``tokenizer.json`` can, the form a
                checkpoint with a chat template comes in).
        """
        raise TokenizerError(
            f"a chat template's rendering is read with a Hugging Face tokenizer.json, and this tokenizer is "
            f"{self.kind}; name a built-in template instead (data.template / --template)"
        )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (the library's batch encoder where it has one), without BOS/EOS: what
        ``[encode(t) for t in texts]`` gives.

        Args:
            texts: The texts.

        Returns:
            One list of ids per text.
        """
        return self._encode_batch(list(texts))

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self._encode(t) for t in texts]

    def cut(self, text: str, offset: int = 0) -> int:
        """Where a long document may be cut, to be encoded in pieces with the ids of encoding it whole.

        The largest ``p <= len(text)`` such that, whatever text follows, the ids of ``text[:p]`` (:meth:`encode`,
        or :meth:`encode_continuation` when ``text`` continues a document) followed by those of the rest
        (:meth:`encode_continuation`) are the ids of the whole. Every kind cuts only where it is proven to:

        - ``char``: anywhere;
        - ``gpt2``, and a ``bpe`` with GPT-2's byte-level pre-tokenizer or Llama 3's (or Qwen 2's) split pattern
          before a byte-level one: before a space between two non-whitespace characters (no pre-token of these
          patterns runs from a non-whitespace character into a space, and a pre-token starts there);
        - ``sentencepiece``, and a ``bpe`` in SentencePiece's manner (a ``▁`` prepended, spaces made ``▁``): the
          same place, when no piece holds a ``▁`` after another character, so that no piece spans a word
          boundary; the continuation is encoded without that space, for which the ``▁`` prepended to every
          encoded text stands (checked on the normalizer);
        - ``tiktoken``: every 400,000 characters from the start of the document, where Meta's encoder (and
          :meth:`encode`) cuts a long text anyway.

        Other ``tokenizer.json`` pipelines are not cut (0): a document is then encoded whole.

        Args:
            text: a part of one document that begins ``offset`` characters into it, where it was cut before
                (or at its start).
            offset: characters of the document before ``text``.

        Returns:
            The position, or 0 when ``text`` has no such place.
        """
        return 0

    def encode_continuation(self, text: str) -> list[int]:
        """The ids of ``text`` where it continues a document that :meth:`cut` cut before it (no BOS/EOS)."""
        return self._encode(text)

    def fingerprint(self) -> str:
        """A hash of what this tokenizer does: its kind, vocabulary size, special tokens and the ids of a probe
        text covering letters, digits, whitespace runs, punctuation and non-ASCII characters. Two tokenizers with
        the same fingerprint encode alike, whatever files they were loaded from (a Hugging Face directory, a
        memfit checkpoint's copy).

        Returns:
            16 hex digits.
        """
        disabled, log.disabled = (
            log.disabled,
            True,
        )  # a char tokenizer would warn of the probe's unknown characters
        try:
            probe = self._encode(_FINGERPRINT_PROBE)
        finally:
            log.disabled = disabled
        what = [self.kind, self.vocab_size, sorted(self.special_tokens.items()), probe]
        if self.bos_id is not None and not self.add_bos:  # marked only then: others keep their fingerprints
            what.append("no BOS before text")
        data = json.dumps(what)
        return hashlib.sha256(data.encode("utf-8")).hexdigest()[:16]

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text, rendering special tokens as their text (``"<|end_of_text|>"``).

        Byte-level kinds replace an incomplete UTF-8 sequence (a cut multi-byte character) with U+FFFD.

        Args:
            ids: Token ids (a list, or anything with ``tolist()`` such as a tensor or numpy array).

        Returns:
            The text.

        Raises:
            TokenizerError: An id is outside ``[0, vocab_size)``.
        """
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids:
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise TokenizerError(
                    f"token id {bad} is outside [0, {self.vocab_size}) for this {self.kind} tokenizer"
                )
        return self._decode(ids)

    def save(self, directory: str | Path) -> None:
        """Write this tokenizer to ``directory`` so that ``load_tokenizer(directory)`` rebuilds it identically.

        Writes the kind's model files (copies of the original bytes for sentencepiece, tiktoken and gpt2) and
        ``tokenizer_config.json`` with ``kind``, ``bos_token``, ``eos_token``, ``add_bos`` and ``vocab_size``
        (and for tiktoken the names of its special tokens, ``special_tokens``); with a :attr:`chat_template`, also
        ``chat_template.jinja`` and the template's named tokens (``chat_template_tokens``).

        Args:
            directory: Created if missing; files of the same names in it are replaced.

        Raises:
            OSError: The directory cannot be created or written.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "kind": self.kind,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
            "add_bos": self.add_bos,
            "vocab_size": self.vocab_size,
        }
        config.update(self._save_files(directory))
        if self.chat_template is not None:  # the model's own template travels with its tokenizer
            (directory / CHAT_TEMPLATE_NAME).write_text(self.chat_template.text, encoding="utf-8")
            config["chat_template_tokens"] = self.chat_template.tokens
        (directory / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, add_bos={self.add_bos})"
        )

    @abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def _decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def _save_files(self, directory: Path) -> dict[str, Any]:
        """Write the model files; return extra keys for tokenizer_config.json."""


def _space_cut(text: str) -> int:
    """The position of the last space of ``text`` between two non-whitespace characters, or 0."""
    i = text.rfind(" ", 1, len(text) - 1)
    while i > 0 and (text[i - 1].isspace() or text[i + 1].isspace()):
        i = text.rfind(" ", 1, i)
    return max(i, 0)


def _spans_word_boundary(piece: str) -> bool:
    """A SentencePiece-style piece holding a ``▁`` after another character (it would span a word boundary)."""
    return any(c == "\u2581" and piece[k - 1] != "\u2581" for k, c in enumerate(piece) if k)
