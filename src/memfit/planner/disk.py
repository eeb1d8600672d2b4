"""Disk space for a run's checkpoints, checked before the run starts.

A checkpoint holds the trainable weights and the optimizer state (:mod:`memfit.checkpoint`), written aside and
renamed into place, and only then are checkpoints beyond the newest ``keep_last_checkpoints`` deleted: while the
``k``-th save of a run is written, the ones kept so far are still on disk. :func:`check_checkpoint_disk` adds up
what the run's saves will hold at their fullest moment and refuses the run, before anything is allocated, when the
disk under ``output_dir`` has less free space: a full disk found at the first save, hours in, would cost the steps
before it.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from memfit.config import TrainConfig
from memfit.distributed import shard_ranks
from memfit.errors import CheckpointError
from memfit.models.config import DecoderConfig
from memfit.planner.closed_form import model_state_bytes_closed_form
from memfit.units import format_bytes

__all__ = ["checkpoint_bytes", "check_checkpoint_disk", "saves_of_run"]


def checkpoint_bytes(cfg: TrainConfig, mcfg: DecoderConfig, world_size: int = 1) -> int:
    """Bytes of the tensors in one checkpoint of the run, all ranks together: the trainable weights in their dtype
    (the whole model for a full fine-tune or pretraining; the adapters of LoRA, QLoRA and adapter runs, whose
    frozen base is re-read from ``checkpoint_dir``) and the optimizer state (:func:`memfit.planner.closed_form.
    model_state_bytes_closed_form`). Files' headers, the trainer state and the tokenizer add kilobytes.

    Args:
        cfg: the run config.
        mcfg: the architecture.
        world_size: ranks of a sharded run (each writes its shards; their sum is about one rank's times the ranks).

    Returns:
        Bytes.
    """
    states = model_state_bytes_closed_form(cfg, mcfg, world_size)
    # hybrid sharding: the replicas hold the same shards, and DCP writes each once (its planner's dedup)
    return (states["trainable_parameters"] + states["optimizer_state"]) * shard_ranks(
        cfg.distributed.replicate, world_size
    )


def saves_of_run(cfg: TrainConfig, start_step: int) -> int:
    """How many checkpoints a run from ``start_step`` to ``cfg.max_steps`` writes: one every ``checkpoint_every``
    steps (none when 0) and the final one (at ``max_steps``, which a periodic one may already be)."""
    if start_step >= cfg.max_steps:
        return 0
    every = cfg.checkpoint_every
    periodic = 0 if every <= 0 else cfg.max_steps // every - start_step // every
    return periodic + (0 if every > 0 and cfg.max_steps % every == 0 else 1)


def check_checkpoint_disk(
    cfg: TrainConfig, mcfg: DecoderConfig, world_size: int, start_step: int, existing: int
) -> int:
    """Refuse a run whose checkpoints will not fit in the free space of ``output_dir``'s disk.

    At the ``j``-th save of the run, ``min(existing + j - 1, keep_last_checkpoints)`` checkpoints are on disk beside
    the one being written; the most the run adds to today's use is that count plus one, less the ``existing`` ones,
    times :func:`checkpoint_bytes`.

    Args:
        cfg: the run config.
        mcfg: the architecture.
        world_size: ranks of the run.
        start_step: the step the run starts at (a resumed run's).
        existing: checkpoints already in ``output_dir`` (a resumed run's).

    Returns:
        The bytes the run's checkpoints need beyond today's use (0 when it saves none).

    Raises:
        CheckpointError: the free space is less than that, naming both in bytes and GiB, and what to change.
    """
    saves = saves_of_run(cfg, start_step)
    if saves == 0:
        return 0
    one = checkpoint_bytes(cfg, mcfg, world_size)
    held = (
        min(existing + saves - 1, cfg.keep_last_checkpoints) + 1
    )  # at the fullest save, the new one included
    needed = max(1, held - existing) * one
    where = _existing_parent(Path(cfg.output_dir))
    free = shutil.disk_usage(where).free
    if needed > free:
        at_most = max(0, math.floor(free / one) - 1 + existing) if one else 0
        raise CheckpointError(
            f"the run's checkpoints need {format_bytes(needed)} ({needed:,} bytes: {held - existing} of "
            f"{format_bytes(one)} beyond those in output_dir, the weights and the optimizer state) but the disk "
            f"of '{where}' has {format_bytes(free)} ({free:,} bytes) free; free disk space, choose another "
            f"output_dir, or keep fewer checkpoints (keep_last_checkpoints={cfg.keep_last_checkpoints}"
            + (f"; {at_most} would fit" if at_most >= 1 else "")
            + "); the run did not start"
        )
    return needed


def _existing_parent(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (``output_dir`` is created only once the checks pass)."""
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path
