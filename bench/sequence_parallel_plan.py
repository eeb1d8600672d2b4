"""Predicted: the longest context of Llama-3.1-8B and -70B on 8 and 32 GPUs of 80 GiB with sequence parallelism.

For each row, :func:`memfit.planner.context.longest_length` of one fixed switch set (on this CPU machine: every
number is the estimator's trace of rank 0's step over a fake process group of ``world_size`` ranks, the all-to-all
buffers included; no GPU involved): the longest ``seq_len`` whose predicted allocator peak fits 80 GiB less the
planner's 10% margin, its peak, device total, pinned host memory, the largest category at the peak, and the cost
model's tokens/s per GPU (``interconnect_bytes_per_second`` 200 GB/s: an NVLink node; the 32-GPU rows cross nodes,
so they are given at InfiniBand's 50 GB/s too). Then ``memfit plan seq_len=max`` for the 8B on 8 GPUs: the
ladder of what each technique buys, ending with sequence parallelism over 8, and the planner's pick there.

Every figure is a prediction until a GPU run confirms it. Reproduce (about 4 minutes on 2 CPU cores)::

    .venv/bin/python bench/sequence_parallel_plan.py

It rewrites the section between the ``sequence-parallel-plan`` markers of ``docs/benchmarks.md`` and writes
``docs/sequence_parallel_plan.json``; ``--out -`` prints the section instead; ``--skip-plan`` leaves out the
``memfit plan`` run.
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
sys.path.insert(0, str(ROOT / "src"))

from memfit.config import load_config  # noqa: E402
from memfit.planner import context  # noqa: E402
from memfit.planner import plan as plan_  # noqa: E402
from memfit.planner.cost import COST_CONSTANTS  # noqa: E402
from memfit.units import GIB  # noqa: E402

BUDGET = 80 * GIB
COMMON = {
    "optimizer.name": "adamw",  # a full fine-tune (left out, a preset without checkpoint_dir gets Muon)
    "batch_size": 1,
    "dtype": "bf16",
    "device": "cuda",
    "optimizer_in_backward": True,
    "max_grad_norm": 0,
    "activation_checkpointing": "full",
    "chunked_cross_entropy": "auto",
    "tiled_mlp": "auto",
    "activation_offloading": True,
}
ROWS = [
    # (label, model, ranks, sequence_parallel, overrides)
    ("8B, 8 GPUs, FSDP2 alone", "llama3.1-8b", 8, 1, {}),
    ("8B, 8 GPUs, sp=8", "llama3.1-8b", 8, 8, {}),
    ("8B, 8 GPUs, sp=8, no offloading", "llama3.1-8b", 8, 8, {"activation_offloading": False}),
    ("70B, 8 GPUs, sp=8", "llama3-70b", 8, 8, {}),
    ("70B, 32 GPUs, sp=8 (4 x 8)", "llama3-70b", 32, 8, {}),
    ("70B, 32 GPUs, sp=32", "llama3-70b", 32, 32, {}),
]


def row(label: str, model: str, ranks: int, sp: int, extra: dict) -> dict:
    settings = {**COMMON, **extra, "model": model, "distributed.sequence_parallel": sp}
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items()], world_size=ranks, needs_weights=False)
    ctx = plan_._Context(context.at_length(cfg, 8192, ranks), ranks, BUDGET, plan_.DEFAULT_MARGIN, None)
    start = time.perf_counter()
    seq_len, e, over, estimates = context.longest_length(
        cfg, ctx.usable, world_size=ranks, progress=lambda line: print(line, file=sys.stderr, flush=True)
    )
    out = {"label": label, "settings": settings, "ranks": ranks, "seq_len": seq_len, "estimates": estimates}
    out["seconds"] = time.perf_counter() - start
    if e is None:
        return out
    at = context.at_length(cfg, seq_len, ranks)
    speeds = {}
    for gbps in (200, 50):
        constants = {**COST_CONSTANTS["cuda"], "interconnect_bytes_per_second": gbps * 1e9}
        c = plan_._Context(at, ranks, BUDGET, plan_.DEFAULT_MARGIN, constants)
        cost = c.cost(at, e.unseen.get("offloaded_activations", 0), e.device_total_bytes)
        speeds[gbps] = {"tokens_per_second_per_gpu": c.tokens(at) / cost["total"], "cost": cost}
    limit = max(e.breakdown, key=e.breakdown.get)
    return {
        **out,
        "peak_gib": e.peak_bytes / GIB,
        "device_total_gib": e.device_total_bytes / GIB,
        "host_gib": e.host_bytes / GIB,
        "limit": limit,
        "limit_gib": e.breakdown[limit] / GIB,
        "speed": speeds,
    }


def memfit_plan() -> dict:
    cmd = [
        sys.executable,
        "-m",
        "memfit",
        "plan",
        "world_size=8",
        "budget=80GiB",
        "model=llama3.1-8b",
        "batch_size=1",
        "dtype=bf16",
        "device=cuda",
        "seq_len=max",
        "optimizer.name=adamw",  # a full fine-tune (left out, a preset without checkpoint_dir gets Muon)
        "--json",
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1], "seconds": seconds}
    return {**json.loads(proc.stdout), "seconds": seconds, "command": " ".join(["memfit", *cmd[3:-1]])}


def section(rows: list[dict], planned: dict | None) -> str:
    lines = [
        "## Predicted: the longest context across ranks with sequence parallelism",
        "",
        "Predictions, not measurements: the estimator's trace of rank 0's step over a fake process group on a CPU "
        "machine, 80 GiB GPUs with 10% kept free, Llama-3.1-8B and Llama-3-70B (the 3.1 architecture less its "
        "RoPE scaling: the same memory), batch 1, `dtype=bf16`, AdamW in backward, "
        "`activation_checkpointing=full chunked_cross_entropy=auto tiled_mlp=auto activation_offloading=true`, "
        "FSDP2 over all ranks. tokens/s per GPU: the cost model's (docs/memory.md, Planner) at 200 GB/s (NVLink) "
        "and 50 GB/s (InfiniBand) between ranks.",
        "",
        "| run | longest seq_len | peak (GiB) | device total (GiB) | pinned host per rank (GiB) | the limit "
        "(GiB) | tokens/s/GPU at 200 / 50 GB/s | estimates (time) |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in rows:
        if not r.get("seq_len"):
            lines.append(f"| {r['label']} | nothing fits | | | | | | {r['estimates']} |")
            continue
        s = r["speed"]
        lines.append(
            f"| {r['label']} | {r['seq_len']:,} | {r['peak_gib']:.1f} | {r['device_total_gib']:.1f} | "
            f"{r['host_gib']:.1f} | {r['limit']} {r['limit_gib']:.1f} | "
            f"{s[200]['tokens_per_second_per_gpu']:,.0f} / {s[50]['tokens_per_second_per_gpu']:,.0f} | "
            f"{r['estimates']} ({r['seconds']:.0f} s) |"
        )
    lines += [
        "",
        "Published, for comparison (measured on GPUs, other settings): torchtitan's context parallelism (ring "
        "attention) trains Llama-3.1-8B at 262,144 tokens on 8 H100s with CP 8 (84.5 GiB, 32K at 83.9 GiB without); "
        "Arctic Long Sequence Training (arXiv 2506.13996; Ulysses SP, tiled MLP and loss, offloaded checkpoints and "
        "optimizer state offloaded to the host) reports 3.7M tokens for Llama-3-8B on 8 H100s and 15M on 32.",
    ]
    if planned is not None:
        lines += ["", "`memfit plan world_size=8 budget=80GiB model=llama3.1-8b batch_size=1 dtype=bf16 device=cuda "
                  "seq_len=max`:", ""]  # fmt: skip
        if "error" in planned:
            lines.append(f"failed: {planned['error']}")
        else:
            lines += [
                "| rung | longest seq_len | tokens/s/GPU (cost model) |",
                "|---|---:|---:|",
            ]
            for rung in planned.get("longest_context", []):
                speed = rung.get("tokens_per_second_per_gpu") or 0
                lines.append(f"| {rung['switches']} | {rung.get('seq_len') or 0:,} | {speed:,.0f} |")
            best = planned.get("best") or {}
            lines += [
                "",
                f"The planner's pick at the longest: `{best.get('switches', '-')}`, seq_len "
                f"{best.get('seq_len') or 0:,}, peak {best.get('peak_memory_gib') or 0:.1f} GiB, "
                f"{best.get('tokens_per_second_per_gpu') or 0:,.0f} tokens/s/GPU (cost model; "
                f"{planned['seconds'] / 60:.0f} min to plan).",
            ]
    lines += ["", "Reproduce: `.venv/bin/python bench/sequence_parallel_plan.py`."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    parser.add_argument("--skip-plan", action="store_true")
    parser.add_argument("--rows", nargs="+", type=int, default=None, help="indices of ROWS to run")
    args = parser.parse_args()
    rows = []
    for i, spec in enumerate(ROWS):
        if args.rows is not None and i not in args.rows:
            continue
        rows.append(row(*spec))
        r = rows[-1]
        print(f"{r['label']}: seq_len {r['seq_len']:,} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
    planned = None if args.skip_plan else memfit_plan()
    text = section(rows, planned)
    if args.out == "-":
        print(text)
    else:
        write_section(Path(args.out), "sequence-parallel-plan", text)
        (ROOT / "docs" / "sequence_parallel_plan.json").write_text(
            json.dumps({"rows": rows, "plan": planned}, indent=1, default=str) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
