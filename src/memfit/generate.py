"""Autoregressive sampling from a trained model: temperature, top-k, greedy at temperature 0. ``memfit generate``
loads the model with :func:`memfit.build.load_for_generation` and samples with :func:`generate_text`.

The model reads a prompt as it read its training data (:func:`prompt_ids`): a plain prompt as the start of a
document (``[BOS] prompt`` where the tokenizer puts BOS before text, as ``memfit prepare`` does), a templated one as
fine-tuning rendered it.

Each new token re-runs the model over the (cropped) context: there is no KV cache, which keeps the model file
architecture-only and is fast enough for the small models memfit samples from at the end of a run.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Collection

import torch

from memfit.data.templates import encode_prompt, stop_token_ids
from memfit.models.decoder import Decoder


@torch.no_grad()
def generate(
    model: Decoder,
    ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    eos_id: int | Collection[int] | None = None,
    generator: torch.Generator | None = None,
    autocast_dtype: torch.dtype | None = None,
    vocab_limit: int | None = None,
) -> torch.Tensor:
    """Append up to ``max_new_tokens`` sampled tokens to ``ids``.

    Args:
        model: returns logits ``(B, T, vocab_size)`` for ids ``(B, T)``.
        ids: the prompt, ``(1, T0)`` int64 on the model's device.
        max_new_tokens: how many tokens to add at most.
        temperature: softmax temperature; 0 picks the most likely token (greedy).
        top_k: sample among the ``top_k`` most likely tokens; 0 means all.
        eos_id: stop after this token (or any of these tokens) is produced.
        generator: the random source (seed it for reproducible samples).
        autocast_dtype: run the forward under autocast of this dtype.
        vocab_limit: sample only ids below this (the tokenizer's size when the embedding is padded beyond it).

    Returns:
        ``(1, T0 + n)`` int64: the prompt followed by the ``n <= max_new_tokens`` new tokens.
    """
    max_len = model.config.max_seq_len
    stop = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    for _ in range(max_new_tokens):
        context = ids[:, -max_len:]  # (1, <= max_seq_len)
        ctx = (
            torch.autocast(ids.device.type, dtype=autocast_dtype)
            if autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            logits = model(context)[:, -1, :vocab_limit].float()  # (1, V) or (1, vocab_limit)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)  # (1, 1)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (1, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)  # (1, 1)
        ids = torch.cat([ids, nxt], dim=1)
        if int(nxt) in stop:
            break
    return ids


def prompt_ids(tokenizer, prompt: str, template: str | None = None) -> list[int]:
    """The ids the model is fed for ``prompt``.

    Args:
        tokenizer: the model's tokenizer.
        prompt: text to continue, or with ``template`` the user's message.
        template: a prompt template of :mod:`memfit.data.instruct`, or ``None`` for plain continuation.

    Returns:
        Without a template, the first ids of a training document with this text as ``memfit prepare`` writes it:
        ``[BOS] + encode(prompt)`` where the tokenizer puts BOS before text (:attr:`Tokenizer.add_bos`), else
        ``encode(prompt)``; an empty prompt so is ``[EOS]`` (what precedes a document in such data), or ``[BOS]``
        or ``[0]`` where there is none. With a template, the rendering of one user turn up to the reply, as in
        fine-tuning (:func:`memfit.data.templates.encode_prompt`): the template writes its own BOS, once.
    """
    if template is not None:
        return encode_prompt([{"role": "user", "content": prompt}], template, tokenizer)
    ids = tokenizer.encode(prompt, bos=tokenizer.add_bos)
    if not ids:
        start = tokenizer.eos_id if tokenizer.eos_id is not None else tokenizer.bos_id
        ids = [start if start is not None else 0]
    return ids


def generate_text(
    model: Decoder,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int = 0,
    dtype: str = "fp32",
    template: str | None = None,
) -> str:
    """Encode ``prompt``, sample a continuation and decode it.

    Args:
        model: the model.
        tokenizer: its tokenizer.
        prompt: text to continue, or with ``template`` the user's message.
        max_new_tokens, temperature, top_k, seed: see :func:`generate`.
        dtype: the dtype policy (``bf16_mixed`` samples under bf16 autocast).
        template: a prompt template of :mod:`memfit.data.instruct` (``alpaca``, ``llama3-chat``, ...): the prompt
            becomes one user turn rendered as in fine-tuning, and sampling stops at the template's end-of-turn
            tokens. ``None``: plain continuation.

    Returns:
        Without a template: ``prompt`` exactly as given, followed by the generated text. With one: the reply only.
        Special tokens are left out. The model is fed :func:`prompt_ids`.
    """
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, prompt, template)
    stop: int | list[int] | None = (
        stop_token_ids(template, tokenizer) if template is not None else tokenizer.eos_id
    )
    if len(ids) > model.config.max_seq_len:
        warnings.warn(
            f"the prompt has {len(ids)} tokens, more than the model's context of {model.config.max_seq_len}: "
            f"only its last {model.config.max_seq_len} tokens are seen",
            stacklevel=2,
        )
    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(
        model,
        torch.tensor([ids], dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_id=stop,
        generator=generator,
        autocast_dtype=torch.bfloat16 if dtype == "bf16_mixed" else None,
        vocab_limit=tokenizer.vocab_size,
    )
    # special tokens (BOS, EOS, <unk>, ...) are not text: leave them out of what is shown
    specials = set(tokenizer.special_tokens.values())
    new_ids = [i for i in out[0, len(ids) :].tolist() if i not in specials]
    if template is not None:
        return tokenizer.decode(new_ids)
    # decode prompt and continuation together: SentencePiece drops the space that starts a continuation decoded
    # on its own ("llama?" + "writing" instead of "llama? writing")
    shown = [i for i in ids if i not in specials]
    full, head = tokenizer.decode(shown + new_ids), tokenizer.decode(shown)
    return prompt + (full[len(head) :] if full.startswith(head) else tokenizer.decode(new_ids))
