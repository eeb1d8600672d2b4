"""Text <-> token ids behind one interface, whatever made the vocabulary.

Five kinds, each backed by the library that defines it (no BPE is implemented here):

- ``char``: one id per character seen at build time, then ``<unk>``, ``<bos>``, ``<eos>``.
- ``bpe``: a Hugging Face `tokenizers` tokenizer: a byte-level BPE trained by :func:`train_bpe`, or any
  ``tokenizer.json``.
- ``sentencepiece``: a SentencePiece ``.model`` (Llama 1/2 ``tokenizer.model``).
- ``tiktoken``: a tiktoken ranks file (Llama 3's ``tokenizer.model``) with Llama 3's split pattern and its 256
  special tokens appended after the ranks (named by the Hugging Face files beside it, else as Llama 3.1 names
  them).
- ``gpt2``: OpenAI's GPT-2 ``encoder.json`` + ``vocab.bpe``, encoded with tiktoken.

Every kind follows the same rules: ``encode`` adds BOS/EOS only when asked (``add_bos`` says whether the model
reads a text with BOS first: what ``memfit prepare`` and ``memfit generate`` do), and never turns special-token text
that occurs in plain text (``"<|end_of_text|>"``, ``"<s>"``) into special ids; ``decode`` renders every id,
special tokens included, as its text; ``save(directory)`` writes what :func:`load_tokenizer` needs to rebuild an
identical tokenizer, plus a ``tokenizer_config.json`` naming the kind. Nothing is ever downloaded.

A tokenizer directory may also hold the model's chat template (``chat_template.jinja``, or ``chat_template`` in a
Hugging Face ``tokenizer_config.json``): :func:`load_tokenizer` keeps it as :attr:`Tokenizer.chat_template` (text
only; :mod:`memfit.data.chat_template` renders it) and :meth:`Tokenizer.save` writes it back, so a run fine-tuned
from such a checkpoint carries the template it was trained with.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import json
import logging
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import EllipsisType
from typing import Any

from memfit.errors import TokenizerError

log = logging.getLogger(__name__)

CONFIG_NAME = "tokenizer_config.json"
"""The file :meth:`Tokenizer.save` writes beside the model files: ``{"kind", "bos_token", "eos_token",
"vocab_size", ...}``. Hugging Face uses the same name; memfit's is recognised by its ``kind`` key."""

KINDS = ("char", "bpe", "sentencepiece", "tiktoken", "gpt2")

BPE_BOS = "<|begin_of_text|>"
BPE_EOS = "<|end_of_text|>"

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

# GPT-2's pre-tokenizer split pattern, as tiktoken writes it (equivalent to the one in openai/gpt-2 encoder.py).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOS = "<|endoftext|>"

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+[0-9]+[ \t]*\r?$")

_FINGERPRINT_PROBE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{} \"quotes\" 'x'\n\tTabs   and    "
    "runs\n\ndef f(x):\n    return x ** 2  # code\nÉté, naïve café, Straße, Ελληνικά, русский, 日本語, 한국어, 🙂"
)

# Names tried, in order, when a tokenizer.json comes without a config that names its BOS/EOS tokens.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]")


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


# ----------------------------------------------------------------------------------------------------------------
# char


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


