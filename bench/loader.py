"""Training on prepared datasets: the data loader's share of a step, and a run's memory over a dataset of 4 GiB
of tokens against one of 10 MiB.

- **Loader share**: the 78.6M-parameter Llama (dim 768, 12 layers, 12 query and 4 key/value heads, SwiGLU 2048,
  vocab 2048), batch 4 x 256, fp32 AdamW, on the main job's prepared Tiny Shakespeare: the mean time of
  ``RunData.train_batch`` (drawing the step's windows from the memory-mapped shards) over 200 steps, against the
  mean time of a training step (``memfit.step.train_step``, 3 steps after one warm-up).
- **Memory vs dataset size**: two datasets in the prepared format, written here with random token ids (the reader
  does not care what the ids are): 10 MiB and 4 GiB of ``uint16`` tokens (2,147,483,648 tokens in 8 shards). The
  main job's model trains 40 steps on each (``memfit pretrain data.path=DIR``, a fresh process each); peak RSS is
  the process's high-water mark (``VmHWM``).

Reproduce (about 6 minutes on 2 CPU cores; 4.1 GiB of temporary disk)::

    .venv/bin/python bench/loader.py

It rewrites the section between the ``loader`` markers of ``docs/benchmarks.md`` (``--out -`` only prints).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from docs_section import write_section

from memfit.units import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
MODEL_78M = {
    "model_args.dim": 768,
    "model_args.num_layers": 12,
    "model_args.num_heads": 12,
    "model_args.num_kv_heads": 4,
    "model_args.intermediate_size": 2048,
}


def synthetic_dataset(out: Path, tokens: int, tokenizer_dir: Path, shards: int) -> None:
    """A dataset in the prepared format with ``tokens`` random ids (one source, 1% of them held out)."""
    from memfit.data.tokens import FORMAT, VERSION
    from memfit.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    (out / "web").mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-r", str(tokenizer_dir), str(out / "tokenizer")], check=True)
    rng = np.random.default_rng(0)
    val_tokens = max(tokens // 100, 4096)
    entries = []
    per_shard = -(-(tokens - val_tokens) // shards)
    left = tokens - val_tokens
    for i in range(shards):
        n = min(per_shard, left)
        left -= n
        path = out / "web" / f"synthetic-{i:05d}.train.bin"
        with open(path, "wb") as fh:
            for start in range(0, n, 1 << 26):
                fh.write(rng.integers(0, tok.vocab_size, min(1 << 26, n - start), dtype=np.uint16).tobytes())
        entries.append({"file": path.name, "split": "train", "tokens": n, "documents": 1})
    path = out / "web" / "synthetic-val.bin"
    rng.integers(0, tok.vocab_size, val_tokens, dtype=np.uint16).tofile(path)
    entries.append({"file": path.name, "split": "val", "tokens": val_tokens, "documents": 1})
    source = {"documents": shards + 1, "tokens": tokens, "skipped": 0, "files": [], "shards": entries}
    source["train"] = {"documents": shards, "tokens": tokens - val_tokens}
    source["val"] = {"documents": 1, "tokens": val_tokens}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": "uint16",
        "tokenizer": {
            "kind": tok.kind,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "fingerprint": tok.fingerprint(),
        },  # fmt: skip
        "settings": {"synthetic": True},
        "documents": shards + 1,
        "tokens": tokens,
        "sources": {"web": source},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


def child_share(data_dir: str) -> None:
    """Mean seconds of drawing a step's batch and of a training step on the 78.6M model."""
    import torch

    from memfit.build import build_training
    from memfit.config import load_config
    from memfit.data.run import run_data, run_tokenizer
    from memfit.data.tokens import read_manifest
    from memfit.models.presets import model_config
    from memfit.step import train_step, train_step_options

    torch.set_num_threads(2)
    overrides = [f"{k}={v}" for k, v in MODEL_78M.items()] + [
        f"data.path={data_dir}",
        "batch_size=4",
        "seq_len=256",
        "optimizer.name=adamw",  # the table's update rule (left out, a run from scratch gets Muon)
    ]
    cfg = load_config(None, overrides)
    tokenizer, manifest = run_tokenizer(cfg, Path(tempfile.mkdtemp()), None)
    data = run_data(cfg, tokenizer, read_manifest(data_dir), 256, Path(data_dir))
    start = time.perf_counter()
    for step in range(200):
        data.train_batch(step, 0)
    loader = (time.perf_counter() - start) / 200
    mcfg = model_config(
        "shakespeare", vocab_size=tokenizer.vocab_size, **{k.split(".")[1]: v for k, v in MODEL_78M.items()}
    )
    built = build_training(cfg, mcfg, torch.device("cpu"))
    options = train_step_options(cfg)
    times = []
    for step in range(4):
        batch = [data.train_batch(step, 0)]
        t0 = time.perf_counter()
        train_step(built.model, built.optimizer, batch, **options).loss.item()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"loader": loader, "step": sum(times[1:]) / 3, "params": built.num_params}))


