"""memfit.data.preference: preference pairs render to exactly TRL's ``DPOTrainer`` rows (prompt with the generation
prompt, completion the rest of the whole rendering; ids checked against transformers' ``apply_chat_template``),
implicit prompts are extracted as TRL's ``extract_prompt`` does, batches hold the chosen rows then the rejected rows
as a pure function of their position, truncation and skipping are counted so that the counts add up, bad records
are named by file, record and line, and the fingerprint follows the tokens.

The tokenizer is GPT-2's BPE with ChatML's special tokens and Qwen 2.5's chat template beside it
(tests/data/test_chat_template.py's ``save_tokenizer_dir``).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from memfit.data.chat_template import ChatTemplate
from memfit.data.instruct import pad_token_id, prepare_instruct
from memfit.data.preference import PreferenceSplit, encode_pair, load_pairs, prepare_preference
from memfit.data.templates import encode_conversation, encode_prompt, resolve_template
from memfit.data_formats import DATA_FORMATS, INSTRUCT_FORMATS, PREFERENCE_COLUMNS, format_columns
from memfit.errors import DataError
from memfit.memory.techniques import IGNORE_INDEX
from memfit.tokenizer import load_tokenizer

from .test_chat_template import save_tokenizer_dir

CHATML_JINJA = (  # the usual ChatML template: what memfit's built-in chatml renders
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "Be brief."}
GOOD_REPLIES = {"chosen": "Hello!", "rejected": "Bye."}
STRING_RECORD = {"prompt": "What color is the sky?", "chosen": "Blue.", "rejected": "Green, surely."}
CONV_RECORD = {  # a multi-turn prompt; chosen a list of messages, rejected one message
    "prompt": [SYSTEM, user("Capital of France?"), assistant("Paris."), user("And of Italy?")],
    "chosen": [assistant("Rome.")],
    "rejected": assistant("Milan, I think."),
}
MESSAGES = {  # the records as (prompt, chosen, rejected) conversations
    "string": ([user("What color is the sky?")], [assistant("Blue.")], [assistant("Green, surely.")]),
    "conv": (CONV_RECORD["prompt"], CONV_RECORD["chosen"], [CONV_RECORD["rejected"]]),
}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text(
        "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n", encoding="utf-8"
    )
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return save_tokenizer_dir(tmp_path_factory.mktemp("pref") / "qwen", "qwen25_instruct.jinja")


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def prepare(path: Path, tok, template="chatml", **kw):
    kw = {"max_seq_len": 256, "val_fraction": 0.0, "seed": 0, **kw}
    return prepare_preference(path, template, tok, **kw)


def trl_rows(prompt_ids: list[int], full: list[int], limit: int) -> tuple[list[int], list[int]]:
    """TRL's row for a prompt and a whole rendering (``_prepare_dataset``'s slice, the collator's
    ``completion_mask`` and ``keep_start`` truncation), as memfit's (input, target) pair with the next-token
    shift."""
    completion = full[len(prompt_ids) :]
    ids = (prompt_ids + completion)[:limit]
    mask = ([0] * len(prompt_ids) + [1] * len(completion))[:limit]
    labels = [i if m else IGNORE_INDEX for i, m in zip(ids, mask, strict=True)]
    return ids[:-1], labels[1:]


def split_rows(split: PreferenceSplit, k: int) -> list[tuple[list[int], list[int]]]:
    """Pair ``k``'s chosen and rejected (inputs, targets), padding removed."""
    inputs, targets, index = split.collate([k])
    assert index.tolist() == [k]
    n = split.lengths[k]
    return [(inputs[r, : n[r]].tolist(), targets[r, : n[r]].tolist()) for r in (0, 1)]


# ----------------------------------------------------------------------------------------------------------------
# Rendering: TRL's slices, exactly


