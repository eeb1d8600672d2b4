"""Preference tuning (DPO) at the largest sizes this machine holds: memfit's predicted peak host memory against the
measured one, phase by phase, beside TRL's ``DPOTrainer`` on the same directory and pairs under the same cap.

Rows (``--rows``, default all, run in this order; each one fresh process):

- ``3b-dpo``: **Llama-3.2-3B full DPO** (every weight trained), bf16 (``bf16_rounding=auto``: stochastic), one pair
  a step (its chosen and rejected rows, each at most 512 tokens), 2 steps and the final checkpoint, with the
  switches ``memfit plan budget=20GiB device=cpu checkpoint_dir=DIR method=full objective=dpo batch_size=1
  seq_len=512 dtype=bf16 DATA --out plan.yaml`` writes, run as written (``memfit finetune --config plan.yaml``
  plus run-length and output overrides). The reference log-probabilities are precomputed by the starting weights
  before training (``preference.reference=auto``: ``precomputed``) into a fresh ``reference_dir``: that pass is a
  phase of its own, predicted (``phase_peaks_gib["reference"]``) and measured.
- ``3b-dpo-trl``: **TRL 1.13's ``DPOTrainer``** on the same directory and pairs (``bench/trl_dpo.py``: bf16
  weights, ``precompute_ref_log_probs=True``, gradient checkpointing, AdamW, batch 1, 2 steps) under a hard memory
  cap (``--cap-gib``, 22 by default, as ``bench/largest_model.py`` caps its peers); the row records where it stops,
  or its peak.
- ``8b-qlora-dpo``: **Llama-3.1-8B QLoRA DPO**: the bf16 base quantized to NF4 as it loads, LoRA rank 16 (alpha
  32) on all seven decoder linears, bf16, full activation checkpointing and the chunked loss, one pair a step at
  most 512 tokens a row, 2 steps; the reference is the base with the adapters off (``preference.reference=auto``:
  ``lora_off``), computed inside each step: no second model.
- ``8b-qlora-dpo-trl``: **TRL's ``DPOTrainer`` with PEFT QLoRA** (``bench/trl_dpo.py``: bitsandbytes NF4 with
  double quantization and bf16 compute, ``prepare_model_for_kbit_training``, the same rank and targets; TRL's
  reference is the adapters-off base too), under the cap.

The models are ``bench/largest_model.py``'s random Hugging Face directories (``bench/random_hf.py``: Meta's
configs, GPT-2's tokenizer), written once under ``--workdir`` and shared with that script. The pairs are 6 made
from the Dolly sample (:func:`long_pairs`: a record's instruction, and two runs of the responses after it, each
longer than 512 tokens), rendered with ``data.template=chatml``: every row is cut to 513 tokens, so every step
holds rows as long as the estimate's (the longest the data has), as the packed rows of ``bench/largest_model.py``
do.

Measured as ``bench/largest_model.py`` measures (``memfit_run``: ``/usr/bin/time -v``'s peak RSS, the process
tree's RSS sampled every 0.1 s and split into phases at the lines memfit prints: load to ``reference
log-probabilities ... computing``, reference to the banner, then the first step, the steady step to the save's
first line, the save). The
rows go into ``docs/largest_model.json`` beside that script's (a row run again replaces its entry) and this
script rewrites the section between the ``preference`` markers of ``docs/benchmarks.md``.

Reproduce (the machine to itself; about 15 minutes for ``3b-dpo``, an hour for ``8b-qlora-dpo``, its load
quantizing ~7B weights)::

    .venv/bin/python bench/preference.py
    .venv/bin/python bench/preference.py --rows 3b-dpo 3b-dpo-trl
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from docs_section import write_section
from largest_model import LORA_TARGETS, _memfit, _shown, _switches, measured_row, memfit_run, store_row
from measured_run import gib, memory_cap, run_measured, split_phases
from random_hf import ASSETS, ROOT, ensure_model, model_spec

from memfit.units import GIB

ROWS = ("3b-dpo", "3b-dpo-trl", "8b-qlora-dpo", "8b-qlora-dpo-trl")
ROW_MODEL = {"3b-dpo": "3b", "3b-dpo-trl": "3b", "8b-qlora-dpo": "8b", "8b-qlora-dpo-trl": "8b"}
SECTION = "preference"
SEQ_LEN = 512
STEPS = 2
NUM_PAIRS = 6


def long_pairs(path: Path, count: int = NUM_PAIRS, chars: int = 4000) -> Path:
    """``count`` pairs whose every row fills ``SEQ_LEN + 1`` tokens, written to ``path`` (JSONL): the prompt a
    Dolly record's instruction, the chosen and the rejected reply each the Dolly responses that follow it (from two
    different records on), joined until ``chars`` characters (GPT-2's BPE: ~4 characters a token, so > 512 tokens).
    Every step's rows are then as long as the longest the estimate assumes, as the packed rows of
    ``bench/largest_model.py`` are."""
    records = json.loads((ASSETS / "dolly_sample.json").read_text())
    responses = [r["response"] for r in records]

    def reply(start: int) -> str:
        out, k = "", start
        while len(out) < chars:
            out += responses[k % len(responses)] + "\n\n"
            k += 1
        return out[:chars]

    lines = [
        json.dumps({"prompt": records[i]["instruction"], "chosen": reply(i + 1), "rejected": reply(i + 5)})
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def data(run_dir: Path) -> list[str]:
    """The pairs (:func:`long_pairs`), as ``memfit plan`` and ``memfit finetune`` take them, with a fresh reference
    directory."""
    pairs = long_pairs(run_dir / "pairs.jsonl")
    return [
        f"data.path={pairs}", "data.format=preference", "data.template=chatml", "objective=dpo",
        f"preference.reference_dir={run_dir / 'reference'}",
    ]  # fmt: skip


def row_3b_dpo(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """``3b-dpo``: plan, then run the plan with its reference precomputed."""
    shutil.rmtree(run_dir / "reference", ignore_errors=True)  # the pass is measured: none stored yet
    plan_path = run_dir / "plan.yaml"
    plan_path.unlink(missing_ok=True)
    base = [f"checkpoint_dir={model_dir}", "method=full", "batch_size=1", f"seq_len={SEQ_LEN}", "dtype=bf16"]
    plan_cmd = [*_memfit(), "plan", f"budget={args.budget}", "device=cpu", *base, *data(run_dir),
                "--out", str(plan_path)]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(plan_cmd, capture_output=True, text=True, cwd=ROOT)
    (run_dir / "plan.txt").write_text(proc.stdout + "\n" + proc.stderr)
    plan = {"command": _shown(plan_cmd), "process_seconds": round(time.monotonic() - t0, 1)}
    if proc.returncode != 0 or not plan_path.exists():
        plan["message"] = proc.stderr.strip()[-3000:]
        return {
            "plan": plan,
            "outcome": "no plan fits" if "nothing fits" in plan["message"] else "plan failed",
        }
    plan["header"] = [ln for ln in plan_path.read_text().splitlines() if ln.startswith("#")]
    config = yaml.safe_load(plan_path.read_text())
    row = {"plan": plan, "config": config, "switches": _switches(config), "forced": False}
    return {**row, **memfit_run(name, ["--config", str(plan_path)], STEPS, run_dir, args.guard_bytes, True)}


def row_8b_qlora_dpo(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """``8b-qlora-dpo``: the QLoRA DPO config as a YAML file, estimated and run."""
    config = {
        "checkpoint_dir": str(model_dir), "method": "qlora", "dtype": "bf16", "device": "cpu", "batch_size": 1,
        "seq_len": SEQ_LEN, "activation_checkpointing": "full", "chunked_cross_entropy": "auto",
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.0, "target_modules": LORA_TARGETS},
    }  # fmt: skip
    path = run_dir / "qlora_dpo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    row = {"config": config, "switches": _switches(config), "forced": False}
    return {
        **row,
        **memfit_run(name, ["--config", str(path), *data(run_dir)], STEPS, run_dir, args.guard_bytes),
    }


def row_trl(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """A TRL row (``bench/trl_dpo.py``) under the cap: where it stops, or its peak."""
    mode = "qlora" if "qlora" in name else "full"
    pairs = long_pairs(run_dir / "pairs.jsonl")
    child = {"dir": str(model_dir), "mode": mode, "data": str(pairs), "seq_len": SEQ_LEN, "steps": STEPS,
             "rank": 16, "alpha": 32, "targets": LORA_TARGETS}  # fmt: skip
    cap_bytes = int(args.cap_gib * GIB)
    with memory_cap(cap_bytes, name) as (prefix, cap_text):
        limit = ["timeout", f"{args.trl_timeout_s:g}"] if args.trl_timeout_s else []
        cmd = [
            *limit,
            *prefix,
            sys.executable,
            str(Path(__file__).with_name("trl_dpo.py")),
            json.dumps(child),
        ]
        run = run_measured(cmd, run_dir / "trl.log", cap_bytes + GIB, name)
    steps = [run.first(rf"trl: step {n} \|") for n in range(1, STEPS + 1)]
    loaded, built = run.first(r"trl: loaded"), run.first(r"trl: trainer built")
    peaks, phase_seconds, ended_in = split_phases(
        run, [("setup", run.first(r"trl: loading")), ("load", loaded), ("trainer", built),
              ("first_step", steps[0]), ("steady_step", steps[-1])]
    )  # fmt: skip
    done = [t for t in steps if t is not None]
    said = [ln for _, ln in run.lines if ln.startswith("trl: ")]
    failed = next((ln for ln in said if ln.startswith("trl: failed in")), None)
    if run.returncode == 0:
        outcome = "ok"
    elif run.returncode == 124 and args.trl_timeout_s:
        outcome = f"stopped at this bench's time limit ({args.trl_timeout_s:g} s) during {ended_in}"
    elif run.signal is not None:
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) during {ended_in}"
    else:
        outcome = failed or f"failed (exit {run.returncode}) during {ended_in}"
    return {
        "command": _shown(cmd),
        "config": {**child, "cap": cap_text},
        "switches": {"trl": "DPOTrainer", **({"precompute_ref_log_probs": True} if mode == "full" else
                     {"peft": "QLoRA (bitsandbytes nf4)"}), "gradient_checkpointing": True},
        "forced": False,
        "predicted_peak_rss_gib": None,
        "measured_peak_rss_gib": gib(run.max_rss_bytes),
        "phase_peaks_gib": peaks,
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load") if loaded is not None else None,
        "step_seconds": [round(b - a, 1) for a, b in zip([built or 0.0, *done], done, strict=False)],
        "losses": [float(re.search(r"loss (\S+)", ln).group(1)) for ln in said if re.match(r"trl: step \d+ \|", ln)],
        "said": said,
        "outcome": outcome,
        "cap_gib": args.cap_gib,
        "exit_status": run.returncode,
        "wall_seconds": round(run.wall_seconds, 1),
        "log": str(run_dir / "trl.log"),
    }  # fmt: skip


def _cell(value: Any, fmt: str = "{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


PROSE_START, PROSE_END = "<!-- preference-prose:start -->", "<!-- preference-prose:end -->"
"""The hand-written prose inside the section, kept as it is when the script rewrites the section."""


def kept_prose(doc: Path) -> str:
    """The prose between the prose markers of ``doc`` (a placeholder until written)."""
    text = doc.read_text() if doc.exists() else ""
    if PROSE_START in text and PROSE_END in text:
        return text[text.index(PROSE_START) + len(PROSE_START) : text.index(PROSE_END)].strip()
    return "*To be written by hand: what each row needed, and how each prediction compares with its measurement.*"


def section(rows: list[dict[str, Any]], prose: str = "") -> str:
    """The markdown section of this script's rows of the JSON, with ``prose`` between the prose markers."""
    rows = [r for r in rows if r.get("name") in ROWS]
    lines = [
        "## Preference tuning (DPO) on 24 GiB",
        "",
        "Each row is one fresh process on this machine (2 CPU cores, 24 GiB of RAM, no swap), on "
        "`bench/largest_model.py`'s directories of random bf16 weights, one pair a step of 6 made "
        "from the Dolly sample (its chosen and rejected rows, each cut to 512 tokens), 2 steps. "
        "*Predicted* is `memfit estimate --json`'s `host_peak_rss_gib`, and per phase its `phase_peaks_gib` plus "
        "what the process holds besides its tensors; *measured* is the whole process's peak RSS (`/usr/bin/time "
        "-v`), the phase peaks the RSS sampled every 0.1 s, split at the lines the run prints. The TRL rows run "
        "under a hard cap on resident memory. GiB = 1024**3 bytes.",
        "",
        "Reproduce: `.venv/bin/python bench/preference.py` (`--rows NAME` runs one and keeps the others' results)",
        "",
        "| row | config | predicted (GiB) | measured (GiB) | load / reference / first step / steady / save peak "
        "(GiB) | predicted load / reference / step / save (GiB) | step (s) | losses | outcome |",
        "|---|---|---:|---:|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.get("phase_peaks_gib") or {}
        load = max(
            (v for k, v in p.items() if k in ("setup", "load", "trainer") and v is not None), default=None
        )
        measured = " / ".join(
            _cell(v)
            for v in (load, p.get("reference"), p.get("first_step"), p.get("steady_step"), p.get("save"))
        )
        q = r.get("predicted_phase_rss_gib") or {}
        predicted = " / ".join(_cell(q.get(k)) for k in ("load", "reference", "step", "save")) if q else "—"
        switches = ", ".join(f"`{k}={v}`" for k, v in (r.get("switches") or {}).items()) or "—"
        steps = ", ".join(f"{s:.1f}" for s in r.get("step_seconds") or []) or "—"
        losses = ", ".join(f"{v:.4f}" for v in r.get("losses") or []) or "—"
        outcome = str(r.get("outcome", "")).replace("|", "/")[:200]
        lines.append(
            f"| {r['name']} | {switches} | {_cell(r.get('predicted_peak_rss_gib'))} "
            f"| {_cell(r.get('measured_peak_rss_gib'))} | {measured} | {predicted} | {steps} | {losses} "
            f"| {outcome} |"
        )
    lines += ["", PROSE_START, prose, PROSE_END]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows", nargs="*", choices=ROWS, default=list(ROWS), help="rows to run (default: all)"
    )
    parser.add_argument(
        "--scale", choices=("full", "small"), default="full", help="small: tiny stand-in models"
    )
    parser.add_argument("--workdir", default=str(ROOT / "out" / "largest_model"), help="models and runs")
    parser.add_argument("--budget", default="20GiB", help="memfit plan's budget for 3b-dpo (default: 20GiB)")
    parser.add_argument("--cap-gib", type=float, default=22.0, help="the TRL rows' memory cap (default: 22)")
    parser.add_argument(
        "--guard-gib", type=float, default=23.0, help="kill a memfit row past this (default: 23)"
    )
    parser.add_argument(
        "--trl-timeout-s",
        type=float,
        default=3600,
        help="stop a TRL row after this long (default: 3600; 0: none)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument("--keep", action="store_true", help="keep outputs and the random models")
    parser.add_argument("--clear-models", action="store_true", help="make disk room as largest_model.py does")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    small = args.scale == "small"
    json_path = workdir / "small" / "preference.json" if small else ROOT / "docs" / "largest_model.json"
    args.guard_bytes = int(args.guard_gib * GIB)
    runs = workdir / ("small" if small else "full")
    rows = [r for r in ROWS if r in args.rows]
    results = json.loads(json_path.read_text()) if json_path.exists() else []
    for i, name in enumerate(rows):
        model_key = ROW_MODEL[name]
        model_dir, made = ensure_model(
            model_spec(model_key, args.scale), workdir, args.seed, args.clear_models
        )
        run_dir = runs / name
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"--- {name} ({made['num_params']:,} parameters)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        run_row = {"3b-dpo": row_3b_dpo, "8b-qlora-dpo": row_8b_qlora_dpo}.get(name, row_trl)
        row = run_row(args, model_dir, run_dir, name)
        reproduce = [".venv/bin/python", "bench/preference.py", "--rows", name]
        if "trl" in name and args.trl_timeout_s != 3600:
            reproduce += ["--trl-timeout-s", f"{args.trl_timeout_s:g}"]
        reproduce = shlex.join(reproduce + (["--scale", "small"] if small else []))
        row = measured_row(name, reproduce, args.scale, model_dir, made, row, t0)
        # largest_model.py's rows first, in their order (a stable sort), then these
        results = store_row(
            json_path, results, row, lambda r: (1, ROWS.index(r["name"])) if r.get("name") in ROWS else (0, 0)
        )
        if not args.keep:
            shutil.rmtree(run_dir / "output", ignore_errors=True)
            if all(ROW_MODEL[later] != model_key for later in rows[i + 1 :]):
                shutil.rmtree(model_dir, ignore_errors=True)
    doc = ROOT / "docs" / "benchmarks.md"
    text = section(results, kept_prose(doc))
    print(text)
    if not small:
        write_section(doc, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
