"""memfit.data.instruct: every format loads, every template renders exactly (token for token against transformers'
``apply_chat_template`` with Meta's templates, and against Meta's Llama 2 reference on a SentencePiece model), the
loss mask covers exactly the replies, bad records are reported by file, record and line, batches are a pure
function of their position, and a packed batch computes exactly what its samples compute alone.

Assets (tests/assets, provenance in SOURCES.md): a Dolly sample, two ShareGPT chats, torchtune's 2k SentencePiece
and tiktoken models.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from memfit.data.chat_template import ChatTemplate
from memfit.data.instruct import IGNORE_INDEX, InstructSplit, batch_position, prepare_instruct
from memfit.data.records import load_conversations
from memfit.data.templates import builtin_template_source, encode_conversation, encode_prompt, stop_token_ids
from memfit.data_formats import TEMPLATES
from memfit.errors import DataError
from memfit.tokenizer import LLAMA3_PATTERN, load_tokenizer, train_bpe

ASSETS = Path(__file__).parent.parent / "assets"
DOLLY = ASSETS / "dolly_sample.json"
SHAREGPT_TINY = ASSETS / "sharegpt_tiny.json"
SHAREGPT_CONV = ASSETS / "sharegpt_conversation.json"

ALPACA_RECORDS = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "Eat well, sleep, move."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {"instruction": "Name a colour.", "output": "Blue"},  # no input field at all
]
OPENAI_RECORDS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
        ]
    },
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]
# A chat whose contents carry surrounding whitespace and inner newlines (the chat templates strip the former).
CHAT = [
    {"role": "system", "content": "You are a helpful assistant.\n"},
    {"role": "user", "content": "  What is the capital of France?"},
    {"role": "assistant", "content": "Paris.\nIt is also its largest city. "},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records), encoding="utf-8")
    return path


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def chat_text() -> list[str]:
    texts = [json.dumps(json.loads(p.read_text())) for p in (DOLLY, SHAREGPT_TINY, SHAREGPT_CONV)]
    return texts + [m["content"] for m in CHAT]


def hf_bpe(tmp_path: Path, specials: list[str], llama3_split: bool) -> Path:
    """A byte-level BPE ``tokenizer.json`` with the given special tokens, trained on the test chats."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    if llama3_split:  # Llama 3's tokenizer.json: its split regex, then byte-level without GPT-2's regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(chat_text(), trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def hf_reference(path: Path, bos: str | None, eos: str, template: str):
    PreTrainedTokenizerFast = pytest.importorskip("transformers").PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=bos, eos_token=eos)
    hf.chat_template = template
    return hf


def hf_ids(hf, messages, generation_prompt: bool = False) -> list[int]:
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return hf.encode(text, add_special_tokens=False)


# Meta's templates as published in the tokenizer_config.json of meta-llama/Meta-Llama-3-8B-Instruct and
# meta-llama/Llama-2-7b-chat-hf, and the usual ChatML template.
LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA2_JINJA = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
    "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}"
    "{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
    "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
CHATML_JINJA = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def bpe():
    """memfit's own byte-level BPE: <|begin_of_text|> (BOS) and <|end_of_text|> (EOS), no chat tokens."""
    return train_bpe(chat_text(), 600)


@pytest.fixture(scope="module")
def tiktoken_tok():
    return load_tokenizer(ASSETS / "tiktoken_2k.model")


@pytest.fixture(scope="module")
def sp_tok():
    return load_tokenizer(ASSETS / "sentencepiece_2k.model")