@pytest.mark.parametrize("template", ["chatml", "checkpoint"])
def test_records_render_to_the_prompt_and_the_rest_of_the_whole_rendering(tmp_path, tok, template):
    chat = resolve_template("auto", tok) if template == "checkpoint" else "chatml"
    assert isinstance(chat, ChatTemplate) == (template == "checkpoint")
    data = prepare(write_jsonl(tmp_path / "p.jsonl", [STRING_RECORD, CONV_RECORD]), tok, chat)
    assert len(data.train) == 2 and len(data.val) == 0
    for k, (prompt, chosen, rejected) in enumerate(MESSAGES.values()):
        prompt_ids = encode_prompt(prompt, chat, tok)
        expected = [
            trl_rows(prompt_ids, encode_conversation(prompt + c, chat, tok)[0], 257)
            for c in (chosen, rejected)
        ]
        assert split_rows(data.train, k) == expected
        encoded = encode_pair(prompt, chosen, rejected, chat, tok)
        assert encoded.num_prefix_mismatch == 0 and encoded.prompt_ids == prompt_ids
    # the completion is everything after the generation prompt: the reply, <|im_end|> and the newline
    encoded = encode_pair(*MESSAGES["string"], chat, tok)
    system = (
        "" if template == "chatml" else "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are"
    )
    assert tok.decode(encoded.prompt_ids).startswith(system)
    assert tok.decode(encoded.prompt_ids).endswith(
        "<|im_start|>user\nWhat color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(encoded.chosen_ids) == "Blue.<|im_end|>\n"
    assert tok.decode(encoded.rejected_ids) == "Green, surely.<|im_end|>\n"
    (inputs, targets), _ = split_rows(data.train, 0)
    p = len(encoded.prompt_ids)
    assert inputs == encoded.prompt_ids + encoded.chosen_ids[:-1]
    assert targets == [IGNORE_INDEX] * (p - 1) + encoded.chosen_ids  # trained on the completion only


# template -> (max_seq_len, pairs truncated, rows whose whole rendering does not begin with the prompt's ids)
TRL_CASES = {
    "chatml": (40, 1, 0),
    "qwen25_instruct.jinja": (40, 2, 0),
    # GPT-2's pre-tokenizer reads the generation prompt's closing "\n\n" as one token, but as "\n", "\n" before
    # the reply's first word: TRL's slice then starts the completion with the second "\n", and so does memfit's
    "llama32_instruct.jinja": (65, 1, 4),
}


@pytest.mark.parametrize("template", list(TRL_CASES))
def test_rows_equal_trl_slices_of_apply_chat_template(tmp_path, template):
    transformers = pytest.importorskip("transformers")
    directory = save_tokenizer_dir(
        tmp_path / "tok", "qwen25_instruct.jinja" if template == "chatml" else template
    )
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    tokenizer = load_tokenizer(directory)
    if template == "chatml":
        reference.chat_template = CHATML_JINJA
    chat = "chatml" if template == "chatml" else resolve_template("auto", tokenizer)
    max_seq_len, truncated, mismatched = TRL_CASES[template]
    path = write_jsonl(tmp_path / "p.jsonl", [STRING_RECORD, CONV_RECORD])
    data = prepare(path, tokenizer, chat, max_seq_len=max_seq_len)
    s = data.stats
    assert (s.num_pairs, s.num_truncated, s.num_prefix_mismatch) == (2, truncated, mismatched)

    def apply(messages, generation_prompt=False):
        return list(
            reference.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=generation_prompt, return_dict=False
            )
        )

    for k, (prompt, chosen, rejected) in enumerate(MESSAGES.values()):
        prompt_ids = apply(prompt, generation_prompt=True)
        expected = [trl_rows(prompt_ids, apply(prompt + c), max_seq_len + 1) for c in (chosen, rejected)]
        assert split_rows(data.train, k) == expected


def test_a_prefix_mismatch_keeps_the_slice_counts_it_and_warns_once(tmp_path, tok_dir, caplog):
    # a template whose generation prompt "A" merges with a reply that continues the word: "A" + "nswer" is
    # one token, so the whole rendering does not begin with the prompt's tokens
    directory = tmp_path / "merging"
    shutil.copytree(tok_dir, directory)
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\\n' }}{% else %}"
        "{{ 'A' + m['content'] }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A' }}{% endif %}"
    )
    tokenizer = load_tokenizer(directory)
    chat = resolve_template("auto", tokenizer)
    records = [
        {"prompt": "Say it.", "chosen": "nswer the", "rejected": " yes"},  # chosen mismatches: kept
        {
            "prompt": "Say it.",
            "chosen": " yes",
            "rejected": "nswer",
        },  # rejected mismatches, nothing left: dropped
    ]
    with caplog.at_level(logging.WARNING, logger="memfit.data.preference"):
        data = prepare(write_jsonl(tmp_path / "p.jsonl", records), tokenizer, chat)
    s = data.stats
    assert (s.num_prefix_mismatch, s.num_dropped, s.num_pairs) == (2, 1, 1)
    warnings = [r.getMessage() for r in caplog.records if "do not begin with their prompt" in r.getMessage()]
    assert len(warnings) == 1 and "2 row(s) of 2 pair(s)" in warnings[0]
    prompt_ids = encode_prompt([user("Say it.")], chat, tokenizer)
    assert tokenizer.decode(prompt_ids) == "Q: Say it.\nA"
    (chosen, chosen_targets), _ = split_rows(data.train, 0)
    assert tokenizer.decode(chosen) == "Q: Say it.\nA"  # the prompt's ids, then " the" (TRL's slice)
    assert tokenizer.decode([t for t in chosen_targets if t != IGNORE_INDEX]) == " the"


