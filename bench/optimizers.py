"""The optimizers that keep less state against AdamW and the low-bit AdamWs, on CPU, one fresh process per run.

Five parts (``--part state quality seeds predict muon-speed``, all by default):

- **state** — the 78.6M model of ``bench/peers.py`` (dim 768, 12 layers, 12/4 heads, SwiGLU 2048, vocabulary
  2,048; a random-init Hugging Face checkpoint fine-tuned with ``memfit finetune method=full``, fp32, batch 4 x 256,
  constant lr 1e-3), each optimizer eagerly and with ``optimizer_in_backward`` (``max_grad_norm=0``): the tracked
  ``optimizer_state`` (a 2-step run with ``track_memory=true``: the bytes of the state tensors the tracker finds,
  GiB = 1024**3), then, in a run of ``--steps`` untracked steps, the process's peak RSS (``ru_maxrss``) and
  tokens/s over the steps after ``--warmup``; the estimator's closed form of the state beside the tracked bytes.
- **quality** — the main job (``memfit pretrain`` with no other keys: the 5.2M-parameter Llama on Tiny Shakespeare,
  250 steps of 16 x 256 tokens, warm-up 25 steps then cosine decay to a tenth) with each optimizer at each of its
  learning rates (``--sweep``; the rest at their recommended defaults), validation every 25 steps: the final
  validation loss, and the steps and training seconds (the step records' time, evaluation left out) at which the
  validation loss first reaches AdamW's final one at the main job's default learning rate.
- **seeds** — AdamW and Muon at the main job's lr with other seeds (``--seeds``, default 1): does Muon's lead
  over AdamW hold beyond the seed spread?
- **muon-speed** — Muon's Newton-Schulz iteration in bf16 (torch's) and in fp32 against AdamW, in one process
  per model whose steps interleave the sides (round after round, in rotated order), so that a shared machine
  slows them alike: the 0.8M model (4 layers of 128, 4/2 heads, SwiGLU 344, 68 ids: character-level Shakespeare,
  12 x 64 tokens) and the 78.6M one (4 x 256 tokens), each natively and under ``ONEDNN_MAX_CPU_ISA=AVX512_CORE``
  (a CPU without bf16 instructions, as oneDNN sees it); median step time per side, tokens/s and its ratio to
  AdamW's, and which dtype ``muon_ns_dtype=auto`` picked there.
- **predict** — ``memfit estimate`` of the Llama-3-8B full fine-tune on one GPU (``configs/
  llama3_8b_full_single_device.yaml``: bf16, the optimizer in backward, full checkpointing, chunked
  cross-entropy) with each optimizer: its state and the predicted peak.

Reproduce (about 90 minutes on 2 CPU cores, alone on the machine)::

    .venv/bin/python bench/optimizers.py

It rewrites the sections ``optimizers``, ``optimizers-quality``, ``optimizers-seeds`` and ``optimizers-8b`` of
``docs/benchmarks.md`` and writes ``docs/optimizers_results.json``; ``--out -`` prints them instead; ``--quick`` is
a smoke test (a tiny model, 3 steps; quality: 20 steps, one rate each); ``--from-results`` rewrites the sections
from the JSON without running anything (the parts may be run apart, each alone on the machine).
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
from typing import Any

from docs_section import write_section
from peers import MODELS, ROOT, prepare_inputs, reproduce_command, run_measured, run_memfit

GIB = 1024**3
STATE_OPTIMIZERS = (
    "adamw",
    "adamw8bit",
    "paged_adamw8bit",
    "torchao_adamw4bit",
    "muon",
    "adafactor",
    "apollo",
    "apollo_mini",
    "adam_mini",
)
# optimizer -> learning rates of the main job's sweep. AdamW: the main job's default and twice it. Muon with
# match_rms_adamw (memfit's default): AdamW's learning rate carries over (Moonlight), and twice it. APOLLO-Mini:
# the main job's rate and the authors' 1e-2 for small models. Adafactor: its lr caps a step relative to each
# parameter's RMS (torch's default 1e-2) and 3x that.
SWEEP = {
    "adamw": (2e-3, 4e-3),
    "muon": (2e-3, 4e-3),
    "apollo_mini": (2e-3, 1e-2),
    "adafactor": (1e-2, 3e-2),
}
REFERENCE = ("adamw", 2e-3)  # the main job as it ships
DEFAULT_SEED = 1337  # the main job's


def closed_form_state(model_dir: Path, name: str, env: dict[str, str]) -> int:
    """The estimator's closed form of the optimizer state of a full fine-tune of ``model_dir``, in bytes."""
    code = (
        "import json, sys\n"
        "from memfit.config import load_config\n"
        "from memfit.build import run_model_config\n"
        "from memfit.planner.closed_form import model_state_bytes_closed_form\n"
        f"cfg = load_config(None, ['checkpoint_dir={model_dir}', 'method=full', 'optimizer.name={name}'])\n"
        "print(model_state_bytes_closed_form(cfg, run_model_config(cfg))['optimizer_state'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def tracked_state(
    args: argparse.Namespace, env: dict, overrides: dict, checkpoint: Path, data: Path, out: Path
):
    """The tracked ``optimizer_state`` in bytes of a 2-step run (the state exists after step 1)."""
    short = argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 0})
    result = run_memfit(short, env, {**overrides, "track_memory": "true"}, checkpoint, data, out)
    if "error" in result:
        return None, result["error"]
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "memory_breakdown" in r][-1]
    return round(last["memory_breakdown"]["optimizer_state"] * GIB), None


