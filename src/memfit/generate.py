"""Autoregressive sampling from a trained model: temperature, top-k, greedy at temperature 0.

Each new token re-runs the model over the (cropped) context: there is no KV cache, which keeps the model file
architecture-only and is fast enough for the small models memfit samples from at the end of a run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from memfit import checkpoint as ckpt_io
from memfit.errors import CheckpointError
from memfit.models.llama import Llama, build_llama


@torch.no_grad()
def generate(
    model: Llama,
    ids: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    eos_id: int | None = None,
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
        eos_id: stop after this token is produced.
        generator: the random source (seed it for reproducible samples).
        autocast_dtype: run the forward under autocast of this dtype.
        vocab_limit: sample only ids below this (the tokenizer's size when the embedding is padded beyond it).

    Returns:
        ``(1, T0 + n)`` int64: the prompt followed by the ``n <= max_new_tokens`` new tokens.
    """
    max_len = model.config.max_seq_len
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
        if eos_id is not None and int(nxt) == eos_id:
            break
    return ids


def generate_text(
    model: Llama,
    tokenizer,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int = 0,
    dtype: str = "fp32",
) -> str:
    """Encode ``prompt``, sample a continuation and decode it.

    Returns:
        ``prompt`` exactly as given, followed by the generated text (special tokens left out). An empty prompt
        starts from BOS.
    """
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt)
    if not ids:
        ids = [tokenizer.bos_id if tokenizer.bos_id is not None else 0]
    generator = torch.Generator(device=device).manual_seed(seed)
    out = generate(
        model,
        torch.tensor([ids], dtype=torch.long, device=device),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        eos_id=tokenizer.eos_id,
        generator=generator,
        autocast_dtype=torch.bfloat16 if dtype == "bf16_mixed" else None,
        vocab_limit=tokenizer.vocab_size,
    )
    # special tokens (BOS, EOS, <unk>, ...) are not text: leave them out of what is shown
    specials = set(tokenizer.special_tokens.values())
    new_ids = [i for i in out[0, len(ids) :].tolist() if i not in specials]
    return prompt + tokenizer.decode(new_ids)


def load_for_generation(path: str | Path, device: str | torch.device = "cpu") -> tuple[Llama, object]:
    """Load model and tokenizer from a checkpoint directory or a run directory (its newest checkpoint).

    Raises:
        CheckpointError: nothing loadable is there, or a file is truncated.
    """
    from memfit.tokenizer import load_tokenizer

    ckpt = ckpt_io.resolve_checkpoint(path)
    mcfg = ckpt_io.read_model_config(ckpt)
    state = ckpt_io.read_trainer_state(ckpt)
    ckpt_io.check_files(ckpt, state, need_optimizer=False)
    dtype = {"bf16": torch.bfloat16}.get(state.get("config", {}).get("dtype"), torch.float32)
    if not (ckpt / "tokenizer").is_dir():
        raise CheckpointError(f"checkpoint '{ckpt}' has no tokenizer/ directory; it is incomplete")
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    model = build_llama(mcfg, device=device, dtype=dtype, init=False)
    ckpt_io.load_weights(ckpt, model)
    model.eval()
    return model, tokenizer
