"""Meta's original Llama layout: read ``params.json`` and the ``consolidated.*.pth`` shards.

A directory holds ``params.json`` and ``consolidated.00.pth`` (``.01``, ... for model-parallel shards). Shards are
read with ``torch.load(weights_only=True, mmap=True)``. Tensors are renamed to Hugging Face names, shards
concatenated, and the rows of ``wq``/``wk`` permuted from Meta's interleaved RoPE layout (channel pairs
``(2i, 2i + 1)``) to the ``rotate_half`` layout (``(i, i + hd/2)``) that memfit and transformers use
(:func:`meta_to_hf_rows`, inverse :func:`hf_to_meta_rows`). The pages of the mapped files are handed back to the
kernel once each tensor is copied out, so the mapped files do not add a second copy to the peak.
"""

from __future__ import annotations

import ctypes
import mmap
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from memfit.convert.tensors import Entry, PretrainedInfo, Scan, config_file, read_json
from memfit.errors import CheckpointError
from memfit.models.config import DecoderConfig, RopeScaling

__all__ = ["META_PARAMS", "META_SHARD", "hf_to_meta_rows", "meta_to_hf_rows", "read_meta_params", "scan_meta"]

META_PARAMS = "params.json"
META_SHARD = re.compile(r"^consolidated\.(\d+)\.pth$")


def read_meta_params(path: str | Path) -> DecoderConfig:
    """The :class:`DecoderConfig` of a Meta checkpoint (``params.json`` plus the tensor shapes).

    ``params.json`` holds ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads`` (default ``n_heads``),
    ``vocab_size`` (``-1`` in Llama 2: taken from the embedding's shape), ``multiple_of``, ``ffn_dim_multiplier``,
    ``norm_eps`` (default 1e-5), ``rope_theta`` (default 10000) and ``use_scaled_rope`` (Llama 3.1 and 3.2: the
    "llama3" scaling with factor 8, low 1, high 4, original context 8192, as Meta's reference code applies; the
    optional keys ``rope_scaling_factor`` / ``rope_high_freq_factor`` override factor and high). Note that the
    Hugging Face conversions of Llama 3.2 1B/3B use factor 32; a Meta 3.2 download without
    ``rope_scaling_factor`` gets Meta's 8.

    ``intermediate_size`` is taken from the shape of ``w1`` and checked against Meta's rule
    ``multiple_of * ceil(int(ffn_dim_multiplier * int(8 * dim / 3)) / multiple_of)`` when ``multiple_of`` is
    given. The output projection is tied to the embedding when ``output.weight`` is absent or bit-identical to
    ``tok_embeddings.weight``.

    ``params.json`` has no context length (Meta's ``max_seq_len`` is an inference buffer size), so ``max_seq_len``
    is chosen by family: 131072 with ``use_scaled_rope`` (Llama 3.1/3.2), 8192 for Llama 3 (``rope_theta``
    500000 or a vocabulary above 32000), else 4096 (Llama 2). memfit does not enforce it.

    Args:
        path: the checkpoint directory or its ``params.json``.

    Returns:
        The validated config.

    Raises:
        CheckpointError: naming the file and key or tensor, when a file is missing or unreadable, a key is
            missing, shards disagree, or the shapes contradict ``params.json``.
    """
    return _meta_layout(_checkpoint_dir(Path(path), META_PARAMS)).config


def _checkpoint_dir(path: Path, name: str) -> Path:
    return config_file(path, name).parent


# Meta name (after "layers.{i}.") -> (Hugging Face name, concatenation dim across model-parallel shards or None
# for a replicated tensor, which heads count permutes the rows: "q", "k" or None).
_META_LAYER_NAMES = {
    "attention.wq.weight": ("self_attn.q_proj.weight", 0, "q"),
    "attention.wk.weight": ("self_attn.k_proj.weight", 0, "k"),
    "attention.wv.weight": ("self_attn.v_proj.weight", 0, None),
    "attention.wo.weight": ("self_attn.o_proj.weight", 1, None),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", 0, None),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", 1, None),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", 0, None),
    "attention_norm.weight": ("input_layernorm.weight", None, None),
    "ffn_norm.weight": ("post_attention_layernorm.weight", None, None),
}
_META_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_META_SKIPPED = ("rope.freqs",)  # Llama 2 stores its RoPE table; memfit recomputes it


@dataclass(frozen=True)
class _MetaTensor:
    meta_name: str
    entry: Entry
    cat_dim: int | None
    heads: int | None  # rows are permuted from Meta's interleaved RoPE layout with this many heads


