"""Instruction and chat data: records -> conversations -> prompt templates with exact loss masks -> batches.

Three stages, each a function of its inputs alone:

1. :func:`load_conversations` reads a ``.json`` file (a list of records, or one record as an object) or a
   ``.jsonl`` file (one record per line, blank lines ignored) in one of :data:`memfit.data_formats.INSTRUCT_FORMATS` and
   turns every record into a conversation: a list of messages ``{"role": "system" | "user" | "assistant",
   "content": str}``. Alpaca and Dolly records become ``[user, assistant]``; a non-empty ``input`` (Dolly's
   ``context``) rides on the user message as an extra ``"input"`` key, so the ``alpaca`` template can render
   its ``### Input:`` section (the chat templates append it to the user's text after a blank line).
2. :func:`encode_conversation` renders a conversation with one of :data:`TEMPLATES`, *segment by segment*: each
   piece of text is tokenized on its own and special tokens are inserted as ids, so the boundary between prompt and
   reply is a token boundary and the loss mask is exact. Labels equal the ids on assistant replies and on the
   end-of-turn token(s) that follow each reply, and :data:`IGNORE_INDEX` everywhere else.
3. :func:`prepare_instruct` loads, splits (a seeded random validation fraction of the records), encodes, truncates
   to ``max_seq_len + 1`` tokens and optionally packs the samples, returning :class:`InstructData`. Each
   :class:`InstructSplit` serves batches as a pure function of their position in an endless stream of seeded
   epochs, so a resumed run sees exactly the batches the uninterrupted run would have.

A sample of ``n`` tokens trains the model on input ``ids[:-1]`` against target ``labels[1:]`` (next-token shift);
that is why samples hold up to ``max_seq_len + 1`` tokens. Packed rows concatenate the shifted (input, target)
pairs of several samples into exactly ``max_seq_len`` positions and carry ``doc_ids`` so that ``Decoder.forward``
keeps attention inside each sample and restarts its positions: a packed row computes what its samples would alone.

Record indices in error messages count from 0 (the position in the JSON list, or among the non-blank lines of a
JSONL file); line numbers count from 1.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.chat_template import ROLES, ChatTemplate
from memfit.data.records import load_records
from memfit.data_formats import DEFAULT_TEMPLATE, INSTRUCT_FORMATS, TEMPLATES
from memfit.errors import DataError
from memfit.memory.techniques import IGNORE_INDEX
from memfit.tokenizer import ChatTemplateSource

log = logging.getLogger(__name__)

# Stanford Alpaca's prompts (tatsu-lab/stanford_alpaca, train.py PROMPT_DICT).
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
# Llama 2 chat markers (meta-llama/llama, llama/generation.py).
_B_INST, _E_INST = "[INST]", "[/INST]"
_B_SYS, _E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"
# Llama 3 chat special tokens (meta-llama/llama3, llama/tokenizer.py ChatFormat).
_L3_BOT, _L3_START, _L3_END, _L3_EOT = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# ChatML markers.
_IM_START, _IM_END = "<|im_start|>", "<|im_end|>"
# Names of a padding token, tried in order when the tokenizer has no ``pad_id``.
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


# ----------------------------------------------------------------------------------------------------------------
# Templates

Template = str | ChatTemplate
"""A prompt template: the name of a built-in one (:data:`TEMPLATES`) or a checkpoint's own :class:`ChatTemplate`."""


def resolve_template(name: str, tokenizer: Any) -> Template:
    """The template ``data.template`` (or ``generate --template``) names, for this tokenizer.

    Args:
        name: ``auto`` or one of :data:`TEMPLATES`.
        tokenizer: The run's tokenizer; its :attr:`~memfit.tokenizer.Tokenizer.chat_template` is the checkpoint's
            own template, where it has one.

    Returns:
        A named template as is; for ``auto``, the tokenizer's chat template when it has one, else
        :data:`~memfit.data_formats.DEFAULT_TEMPLATE` (``alpaca``).

    Raises:
        DataError: ``name`` is unknown, or the chat template is not valid Jinja (naming its file).
    """
    if name != "auto":
        if name not in TEMPLATES:
            raise DataError(f"unknown chat template {name!r}; expected auto or one of {', '.join(TEMPLATES)}")
        return name
    source = getattr(tokenizer, "chat_template", None)
    return ChatTemplate(source) if source is not None else DEFAULT_TEMPLATE


def template_label(name: str, template: Template) -> str:
    """How the banner names the template a run renders with and where it came from, e.g. ``chatml``,
    ``auto: the checkpoint's chat template '<dir>/chat_template.jinja'`` or ``alpaca (auto: the tokenizer has no
    chat template)``."""
    if isinstance(template, ChatTemplate):
        return f"{name}: {template.label}" if name == "auto" else template.label
    if name == "auto":
        return f"{template} (auto: the tokenizer has no chat template)"
    return template


def template_name(template: Template) -> str:
    """A template's name in messages, quoted: the built-in's name, or the chat template's file."""
    return repr(template) if isinstance(template, str) else f"'{template.path}'"