def trained_text(tok, ids, labels) -> str:
    return tok.decode([i for i, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


# ----------------------------------------------------------------------------------------------------------------
# Loading


def test_dolly_asset_loads_as_alpaca_with_context_as_input():
    convs, skipped = load_conversations(DOLLY, "dolly")
    records = json.loads(DOLLY.read_text())
    assert skipped == 0 and len(convs) == len(records) == 12
    for conv, rec in zip(convs, records, strict=True):
        user = {"role": "user", "content": rec["instruction"]}
        if rec["context"]:
            user["input"] = rec["context"]
        assert conv == [user, {"role": "assistant", "content": rec["response"]}]
    # dolly is alpaca through a column mapping
    assert (
        load_conversations(DOLLY, "alpaca", column_map={"input": "context", "output": "response"})[0] == convs
    )


def test_sharegpt_assets_load():
    convs, skipped = load_conversations(SHAREGPT_TINY, "sharegpt")
    assert skipped == 0
    assert [m["role"] for m in convs[0]] == ["system", "user", "assistant", "user", "assistant"]
    assert convs[0][1] == {"role": "user", "content": "What is the meaning of life?"}
    assert convs[0][4] == {"role": "assistant", "content": "I agree."}
    # a single record stored as an object
    convs, _ = load_conversations(SHAREGPT_CONV, "sharegpt")
    raw = json.loads(SHAREGPT_CONV.read_text())["conversations"]
    assert len(convs) == 1 and [m["content"] for m in convs[0]] == [t["value"] for t in raw]
    assert [m["role"] for m in convs[0]] == ["user" if t["from"] == "human" else "assistant" for t in raw]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_alpaca_and_openai_load_from_json_and_jsonl(tmp_path, suffix):
    def write(name, records):
        if suffix == ".json":
            return write_json(tmp_path / f"{name}.json", records)
        lines = [json.dumps(r) for r in records]
        return write_jsonl(
            tmp_path / f"{name}.jsonl", [lines[0], "", "   ", *lines[1:]]
        )  # blank lines ignored

    convs, skipped = load_conversations(write("alpaca", ALPACA_RECORDS), "alpaca")
    assert skipped == 0
    assert convs == [
        [
            {"role": "user", "content": "Give three tips for staying healthy."},
            {"role": "assistant", "content": "Eat well, sleep, move."},
        ],
        [
            {"role": "user", "content": "Translate to French.", "input": "Good morning"},
            {"role": "assistant", "content": "Bonjour"},
        ],
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}],
    ]
    convs, _ = load_conversations(write("openai", OPENAI_RECORDS), "openai")
    assert convs == [r["messages"] for r in OPENAI_RECORDS]


def test_column_map(tmp_path):
    records = [
        {"question": r["instruction"], "input": r.get("input", ""), "answer": r["output"]}
        for r in ALPACA_RECORDS
    ]
    path = write_json(tmp_path / "qa.json", records)
    expected, _ = load_conversations(write_json(tmp_path / "a.json", ALPACA_RECORDS), "alpaca")
    got, _ = load_conversations(path, "alpaca", column_map={"instruction": "question", "output": "answer"})
    assert got == expected
    chats = [
        {"chat": [{"speaker": m["role"], "text": m["content"]} for m in r["messages"]]}
        for r in OPENAI_RECORDS
    ]
    got, _ = load_conversations(
        write_json(tmp_path / "c.json", chats),
        "openai",
        column_map={"messages": "chat", "role": "speaker", "content": "text"},
    )
    assert got == [r["messages"] for r in OPENAI_RECORDS]
    with pytest.raises(
        DataError, match=r"'question' is not a field of the alpaca format.*instruction, input, output"
    ):
        load_conversations(path, "alpaca", column_map={"question": "instruction"})
    with pytest.raises(DataError, match="unknown data format 'csv'"):
        load_conversations(path, "csv")


BAD_RECORDS = {
    "missing field": ('{"instruction": "x"}', "alpaca", "missing field 'output'"),
    "not a string": (
        '{"instruction": "x", "output": 3}',
        "alpaca",
        "field 'output' must be a string, got int 3",
    ),
    "not an object": ('["x", "y"]', "alpaca", "a record must be a JSON object, got list"),
    "unknown role": (
        '{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}',
        "sharegpt",
        "turn 1 has unknown speaker 'bot'",
    ),
    "unknown openai role": (
        '{"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]}',
        "openai",
        "turn 1 has unknown role 'tool'",
    ),
    "empty conversation": ('{"conversations": []}', "sharegpt", "the conversation is empty"),
    "no assistant turn": (
        '{"messages": [{"role": "user", "content": "a"}]}',
        "openai",
        "the conversation has no assistant turn",
    ),
    "invalid json": ('{"instruction": "x", ', "alpaca", "invalid JSON"),
}
GOOD_LINE = {
    "alpaca": '{"instruction": "i", "output": "o"}',
    "sharegpt": '{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}',
    "openai": '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}',
}