def run_rss(cmd: list[str], env: dict[str, str], out: Path) -> dict[str, float]:
    """Run a training command; its peak RSS (the largest ``peak_memory_rss`` in its metrics.jsonl) and wall time."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    peak = max(r["peak_memory_rss"] for r in records if r.get("peak_memory_rss") is not None)
    return {"peak_rss_gib": peak, "seconds": time.perf_counter() - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--_share", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._share:
        child_share(args._share)
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="memfit_loader_bench_"))
    python, env = sys.executable, {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    shakespeare = work / "shakespeare"
    if not (shakespeare / "manifest.json").exists():
        subprocess.run([python, "-m", "memfit", "prepare", "--out", str(shakespeare), "--source",
                        f"tinyshakespeare={ROOT / 'src/memfit/assets/tinyshakespeare.txt'}", "--quiet",
                        "val_fraction=0.1"], env=env, check=True)  # fmt: skip
    share = subprocess.run(
        [python, __file__, "--_share", str(shakespeare)], env=env, capture_output=True, text=True
    )
    if share.returncode != 0:
        raise RuntimeError(share.stderr[-3000:])
    s = json.loads(share.stdout.strip().splitlines()[-1])

    rows = []
    for name, nbytes, shards in (("10 MiB", 10 * MIB, 1), ("4 GiB", 4 * GIB, 8)):
        directory = work / name.replace(" ", "")
        if not (directory / "manifest.json").exists():
            print(f"writing the {name} dataset", flush=True)
            synthetic_dataset(directory, nbytes // 2, shakespeare / "tokenizer", shards)
        out = work / f"run_{directory.name}"
        subprocess.run(["rm", "-rf", str(out)], check=True)
        cmd = [python, "-m", "memfit", "pretrain", f"data.path={directory}", f"output_dir={out}", "max_steps=40",
               "optimizer.name=adamw",
               "log_every=5", "eval_every=0", "eval_batches=2", "checkpoint_every=0", "sample.max_new_tokens=0",
               "progress_bar=false", "tensorboard=false"]  # fmt: skip
        rows.append((name, nbytes // 2, run_rss(cmd, env, out)))
    diff_mib = (rows[1][2]["peak_rss_gib"] - rows[0][2]["peak_rss_gib"]) * 1024
    section = "\n".join(
        [
            "## Training on prepared datasets: the loader's share of a step, memory vs dataset size",
            "",
            "Reproduce: `.venv/bin/python bench/loader.py` (module docstring: the cases). 2 CPU cores, fp32.",
            "",
            "| model | batch | loader per step (ms) | training step (s) | loader share |",
            "|---|---|---:|---:|---:|",
            f"| {s['params'] / 1e6:.1f}M parameters | 4 x 256 | {s['loader'] * 1e3:.2f} | {s['step']:.2f} | "
            f"{s['loader'] / s['step']:.3%} |",
            "",
            "| dataset | tokens | peak RSS (GiB) | wall time (s) |",
            "|---|---:|---:|---:|",
            *[
                f"| {n} of tokens | {t:,} | {r['peak_rss_gib']:.3f} | {r['seconds']:.0f} |"
                for n, t, r in rows
            ],
            "",
            f"Peak RSS over 4 GiB of tokens minus over 10 MiB: **{diff_mib:+.0f} MiB** (the main job's model, 40 "
            f"steps of 16 x 256; the shards are memory-mapped and only the pages of the drawn windows are read).",
        ]
    )
    print(section)
    if args.out != "-":
        write_section(Path(args.out), "loader", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
