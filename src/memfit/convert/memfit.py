"""memfit run checkpoints as a source of pretrained weights.

A checkpoint written by memfit holds ``model.safetensors`` + ``model_config.json``, or, for a sharded run, ``dcp/``
(consolidated into one full state dict on this host); a run directory holding ``checkpoints/step_*/`` gives its
newest checkpoint (:func:`memfit.checkpoint.resolve_checkpoint`). LoRA/adapter checkpoints are refused: merge first.
"""

from __future__ import annotations

from pathlib import Path

from memfit.checkpoint import (
    DCP_DIR,
    WEIGHTS,
    check_files,
    is_sharded,
    missing_file,
    read_model_config,
    read_sharded_weights,
    read_trainer_state,
    resolve_checkpoint,
)
from memfit.convert.tensors import (
    Entry,
    PretrainedInfo,
    Scan,
    first_float_dtype,
    read_safetensors,
    safetensors_header,
)
from memfit.errors import CheckpointError

__all__ = ["scan_memfit"]


def scan_memfit(path: Path) -> Scan:
    """A memfit checkpoint's config, info and tensor list (a run directory: its newest checkpoint).

    A single-file checkpoint is known from its safetensors header; a sharded one (``dcp/``) is consolidated into
    one full state dict on this host here.
    """
    ckpt = resolve_checkpoint(path)
    weights = ckpt / WEIGHTS
    if is_sharded(ckpt) and not weights.is_file():
        return _scan_sharded_memfit(ckpt)
    if not weights.is_file():
        if (ckpt / "adapter.safetensors").is_file():
            raise CheckpointError(
                f"checkpoint '{ckpt}' holds LoRA/adapter weights only (adapter.safetensors); its base model is the "
                f"run's checkpoint_dir. Merge the adapters into the base before exporting full weights"
            )
        raise missing_file(ckpt, WEIGHTS)
    # every memfit checkpoint has its trainer state: it holds the byte sizes that catch a truncated file
    check_files(ckpt, read_trainer_state(ckpt), need_optimizer=False)
    config = read_model_config(ckpt)
    entries = [Entry(n, s, d, weights) for n, (s, d) in safetensors_header(weights).items()]
    info = _memfit_info(ckpt, entries)
    return Scan(config, info, entries, lambda: read_safetensors(entries), streamed=True)


def _memfit_info(ckpt: Path, entries: list[Entry]) -> PretrainedInfo:
    """What a memfit checkpoint tells besides its tensors: stored dtype and its ``tokenizer/`` directory."""
    tokenizer_dir = ckpt / "tokenizer"
    return PretrainedInfo(
        format="memfit",
        path=ckpt,
        stored_dtype=first_float_dtype(entries),
        tokenizer_path=tokenizer_dir if tokenizer_dir.is_dir() else None,
        notes=() if tokenizer_dir.is_dir() else (f"no tokenizer directory '{tokenizer_dir}'",),
    )


def _scan_sharded_memfit(ckpt: Path) -> Scan:
    """A sharded run's checkpoint (``dcp/``): consolidated into one full state dict on this host."""
    state = read_trainer_state(ckpt)
    check_files(ckpt, state, need_optimizer=False)
    if state.get("config", {}).get("method", "full") != "full":
        raise CheckpointError(
            f"checkpoint '{ckpt}' is a sharded LoRA/adapter run's; merge the adapters into the base before exporting "
            f"full weights"
        )
    config = read_model_config(ckpt)
    tensors = read_sharded_weights(ckpt)
    if config.tie_word_embeddings:  # stored once, under the embedding's name (as model.safetensors does)
        tensors.pop("lm_head.weight", None)
    where = ckpt / DCP_DIR / ".metadata"  # what names it (and what a fingerprint hashes)
    entries = [Entry(n, tuple(t.shape), t.dtype, where) for n, t in tensors.items()]
    info = _memfit_info(ckpt, entries)
    return Scan(config, info, entries, lambda: ((e, tensors[e.name]) for e in entries))