def state_part(args: argparse.Namespace, env: dict[str, str], work: Path) -> list[dict]:
    data, models = prepare_inputs(args, work, env)
    (model,) = args.grid
    checkpoint = work / f"checkpoint_{model}"
    rows = []
    for name in args.optimizers:
        for in_backward in (False, True):
            overrides: dict[str, Any] = {"optimizer.name": name, "optimizer.weight_decay": 0.1}
            if in_backward:
                overrides.update({"optimizer_in_backward": "true", "max_grad_norm": 0})
            label = f"{name}{' + in backward' if in_backward else ''}"
            out = work / "runs" / label.replace(" ", "_").replace("+", "")
            state, error = tracked_state(args, env, overrides, checkpoint, data, out / "tracked")
            result = run_memfit(args, env, overrides, checkpoint, data, out / "timed")
            row = {
                "optimizer": name,
                "in_backward": in_backward,
                "tracked_state_bytes": state,
                "closed_form_state_bytes": closed_form_state(checkpoint, name, env),
                "num_params": models[model]["num_params"],
                **{k: result.get(k) for k in ("rss_mib", "tokens_per_second", "losses", "error")},
            }
            if error:
                row["error"] = error
            rows.append(row)
            print(
                f"{label}: state {state} B, RSS {row['rss_mib']:,.0f} MiB, "
                f"{row['tokens_per_second'] or 0:,.0f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    return rows


def seconds_to(records: list[dict], step: int, tokens_per_step: int) -> float:
    """Training seconds up to the end of ``step`` from the step records (each over the steps since the last)."""
    seconds, previous = 0.0, 0
    for r in records:
        if r["step"] > step:
            break
        seconds += (r["step"] - previous) * tokens_per_step / r["tokens_per_second_per_gpu"]
        previous = r["step"]
    return seconds


def main_job_run(args: argparse.Namespace, env: dict[str, str], work: Path, name: str, lr: float, seed=None):
    """One run of the main job with ``name`` at ``lr`` (and ``seed``, if given): its validation curve, step records,
    final validation loss and training seconds."""
    out = work / "quality" / f"{name}_{lr:g}{'' if seed is None else f'_seed{seed}'}"
    settings = {
        "output_dir": out / "run",
        "optimizer.name": name,
        "optimizer.lr": lr,
        "optimizer.min_lr": lr / 10,
        "eval_every": 25,
        "log_every": 5,
        "sample.max_new_tokens": 0,
        "progress_bar": "false",
        **({} if seed is None else {"seed": seed}),
        **({"max_steps": args.quality_steps, "eval_every": 5} if args.quick else {}),
    }
    cmd = [sys.executable, "-m", "memfit", "pretrain", *(f"{k}={v}" for k, v in settings.items())]
    code, rss, wall, _ = run_measured(cmd, env, out)
    row: dict[str, Any] = {"optimizer": name, "lr": lr, "rss_mib": rss, "wall_seconds": wall}
    if seed is not None:
        row["seed"] = seed
    if code != 0:
        row["error"] = (out / "stderr.txt").read_text().strip().splitlines()[-1][:160]
    else:
        records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r and "tokens_per_second_per_gpu" in r]
        row["val"] = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        row["records"] = [{k: r[k] for k in ("step", "loss", "tokens_per_second_per_gpu")} for r in steps]
        row["final_val_loss"] = row["val"][-1][1]
        row["train_seconds"] = seconds_to(row["records"], 10**9, 16 * 256)
    print(
        f"{name} lr {lr:g} seed {seed}: final val {row.get('final_val_loss')}, {wall:.0f} s", file=sys.stderr
    )
    return row


