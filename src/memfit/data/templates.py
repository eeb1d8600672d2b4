"""memfit's built-in prompt templates (:data:`memfit.data_formats.TEMPLATES`: ``alpaca``, ``llama2-chat``,
``llama3-chat``, ``chatml``) and a checkpoint's own chat template, rendered into token ids with exact loss masks.

:func:`resolve_template` names the template a run uses; :func:`encode_conversation` renders a conversation (a list of
``{"role", "content"}`` messages) *segment by segment*: each piece of text is tokenized on its own and special
tokens are inserted as ids, so the boundary between prompt and reply is a token boundary and the loss mask is exact
(labels are the ids on assistant replies and the end-of-turn token(s) after each, :data:`IGNORE_INDEX` elsewhere);
:func:`encode_prompt` renders a prompt for generation and :func:`stop_token_ids` says where generation stops;
:func:`builtin_template_source` gives a built-in template as the Jinja an export writes for transformers. Split from
:mod:`memfit.data.instruct`, which loads, splits, truncates and packs what this renders.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from memfit.data.chat_template import ROLES, ChatTemplate
from memfit.data_formats import DEFAULT_TEMPLATE, TEMPLATES
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
