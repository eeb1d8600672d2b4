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
from memfit.config import TrainConfig, config_from_dict, config_to_dict
from memfit.data.run import tokenizer_settings
from memfit.errors import CheckpointError, ConfigError
from memfit.models import peft
from memfit.models.config import DecoderConfig


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


def recorded_hub(cfg: TrainConfig) -> dict[str, Any] | None:
    """The Hub repos the run in ``output_dir`` recorded (its newest checkpoint's trainer state ``hub``: each key's
    repo, revision and commit, :meth:`memfit.hub.HubSource.record`) when ``cfg`` resumes it, else ``None``. Read
    before the Hub ids are resolved, so that a resume reads the commit the run started from."""
    latest = ckpt_io.latest_checkpoint(cfg.output_dir) if cfg.resume else None
    if latest is None:
        return None
    try:
        return ckpt_io.read_trainer_state(latest).get("hub")
    except CheckpointError:  # reported by find_resume, with the rest of the checkpoint's checks
        return None


def resumed_config(cfg: TrainConfig, state: dict[str, Any]) -> TrainConfig:
    """``cfg`` as it continues the run whose trainer state is ``state``: ``data.template=auto`` (the default) takes
    the template the run was trained with, when the run named one (runs saved before ``auto`` existed record the
    template they rendered with, ``alpaca`` by default), so that the rendering does not change under a resume.

    Args:
        cfg: the run config.
        state: the resumed checkpoint's trainer state.

    Returns:
        ``cfg``, or a copy with the run's ``data.template``.
    """
    saved = ((state or {}).get("config") or {}).get("data", {}).get("template")
    if cfg.data.format == "text" or cfg.data.template != "auto" or saved in (None, "auto"):
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, template=saved))


def check_resume(cfg: TrainConfig, resume_dir: Path, state: dict[str, Any]) -> None:
    """Check that ``cfg`` may continue the run saved in ``resume_dir``: the same tokenizer, method, data format and
    method settings, and (LoRA / adapter) the same frozen base.

    Raises:
        ConfigError: naming the first key that differs from the run's.
        CheckpointError: a LoRA / adapter run's base is gone or changed.
    """
    saved_cfg = state.get("config", {})
    if saved_cfg:
        now, then = tokenizer_settings(cfg), tokenizer_settings(config_from_dict(saved_cfg, check=False))
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
        # another optimizer cannot take the run's state (and a config that leaves the name out gets the default of
        # today, which may not be the run's: config.default_optimizer)
        "optimizer.name": (cfg.optimizer.name, saved.optimizer.name),
    }
    if cfg.data.format != "text":
        keys["data.template"] = (cfg.data.template, saved.data.template)
    if cfg.method in peft.LORA_METHODS:
        keys["lora"] = (dataclasses.asdict(cfg.lora), dataclasses.asdict(saved.lora))
    if cfg.method == "adapter":
        keys["adapter"] = (dataclasses.asdict(cfg.adapter), dataclasses.asdict(saved.adapter))
    for key, (now, then) in keys.items():
        if now != then:
            raise ConfigError(
                f"config key '{key}': the run in '{output_dir}' was trained with {then!r}, the config asks for "
                f"{now!r}; resume with the run's setting, or choose another output_dir for a new run"
            )


