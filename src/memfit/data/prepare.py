"""``memfit prepare``: raw text sources -> a prepared token dataset (the format of :mod:`memfit.data.tokens`), once,
independent of any run.

Plan of work:

1. **Check everything first**: the sources' files exist and have known formats, the tokenizer loads, and the
   output directory is empty, an interrupted prepare of the same settings, or the same dataset (then a run is a
   no-op, or prepares only files that were added or changed). Then each source's validation split is decided
   (:mod:`memfit.data.split`: the hash, with a minimum of held-out text per source), reading a little of each
   source (all of a small one): a bad record or an empty source found there stops it here. Nothing is written
   before these checks pass. A prepare that then stops on its input (a bad record further on) removes the dataset
   it began (``out`` was missing or empty); interrupted, or on a full disk, it keeps its work to continue from.
2. **The tokenizer**: the one given (a tokenizer file, or a Hugging Face / memfit checkpoint directory), or a
   byte-level BPE trained on a bounded sample of the training documents (``tokenizer_sample_bytes``, read in
   source and file order). Saved into ``tokenizer/`` with its fingerprint.
3. **Units of work**: one per input file. A unit streams its file's documents (a long one in pieces, cut where
   the tokenizer's ids do not change) with their split (:mod:`memfit.data.sources`: a hash of each record's
   text, the tail of a ``.txt``), encodes them in batches of about 1 MiB of text with the tokenizer's batch
   encoder (a long piece in calls of at most :data:`ENCODE_CHARS`), and appends ``[BOS] ids [EOS]`` to the
   split's current shard as token arrays (``ids [EOS]`` for a tokenizer that reads text without BOS,
   :attr:`memfit.tokenizer.Tokenizer.add_bos`). A shard pair (``NAME-k.train.bin``, ``NAME-k.val.bin``)
   closes at the first piece boundary that would take the training shard past ``shard_tokens``; its sidecar
   ``NAME-k.json`` (written after both shards are in place) records the input pieces it covers. After a SIGKILL
   the finished pairs are kept (when ``NAME.writing.json``, written before them, says they are of the same file
   and split): the unit skips the pieces they cover and redoes only the pair it was writing. A unit's
   ``NAME.json`` index marks it done. Memory is bounded by a batch of text per worker, whatever the corpus
   size and whatever the size of one document.
4. **Fan-out**: the units run in ``workers`` processes through datatrove's ``LocalPipelineExecutor`` (Hugging Face's
   data-processing library); ``num_nodes`` / ``node_rank`` give each machine a disjoint block of the units, all
   writing into one shared directory (see docs/data.md). A unit's output depends on its file alone, so the bytes
   are the same whatever the number of workers or machines. An advisory lock per unit keeps two processes off the
   same unit (for example a worker that outlived a killed run).
5. **The manifest**: when every unit is done, ``manifest.json`` (sources, documents and tokens per source, split,
   file and shard, the files that gave no document, the tokenizer and its fingerprint, the settings, the format
   version) is written atomically, and a table per source is printed, with a note for each empty file.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from memfit import storage
from memfit.config import PrepareConfig
from memfit.convert import checkpoint_tokenizer, detect_format
from memfit.data.sources import InputFile, Piece, ReadCounts, read_pieces, resolve_sources
from memfit.data.split import no_text, source_splits
from memfit.data.tokens import FORMAT, MANIFEST, SPLITS, VERSION, token_dtype
from memfit.errors import DataError, MemfitError, TokenizerError, WriteError
from memfit.tokenizer import CharTokenizer, Tokenizer, load_tokenizer, train_bpe

STATE_DIR = ".prepare"
"""Where an unfinished prepare keeps its settings and the executor's logs."""
BATCH_CHARS = 1 << 20
"""Characters of text encoded in one batch (bounds a worker's memory)."""
ENCODE_CHARS = 1 << 18
"""A longer piece of a document is encoded in parts of at most this many characters, cut where the tokenizer
allows (:meth:`~memfit.tokenizer.Tokenizer.cut`): what bounds the tokenizer's own memory (about 150 bytes per
character of one call for a Hugging Face tokenizer)."""


# ----------------------------------------------------------------------------------------------------------------
# Settings and the output directory
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    """One input file, the name its shards and index take in the source's directory, and its source's split."""

    file: InputFile
    name: str
    val_hash_max: int | None = None
    """Its source's minimum of held-out text (:class:`~memfit.data.split.SourceSplit`); ``None``: the hash alone."""

    @property
    def source(self) -> str:
        return self.file.source


