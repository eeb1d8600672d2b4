"""memfit.tokenizer: every kind round-trips real text, matches a reference implementation id for id, adds BOS/EOS
only when asked, saves and reloads identically, and reports bad files by name.

Assets (tests/assets, provenance in SOURCES.md): torchtune's 2k SentencePiece and tiktoken test models, and the
GPT-2 encoder.json / vocab.bpe pair. The corpus is Tiny Shakespeare, shipped inside the package.
"""

from __future__ import annotations

import base64
import importlib.resources
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from memfit.tokenizer import (
    CharTokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)

ASSETS = Path(__file__).parent / "assets"
SP_MODEL = ASSETS / "sentencepiece_2k.model"
TIKTOKEN_MODEL = ASSETS / "tiktoken_2k.model"
GPT2_ENCODER = ASSETS / "gpt2_encoder.json"
GPT2_VOCAB = ASSETS / "gpt2_vocab.bpe"

TEXT = importlib.resources.files("memfit").joinpath("assets/tinyshakespeare.txt").read_text(encoding="utf-8")
TRAIN = TEXT[:150_000]  # the trained BPE sees only this
HELD_OUT = TEXT[-30_000:]  # ... and is tested on this (the end of the corpus, never seen in training)
PARAGRAPH = TEXT[500_000:502_000]
# Accents, combining marks, CJK, emoji with ZWJ, a ligature, tabs/CR/newline runs and a lone trailing space.
UNICODE = "Café naïve e\u0301 — 日本語 Ωμέγα 🎉 👩\u200d👩\u200d👧 ﬁne\t\r\n\n  spaced  end "
BPE_VOCAB = 512

KINDS = ["char", "bpe", "tokenizer.json", "sentencepiece", "tiktoken", "gpt2"]
BYTE_LEVEL = ["bpe", "tokenizer.json", "tiktoken", "gpt2"]


@pytest.fixture(scope="module")
def bpe():
    return train_bpe([TRAIN], BPE_VOCAB)


@pytest.fixture(scope="module")
def tokenizers(bpe, tmp_path_factory):
    """One tokenizer of every kind, built the way a user would."""
    json_dir = tmp_path_factory.mktemp("bpe_json")
    bpe.save(json_dir)
    return {
        "char": CharTokenizer.from_text(TEXT),
        "bpe": bpe,
        "tokenizer.json": load_tokenizer(json_dir / "tokenizer.json"),  # by file path
        "sentencepiece": load_tokenizer(SP_MODEL),
        "tiktoken": load_tokenizer(TIKTOKEN_MODEL),
        "gpt2": load_tokenizer(GPT2_ENCODER),  # finds gpt2_vocab.bpe beside it
    }


# ---------------------------------------------------------------------------------------------------------------
# Round trips


@pytest.mark.parametrize("kind", ["char", "bpe", "tokenizer.json", "tiktoken", "gpt2"])
def test_round_trip_shakespeare(tokenizers, kind):
    tok = tokenizers[kind]
    ids = tok.encode(HELD_OUT)
    assert 0 < len(ids) <= len(HELD_OUT)
    assert 0 <= min(ids) and max(ids) < tok.vocab_size
    assert tok.decode(ids) == HELD_OUT


@pytest.mark.parametrize("kind", BYTE_LEVEL)
def test_round_trip_unicode(tokenizers, kind):
    tok = tokenizers[kind]
    for text in (UNICODE, "", " ", "\n", "🎉" * 3, "\x00\x7f\ufeff"):
        assert tok.decode(tok.encode(text)) == text


def test_kinds(tokenizers):
    assert {k: t.kind for k, t in tokenizers.items()} == {
        "char": "char",
        "bpe": "bpe",
        "tokenizer.json": "bpe",
        "sentencepiece": "sentencepiece",
        "tiktoken": "tiktoken",
        "gpt2": "gpt2",
    }


def test_decode_accepts_arrays(tokenizers):
    tok = tokenizers["bpe"]
    ids = tok.encode(PARAGRAPH)
    assert tok.decode(np.asarray(ids, dtype=np.uint16)) == PARAGRAPH