class _Rendering:
    """Token ids and a trainable flag per token, built piece by piece.

    Text that directly continues earlier text (not after a special id, not at the start) is encoded as a
    continuation: for SentencePiece, which puts a dummy-prefix space before every encoded string, it is encoded
    after an anchor (``"\\n"``) whose ids are then removed, so the ids equal those of the whole string (the way
    torchtune's ``trim_leading_whitespace`` works). Byte-level tokenizers need nothing: every piece boundary in
    these templates is a pre-tokenizer boundary (a special token or a space/newline before a word).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.train: list[bool] = []
        self._after_text = False
        self._anchor = tokenizer.encode("\n") if getattr(tokenizer, "kind", "") == "sentencepiece" else None

    def text(self, text: str, train: bool) -> None:
        ids = self._encode(text, self._after_text) if text else []
        self.ids += ids
        self.train += [train] * len(ids)
        self._after_text = self._after_text or bool(text)

    def special(self, token_id: int, train: bool) -> None:
        self.ids.append(token_id)
        self.train.append(train)
        self._after_text = False

    def _encode(self, text: str, continuation: bool) -> list[int]:
        if continuation and self._anchor is not None:
            full = self.tokenizer.encode("\n" + text)
            if full[: len(self._anchor)] == self._anchor:
                return full[len(self._anchor) :]
        return self.tokenizer.encode(text)


def specials_for(template: Template, tokenizer: Any) -> dict[str, int]:
    """The special ids a template needs from ``tokenizer``; raises when it lacks one (a chat template: when it
    cannot be rendered or read with this tokenizer)."""
    if isinstance(template, ChatTemplate):
        template.check(tokenizer)
        return {}
    if template not in TEMPLATES:
        raise DataError(f"unknown chat template {template!r}; expected one of {', '.join(TEMPLATES)}")
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    specials = tokenizer.special_tokens
    out: dict[str, int] = {}
    if tokenizer.bos_id is not None:
        out["bos"] = tokenizer.bos_id
    if tokenizer.eos_id is not None:
        out["eos"] = tokenizer.eos_id
    if template == "alpaca" and "eos" not in out:
        raise DataError(
            f"template 'alpaca' ends each response with EOS, but this {kind} tokenizer has none; use a tokenizer "
            "with an EOS token"
        )
    if template == "llama2-chat":
        for name, token in (("bos", "<s>"), ("eos", "</s>")):
            if name not in out:
                raise DataError(
                    f"template 'llama2-chat' writes {token} as the tokenizer's {name.upper()} id, but this {kind} "
                    "tokenizer has no such token; use template 'chatml' or 'alpaca'"
                )
    if template == "llama3-chat":
        for token in (_L3_BOT, _L3_START, _L3_END, _L3_EOT):
            if token not in specials:
                raise DataError(
                    f"template 'llama3-chat' needs the special token {token!r}, which this {kind} tokenizer lacks "
                    "(Llama 3 tokenizers have it); use template 'chatml' (any tokenizer) or 'llama2-chat' "
                    "(a tokenizer with BOS and EOS), or a Llama 3 tokenizer"
                )
            out[token] = specials[token]
    if template == "chatml" and _IM_START in specials and _IM_END in specials:
        out[_IM_START], out[_IM_END] = specials[_IM_START], specials[_IM_END]
    return out


def _user_text(message: dict[str, str]) -> str:
    """The user's text; an Alpaca/Dolly ``input`` follows the instruction after a blank line (chat templates)."""
    extra = message.get("input")
    return message["content"] + (f"\n\n{extra}" if extra else "")


def _render(
    messages: Sequence[dict[str, str]], template: str, tokenizer: Any, generation_prompt: bool
) -> _Rendering:
    ids = specials_for(template, tokenizer)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': str}}, got {m!r:.120}"
            )
    if generation_prompt:
        if not messages or messages[-1]["role"] != "user":
            raise DataError("a generation prompt ends with a user message")
    else:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise DataError("the conversation has no assistant reply (nothing to train on)")
        messages = messages[: last + 1]  # messages after the last reply carry no target
    r = _Rendering(tokenizer)
    {"alpaca": _alpaca, "llama2-chat": _llama2, "llama3-chat": _llama3, "chatml": _chatml}[template](
        r, list(messages), ids, generation_prompt
    )
    return r


def _alpaca(r: _Rendering, messages: list[dict], ids: dict[str, int], gen: bool) -> None:
    # A system message is prepended to the instruction, separated by a blank line (Alpaca has no system slot).
    system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
    roles = [m["role"] for m in messages]
    if roles != (["user"] if gen else ["user", "assistant"]):
        raise DataError(
            "template 'alpaca' is single-turn: [system?], user, assistant; this conversation has roles "
            f"{roles} (use 'llama3-chat', 'llama2-chat' or 'chatml' for multi-turn chats)"
        )
    user = messages[0]
    instruction = user["content"] if system is None else f"{system}\n\n{user['content']}"
    prompt = ALPACA_PROMPT_INPUT if user.get("input") else ALPACA_PROMPT_NO_INPUT
    prompt = prompt.format(instruction=instruction, input=user.get("input", ""))
    if "bos" in ids:
        r.special(ids["bos"], train=False)
    r.text(prompt, train=False)
    if not gen:
        r.text(messages[1]["content"], train=True)
        r.special(ids["eos"], train=True)


def _llama2(r: _Rendering, messages: list[dict], ids: dict[str, int], gen: bool) -> None:
    # Meta's chat_completion and the Hugging Face Llama-2-chat template: contents stripped, the system prompt
    # wrapped in <<SYS>> inside the first [INST], each exchange "<s>[INST] user [/INST] reply </s>".
    system = messages.pop(0)["content"] if messages and messages[0]["role"] == "system" else None
    for i, m in enumerate(messages):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            raise DataError(
                f"template 'llama2-chat' needs an optional first system message, then user and assistant "
                f"alternating from user; message {i + (system is not None)} is {m['role']!r} where "
                f"{expected!r} belongs"
            )
    for i in range(0, len(messages), 2):
        user = _user_text(messages[i])
        if i == 0 and system is not None:
            user = _B_SYS + system + _E_SYS + user
        r.special(ids["bos"], train=False)
        r.text(f"{_B_INST} {user.strip()} {_E_INST}", train=False)
        if i + 1 < len(messages):
            r.text(f" {messages[i + 1]['content'].strip()} ", train=True)
            r.special(ids["eos"], train=True)