def unit_name(f: InputFile) -> str:
    """``<file name>-<8 hex digits of the path's hash>``: stable when other files are added, distinct for files of
    the same name in different directories."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f.path.name)
    return f"{stem}-{hashlib.sha256(str(f.path).encode()).hexdigest()[:8]}"


def dataset_key(cfg: PrepareConfig, tokenizer_fingerprint: str | None) -> dict[str, Any]:
    """What makes two prepared datasets the same: the settings that change the bytes and the tokenizer (the input
    files are not part of it: files may be added to a dataset)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": cfg.tokenizer,
        "tokenizer_fingerprint": tokenizer_fingerprint,
        "vocab_size": cfg.vocab_size if cfg.tokenizer is None else None,
        "char_tokenizer": cfg.char_tokenizer,
        "tokenizer_sample_bytes": cfg.tokenizer_sample_bytes if cfg.tokenizer is None else None,
        "val_fraction": cfg.val_fraction,
        "text_field": cfg.text_field,
        "shard_tokens": cfg.shard_tokens,
        "skip_malformed": cfg.skip_malformed,
    }


def _write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (aside, then renamed into place; the file aside is removed if that fails)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _comparable(key: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in key.items() if k != "tokenizer_fingerprint"}


def check_output_dir(out: Path, key: dict[str, Any]) -> str:
    """What ``out`` holds: ``new`` (missing or empty), ``resume`` (an unfinished prepare of these settings) or
    ``existing`` (a finished dataset of these settings).

    Raises:
        DataError: ``out`` is a file, holds something that is not a prepared dataset, or holds a dataset prepared
            with other settings (nothing in it is changed).
    """
    if not out.exists():
        return "new"
    if not out.is_dir():
        raise DataError(f"--out '{out}' is a file; give a directory for the prepared dataset")
    if all(p.name == STATE_DIR for p in out.iterdir()) and not (out / STATE_DIR / "settings.json").exists():
        return "new"  # empty, or another machine's prepare has just begun
    saved = _read_json(out / STATE_DIR / "settings.json")
    if saved is None:
        manifest = _read_json(out / MANIFEST)
        saved = manifest.get("settings") if isinstance(manifest, dict) else None
    if not isinstance(saved, dict):
        raise DataError(
            f"--out '{out}' is not empty and holds no prepared dataset; choose an empty or new directory "
            f"(nothing was changed)"
        )
    if _comparable(saved) != _comparable(key):
        differ = sorted(k for k in key if k != "tokenizer_fingerprint" and saved.get(k) != key[k])
        raise DataError(
            f"--out '{out}' already holds a different dataset (prepared with other {', '.join(differ)}); choose "
            f"another directory, or delete it to prepare it anew (nothing was changed)"
        )
    return "existing" if (out / MANIFEST).is_file() else "resume"


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------------------------


