"""A checkpoint's own chat template: rendered as transformers renders it, with the replies found for the loss mask.

Hugging Face checkpoints ship their chat template as Jinja (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``; :attr:`memfit.tokenizer.Tokenizer.chat_template` holds it). :class:`ChatTemplate`
renders it the way transformers' ``apply_chat_template`` does (``transformers/utils/chat_template_utils.py``): a
``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and the ``{% generation %}`` tag, the globals ``raise_exception``, ``strftime_now``, ``dict`` and
``namespace``, a ``tojson`` filter that does not escape HTML, and as variables ``messages``,
``add_generation_prompt``, ``tools`` and ``documents`` (both ``None``) and the tokenizer's named special tokens
(``bos_token``, ``eos_token``, ...). The rendered text is tokenized with special tokens' texts read as their ids and
no BOS/EOS added (:meth:`memfit.tokenizer.Tokenizer.encode_markup`), as ``apply_chat_template(..., tokenize=True)``
does, so the ids equal transformers'.

The loss mask comes from the rendering itself. For assistant message ``i`` of a conversation ``m`` rendered whole
as ``F``:

- its reply starts where ``render(m[:i], add_generation_prompt=True)`` ends, which must be a prefix of ``F`` (the
  *prefix property*; a template without it is refused, naming its file);
- it ends where ``render(m[:i + 1])`` stops agreeing with ``F``: at the end of that rendering when it is a prefix of
  ``F`` (ChatML, Llama 3, Gemma: the reply and the end-of-turn that closes it, ``<|im_end|>\\n``, ``<|eot_id|>``,
  ``<end_of_turn>\\n``), or before what the template writes only at the end of a conversation (Phi-3's
  ``eos_token`` after the last turn), which the last reply then keeps.

A token is trained when it ends inside a reply's span (a token that runs into a reply from its header is trained,
as transformers' assistant mask does; one that runs past the span's end is not).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from memfit.errors import DataError, TokenizerError
from memfit.memory.techniques import IGNORE_INDEX
from memfit.tokenizer import ChatTemplateSource

ROLES = ("system", "user", "assistant")

# A probe conversation: rendered once when a template is loaded (it must render and have the prefix property) and
# to find the text that closes a reply (its first special token stops generation).
_PROBE = (
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
)


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` tag (marks assistant text for its own mask); here
    it renders its body, as transformers does when it is not tracking."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed attributes, as transformers' ``TemplateNamespace``."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick: namespace(self=...))
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type's other attributes (transformers'
    ``TemplateDict``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys=False
) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _messages(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """Plain ``{"role", "content"}`` dicts; an Alpaca/Dolly ``input`` follows the instruction after a blank line
    (as memfit's built-in chat templates put it)."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"message {i} must be {{'role': one of {', '.join(ROLES)}, 'content': str}}, got {m!r:.120}"
            )
        extra = m.get("input")
        out.append({"role": m["role"], "content": m["content"] + (f"\n\n{extra}" if extra else "")})
    return out