@pytest.mark.parametrize("case", list(BAD_RECORDS))
def test_malformed_record_named_by_file_record_and_line(tmp_path, case):
    bad, fmt, why = BAD_RECORDS[case]
    good = GOOD_LINE[fmt]
    path = write_jsonl(
        tmp_path / "data.jsonl", [good, "", bad, good]
    )  # the bad record is record 1, on line 3
    with pytest.raises(
        DataError, match=rf"'{re.escape(str(path))}' record 1 \(0-based; line 3\) is malformed: {why}"
    ):
        load_conversations(path, fmt)
    convs, skipped = load_conversations(path, fmt, skip_malformed=True)
    assert (len(convs), skipped) == (2, 1)
    if case != "invalid json":  # a .json file names the record index (no line)
        json_path = tmp_path / "data.json"
        json_path.write_text(f"[{good}, {bad}]")
        with pytest.raises(
            DataError, match=rf"'{re.escape(str(json_path))}' record 1 \(0-based\) is malformed: {why}"
        ):
            load_conversations(json_path, fmt)
        assert load_conversations(json_path, fmt, skip_malformed=True)[1] == 1


def test_bad_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_conversations(tmp_path / "nope.json", "alpaca")
    with pytest.raises(DataError, match=r"extension '\.csv'"):
        load_conversations(write_json(tmp_path / "a.csv", ALPACA_RECORDS), "alpaca")
    lines = write_jsonl(tmp_path / "lines.json", [json.dumps(r) for r in ALPACA_RECORDS])
    with pytest.raises(DataError, match="line 2, column 1; it looks like JSON Lines"):
        load_conversations(lines, "alpaca")
    with pytest.raises(DataError, match="holds no records"):
        load_conversations(write_json(tmp_path / "empty.json", []), "alpaca")
    all_bad = write_jsonl(tmp_path / "bad.jsonl", ["{", "{"])
    with pytest.raises(DataError, match=r"no valid alpaca record \(2 malformed"):
        load_conversations(all_bad, "alpaca", skip_malformed=True)


# ----------------------------------------------------------------------------------------------------------------
# Templates


def test_alpaca_template_exact_text_and_mask(bpe):
    with_input = [
        {"role": "user", "content": "Translate to French.", "input": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
    ]
    ids, labels = encode_conversation(with_input, "alpaca", bpe)
    prompt = (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nTranslate to French."
        "\n\n### Input:\nGood morning\n\n### Response:\n"
    )
    assert bpe.decode(ids) == f"<|begin_of_text|>{prompt}Bonjour<|end_of_text|>"
    # segment by segment equals Stanford Alpaca's whole-string tokenization (source + target) here
    assert ids == [bpe.bos_id, *bpe.encode(prompt + "Bonjour"), bpe.eos_id]
    n_prompt = 1 + len(bpe.encode(prompt))
    assert labels == [IGNORE_INDEX] * n_prompt + ids[n_prompt:]
    assert trained_text(bpe, ids, labels) == "Bonjour<|end_of_text|>"

    no_input = [{"role": "system", "content": "Be terse."}, *ALPACA_CONVS[0]]
    ids, _ = encode_conversation(no_input, "alpaca", bpe)
    assert bpe.decode(ids) == (
        "<|begin_of_text|>Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nBe terse.\n\nName a colour.\n\n### Response:\nBlue<|end_of_text|>"
    )
    with pytest.raises(DataError, match="'alpaca' is single-turn.*'user', 'assistant', 'user', 'assistant'"):
        encode_conversation(CHAT, "alpaca", bpe)


ALPACA_CONVS = [[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]]


def test_llama3_template_matches_transformers(tmp_path):
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
    ]
    path = hf_bpe(tmp_path, specials, llama3_split=True)
    tok = load_tokenizer(path)
    hf = hf_reference(path, "<|begin_of_text|>", "<|end_of_text|>", LLAMA3_JINJA)
    ids, labels = encode_conversation(CHAT, "llama3-chat", tok)
    assert ids == hf_ids(hf, CHAT)
    assert encode_prompt(CHAT[:4], "llama3-chat", tok) == hf_ids(hf, CHAT[:4], generation_prompt=True)
    assert trained_text(tok, ids, labels) == "Paris.\nIt is also its largest city.<|eot_id|>Rome.<|eot_id|>"


