"""Checkpoints and datasets named by a Hugging Face Hub id, fetched through huggingface_hub into its shared cache.

A Hub id is ``ORG/NAME`` or ``ORG/NAME@REVISION`` (a branch, a tag or a commit sha; default ``main``). It is read as
one only where no local path of that spelling exists: a directory ``ORG/NAME`` under the current directory always
wins (:func:`hub_id`). Everything else is huggingface_hub's: its cache (``HF_HOME``, ``HF_HUB_CACHE``; the layout
``models--ORG--NAME/{blobs,refs,snapshots}``), its token (``HF_TOKEN``, ``hf auth login``), its offline switch
(``HF_HUB_OFFLINE=1``: the cache alone, nothing is asked of the network) and its progress bars.

What is fetched is what memfit reads and nothing else:

- a model for training (:func:`resolve_checkpoint`, ``weights=True``): :data:`MODEL_FILES` at the top of the repo
  (``config.json``, ``generation_config.json``, ``model.safetensors`` or ``model.safetensors.index.json`` and its
  ``model-*-of-*.safetensors`` shards, the tokenizer's files and ``chat_template.jinja``); never ``*.bin``,
  ``*.pth``, ``*.gguf`` or the ``original/`` copies;
- a model for ``memfit estimate`` / ``plan`` (``weights=False``): :data:`CONFIG_FILES` only (``config.json`` and the
  index that says which shard holds which tensor), never a weight;
- a dataset (:func:`resolve_dataset`): the ``.parquet``, ``.json`` / ``.jsonl`` (``.gz``, ``.zst``) and ``.txt``
  files a pattern and a split select (:func:`select_files`).

Before anything is downloaded the repo is listed (a dry run: names, sizes, what the cache already holds), the free
disk of the cache is checked against the bytes still to fetch, and every refusal (a gated, missing or private repo,
a revision that does not exist, a Hub that cannot be reached with nothing cached) is one paragraph that names the
repo and what to do (:func:`hub_error`). The snapshot's commit sha is what a run records (:class:`HubSource`), so
that a resume reads the same files even after the branch has moved on.

huggingface_hub is imported on first use, not with memfit: ``HF_HUB_OFFLINE`` and the cache location are read by it
then.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from memfit.errors import CheckpointError, DataError, MemfitError
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.config import TrainConfig

__all__ = [
    "CONFIG_FILES",
    "DATASET_SUFFIXES",
    "HubSource",
    "MODEL_FILES",
    "RECORD_SUFFIXES",
    "TEXT_SUFFIXES",
    "hub_error",
    "hub_id",
    "resolve_checkpoint",
    "resolve_dataset",
    "resolve_run",
    "select_files",
    "snapshot_repo",
]

_HUB_ID = re.compile(
    r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<revision>[A-Za-z0-9][\w./-]*))?"
)

MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*-of-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
)
"""What a training run reads of a Hugging Face model repo (huggingface_hub's ``allow_patterns``), at its top level
only: the config, the safetensors weights (one file, or the index and its shards), the BOS/EOS ids of
``generation_config.json``, the tokenizer (``tokenizer.json`` with ``tokenizer_config.json`` and
``special_tokens_map.json``, or ``tokenizer.model``: SentencePiece or tiktoken) and the chat template."""

CONFIG_FILES = ("config.json", "model.safetensors.index.json")
"""What ``memfit estimate`` and ``plan`` read of a model repo: the architecture, and which shard holds which tensor
(the order a load reads them in). Tensor shapes follow from the config; no weight is fetched."""

_NEVER = ("*/*", "*.bin", "*.pth", "*.pt", "*.gguf", "*.h5", "*.msgpack", "*.onnx")
"""``ignore_patterns`` of a model: anything below the top level (``original/``), and every pickled or foreign
weight format."""

DATASET_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".txt")
"""The files of a dataset repo memfit's readers take (:mod:`memfit.data.sources`, :mod:`memfit.data.records`)."""
TEXT_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".txt")
"""What a text corpus is read from (:data:`memfit.data.sources.SUFFIXES`, spelled out: the data layer is above
this one)."""
RECORD_SUFFIXES = (".json", ".jsonl")
"""What instruction, chat and preference records are read from (:func:`memfit.data.records.read_raw`)."""


