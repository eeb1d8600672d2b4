"""Instruction and chat data: records -> conversations -> prompt templates with exact loss masks -> batches.

Three stages, each a function of its inputs alone:

1. :func:`load_conversations` reads a ``.json`` file (a list of records, or one record as an object) or a
   ``.jsonl`` file (one record per line, blank lines ignored) in one of :data:`memfit.data_formats.INSTRUCT_FORMATS` and
   turns every record into a conversation: a list of messages ``{"role": "system" | "user" | "assistant",
   "content": str}``. Alpaca and Dolly records become ``[user, assistant]``; a non-empty ``input`` (Dolly's
   ``context``) rides on the user message as an extra ``"input"`` key, so the ``alpaca`` template can render
   its ``### Input:`` section (the chat templates append it to the user's text after a blank line).
2. :func:`memfit.data.templates.encode_conversation` renders a conversation with one of
   :data:`memfit.data_formats.TEMPLATES` (or the checkpoint's own), with exact loss masks: see
   :mod:`memfit.data.templates`.
3. :func:`prepare_instruct` loads, splits (a seeded random validation fraction of the records), encodes, truncates
   to ``max_seq_len + 1`` tokens and optionally packs the samples, returning :class:`InstructData`. Each
   :class:`InstructSplit` serves batches as a pure function of their position in an endless stream of seeded
   epochs, so a resumed run sees exactly the batches the uninterrupted run would have.

A sample of ``n`` tokens trains the model on input ``ids[:-1]`` against target ``labels[1:]`` (next-token shift);
that is why samples hold up to ``max_seq_len + 1`` tokens. Packed rows concatenate the shifted (input, target)
pairs of several samples into exactly ``max_seq_len`` positions and carry ``doc_ids`` so that ``Decoder.forward``
keeps attention inside each sample and restarts its positions: a packed row computes what its samples would alone.

Record indices in error messages count from 0 (the position in the JSON list, or among the non-blank lines of a
JSONL file); line numbers count from 1.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.records import load_records
from memfit.data.templates import Template, encode_conversation, specials_for, template_name
from memfit.data_formats import INSTRUCT_FORMATS
from memfit.errors import DataError
from memfit.memory.techniques import IGNORE_INDEX

log = logging.getLogger(__name__)

# Names of a padding token, tried in order when the tokenizer has no ``pad_id``.
_PAD_NAMES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


# ----------------------------------------------------------------------------------------------------------------
# Splits and batches


def pad_token_id(tokenizer: Any) -> int:
    """The id that pads inputs: the tokenizer's ``pad_id`` or a pad special token if any, else EOS, else 0.

    Padded positions never reach the loss (their targets are :data:`IGNORE_INDEX`) and, padding being at the
    right end of a row (or its own packed sample), never influence a real token; the choice is cosmetic.
    """
    pad = getattr(tokenizer, "pad_id", None)
    if pad is not None:
        return int(pad)
    specials = tokenizer.special_tokens
    for name in _PAD_NAMES:
        if name in specials:
            return specials[name]
    return tokenizer.eos_id if tokenizer.eos_id is not None else 0


def batch_position(
    step: int,
    micro_step: int,
    batch_size: int,
    gradient_accumulation_steps: int,
    rank: int = 0,
    world_size: int = 1,
) -> int:
    """Position of the first sample of one micro-batch in the stream of :meth:`InstructSplit.batch`.

    Consecutive micro-batches of a step, and the ranks within each, take consecutive disjoint slices of the
    stream, so one step consumes ``batch_size * gradient_accumulation_steps * world_size`` samples.

    Args:
        step: Optimizer step, from 0.
        micro_step: Micro-batch within the step, ``[0, gradient_accumulation_steps)``.
        batch_size: Samples (or packed rows) per micro-batch.
        gradient_accumulation_steps: Micro-batches per step.
        rank: This process's rank.
        world_size: Number of data-parallel processes.

    Returns:
        The position.
    """
    return ((step * gradient_accumulation_steps + micro_step) * world_size + rank) * batch_size


class EpochStream:
    """Items served as an endless stream of seeded epochs: the order logic :class:`InstructSplit` and
    :class:`memfit.data.preference.PreferenceSplit` share.

    Item ``p`` of the stream is item ``order(p // N, seed)[p % N]`` of the ``N = len(self)`` items, so a batch is a
    pure function of ``(batch_size, position, seed)``. A subclass defines ``__len__`` and names its items in
    :attr:`item_name` (for the error an empty split raises).
    """

    item_name = "items"

    def __init__(self) -> None:
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        raise NotImplementedError

    def num_batches(self, batch_size: int) -> int:
        """Batches of ``batch_size`` in one epoch, the last possibly partial: ``ceil(len(self) / batch_size)``."""
        return math.ceil(len(self) / batch_size)

    def order(self, epoch: int, seed: int | None) -> np.ndarray:
        """(N,) item indices in the order epoch ``epoch`` visits them.

        Args:
            epoch: Epoch number, from 0.
            seed: ``None`` for the identity order, else ``numpy.random.default_rng([seed, epoch]).permutation``.

        Returns:
            The permutation (a cached array; do not modify).
        """
        if seed is None:
            return np.arange(len(self))
        key = (seed, epoch)
        if key not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key] = np.random.default_rng([seed, epoch]).permutation(len(self))
        return self._perms[key]

    def indices(self, batch_size: int, position: int, seed: int | None) -> np.ndarray:
        """(batch_size,) int64 item indices of the batch whose first item is at ``position`` of the stream.

        Raises:
            ValueError: ``batch_size < 1`` or ``position < 0``.
            DataError: The split is empty.
        """
        if batch_size < 1 or position < 0:
            raise ValueError(f"batch_size must be >= 1 and position >= 0, got {batch_size} and {position}")
        n = len(self)
        if n == 0:
            raise DataError(
                f"this split holds no {self.item_name}; cannot draw a batch (is data.val_fraction 0?)"
            )
        out = np.empty(batch_size, dtype=np.int64)
        for j, p in enumerate(range(position, position + batch_size)):
            epoch, k = divmod(p, n)
            out[j] = self.order(epoch, seed)[k]
        return out


class InstructSplit(EpochStream):
    """The samples (or packed rows) of one split, served as padded batches.

    Item ``k`` holds model inputs and targets of the same length (``ids[:-1]`` and ``labels[1:]`` of a sample; or
    a packed row of exactly ``max_seq_len``) and, when packed, the row's ``doc_ids``. Items are stored as flat
    int32 arrays with offsets.

    Args:
        inputs: Per item, (n,) input ids.
        targets: Per item, (n,) target ids, :data:`IGNORE_INDEX` where not trained.
        doc_ids: ``None`` (unpacked), or per item (n,) sample numbers ``0, 1, 2, ...`` (packed rows).
        pad_id: Id that right-pads inputs to the longest item of a batch.
        num_tokens: Non-pad input tokens, when the items hold padding (packed rows); ``None`` counts every
            position.

    Attributes:
        packed: Whether items are packed rows.
        num_tokens: Input tokens of all items, padding excluded.
        num_label_tokens: Targets that are trained (not :data:`IGNORE_INDEX`).
        pad_id: As given.
    """

    item_name = "samples"

    def __init__(
        self,
        inputs: Sequence[np.ndarray],
        targets: Sequence[np.ndarray],
        doc_ids: Sequence[np.ndarray] | None,
        pad_id: int,
        num_tokens: int | None = None,
    ) -> None:
        lengths = np.array([len(x) for x in inputs], dtype=np.int64)
        if len(targets) != len(inputs) or any(len(t) != n for t, n in zip(targets, lengths, strict=False)):
            raise ValueError("every item needs inputs and targets of the same length")
        self.packed = doc_ids is not None
        self.pad_id = int(pad_id)
        self._offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self._lengths = lengths

        def flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
            return np.concatenate(arrays).astype(np.int32) if len(arrays) else np.zeros(0, np.int32)

        self._inputs, self._targets = flat(inputs), flat(targets)
        self._doc_ids = flat(doc_ids) if doc_ids is not None else None
        self.num_tokens = int(lengths.sum()) if num_tokens is None else num_tokens
        self.num_label_tokens = int((self._targets != IGNORE_INDEX).sum())
        super().__init__()

    @property
    def max_length(self) -> int:
        """Tokens of the longest item (0 for an empty split): the widest batch this split can produce."""
        return int(self._lengths.max()) if len(self._lengths) else 0

    def __len__(self) -> int:
        """Number of items: samples, or packed rows."""
        return len(self._lengths)

    @property
    def lengths(self) -> np.ndarray:
        """(N,) int64 input length of each item."""
        return self._lengths.copy()

    def batch(
        self, batch_size: int, position: int, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The batch whose first item is at ``position`` of an endless stream of epochs.

        Item ``p`` of the stream is item ``order(p // N, seed)[p % N]``; a batch may run across an epoch boundary.
        The result depends only on ``(batch_size, position, seed)``, so training resumes exactly.

        Args:
            batch_size: Items per batch ``B``.
            position: Index of the batch's first item in the stream (see :func:`batch_position`).
            seed: Shuffle seed; ``None`` for file order in every epoch (validation).

        Returns:
            ``(inputs, targets, doc_ids)``: int64 tensors of shape ``(B, T)``, ``T`` the longest item of the batch
            (``max_seq_len`` when packed); inputs right-padded with ``pad_id``, targets with
            :data:`IGNORE_INDEX`. ``doc_ids`` is ``(B, T)`` for packed splits (pass it to ``Decoder.forward``) and
            ``None`` otherwise.

        Raises:
            ValueError: ``batch_size < 1`` or ``position < 0``.
            DataError: The split is empty.
        """
        return self.collate(self.indices(batch_size, position, seed))

    def collate(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Stack the given items into one right-padded batch (as :meth:`batch` returns)."""
        indices = np.asarray(indices, dtype=np.int64)
        T = int(self._lengths[indices].max())
        B = len(indices)
        inputs = np.full((B, T), self.pad_id, dtype=np.int64)  # (B, T)
        targets = np.full((B, T), IGNORE_INDEX, dtype=np.int64)  # (B, T)
        docs = np.zeros((B, T), dtype=np.int64) if self._doc_ids is not None else None  # (B, T)
        for row, k in enumerate(indices):
            a, b = self._offsets[k], self._offsets[k + 1]
            inputs[row, : b - a] = self._inputs[a:b]
            targets[row, : b - a] = self._targets[a:b]
            if docs is not None:
                docs[row, : b - a] = self._doc_ids[a:b]
        return (
            torch.from_numpy(inputs),
            torch.from_numpy(targets),
            None if docs is None else torch.from_numpy(docs),
        )

    def epoch_batches(
        self, batch_size: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Every item once, in file order, in batches of ``batch_size`` (the last may be smaller): for evaluation.

        Yields:
            As :meth:`batch`.
        """
        for start in range(0, len(self), batch_size):
            yield self.collate(np.arange(start, min(start + batch_size, len(self))))

    def fingerprint(self) -> str:
        """The sha256 hex digest of the items: their offsets, input ids, targets (the label mask included, as
        :data:`IGNORE_INDEX`) and doc ids, in item order.

        Splits that feed a model the same tokens against the same targets share it; it keys what is computed from
        them (a preference run's reference log-probs). Padding and ``pad_id`` do not enter it.
        """
        h = hashlib.sha256()
        arrays = (
            ("offsets", self._offsets, "<i8"),
            ("inputs", self._inputs, "<i4"),
            ("targets", self._targets, "<i4"),
            ("doc_ids", self._doc_ids, "<i4"),
        )
        for name, array, dtype in arrays:
            if array is not None:
                h.update(f"{name}:{len(array)}:".encode())
                h.update(np.ascontiguousarray(array, dtype=dtype).tobytes())
        return h.hexdigest()


@dataclass
class InstructStats:
    """What :func:`prepare_instruct` did, over both splits.

    Attributes:
        num_records: Valid records loaded (malformed ones excluded).
        num_skipped: Malformed records skipped: at loading, or whose roles the template cannot render.
        num_truncated: Samples longer than ``max_seq_len + 1`` tokens, cut to that length.
        num_dropped: Samples left with no trained target after truncation, dropped.
        num_train_samples: Samples in the training split (before packing).
        num_val_samples: Samples in the validation split (before packing).
        num_tokens: Model input tokens of the kept samples, padding excluded (``len(ids) - 1`` per sample); one
            epoch of both splits feeds this many.
        num_label_tokens: Trained targets of the kept samples (``labels[1:]`` not :data:`IGNORE_INDEX`).
        num_train_rows: Packed rows of the training split (``None`` unpacked).
        num_val_rows: Packed rows of the validation split (``None`` unpacked).
        num_val_records: Records held out for validation (``num_val_samples`` of them are kept).
        num_val_dropped: Held-out records dropped with no trained target after truncation (the others not kept
            were skipped: their roles do not fit the template).
        packing_efficiency: Fraction of packed input positions that hold a real token, not padding, over both
            splits (``None`` unpacked).
    """

    num_records: int
    num_skipped: int
    num_truncated: int
    num_dropped: int
    num_train_samples: int
    num_val_samples: int
    num_tokens: int
    num_label_tokens: int
    num_train_rows: int | None = None
    num_val_rows: int | None = None
    num_val_records: int = 0
    num_val_dropped: int = 0
    packing_efficiency: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (for logging)."""
        return asdict(self)


@dataclass
class InstructData:
    """Prepared instruction data: training and validation splits and what preparation did."""

    train: InstructSplit
    val: InstructSplit
    stats: InstructStats


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) record indices, each in file order; val a seeded random ``val_fraction`` of ``n``."""
    n_val = 0
    if val_fraction > 0 and n >= 2:
        n_val = min(n - 1, max(1, round(n * val_fraction)))
    perm = np.random.default_rng([seed, 0]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


# ----------------------------------------------------------------------------------------------------------------
# Why a file leaves nothing to train on (shared with memfit.data.preference)

SKIP_CAUSES = ("system", "template", "truncated")
"""Why a valid record yields no sample: the template refuses its system role (it renders once its system messages
are dropped), the template cannot render it otherwise, or truncation to ``max_seq_len + 1`` tokens leaves it
nothing to train on."""


def unrendered_cause(
    messages: Sequence[dict[str, str]], render: Callable[[list[dict[str, str]]], Any]
) -> str:
    """Why a template could not render a record: ``"system"`` when it renders once its system messages are dropped
    (the template refuses the system role, as Gemma's does), else ``"template"``.

    Args:
        messages: The record's messages that may hold system messages (a preference pair's prompt).
        render: Renders the record with these messages in their place; raises ``DataError`` when it cannot.
    """
    rest = [m for m in messages if m["role"] != "system"]
    if len(rest) == len(messages):
        return "template"
    try:
        render(rest)
    except DataError:
        return "template"
    return "system"


def no_training_error(
    path: Path,
    unit: str,
    *,
    num_malformed: int,
    num_val: int,
    train_causes: Sequence[tuple[str, str | None]],
    template: Template,
    truncated: str,
) -> DataError:
    """The error for a file that leaves no training sample (or pair), its counts adding up to the records read.

    Args:
        path: The data file.
        unit: What a record would have given, e.g. ``"training sample"``.
        num_malformed: Malformed records skipped at loading.
        num_val: Valid records held out for validation.
        train_causes: Per valid record of the training split (none was kept): its cause (:data:`SKIP_CAUSES`),
            and the template's error where it could not render the record (the first of cause ``"template"`` is
            quoted).
        template: The template the records were rendered with.
        truncated: What a record dropped by truncation is, with what lengthens the samples, e.g. ``"with nothing
            to train on after truncation to 65 tokens (raise seq_len)"``.
    """
    name = template_name(template)
    first_unrendered = next((error for cause, error in train_causes if cause == "template"), None)
    why = {
        "system": f"skipped because template {name} refuses the system role (drop the records' system messages, "
        "or set data.template=chatml, which takes a system message and works with any tokenizer)",
        "template": f"skipped because template {name} cannot render their roles (first: {first_unrendered})",
        "truncated": truncated,
    }
    counts = [f"{num_malformed} malformed (skipped)"] if num_malformed else []
    counts += [f"{num_val} held out for validation", f"the other {len(train_causes)} for training"]
    tally = collections.Counter(cause for cause, _ in train_causes)
    causes = [f"{tally[cause]} {why[cause]}" for cause in SKIP_CAUSES if tally[cause]]
    read = num_malformed + num_val + len(train_causes)
    return DataError(
        f"'{path}' leaves no {unit}: of {read} record(s) read, {', '.join(counts)}"
        + (f": {', '.join(causes)}" if causes else "")
    )


def _pack(
    samples: list[tuple[np.ndarray, np.ndarray]], max_seq_len: int, pad_id: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], int]:
    """Pack (input, target) pairs greedily, in a seeded shuffled order, into rows of exactly ``max_seq_len``.

    A sample is never split: when the next one does not fit, the row is closed and padded (inputs ``pad_id``,
    targets :data:`IGNORE_INDEX`, doc id one past the row's last sample, so padding attends only to itself).

    Returns:
        ``(inputs, targets, doc_ids, real_tokens)``: per row (max_seq_len,) arrays, and the non-pad positions.
    """
    rows_in: list[np.ndarray] = []
    rows_tg: list[np.ndarray] = []
    rows_doc: list[np.ndarray] = []
    cur: list[tuple[np.ndarray, np.ndarray]] = []
    used = real = 0

    def close() -> None:
        pad = max_seq_len - used
        inp = [x for x, _ in cur] + [np.full(pad, pad_id, np.int32)]
        tgt = [y for _, y in cur] + [np.full(pad, IGNORE_INDEX, np.int32)]
        doc = [np.full(len(x), d, np.int32) for d, (x, _) in enumerate(cur)] + [
            np.full(pad, len(cur), np.int32)
        ]
        rows_in.append(np.concatenate(inp))
        rows_tg.append(np.concatenate(tgt))
        rows_doc.append(np.concatenate(doc))

    for k in rng.permutation(len(samples)):
        x, y = samples[k]
        if used + len(x) > max_seq_len:
            close()
            cur, used = [], 0
        cur.append((x, y))
        used += len(x)
        real += len(x)
    if cur:
        close()
    return rows_in, rows_tg, rows_doc, real


def prepare_instruct(
    path: str | Path,
    fmt: str,
    template: Template,
    tokenizer: Any,
    *,
    max_seq_len: int,
    val_fraction: float,
    seed: int,
    train_on_prompt: bool = False,
    packing: bool = False,
    skip_malformed: bool = False,
    column_map: dict[str, str] | None = None,
    length_fix: str = "raise max_seq_len",
) -> InstructData:
    """Load, split, encode, truncate and (optionally) pack an instruction or chat data file.

    Args:
        path: The data file (see :func:`load_conversations`).
        fmt: One of :data:`memfit.data_formats.INSTRUCT_FORMATS`.
        template: One of :data:`TEMPLATES`, or a checkpoint's :class:`~memfit.data.chat_template.ChatTemplate`
            (see :func:`resolve_template`).
        tokenizer: A ``memfit.tokenizer.Tokenizer``.
        max_seq_len: Model inputs per sample ``T``; samples hold at most ``T + 1`` tokens (longer ones are cut
            to that and counted in ``num_truncated``); packed rows hold exactly ``T`` inputs.
        val_fraction: Fraction of the records held out for validation, in ``[0, 1)``, chosen at random with
            ``seed``; at least one record when > 0 and there are two or more records (and never all of them); 0
            gives an empty split.
        seed: Seeds the split (``default_rng([seed, 0])``) and the packing order (``default_rng([seed, 1,
            split])``, split 0 train, 1 val).
        train_on_prompt: Train on prompt tokens too (see :func:`encode_conversation`).
        packing: Pack the samples of each split into rows of exactly ``max_seq_len`` inputs with ``doc_ids``.
        skip_malformed: Skip and count malformed records, and records whose roles the template cannot render,
            instead of raising.
        column_map: Field renames (see :func:`load_conversations`).
        length_fix: What the error for a file that truncation leaves nothing to train on tells the user to do
            (the caller knows which of its settings gives ``max_seq_len``, e.g. ``raise seq_len``).

    Returns:
        The splits and their :class:`InstructStats`.

    Raises:
        DataError: Bad arguments (each named); the file or a record is bad (see :func:`load_conversations`); the
            tokenizer cannot serve the template, or a chat template cannot be rendered (naming its file); a
            record's roles do not fit the template (unless ``skip_malformed``); or no training sample is left
            (:func:`no_training_error`: the counts add up to the records read, each cause named with its fix).
    """
    path = Path(path)
    if fmt not in INSTRUCT_FORMATS:  # "preference" is a data format too, read by memfit.data.preference
        raise DataError(
            f"prepare_instruct reads the formats {', '.join(INSTRUCT_FORMATS)}, not {fmt!r}"
            + (
                " (preference pairs: memfit.data.preference.prepare_preference)"
                if fmt == "preference"
                else ""
            )
        )
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise DataError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    specials_for(template, tokenizer)  # a tokenizer/template mismatch fails here, not once per record
    records, num_malformed = load_records(path, fmt, column_map, skip_malformed)

    def encode(messages: Sequence[dict[str, str]]) -> tuple[list[int], list[int]]:
        return encode_conversation(messages, template, tokenizer, train_on_prompt=train_on_prompt)

    # ---- encode and truncate
    samples: list[tuple[np.ndarray, np.ndarray] | None] = []
    num_truncated = num_dropped = num_tokens = num_label_tokens = 0
    causes: dict[int, str] = {}  # record -> why it gave no sample (SKIP_CAUSES)
    template_errors: dict[int, str] = {}  # record -> why the template cannot render it
    for rec in records:
        try:
            ids, labels = encode(rec.messages)
        except DataError as exc:
            message = f"{rec.where(path)}: {exc}"
            if not skip_malformed:
                raise DataError(f"{message} (set data.skip_malformed to skip such records)") from None
            template_errors[len(samples)] = message
            causes[len(samples)] = unrendered_cause(rec.messages, encode)
            samples.append(None)
            continue
        if len(ids) > max_seq_len + 1:
            ids, labels = ids[: max_seq_len + 1], labels[: max_seq_len + 1]
            num_truncated += 1
        trained = sum(1 for t in labels[1:] if t != IGNORE_INDEX)
        if trained == 0:
            num_dropped += 1
            causes[len(samples)] = "truncated"
            samples.append(None)
            continue
        num_tokens += len(ids) - 1
        num_label_tokens += trained
        samples.append((np.asarray(ids[:-1], np.int32), np.asarray(labels[1:], np.int32)))
    if template_errors:
        log.warning(
            "skipped %d record(s) of '%s' that template %s cannot render; first: %s",
            len(template_errors),
            path,
            template_name(template),
            "; ".join(list(template_errors.values())[:3]),
        )

    # ---- split (by record, so the split does not depend on the template or max_seq_len)
    train_idx, val_idx = split_indices(len(records), val_fraction, seed)
    train_samples = [s for i in train_idx if (s := samples[i]) is not None]
    val_samples = [s for i in val_idx if (s := samples[i]) is not None]
    if not train_samples:
        raise no_training_error(
            path,
            "training sample",
            num_malformed=num_malformed,
            num_val=len(val_idx),
            train_causes=[(causes[j], template_errors.get(j)) for j in map(int, train_idx)],
            template=template,
            truncated=f"with nothing to train on after truncation to {max_seq_len + 1} tokens ({length_fix})",
        )

    # ---- build the splits, packing if asked
    pad_id = pad_token_id(tokenizer)
    stats = InstructStats(
        num_records=len(records),
        num_skipped=num_malformed + len(template_errors),
        num_truncated=num_truncated,
        num_dropped=num_dropped,
        num_train_samples=len(train_samples),
        num_val_samples=len(val_samples),
        num_val_records=len(val_idx),
        num_val_dropped=sum(1 for i in val_idx if causes.get(int(i)) == "truncated"),
        num_tokens=num_tokens,
        num_label_tokens=num_label_tokens,
    )
    splits = []
    real_total = rows_total = 0
    for split, split_samples in enumerate((train_samples, val_samples)):
        if not packing:
            splits.append(
                InstructSplit([x for x, _ in split_samples], [y for _, y in split_samples], None, pad_id)
            )
            continue
        rng = np.random.default_rng([seed, 1, split])
        rows_in, rows_tg, rows_doc, real = _pack(split_samples, max_seq_len, pad_id, rng)
        splits.append(InstructSplit(rows_in, rows_tg, rows_doc, pad_id, num_tokens=real))
        real_total += real
        rows_total += len(rows_in)
    if packing:
        stats.num_train_rows, stats.num_val_rows = len(splits[0]), len(splits[1])
        stats.packing_efficiency = real_total / (rows_total * max_seq_len)
    log.info(
        "instruction data '%s' (%s, template %s): %s", path, fmt, template_name(template), stats.as_dict()
    )
    return InstructData(train=splits[0], val=splits[1], stats=stats)
