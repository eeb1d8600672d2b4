"""Sequence parallelism on a host: per-rank peak memory and speed of 2 ranks sharing each sequence
(``distributed.sequence_parallel=2``, DeepSpeed-Ulysses) against one process on the same sequences, on CPU.

- **Model and data**: those of ``bench/long_context.py`` (the 25.6M Llama of ``bench/peers.py``, random init, fp32,
  its checkpoint written with ``max_position_embeddings`` 32,768; Tiny Shakespeare prepared with its tokenizer).
- **Configurations**, both with the long-context set (``activation_checkpointing=full tiled_mlp=auto
  chunked_cross_entropy=auto activation_offloading=true``), ``memfit finetune method=full``, batch 1, AdamW with the
  for-loop update, constant lr: (1) one process (2 threads); (2) ``nproc=2 distributed.sequence_parallel=2``: 2
  ranks (1 thread each, memfit's ``nproc`` default on 2 cores), each holding T/2 tokens of the sequence, FSDP2 over
  both.
- **Measured**, each point a fresh launch with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc returns big frees to the
  kernel, so the resident set follows the live bytes): the fullest rank's peak RSS over the training steps
  (memfit's ``peak_memory_rss``, the maximum over ranks of each rank's process peak), each rank's
  ``peak_memory_by_rank`` at the end of the run, and the seconds of the second step (the first pays one-off costs;
  from rank 0's ``tokens_per_second_per_gpu``, which counts a rank's own tokens: T/2 under sp=2).
- **Derived**: bytes per token per rank, the slope of the fullest rank's peak RSS between the two lengths; its ratio
  sp=2 / one process (the issue's goal: at most 0.55, since each rank holds half the sequence); tokens/s per rank
  and for the pair.

Reproduce (about 15 minutes on 2 CPU cores, alone on the machine)::

    .venv/bin/python bench/sequence_parallel.py --work /tmp/sp_bench

It rewrites the section between the ``sequence_parallel`` markers of ``docs/benchmarks.md`` and writes
``docs/sequence_parallel.json``; ``--out -`` prints the section instead; ``--lengths`` chooses T, ``--quick`` is a
smoke test (T 512 and 1,024).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from docs_section import write_section
from peers import ROOT, cpu_model, prepare_inputs, run_memfit

LONG_CONTEXT = {
    "activation_checkpointing": "full",
    "tiled_mlp": "auto",
    "chunked_cross_entropy": "auto",
    "activation_offloading": "true",
}
CONFIGS = {
    "one process": {},
    "sp=2 (2 ranks)": {"nproc": 2, "distributed.sequence_parallel": 2},
}
MIB, GIB = 1024**2, 1024**3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--model", default="25.6M")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--work", default=None, help="keep the data, checkpoint and logs here")
    p.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-': print the section")
    p.add_argument("--quick", action="store_true", help="T 512 and 1,024 (a smoke test)")
    return p.parse_args()


def run_point(
    work: Path, env: dict[str, str], inputs: dict[str, Path], name: str, seq_len: int, args
) -> dict:
    """One ``memfit finetune`` launch of configuration ``name`` at ``seq_len`` (:func:`peers.run_memfit`): its
    measurements or ``error``."""
    out = work / "runs" / f"{name.split(' ')[0]}_{seq_len}"
    run_args = argparse.Namespace(
        steps=2, warmup=1, batch_size=1, seq_len=seq_len, seed=args.seed, lr=args.lr
    )
    overrides = {"optimizer.implementation": "for_loop", **LONG_CONTEXT, **CONFIGS[name]}
    result = run_memfit(run_args, env, overrides, inputs["checkpoint"], inputs["data"], out)
    if "error" in result:
        return result
    # tokens_per_second_per_gpu counts a rank's own tokens, T / sp: run_memfit's seconds (from T) are sp times long
    sp = CONFIGS[name].get("distributed.sequence_parallel", 1)
    seconds = [s / sp for s in result["step_seconds"]]
    by_rank = [
        line for line in (out / "stdout.txt").read_text().splitlines() if line.startswith("peak_memory_rss:")
    ]
    return {
        "losses": result["losses"],
        "step_seconds": seconds,
        "tokens_per_second_per_rank": seq_len / sp / seconds[-1],
        "tokens_per_second": seq_len / seconds[-1],
        "peak_rss_mib": result["metrics_peak_rss_mib"],
        "launch_rss_mib": result["rss_mib"],
        "summary_rss": by_rank[-1] if by_rank else "",
        "wall_seconds": result["wall_seconds"],
    }


def section(results: dict[str, Any], command: str) -> str:
    lengths = results["lengths"]
    rows = [
        "## Sequence parallelism on CPU: 2 ranks sharing each sequence vs one process",
        "",
        f"Measured {results['date']} on {results['cpu']} ({results['cores']} cores), torch {results['torch']}, "
        f"the {results['model']} model of `bench/peers.py` (fp32, batch 1), both with the long-context set "
        "(`activation_checkpointing=full tiled_mlp=auto chunked_cross_entropy=auto activation_offloading=true`), "
        "`memfit finetune method=full`, AdamW for-loop, each point a fresh launch with "
        "`MALLOC_MMAP_THRESHOLD_=131072`. sp=2 is `nproc=2 distributed.sequence_parallel=2`: 2 ranks of 1 thread, "
        "each holding T/2 tokens, FSDP2 over both; one process runs on 2 threads. Peak RSS: the fullest rank's "
        "process peak over the training steps (`peak_memory_rss`). Step: the second of two (rank 0's). Command: "
        f"`{command}`.",
        "",
        "| configuration | T | peak RSS MiB (fullest rank) | end-of-run peaks by rank | step s | tokens/s per rank "
        "| tokens/s (all ranks) | loss step 1 |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name in CONFIGS:
        for T in lengths:
            p = results["points"][name][str(T)]
            if "error" in p:
                rows.append(f"| {name} | {T:,} | failed: {p['error'][-120:]} | | | | | |")
                continue
            rows.append(
                f"| {name} | {T:,} | {p['peak_rss_mib']:,.0f} | {p['summary_rss'].split(': ', 1)[-1]} | "
                f"{p['step_seconds'][-1]:.1f} | {p['tokens_per_second_per_rank']:,.0f} | "
                f"{p['tokens_per_second']:,.0f} | {p['losses'][0]:.4f} |"
            )
    d = results["derived"]
    rows += [
        "",
        f"| configuration | bytes per token per rank (RSS slope {lengths[-2]:,} → {lengths[-1]:,}) | vs one process |",
        "|---|---:|---:|",
    ]
    for name in CONFIGS:
        slope = d.get(name, {}).get("kib_per_token")
        ratio = d.get(name, {}).get("ratio")
        slope_cell = "-" if slope is None else f"{slope:.1f} KiB"
        ratio_cell = "-" if ratio is None else f"{ratio:.2f}"
        rows.append(f"| {name} | {slope_cell} | {ratio_cell} |")
    goal = d.get("sp=2 (2 ranks)", {}).get("ratio")
    rows += [
        "",
        f"Goal: each rank's bytes per token at most 0.55x one process's: **{goal:.2f}x**"
        + (" (met)." if goal is not None and goal <= 0.55 else " (not met).")
        if goal is not None
        else "Goal: not measured.",
    ]
    return "\n".join(rows)


def main() -> int:
    args = parse_args()
    if args.quick:
        args.lengths = [512, 1024]
    work = Path(args.work or tempfile.mkdtemp(prefix="memfit_sp_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONPATH": str(ROOT / "src")}
    env.pop("OMP_NUM_THREADS", None)  # memfit's nproc sets 1 per rank on 2 cores; one process uses both
    data, _ = prepare_inputs(
        argparse.Namespace(grid={args.model: []}, seq_len=32768, seed=args.seed), work, env
    )
    inputs = {"checkpoint": work / f"checkpoint_{args.model}", "data": data}
    points: dict[str, dict[str, Any]] = {name: {} for name in CONFIGS}
    for T in args.lengths:
        for name in CONFIGS:
            started = time.perf_counter()
            points[name][str(T)] = run_point(work, env, inputs, name, T, args)
            p = points[name][str(T)]
            print(
                f"{name} T={T}: "
                + (f"FAILED {p['error'][-200:]}" if "error" in p else
                   f"peak RSS {p['peak_rss_mib']:.0f} MiB, step {p['step_seconds'][-1]:.1f} s, "
                   f"loss {p['losses'][0]:.4f}")
                + f" ({time.perf_counter() - started:.0f} s)",
                file=sys.stderr,
                flush=True,
            )  # fmt: skip
    derived: dict[str, dict[str, float]] = {}
    a, b = args.lengths[-2], args.lengths[-1]
    for name in CONFIGS:
        pa, pb = points[name][str(a)], points[name][str(b)]
        if "error" not in pa and "error" not in pb:
            derived[name] = {"kib_per_token": (pb["peak_rss_mib"] - pa["peak_rss_mib"]) * 1024 / (b - a)}
    one = derived.get("one process", {}).get("kib_per_token")
    for name in derived:
        if one:
            derived[name]["ratio"] = derived[name]["kib_per_token"] / one
    import torch  # after the children: only for the version

    results = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": cpu_model() or platform.processor(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "model": args.model,
        "lengths": args.lengths,
        "points": points,
        "derived": derived,
    }
    command = "python bench/sequence_parallel.py" + (
        f" --lengths {' '.join(map(str, args.lengths))}"
        if not args.quick and args.lengths != [8192, 16384]
        else ""
    )
    text = section(results, command)
    if args.out == "-":
        print(text)
        (work / "sequence_parallel.json").write_text(json.dumps(results, indent=1))
    else:
        write_section(Path(args.out), "sequence_parallel", text)
        (Path(args.out).parent / "sequence_parallel.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