# ----------------------------------------------------------------------------------------------------------------
# bpe: a Hugging Face `tokenizers` tokenizer


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer (a trained byte-level BPE, or any ``tokenizer.json``).

    Encodes without the tokenizer's post-processor (Llama 3's ``tokenizer.json`` would add BOS by itself), and
    with special tokens split as text, so BOS/EOS come only from ``encode(bos=..., eos=...)``. The post-processor
    says ``add_bos``: whether it puts BOS first, as transformers encodes a prompt.

    Args:
        tokenizer: The ``tokenizers.Tokenizer``.
        bos_token: Text of the BOS token, or ``None``.
        eos_token: Text of the EOS token, or ``None``.
        extra_special_tokens: Tokens of the vocabulary to treat as special although ``tokenizer.json`` does not
            mark them so (a Hugging Face ``tokenizer_config.json`` may list them); tokens not in the vocabulary
            are ignored.
        add_bos: Whether the model reads a text with BOS first; ``None``: as the post-processor does. Where the
            post-processor does otherwise it is replaced by one that does this, so that the saved
            ``tokenizer.json`` encodes alike in transformers.

    Raises:
        TokenizerError: ``bos_token`` or ``eos_token`` is not in the vocabulary.
    """

    kind = "bpe"

    def __init__(
        self,
        tokenizer: Any,
        bos_token: str | None,
        eos_token: str | None,
        extra_special_tokens: Sequence[str] = (),
        add_bos: bool | None = None,
    ):
        from tokenizers import AddedToken, processors  # deferred: each backend is imported when used

        self._tok = tokenizer
        # Special tokens written in the text are encoded as text (the setting is not saved in tokenizer.json).
        self._tok.encode_special_tokens = True
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        specials = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        extra = [t for t in extra_special_tokens if t in vocab and t not in specials]
        if extra:  # re-adding an existing token as special keeps its id; encode then treats its text as text
            tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in extra])
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._specials = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        for name, token in (("bos_token", bos_token), ("eos_token", eos_token)):
            if token is not None and token not in vocab:
                raise TokenizerError(f"{name} {token!r} is not in the tokenizer's vocabulary")
            if token is not None:
                self._specials.setdefault(token, vocab[token])
        self._bos_token, self._eos_token = bos_token, eos_token
        first = _bos_first(tokenizer, bos_token)
        self._add_bos = first if add_bos is None else add_bos
        if self.add_bos != first:
            if self.add_bos:
                single, pair = f"{bos_token}:0 $A:0", f"{bos_token}:0 $A:0 {bos_token}:1 $B:1"
            else:
                single, pair = "$A:0", "$A:0 $B:1"
            tokenizer.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=[(bos_token, self.bos_id)] if self.add_bos else []
            )

    @property
    def vocab_size(self) -> int:
        """Largest id + 1, added tokens included."""
        return self._vocab_size

    @property
    def special_tokens(self) -> dict[str, int]:
        """The added tokens marked special, plus BOS/EOS."""
        return dict(self._specials)

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def encode_markup(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """As :meth:`Tokenizer.encode_markup`: the ids transformers' fast tokenizer gives ``text`` with
        ``add_special_tokens=False`` (added tokens matched in the text), and the characters each token covers."""
        enc = self._markup_tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    @functools.cached_property
    def _markup_tok(self) -> Any:
        """A copy that matches added tokens in text and leaves offsets untrimmed (no post-processor: with
        ``add_special_tokens=False`` it adds no id, only trims whitespace off the offsets)."""
        from tokenizers import Tokenizer as HFCore

        tok = HFCore.from_str(self._tok.to_str())
        tok.encode_special_tokens = False
        tok.post_processor = None
        return tok

    def cut(self, text: str, offset: int = 0) -> int:
        """Before a space between non-whitespace characters, for the pipelines :meth:`Tokenizer.cut` names."""
        return 0 if self._cut_rule is None else _space_cut(text)

    def encode_continuation(self, text: str) -> list[int]:
        if self._cut_rule == "drop-space" and text.startswith(" "):
            text = text[1:]  # the ▁ the normalizer prepends stands for it
        return self._encode(text)

    @functools.cached_property
    def _cut_rule(self) -> str | None:
        return _hf_cut_rule(json.loads(self._tok.to_str()))

    def _save_files(self, directory: Path) -> dict[str, Any]:
        self._tok.save(str(directory / "tokenizer.json"))
        return {}


def _bos_first(tokenizer: Any, bos_token: str | None) -> bool:
    """Whether a ``tokenizers.Tokenizer``'s post-processor puts ``bos_token`` first (what it adds with
    ``add_special_tokens=True``, as transformers encodes a text)."""
    bos_id = None if bos_token is None else tokenizer.token_to_id(bos_token)
    if bos_id is None:
        return False
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    return full[:1] == [bos_id] and full[1 : 1 + len(plain)] == plain


# Split patterns after which a byte-level BPE can be cut before a space (see Tokenizer.cut): Llama 3's, and Qwen 2's
# (the same with one digit per pre-token).
_CUTTABLE_SPLITS = (LLAMA3_PATTERN, LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"))


def _hf_cut_rule(spec: dict[str, Any]) -> str | None:
    """How a ``tokenizer.json`` pipeline may be cut (see :meth:`Tokenizer.cut`): ``"space"``, ``"drop-space"``
    (SentencePiece's manner: the continuation is encoded without its leading space) or None (not at all)."""
    added = spec.get("added_tokens") or []
    if any(not t.get("special") and any(c.isspace() for c in t.get("content", "")) for t in added):
        return None  # an added token could span the cut
    norm, pre = spec.get("normalizer"), spec.get("pre_tokenizer")
    if (norm is None or norm.get("type") in ("NFC", "NFKC")) and _byte_level(pre):
        return "space"
    prepends = (
        norm is not None
        and norm.get("type") == "Sequence"
        and [
            (n.get("type"), n.get("prepend"), n.get("pattern"), n.get("content"))
            for n in norm.get("normalizers", [])
        ]
        == [("Prepend", "\u2581", None, None), ("Replace", None, {"String": " "}, "\u2581")]
    )
    metaspace = (
        norm is None
        and pre is not None
        and pre.get("type") == "Metaspace"
        and pre.get("replacement") == "\u2581"
        and pre.get("prepend_scheme", "always") in ("always", "first")
    )
    if (prepends and pre is None) or metaspace:
        vocab = (spec.get("model") or {}).get("vocab") or {}
        pieces = vocab if isinstance(vocab, dict) else [v[0] for v in vocab]  # BPE: a dict; Unigram: a list
        if (metaspace and pre.get("split", True)) or not any(_spans_word_boundary(t) for t in pieces):
            return "drop-space"
    return None


def _byte_level(pre: dict[str, Any] | None) -> bool:
    """GPT-2's byte-level pre-tokenizer (its regex, no prefix space), or a cuttable split before a byte-level one."""
    if pre is None:
        return False
    if pre.get("type") == "ByteLevel":
        return pre.get("add_prefix_space") is False and pre.get("use_regex", True)
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in _CUTTABLE_SPLITS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and byte_level.get("add_prefix_space") is False
        and byte_level.get("use_regex") is False
    )


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with `tokenizers` (GPT-2's byte-level pre-tokenizer and decoder).

    The vocabulary is ``<|begin_of_text|>`` (BOS, id 0), ``<|end_of_text|>`` (EOS, id 1), the 256 bytes, then
    merges learned from ``texts`` only. Texts are read with BOS first (its post-processor adds it, as in Llama 3's
    ``tokenizer.json``). Every string round-trips: ``decode(encode(s)) == s``. The same texts and
    size give the same tokenizer.

    Args:
        texts: Training texts (a single ``str`` is taken as one text).
        vocab_size: Vocabulary size including the 2 special tokens and 256 bytes; fewer ids result when the
            texts hold fewer distinct merges.

    Returns:
        The trained tokenizer (kind ``"bpe"``).

    Raises:
        TokenizerError: ``vocab_size`` < 258.
    """
    from tokenizers import Tokenizer as HFCore  # deferred: each backend is imported only when it is used
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 258:
        raise TokenizerError(
            f"a byte-level BPE needs vocab_size >= 258 (256 bytes + BOS + EOS), got {vocab_size}"
        )
    if isinstance(texts, str):
        texts = [texts]
    tok = HFCore(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_BOS, BPE_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, BPE_BOS, BPE_EOS, add_bos=True)


# ----------------------------------------------------------------------------------------------------------------
# sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (Llama 1/2's ``tokenizer.model``); BOS/EOS are the model's own piece ids.

    SentencePiece normalises before encoding, so ``decode(encode(s))`` is the normalised ``s``: with the usual
    ``nmt_nfkc`` rule NFKC folding (``"ﬁ"`` -> ``"fi"``), whitespace runs (newlines included) collapsed to one
    space and leading/trailing whitespace removed; characters the model cannot encode (no byte fallback) become
    ``<unk>``, decoded as ``" ⁇ "``. Control pieces (``<s>``, ``</s>``) decode to their text.

    Args:
        model: The serialized model (the bytes of the ``.model`` file).
        source: Where the bytes came from, for error messages.
        add_bos: Whether the model reads a text with BOS first (Llama 1/2 do, as Meta's reference and
            transformers' ``LlamaTokenizer`` encode it).

    Raises:
        TokenizerError: The bytes are not a SentencePiece model.
    """

    kind = "sentencepiece"

    def __init__(self, model: bytes, source: str = "<bytes>", add_bos: bool = True):
        import sentencepiece as spm  # deferred: each backend is imported only when it is used

        try:
            sp = spm.SentencePieceProcessor(model_proto=model)
        except Exception as e:  # sentencepiece raises RuntimeError (or others) with its C++ message
            raise TokenizerError(f"'{source}' is not a valid SentencePiece model: {e}") from e
        if sp.vocab_size() <= 0:
            raise TokenizerError(f"'{source}' is a SentencePiece model with an empty vocabulary")
        self._sp, self._model = sp, model
        n = sp.vocab_size()
        self._control = {i for i in range(n) if sp.is_control(i)}
        self._specials = {sp.id_to_piece(i): i for i in range(n) if i in self._control or sp.is_unknown(i)}
        self._bos_token = sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else None
        self._eos_token = sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else None
        self._add_bos = add_bos

    @property
    def vocab_size(self) -> int:
        """Number of pieces."""
        return self._sp.vocab_size()

    @property
    def special_tokens(self) -> dict[str, int]:
        """Control pieces (``<s>``, ``</s>``, pad) and ``<unk>``."""
        return dict(self._specials)

    def _encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def cut(self, text: str, offset: int = 0) -> int:
        """Before a space between non-whitespace characters, when the model allows it (:meth:`Tokenizer.cut`)."""
        return 0 if self._cut_rule is None else _space_cut(text)

    def encode_continuation(self, text: str) -> list[int]:
        if self._cut_rule == "drop-space" and text.startswith(" "):
            text = text[1:]  # the dummy-prefix ▁ stands for it
        return self._encode(text)

    @functools.cached_property
    def _cut_rule(self) -> str | None:
        """``"drop-space"`` (the model prepends a ``▁``: a continuation is encoded without its leading space),
        ``"space"`` (it does not: a continuation keeps it), or None: the normalizer does not make ``"x y"`` what
        it makes of ``"x"`` and the continuation apart, or a piece spans a word boundary."""
        sp = self._sp
        whole, left = sp.normalize("x y"), sp.normalize("x")
        if left + sp.normalize("y") == whole and whole.startswith("\u2581"):
            rule = "drop-space"
        elif left + sp.normalize(" y") == whole:
            rule = "space"
        else:
            return None
        if any(_spans_word_boundary(sp.id_to_piece(i)) for i in range(sp.vocab_size())):
            return None
        return rule

    def _decode(self, ids: list[int]) -> str:
        if self._control.isdisjoint(ids):
            return self._sp.decode(ids)
        # SentencePiece drops control pieces when decoding; render them, decoding the runs between them.
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._control:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        (directory / "tokenizer.model").write_bytes(self._model)
        return {}


# ----------------------------------------------------------------------------------------------------------------
# tiktoken (Llama 3) and GPT-2


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


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> byte (the inverse of ``bytes_to_unicode`` in openai/gpt-2)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class GPT2Tokenizer(_TiktokenBacked):
    """OpenAI's GPT-2 BPE from ``encoder.json`` + ``vocab.bpe``, encoded with tiktoken.

    50257 ids; ``"Hello world"`` -> ``[15496, 995]``. GPT-2 has one special token, ``<|endoftext|>`` (50256),
    which it was trained with between documents; it is both EOS and BOS here (``bos_id == eos_id == 50256``), as
    in `transformers`' GPT-2 tokenizer.

    Args:
        encoder_json: The bytes of ``encoder.json`` (token -> id).
        vocab_bpe: The bytes of ``vocab.bpe`` (the merges, in priority order).
        source: Where the bytes came from, for error messages.

    Raises:
        TokenizerError: The files are malformed or do not belong together.
    """

    kind = "gpt2"

    def __init__(self, encoder_json: bytes, vocab_bpe: bytes, source: str = "<bytes>"):
        try:
            encoder = json.loads(encoder_json)
        except (ValueError, UnicodeDecodeError) as e:
            raise TokenizerError(f"'{source}': encoder.json is not valid JSON ({e})") from e
        if not isinstance(encoder, dict) or not all(isinstance(v, int) for v in encoder.values()):
            raise TokenizerError(f"'{source}': encoder.json must map token strings to integer ids")
        try:
            lines = vocab_bpe.decode("utf-8").splitlines()
        except UnicodeDecodeError as e:
            raise TokenizerError(f"'{source}': vocab.bpe is not UTF-8 ({e})") from e
        merges = [line.split() for line in lines if line.strip() and not line.startswith("#version")]
        if not merges or any(len(m) != 2 for m in merges):
            raise TokenizerError(
                f"'{source}': vocab.bpe must hold one merge ('<left> <right>') per line after '#version'"
            )

        # Ranks are the encoder ids of the 256 bytes and of each merge's result; tiktoken merges by rank, which is
        # only right when a merge's id is its priority: check, as tiktoken does for its own gpt2 files.
        to_byte = _gpt2_byte_decoder()
        ranks: dict[bytes, int] = {}
        for ch, b in to_byte.items():
            if ch not in encoder:
                raise TokenizerError(f"'{source}': encoder.json lacks the single-byte token {ch!r}")
            ranks[bytes([b])] = encoder[ch]
        for i, (left, right) in enumerate(merges):
            token = left + right
            if encoder.get(token) != 256 + i:
                raise TokenizerError(
                    f"'{source}': vocab.bpe line {i + 2} merges to {token!r}, whose encoder.json id is "
                    f"{encoder.get(token)} instead of {256 + i}: encoder.json and vocab.bpe do not belong together"
                )
            try:
                ranks[bytes(to_byte[c] for c in token)] = 256 + i
            except KeyError:
                raise TokenizerError(
                    f"'{source}': vocab.bpe line {i + 2} holds a character outside GPT-2's byte alphabet"
                ) from None
        rank_ids = set(ranks.values())
        specials = {t: i for t, i in encoder.items() if i not in rank_ids}
        if GPT2_EOS not in specials:
            raise TokenizerError(f"'{source}': encoder.json lacks GPT-2's {GPT2_EOS} token")
        self._specials = specials
        self._enc = _tiktoken_encoding("gpt2", GPT2_PATTERN, ranks, specials)
        self._files = (encoder_json, vocab_bpe)
        self._bos_token = self._eos_token = GPT2_EOS

    def cut(self, text: str, offset: int = 0) -> int:
        """Before a space between non-whitespace characters (:meth:`Tokenizer.cut`)."""
        return _space_cut(text)

    def _encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def _decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids)

    def _save_files(self, directory: Path) -> dict[str, Any]:
        (directory / "encoder.json").write_bytes(self._files[0])
        (directory / "vocab.bpe").write_bytes(self._files[1])
        return {}


