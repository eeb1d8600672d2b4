"""Reading real files: one JSON Lines rule for every reader (a byte-order mark, CRLF, any character inside a
string), a ``.txt`` without its byte-order mark, every empty input file named, and one huge document read,
tokenized and written in bounded memory with exactly the ids of encoding it whole, for every tokenizer kind."""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib
import importlib.util
import io
import json
import random
import sysconfig
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import memfit.data.prepare as prepare_module
import memfit.data.sources as sources
import memfit.tokenizer.tiktoken as tiktoken_kind
from memfit.cli import main
from memfit.config import load_prepare_config
from memfit.data.prepare import prepare
from memfit.data.records import load_conversations
from memfit.data.sources import read_pieces, resolve_sources
from memfit.data.tokens import is_validation, read_manifest
from memfit.errors import DataError
from memfit.tokenizer import LLAMA3_PATTERN, load_tokenizer

from ..conftest import ASSETS

BOM = codecs.BOM_UTF8


def _jsonl():
    return importlib.import_module("memfit.data.jsonl")  # (imported here: the module is new)


def text_hash():
    return hashlib.blake2b(digest_size=8)  # what a document's split is drawn from


SHAKESPEARE = (Path(sources.__file__).parents[1] / "assets" / "tinyshakespeare.txt").read_text(
    encoding="utf-8"
)
# U+2028, U+2029 and U+0085 are line ends to str.splitlines, and text to JSON
TEXTS = ["first", "a line\u2028separator, a paragraph\u2029separator, a next line\u0085and café", "last"]


def _records(path: Path, records: list[dict], bom: bool = False, crlf: bool = False) -> Path:
    end = "\r\n" if crlf else "\n"
    data = "".join(json.dumps(r, ensure_ascii=False) + end for r in records).encode("utf-8")
    path.write_bytes((BOM if bom else b"") + data)
    return path


def _texts(path: Path, **kw) -> list[str]:
    (f,) = resolve_sources({"s": [str(path)]})["s"]
    return [p.text for p in read_pieces(f, val_fraction=0.0, **kw)]


# ----------------------------------------------------------------------------------------------------------------
# One JSON Lines rule
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("crlf", [False, True], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [False, True], ids=["no-bom", "bom"])
def test_prepare_and_fine_tuning_read_json_lines_alike(tmp_path, bom, crlf):
    text = _records(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS], bom, crlf)
    assert _texts(text) == TEXTS
    counts = sources.ReadCounts()
    assert _texts(text, skip_malformed=True, counts=counts) == TEXTS and counts.skipped == 0
    chat = _records(tmp_path / "chat.jsonl", [{"instruction": t, "output": "o"} for t in TEXTS], bom, crlf)
    conversations, skipped = load_conversations(chat, "alpaca")
    assert [c[0]["content"] for c in conversations] == TEXTS and skipped == 0


def test_a_fine_tuning_json_file_with_a_byte_order_mark(tmp_path):
    path = tmp_path / "chat.json"
    path.write_bytes(BOM + json.dumps([{"instruction": t, "output": "o"} for t in TEXTS]).encode())
    assert [c[0]["content"] for c in load_conversations(path, "alpaca")[0]] == TEXTS


def test_a_text_file_loses_its_byte_order_mark(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(BOM + b"To be, or not to be.\nThat is the question.\n")
    assert "".join(_texts(path)) == "To be, or not to be.\nThat is the question.\n"


def test_a_lone_surrogate_is_a_bad_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": "half a pair: \\ud800"}\n{"text": "last"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: the text holds a lone UTF-16 surrogate"):
        _texts(path)
    assert _texts(path, skip_malformed=True) == ["ok", "last"]


# ----------------------------------------------------------------------------------------------------------------
# Empty input files
# ----------------------------------------------------------------------------------------------------------------


