"""A run's data set-up: its tokenizer, and a pure function of the step that gives each step's batches.

Pretraining draws ``seq_len + 1``-token windows from a prepared token dataset (:mod:`memfit.data.tokens`; raw text
is prepared first, :mod:`memfit.data.prepare`); fine-tuning
renders instruction / chat records with a template (:mod:`memfit.data.instruct`). Either way the batches of a step
are a pure function of ``(seed, step, micro_step)``, so a resumed run sees exactly the batches it would have
seen, and N ranks draw their slices of one global batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memfit import distributed as dist_
from memfit import hub
from memfit.config import PrepareConfig, TrainConfig, load_prepare_config, show_progress
from memfit.convert import checkpoint_tokenizer
from memfit.data.instruct import InstructStats, batch_position, prepare_instruct
from memfit.data.preference import PreferenceData, prepare_preference
from memfit.data.prepare import empty_file_notes, prepare
from memfit.data.sources import default_corpus_path, source_tree
from memfit.data.templates import resolve_template, template_label, template_name
from memfit.data.tokens import TRAIN, VAL, TokenDataset, document_ids, is_dataset, read_manifest
from memfit.errors import ConfigError, DataError
from memfit.memory.ulysses import pad_batch, shard_batch
from memfit.tokenizer import Tokenizer, load_tokenizer

Batch = tuple[torch.Tensor | None, ...]
"""``(inputs, targets, doc_ids)``: ``(B, T)`` int64 each; ``doc_ids`` is ``None`` unless samples are packed. A
sequence-parallel rank's adds its tokens' ``positions`` (:func:`sequence_shards`)."""


@dataclass
class RunData:
    """Where a run's batches come from: text windows (pretraining) or instruction / chat samples.

    Both are pure functions of the step, so a resumed run sees exactly the batches it would have seen.
    """

    train_batch: Callable[[int, int], Batch]
    """``(step, micro_step) -> Batch`` on the CPU."""
    val_batches: Callable[[], Iterator[Batch]]
    """The fixed validation batches."""
    summary: str
    """One line for the start-of-run banner."""
    longest: int
    """Tokens per row of the widest training batch the data can produce (the worst case for memory)."""
    val_sources: dict[str, Callable[[], Iterator[Batch]]] = field(default_factory=dict)
    """A text dataset's fixed validation batches per source (``val_batches`` is then unused)."""
    val_empty_reason: str | None = None
    """Why there is nothing to validate on, naming the key that decides it (for the end-of-run message), e.g.
    ``no validation samples: data.val_fraction=0``; ``None`` when there is."""
    pairs: PreferenceData | None = None
    """Preference pairs (``data.format: preference``): their splits, whose reference log-probabilities the loop
    computes or reads (:mod:`memfit.reference`) and hands to :attr:`references`."""
    references: dict[str, np.ndarray] = field(default_factory=dict)
    """``"train"`` / ``"val"`` -> ``(pairs, 2)`` stored reference log-probabilities; each batch then carries its
    pairs' (``(inputs, targets, reference)``); empty: batches carry ``None``."""