# ----------------------------------------------------------------------------------------------------------------
# Implicit prompts


def test_implicit_prompt_is_the_shared_leading_messages(tmp_path, tok):
    explicit = [
        {"prompt": [user("Hi")], "chosen": [assistant("Hello!")], "rejected": [assistant("Go away.")]},
        {  # multi-turn: the prompt runs up to the last user message
            "prompt": [SYSTEM, user("Capital of France?"), assistant("Paris."), user("And of Italy?")],
            "chosen": [assistant("Rome.")],
            "rejected": [assistant("Milan.")],
        },
        {  # the rejected conversation runs on: the rest of it is its completion
            "prompt": [user("Hi")],
            "chosen": [assistant("Hello!")],
            "rejected": [assistant("Hello!"), user("Well?"), assistant("Bye.")],
        },
    ]
    implicit = [
        {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in explicit
    ]
    pairs, skipped = load_pairs(write_jsonl(tmp_path / "implicit.jsonl", implicit))
    assert skipped == 0
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        (r["prompt"], r["chosen"], r["rejected"]) for r in explicit
    ]
    a = prepare(tmp_path / "implicit.jsonl", tok)
    b = prepare(write_jsonl(tmp_path / "explicit.jsonl", explicit), tok)
    assert a.train.fingerprint() == b.train.fingerprint()
    # identical conversations: TRL's extract_prompt takes all but the last message of the shorter as the prompt
    same = [user("Hi"), assistant("Hello!")]
    (pair,), _ = load_pairs(write_jsonl(tmp_path / "same.jsonl", [{"chosen": same, "rejected": same}]))
    assert (pair.prompt, pair.chosen, pair.rejected) == ([same[0]], [same[1]], [same[1]])


@pytest.mark.slow
def test_trl_extract_prompt_and_collator_agree(tmp_path, tok):
    """TRL itself, in a process of its own (importing it takes seconds and touches global state)."""
    pytest.importorskip("trl")
    conversations = [
        ([user("Hi"), assistant("Hello!")], [user("Hi"), assistant("Go away.")]),
        (
            [SYSTEM, user("Q?"), assistant("A."), user("Q2?"), assistant("B.")],
            [SYSTEM, user("Q?"), assistant("A."), user("Q2?"), assistant("C.")],
        ),
        (
            [user("Hi"), assistant("Hello!")],
            [user("Hi"), assistant("Hello!"), user("Well?"), assistant("Bye.")],
        ),
        ([user("Hi"), assistant("Hello!")], [user("Hi"), assistant("Hello!")]),
    ]
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": c, "rejected": r} for c, r in conversations])
    # rows of 26 tokens at most: the second pair's prompt fills them (dropped), the third's rejected row is cut
    data = prepare(path, tok, max_seq_len=25)
    assert (data.stats.num_pairs, data.stats.num_dropped, data.stats.num_truncated) == (3, 1, 1)
    pairs, _ = load_pairs(path)
    examples = []
    for pair in pairs:
        e = encode_pair(pair.prompt, pair.chosen, pair.rejected, "chatml", tok)
        examples.append(
            {"prompt_ids": e.prompt_ids, "chosen_ids": e.chosen_ids, "rejected_ids": e.rejected_ids}
        )
    script = (  # _prepare_dataset's filter of prompts that fill max_length, then the collator
        "import json, sys\n"
        "from trl.data_utils import extract_prompt\n"
        "from trl.trainer.dpo_trainer import DataCollatorForPreference\n"
        "conversations, examples, pad, max_length = json.load(sys.stdin)\n"
        "prompts = [extract_prompt({'chosen': c, 'rejected': r}) for c, r in conversations]\n"
        "kept = [e for e in examples if len(e['prompt_ids']) < max_length]\n"
        "out = DataCollatorForPreference(pad_token_id=pad, max_length=max_length)(kept)\n"
        "print(json.dumps([prompts, *(out[k].tolist() for k in ('input_ids', 'attention_mask', 'completion_mask'))]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps([conversations, examples, pad_token_id(tok), 26]),
        capture_output=True,
        text=True,
        check=True,
    )
    prompts, input_ids, attention_mask, completion_mask = json.loads(done.stdout.strip().splitlines()[-1])
    assert [[p["prompt"], p["chosen"], p["rejected"]] for p in prompts] == [
        [pair.prompt, pair.chosen, pair.rejected] for pair in pairs
    ]
    inputs, targets, index = data.train.batch(3, 0, seed=None)  # (6, T) each
    assert index.tolist() == [0, 1, 2]
    ids = torch.tensor(input_ids)  # (6, T + 1): TRL's whole rows, chosen then rejected
    mask = torch.tensor(completion_mask)  # (6, T + 1)
    assert ids.shape == (6, inputs.shape[1] + 1)
    # memfit's inputs are each row but its last token, padded; its targets the completion tokens shifted by one
    n = torch.tensor(attention_mask).sum(dim=1) - 1  # (6,) input tokens of each row
    real = torch.arange(inputs.shape[1]) < n[:, None]  # (6, T)
    assert torch.equal(inputs, torch.where(real, ids[:, :-1], pad_token_id(tok)))
    assert torch.equal(targets, torch.where(mask[:, 1:] == 1, ids[:, 1:], IGNORE_INDEX))


