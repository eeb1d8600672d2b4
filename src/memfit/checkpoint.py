"""Checkpoints: safetensors weights plus the trainer state beside them, written atomically.

Layout of ``output_dir/checkpoints/step_00000250/``:

- ``model.safetensors``: the weights under Hugging Face ``LlamaForCausalLM`` names (a tied ``lm_head.weight``
  is stored once, as ``model.embed_tokens.weight``); or, for LoRA and adapter runs, ``adapter.safetensors``: only
  the trainable weights (the frozen base is re-read from the run's ``checkpoint_dir``);
- ``model_config.json``: the :class:`~memfit.models.decoder.DecoderConfig`;
- ``optimizer.pt``: ``optimizer.state_dict()`` (tensors, numbers and lists only; read with ``weights_only=True``);
- ``trainer_state.json``: step, data position, RNG states, the run config, and the byte size of every file here
  (so a truncated file is caught before it is read);
- ``tokenizer/``: the tokenizer, reloadable with :func:`memfit.tokenizer.load_tokenizer`.

A sharded run (torchrun, more than one rank) writes ``dcp/`` (``torch.distributed.checkpoint``: every rank's shards
of the weights and of the optimizer state, plus ``.metadata``) in place of ``model.safetensors`` and ``optimizer.pt``;
see :func:`save_sharded_checkpoint`.

A checkpoint is written into a hidden ``.tmp-step_...`` directory, each file fsync'ed, then renamed into place, so
a run killed at any moment (SIGKILL included) leaves either the complete new checkpoint or none, and the previous
one intact. Only then are checkpoints beyond the newest ``keep_last`` deleted. SIGINT and SIGTERM take effect when
the checkpoint being written is complete (:func:`save`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from memfit import storage
from memfit.errors import CheckpointError
from memfit.filemode import give_default_mode
from memfit.models.config import DecoderConfig, RopeScaling

_STEP_DIR = re.compile(r"^step_(\d{8})$")
WEIGHTS = "model.safetensors"
ADAPTER_WEIGHTS = "adapter.safetensors"
MODEL_CONFIG = "model_config.json"
OPTIMIZER = "optimizer.pt"
TRAINER_STATE = "trainer_state.json"
DCP_DIR = "dcp"  # a sharded run's weights and optimizer state, written by torch.distributed.checkpoint


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest first (unfinished ``.tmp-*`` directories are ignored)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint directory, or ``None``."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from either itself or the run directory holding ``checkpoints/``.

    Raises:
        CheckpointError: neither exists.
    """
    p = Path(path)
    if (p / WEIGHTS).is_file() or (p / ADAPTER_WEIGHTS).is_file() or (p / TRAINER_STATE).is_file():
        return p
    latest = latest_checkpoint(p)
    if latest is None:
        raise CheckpointError(
            f"no checkpoint found at '{p}': expected a run directory with checkpoints/step_*/ or a checkpoint "
            f"directory holding {WEIGHTS}; train first (memfit pretrain output_dir={p}) or fix the path"
        )
    return latest