def reach(rows: list[dict], target: float) -> None:
    """Set each row's ``steps_to_target`` and ``seconds_to_target``: the first validation at or below ``target``."""
    for row in rows:
        if "error" in row:
            continue
        reached = next((s for s, v in row["val"] if v <= target), None)
        row["steps_to_target"] = reached
        row["seconds_to_target"] = seconds_to(row["records"], reached, 16 * 256) if reached else None


def quality_part(args: argparse.Namespace, env: dict[str, str], work: Path) -> list[dict]:
    rows = [main_job_run(args, env, work, name, lr) for name, rates in args.sweep.items() for lr in rates]
    reference = next(r for r in rows if (r["optimizer"], r["lr"]) == REFERENCE and "error" not in r)
    reach(rows, reference["final_val_loss"])
    return rows


def seeds_part(args: argparse.Namespace, env: dict[str, str], work: Path) -> list[dict]:
    """AdamW and Muon at the main job's lr with other seeds (the seed sets the initial weights and the batches):
    each Muon run against its own seed's AdamW."""
    rows = []
    for seed in args.seeds:
        pair = [
            main_job_run(args, env, work, name, lr, seed) for name, lr in (REFERENCE, ("muon", REFERENCE[1]))
        ]
        if "error" not in pair[0]:
            reach(pair, pair[0]["final_val_loss"])
        rows += pair
    return rows


PREDICT_CONFIG = ROOT / "configs" / "llama3_8b_full_single_device.yaml"


def predict_part(args: argparse.Namespace, env: dict[str, str]) -> list[dict]:
    """``memfit estimate --json`` of the seed recipe (Llama-3-8B full fine-tune on one GPU: bf16, full activation
    checkpointing, chunked cross-entropy, the optimizer in backward, batch 2 x 2048) with each optimizer."""
    rows = []
    for name in args.optimizers:
        cmd = [sys.executable, "-m", "memfit", "estimate", "--config", str(PREDICT_CONFIG), "device=cuda"]
        cmd += [f"optimizer.name={name}", "--json"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            rows.append({"optimizer": name, "error": done.stderr.strip().splitlines()[-1][:160]})
            continue
        e = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "optimizer": name,
                "peak_gib": e["peak_memory_gib"],
                "reserved_gib": e["peak_memory_reserved_gib"],
                "state_gib": e["model_states_gib"]["optimizer_state"],
                "paged_gib": e["model_states_gib"]["paged_optimizer_state"],
                "parameters_gib": e["model_states_gib"]["parameters"],
                "phase": e["phase"],
                "num_params": e["num_params"],
                "seconds": e["seconds"],
            }
        )
        print(f"8B {name}: peak {rows[-1]['peak_gib']:.2f} GiB", file=sys.stderr, flush=True)
    return rows