# ----------------------------------------------------------------------------------------------------------------
# Batches


@pytest.fixture(scope="module")
def five_pairs(tmp_path_factory, tok):
    records = [
        {"prompt": f"Question {k}: {'why ' * k}?", "chosen": "Yes. " * (k + 1), "rejected": "No." * (5 - k)}
        for k in range(5)
    ]
    return prepare(write_jsonl(tmp_path_factory.mktemp("five") / "p.jsonl", records), tok)


def test_batch_is_chosen_rows_then_rejected_rows_padded_and_masked(five_pairs, tok):
    train = five_pairs.train
    pad = pad_token_id(tok)
    inputs, targets, index = train.batch(3, 0, seed=7)
    assert inputs.dtype == targets.dtype == index.dtype == torch.int64
    assert index.tolist() == train.indices(3, 0, seed=7).tolist() == train.order(0, 7)[:3].tolist()
    lengths = train.lengths  # (N, 2)
    T = int(lengths[index.numpy()].max())
    assert inputs.shape == targets.shape == (6, T)
    for b, k in enumerate(index.tolist()):
        for side, row in ((0, b), (1, 3 + b)):  # rows 0..B-1 chosen, B..2B-1 rejected, in the same order
            x, y = split_rows(train, k)[side]
            n = len(x)
            assert inputs[row, :n].tolist() == x and targets[row, :n].tolist() == y
            assert (inputs[row, n:] == pad).all() and (targets[row, n:] == IGNORE_INDEX).all()
    # targets are masked on the prompt: the first trained target of a row is its first completion token
    prompt_ids = encode_prompt([user("Question 0: ?")], "chatml", tok)
    x, y = split_rows(train, 0)[0]
    assert x[: len(prompt_ids)] == prompt_ids
    p = len(prompt_ids)
    assert y[: p - 1] == [IGNORE_INDEX] * (p - 1) and y[p - 1] == x[p]
    assert int((targets != IGNORE_INDEX).sum()) == sum(
        sum(t != IGNORE_INDEX for t in split_rows(train, k)[s][1]) for k in index.tolist() for s in (0, 1)
    )
    assert train.max_length == int(lengths.max())
    assert train.num_label_tokens == five_pairs.stats.num_label_tokens
    assert train.num_tokens == five_pairs.stats.num_tokens == int(lengths.sum())