def tokenizer_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The tokenizer settings that matter for ``cfg.tokenizer.kind`` (the cache and resume key)."""
    if cfg.checkpoint_dir is not None:
        return {"kind": "checkpoint", "path": str(cfg.checkpoint_dir)}
    tok = cfg.tokenizer
    extra = {"bpe": {"vocab_size": tok.vocab_size}, "file": {"path": tok.path}}.get(tok.kind, {})
    return {"kind": tok.kind, **extra}


def text_dataset_dir(cfg: TrainConfig, out: Path) -> Path:
    """The token dataset a text run trains on: ``data.path`` when it is a prepared dataset, else the run's own
    ``output_dir/data`` (prepared from the raw text)."""
    return Path(cfg.data.path) if is_dataset(cfg.data.path) else out / "data"


def _raw_sources(
    path: str | None, files: str | None = None, split: str | None = None
) -> dict[str, list[str]]:
    """The sources of raw text named by ``data.path``: Tiny Shakespeare (shipped) for ``None``; a directory of
    sub-directories is one source each (RedPajama's layout); any other file, directory or glob is one source named
    after it. A Hub dataset's snapshot (:func:`memfit.hub.resolve_run`), or a directory with ``data.files`` or
    ``data.split``, is one source of the files those select (:func:`memfit.hub.select_files`), named after the
    repo (or the directory)."""
    if path is None:
        return {"tinyshakespeare": [str(default_corpus_path())]}
    p = Path(path)
    if not p.exists() and not any(c in path for c in "*?["):
        raise DataError(
            f"corpus file '{p}' does not exist; point data.path at text, a directory or glob of it"
        )
    snapshot = hub.snapshot_repo(p) if p.is_dir() else None
    if snapshot is not None or (p.is_dir() and (files or split)):
        present = [f.relative_to(p).as_posix() for f in p.rglob("*") if f.is_file()]
        chosen = hub.select_files(present, files, split, hub.TEXT_SUFFIXES)
        if not chosen:
            raise DataError(
                f"data.path '{p}' holds no {', '.join(hub.TEXT_SUFFIXES)} file"
                + (f" that data.files={files!r} and data.split={split!r} select" if files or split else "")
            )
        label = snapshot[1].rpartition("/")[2] if snapshot is not None else p.name
        name = re.sub(r"[^A-Za-z0-9_-]+", "_", label).strip("_") or "text"
        return {name: [str(p / c) for c in chosen]}
    if p.is_dir() and any(d.is_dir() for d in p.iterdir()) and not any(f.is_file() for f in p.iterdir()):
        return source_tree(p)
    name = re.sub(r"[^A-Za-z0-9_-]+", "_", p.name.split(".")[0]).strip("_") or "text"
    return {name: [str(p)]}


def _prepare_settings(cfg: TrainConfig, directory: Path) -> PrepareConfig:
    """How a run prepares its raw text: the tokenizer its settings ask for, ``data.val_fraction``, every core."""
    tok = cfg.tokenizer
    if cfg.checkpoint_dir is not None:
        given = cfg.checkpoint_dir
    elif tok.kind == "file":
        given = tok.path
    else:
        given = None
    return load_prepare_config(
        [],
        out=str(directory),
        tokenizer=given,
        vocab_size=tok.vocab_size,
        char_tokenizer=given is None and tok.kind == "char",
        val_fraction=cfg.data.val_fraction,
        skip_malformed=cfg.data.skip_malformed,
    )


def run_tokenizer(cfg: TrainConfig, out: Path, resume_dir: Path | None) -> tuple[Tokenizer, dict | None]:
    """The run's tokenizer, and for text its prepared token dataset's manifest (prepared now when ``data.path`` is
    raw text: once, into ``output_dir/data``; a later run or a resume reuses it).

    Sharded, rank 0 prepares the dataset; the others then read it.

    Args:
        cfg: the run config.
        out: the run directory.
        resume_dir: the checkpoint being resumed, or ``None``.

    Returns:
        ``(tokenizer, manifest)``; ``manifest`` is ``None`` for instruction / chat records.

    Raises:
        DataError: the text cannot be prepared, or the dataset's tokenizer is not the one of the checkpoint the
            run starts from or resumes (checked before anything is allocated).
        CheckpointError, TokenizerError: a tokenizer cannot be read.
    """
    fixed = None  # the tokenizer the run is bound to, when it is not made from the text
    if resume_dir is not None:
        fixed = load_tokenizer(resume_dir / "tokenizer")
    elif cfg.checkpoint_dir is not None:
        fixed = checkpoint_tokenizer(cfg.checkpoint_dir)
    elif cfg.data.format != "text" or cfg.tokenizer.kind == "file":
        fixed = load_tokenizer(cfg.tokenizer.path)
    if cfg.data.format != "text":
        return fixed, None
    directory = text_dataset_dir(cfg, out)
    if not is_dataset(cfg.data.path):
        if dist_.is_main():
            settings = _prepare_settings(cfg, directory)
            # a new run in this output_dir owns its data/: settings of an earlier run there are replaced
            sources = _raw_sources(cfg.data.path, cfg.data.files, cfg.data.split)
            result = prepare(
                settings, sources, progress_bar=show_progress(cfg.progress_bar), replace=resume_dir is None
            )
            if result.prepared:
                tqdm.write(f"prepared {result.manifest['tokens']:,} tokens into '{directory}'")
                for note in empty_file_notes(result.manifest):
                    tqdm.write(note)
        dist_.barrier()  # the other ranks read what rank 0 prepared
    manifest = read_manifest(directory)
    tokenizer = load_tokenizer(directory / "tokenizer")
    if fixed is not None and fixed.fingerprint() != tokenizer.fingerprint():
        if resume_dir is not None:
            what, where = "the resumed run", resume_dir / "tokenizer"
        elif cfg.checkpoint_dir is not None:
            what, where = f"checkpoint_dir '{cfg.checkpoint_dir}'", cfg.checkpoint_dir
        else:
            what, where = f"tokenizer.path '{cfg.tokenizer.path}'", cfg.tokenizer.path
        raise DataError(
            f"the dataset '{directory}' was prepared with another tokenizer than {what} (fingerprints "
            f"{tokenizer.fingerprint()} and {fixed.fingerprint()}); prepare it with --tokenizer {where} so that "
            f"its token ids mean what the model learned"
        )
    return (fixed or tokenizer), manifest


def run_data(
    cfg: TrainConfig, tokenizer: Tokenizer, manifest: dict | None, seq_len: int, out: Path
) -> RunData:
    """Where the run's batches come from: :func:`text_data` for a token dataset, :func:`preference_data` for
    preference pairs, else :func:`instruct_data`."""
    if manifest is not None:
        data = text_data(cfg, text_dataset_dir(cfg, out), manifest, seq_len)
    elif cfg.data.format == "preference":
        return preference_data(cfg, tokenizer, seq_len)  # never sequence-parallel (config validation)
    else:
        data = instruct_data(cfg, tokenizer, seq_len)
    return tensor_parallel_padding(sequence_shards(data, cfg.distributed.sequence_parallel), cfg)


def tensor_parallel_padding(data: RunData, cfg: TrainConfig) -> RunData:
    """``data`` whose rows are padded at the end to a multiple of ``distributed.tensor_parallel`` tokens
    (:func:`memfit.memory.ulysses.pad_batch`: the padding counts nowhere), as tensor parallelism's sequence split
    of the residual stream needs (instruction batches are as long as their longest sample). Unchanged for T = 1 or
    a single process."""
    tp = cfg.distributed.tensor_parallel
    if tp == 1 or dist_.world_size() == 1:
        return data
    return map_batches(data, lambda b: pad_batch(b, tp))


def map_batches(data: RunData, change: Callable[[Batch], Batch]) -> RunData:
    """``data`` with ``change`` applied to every batch it gives: the training batches and every validation
    source's (what a rank of a sequence- or tensor-parallel group sees of its group's rows)."""

    def changed(batches: Callable[[], Iterator[Batch]]) -> Callable[[], Iterator[Batch]]:
        return lambda: (change(b) for b in batches())

    return dataclasses.replace(
        data,
        train_batch=lambda step, micro: change(data.train_batch(step, micro)),
        val_batches=changed(data.val_batches),
        val_sources={name: changed(batches) for name, batches in data.val_sources.items()},
    )


def sequence_shards(data: RunData, sequence_parallel: int) -> RunData:
    """``data`` as a rank of a sequence-parallel group sees it: every batch its slice of the group's rows
    (:func:`memfit.memory.ulysses.shard_batch`: inputs and targets of its ``T / N`` tokens, the whole rows'
    document ids, its tokens' positions). Unchanged for N = 1 or a single process."""
    sp = sequence_parallel
    if sp == 1 or dist_.world_size() == 1:
        return data
    rank = dist_.sequence_rank(sp)
    return map_batches(data, lambda b: shard_batch(b, rank, sp))


def text_data(cfg: TrainConfig, directory: Path, manifest: dict, seq_len: int) -> RunData:
    """Windows of ``seq_len + 1`` tokens of a prepared dataset (see :class:`~memfit.data.tokens.TokenDataset`).

    Sequence ``n`` of the run (global batches of ``world_size * batch_size`` sequences, in order) draws its source
    by ``data.weights`` and a window of it without replacement, keyed by the seed and ``n``
    (:meth:`~memfit.data.tokens.TokenDataset.sequence`); each rank takes its ``batch_size`` rows of each global
    batch. Validation draws ``eval_batches`` fixed batches from every source's held-out
    documents.

    Raises:
        ConfigError: ``data.weights`` names a source the dataset does not have; ``cross_document_attention: false``
            with a tokenizer that has no BOS/EOS separators.
        DataError: a shard is missing or truncated; a weighted source is shorter than one window.
    """
    names = list(manifest["sources"])
    for name in cfg.data.weights:
        if name not in names:
            raise ConfigError(
                f"config key 'data.weights.{name}': the dataset '{directory}' has no source {name!r}; its sources "
                f"are {', '.join(names)}"
            )
    tok = manifest["tokenizer"]
    if not cfg.data.cross_document_attention and tok["bos_id"] is None and tok["eos_id"] is None:
        raise ConfigError(
            "config key 'data.cross_document_attention': the dataset's tokenizer has no BOS or EOS token, so "
            "documents cannot be told apart in a window; leave it true or prepare with a tokenizer that has them"
        )
    train = TokenDataset(directory, "train", seq_len, cfg.data.weights or None, manifest)
    val = TokenDataset(directory, "val", seq_len, None, manifest)
    group = dist_.ranks_per_batch(cfg)  # a sequence- or tensor-parallel group shares its rows
    B, rank, world = cfg.batch_size, dist_.data_rank(group), dist_.data_world_size(group)
    G = world * B  # the global batch: the same sequences on any number of ranks

    def rows(batch: int) -> range:
        """This rank's sequence numbers in global batch number ``batch`` of the run."""
        first = batch * G + rank * B
        return range(first, first + B)

    def with_doc_ids(inputs: torch.Tensor, targets: torch.Tensor) -> Batch:
        if cfg.data.cross_document_attention:
            return inputs, targets, None
        return inputs, targets, document_ids(inputs, tok["bos_id"], tok["eos_id"])

    def train_batch(step: int, micro: int) -> Batch:
        inputs, targets, _ = train.batch(
            cfg.seed, TRAIN, rows(step * cfg.gradient_accumulation_steps + micro)
        )
        return with_doc_ids(inputs, targets)

    def source_batches(source: int) -> Callable[[], Iterator[Batch]]:
        def batches() -> Iterator[Batch]:
            for i in range(cfg.eval_batches):
                inputs, targets, _ = val.batch(cfg.seed, VAL, rows(i), source=source)
                yield with_doc_ids(inputs, targets)

        return batches

    val_sources = {
        name: source_batches(i)
        for i, (name, stream) in enumerate(zip(val.names, val.streams, strict=True))
        if stream.num_tokens >= seq_len + 1
    }
    short = [n for n in val.names if n not in val_sources]
    key = "data.val_fraction" if not is_dataset(cfg.data.path) else "memfit prepare's val_fraction"
    reason = None
    if manifest["settings"].get("val_fraction") == 0:
        reason = f"no validation windows: the dataset holds out no text ({key}=0)"
    elif not val_sources:
        held = ", ".join(f"{n} {s.num_tokens:,}" for n, s in zip(val.names, val.streams, strict=True))
        reason = (
            f"no validation windows: every source holds fewer validation tokens than one window of seq_len + 1 = "
            f"{seq_len + 1} ({held}); lower seq_len or hold out more with {key}"
        )
    weights = {n: float(w) for n, w in zip(train.names, train.weights, strict=True)}
    mixture = ", ".join(f"{n} {w:.1%}" for n, w in weights.items()) if len(weights) > 1 else names[0]
    if short and val_sources:  # the banner says it (and, for none at all, the reason)
        mixture += (
            f"; no val_loss for {', '.join(short)}: fewer validation tokens than one window of {seq_len + 1}"
        )
    summary = f"{train.num_tokens:,} train / {val.num_tokens:,} val tokens ({mixture})"
    return RunData(train_batch, lambda: iter(()), summary, seq_len, val_sources, reason)


def instruct_data(cfg: TrainConfig, tokenizer, seq_len: int) -> RunData:
    """Instruction / chat samples rendered with ``data.template`` (see :mod:`memfit.data.instruct`; ``auto``: the
    tokenizer's chat template, which a checkpoint's tokenizer directory holds, else ``alpaca``).

    Training batches walk seeded epoch permutations (see :func:`~memfit.data.instruct.batch_position`);
    validation batches walk the held-out samples once, in order, up to ``eval_batches`` batches.
    """
    d = cfg.data
    template = resolve_template(d.template, tokenizer)
    data = prepare_instruct(
        d.path,
        d.format,
        template,
        tokenizer,
        max_seq_len=seq_len,
        val_fraction=d.val_fraction,
        seed=cfg.seed,
        train_on_prompt=d.train_on_prompt,
        packing=d.packing,
        skip_malformed=d.skip_malformed,
        column_map=d.column_map or None,
        length_fix=_length_fix(cfg),
    )

    group = dist_.ranks_per_batch(cfg)  # a sequence- or tensor-parallel group shares its rows
    B, rank, world = cfg.batch_size, dist_.data_rank(group), dist_.data_world_size(group)

    def train_batch(step: int, micro: int) -> Batch:
        position = batch_position(step, micro, cfg.batch_size, cfg.gradient_accumulation_steps, rank, world)
        return data.train.batch(cfg.batch_size, position, cfg.seed)

    def val_batches() -> Iterator[Batch]:
        # global batches of world * B samples, of which this rank takes its B rows (see text_data)
        for batch in itertools.islice(data.val.epoch_batches(world * B), cfg.eval_batches):
            yield tuple(None if t is None else t[rank * B : (rank + 1) * B] for t in batch)

    stats = data.stats
    summary = (
        f"{stats.num_records:,} record{'s' * (stats.num_records != 1)} ({d.format}, template "
        f"{template_label(d.template, template)}): "
        f"{len(data.train):,} train / "
        f"{len(data.val):,} val {'rows' if d.packing else 'samples'}"
        + (f" ({stats.packing_efficiency:.0%} tokens, the rest padding)" if d.packing else "")
        + f", {stats.num_tokens:,} tokens ({stats.num_label_tokens:,} trained), {stats.num_truncated:,} truncated to "
        f"{seq_len + 1} tokens (of which {stats.num_dropped:,} dropped: no reply left), {stats.num_skipped:,} "
        f"malformed skipped"
    )
    longest = seq_len if d.packing else data.train.max_length  # padded to the batch's longest item
    return RunData(
        train_batch,
        val_batches,
        summary,
        longest,
        val_empty_reason=_val_empty_reason(cfg, stats, seq_len, template_name(template)),
    )


def preference_data(cfg: TrainConfig, tokenizer, seq_len: int) -> RunData:
    """Preference pairs rendered with ``data.template`` (:mod:`memfit.data.preference`): each micro-batch is
    ``(inputs, targets, reference)``, its ``2B`` rows the B pairs' chosen replies then their rejected ones, and
    ``reference`` their stored reference log-probabilities (``(2B,)`` fp32, once :attr:`RunData.references` has
    them) or ``None``. Training walks seeded epoch permutations of the pairs as :func:`instruct_data` walks samples;
    validation walks the held-out pairs once, in order."""
    d = cfg.data
    template = resolve_template(d.template, tokenizer)
    pairs = prepare_preference(
        d.path,
        template,
        tokenizer,
        max_seq_len=seq_len,
        val_fraction=d.val_fraction,
        seed=cfg.seed,
        skip_malformed=d.skip_malformed,
        column_map=d.column_map or None,
        length_fix=_length_fix(cfg),
    )
    B, rank, world = cfg.batch_size, dist_.data_rank(), dist_.data_world_size()
    references: dict[str, np.ndarray] = {}

    def with_reference(split: str, batch: tuple) -> Batch:
        inputs, targets, index = batch
        table = references.get(split)
        if table is None:
            return inputs, targets, None
        rows = table[index.numpy()]  # (B, 2): [chosen, rejected] of each pair
        return inputs, targets, torch.from_numpy(np.concatenate([rows[:, 0], rows[:, 1]]).astype(np.float32))

    def train_batch(step: int, micro: int) -> Batch:
        position = batch_position(step, micro, B, cfg.gradient_accumulation_steps, rank, world)
        return with_reference("train", pairs.train.batch(B, position, cfg.seed))

    def val_batches() -> Iterator[Batch]:
        # global batches of world * B pairs, of which this rank takes its B (see text_data); a rank left without
        # a pair in the last one runs pair 0 uncounted (its fourth element, which pairs count: none), so that every
        # rank runs as many forwards (sharded, each is a collective)
        for start in itertools.islice(range(0, len(pairs.val), world * B), cfg.eval_batches):
            index = np.arange(start + rank * B, min(start + (rank + 1) * B, len(pairs.val)))
            counted = torch.ones(len(index), dtype=torch.bool)
            if not len(index):
                index, counted = np.zeros(1, dtype=np.int64), torch.zeros(1, dtype=torch.bool)
            yield (*with_reference("val", pairs.val.collate(index)), counted)

    s = pairs.stats
    summary = (
        f"{s.num_records:,} record{'s' * (s.num_records != 1)} (preference, template "
        f"{template_label(d.template, template)}): {s.num_train_pairs:,} train / {s.num_val_pairs:,} val pairs, "
        f"{s.num_tokens:,} tokens ({s.num_label_tokens:,} in replies), {s.num_truncated:,} truncated to "
        f"{seq_len + 1} tokens, {s.num_dropped:,} dropped (no reply left), "
        f"{s.num_malformed + s.num_template_skipped:,} malformed skipped"
    )
    reason = None
    if not len(pairs.val):
        reason = (
            "no validation pairs: data.val_fraction=0"
            if d.val_fraction == 0
            else f"no validation pairs: the {s.num_val_records} held out by data.val_fraction={d.val_fraction:g} "
            "were dropped or skipped"
        )
    return RunData(
        train_batch, val_batches, summary, pairs.train.max_length, val_empty_reason=reason, pairs=pairs,
        references=references,
    )  # fmt: skip


def _length_fix(cfg: TrainConfig) -> str:
    """What lengthens the samples of a run: ``seq_len``, or where it is 0 (the model's own ``max_seq_len``)
    ``model_args.max_seq_len``; a checkpoint's ``max_seq_len`` is fixed."""
    if cfg.seq_len:
        ceiling = "the checkpoint's max_seq_len" if cfg.checkpoint_dir else "the model's max_seq_len"
        return f"raise seq_len, at most {ceiling}"
    if cfg.checkpoint_dir is None:
        return "seq_len is 0, the model's max_seq_len: raise model_args.max_seq_len"
    return "seq_len is 0, already the checkpoint's max_seq_len: shorten the records"


def _val_empty_reason(cfg: TrainConfig, stats: InstructStats, seq_len: int, template: str) -> str | None:
    """Why instruction data has no validation sample, naming the key that decides it; ``None`` when it has."""
    if stats.num_val_samples:
        return None
    vf = cfg.data.val_fraction
    if vf == 0:
        return "no validation samples: data.val_fraction=0"
    if stats.num_val_records == 0:
        return (
            f"no validation samples: data.val_fraction={vf:g} holds out none of 1 record (it takes 2 or more)"
        )
    held, dropped = stats.num_val_records, stats.num_val_dropped
    causes = []
    if dropped:
        causes.append(
            f"{dropped} had no reply token left after truncation to {seq_len + 1} tokens ({_length_fix(cfg)})"
        )
    if held - dropped:
        causes.append(f"{held - dropped} skipped: template {template} cannot render their roles")
    return (
        f"no validation samples: the {held} record{'s' * (held != 1)} data.val_fraction={vf:g} held out "
        f"{'were all' if held != 1 else 'was'} dropped: " + "; ".join(causes)
    )
