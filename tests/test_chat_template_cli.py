"""memfit finetune and generate with a checkpoint's own chat template (data.template=auto, --template auto).

The checkpoint is tests/conftest.py's tiny Hugging Face directory with SmolLM2's ChatML template beside its
tokenizer (tests/assets/chat_templates).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from memfit.cli import main
from memfit.data.instruct import prepare_instruct
from memfit.data.records import load_conversations
from memfit.data.templates import encode_conversation, encode_prompt, resolve_template
from memfit.memory.techniques import IGNORE_INDEX
from memfit.tokenizer import load_tokenizer

from .conftest import CHAT_TEMPLATE, DOLLY, finetune_overrides


def _finetune(checkpoint: Path, out: Path, template: str | None = None, **extra) -> list[str]:
    """The tiny fine-tune's overrides with ``data.template`` left at its default (auto), or ``template``."""
    args = finetune_overrides(checkpoint, out, **{"max_steps": 1, **extra})
    args = [a for a in args if not a.startswith("data.template=")]
    return args if template is None else [*args, f"data.template={template}"]


def test_finetune_renders_with_the_checkpoint_template_and_trains_only_the_replies(
    chat_checkpoint, tmp_path, capsys
):
    tokenizer = load_tokenizer(chat_checkpoint)
    template = resolve_template("auto", tokenizer)
    # what the run trains on: every reply with the <|im_end|>\n that closes it, nothing else
    data = prepare_instruct(DOLLY, "dolly", template, tokenizer, max_seq_len=1024, val_fraction=0.0, seed=0)
    conversations, _ = load_conversations(DOLLY, "dolly")
    encoded = [encode_conversation(c, template, tokenizer) for c in conversations]
    kept = [  # samples of seq_len + 1 = 1025 tokens at most; one record has no reply token left in them
        (c, ids[:1025], len(ids) > 1025)
        for c, (ids, labels) in zip(conversations, encoded, strict=True)
        if any(t != IGNORE_INDEX for t in labels[1:1025])
    ]
    assert len(data.train) == len(kept) == 11
    assert sum(cut for _, _, cut in kept) == data.stats.num_truncated - data.stats.num_dropped == 1
    for k, (conversation, ids, cut) in enumerate(kept):
        inputs, targets, _ = data.train.collate([k])
        assert inputs[0].tolist() == ids[:-1]
        trained = tokenizer.decode([t for t in targets[0].tolist() if t != IGNORE_INDEX])
        reply = conversation[1]["content"] + "<|im_end|>\n"
        assert reply.startswith(trained) and len(trained) > 0 if cut else trained == reply
        prompt = tokenizer.decode(inputs[0].tolist())
        assert prompt.startswith(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\n"
        )

    capsys.readouterr()
    out = tmp_path / "run"
    assert main(["finetune", *_finetune(chat_checkpoint, out)]) == 0
    banner = capsys.readouterr().out
    assert (
        f"(dolly, template auto: the checkpoint's chat template '{chat_checkpoint / 'chat_template.jinja'}')"
        in (banner)
    )
    full = prepare_instruct(
        DOLLY, "dolly", template, tokenizer, max_seq_len=1024, val_fraction=0.1, seed=1337
    )
    assert f"{full.stats.num_tokens:,} tokens ({full.stats.num_label_tokens:,} trained)" in banner
    # the run keeps the template it was fine-tuned with
    saved = next(out.glob("checkpoints/*/tokenizer/chat_template.jinja"))
    assert saved.read_text() == CHAT_TEMPLATE.read_text()


def test_finetune_without_a_chat_template_says_auto_is_alpaca(hf_checkpoint, tmp_path, capsys):
    capsys.readouterr()
    assert main(["finetune", *_finetune(hf_checkpoint, tmp_path / "run")]) == 0
    assert "(dolly, template alpaca (auto: the tokenizer has no chat template))" in capsys.readouterr().out


def test_a_named_template_overrides(chat_checkpoint, tmp_path, capsys):
    capsys.readouterr()
    assert main(["finetune", *_finetune(chat_checkpoint, tmp_path / "run"), "data.template=chatml"]) == 0
    assert "(dolly, template chatml)" in capsys.readouterr().out