@pytest.mark.parametrize("kind", KINDS)
def test_decode_rejects_out_of_range_ids(tokenizers, kind):
    tok = tokenizers[kind]
    with pytest.raises(TokenizerError, match=str(tok.vocab_size)):
        tok.decode([0, tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


# ---------------------------------------------------------------------------------------------------------------
# SentencePiece: round trip on normalised text


SP_PARAGRAPH = TEXT[1_007_000:1_012_000]  # every character here is in the 2k model's vocabulary


def test_sentencepiece_round_trip_normalised(tokenizers):
    """SentencePiece (nmt_nfkc, remove_extra_whitespaces) folds whitespace runs, newlines included, to one space
    and strips the ends; on ASCII, NFKC changes nothing else."""
    tok = tokenizers["sentencepiece"]
    assert "\n\n" in SP_PARAGRAPH
    ids = tok.encode(SP_PARAGRAPH)
    assert 0 not in ids  # <unk>: the slice is chosen so that every character is covered
    assert tok.decode(ids) == " ".join(SP_PARAGRAPH.split())


def test_sentencepiece_normalisation_and_unknowns(tokenizers):
    tok = tokenizers["sentencepiece"]
    assert tok.vocab_size == 2000 and (tok.bos_id, tok.eos_id) == (1, 2)
    assert tok.special_tokens == {"<unk>": 0, "<s>": 1, "</s>": 2}
    assert (
        tok.decode(tok.encode("  ﬁne \n\n\tday  ")) == "fine day"
    )  # NFKC ligature fold, whitespace collapse
    # The 2k model has no byte fallback: characters outside it become <unk> (id 0), decoded as " ⁇ ".
    assert 0 in tok.encode("café") and 0 in tok.encode("Zeal")
    assert "⁇" in tok.decode(tok.encode("café"))


# ---------------------------------------------------------------------------------------------------------------
# GPT-2 against transformers


def test_gpt2_known_ids(tokenizers):
    tok = tokenizers["gpt2"]
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode(" Hello world") == [18435, 995]
    assert tok.vocab_size == 50257
    assert tok.bos_id == tok.eos_id == 50256  # <|endoftext|> is GPT-2's only special token: both roles
    assert tok.special_tokens == {"<|endoftext|>": 50256}
    assert tok.decode([50256, 15496, 995, 50256]) == "<|endoftext|>Hello world<|endoftext|>"


def test_gpt2_matches_transformers(tokenizers):
    transformers = pytest.importorskip("transformers")
    vocab = json.loads(GPT2_ENCODER.read_text(encoding="utf-8"))
    lines = GPT2_VOCAB.read_text(encoding="utf-8").split("\n")[1:]
    merges = [tuple(line.split()) for line in lines if line]
    reference = transformers.GPT2Tokenizer(vocab=vocab, merges=merges)
    tok = tokenizers["gpt2"]
    for text in (PARAGRAPH, HELD_OUT[:5000], UNICODE, "It's 2024: 3.14159 + 42 = ?!  \n\n"):
        expected = reference(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == expected
        assert len(expected) > 5


# ---------------------------------------------------------------------------------------------------------------
# tiktoken (Llama 3 layout) against torchtune and a directly built tiktoken.Encoding

# Split pattern of Llama 3 as published in meta-llama/llama-models, written out here independently.
LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def test_tiktoken_matches_torchtune(tokenizers):
    """Ids that torchtune's test_llama3_tokenizer.py expects from tiktoken_small.model for the same sentences."""
    tok = tokenizers["tiktoken"]
    text_a = "I can see the sun. But even if I cannot see the sun, I know that it exists."
    expected_a = [73, 503, 654, 262, 376, 110, 46, 690, 720, 428, 270, 1119, 654]
    expected_a += [262, 376, 110, 44, 270, 686, 334, 312, 522, 511, 115, 46]
    assert tok.encode(text_a) == expected_a
    text_b = "And to know that the sun is there - that is living."
    assert tok.encode(text_b) == [65, 269, 277, 686, 334, 262, 376, 110, 351, 443, 32, 45, 334, 351, 1955, 46]
    assert tok.encode("user") == [477, 273]
    assert tok.encode("assistant") == [520, 511, 446]
    assert tok.encode("\n\n") == [10, 10]


@pytest.fixture(scope="module")
def tiktoken_reference():
    """tiktoken.Encoding built here from the ranks file and Llama 3's pattern, without memfit."""
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {}
    for line in TIKTOKEN_MODEL.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(name="ref", pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens={})


def test_tiktoken_matches_direct_encoding(tokenizers, tiktoken_reference):
    tok = tokenizers["tiktoken"]
    for text in (PARAGRAPH, UNICODE):
        assert tok.encode(text) == tiktoken_reference.encode_ordinary(text)


def test_tiktoken_cuts_long_runs_like_meta(tokenizers, tiktoken_reference):
    """Meta's Llama 3 tokenizer encodes a run of over 25,000 non-whitespace characters in 25,000-character
    pieces; here that changes the ids, and memfit's must equal Meta's."""
    tok, ref = tokenizers["tiktoken"], tiktoken_reference
    text = "the" * 20_000
    meta = ref.encode_ordinary(text[:25_000]) + ref.encode_ordinary(text[25_000:50_000])
    meta += ref.encode_ordinary(text[50_000:])
    assert meta != ref.encode_ordinary(text)
    assert tok.encode(text) == meta


def test_tiktoken_special_token_layout(tokenizers):
    """Llama 3's 256 special tokens follow the 2000 ranks: ids 2000..2255 (128000..128255 for Llama 3)."""
    tok = tokenizers["tiktoken"]
    assert tok.vocab_size == 2256
    assert (tok.bos_id, tok.eos_id) == (2000, 2001)
    sp = tok.special_tokens
    assert len(sp) == 256 and sorted(sp.values()) == list(range(2000, 2256))
    assert sp["<|begin_of_text|>"] == 2000 and sp["<|end_of_text|>"] == 2001
    assert sp["<|finetune_right_pad_id|>"] == 2004
    assert (sp["<|start_header_id|>"], sp["<|end_header_id|>"]) == (2006, 2007)
    assert (sp["<|eom_id|>"], sp["<|eot_id|>"], sp["<|python_tag|>"]) == (2008, 2009, 2010)
    assert sp["<|reserved_special_token_2|>"] == 2011 and sp["<|reserved_special_token_246|>"] == 2255
    assert tok.decode([2000, 2006, 2009]) == "<|begin_of_text|><|start_header_id|><|eot_id|>"


# Llama 3's (3.0) names of its 256 special ids, as meta-llama/llama3's tokenizer.py and the Hugging Face
# Meta-Llama-3 tokenizer.json give them; memfit's defaults are Llama 3.1's.
LLAMA3_0_NAMES = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|reserved_special_token_2|>",
    "<|reserved_special_token_3|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|reserved_special_token_4|>",
    "<|eot_id|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]


def _llama3_0_dir(tmp_path: Path, file: str) -> Path:
    """tiktoken_2k.model as tokenizer.model, with a Hugging Face file beside it naming the specials Llama 3's way
    (and for tokenizer_config.json, Llama-3-Instruct's EOS: <|eot_id|>)."""
    tmp_path.mkdir(exist_ok=True)
    shutil.copy(TIKTOKEN_MODEL, tmp_path / "tokenizer.model")
    if file == "tokenizer_config.json":
        decoder = {str(2000 + i): {"content": t, "special": True} for i, t in enumerate(LLAMA3_0_NAMES)}
        config = {
            "added_tokens_decoder": decoder,
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
        }
        (tmp_path / file).write_text(json.dumps(config))
    else:
        added = [{"id": 2000 + i, "content": t, "special": True} for i, t in enumerate(LLAMA3_0_NAMES)]
        (tmp_path / file).write_text(json.dumps({"added_tokens": added}))
    return tmp_path / "tokenizer.model"


@pytest.mark.parametrize("file", ["tokenizer_config.json", "tokenizer.json"])
def test_tiktoken_special_names_come_from_the_file_beside_it(tmp_path, file):
    tok = load_tokenizer(_llama3_0_dir(tmp_path, file))
    sp = tok.special_tokens
    assert sp == {t: 2000 + i for i, t in enumerate(LLAMA3_0_NAMES)}
    assert sp["<|reserved_special_token_2|>"] == 2004 and sp["<|reserved_special_token_4|>"] == 2008
    assert "<|eom_id|>" not in sp and "<|python_tag|>" not in sp
    assert (sp["<|start_header_id|>"], sp["<|eot_id|>"]) == (2006, 2009)  # the ids both namings agree on
    assert tok.bos_id == 2000 and tok.eos_id == (2009 if file == "tokenizer_config.json" else 2001)
    assert tok.decode([2004, 2008]) == "<|reserved_special_token_2|><|reserved_special_token_4|>"
    # special-token text in plain text stays text, whatever the names
    assert not set(tok.encode("<|reserved_special_token_2|><|eom_id|>")) & set(sp.values())
    # a memfit checkpoint's copy keeps the names (and so the fingerprint), by directory or by file
    tok.save(tmp_path / "copy")
    for again in (load_tokenizer(tmp_path / "copy"), load_tokenizer(tmp_path / "copy" / "tokenizer.model")):
        assert again.special_tokens == sp and (again.bos_id, again.eos_id) == (tok.bos_id, tok.eos_id)
        assert again.fingerprint() == tok.fingerprint()


def test_tiktoken_bos_eos_from_special_tokens_map(tmp_path):
    shutil.copy(TIKTOKEN_MODEL, tmp_path / "tokenizer.model")
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}})
    )
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (2000, 2009) and tok.special_tokens["<|eom_id|>"] == 2008


