"""Reference log-probabilities computed once, before training, and kept on disk: a full-weight DPO or IPO run then
holds one model, not the policy and a frozen copy of it.

The pass runs the starting model (the checkpoint, before any update) over every pair of a split, in file order,
without gradients, as the step computes a row's log-probability (:func:`memfit.step.sequence_logps`, chunked
when the run chunks its loss), and stores ``(num_pairs, 2)`` float64 ``[chosen, rejected]`` summed reply
log-probabilities as ``<reference_dir>/<key>.npy``. The key is a sha256 of the checkpoint's weight files
(:func:`memfit.convert.weights_fingerprint`), the split's rendered pairs (their token ids and reply masks:
:meth:`memfit.data.preference.PreferenceSplit.fingerprint`, which covers the data, the template and
``seq_len``) and the dtype policy, so a later run of the same pairs on the same weights reuses the file and any
change computes a new one. An interrupted pass resumes from ``<key>.partial.npz`` (written atomically every
:data:`SAVE_EVERY_S` seconds), and the finished file is written atomically: a reader never sees half of one.

TRL's ``precompute_ref_log_probs`` does the same in memory for one run (its cache keyed by the dataset's
fingerprint and a hash of the model); storing the result for later runs is an open request there (trl#3985).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memfit import distributed as dist_
from memfit.convert import weights_fingerprint
from memfit.errors import DataError
from memfit.step import sequence_logps

SAVE_EVERY_S = 60.0
"""Seconds between the partial results an interrupted pass resumes from."""
FORMAT_VERSION = 1


def reference_key(checkpoint_dir: str | Path, split_fingerprint: str, dtype: str) -> str:
    """The file name (without suffix) of a split's reference log-probabilities: sha256 hex of the checkpoint's
    weights fingerprint, the split's fingerprint, the dtype policy and the format version."""
    parts = (str(FORMAT_VERSION), weights_fingerprint(checkpoint_dir), split_fingerprint, dtype)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def default_reference_dir(data_path: str | Path) -> Path:
    """``.memfit_reference`` in the directory of the data file: the pairs' reference log-probabilities are kept
    beside the pairs."""
    return Path(data_path).expanduser().absolute().parent / ".memfit_reference"


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


def _save_npy(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    _atomic(path, write)


def _save_partial(path: Path, logps: np.ndarray, rounds: int) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, logps=logps, rounds=np.array(rounds))

    _atomic(path, write)


def load_reference(directory: Path, key: str, num_pairs: int) -> np.ndarray | None:
    """The stored log-probabilities of ``key``, ``(num_pairs, 2)`` float64, or ``None`` when there are none yet.

    Raises:
        DataError: the file is unreadable or holds another number of pairs (naming it: delete it to recompute).
    """
    path = directory / f"{key}.npy"
    if not path.is_file():
        return None
    try:
        table = np.load(path)
    except (OSError, ValueError) as exc:
        raise DataError(
            f"reference log-probabilities '{path}' cannot be read ({exc}); delete it to recompute"
        ) from None
    if table.shape != (num_pairs, 2) or not np.isfinite(table).all():
        raise DataError(
            f"reference log-probabilities '{path}' hold {table.shape} values, not ({num_pairs}, 2) finite ones; "
            "delete the file to recompute it"
        )
    return table