def check_writable(output_dir: str | Path) -> None:
    """Prove that ``output_dir`` can be created and written, without creating it.

    The probe file goes into ``output_dir`` if it exists, else into its nearest existing ancestor, so a run that
    fails validation later leaves no empty directory behind.

    Raises:
        CheckpointError: a path component is a file, or the directory cannot be written.
    """
    p = Path(output_dir).absolute()
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CheckpointError(
            f"output directory '{output_dir}' cannot be created: '{existing}' is a file, not a directory; "
            f"choose another with output_dir=PATH"
        )
    try:
        probe = existing / f".memfit-write-test-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(
            f"output directory '{output_dir}' is not writable ({exc.strerror} in '{existing}'); "
            f"choose another with output_dir=PATH"
        ) from None


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: renames and new files), ignoring filesystems that refuse it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (before renaming it into place)."""
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        fsync_dir(d)


def _put_in_place(tmp: Path, final: Path) -> None:
    """Make the written directory ``tmp`` the directory ``final``, durably: its files synced, then renamed into place
    (an existing ``final`` is moved aside first and removed after), then the parent synced."""
    fsync_tree(tmp)
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


@contextlib.contextmanager
def atomic_directory(
    final: Path, what: str, kept: str | None = None, where: str = "directory"
) -> Iterator[Path]:
    """Write a directory aside, then rename it into place: readers see the old one or the complete new one.

    Yields a hidden sibling ``.tmp-<name>-<pid>`` to fill. On success its files are fsync'ed and it replaces
    ``final`` (an existing ``final`` is moved aside first and deleted after). On any error it is deleted and
    ``final`` is left as it was.

    Args:
        final: the directory to create or replace.
        what: what is being written, for the error message (e.g. "checkpoint").
        kept: what the user still has, for the error message (default: "what was there before is untouched").
        where: the setting that chose the location, for the error message's advice (e.g. "output_dir").

    Raises:
        CheckpointError: writing or renaming failed (disk full, quota, permissions, read-only file system); the
            message names ``final``, the cause, what was kept and what to do.
    """
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        yield tmp
        _put_in_place(tmp, final)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        error = storage.os_error_of(exc)
        if error is None:
            raise
        raise CheckpointError(storage.write_failure(what, final, error, kept, where)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def kept_checkpoint(output_dir: str | Path) -> str:
    """What a run still has when a checkpoint could not be written (for :func:`write_failure`)."""
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return "this run has no earlier checkpoint"
    return f"the newest complete checkpoint '{latest}' is kept (resume=true continues from it)"


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """Silence DCP's warning that it loads in one process: memfit asks for exactly that (``no_dist``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        yield


def model_config_to_dict(config: DecoderConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def model_config_from_dict(data: dict[str, Any]) -> DecoderConfig:
    data = dict(data)
    if data.get("rope_scaling") is not None:
        data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
    return DecoderConfig(**data)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters with ``requires_grad`` (LoRA / adapter weights), detached and contiguous."""
    return {n: p.detach().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def _weights_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors stored once (HF convention: the embedding keeps the name)."""
    seen: dict[int, str] = {}
    out = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        if key in seen:
            continue
        seen[key] = name
        out[name] = tensor.detach().contiguous()
    return out


def rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA) RNG states, JSON-serialisable."""
    state = {"torch_cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["torch_cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    torch.set_rng_state(
        torch.from_numpy(np.frombuffer(base64.b64decode(state["torch_cpu"]), dtype=np.uint8).copy())
    )
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(
            [
                torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())
                for s in state["torch_cuda"]
            ]
        )


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    model_config: DecoderConfig,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    tokenizer,
    keep_last: int,
    trainable_only: bool = False,
    weights: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically, then prune old ones.

    Args:
        output_dir: the run directory.
        step: optimizer steps completed.
        model: the model (its ``state_dict`` is saved under Hugging Face names).
        model_config: the architecture, saved as JSON.
        optimizer: its ``state_dict`` is saved; ``None`` saves weights only.
        trainer_state: JSON-serialisable extras (config, data position, ...); ``step`` and RNG states are added.
        tokenizer: saved with its ``save`` method.
        keep_last: how many newest checkpoints to keep.
        trainable_only: write only the trainable parameters, as ``adapter.safetensors`` (LoRA / adapter runs,
            whose frozen base stays where ``checkpoint_dir`` points).
        weights: the whole state dict to write instead of ``model``'s (a sharded run's, gathered on one rank);
            a tied ``lm_head.weight`` is dropped as above.
        optimizer_state: the state dict to write instead of ``optimizer``'s (a sharded run's, gathered).

    Returns:
        The final checkpoint directory.

    Raises:
        CheckpointError: writing failed (the previous checkpoints are untouched).
    """
    final = checkpoints_dir(output_dir) / f"step_{step:08d}"
    # a checkpoint of the same step from an earlier (interrupted) attempt is replaced
    with atomic_directory(final, "checkpoint", kept_checkpoint(output_dir), "output_dir") as tmp:
        if weights is None:
            weights = trainable_state_dict(model) if trainable_only else _weights_state_dict(model)
        elif model_config.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        weights = {k: v.detach().contiguous() for k, v in weights.items()}
        save_file(
            weights,
            str(tmp / (ADAPTER_WEIGHTS if trainable_only else WEIGHTS)),
            metadata={"format": "pt", "step": str(step)},
        )
        give_default_mode(tmp / (ADAPTER_WEIGHTS if trainable_only else WEIGHTS))  # save_file leaves 0o600
        (tmp / MODEL_CONFIG).write_text(json.dumps(model_config_to_dict(model_config), indent=2))
        if optimizer_state is not None:
            storage.torch_save(optimizer_state, tmp / OPTIMIZER)
        elif optimizer is not None:
            storage.torch_save(optimizer.state_dict(), tmp / OPTIMIZER)
        tokenizer.save(tmp / "tokenizer")
        state = {**trainer_state, "step": step, "rng": rng_state()}
        state["file_sizes"] = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    prune_checkpoints(output_dir, keep_last)
    return final