@dataclass(frozen=True)
class HubSource:
    """A Hub repo resolved to a snapshot in the local cache: what a run records, and what a resume pins."""

    repo_id: str
    """``ORG/NAME``."""
    repo_type: str
    """``model`` or ``dataset``."""
    revision: str
    """The revision asked for (``main`` unless the id said ``@REVISION``)."""
    commit: str
    """The 40-hex commit sha the revision resolved to: the snapshot read."""
    path: Path
    """The snapshot directory in the cache (``.../snapshots/<commit>``)."""
    files: tuple[str, ...] = ()
    """A dataset's selected files, relative to ``path`` (empty for a model: ``path`` is the checkpoint)."""

    @property
    def pinned(self) -> str:
        """``ORG/NAME@<commit>``: the same files wherever the branch has moved since."""
        return f"{self.repo_id}@{self.commit}"

    def label(self) -> str:
        """``Qwen/Qwen3-0.6B@main``: the id as asked."""
        return f"{self.repo_id}@{self.revision}"

    def describe(self) -> str:
        """``hub Qwen/Qwen3-0.6B@main (commit 0123456789ab) -> '/cache/models--Qwen--Qwen3-0.6B/snapshots/...'``."""
        return f"hub {self.label()} (commit {self.commit[:12]}) -> '{self.path}'"

    def record(self) -> dict[str, Any]:
        """The JSON a run keeps of it (its trainer state's ``hub``)."""
        return {**dataclasses.asdict(self), "path": str(self.path), "files": list(self.files)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> HubSource:
        """:meth:`record` read back."""
        return cls(**{**record, "path": Path(record["path"]), "files": tuple(record.get("files") or ())})


def hub_id(spec: str | None) -> tuple[str, str | None] | None:
    """``(ORG/NAME, revision or None)`` when ``spec`` names a Hub repo, else ``None``.

    ``spec`` is a Hub id when it reads ``ORG/NAME`` or ``ORG/NAME@REVISION`` and no file or directory of that
    spelling exists (relative to the current directory, ``~`` expanded): a local path always wins.
    """
    if spec is None or Path(spec).expanduser().exists():
        return None
    match = _HUB_ID.fullmatch(spec.strip())
    if match is None or ".." in match.group("repo"):
        return None
    return match.group("repo"), match.group("revision")


def snapshot_repo(path: str | Path) -> tuple[str, str, str] | None:
    """``(repo_type, ORG/NAME, commit)`` when ``path`` is (or is inside) a snapshot of huggingface_hub's cache
    (``.../models--ORG--NAME/snapshots/<commit>/...``), else ``None``."""
    parts = Path(path).absolute().parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots":
            kind, _, name = parts[i - 1].partition("--")
            if kind in ("models", "datasets") and "--" in name:
                return kind[:-1], name.replace("--", "/", 1), parts[i + 1]
    return None


# ================================================================================================================
# A run's settings


def resolve_run(
    cfg: TrainConfig,
    *,
    weights: bool = True,
    data: bool = True,
    recorded: dict[str, Any] | None = None,
    say: Callable[[str], None] | None = None,
) -> tuple[TrainConfig, dict[str, HubSource]]:
    """``cfg`` with the Hub ids of ``checkpoint_dir`` and ``data.path`` replaced by what they resolve to in the cache,
    fetched first where missing: the model's snapshot directory; for a text corpus the dataset's snapshot directory
    (its files chosen by ``data.files`` and ``data.split`` when the corpus is read); for records the one ``.json`` /
    ``.jsonl`` file selected. A local path of the same spelling is kept as it is (it wins).

    Args:
        cfg: the run config (``memfit.config.TrainConfig``).
        weights: fetch the model's weights and tokenizer; ``False``: its config alone (estimate, plan).
        data: resolve ``data.path`` too (``False``: estimate and plan read no data).
        recorded: a resumed run's ``hub`` record (:meth:`HubSource.record` by key): a setting naming the same repo
            (at no revision, or the one recorded) reads the recorded commit, wherever the branch has moved since.
        say: where announcements go (a download; a pinned resume) (default: stderr).

    Returns:
        ``(cfg, sources)``: the config with local paths, and the :class:`HubSource` of each resolved key
        (``checkpoint_dir``, ``data.path``).

    Raises:
        CheckpointError, DataError: see :func:`resolve_checkpoint` and :func:`resolve_dataset`; records whose
            selection is not exactly one file.
    """
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    sources: dict[str, HubSource] = {}
    if (parsed := hub_id(cfg.checkpoint_dir)) is not None:
        revision, then = _pinned(recorded, "checkpoint_dir", parsed, say)
        source = resolve_checkpoint(cfg.checkpoint_dir, weights=weights, revision=revision, say=say)
        sources["checkpoint_dir"] = dataclasses.replace(source, revision=then or source.revision)
        cfg = dataclasses.replace(cfg, checkpoint_dir=str(source.path))
    if data and (parsed := hub_id(cfg.data.path)) is not None:
        d = cfg.data
        text = d.format == "text"
        revision, then = _pinned(recorded, "data.path", parsed, say)
        suffixes = TEXT_SUFFIXES if text else RECORD_SUFFIXES
        try:
            source = resolve_dataset(
                d.path, patterns=d.files, split=d.split, suffixes=suffixes, revision=revision, say=say
            )
        except DataError as exc:
            hint = (
                ""
                if text
                else f"; data.format={d.format} reads records from .json / .jsonl (parquet: text only)"
            )
            raise DataError(f"{exc}{hint}") from None
        if not text and len(source.files) != 1:
            shown = ", ".join(source.files[:5]) + (" ..." if len(source.files) > 5 else "")
            raise DataError(
                f"data.path '{d.path}': data.format={d.format} reads one .json or .jsonl file of records, and "
                f"{len(source.files)} are selected ({shown}); choose one with data.files (e.g. "
                f"data.files='{source.files[0]}') or data.split"
            )
        sources["data.path"] = dataclasses.replace(source, revision=then or source.revision)
        path = source.path if text else source.path / source.files[0]
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, path=str(path)))
    return cfg, sources