def test_llama2_template_matches_transformers(tmp_path):
    path = hf_bpe(tmp_path, ["<unk>", "<s>", "</s>"], llama3_split=False)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = load_tokenizer(path)
    hf = hf_reference(path, "<s>", "</s>", LLAMA2_JINJA)
    ids, labels = encode_conversation(CHAT, "llama2-chat", tok)
    assert ids == hf_ids(hf, CHAT)
    assert tok.decode(ids) == (
        "<s>[INST] <<SYS>>\nYou are a helpful assistant.\n\n<</SYS>>\n\n  What is the capital of France? [/INST] "
        "Paris.\nIt is also its largest city. </s><s>[INST] And of Italy? [/INST] Rome. </s>"
    )
    assert [i for i, t in enumerate(ids) if t == tok.bos_id] == [0, ids.index(tok.eos_id) + 1]
    assert encode_prompt(CHAT[:4], "llama2-chat", tok) == hf_ids(hf, CHAT[:4])
    assert trained_text(tok, ids, labels) == " Paris.\nIt is also its largest city. </s> Rome. </s>"


def test_llama2_template_matches_meta_reference_on_sentencepiece(sp_tok):
    # meta-llama/llama generation.py chat_completion: each exchange is encoded as one string with BOS and EOS.
    ids, labels = encode_conversation(CHAT, "llama2-chat", sp_tok)
    sys_user = "<<SYS>>\n" + CHAT[0]["content"] + "\n<</SYS>>\n\n" + CHAT[1]["content"]
    expected = []
    for user, reply in ((sys_user, CHAT[2]["content"]), (CHAT[3]["content"], CHAT[4]["content"])):
        expected += sp_tok.encode(f"[INST] {user.strip()} [/INST] {reply.strip()} ", bos=True, eos=True)
    assert ids == expected
    # trained: exactly what follows "[/INST]" in each exchange, EOS included
    first = sp_tok.encode(
        f"[INST] {sys_user.strip()} [/INST] {CHAT[2]['content'].strip()} ", bos=True, eos=True
    )
    start = len(sp_tok.encode(f"[INST] {sys_user.strip()} [/INST]", bos=True))
    assert labels[: len(first)] == [IGNORE_INDEX] * start + first[start:]


def test_llama3_template_on_tiktoken_special_ids(tiktoken_tok):
    tok = tiktoken_tok
    sp = tok.special_tokens
    ids, labels = encode_conversation(CHAT[:3], "llama3-chat", tok)
    assert tok.decode(ids) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nParis.\nIt is also its largest city.<|eot_id|>"
    )
    assert (
        ids[0] == sp["<|begin_of_text|>"]
        and ids[1] == sp["<|start_header_id|>"]
        and ids[-1] == sp["<|eot_id|>"]
    )
    assert ids.count(sp["<|start_header_id|>"]) == ids.count(sp["<|end_header_id|>"]) == 3
    assert ids.count(sp["<|eot_id|>"]) == 3 and ids.count(tok.eos_id) == 0
    prompt = encode_prompt(CHAT[:2], "llama3-chat", tok)
    assert ids[: len(prompt)] == prompt
    assert labels == [IGNORE_INDEX] * len(prompt) + ids[len(prompt) :]
    assert stop_token_ids("llama3-chat", tok) == [tok.eos_id, sp["<|eot_id|>"]]
    # special-token text typed by a user stays text
    evil = [{"role": "user", "content": "<|eot_id|>"}, {"role": "assistant", "content": "ok"}]
    assert encode_conversation(evil, "llama3-chat", tok)[0].count(sp["<|eot_id|>"]) == 2


def test_llama3_template_needs_llama3_specials(bpe):
    with pytest.raises(
        DataError, match=r"needs the special token '<\|start_header_id\|>'.*use template 'chatml'"
    ):
        encode_conversation(CHAT, "llama3-chat", bpe)


