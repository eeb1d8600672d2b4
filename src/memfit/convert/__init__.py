"""Checkpoint formats in and out: the format-independent entry points (detect, read, load, convert to HF).

Formats (:func:`detect_format`), each read by one module of this package:

- ``"hf"`` (:mod:`memfit.convert.hf`): a Hugging Face ``LlamaForCausalLM`` directory: ``config.json`` and
  ``model.safetensors``, or the shards listed in ``model.safetensors.index.json`` (what ``save_pretrained``
  writes). ``config.json`` is read in both the transformers 4.x spelling (``rope_theta`` and ``rope_scaling`` at the
  top level, ``torch_dtype``) and the 5.x one (``rope_parameters``, ``dtype``).
- ``"meta"`` (:mod:`memfit.convert.meta`): Meta's original release: ``params.json`` and ``consolidated.00.pth``
  (``.01``, ... for model-parallel shards), read with ``torch.load(weights_only=True, mmap=True)``. Tensors are
  renamed to Hugging Face names, shards concatenated, and the rows of ``wq``/``wk`` permuted from Meta's interleaved
  RoPE layout (channel pairs ``(2i, 2i + 1)``) to the ``rotate_half`` layout (``(i, i + hd/2)``) that memfit and
  transformers use.
- ``"memfit"`` (:mod:`memfit.convert.memfit`): a checkpoint written by memfit (``model.safetensors`` +
  ``model_config.json``), or a run directory holding ``checkpoints/step_*/`` (the newest is read).

Each reader turns a directory into a :class:`~memfit.convert.tensors.Scan` (config, info and tensor list from the
headers only); the functions here dispatch on the format once and work on the scan. :func:`load_pretrained` builds
the model on the meta device and materialises it one parameter at a time, straight from the file into its final
dtype and device, so host memory peaks near one copy of the weights in the target dtype plus one tensor (measured in
``docs/benchmarks.md``, "Loading pretrained weights"). :func:`memfit.convert.hf.export_hf` writes a directory that
``LlamaForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load, atomically and with one shard in
memory at a time; :func:`export_checkpoint` converts any readable checkpoint to it. Hugging Face PEFT adapters are
read and written by :mod:`memfit.convert.peft_adapter`.

Nothing is unpickled beyond tensors (``weights_only=True``) and nothing is downloaded here (a Hub id is fetched
by :mod:`memfit.hub` before a directory reaches this package).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from memfit.checkpoint import MODEL_CONFIG, TRAINER_STATE, latest_checkpoint, resolve_checkpoint
from memfit.convert.hf import (
    DEFAULT_MAX_SHARD_SIZE,
    HF_CONFIG,
    HF_GENERATION_CONFIG,
    HF_INDEX,
    HF_WEIGHTS,
    check_out_dir,
    config_only,
    export_hf,
    scan_hf,
    scan_hf_config,
)
from memfit.convert.memfit import scan_memfit
from memfit.convert.meta import META_PARAMS, META_SHARD, scan_meta
from memfit.convert.tensors import Entry, PretrainedInfo, Scan, StackFactory, read_json
from memfit.errors import CheckpointError
from memfit.models.config import DecoderConfig
from memfit.models.decoder import Decoder, build_decoder
from memfit.tokenizer import ChatTemplateSource, Tokenizer, load_tokenizer

__all__ = [
    "FORMATS",
    "PretrainedInfo",
    "detect_format",
    "export_checkpoint",
    "iter_state_dict",
    "expert_load_order",
    "load_order",
    "load_pretrained",
    "pretrained_parameters",
    "read_config",
    "weights_fingerprint",
]

log = logging.getLogger(__name__)

FORMATS = ("hf", "meta", "memfit")
_EXPECTED_FORMATS = (
    "a Hugging Face directory (config.json + model.safetensors, or model.safetensors.index.json and its "
    "shards), a Meta directory (params.json + consolidated.00.pth, consolidated.01.pth, ...), or a memfit "
    "checkpoint or run directory (model.safetensors + model_config.json, or checkpoints/step_*/)"
)


# ================================================================================================================
# Format detection


def detect_format(path: str | Path) -> str:
    """Which checkpoint format a directory holds.

    Args:
        path: a checkpoint directory (for memfit also a run directory holding ``checkpoints/``).

    Returns:
        ``"hf"`` (``config.json`` + ``*.safetensors``), ``"meta"`` (``params.json`` + ``consolidated.*.pth``) or
        ``"memfit"`` (see :func:`memfit.checkpoint.resolve_checkpoint`).

    Raises:
        CheckpointError: ``path`` does not exist, is a file, or holds none of these; the message lists what was
            expected and what was found. A Hugging Face directory with only pickled ``pytorch_model.bin`` weights
            is refused (memfit does not unpickle untrusted files).
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint path '{p}' does not exist; expected {_EXPECTED_FORMATS}")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint path '{p}' is a file; pass the directory that holds it")
    if (p / HF_CONFIG).is_file():
        if (p / HF_WEIGHTS).is_file() or (p / HF_INDEX).is_file() or any(p.glob("*.safetensors")):
            return "hf"
        if any(p.glob("pytorch_model*.bin")):
            raise CheckpointError(
                f"'{p}' holds pickled pytorch_model*.bin weights only; memfit reads safetensors (it does not "
                f"unpickle untrusted files). Convert once where you trust the file: "
                f"LlamaForCausalLM.from_pretrained('{p}').save_pretrained(OUT, safe_serialization=True)"
            )
    if (p / META_PARAMS).is_file() and any(META_SHARD.match(f.name) for f in p.iterdir()):
        return "meta"
    if (p / MODEL_CONFIG).is_file() or (p / TRAINER_STATE).is_file() or latest_checkpoint(p) is not None:
        return "memfit"  # a checkpoint missing files is still one: its reader names what is missing
    found = sorted(f.name + ("/" if f.is_dir() else "") for f in p.iterdir())
    shown = ", ".join(found[:12]) + (f", ... ({len(found)} entries)" if len(found) > 12 else "")
    raise CheckpointError(
        f"'{p}' is not a checkpoint memfit can read; expected {_EXPECTED_FORMATS}. Found: {shown or 'nothing'}"
    )


