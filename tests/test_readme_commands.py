"""Every command the README and docs/cli.md show runs as written (issue 53): each ``memfit`` line of their code
blocks, in the order a reader meets them, in a scratch directory that sees the repo's ``src``, ``tests`` and
``configs`` by the same relative paths. The one change: a training command gets ``max_steps=2`` after its own
arguments (the last value wins), so that the main job and the fine-tunes are a few steps, not minutes. Lines with
placeholders (``DIR``, ``ORG/NAME``, ``[key=value ...]``) are syntax, not commands, and are left out; the Hub
example, with no network here, must fail with the one paragraph that names the repo and what to do."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "cli.md")
TRAINING = ("pretrain", "finetune")
_COMMAND = re.compile(r"(\.venv/bin/)?memfit (prepare|pretrain|finetune|generate|export|estimate|plan)( |$)")
"""A command line (not the output a block shows, ``memfit pretrain: model ...``)."""
_PLACEHOLDER = re.compile(r"\b(DIR|FILE|PATH|HF_DIR|ORG/NAME|PRESET|TEXT|N|B|T|S|K)\b|\[|\.\.\.")


def documented_commands(path: Path) -> list[list[str]]:
    """The ``memfit`` commands of ``path``'s fenced code blocks, continuation lines joined and comments cut, as
    argument lists after ``memfit``; those with placeholders left out."""
    commands, block, line_so_far = [], False, ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        if raw.startswith("```"):
            block, line_so_far = not block, ""
            continue
        if not block:
            continue
        line = line_so_far + raw.strip()
        if line.endswith("\\"):
            line_so_far = line[:-1] + " "
            continue
        line_so_far = ""
        line = line.split(" #", 1)[0].strip()
        line = line.rsplit("&& ", 1)[-1]  # the set-up line ends in the main job
        if not _COMMAND.match(line) or _PLACEHOLDER.search(line):
            continue
        commands.append(shlex.split(line)[1:])
    return commands


def test_the_documents_show_the_commands_this_test_runs():
    readme, cli = (documented_commands(p) for p in DOCS)
    assert [c[0] for c in readme] == [
        "pretrain", "generate", "prepare", "pretrain", "export", "finetune", "finetune", "finetune", "generate",
        "estimate", "plan",
    ]  # fmt: skip
    assert ["plan", "model=llama3-8b", "budget=24GiB"] == readme[-1][:3]
    assert [c[0] for c in cli] == ["export", "finetune", "generate", "estimate", "estimate", "estimate"]


@pytest.mark.slow
def test_every_documented_command_runs_as_written(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hf-cache")}
    for doc in DOCS:  # each in a directory of its own; docs/cli.md's start from the README's main job
        cwd = tmp_path / doc.stem
        cwd.mkdir()
        for name in ("src", "tests", "configs"):
            (cwd / name).symlink_to(ROOT / name)
        if doc != DOCS[0]:
            shutil.copytree(tmp_path / DOCS[0].stem / "out" / "shakespeare", cwd / "out" / "shakespeare")
        for args in documented_commands(doc):
            if args[0] in TRAINING:
                args = [*args, "max_steps=2"]
            proc = subprocess.run(
                [sys.executable, "-m", "memfit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                timeout=600,
            )  # fmt: skip
            shown = f"{doc.name}: memfit {shlex.join(args)}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            if any(
                a.startswith("checkpoint_dir=Qwen/") for a in args
            ):  # the Hub, offline: refused, with the fix
                assert proc.returncode != 0, shown
                assert "Qwen/Qwen3-0.6B" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr, shown
                continue
            assert proc.returncode == 0, shown
        assert (cwd / "out" / "shakespeare_hf" / "config.json").is_file()
    assert (tmp_path / "README" / "plan8b.yaml").is_file()
