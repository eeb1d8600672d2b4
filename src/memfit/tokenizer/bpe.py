"""The ``bpe`` kind: a Hugging Face `tokenizers` tokenizer (:class:`HFTokenizer`), either a byte-level BPE trained
by :func:`train_bpe` or any ``tokenizer.json``, and where such a pipeline may be cut (:meth:`HFTokenizer.cut`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from memfit.errors import TokenizerError
from memfit.tokenizer.base import Tokenizer, _space_cut, _spans_word_boundary
from memfit.tokenizer.tiktoken import LLAMA3_PATTERN

BPE_BOS = "<|begin_of_text|>"
BPE_EOS = "<|end_of_text|>"


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
