"""The ``gpt2`` kind: OpenAI's GPT-2 ``encoder.json`` + ``vocab.bpe``, encoded with tiktoken
(:class:`GPT2Tokenizer`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memfit.errors import TokenizerError
from memfit.tokenizer.base import _space_cut
from memfit.tokenizer.tiktoken import _tiktoken_encoding, _TiktokenBacked

# GPT-2's pre-tokenizer split pattern, as tiktoken writes it (equivalent to the one in openai/gpt-2 encoder.py).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOS = "<|endoftext|>"


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