MUON_SPEED_MODELS = {
    # name: (shape, vocabulary, batch, seq_len, rounds natively, rounds without bf16 instructions)
    "0.8M": ({"dim": 128, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 344}, 68, 12, 64,
             21, 11),
    "78.6M": (MODELS["78.6M"], 2048, 4, 256, 4, 2),
}  # fmt: skip
MUON_SIDES = {"adamw": {"name": "adamw"}, "muon bf16": {"name": "muon", "muon_ns_dtype": "bf16"},
              "muon fp32": {"name": "muon", "muon_ns_dtype": "fp32"}}  # fmt: skip


def muon_speed_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """In this process: one model per side from the same initial weights, ``rounds`` rounds of one training step
    of each side (the order rotated each round), random token batches; the median step seconds of each side after
    the first round (the state is made in it)."""
    import statistics

    import torch

    from memfit.config import OptimizerConfig
    from memfit.memory import hybrids
    from memfit.memory.optim import build_optimizer
    from memfit.models.config import DecoderConfig
    from memfit.models.decoder import build_decoder
    from memfit.step import train_step

    shape, vocab, batch, seq_len, rounds = (spec[k] for k in ("shape", "vocab", "batch", "seq_len", "rounds"))
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    mcfg = DecoderConfig(vocab_size=vocab, max_seq_len=seq_len, **shape)
    runs = {}
    for side, opt in MUON_SIDES.items():
        model = build_decoder(mcfg, seed=0)
        runs[side] = (model, build_optimizer(model, OptimizerConfig(lr=1e-3, weight_decay=0.1, **opt)))
    gen = torch.Generator().manual_seed(0)
    seconds: dict[str, list[float]] = {side: [] for side in runs}
    sides = list(runs)
    for r in range(rounds):
        x = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen)
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            model, opt = runs[side]
            t0 = time.perf_counter()
            train_step(model, opt, [(x[:, :-1], x[:, 1:])], max_grad_norm=1.0, dtype="fp32").loss.item()
            if r:
                seconds[side].append(time.perf_counter() - t0)
    median = {side: statistics.median(v) for side, v in seconds.items()}
    return {
        "num_params": sum(p.numel() for p in runs["adamw"][0].parameters()),
        "auto": str(hybrids.newton_schulz_dtype("auto", "cpu")).removeprefix("torch."),
        "bf16_fast": hybrids.cpu_bf16_matmuls_fast(),
        "step_seconds": median,
        "tokens_per_second": {side: batch * seq_len / t for side, t in median.items()},
        "rounds": rounds,
        "threads": torch.get_num_threads(),
    }


def muon_speed_part(args: argparse.Namespace, env: dict[str, str], work: Path) -> list[dict]:
    rows = []
    for model, (shape, vocab, batch, seq_len, native, emulated) in MUON_SPEED_MODELS.items():
        if args.quick and model != "0.8M":
            continue
        for isa, rounds in (("", native), ("AVX512_CORE", emulated)):
            spec = {"shape": shape, "vocab": vocab, "batch": batch, "seq_len": seq_len,
                    "rounds": 3 if args.quick else rounds, "threads": args.threads}  # fmt: skip
            run_env = {**env, **({"ONEDNN_MAX_CPU_ISA": isa} if isa else {})}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--muon-speed-worker", json.dumps(spec)]
            done = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
            row: dict[str, Any] = {"model": model, "isa": isa or "native", "batch": batch, "seq_len": seq_len}
            if done.returncode != 0:
                row["error"] = done.stderr.strip().splitlines()[-1][:160]
            else:
                row.update(json.loads(done.stdout.strip().splitlines()[-1]))
            rows.append(row)
            print(
                f"muon speed {model} {row['isa']}: {row.get('tokens_per_second')}",
                file=sys.stderr,
                flush=True,
            )
    return rows


