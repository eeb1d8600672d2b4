"""Predicted: the longest context of Llama-3.1-8B on one 24, 48 and 80 GiB GPU, full fine-tuning and QLoRA.

For each budget and method, ``memfit plan budget=B model=llama3.1-8b method=M batch_size=1 dtype=bf16 device=cuda
seq_len=max --json`` (on this CPU machine: every number is the estimator's trace of the run's own step on fake
tensors, no GPU involved): the longest ``seq_len`` that fits with the fastest switch set there, its predicted peak
(allocator), the device total, the pinned host memory the offloaded checkpoints take, the term that sets the limit,
and the cost model's tokens/s; and, for the 80 GiB full fine-tune, the ladder of what each technique buys. Every
figure is a prediction until a GPU run confirms it (``bench/gpu_estimate_check.py`` measures a 1B model at the
longest length the planner predicts for 8 GiB).

Reproduce (about 5 minutes on 2 CPU cores)::

    .venv/bin/python bench/long_context_plan.py

It rewrites the section between the ``long-context-plan`` markers of ``docs/benchmarks.md`` and writes
``docs/long_context_plan.json``; ``--out -`` prints the section instead. ``--families`` plans the 8-9B presets of the
other families (:data:`FAMILY_MODELS`: Qwen3's q/k norms and explicit head size, Gemma 2's local and global layers,
soft-capped scores and 256-wide heads) the same way and writes the ``long-context-plan-families`` section and
``docs/long_context_plan_families.json`` (about 15 minutes with the defaults ``--budgets 80 --methods full``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from docs_section import write_section

ROOT = Path(__file__).resolve().parents[1]
BUDGETS_GIB = (24, 48, 80)
METHODS = ("full", "qlora")
FAMILY_MODELS = ("qwen3-8b", "gemma-2-9b")
"""The other families' presets of ``--families``."""
# a full fine-tune with AdamW (left out, a preset without checkpoint_dir would get Muon: pretraining)
BASE = [
    "batch_size=1",
    "dtype=bf16",
    "device=cuda",
    "seq_len=max",
    "optimizer.name=adamw",
]


def plan(budget_gib: int, method: str, model: str = "llama3.1-8b") -> dict:
    """``memfit plan ... --json`` of one budget, method and preset, with its wall time."""
    cmd = [
        str(ROOT / ".venv" / "bin" / "memfit"),
        "plan",
        f"budget={budget_gib}GiB",
        f"method={method}",
        f"model={model}",
        *BASE,
    ]
    start = time.perf_counter()
    proc = subprocess.run([*cmd, "--json"], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1], "seconds": seconds}
    return {**json.loads(proc.stdout), "seconds": seconds, "command": " ".join(["memfit", *cmd[1:]])}


