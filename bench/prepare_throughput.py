"""``memfit prepare`` on a generated corpus of >= 1 GiB: throughput and peak memory, side by side with a
nanoGPT-style prepare (the whole corpus in memory, one process) and the tokenizer's own batch encoder.

The corpus is generated here (never committed): JSON Lines files of documents of 1-24 KiB, each made of random
runs of real lines (Tiny Shakespeare, and the Python sources of the standard library this Python ships), so that
the BPE sees prose and code. The tokenizer is a byte-level BPE of 32,000 ids trained once on the first 32 MiB
(``tokenizers``), saved, and given to every case. Each case runs in a fresh process; its peak memory is the
largest resident set of its whole process tree (sampled every 0.1 s), and it is timed from start to exit
(imports, worker start-up and the manifest included).

Cases:

- ``tokenizer batch encode``: ``Tokenizer.encode_batch`` of 1 MiB batches of documents, on one core
  (``TOKENIZERS_PARALLELISM=false``): the ceiling of one worker.
- ``memfit prepare, N workers``: the CLI, ``--workers N`` (1 and 2), on the 1 GiB corpus; the two outputs are
  compared byte for byte.
- ``nanoGPT-style``: read each file whole, decode its records, encode them all with ``encode_batch``, concatenate
  into one uint16 array, write ``train.bin`` (nanoGPT's ``data/shakespeare/prepare.py`` pattern with the same
  tokenizer; no validation split): on one of the 8 files, and on the whole corpus under a 16 GiB address-space cap
  (uncapped it took the 24 GiB machine's memory and was killed by the kernel's OOM killer).
- ``memfit prepare, 2 workers, 4x``: the same on a corpus 4x as large: the peak must not grow with the corpus.

Reproduce (about 15 minutes on 2 CPU cores; ~6 GiB of temporary disk)::

    .venv/bin/python bench/prepare_throughput.py

It rewrites the section between the ``prepare`` markers of ``docs/benchmarks.md`` (``--out -`` only prints).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import psutil
from docs_section import write_section

from memfit.data.sources import default_corpus_path
from memfit.units import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
FILES = 8


def make_corpus(directory: Path, gib: float, seed: int = 0) -> int:
    """JSON Lines files totalling ``gib`` GiB of records; returns the bytes written."""
    directory.mkdir(parents=True, exist_ok=True)
    lines = default_corpus_path().read_text(encoding="utf-8").splitlines(keepends=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py"))[:200]:
        lines += path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    rng = random.Random(seed)
    target = int(gib * GIB / FILES)
    total = 0
    for i in range(FILES):
        written = 0
        with open(directory / f"part_{i:03d}.jsonl", "w", encoding="utf-8") as fh:
            while written < target:
                size = rng.randint(1024, 24 * 1024)
                doc, chars = [], 0
                while chars < size:
                    start = rng.randrange(len(lines) - 64)
                    run = lines[start : start + rng.randint(4, 64)]
                    doc += run
                    chars += sum(len(x) for x in run)
                record = json.dumps({"text": "".join(doc), "meta": {"n": written}}) + "\n"
                fh.write(record)
                written += len(record.encode("utf-8"))
        total += written
    return total


def run_measured(
    cmd: list[str], env: dict[str, str] | None = None, limit: int | None = None, check: bool = True
) -> dict[str, float]:
    """Run ``cmd``; its wall time and the peak resident memory of its process tree (bytes). ``limit`` caps the
    address space of the process (bytes), so a run that does not fit fails instead of taking the machine."""

    def cap() -> None:
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.perf_counter()
    proc = psutil.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=cap
    )
    peak = 0
    while proc.poll() is None:
        try:
            tree = [proc, *proc.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.1)
    output = proc.stdout.read()
    if proc.returncode != 0 and check:
        raise RuntimeError(f"{cmd} failed:\n{output[-4000:]}")
    ok = proc.returncode == 0
    return {"seconds": time.perf_counter() - start, "peak_rss": peak, "output": output, "ok": ok}


def digest(directory: Path) -> str:
    """A hash of every dataset file (logs and locks left out)."""
    h = hashlib.sha256()
    for p in sorted(directory.rglob("*")):
        if p.is_file() and ".prepare" not in p.parts and not p.name.endswith(".lock"):
            h.update(str(p.relative_to(directory)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def child_encode(corpus: str, tokenizer: str, limit: int) -> None:
    """The tokenizer's own batch encoder on one core, over the first ``limit`` bytes of documents."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from memfit.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    docs, size = [], 0
    for path in sorted(Path(corpus).glob("*.jsonl")):
        for line in open(path, encoding="utf-8"):
            docs.append(json.loads(line)["text"])
            size += len(line)
            if size >= limit:
                break
        if size >= limit:
            break
    start, tokens, batch, chars = time.perf_counter(), 0, [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= MIB:
            tokens += sum(len(x) for x in tok.encode_batch(batch))
            batch, chars = [], 0
    tokens += sum(len(x) for x in tok.encode_batch(batch))
    print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - start, "bytes": size}))