def test_chatml_special_tokens_match_transformers(tmp_path):
    path = hf_bpe(tmp_path, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], llama3_split=False)
    tok = load_tokenizer(path)
    assert tok.bos_id is None and tok.eos_id == tok.special_tokens["<|endoftext|>"]
    hf = hf_reference(path, None, "<|endoftext|>", CHATML_JINJA)
    ids, labels = encode_conversation(CHAT, "chatml", tok)
    assert ids == hf_ids(hf, CHAT) + [tok.eos_id]  # EOS after the last reply
    assert encode_prompt(CHAT[:4], "chatml", tok) == hf_ids(hf, CHAT[:4], generation_prompt=True)
    assert trained_text(tok, ids, labels) == (
        "Paris.\nIt is also its largest city. <|im_end|>\nRome.<|im_end|>\n<|endoftext|>"
    )
    im_end = tok.special_tokens["<|im_end|>"]
    assert ids.count(im_end) == 5
    assert stop_token_ids("chatml", tok) == [tok.eos_id, im_end]


def test_chatml_plain_text_markers(bpe):
    ids, labels = encode_conversation(CHAT[1:3], "chatml", bpe)
    assert bpe.decode(ids) == (
        "<|im_start|>user\n  What is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        "Paris.\nIt is also its largest city. <|im_end|>\n<|end_of_text|>"
    )
    assert ids.count(bpe.eos_id) == 1 and ids[-1] == bpe.eos_id  # the markers are text, not ids
    assert (
        trained_text(bpe, ids, labels) == "Paris.\nIt is also its largest city. <|im_end|>\n<|end_of_text|>"
    )
    assert stop_token_ids("chatml", bpe) == [bpe.eos_id]


@pytest.mark.parametrize("template", TEMPLATES)
def test_mask_is_exactly_the_prompt_and_train_on_prompt(template, tiktoken_tok):
    conv = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, or green."},
    ]
    ids, labels = encode_conversation(conv, template, tiktoken_tok)
    prompt = encode_prompt(conv[:1], template, tiktoken_tok)
    assert ids[: len(prompt)] == prompt
    assert labels == [IGNORE_INDEX] * len(prompt) + ids[len(prompt) :]
    assert len(ids) > len(prompt) + 1
    ids2, labels2 = encode_conversation(conv, template, tiktoken_tok, train_on_prompt=True)
    assert ids2 == ids and labels2 == ids
    # messages after the last reply are not rendered; a conversation without one is refused
    assert (
        encode_conversation([*conv, {"role": "user", "content": "More?"}], template, tiktoken_tok)[0] == ids
    )
    with pytest.raises(DataError, match="no assistant reply"):
        encode_conversation(conv[:1], template, tiktoken_tok)
    with pytest.raises(DataError, match="ends with a user message"):
        encode_prompt(conv, template, tiktoken_tok)


def test_llama2_refuses_non_alternating_roles(sp_tok):
    conv = [{"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Hello"}, CHAT[2]]
    with pytest.raises(DataError, match="message 0 is 'assistant' where 'user' belongs"):
        encode_conversation(conv, "llama2-chat", sp_tok)


# The built-in templates as Jinja (what memfit export writes): transformers renders what memfit trains on
ALL_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|im_start|>",
    "<|im_end|>",
]
JINJA_CONVERSATIONS = {
    "alpaca": [
        [{"role": "system", "content": "Be terse."}, *ALPACA_CONVS[0]],
        [{"role": "user", "content": "Translate to French.", "input": "Good morning"}, CHAT[4]],
    ],
    "chat": [CHAT, [{"role": "user", "content": "Translate to French.", "input": "Good morning"}, CHAT[4]]],
}


@pytest.fixture(scope="module")
def every_special(tmp_path_factory):
    """A Llama-3-style byte-level BPE with BOS, EOS and the special tokens of every built-in template, and the
    same file in transformers' ``PreTrainedTokenizerFast``."""
    tmp = tmp_path_factory.mktemp("every_special")
    path = hf_bpe(tmp, ALL_SPECIALS, llama3_split=True)
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"})
    )
    return load_tokenizer(path), hf_reference(path, "<|begin_of_text|>", "<|end_of_text|>", "")


