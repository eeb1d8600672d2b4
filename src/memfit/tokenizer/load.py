"""Loading a tokenizer from a directory or a file (:func:`load_tokenizer`): which kind its files are, by name and
content, with what the Hugging Face files beside them say (BOS/EOS, ``add_bos``, special tokens' names), and the chat
template a tokenizer directory holds (:func:`read_chat_template_source`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from memfit.errors import TokenizerError
from memfit.tokenizer.base import (
    CHAT_TEMPLATE_NAME,
    CONFIG_NAME,
    KINDS,
    TEMPLATE_TOKEN_NAMES,
    ChatTemplateSource,
    Tokenizer,
    log,
)
from memfit.tokenizer.bpe import HFTokenizer, _bos_first
from memfit.tokenizer.char import CharTokenizer
from memfit.tokenizer.gpt2 import GPT2Tokenizer
from memfit.tokenizer.sentencepiece import SentencePieceTokenizer
from memfit.tokenizer.tiktoken import TiktokenTokenizer

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+[0-9]+[ \t]*\r?$")

# Names tried, in order, when a tokenizer.json comes without a config that names its BOS/EOS tokens.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]")

_EXPECTED = (
    "a directory saved by memfit (tokenizer_config.json with 'kind'), a Hugging Face tokenizer.json, a "
    "SentencePiece or tiktoken tokenizer.model, or GPT-2's encoder.json + vocab.bpe"
)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a directory or a file, recognising the format by name and content.

    A directory is searched in this order: memfit's ``tokenizer_config.json`` (from :meth:`Tokenizer.save`), a
    Hugging Face ``tokenizer.json`` (BOS/EOS from ``tokenizer_config.json`` or ``special_tokens_map.json`` beside
    it, else from well-known token names), a ``tokenizer.model``, GPT-2's ``encoder.json`` + ``vocab.bpe`` (also
    ``gpt2_encoder.json`` + ``gpt2_vocab.bpe``, or any one ``*encoder.json`` with one ``*.bpe``), or a single
    ``*.model``. A ``.model`` file is a tiktoken ranks file when it is ``<base64> <rank>`` lines, else it must be
    a SentencePiece model.

    Whether texts start with BOS (:attr:`Tokenizer.add_bos`) follows the tokenizer's own library: a
    ``tokenizer.json`` says by its post-processor (as transformers 5 encodes, whatever ``add_bos_token`` says), a
    ``tokenizer.model`` by ``add_bos_token`` in a ``tokenizer_config.json`` beside it, else yes (Meta's Llama 2
    and 3 files).

    A tiktoken ``tokenizer.model`` holds no names for its 256 special ids: they come from the Hugging Face files
    beside it (``added_tokens_decoder`` of ``tokenizer_config.json``, else ``added_tokens`` of ``tokenizer.json``;
    BOS/EOS from ``bos_token`` / ``eos_token`` of ``tokenizer_config.json``, else ``special_tokens_map.json``),
    else they are Llama 3.1's (:class:`TiktokenTokenizer`).

    Args:
        path: The directory or file.

    Returns:
        The tokenizer.

    Raises:
        TokenizerError: ``path`` does not exist, holds no recognised tokenizer, or a file is corrupt; the
            message names the file and what was expected.
    """
    path = Path(path)
    if not path.exists():
        raise TokenizerError(f"tokenizer path '{path}' does not exist; expected {_EXPECTED}")
    if path.is_dir():
        return _load_dir(path)
    return _load_file(path)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise TokenizerError(f"cannot read tokenizer file '{path}': {e}") from e


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_bytes(path))
    except (ValueError, UnicodeDecodeError) as e:
        raise TokenizerError(f"'{path}' is not valid JSON ({e}); expected {_EXPECTED}") from e


def _load_dir(directory: Path) -> Tokenizer:
    tokenizer = _load_dir_files(directory)
    tokenizer.chat_template = read_chat_template_source(directory)
    return tokenizer