def save(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    model_config: DecoderConfig,
    trainer_state: dict[str, Any],
    tokenizer,
    keep_last: int,
    trainable_only: bool = False,
) -> Path:
    """Write a run's checkpoint ``output_dir/checkpoints/step_N`` atomically, the one way that fits the run:

    - one process: the weights as safetensors and the optimizer state (:func:`save_checkpoint`);
    - sharded, ``trainable_only`` (LoRA / adapter): the few trainable weights and their state gathered on rank 0,
      the same files as one process writes (:func:`save_gathered_trainable_checkpoint`);
    - sharded, every weight: each rank writes its own shards with ``torch.distributed.checkpoint``
      (:func:`save_sharded_checkpoint`); generate, export and a resume on any number of ranks reshard them.

    Sharded, every rank must call it (collective). SIGINT and SIGTERM that arrive meanwhile take effect once it is
    written (:func:`signals_held`); if it fails, or is cut short otherwise, no part of it is left in place.

    Args:
        output_dir: the run directory.
        step: the optimizer steps taken.
        model: the model (sharded or not).
        optimizer: its optimizer.
        model_config: the architecture (``model_config.json``).
        trainer_state: ``trainer_state.json``'s contents (the run config, data position, ...).
        tokenizer: saved into ``tokenizer/``.
        keep_last: how many of the newest checkpoints to keep.
        trainable_only: only the trainable weights (LoRA / adapter: the frozen base stays in ``checkpoint_dir``).

    Returns:
        The checkpoint directory.
    """

    args = (output_dir, step, model, model_config, optimizer, trainer_state, tokenizer, keep_last)
    with signals_held():
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return save_checkpoint(*args, trainable_only=trainable_only)
        if trainable_only:
            return save_gathered_trainable_checkpoint(*args)
        return save_sharded_checkpoint(*args)


