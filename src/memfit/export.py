"""``memfit export``: write a memfit run (or any readable checkpoint) as a Hugging Face directory.

It sits above :mod:`memfit.convert`: a full model goes through :func:`memfit.convert.export_checkpoint`; a LoRA run
is merged and written with :func:`memfit.convert.hf.export_hf`, or its adapter alone with
:func:`memfit.convert.peft_adapter.save_peft_adapter`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit.build import load_for_generation, run_template
from memfit.checkpoint import check_files, read_trainer_state, resolve_checkpoint
from memfit.config import TrainConfig, config_from_dict
from memfit.convert import detect_format, export_checkpoint
from memfit.convert.hf import DEFAULT_MAX_SHARD_SIZE, check_out_dir, export_hf
from memfit.convert.peft_adapter import save_peft_adapter
from memfit.data.chat_template import ChatTemplate
from memfit.data.templates import Template, builtin_template_source, template_label
from memfit.errors import CheckpointError
from memfit.models.peft import merge_lora
from memfit.tokenizer import ChatTemplateSource, load_tokenizer, read_chat_template_source

__all__ = ["EXPORT_DTYPES", "Exported", "export_run"]

EXPORT_DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Exported:
    """What ``memfit export`` wrote.

    Attributes:
        path: The new directory.
        chat_template: Which chat template the directory carries and where it came from, for the summary line
            (``chatml (the run's data.template): memfit's built-in, written as Jinja in place of the
            checkpoint's own``, ``auto: the checkpoint's chat template '<dir>/chat_template.jinja'``, ...).
    """

    path: Path
    chat_template: str


def export_run(
    src: str | Path,
    out_dir: str | Path,
    *,
    adapter_only: bool = False,
    dtype: str = "auto",
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Exported:
    """``memfit export``: write a memfit run (or any readable checkpoint) as a Hugging Face directory.

    A full fine-tune or pretraining run, a Hugging Face or a Meta checkpoint goes through
    :func:`memfit.convert.export_checkpoint`. A LoRA run is loaded as its base (``checkpoint_dir``) plus the trained
    LoRA weights, then merged into the base (``W + (alpha / r) B A``) and exported as a plain
    ``LlamaForCausalLM``; with ``adapter_only`` only the LoRA weights are written, in Hugging Face PEFT's adapter
    format (:func:`memfit.convert.peft_adapter.save_peft_adapter`).

    The directory's chat template (``chat_template.jinja``, and ``chat_template`` in ``tokenizer_config.json``) is
    the one the run rendered its records with, so that transformers' ``apply_chat_template`` gives the prompt
    format the model was trained on: a built-in ``data.template`` as its Jinja form
    (:func:`memfit.data.templates.builtin_template_source`), in place of the checkpoint's own; the checkpoint's own
    template unchanged under ``data.template=auto``; the tokenizer's own (if any) for a run on a text corpus and
    for a Hugging Face or Meta checkpoint.

    Args:
        src: a memfit run or checkpoint directory, or a Hugging Face / Meta checkpoint directory.
        out_dir: the new directory; it must not exist or be empty (checked before anything is read).
        adapter_only: LoRA runs only: write the adapter, not merged weights.
        dtype: ``auto`` (keep the weights' dtype), ``fp32`` or ``bf16``.
        max_shard_size: bytes per safetensors shard.

    Returns:
        The directory and which chat template it carries (:class:`Exported`).

    Raises:
        CheckpointError: ``out_dir`` is not empty; ``src`` is unreadable; ``adapter_only`` for a run without LoRA;
            or a LLaMA-Adapter run, whose prompts and gates have no Hugging Face ``LlamaForCausalLM`` equivalent.
    """

    out = Path(out_dir)
    check_out_dir(out)
    torch_dtype = EXPORT_DTYPES[dtype]
    cfg = None
    if detect_format(src) == "memfit":
        ckpt = resolve_checkpoint(src)
        state = read_trainer_state(ckpt)
        check_files(ckpt, state, need_optimizer=False)  # whole, before its tokenizer and template are read
        cfg = config_from_dict(state.get("config", {}), check=False)
    method = cfg.method if cfg is not None else "full"
    if method == "adapter":
        raise CheckpointError(
            f"'{src}' is a LLaMA-Adapter run: its learned prompts and gates have no place in a Hugging Face "
            f"LlamaForCausalLM, so it cannot be exported. Sample from it with memfit generate --checkpoint {src}, "
            f"or fine-tune with method=lora (mergeable) or method=full for an exportable model"
        )
    if method == "full":
        if adapter_only:
            raise CheckpointError(f"--adapter-only applies to LoRA runs; '{src}' holds a full model")
        if cfg is None:  # a Hugging Face or Meta checkpoint: its own template, as it is
            own = read_chat_template_source(Path(src)) if Path(src).is_dir() else None
            source = None
            label = f"the checkpoint's own '{own.path}'" if own else "none (the checkpoint has none)"
        else:
            tokenizer = load_tokenizer(ckpt / "tokenizer")
            source, label = _carried_template(cfg, tokenizer, run_template(cfg, tokenizer))
        path = export_checkpoint(
            src, out, dtype=torch_dtype, max_shard_size=max_shard_size, chat_template=source
        )
        return Exported(path, label)

    model, tokenizer, template = load_for_generation(src)
    if adapter_only:
        base = cfg.checkpoint_dir or ""
        path = save_peft_adapter(model, out, base_model_name_or_path=str(base))
        return Exported(path, "none (an adapter is written without a tokenizer)")
    merge_lora(model)
    source, label = _carried_template(cfg, tokenizer, template)
    path = export_hf(
        model,
        out,
        tokenizer=tokenizer,
        dtype=torch_dtype,
        max_shard_size=max_shard_size,
        chat_template=source,
    )
    return Exported(path, label)


def _carried_template(
    cfg: TrainConfig, tokenizer: Any, template: Template | None
) -> tuple[ChatTemplateSource | None, str]:
    """The chat template an export of a run carries (``None``: the tokenizer's own, as it is) and its label.

    Args:
        cfg: The run's config.
        tokenizer: The run's tokenizer (its ``chat_template`` is the checkpoint's own, where it has one).
        template: What the run rendered its records with (:func:`memfit.build.run_template`; ``None`` for a text
            corpus).
    """
    own = tokenizer.chat_template
    if template is None:
        kept = f"the checkpoint's own '{own.path}'" if own is not None else "none (the tokenizer has none)"
        return None, f"{kept}; the run trained on a text corpus"
    if isinstance(template, ChatTemplate):
        return template.source, f"{template_label(cfg.data.template, template)}, as the run trained with it"
    replaced = " in place of the checkpoint's own" if own is not None else ""
    label = f"{template_label(cfg.data.template, template)}: memfit's built-in template, written as Jinja{replaced}"
    return builtin_template_source(template, tokenizer), label
