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

One module per kind (``char``, ``bpe``, ``sentencepiece``, ``tiktoken``, ``gpt2``) beside the interface they share
(``base``) and the loader that recognises them (``load``); every public name is importable from here.
"""

from memfit.errors import TokenizerError
from memfit.tokenizer.base import (
    CHAT_TEMPLATE_NAME,
    CONFIG_NAME,
    KINDS,
    TEMPLATE_TOKEN_NAMES,
    ChatTemplateSource,
    Tokenizer,
)
from memfit.tokenizer.bpe import BPE_BOS, BPE_EOS, HFTokenizer, train_bpe
from memfit.tokenizer.char import CharTokenizer
from memfit.tokenizer.gpt2 import GPT2_EOS, GPT2_PATTERN, GPT2Tokenizer
from memfit.tokenizer.load import load_tokenizer, read_chat_template_source
from memfit.tokenizer.sentencepiece import SentencePieceTokenizer
from memfit.tokenizer.tiktoken import (
    LLAMA3_NUM_SPECIAL,
    LLAMA3_PATTERN,
    LLAMA3_SPECIAL_TOKENS,
    TiktokenTokenizer,
    parse_tiktoken_ranks,
)

__all__ = [
    "BPE_BOS",
    "BPE_EOS",
    "CHAT_TEMPLATE_NAME",
    "CONFIG_NAME",
    "GPT2_EOS",
    "GPT2_PATTERN",
    "KINDS",
    "LLAMA3_NUM_SPECIAL",
    "LLAMA3_PATTERN",
    "LLAMA3_SPECIAL_TOKENS",
    "TEMPLATE_TOKEN_NAMES",
    "CharTokenizer",
    "ChatTemplateSource",
    "GPT2Tokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "TiktokenTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "parse_tiktoken_ranks",
    "read_chat_template_source",
    "train_bpe",
]