def test_seeded_order_is_a_pure_function_of_position_and_covers_each_pair_once(five_pairs):
    train = five_pairs.train
    n = len(train)
    a, b = train.batch(2, 3, seed=11), train.batch(2, 3, seed=11)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for epoch in range(3):
        seen = np.concatenate([train.indices(1, epoch * n + p, seed=11) for p in range(n)])
        assert sorted(seen.tolist()) == list(range(n))
        assert np.array_equal(seen, np.random.default_rng([11, epoch]).permutation(n))
    assert not np.array_equal(train.order(0, 11), train.order(1, 11))
    # a batch runs across the epoch boundary; the index says which pairs it holds
    _, _, index = train.batch(3, n - 1, seed=11)
    assert index.tolist() == [train.order(0, 11)[n - 1], *train.order(1, 11)[:2]]
    assert np.array_equal(train.indices(n, 0, seed=None), np.arange(n))  # validation: file order
    batches = list(train.epoch_batches(2))
    assert [b[2].tolist() for b in batches] == [[0, 1], [2, 3], [4]] and train.num_batches(2) == 3
    with pytest.raises(DataError, match="holds no pairs"):
        five_pairs.val.batch(2, 0, None)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        train.batch(0, 0, seed=1)


def test_split_by_record_with_instruct_rule(tmp_path, tok):
    records = [{"prompt": f"Q{k}", "chosen": "Yes.", "rejected": "No."} for k in range(8)]
    path = write_jsonl(tmp_path / "p.jsonl", records)
    data = prepare(path, tok, val_fraction=0.25, seed=3)
    s = data.stats
    assert (len(data.train), len(data.val)) == (s.num_train_pairs, s.num_val_pairs) == (6, 2)
    assert s.num_val_records == 2
    held_out = np.sort(np.random.default_rng([3, 0]).permutation(8)[:2])  # instruct.py's split_indices
    for k, i in enumerate(held_out):
        prompt_ids = encode_prompt([user(f"Q{i}")], "chatml", tok)
        assert split_rows(data.val, k)[0][0][: len(prompt_ids)] == prompt_ids


# ----------------------------------------------------------------------------------------------------------------
# Truncation and counts


def test_truncation_and_drops_are_counted_and_add_up(tmp_path, tok):
    records = [
        {"prompt": "Hi", "chosen": "Hello!", "rejected": "Bye."},  # fits
        {"prompt": "Hi", "chosen": "word " * 60, "rejected": "Bye."},  # chosen cut: kept, truncated
        {"prompt": "long " * 60, "chosen": "ok", "rejected": "no"},  # the prompt fills the row: dropped
        '{"prompt": "Hi", "chosen": ',  # malformed
        {"prompt": "Hi", "chosen": "ok", "rejected": "no"},  # fits
    ]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    max_seq_len = 32
    data = prepare(path, tok, max_seq_len=max_seq_len, skip_malformed=True, val_fraction=0.25, seed=1)
    s = data.stats
    assert (s.num_records, s.num_malformed, s.num_template_skipped, s.num_dropped) == (5, 1, 0, 1)
    assert (s.num_pairs, s.num_truncated) == (3, 1)
    assert s.num_records == s.num_pairs + s.num_malformed + s.num_template_skipped + s.num_dropped
    assert s.num_pairs == s.num_train_pairs + s.num_val_pairs == len(data.train) + len(data.val)
    assert s.num_tokens == data.train.num_tokens + data.val.num_tokens
    assert s.num_label_tokens == data.train.num_label_tokens + data.val.num_label_tokens
    assert max(data.train.max_length, data.val.max_length) == max_seq_len  # cut to max_seq_len + 1 tokens
    # the cut row is the first max_seq_len + 1 tokens of prompt + completion (keep_start)
    prompt, chosen = [user("Hi")], [assistant("word " * 60)]
    prompt_ids = encode_prompt(prompt, "chatml", tok)
    expected = trl_rows(prompt_ids, encode_conversation(prompt + chosen, "chatml", tok)[0], max_seq_len + 1)
    splits = (data.train, data.val)
    cut = [(split, k) for split in splits for k in range(len(split)) if split.lengths[k][0] == max_seq_len]
    assert len(cut) == 1 and split_rows(*cut[0])[0] == expected
    # nothing left to train on: the error names the file and each count
    with pytest.raises(DataError) as err:
        prepare(write_jsonl(tmp_path / "d.jsonl", [records[2], records[3]]), tok, max_seq_len=32, skip_malformed=True,
                length_fix="raise seq_len")  # fmt: skip
    assert str(err.value) == (
        f"'{tmp_path / 'd.jsonl'}' leaves no training pair: of 2 record(s) read, 1 malformed (skipped), 0 held out "
        "for validation, the other 1 for training: 1 dropped by truncation to 33 tokens (their prompt fills them, "
        "or a completion has no token left; raise seq_len)"
    )