def _load_dir_files(directory: Path) -> Tokenizer:
    config_path = directory / CONFIG_NAME
    if config_path.is_file():
        config = _read_json(config_path)
        if isinstance(config, dict) and "kind" in config:
            return _load_memfit(directory, config, config_path)
    if (directory / "tokenizer.json").is_file():
        return _load_hf(directory / "tokenizer.json")
    if (directory / "tokenizer.model").is_file():
        return _load_model_file(directory / "tokenizer.model")
    pair = _find_gpt2_pair(directory)
    if pair is not None:
        return _load_gpt2(*pair)
    models = sorted(directory.glob("*.model"))
    if len(models) == 1:
        return _load_model_file(models[0])
    raise TokenizerError(f"no tokenizer files in directory '{directory}'; expected {_EXPECTED}")


def read_chat_template_source(directory: Path) -> ChatTemplateSource | None:
    """The chat template a tokenizer directory holds, with the named tokens it sees; ``None`` when it has none.

    The template is ``chat_template.jinja`` (transformers 5, and memfit's saved tokenizers), else the
    ``chat_template`` string of a Hugging Face ``tokenizer_config.json`` (transformers 4). Its named tokens are
    those of :data:`TEMPLATE_TOKEN_NAMES` (and a dict of named ``extra_special_tokens``) that
    ``tokenizer_config.json`` sets, else ``special_tokens_map.json``; a directory memfit saved keeps them in its
    config's ``chat_template_tokens``.

    Args:
        directory: The tokenizer directory.

    Returns:
        The template, or ``None``.

    Raises:
        TokenizerError: ``chat_template.jinja`` is unreadable or not UTF-8, or a config file is not JSON.
    """
    directory = Path(directory)
    jinja = directory / CHAT_TEMPLATE_NAME
    config_path = directory / CONFIG_NAME
    config = _read_json(config_path) if config_path.is_file() else None
    config = config if isinstance(config, dict) else {}
    if jinja.is_file():
        try:
            text, path = jinja.read_text(encoding="utf-8"), str(jinja)
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read the chat template '{jinja}': {e}") from e
    elif isinstance(config.get("chat_template"), str):
        text, path = config["chat_template"], str(config_path)
    else:
        return None
    if "kind" in config:  # a directory memfit saved
        saved = config.get("chat_template_tokens") or {}
        kept = {k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, str)}
        return ChatTemplateSource(text, path, kept)
    tokens: dict[str, str] = {}
    sources = [config]
    if (directory / "special_tokens_map.json").is_file():
        mapped = _read_json(directory / "special_tokens_map.json")
        sources.append(mapped if isinstance(mapped, dict) else {})
    for source in sources:
        names = list(TEMPLATE_TOKEN_NAMES)
        extra = source.get("extra_special_tokens")
        if isinstance(extra, dict):  # transformers 5: model-specific named tokens, e.g. {"image_token": ...}
            names += [k for k in extra if isinstance(k, str)]
        for name in names:
            value = _token_text(source.get(name, extra.get(name) if isinstance(extra, dict) else None))
            if value is not None:
                tokens.setdefault(name, value)
    return ChatTemplateSource(text, path, tokens)


def _load_file(path: Path) -> Tokenizer:
    if path.name == CONFIG_NAME:
        return _load_dir(path.parent)
    head = _read_bytes(path)[:4096]
    if path.suffix == ".json" or head.lstrip().startswith(b"{"):
        obj = _read_json(path)
        if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
            return _load_hf(path)
        if isinstance(obj, dict) and obj and all(isinstance(v, int) for v in obj.values()):
            pair = _find_gpt2_pair(path.parent, encoder=path)
            if pair is None:
                raise TokenizerError(
                    f"'{path}' looks like GPT-2's encoder.json but no vocab.bpe is beside it"
                )
            return _load_gpt2(*pair)
        raise TokenizerError(
            f"'{path}' is JSON but neither a Hugging Face tokenizer.json (no 'model' key) nor GPT-2's encoder.json"
        )
    if head.startswith(b"#version"):
        pair = _find_gpt2_pair(path.parent, bpe=path)
        if pair is None:
            raise TokenizerError(f"'{path}' looks like GPT-2's vocab.bpe but no encoder.json is beside it")
        return _load_gpt2(*pair)
    return _load_model_file(path)