def _llama3(r: _Rendering, messages: list[dict], ids: dict[str, int], gen: bool) -> None:
    # Meta's ChatFormat and the Hugging Face Llama-3-Instruct template: contents stripped.
    def header(role: str) -> None:
        r.special(ids[_L3_START], train=False)
        r.text(role, train=False)
        r.special(ids[_L3_END], train=False)
        r.text("\n\n", train=False)

    r.special(ids[_L3_BOT], train=False)
    for m in messages:
        header(m["role"])
        reply = m["role"] == "assistant"
        r.text((m["content"] if reply else _user_text(m)).strip(), train=reply)
        r.special(ids[_L3_EOT], train=reply)
    if gen:
        header("assistant")


def _chatml(r: _Rendering, messages: list[dict], ids: dict[str, int], gen: bool) -> None:
    special = _IM_START in ids

    def marker(token: str, train: bool) -> None:
        if special:
            r.special(ids[token], train)
        else:
            r.text(token, train)

    for m in messages:
        marker(_IM_START, train=False)
        r.text(f"{m['role']}\n", train=False)
        reply = m["role"] == "assistant"
        r.text(m["content"] if reply else _user_text(m), train=reply)
        marker(_IM_END, train=reply)
        r.text("\n", train=reply)
    if gen:
        marker(_IM_START, train=False)
        r.text("assistant\n", train=False)
    elif "eos" in ids and ids["eos"] != ids.get(_IM_END):
        r.special(ids["eos"], train=True)