def test_template_errors_name_the_record_or_are_skipped_and_counted(tmp_path, tok):
    two_turns = {
        "prompt": [user("Capital of France?"), assistant("Paris."), user("And of Italy?")],
        "chosen": "Rome.",
        "rejected": "Milan.",
    }
    path = write_jsonl(
        tmp_path / "t.jsonl", [{"prompt": "Hi", "chosen": "Hello!", "rejected": "Bye."}, "", two_turns]
    )
    with pytest.raises(
        DataError,
        match=rf"^'{re.escape(str(path))}' record 1 \(0-based; line 3\): template 'alpaca' is single-turn.*"
        r"\(set data.skip_malformed to skip such records\)$",
    ):
        prepare(path, tok, "alpaca")
    s = prepare(path, tok, "alpaca", skip_malformed=True).stats
    assert (s.num_records, s.num_pairs, s.num_malformed, s.num_template_skipped) == (2, 1, 0, 1)
    with pytest.raises(DataError, match=r"1 skipped because template 'alpaca' cannot render their roles"):
        prepare(write_jsonl(tmp_path / "only.jsonl", [two_turns]), tok, "alpaca", skip_malformed=True)


def test_a_template_that_refuses_the_system_role_is_named_as_the_cause_with_fixes_that_work(tmp_path):
    gemma = load_tokenizer(save_tokenizer_dir(tmp_path / "gemma", "gemma2_it.jinja"))
    template = resolve_template("auto", gemma)
    with_system = {"prompt": [SYSTEM, user("Hi")], "chosen": "Hello!", "rejected": "Bye."}
    path = write_jsonl(tmp_path / "p.jsonl", [with_system] * 10 + [{"prompt": "long " * 80, **GOOD_REPLIES}])
    with pytest.raises(DataError) as err:
        prepare(
            path,
            gemma,
            template,
            max_seq_len=64,
            val_fraction=0.2,
            skip_malformed=True,
            length_fix="raise seq_len",
        )
    assert str(err.value) == (
        f"'{path}' leaves no training pair: of 11 record(s) read, 2 held out for validation, the other 9 for "
        f"training: 8 skipped because template '{template.path}' refuses the system role (drop the records' system "
        "messages, or set data.template=chatml, which takes a system message and works with any tokenizer), 1 "
        "dropped by truncation to 65 tokens (their prompt fills them, or a completion has no token left; raise "
        "seq_len)"
    )
    # the fixes it names: the system messages dropped, or a template that takes them
    no_system = write_jsonl(tmp_path / "n.jsonl", [{**with_system, "prompt": [user("Hi")]}] * 10)
    assert len(prepare(no_system, gemma, template, max_seq_len=64, val_fraction=0.2).train) == 8
    assert (
        len(prepare(path, gemma, "chatml", max_seq_len=64, val_fraction=0.2, skip_malformed=True).train) == 8
    )


# ----------------------------------------------------------------------------------------------------------------
# Malformed records, column_map


GOOD = {"prompt": "Hi", "chosen": "Hello!", "rejected": "Bye."}
BAD = {
    "missing field": (
        {"prompt": "Hi", "chosen": "Hello!"},
        r"missing field 'rejected'; fields present: 'prompt'",
    ),
    "wrong type": (
        {"prompt": 3, "chosen": "a", "rejected": "b"},
        r"field 'prompt' must be a string or a list",
    ),
    "prompt ends with the assistant": (
        {"prompt": [user("Hi"), assistant("Hello")], "chosen": "a", "rejected": "b"},
        r"field 'prompt' ends with an 'assistant' message; a prompt ends with the user's message",
    ),
    "completion begins with the user": (
        {"prompt": "Hi", "chosen": [user("a"), assistant("b")], "rejected": "b"},
        r"field 'chosen' begins with a 'user' message",
    ),
    "unknown role": (
        {"prompt": [{"role": "human", "content": "Hi"}], "chosen": "a", "rejected": "b"},
        r"field 'prompt' message 0 has role 'human'",
    ),
    "no shared prompt": (
        {"chosen": [assistant("a")], "rejected": [user("b"), assistant("c")]},
        r"missing field 'prompt', and 'chosen' and 'rejected' share no leading message",
    ),
    "implicit prompt from strings": ({"chosen": "a", "rejected": "b"}, r"missing field 'prompt'; without it"),
    "not an object": ([1, 2], r"a record must be a JSON object"),
    "bad JSON line": ('{"prompt": "Hi", ', r"invalid JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_records_are_named_by_file_record_and_line_or_skipped(tmp_path, tok, case):
    bad, why = BAD[case]
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, "", bad, GOOD])  # the bad record is record 1, on line 3
    where = rf"'{re.escape(str(path))}' record 1 \(0-based; line 3\) is malformed: "
    with pytest.raises(DataError, match=rf"^{where}{why}.*\(set data.skip_malformed to skip such records\)$"):
        prepare(path, tok)
    data = prepare(path, tok, skip_malformed=True)
    assert (data.stats.num_records, data.stats.num_malformed, data.stats.num_pairs) == (3, 1, 2)
    if case != "bad JSON line":  # a .json file names the record without a line
        json_path = tmp_path / "p.json"
        json_path.write_text(json.dumps([GOOD, bad]))
        with pytest.raises(
            DataError, match=rf"'{re.escape(str(json_path))}' record 1 \(0-based\) is malformed: {why}"
        ):
            load_pairs(json_path)