@pytest.mark.parametrize(
    "config, error",
    [
        ({"added_tokens_decoder": {"2256": {"content": "<|extra|>"}}}, "names token id 2256 .* 2000..2255"),
        (
            {"added_tokens_decoder": {"2011": {"content": "<|eot_id|>"}}},
            "'<\\|eot_id\\|>' is then both id 2009 and",
        ),
        ({"eos_token": "<|im_end|>"}, "eos_token '<\\|im_end\\|>' is not one of the special tokens"),
        ({"added_tokens_decoder": ["<|begin_of_text|>"]}, "must map ids to token texts"),
    ],
    ids=["outside", "twice", "unknown-eos", "malformed"],
)
def test_tiktoken_special_names_that_do_not_fit_name_the_file(tmp_path, config, error):
    shutil.copy(TIKTOKEN_MODEL, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=error) as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(info.value)


def test_tiktoken_long_whitespace_run(tokenizers):
    """A million spaces overflow tiktoken's regex stack when encoded whole; Meta's cutting avoids it."""
    tok = tokenizers["tiktoken"]
    text = "a" + " " * 1_000_000 + "b" * 30_000
    assert tok.decode(tok.encode(text)) == text


# ---------------------------------------------------------------------------------------------------------------
# BOS / EOS and special tokens