def load_given_tokenizer(path: str) -> Tokenizer:
    """A tokenizer file, a directory of tokenizer files, or a Hugging Face / Meta / memfit checkpoint directory.

    Raises:
        DataError: nothing usable is there.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"tokenizer '{path}' does not exist; give a tokenizer file or a checkpoint directory")
    try:
        if p.is_dir():
            try:
                detect_format(p)
            except Exception:  # a directory of tokenizer files, not a checkpoint
                return load_tokenizer(p)
            return checkpoint_tokenizer(p)
        return load_tokenizer(p)
    except (OSError, ValueError, TokenizerError) as exc:
        raise DataError(f"tokenizer '{path}' cannot be loaded: {exc}") from None


def _training_sample(units: list[Unit], cfg: PrepareConfig) -> Iterator[str]:
    """Training documents (never validation ones), in source and file order, up to ``tokenizer_sample_bytes``."""
    budget = cfg.tokenizer_sample_bytes
    for unit in units:
        for piece in _pieces(unit, cfg, ReadCounts()):
            if piece.split == "val":
                continue
            yield piece.text[:budget]
            budget -= len(piece.text)
            if budget <= 0:
                return


def make_tokenizer(units: list[Unit], cfg: PrepareConfig) -> Tokenizer:
    """The dataset's tokenizer: ``cfg.tokenizer`` loaded, or one made from a bounded sample of the training
    documents (a byte-level BPE of ``vocab_size`` ids, or with ``char_tokenizer`` one id per character)."""
    if cfg.tokenizer is not None:
        return load_given_tokenizer(cfg.tokenizer)
    if cfg.char_tokenizer:
        return CharTokenizer.from_text("".join(_training_sample(units, cfg)))
    return train_bpe(_training_sample(units, cfg), cfg.vocab_size)


# ----------------------------------------------------------------------------------------------------------------
# One unit: an input file -> shard pairs
# ----------------------------------------------------------------------------------------------------------------


def _pieces(
    unit: Unit, cfg: PrepareConfig, counts: ReadCounts, tokenizer: Tokenizer | None = None
) -> Iterator[Piece]:
    return read_pieces(
        unit.file,
        val_fraction=cfg.val_fraction,
        text_field=cfg.text_field,
        skip_malformed=cfg.skip_malformed,
        counts=counts,
        val_hash_max=unit.val_hash_max,
        cut=None if tokenizer is None else tokenizer.cut,
    )


@contextlib.contextmanager
def _unit_lock(directory: Path, name: str) -> Iterator[None]:
    """An advisory lock on one unit, released when this process ends however it ends."""
    with open(directory / f".{name}.lock", "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


class _ShardPair:
    """The training and validation shards being written for one unit, appended to on disk as batches arrive."""

    def __init__(self, directory: Path, unit: str, index: int, dtype: np.dtype) -> None:
        self.directory, self.unit, self.index, self.dtype = directory, unit, index, dtype
        self.files = {split: directory / f"{unit}-{index:05d}.{split}.bin" for split in SPLITS}
        self.handles = {split: open(self._tmp(split), "wb") for split in SPLITS}
        self.tokens = dict.fromkeys(SPLITS, 0)
        self.documents = dict.fromkeys(SPLITS, 0)

    def _tmp(self, split: str) -> Path:
        return self.files[split].with_name(self.files[split].name + ".tmp")

    def write(self, split: str, ids: np.ndarray, starts: bool) -> None:
        self.handles[split].write(ids.tobytes())
        self.tokens[split] += len(ids)
        self.documents[split] += int(starts)

    def close(self, input_pieces_end: int) -> dict[str, Any]:
        """Put both shards in place, then the sidecar that marks the pair finished."""
        for split in SPLITS:
            fh = self.handles[split]
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(self._tmp(split), self.files[split])
        record = {
            "index": self.index,
            "input_pieces_end": input_pieces_end,
            "shards": [
                {
                    "file": self.files[s].name,
                    "split": s,
                    "tokens": self.tokens[s],
                    "documents": self.documents[s],
                }
                for s in SPLITS
            ],
        }
        _write_json(self.directory / f"{self.unit}-{self.index:05d}.json", record)
        return record

    def abandon(self) -> None:
        for split in SPLITS:
            try:
                self.handles[split].close()  # flushes: fails again on a full disk
            except OSError:
                pass
            self._tmp(split).unlink(missing_ok=True)


def _finished_pairs(directory: Path, unit: str, dtype: np.dtype) -> list[dict[str, Any]]:
    """The shard pairs of a unit that a previous, interrupted run finished (consecutive from 0, intact)."""
    pairs = []
    while True:
        record = _read_json(directory / f"{unit}-{len(pairs):05d}.json")
        if not isinstance(record, dict):
            return pairs
        for shard in record["shards"]:
            path = directory / shard["file"]
            if not path.is_file() or path.stat().st_size != shard["tokens"] * dtype.itemsize:
                return pairs
        pairs.append(record)


def _remove_unit_files(directory: Path, unit: str, keep: int) -> None:
    """Remove a unit's index and its shard pairs from number ``keep`` on (and any temporary file)."""
    (directory / f"{unit}.json").unlink(missing_ok=True)
    pattern = re.compile(rf"^{re.escape(unit)}-(\d{{5}})\.")
    for path in directory.iterdir():
        match = pattern.match(path.name)
        if match and (int(match.group(1)) >= keep or path.name.endswith(".tmp")):
            path.unlink(missing_ok=True)
        elif path.name.startswith(f".{unit}") and ".tmp-" in path.name:  # a JSON write a killed run left
            path.unlink(missing_ok=True)


def unit_done(directory: Path, unit: Unit) -> dict[str, Any] | None:
    """The index of a finished unit whose input file and split are unchanged, or None (an index written before
    the per-source minimum has no ``val_hash_max``: the hash alone)."""
    index = _read_json(directory / f"{unit.name}.json")
    if (
        isinstance(index, dict)
        and index.get("input") == unit.file.fingerprint()
        and index.get("val_hash_max") == unit.val_hash_max
    ):
        return index
    return None