# ================================================================================================================
# Configs


def read_config(path: str | Path, fmt: str | None = None) -> tuple[DecoderConfig, PretrainedInfo]:
    """The architecture and metadata of a checkpoint, from its config and tensor headers only (no weights read).

    Use it to estimate or plan a run from a checkpoint: ``build_decoder(config, device="meta")``. A Hugging Face
    directory holding ``config.json`` alone (what ``memfit estimate`` fetches of a Hub model) is read too.

    Args:
        path: a checkpoint directory of any format (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Returns:
        ``(config, info)``. For "meta" and "memfit" the token ids in ``info`` are filled in by
        :func:`load_pretrained`, which reads the tokenizer.

    Raises:
        CheckpointError: see :func:`detect_format`, :func:`memfit.convert.hf.read_hf_config` and
            :func:`memfit.convert.meta.read_meta_params`.
    """
    scan = _scan(Path(path), fmt, config_alone=True)
    return scan.config, scan.info


def weights_fingerprint(path: str | Path, fmt: str | None = None) -> str:
    """A cheap fingerprint of a checkpoint's weight files, to notice that a base model changed under a LoRA run.

    sha256 over each weight file's name, size and its first and last MiB (not the whole file: a 16 GiB base is
    fingerprinted in milliseconds). A copy or move of the same files keeps the fingerprint; different weights of
    the same shapes change it (their bytes differ within the first MiB of every file).

    Args:
        path: a checkpoint directory of any format.
        fmt: the format, or None to detect it.

    Returns:
        A hex digest.

    Raises:
        CheckpointError: see :func:`detect_format`.
    """
    import hashlib

    digest = hashlib.sha256()
    files = weight_files(path, fmt)
    chunk = 1024**2
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            digest.update(f.read(chunk))
            f.seek(max(size - chunk, 0))
            digest.update(f.read(chunk))
    return digest.hexdigest()