@pytest.mark.parametrize("template", TEMPLATES)
def test_builtin_template_as_jinja_renders_what_memfit_trains_on(template, every_special):
    """transformers' apply_chat_template with a built-in template's Jinja gives the text and the ids memfit's
    renderer gives: a whole conversation (training) and its prompt with the generation prompt (sampling), with an
    Alpaca/Dolly ``input``; memfit reading the same Jinja as a checkpoint's template trains the same tokens."""
    tok, hf = every_special
    source = builtin_template_source(template, tok)
    assert source.tokens == {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    hf.chat_template = source.text
    for conversation in JINJA_CONVERSATIONS["alpaca" if template == "alpaca" else "chat"]:
        ids, labels = encode_conversation(conversation, template, tok)
        text = hf.apply_chat_template(conversation, tokenize=False)
        assert text == tok.decode(ids)
        assert hf.encode(text, add_special_tokens=False) == ids
        users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
        prompt = conversation[: users[-1] + 1]
        prompt_ids = encode_prompt(prompt, template, tok)
        text = hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        assert text == tok.decode(prompt_ids)
        assert hf.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False) == prompt_ids
        if not any("input" in m for m in conversation):  # memfit's Jinja reading folds input into the content
            jinja = ChatTemplate(source)
            assert jinja.encode(conversation, tok) == (ids, labels)
            assert jinja.encode_prompt(prompt, tok) == prompt_ids
    if template in ("alpaca", "llama2-chat"):  # a conversation the template does not take is refused
        refused = CHAT[1:] if template == "alpaca" else [CHAT[2], *CHAT[1:3]]
        with pytest.raises(Exception, match=f"template '{template}'"):
            hf.apply_chat_template(refused, tokenize=False)


# ----------------------------------------------------------------------------------------------------------------
# prepare_instruct: splits, truncation, dropping, template errors


def test_prepare_split_and_stats(bpe):
    data = prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=4096, val_fraction=0.25, seed=3)
    s = data.stats
    assert (s.num_records, s.num_skipped, s.num_truncated, s.num_dropped) == (12, 0, 0, 0)
    assert (len(data.train), len(data.val)) == (s.num_train_samples, s.num_val_samples) == (9, 3)
    assert (s.num_val_records, s.num_val_dropped) == (3, 0)
    assert data.train.num_tokens + data.val.num_tokens == s.num_tokens
    assert data.train.num_label_tokens + data.val.num_label_tokens == s.num_label_tokens
    # the split is a function of the seed
    again = prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=4096, val_fraction=0.25, seed=3)
    assert torch.equal(again.val.batch(3, 0, None)[0], data.val.batch(3, 0, None)[0])
    other = prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=4096, val_fraction=0.25, seed=4)
    assert not np.array_equal(other.val.lengths, data.val.lengths)
    # val_fraction 0: no validation split; a small fraction still holds out one record
    none = prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=4096, val_fraction=0.0, seed=3)
    assert (len(none.train), len(none.val)) == (12, 0)
    with pytest.raises(DataError, match="holds no samples"):
        none.val.batch(2, 0, None)
    assert (
        len(prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=4096, val_fraction=0.01, seed=3).val)
        == 1
    )
    with pytest.raises(DataError, match=r"val_fraction must be in \[0, 1\)"):
        prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=64, val_fraction=1.0, seed=3)


def test_prepare_truncates_and_drops(tmp_path, bpe):
    records = [
        {"instruction": "Say hi.", "output": "hi"},  # fits
        {"instruction": "Write a long answer.", "output": "word " * 200},  # truncated, replies left: kept
        {"instruction": "long prompt " * 200, "output": "ok"},  # truncated inside the prompt: dropped
    ]
    path = write_json(tmp_path / "t.json", records)
    max_seq_len = 96
    data = prepare_instruct(path, "alpaca", "alpaca", bpe, max_seq_len=max_seq_len, val_fraction=0.0, seed=0)
    s = data.stats
    assert (s.num_records, s.num_truncated, s.num_dropped, len(data.train)) == (3, 2, 1, 2)
    assert sorted(data.train.lengths.tolist())[-1] == max_seq_len  # cut to max_seq_len + 1 tokens
    full_ids, full_labels = encode_conversation(
        load_conversations(path, "alpaca")[0][1], "alpaca", bpe, train_on_prompt=False
    )
    _, targets, _ = data.train.collate([1])
    assert targets[0].tolist() == full_labels[1 : max_seq_len + 1]
    with pytest.raises(DataError) as err:
        prepare_instruct(
            write_json(tmp_path / "d.json", records[2:]), "alpaca", "alpaca", bpe, max_seq_len=96,
            val_fraction=0.0, seed=0,
        )  # fmt: skip
    assert str(err.value) == (
        f"'{tmp_path / 'd.json'}' leaves no training sample: of 1 record(s) read, 0 held out for validation, the "
        "other 1 for training: 1 with nothing to train on after truncation to 97 tokens (raise max_seq_len)"
    )


