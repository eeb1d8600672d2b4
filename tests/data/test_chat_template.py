"""A checkpoint's own chat template: ids equal transformers' apply_chat_template, masks cover exactly the replies.

The templates are those real checkpoints ship (tests/assets/chat_templates, provenance in tests/assets/SOURCES.md),
each saved with a byte-level BPE tokenizer.json built here from GPT-2's files plus the special tokens it names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.data.chat_template import ChatTemplate
from memfit.data.instruct import prepare_instruct
from memfit.data.templates import (
    encode_conversation,
    encode_prompt,
    resolve_template,
    stop_token_ids,
    template_label,
)
from memfit.errors import DataError
from memfit.memory.techniques import IGNORE_INDEX
from memfit.tokenizer import load_tokenizer

ASSETS = Path(__file__).resolve().parents[1] / "assets"
TEMPLATES = ASSETS / "chat_templates"

# template file -> (bos, eos, the special tokens it writes, whether it takes a system message, end of a turn)
SPECS = {
    "llama32_instruct.jinja": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        True,
        "<|eot_id|>",
    ),
    "qwen25_instruct.jinja": (None, "<|im_end|>", ["<|im_start|>", "<|im_end|>"], True, "<|im_end|>\n"),
    "smollm2_instruct.jinja": (
        "<|im_start|>",
        "<|im_end|>",
        ["<|im_start|>", "<|im_end|>"],
        True,
        "<|im_end|>\n",
    ),
    "gemma2_it.jinja": (
        "<bos>",
        "<eos>",
        ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
        False,
        "<end_of_turn>\n",
    ),
    "phi35_mini_instruct.jinja": (
        "<s>",
        "<|endoftext|>",
        ["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
        True,
        "<|end|>\n",
    ),
}

SYSTEM = {"role": "system", "content": "You are a terse geography tutor."}
CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy, in one word?"},
    {"role": "assistant", "content": " Rome, of course.\n"},
]


def save_tokenizer_dir(directory: Path, template: str, *, in_config: bool = False) -> Path:
    """A Hugging Face tokenizer directory: GPT-2's BPE with the template's special tokens, and the template
    (chat_template.jinja, or with ``in_config`` the ``chat_template`` of tokenizer_config.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    bos, eos, specials, _, _ = SPECS[template]
    vocab = json.loads((ASSETS / "gpt2_encoder.json").read_text())
    merges = [
        tuple(line.split()) for line in (ASSETS / "gpt2_vocab.bpe").read_text().splitlines()[1:] if line
    ]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ["<|endoftext|>", *specials]]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    text = (TEMPLATES / template).read_text(encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos}
    config["pad_token"] = "<|endoftext|>"
    if in_config:
        config["chat_template"] = text
    else:
        (directory / "chat_template.jinja").write_text(text, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


def _conversations(template: str) -> list[list[dict[str, str]]]:
    with_system = SPECS[template][3]
    chats = [CHAT[:2], CHAT]
    if with_system:
        chats.append([SYSTEM, *CHAT])
    return chats


@pytest.mark.parametrize("in_config", [False, True], ids=["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("template", list(SPECS))
def test_ids_equal_apply_chat_template_and_labels_are_the_replies(tmp_path, template, in_config):
    transformers = pytest.importorskip("transformers")
    directory = save_tokenizer_dir(tmp_path / "tok", template, in_config=in_config)
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    tokenizer = load_tokenizer(directory)
    chat = resolve_template("auto", tokenizer)
    assert isinstance(chat, ChatTemplate)
    where = "chat_template.jinja" if not in_config else "tokenizer_config.json"
    assert chat.path == str(directory / where)
    end_of_turn = SPECS[template][4]
    for messages in _conversations(template):
        ids, labels = encode_conversation(messages, chat, tokenizer)
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ids == list(expected)
        # the trained tokens are exactly each reply with the end of turn that closes it (Phi-3 also ends the
        # conversation with EOS after its last turn, which the last reply keeps)
        trained = [i for i, t in zip(ids, labels, strict=True) if t != IGNORE_INDEX]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        if template == "gemma2_it.jinja" or template == "llama32_instruct.jinja":
            replies = [r.strip() for r in replies]  # these templates trim every message
        tail = SPECS[template][1] if template == "phi35_mini_instruct.jinja" else ""
        want = "".join(r + end_of_turn for r in replies) + tail
        assert tokenizer.decode(trained) == want
        # and they are contiguous runs that decode to the replies one by one
        runs, run = [], []
        for i, t in zip(ids, labels, strict=True):
            if t != IGNORE_INDEX:
                run.append(i)
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        assert [tokenizer.decode(r) for r in runs][: len(replies)] == [
            r + end_of_turn + (tail if k == len(replies) - 1 else "") for k, r in enumerate(replies)
        ]
        # the generation prompt
        prompt = messages[:-1]
        expected_prompt = reference.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert encode_prompt(prompt, chat, tokenizer) == list(expected_prompt)


@pytest.mark.parametrize(
    ("template", "stop"),
    [
        ("llama32_instruct.jinja", ["<|eot_id|>"]),
        ("qwen25_instruct.jinja", ["<|im_end|>"]),
        ("smollm2_instruct.jinja", ["<|im_end|>"]),
        ("gemma2_it.jinja", ["<eos>", "<end_of_turn>"]),
        ("phi35_mini_instruct.jinja", ["<|endoftext|>", "<|end|>"]),
    ],
)
def test_generation_stops_at_the_token_that_closes_a_reply(tmp_path, template, stop):
    tokenizer = load_tokenizer(save_tokenizer_dir(tmp_path / "tok", template))
    chat = resolve_template("auto", tokenizer)
    assert stop_token_ids(chat, tokenizer) == [tokenizer.special_tokens[t] for t in stop]


def test_train_on_prompt_trains_every_token(tmp_path):
    tokenizer = load_tokenizer(save_tokenizer_dir(tmp_path / "tok", "qwen25_instruct.jinja"))
    ids, labels = encode_conversation(
        CHAT, resolve_template("auto", tokenizer), tokenizer, train_on_prompt=True
    )
    assert labels == ids


def test_auto_without_a_chat_template_is_alpaca_and_a_named_template_overrides(tmp_path):
    directory = save_tokenizer_dir(tmp_path / "tok", "qwen25_instruct.jinja")
    tokenizer = load_tokenizer(directory)
    assert resolve_template("chatml", tokenizer) == "chatml"
    assert template_label("chatml", "chatml") == "chatml"
    chat = resolve_template("auto", tokenizer)
    assert (
        template_label("auto", chat)
        == f"auto: the checkpoint's chat template '{directory / 'chat_template.jinja'}'"
    )
    (directory / "chat_template.jinja").unlink()
    plain = load_tokenizer(directory)
    assert plain.chat_template is None
    assert resolve_template("auto", plain) == "alpaca"
    assert template_label("auto", "alpaca") == "alpaca (auto: the tokenizer has no chat template)"


def test_a_saved_tokenizer_keeps_its_chat_template_and_named_tokens(tmp_path):
    tokenizer = load_tokenizer(save_tokenizer_dir(tmp_path / "tok", "phi35_mini_instruct.jinja"))
    tokenizer.save(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.chat_template.text == (TEMPLATES / "phi35_mini_instruct.jinja").read_text()
    assert again.chat_template.tokens == {
        "bos_token": "<s>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    assert encode_conversation(CHAT, resolve_template("auto", again), again) == encode_conversation(
        CHAT, resolve_template("auto", tokenizer), tokenizer
    )


def test_a_template_that_refuses_a_role_names_its_file(tmp_path):
    directory = save_tokenizer_dir(tmp_path / "tok", "gemma2_it.jinja")
    tokenizer = load_tokenizer(directory)
    chat = resolve_template("auto", tokenizer)
    with pytest.raises(DataError) as err:
        encode_conversation([SYSTEM, *CHAT], chat, tokenizer)
    assert str(err.value) == (
        f"the chat template '{directory / 'chat_template.jinja'}' cannot render this conversation (roles system, "
        "user, assistant, user, assistant): System role not supported"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{% for m in messages %}{{ m.content }", "is not valid Jinja: unexpected '}' (line 1)"),
        (
            "{{ raise_exception('no chats here') }}",
            "cannot render this conversation (roles user, assistant): no chats here",
        ),
        (
            "{{ messages[0].content.upper().nope() }}",
            "cannot render this conversation (roles user, assistant): ",
        ),
        (
            "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}<A>{% endif %}",
            "does not begin the whole conversation's rendering",
        ),
    ],
    ids=["syntax", "raise_exception", "error", "no-prefix-property"],
)
def test_a_broken_template_is_refused_naming_the_file(tmp_path, text, message):
    directory = save_tokenizer_dir(tmp_path / "tok", "qwen25_instruct.jinja")
    (directory / "chat_template.jinja").write_text(text)
    tokenizer = load_tokenizer(directory)
    with pytest.raises(DataError) as err:
        resolve_template("auto", tokenizer).check(tokenizer)
    assert f"the chat template '{directory / 'chat_template.jinja'}' " in str(err.value)
    assert message in str(err.value)


def test_the_sandbox_refuses_what_transformers_refuses(tmp_path):
    directory = save_tokenizer_dir(tmp_path / "tok", "qwen25_instruct.jinja")
    (directory / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    tokenizer = load_tokenizer(directory)
    with pytest.raises(DataError) as err:
        resolve_template("auto", tokenizer).render(CHAT, add_generation_prompt=False)
    assert str(err.value).endswith(
        "cannot render this conversation (roles user, assistant, user, assistant): access to attribute '__class__' "
        "of 'list' object is unsafe."
    )


# ----------------------------------------------------------------------------------------------------------------
# A file that leaves no training sample: counts that add up to the records read, and each cause with its fix

_SHORT = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
_LONG = [{"role": "user", "content": "long " * 100}, {"role": "assistant", "content": "Yes."}]
_TWO_USERS = [{"role": "user", "content": "Hi."}, *_SHORT]  # Gemma's template: roles must alternate


def _write_chats(path: Path, chats: list[list[dict[str, str]] | str]) -> Path:
    lines = [c if isinstance(c, str) else json.dumps({"messages": c}) for c in chats]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


_DROP_SYSTEM = "drop the records' system messages"
_CHATML = "set data.template=chatml"
_SYSTEM_ROLE = (
    "skipped because template '{template}' refuses the system role (drop the records' system messages, or set "
    "data.template=chatml, which takes a system message and works with any tokenizer)"
)


@pytest.mark.parametrize(
    ("chats", "counts", "fixes"),
    [
        # every record has a system message, which Gemma's template refuses (the 20 records)
        (
            [[SYSTEM, *_SHORT]] * 20,
            f"2 held out for validation, the other 18 for training: 18 {_SYSTEM_ROLE}",
            2,
        ),
        # every prompt fills the 65 tokens: seq_len is the fix
        (
            [_LONG] * 20,
            "2 held out for validation, the other 18 for training: 18 with nothing to train on after truncation "
            "to 65 tokens (raise seq_len)",
            1,
        ),
        # a mix, with a malformed line and records the template refuses for another reason
        (
            [[SYSTEM, *_SHORT]] * 10 + [_LONG] * 6 + [_TWO_USERS] * 3 + ["{not json"],
            f"1 malformed (skipped), 2 held out for validation, the other 17 for training: 9 {_SYSTEM_ROLE}, 3 "
            "skipped because template '{template}' cannot render their roles (first: '{path}' record 16 (0-based; "
            "line 17): the chat template '{template}' cannot render this conversation (roles user, user, "
            "assistant): Conversation roles must alternate user/assistant/user/assistant/...), 5 with nothing to "
            "train on after truncation to 65 tokens (raise seq_len)",
            3,
        ),
    ],
    ids=["system-role", "truncation", "mix"],
)
def test_no_training_sample_counts_add_up_and_name_the_cause_with_a_fix_that_works(
    tmp_path, chats, counts, fixes
):
    tokenizer = load_tokenizer(save_tokenizer_dir(tmp_path / "tok", "gemma2_it.jinja"))
    template = resolve_template("auto", tokenizer)
    path = _write_chats(tmp_path / "chat.jsonl", chats)
    kw = {
        "max_seq_len": 64,
        "val_fraction": 0.1,
        "seed": 0,
        "skip_malformed": True,
        "length_fix": "raise seq_len",
    }
    with pytest.raises(DataError) as err:
        prepare_instruct(path, "openai", template, tokenizer, **kw)
    message = str(err.value)
    assert message == (
        f"'{path}' leaves no training sample: of {len(chats)} record(s) read, "
        + counts.format(template=template.path, path=path)
    )
    # each fix the message names works on its own
    no_system = [c if isinstance(c, str) else [m for m in c if m["role"] != "system"] for c in chats]
    named = {
        _DROP_SYSTEM: (_write_chats(tmp_path / "no_system.jsonl", no_system), template, kw),
        _CHATML: (path, "chatml", kw),
        "raise seq_len": (path, template, {**kw, "max_seq_len": 512}),
    }
    named = {fix: run for fix, run in named.items() if fix in message}
    assert len(named) == fixes
    for fix, (data, run_template, run_kw) in named.items():
        assert len(prepare_instruct(data, "openai", run_template, tokenizer, **run_kw).train) > 0, fix