def test_every_empty_input_file_is_named_and_counted(tmp_path, capsys):
    web = tmp_path / "web"
    web.mkdir()
    _records(web / "a.jsonl", [{"text": SHAKESPEARE[:3000]}, {"text": SHAKESPEARE[3000:6000]}])
    (web / "b_empty.jsonl").write_bytes(b"")
    (web / "c_blank.jsonl").write_text("\n \n")
    _records(web / "d_empty_texts.jsonl", [{"text": ""}])
    (web / "e_empty.txt").write_bytes(BOM)
    out = tmp_path / "out"
    argv = [
        "prepare",
        "--out",
        str(out),
        "--source",
        f"web={web}",
        "--workers",
        "1",
        "--quiet",
        "vocab_size=300",
    ]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    empty = ["b_empty.jsonl", "c_blank.jsonl", "d_empty_texts.jsonl", "e_empty.txt"]
    for name in empty:
        assert f"note: source 'web': '{web / name}' holds no document" in printed
    assert "a.jsonl' holds no document" not in printed
    source = read_manifest(out)["sources"]["web"]
    assert source["empty_files"] == [str(web / name) for name in empty]
    assert [(Path(f["path"]).name, f["documents"]) for f in source["files"]] == [("a.jsonl", 2)] + [
        (name, 0) for name in empty
    ]
    assert source["files"][0]["tokens"] == source["tokens"]


# ----------------------------------------------------------------------------------------------------------------
# A huge document in bounded memory
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_one_huge_document_is_read_in_bounded_pieces(tmp_path, suffix):
    """The real constants: a 24 MB one-record line (or a one-line .txt, no newline in it) is never held whole:
    its text comes in pieces of at most PIECE_CHARS characters, and what the reader allocates at once is bounded
    by its blocks, not by the document."""
    text = (SHAKESPEARE * 22)[:24_000_000]
    path = tmp_path / f"one{suffix}"
    if suffix == ".txt":
        text = text.replace("\n", " ")
        path.write_text(text)
    else:
        path.write_text(json.dumps({"meta": {"n": 1}, "text": text}) + "\n")
    (f,) = resolve_sources({"s": [str(path)]})["s"]
    tracemalloc.start()
    try:
        sizes, digest = [], text_hash()
        for piece in read_pieces(f, val_fraction=0.5):
            sizes.append(len(piece.text))
            digest.update(piece.text.encode())
            split = piece.split
            del piece
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert max(sizes) <= sources.PIECE_CHARS and sum(sizes) == len(text) and len(sizes) >= 23
    assert digest.digest() == text_hash_of(text)
    assert split == ("train" if suffix == ".txt" else "val" if is_validation(text, 0.5) else "train")
    # blocks of 1 MiB and their few copies (decoded, unescaped, joined, the piece held back): ~13 MiB for the
    # record, 5 MiB for the .txt, whatever the document's size
    assert peak < 16 * 2**20, f"the reader held {peak / 2**20:.1f} MiB at once"


def text_hash_of(text: str) -> bytes:
    h = text_hash()
    h.update(text.encode())
    return h.digest()


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 2,000 characters, lines read 4 KiB at a time, strings over 512 bytes streamed, encode calls of
    at most 700 characters and Llama 3's tiktoken chunks of 1,500: every mechanism of a huge document, small."""
    monkeypatch.setattr(sources, "PIECE_CHARS", 2000)
    monkeypatch.setattr(sources, "MAX_PIECE_CHARS", 16000, raising=False)
    if importlib.util.find_spec("memfit.data.jsonl") is not None:
        monkeypatch.setattr(_jsonl(), "LINE_BYTES", 4096)
        monkeypatch.setattr(_jsonl(), "SHORT_STRING_BYTES", 512)
    monkeypatch.setattr(prepare_module, "ENCODE_CHARS", 700, raising=False)
    monkeypatch.setattr(prepare_module, "BATCH_CHARS", 2000)
    monkeypatch.setattr(tiktoken_kind, "_TIKTOKEN_MAX_ENCODE_CHARS", 1500)


def _document(seed: int = 0, chars: int = 40_000) -> str:
    """Prose, code, whitespace runs, digits and non-ASCII text, in random runs."""
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:8]
    code = "".join(p.read_text(errors="replace") for p in stdlib)
    other = "Été, naïve café, Straße, Ελληνικά, русский, 日本語の文, 한국어, 🙂 x\u2028y  1234567 89,  \t\n\n  indent "
    rng = random.Random(seed)
    parts, n = [], 0
    while n < chars:
        source = rng.choice([SHAKESPEARE, code, other * 40])
        start = rng.randrange(len(source) - 1500)
        parts.append(source[start : start + rng.randint(50, 1500)])
        n += len(parts[-1])
    return "".join(parts)


