"""A Hugging Face cache built on disk in huggingface_hub's own layout, for tests that resolve Hub ids with no network:
``models--ORG--NAME/blobs/<sha256>`` (each file's bytes once), ``refs/<branch>`` holding a commit sha and
``snapshots/<commit>/<path>`` symlinks into the blobs (``datasets--ORG--NAME/...`` for a dataset)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def commit_sha(label: str) -> str:
    """A 40-hex commit sha, made from ``label`` (a real cache's are git's)."""
    return hashlib.sha1(label.encode()).hexdigest()


def put_snapshot(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes | Path],
    commit: str,
    *,
    repo_type: str = "model",
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Add the snapshot ``commit`` of ``repo_id`` holding ``files`` (repo path -> bytes, or a file to copy) to the
    cache at ``cache``; each of ``refs`` then points at it. Returns the snapshot directory."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        raw = data.read_bytes() if isinstance(data, Path) else data
        blob = repo / "blobs" / hashlib.sha256(raw).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            blob.write_bytes(raw)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, link.parent))  # relative, as huggingface_hub writes them
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def point_hub_at(cache: Path, monkeypatch) -> Path:
    """Make huggingface_hub read ``cache`` (``HF_HUB_CACHE``) offline (``HF_HUB_OFFLINE=1``): both set in the
    environment and in huggingface_hub's constants, which it read when first imported."""
    from huggingface_hub import constants

    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