@contextlib.contextmanager
def signals_held(signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """``signals`` that arrive inside the block are delivered at its end, to the handlers in place before it.

    So that Ctrl-C or SIGTERM (a launcher's, or the kernel's when the launcher dies: :mod:`memfit.lifeline`) stops
    a run after the checkpoint it is writing is complete: the ``KeyboardInterrupt`` they raise, raised inside
    ``torch.distributed.checkpoint``'s writer, can abort the process (torch.save's C++ writer, left to finish its
    file after the file was closed: "terminate called ... write to closed file") and leave the checkpoint
    half-written. Handlers can be set in the main thread only: elsewhere nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in signals}
    previous = {sig: handler for sig, handler in previous.items() if handler is not None}  # None: set from C
    for sig in previous:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(held):
            signal.raise_signal(sig)


def prune_checkpoints(output_dir: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints. Each is first renamed out of the checkpoint namespace
    (``.old-step_...``, atomic), then deleted: a run killed while deleting leaves a hidden directory that the next
    run removes, never a half-deleted ``step_...`` that looks like a checkpoint."""
    for old in list_checkpoints(output_dir)[:-keep_last]:
        doomed = old.with_name(f".old-{old.name}-{os.getpid()}")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(output_dir: str | Path) -> None:
    """Delete ``.tmp-*`` directories left by a run killed while writing a checkpoint."""
    root = checkpoints_dir(output_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith((".tmp-", ".old-")):
                shutil.rmtree(p, ignore_errors=True)


def missing_file(ckpt: Path, name: str) -> CheckpointError:
    """The error every verb raises for a memfit checkpoint that lacks one of its files (the same words whether
    it is generated from, exported, fine-tuned from or resumed)."""
    return CheckpointError(
        f"checkpoint '{ckpt}' is missing '{name}'; it is incomplete: memfit writes a checkpoint whole or not at all, "
        f"so it was damaged or copied in part. Use a complete one (a run directory stands for its newest complete "
        f"checkpoint); to resume, delete '{ckpt}' and resume=true falls back to the previous one"
    )


def check_files(ckpt: Path, state: dict[str, Any], need_optimizer: bool) -> None:
    """Check that a checkpoint's files exist and have the byte sizes recorded when it was written.

    Args:
        ckpt: the checkpoint directory.
        state: its parsed ``trainer_state.json`` (holds ``file_sizes``).
        need_optimizer: also require ``optimizer.pt``.

    Raises:
        CheckpointError: a file is missing or truncated; the message says which and what to do.
    """
    if is_sharded(ckpt):  # weights and optimizer state both live in dcp/
        needed = [f"{DCP_DIR}/.metadata", MODEL_CONFIG]
    else:
        weights = ADAPTER_WEIGHTS if (ckpt / ADAPTER_WEIGHTS).is_file() else WEIGHTS
        needed = [weights, MODEL_CONFIG] + ([OPTIMIZER] if need_optimizer else [])
    for name in needed:
        if not (ckpt / name).is_file():
            raise missing_file(ckpt, name)
    if not (ckpt / "tokenizer").is_dir():
        raise missing_file(ckpt, "tokenizer/")
    for name, size in state.get("file_sizes", {}).items():
        p = ckpt / name
        if p.is_file() and p.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint file '{p}' is truncated or altered ({p.stat().st_size} bytes, {size} expected). "
                f"Delete '{ckpt}' to fall back to the previous checkpoint (resume=true takes the newest complete one)."
            )


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """Parse ``trainer_state.json``.

    Raises:
        CheckpointError: missing or not valid JSON.
    """
    path = ckpt / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise missing_file(ckpt, TRAINER_STATE) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint file '{path}' is truncated or corrupt ({exc}); delete '{ckpt}' and resume from the "
            f"previous one"
        ) from None


def read_model_config(ckpt: Path) -> DecoderConfig:
    """The :class:`DecoderConfig` saved in a checkpoint.

    Raises:
        CheckpointError: missing or invalid.
    """
    path = ckpt / MODEL_CONFIG
    try:
        return model_config_from_dict(json.loads(path.read_text()))
    except FileNotFoundError:
        raise missing_file(ckpt, MODEL_CONFIG) from None
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint file '{path}' is truncated or corrupt ({exc}); delete '{ckpt}' to fall back to the previous "
            f"checkpoint"
        ) from None