def _pinned(
    recorded: dict[str, Any] | None, key: str, parsed: tuple[str, str | None], say: Callable[[str], None]
) -> tuple[str | None, str | None]:
    """``(revision to read, revision to record)``: a resumed run's recorded commit where ``key`` names its repo at no
    revision or at the one it recorded; ``(None, None)`` otherwise (what the setting says)."""
    then = (recorded or {}).get(key)
    repo_id, asked = parsed
    if not then or then.get("repo_id") != repo_id or asked not in (None, then["revision"], then["commit"]):
        return None, None
    say(
        f"{key}: resuming on hub {repo_id} at commit {then['commit'][:12]}, the commit the run started from "
        f"({then['revision']} may have moved since)"
    )
    return then["commit"], then["revision"]


# ================================================================================================================
# Models


def resolve_checkpoint(
    spec: str,
    *,
    weights: bool = True,
    revision: str | None = None,
    key: str = "checkpoint_dir",
    say: Callable[[str], None] | None = None,
) -> HubSource:
    """The snapshot directory of the Hub model ``spec`` (``ORG/NAME[@REVISION]``), fetched into the cache first where
    it is not there yet.

    Args:
        spec: the Hub id (see :func:`hub_id`).
        weights: fetch what a run reads (:data:`MODEL_FILES`); ``False``: what an estimate reads
            (:data:`CONFIG_FILES`), never a weight.
        revision: read this revision instead of the one ``spec`` names (a resume's recorded commit).
        key: the setting that named it, for messages.
        say: where the line announcing a download goes (default: stderr).

    Returns:
        The :class:`HubSource`; its ``path`` holds ``config.json`` (and, with ``weights``, the safetensors).

    Raises:
        CheckpointError: one paragraph naming the repo and what to do: the repo is gated, missing or private, the
            revision does not exist, the Hub cannot be reached (or ``HF_HUB_OFFLINE=1``) and the cache lacks it,
            the repo holds no safetensors weights (pickled ``*.bin`` are never read), or the cache's disk lacks the
            space the files need.
    """
    repo_id, asked = _split(spec, key)
    revision = revision or asked or "main"
    allow = list(MODEL_FILES if weights else CONFIG_FILES)
    fetch = _Fetch(repo_id, "model", revision, key, CheckpointError, say)
    listed = fetch.listing(allow, _NEVER)
    if listed is not None:
        names = {info.filename for info in listed}
        if "config.json" not in names:
            raise CheckpointError(
                f"{key} '{spec}': Hub model {repo_id}@{revision} has no config.json at its top level, so it is not "
                f"a Hugging Face checkpoint memfit reads (its files: https://huggingface.co/{repo_id}/tree/{revision})"
            )
        if weights and not names & {"model.safetensors", "model.safetensors.index.json"}:
            raise CheckpointError(
                f"{key} '{spec}': Hub model {repo_id}@{revision} has no model.safetensors (or its index) at its top "
                f"level; memfit reads safetensors and never unpickles *.bin / *.pth files. Nothing was downloaded"
            )
    path = fetch.download(listed, allow, _NEVER)
    if weights:
        _check_weights(path, repo_id, fetch.commit or path.name, key)
    return HubSource(repo_id, "model", revision, fetch.commit or path.name, path)