class _UnitWriter:
    """Routes a unit's documents, encoded in batches, into its shard pairs."""

    def __init__(
        self,
        directory: Path,
        unit: str,
        tokenizer: Tokenizer,
        shard_tokens: int,
        finished: list[dict[str, Any]],
        progress: Callable[[int, int, int], None] | None,
    ) -> None:
        self.directory, self.unit, self.tokenizer, self.shard_tokens = (
            directory,
            unit,
            tokenizer,
            shard_tokens,
        )
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.bos = tokenizer.bos_id if tokenizer.add_bos else None  # as the model will read a prompt
        self.eos = tokenizer.eos_id
        self.pairs = finished
        self.consumed = finished[-1]["input_pieces_end"] if finished else 0  # input documents in closed pairs
        self.pair = _ShardPair(directory, unit, len(self.pairs), self.dtype)
        self.pending: list[Piece] = []  # not encoded yet
        self.pending_chars = 0
        self.progress = progress

    def add(self, piece: Piece) -> None:
        self.pending.append(piece)
        self.pending_chars += len(piece.text)
        if self.pending_chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> int:
        """Encode the pending pieces and append them; returns their tokens. A piece that continues a document is
        encoded on its own (:meth:`~memfit.tokenizer.Tokenizer.encode_continuation`), the others in one batch."""
        if not self.pending:
            return 0
        batched = [p.text for p in self.pending if not p.continues and len(p.text) <= ENCODE_CHARS]
        fresh = iter(self.tokenizer.encode_batch(batched))
        tokens = 0
        for piece in self.pending:
            if piece.continues or len(piece.text) > ENCODE_CHARS:
                array = self._array(self._encode_long(piece), piece)
            else:
                array = self._array([np.asarray(next(fresh), dtype=self.dtype)], piece)
            train = self.pair.tokens["train"]
            if piece.split == "train" and train and train + len(array) > self.shard_tokens:
                self.pairs.append(self.pair.close(input_pieces_end=self.consumed))
                self.pair = _ShardPair(self.directory, self.unit, len(self.pairs), self.dtype)
            self.pair.write(piece.split, array, piece.starts)
            self.consumed += 1
            tokens += len(array)
        if self.progress is not None:
            self.progress(len(self.pending), tokens, 0)
        self.pending, self.pending_chars = [], 0
        return tokens

    def _encode_long(self, piece: Piece) -> list[np.ndarray]:
        """The ids of a piece that continues its document or is long, encoded in parts of at most
        :data:`ENCODE_CHARS` where the tokenizer can be cut (whole where it cannot)."""
        tok, text, start = self.tokenizer, piece.text, 0
        parts = []
        while len(text) - start > ENCODE_CHARS:
            at = tok.cut(text[start : start + ENCODE_CHARS], piece.offset + start)
            if at == 0:
                break
            part = text[start : start + at]
            ids = tok.encode_continuation(part) if piece.continues or start else tok.encode(part)
            parts.append(np.asarray(ids, dtype=self.dtype))
            start += at
        rest = text[start:]
        ids = tok.encode_continuation(rest) if piece.continues or start else tok.encode(rest)
        return [*parts, np.asarray(ids, dtype=self.dtype)]

    def _array(self, parts: list[np.ndarray], piece: Piece) -> np.ndarray:
        """``[BOS] ids [EOS]`` (each separator where the piece starts / ends its document, and the tokenizer has
        it) as one token array."""
        bos = [np.asarray([self.bos], self.dtype)] if piece.starts and self.bos is not None else []
        eos = [np.asarray([self.eos], self.dtype)] if piece.ends and self.eos is not None else []
        return np.concatenate([*bos, *parts, *eos]) if bos or eos or len(parts) > 1 else parts[0]

    def finish(self) -> list[dict[str, Any]]:
        """Write what is pending and close the last pair (left out when it is empty and others exist)."""
        self.flush()
        if any(self.pair.tokens.values()) or not self.pairs:
            self.pairs.append(self.pair.close(input_pieces_end=self.consumed))
        else:
            self.pair.abandon()
        return self.pairs

    def abandon(self) -> None:
        self.pair.abandon()


