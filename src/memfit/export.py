"""``memfit export``: write a memfit run (or any readable checkpoint) as a Hugging Face directory.

It sits above :mod:`memfit.convert`: a full model goes through :func:`memfit.convert.export_checkpoint`; a LoRA run
is merged and written with :func:`memfit.convert.hf.export_hf`, or its adapter alone with
:func:`memfit.convert.peft_adapter.save_peft_adapter`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from memfit.build import load_for_generation
from memfit.checkpoint import read_trainer_state, resolve_checkpoint
from memfit.config import config_from_dict
from memfit.convert import detect_format, export_checkpoint
from memfit.convert.hf import DEFAULT_MAX_SHARD_SIZE, check_out_dir, export_hf
from memfit.convert.peft_adapter import save_peft_adapter
from memfit.errors import CheckpointError
from memfit.models.peft import merge_lora

__all__ = ["EXPORT_DTYPES", "export_run"]

EXPORT_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


def export_run(
    src: str | Path,
    out_dir: str | Path,
    *,
    adapter_only: bool = False,
    dtype: str = "auto",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """``memfit export``: write a memfit run (or any readable checkpoint) as a Hugging Face directory.

    A full fine-tune or pretraining run, a Hugging Face or a Meta checkpoint goes through
    :func:`memfit.convert.export_checkpoint`. A LoRA run is loaded as its base (``checkpoint_dir``) plus the trained
    LoRA weights, then merged into the base (``W + (alpha / r) B A``) and exported as a plain
    ``LlamaForCausalLM``; with ``adapter_only`` only the LoRA weights are written, in Hugging Face PEFT's adapter
    format (:func:`memfit.convert.peft_adapter.save_peft_adapter`).

    Args:
        src: a memfit run or checkpoint directory, or a Hugging Face / Meta checkpoint directory.
        out_dir: the new directory; it must not exist or be empty (checked before anything is read).
        adapter_only: LoRA runs only: write the adapter, not merged weights.
        dtype: ``auto`` (keep the weights' dtype), ``fp32`` or ``bf16``.
        max_shard_size: bytes per safetensors shard.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: ``out_dir`` is not empty; ``src`` is unreadable; ``adapter_only`` for a run without LoRA;
            or a LLaMA-Adapter run, whose prompts and gates have no Hugging Face ``LlamaForCausalLM`` equivalent.
    """

    out = Path(out_dir)
    check_out_dir(out)
    torch_dtype = EXPORT_DTYPES[dtype]
    method = "full"
    if detect_format(src) == "memfit":
        state = read_trainer_state(resolve_checkpoint(src))
        method = config_from_dict(state.get("config", {}), check=False).method
    if method == "adapter":
        raise CheckpointError(
            f"'{src}' is a LLaMA-Adapter run: its learned prompts and gates have no place in a Hugging Face "
            f"LlamaForCausalLM, so it cannot be exported. Sample from it with memfit generate --checkpoint {src}, "
            f"or fine-tune with method=lora (mergeable) or method=full for an exportable model"
        )
    if method == "full":
        if adapter_only:
            raise CheckpointError(f"--adapter-only applies to LoRA runs; '{src}' holds a full model")
        return export_checkpoint(src, out, dtype=torch_dtype, max_shard_size=max_shard_size)

    model, tokenizer, _ = load_for_generation(src)
    if adapter_only:
        base = config_from_dict(state["config"], check=False).checkpoint_dir or ""
        return save_peft_adapter(model, out, base_model_name_or_path=str(base))
    merge_lora(model)
    return export_hf(model, out, tokenizer=tokenizer, dtype=torch_dtype, max_shard_size=max_shard_size)