def muon_speed_table(rows: list[dict]) -> str:
    lines = [
        "| model | tokens a step | bf16 matmuls | `auto` picks | AdamW tok/s | Muon bf16 tok/s | vs AdamW | "
        "Muon fp32 tok/s | vs AdamW | Muon `auto` vs AdamW |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['batch']} x {r['seq_len']} | "
        isa = "AMX (native)" if r["isa"] == "native" else f"`ONEDNN_MAX_CPU_ISA={r['isa']}`"
        if r.get("error"):
            lines.append(f"{head}{isa} | failed: {r['error']} |")
            continue
        tps = r["tokens_per_second"]
        auto = "muon bf16" if r["auto"] == "bfloat16" else "muon fp32"
        lines.append(
            f"{head}{isa} | {'bf16' if r['auto'] == 'bfloat16' else 'fp32'} | {tps['adamw']:,.0f} | "
            f"{tps['muon bf16']:,.0f} | {tps['muon bf16'] / tps['adamw']:.2f} | {tps['muon fp32']:,.0f} | "
            f"{tps['muon fp32'] / tps['adamw']:.2f} | **{tps[auto] / tps['adamw']:.2f}** |"
        )
    return "\n".join(lines)


def muon_speed_section(args: argparse.Namespace, rows: list[dict], command: str, results: dict) -> str:
    rounds = ", ".join(f"{r['model']} {r['isa']}: {r.get('rounds')}" for r in rows)
    return (
        f"Reproduce: `{command}` (`--part muon-speed`). One process per row; one model per side from the same "
        f"initial weights (fp32, eager, random token batches, clipping at 1.0), their training steps interleaved "
        f"round after round in rotated order, tok/s from each side's median step after the first round "
        f"(rounds: {rounds}), torch threads: {rows[0].get('threads')}; the machine was shared with other "
        f"engineers' test runs, which slow every side of a row alike but not every row alike: compare ratios "
        f"within a row. The bf16 column says whether "
        f"oneDNN could use the CPU's bf16 instructions (`ONEDNN_MAX_CPU_ISA=AVX512_CORE` hides AMX and "
        f"AVX512-BF16 from it, as on a CPU without them), and `auto` is `optimizer.muon_ns_dtype=auto`'s pick "
        f"there.\n\n{muon_speed_table(rows)}"
    )


def predict_table(rows: list[dict]) -> str:
    lines = [
        "| optimizer | state (GiB) | of it paged (GiB) | predicted allocator peak (GiB) | reserved (GiB) | at |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| `{r['optimizer']}` | failed: {r['error']} |")
            continue
        lines.append(
            f"| `{r['optimizer']}` | {r['state_gib']:.2f} | {r['paged_gib']:.2f} | {r['peak_gib']:.2f} | "
            f"{r['reserved_gib']:.2f} | {r['phase']} |"
        )
    return "\n".join(lines)


def _mib(b: int | None) -> str:
    return "" if b is None else f"{b / 2**20:,.1f}"


def state_table(rows: list[dict]) -> str:
    adamw = next(r for r in rows if r["optimizer"] == "adamw" and not r["in_backward"])
    lines = [
        "| optimizer | in backward | tracked `optimizer_state` (MiB) | closed form (MiB) | bytes/param | vs AdamW | "
        "peak RSS (MiB) | tok/s | tok/s vs AdamW | step-1 -> last loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(
                f"| `{r['optimizer']}` | {'yes' if r['in_backward'] else ''} | failed: {r['error']} |"
            )
            continue
        state = r["tracked_state_bytes"]
        speed = (
            r["tokens_per_second"] / adamw["tokens_per_second"] if adamw.get("tokens_per_second") else None
        )
        lines.append(
            f"| `{r['optimizer']}` | {'yes' if r['in_backward'] else ''} | {_mib(state)} | "
            f"{_mib(r['closed_form_state_bytes'])} | {state / r['num_params']:.2f} | "
            f"{state / adamw['tracked_state_bytes']:.2f} | {r['rss_mib']:,.0f} | {r['tokens_per_second']:,.0f} | "
            f"{speed:.2f} | {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f} |"
        )
    return "\n".join(lines)


def quality_table(rows: list[dict]) -> str:
    target = next(r for r in rows if (r["optimizer"], r["lr"]) == REFERENCE)["final_val_loss"]
    lines = [
        f"Target: AdamW's final validation loss at the main job's lr {REFERENCE[1]:g}, **{target:.4f}**.",
        "",
        "| optimizer | lr | final val loss | steps to target | training s to target | training s (250 steps) | "
        "tok/s | peak RSS (MiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.get("error"):
            lines.append(f"| `{r['optimizer']}` | {r['lr']:g} | failed: {r['error']} |")
            continue
        tokens = 16 * 256 * r["records"][-1]["step"]
        to_target = "" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.0f}"
        lines.append(
            f"| `{r['optimizer']}` | {r['lr']:g} | {r['final_val_loss']:.4f} | {r['steps_to_target'] or 'not reached'} "
            f"| {to_target} | {r['train_seconds']:.0f} | {tokens / r['train_seconds']:,.0f} | {r['rss_mib']:,.0f} |"
        )
    return "\n".join(lines)


def seeds_table(rows: list[dict], quality: list[dict] | None) -> str:
    """Final validation losses by seed: the default seed's from the quality part's rows (if there), then the others."""
    pairs = (REFERENCE, ("muon", REFERENCE[1]))
    default = [{**r, "seed": DEFAULT_SEED} for r in quality or [] if (r["optimizer"], r["lr"]) in pairs]
    everything = default + rows
    lines = [
        "| seed | optimizer | lr | final val loss | Muon - AdamW | steps to this seed's AdamW final loss |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in everything:
        if r.get("error"):
            lines.append(f"| {r['seed']} | `{r['optimizer']}` | {r['lr']:g} | failed: {r['error']} |")
            continue
        adamw = next((a for a in everything if a["optimizer"] == "adamw" and a["seed"] == r["seed"]), None)
        gap = ""
        if r["optimizer"] != "adamw" and adamw is not None and "error" not in adamw:
            gap = f"{r['final_val_loss'] - adamw['final_val_loss']:+.4f}"
        lines.append(
            f"| {r['seed']} | `{r['optimizer']}` | {r['lr']:g} | {r['final_val_loss']:.4f} | {gap} | "
            f"{r.get('steps_to_target') or 'not reached'} |"
        )
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--part",
        nargs="+",
        choices=("state", "quality", "seeds", "predict", "muon-speed"),
        default=["state", "quality", "seeds", "predict", "muon-speed"],
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], help="of the seeds part")
    parser.add_argument(
        "--from-results",
        action="store_true",
        help="rewrite the sections from docs/optimizers_results.json only",
    )
    parser.add_argument("--optimizers", nargs="+", default=list(STATE_OPTIMIZERS), help="of the state part")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of the state part")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of tokens/s")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument(
        "--threads", type=int, default=0, help="muon-speed: torch's threads (0: its default, one per core)"
    )
    parser.add_argument("--workdir", default=None, help="reuse its prepared data and checkpoint")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    args.grid = {"tiny" if args.quick else "78.6M": None}
    args.sweep = {k: v[:1] for k, v in SWEEP.items()} if args.quick else SWEEP
    args.quality_steps = 20
    if args.quick:
        args.steps, args.warmup = 3, 1
    assert set(args.grid) <= set(MODELS)
    return args