@dataclass(frozen=True)
class _MetaLayout:
    config: DecoderConfig
    shards: list[Path]
    tensors: list[_MetaTensor]  # rope.freqs and an output.weight tied to the embedding are left out
    stored_dtype: torch.dtype | None
    notes: tuple[str, ...]


def _meta_shard_files(directory: Path) -> list[Path]:
    found = {int(m.group(1)): f for f in directory.iterdir() if (m := META_SHARD.match(f.name))}
    if not found:
        raise CheckpointError(f"'{directory}' has no consolidated.00.pth; a Meta checkpoint needs it")
    for i in range(max(found) + 1):
        if i not in found:
            raise CheckpointError(
                f"Meta checkpoint '{directory}' has consolidated.{max(found):02d}.pth but lacks "
                f"'{directory / f'consolidated.{i:02d}.pth'}'; the download is incomplete"
            )
    return [found[i] for i in range(len(found))]


def _torch_load(path: Path) -> dict[str, Tensor]:
    """``torch.load`` of a Meta shard: memory-mapped, tensors only."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (
        Exception
    ) as exc:  # zip errors are RuntimeError, unsafe pickles UnpicklingError, short files EOFError
        raise CheckpointError(
            f"'{path}' cannot be read as a PyTorch checkpoint of tensors ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); it is truncated, corrupt, or holds objects other "
            f"than tensors (memfit loads with weights_only=True): download it again"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(
            f"'{path}' must hold a dict of tensor name -> tensor, as Meta's consolidated.*.pth do"
        )
    return state


def _meta_hf_name(meta_name: str, path: Path) -> tuple[str, int | None, str | None] | None:
    """Hugging Face name, concatenation dim and permutation of a Meta tensor; None for skipped tensors."""
    if meta_name in _META_SKIPPED:
        return None
    if meta_name == "tok_embeddings.weight":
        return "model.embed_tokens.weight", -1, None  # -1: the split dim is inferred from the shapes
    if meta_name == "norm.weight":
        return "model.norm.weight", None, None
    if meta_name == "output.weight":
        return "lm_head.weight", 0, None
    m = _META_LAYER.match(meta_name)
    if m and m.group(2) in _META_LAYER_NAMES:
        name, dim, heads = _META_LAYER_NAMES[m.group(2)]
        return f"model.layers.{m.group(1)}.{name}", dim, heads
    raise CheckpointError(
        f"'{path}' holds tensor '{meta_name}', which a Meta Llama checkpoint does not have (expected "
        f"tok_embeddings, layers.N.attention.w[qkvo], layers.N.feed_forward.w[123], *_norm, norm, output)"
    )


def _meta_layout(directory: Path) -> _MetaLayout:
    params_path = directory / META_PARAMS
    params = read_json(params_path)
    if not isinstance(params, dict):
        raise CheckpointError(f"'{params_path}' must hold a JSON object")
    for key in ("dim", "n_layers", "n_heads"):
        if not isinstance(params.get(key), int):
            raise CheckpointError(
                f"'{params_path}': {key} is missing or not an int; Meta's params.json has it"
            )
    dim, n_heads = params["dim"], params["n_heads"]
    n_kv_heads = params.get("n_kv_heads") or n_heads
    shards = _meta_shard_files(directory)
    n = len(shards)

    # Shapes and dtypes of every shard (memory-mapped: nothing is read but the pickled index).
    shard_meta: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = []
    for path in shards:
        state = _torch_load(path)
        shard_meta.append({k: (tuple(v.shape), v.dtype) for k, v in state.items()})
        del state
    names = list(shard_meta[0])
    for path, meta in zip(shards[1:], shard_meta[1:], strict=True):
        if set(meta) != set(names):
            diff = sorted(set(meta) ^ set(names))
            raise CheckpointError(
                f"'{path}' and '{shards[0]}' hold different tensors ({diff[:3]}); the shards are from different "
                f"checkpoints"
            )
    for key in ("tok_embeddings.weight", "layers.0.feed_forward.w1.weight"):
        if key not in shard_meta[0]:
            raise CheckpointError(f"'{shards[0]}' lacks tensor '{key}'; it is not a Meta Llama checkpoint")

    # The embedding is split along the model width (Llama 2's ParallelEmbedding) or the vocabulary (Llama 3's
    # VocabParallelEmbedding): tell them apart by the width of a shard.
    emb_rows, emb_cols = shard_meta[0]["tok_embeddings.weight"][0]
    if n == 1 or emb_cols == dim:
        emb_dim = 0
    elif emb_cols * n == dim:
        emb_dim = 1
    else:
        raise CheckpointError(
            f"'{shards[0]}': tok_embeddings.weight has shape {(emb_rows, emb_cols)}, which is neither dim "
            f"({dim}, from '{params_path}') nor dim / {n} shards wide"
        )
    vocab_size = sum(m["tok_embeddings.weight"][0][0] for m in shard_meta) if emb_dim == 0 else emb_rows
    if params.get("vocab_size", -1) not in (-1, None, vocab_size):
        raise CheckpointError(
            f"'{params_path}': vocab_size is {params['vocab_size']} but tok_embeddings.weight holds {vocab_size} rows"
        )

    intermediate_size = shard_meta[0]["layers.0.feed_forward.w1.weight"][0][0] * n
    notes: list[str] = []
    if params.get("multiple_of") is not None:
        multiple_of = params["multiple_of"]
        hidden = int(2 * (4 * dim) / 3)
        if params.get("ffn_dim_multiplier") is not None:
            hidden = int(params["ffn_dim_multiplier"] * hidden)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
        if hidden != intermediate_size:
            raise CheckpointError(
                f"'{params_path}': multiple_of {multiple_of} and ffn_dim_multiplier "
                f"{params.get('ffn_dim_multiplier')} give a feed-forward size of {hidden}, but "
                f"layers.0.feed_forward.w1.weight has {intermediate_size} rows; params.json and the weights disagree"
            )

    scaling = None
    if params.get("use_scaled_rope"):
        scaling = RopeScaling(
            factor=float(params.get("rope_scaling_factor", 8.0)),
            low_freq_factor=1.0,
            high_freq_factor=float(params.get("rope_high_freq_factor", 4.0)),
            original_max_position_embeddings=8192,
        )
    rope_theta = params.get("rope_theta", 10000.0)
    if scaling is not None:
        max_seq_len = 131072
    elif rope_theta >= 500000 or vocab_size > 32000:
        max_seq_len = 8192
    else:
        max_seq_len = 4096
    notes.append(f"max_seq_len {max_seq_len} chosen by model family (params.json has no context length)")

    # Tied output: absent, or bit-identical to the embedding (Llama 3.2 1B/3B ship a copy).
    tie = "output.weight" not in names
    if not tie and all(m["output.weight"][0] == m["tok_embeddings.weight"][0] for m in shard_meta):
        tie = all(_meta_tensors_equal(p, "output.weight", "tok_embeddings.weight") for p in shards)
    if tie and "output.weight" in names:
        notes.append("output.weight equals tok_embeddings.weight: loaded tied (stored once)")

    try:
        config = DecoderConfig(
            vocab_size=vocab_size,
            dim=dim,
            num_layers=params["n_layers"],
            num_heads=n_heads,
            num_kv_heads=n_kv_heads,
            intermediate_size=intermediate_size,
            norm_eps=params.get("norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_seq_len=max_seq_len,
            tie_word_embeddings=tie,
        )
    except ValueError as exc:
        raise CheckpointError(f"'{params_path}': {exc}") from None

    tensors: list[_MetaTensor] = []
    for meta_name in names:
        mapped = _meta_hf_name(meta_name, shards[0])
        if mapped is None or (tie and meta_name == "output.weight"):
            continue
        hf_name, cat_dim, permute = mapped
        cat_dim = emb_dim if cat_dim == -1 else cat_dim
        shapes = [m[meta_name][0] for m in shard_meta]
        if cat_dim is None or n == 1:
            if any(s != shapes[0] for s in shapes):
                raise CheckpointError(
                    f"'{meta_name}' is replicated in Meta's shards but its shapes differ: {shapes} in '{directory}'"
                )
            shape = shapes[0]
        else:
            shape = list(shapes[0])
            shape[cat_dim] = sum(s[cat_dim] for s in shapes)
            shape = tuple(shape)
        heads = {"q": n_heads, "k": n_kv_heads, None: None}[permute]
        entry = Entry(hf_name, shape, shard_meta[0][meta_name][1], shards[0])
        tensors.append(_MetaTensor(meta_name, entry, None if n == 1 else cat_dim, heads))
    stored = next((t.entry.dtype for t in tensors if t.entry.dtype.is_floating_point), None)
    return _MetaLayout(config, shards, tensors, stored, tuple(notes))


def _meta_tensors_equal(path: Path, a: str, b: str) -> bool:
    state = _torch_load(path)
    try:
        return torch.equal(state[a], state[b])
    finally:
        _release_pages(path, [state[a], state[b]])
        del state


def meta_to_hf_rows(weight: Tensor, num_heads: int) -> Tensor:
    """Permute the rows of a Meta ``wq``/``wk`` from interleaved RoPE pairs to Hugging Face's rotate_half layout.

    Meta rotates channel pairs ``(2i, 2i + 1)`` of each head; ``rotate_half`` rotates ``(i, i + hd/2)``. This is
    the permutation transformers' ``convert_llama_weights_to_hf`` applies.

    Args:
        weight: (num_heads * hd, C) projection weight in Meta's layout.
        num_heads: query heads for ``wq``, key/value heads for ``wk``.

    Returns:
        (num_heads * hd, C), a new tensor in the rotate_half layout.
    """
    rows, cols = weight.shape
    hd = rows // num_heads
    w = weight.view(num_heads, hd // 2, 2, cols)  # (nh, hd/2, 2, C): pair index, then the pair's two channels
    out = torch.empty(num_heads, 2, hd // 2, cols, dtype=weight.dtype, device=weight.device)
    out.copy_(w.transpose(1, 2))  # (nh, 2, hd/2, C): first channels of the pairs, then the second ones
    return out.view(rows, cols)  # (nh * hd, C)


def hf_to_meta_rows(weight: Tensor, num_heads: int) -> Tensor:
    """The inverse of :func:`meta_to_hf_rows`: rotate_half layout back to Meta's interleaved pairs.

    Args:
        weight: (num_heads * hd, C) in Hugging Face's layout.
        num_heads: query heads for ``q_proj``, key/value heads for ``k_proj``.

    Returns:
        (num_heads * hd, C), a new tensor in Meta's layout.
    """
    rows, cols = weight.shape
    hd = rows // num_heads
    w = weight.view(num_heads, 2, hd // 2, cols)  # (nh, 2, hd/2, C): half, then index within the half
    out = torch.empty(num_heads, hd // 2, 2, cols, dtype=weight.dtype, device=weight.device)
    out.copy_(w.transpose(1, 2))  # (nh, hd/2, 2, C): interleaved pairs
    return out.view(rows, cols)  # (nh * hd, C)


def scan_meta(path: Path) -> Scan:
    """A Meta checkpoint's config, info (``tokenizer.model`` beside it or in its parent) and tensor list under
    Hugging Face names, from ``params.json`` and the shards' pickled indices only."""
    directory = _checkpoint_dir(path, META_PARAMS)
    layout = _meta_layout(directory)
    notes = list(layout.notes)
    tokenizer_path = next(
        (p for p in (directory / "tokenizer.model", directory.parent / "tokenizer.model") if p.is_file()),
        None,
    )
    if tokenizer_path is None:
        notes.append(f"no tokenizer.model in '{directory}' or its parent")
    elif tokenizer_path.parent != directory:
        notes.append(f"tokenizer read from '{tokenizer_path}' (Meta's Llama 2 layout)")
    info = PretrainedInfo(
        format="meta",
        path=directory,
        stored_dtype=layout.stored_dtype,
        tokenizer_path=tokenizer_path,
        notes=tuple(notes),
    )
    return Scan(layout.config, info, [t.entry for t in layout.tensors], lambda: _read_meta(layout))