def _check_weights(path: Path, repo_id: str, commit: str, key: str) -> None:
    """The snapshot holds the weights (a cache filled by ``memfit estimate`` holds only the config).

    Raises:
        CheckpointError: naming what is missing and how to fetch it.
    """
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(
                f"{key}: '{index}' is not a safetensors index ({exc}); is it truncated?"
            ) from None
        missing += [s for s in shards if not (path / s).is_file()]
    elif not (path / "model.safetensors").is_file():
        missing.append("model.safetensors (or model.safetensors.index.json and its shards)")
    if missing:
        raise CheckpointError(
            f"{key}: the cached snapshot of Hub model {repo_id} at commit {commit[:12]} ('{path}') lacks "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (a cache filled by memfit estimate or plan "
            f"holds the config alone), and the Hub was not asked (HF_HUB_OFFLINE=1, or it could not be reached): "
            f"run once with network access to fetch the weights, or point HF_HUB_CACHE (or HF_HOME) at a cache that "
            f"holds them"
        )


# ================================================================================================================
# Datasets


def select_files(
    paths: Iterable[str],
    patterns: str | list[str] | None = None,
    split: str | None = None,
    suffixes: tuple[str, ...] = DATASET_SUFFIXES,
) -> list[str]:
    """The files of a dataset a run reads, sorted.

    Args:
        paths: the repo's (or directory's) files, relative, with ``/`` between parts.
        patterns: huggingface_hub's ``allow_patterns`` (fnmatch: ``*`` also matches ``/``), e.g.
            ``data/train-*.parquet``; default every file of a readable suffix.
        split: keep the files whose path names this split as a whole word between ``/``, ``-``, ``_`` or ``.``
            (``train`` selects ``train.jsonl``, ``data/train-00000-of-00002.parquet``, ``train/part0.parquet``;
            not ``pretrain.txt``).
        suffixes: the readable suffixes.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    word = None if split is None else re.compile(rf"(^|[/_.-]){re.escape(split)}([/_.-]|$)")
    out = []
    for p in paths:
        if not p.lower().endswith(suffixes) or any(part.startswith(".") for part in PurePosixPath(p).parts):
            continue
        if patterns and not any(fnmatch.fnmatchcase(p, pat) for pat in patterns):
            continue
        if word is not None and not word.search(p):
            continue
        out.append(p)
    return sorted(out)


def resolve_dataset(
    spec: str,
    *,
    patterns: str | list[str] | None = None,
    split: str | None = None,
    suffixes: tuple[str, ...] = DATASET_SUFFIXES,
    revision: str | None = None,
    key: str = "data.path",
    say: Callable[[str], None] | None = None,
) -> HubSource:
    """The snapshot of the Hub dataset ``spec`` (``ORG/NAME[@REVISION]``, ``repo_type="dataset"``) holding the files
    :func:`select_files` picks, fetched into the cache first where it is not there yet.

    Args:
        spec: the Hub id (see :func:`hub_id`).
        patterns, split, suffixes: which files (see :func:`select_files`).
        revision: read this revision instead of the one ``spec`` names (a resume's recorded commit).
        key: the setting that named it, for messages.
        say: where the line announcing a download goes (default: stderr).

    Returns:
        The :class:`HubSource`; ``files`` are the selected files under ``path``.

    Raises:
        DataError: as :func:`resolve_checkpoint` raises CheckpointError, and when no file is selected.
    """
    repo_id, asked = _split(spec, key)
    revision = revision or asked or "main"
    allow = list(patterns) if isinstance(patterns, list) else [patterns] if patterns else None
    if allow is None:
        allow = [f"*{s}" for s in suffixes]
    fetch = _Fetch(repo_id, "dataset", revision, key, DataError, say)
    listed = fetch.listing(allow, None)
    chosen = None
    if listed is not None:
        chosen = select_files([i.filename for i in listed], patterns, split, suffixes)
        listed = [i for i in listed if i.filename in set(chosen)]
        _none_selected(chosen, spec, patterns, split, suffixes, key)
        allow = [_literal(name) for name in chosen]
    path = fetch.download(listed, allow, None)
    if chosen is None:  # from the cache alone: what its snapshot holds
        present = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
        chosen = select_files(present, patterns, split, suffixes)
        _none_selected(chosen, spec, patterns, split, suffixes, key, cached=path)
    return HubSource(repo_id, "dataset", revision, fetch.commit or path.name, path, tuple(chosen))


def _none_selected(chosen, spec, patterns, split, suffixes, key, cached: Path | None = None) -> None:
    if chosen:
        return
    where = f"the cached snapshot '{cached}'" if cached is not None else "the Hub repo"
    picked = " and ".join(
        s for s in (f"pattern {patterns!r}" if patterns else "", f"split {split!r}" if split else "") if s
    )
    raise DataError(
        f"{key} '{spec}': {where} holds no {', '.join(suffixes)} file"
        + (f" matching {picked}" if picked else "")
        + "; check the data.files pattern (fnmatch over the repo's paths, e.g. 'data/train-*.parquet') or data.split"
    )


def _literal(name: str) -> str:
    """An ``allow_patterns`` entry matching exactly ``name`` (fnmatch's ``*?[`` escaped)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


# ================================================================================================================
# Fetching and its errors


def _split(spec: str, key: str) -> tuple[str, str | None]:
    parsed = hub_id(spec)
    if parsed is None:
        raise ValueError(f"{key} {spec!r} is not a Hub id (ORG/NAME[@REVISION]) or is a local path")
    return parsed


class _Fetch:
    """One repo at one revision: listed (a dry run), then downloaded, or read from the cache alone."""

    def __init__(self, repo_id, repo_type, revision, key, error: type[MemfitError], say) -> None:
        self.repo_id, self.repo_type, self.revision, self.key, self.error = (
            repo_id,
            repo_type,
            revision,
            key,
            error,
        )
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.commit: str | None = None
        self.unreachable: BaseException | None = None

    def listing(self, allow: list[str] | None, ignore: tuple[str, ...] | None) -> list[Any] | None:
        """The files the download would fetch (huggingface_hub's dry run: names, sizes, cached or not); ``None``
        when the Hub is not asked (``HF_HUB_OFFLINE=1``) or cannot be reached: the cache alone decides then."""
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import DryRunError

        if constants.is_offline_mode():
            return None
        try:
            listed = snapshot_download(
                self.repo_id,
                repo_type=self.repo_type,
                revision=self.revision,
                allow_patterns=allow,
                ignore_patterns=list(ignore) if ignore else None,
                dry_run=True,
            )
        except DryRunError as exc:  # the repo could not be listed: why is its cause
            cause = exc.__cause__ or exc
            if _is_refusal(cause):
                raise self.refused(cause) from None
            self.unreachable = cause
            return None
        except Exception as exc:
            if _is_refusal(exc):
                raise self.refused(exc) from None
            raise
        if listed:
            self.commit = listed[0].commit_hash
        return listed

    def download(
        self, listed: list[Any] | None, allow: list[str] | None, ignore: tuple[str, ...] | None
    ) -> Path:
        """Fetch what ``listed`` says is missing (after checking the disk), or find the snapshot in the cache."""
        from huggingface_hub import constants, snapshot_download

        cache = Path(constants.HF_HUB_CACHE)
        if listed is not None:
            missing = [i for i in listed if i.will_download]
            need = sum(i.file_size or 0 for i in missing)
            if missing:
                free = _free_bytes(cache)
                if need > free:
                    raise self.error(
                        f"{self.key}: fetching {len(missing)} file(s) of Hub {self.repo_type} {self.repo_id}@"
                        f"{self.revision} needs {format_bytes(need)}, but the cache's disk ('{cache}') has "
                        f"{format_bytes(free)} free; free some space, or point HF_HUB_CACHE (or HF_HOME) at a larger "
                        f"disk. Nothing was downloaded"
                    )
                self.say(
                    f"fetching {len(missing)} file(s), {format_bytes(need)}, of Hub {self.repo_type} "
                    f"{self.repo_id}@{self.revision} (commit {(self.commit or '?')[:12]}) into '{cache}'"
                )
        try:
            path = snapshot_download(
                self.repo_id,
                repo_type=self.repo_type,
                revision=self.commit or self.revision,
                allow_patterns=allow,
                ignore_patterns=list(ignore) if ignore else None,
                local_files_only=listed is None,
            )
        except Exception as exc:
            if _is_refusal(exc) or _is_not_cached(exc):
                raise self.refused(exc) from None
            raise
        return Path(path)

    def refused(self, exc: BaseException) -> MemfitError:
        """One paragraph for what huggingface_hub raised (see :func:`hub_error`)."""
        return hub_error(
            exc, self.repo_id, self.revision, repo_type=self.repo_type, key=self.key, error=self.error,
            unreachable=self.unreachable,
        )  # fmt: skip


def _free_bytes(cache: Path) -> int:
    """Free bytes of the disk that holds (or will hold) ``cache``."""
    probe = cache
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _is_refusal(exc: BaseException) -> bool:
    from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
        return True
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, FileNotFoundError):
        return True  # RemoteEntryNotFoundError; the local one is _is_not_cached
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None) in (401, 403)


def _is_not_cached(exc: BaseException) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError

    return isinstance(exc, LocalEntryNotFoundError)


def hub_error(
    exc: BaseException,
    repo_id: str,
    revision: str,
    *,
    repo_type: str = "model",
    key: str = "checkpoint_dir",
    error: type[MemfitError] = CheckpointError,
    unreachable: BaseException | None = None,
) -> MemfitError:
    """The one-paragraph error for what huggingface_hub raised about a repo: what happened, which repo, what to do.

    Args:
        exc: huggingface_hub's exception (``GatedRepoError``, ``RepositoryNotFoundError``, ``RevisionNotFoundError``,
            ``EntryNotFoundError``, ``LocalEntryNotFoundError`` / ``IncompleteSnapshotError``, an HTTP 401 / 403).
        repo_id, revision, repo_type: the repo asked for.
        key: the setting that named it.
        error: the class to return (``CheckpointError`` for a model, ``DataError`` for a dataset).
        unreachable: why the Hub could not be asked, where it could not (a connection error).

    Returns:
        An ``error`` to raise (``from None``: the message says it all).
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    url = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
    repo = f"Hub {repo_type} {repo_id}"
    token = "give your token (HF_TOKEN=hf_... in the environment, or `hf auth login`)"
    offline = "or, where a filled Hugging Face cache holds it, run with HF_HUB_OFFLINE=1"
    nothing = "Nothing was downloaded or allocated"
    if isinstance(exc, GatedRepoError):
        why = (
            f"{repo} is gated and this machine has no access to it: accept its conditions at {url} with your "
            f"account, then {token}; {offline}"
        )
    elif isinstance(exc, RevisionNotFoundError):
        why = (
            f"{repo} has no revision '{revision}' (a branch, a tag or a commit sha; see {url}/tree/main); fix the "
            f"part after '@'"
        )
    elif isinstance(exc, RepositoryNotFoundError) or getattr(
        getattr(exc, "response", None), "status_code", 0
    ) in (
        401,
        403,
    ):
        why = (
            f"'{repo_id}' is neither a local path nor a {repo_type} repository the Hub shows this machine (not "
            f"found, or private): check the spelling (ORG/NAME, or a path that exists); a private repository needs "
            f"your token (HF_TOKEN=hf_... or `hf auth login`); {offline}"
        )
    elif isinstance(exc, FileNotFoundError):
        # LocalEntryNotFoundError, IncompleteSnapshotError: not in the cache
        cause = (
            "HF_HUB_OFFLINE=1 is set"
            if constants.is_offline_mode()
            else f"the Hub could not be reached ({type(unreachable).__name__}: {unreachable})"
            if unreachable is not None
            else "the Hub was not asked"
        )
        why = (
            f"no local path of that name exists, and {repo}@{revision} is not in the Hugging Face cache "
            f"('{constants.HF_HUB_CACHE}'), or not whole, and {cause}: run once with network access to fetch it "
            f"(HF_HUB_OFFLINE unset), or point HF_HUB_CACHE (or HF_HOME) at a cache that holds it"
        )
    else:  # a remote file that is not there
        why = f"{repo}@{revision} lacks a file memfit reads ({exc}); see {url}/tree/{revision}"
    return error(f"{key} '{repo_id}{'@' + revision if revision != 'main' else ''}': {why}. {nothing}")