def state_section(args: argparse.Namespace, rows: list[dict], command: str, results: dict) -> str:
    return (
        f"Reproduce: `{command}` (state part: `--part state`). Model 78.6M of `bench/peers.py` "
        f"({rows[0]['num_params']:,} parameters), `memfit finetune method=full`, fp32, batch "
        f"{args.batch_size} x {args.seq_len}, constant lr {args.lr:g}, weight decay 0.1; tok/s over steps "
        f"{args.warmup + 1}-{args.steps}; each optimizer's defaults (`apollo`: rank 192 = width / 4; "
        f"`apollo_mini`: rank 1). MiB = 1024**2 bytes.\n\n{state_table(rows)}"
    )


def quality_section(args: argparse.Namespace, rows: list[dict], command: str, results: dict) -> str:
    return (
        f"Reproduce: `{command}` (quality part: `--part quality`). The main job (`memfit pretrain`: 5.2M "
        f"parameters, Tiny Shakespeare, 250 steps of 16 x 256 tokens, warm-up 25 steps, cosine to lr / 10), "
        f"validation every 25 steps (10 batches); training seconds from the step records (evaluation left "
        f"out); one run each, in turn, alone on 2 cores.\n\n{quality_table(rows)}"
    )


def seeds_section(args: argparse.Namespace, rows: list[dict], command: str, results: dict) -> str:
    return (
        f"Reproduce: `{command}` (`--part seeds`; the seed-{DEFAULT_SEED} rows are the quality part's). The main "
        f"job with AdamW and Muon at lr {REFERENCE[1]:g} and other seeds (a seed sets the initial weights and the "
        f"batches); the main job's spread over seeds with AdamW is 0.06-0.11 nats (the second table of this "
        f"page).\n\n{seeds_table(rows, results.get('quality'))}"
    )


