"""The ``sentencepiece`` kind: a SentencePiece ``.model`` (Llama 1/2's ``tokenizer.model``), run by the
sentencepiece library (:class:`SentencePieceTokenizer`)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from memfit.errors import TokenizerError
from memfit.tokenizer.base import Tokenizer, _space_cut, _spans_word_boundary


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