def child_nanogpt(corpus: str, tokenizer: str, out: str, files: int) -> None:
    """nanoGPT-style: the whole corpus in memory, one process, one uint16 array."""
    import numpy as np

    from memfit.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    docs = []
    for path in sorted(Path(corpus).glob("*.jsonl"))[:files]:
        text = path.read_text(encoding="utf-8")  # the whole file
        docs += [json.loads(line)["text"] for line in text.splitlines()]
        del text
    ids = tok.encode_batch(docs)
    bos, eos = tok.bos_id, tok.eos_id
    arr = np.concatenate([np.array([bos, *x, eos], dtype=np.uint16) for x in ids])
    arr.tofile(out)
    print(json.dumps({"tokens": int(arr.size)}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the corpus (GiB)")
    parser.add_argument(
        "--workdir", default=None, help="keep the corpora here (default: a temporary directory)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--_encode", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--_nanogpt", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._encode:
        child_encode(args._encode[0], args._encode[1], int(args._encode[2]))
        return 0
    if args._nanogpt:
        child_nanogpt(*args._nanogpt[:3], int(args._nanogpt[3]))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="memfit_prepare_bench_"))
    small, big = work / "corpus_1x", work / "corpus_4x"
    sizes = {}
    for directory, gib in ((small, args.gib), (big, 4 * args.gib)):
        if not directory.exists():
            print(f"generating {gib:g} GiB in {directory}", flush=True)
        sizes[directory] = (
            make_corpus(directory, gib)
            if not directory.exists()
            else sum(p.stat().st_size for p in directory.glob("*.jsonl"))
        )
    tokenizer = work / "tokenizer"
    if not tokenizer.exists():
        from memfit.tokenizer import train_bpe

        sample, size = [], 0
        for line in open(small / "part_000.jsonl", encoding="utf-8"):
            sample.append(json.loads(line)["text"])
            size += len(line)
            if size >= 32 * MIB:
                break
        train_bpe(sample, 32000).save(tokenizer)
    python = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    rows = []

    enc = run_measured([python, __file__, "--_encode", str(small), str(tokenizer), str(256 * MIB)], env)
    e = json.loads(enc["output"].strip().splitlines()[-1])
    encode_rate = e["tokens"] / e["seconds"]
    rows.append(
        (
            "tokenizer batch encode, 1 core (256 MiB)",
            1,
            e["bytes"],
            e["tokens"],
            e["seconds"],
            enc["peak_rss"],
        )
    )

    outputs = {}
    for workers in (1, 2):
        out = work / f"prepared_{workers}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        cmd = [python, "-m", "memfit", "prepare", "--out", str(out), "--source", f"web={small}", "--tokenizer",
               str(tokenizer), "--workers", str(workers), "--quiet", "val_fraction=0.001"]  # fmt: skip
        r = run_measured(cmd, env)
        tokens = json.loads((out / "manifest.json").read_text())["tokens"]
        # one worker encodes with the tokenizer's own 2 threads; two workers with one thread each
        rows.append((f"memfit prepare, {workers} worker{'s' * (workers > 1)}", 2, sizes[small], tokens,
                     r["seconds"], r["peak_rss"]))  # fmt: skip
        outputs[workers] = out
    identical = digest(outputs[1]) == digest(outputs[2])

    nano = work / "nanogpt_train.bin"
    one_file = (small / "part_000.jsonl").stat().st_size
    r = run_measured([python, __file__, "--_nanogpt", str(small), str(tokenizer), str(nano), "1"], env)
    tokens = json.loads(r["output"].strip().splitlines()[-1])["tokens"]
    name = "nanoGPT-style (whole corpus in memory), 1 of the 8 files"
    rows.append((name, 2, one_file, tokens, r["seconds"], r["peak_rss"]))  # the tokenizer's 2 threads
    cmd = [python, __file__, "--_nanogpt", str(small), str(tokenizer), str(nano), str(FILES)]
    r = run_measured(cmd, env, limit=16 * GIB, check=False)
    nano_full = "fitted" if r["ok"] else f"failed at the 16 GiB address-space cap after {r['seconds']:.0f} s"
    rows.append(("nanoGPT-style, the whole 1x corpus", 2, sizes[small], 0, r["seconds"], r["peak_rss"]))

    out = work / "prepared_4x"
    subprocess.run(["rm", "-rf", str(out)], check=True)
    cmd = [python, "-m", "memfit", "prepare", "--out", str(out), "--source", f"web={big}", "--tokenizer",
           str(tokenizer), "--workers", "2", "--quiet", "val_fraction=0.001"]  # fmt: skip
    r = run_measured(cmd, env)
    tokens = json.loads((out / "manifest.json").read_text())["tokens"]
    rows.append(
        ("memfit prepare, 2 workers, 4x the corpus", 2, sizes[big], tokens, r["seconds"], r["peak_rss"])
    )

    peak_1x = next(r[5] for r in rows if r[0] == "memfit prepare, 2 workers")
    table = [
        "| case | cores busy | corpus (GiB) | tokens | seconds | tokens/s | tokens/s per core | vs batch encode, "
        "per core | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, procs, nbytes, tokens, seconds, peak in rows:
        if not tokens:
            table.append(
                f"| {name} | {procs} | {nbytes / GIB:.2f} | {nano_full} | | | | | {peak / MIB:,.0f} |"
            )
            continue
        rate = tokens / seconds
        table.append(
            f"| {name} | {procs} | {nbytes / GIB:.2f} | {tokens:,} | {seconds:.1f} | {rate:,.0f} | "
            f"{rate / procs:,.0f} | {rate / procs / encode_rate:.2f} | {peak / MIB:,.0f} |"
        )
    section = "\n".join(
        [
            "## Preparing a corpus: `memfit prepare` vs a nanoGPT-style prepare",
            "",
            f"Generated JSON Lines corpus ({FILES} files; documents of 1-24 KiB of real prose and code lines), a "
            "byte-level BPE of 32,000 ids, every case a fresh process timed from start to exit; peak RSS is the "
            "largest resident set of the whole process tree (workers included). 2 CPU cores. "
            "Reproduce: `.venv/bin/python bench/prepare_throughput.py` (module docstring: what each case does).",
            "",
            *table,
            "",
            f"- 1 and 2 workers write identical bytes: **{identical}**.",
            f"- Peak RSS of 4x the corpus over 1x (2 workers): **{rows[-1][5] / peak_1x:.2f}**.",
        ]
    )
    print(section)
    if args.out != "-":
        write_section(Path(args.out), "prepare", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
