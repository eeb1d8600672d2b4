"""bf16 weights that learn: the validation loss of one fine-tune with each ``bf16_rounding`` and optimizer, beside fp32
AdamW, and the update's time under each rounding.

Two parts (``--part quality update``, both by default):

- **quality** — memfit pretrains a Llama of 52.2M parameters (dim 512, 10 layers, 8/4 heads, SwiGLU 1,792, an
  untied byte-level BPE of 16,384 ids trained by ``memfit prepare``) on this Python's standard library (its
  top-level modules) and Tiny Shakespeare, in fp32 with AdamW; exports it as a Hugging Face directory; then
  fine-tunes it (``method=full``, every weight) on an instruction set built from the standard library's packages
  (a different set of files): "Write the body of the Python function ``name(args)``: <its docstring's first
  paragraph>" answered by its source, in the Alpaca template, packed into rows of 512 tokens, the loss on the
  answers, 10% of the records held out by memfit's hash split. Every fine-tune runs the same steps, batches,
  schedule (warm-up, cosine to a tenth) and seed, ``max_grad_norm=0``; the table reports the validation loss
  after the last step and its gap to fp32 AdamW's.
- **update** — the time of one optimizer step of a (4,096 x 4,096) bf16 weight under each rounding, AdamW and
  torchao's 4-bit AdamW, interleaved round after round: the cost model's factor
  (``memfit.memory.switches.methods.ROUNDING_UPDATE_FACTOR["cpu"]``).

Reproduce (about 60 minutes on 2 CPU cores; quality numbers do not depend on the machine's load, the update times
do: run ``--part update`` alone)::

    .venv/bin/python bench/bf16_rounding.py

It rewrites the sections ``bf16-rounding`` and ``bf16-rounding-update`` of ``docs/benchmarks.md`` and writes
``docs/bf16_rounding.json``; ``--quick`` is a smoke test (a tiny model, a few steps; nothing written unless
``--out`` names a file).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from docs_section import write_section
from peers import ROOT, reproduce_command

MEMFIT = [sys.executable, "-m", "memfit"]
BASE = {
    "dim": 512,
    "num_layers": 10,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1792,
    "max_seq_len": 512,
}
QUICK_BASE = {
    "dim": 64,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 172,
    "max_seq_len": 512,
}
LR = 5e-5
"""The fine-tunes' peak learning rate for the AdamW family (Adam's update is ~lr per weight): about the bf16 gap of
a weight of 0.01-0.03 (2**-8 of it), where rounding to nearest cancels most updates, as at real fine-tuning rates
on real weights (torchtune's Llama-3.1-8B full fine-tune: 2e-5)."""
RUNS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("fp32 adamw (reference)", {"dtype": "fp32", "optimizer.name": "adamw"}),
    ("bf16 nearest adamw", {"dtype": "bf16", "bf16_rounding": "nearest", "optimizer.name": "adamw"}),
    (
        "bf16 nearest paged_adamw8bit in backward (torchtune's recipe)",
        {
            "dtype": "bf16",
            "bf16_rounding": "nearest",
            "optimizer.name": "paged_adamw8bit",
            "optimizer_in_backward": "true",
        },
    ),
    ("bf16 stochastic adamw", {"dtype": "bf16", "bf16_rounding": "stochastic", "optimizer.name": "adamw"}),
    (
        "bf16 stochastic adamw8bit",
        {"dtype": "bf16", "bf16_rounding": "stochastic", "optimizer.name": "adamw8bit"},
    ),
    (
        "bf16 stochastic torchao_adamw4bit",
        {"dtype": "bf16", "bf16_rounding": "stochastic", "optimizer.name": "torchao_adamw4bit"},
    ),
    # Adafactor's step is relative (lr x the weight's RMS): 1e-3 moves a weight of RMS 0.03 by ~3e-5, as above
    (
        "bf16 stochastic adafactor",
        {"dtype": "bf16", "bf16_rounding": "stochastic", "optimizer.name": "adafactor", "optimizer.lr": 1e-3},
    ),
    (
        "bf16 stochastic apollo_mini",
        {"dtype": "bf16", "bf16_rounding": "stochastic", "optimizer.name": "apollo_mini"},
    ),
    ("bf16 stochastic muon", {"dtype": "bf16", "bf16_rounding": "stochastic", "optimizer.name": "muon"}),
    ("bf16 kahan adamw", {"dtype": "bf16", "bf16_rounding": "kahan", "optimizer.name": "adamw"}),
)