def prepare_unit(
    unit: Unit,
    out: Path,
    cfg: PrepareConfig,
    tokenizer: Tokenizer,
    progress: Callable[[int, int, int], None] | None = None,
) -> dict[str, Any]:
    """Tokenize one input file into its shard pairs and write its index (see the module docstring, 3).

    Args:
        unit: the file and its name.
        out: the dataset directory.
        cfg: the prepare settings.
        tokenizer: the dataset's tokenizer.
        progress: called with ``(documents, tokens, input bytes)`` done since the last call.

    Returns:
        The unit's index: ``input`` (the file's fingerprint), ``documents`` / ``tokens`` per split, ``skipped``
        (malformed records skipped), ``pairs`` (the shard pairs' records), ``val_hash_max`` (its source's split).

    Raises:
        DataError: a bad record (unless ``skip_malformed``), naming its file and line.
    """
    directory = out / unit.source
    directory.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    with _unit_lock(directory, unit.name):
        done = unit_done(directory, unit)
        if done is not None:  # another process finished it while this one waited for the lock
            return done
        # the pairs an interrupted run finished are kept when they are of this file and split: the marker it
        # wrote before its first pair says so (a changed file, or another split of its source, starts anew)
        writing, state = directory / f"{unit.name}.writing.json", _unit_state(unit)
        finished = _finished_pairs(directory, unit.name, dtype) if _read_json(writing) == state else []
        _remove_unit_files(directory, unit.name, keep=len(finished))
        if _read_json(writing) != state:
            _write_json(writing, state)
        writer = _UnitWriter(directory, unit.name, tokenizer, cfg.shard_tokens, finished, progress)
        skip, counts, position = writer.consumed, ReadCounts(), 0
        try:
            for number, piece in enumerate(_pieces(unit, cfg, counts, tokenizer)):
                if progress is not None and counts.position - position >= BATCH_CHARS:
                    progress(0, 0, counts.position - position)
                    position = counts.position
                if number < skip:  # in a pair a previous run finished
                    continue
                writer.add(piece)
            pairs = writer.finish()
        except BaseException:
            writer.abandon()
            raise
        if progress is not None:
            progress(0, 0, unit.file.size - position)
        index = {
            "input": unit.file.fingerprint(),
            "documents": {
                s: sum(sh["documents"] for p in pairs for sh in p["shards"] if sh["split"] == s)
                for s in SPLITS
            },
            "tokens": {
                s: sum(sh["tokens"] for p in pairs for sh in p["shards"] if sh["split"] == s) for s in SPLITS
            },
            "skipped": counts.skipped,
            "first_skipped": counts.first_skipped,
            "pairs": pairs,
            "val_hash_max": unit.val_hash_max,
        }
        _write_json(directory / f"{unit.name}.json", index)
        writing.unlink(missing_ok=True)
        return index


def _unit_state(unit: Unit) -> dict[str, Any]:
    """What a unit's shard pairs are made of: its input file and its source's split."""
    return {"input": unit.file.fingerprint(), "val_hash_max": unit.val_hash_max}


# ----------------------------------------------------------------------------------------------------------------
# The whole corpus
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PrepareResult:
    """What :func:`prepare` did."""

    out: Path
    manifest: dict[str, Any] | None
    """The manifest, or None while units of other machines are not done yet."""
    units: int
    """Units of this machine."""
    prepared: int
    """Units prepared by this call (0: it was a no-op)."""
    seconds: float


class _Progress:
    """Documents, tokens and input bytes done, summed over worker processes (a manager's dict), shown as a
    tqdm bar over the input bytes with documents/s and tokens/s."""

    def __init__(self, total_bytes: int, enabled: bool, shared: Any) -> None:
        self.shared = shared
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="prepare",
            disable=not enabled,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        self.start = time.perf_counter()

    def callback(self) -> Callable[[int, int, int], None]:
        shared = self.shared

        def report(documents: int, tokens: int, nbytes: int) -> None:
            key = os.getpid()
            d, t, b = shared.get(key, (0, 0, 0))
            shared[key] = (d + documents, t + tokens, b + nbytes)

        return report

    def refresh(self) -> None:
        values = list(self.shared.values())
        docs, tokens, nbytes = (sum(v[i] for v in values) for i in range(3))
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.n = min(nbytes, self.bar.total)
        self.bar.set_postfix_str(
            f"{docs / elapsed:,.0f} docs/s, {tokens / elapsed:,.0f} tokens/s", refresh=False
        )
        self.bar.refresh()

    def close(self) -> None:
        self.refresh()
        self.bar.close()


def _quiet_datatrove() -> None:
    """datatrove logs every task to stderr (through loguru); the progress bar and the summary say what matters."""
    from loguru import logger  # deferred: datatrove's logger, imported with it

    logger.disable("datatrove")


class _UnitTask:
    """What datatrove runs for each task (rank ``r``): prepare unit ``r``. A class, so the worker processes
    receive it by reference."""

    def __init__(self, units: list[Unit], out: Path, cfg: PrepareConfig, report: Callable | None) -> None:
        self.units, self.out, self.cfg, self.report = units, out, cfg, report

    def __setstate__(self, state: dict[str, Any]) -> None:
        _quiet_datatrove()  # in a worker process, before the executor logs anything of this task
        self.__dict__.update(state)

    def __call__(self, _data: Any, rank: int = 0, world_size: int = 1) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
        tokenizer = load_tokenizer(self.out / "tokenizer")
        prepare_unit(self.units[rank], self.out, self.cfg, tokenizer, self.report)


