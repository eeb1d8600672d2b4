"""Every memory switch alone, and the best combination, side by side on one CPU: peak by category, RSS, speed.

Each configuration runs in its own process (so peak RSS is its own) on the same 56M-parameter Llama with the
same batch: one untimed step (it creates the optimizer state), timed steps (at least one, up to ``--timed-steps``
while under 4 s: tokens/s and peak RSS), then one step under :class:`memfit.memory.tracker.MemoryTracker` (live
bytes by category at the step's peak, and the phase of that peak). Ratios are to the baseline measured in the same
run (these machines are noisy). bf16 rows are slow on CPUs without native bf16 matrix units.

Reproduce (about 10 minutes on 2 CPU cores)::

    .venv/bin/python bench/techniques.py --out docs/benchmarks.md

It rewrites the section between the ``techniques`` markers of ``docs/benchmarks.md`` and writes
``docs/techniques_memory.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from docs_section import write_section

MIB = 1024**2
MIN_TIMED_SECONDS = (
    4.0  # time at least one step, more while under this (slow rows: bf16 on CPU, eager torchao)
)
ROOT = Path(__file__).resolve().parents[1]

# name -> run-config deltas from the baseline (fp32, torch AdamW foreach, nothing else)
CONFIGS: dict[str, dict] = {
    "baseline (AdamW foreach, fp32)": {},
    "AdamW for-loop": {"implementation": "for_loop"},
    "AdamW fused": {"implementation": "fused"},
    "optimizer in backward": {"implementation": "for_loop", "optimizer_in_backward": True},
    "activation checkpointing (full)": {"activation_checkpointing": "full"},
    "chunked cross-entropy (8)": {"chunked_cross_entropy": 8},
    "bnb AdamW8bit": {"optimizer": "adamw8bit"},
    "torchao AdamW8bit": {"optimizer": "torchao_adamw8bit"},
    "torchao AdamW4bit": {"optimizer": "torchao_adamw4bit"},
    "bf16 (weights, grads, state)": {"dtype": "bf16"},
    "bf16 autocast (fp32 master)": {"dtype": "bf16_mixed"},
    "best on CPU: AdamW8bit + in backward + AC + chunked CE (fp32)": {
        "optimizer": "adamw8bit",
        "optimizer_in_backward": True,
        "activation_checkpointing": "full",
        "chunked_cross_entropy": 8,
    },
    "least memory: bf16 + AdamW8bit + in backward + AC + chunked CE": {
        "dtype": "bf16",
        "optimizer": "adamw8bit",
        "optimizer_in_backward": True,
        "activation_checkpointing": "full",
        "chunked_cross_entropy": 8,
    },
}

MODEL_ARGS = {
    "vocab_size": 32000,
    "dim": 512,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1408,
    "max_seq_len": 512,
}


def run_one(spec: dict, batch_size: int, seq_len: int, timed_steps: int, timeline: str | None) -> dict:
    """Run one configuration in this process and return its measurements."""
    import torch

    from memfit.build import PARAM_DTYPES
    from memfit.config import OptimizerConfig
    from memfit.memory.optim import build_optimizer, optimizer_state_bytes
    from memfit.memory.stats import PeakMemory
    from memfit.memory.techniques import apply_activation_checkpointing
    from memfit.memory.timeline import plot_timeline
    from memfit.memory.tracker import MemoryTracker
    from memfit.models.config import DecoderConfig
    from memfit.models.decoder import build_decoder
    from memfit.step import train_step

    torch.manual_seed(0)
    dtype = spec.get("dtype", "fp32")
    model = build_decoder(DecoderConfig(**MODEL_ARGS), dtype=PARAM_DTYPES[dtype], seed=0)
    apply_activation_checkpointing(model, spec.get("activation_checkpointing", "none"))
    opt_cfg = OptimizerConfig(
        name=spec.get("optimizer", "adamw"),
        implementation=spec.get("implementation", "foreach"),
        lr=1e-4,
        weight_decay=0.1,
    )
    optimizer = build_optimizer(model, opt_cfg, in_backward=spec.get("optimizer_in_backward", False))
    step_kw = {
        "max_grad_norm": 0.0 if spec.get("optimizer_in_backward") else 1.0,
        "dtype": dtype,
        "chunked_cross_entropy": spec.get("chunked_cross_entropy", 0),
    }
    g = torch.Generator().manual_seed(0)

    def batch():
        x = torch.randint(0, MODEL_ARGS["vocab_size"], (batch_size, seq_len + 1), generator=g)
        return [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]

    losses = [train_step(model, optimizer, batch(), **step_kw).loss.item()]  # creates the optimizer state
    peak = PeakMemory(torch.device("cpu"))
    t0 = time.perf_counter()
    done = 0
    while done < timed_steps and (done == 0 or time.perf_counter() - t0 < MIN_TIMED_SECONDS):
        losses.append(train_step(model, optimizer, batch(), **step_kw).loss.item())
        done += 1
    elapsed = time.perf_counter() - t0
    rss = peak.read_and_reset()["peak_memory_rss"]
    tracker = MemoryTracker(model, optimizer)
    with tracker:
        losses.append(train_step(model, optimizer, batch(), tracker=tracker, **step_kw).loss.item())
    if timeline:
        plot_timeline(tracker.timeline, timeline, title="baseline: one training step")
    num_params = sum(p.numel() for p in model.parameters())
    return {
        "num_params": num_params,
        "tokens_per_second": done * batch_size * seq_len / elapsed,
        "timed_steps": done,
        "peak_rss_gib": rss,
        "tracked_peak_bytes": tracker.peak_bytes,
        "peak_phase": tracker.peak_phase,
        "breakdown_bytes": dict(tracker.peak_breakdown),
        "max_over_step_bytes": {
            c: max((ev[2].get(c, 0) for ev in tracker.timeline), default=0)
            for c in ("gradients", "activations")
        },
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "losses": losses,
    }


def _table(results: dict[str, dict], args) -> str:
    base = next(iter(results.values()))
    cats = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
    head = (
        "| configuration | peak (MiB) | vs baseline | "
        + " | ".join(cats)
        + " | phase of peak | max gradients over the step | max activations over the step | peak RSS (GiB) "
        "| tokens/s | vs baseline |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in results.items():
        if "error" in r:
            lines.append(
                f"| {name} | — | — | "
                + " | ".join("—" for _ in cats)
                + f" | {r['error']} | — | — | — | — | — |"
            )
            continue
        cells = " | ".join(f"{r['breakdown_bytes'].get(c, 0) / MIB:,.0f}" for c in cats)
        lines.append(
            f"| {name} | {r['tracked_peak_bytes'] / MIB:,.0f} "
            f"| {r['tracked_peak_bytes'] / base['tracked_peak_bytes']:.2f} "
            f"| {cells} | {r['peak_phase']} | {r['max_over_step_bytes']['gradients'] / MIB:,.0f} "
            f"| {r['max_over_step_bytes']['activations'] / MIB:,.0f} | {r['peak_rss_gib']:.2f} "
            f"| {r['tokens_per_second']:,.0f} "
            f"| {r['tokens_per_second'] / base['tokens_per_second']:.2f} |"
        )
    return "\n".join(lines)


def _plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
    ok = {k: v for k, v in results.items() if "error" not in v}
    fig, ax = plt.subplots(figsize=(10, 5), dpi=120)
    bottom = [0.0] * len(ok)
    for c in cats:
        vals = [r["breakdown_bytes"].get(c, 0) / MIB for r in ok.values()]
        ax.barh(list(ok), vals, left=bottom, label=c)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("live MiB at the step's peak")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("memory at the peak of one training step, by category")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--timed-steps", type=int, default=3, help="at most this many timed steps per row")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument("--only", nargs="*", help="run only these configuration names")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_timeline", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._child:
        spec = json.loads(args._child)
        print(json.dumps(run_one(spec, args.batch_size, args.seq_len, args.timed_steps, args._timeline)))
        return 0

    results: dict[str, dict] = {}
    docs = Path(args.out).parent
    for i, (name, spec) in enumerate(CONFIGS.items()):
        if args.only and name not in args.only:
            continue
        cmd = [
            sys.executable,
            __file__,
            "--_child",
            json.dumps(spec),
            "--batch-size",
            str(args.batch_size),
            "--seq-len",
            str(args.seq_len),
            "--timed-steps",
            str(args.timed_steps),
        ]
        if i == 0:
            cmd += ["--_timeline", str(docs / "techniques_timeline.png")]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["failed"])[-1][:120].replace("|", "/")
            results[name] = {"error": reason}
        else:
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: {results[name].get('error') or 'ok'}", file=sys.stderr, flush=True)

    base = next(iter(results.values()))
    section = (
        "## Memory techniques on CPU\n\n"
        f"A {base.get('num_params', 0) / 1e6:.1f}M-parameter Llama (dim {MODEL_ARGS['dim']}, "
        f"{MODEL_ARGS['num_layers']} layers, {MODEL_ARGS['num_heads']}/{MODEL_ARGS['num_kv_heads']} heads, "
        f"vocab {MODEL_ARGS['vocab_size']:,}), batch {args.batch_size} x {args.seq_len} tokens, one process per row. "
        "Peak and categories are live bytes (MiB) at the peak of one tracked step, from memfit's tracker; the two "
        "'max ... over the step' columns are each category's own maximum during that step (activations peak at the "
        "end of the forward, before the step's overall peak); "
        "peak RSS is the process high-water over the timed steps (includes the Python/torch runtime, ~0.3 GiB); "
        "tokens/s over the timed steps, untracked.\n\n"
        f"Reproduce: `.venv/bin/python bench/techniques.py --batch-size {args.batch_size} --seq-len {args.seq_len} "
        f"--timed-steps {args.timed_steps}`\n\n"
        + _table(results, args)
        + "\n\n![peak by category](techniques_memory.png)\n\nOne baseline step over time: "
        "![timeline](techniques_timeline.png)\n"
    )
    _plot(results, docs / "techniques_memory.png")
    write_section(Path(args.out), "techniques", section)
    (docs / "techniques_results.json").write_text(json.dumps(results, indent=1))
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