@pytest.mark.parametrize("kind", KINDS)
def test_bos_eos_only_when_asked(tokenizers, kind):
    tok = tokenizers[kind]
    text = "Hello world"
    ids = tok.encode(text)
    assert tok.bos_id is not None and tok.eos_id is not None
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.encode(text, bos=True, eos=True) == [tok.bos_id, *ids, tok.eos_id]
    assert tok.encode(text, bos=True) == [tok.bos_id, *ids]
    assert tok.encode(text, eos=True) == [*ids, tok.eos_id]
    # decode renders special tokens as their text
    bos_text = {v: k for k, v in tok.special_tokens.items()}[tok.bos_id]
    eos_text = {v: k for k, v in tok.special_tokens.items()}[tok.eos_id]
    assert tok.decode(tok.encode(text, bos=True, eos=True)) == bos_text + text + eos_text


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_not_produced_from_plain_text(tokenizers, kind):
    tok = tokenizers[kind]
    specials = tok.special_tokens
    assert tok.bos_id in specials.values() and tok.eos_id in specials.values()
    text = "To be " + " or ".join(list(specials)[:20]) + " not to be"
    ids = tok.encode(text)
    assert not set(ids) & set(specials.values()) - {specials.get("<unk>")}
    if kind in BYTE_LEVEL:
        assert tok.decode(ids) == text


def test_bpe_expected_special_ids(bpe):
    assert (bpe.bos_id, bpe.eos_id) == (0, 1)
    assert bpe.special_tokens == {"<|begin_of_text|>": 0, "<|end_of_text|>": 1}