def precompute_reference(
    model: torch.nn.Module,
    split: Any,
    *,
    batch_size: int,
    device: torch.device,
    directory: Path,
    key: str,
    step_options: dict[str, Any],
    describe: dict[str, Any] | None = None,
    progress_bar: bool = False,
    label: str = "train",
) -> np.ndarray:
    """The reference log-probabilities of every pair of ``split``: read from ``directory`` when stored, else
    computed now with ``model`` (and stored).

    Sharded, every rank takes its own batch of each round (batch ``round * world + rank``; a rank past the last
    batch repeats it and its result is dropped), the results are summed over the ranks and rank 0 writes them.

    Args:
        model: the starting model, in the state the run starts from.
        split: a :class:`~memfit.data.preference.PreferenceSplit`.
        batch_size: pairs per forward (``2 * batch_size`` rows).
        device: where the model is.
        directory: where the files go (created).
        key: :func:`reference_key`.
        step_options: ``dtype`` and ``chunked_cross_entropy`` of the run (:func:`memfit.step.sequence_logps`).
        describe: what the side file ``<key>.json`` records for people (checkpoint, data, ...).
        progress_bar: show one.
        label: the split's name in messages.

    Returns:
        ``(len(split), 2)`` float64: each pair's ``[chosen, rejected]`` summed reply log-probability (nats).

    Raises:
        DataError: a stored file cannot be read or does not fit the split.
        OSError: the directory cannot be written (a full disk: the partial results written so far remain).
    """
    n = len(split)
    stored = load_reference(directory, key, n)
    if stored is not None:
        return stored
    main, world, rank = dist_.is_main(), dist_.world_size(), dist_.rank()
    partial = directory / f"{key}.partial.npz"
    logps = np.full((n, 2), np.nan, dtype=np.float64)
    start_round = 0
    if partial.is_file():
        with np.load(partial) as saved:
            if saved["logps"].shape == logps.shape:
                logps, start_round = saved["logps"].copy(), int(saved["rounds"])
    if main:
        directory.mkdir(parents=True, exist_ok=True)
    num_batches = -(-n // batch_size)
    num_rounds = -(-num_batches // world)
    options = {k: step_options[k] for k in ("dtype", "chunked_cross_entropy")}
    was_training = model.training
    model.eval()
    last_save = time.monotonic()
    bar = tqdm(
        total=num_rounds,
        initial=start_round,
        desc=f"reference log-probs ({label})",
        unit="round",
        disable=not (progress_bar and main),
        dynamic_ncols=True,
    )
    for r in range(start_round, num_rounds):
        b = min(r * world + rank, num_batches - 1)
        first = b * batch_size
        index = np.arange(first, min(first + batch_size, n))
        inputs, targets, _ = split.collate(index)
        got = sequence_logps(model, inputs.to(device), targets.to(device), **options).double()  # (2k,)
        k = len(index)
        mine = torch.full((world, batch_size, 2), 0.0, dtype=torch.float64, device=device)
        valid = torch.zeros((world, batch_size), dtype=torch.float64, device=device)
        if r * world + rank < num_batches:
            mine[rank, :k, 0], mine[rank, :k, 1] = got[:k], got[k:]
            valid[rank, :k] = 1.0
        mine, valid = dist_.all_reduce_sum(mine).cpu().numpy(), dist_.all_reduce_sum(valid).cpu().numpy()
        for w in range(world):
            bw = r * world + w
            if bw < num_batches:
                rows = np.arange(bw * batch_size, min(bw * batch_size + batch_size, n))
                logps[rows] = mine[w, : len(rows)]
        bar.update(1)
        if main and time.monotonic() - last_save > SAVE_EVERY_S and r + 1 < num_rounds:
            _save_partial(partial, logps, r + 1)
            last_save = time.monotonic()
    bar.close()
    model.train(was_training)
    if not np.isfinite(logps).all():
        bad = int((~np.isfinite(logps)).any(axis=1).sum())
        raise DataError(
            f"the reference model gave non-finite log-probabilities for {bad} {label} pair(s); check the "
            "checkpoint (and dtype) before training against it"
        )
    if main:
        _save_npy(directory / f"{key}.npy", logps)
        side = {"key": key, "pairs": n, "split": label, "format": FORMAT_VERSION, **(describe or {})}
        (directory / f"{key}.json").write_text(json.dumps(side, indent=1) + "\n", encoding="utf-8")
        partial.unlink(missing_ok=True)
    dist_.barrier()
    return logps