def test_prepare_template_errors_name_the_record_or_are_skipped(tmp_path, bpe):
    lines = [
        json.dumps(OPENAI_RECORDS[1]),
        "{not json",
        json.dumps({"messages": CHAT}),
        json.dumps(OPENAI_RECORDS[0]),
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", lines)
    data = prepare_instruct(
        path, "openai", "alpaca", bpe, max_seq_len=256, val_fraction=0.0, seed=0, skip_malformed=True
    )  # the invalid line at loading, the multi-turn chat at rendering
    assert (data.stats.num_records, data.stats.num_skipped, len(data.train)) == (3, 2, 2)
    path = write_jsonl(tmp_path / "chat.jsonl", [lines[0], "", lines[2]])
    with pytest.raises(DataError, match=r"record 1 \(0-based; line 3\): template 'alpaca' is single-turn"):
        prepare_instruct(path, "openai", "alpaca", bpe, max_seq_len=256, val_fraction=0.0, seed=0)
    with pytest.raises(
        DataError,
        match=rf"'{re.escape(str(SHAREGPT_TINY))}' record 0 \(0-based\): template 'alpaca' is single-turn",
    ):
        prepare_instruct(SHAREGPT_TINY, "sharegpt", "alpaca", bpe, max_seq_len=64, val_fraction=0.0, seed=0)
    with pytest.raises(DataError, match="leaves no training sample"):
        prepare_instruct(
            SHAREGPT_TINY,
            "sharegpt",
            "alpaca",
            bpe,
            max_seq_len=64,
            val_fraction=0.0,
            seed=0,
            skip_malformed=True,
        )
    with pytest.raises(DataError, match="needs the special token"):  # before reading any record
        prepare_instruct(
            SHAREGPT_TINY, "sharegpt", "llama3-chat", bpe, max_seq_len=64, val_fraction=0.0, seed=0
        )


# ----------------------------------------------------------------------------------------------------------------
# Batches


@pytest.fixture(scope="module")
def dolly_data(bpe):
    return prepare_instruct(DOLLY, "dolly", "alpaca", bpe, max_seq_len=4096, val_fraction=0.25, seed=0)


def test_batch_is_a_pure_function_of_position(dolly_data):
    train = dolly_data.train
    n = len(train)
    a = train.batch(4, 7, seed=11)
    b = train.batch(4, 7, seed=11)
    assert all(torch.equal(x, y) for x, y in zip(a[:2], b[:2], strict=True)) and a[2] is None
    # an epoch visits every sample once; epochs differ; a batch may run across an epoch boundary
    seen = np.concatenate([train.indices(3, p, seed=11) for p in range(0, n, 3)])
    assert sorted(seen.tolist()) == list(range(n))
    assert not np.array_equal(train.order(0, 11), train.order(1, 11))
    assert train.indices(2, n - 1, seed=11).tolist() == [train.order(0, 11)[n - 1], train.order(1, 11)[0]]
    assert train.indices(n, 0, seed=None).tolist() == list(range(n))  # validation: file order
    assert np.array_equal(train.order(5, 11), np.random.default_rng([11, 5]).permutation(n))
    assert (
        batch_position(step=2, micro_step=1, batch_size=4, gradient_accumulation_steps=3) == (2 * 3 + 1) * 4
    )
    assert batch_position(2, 1, 4, 3, rank=1, world_size=2) == ((2 * 3 + 1) * 2 + 1) * 4


def test_batch_padding(dolly_data, bpe):
    train = dolly_data.train
    inputs, targets, doc_ids = train.batch(len(train), 0, seed=None)
    lengths = train.lengths
    assert doc_ids is None and inputs.dtype == targets.dtype == torch.int64
    assert inputs.shape == targets.shape == (len(train), int(lengths.max()))
    for row, n in enumerate(lengths.tolist()):
        assert (targets[row, n:] == IGNORE_INDEX).all() and (inputs[row, n:] == bpe.eos_id).all()
        assert (targets[row, :n] != IGNORE_INDEX).any()
    assert int((targets != IGNORE_INDEX).sum()) == train.num_label_tokens
    # eval helper: every item once, in order
    assert sum(b[0].shape[0] for b in dolly_data.val.epoch_batches(2)) == len(dolly_data.val) == 3
    assert dolly_data.val.num_batches(2) == 2


# ----------------------------------------------------------------------------------------------------------------
# Packing


@pytest.fixture(scope="module")
def packed_pair(tiktoken_tok):
    kw = dict(max_seq_len=384, val_fraction=0.0, seed=5)
    plain = prepare_instruct(DOLLY, "dolly", "llama3-chat", tiktoken_tok, **kw)
    packed = prepare_instruct(DOLLY, "dolly", "llama3-chat", tiktoken_tok, packing=True, **kw)
    return plain, packed


def test_packed_rows(packed_pair):
    plain, packed = packed_pair
    T = 384
    rows = packed.train
    assert rows.packed and len(rows) == packed.stats.num_train_rows < len(plain.train)
    inputs, targets, doc_ids = rows.batch(len(rows), 0, seed=None)
    assert inputs.shape == targets.shape == doc_ids.shape == (len(rows), T) and doc_ids.dtype == torch.int64
    pieces = []
    for r in range(len(rows)):
        d = doc_ids[r]
        assert d[0] == 0 and ((d[1:] - d[:-1]) >= 0).all() and ((d[1:] - d[:-1]) <= 1).all()
        for k in range(int(d.max()) + 1):
            sel = d == k
            pieces.append((tuple(inputs[r, sel].tolist()), tuple(targets[r, sel].tolist())))
    # every sample once; padding pieces are all IGNORE_INDEX targets and padded with the pad id
    samples = set()
    for i in range(len(plain.train)):
        x, y, _ = plain.train.collate([i])
        samples.add((tuple(x[0].tolist()), tuple(y[0].tolist())))
    real = [p for p in pieces if any(t != IGNORE_INDEX for t in p[1])]
    pads = [p for p in pieces if all(t == IGNORE_INDEX for t in p[1])]
    assert len(real) == len(plain.train) and set(real) == samples
    assert all(set(p[0]) == {rows.pad_id} for p in pads)
    assert rows.num_tokens == plain.train.num_tokens == packed.stats.num_tokens
    assert packed.stats.packing_efficiency == pytest.approx(rows.num_tokens / (len(rows) * T))
    assert 0.5 < packed.stats.packing_efficiency <= 1.0


def test_packed_loss_equals_unpacked_losses(packed_pair):
    from memfit.models.decoder import build_decoder
    from memfit.models.presets import model_config

    plain, packed = packed_pair
    torch.manual_seed(0)
    model = build_decoder(model_config("tiny", vocab_size=2256, max_seq_len=384), seed=0).eval()
    with torch.no_grad():
        inputs, targets, doc_ids = packed.train.batch(len(packed.train), 0, seed=None)
        logits = model(inputs, doc_ids)  # (B, T, V)
        packed_loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        per_sample = []
        for i in range(len(plain.train)):
            x, y, _ = plain.train.collate([i])
            per_sample.append(F.cross_entropy(model(x)[0], y[0], ignore_index=IGNORE_INDEX, reduction="sum"))
    torch.testing.assert_close(packed_loss, torch.stack(per_sample).sum(), rtol=1e-5, atol=1e-5)
    # and each packed sample's loss equals its own
    own = {tuple(plain.train.collate([i])[0][0].tolist()): per_sample[i] for i in range(len(plain.train))}
    with torch.no_grad():
        token_loss = F.cross_entropy(
            logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
        )  # (B, T)
    for r in range(inputs.shape[0]):
        for k in range(int(doc_ids[r].max()) + 1):
            sel = doc_ids[r] == k
            key = tuple(inputs[r, sel].tolist())
            if key in own:
                torch.testing.assert_close(token_loss[r, sel].sum(), own[key], rtol=1e-5, atol=1e-5)


def test_unpacked_split_rejects_mismatched_items():
    with pytest.raises(ValueError, match="same length"):
        InstructSplit([np.zeros(3, np.int32)], [np.zeros(2, np.int32)], None, pad_id=0)