class ChatTemplate:
    """A checkpoint's own Jinja chat template, compiled in a sandbox and rendered as transformers renders it.

    Args:
        source: The template and its named special tokens (:attr:`memfit.tokenizer.Tokenizer.chat_template`).

    Attributes:
        path: The file the template was read from.
        tokens: The named special tokens the template sees (``bos_token`` -> ``"<|begin_of_text|>"``, ...).

    Raises:
        DataError: The template is not valid Jinja (the message names the file and the line).
    """

    def __init__(self, source: ChatTemplateSource) -> None:
        self.source = source
        self.path = source.path
        self.tokens = dict(source.tokens)
        try:
            self._template = _environment().from_string(source.text)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise DataError(
                f"the chat template '{self.path}' is not valid Jinja: {exc.message} (line {exc.lineno}); fix the "
                "file or name a built-in template (data.template / --template)"
            ) from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.path!r})"

    @property
    def label(self) -> str:
        """Which template this is and where it came from, for the banner."""
        return f"the checkpoint's chat template '{self.path}'"

    # ---- rendering

    def render(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool, now: datetime | None = None
    ) -> str:
        """The text transformers' ``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``
        gives.

        Args:
            messages: ``[{"role": "system" | "user" | "assistant", "content": str}, ...]``.
            add_generation_prompt: Append the header that opens the assistant's reply.
            now: What ``strftime_now`` formats (the same instant across the renderings of one conversation, so
                that a date in the system header cannot differ between them); ``None``: now.

        Returns:
            The rendered text.

        Raises:
            DataError: The template fails on this conversation (``raise_exception``, a role it does not take, an
                error in the template); the message names the file.
        """
        moment = now or datetime.now()
        try:
            return self._template.render(
                messages=_messages(messages),
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                strftime_now=moment.strftime,
                **self.tokens,
            )
        except DataError:
            raise
        except Exception as exc:  # a template is code: any error of its own is its refusal of this input
            roles = ", ".join(m.get("role", "?") for m in messages if isinstance(m, dict))
            raise DataError(
                f"the chat template '{self.path}' cannot render this conversation (roles {roles}): "
                f"{type(exc).__name__ + ': ' if not isinstance(exc, jinja2.TemplateError) else ''}{exc}"
            ) from None

    def check(self, tokenizer: Any) -> None:
        """Refuse a template memfit cannot train or sample with, before any record is read.

        Renders a probe exchange (a user question and an assistant reply) and encodes it: the template must
        render, have the prefix property, and the tokenizer must read its rendering.

        Raises:
            DataError: It cannot; the message names the file and why.
        """
        self.encode(list(_PROBE), tokenizer)
        self.encode_prompt(list(_PROBE[:1]), tokenizer)

    # ---- encoding

    def _markup(self, tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        try:
            return tokenizer.encode_markup(text)
        except TokenizerError as exc:
            raise DataError(f"the chat template '{self.path}' cannot be used: {exc}") from None

    def reply_spans(
        self, messages: Sequence[dict[str, str]], now: datetime | None = None
    ) -> tuple[str, list]:
        """The whole rendering of a conversation and the ``(start, end)`` character span of each assistant reply.

        Args:
            messages: The conversation.
            now: See :meth:`render`.

        Returns:
            ``(text, spans)``.

        Raises:
            DataError: As :meth:`render`; or the template lacks the prefix property (a reply's generation prompt is
                not where the whole rendering has it, or the reply is not in it).
        """
        now = now or datetime.now()
        text = self.render(messages, add_generation_prompt=False, now=now)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True, now=now)
            if not text.startswith(prompt):
                raise DataError(
                    f"the chat template '{self.path}' renders the conversation up to assistant message {i} with "
                    "add_generation_prompt=True as text that does not begin the whole conversation's rendering, "
                    "so memfit cannot tell where the reply starts (the template lacks the prefix property); name "
                    "a built-in template (data.template)"
                )
            upto = self.render(messages[: i + 1], add_generation_prompt=False, now=now)
            end = len(os.path.commonprefix([upto, text]))
            if end <= len(prompt):
                raise DataError(
                    f"the chat template '{self.path}' writes nothing for assistant message {i} after its "
                    "generation prompt, so there is no reply to train on; name a built-in template (data.template)"
                )
            spans.append((len(prompt), end))
        return text, spans

    def encode(
        self, messages: Sequence[dict[str, str]], tokenizer: Any, train_on_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """Render a conversation into token ids and loss labels (see the module's description).

        Messages after the last assistant reply carry no target and are not rendered.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` with at least one assistant reply.
            tokenizer: A ``memfit.tokenizer.Tokenizer`` that reads rendered text (``encode_markup``).
            train_on_prompt: Train on every token.

        Returns:
            ``(ids, labels)``: ``ids`` equal transformers' ``apply_chat_template(messages, tokenize=True)``;
            ``labels[k]`` is ``ids[k]`` where token k is in a reply (or everywhere with ``train_on_prompt``),
            else :data:`IGNORE_INDEX`.

        Raises:
            DataError: As :meth:`reply_spans`; no assistant reply; the tokenizer cannot read the rendering.
        """
        messages = _messages(messages)
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            raise DataError("the conversation has no assistant reply (nothing to train on)")
        messages = messages[: last + 1]
        text, spans = self.reply_spans(messages)
        ids, offsets = self._markup(tokenizer, text)
        if train_on_prompt:
            return list(ids), list(ids)
        labels = [IGNORE_INDEX] * len(ids)
        s = 0
        for k, (_, token_end) in enumerate(offsets):  # tokens and spans both in order: one pass
            while s < len(spans) and token_end > spans[s][1]:
                s += 1
            if s == len(spans):
                break
            if token_end > spans[s][0]:
                labels[k] = ids[k]
        return list(ids), labels

    def encode_prompt(self, messages: Sequence[dict[str, str]], tokenizer: Any) -> list[int]:
        """The ids of a conversation that ends with a user message, with the generation prompt (for sampling).

        Raises:
            DataError: As :meth:`render`, or the last message is not the user's.
        """
        messages = _messages(messages)
        if not messages or messages[-1]["role"] != "user":
            raise DataError("a generation prompt ends with a user message")
        return self._markup(tokenizer, self.render(messages, add_generation_prompt=True))[0]

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        """Ids that end a reply in generation: EOS (when the tokenizer has one) and the first special token the
        template closes a reply with (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``)."""
        out = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        now = datetime.now()
        prompt = self.render(list(_PROBE[:1]), add_generation_prompt=True, now=now)
        whole = self.render(list(_PROBE), add_generation_prompt=False, now=now)
        reply = _PROBE[1]["content"]
        after = whole[len(prompt) :] if whole.startswith(prompt) else ""
        at = after.find(reply)
        if at >= 0:
            specials = set(tokenizer.special_tokens.values())
            closing = self._markup(tokenizer, after[at + len(reply) :])[0]
            first = next((i for i in closing if i in specials), None)
            if first is not None and first not in out:
                out.append(first)
        return out