def load_weights(ckpt: Path, model: torch.nn.Module) -> None:
    """Load ``model.safetensors`` into ``model`` (strict; tied weights restored from the single stored copy).

    A checkpoint holding ``adapter.safetensors`` instead loads into the model's trainable parameters (strict over
    those: every one present, nothing else).

    Raises:
        CheckpointError: the file is missing, truncated, or its tensors do not match the model.
    """
    if is_sharded(ckpt):  # consolidated here (no collective), whatever the number of ranks that wrote it
        path = ckpt / DCP_DIR
        tensors = read_sharded_weights(ckpt)
    else:
        if (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / WEIGHTS).is_file():
            _load_trainable(ckpt / ADAPTER_WEIGHTS, model)
            return
        path = ckpt / WEIGHTS
        if not path.is_file():
            raise CheckpointError(f"checkpoint weights '{path}' do not exist")
        tensors = _read_safetensors(path)
    expected = model.state_dict()
    missing = [k for k in expected if k not in tensors and not _is_tied_alias(model, k, tensors)]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint weights '{path}' do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    with torch.no_grad():
        for name, tensor in expected.items():
            if name not in tensors:
                continue
            if tensors[name].shape != tensor.shape:
                raise CheckpointError(
                    f"checkpoint weights '{path}': '{name}' has shape {tuple(tensors[name].shape)}, the model expects "
                    f"{tuple(tensor.shape)}"
                )
            tensor.copy_(tensors[name])


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint weights '{path}' are truncated or corrupt ({exc}); delete '{path.parent}' to fall back to "
            f"the previous checkpoint"
        ) from None