def predict_section(args: argparse.Namespace, rows: list[dict], command: str, results: dict) -> str:
    return (
        f"Reproduce: `{command}` (`--part predict`): `memfit estimate --config "
        f"configs/llama3_8b_full_single_device.yaml device=cuda optimizer.name=NAME --json` (Llama-3-8B, "
        f"{rows[0].get('num_params', 0):,} parameters, full fine-tune on one GPU: bf16, `optimizer_in_backward`, "
        f"full activation checkpointing, chunked cross-entropy, batch 2 x 2048; each optimizer at its defaults: "
        f"`apollo` rank 1024 = width / 4). Weights 14.96 GiB in every row. GiB = 1024**3 bytes.\n\n"
        f"{predict_table(rows)}"
    )


# part -> (how it runs, its section of docs/benchmarks.md, how the section reads)
PARTS = {
    "state": (state_part, "optimizers", state_section),
    "quality": (quality_part, "optimizers-quality", quality_section),
    "seeds": (seeds_part, "optimizers-seeds", seeds_section),
    "predict": (lambda args, env, work: predict_part(args, env), "optimizers-8b", predict_section),
    "muon-speed": (muon_speed_part, "optimizers-muon-speed", muon_speed_section),
}


def main() -> int:
    if sys.argv[1:2] == ["--muon-speed-worker"]:
        print(json.dumps(muon_speed_worker(json.loads(sys.argv[2]))))
        return 0
    args = parse_args()
    started = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="memfit_optimizers_bench_"))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    results_path = ROOT / "docs" / "optimizers_results.json" if args.out != "-" else work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    command = reproduce_command([a for a in args.argv if a != "--from-results"], "bench/optimizers.py")
    sections = {}
    for part in args.part:
        run, name, section = PARTS[part]
        if not args.from_results:
            results[part] = run(args, env, work)
        sections[name] = section(args, results[part], command, results)
    results_path.write_text(json.dumps(results, indent=1))
    for name, text in sections.items():
        if args.out == "-":
            print(f"<!-- {name} -->\n{text}\n")
        else:
            write_section(Path(args.out), name, text)
    print(f"done in {time.perf_counter() - started:.0f} s; work directory {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
