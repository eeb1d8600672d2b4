"""Reference log-probabilities computed once, before training, and kept on disk: a full-weight DPO or IPO run then
holds one model, not the policy and a frozen copy of it.

The pass runs the starting model (the checkpoint, before any update) over every pair of a split, in file order,
without gradients, as the step computes a row's log-probability (:func:`memfit.step.sequence_logps`, chunked
when the run chunks its loss), and stores ``(num_pairs, 2)`` float64 ``[chosen, rejected]`` summed reply
log-probabilities as ``<reference_dir>/<key>.npy``. The key is a sha256 of the checkpoint's weight files
(every byte: :func:`checkpoint_digest`), the split's rendered pairs (their token ids and reply masks:
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
from memfit.convert import weight_files
from memfit.errors import DataError
from memfit.step import sequence_logps

SAVE_EVERY_S = 60.0
"""Seconds between the partial results an interrupted pass resumes from."""
FORMAT_VERSION = 1


def checkpoint_digest(checkpoint_dir: str | Path, cache: Path | None = None) -> str:
    """sha256 hex over a checkpoint's weight files and ``config.json``, every byte of them: the reference
    log-probabilities must change with any weight (a cheap fingerprint of a few MiB a file would miss an edit in
    the middle of one).

    Each file's own sha256 is kept in ``cache`` (a JSON file; ``None``: none) under its path, size and
    modification time, so a later run over unchanged files reads instead of hashing them again (hashing runs at
    about 1 GB/s: seconds for an 8B checkpoint).

    Raises:
        CheckpointError: ``checkpoint_dir`` is not a checkpoint (:func:`memfit.convert.detect_format`).
    """
    root = Path(checkpoint_dir)
    files = weight_files(root) + [f for f in (root / "config.json", root / "params.json") if f.is_file()]
    known = {}
    if cache is not None and cache.is_file():
        try:
            known = json.loads(cache.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            known = {}  # a damaged cache is only a cache
    digest, changed = hashlib.sha256(), False
    for file in files:
        st = file.stat()
        name = str(file.resolve())
        entry = known.get(name)
        if not (entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns):
            h = hashlib.sha256()
            with open(file, "rb") as f:
                while block := f.read(16 * 1024**2):
                    h.update(block)
            entry = known[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}
            changed = True
        digest.update(f"{file.name}:{st.st_size}:{entry['sha256']}\n".encode())
    if cache is not None and changed:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _atomic(cache, lambda tmp: tmp.write_text(json.dumps(known, indent=1) + "\n", encoding="utf-8"))
    return digest.hexdigest()


def reference_key(
    checkpoint_dir: str | Path, split_fingerprint: str, dtype: str, cache: Path | None = None
) -> str:
    """The file name (without suffix) of a split's reference log-probabilities: sha256 hex of the checkpoint's
    bytes (:func:`checkpoint_digest`, its per-file hashes kept in ``cache``), the split's fingerprint, the dtype
    policy and the format version."""
    parts = (str(FORMAT_VERSION), checkpoint_digest(checkpoint_dir, cache), split_fingerprint, dtype)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def default_reference_dir(data_path: str | Path) -> Path:
    """``.memfit_reference`` in the directory of the data file: the pairs' reference log-probabilities are kept
    beside the pairs."""
    return Path(data_path).expanduser().absolute().parent / ".memfit_reference"


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` a file aside, then rename it into place: a reader never sees half of one (the file aside is removed
    when either fails: a full disk, say)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _save_npy(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    _atomic(path, write)


def _save_partial(path: Path, logps: np.ndarray) -> None:
    """The pass's results so far (``NaN`` rows: not computed yet), written atomically."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, logps=logps)

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

    The pairs not computed yet (all, or those a partial file of an interrupted pass lacks) go in batches of
    ``batch_size``, in order. Sharded, every rank takes its own batch of each round (batch ``round * world +
    rank``; a rank past the last batch repeats it and its result is dropped), the results are summed over the
    ranks and rank 0 writes them. The pass runs eager (``torch.compiler.set_stance("force_eager")``), compiled
    layers or not.

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
    if main and partial.is_file():
        with np.load(partial) as saved:
            if saved["logps"].shape == logps.shape:
                logps = saved["logps"].copy()
        directory.mkdir(parents=True, exist_ok=True)
    elif main:
        directory.mkdir(parents=True, exist_ok=True)
    logps = dist_.from_main(logps)  # every rank resumes from rank 0's partial results
    # the pairs still to compute, in order: an interrupted pass resumes with the same batches (the same batch size)
    # or with any other batch size or number of ranks
    todo = np.flatnonzero(~np.isfinite(logps).all(axis=1))
    batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
    num_rounds = -(-len(batches) // world)
    options = {k: step_options[k] for k in ("dtype", "chunked_cross_entropy")}
    was_training = model.training
    model.eval()
    last_save = time.monotonic()
    bar = tqdm(
        total=len(todo),
        desc=f"reference log-probs ({label})",
        unit="pair",
        disable=not (progress_bar and main),
        dynamic_ncols=True,
    )
    # eager: a pass without gradients, once; compiling its graphs beside the step's gains nothing
    with torch.compiler.set_stance("force_eager"):
        for r in range(num_rounds):
            b = r * world + rank  # this rank's batch; past the last, it repeats the last and drops the result
            index = batches[min(b, len(batches) - 1)]
            inputs, targets, _ = split.collate(index)
            got = sequence_logps(model, inputs.to(device), targets.to(device), **options).double()  # (2k,)
            mine = torch.zeros((world, batch_size, 2), dtype=torch.float64, device=device)
            if b < len(batches):
                k = len(index)
                mine[rank, :k, 0], mine[rank, :k, 1] = got[:k], got[k:]
            mine = dist_.all_reduce_sum(mine).cpu().numpy()
            for w in range(world):
                if r * world + w < len(batches):
                    rows = batches[r * world + w]
                    logps[rows] = mine[w, : len(rows)]
                    bar.update(len(rows))
            if main and time.monotonic() - last_save > SAVE_EVERY_S and r + 1 < num_rounds:
                _save_partial(partial, logps)
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
        _atomic(directory / f"{key}.json", lambda tmp: tmp.write_text(json.dumps(side, indent=1) + "\n"))
        partial.unlink(missing_ok=True)
    dist_.barrier()
    return logps