def _hf_tokenizer(tmp_path: Path, kind: str) -> Path:
    """A ``tokenizer.json`` of one of the pipelines that can be cut, trained on the test text."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    split = {"llama3": LLAMA3_PATTERN, "qwen2": LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")}.get(kind)
    specials = ["<s>", "</s>"]
    if kind == "llama2":  # Llama 2's tokenizer.json: a ▁ prepended and spaces made ▁, byte fallback, no split
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        # trained within words, as its vocabulary was (by SentencePiece); saved without a pre-tokenizer, as it is
        tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=800,
            special_tokens=["<unk>", *specials, *[f"<0x{b:02X}>" for b in range(256)]],
            initial_alphabet=[],
        )
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=800, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    tok.train_from_iterator([_document(1, 60_000)], trainer)
    spec = json.loads(tok.to_str())
    if kind == "llama2":
        spec["pre_tokenizer"] = None
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


def _sentencepiece_llama2(tmp_path: Path) -> Path:
    """A SentencePiece BPE the way Llama 2's is made: identity normalizer, whitespace kept, byte fallback."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_document(2, 60_000).splitlines()),
        model_writer=model,
        vocab_size=600,
        model_type="bpe",
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        byte_fallback=True,
        character_coverage=1.0,
    )
    path = tmp_path / "llama2_sp.model"
    path.write_bytes(model.getvalue())
    return path


KINDS = [
    "char",
    "bpe",
    "gpt2",
    "tiktoken",
    "sentencepiece",
    "sentencepiece-llama2",
    "llama3",
    "qwen2",
    "llama2",
]


def _tokenizer_setting(tmp_path: Path, kind: str) -> dict:
    given = {
        "gpt2": ASSETS / "gpt2_encoder.json",
        "tiktoken": ASSETS / "tiktoken_2k.model",
        "sentencepiece": ASSETS / "sentencepiece_2k.model",
    }
    if kind in given:
        return {"tokenizer": str(given[kind])}
    if kind == "sentencepiece-llama2":
        return {"tokenizer": str(_sentencepiece_llama2(tmp_path))}
    if kind in ("llama3", "qwen2", "llama2"):
        return {"tokenizer": str(_hf_tokenizer(tmp_path, kind))}
    return {"overrides": ["char_tokenizer=true"] if kind == "char" else ["vocab_size=600"]}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".txt"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_huge_document_gets_the_ids_of_encoding_it_whole(tmp_path, small_pieces, kind, suffix):
    text = _document()
    path = tmp_path / f"one{suffix}"
    if suffix == ".txt":
        path.write_text(text, encoding="utf-8")
    else:
        opener = gzip.open if suffix.endswith(".gz") else open
        with opener(path, "wt", encoding="utf-8") as fh:
            fh.write(json.dumps({"text": text, "meta": {"long": "x" * 5000}}) + "\n")
    setting = _tokenizer_setting(tmp_path, kind)
    out = tmp_path / "out"
    cfg = load_prepare_config(
        ["val_fraction=0", "shard_tokens=4000", *setting.get("overrides", [])],
        out=str(out),
        workers=1,
        tokenizer=setting.get("tokenizer"),
    )
    prepare(cfg, {"one": [str(path)]}, progress_bar=False)
    tok = load_tokenizer(out / "tokenizer")
    manifest = read_manifest(out)
    shards = [s for s in manifest["sources"]["one"]["shards"] if s["split"] == "train"]
    dtype = np.dtype(manifest["dtype"])
    ids = np.concatenate([np.fromfile(out / "one" / s["file"], dtype=dtype) for s in shards])
    bos = [tok.bos_id] if tok.add_bos else []  # as prepare writes a document (Tokenizer.add_bos)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    assert ids.tolist() == bos + tok.encode(text) + eos
    assert len(shards) > 2  # the pairs closed inside the document
    (f,) = resolve_sources({"s": [str(path)]})["s"]
    pieces = list(read_pieces(f, val_fraction=0.0, cut=tok.cut))
    assert len(pieces) > 10 and max(len(p.text) for p in pieces) <= 2000, "the document was not cut"
    assert "".join(p.text for p in pieces) == text