def table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| method | budget | longest seq_len | switch set (the planner's pick there) | peak (GiB) | device total "
        "(GiB) | pinned host (GiB) | the limit | tokens/s/gpu (cost model) | plan time |",
        "|---|---|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for key, r in results.items():
        method, budget = key.split("@")[:2]
        best = r.get("best")
        if not best:
            lines.append(f"| {method} | {budget} GiB | none | {r.get('error', 'nothing fits')} | | | | | | |")
            continue
        lines.append(
            f"| {method} | {budget} GiB | {r['seq_len']:,} | {best['switches']} | {best['peak_memory_gib']:.1f} | "
            f"{best['device_total_gib']:.1f} | {best['host_gib']:.1f} | {r['limit']} | "
            f"{best['tokens_per_second_per_gpu']:,.0f} | {r['seconds']:.0f} s |"
        )
    return lines


def ladder(result: dict) -> list[str]:
    lines = [
        "| switch set (each adds to the one above) | longest seq_len | peak at it (GiB) | pinned host (GiB) | "
        "tokens/s/gpu (cost model) |",
        "|---|---:|---:|---:|---:|",
    ]
    for rung in result.get("longest_context", []):
        length = f"{rung['seq_len']:,}" if rung["seq_len"] else "none"
        peak = f"{rung['peak_memory_gib']:.1f}" if rung["peak_memory_gib"] is not None else "-"
        host = f"{rung['host_gib']:.1f}" if rung["host_gib"] is not None else "-"
        label = f"{rung['switches']} (`{rung['label']}`)"
        lines.append(f"| {label} | {length} | {peak} | {host} | {rung['tokens_per_second_per_gpu']:,.0f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    parser.add_argument("--budgets", nargs="+", type=int, default=list(BUDGETS_GIB))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--families", action="store_true", help="plan FAMILY_MODELS instead (own section)")
    args = parser.parse_args()
    if args.families:
        return families(args)
    results = {}
    for method in args.methods:
        for budget in args.budgets:
            results[f"{method}@{budget}"] = r = plan(budget, method)
            print(f"{method} {budget} GiB: seq_len {r.get('seq_len')} ({r['seconds']:.0f} s)", flush=True)
    full80 = results.get("full@80", {})
    body = [
        "## Predicted: the longest context of Llama-3.1-8B on one GPU",
        "",
        "Predictions, not measurements: `memfit plan budget=B model=llama3.1-8b method=M batch_size=1 dtype=bf16 "
        "device=cuda seq_len=max` on a CPU machine (the estimator's trace of each run's own step on fake "
        "tensors; 10% of the budget kept free). Each is a prediction until a GPU run confirms it. Arctic Long "
        "Sequence Training (arXiv 2506.13996) reports 500K tokens for Llama-3-8B on one 80 GB H100.",
        "",
        *table(results),
        "",
        "What each technique buys, Llama-3.1-8B full fine-tune in 80 GiB:",
        "",
        *ladder(full80),
        "",
        "*The limit* is the largest category of the chosen switch set's breakdown at its peak (always the "
        "backward's, in the layer being recomputed). The pinned host memory is the offloaded checkpoints' "
        "(`L * T * dim * 2` bytes in bf16): the machine needs that much RAM besides the run's own.",
        "",
        "Reproduce: `.venv/bin/python bench/long_context_plan.py` (about 5 minutes on 2 CPU cores).",
    ]
    return _write(args.out, "long-context-plan", body, results)


def _write(out: str, name: str, body: list[str], results: dict) -> int:
    """Print the section (``--out -``), or write it into ``out`` between the ``name`` markers and the results beside
    it as ``docs/<name>.json`` (dashes as underscores)."""
    text = "\n".join(body)
    if out == "-":
        print(text)
    else:
        write_section(Path(out), name, text)
        (ROOT / "docs" / f"{name.replace('-', '_')}.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


def families(args) -> int:
    """``--families``: :data:`FAMILY_MODELS` at ``--budgets`` (default 80 GiB) and ``--methods`` (default full)."""
    budgets = args.budgets if args.budgets != list(BUDGETS_GIB) else [80]
    methods = args.methods if args.methods != list(METHODS) else ["full"]
    rows: dict[str, dict] = {}
    for model in FAMILY_MODELS:
        for method in methods:
            for budget in budgets:
                rows[f"{method}@{budget}@{model}"] = r = plan(budget, method, model)
                print(
                    f"{model} {method} {budget} GiB: seq_len {r.get('seq_len')} ({r['seconds']:.0f} s)",
                    flush=True,
                )
    lines = []
    for model in FAMILY_MODELS:
        mine = {k: v for k, v in rows.items() if k.endswith(f"@{model}")}
        lines += [f"**{model}**", "", *table(mine), ""]
    body = [
        "## Predicted: the longest context of the other families' 8-9B presets on one GPU",
        "",
        "As the Llama-3.1-8B table above, for `model=qwen3-8b` and `model=gemma-2-9b` (predictions, not "
        "measurements; AdamW, bf16, batch 1, `device=cuda`). Gemma 2's local layers read at most their "
        "4,096-key window; its global layers and Qwen3's every layer read all earlier keys.",
        "",
        *lines,
        "Reproduce: `.venv/bin/python bench/long_context_plan.py --families`.",
    ]
    return _write(args.out, "long-context-plan-families", body, rows)


if __name__ == "__main__":
    sys.exit(main())