def encode_conversation(
    messages: Sequence[dict[str, str]], template: Template, tokenizer: Any, *, train_on_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Render a conversation with a chat template into token ids and loss labels.

    Each piece is tokenized on its own and special tokens are inserted as ids (plain text never becomes one).
    Messages after the last assistant reply carry no target and are not rendered. Renderings (``<x>`` is the
    special id of token x; ``{content}`` is the message text):

    - ``alpaca``: ``<BOS>`` (if the tokenizer has one), Stanford Alpaca's prompt (:data:`ALPACA_PROMPT_INPUT` when
      the user message has an ``input``, else :data:`ALPACA_PROMPT_NO_INPUT`), the response, ``<EOS>``.
      Single-turn only; a system message is prepended to the instruction, followed by a blank line.
    - ``llama2-chat``: ``<s>[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST] {assistant} </s>``, then
      ``<s>[INST] {user} [/INST] {assistant} </s>`` per further exchange, ``<s>``/``</s>`` the tokenizer's
      BOS/EOS; contents stripped (as Meta's reference and the Hugging Face template do); roles must alternate.
    - ``llama3-chat``: ``<|begin_of_text|>``, then per message
      ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>`` with contents stripped.
    - ``chatml``: per message ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then ``<EOS>`` if the tokenizer
      has one (and it is not ``<|im_end|>``). The markers are special ids when the tokenizer has both as special
      tokens, otherwise they are encoded as plain text.

    Trained tokens: each assistant reply and the end-of-turn that follows it (``<EOS>`` for alpaca and
    llama2-chat, whose reply piece is ``" {assistant} "``; ``<|eot_id|>``; ``<|im_end|>\\n``, plus the final
    ``<EOS>``, for chatml).

    A checkpoint's own :class:`~memfit.data.chat_template.ChatTemplate` renders the whole conversation with Jinja
    as transformers does, the ids equal to ``apply_chat_template(messages, tokenize=True)``, each reply and the
    end-of-turn the template closes it with trained (:meth:`ChatTemplate.encode`).

    Args:
        messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]`` (a user message may carry
            an ``"input"``, see :func:`load_conversations`).
        template: One of :data:`TEMPLATES`, or a :class:`~memfit.data.chat_template.ChatTemplate`.
        tokenizer: A ``memfit.tokenizer.Tokenizer``.
        train_on_prompt: Train on every token (labels equal ids).

    Returns:
        ``(ids, labels)``, lists of the same length; ``labels[i]`` is ``ids[i]`` where token i is a training target
        and :data:`IGNORE_INDEX` elsewhere. The model is trained on input ``ids[:-1]`` against ``labels[1:]``.

    Raises:
        DataError: Unknown template; the tokenizer lacks a token the template needs (the message names it and
            the template to use instead); a message is not a role/content dict; no assistant reply; the roles do
            not fit the template (multi-turn for alpaca, non-alternating for llama2-chat); a chat template cannot
            render the conversation (naming its file).
    """
    if isinstance(template, ChatTemplate):
        return template.encode(messages, tokenizer, train_on_prompt=train_on_prompt)
    r = _render(messages, template, tokenizer, generation_prompt=False)
    labels = (
        list(r.ids)
        if train_on_prompt
        else [i if t else IGNORE_INDEX for i, t in zip(r.ids, r.train, strict=True)]
    )
    return r.ids, labels


def encode_prompt(messages: Sequence[dict[str, str]], template: Template, tokenizer: Any) -> list[int]:
    """Render a conversation that ends with a user message, up to where the assistant's reply begins.

    The ids equal the prefix of :func:`encode_conversation`'s for the same messages plus a reply: they end with
    ``### Response:\\n`` (alpaca), ``[/INST]`` (llama2-chat), ``<|start_header_id|>assistant<|end_header_id|>\\n\\n``
    (llama3-chat) or ``<|im_start|>assistant\\n`` (chatml); a chat template's rendering with
    ``add_generation_prompt=True``.

    Args:
        messages: The conversation so far, ending with a user message.
        template: One of :data:`TEMPLATES`, or a :class:`~memfit.data.chat_template.ChatTemplate`.
        tokenizer: A ``memfit.tokenizer.Tokenizer``.

    Returns:
        The prompt's token ids, for generation.

    Raises:
        DataError: As :func:`encode_conversation`, or the last message is not the user's.
    """
    if isinstance(template, ChatTemplate):
        return template.encode_prompt(messages, tokenizer)
    return _render(messages, template, tokenizer, generation_prompt=True).ids


def stop_token_ids(template: Template, tokenizer: Any) -> list[int]:
    """Ids that end an assistant reply in generation.

    Args:
        template: One of :data:`TEMPLATES`, or a :class:`~memfit.data.chat_template.ChatTemplate`.
        tokenizer: A ``memfit.tokenizer.Tokenizer``.

    Returns:
        EOS (when the tokenizer has one), plus ``<|eot_id|>`` for llama3-chat and ``<|im_end|>`` for chatml when it
        is a special token, or the first special token a chat template closes a reply with; without duplicates.

    Raises:
        DataError: As :func:`encode_conversation` for a template the tokenizer cannot serve.
    """
    if isinstance(template, ChatTemplate):
        return template.stop_token_ids(tokenizer)
    ids = specials_for(template, tokenizer)
    out = [ids["eos"]] if "eos" in ids else []
    for token in (_L3_EOT, _IM_END):
        if token in ids and ids[token] not in out:
            out.append(ids[token])
    return out


# ----------------------------------------------------------------------------------------------------------------
# The built-in templates as Jinja (what an export carries, for transformers' apply_chat_template)

# Each renders, with transformers' Jinja settings (trim_blocks, lstrip_blocks), the text whose tokens the renderer
# above writes: for a conversation that ends with a reply (training), or with a user message under
# add_generation_prompt (sampling). An Alpaca/Dolly "input" key on a user message is read as the renderer reads it.
_JINJA_SYSTEM_AND_TURNS = r"""{% if messages and messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}
{% set turns = messages[1:] %}
{% else %}
{% set system = none %}
{% set turns = messages %}
{% endif %}
"""
_JINJA_USER_TEXT = r"m['content'] + ('\n\n' + m['input'] if m['input'] is defined and m['input'] else '')"
_BUILTIN_JINJA = {
    "alpaca": _JINJA_SYSTEM_AND_TURNS
    + r"""{% set roles = turns | map(attribute='role') | list %}
{% if roles != (['user'] if add_generation_prompt else ['user', 'assistant']) %}
{{ raise_exception("template 'alpaca' is single-turn: [system], user, assistant") }}
{% endif %}
{% set m = turns[0] %}
{% set instruction = m['content'] if system is none else system + '\n\n' + m['content'] %}
{% if bos_token %}{{ bos_token }}{% endif %}
{% if m['input'] is defined and m['input'] %}
{{ 'Below is an instruction that describes a task, paired with an input that provides further context. '
   + 'Write a response that appropriately completes the request.\n\n### Instruction:\n' + instruction
   + '\n\n### Input:\n' + m['input'] + '\n\n### Response:\n' }}{% else %}
{{ 'Below is an instruction that describes a task. Write a response that appropriately completes the request.'
   + '\n\n### Instruction:\n' + instruction + '\n\n### Response:\n' }}{% endif %}
{% if not add_generation_prompt %}{{ turns[1]['content'] + eos_token }}{% endif %}
""",
    "llama2-chat": _JINJA_SYSTEM_AND_TURNS
    + r"""{% for m in turns %}
{% if m['role'] != ('user' if loop.index0 % 2 == 0 else 'assistant') %}
{{ raise_exception("template 'llama2-chat' needs an optional system message, then user and assistant alternating") }}
{% endif %}
{% if m['role'] == 'user' %}
{% set text = """
    + _JINJA_USER_TEXT
    + r""" %}
{% if loop.first and system is not none %}
{% set text = '<<SYS>>\n' + system + '\n<</SYS>>\n\n' + text %}
{% endif %}
{{ bos_token + '[INST] ' + text | trim + ' [/INST]' }}{% else %}
{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}
{% endfor %}
""",
    "llama3-chat": r"""{{ '<|begin_of_text|>' }}{% for m in messages %}
{% set text = m['content'] if m['role'] == 'assistant' else """
    + _JINJA_USER_TEXT
    + r""" %}
{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + text | trim + '<|eot_id|>' }}{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
""",
    "chatml": r"""{% for m in messages %}
{% set text = m['content'] if m['role'] == 'assistant' else """
    + _JINJA_USER_TEXT
    + r""" %}
{{ '<|im_start|>' + m['role'] + '\n' + text + '<|im_end|>\n' }}{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% elif messages and messages[-1]['role'] == 'assistant'
   and eos_token and eos_token != '<|im_end|>' %}{{ eos_token }}{% endif %}
""",
}


def builtin_template_source(template: str, tokenizer: Any) -> ChatTemplateSource:
    """A built-in template as Jinja, for transformers' ``apply_chat_template`` (what ``memfit export`` writes).

    The Jinja renders the text whose tokens :func:`encode_conversation` and :func:`encode_prompt` give with this
    template, for a conversation that ends with an assistant reply or, with ``add_generation_prompt=True``, with
    a user message: the special tokens as their text (BOS and EOS as the tokenizer's ``bos_token`` and
    ``eos_token``), an Alpaca/Dolly ``input`` key of a user message as this module reads it, and a conversation
    the template does not take refused with ``raise_exception``. Tokenized whole, as transformers does, that text
    gives the renderer's ids where each piece boundary of the rendering is a pre-tokenizer boundary: special
    tokens, and the byte-level BPE tokenizers of Llama 3 / GPT-2 style between text pieces (not ChatML's markers as
    plain text, whose ``.<|`` can merge; not necessarily SentencePiece, which the renderer encodes piece by piece).

    Args:
        template: One of :data:`TEMPLATES`.
        tokenizer: A ``memfit.tokenizer.Tokenizer``; its BOS and EOS texts are the tokens the Jinja sees.

    Returns:
        The Jinja, with ``path`` naming the template (``memfit's built-in template 'chatml'``) and ``tokens``
        ``bos_token`` / ``eos_token`` where the tokenizer has them.

    Raises:
        DataError: ``template`` is not a built-in one.
    """
    if template not in _BUILTIN_JINJA:
        raise DataError(f"unknown chat template {template!r}; expected one of {', '.join(TEMPLATES)}")
    names = {i: t for t, i in tokenizer.special_tokens.items()}
    tokens = {
        name: names[i]
        for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
        if i is not None and i in names
    }
    return ChatTemplateSource(_BUILTIN_JINJA[template], f"memfit's built-in template '{template}'", tokens)


# ----------------------------------------------------------------------------------------------------------------
# Splits and batches


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads inputs: the tokenizer's ``pad_id`` or a pad special token if any, else EOS, else 0.

    Padded positions never reach the loss (their targets are :data:`IGNORE_INDEX`) and, padding being at the
    right end of a row (or its own packed sample), never influence a real token; the choice is cosmetic.
    """
    pad = getattr(tokenizer, "pad_id", None)
    if pad is not None:
        return int(pad)
    specials = tokenizer.special_tokens
    for name in _PAD_NAMES:
        if name in specials:
            return specials[name]
    return tokenizer.eos_id if tokenizer.eos_id is not None else 0


def batch_position(
    step: int,
    micro_step: int,
    batch_size: int,
    gradient_accumulation_steps: int,
    rank: int = 0,
    world_size: int = 1,
) -> int:
    """Position of the first sample of one micro-batch in the stream of :meth:`InstructSplit.batch`.

    Consecutive micro-batches of a step, and the ranks within each, take consecutive disjoint slices of the
    stream, so one step consumes ``batch_size * gradient_accumulation_steps * world_size`` samples.

    Args:
        step: Optimizer step, from 0.
        micro_step: Micro-batch within the step, ``[0, gradient_accumulation_steps)``.
        batch_size: Samples (or packed rows) per micro-batch.
        gradient_accumulation_steps: Micro-batches per step.
        rank: This process's rank.
        world_size: Number of data-parallel processes.

    Returns:
        The position.
    """
    return ((step * gradient_accumulation_steps + micro_step) * world_size + rank) * batch_size


class EpochStream:
    """Items served as an endless stream of seeded epochs: the order logic :class:`InstructSplit` and
    :class:`memfit.data.preference.PreferenceSplit` share.

    Item ``p`` of the stream is item ``order(p // N, seed)[p % N]`` of the ``N = len(self)`` items, so a batch is a
    pure function of ``(batch_size, position, seed)``. A subclass defines ``__len__`` and names its items in
    :attr:`item_name` (for the error an empty split raises).
    """

    item_name = "items"

    def __init__(self) -> None:
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        raise NotImplementedError

    def num_batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` in one epoch, the last possibly partial: ``ceil(len(self) / batch_size)``."""
        return math.ceil(len(self) / batch_size)

    def order(self, epoch: int, seed: int | None) -> np.ndarray:
        """(N,) item indices in the order epoch ``epoch`` visits them.

        Args:
            epoch: Epoch number, from 0.
            seed: ``None`` for the identity order, else ``numpy.random.default_rng([seed, epoch]).permutation``.

        Returns:
            The permutation (a cached array; do not modify).
        """
        if seed is None:
            return np.arange(len(self))
        key = (seed, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = np.random.default_rng([seed, epoch]).permutation(len(self))
        return self._perms[key]

    def indices(self, batch_size: int, position: int, seed: int | None) -> np.ndarray:
        """(batch_size,) int64 item indices of the batch whose first item is at ``position`` of the stream.

        Raises:
            ValueError: ``batch_size < 1`` or ``position < 0``.
            DataError: The split is empty.
        """
        if batch_size < 1 or position < 0:
            raise ValueError(f"batch_size must be >= 1 and position >= 0, got {batch_size} and {position}")
        n = len(self)
        if n == 0:
            raise DataError(
                f"this split holds no {self.item_name}; cannot draw a batch (is data.val_fraction 0?)"
            )
        out = np.empty(batch_size, dtype=np.int64)
        for j, p in enumerate(range(position, position + batch_size)):
            epoch, k = divmod(p, n)
            out[j] = self.order(epoch, seed)[k]
        return out


class InstructSplit(EpochStream):
    """The samples (or packed rows) of one split, served as padded batches.

    Item ``k`` holds model inputs and targets of the same length (``ids[:-1]`` and ``labels[1:]`` of a sample; or
    a packed row of exactly ``max_seq_len``) and, when packed, the row's ``doc_ids``. Items are stored as flat
    int32 arrays with offsets.

    Args:
        inputs: Per item, (n,) input ids.
        targets: Per item, (n,) target ids, :data:`IGNORE_INDEX` where not trained.
        doc_ids: ``None`` (unpacked), or per item (n,) sample numbers ``0, 1, 2, ...`` (packed rows).
        pad_id: Id that right-pads inputs to the longest item of a batch.
        num_tokens: Non-pad input tokens, when the items hold padding (packed rows); ``None`` counts every
            position.

    Attributes:
        packed: Whether items are packed rows.
        num_tokens: Input tokens of all items, padding excluded.
        num_label_tokens: Targets that are trained (not :data:`IGNORE_INDEX`).
        pad_id: As given.
    """

    item_name = "samples"

    def __init__(
        self,
        inputs: Sequence[np.ndarray],
        targets: Sequence[np.ndarray],
        doc_ids: Sequence[np.ndarray] | None,
        pad_id: int,
        num_tokens: int | None = None,
    ) -> None:
        lengths = np.array([len(x) for x in inputs], dtype=np.int64)
        if len(targets) != len(inputs) or any(len(t) != n for t, n in zip(targets, lengths, strict=False)):
            raise ValueError("every item needs inputs and targets of the same length")
        self.packed = doc_ids is not None
        self.pad_id = int(pad_id)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._lengths = lengths

        def flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays).astype(np.int32) if len(arrays) else np.zeros(0, np.int32)

        self._inputs, self._targets = flat(inputs), flat(targets)
        self._doc_ids = flat(doc_ids) if doc_ids is not None else None
        self.num_tokens = int(lengths.sum()) if num_tokens is None else num_tokens
        self.num_label_tokens = int((self._targets != IGNORE_INDEX).sum())
        super().__init__()

    @property
    def max_length(self) -> int:
        """Tokens of the longest item (0 for an empty split): the widest batch this split can produce."""
        return int(self._lengths.max()) if len(self._lengths) else 0

    def __len__(self) -> int:
        """Number of items: samples, or packed rows."""
        return len(self._lengths)

    @property
    def lengths(self) -> np.ndarray:
        """(N,) int64 input length of each item."""
        return self._lengths.copy()

    def batch(
        self, batch_size: int, position: int, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch whose first item is at ``position`` of an endless stream of epochs.

        Item ``p`` of the stream is item ``order(p // N, seed)[p % N]``; a batch may run across an epoch boundary.
        The result depends only on ``(batch_size, position, seed)``, so training resumes exactly.

        Args:
            batch_size: Items per batch ``B``.
            position: Index of the batch's first item in the stream (see :func:`batch_position`).
            seed: Shuffle seed; ``None`` for file order in every epoch (validation).

        Returns:
            ``(inputs, targets, doc_ids)``: int64 tensors of shape ``(B, T)``, ``T`` the longest item of the batch
            (``max_seq_len`` when packed); inputs right-padded with ``pad_id``, targets with
            :data:`IGNORE_INDEX`. ``doc_ids`` is ``(B, T)`` for packed splits (pass it to ``Decoder.forward``) and
            ``None`` otherwise.

        Raises:
            ValueError: ``batch_size < 1`` or ``position < 0``.
            DataError: The split is empty.
        """
        return self.collate(self.indices(batch_size, position, seed))

    def collate(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Stack the given items into one right-padded batch (as :meth:`batch` returns)."""
        indices = np.asarray(indices, dtype=np.int64)
        T = int(self._lengths[indices].max())
        B = len(indices)
        inputs = np.full((B, T), self.pad_id, dtype=np.int64)  # (B, T)
        targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)  # (B, T)
        docs = np.zeros((B, T), dtype=np.int64) if self._doc_ids is not None else None  # (B, T)
        for row, k in enumerate(indices):
            a, b = self._offsets[k], self._offsets[k + 1]
            inputs[row, : b - a] = self._inputs[a:b]
            targets[row, : b - a] = self._targets[a:b]
            if docs is not None:
                docs[row, : b - a] = self._doc_ids[a:b]
        return (
            torch.from_numpy(inputs),
            torch.from_numpy(targets),
            None if docs is None else torch.from_numpy(docs),
        )

    def epoch_batches(
        self, batch_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Every item once, in file order, in batches of ``batch_size`` (the last may be smaller): for evaluation.

        Yields:
            As :meth:`batch`.
        """
        for start in range(0, len(self), batch_size):
            yield self.collate(np.arange(start, min(start + batch_size, len(self))))

    def fingerprint(self) -> str:
        """The sha256 hex digest of the items: their offsets, input ids, targets (the label mask included, as
        :data:`IGNORE_INDEX`) and doc ids, in item order.

        Splits that feed a model the same tokens against the same targets share it; it keys what is computed from
        them (a preference run's reference log-probs). Padding and ``pad_id`` do not enter it.
        """
        h = hashlib.sha256()
        arrays = (
            ("offsets", self._offsets, "<i8"),
            ("inputs", self._inputs, "<i4"),
            ("targets", self._targets, "<i4"),
            ("doc_ids", self._doc_ids, "<i4"),
        )
        for name, array, dtype in arrays:
            if array is not None:
                h.update(f"{name}:{len(array)}:".encode())
                h.update(np.ascontiguousarray(array, dtype=dtype).tobytes())
        return h.hexdigest()


@dataclass
class InstructStats:
    """What :func:`prepare_instruct` did, over both splits.

    Attributes:
        num_records: Valid records loaded (malformed ones excluded).
        num_skipped: Malformed records skipped: at loading, or whose roles the template cannot render.
        num_truncated: Samples longer than ``max_seq_len + 1`` tokens, cut to that length.
        num_dropped: Samples left with no trained target after truncation, dropped.
        num_train_samples: Samples in the training split (before packing).
        num_val_samples: Samples in the validation split (before packing).
        num_tokens: Model input tokens of the kept samples, padding excluded (``len(ids) - 1`` per sample); one
            epoch of both splits feeds this many.
        num_label_tokens: Trained targets of the kept samples (``labels[1:]`` not :data:`IGNORE_INDEX`).
        num_train_rows: Packed rows of the training split (``None`` unpacked).
        num_val_rows: Packed rows of the validation split (``None`` unpacked).
        num_val_records: Records held out for validation (``num_val_samples`` of them are kept).
        num_val_dropped: Held-out records dropped with no trained target after truncation (the others not kept
            were skipped: their roles do not fit the template).
        packing_efficiency: Fraction of packed input positions that hold a real token, not padding, over both
            splits (``None`` unpacked).
    """

    num_records: int
    num_skipped: int
    num_truncated: int
    num_dropped: int
    num_train_samples: int
    num_val_samples: int
    num_tokens: int
    num_label_tokens: int
    num_train_rows: int | None = None
    num_val_rows: int | None = None
    num_val_records: int = 0
    num_val_dropped: int = 0
    packing_efficiency: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (for logging)."""
        return asdict(self)


@dataclass
class InstructData:
    """Prepared instruction data: training and validation splits and what preparation did."""

    train: InstructSplit
    val: InstructSplit
    stats: InstructStats


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) record indices, each in file order; val a seeded random ``val_fraction`` of ``n``."""
    n_val = 0
    if val_fraction > 0 and n >= 2:
        n_val = min(n - 1, max(1, round(n * val_fraction)))
    perm = np.random.default_rng([seed, 0]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


# ----------------------------------------------------------------------------------------------------------------
# Why a file leaves nothing to train on (shared with memfit.data.preference)

SKIP_CAUSES = ("system", "template", "truncated")
"""Why a valid record yields no sample: the template refuses its system role (it renders once its system messages
are dropped), the template cannot render it otherwise, or truncation to ``max_seq_len + 1`` tokens leaves it
nothing to train on."""


def unrendered_cause(
    messages: Sequence[dict[str, str]], render: Callable[[list[dict[str, str]]], Any]
) -> str:
    """Why a template could not render a record: ``"system"`` when it renders once its system messages are dropped
    (the template refuses the system role, as Gemma's does), else ``"template"``.

    Args:
        messages: The record's messages that may hold system messages (a preference pair's prompt).
        render: Renders the record with these messages in their place; raises ``DataError`` when it cannot.
    """
    rest = [m for m in messages if m["role"] != "system"]
    if len(rest) == len(messages):
        return "template"
    try:
        render(rest)
    except DataError:
        return "template"
    return "system"


def no_training_error(
    path: Path,
    unit: str,
    *,
    num_malformed: int,
    num_val: int,
    train_causes: Sequence[tuple[str, str | None]],
    template: Template,
    truncated: str,
) -> DataError:
    """The error for a file that leaves no training sample (or pair), its counts adding up to the records read.

    Args:
        path: The data file.
        unit: What a record would have given, e.g. ``"training sample"``.
        num_malformed: Malformed records skipped at loading.
        num_val: Valid records held out for validation.
        train_causes: Per valid record of the training split (none was kept): its cause (:data:`SKIP_CAUSES`),
            and the template's error where it could not render the record (the first of cause ``"template"`` is
            quoted).
        template: The template the records were rendered with.
        truncated: What a record dropped by truncation is, with what lengthens the samples, e.g. ``"with nothing
            to train on after truncation to 65 tokens (raise seq_len)"``.
    """
    name = template_name(template)
    first_unrendered = next((error for cause, error in train_causes if cause == "template"), None)
    why = {
        "system": f"skipped because template {name} refuses the system role (drop the records' system messages, "
        "or set data.template=chatml, which takes a system message and works with any tokenizer)",
        "template": f"skipped because template {name} cannot render their roles (first: {first_unrendered})",
        "truncated": truncated,
    }
    counts = [f"{num_malformed} malformed (skipped)"] if num_malformed else []
    counts += [f"{num_val} held out for validation", f"the other {len(train_causes)} for training"]
    tally = collections.Counter(cause for cause, _ in train_causes)
    causes = [f"{tally[cause]} {why[cause]}" for cause in SKIP_CAUSES if tally[cause]]
    read = num_malformed + num_val + len(train_causes)
    return DataError(
        f"'{path}' leaves no {unit}: of {read} record(s) read, {', '.join(counts)}"
        + (f": {', '.join(causes)}" if causes else "")
    )


def _pack(
    samples: list[tuple[np.ndarray, np.ndarray]], max_seq_len: int, pad_id: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], int]:
    """Pack (input, target) pairs greedily, in a seeded shuffled order, into rows of exactly ``max_seq_len``.

    A sample is never split: when the next one does not fit, the row is closed and padded (inputs ``pad_id``,
    targets :data:`IGNORE_INDEX`, doc id one past the row's last sample, so padding attends only to itself).

    Returns:
        ``(inputs, targets, doc_ids, real_tokens)``: per row (max_seq_len,) arrays, and the non-pad positions.
    """
    rows_in: list[np.ndarray] = []
    rows_tg: list[np.ndarray] = []
    rows_doc: list[np.ndarray] = []
    cur: list[tuple[np.ndarray, np.ndarray]] = []
    used = real = 0

    def close() -> None:
        pad = max_seq_len - used
        inp = [x for x, _ in cur] + [np.full(pad, pad_id, np.int32)]
        tgt = [y for _, y in cur] + [np.full(pad, IGNORE_INDEX, np.int32)]
        doc = [np.full(len(x), d, np.int32) for d, (x, _) in enumerate(cur)] + [
            np.full(pad, len(cur), np.int32)
        ]
        rows_in.append(np.concatenate(inp))
        rows_tg.append(np.concatenate(tgt))
        rows_doc.append(np.concatenate(doc))

    for k in rng.permutation(len(samples)):
        x, y = samples[k]
        if used + len(x) > max_seq_len:
            close()
            cur, used = [], 0
        cur.append((x, y))
        used += len(x)
        real += len(x)
    if cur:
        close()
    return rows_in, rows_tg, rows_doc, real


def prepare_instruct(
    path: str | Path,
    fmt: str,
    template: Template,
    tokenizer: Any,
    *,
    max_seq_len: int,
    val_fraction: float,
    seed: int,
    train_on_prompt: bool = False,
    packing: bool = False,
    skip_malformed: bool = False,
    column_map: dict[str, str] | None = None,
    length_fix: str = "raise max_seq_len",
) -> InstructData:
    """Load, split, encode, truncate and (optionally) pack an instruction or chat data file.

    Args:
        path: The data file (see :func:`load_conversations`).
        fmt: One of :data:`memfit.data_formats.INSTRUCT_FORMATS`.
        template: One of :data:`TEMPLATES`, or a checkpoint's :class:`~memfit.data.chat_template.ChatTemplate`
            (see :func:`resolve_template`).
        tokenizer: A ``memfit.tokenizer.Tokenizer``.
        max_seq_len: Model inputs per sample ``T``; samples hold at most ``T + 1`` tokens (longer ones are cut
            to that and counted in ``num_truncated``); packed rows hold exactly ``T`` inputs.
        val_fraction: Fraction of the records held out for validation, in ``[0, 1)``, chosen at random with
            ``seed``; at least one record when > 0 and there are two or more records (and never all of them); 0
            gives an empty split.
        seed: Seeds the split (``default_rng([seed, 0])``) and the packing order (``default_rng([seed, 1,
            split])``, split 0 train, 1 val).
        train_on_prompt: Train on prompt tokens too (see :func:`encode_conversation`).
        packing: Pack the samples of each split into rows of exactly ``max_seq_len`` inputs with ``doc_ids``.
        skip_malformed: Skip and count malformed records, and records whose roles the template cannot render,
            instead of raising.
        column_map: Field renames (see :func:`load_conversations`).
        length_fix: What the error for a file that truncation leaves nothing to train on tells the user to do
            (the caller knows which of its settings gives ``max_seq_len``, e.g. ``raise seq_len``).

    Returns:
        The splits and their :class:`InstructStats`.

    Raises:
        DataError: Bad arguments (each named); the file or a record is bad (see :func:`load_conversations`); the
            tokenizer cannot serve the template, or a chat template cannot be rendered (naming its file); a
            record's roles do not fit the template (unless ``skip_malformed``); or no training sample is left
            (:func:`no_training_error`: the counts add up to the records read, each cause named with its fix).
    """
    path = Path(path)
    if fmt not in INSTRUCT_FORMATS:  # "preference" is a data format too, read by memfit.data.preference
        raise DataError(
            f"prepare_instruct reads the formats {', '.join(INSTRUCT_FORMATS)}, not {fmt!r}"
            + (
                " (preference pairs: memfit.data.preference.prepare_preference)"
                if fmt == "preference"
                else ""
            )
        )
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise DataError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    specials_for(template, tokenizer)  # a tokenizer/template mismatch fails here, not once per record
    records, num_malformed = load_records(path, fmt, column_map, skip_malformed)

    def encode(messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
        return encode_conversation(messages, template, tokenizer, train_on_prompt=train_on_prompt)

    # ---- encode and truncate
    samples: list[tuple[np.ndarray, np.ndarray] | None] = []
    num_truncated = num_dropped = num_tokens = num_label_tokens = 0
    causes: dict[int, str] = {}  # record -> why it gave no sample (SKIP_CAUSES)
    template_errors: dict[int, str] = {}  # record -> why the template cannot render it
    for rec in records:
        try:
            ids, labels = encode(rec.messages)
        except DataError as exc:
            message = f"{rec.where(path)}: {exc}"
            if not skip_malformed:
                raise DataError(f"{message} (set data.skip_malformed to skip such records)") from None
            template_errors[len(samples)] = message
            causes[len(samples)] = unrendered_cause(rec.messages, encode)
            samples.append(None)
            continue
        if len(ids) > max_seq_len + 1:
            ids, labels = ids[: max_seq_len + 1], labels[: max_seq_len + 1]
            num_truncated += 1
        trained = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
        if trained == 0:
            num_dropped += 1
            causes[len(samples)] = "truncated"
            samples.append(None)
            continue
        num_tokens += len(ids) - 1
        num_label_tokens += trained
        samples.append((np.asarray(ids[:-1], np.int32), np.asarray(labels[1:], np.int32)))
    if template_errors:
        log.warning(
            "skipped %d record(s) of '%s' that template %s cannot render; first: %s",
            len(template_errors),
            path,
            template_name(template),
            "; ".join(list(template_errors.values())[:3]),
        )

    # ---- split (by record, so the split does not depend on the template or max_seq_len)
    train_idx, val_idx = split_indices(len(records), val_fraction, seed)
    train_samples = [s for i in train_idx if (s := samples[i]) is not None]
    val_samples = [s for i in val_idx if (s := samples[i]) is not None]
    if not train_samples:
        raise no_training_error(
            path,
            "training sample",
            num_malformed=num_malformed,
            num_val=len(val_idx),
            train_causes=[(causes[j], template_errors.get(j)) for j in map(int, train_idx)],
            template=template,
            truncated=f"with nothing to train on after truncation to {max_seq_len + 1} tokens ({length_fix})",
        )

    # ---- build the splits, packing if asked
    pad_id = pad_token_id(tokenizer)
    stats = InstructStats(
        num_records=len(records),
        num_skipped=num_malformed + len(template_errors),
        num_truncated=num_truncated,
        num_dropped=num_dropped,
        num_train_samples=len(train_samples),
        num_val_samples=len(val_samples),
        num_val_records=len(val_idx),
        num_val_dropped=sum(1 for i in val_idx if causes.get(int(i)) == "truncated"),
        num_tokens=num_tokens,
        num_label_tokens=num_label_tokens,
    )
    splits = []
    real_total = rows_total = 0
    for split, split_samples in enumerate((train_samples, val_samples)):
        if not packing:
            splits.append(
                InstructSplit([x for x, _ in split_samples], [y for _, y in split_samples], None, pad_id)
            )
            continue
        rng = np.random.default_rng([seed, 1, split])
        rows_in, rows_tg, rows_doc, real = _pack(split_samples, max_seq_len, pad_id, rng)
        splits.append(InstructSplit(rows_in, rows_tg, rows_doc, pad_id, num_tokens=real))
        real_total += real
        rows_total += len(rows_in)
    if packing:
        stats.num_train_rows, stats.num_val_rows = len(splits[0]), len(splits[1])
        stats.packing_efficiency = real_total / (rows_total * max_seq_len)
    log.info(
        "instruction data '%s' (%s, template %s): %s", path, fmt, template_name(template), stats.as_dict()
    )
    return InstructData(train=splits[0], val=splits[1], stats=stats)