def _load_model_file(path: Path) -> Tokenizer:
    config = _hf_config(path.parent, memfit=True)
    if path.name == "tokenizer.model" and config.get("kind") in ("sentencepiece", "tiktoken"):
        return _load_memfit(path.parent, config, path.parent / CONFIG_NAME)  # a directory memfit saved
    data = _read_bytes(path)
    first_line = data.split(b"\n", 1)[0]
    if _TIKTOKEN_LINE.match(first_line):
        return TiktokenTokenizer(data, str(path), **_hf_beside(path.parent))
    add_bos = _add_bos_entry(_hf_config(path.parent), "add_bos_token", path.parent / CONFIG_NAME)
    try:
        return SentencePieceTokenizer(data, str(path), add_bos=add_bos is not False)
    except TokenizerError as e:
        raise TokenizerError(
            f"'{path}' is neither a SentencePiece model nor a tiktoken ranks file ('<base64 token> <rank>' lines); "
            f"is it truncated or corrupt? ({e})"
        ) from e


def _find_gpt2_pair(
    directory: Path, encoder: Path | None = None, bpe: Path | None = None
) -> tuple[Path, Path] | None:
    def pick(given: Path | None, names: tuple[str, ...], pattern: str) -> Path | None:
        if given is not None:
            return given
        for name in names:
            if (directory / name).is_file():
                return directory / name
        found = sorted(directory.glob(pattern))
        return found[0] if len(found) == 1 else None

    # Prefer the partner with the matching name (gpt2_encoder.json <-> gpt2_vocab.bpe).
    enc_names = ("encoder.json", "gpt2_encoder.json")
    bpe_names = ("vocab.bpe", "gpt2_vocab.bpe")
    if encoder is not None and encoder.name.endswith("encoder.json"):
        bpe_names = (encoder.name.replace("encoder.json", "vocab.bpe"), *bpe_names)
    if bpe is not None and bpe.name.endswith("vocab.bpe"):
        enc_names = (bpe.name.replace("vocab.bpe", "encoder.json"), *enc_names)
    enc_path = pick(encoder, enc_names, "*encoder.json")
    bpe_path = pick(bpe, bpe_names, "*.bpe")
    if enc_path is None and bpe_path is None:
        return None
    if enc_path is None or bpe_path is None:
        if encoder is not None or bpe is not None:
            return None  # the caller names the file it was given
        have, lack = (enc_path, "vocab.bpe") if bpe_path is None else (bpe_path, "encoder.json")
        raise TokenizerError(f"found '{have}' but no GPT-2 {lack} beside it in '{directory}'")
    return enc_path, bpe_path


def _load_gpt2(encoder: Path, bpe: Path) -> GPT2Tokenizer:
    return GPT2Tokenizer(_read_bytes(encoder), _read_bytes(bpe), f"{encoder} + {bpe}")