def _progress_manager() -> Any:
    """A ``multiprocess`` manager for the workers' shared progress counters. Imported only when units fan out
    over several workers: ``multiprocess`` comes with datatrove, which a one-process prepare (a run's own data on
    a machine without datatrove, such as the lent GPU machine) does without."""
    import multiprocess  # deferred: with datatrove, only for a fan-out

    return multiprocess.Manager()


def _run_units(
    units: list[Unit], cfg: PrepareConfig, out: Path, first: int, count: int, report: Callable
) -> None:
    """Prepare units ``[first, first + count)`` in ``cfg.workers`` processes with datatrove's local executor."""
    from datatrove.executor import LocalPipelineExecutor  # deferred: only memfit prepare fans out

    _quiet_datatrove()
    executor = LocalPipelineExecutor(
        pipeline=[_UnitTask(units, out, cfg, report)],
        tasks=len(units),
        workers=min(cfg.workers, count),
        logging_dir=str(out / STATE_DIR / "executor"),
        skip_completed=False,  # our unit indexes say what is done (they survive files being added)
        local_tasks=count,
        local_rank_offset=first,
    )
    executor.run()


def _dataset_tokenizer(
    out: Path, units: list[Unit], cfg: PrepareConfig, given: Tokenizer | None
) -> Tokenizer:
    """The tokenizer in ``out/tokenizer``: kept from an earlier or concurrent prepare of the same settings, else
    made (or the given one) and put in place atomically; when another machine put its own there first, that one
    is used (a trained BPE is deterministic, so they are the same)."""
    directory = out / "tokenizer"
    if (directory / "tokenizer_config.json").is_file():
        return load_tokenizer(directory)
    tokenizer = given if given is not None else make_tokenizer(units, cfg)
    tmp = out / STATE_DIR / f"tokenizer.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer.save(tmp)
    try:
        os.rename(tmp, directory)
    except OSError:  # another machine was first
        shutil.rmtree(tmp, ignore_errors=True)
        theirs = load_tokenizer(directory)
        if theirs.fingerprint() != tokenizer.fingerprint():
            raise DataError(
                f"'{directory}' holds another tokenizer than this prepare makes; prepare anew"
            ) from None
        return theirs
    return tokenizer


def prepare(
    cfg: PrepareConfig, sources: dict[str, list[str]], *, progress_bar: bool = True, replace: bool = False
) -> PrepareResult:
    """Prepare a token dataset in ``cfg.out`` from ``sources``: :func:`_prepare`, and when it fails:

    - interrupted (Ctrl-C, SIGTERM; SIGKILL leaves it as it is) or a failed write (disk full, quota, permissions,
      reported as a :class:`~memfit.errors.WriteError` that names the path): the finished shards and the settings
      are kept, and the same command continues from them;
    - stopped by its input (a bad record, an empty source: a :class:`~memfit.errors.MemfitError`), which the same
      command would meet again: a dataset this call began on one machine (``cfg.out`` was missing or empty) is
      removed, so that the command can be run again with other input or settings; an earlier run's dataset,
      complete or partial, keeps what it had, and the files this call finished.

    The shards being written are removed in every case (``*.bin.tmp``)."""
    made: list[tuple[Path, bool]] = []
    try:
        return _prepare(cfg, sources, progress_bar=progress_bar, replace=replace, made=made)
    except BaseException as exc:
        _remove_partial_shards(Path(cfg.out).expanduser().absolute())
        if not isinstance(exc, Exception):
            raise
        error = storage.os_error_of(exc)
        if isinstance(exc, MemfitError) and not isinstance(exc, WriteError) and made:
            _remove_made(*made[0])
            out = Path(cfg.out).expanduser().absolute()
            what = (
                f"--out '{out}' is removed (this prepare made it)"
                if made[0][1]
                else f"'{out}' is empty again"
            )
            raise type(exc)(f"{exc}; {what}") from None
        if error is None or isinstance(exc, MemfitError):
            raise
        raise WriteError(
            storage.write_failure(
                "the dataset",
                Path(cfg.out).expanduser().absolute(),
                error,
                "the shards finished so far are kept, and the same command continues from them",
                "--out",
                partial="No partial shard was left behind",
            )
        ) from None


