"""A run's data set-up: its tokenizer, and a pure function of the step that gives each step's batches.

Pretraining cuts random ``seq_len`` windows from a tokenized corpus (:mod:`memfit.data.corpus`); fine-tuning
renders instruction / chat records with a template (:mod:`memfit.data.instruct`). Either way the batches of a step
are a pure function of ``(seed, step, micro_step)``, so a resumed run sees exactly the batches it would have
seen, and N ranks draw their slices of one global batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from memfit import distributed as dist_
from memfit.config import TrainConfig
from memfit.convert import checkpoint_tokenizer
from memfit.data.corpus import TRAIN, VAL, Corpus, TokenWindows, batch_rng, prepare_corpus
from memfit.data.instruct import batch_position, prepare_instruct
from memfit.tokenizer import CharTokenizer, Tokenizer, load_tokenizer, train_bpe

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(inputs, targets, doc_ids)``: ``(B, T)`` int64 each; ``doc_ids`` is ``None`` unless samples are packed."""


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


def make_tokenizer(cfg: TrainConfig, train_text: str):
    """Build the tokenizer ``cfg.tokenizer`` asks for, from the training split only."""
    kind = cfg.tokenizer.kind
    if kind == "bpe":
        return train_bpe([train_text], cfg.tokenizer.vocab_size)
    if kind == "char":
        return CharTokenizer.from_text(train_text)
    return load_tokenizer(cfg.tokenizer.path)


def tokenizer_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The tokenizer settings that matter for ``cfg.tokenizer.kind`` (the cache and resume key)."""
    if cfg.checkpoint_dir is not None:
        return {"kind": "checkpoint", "path": str(cfg.checkpoint_dir)}
    tok = cfg.tokenizer
    extra = {"bpe": {"vocab_size": tok.vocab_size}, "file": {"path": tok.path}}.get(tok.kind, {})
    return {"kind": tok.kind, **extra}


def run_tokenizer(cfg: TrainConfig, out: Path, resume_dir: Path | None) -> tuple[Tokenizer, Corpus | None]:
    """The run's tokenizer, and for a text corpus its token files (tokenized once into ``out/data``).

    The tokenizer is the resumed run's, ``checkpoint_dir``'s, ``tokenizer.path``'s, or (``bpe``, ``char``) one
    made from the corpus's training split. Sharded, rank 0 tokenizes and writes the token files; the others then
    reuse them.

    Args:
        cfg: the run config.
        out: the run directory.
        resume_dir: the checkpoint being resumed, or ``None``.

    Returns:
        ``(tokenizer, corpus)``; ``corpus`` is ``None`` for instruction / chat records.

    Raises:
        DataError, CheckpointError, TokenizerError: the corpus or a tokenizer cannot be read.
    """
    fixed = None  # None: trained on the corpus (bpe, char)
    if resume_dir is not None:
        fixed = load_tokenizer(resume_dir / "tokenizer")
    elif cfg.checkpoint_dir is not None:
        fixed = checkpoint_tokenizer(cfg.checkpoint_dir)
    elif cfg.data.format != "text":
        fixed = load_tokenizer(cfg.tokenizer.path)
    if (
        dist_.is_main()
        and cfg.data.format == "text"
        and str(cfg.data.path or "").endswith((".json", ".jsonl"))
    ):
        tqdm.write(
            f"note: data.format is 'text', so '{cfg.data.path}' is read as plain text; for instruction or chat "
            f"records set data.format (alpaca, dolly, sharegpt, openai)"
        )
    if cfg.data.format != "text":
        return fixed, None
    if fixed is not None:
        make, load = (lambda _text: fixed), (lambda _d: fixed)
    else:
        make, load = (lambda text: make_tokenizer(cfg, text)), load_tokenizer
    if not dist_.is_main():  # rank 0 tokenizes and writes the token files; the others then reuse them
        dist_.barrier()
    tokenizer, corpus = prepare_corpus(
        cfg.data.path, cfg.data.val_fraction, make, out / "data", load, tokenizer_key=tokenizer_settings(cfg)
    )
    if dist_.is_main():
        dist_.barrier()
    return tokenizer, corpus


def run_data(cfg: TrainConfig, tokenizer: Tokenizer, corpus: Corpus | None, seq_len: int) -> RunData:
    """Where the run's batches come from: :func:`text_data` for a corpus, else :func:`instruct_data`."""
    if corpus is not None:
        return text_data(cfg, corpus, seq_len)
    return instruct_data(cfg, tokenizer, seq_len)


