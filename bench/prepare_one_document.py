"""``memfit prepare`` on one huge document: the peak memory over the process's baseline, as a multiple of the
document, for a ~200 MB and a ~1 GB single-record JSON Lines file, before (``--before``: another checkout's
``src``) and after (this tree).

The record is generated here, in a temporary directory that is deleted afterwards (never committed): Tiny
Shakespeare repeated to the size, written as one JSON line ``{"text": ..., "meta": ...}`` by ``json.dumps`` (its
newlines become ``\\n`` escapes, as in scraped corpora). The tokenizer is GPT-2's byte-level BPE
(``tests/assets``, encoded by tiktoken: fast enough for a GB on a busy machine) given to every case, so that no
BPE is trained on the document; ``--tokenizer`` names another. Each case is a fresh ``memfit prepare --workers
1`` process; its peak is the largest resident set of its process tree (sampled every 0.1 s,
:func:`prepare_throughput.run_measured`), and its baseline the peak of the same command on a one-line record
(imports, the tokenizer, the manifest). The old code runs under an address-space cap (``--cap-gib``), so that a
case that does not fit fails there instead of taking the machine, and is reported as failed.

Memory numbers are valid on a busy machine; the seconds are not (other processes share its cores).

Reproduce (~20 min on 2 busy CPU cores; ~1.3 GB of temporary disk)::

    git worktree add /tmp/memfit-main main   # the code to compare with
    .venv/bin/python bench/prepare_one_document.py --before /tmp/memfit-main/src

It rewrites the section between the ``one-document`` markers of ``docs/data.md`` (``--out -`` only prints).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from docs_section import write_section
from prepare_throughput import run_measured

from memfit.data.sources import default_corpus_path
from memfit.units import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]


def make_record(path: Path, chars: int) -> int:
    """One JSON line whose ``text`` is Tiny Shakespeare repeated to ``chars`` characters; returns its bytes."""
    corpus = default_corpus_path().read_text(encoding="utf-8")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write('{"meta": {"source": "tinyshakespeare, repeated"}, "text": "')
        left = chars
        while left > 0:
            part = corpus[:left]
            fh.write(json.dumps(part)[1:-1])
            left -= len(part)
        fh.write('"}\n')
    return path.stat().st_size


def prepare_cmd(src: Path, record: Path, out: Path, tokenizer: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "memfit", "prepare", "--out", str(out), "--source", f"one={record}",
           "--tokenizer", str(tokenizer), "--workers", "1", "--quiet", "val_fraction=0"]  # fmt: skip
    return cmd, {**os.environ, "PYTHONPATH": str(src), "TOKENIZERS_PARALLELISM": "false"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="the src directory of the code to compare with")
    parser.add_argument("--sizes-mb", default="200,1000", help="document sizes (characters, millions)")
    parser.add_argument(
        "--cap-gib", type=float, default=8.0, help="address-space cap of the old code's cases"
    )
    parser.add_argument("--tokenizer", default=str(ROOT / "tests" / "assets" / "gpt2_encoder.json"))
    parser.add_argument("--out", default=str(ROOT / "docs" / "data.md"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="memfit_one_document_"))
    try:
        tokenizer = Path(args.tokenizer)
        tiny = work / "tiny.jsonl"
        tiny.write_text(json.dumps({"text": "To be, or not to be."}) + "\n", encoding="utf-8")
        sides = [("after", ROOT / "src")] + ([("before", Path(args.before))] if args.before else [])
        baseline = {}
        for side, src in sides:
            cmd, env = prepare_cmd(src, tiny, work / f"tiny_{side}", tokenizer)
            baseline[side] = run_measured(cmd, env)["peak_rss"]
        rows = []
        for millions in (int(x) for x in args.sizes_mb.split(",")):
            record = work / f"one_{millions}M.jsonl"
            size = make_record(record, millions * 1_000_000)
            for side, src in sides:
                out = work / f"out_{side}_{millions}"
                cmd, env = prepare_cmd(src, record, out, tokenizer)
                capped = side == "before"
                r = run_measured(
                    cmd, env, limit=int(args.cap_gib * GIB) if capped else None, check=not capped
                )
                tokens = json.loads((out / "manifest.json").read_text())["tokens"] if r["ok"] else None
                above = r["peak_rss"] - baseline[side]
                rows.append((side, size, tokens, r["seconds"], r["peak_rss"], above, r["ok"]))
                print(rows[-1], flush=True)
                shutil.rmtree(out, ignore_errors=True)
            record.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    table = [
        "| code | document (MB) | tokens | peak RSS (MiB) | above baseline (MiB) | above baseline / document "
        "| seconds |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for side, size, tokens, seconds, peak, above, ok in rows:
        if not ok:
            table.append(
                f"| {side} | {size / 1e6:,.0f} | failed at the {args.cap_gib:g} GiB address-space cap | "
                f"{peak / MIB:,.0f} | {above / MIB:,.0f} | > {args.cap_gib * GIB / size:.1f} | {seconds:.0f} |"
            )
            continue
        table.append(
            f"| {side} | {size / 1e6:,.0f} | {tokens:,} | {peak / MIB:,.0f} | {above / MIB:,.1f} | "
            f"{above / size:.3f} | {seconds:.0f} |"
        )
    base = ", ".join(f"{side} {value / MIB:,.0f} MiB" for side, value in baseline.items())
    section = "\n".join(
        [
            "One JSON Lines record holding one document (Tiny Shakespeare repeated; `json.dumps`, so its newlines "
            "are `\\n` escapes), prepared by `memfit prepare --workers 1` with GPT-2's BPE (tiktoken). "
            f"Baseline: the peak of the same command on a one-line record ({base}). Peak RSS is the largest "
            "resident set of the process tree; the memory numbers hold on a busy machine, the seconds do not "
            "(2 CPU cores shared with other work). Reproduce: "
            "`.venv/bin/python bench/prepare_one_document.py --before OTHER_CHECKOUT/src`.",
            "",
            *table,
        ]
    )
    print(section)
    if args.out != "-":
        write_section(Path(args.out), "one-document", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
