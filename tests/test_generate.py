"""memfit generate feeds the model a prompt as training showed it text: the ids the model's forward receives for a
prompt are the first ids of a training document with that text as ``memfit prepare`` writes it, for every kind of
tokenizer; for a tokenizer directory saved by transformers they are ``AutoTokenizer(...)(prompt)["input_ids"]``; a
chat template's own BOS comes once.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from memfit.config import load_prepare_config
from memfit.data.prepare import prepare
from memfit.data.sources import default_corpus_path
from memfit.data.templates import encode_conversation
from memfit.data.tokens import read_manifest
from memfit.generate import generate_text, prompt_ids
from memfit.models.decoder import build_decoder
from memfit.models.presets import model_config
from memfit.tokenizer import load_tokenizer

from .conftest import ASSETS

transformers = pytest.importorskip("transformers")

PROMPT = "ROMEO: What light"


def _core(specials: list[str]):
    """A small byte-level BPE ``tokenizers.Tokenizer`` trained here, with ``specials`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([default_corpus_path().read_text(encoding="utf-8")[:20000]], trainer=trainer)
    return tok


def _hf_llama(d: Path) -> Path:
    """Saved by transformers with BOS put first (``add_bos_token``: a TemplateProcessing post-processor)."""
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_core(["<s>", "</s>"]), bos_token="<s>", eos_token="</s>", add_bos_token=True
    )
    fast.save_pretrained(d)
    return d


def _hf_llama3(d: Path) -> Path:
    """Llama 3's tokenizer.json layout: ByteLevel then TemplateProcessing ``<|begin_of_text|> $A``."""
    from tokenizers import processors

    core = _core(["<|begin_of_text|>", "<|end_of_text|>"])
    core.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                special_tokens=[("<|begin_of_text|>", 0)],
            ),
        ]
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    ).save_pretrained(d)
    return d


def _hf_gpt2(d: Path) -> Path:
    """GPT-2's layout: ``<|endoftext|>`` is BOS and EOS, and transformers puts nothing before a text."""
    from tokenizers import processors

    core = _core(["<|endoftext|>"])
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    transformers.GPT2TokenizerFast(
        tokenizer_object=core, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    ).save_pretrained(d)
    return d


def _sentencepiece(add_bos_token: bool):
    def make(d: Path) -> Path:
        """A SentencePiece tokenizer.model with a tokenizer_config.json (no tokenizer.json; no tokenizer_class,
        whose LlamaTokenizer would impose Llama's own normalisation on this model)."""
        d.mkdir()
        shutil.copy(ASSETS / "sentencepiece_2k.model", d / "tokenizer.model")
        config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": add_bos_token}
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        return d

    return make


HF_DIRS = {
    "hf-llama": _hf_llama,
    "hf-llama3": _hf_llama3,
    "hf-gpt2": _hf_gpt2,
    "hf-sentencepiece": _sentencepiece(True),
    "hf-sentencepiece-no-bos": _sentencepiece(False),
}
# The prepare settings of each kind's tokenizer: one prepare makes, or one a user points it at.
SOURCES = {
    "char": lambda d: {"char_tokenizer": True},
    "bpe": lambda d: {"vocab_size": 300},
    "sentencepiece": lambda d: {"tokenizer": str(ASSETS / "sentencepiece_2k.model")},
    "tiktoken": lambda d: {"tokenizer": str(ASSETS / "tiktoken_2k.model")},
    "gpt2": lambda d: {"tokenizer": str(ASSETS / "gpt2_encoder.json")},
    **{kind: lambda d, make=make: {"tokenizer": str(make(d))} for kind, make in HF_DIRS.items()},
}


def fed_ids(tokenizer, prompt: str, template: str | None = None) -> list[int]:
    """The ids ``generate_text`` gives the model's forward first (a spy on a tiny model)."""
    model = build_decoder(model_config("tiny", vocab_size=tokenizer.vocab_size), seed=0).eval()
    seen = []
    model.register_forward_pre_hook(lambda _, args: seen.append(args[0][0].tolist()))
    generate_text(model, tokenizer, prompt, max_new_tokens=1, temperature=0, top_k=0, template=template)
    return seen[0]


def _prepared_document(tmp_path: Path, settings: dict, text: str):
    """``memfit prepare`` of one document ``text``: the dataset's tokenizer, the ids of its training shard and
    its manifest."""
    corpus = tmp_path / "doc.jsonl"
    corpus.write_text(json.dumps({"text": text}) + "\n")
    cfg = load_prepare_config([], out=str(tmp_path / "data"), workers=1, val_fraction=0.0, **settings)
    prepare(cfg, {"doc": [str(corpus)]}, progress_bar=False)
    manifest = read_manifest(tmp_path / "data")
    (shard,) = [s for s in manifest["sources"]["doc"]["shards"] if s["split"] == "train"]
    ids = np.fromfile(tmp_path / "data" / "doc" / shard["file"], dtype=manifest["dtype"]).tolist()
    return load_tokenizer(tmp_path / "data" / "tokenizer"), ids, manifest


@pytest.mark.parametrize("kind", list(SOURCES))
def test_generate_feeds_a_prompt_as_a_training_document_starts(tmp_path_factory, kind):
    tmp = tmp_path_factory.mktemp(kind)
    tokenizer, document, manifest = _prepared_document(tmp, SOURCES[kind](tmp / "tokenizer"), PROMPT)
    fed = fed_ids(tokenizer, PROMPT)
    assert fed == document[: len(fed)] and document == [*fed, tokenizer.eos_id]
    assert fed == prompt_ids(tokenizer, PROMPT)
    with_bos = kind not in ("hf-gpt2", "hf-sentencepiece-no-bos")
    assert tokenizer.add_bos is with_bos and (fed[0] == tokenizer.bos_id) is with_bos
    assert fed[with_bos:] == tokenizer.encode(PROMPT)
    # the separators the shards hold, which split a window into documents
    assert manifest["tokenizer"]["bos_id"] == (tokenizer.bos_id if with_bos else None)


@pytest.mark.parametrize("kind", list(HF_DIRS))
def test_generate_feeds_what_transformers_encodes(tmp_path, kind):
    directory = HF_DIRS[kind](tmp_path / kind)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer = load_tokenizer(directory)
    assert fed_ids(tokenizer, PROMPT) == hf(PROMPT)["input_ids"]
    assert tokenizer.add_bos is (hf(PROMPT)["input_ids"][0] == hf.bos_token_id)


def test_a_saved_tokenizer_keeps_reading_text_without_bos(tmp_path):
    """A memfit checkpoint's copy of a tokenizer without BOS before text reads the same (in memfit and in
    transformers), and its fingerprint tells it from the same files read with BOS."""
    tokenizer = load_tokenizer(_hf_gpt2(tmp_path / "hf"))
    tokenizer.save(tmp_path / "copy")
    again = load_tokenizer(tmp_path / "copy")
    assert again.add_bos is False and prompt_ids(again, PROMPT) == prompt_ids(tokenizer, PROMPT)
    assert again.fingerprint() == tokenizer.fingerprint()
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert hf(PROMPT)["input_ids"] == prompt_ids(again, PROMPT)
    config = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    (tmp_path / "copy" / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos": True}))
    with_bos = load_tokenizer(tmp_path / "copy")
    assert prompt_ids(with_bos, PROMPT) == [with_bos.bos_id, *prompt_ids(again, PROMPT)]
    assert with_bos.fingerprint() != again.fingerprint()


def test_empty_prompt_starts_where_a_document_starts(tmp_path):
    sp = load_tokenizer(ASSETS / "sentencepiece_2k.model")
    assert prompt_ids(sp, "") == [sp.bos_id]
    gpt2_like = load_tokenizer(_hf_gpt2(tmp_path / "gpt2"))
    assert prompt_ids(gpt2_like, "") == [gpt2_like.eos_id]  # what precedes each document of its data


@pytest.mark.parametrize(
    "template, source",
    [
        ("llama3-chat", ASSETS / "tiktoken_2k.model"),
        ("llama2-chat", ASSETS / "sentencepiece_2k.model"),
        ("alpaca", ASSETS / "sentencepiece_2k.model"),
        ("chatml", ASSETS / "tiktoken_2k.model"),
    ],
)
def test_a_template_writes_its_own_bos_once(template, source):
    tokenizer = load_tokenizer(source)
    fed = fed_ids(tokenizer, "What is a llama?", template)
    ids, _ = encode_conversation(
        [{"role": "user", "content": "What is a llama?"}, {"role": "assistant", "content": "An animal."}],
        template,
        tokenizer,
    )
    assert fed == ids[: len(fed)]  # as fine-tuning rendered it
    assert fed.count(tokenizer.bos_id) == (0 if template == "chatml" else 1)
    assert template == "chatml" or fed[0] == tokenizer.bos_id