def text_data(cfg: TrainConfig, corpus, seq_len: int) -> RunData:
    """Random ``seq_len`` windows of a tokenized corpus (see :class:`~memfit.data.corpus.TokenWindows`)."""
    train_windows = TokenWindows(corpus.train_path, seq_len)
    val_windows = TokenWindows(corpus.val_path, seq_len)

    B, rank, world = cfg.batch_size, dist_.rank(), dist_.world_size()

    def train_batch(step: int, micro: int) -> Batch:
        # the global batch of world * B windows, drawn alike on every rank, of which this rank takes its B: so N
        # ranks with batch_size B train on exactly what one process with batch_size N * B does
        inputs, targets = train_windows.batch(world * B, batch_rng(cfg.seed, TRAIN, step, micro))
        return inputs[rank * B : (rank + 1) * B], targets[rank * B : (rank + 1) * B], None

    def val_batches() -> Iterator[Batch]:
        for i in range(cfg.eval_batches):
            inputs, targets = val_windows.batch(world * B, batch_rng(cfg.seed, VAL, i))
            yield inputs[rank * B : (rank + 1) * B], targets[rank * B : (rank + 1) * B], None

    return RunData(
        train_batch, val_batches, f"{corpus.train_tokens:,} train / {corpus.val_tokens:,} val tokens", seq_len
    )


def instruct_data(cfg: TrainConfig, tokenizer, seq_len: int) -> RunData:
    """Instruction / chat samples rendered with ``data.template`` (see :mod:`memfit.data.instruct`).

    Training batches walk seeded epoch permutations (see :func:`~memfit.data.instruct.batch_position`);
    validation batches walk the held-out samples once, in order, up to ``eval_batches`` batches.
    """
    d = cfg.data
    data = prepare_instruct(
        d.path,
        d.format,
        d.template,
        tokenizer,
        max_seq_len=seq_len,
        val_fraction=d.val_fraction,
        seed=cfg.seed,
        train_on_prompt=d.train_on_prompt,
        packing=d.packing,
        skip_malformed=d.skip_malformed,
        column_map=d.column_map or None,
    )

    def train_batch(step: int, micro: int) -> Batch:
        position = batch_position(
            step, micro, cfg.batch_size, cfg.gradient_accumulation_steps, dist_.rank(), dist_.world_size()
        )
        return data.train.batch(cfg.batch_size, position, cfg.seed)

    B, rank, world = cfg.batch_size, dist_.rank(), dist_.world_size()

    def val_batches() -> Iterator[Batch]:
        # global batches of world * B samples, of which this rank takes its B rows (see text_data)
        for batch in itertools.islice(data.val.epoch_batches(world * B), cfg.eval_batches):
            yield tuple(None if t is None else t[rank * B : (rank + 1) * B] for t in batch)

    stats = data.stats
    summary = (
        f"{stats.num_records:,} record{'s' * (stats.num_records != 1)} ({d.format}, template {d.template}): "
        f"{len(data.train):,} train / "
        f"{len(data.val):,} val {'rows' if d.packing else 'samples'}"
        + (f" ({stats.packing_efficiency:.0%} tokens, the rest padding)" if d.packing else "")
        + f", {stats.num_tokens:,} tokens ({stats.num_label_tokens:,} trained), {stats.num_truncated:,} truncated to "
        f"{seq_len + 1} tokens (of which {stats.num_dropped:,} dropped: no reply left), {stats.num_skipped:,} "
        f"malformed skipped"
    )
    longest = seq_len if d.packing else data.train.max_length  # padded to the batch's longest item
    return RunData(train_batch, val_batches, summary, longest)