def test_a_broken_template_is_refused_before_training(chat_checkpoint, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(chat_checkpoint, broken)
    (broken / "chat_template.jinja").write_text("{% for message in messages %}{{ message.content }")
    capsys.readouterr()
    assert main(["finetune", *_finetune(broken, tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert f"the chat template '{broken / 'chat_template.jinja'}' is not valid Jinja: unexpected '}}'" in err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_generate_auto_renders_one_user_message_with_the_generation_prompt(chat_checkpoint, capsys):
    transformers = pytest.importorskip("transformers")
    prompt = "What is the capital of France?"
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(chat_checkpoint), "--prompt", prompt, "--temperature", "0"]
    assert main([*args, "--max-new-tokens", "8", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["template"] == str(chat_checkpoint / "chat_template.jinja")
    # the same greedy reply from the ids transformers' apply_chat_template gives the prompt
    reference = transformers.AutoTokenizer.from_pretrained(str(chat_checkpoint))
    ids = reference.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=True, add_generation_prompt=True, return_dict=False
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(str(chat_checkpoint)).eval()
    tokenizer = load_tokenizer(chat_checkpoint)
    stop = set(resolve_template("auto", tokenizer).stop_token_ids(tokenizer))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=list(stop))
    new = [i for i in out[0, len(ids) :].tolist() if i not in tokenizer.special_tokens.values()]
    assert shown["text"] == tokenizer.decode(new)


def test_generate_auto_on_a_run_uses_the_template_it_was_fine_tuned_with(chat_checkpoint, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["finetune", *_finetune(chat_checkpoint, out)]) == 0
    capsys.readouterr()
    args = ["generate", "--checkpoint", str(out), "--prompt", "Hi", "--max-new-tokens", "2", "--json"]
    assert main(args) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["template"] == str(next(out.glob("checkpoints/*/tokenizer/chat_template.jinja")))


def test_a_run_trained_with_a_named_template_resumes_with_it_under_the_default(
    chat_checkpoint, tmp_path, capsys
):
    """data.template=auto (the default) resumes a run that named its template (as every run saved before auto
    existed did: alpaca) with that template, not with the checkpoint's, so a resume renders what the run trained on;
    the losses of the resumed steps equal an uninterrupted run's."""
    straight, out = tmp_path / "straight", tmp_path / "resumed"
    assert main(["finetune", *_finetune(chat_checkpoint, straight, "alpaca", max_steps=2)]) == 0
    assert main(["finetune", *_finetune(chat_checkpoint, out, "alpaca", max_steps=1)]) == 0
    capsys.readouterr()
    assert main(["finetune", *_finetune(chat_checkpoint, out, max_steps=2, resume="true")]) == 0
    assert "(dolly, template alpaca)" in capsys.readouterr().out

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

    assert losses(out)[2] == losses(straight)[2]


PROMPT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.parametrize(
    "template, method", [("alpaca", "full"), ("llama2-chat", "lora"), ("chatml", "full")]
)
def test_export_carries_the_builtin_template_the_run_trained_with(
    template, method, chat_checkpoint, tmp_path, capsys
):
    """A run that named a built-in template over the checkpoint's own (SmolLM2's ChatML, with its default system
    prompt) exports that template as Jinja: transformers' apply_chat_template on the export renders exactly the
    text memfit renders with the run's template, and the ids memfit trained on (ChatML's markers are plain text to
    this tokenizer, and whole-string BPE happens to merge nothing across them here); the summary line says which
    template and whence."""
    transformers = pytest.importorskip("transformers")
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["finetune", *_finetune(chat_checkpoint, run, template, method=method)]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--out", str(hf)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"exported to {hf} (chat template: {template}: memfit's built-in template, written as Jinja in place of "
        "the checkpoint's own)"
    )
    tokenizer = load_tokenizer(hf)
    reference = transformers.AutoTokenizer.from_pretrained(str(hf))
    prompt_ids = encode_prompt(PROMPT, template, tokenizer)
    text = reference.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert text == tokenizer.decode(prompt_ids)
    assert "SmolLM" not in text
    ids = reference.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=False)
    assert ids == prompt_ids
    # both places transformers reads a template hold it (chat_template.jinja first, 4.x the config)
    jinja = (hf / "chat_template.jinja").read_text()
    assert json.loads((hf / "tokenizer_config.json").read_text())["chat_template"] == jinja
    assert jinja != CHAT_TEMPLATE.read_text()


def test_export_of_an_auto_run_keeps_the_checkpoint_template(chat_checkpoint, tmp_path, capsys):
    """data.template=auto: the export carries the checkpoint's own template byte for byte, and transformers
    renders with it what it renders with the checkpoint."""
    transformers = pytest.importorskip("transformers")
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["finetune", *_finetune(chat_checkpoint, run)]) == 0
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--out", str(hf)]) == 0
    saved = next(run.glob("checkpoints/*/tokenizer/chat_template.jinja"))
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"exported to {hf} (chat template: auto: the checkpoint's chat template '{saved}', as the run trained "
        "with it)"
    )
    assert (hf / "chat_template.jinja").read_bytes() == CHAT_TEMPLATE.read_bytes()
    config = json.loads((hf / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE.read_text()
    rendered = [
        transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
            PROMPT[1:], tokenize=False, add_generation_prompt=True
        )
        for d in (hf, chat_checkpoint)
    ]
    assert rendered[0] == rendered[1]
