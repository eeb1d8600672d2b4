"""Preference pairs (DPO and its kin): records -> (prompt, chosen, rejected) conversations -> two token rows per pair
with completion-only labels -> batches of the chosen rows, then the rejected rows.

The format (``data.format: preference``): a ``.json`` file (a list of records, or one record as an object) or a
``.jsonl`` file (one record per line, blank lines ignored), read as :mod:`memfit.data.records` reads instruction
records. A record has the fields ``prompt``, ``chosen`` and ``rejected`` (the names in the file can differ:
``column_map`` maps these canonical names to them):

- ``prompt``: a string (the user's message) or a list of messages ``{"role": "system" | "user" | "assistant",
  "content": str}`` that ends with a user message.
- ``chosen``, ``rejected``: a string (the assistant's reply), one message, or a list of messages (TRL's
  conversational format: normally one assistant message) that begins and ends with an assistant message.
- Implicit prompt (TRL's ``extract_prompt``): without a ``prompt`` field (or with ``null``), ``chosen`` and
  ``rejected`` are whole conversations; the prompt is their shared leading messages (up to the first message where
  they differ, or all but the last message of the shorter one where they do not) and must end with a user message;
  ``chosen`` and ``rejected`` are the rest.

A record is malformed when it is not a JSON object, a field is missing or of the wrong type, a message is not a
role/content dict with a known role, a prompt does not end with the user's message, a completion does not begin
and end with the assistant's, or (JSONL) its line is not valid JSON. It raises a :class:`~memfit.errors.DataError`
naming the file, the record (0-based) and the line (1-based, JSONL), or with ``skip_malformed`` is skipped and
counted.

Rendering and masking follow TRL 1.13's ``DPOTrainer`` on conversational data (``trl/trainer/dpo_trainer.py``,
``_prepare_dataset`` and ``DataCollatorForPreference``), with a template as
:func:`memfit.data.templates.resolve_template` gives (a built-in one or the checkpoint's own chat template):

- ``prompt_ids = encode_prompt(prompt)``: the prompt rendered with the generation prompt (``add_generation_prompt
  =True``).
- ``full = encode_conversation(prompt + chosen)[0]`` and the chosen completion is ``full[len(prompt_ids):]``:
  *everything* after the generation prompt, the reply and whatever the template writes after it (ChatML:
  ``reply<|im_end|>\\n``, and the tokenizer's EOS for memfit's built-in ``chatml``). The same for rejected.
  When ``full`` does not begin with ``prompt_ids`` (a tokenizer that merges tokens across the boundary) the slice
  is kept, counted (``num_prefix_mismatch``) and a warning logged, as TRL does.
- The rows are ``prompt_ids + chosen_ids`` and ``prompt_ids + rejected_ids``, with labels equal to the ids on
  the completion's tokens and :data:`~memfit.memory.techniques.IGNORE_INDEX` on the prompt's (TRL's
  ``completion_mask``). Each is cut to its first ``max_seq_len + 1`` tokens (TRL's ``keep_start`` truncation
  with ``max_length = max_seq_len + 1``); a pair whose prompt alone fills that many tokens (TRL drops it too), or
  that leaves a row with no completion token to train on, is dropped and counted.
- A row of ``n`` tokens trains the model on input ``ids[:-1]`` against target ``labels[1:]`` (next-token shift,
  as :mod:`memfit.data.instruct`), so the first completion token is scored from the last prompt token.

Where memfit differs from TRL: string records are rendered through the template as a one-turn chat (TRL tokenizes
a plain-text ``prompt + chosen`` without a template and appends EOS); completions must begin and end with an
assistant message (TRL renders whatever it is given); message dicts keep only ``role`` and ``content``.

:func:`prepare_preference` loads, splits (a seeded random validation fraction of the records), renders and
truncates, and returns :class:`PreferenceData`, whose :class:`PreferenceSplit` serves batches of ``2B`` rows (the
``B`` pairs' chosen rows, then their rejected rows in the same order) as a pure function of their position in an
endless stream of seeded epochs, like :class:`~memfit.data.instruct.InstructSplit`, with the pairs' indices in the
split so that reference log-probabilities computed once can be looked up per pair (keyed by
:meth:`PreferenceSplit.fingerprint`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data.chat_template import ROLES
from memfit.data.instruct import (
    EpochStream,
    InstructSplit,
    no_training_error,
    pad_token_id,
    split_indices,
    unrendered_cause,
)
from memfit.data.records import Malformed, record_where, valid_records
from memfit.data.templates import Template, encode_conversation, encode_prompt, specials_for, template_name
from memfit.data_formats import PREFERENCE_FORMAT, format_columns
from memfit.errors import DataError
from memfit.memory.techniques import IGNORE_INDEX

log = logging.getLogger(__name__)

_SKIP_HINT = "(set data.skip_malformed to skip such records)"

Messages = list[dict[str, str]]


# ----------------------------------------------------------------------------------------------------------------
# Loading records


@dataclass(frozen=True)
class PreferencePair:
    """One loaded preference pair and where it came from (for error messages).

    Attributes:
        index: The record's index in the file, from 0.
        line: Its line, from 1 (``.jsonl``), or ``None`` (``.json``).
        prompt: The prompt's messages; the last is the user's.
        chosen: The preferred completion's messages; the first and the last are the assistant's.
        rejected: The dispreferred completion's messages, likewise.
    """

    index: int
    line: int | None
    prompt: Messages
    chosen: Messages
    rejected: Messages

    def where(self, path: Path) -> str:
        """``'<path>' record <index> (0-based; line <line>)``, as :mod:`memfit.data.records` names records."""
        return record_where(path, self.index, self.line)


def load_pairs(
    path: str | Path, *, column_map: dict[str, str] | None = None, skip_malformed: bool = False
) -> tuple[list[PreferencePair], int]:
    """Read preference records as (prompt, chosen, rejected) conversations (see the module's description).

    Args:
        path: A ``.json`` file (a list of records, or one record as an object) or a ``.jsonl`` file.
        column_map: Canonical field name (``prompt``, ``chosen``, ``rejected``) -> field name in the file.
        skip_malformed: Skip malformed records and count them (a warning logs how many and the first reasons)
            instead of raising.

    Returns:
        ``(pairs, num_malformed)``: the valid pairs in file order, and the malformed records skipped.

    Raises:
        DataError: The file is missing, unreadable, not UTF-8, not valid JSON (``.json``), of another extension,
            or holds no record; a ``column_map`` key is unknown; without ``skip_malformed``, a record is malformed
            (the message names the file, the record, the line for JSONL, and what is wrong); or every record is
            malformed.
    """
    path = Path(path)
    columns = format_columns(PREFERENCE_FORMAT, column_map)
    valid, skipped = valid_records(
        path, PREFERENCE_FORMAT, lambda item: _to_pair(item, columns), skip_malformed
    )
    return [PreferencePair(index, line, *pair) for index, line, pair in valid], skipped


def _label(name: str, canonical: str) -> str:
    """How a message names a field: its name, and the canonical one when ``column_map`` renamed it."""
    return repr(name) if name == canonical else f"{name!r} (the {canonical})"


def _message(m: Any, what: str) -> dict[str, str]:
    if not isinstance(m, dict):
        raise Malformed(f"{what} is a {type(m).__name__}, not a message {{'role', 'content'}}: {m!r:.40}")
    if "role" not in m or "content" not in m:
        raise Malformed(
            f"{what} needs 'role' and 'content'; it has {', '.join(map(repr, list(m)[:8])) or 'none'}"
        )
    role, content = m["role"], m["content"]
    if not isinstance(role, str) or role not in ROLES:
        raise Malformed(f"{what} has role {role!r:.40}; expected one of {', '.join(ROLES)}")
    if not isinstance(content, str):
        raise Malformed(f"{what} has content of type {type(content).__name__}, not a string: {content!r:.40}")
    return {"role": role, "content": content}


def _message_list(value: list, label: str) -> Messages:
    if not value:
        raise Malformed(f"field {label} is an empty list of messages")
    return [_message(m, f"field {label} message {i}") for i, m in enumerate(value)]


def _prompt(value: Any, label: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise Malformed(
            f"field {label} must be a string or a list of messages, got {type(value).__name__} {value!r:.40}"
        )
    messages = _message_list(value, label)
    _check_prompt(messages, f"field {label}")
    return messages


def _check_prompt(messages: Messages, what: str) -> None:
    if messages[-1]["role"] != "user":
        raise Malformed(
            f"{what} ends with a{'n' * (messages[-1]['role'] == 'assistant')} {messages[-1]['role']!r} message; "
            "a prompt ends with the user's message"
        )


def _completion(value: Any, label: str) -> Messages:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, dict):
        messages = [_message(value, f"field {label}")]
    elif isinstance(value, list):
        messages = _message_list(value, label)
    else:
        raise Malformed(
            f"field {label} must be a string, a message or a list of messages, got {type(value).__name__} "
            f"{value!r:.40}"
        )
    _check_completion(messages, f"field {label}")
    return messages


def _check_completion(messages: Messages, what: str) -> None:
    for end, m in (("begins", messages[0]), ("ends", messages[-1])):
        if m["role"] != "assistant":
            raise Malformed(
                f"{what} {end} with a {m['role']!r} message; a completion is the assistant's reply (it begins "
                "and ends with an assistant message)"
            )


def _to_pair(item: Any, columns: dict[str, str]) -> tuple[Messages, Messages, Messages]:
    if not isinstance(item, dict):
        raise Malformed(f"a record must be a JSON object, got {type(item).__name__} {item!r:.40}")
    labels = {key: _label(columns[key], key) for key in ("prompt", "chosen", "rejected")}
    for key in ("chosen", "rejected"):
        if columns[key] in item and item[columns[key]] is None:
            raise Malformed(f"field {labels[key]} is null")
        if columns[key] not in item:
            have = ", ".join(map(repr, list(item)[:8])) or "none"
            raise Malformed(f"missing field {labels[key]}; fields present: {have} (rename with column_map)")
    chosen, rejected = item[columns["chosen"]], item[columns["rejected"]]
    if item.get(columns["prompt"]) is not None:
        prompt = _prompt(item[columns["prompt"]], labels["prompt"])
        return prompt, _completion(chosen, labels["chosen"]), _completion(rejected, labels["rejected"])

    # implicit prompt: the shared leading messages of two whole conversations (TRL's extract_prompt)
    for key, value in (("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, list):
            raise Malformed(
                f"missing field {labels['prompt']}; without it, {labels['chosen']} and {labels['rejected']} must "
                f"be whole conversations (lists of messages) that share the prompt, but {labels[key]} is a "
                f"{type(value).__name__} (rename with column_map)"
            )
    chosen, rejected = _message_list(chosen, labels["chosen"]), _message_list(rejected, labels["rejected"])
    n = min(len(chosen), len(rejected))
    k = next((i for i in range(n) if chosen[i] != rejected[i]), n - 1)
    what = f"the implicit prompt (the messages {labels['chosen']} and {labels['rejected']} share)"
    if k == 0:
        raise Malformed(
            f"missing field {labels['prompt']}, and {labels['chosen']} and {labels['rejected']} share no leading "
            "message before their completions to take it from"
        )
    _check_prompt(chosen[:k], what)
    _check_completion(chosen[k:], f"field {labels['chosen']} after {what}")
    _check_completion(rejected[k:], f"field {labels['rejected']} after {what}")
    return chosen[:k], chosen[k:], rejected[k:]


# ----------------------------------------------------------------------------------------------------------------
# Rendering


@dataclass(frozen=True)
class EncodedPair:
    """A pair's prompt and completion token ids, sliced as TRL's ``DPOTrainer`` slices them.

    Attributes:
        prompt_ids: The prompt rendered with the generation prompt.
        chosen_ids: Everything after ``len(prompt_ids)`` tokens of the rendering of ``prompt + chosen``.
        rejected_ids: Likewise for ``prompt + rejected``.
        num_prefix_mismatch: How many of the two renderings (0, 1 or 2) do not begin with ``prompt_ids``.
    """

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    num_prefix_mismatch: int


def encode_pair(
    prompt: Sequence[dict[str, str]],
    chosen: Sequence[dict[str, str]],
    rejected: Sequence[dict[str, str]],
    template: Template,
    tokenizer: Any,
) -> EncodedPair:
    """Render a pair: ``prompt_ids`` with the generation prompt, and each completion as the tokens of the whole
    conversation after ``len(prompt_ids)`` (see the module's description).

    Args:
        prompt: Messages ending with a user message.
        chosen: Messages beginning and ending with an assistant message.
        rejected: Likewise.
        template: One of :data:`memfit.data_formats.TEMPLATES`, or a checkpoint's
            :class:`~memfit.data.chat_template.ChatTemplate`.
        tokenizer: A ``memfit.tokenizer.Tokenizer``.

    Returns:
        The :class:`EncodedPair`.

    Raises:
        DataError: As :func:`memfit.data.templates.encode_conversation` and
            :func:`~memfit.data.templates.encode_prompt`: the template cannot render these roles, or the tokenizer
            cannot serve the template.
    """
    prompt_ids = encode_prompt(prompt, template, tokenizer)
    completions = []
    mismatch = 0
    for completion in (chosen, rejected):
        full, _ = encode_conversation([*prompt, *completion], template, tokenizer)
        mismatch += int(full[: len(prompt_ids)] != prompt_ids)
        completions.append(full[len(prompt_ids) :])
    return EncodedPair(prompt_ids, completions[0], completions[1], mismatch)


def _pair_rows(pair: EncodedPair, limit: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], bool] | None:
    """The pair's chosen and rejected ``(inputs, targets)``, each (n - 1,) int32 for a row of ``n <= limit``
    tokens, and whether a row was cut; ``None`` when the prompt fills ``limit`` or a row has no target left."""
    if len(pair.prompt_ids) >= limit:
        return None
    rows = []
    cut = False
    for completion in (pair.chosen_ids, pair.rejected_ids):
        ids = pair.prompt_ids + completion
        labels = [IGNORE_INDEX] * len(pair.prompt_ids) + completion
        cut = cut or len(ids) > limit
        ids, labels = ids[:limit], labels[:limit]
        targets = np.asarray(labels[1:], np.int32)
        if not (targets != IGNORE_INDEX).any():
            return None
        rows.append((np.asarray(ids[:-1], np.int32), targets))
    return rows, cut


# ----------------------------------------------------------------------------------------------------------------
# Splits and batches


class PreferenceSplit(EpochStream):
    """The pairs of one split, served as batches of their chosen rows, then their rejected rows.

    Each pair holds two rows of model inputs and targets (``ids[:-1]`` and ``labels[1:]`` of ``prompt +
    completion``), stored flat in int32 arrays with offsets (an :class:`~memfit.data.instruct.InstructSplit` of
    ``2N`` rows, pair ``k``'s chosen row at ``2k`` and its rejected row at ``2k + 1``). The order of the pairs in
    an epoch is :class:`~memfit.data.instruct.EpochStream`'s, as for instruction samples.

    Args:
        chosen: Per pair, ``(inputs, targets)`` of its chosen row, each (n,) ids, targets :data:`IGNORE_INDEX`
            where not trained.
        rejected: Per pair, likewise for its rejected row.
        pad_id: Id that right-pads inputs to the longest row of a batch.

    Attributes:
        pad_id: As given.
        num_tokens: Input tokens of all rows, padding excluded.
        num_label_tokens: Targets of all rows that are trained (not :data:`IGNORE_INDEX`).

    Raises:
        ValueError: ``chosen`` and ``rejected`` differ in length, or a row's inputs and targets do.
    """

    item_name = "pairs"

    def __init__(
        self,
        chosen: Sequence[tuple[np.ndarray, np.ndarray]],
        rejected: Sequence[tuple[np.ndarray, np.ndarray]],
        pad_id: int,
    ) -> None:
        if len(chosen) != len(rejected):
            raise ValueError(
                f"every pair needs a chosen and a rejected row, got {len(chosen)} and {len(rejected)}"
            )
        rows = [
            row for pair in zip(chosen, rejected, strict=True) for row in pair
        ]  # chosen 2k, rejected 2k + 1
        self._rows = InstructSplit([x for x, _ in rows], [y for _, y in rows], None, pad_id)
        self._n = len(chosen)
        self.pad_id = self._rows.pad_id
        self.num_tokens = self._rows.num_tokens
        self.num_label_tokens = self._rows.num_label_tokens
        super().__init__()

    def __len__(self) -> int:
        """Number of pairs."""
        return self._n

    @property
    def max_length(self) -> int:
        """Input tokens of the longest row (0 for an empty split): the widest batch this split can produce."""
        return self._rows.max_length

    @property
    def lengths(self) -> np.ndarray:
        """(N, 2) int64 input length of each pair's chosen and rejected row."""
        return self._rows.lengths.reshape(self._n, 2)

    def batch(
        self, batch_size: int, position: int, seed: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch whose first pair is at ``position`` of an endless stream of epochs.

        Pair ``p`` of the stream is pair ``order(p // N, seed)[p % N]``; a batch may run across an epoch boundary.
        The result depends only on ``(batch_size, position, seed)``, so training resumes exactly.

        Args:
            batch_size: Pairs per batch ``B``.
            position: Index of the batch's first pair in the stream (see
                :func:`memfit.data.instruct.batch_position`).
            seed: Shuffle seed; ``None`` for file order in every epoch (validation).

        Returns:
            ``(inputs, targets, index)``: ``inputs`` and ``targets`` are int64 ``(2B, T)``, rows ``0..B-1`` the
            pairs' chosen rows and rows ``B..2B-1`` their rejected rows in the same order, ``T`` the longest of
            the ``2B`` rows; inputs right-padded with ``pad_id``, targets with :data:`IGNORE_INDEX` (and
            :data:`IGNORE_INDEX` on the prompt). ``index`` is int64 ``(B,)``: the pairs' indices in this split.

        Raises:
            ValueError: ``batch_size < 1`` or ``position < 0``.
            DataError: The split is empty.
        """
        return self.collate(self.indices(batch_size, position, seed))

    def collate(self, index: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stack the given pairs' rows into one right-padded batch (as :meth:`batch` returns).

        Args:
            index: (B,) pair indices in this split.

        Returns:
            As :meth:`batch`.
        """
        index = np.array(index, dtype=np.int64)  # (B,), a copy the caller cannot change under the tensor
        rows = np.concatenate([2 * index, 2 * index + 1])  # (2B,): the chosen rows, then the rejected rows
        inputs, targets, _ = self._rows.collate(rows)  # (2B, T) each
        return inputs, targets, torch.from_numpy(index)

    def epoch_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every pair once, in file order, in batches of ``batch_size`` pairs (the last may be smaller): for
        evaluation.

        Yields:
            As :meth:`batch`.
        """
        for start in range(0, len(self), batch_size):
            yield self.collate(np.arange(start, min(start + batch_size, len(self))))

    def fingerprint(self) -> str:
        """The sha256 hex digest of the split's rows: token ids, targets (the label mask included) and offsets,
        in pair order.

        It changes when any token or label of any row does, or the pairs' order, and not otherwise (not with
        ``pad_id``); it keys a cache of reference log-probabilities computed per pair.
        """
        return hashlib.sha256(
            f"memfit preference pairs:{self._n}:{self._rows.fingerprint()}".encode()
        ).hexdigest()


@dataclass
class PreferenceStats:
    """What :func:`prepare_preference` did, over both splits.

    The counts of records add up: ``num_records == num_pairs + num_malformed + num_template_skipped +
    num_dropped``, and ``num_pairs == num_train_pairs + num_val_pairs``.

    Attributes:
        num_records: Records read from the file, malformed ones included.
        num_pairs: Pairs kept, in both splits.
        num_malformed: Malformed records skipped at loading (``skip_malformed``).
        num_template_skipped: Records skipped because the template cannot render their roles (``skip_malformed``).
        num_dropped: Pairs dropped by truncation: the prompt alone fills ``max_seq_len + 1`` tokens, or a row is
            left with no completion token to train on.
        num_truncated: Kept pairs with a row cut to ``max_seq_len + 1`` tokens.
        num_prefix_mismatch: Rows (a pair's chosen or rejected) of rendered pairs whose whole rendering does not
            begin with the prompt's tokens; their completion is the slice after ``len(prompt_ids)`` regardless.
        num_train_pairs: Pairs in the training split.
        num_val_pairs: Pairs in the validation split.
        num_val_records: Valid records held out for validation (``num_val_pairs`` of them are kept).
        num_tokens: Model input tokens of the kept rows, padding excluded (``len(ids) - 1`` per row, two rows per
            pair); one epoch of both splits feeds this many.
        num_label_tokens: Trained targets of the kept rows (chosen and rejected completion tokens).
    """

    num_records: int
    num_pairs: int
    num_malformed: int
    num_template_skipped: int
    num_dropped: int
    num_truncated: int
    num_prefix_mismatch: int
    num_train_pairs: int
    num_val_pairs: int
    num_val_records: int
    num_tokens: int
    num_label_tokens: int

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict (for logging)."""
        return asdict(self)


@dataclass
class PreferenceData:
    """Prepared preference pairs: training and validation splits and what preparation did."""

    train: PreferenceSplit
    val: PreferenceSplit
    stats: PreferenceStats


def prepare_preference(
    path: str | Path,
    template: Template,
    tokenizer: Any,
    *,
    max_seq_len: int,
    val_fraction: float,
    seed: int,
    skip_malformed: bool = False,
    column_map: dict[str, str] | None = None,
    length_fix: str = "raise max_seq_len",
) -> PreferenceData:
    """Load, split, render and truncate a file of preference pairs.

    Args:
        path: The data file (see :func:`load_pairs`).
        template: One of :data:`memfit.data_formats.TEMPLATES`, or a checkpoint's
            :class:`~memfit.data.chat_template.ChatTemplate` (see :func:`memfit.data.templates.resolve_template`).
        tokenizer: A ``memfit.tokenizer.Tokenizer``.
        max_seq_len: Model inputs per row ``T``; rows hold at most ``T + 1`` tokens (longer ones are cut to their
            first ``T + 1``, the pair counted in ``num_truncated``).
        val_fraction: Fraction of the valid records held out for validation, in ``[0, 1)``, chosen at random with
            ``seed`` as :func:`memfit.data.instruct.prepare_instruct` chooses them.
        seed: Seeds the split (``default_rng([seed, 0])``).
        skip_malformed: Skip and count malformed records, and records whose roles the template cannot render,
            instead of raising.
        column_map: Field renames (see :func:`load_pairs`).
        length_fix: What the error for a file that truncation leaves nothing to train on tells the user to do
            (the caller knows which of its settings gives ``max_seq_len``, e.g. ``raise seq_len``).

    Returns:
        The splits and their :class:`PreferenceStats`.

    Raises:
        DataError: Bad arguments (each named); the file or a record is bad (see :func:`load_pairs`); the tokenizer
            cannot serve the template, or a chat template cannot be rendered (naming its file); a record's roles
            do not fit the template (unless ``skip_malformed``); or no training pair is left
            (:func:`memfit.data.instruct.no_training_error`: the counts add up to the records read, each cause named
            with its fix).
    """
    path = Path(path)
    if not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise DataError(f"max_seq_len must be a positive integer, got {max_seq_len!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    specials_for(template, tokenizer)  # a tokenizer/template mismatch fails here, not once per record
    pairs, num_malformed = load_pairs(path, column_map=column_map, skip_malformed=skip_malformed)

    # ---- render and truncate
    limit = max_seq_len + 1
    rows: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None] = []
    causes: dict[int, str] = {}  # record -> why it gave no pair (memfit.data.instruct.SKIP_CAUSES)
    template_errors: dict[int, str] = {}  # record -> why the template cannot render it
    mismatched: list[str] = []
    num_dropped = num_truncated = num_prefix_mismatch = num_tokens = num_label_tokens = 0
    for pair in pairs:
        try:
            encoded = encode_pair(pair.prompt, pair.chosen, pair.rejected, template, tokenizer)
        except DataError as exc:
            message = f"{pair.where(path)}: {exc}"
            if not skip_malformed:
                raise DataError(f"{message} {_SKIP_HINT}") from None
            template_errors[len(rows)] = message
            causes[len(rows)] = unrendered_cause(
                pair.prompt,
                lambda prompt, p=pair: encode_pair(prompt, p.chosen, p.rejected, template, tokenizer),
            )
            rows.append(None)
            continue
        if encoded.num_prefix_mismatch:
            num_prefix_mismatch += encoded.num_prefix_mismatch
            mismatched.append(pair.where(path))
        kept = _pair_rows(encoded, limit)
        if kept is None:
            num_dropped += 1
            causes[len(rows)] = "truncated"
            rows.append(None)
            continue
        (chosen, rejected), cut = kept
        num_truncated += cut
        for inputs, targets in (chosen, rejected):
            num_tokens += len(inputs)
            num_label_tokens += int((targets != IGNORE_INDEX).sum())
        rows.append((chosen, rejected))
    if template_errors:
        log.warning(
            "skipped %d record(s) of '%s' that template %s cannot render; first: %s",
            len(template_errors),
            path,
            template_name(template),
            "; ".join(list(template_errors.values())[:3]),
        )
    if mismatched:  # once, where TRL warns once per row
        log.warning(
            "%d row(s) of %d pair(s) of '%s' rendered with template %s do not begin with their prompt's tokens "
            "(the tokenizer merges tokens across the prompt's end); their completion is the rest after the "
            "prompt's length, as TRL takes it; first: %s",
            num_prefix_mismatch,
            len(mismatched),
            path,
            template_name(template),
            "; ".join(mismatched[:3]),
        )

    # ---- split (by record, so the split does not depend on the template or max_seq_len)
    train_idx, val_idx = split_indices(len(pairs), val_fraction, seed)
    train = [r for i in train_idx if (r := rows[i]) is not None]
    val = [r for i in val_idx if (r := rows[i]) is not None]
    num_records = len(pairs) + num_malformed
    if not train:
        raise no_training_error(
            path,
            "training pair",
            num_malformed=num_malformed,
            num_val=len(val_idx),
            train_causes=[(causes[j], template_errors.get(j)) for j in map(int, train_idx)],
            template=template,
            truncated=f"dropped by truncation to {limit} tokens (their prompt fills them, or a completion has no "
            f"token left; {length_fix})",
        )

    pad_id = pad_token_id(tokenizer)
    splits = [PreferenceSplit([c for c, _ in s], [r for _, r in s], pad_id) for s in (train, val)]
    stats = PreferenceStats(
        num_records=num_records,
        num_pairs=len(train) + len(val),
        num_malformed=num_malformed,
        num_template_skipped=len(template_errors),
        num_dropped=num_dropped,
        num_truncated=num_truncated,
        num_prefix_mismatch=num_prefix_mismatch,
        num_train_pairs=len(train),
        num_val_pairs=len(val),
        num_val_records=len(val_idx),
        num_tokens=num_tokens,
        num_label_tokens=num_label_tokens,
    )
    log.info("preference data '%s' (template %s): %s", path, template_name(template), stats.as_dict())
    return PreferenceData(train=splits[0], val=splits[1], stats=stats)