def _load_trainable(path: Path, model: torch.nn.Module) -> None:
    tensors = _read_safetensors(path)
    expected = dict(trainable_state_dict(model))
    params = dict(model.named_parameters())
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise CheckpointError(
            f"adapter weights '{path}' do not match the model's trainable parameters: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]} (was it written with other method / lora / adapter settings?)"
        )
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.shape != params[name].shape:
                raise CheckpointError(
                    f"adapter weights '{path}': '{name}' has shape {tuple(tensor.shape)}, the model expects "
                    f"{tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)


def _is_tied_alias(model: torch.nn.Module, name: str, tensors: dict[str, torch.Tensor]) -> bool:
    cfg = getattr(model, "config", None)
    return (
        name == "lm_head.weight"
        and bool(getattr(cfg, "tie_word_embeddings", False))
        and "model.embed_tokens.weight" in tensors
    )


def load_checkpoint(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Restore weights, optimizer state and RNG state from a checkpoint.

    Args:
        ckpt: the checkpoint directory.
        model: a materialised model of the saved architecture.
        optimizer: the optimizer over ``model``'s parameters, or ``None`` to load weights only.

    Returns:
        The trainer state (``step``, data position, config, ...).

    Raises:
        CheckpointError: a file is missing, truncated or does not match.
    """
    state = read_trainer_state(ckpt)
    check_files(ckpt, state, need_optimizer=optimizer is not None)
    if is_sharded(ckpt) or _process_group_size() > 1:
        if is_sharded(ckpt):
            load_sharded(ckpt, model, optimizer)
        else:
            _load_full_into_sharded(ckpt, model, optimizer)
        if "rng" in state:
            set_rng_state(state["rng"])
        return state
    load_weights(ckpt, model)
    if optimizer is not None:
        path = ckpt / OPTIMIZER
        try:
            opt_state = torch.load(path, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(opt_state)
        except (RuntimeError, OSError, ValueError, KeyError, EOFError) as exc:
            raise CheckpointError(
                f"optimizer state '{path}' is truncated, corrupt or does not match the optimizer ({exc})"
            ) from None
    if "rng" in state:
        set_rng_state(state["rng"])
    return state


# ----------------------------------------------------------------------------------------------------------------
# Sharded checkpoints (torch.distributed.checkpoint)
# ----------------------------------------------------------------------------------------------------------------
#
# A run under torchrun with more than one rank writes ``dcp/`` instead of ``model.safetensors`` + ``optimizer.pt``:
# each rank writes its own shards of ``{"model": get_model_state_dict, "optim": get_optimizer_state_dict}`` (names
# of the unwrapped model, so FSDP2, FSDP1 and one process agree), rank 0 the metadata. Reading it back reshards to
# whatever loads it: another number of ranks, one process (no process group), or a consolidated full state dict
# (generate, export).


def is_sharded(ckpt: Path) -> bool:
    """The checkpoint holds a ``dcp/`` directory (a sharded run's)."""
    return (Path(ckpt) / DCP_DIR).is_dir()


def _agree(error: str | None) -> str | None:
    """Rank 0's error (or ``None``), known to every rank, so that all raise or none does."""

    box = [error]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def save_sharded_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    model_config: DecoderConfig,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    tokenizer,
    keep_last: int,
) -> Path:
    """Write a sharded checkpoint with ``torch.distributed.checkpoint``, atomically. Collective: every rank calls it.

    Every rank writes its shards into the hidden ``.tmp-step_..-sharded/dcp/``; after a barrier rank 0 adds
    ``model_config.json``, ``tokenizer/`` and ``trainer_state.json`` (with the byte size of every file, shards
    included), fsyncs, renames the directory into place and prunes checkpoints beyond the newest ``keep_last``.

    Returns:
        The final checkpoint directory.

    Raises:
        CheckpointError: writing failed, on every rank (the previous checkpoints are untouched).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = checkpoints_dir(output_dir) / f"step_{step:08d}"
    tmp = final.parent / f".tmp-{final.name}-sharded"  # one name all ranks know
    main = dist.get_rank() == 0
    kept = kept_checkpoint(output_dir) if main else ""
    error = None

    def failed(exc: BaseException) -> str:
        os_error = storage.os_error_of(exc)
        if os_error is None:
            return f"could not write checkpoint '{final}' ({exc}); {kept}"
        return storage.write_failure("checkpoint", final, os_error, kept, "output_dir")

    if main:
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / DCP_DIR).mkdir(parents=True)
        except OSError as exc:
            error = failed(exc)
    shards_written = False  # past the barrier: every rank's shards are in tmp, and rank 0 alone goes on
    try:
        error = _agree(error)
        if error is None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            try:
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp / DCP_DIR)
            except Exception as exc:  # a rank's write failed: dcp.save raises the same on every rank
                error = failed(exc)
            dist.barrier()
            shards_written = True
            if main and error is None:
                try:
                    (tmp / MODEL_CONFIG).write_text(json.dumps(model_config_to_dict(model_config), indent=2))
                    tokenizer.save(tmp / "tokenizer")
                    state = {
                        **trainer_state,
                        "step": step,
                        "rng": rng_state(),
                        "world_size": dist.get_world_size(),
                    }
                    state["file_sizes"] = {
                        str(p.relative_to(tmp)): p.stat().st_size
                        for p in sorted(tmp.rglob("*"))
                        if p.is_file()
                    }
                    (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2))
                    _put_in_place(
                        tmp, final
                    )  # (the same step from an earlier, interrupted attempt: replaced)
                    prune_checkpoints(output_dir, keep_last)
                except OSError as exc:
                    error = failed(exc)
            error = _agree(error)
    except BaseException:  # broken off (SIGTERM, Ctrl-C, a rank gone): nothing half-written is left behind
        if main or not shards_written:  # before the barrier rank 0 cannot be renaming tmp into place
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if error is not None:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(error)
    return final


def save_gathered_trainable_checkpoint(
    output_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    model_config: DecoderConfig,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    tokenizer,
    keep_last: int,
) -> Path:
    """A sharded LoRA / adapter run's checkpoint: its trainable weights and their optimizer state (a few MiB) are
    gathered on rank 0, which writes exactly what one process writes (``adapter.safetensors`` + ``optimizer.pt``,
    see :func:`save_checkpoint`); the frozen base stays where ``checkpoint_dir`` points. Such a checkpoint resumes
    on any number of ranks and is read by ``generate`` and ``export`` as a one-process run's. Collective.

    Returns:
        The final checkpoint directory.

    Raises:
        CheckpointError: writing failed, on every rank (the previous checkpoints are untouched).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    # gathered on every rank, or on rank 0 alone with cpu_offload: only worth it on CUDA (and on CPU, FSDP1's
    # rank-0-only offload copies freed storage: SIGSEGV in torch 2.13)
    on_cuda = next(model.parameters()).device.type == "cuda"
    options = StateDictOptions(full_state_dict=True, cpu_offload=on_cuda, ignore_frozen_params=True)
    weights = get_model_state_dict(model, options=options)  # rank 0 alone keeps the gathered tensors
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    final, error = None, None
    if dist.get_rank() == 0:
        try:
            final = save_checkpoint(
                output_dir,
                step,
                model,
                model_config,
                None,
                trainer_state,
                tokenizer,
                keep_last,
                trainable_only=True,
                weights=weights,
                optimizer_state=_indexed_optimizer_state(optim_sd),
            )
        except CheckpointError as exc:
            error = str(exc)
    error = _agree(error)
    if error is not None:
        raise CheckpointError(error)
    return checkpoints_dir(output_dir) / f"step_{step:08d}" if final is None else final


def _indexed_optimizer_state(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state dict (``get_optimizer_state_dict``) as ``Optimizer.state_dict()`` lays it
    out: parameters numbered group by group."""
    index = {}
    groups = []
    for group in optim_sd["param_groups"]:
        ids = []
        for name in group["params"]:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**group, "params": ids})
    return {"state": {index[n]: v for n, v in optim_sd["state"].items()}, "param_groups": groups}


def _dcp_error(ckpt: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"sharded checkpoint '{ckpt / DCP_DIR}' is truncated, corrupt or does not match the model ({exc}); delete "
        f"'{ckpt}' to fall back to the previous checkpoint"
    )


def read_sharded_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a sharded checkpoint, consolidated on this process's host.

    Reads the shards of every rank that wrote it, with no collective (a process group may be up or not).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    where = Path(ckpt) / DCP_DIR
    try:
        meta = dcp.FileSystemReader(str(where)).read_metadata()
        weights = {}
        for key, m in meta.state_dict_metadata.items():
            path = (meta.planner_data or {}).get(key)
            if path is not None and len(path) == 2 and path[0] == "model":
                name = path[1]
            elif path is None and key.startswith("model."):
                name = key[len("model.") :]
            else:
                continue
            if isinstance(m, TensorStorageMetadata):
                weights[name] = torch.empty(m.size, dtype=m.properties.dtype)
        with _single_process_dcp():
            dcp.load({"model": weights}, checkpoint_id=where, no_dist=True)
    except CheckpointError:
        raise
    except Exception as exc:
        raise _dcp_error(Path(ckpt), exc) from None
    if not weights:
        raise _dcp_error(Path(ckpt), ValueError("no model weights in it"))
    return weights


def load_sharded(ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load a sharded checkpoint into ``model`` (and ``optimizer``), resharding to however they are laid out.

    Collective when a process group with more than one rank is up (every rank calls it): each rank reads the parts
    of the shards it holds. A single process (no process group) reads everything into its plain model.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    try:
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
        else:
            init_optimizer_state(optimizer)
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
        with _single_process_dcp():
            dcp.load(state, checkpoint_id=Path(ckpt) / DCP_DIR, no_dist=not distributed)
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except CheckpointError:
        raise
    except Exception as exc:
        raise _dcp_error(Path(ckpt), exc) from None
    if optimizer is not None and not state["optim"].get("state") and _has_optimizer_state(ckpt):
        raise _dcp_error(Path(ckpt), ValueError("no optimizer state was restored"))


def _process_group_size() -> int:

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _load_full_into_sharded(
    ckpt: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """A one-process checkpoint (``model.safetensors``, or a LoRA / adapter run's ``adapter.safetensors``, +
    ``optimizer.pt``) into a sharded model and optimizer. Collective: every rank reads the files and keeps its
    shards.

    ``optimizer.pt`` numbers the parameters group by group, in the order of the optimizer's groups, which sharding
    keeps: the i-th is the i-th name of the sharded optimizer's (name-keyed) state dict.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    trainable_only = (ckpt / ADAPTER_WEIGHTS).is_file() and not (ckpt / WEIGHTS).is_file()
    weights = _read_safetensors(ckpt / (ADAPTER_WEIGHTS if trainable_only else WEIGHTS))
    cfg = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    if not trainable_only and getattr(cfg, "tie_word_embeddings", False) and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    # a LoRA / adapter checkpoint holds the trainable weights only: the frozen base is already in place
    options = StateDictOptions(full_state_dict=True, strict=not trainable_only)
    optim_sd = None
    try:
        if optimizer is not None:
            saved = torch.load(ckpt / OPTIMIZER, map_location="cpu", weights_only=True)
            init_optimizer_state(optimizer)
            names = [
                n for g in get_optimizer_state_dict(model, optimizer)["param_groups"] for n in g["params"]
            ]
            groups, i = [], 0
            for group in saved["param_groups"]:
                count = len(group["params"])
                groups.append({**group, "params": names[i : i + count]})
                i += count
            if i != len(names):
                raise ValueError(
                    f"{i} parameters in the checkpoint's optimizer state, {len(names)} in the model"
                )
            optim_sd = {"state": {names[k]: v for k, v in saved["state"].items()}, "param_groups": groups}
        if optim_sd is None:
            set_model_state_dict(model, weights, options=options)
        else:
            set_state_dict(
                model, optimizer, model_state_dict=weights, optim_state_dict=optim_sd, options=options
            )
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint '{ckpt}' does not load into the sharded model and optimizer ({exc}); resume it in one "
            f"process"
        ) from None


def _has_optimizer_state(ckpt: Path) -> bool:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(Path(ckpt) / DCP_DIR)).read_metadata()
    return any(key.startswith("optim.state.") for key in meta.state_dict_metadata)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the (lazily made) optimizer state, so that there are tensors for ``dcp.load`` to fill.

    What torch's distributed checkpointing does (``torch.distributed.checkpoint.state_dict._init_optim_state``):
    one step on zero gradients at lr 0, skipped when the state already holds tensors or a gradient exists. Unlike
    torch's, it also steps an optimizer whose state holds numbers but no tensor before its first step (APOLLO
    numbers each parameter's seed at construction); and it is memfit's own, so that a run or an estimate that
    never touches a distributed checkpoint does not import torch.distributed.checkpoint (~0.5 s, FSDP with it).
    An :class:`~memfit.memory.optim.OptimizerInBackward` steps inside backward only, so each of its per-parameter
    optimizers is initialised instead (those of a :class:`~memfit.memory.optim.PerParameterOptimizer` too), then
    the Kahan compensation of ``bf16_rounding: kahan`` is created beside their state.
    """
    inner = getattr(optimizer, "_inner", None)
    for opt in inner.values() if isinstance(inner, dict) else [optimizer]:
        if not any(isinstance(v, torch.Tensor) for st in opt.state.values() for v in st.values()):
            _zero_step(opt)
    compensation = getattr(optimizer, "create_compensation", None)
    if callable(compensation):  # bf16_rounding=kahan: its buffers, which a step that rounds would have made
        compensation()


def _zero_step(optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients at lr 0 (nothing moves: the update is lr times a function of zero gradients),
    unless a parameter has a gradient already; the lrs are restored and the gradients set to None after it."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        if "lr" in g:
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