def test_a_tokenizer_json_of_another_pipeline_is_not_cut(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [SHAKESPEARE[:5000]], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path / "tokenizer.json").cut("some words and more words", 0) == 0


# ----------------------------------------------------------------------------------------------------------------
# A long line, parsed as it streams past
# ----------------------------------------------------------------------------------------------------------------


def _random_string(rng: random.Random, n: int) -> str:
    alphabet = 'ab c"\\/\n\t\r\x00\x1f\u2028\u0085é日🙂\ud7ff\ue000'
    return "".join(rng.choice(alphabet) for _ in range(n))


@pytest.mark.parametrize("ascii_only", [True, False], ids=["ensure_ascii", "utf-8"])
def test_a_long_line_streamed_in_blocks_parses_as_json_loads(monkeypatch, ascii_only):
    jsonl = _jsonl()
    monkeypatch.setattr(jsonl, "SHORT_STRING_BYTES", 40)
    rng = random.Random(0)
    for _ in range(40):
        record = {"text": _random_string(rng, rng.randint(0, 400)), "k": [1, {"s": _random_string(rng, 60)}]}
        line = (json.dumps(record, ensure_ascii=ascii_only) + "\n").encode()
        cuts = sorted(rng.sample(range(1, len(line)), min(12, len(line) - 1)))
        blocks = [line[a:b] for a, b in zip([0, *cuts], [*cuts, len(line)], strict=True)]
        value, longs = jsonl.scan_long_value(blocks)
        assert _restore(value, longs, line, rng) == json.loads(line)


def _restore(value, longs, line: bytes, rng: random.Random):
    """``value`` with each long string's placeholder replaced by its text, decoded in blocks of 1-9 bytes."""
    if isinstance(value, str) and value in longs:
        s = longs[value]
        raw = line[s.start : s.end]
        step = rng.randint(1, 9)
        text = "".join(_jsonl().decode_string(raw[i : i + step] for i in range(0, len(raw), step)))
        assert (s.digest, s.chars) == (text_hash_of(text), len(text))
        return text
    if isinstance(value, dict):
        return {_restore(k, longs, line, rng): _restore(x, longs, line, rng) for k, x in value.items()}
    return [_restore(x, longs, line, rng) for x in value] if isinstance(value, list) else value


@pytest.mark.parametrize(
    "line, why",
    [
        (b'{"text": "' + b"a" * 600 + b'\\x"}\n', "Invalid \\\\escape"),
        (b'{"text": "' + b"a" * 600 + b'\x01"}\n', "Invalid control character at column 6011"),
        (b'{"text": "' + b"a" * 600 + b'\xe9"}\n', "not valid UTF-8: byte 0xe9 at column 6011"),
        (b'{"text": "' + b"a" * 600 + b"\n", "Invalid control character at column 6011"),
        (b'{"text": "' + b"a" * 600 + b'"} {}\n', "malformed JSON \\(Extra data"),
        (b'{"text": "' + b"a" * 600 + b'", "n": 1,}\n', "malformed JSON"),
    ],
    ids=["escape", "control", "utf8", "unterminated", "extra", "trailing-comma"],
)
def test_a_bad_long_line_names_its_file_and_line_like_a_short_one(tmp_path, small_pieces, line, why):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "first"}\n' + line.replace(b"a" * 600, b"a" * 6000) + b'{"text": "last"}\n')
    with pytest.raises(DataError, match=f"bad\\.jsonl:2: .*{why}"):
        _texts(path)
    assert _texts(path, skip_malformed=True) == ["first", "last"]


def test_a_long_record_of_a_zstd_file_is_read_again_from_its_start(tmp_path, small_pieces):
    import zstandard

    text = _document(3, 12_000)
    lines = [json.dumps({"text": "short"}), json.dumps({"text": text}), json.dumps({"text": "after"})]
    path = tmp_path / "one.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(("\n".join(lines) + "\n").encode()))
    texts = _texts(path)
    assert texts[0] == "short" and "".join(texts[1:-1]) == text and texts[-1] == "after"
    assert len(texts) > 6 and max(map(len, texts)) <= 2000