def check_resume_model(
    cfg: TrainConfig, resume_dir: Path, state: dict[str, Any], mcfg: DecoderConfig
) -> None:
    """Refuse to resume the run saved in ``resume_dir`` with another architecture than its own (``model``,
    ``model_args``, or what ``checkpoint_dir`` holds now), before anything is traced or allocated.

    Args:
        cfg: the run config.
        resume_dir: the checkpoint to resume.
        state: its trainer state (the run's config, to tell a changed preset from a changed ``model_args``).
        mcfg: the architecture ``cfg`` asks for.

    Raises:
        ConfigError: naming the key and every :class:`~memfit.models.decoder.DecoderConfig` field that differs, with
            the checkpoint's value and the config's.
        CheckpointError: the checkpoint's ``model_config.json`` is missing or corrupt.
    """
    saved = ckpt_io.read_model_config(resume_dir)
    if saved == mcfg:
        return
    diff = [
        (f.name, getattr(saved, f.name), getattr(mcfg, f.name))
        for f in dataclasses.fields(mcfg)
        if getattr(saved, f.name) != getattr(mcfg, f.name)
    ]
    saved_model = (state.get("config") or {}).get("model", cfg.model)
    if cfg.checkpoint_dir is not None:
        key = "checkpoint_dir"
    elif saved_model != cfg.model:
        key = "model"
    else:
        key = f"model_args.{diff[0][0]}" if len(diff) == 1 else "model_args"
    then = ", ".join(f"{name}={old!r}" for name, old, _ in diff)
    now = ", ".join(f"{name}={new!r}" for name, _, new in diff)
    if key == "checkpoint_dir":
        asks, fix = f"'{cfg.checkpoint_dir}' now holds {now}", "resume from the weights the run started from"
    else:
        asks, fix = f"the config asks for {now}", "resume with the run's model and model_args"
    was = f" (model {saved_model!r})" if key == "model" else ""
    raise ConfigError(
        f"config key '{key}': the run in '{cfg.output_dir}' was trained with a model of {then}{was}, {asks}; "
        f"{fix}, or choose another output_dir for a new run (nothing was allocated or changed)"
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


def resume_notes(cfg: TrainConfig, state: dict[str, Any], world_size: int = 1) -> list[str]:
    """One note per key that changes the schedule or the data (``max_steps``, ``optimizer.*``, ``data.*``, ...)
    whose value differs from the resumed checkpoint's run, naming both values; a changed batch (``batch_size``,
    ``gradient_accumulation_steps`` or the number of ranks) gets one note that says whether the global batch
    changes (:func:`batch_note`).

    Args:
        cfg: the run config.
        state: the resumed checkpoint's trainer state (its run's config and ``world_size``).
        world_size: the ranks of this run.
    """
    saved = state.get("config") or {}
    if not saved:
        return []
    now, then = _flat(config_to_dict(cfg)), _flat(saved)
    batch = batch_note(cfg, saved, state.get("world_size"), world_size)
    notes = [] if batch is None else [batch]
    mesh = mesh_note(cfg, saved, state.get("world_size"), world_size)
    if mesh is not None:
        notes.append(mesh)
    for key in sorted(set(now) | set(then)):
        if key.split(".")[0] not in _NOTED_KEYS or now.get(key) == then.get(key):
            continue
        if key not in then:  # a key newer than the checkpoint's run: it ran with what is now the default
            continue
        if batch is not None and key in _BATCH_KEYS:
            continue
        notes.append(
            f"note: resuming with {key}={now.get(key)!r}; the checkpoint's run had {key}={then.get(key)!r}"
        )
    return notes


_BATCH_KEYS = ("batch_size", "gradient_accumulation_steps")


def batch_note(
    cfg: TrainConfig, saved: dict[str, Any], saved_world_size: int | None, world_size: int
) -> str | None:
    """The note of a resume whose batch differs from the checkpoint's run: the per-rank keys that changed, the
    ranks, and the global batch (``batch_size * gradient_accumulation_steps * ranks / (sequence_parallel *
    tensor_parallel)`` sequences a step), e.g.
    ``note: resuming with batch_size 4 -> 8 per rank on 1 rank instead of 2: the global batch (8 sequences a
    step) is unchanged``.

    Args:
        cfg: the run config.
        saved: the checkpoint's run config (as saved).
        saved_world_size: the ranks of the checkpoint's run; ``None`` (a checkpoint that does not record them):
            no note here, :func:`resume_notes` names each changed key on its own.
        world_size: the ranks of this run.

    Returns:
        The note, or ``None`` when the batch and the ranks are the checkpoint's.
    """
    if saved_world_size is None:
        return None
    size, accumulation = cfg.batch_size, cfg.gradient_accumulation_steps
    saved_size = saved.get("batch_size", size)
    saved_accumulation = saved.get("gradient_accumulation_steps", accumulation)
    changed = [
        f"{key} {then} -> {now}"
        for key, then, now in zip(
            _BATCH_KEYS, (saved_size, saved_accumulation), (size, accumulation), strict=True
        )
        if then != now
    ]
    if not changed and saved_world_size == world_size:
        return None
    ranks = f"on {world_size} rank{'s' * (world_size != 1)}"
    if saved_world_size != world_size:
        ranks += f" instead of {saved_world_size}"
    if changed:
        what = f"with {', '.join(changed)} per rank {ranks}"
    else:
        what = f"{ranks}, with batch_size {size} x gradient_accumulation_steps {accumulation} per rank"
    # a sequence- or tensor-parallel group of N ranks shares its sequences: world / N groups draw batch_size each
    saved_d = saved.get("distributed") or {}
    saved_sp = (
        saved_d.get("sequence_parallel", 1) * saved_d.get("tensor_parallel", 1) if saved_world_size > 1 else 1
    )
    sp = cfg.distributed.sequence_parallel * cfg.distributed.tensor_parallel if world_size > 1 else 1
    before = saved_size * saved_accumulation * saved_world_size // saved_sp
    after = size * accumulation * world_size // sp
    if before == after:
        return f"note: resuming {what}: the global batch ({after} sequences a step) is unchanged"
    return f"note: resuming {what}: the global batch changes from {before} to {after} sequences a step"


def _mesh(replicate: int, world_size: int) -> str:
    if world_size == 1:
        return "1 process"
    if replicate > 1:
        return f"{replicate} replicas x {world_size // replicate} shards (hybrid)"
    return f"{world_size} shards"


def mesh_note(
    cfg: TrainConfig, saved: dict[str, Any], saved_world_size: int | None, world_size: int
) -> str | None:
    """The note of a resume whose hybrid sharding (``distributed.replicate``) differs from the checkpoint's run,
    e.g. ``note: resuming on 4 shards; the checkpoint was saved on 2 replicas x 2 shards (hybrid): its shards are
    read into this layout (DCP resharding), the steps are the same``. The steps are the same either way: the
    replicas hold the same shards, and the data never depends on them. ``None`` when the layout is the
    checkpoint's, or only the ranks changed (:func:`batch_note` says so).
    """
    if saved_world_size is None:
        return None
    then = (saved.get("distributed") or {}).get("replicate", 1) if saved_world_size > 1 else 1
    now = cfg.distributed.replicate if world_size > 1 else 1
    if then == now:
        return None
    return (
        f"note: resuming on {_mesh(now, world_size)}; the checkpoint was saved on {_mesh(then, saved_world_size)}: "
        "its shards are read into this layout (DCP resharding), the steps are the same"
    )


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