def _read_meta(layout: _MetaLayout) -> Iterator[tuple[Entry, Tensor]]:
    """Yield the Hugging Face tensors of a Meta checkpoint, concatenated over shards and permuted, one at a time.

    The shards stay memory-mapped; each result is a copy in ordinary memory, after which the pages it was read
    from are handed back to the kernel (Linux), so the mapped files do not add a second copy to the peak.
    """
    states = [_torch_load(p) for p in layout.shards]
    for t in layout.tensors:
        parts = [s.pop(t.meta_name) for s in states]
        whole = parts[0] if t.cat_dim is None else torch.cat(parts, dim=t.cat_dim)  # cat_dim None: one shard
        if t.heads is not None:
            out = meta_to_hf_rows(whole, t.heads)
        elif t.cat_dim is None:
            out = whole.clone()  # own the memory: never hand out a view of the mapped file
        else:
            out = whole
        del whole
        for path, part in zip(layout.shards, parts, strict=True):
            _release_pages(path, [part])
        del parts
        yield t.entry, out
    del states


# Linux: madvise(MADV_DONTNEED) on a private file mapping drops its pages from this process (a later access
# re-reads the file); only ranges inside a mapping of the given file are touched, never anonymous memory.
_MADV_DONTNEED = 4


def _release_pages(path: Path, tensors: list[Tensor]) -> None:
    if sys.platform != "linux" or not tensors:
        return
    try:
        target = str(path.resolve())
        maps = []
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip() == target:
                    lo, hi = (int(x, 16) for x in fields[0].split("-"))
                    maps.append((lo, hi))
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        for t in tensors:
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
            lo, hi = start // page * page, -(-end // page) * page
            if any(m_lo <= lo and hi <= m_hi for m_lo, m_hi in maps):
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
    except (OSError, AttributeError, ValueError):
        pass  # an optimisation only