def _token_text(value: Any) -> str | None:
    """A bos/eos entry of a HF config: a string, ``{"content": ...}`` or ``None``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_hf(path: Path, memfit: dict[str, Any] | None = None) -> HFTokenizer:
    """Load a tokenizer.json; BOS/EOS and ``add_bos`` from ``memfit`` (the config of a directory memfit saved), or
    else BOS/EOS from the files beside it and ``add_bos`` from the post-processor."""
    from tokenizers import Tokenizer as HFCore  # deferred: each backend is imported only when it is used

    data = _read_bytes(path)
    try:
        tok = HFCore.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises a bare Exception with serde's message
        raise TokenizerError(f"'{path}' is not a valid Hugging Face tokenizer.json: {e}") from e
    add_bos: bool | None
    if memfit is not None:
        bos, eos, extra = memfit.get("bos_token"), memfit.get("eos_token"), ()
        # (a directory saved before the key existed: memfit prepare put BOS first whatever the tokenizer)
        add_bos = _add_bos_entry(memfit, "add_bos", path.parent / CONFIG_NAME) is not False
    else:
        named = _hf_bos_eos(path.parent)
        if named is None:
            specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
            named = (
                next((t for t in _BOS_NAMES if t in specials), None),
                next((t for t in _EOS_NAMES if t in specials), None),
                path,
            )
        bos, eos, _ = named
        extra = _hf_extra_specials(path.parent)
        add_bos = None  # as the post-processor does; transformers 5 reads add_bos_token only without one
        flag = _add_bos_entry(_hf_config(path.parent), "add_bos_token", path.parent / CONFIG_NAME)
        if flag is not None and flag != _bos_first(tok, _token_text(bos)):
            log.warning(
                "'%s' sets add_bos_token %s, but '%s' (its post-processor) encodes otherwise: texts are read as "
                "tokenizer.json encodes them, as transformers 5 does",
                path.parent / CONFIG_NAME,
                str(flag).lower(),
                path,
            )
    try:
        return HFTokenizer(tok, _token_text(bos), _token_text(eos), extra, add_bos=add_bos)
    except TokenizerError as e:
        raise TokenizerError(f"'{path}': {e}") from e


def _hf_config(directory: Path, memfit: bool = False) -> dict[str, Any]:
    """The ``tokenizer_config.json`` in ``directory``: Hugging Face's (``{}`` for memfit's, unless ``memfit``)."""
    path = directory / CONFIG_NAME
    cfg = _read_json(path) if path.is_file() else None
    if not isinstance(cfg, dict) or ("kind" in cfg) != memfit:
        return {}
    return cfg


def _add_bos_entry(config: dict[str, Any], key: str, where: Path) -> bool | None:
    value = config.get(key)
    if value is not None and not isinstance(value, bool):
        raise TokenizerError(f"'{where}': {key} must be true or false, got {value!r}")
    return value


def _hf_bos_eos(directory: Path) -> tuple[Any, Any, Path] | None:
    """BOS/EOS entries of a Hugging Face ``tokenizer_config.json`` or else ``special_tokens_map.json``, if any,
    and that file."""
    for name in (CONFIG_NAME, "special_tokens_map.json"):
        cfg_path = directory / name
        if cfg_path.is_file():
            cfg = _read_json(cfg_path)
            if isinstance(cfg, dict) and ("bos_token" in cfg or "eos_token" in cfg):
                return cfg.get("bos_token"), cfg.get("eos_token"), cfg_path
    return None


def _hf_beside(directory: Path) -> dict[str, Any]:
    """What the Hugging Face files in ``directory`` say of a ``tokenizer.model`` beside them, as
    :class:`TiktokenTokenizer` arguments (only those they set): the names of special ids (``added_tokens_decoder``
    of ``tokenizer_config.json``, else ``added_tokens`` of ``tokenizer.json``), BOS/EOS (``tokenizer_config.json``,
    else ``special_tokens_map.json``) and ``add_bos`` (``add_bos_token`` of ``tokenizer_config.json``)."""
    out: dict[str, Any] = {}
    config = _hf_config(directory)
    added, where = config.get("added_tokens_decoder"), directory / CONFIG_NAME
    if not added and (directory / "tokenizer.json").is_file():
        where = directory / "tokenizer.json"
        added = _read_json(where)
        added = added.get("added_tokens") if isinstance(added, dict) else None
        if isinstance(added, list):
            added = {t.get("id") if isinstance(t, dict) else None: t for t in added}
    if added:
        try:
            names = {int(i): _token_text(t) for i, t in added.items()}
        except (AttributeError, TypeError, ValueError):
            names = {}
        if not names or not all(isinstance(t, str) for t in names.values()):
            raise TokenizerError(
                f"'{where}': its added tokens must map ids to token texts ({{'128000': {{'content': ...}}}} or "
                "[{'id': 128000, 'content': ...}])"
            )
        out["special_tokens"], out["special_tokens_from"] = names, str(where)
    named = _hf_bos_eos(directory)
    if named is not None:
        out["bos_token"], out["eos_token"] = _token_text(named[0]), _token_text(named[1])
        out["bos_eos_from"] = str(named[2])
    add_bos = _add_bos_entry(config, "add_bos_token", directory / CONFIG_NAME)
    if add_bos is not None:
        out["add_bos"] = add_bos
    return out


def _hf_extra_specials(directory: Path) -> list[str]:
    """Tokens a Hugging Face ``tokenizer_config.json`` declares special: ``additional_special_tokens`` (4.x),
    ``extra_special_tokens`` (5.x, a list or a dict) and ``added_tokens_decoder`` entries with ``special``."""
    cfg_path = directory / CONFIG_NAME
    if not cfg_path.is_file():
        return []
    cfg = _read_json(cfg_path)
    if not isinstance(cfg, dict):
        return []
    found: list[Any] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = cfg.get(key)
        found += list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    decoder = cfg.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        found += [t for t in decoder.values() if isinstance(t, dict) and t.get("special")]
    return [t for t in (_token_text(v) for v in found) if t is not None]


def _load_memfit(directory: Path, config: dict[str, Any], config_path: Path) -> Tokenizer:
    kind = config["kind"]
    if kind not in KINDS:
        raise TokenizerError(f"'{config_path}' names tokenizer kind {kind!r}; expected one of {KINDS}")

    def need(name: str) -> Path:
        p = directory / name
        if not p.is_file():
            raise TokenizerError(f"'{config_path}' is for a {kind} tokenizer, but '{p}' is missing")
        return p

    tokenizer: Tokenizer
    if kind == "char":
        vocab = config.get("vocab")
        if not isinstance(vocab, list):
            raise TokenizerError(
                f"'{config_path}' is for a char tokenizer but has no 'vocab' list of characters"
            )
        try:
            tokenizer = CharTokenizer(vocab)
        except TokenizerError as e:
            raise TokenizerError(f"'{config_path}': {e}") from e
    elif kind == "bpe":
        tokenizer = _load_hf(need("tokenizer.json"), config)
    elif kind == "sentencepiece":
        p = need("tokenizer.model")
        add_bos = _add_bos_entry(config, "add_bos", config_path)
        tokenizer = SentencePieceTokenizer(_read_bytes(p), str(p), add_bos=add_bos is not False)
    elif kind == "tiktoken":
        p = need("tokenizer.model")
        names = config.get("special_tokens") or {}
        if not isinstance(names, dict) or not all(isinstance(i, int) for i in names.values()):
            raise TokenizerError(f"'{config_path}': special_tokens must map token texts to ids")
        tokenizer = TiktokenTokenizer(
            _read_bytes(p),
            str(p),
            special_tokens={i: t for t, i in names.items()},
            special_tokens_from=str(config_path),
            bos_token=config.get("bos_token", ...),
            eos_token=config.get("eos_token", ...),
            add_bos=_add_bos_entry(config, "add_bos", config_path) is not False,
        )
    else:
        tokenizer = _load_gpt2(need("encoder.json"), need("vocab.bpe"))
    expected = config.get("vocab_size")
    if expected is not None and expected != tokenizer.vocab_size:
        raise TokenizerError(
            f"'{config_path}' records vocab_size {expected} but the files in '{directory}' give {tokenizer.vocab_size}"
        )
    return tokenizer