# ----------------------------------------------------------------------------------------------------------------
# Inputs: a corpus and an instruction set, from this Python's standard library
# ----------------------------------------------------------------------------------------------------------------


def stdlib() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(pattern: str) -> list[Path]:
    skip = ("test", "idlelib", "site-packages", "lib2to3", "turtledemo")
    return sorted(p for p in stdlib().glob(pattern) if not any(s in p.parts or s in p.name for s in skip))


def write_corpus(out: Path) -> Path:
    """The top-level standard-library modules, one JSONL document each."""
    with out.open("w") as f:
        for path in _python_files("*.py"):
            f.write(json.dumps({"text": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
    return out


def write_instructions(out: Path, limit: int) -> int:
    """Alpaca records from the standard library's packages: each function with a docstring and a body, its
    signature and the docstring's first paragraph as the instruction, its source without the docstring as the
    answer (at most 1,200 characters)."""
    records = []
    for path in _python_files("*/*.py"):
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or len(node.body) < 2:
                continue
            doc = ast.get_docstring(node)
            if not doc or node.name.startswith("__"):
                continue
            body = node.body[1:]
            code = "\n".join(ast.get_source_segment(source, stmt) or "" for stmt in body)
            if not code.strip() or len(code) > 1200:
                continue
            args = ast.unparse(node.args)
            summary = doc.split("\n\n")[0].strip()
            records.append(
                {
                    "instruction": f"Write the body of the Python function `{node.name}({args})`: {summary}",
                    "input": "",
                    "output": code,
                }
            )
    records.sort(key=lambda r: hashlib.sha256(r["instruction"].encode()).hexdigest())  # a fixed shuffle
    out.write_text(json.dumps(records[:limit]))
    return min(limit, len(records))


# ----------------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------------


def run(cmd: list[str], log: Path, env: dict[str, str]) -> float:
    start = time.monotonic()
    with log.open("w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if code != 0:
        raise SystemExit(f"failed ({code}): {' '.join(cmd)}; see {log}")
    return time.monotonic() - start


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def pretrain(work: Path, args: argparse.Namespace, env: dict[str, str]) -> Path:
    """The base model: prepared, pretrained, exported (each step skipped when its output exists)."""
    base = QUICK_BASE if args.quick else BASE
    tokens, run_dir, hf = work / "tokens", work / "base", work / "base_hf"
    if not (tokens / "manifest.json").exists():
        corpus = write_corpus(work / "stdlib.jsonl")
        shakespeare = ROOT / "src" / "memfit" / "assets" / "tinyshakespeare.txt"
        run(
            [*MEMFIT, "prepare", "--out", str(tokens), "--source", f"python={corpus}",
             "--source", f"shakespeare={shakespeare}", "--quiet", f"vocab_size={args.vocab_size}"],
            work / "prepare.log", env,
        )  # fmt: skip
    if not (hf / "config.json").exists():
        settings = {
            "data.path": tokens,
            "output_dir": run_dir,
            "model": "shakespeare",
            **{f"model_args.{k}": v for k, v in base.items()},
            "optimizer.name": "adamw",
            "optimizer.lr": 1e-3,
            "optimizer.warmup_steps": max(1, args.pretrain_steps // 10),
            "max_steps": args.pretrain_steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "eval_every": 0,
            "checkpoint_every": 0,
            "sample.max_new_tokens": 0,
            "loss_plot": "false",
            "progress_bar": "false",
        }
        run([*MEMFIT, "pretrain", *(f"{k}={v}" for k, v in settings.items())], work / "pretrain.log", env)
        run([*MEMFIT, "export", "--checkpoint", str(run_dir), "--out", str(hf)], work / "export.log", env)
    return hf


def finetune(name: str, overrides: dict[str, Any], hf: Path, data: Path, work: Path, args, env) -> dict:
    out = work / "ft" / name.split(" (")[0].replace(" ", "_")
    settings = {
        "checkpoint_dir": hf,
        "method": "full",
        "data.path": data,
        "data.format": "alpaca",
        "data.template": "alpaca",
        "data.val_fraction": 0.1,
        "data.packing": "true",
        "output_dir": out,
        "optimizer.lr": LR,
        "optimizer.min_lr": LR / 10,
        "optimizer.warmup_steps": max(1, args.steps // 10),
        "optimizer.weight_decay": 0.0,
        "max_grad_norm": 0,
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "eval_every": args.eval_every,
        "eval_batches": args.eval_batches,
        "checkpoint_every": 0,
        "keep_last_checkpoints": 1,
        "sample.max_new_tokens": 0,
        "loss_plot": "false",
        "progress_bar": "false",
        "preflight": "false",
        **overrides,
    }
    settings["optimizer.min_lr"] = float(settings["optimizer.lr"]) / 10
    wall = run(
        [*MEMFIT, "finetune", *(f"{k}={v}" for k, v in settings.items())], work / f"{out.name}.log", env
    )
    recs = records(out)
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    steps = [r for r in recs if "loss" in r and "tokens_per_second_per_gpu" in r]
    row = {
        "name": name,
        "settings": {k: str(v) for k, v in overrides.items()},
        "val": val,
        "final_val_loss": val[-1][1],
        "final_train_loss": steps[-1]["loss"] if steps else None,
        "wall_s": round(wall, 1),
        "tokens_per_second_per_gpu": statistics.median(
            r["tokens_per_second_per_gpu"] for r in steps[1:] or steps
        ),
    }
    print(f"{name}: val {row['final_val_loss']:.4f} ({wall:.0f} s)", file=sys.stderr, flush=True)
    return row


def quality(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict:
    hf = pretrain(work, args, env)
    data = work / "stdlib_instruct.json"
    count = write_instructions(data, args.records)
    rows = [finetune(name, overrides, hf, data, work, args, env) for name, overrides in RUNS]
    reference = rows[0]["final_val_loss"]
    for row in rows:
        row["gap_to_fp32"] = (row["final_val_loss"] - reference) / reference
    params = json.loads((hf / "config.json").read_text())
    return {"rows": rows, "records": count, "base": params, "steps": args.steps}


# ----------------------------------------------------------------------------------------------------------------
# The update's time under each rounding
# ----------------------------------------------------------------------------------------------------------------

UPDATE_PROBE = r"""
import json, statistics, sys, time, warnings, torch
warnings.filterwarnings("ignore")
from memfit.config import OptimizerConfig
from memfit.memory.optim import build_optimizer
size, rounds = int(sys.argv[1]), int(sys.argv[2])
sides = {}
for name in ("adamw", "torchao_adamw4bit"):
    for mode in ("nearest", "stochastic", "kahan"):
        p = torch.nn.Parameter(torch.randn(size, size, dtype=torch.bfloat16) * 0.02)
        opt = build_optimizer(torch.nn.ParameterDict({"w": p}), OptimizerConfig(name=name, lr=1e-4), rounding=mode)
        p.grad = torch.randn_like(p) * 1e-3
        opt.step()  # state made
        sides[(name, mode)] = (p, opt, [])
for r in range(rounds):
    keys = list(sides)
    for key in keys[r % len(keys):] + keys[: r % len(keys)]:
        p, opt, times = sides[key]
        t = time.perf_counter(); opt.step(); times.append(time.perf_counter() - t)
print(json.dumps({f"{n} {m}": statistics.median(t) for (n, m), (_, _, t) in sides.items()}))
"""


def update_times(args: argparse.Namespace, env: dict[str, str]) -> dict:
    size, rounds = (256, 3) if args.quick else (4096, 9)
    out = subprocess.run(
        [sys.executable, "-c", UPDATE_PROBE, str(size), str(rounds)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    medians = json.loads(out.stdout.strip().splitlines()[-1])
    factors = {
        name: {
            mode: medians[f"{name} {mode}"] / medians[f"{name} nearest"] for mode in ("stochastic", "kahan")
        }
        for name in ("adamw", "torchao_adamw4bit")
    }
    return {"size": size, "rounds": rounds, "seconds": medians, "factors": factors}


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------


def quality_section(result: dict, command: str) -> str:
    base = result["base"]
    lines = [
        "### bf16 weights that learn: validation loss by rounding and optimizer",
        "",
        f"A {base['hidden_size']}-wide, {base['num_hidden_layers']}-layer Llama (vocabulary "
        f"{base['vocab_size']:,}) pretrained by memfit on this Python's standard library and Tiny Shakespeare, "
        f"then fine-tuned (every weight) on {result['records']:,} instruction records built from the standard "
        f"library's packages, 10% held out; {result['steps']} steps each, the same batches, schedule and seed, "
        f"peak lr {LR:g} (Adafactor: 1e-3, relative), no clipping. The validation loss after the last step "
        f"(nats/token), and its gap to fp32 AdamW's:",
        "",
        "| run | validation loss | gap to fp32 AdamW | train loss (last step) |",
        "|---|---:|---:|---:|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['name']} | {row['final_val_loss']:.4f} | {100 * row['gap_to_fp32']:+.2f}% | "
            f"{row['final_train_loss']:.4f} |"
        )
    gap = {row["name"]: 100 * row["gap_to_fp32"] for row in result["rows"]}
    stochastic, nearest = gap["bf16 stochastic adamw"], gap["bf16 nearest adamw"]
    lines += [
        "",
        f"The goal, bf16 with stochastic rounding within 1% of fp32 AdamW: {stochastic:+.2f}% "
        f"({'met' if abs(stochastic) <= 1 else 'missed'}); rounded to nearest, the same AdamW is "
        f"{nearest:+.2f}% and torchtune's recipe {gap[RUNS[2][0]]:+.2f}%: at fine-tuning rates most updates are "
        f"below half a bf16 step of the weight and cancel. Kahan's compensation ({gap['bf16 kahan adamw']:+.2f}%) "
        f"does as well as stochastic rounding for 2 bytes/parameter more, and 8-bit AdamW state "
        f"({gap['bf16 stochastic adamw8bit']:+.2f}%) costs nothing here. The other optimizers' gaps are their "
        f"update rules' at one learning rate each (4-bit state, APOLLO-Mini, Adafactor, Muon), not the rounding's. "
        f"So `bf16_rounding` defaults to `auto`: stochastic wherever the optimizer can round so.",
        "",
        f"Reproduce: `{command} --part quality` (the losses do not depend on the machine's load).",
    ]
    return "\n".join(lines)


def update_section(result: dict, command: str) -> str:
    lines = [
        "### The update's time under each rounding",
        "",
        f"One optimizer step of a ({result['size']:,} x {result['size']:,}) bf16 weight, median of "
        f"{result['rounds']} interleaved rounds, as a multiple of the same optimizer rounding to nearest:",
        "",
        "| optimizer | nearest (s) | stochastic | kahan |",
        "|---|---:|---:|---:|",
    ]
    for name, factors in result["factors"].items():
        lines.append(
            f"| {name} | {result['seconds'][f'{name} nearest']:.3f} | {factors['stochastic']:.2f}x | "
            f"{factors['kahan']:.2f}x |"
        )
    lines += ["", f"Reproduce: `{command} --part update`, alone on the machine."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        nargs="*",
        default=["quality", "update"],
        choices=["quality", "update"],
        help="what to run (none: rewrite the sections from docs/bf16_rounding.json)",
    )
    parser.add_argument("--steps", type=int, default=40, help="fine-tuning steps of each run")
    parser.add_argument("--pretrain-steps", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=20)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few steps: a smoke test")
    parser.add_argument("--workdir", type=Path, default=None, help="keeps the base model between invocations")
    parser.add_argument(
        "--out", default=None, help="the markdown file to rewrite (default docs/benchmarks.md)"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.pretrain_steps, args.batch_size, args.seq_len = 4, 4, 2, 512
        args.eval_every, args.eval_batches, args.records, args.vocab_size = 4, 2, 60, 512
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bf16_rounding_"))
    work.mkdir(parents=True, exist_ok=True)
    results_path = ROOT / "docs" / "bf16_rounding.json"
    results = json.loads(results_path.read_text()) if results_path.exists() and not args.quick else {}
    if "quality" in args.part:
        results["quality"] = quality(args, work, env)
    if "update" in args.part:
        results["update"] = update_times(args, env)
    argv, skipping = [], False
    for arg in sys.argv[1:]:  # the command without --part and its values: each section adds its own
        if arg == "--part":
            skipping = True
        elif skipping and arg in ("quality", "update"):
            continue
        else:
            skipping = False
            argv.append(arg)
    command = reproduce_command(argv, "bench/bf16_rounding.py")
    sections = {}
    if "quality" in results:
        sections["bf16-rounding"] = quality_section(results["quality"], command)
    if "update" in results:
        sections["bf16-rounding-update"] = update_section(results["update"], command)
    if args.quick and args.out is None:
        print("\n\n".join(sections.values()))
        return 0
    doc = Path(args.out) if args.out else ROOT / "docs" / "benchmarks.md"
    for name, text in sections.items():
        write_section(doc, name, text)
    if not args.quick:
        results_path.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