def test_every_record_malformed(tmp_path, tok):
    with pytest.raises(DataError, match=r"holds no valid preference record \(2 malformed, skipped\)"):
        prepare(write_jsonl(tmp_path / "bad.jsonl", ["{", "{"]), tok, skip_malformed=True)


def test_column_map(tmp_path, tok):
    renamed = [
        {"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]} for r in (STRING_RECORD, GOOD)
    ]
    column_map = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    a = prepare(write_jsonl(tmp_path / "renamed.jsonl", renamed), tok, column_map=column_map)
    b = prepare(write_jsonl(tmp_path / "plain.jsonl", [STRING_RECORD, GOOD]), tok)
    assert a.train.fingerprint() == b.train.fingerprint()
    with pytest.raises(
        DataError, match=r"missing field 'worse' \(the rejected\); fields present: 'question', 'good'"
    ):
        prepare(tmp_path / "renamed.jsonl", tok, column_map={**column_map, "rejected": "worse"})
    with pytest.raises(DataError, match="column_map key 'answer' is not a field of the preference format"):
        prepare(tmp_path / "plain.jsonl", tok, column_map={"answer": "x"})
    assert format_columns("preference", {"chosen": "good"}) == {**PREFERENCE_COLUMNS, "chosen": "good"}
    assert "preference" in DATA_FORMATS and "preference" not in INSTRUCT_FORMATS
    with pytest.raises(DataError, match="prepare_instruct reads the formats .* not 'preference'"):
        prepare_instruct(tmp_path / "plain.jsonl", "preference", "chatml", tok, max_seq_len=64, val_fraction=0.0,
                         seed=0)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Fingerprint


def test_fingerprint_follows_the_tokens(tmp_path, tok):
    records = [STRING_RECORD, CONV_RECORD, GOOD]
    base = prepare(write_jsonl(tmp_path / "a.jsonl", records), tok).train.fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert prepare(tmp_path / "a.jsonl", tok).train.fingerprint() == base  # deterministic
    assert (
        prepare(tmp_path / "a.jsonl", tok, max_seq_len=1000).train.fingerprint() == base
    )  # nothing cut either way
    changed = [{**STRING_RECORD, "rejected": "Green, surely!"}, CONV_RECORD, GOOD]  # one token of one row
    assert prepare(write_jsonl(tmp_path / "b.jsonl", changed), tok).train.fingerprint() != base
    assert prepare(tmp_path / "a.jsonl", tok, max_seq_len=20).train.fingerprint() != base  # rows cut
    # the label mask enters it: the same tokens, a different prompt / completion boundary
    x, y = np.arange(1, 6, dtype=np.int32), np.array([-100, -100, 3, 4, 5], np.int32)
    y2 = np.array([-100, 2, 3, 4, 5], np.int32)
    one = PreferenceSplit([(x, y)], [(x, y)], pad_id=0)
    assert (
        PreferenceSplit([(x, y)], [(x, y)], pad_id=9).fingerprint() == one.fingerprint()
    )  # padding is not data
    assert PreferenceSplit([(x, y2)], [(x, y)], pad_id=0).fingerprint() != one.fingerprint()
    with pytest.raises(ValueError, match="a chosen and a rejected row"):
        PreferenceSplit([(x, y)], [], pad_id=0)