def test_no_bos_raises(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    core = Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "bpe" and tok.bos_id is None and tok.eos_id is None
    assert tok.encode("hello") == [0]
    with pytest.raises(TokenizerError, match="no BOS"):
        tok.encode("hello", bos=True)
    with pytest.raises(TokenizerError, match="no EOS"):
        tok.encode("hello", eos=True)


# ---------------------------------------------------------------------------------------------------------------
# char


def test_char_vocabulary(tokenizers):
    tok = tokenizers["char"]
    chars = sorted(set(TEXT))
    assert len(chars) == 65  # nanoGPT's shakespeare_char vocabulary
    assert tok.vocab_size == 68
    assert tok.special_tokens == {"<unk>": 65, "<bos>": 66, "<eos>": 67}
    assert (tok.bos_id, tok.eos_id, tok.unk_id) == (66, 67, 65)
    assert tok.encode("\n !a") == [chars.index(c) for c in "\n !a"] == [0, 1, 2, 39]


def test_char_unseen_characters_become_unk():
    tok = CharTokenizer.from_text("abc")
    assert tok.vocab_size == 6
    assert tok.encode("abzé") == [0, 1, tok.unk_id, tok.unk_id]
    assert tok.decode(tok.encode("abzé")) == "ab<unk><unk>"


# ---------------------------------------------------------------------------------------------------------------
# Trained BPE


def test_bpe_vocab_size(bpe):
    assert bpe.vocab_size == BPE_VOCAB
    ids = bpe.encode(TRAIN)
    assert max(ids) == BPE_VOCAB - 1  # the last merge is used on the text it was learned from
    assert len(ids) < len(TRAIN.encode("utf-8")) / 2  # it compresses


def test_bpe_is_deterministic(bpe, tmp_path):
    again = train_bpe([TRAIN], BPE_VOCAB)
    assert again.encode(HELD_OUT) == bpe.encode(HELD_OUT)
    bpe.save(tmp_path / "a")
    again.save(tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()


def test_bpe_learns_only_from_given_text(bpe):
    """A made-up word is one token only for the tokenizer whose training text held it."""
    word = " zyxquv"
    assert word.strip() not in TEXT
    with_word = train_bpe([TRAIN, word * 500], BPE_VOCAB)
    assert len(with_word.encode(word)) == 1
    assert len(bpe.encode(word)) >= 4


def test_bpe_accepts_a_single_string():
    assert train_bpe(TRAIN[:20_000], 300).encode(TRAIN[:1000]) == train_bpe([TRAIN[:20_000]], 300).encode(
        TRAIN[:1000]
    )


def test_bpe_rejects_tiny_vocab():
    with pytest.raises(TokenizerError, match="258"):
        train_bpe(["abc"], 100)


# ---------------------------------------------------------------------------------------------------------------
# save / load


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_identical(tokenizers, kind, tmp_path):
    tok = tokenizers[kind]
    tok.save(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["kind"] == tok.kind and config["vocab_size"] == tok.vocab_size
    again = load_tokenizer(tmp_path / "tok")
    assert type(again) is type(tok)
    assert (again.kind, again.vocab_size, again.bos_id, again.eos_id) == (
        tok.kind,
        tok.vocab_size,
        tok.bos_id,
        tok.eos_id,
    )
    assert again.special_tokens == tok.special_tokens
    for text in (PARAGRAPH, UNICODE):
        assert again.encode(text, bos=True, eos=True) == tok.encode(text, bos=True, eos=True)
    # saving the reloaded tokenizer again writes the same files
    again.save(tmp_path / "tok2")
    for f in sorted((tmp_path / "tok").iterdir()):
        assert f.read_bytes() == (tmp_path / "tok2" / f.name).read_bytes(), f.name


@pytest.mark.parametrize(
    "kind, files",
    [
        ("sentencepiece", {"tokenizer.model": SP_MODEL}),
        ("tiktoken", {"tokenizer.model": TIKTOKEN_MODEL}),
        ("gpt2", {"encoder.json": GPT2_ENCODER, "vocab.bpe": GPT2_VOCAB}),
    ],
)
def test_save_copies_model_bytes(tokenizers, kind, files, tmp_path):
    tokenizers[kind].save(tmp_path)
    for name, original in files.items():
        assert (tmp_path / name).read_bytes() == original.read_bytes()


def test_load_detects_model_kind_by_content(tmp_path):
    """Both test models are named tokenizer.model in a directory; the content decides the kind."""
    for original, kind in ((SP_MODEL, "sentencepiece"), (TIKTOKEN_MODEL, "tiktoken")):
        d = tmp_path / kind
        d.mkdir()
        shutil.copy(original, d / "tokenizer.model")
        assert load_tokenizer(d).kind == kind
        assert load_tokenizer(d / "tokenizer.model").kind == kind


@pytest.mark.parametrize("names", [("encoder.json", "vocab.bpe"), ("gpt2_encoder.json", "gpt2_vocab.bpe")])
def test_load_gpt2_pair(tmp_path, names):
    shutil.copy(GPT2_ENCODER, tmp_path / names[0])
    shutil.copy(GPT2_VOCAB, tmp_path / names[1])
    for path in (tmp_path, tmp_path / names[0], tmp_path / names[1]):
        tok = load_tokenizer(path)
        assert tok.kind == "gpt2" and tok.encode("Hello world") == [15496, 995]


def test_load_hf_directory_reads_bos_eos_from_its_config(bpe, tmp_path):
    """A Hugging Face directory: tokenizer.json + tokenizer_config.json (no memfit 'kind')."""
    bpe._tok.save(str(tmp_path / "tokenizer.json"))
    hf_config = {
        "bos_token": {"content": "<|end_of_text|>"},
        "eos_token": "<|begin_of_text|>",
        "model_max_length": 8,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(hf_config))
    tok = load_tokenizer(tmp_path)
    assert tok.kind == "bpe"
    assert (tok.bos_id, tok.eos_id) == (1, 0)  # swapped on purpose: taken from the config, not guessed
    (tmp_path / "tokenizer_config.json").unlink()
    assert (load_tokenizer(tmp_path).bos_id, load_tokenizer(tmp_path).eos_id) == (0, 1)  # well-known names


# ---------------------------------------------------------------------------------------------------------------
# Errors


def test_error_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(TokenizerError, match="nope") as info:
        load_tokenizer(missing)
    assert "does not exist" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_error_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "README.txt").write_text("nothing here")
    with pytest.raises(TokenizerError, match="no tokenizer files") as info:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(info.value) and "tokenizer.json" in str(info.value)


@pytest.mark.parametrize("original", [SP_MODEL, TIKTOKEN_MODEL], ids=["sentencepiece", "tiktoken"])
def test_error_truncated_model(tmp_path, original):
    data = original.read_bytes()
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(data[: len(data) // 2 + 3])  # +3: cut inside a line / a protobuf field
    with pytest.raises(TokenizerError, match="tokenizer.model") as info:
        load_tokenizer(tmp_path)
    assert "truncated or corrupt" in str(info.value)


def test_error_garbage_model(tmp_path):
    bad = tmp_path / "garbage.model"
    bad.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)))
    with pytest.raises(TokenizerError, match="garbage.model") as info:
        load_tokenizer(bad)
    assert "neither a SentencePiece model nor a tiktoken ranks file" in str(info.value)
    bad.write_bytes(b"")
    with pytest.raises(TokenizerError, match="garbage.model"):
        load_tokenizer(bad)


def test_error_corrupt_tokenizer_json(bpe, tmp_path):
    bpe.save(tmp_path)
    path = tmp_path / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(path)


def test_error_gpt2_half_pair(tmp_path):
    shutil.copy(GPT2_ENCODER, tmp_path / "encoder.json")
    with pytest.raises(TokenizerError, match="vocab.bpe"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="encoder.json"):
        load_tokenizer(tmp_path / "encoder.json")


def test_error_gpt2_mismatched_pair(tmp_path):
    """encoder.json and vocab.bpe from different tokenizers: the merge ranks disagree with the ids."""
    lines = GPT2_VOCAB.read_text(encoding="utf-8").split("\n")
    lines[1], lines[2] = lines[2], lines[1]
    (tmp_path / "vocab.bpe").write_text("\n".join(lines), encoding="utf-8")
    shutil.copy(GPT2_ENCODER, tmp_path / "encoder.json")
    with pytest.raises(TokenizerError, match="do not belong together"):
        load_tokenizer(tmp_path)


def test_error_saved_directory_missing_model_file(tokenizers, tmp_path):
    tokenizers["tiktoken"].save(tmp_path)
    (tmp_path / "tokenizer.model").unlink()
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        load_tokenizer(tmp_path)


def test_error_tiktoken_ranks_with_a_gap(tmp_path):
    lines = TIKTOKEN_MODEL.read_bytes().splitlines()
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(b"\n".join(lines[:500] + lines[501:]) + b"\n")
    with pytest.raises(TokenizerError, match=r"tokenizer.model.*ranks are not 0\.\.1998"):
        load_tokenizer(bad)