# ----------------------------------------------------------------------------------------------------------------
# Loading

_EXPECTED = (
    "a directory saved by memfit (tokenizer_config.json with 'kind'), a Hugging Face tokenizer.json, a "
    "SentencePiece or tiktoken tokenizer.model, or GPT-2's encoder.json + vocab.bpe"
)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a directory or a file, recognising the format by name and content.

    A directory is searched in this order: memfit's ``tokenizer_config.json`` (from :meth:`Tokenizer.save`), a
    Hugging Face ``tokenizer.json`` (BOS/EOS from ``tokenizer_config.json`` or ``special_tokens_map.json`` beside
    it, else from well-known token names), a ``tokenizer.model``, GPT-2's ``encoder.json`` + ``vocab.bpe`` (also
    ``gpt2_encoder.json`` + ``gpt2_vocab.bpe``, or any one ``*encoder.json`` with one ``*.bpe``), or a single
    ``*.model``. A ``.model`` file is a tiktoken ranks file when it is ``<base64> <rank>`` lines, else it must be
    a SentencePiece model.

    Whether texts start with BOS (:attr:`Tokenizer.add_bos`) follows the tokenizer's own library: a
    ``tokenizer.json`` says by its post-processor (as transformers 5 encodes, whatever ``add_bos_token`` says), a
    ``tokenizer.model`` by ``add_bos_token`` in a ``tokenizer_config.json`` beside it, else yes (Meta's Llama 2
    and 3 files).

    A tiktoken ``tokenizer.model`` holds no names for its 256 special ids: they come from the Hugging Face files
    beside it (``added_tokens_decoder`` of ``tokenizer_config.json``, else ``added_tokens`` of ``tokenizer.json``;
    BOS/EOS from ``bos_token`` / ``eos_token`` of ``tokenizer_config.json``, else ``special_tokens_map.json``),
    else they are Llama 3.1's (:class:`TiktokenTokenizer`).

    Args:
        path: The directory or file.

    Returns:
        The tokenizer.

    Raises:
        TokenizerError: ``path`` does not exist, holds no recognised tokenizer, or a file is corrupt; the
            message names the file and what was expected.
    """
    path = Path(path)
    if not path.exists():
        raise TokenizerError(f"tokenizer path '{path}' does not exist; expected {_EXPECTED}")
    if path.is_dir():
        return _load_dir(path)
    return _load_file(path)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file '{path}': {e}") from e


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_bytes(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"'{path}' is not valid JSON ({e}); expected {_EXPECTED}") from e


def _load_dir(directory: Path) -> Tokenizer:
    tokenizer = _load_dir_files(directory)
    tokenizer.chat_template = read_chat_template_source(directory)
    return tokenizer


def _load_dir_files(directory: Path) -> Tokenizer:
    config_path = directory / CONFIG_NAME
    if config_path.is_file():
        config = _read_json(config_path)
        if isinstance(config, dict) and "kind" in config:
            return _load_memfit(directory, config, config_path)
    if (directory / "tokenizer.json").is_file():
        return _load_hf(directory / "tokenizer.json")
    if (directory / "tokenizer.model").is_file():
        return _load_model_file(directory / "tokenizer.model")
    pair = _find_gpt2_pair(directory)
    if pair is not None:
        return _load_gpt2(*pair)
    models = sorted(directory.glob("*.model"))
    if len(models) == 1:
        return _load_model_file(models[0])
    raise TokenizerError(f"no tokenizer files in directory '{directory}'; expected {_EXPECTED}")


def read_chat_template_source(directory: Path) -> ChatTemplateSource | None:
    """The chat template a tokenizer directory holds, with the named tokens it sees; ``None`` when it has none.

    The template is ``chat_template.jinja`` (transformers 5, and memfit's saved tokenizers), else the
    ``chat_template`` string of a Hugging Face ``tokenizer_config.json`` (transformers 4). Its named tokens are
    those of :data:`TEMPLATE_TOKEN_NAMES` (and a dict of named ``extra_special_tokens``) that
    ``tokenizer_config.json`` sets, else ``special_tokens_map.json``; a directory memfit saved keeps them in its
    config's ``chat_template_tokens``.

    Args:
        directory: The tokenizer directory.

    Returns:
        The template, or ``None``.

    Raises:
        TokenizerError: ``chat_template.jinja`` is unreadable or not UTF-8, or a config file is not JSON.
    """
    directory = Path(directory)
    jinja = directory / CHAT_TEMPLATE_NAME
    config_path = directory / CONFIG_NAME
    config = _read_json(config_path) if config_path.is_file() else None
    config = config if isinstance(config, dict) else {}
    if jinja.is_file():
        try:
            text, path = jinja.read_text(encoding="utf-8"), str(jinja)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read the chat template '{jinja}': {e}") from e
    elif isinstance(config.get("chat_template"), str):
        text, path = config["chat_template"], str(config_path)
    else:
        return None
    if "kind" in config:  # a directory memfit saved
        saved = config.get("chat_template_tokens") or {}
        kept = {k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, str)}
        return ChatTemplateSource(text, path, kept)
    tokens: dict[str, str] = {}
    sources = [config]
    if (directory / "special_tokens_map.json").is_file():
        mapped = _read_json(directory / "special_tokens_map.json")
        sources.append(mapped if isinstance(mapped, dict) else {})
    for source in sources:
        names = list(TEMPLATE_TOKEN_NAMES)
        extra = source.get("extra_special_tokens")
        if isinstance(extra, dict):  # transformers 5: model-specific named tokens, e.g. {"image_token": ...}
            names += [k for k in extra if isinstance(k, str)]
        for name in names:
            value = _token_text(source.get(name, extra.get(name) if isinstance(extra, dict) else None))
            if value is not None:
                tokens.setdefault(name, value)
    return ChatTemplateSource(text, path, tokens)


def _load_file(path: Path) -> Tokenizer:
    if path.name == CONFIG_NAME:
        return _load_dir(path.parent)
    head = _read_bytes(path)[:4096]
    if path.suffix == ".json" or head.lstrip().startswith(b"{"):
        obj = _read_json(path)
        if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
            return _load_hf(path)
        if isinstance(obj, dict) and obj and all(isinstance(v, int) for v in obj.values()):
            pair = _find_gpt2_pair(path.parent, encoder=path)
            if pair is None:
                raise TokenizerError(
                    f"'{path}' looks like GPT-2's encoder.json but no vocab.bpe is beside it"
                )
            return _load_gpt2(*pair)
        raise TokenizerError(
            f"'{path}' is JSON but neither a Hugging Face tokenizer.json (no 'model' key) nor GPT-2's encoder.json"
        )
    if head.startswith(b"#version"):
        pair = _find_gpt2_pair(path.parent, bpe=path)
        if pair is None:
            raise TokenizerError(f"'{path}' looks like GPT-2's vocab.bpe but no encoder.json is beside it")
        return _load_gpt2(*pair)
    return _load_model_file(path)


def _load_model_file(path: Path) -> Tokenizer:
    config = _hf_config(path.parent, memfit=True)
    if path.name == "tokenizer.model" and config.get("kind") in ("sentencepiece", "tiktoken"):
        return _load_memfit(path.parent, config, path.parent / CONFIG_NAME)  # a directory memfit saved
    data = _read_bytes(path)
    first_line = data.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first_line):
        return TiktokenTokenizer(data, str(path), **_hf_beside(path.parent))
    add_bos = _add_bos_entry(_hf_config(path.parent), "add_bos_token", path.parent / CONFIG_NAME)
    try:
        return SentencePieceTokenizer(data, str(path), add_bos=add_bos is not False)
    except TokenizerError as e:
        raise TokenizerError(
            f"'{path}' is neither a SentencePiece model nor a tiktoken ranks file ('<base64 token> <rank>' lines); "
            f"is it truncated or corrupt? ({e})"
        ) from e


def _find_gpt2_pair(
    directory: Path, encoder: Path | None = None, bpe: Path | None = None
) -> tuple[Path, Path] | None:
    def pick(given: Path | None, names: tuple[str, ...], pattern: str) -> Path | None:
        if given is not None:
            return given
        for name in names:
            if (directory / name).is_file():
                return directory / name
        found = sorted(directory.glob(pattern))
        return found[0] if len(found) == 1 else None

    # Prefer the partner with the matching name (gpt2_encoder.json <-> gpt2_vocab.bpe).
    enc_names = ("encoder.json", "gpt2_encoder.json")
    bpe_names = ("vocab.bpe", "gpt2_vocab.bpe")
    if encoder is not None and encoder.name.endswith("encoder.json"):
        bpe_names = (encoder.name.replace("encoder.json", "vocab.bpe"), *bpe_names)
    if bpe is not None and bpe.name.endswith("vocab.bpe"):
        enc_names = (bpe.name.replace("vocab.bpe", "encoder.json"), *enc_names)
    enc_path = pick(encoder, enc_names, "*encoder.json")
    bpe_path = pick(bpe, bpe_names, "*.bpe")
    if enc_path is None and bpe_path is None:
        return None
    if enc_path is None or bpe_path is None:
        if encoder is not None or bpe is not None:
            return None  # the caller names the file it was given
        have, lack = (enc_path, "vocab.bpe") if bpe_path is None else (bpe_path, "encoder.json")
        raise TokenizerError(f"found '{have}' but no GPT-2 {lack} beside it in '{directory}'")
    return enc_path, bpe_path


def _load_gpt2(encoder: Path, bpe: Path) -> GPT2Tokenizer:
    return GPT2Tokenizer(_read_bytes(encoder), _read_bytes(bpe), f"{encoder} + {bpe}")


def _token_text(value: Any) -> str | None:
    """A bos/eos entry of a HF config: a string, ``{"content": ...}`` or ``None``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_hf(path: Path, memfit: dict[str, Any] | None = None) -> HFTokenizer:
    """Load a tokenizer.json; BOS/EOS and ``add_bos`` from ``memfit`` (the config of a directory memfit saved), or
    else BOS/EOS from the files beside it and ``add_bos`` from the post-processor."""
    from tokenizers import Tokenizer as HFCore  # deferred: each backend is imported only when it is used

    data = _read_bytes(path)
    try:
        tok = HFCore.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise TokenizerError(f"'{path}' is not a valid Hugging Face tokenizer.json: {e}") from e
    add_bos: bool | None
    if memfit is not None:
        bos, eos, extra = memfit.get("bos_token"), memfit.get("eos_token"), ()
        # (a directory saved before the key existed: memfit prepare put BOS first whatever the tokenizer)
        add_bos = _add_bos_entry(memfit, "add_bos", path.parent / CONFIG_NAME) is not False
    else:
        named = _hf_bos_eos(path.parent)
        if named is None:
            specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
            named = (
                next((t for t in _BOS_NAMES if t in specials), None),
                next((t for t in _EOS_NAMES if t in specials), None),
                path,
            )
        bos, eos, _ = named
        extra = _hf_extra_specials(path.parent)
        add_bos = None  # as the post-processor does; transformers 5 reads add_bos_token only without one
        flag = _add_bos_entry(_hf_config(path.parent), "add_bos_token", path.parent / CONFIG_NAME)
        if flag is not None and flag != _bos_first(tok, _token_text(bos)):
            log.warning(
                "'%s' sets add_bos_token %s, but '%s' (its post-processor) encodes otherwise: texts are read as "
                "tokenizer.json encodes them, as transformers 5 does",
                path.parent / CONFIG_NAME,
                str(flag).lower(),
                path,
            )
    try:
        return HFTokenizer(tok, _token_text(bos), _token_text(eos), extra, add_bos=add_bos)
    except TokenizerError as e:
        raise TokenizerError(f"'{path}': {e}") from e


def _hf_config(directory: Path, memfit: bool = False) -> dict[str, Any]:
    """The ``tokenizer_config.json`` in ``directory``: Hugging Face's (``{}`` for memfit's, unless ``memfit``)."""
    path = directory / CONFIG_NAME
    cfg = _read_json(path) if path.is_file() else None
    if not isinstance(cfg, dict) or ("kind" in cfg) != memfit:
        return {}
    return cfg


def _add_bos_entry(config: dict[str, Any], key: str, where: Path) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise TokenizerError(f"'{where}': {key} must be true or false, got {value!r}")
    return value


def _hf_bos_eos(directory: Path) -> tuple[Any, Any, Path] | None:
    """BOS/EOS entries of a Hugging Face ``tokenizer_config.json`` or else ``special_tokens_map.json``, if any,
    and that file."""
    for name in (CONFIG_NAME, "special_tokens_map.json"):
        cfg_path = directory / name
        if cfg_path.is_file():
            cfg = _read_json(cfg_path)
            if isinstance(cfg, dict) and ("bos_token" in cfg or "eos_token" in cfg):
                return cfg.get("bos_token"), cfg.get("eos_token"), cfg_path
    return None


def _hf_beside(directory: Path) -> dict[str, Any]:
    """What the Hugging Face files in ``directory`` say of a ``tokenizer.model`` beside them, as
    :class:`TiktokenTokenizer` arguments (only those they set): the names of special ids (``added_tokens_decoder``
    of ``tokenizer_config.json``, else ``added_tokens`` of ``tokenizer.json``), BOS/EOS (``tokenizer_config.json``,
    else ``special_tokens_map.json``) and ``add_bos`` (``add_bos_token`` of ``tokenizer_config.json``)."""
    out: dict[str, Any] = {}
    config = _hf_config(directory)
    added, where = config.get("added_tokens_decoder"), directory / CONFIG_NAME
    if not added and (directory / "tokenizer.json").is_file():
        where = directory / "tokenizer.json"
        added = _read_json(where)
        added = added.get("added_tokens") if isinstance(added, dict) else None
        if isinstance(added, list):
            added = {t.get("id") if isinstance(t, dict) else None: t for t in added}
    if added:
        try:
            names = {int(i): _token_text(t) for i, t in added.items()}
        except (AttributeError, TypeError, ValueError):
            names = {}
        if not names or not all(isinstance(t, str) for t in names.values()):
            raise TokenizerError(
                f"'{where}': its added tokens must map ids to token texts ({{'128000': {{'content': ...}}}} or "
                "[{'id': 128000, 'content': ...}])"
            )
        out["special_tokens"], out["special_tokens_from"] = names, str(where)
    named = _hf_bos_eos(directory)
    if named is not None:
        out["bos_token"], out["eos_token"] = _token_text(named[0]), _token_text(named[1])
        out["bos_eos_from"] = str(named[2])
    add_bos = _add_bos_entry(config, "add_bos_token", directory / CONFIG_NAME)
    if add_bos is not None:
        out["add_bos"] = add_bos
    return out


def _hf_extra_specials(directory: Path) -> list[str]:
    """Tokens a Hugging Face ``tokenizer_config.json`` declares special: ``additional_special_tokens`` (4.x),
    ``extra_special_tokens`` (5.x, a list or a dict) and ``added_tokens_decoder`` entries with ``special``."""
    cfg_path = directory / CONFIG_NAME
    if not cfg_path.is_file():
        return []
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        return []
    found: list[Any] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = cfg.get(key)
        found += list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    decoder = cfg.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        found += [t for t in decoder.values() if isinstance(t, dict) and t.get("special")]
    return [t for t in (_token_text(v) for v in found) if t is not None]


def _load_memfit(directory: Path, config: dict[str, Any], config_path: Path) -> Tokenizer:
    kind = config["kind"]
    if kind not in KINDS:
        raise TokenizerError(f"'{config_path}' names tokenizer kind {kind!r}; expected one of {KINDS}")

    def need(name: str) -> Path:
        p = directory / name
        if not p.is_file():
            raise TokenizerError(f"'{config_path}' is for a {kind} tokenizer, but '{p}' is missing")
        return p

    tokenizer: Tokenizer
    if kind == "char":
        vocab = config.get("vocab")
        if not isinstance(vocab, list):
            raise TokenizerError(
                f"'{config_path}' is for a char tokenizer but has no 'vocab' list of characters"
            )
        try:
            tokenizer = CharTokenizer(vocab)
        except TokenizerError as e:
            raise TokenizerError(f"'{config_path}': {e}") from e
    elif kind == "bpe":
        tokenizer = _load_hf(need("tokenizer.json"), config)
    elif kind == "sentencepiece":
        p = need("tokenizer.model")
        add_bos = _add_bos_entry(config, "add_bos", config_path)
        tokenizer = SentencePieceTokenizer(_read_bytes(p), str(p), add_bos=add_bos is not False)
    elif kind == "tiktoken":
        p = need("tokenizer.model")
        names = config.get("special_tokens") or {}
        if not isinstance(names, dict) or not all(isinstance(i, int) for i in names.values()):
            raise TokenizerError(f"'{config_path}': special_tokens must map token texts to ids")
        tokenizer = TiktokenTokenizer(
            _read_bytes(p),
            str(p),
            special_tokens={i: t for t, i in names.items()},
            special_tokens_from=str(config_path),
            bos_token=config.get("bos_token", ...),
            eos_token=config.get("eos_token", ...),
            add_bos=_add_bos_entry(config, "add_bos", config_path) is not False,
        )
    else:
        tokenizer = _load_gpt2(need("encoder.json"), need("vocab.bpe"))
    expected = config.get("vocab_size")
    if expected is not None and expected != tokenizer.vocab_size:
        raise TokenizerError(
            f"'{config_path}' records vocab_size {expected} but the files in '{directory}' give {tokenizer.vocab_size}"
        )
    return tokenizer