def weight_files(path: str | Path, fmt: str | None = None) -> list[Path]:
    """The files a checkpoint's weights are read from, sorted (safetensors shards, ``.pth`` files).

    Raises:
        CheckpointError: see :func:`detect_format`.
    """
    return sorted({entry.file for entry in _scan(Path(path), fmt).entries})


def _scan(path: Path, fmt: str | None, *, config_alone: bool = False) -> Scan:
    """``path``'s scan; ``config_alone``: a Hugging Face ``config.json`` without weights is read as the checkpoint
    its config implies (:func:`memfit.convert.hf.scan_hf_config`: what the estimator needs), not refused."""
    if config_alone and fmt in (None, "hf") and path.is_dir() and config_only(path):
        return scan_hf_config(path)
    fmt = fmt or detect_format(path)
    if fmt == "hf":
        return scan_hf(path)
    if fmt == "meta":
        return scan_meta(path)
    if fmt == "memfit":
        return scan_memfit(path)
    raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")


# ================================================================================================================
# Reading weights


def iter_state_dict(path: str | Path, fmt: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """Yield a checkpoint's tensors one at a time, under Hugging Face ``LlamaForCausalLM`` names, in stored dtype.

    Hugging Face and memfit files are read from safetensors (every shard of an index is checked to exist and to
    hold its tensors before the first tensor is read). Meta shards are memory-mapped, concatenated
    (``wq``/``wk``/``wv``/``w1``/``w3``/``output`` along dim 0, ``wo``/``w2`` along dim 1, ``tok_embeddings`` along
    the split its shapes show; norms are replicated), renamed and ``wq``/``wk`` rows permuted to the rotate_half
    layout (:func:`memfit.convert.meta.meta_to_hf_rows`); ``rope.freqs`` and an ``output.weight`` identical to the
    embedding are skipped. Each yielded tensor owns its memory (none views a mapped file).

    Args:
        path: a checkpoint directory (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Yields:
        ``(name, tensor)`` pairs, e.g. ``("model.layers.0.self_attn.q_proj.weight", (nh * hd, C) tensor)``.

    Raises:
        CheckpointError: a file is missing, truncated or inconsistent; the message names it.
    """
    for entry, tensor in _scan(Path(path), fmt).read():
        yield entry.name, tensor


def load_pretrained(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = torch.float32,
    fmt: str | None = None,
    transform: Callable[[str, Tensor], Tensor] | None = None,
    stack: StackFactory | None = None,
) -> tuple[Decoder, Tokenizer | None, PretrainedInfo]:
    """Load a pretrained Llama (Hugging Face, Meta or memfit format) and its tokenizer.

    The model is built on the meta device, every tensor's name and shape is checked against it from the file
    headers (before any weight is read), then parameters are materialised one at a time: read, converted to
    ``dtype`` on ``device``, and assigned. Host memory therefore peaks near the weights in ``dtype`` plus one
    tensor as stored, not two copies. A tied ``lm_head`` is the embedding Parameter (a stored ``lm_head.weight``
    is then ignored, as transformers does). The RoPE buffer is recomputed in float32.

    Args:
        path: the checkpoint directory (see :func:`detect_format`).
        device: where the parameters go (``"cpu"``, ``"cuda"``, ...).
        dtype: floating dtype of the parameters; None keeps each tensor's stored dtype.
        fmt: the format, or None to detect it.
        transform: called as ``transform(name, tensor)`` on each parameter once it is in ``dtype`` on ``device``;
            what it returns is kept instead (QLoRA's NF4 quantization). A parameter it changed into another
            tensor type is frozen.
        stack: for a mixture of experts stored one tensor per expert, what fills each stack of experts from its
            parts (:data:`~memfit.convert.tensors.StackFactory`: QLoRA quantizes each expert as it is read);
            a tensor subclass its ``finish`` gives is kept as it is (frozen), neither converted nor transformed.

    Returns:
        ``(model, tokenizer, info)``: the model in train mode with ``requires_grad`` parameters; the tokenizer
        from :func:`memfit.tokenizer.load_tokenizer` (``tokenizer.json`` with ``tokenizer_config.json``, or
        ``tokenizer.model``: SentencePiece for Llama 2, tiktoken for Llama 3), or None when the checkpoint has no
        tokenizer files (``info.notes`` says so); and :class:`PretrainedInfo`.

    Raises:
        CheckpointError: naming the tensor and the file, when a tensor is missing, unexpected, mis-shaped or not
            floating point, or a file is missing, truncated or inconsistent.
        memfit.tokenizer.TokenizerError: a tokenizer file is corrupt.
        ValueError: ``device`` is meta (use :func:`read_config` and ``build_decoder(config, device="meta")``).
    """
    if torch.device(device).type == "meta":
        raise ValueError(
            "load_pretrained reads weights; for a meta model use read_config() and build_decoder()"
        )
    return _load(_scan(Path(path), fmt), torch.device(device), dtype, transform, stack)


def pretrained_parameters(path: str | Path, fmt: str | None = None) -> Iterator[tuple[str, Tensor]]:
    """A checkpoint's parameters one at a time, checked first against the model its config describes.

    Every tensor's name, shape and dtype is checked from the file headers *before* this returns (so a bad
    checkpoint fails before anything is allocated); the returned iterator then reads one tensor per step. Tensors
    the model derives or shares (a tied ``lm_head.weight``, ``rotary_emb.inv_freq``) are left out, so the names
    are exactly the model's ``named_parameters()``. A sharded run fills its shards from it
    (:func:`memfit.distributed.materialize_sharded`), holding one whole tensor at a time.

    Args:
        path: a checkpoint directory (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Returns:
        An iterator of ``(name, tensor)`` in stored dtype, each tensor owning its memory.

    Raises:
        CheckpointError: as :func:`load_pretrained`.
    """
    scan = _scan(Path(path), fmt)
    return _checked_tensors(scan, build_decoder(scan.config, device="meta"))


def load_order(path: str | Path, fmt: str | None = None) -> list[tuple[Entry, bool]] | None:
    """The tensors :func:`load_pretrained` reads from ``path``, in the order it reads them, from the headers alone:
    each is read whole into memory of its own and dropped when the next is read. The flag says whether the model
    keeps it (``False``: read and dropped, as a tied ``lm_head.weight`` or a stored ``rotary_emb.inv_freq``).
    A Hugging Face ``config.json`` without weights gives the tensors its config implies, in the order
    ``save_pretrained`` stores them (:func:`memfit.convert.hf.scan_hf_config`).

    Args:
        path: a checkpoint directory (see :func:`detect_format`).
        fmt: the format, or None to detect it.

    Returns:
        ``[(entry, kept), ...]``, or ``None`` where the format is read otherwise (Meta shards concatenated, fused
        tensors split, a sharded memfit checkpoint consolidated first, a mixture of experts stored one tensor per
        expert: :func:`expert_load_order`).

    Raises:
        CheckpointError: as :func:`load_pretrained`.
    """
    scan = _scan(Path(path), fmt, config_alone=True)
    if not scan.streamed:
        return None
    skip = _check_entries(build_decoder(scan.config, device="meta"), scan)
    by_file: dict[Path, list[Entry]] = {}  # read_safetensors' order: file by file, as first named
    for e in scan.entries:
        by_file.setdefault(e.file, []).append(e)
    return [(e, e.name not in skip) for group in by_file.values() for e in group]


def expert_load_order(
    path: str | Path, fmt: str | None = None
) -> tuple[list[Entry], dict[str, tuple[Entry, int]]] | None:
    """What :func:`load_pretrained` reads from a mixture of experts stored one tensor per expert, from the headers:
    the files' tensors in the order they are read, each dropped when the next is read, and for each expert's
    tensor the stacked tensor it is copied into (allocated in the stored dtype at its first part, handed on whole
    once its last part is in: :func:`memfit.convert.hf.scan_hf`).

    Returns:
        ``(stored, stacks)``: ``stacks`` maps a stored name to ``(stacked entry, parts that fill it)``; ``None`` for
        any other checkpoint (:func:`load_order`).
    """
    scan = _scan(Path(path), fmt, config_alone=True)
    if scan.stacks is None or scan.stored is None:
        return None
    by_file: dict[Path, list[Entry]] = {}  # read_safetensors' order: file by file, as first named
    for e in scan.stored:
        by_file.setdefault(e.file, []).append(e)
    return [e for group in by_file.values() for e in group], scan.stacks


def _checked_tensors(
    scan: Scan, model: Decoder, stack: StackFactory | None = None
) -> Iterator[tuple[str, Tensor]]:
    skip = _check_entries(model, scan)  # now, not at the first read

    def tensors() -> Iterator[tuple[str, Tensor]]:
        for entry, tensor in scan.read(stack=stack) if stack is not None and scan.stacks else scan.read():
            if entry.name not in skip:
                yield entry.name, tensor
            del tensor  # the caller's copy is the only one left while the next tensor is read

    return tensors()


def _load(
    scan: Scan,
    device: torch.device,
    dtype: torch.dtype | None,
    transform: Callable[[str, Tensor], Tensor] | None = None,
    stack: StackFactory | None = None,
) -> tuple[Decoder, Tokenizer | None, PretrainedInfo]:
    config = scan.config
    model = build_decoder(config, device="meta")
    tensors = _checked_tensors(scan, model, stack)
    tokenizer, info = _load_tokenizer(scan.info, config)  # small, and may fail: before the weights

    # ---- materialise one parameter at a time: read, convert, assign, drop the stored copy
    with torch.no_grad():
        for name, tensor in tensors:
            module_name, _, attr = name.rpartition(".")
            final = type(tensor) is not Tensor  # made by its stack (QLoRA's NF4, quantized as it was read)
            value = (
                tensor
                if final
                else tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
            )
            del tensor
            if transform is not None and not final:
                value = transform(name, value)
            trainable = type(value) is Tensor  # a quantized tensor subclass is frozen
            model.get_submodule(module_name)._parameters[attr] = nn.Parameter(value, requires_grad=trainable)
    model.tie_weights()
    model.model.reset_rope(device)
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta:  # unreachable after _check_entries; the guard of "never a meta parameter"
        raise CheckpointError(f"'{info.path}': tensors {still_meta[:5]} were not loaded")
    return model, tokenizer, info


def _check_entries(model: Decoder, scan: Scan) -> set[str]:
    """Check names, shapes and dtypes against the meta-built model; return the names to skip (a tied lm_head)."""
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a tied lm_head.weight is not listed
    where = f"'{scan.info.path}'"
    skip: set[str] = set()
    seen: dict[str, Entry] = {}
    for e in scan.entries:
        if e.name in seen:
            raise CheckpointError(
                f"tensor '{e.name}' is stored twice: in '{seen[e.name].file}' and '{e.file}'"
            )
        seen[e.name] = e
        if e.name.endswith("rotary_emb.inv_freq"):  # saved by transformers < 4.31; derived from the config
            skip.add(e.name)
            continue
        if e.name == "lm_head.weight" and scan.config.tie_word_embeddings:
            skip.add(e.name)
            shape = expected["model.embed_tokens.weight"]
        elif e.name not in expected:
            raise CheckpointError(
                f"'{e.file}' holds tensor '{e.name}', which a Llama of this config does not have; the weights do "
                f"not belong to this config (LoRA/adapter tensors must be merged first)"
            )
        else:
            shape = expected[e.name]
        if e.shape != shape:
            raise CheckpointError(
                f"'{e.file}': tensor '{e.name}' has shape {e.shape} but the config implies {shape}; the weights "
                f"and the config do not belong together"
            )
        if e.dtype is not None and not e.dtype.is_floating_point:
            raise CheckpointError(
                f"'{e.file}': tensor '{e.name}' is stored as {e.dtype}; quantized checkpoints are not supported"
            )
    missing = [n for n in expected if n not in seen]
    if missing:
        files = sorted({str(e.file.name) for e in scan.entries})
        raise CheckpointError(
            f"checkpoint {where} lacks tensor '{missing[0]}' (shape {expected[missing[0]]})"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
            + f"; read {', '.join(files[:4])}{'...' if len(files) > 4 else ''}. The checkpoint is incomplete or "
            f"for another architecture"
        )
    return skip


def _load_tokenizer(info: PretrainedInfo, config: DecoderConfig) -> tuple[Tokenizer | None, PretrainedInfo]:
    if info.tokenizer_path is None:
        return None, info
    tokenizer = load_tokenizer(info.tokenizer_path)
    notes = list(info.notes)
    if tokenizer.vocab_size > config.vocab_size:
        notes.append(
            f"the tokenizer has {tokenizer.vocab_size} ids but the embedding only {config.vocab_size} rows"
        )
        log.warning("%s: %s", info.path, notes[-1])
    bos = info.bos_token_id if info.bos_token_id is not None else tokenizer.bos_id
    eos = info.eos_token_ids
    if not eos and tokenizer.eos_id is not None:
        eos = (tokenizer.eos_id,)
        if info.format == "meta" and tokenizer.kind == "tiktoken":  # Meta stops on these too (3.0 has no eom)
            specials = tokenizer.special_tokens
            eos += tuple(
                specials[t] for t in ("<|eom_id|>", "<|eot_id|>") if t in specials and specials[t] not in eos
            )
    return tokenizer, dataclasses.replace(info, bos_token_id=bos, eos_token_ids=eos, notes=tuple(notes))


# ================================================================================================================
# Converting to Hugging Face


def export_checkpoint(
    src: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    fmt: str | None = None,
    chat_template: ChatTemplateSource | None = None,
) -> Path:
    """Convert a checkpoint of any readable format (Hugging Face, Meta, memfit) to a Hugging Face directory.

    This is ``memfit export SRC OUT``. The weights pass through memory once, in ``dtype`` (see
    :func:`load_pretrained`); BOS/EOS ids carry over from ``src`` (Llama 3's list of stop ids included).

    Args:
        src: the checkpoint directory (a memfit run directory exports its newest checkpoint).
        out_dir: the new directory; it must not exist or be empty (checked before anything is read).
        dtype: dtype of the written weights; None keeps the stored dtype (float32 if unknown).
        max_shard_size: bytes per shard (default 5 GiB).
        fmt: the format of ``src``, or None to detect it.
        chat_template: the chat template the directory carries in place of the tokenizer's own; None keeps the
            tokenizer's (see :func:`memfit.convert.hf.export_hf`).

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: see :func:`load_pretrained` and :func:`memfit.convert.hf.export_hf`.
    """
    check_out_dir(Path(out_dir))
    scan = _scan(Path(src), fmt)
    dtype = dtype or scan.info.stored_dtype or torch.float32
    model, tokenizer, info = _load(scan, torch.device("cpu"), dtype)
    generation: dict[str, Any] = {}
    if info.format == "hf" and (info.path / HF_GENERATION_CONFIG).is_file():  # sampling defaults too
        original = read_json(info.path / HF_GENERATION_CONFIG)
        generation = dict(original) if isinstance(original, dict) else {}
    generation.update(bos_token_id=info.bos_token_id, eos_token_id=list(info.eos_token_ids) or None)
    return export_hf(
        model,
        out_dir,
        tokenizer=tokenizer,
        dtype=dtype,
        max_shard_size=max_shard_size,
        generation_config=generation,
        chat_template=chat_template,
    )


def checkpoint_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer stored with a Hugging Face, Meta or memfit checkpoint (read without the weights).

    Raises:
        CheckpointError: the checkpoint has no tokenizer.
    """
    fmt = detect_format(path)
    where = resolve_checkpoint(path) / "tokenizer" if fmt == "memfit" else Path(path)
    try:
        return load_tokenizer(where)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint_dir '{path}' has no usable tokenizer ({exc}); fine-tuning needs the tokenizer the model was "
            f"trained with (tokenizer.json or tokenizer.model beside the weights)"
        ) from None