def _remove_made(directory: Path, itself: bool) -> None:
    """Remove what a failed prepare made: ``directory`` (``itself``) or its contents."""
    if itself:
        shutil.rmtree(directory, ignore_errors=True)
        return
    for path in directory.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _remove_partial_shards(out: Path) -> None:
    """Delete the shards being written (``*.bin.tmp``) of every unit no live process is working on: what workers
    stopped by a failure elsewhere (their pool is terminated) left. A unit another process (or machine) holds
    the lock of is left alone."""
    if not out.is_dir():
        return
    for directory in (d for d in out.iterdir() if d.is_dir() and d.name != STATE_DIR):
        for lock in directory.glob(".*.lock"):
            unit = lock.name[1 : -len(".lock")]
            with open(lock, "a+") as fh:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue
                for partial in directory.glob(f"{glob.escape(unit)}-*.tmp"):
                    partial.unlink(missing_ok=True)
                fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare(
    cfg: PrepareConfig,
    sources: dict[str, list[str]],
    *,
    progress_bar: bool = True,
    replace: bool = False,
    made: list[tuple[Path, bool]] | None = None,
) -> PrepareResult:
    """Prepare a token dataset in ``cfg.out`` from ``sources`` (see the module docstring).

    Args:
        cfg: the settings (validated).
        sources: source name -> paths, directories or globs.
        progress_bar: show the progress bar (stderr) and the summary table (stdout).
        replace: when ``cfg.out`` holds a dataset of other settings, delete it and prepare anew (a run's own
            ``output_dir/data``, which the run's settings own) instead of refusing.
        made: receives ``(directory, itself)`` when this call starts a new dataset on one machine: the directory
            it creates (the topmost missing one of ``cfg.out``'s path), or ``cfg.out`` when that was empty
            (``itself`` False: only its contents are this call's).

    Returns:
        The :class:`PrepareResult`.

    Raises:
        DataError: a missing or unreadable input, a bad record, an empty source, a tokenizer that cannot be
            loaded, an output directory holding something else; checked before anything is written where it can be.
    """
    start = time.perf_counter()
    out = Path(cfg.out).expanduser().absolute()
    files = resolve_sources(sources)
    given = load_given_tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else None
    key = dataset_key(cfg, given.fingerprint() if given is not None else None)
    try:
        state = check_output_dir(out, key)
    except DataError:
        if not (replace and (out / STATE_DIR / "settings.json").is_file()):
            raise
        shutil.rmtree(out)  # the run's own data of earlier settings
        state = "new"
    splits = source_splits(files, cfg, _read_json(out / MANIFEST) if state == "existing" else None)
    noted = set()
    for name, split in splits.items():  # at once, before the heavy work
        if (note := split.note(name, cfg.val_fraction)) is not None:
            tqdm.write(note)
            noted.add(name)
    units = [Unit(f, unit_name(f), splits[name].val_hash_max) for name in sorted(files) for f in files[name]]
    if given is not None and cfg.tokenizer is not None:
        key["tokenizer"] = str(Path(cfg.tokenizer).expanduser().absolute())
    if state == "new" and cfg.num_nodes == 1 and made is not None:
        top = out
        while not top.parent.exists():
            top = top.parent
        made.append((top, not out.exists()))
    (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    if state == "new":  # first: another machine starting on the same directory then sees these settings
        _write_json(out / STATE_DIR / "settings.json", key)
    tokenizer = _dataset_tokenizer(out, units, cfg, given)
    key["tokenizer_fingerprint"] = tokenizer.fingerprint()
    if given is not None and given.fingerprint() != key["tokenizer_fingerprint"]:
        raise DataError(f"--out '{out}' holds a dataset of another tokenizer than '{cfg.tokenizer}'")
    if _read_json(out / STATE_DIR / "settings.json") != key:
        _write_json(out / STATE_DIR / "settings.json", key)

    # --- this machine's units --------------------------------------------------------------------------------
    per_node = -(-len(units) // cfg.num_nodes)
    first = min(cfg.node_rank * per_node, len(units))
    mine = units[first : first + per_node]
    todo = [u for u in mine if unit_done(out / u.source, u) is None]
    if todo:
        manager = _progress_manager() if cfg.workers > 1 and len(todo) > 1 else None
        shared = manager.dict() if manager is not None else {}
        bar = _Progress(sum(u.file.size for u in todo), progress_bar, shared)
        try:
            if manager is None:  # one process: no executor needed
                for unit in todo:
                    prepare_unit(unit, out, cfg, tokenizer, bar.callback())
                    bar.refresh()
            else:
                done = threading.Event()
                worker_error: list[BaseException] = []

                def run() -> None:
                    try:
                        _run_units(units, cfg, out, first, len(mine), bar.callback())
                    except BaseException as exc:  # reported in the main thread
                        worker_error.append(exc)
                    finally:
                        done.set()

                thread = threading.Thread(target=run, daemon=True)
                thread.start()
                while not done.wait(0.5):
                    bar.refresh()
                thread.join()
                if worker_error and not isinstance(worker_error[0], Exception):
                    raise worker_error[0]  # KeyboardInterrupt, SystemExit
                # a worker's error is raised again below, in this process, with its file and line
        finally:
            bar.close()
            if manager is not None:
                manager.shutdown()
        missing = [u for u in todo if unit_done(out / u.source, u) is None]
        for unit in missing:  # a worker failed: go on here, which raises its error with the file and line
            prepare_unit(unit, out, cfg, tokenizer)
    # --- the manifest, once every unit (of every machine) is done ---------------------------------------------
    manifest = None
    if all(unit_done(out / u.source, u) is not None for u in units):
        manifest = build_manifest(out, units, tokenizer, key)
        if _read_json(out / MANIFEST) != manifest:
            _write_json(out / MANIFEST, manifest)
        for name, src in manifest["sources"].items():  # what the notes above could not know (a .txt tail)
            if cfg.val_fraction > 0 and not src["val"]["tokens"] and name not in noted:
                tqdm.write(
                    f"note: source '{name}' holds no validation tokens (val_fraction={cfg.val_fraction:g}); a run "
                    f"reports no val_loss/{name}"
                )
    return PrepareResult(out, manifest, len(mine), len(todo), time.perf_counter() - start)


def build_manifest(out: Path, units: list[Unit], tokenizer: Tokenizer, key: dict[str, Any]) -> dict[str, Any]:
    """The manifest of a dataset whose units are all done (see :mod:`memfit.data.tokens`)."""
    sources: dict[str, Any] = {}
    for unit in units:
        index = unit_done(out / unit.source, unit)
        src = sources.setdefault(
            unit.source,
            {
                "documents": 0,
                "tokens": 0,
                "skipped": 0,
                "files": [],
                "empty_files": [],
                "shards": [],
                "val_hash_max": unit.val_hash_max,
                **{s: {"documents": 0, "tokens": 0} for s in SPLITS},
            },
        )
        for s in SPLITS:
            src[s]["documents"] += index["documents"][s]
            src[s]["tokens"] += index["tokens"][s]
        src["documents"] += sum(index["documents"].values())
        src["tokens"] += sum(index["tokens"].values())
        src["skipped"] += index["skipped"]
        documents = sum(index["documents"].values())
        src["files"].append(
            {
                **unit.file.fingerprint(),
                "unit": unit.name,
                "documents": documents,
                "tokens": sum(index["tokens"].values()),
            }
        )
        if documents == 0:
            src["empty_files"].append(str(unit.file.path))
        src["shards"] += [sh for pair in index["pairs"] for sh in pair["shards"] if sh["tokens"]]
    for name, src in sources.items():
        if src["tokens"] == 0:
            raise no_text(name, [f["path"] for f in src["files"]])
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "tokenizer": {
            "kind": tokenizer.kind,
            "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id if tokenizer.add_bos else None,  # the separators the shards hold
            "eos_id": tokenizer.eos_id,
            "fingerprint": tokenizer.fingerprint(),
        },
        "settings": key,
        "documents": sum(s["documents"] for s in sources.values()),
        "tokens": sum(s["tokens"] for s in sources.values()),
        "sources": sources,
    }


def empty_file_notes(manifest: dict[str, Any]) -> list[str]:
    """A line for each input file that gave no document (the manifest lists it under its source's
    ``empty_files``, and its ``files`` entry counts 0 documents)."""
    return [
        f"note: source '{name}': '{path}' holds no document (it is empty, or holds only blank lines, empty texts "
        f"or skipped records); it adds nothing to the dataset"
        for name, s in manifest["sources"].items()
        for path in s.get("empty_files", [])
    ]


def summary_table(manifest: dict[str, Any]) -> str:
    """One row per source: documents, tokens (train / val), share of the tokens, shards, skipped records; then a
    note for each input file that gave no document (:func:`empty_file_notes`)."""
    total = max(manifest["tokens"], 1)
    rows = [("source", "documents", "tokens", "train tokens", "val tokens", "share", "shards", "skipped")]
    for name, s in manifest["sources"].items():
        rows.append(
            (
                name,
                f"{s['documents']:,}",
                f"{s['tokens']:,}",
                f"{s['train']['tokens']:,}",
                f"{s['val']['tokens']:,}",
                f"{s['tokens'] / total:.1%}",
                f"{len(s['shards']):,}",
                f"{s['skipped']:,}",
            )
        )
    rows.append(("all", f"{manifest['documents']:,}", f"{manifest['tokens']:,}", "", "", "100.0%", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    table = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    return "\n".join(table + empty_file_notes(manifest))
