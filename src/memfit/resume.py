"""Resuming a run: find the newest complete checkpoint, and refuse one whose settings would change what trains or
what it trains on (naming the key) before anything is allocated."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from memfit import checkpoint as ckpt_io
from memfit import distributed as dist_
from memfit.build import check_base
from memfit.config import LORA_METHODS, TrainConfig, config_from_dict, config_to_dict
from memfit.data.run import tokenizer_settings
from memfit.errors import CheckpointError, ConfigError


def find_resume(cfg: TrainConfig) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its trainer state, or ``(None, None)`` for a new run; refuses to
    overwrite an earlier run's checkpoints without ``resume``.

    Raises:
        CheckpointError: ``output_dir`` cannot be written, or holds checkpoints and ``resume`` is false.
    """
    ckpt_io.check_writable(cfg.output_dir)
    ckpt_io.remove_stale_temporaries(cfg.output_dir)
    latest = ckpt_io.latest_checkpoint(cfg.output_dir)
    if not cfg.resume:
        if latest is not None:
            raise CheckpointError(
                f"output_dir '{cfg.output_dir}' already holds checkpoints ({latest.name}) from an earlier run; "
                f"pass resume=true to continue it, or choose another output_dir (nothing was changed)"
            )
        return None, None
    if latest is None:
        if dist_.is_main():
            tqdm.write(f"resume=true but '{cfg.output_dir}' holds no checkpoint yet: starting from step 0")
        return None, None
    state = ckpt_io.read_trainer_state(latest)
    ckpt_io.check_files(latest, state, need_optimizer=True)  # before anything is read from it or allocated
    return latest, state


def check_resume(cfg: TrainConfig, resume_dir: Path, state: dict[str, Any]) -> None:
    """Check that ``cfg`` may continue the run saved in ``resume_dir``: the same tokenizer, method, data format and
    method settings, and (LoRA / adapter) the same frozen base.

    Raises:
        ConfigError: naming the first key that differs from the run's.
        CheckpointError: a LoRA / adapter run's base is gone or changed.
    """
    saved_cfg = state.get("config", {})
    if saved_cfg:
        now, then = tokenizer_settings(cfg), tokenizer_settings(config_from_dict(saved_cfg))
        if then != now:
            raise ConfigError(
                f"config key 'tokenizer': the run in '{cfg.output_dir}' was trained with tokenizer {then}, "
                f"the config asks for {now}; resume with the same tokenizer settings or choose another "
                f"output_dir"
            )
        check_resume_matches(cfg, config_from_dict(saved_cfg, check=False), cfg.output_dir)
    if cfg.method != "full":
        check_base(cfg, state, resume_dir)


def check_resume_matches(cfg: TrainConfig, saved: TrainConfig, output_dir: str) -> None:
    """Refuse to resume a run with settings that change what trains or what it trains on.

    Raises:
        ConfigError: naming the first key that differs from the run's.
    """
    keys = {
        "checkpoint_dir": (cfg.checkpoint_dir, saved.checkpoint_dir),
        "method": (cfg.method, saved.method),
        "data.format": (cfg.data.format, saved.data.format),
        "data.packing": (cfg.data.packing, saved.data.packing),
    }
    if cfg.data.format != "text":
        keys["data.template"] = (cfg.data.template, saved.data.template)
    if cfg.method in LORA_METHODS:
        keys["lora"] = (dataclasses.asdict(cfg.lora), dataclasses.asdict(saved.lora))
    if cfg.method == "adapter":
        keys["adapter"] = (dataclasses.asdict(cfg.adapter), dataclasses.asdict(saved.adapter))
    for key, (now, then) in keys.items():
        if now != then:
            raise ConfigError(
                f"config key '{key}': the run in '{output_dir}' was trained with {then!r}, the config asks for "
                f"{now!r}; resume with the run's setting, or choose another output_dir for a new run"
            )


# keys that change the schedule, the batches or the numerics of the steps still to run: a resume may change them
# (to train longer, say), and is told that it did
_NOTED_KEYS = (
    "max_steps",
    "seed",
    "batch_size",
    "gradient_accumulation_steps",
    "seq_len",
    "max_grad_norm",
    "dtype",
    "optimizer",
    "data",
    "on_nonfinite",
)


def resume_notes(cfg: TrainConfig, state: dict[str, Any]) -> list[str]:
    """One note per key that changes the schedule or the data (``max_steps``, batch size, ``optimizer.*``,
    ``data.*``, ...) whose value differs from the resumed checkpoint's run, naming both values."""
    saved = state.get("config") or {}
    if not saved:
        return []
    now, then = _flat(config_to_dict(cfg)), _flat(saved)
    notes = []
    for key in sorted(set(now) | set(then)):
        if key.split(".")[0] not in _NOTED_KEYS or now.get(key) == then.get(key):
            continue
        notes.append(
            f"note: resuming with {key}={now.get(key)!r}; the checkpoint's run had {key}={then.get(key)!r}"
        )
    return notes


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
