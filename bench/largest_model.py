"""The largest models that fit a 24 GiB host: memfit's predicted peak host memory against the measured one, on
this machine (2 CPU cores, 24 GiB of RAM, no swap, no GPU), one fresh process per row.

Rows (``--rows``, default all, run in this order):

- ``3b-full``: **Llama-3.2-3B full fine-tune** (3,212,749,824 parameters, tied embeddings), fp32, batch 1 x 512
  tokens, 3 steps and the final checkpoint, with the switches that ``memfit plan budget=20GiB device=cpu
  checkpoint_dir=DIR method=full batch_size=1 seq_len=512 dtype=fp32 DATA --out plan.yaml`` writes, run as written:
  ``memfit finetune --config plan.yaml`` plus run-length and output overrides only (``max_steps``, ``output_dir``,
  the checkpoint at the end only, no validation, no sample, no loss plot, ``log_every=1``). When no plan fits, the
  row records ``outcome: "no plan fits"`` and the planner's message; ``--force-config KEY=VAL ...`` runs that
  configuration instead (the row's keys plus these, as overrides; ``preflight=false`` among them starts a run the
  pre-flight check would refuse) and the row says it was forced.
- ``8b-qlora``: **Llama-3.1-8B QLoRA**: the bf16 base quantized to NF4 as it loads, LoRA rank 16 (alpha 32) on all
  seven decoder linears, full activation checkpointing and the chunked loss (without them the saved activations
  alone are 8.4 GiB: 17.9 GiB estimated in all), fp32, batch 1 x 512, 2 steps and the final adapter checkpoint.
- ``3b-plain``: **the 3B fine-tune without memfit**: a plain ``transformers`` loop
  (``LlamaForCausalLM.from_pretrained(DIR, dtype=torch.float32)``, ``torch.optim.AdamW`` at its defaults, which on
  CPU is the for-loop update; forward with ``labels``, ``loss.backward()``, ``step()``; 3 steps of 1 x 512 ids of
  the tokenized Dolly sample) under a hard memory cap (``--cap-gib``, 22 by default: a cgroup's limit on resident
  memory, through ``systemd-run --scope -p MemoryMax`` where systemd runs, else a cgroup v1 memory group of its own;
  ``prlimit --as``, which caps the address space, mapped files included, where neither is allowed), so that it
  fails alone instead of taking the machine. Its need is predicted by ``memfit estimate`` of the equivalent
  run (``method=full optimizer.name=adamw optimizer.implementation=for_loop``, no memory switch, fp32, 1 x 512). The
  row records where it failed (the phase and the error, or the signal), or its peak if it finished.
- ``3b-torchtune``: **the same fine-tune with torchtune's lowest-memory single-device recipe**
  (``full_finetune_single_device`` as its ``llama3_2/3B_full_single_device`` config sets it: bitsandbytes'
  ``PagedAdamW8bit`` stepped in backward, activation checkpointing, ``CEWithChunkedOutputLoss``), with ``device:
  cpu``, ``dtype: fp32``, batch 1, the Dolly sample packed into rows of 512 tokens (``alpaca_dataset`` from the
  JSON file; the tokenizer ``tests/assets/tiktoken_2k.model`` through ``llama3_tokenizer``, since the directories
  carry GPT-2's), 2 steps and its final checkpoint, under the same cap. torchtune 0.6.1 imports only with a torchao
  older than memfit's (``torchao.dtypes.nf4tensor``), so it runs from a virtual environment of its own
  (``--torchtune-venv``, default ``WORKDIR/torchtune-venv``), made with pip when missing (torch as memfit's,
  ``torchtune==0.6.1``, ``torchao==0.10.0``, bitsandbytes as memfit's). Not run at ``--scale small`` (the
  tokenizer's special ids need Llama 3's vocabulary).
- ``3b-8bit``: **memfit with torchtune's switches** (:func:`torchtune_switches`: ``paged_adamw8bit`` in backward,
  full checkpointing, the loss in 8 chunks), 3 steps and the final checkpoint, estimated and run as ``3b-full``.
- ``8b-full``: **Llama-3.1-8B full fine-tune in bf16** (8,030,261,248 parameters, every one trained, the
  embedding and the untied head included): planned and run as ``3b-full`` (``--budget``, 20GiB by default) with
  ``dtype=bf16`` (``bf16_rounding=auto``: stochastic rounding), batch 1 x 2048 packed, 2 steps and the final bf16
  checkpoint.
- ``qwen3-8b-full``: **Qwen3-8B full fine-tune in bf16** (8,190,735,360 parameters, 36 layers, q/k norms, an untied
  151,936-id vocabulary), as ``8b-full``.
- ``8b-torchtune``: **torchtune's ``llama3_1/8B_full_single_device`` recipe** on the 8B directory, as
  ``3b-torchtune`` runs its 3B recipe but in bf16 (its weights rounded to nearest) at 1 x 2048, under the same cap;
  the row records where it stops.
- ``30b-a3b-qlora``: **Qwen3-30B-A3B QLoRA** (30,532,122,624 parameters, 128 experts of 768 in each of 48
  layers, 8 a token): the bf16 directory, one tensor per expert as on the Hub (57 GiB), each layer's experts stacked
  and quantized to NF4 as they are read (:func:`memfit.models.nf4.to_nf4`, bit-identical to torchao's); LoRA rank 16
  (alpha 32) on the attention linears, bf16, full checkpointing and the chunked loss, batch 1 x 1024, 2 steps.
- ``30b-a3b-peft``: **transformers + PEFT + bitsandbytes QLoRA** of the same directory, rank and batch
  (``bench/peft_qlora.py``: ``BitsAndBytesConfig(load_in_4bit=True, ...)``, ``prepare_model_for_kbit_training``,
  ``get_peft_model``, gradient checkpointing, AdamW), under the same cap as the torchtune rows (``--cap-gib``).
- ``olmoe-full``: **OLMoE-1B-7B full fine-tune in bf16** (6,919,161,856 parameters, 64 experts in each of 16
  layers; the routers frozen as a fine-tune leaves them), planned and run as ``8b-full``.

**Weights.** Each model is written once into ``--workdir`` as a Hugging Face directory of *random* weights
(``config.json`` as Meta's or Qwen's, with BOS/EOS the ids of the tokenizer it carries; ``normal(0, 0.02)``, norms
ones, one seeded generator): bf16 safetensors shards of at most 4 GiB with ``model.safetensors.index.json``, each
tensor made, written and dropped in turn (the safetensors header is written first, from the shapes), so the whole
model is never in memory; in a child process, so that this one never imports torch (a child's ``ru_maxrss`` would
include its parent's high-water mark at the fork). A directory is reused when complete (its ``largest_model.json``
written last, for the same config). The tokenizer is GPT-2's BPE (``tests/assets/gpt2_encoder.json`` and
``gpt2_vocab.bpe``) as a ``tokenizer.json`` (ids < 50,257, inside Llama 3's 128,256).

**Data.** ``tests/assets/dolly_sample.json`` (``data.format=dolly data.template=alpaca``), packed into rows of
exactly 512 tokens (``data.packing=true``), no validation split.

**Measured**, for each row: the predicted peak RSS (``memfit estimate --config plan.yaml OVERRIDES --json``:
``host_peak_rss_gib``); the peak RSS of the whole run (``/usr/bin/time -v``'s "Maximum resident set size"); the
resident set of the process tree sampled every 0.1 s by a thread of this script, and every line of the child's
stdout timestamped as it arrives (``PYTHONUNBUFFERED=1``), which splits the samples into phases: ``setup``
(imports, tokenizer, data, the pre-flight check: to memfit's ``pre-flight:`` line), ``load`` (the weights and the
optimizer: to its banner, ``memfit finetune (...): model ...``), ``first_step`` (to the ``step 1 | loss ...``
line), ``steady_step`` (to the save's first line, ``saving checkpoint step_...``, which memfit prints once the
steps' free heap is given back: a step frees its last tensors after its own line), ``save`` (the final checkpoint:
to ``final validation loss:``);
the peak of a phase is the largest sample inside it (a phase shorter than the interval takes the first sample
after it; a spike shorter than the interval can fall between samples, so the phase peaks may sit below the
measured peak). Load time (``pre-flight:`` to the banner), each step's seconds (between those lines), tokens/s of the
steps after the first (memfit's own ``tokens_per_second_per_gpu`` records), each step's loss (``metrics.jsonl``),
and the bytes of the final checkpoint. The plain loop prints its own markers (``plain: loaded``, ``plain: step N
...``). GiB = 1024**3 bytes.

Reproduce (the machine to itself: tens of minutes per row, the 8B full rows about an hour each; the 8B QLoRA load
alone quantizes ~7B weights at ~0.19 us each; disk for the random directories, 6.0, 15.0 and 15.3 GiB, each written
once and removed after the last row that needs it, and for a row's checkpoint, up to 36 GiB for the 3B: fp32
weights and AdamW state, removed once measured; ``--keep`` keeps both)::

    .venv/bin/python bench/largest_model.py                          # every row
    .venv/bin/python bench/largest_model.py --rows 3b-full --force-config optimizer.name=adamw8bit

It writes ``docs/largest_model.json`` (a row run again replaces its entry; the others are kept) and rewrites the
section between the ``largest-model`` markers of ``docs/benchmarks.md`` (``--out -`` only prints it), keeping the
hand-written prose between its ``largest-model-prose`` markers (a placeholder until written).

``--scale small`` runs the same harness, the same code paths, on tiny Llamas (dim 256, 4 layers, 4/2 heads, SwiGLU
768, vocabulary 50,304 to hold GPT-2's ids: 16.0M parameters tied, 28.9M untied; shards of 8 MiB) in about
1.5 minutes; it writes its JSON under ``--workdir`` (``small/largest_model.json``) and prints the section only, so
it never touches ``docs/``.
"""

from __future__ import annotations

import argparse
import errno
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from docs_section import write_section
from measured_run import Measured, gib, memory_cap, run_measured, split_phases
from random_hf import ASSETS, ROOT, ensure_model, model_spec

from memfit.units import GIB

ROWS = (
    "3b-full",
    "8b-qlora",
    "3b-plain",
    "3b-torchtune",
    "3b-8bit",
    "8b-full",
    "qwen3-8b-full",
    "8b-torchtune",
    "30b-a3b-qlora",
    "30b-a3b-peft",
    "olmoe-full",
)
ROW_MODEL = {"8b-qlora": "8b", "8b-full": "8b", "qwen3-8b-full": "qwen3-8b", "8b-torchtune": "8b",
             "30b-a3b-qlora": "qwen3-30b-a3b", "30b-a3b-peft": "qwen3-30b-a3b",
             "olmoe-full": "olmoe-1b-7b"}  # fmt: skip
"""Row -> the key of its model in ``random_hf.MODELS`` (``3b`` when not named)."""
SECTION = "largest-model"
PROSE_START, PROSE_END = "<!-- largest-model-prose:start -->", "<!-- largest-model-prose:end -->"
"""The hand-written prose inside the section: kept as it is when the script rewrites the section."""
PLACEHOLDER = (
    "*Placeholder, to be written by hand: what each row needed (which switches the plan chose and why, where "
    "the plain loop failed and why, how each prediction compares with its measurement).*"
)
SEQ_LEN = 512


@dataclass(frozen=True)
class FullRow:
    """A full fine-tune row run as ``memfit plan`` writes it: batch 1 x ``seq_len``, ``steps`` steps."""

    seq_len: int
    dtype: str
    steps: int
    budget: str
    """``memfit plan``'s ``budget=`` (default of ``--budget``)."""


FULL_ROWS = {
    "3b-full": FullRow(SEQ_LEN, "fp32", 3, "20GiB"),
    # bf16 weights (bf16_rounding=auto: stochastic), the sequence of torchtune's 8B recipe
    "8b-full": FullRow(2048, "bf16", 2, "20GiB"),
    "qwen3-8b-full": FullRow(2048, "bf16", 2, "20GiB"),
    # a mixture of experts, every weight trained (the routers frozen, as a fine-tune leaves them)
    "olmoe-full": FullRow(2048, "bf16", 2, "20GiB"),
}

DATA = [
    f"data.path={ASSETS / 'dolly_sample.json'}",
    "data.format=dolly",
    "data.template=alpaca",
    "data.packing=true",
]
"""The training data, as ``memfit plan`` and ``memfit finetune`` take it."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SWITCH_KEYS = (
    "method",
    "lora.rank",
    "lora.target_modules",
    "dtype",
    "optimizer.name",
    "optimizer.implementation",
    "optimizer.cpu_offload",
    "optimizer_in_backward",
    "activation_checkpointing",
    "activation_offloading",
    "chunked_cross_entropy",
    "tiled_mlp",
    "bf16_rounding",
    "compile",
    "gradient_accumulation_steps",
)
"""The keys of a config that the table shows as its switches (where the config sets them)."""


# ----------------------------------------------------------------------------------------------------------------
# Child: the plain transformers + PyTorch loop
# ----------------------------------------------------------------------------------------------------------------


def plain_loop(spec: dict[str, Any]) -> int:
    """Child: fine-tune ``spec["dir"]`` with a plain loop, printing a marker line after each phase; on an error it
    prints ``plain: failed in PHASE: ...`` and returns 3 when the error is a failed allocation, else 1."""

    def mark(text: str) -> None:
        print(f"plain: {text}", flush=True)

    phase = "imports"
    try:
        import torch
        from tokenizers import Tokenizer
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        records = json.loads((ASSETS / "dolly_sample.json").read_text())
        text = "\n\n".join(f"{r['instruction']}\n{r['context']}\n{r['response']}" for r in records)
        ids = Tokenizer.from_file(str(Path(spec["dir"]) / "tokenizer.json")).encode(text).ids
        ids = (ids * (spec["seq_len"] // len(ids) + 1))[: spec["seq_len"]]
        batch = torch.tensor([ids])  # (1, T)
        phase = "load"
        mark("loading")
        t0 = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(spec["dir"], dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
        mark(
            f"loaded in {time.perf_counter() - t0:.1f} s ({sum(p.numel() for p in model.parameters()):,} params)"
        )
        for step in range(1, spec["steps"] + 1):
            t0 = time.perf_counter()
            phase = f"step {step} forward"
            mark(phase)  # each phase announced: a process the cap kills says nothing after
            loss = model(input_ids=batch, labels=batch).loss
            phase = f"step {step} backward"
            mark(phase)
            loss.backward()
            phase = f"step {step} optimizer step"
            mark(phase)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mark(f"step {step} | loss {loss.item():.4f} | seconds {time.perf_counter() - t0:.2f}")
        mark("done")
        return 0
    except Exception as exc:  # reported with its phase: what the row records
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        oom = (
            isinstance(exc, MemoryError)
            or getattr(exc, "errno", None) == errno.ENOMEM
            or "allocate" in message.lower()
        )
        mark(f"failed in {phase}: {type(exc).__name__}: {message[:300]}")
        return 3 if oom else 1


# ----------------------------------------------------------------------------------------------------------------
# The parent: one measured process per row (this process never imports torch)
# ----------------------------------------------------------------------------------------------------------------


def _memfit() -> list[str]:
    """The ``memfit`` command of this interpreter's environment."""
    script = Path(sys.executable).parent / "memfit"
    return [str(script)] if script.exists() else [sys.executable, "-m", "memfit"]


def _shown(cmd: list[str]) -> str:
    """A command as the docs show it: paths under the repository relative to it."""
    text = shlex.join(cmd)
    return text.replace(str(ROOT) + "/", "").replace(str(Path(sys.executable).parent) + "/", ".venv/bin/")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _switches(config: dict[str, Any]) -> dict[str, Any]:
    """The switches ``config`` turns on (a plan's YAML lists every switch, the ones left off too)."""
    flat = _dotted(config)
    if flat.get("lora.target_modules") == LORA_TARGETS:
        flat["lora.target_modules"] = "all 7 decoder linears"
    off = (None, False, 0, "none", "0")
    defaults = {"method": "full", "gradient_accumulation_steps": 1}
    return {
        k: flat[k] for k in SWITCH_KEYS if k in flat and flat[k] not in off and defaults.get(k) != flat[k]
    }


def run_overrides(out: Path, steps: int) -> list[str]:
    """The run-length and output overrides of a memfit row: nothing that changes the step's memory."""
    return [
        f"max_steps={steps}", f"output_dir={out}", "checkpoint_every=0", "eval_every=0", "data.val_fraction=0",
        "log_every=1", "sample.max_new_tokens=0", "loss_plot=false", "tensorboard=false",
    ]  # fmt: skip


def estimate(config: list[str], log: Path) -> dict[str, Any]:
    """``memfit estimate CONFIG --json``: its object, the command and its seconds (or the error)."""
    cmd = [*_memfit(), "estimate", *config, "--json"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log.write_text(proc.stdout + proc.stderr)
    out: dict[str, Any] = {"command": _shown(cmd), "process_seconds": round(time.monotonic() - t0, 1)}
    if proc.returncode != 0:
        return {**out, "error": proc.stderr.strip()[-2000:]}
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = ("host_peak_rss_gib", "peak_memory_gib", "host_gib", "phase", "breakdown", "process_baseline_gib",
            "num_params", "num_trainable_params", "seconds", "phase_peaks_gib", "fixes_mmap_threshold")  # fmt: skip
    return {**out, **{k: found.get(k) for k in keys}, "phase_rss_gib": predicted_phase_rss(found)}


def measured_row(
    name: str,
    reproduce: str,
    scale: str,
    model_dir: Path,
    made: dict[str, Any],
    row: dict[str, Any],
    t0: float,
) -> dict[str, Any]:
    """A row as ``docs/largest_model.json`` keeps it: its name, the command that reproduces it, the scale, the model
    (``made``: :func:`random_hf.ensure_model`'s facts), the row's own fields, its seconds since ``t0`` (monotonic)
    and the date."""
    return {
        "name": name,
        "reproduce": reproduce,
        "scale": scale,
        "model": str(model_dir),
        "num_params": made["num_params"],
        "weights_gib": gib(made["weight_bytes"]),
        **row,
        "row_seconds": round(time.monotonic() - t0, 1),
        "date": time.strftime("%Y-%m-%d"),
    }


def store_row(
    json_path: Path,
    results: list[dict[str, Any]],
    row: dict[str, Any],
    order: Callable[[dict[str, Any]], Any],
) -> list[dict[str, Any]]:
    """``results`` with ``row`` in place of the entry of its name, sorted by ``order``, written to ``json_path`` at
    once (after each row: a crash keeps the others); the row's outcome printed to stderr."""
    results = sorted([r for r in results if r.get("name") != row["name"]] + [row], key=order)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"--- {row['name']}: {row.get('outcome')} ({row['row_seconds']} s)", file=sys.stderr, flush=True)
    return results


def predicted_phase_rss(found: dict[str, Any]) -> dict[str, float] | None:
    """The predicted peak RSS (GiB) of each phase memfit estimate predicts (load, reference, step, save): its
    ``phase_rss_gib`` (the phase's tensors, the baseline and runtime, and the steps' free heap), or, from an estimate
    without it, the phase's tensors plus the whole-run prediction less its largest phase's tensors."""
    if found.get("phase_rss_gib"):
        return {k: round(v, 3) for k, v in found["phase_rss_gib"].items()}
    phases, rss = found.get("phase_peaks_gib"), found.get("host_peak_rss_gib")
    if not phases or rss is None:
        return None
    besides = rss - max(phases.values())
    return {k: round(v + besides, 3) for k, v in phases.items()}


def predicted_and_measured(predicted: dict[str, Any], run: Measured) -> dict[str, Any]:
    """A row's predicted peaks (``predicted``: :func:`estimate`'s object, its command taken out) beside the measured
    whole-process peak (``/usr/bin/time -v``) and the highest RSS sample, in GiB."""
    return {
        "estimate_command": predicted.pop("command"),
        "predicted_peak_rss_gib": predicted.get("host_peak_rss_gib"),
        "predicted_phase_rss_gib": predicted.get("phase_rss_gib"),
        "measured_peak_rss_gib": gib(run.max_rss_bytes),
        "sampled_peak_rss_gib": gib(max((s for _, s in run.samples), default=None)),
    }


def memfit_run(
    name: str, config: list[str], steps: int, run_dir: Path, guard_bytes: int, reference: bool = False
) -> dict[str, Any]:
    """Estimate, then run ``memfit finetune CONFIG`` with the run overrides, measured; the row's fields. With
    ``reference``, a stored reference's pass (a preference run) is a phase of its own, between the load and the
    banner."""
    out = run_dir / "output"
    if out.exists():
        shutil.rmtree(out)  # a fresh run (ours: under --workdir)
    overrides = run_overrides(out, steps)
    predicted = estimate([*config, *overrides], run_dir / "estimate.txt")
    cmd = [*_memfit(), "finetune", *config, *overrides]
    run = run_measured(cmd, run_dir / "finetune.log", guard_bytes, name)
    step_times = [run.first(rf"step {n} \| loss ") for n in range(1, steps + 1)]
    loaded = run.first(r"memfit finetune")
    saving = run.first(r"saving checkpoint step_") or step_times[-1]
    peaks, phase_seconds, ended_in = split_phases(
        run,
        [
            ("setup", run.first(r"pre-flight:")),
            *(
                [
                    ("load", run.first(r"reference log-probabilities of .* pairs: computing")),
                    ("reference", loaded),
                ]
                if reference
                else [("load", loaded)]
            ),
            # a step's last frees come after its line: its phase ends where the save begins (its first line,
            # printed once the steps' free heap is given back)
            ("first_step", step_times[0] if steps > 1 else saving),
            *([("steady_step", saving)] if steps > 1 else []),
            ("save", run.first(r"final validation loss")),
        ],
    )
    records = []
    if (out / "metrics.jsonl").exists():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, filter(None, lines)) if r.get("loss") is not None]
    ckpt_line = next((line for _, line in run.lines if line.startswith("checkpoint: ")), None)
    checkpoint = Path(ckpt_line.split(": ", 1)[1]) if ckpt_line else None
    own_rss = next((ln for _, ln in run.lines if ln.startswith("peak_memory_rss: ")), None)
    marks = [loaded, *step_times]
    steady_rates = [r["tokens_per_second_per_gpu"] for r in records[1:]] or [
        r["tokens_per_second_per_gpu"] for r in records
    ]
    if run.returncode == 0 and checkpoint is not None:
        outcome = "ok"
    elif run.killed_by_guard:
        outcome = f"killed by this script's guard ({guard_bytes / GIB:.1f} GiB) during {ended_in}"
    elif run.signal is not None:
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) during {ended_in}"
    else:
        last = next((ln for _, ln in reversed(run.lines) if ln.startswith("memfit")), "")
        outcome = f"failed (exit {run.returncode}) during {ended_in}: {last[:400]}"
    return {
        "command": _shown(cmd),
        **predicted_and_measured(predicted, run),
        "memfit_peak_rss_gib": float(own_rss.split()[1]) if own_rss else None,
        "phase_peaks_gib": peaks,
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load"),
        "step_seconds": [
            round(b - a, 2) for a, b in zip(marks, marks[1:], strict=False) if a is not None and b is not None
        ],
        "tokens_per_second": round(sum(steady_rates) / len(steady_rates), 1) if steady_rates else None,
        "losses": [r["loss"] for r in records],
        "checkpoint_gib": gib(_tree_bytes(checkpoint)) if checkpoint and checkpoint.exists() else None,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "outcome": outcome,
        "exit_status": run.returncode,
        "wall_seconds": round(run.wall_seconds, 1),
        "estimate": predicted,
        "banner": next((ln for _, ln in run.lines if ln.startswith("memfit finetune")), None),
        "preflight": next((ln for _, ln in run.lines if ln.startswith("pre-flight:")), None),
        "log": str(run_dir / "finetune.log"),
    }


def row_full(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """A row of :data:`FULL_ROWS`: plan, then run the plan (or the forced configuration)."""
    spec = FULL_ROWS[name]
    plan_path = run_dir / "plan.yaml"
    plan_path.unlink(missing_ok=True)
    base = [
        f"checkpoint_dir={model_dir}", "method=full", "batch_size=1", f"seq_len={spec.seq_len}", f"dtype={spec.dtype}"
    ]  # fmt: skip
    plan_cmd = [
        *_memfit(),
        "plan",
        f"budget={args.budget or spec.budget}",
        "device=cpu",
        *base,
        *DATA,
        "--out",
        str(plan_path),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(plan_cmd, capture_output=True, text=True, cwd=ROOT)
    (run_dir / "plan.txt").write_text(proc.stdout + "\n" + proc.stderr)
    plan = {"command": _shown(plan_cmd), "process_seconds": round(time.monotonic() - t0, 1)}
    if proc.returncode == 0 and plan_path.exists():
        plan["outcome"] = "fits"
        plan["header"] = [ln for ln in plan_path.read_text().splitlines() if ln.startswith("#")]
    else:
        message = proc.stderr.strip().split("memfit: error: ", 1)[-1]
        plan["outcome"] = "no plan fits" if "nothing fits" in message else f"failed (exit {proc.returncode})"
        plan["message"] = message[-3000:]
    row: dict[str, Any] = {"plan": plan, "forced": bool(args.force_config)}
    if args.force_config:
        overrides = [*base, "device=cpu", *DATA, *args.force_config]
        config = [*overrides]
        row["config"] = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)}
    elif plan["outcome"] == "fits":
        config = ["--config", str(plan_path)]
        row["config"] = yaml.safe_load(plan_path.read_text())
    else:
        return {**row, "outcome": plan["outcome"], "message": plan.get("message")}
    row["switches"] = _switches(row["config"])
    return {**row, **memfit_run(name, config, spec.steps, run_dir, args.guard_bytes)}


QLORA_ROWS = {
    # without checkpointing the 32 layers' saved activations alone are 8.4 GiB at 512 tokens in fp32 (estimated)
    "8b-qlora": {"dtype": "fp32", "seq_len": SEQ_LEN, "targets": LORA_TARGETS},
    # the experts stacked and quantized as each layer's are read; rank 16 on the attention linears
    "30b-a3b-qlora": {"dtype": "bf16", "seq_len": 1024, "targets": LORA_TARGETS[:4]},
}
"""QLoRA rows: the base's dtype, the tokens of the batch, the LoRA targets (rank 16, alpha 32)."""


def row_qlora(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """A row of :data:`QLORA_ROWS`: the QLoRA config written as a YAML file, estimated and run (2 steps)."""
    spec = QLORA_ROWS[name]
    config = {
        "checkpoint_dir": str(model_dir), "method": "qlora", "dtype": spec["dtype"], "device": "cpu",
        "batch_size": 1, "seq_len": spec["seq_len"],
        "lora": {"rank": 16, "alpha": 32, "target_modules": spec["targets"]},
        "activation_checkpointing": "full", "chunked_cross_entropy": 8,
        "data": {"path": str(ASSETS / "dolly_sample.json"), "format": "dolly", "template": "alpaca",
                 "packing": True},
    }  # fmt: skip
    path = run_dir / "qlora.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    row = {"config": config, "switches": _switches(config), "forced": False}
    return {**row, **memfit_run(name, ["--config", str(path)], 2, run_dir, args.guard_bytes)}


def row_peft(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """``30b-a3b-peft``: transformers + PEFT + bitsandbytes QLoRA (``bench/peft_qlora.py``) on the directory of
    ``30b-a3b-qlora``, with its rank, targets, batch and steps, under the cap."""
    spec = QLORA_ROWS["30b-a3b-qlora"]
    child = {"dir": str(model_dir), "rank": 16, "alpha": 32, "targets": list(spec["targets"]),
             "data": str(ASSETS / "dolly_sample.json"), "seq_len": spec["seq_len"], "steps": 2}  # fmt: skip
    cap_bytes = int(args.cap_gib * GIB)
    with memory_cap(cap_bytes, name) as (prefix, cap_text):
        cmd = [*prefix, sys.executable, str(Path(__file__).with_name("peft_qlora.py")), json.dumps(child)]
        run = run_measured(cmd, run_dir / "peft.log", cap_bytes + GIB, name)
    steps = [run.first(rf"peft: step {n} \|") for n in (1, 2)]
    loaded = run.first(r"peft: loaded")
    peaks, phase_seconds, ended_in = split_phases(
        run, [("setup", run.first(r"peft: loading")), ("load", loaded), ("first_step", steps[0]),
              ("steady_step", steps[1])]
    )  # fmt: skip
    done = [t for t in steps if t is not None]
    seconds = [round(b - a, 1) for a, b in zip([loaded or 0.0, *done], done, strict=False)]
    said = [ln for _, ln in run.lines if ln.startswith("peft: ")]
    failed = next((ln for ln in said if ln.startswith("peft: failed in")), None)
    if run.returncode == 0:
        outcome = "ok"
    elif run.signal is not None:
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) during {ended_in}"
    else:
        outcome = failed or f"failed (exit {run.returncode}) during {ended_in}"
    return {
        "command": _shown(cmd),
        "config": {**child, "quantization": "BitsAndBytesConfig(load_in_4bit, nf4, double quant, bf16 compute)",
                   "cap": cap_text},
        "switches": {"gradient_checkpointing": True, "prepare_model_for_kbit_training": True},
        "forced": False,
        "predicted_peak_rss_gib": None,
        "measured_peak_rss_gib": gib(run.max_rss_bytes),
        "sampled_peak_rss_gib": gib(max((s for _, s in run.samples), default=None)),
        "phase_peaks_gib": {k: peaks.get(k) for k in ("setup", "load", "first_step", "steady_step")},
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load") if loaded is not None else None,
        "step_seconds": seconds,
        "tokens_per_second": _steady_tokens_per_second(seconds, spec["seq_len"]),
        "said": said,
        "outcome": outcome,
        "cap_gib": args.cap_gib,
        "cap_method": cap_text,
        "exit_status": run.returncode,
        "wall_seconds": round(run.wall_seconds, 1),
        "log": str(run_dir / "peft.log"),
    }  # fmt: skip


def _steady_tokens_per_second(seconds: list[float], seq_len: int = SEQ_LEN) -> float | None:
    """Tokens per second over the steps after the first (each of one 1 x ``seq_len`` batch)."""
    return round(seq_len * len(seconds[1:]) / sum(seconds[1:]), 1) if seconds[1:] else None


def _capped(
    args: argparse.Namespace, cap_text: str, run: Measured, predicted: dict[str, Any]
) -> dict[str, Any]:
    """The fields of a row run under the cap: the cap, how the process ended and memfit's estimate."""
    return {
        "cap_gib": args.cap_gib,
        "cap_method": cap_text,
        "exit_status": run.returncode,
        "wall_seconds": round(run.wall_seconds, 1),
        "estimate": predicted,
    }


def row_3b_plain(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``3b-plain``: memfit's estimate of the equivalent run, then the plain loop under the cap."""
    config = [
        f"checkpoint_dir={model_dir}", "method=full", "optimizer.name=adamw", "optimizer.implementation=for_loop",
        "optimizer_in_backward=false", "activation_checkpointing=none", "chunked_cross_entropy=0", "tiled_mlp=0",
        "dtype=fp32", "device=cpu", "batch_size=1", f"seq_len={SEQ_LEN}", *DATA,
    ]  # fmt: skip
    predicted = estimate(config, run_dir / "estimate.txt")
    cap_bytes = int(args.cap_gib * GIB)
    spec = {"dir": str(model_dir), "steps": 3, "seq_len": SEQ_LEN, "lr": 2e-5}
    with memory_cap(cap_bytes, "3b-plain") as (prefix, cap_text):
        cmd = [*prefix, sys.executable, __file__, "--_plain", json.dumps(spec)]
        run = run_measured(cmd, run_dir / "plain.log", cap_bytes + GIB, "3b-plain")
    steps = [run.first(rf"plain: step {n} \|") for n in range(1, 4)]
    peaks, phase_seconds, ended_in = split_phases(
        run,
        [
            ("setup", run.first(r"plain: loading")),
            ("load", run.first(r"plain: loaded")),
            ("first_step", steps[0]),
            ("steady_step", steps[-1]),
        ],
    )
    failed = next((ln for _, ln in run.lines if ln.startswith("plain: failed in")), None)
    losses = [
        float(m.group(1)) for _, ln in run.lines if (m := re.search(r"^plain: step \d+ \| loss (\S+)", ln))
    ]
    seconds = [float(m.group(1)) for _, ln in run.lines if (m := re.search(r"\| seconds (\S+)$", ln))]
    if run.returncode == 0:
        outcome = "ok"
    elif failed:
        outcome = failed.removeprefix("plain: ")
    elif run.signal is not None:
        last = next((ln for _, ln in reversed(run.lines) if re.match(r"plain: step \d+ [a-z]", ln)), None)
        where = last.removeprefix("plain: ") if last else ended_in
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) in {where}"
    else:
        outcome = f"failed (exit {run.returncode}) during {ended_in}"
    return {
        "command": _shown(cmd),
        "config": {
            "loop": "LlamaForCausalLM.from_pretrained(dtype=float32), torch.optim.AdamW(lr=2e-5)",
            "batch": f"1 x {SEQ_LEN}",
            "steps": 3,
            "cap": cap_text,
        },  # fmt: skip
        "switches": {
            "optimizer.name": "adamw",
            "optimizer.implementation": "for_loop (torch's default on CPU)",
        },
        "forced": False,
        **predicted_and_measured(predicted, run),
        "phase_peaks_gib": {**peaks, "save": None},
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load") if run.first(r"plain: loaded") is not None else None,
        "step_seconds": seconds,
        "tokens_per_second": _steady_tokens_per_second(seconds),
        "losses": losses,
        "checkpoint_gib": None,
        "outcome": outcome,
        **_capped(args, cap_text, run, predicted),
        "log": str(run_dir / "plain.log"),
    }


TORCHTUNE = ("torchtune==0.6.1", "torchao==0.10.0")
"""What the torchtune row installs beside torch and bitsandbytes at memfit's versions: torchtune 0.6.1 imports
``torchao.dtypes.nf4tensor``, which later torchao releases moved."""


def torchtune_venv(path: Path) -> Path:
    """The ``tune`` command of a virtual environment at ``path`` holding torchtune, made with pip when missing."""
    tune = path / "bin" / "tune"
    if tune.exists():
        return tune
    from importlib.metadata import version

    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pins = [f"torch=={version('torch')}", f"bitsandbytes=={version('bitsandbytes')}", *TORCHTUNE]
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", *pins], check=True)
    return tune


@dataclass(frozen=True)
class TorchtuneRow:
    """A torchtune peer row: its model builder, checkpoint type, dtype and batch of 1 x ``seq_len``."""

    recipe_config: str
    """The torchtune config it follows (``tune cp`` name), for the docs."""
    model: str
    model_type: str
    dtype: str
    seq_len: int
    steps: int = 2


TORCHTUNE_ROWS = {
    "3b-torchtune": TorchtuneRow(
        "llama3_2/3B_full_single_device", "torchtune.models.llama3_2.llama3_2_3b", "LLAMA3_2", "fp32", SEQ_LEN
    ),
    "8b-torchtune": TorchtuneRow(
        "llama3_1/8B_full_single_device", "torchtune.models.llama3_1.llama3_1_8b", "LLAMA3", "bf16", 2048
    ),
}


def torchtune_config(model_dir: Path, out: Path, peer: TorchtuneRow) -> dict[str, Any]:
    """torchtune's ``peer.recipe_config`` config, on this machine: CPU, ``peer.dtype``, the local directory and
    data, batch 1 x ``peer.seq_len`` packed, ``peer.steps`` steps; its memory switches as it ships them."""
    steps, seq_len = peer.steps, peer.seq_len
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return {
        "output_dir": str(out),
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                      "path": str(ASSETS / "tiktoken_2k.model"), "max_seq_len": seq_len},
        "dataset": {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
                    "data_files": str(ASSETS / "dolly_sample.json"), "split": "train", "packed": True,
                    "column_map": {"instruction": "instruction", "input": "context", "output": "response"}},
        "seed": 0, "shuffle": False,
        "model": {"_component_": peer.model},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(model_dir),
                         "checkpoint_files": sorted(set(index["weight_map"].values())),
                         "recipe_checkpoint": None, "output_dir": str(out), "model_type": peer.model_type},
        "resume_from_checkpoint": False, "batch_size": 1, "epochs": 1,
        "optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW8bit", "lr": 2e-5},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "max_steps_per_epoch": steps, "gradient_accumulation_steps": 1, "optimizer_in_bwd": True,
        "clip_grad_norm": None, "compile": False, "device": "cpu", "enable_activation_checkpointing": True,
        "enable_activation_offloading": False, "dtype": peer.dtype,
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(out / "logs")},
        "log_every_n_steps": 1, "log_peak_memory_stats": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }  # fmt: skip


def torchtune_switches(model_dir: Path, dtype: str = "fp32", seq_len: int = SEQ_LEN) -> list[str]:
    """memfit's config of torchtune's lowest-memory recipe: 8-bit AdamW (paged on CUDA) in backward, full
    checkpointing, the cross-entropy in 8 chunks as ``CEWithChunkedOutputLoss`` cuts it; ``dtype`` weights rounded
    to nearest (as torchtune's), 1 x ``seq_len``."""
    return [
        f"checkpoint_dir={model_dir}", "method=full", "optimizer.name=paged_adamw8bit", "optimizer_in_backward=true",
        "max_grad_norm=0", "activation_checkpointing=full", "chunked_cross_entropy=8", "tiled_mlp=0", f"dtype={dtype}",
        "bf16_rounding=nearest", "device=cpu", "batch_size=1", f"seq_len={seq_len}", *DATA,
    ]  # fmt: skip


def row_3b_8bit(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``3b-8bit``: memfit running torchtune's switches (:func:`torchtune_switches`)."""
    config = torchtune_switches(model_dir)
    as_dict = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in config)}
    row = {"config": as_dict, "switches": _switches(as_dict), "forced": False}
    return {**row, **memfit_run("3b-8bit", config, 3, run_dir, args.guard_bytes)}


def row_torchtune(args: argparse.Namespace, model_dir: Path, run_dir: Path, name: str) -> dict[str, Any]:
    """A row of :data:`TORCHTUNE_ROWS`: torchtune's lowest-memory single-device recipe under the cap."""
    peer = TORCHTUNE_ROWS[name]
    if args.scale == "small":
        return {
            "outcome": "not run at --scale small",
            "predicted_peak_rss_gib": None,
            "measured_peak_rss_gib": None,
        }
    predicted = estimate(torchtune_switches(model_dir, peer.dtype, peer.seq_len), run_dir / "estimate.txt")
    tune = torchtune_venv(Path(args.torchtune_venv or Path(args.workdir).resolve() / "torchtune-venv"))
    steps = peer.steps
    out = run_dir / "output"
    shutil.rmtree(out, ignore_errors=True)
    config = run_dir / "torchtune.yaml"
    config.write_text(yaml.safe_dump(torchtune_config(model_dir, out, peer), sort_keys=False))
    cap_bytes = int(args.cap_gib * GIB)
    with memory_cap(cap_bytes, name) as (prefix, cap_text):
        cmd = [*prefix, str(tune), "run", "full_finetune_single_device", "--config", str(config)]
        run = run_measured(cmd, run_dir / "torchtune.log", cap_bytes + GIB, name)
    # the recipe's lines: the model built from the checkpoint, its tqdm bar ("epoch|step|Loss: ..."), the save
    loaded = run.first(r".*Model is initialized with precision")
    step_ends = [run.first(rf".*\d+\|{n}\|Loss: ") for n in range(1, steps + 1)]
    saved = run.first(r".*Saving final epoch checkpoint")
    peaks, phase_seconds, ended_in = split_phases(
        run, [("load", loaded), ("first_step", step_ends[0]), ("steady_step", step_ends[-1]),
              ("save", run.wall_seconds if saved is not None else None)]
    )  # fmt: skip
    done = [t for t in step_ends if t is not None]
    seconds = [round(b - a, 1) for a, b in zip([loaded or 0.0, *done], done, strict=False)]
    metrics = sorted((out / "logs").glob("*.txt")) if out.exists() else []
    losses = (
        [float(m.group(1)) for m in re.finditer(r"loss:(\S+)", metrics[-1].read_text())] if metrics else []
    )
    errors = [ln for _, ln in run.lines if re.match(r"\w*(Error|Exception)\b", ln)]
    if run.returncode == 0:
        outcome = "ok"
    elif run.signal is not None:
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) during {ended_in}"
    else:
        outcome = f"failed (exit {run.returncode}) during {ended_in}" + (f": {errors[-1]}" if errors else "")
    return {
        "command": _shown(cmd),
        "config": {"recipe": "full_finetune_single_device", "as": peer.recipe_config, "file": str(config),
                   "dtype": peer.dtype, "batch": f"1 x {peer.seq_len}", "steps": steps, "cap": cap_text},
        "switches": {"optimizer": "bitsandbytes PagedAdamW8bit (unpaged on CPU)", "optimizer_in_bwd": True,
                     "enable_activation_checkpointing": True, "loss": "CEWithChunkedOutputLoss"},
        "forced": False,
        **predicted_and_measured(predicted, run),
        "phase_peaks_gib": {k: peaks.get(k) for k in ("load", "first_step", "steady_step", "save")},
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load") if loaded is not None else None,
        "step_seconds": seconds,
        "tokens_per_second": _steady_tokens_per_second(seconds, peer.seq_len),
        "losses": losses,
        "checkpoint_gib": gib(_tree_bytes(out)) if saved is not None and out.exists() else None,
        "outcome": outcome,
        **_capped(args, cap_text, run, predicted),
        "versions": list(TORCHTUNE),
        "log": str(run_dir / "torchtune.log"),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------------------------------


def _cell(value: Any, fmt: str = "{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def reproduce_command(args: argparse.Namespace, name: str) -> str:
    """The command that runs row ``name`` as ``args`` ran it (options at their defaults left out)."""
    cmd = [".venv/bin/python", "bench/largest_model.py", "--rows", name]
    if args.scale != "full":
        cmd += ["--scale", args.scale]
    if name in FULL_ROWS and args.budget:
        cmd += ["--budget", args.budget]
    if name in FULL_ROWS and args.force_config:
        cmd += ["--force-config", *args.force_config]
    if name in ("3b-plain", "30b-a3b-peft", *TORCHTUNE_ROWS) and args.cap_gib != 22.0:
        cmd += ["--cap-gib", f"{args.cap_gib:g}"]
    return shlex.join(cmd)


def kept_prose(doc: Path) -> str | None:
    """The prose between the prose markers of ``doc``'s section, to keep when the section is rewritten."""
    text = doc.read_text() if doc.exists() else ""
    if PROSE_START not in text or PROSE_END not in text:
        return None
    prose = text[text.index(PROSE_START) + len(PROSE_START) : text.index(PROSE_END)].strip()
    return prose if prose and prose != PLACEHOLDER else None


def section(rows: list[dict[str, Any]], scale: str, prose: str | None = None) -> str:
    """The markdown section of ``rows`` (the JSON's list), with ``prose`` (default: the placeholder) between the
    prose markers."""
    # the JSON holds other benches' rows too (bench/preference.py)
    rows = [r for r in rows if r.get("name") in ROWS]
    command = ".venv/bin/python bench/largest_model.py" + (" --scale small" if scale == "small" else "")
    plain = argparse.Namespace(scale=scale, budget=None, force_config=None, cap_gib=22.0)
    default = {r["name"]: reproduce_command(plain, r["name"]) for r in rows}
    special = [
        f"`{r['reproduce']}`" for r in rows if r.get("reproduce", default[r["name"]]) != default[r["name"]]
    ]
    lines = [
        "## The largest model on 24 GiB",
        "",
        "Each row is one fresh process on this machine (2 CPU cores, 24 GiB of RAM, no swap), on a Hugging Face "
        "directory of random bf16 weights with Meta's or Qwen's `config.json` (GPT-2's tokenizer), the Dolly "
        "sample packed into full rows: fp32 weights and batch 1 x 512 tokens, but bf16 weights and 1 x 2048 for "
        "the 8B full fine-tunes and torchtune's 8B recipe. *Predicted* is `memfit estimate --json`'s "
        "`host_peak_rss_gib` of the row's config, and *predicted load / step / save* the same per phase (its "
        "`phase_peaks_gib` plus what the process holds besides its tensors); *measured* is the whole process's "
        "peak RSS (`/usr/bin/time -v`); "
        "the phase peaks come from the process's RSS sampled every 0.1 s, split at the lines memfit prints (load: "
        "to its banner, the set-up included; first step; the steady steps; save: the final checkpoint). Step "
        "seconds are between step lines; tok/s is memfit's own over the steps after the first. GiB = 1024**3 "
        "bytes." + (" **Scale small: tiny stand-in models, not the real rows.**" if scale == "small" else ""),
        "",
        f"Reproduce: `{command}` (every row, each in a fresh process; `--rows NAME` runs one and keeps the "
        "others' results)" + (f"; as run here: {', '.join(special)}" if special else ""),
        "",
        "| row | config | predicted (GiB) | measured (GiB) | load / first step / steady / save peak (GiB) "
        "| predicted load / step / save (GiB) | load (s) | step (s) | tok/s | checkpoint (GiB) | outcome |",
        "|---|---|---:|---:|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        p = r.get("phase_peaks_gib") or {}
        load = max((v for k, v in p.items() if k in ("setup", "load") and v is not None), default=None)
        phases = " / ".join(
            _cell(v) for v in (load, p.get("first_step"), p.get("steady_step"), p.get("save"))
        )
        q = r.get("predicted_phase_rss_gib") or {}
        predicted_phases = " / ".join(_cell(q.get(k)) for k in ("load", "step", "save")) if q else "—"
        switches = ", ".join(f"`{k}={v}`" for k, v in (r.get("switches") or {}).items()) or "—"
        if r.get("forced"):
            switches += " (forced)"
        steps = ", ".join(f"{s:.1f}" for s in r.get("step_seconds") or []) or "—"
        outcome = str(r.get("outcome", "")).replace("|", "/")[:200]
        lines.append(
            f"| {r['name']} | {switches} | {_cell(r.get('predicted_peak_rss_gib'))} "
            f"| {_cell(r.get('measured_peak_rss_gib'))} | {phases} | {predicted_phases} "
            f"| {_cell(r.get('load_seconds'), '{:.1f}')} "
            f"| {steps} | {_cell(r.get('tokens_per_second'), '{:,.1f}')} | {_cell(r.get('checkpoint_gib'))} "
            f"| {outcome} |"
        )
    for r in rows:
        if r.get("plan", {}).get("outcome") == "no plan fits":
            lines += ["", f"`{r['name']}`: the planner's message: {r['plan']['message'].strip()}"]
    lines += [
        "",
        PROSE_START,
        prose or PLACEHOLDER,
        PROSE_END,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        nargs="*",
        choices=ROWS,
        default=list(ROWS),
        help="rows to run (default: all; none: rewrite the section from the JSON's results)",
    )
    parser.add_argument(
        "--scale", choices=("full", "small"), default="full", help="small: tiny stand-in models"
    )
    parser.add_argument("--workdir", default=str(ROOT / "out" / "largest_model"), help="models and runs")
    parser.add_argument(
        "--budget", help="memfit plan's budget for the full rows (default: each row's own, FULL_ROWS)"
    )
    parser.add_argument(
        "--cap-gib", type=float, default=22.0, help="the plain loop's memory cap (default: 22)"
    )
    parser.add_argument(
        "--guard-gib", type=float, default=23.0, help="kill a memfit row whose RSS passes this (default: 23)"
    )
    parser.add_argument(
        "--torchtune-venv",
        help="3b-torchtune: a virtual environment with torchtune (default: WORKDIR/torchtune-venv)",
    )
    parser.add_argument(
        "--force-config", nargs="+", metavar="KEY=VAL", help="full rows: run these keys anyway"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep each row's output (checkpoints) and the random models (default: removed once measured)",
    )
    parser.add_argument(
        "--json", help="the results (default: docs/largest_model.json; small: under --workdir)"
    )
    parser.add_argument(
        "--out", help="the markdown to rewrite (default: docs/benchmarks.md; small: '-', print)"
    )
    parser.add_argument(
        "--clear-models",
        action="store_true",
        help="remove the other random models under WORKDIR/models when a row's model would not fit on disk",
    )
    parser.add_argument("--_plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._plain:
        return plain_loop(json.loads(args._plain))

    workdir = Path(args.workdir).resolve()
    small = args.scale == "small"
    default_json = workdir / "small" / "largest_model.json" if small else ROOT / "docs" / "largest_model.json"
    json_path = Path(args.json or default_json)
    out = args.out or ("-" if small else str(ROOT / "docs" / "benchmarks.md"))
    args.guard_bytes = int(args.guard_gib * GIB)
    runs = workdir / ("small" if small else "full")
    rows = [r for r in ROWS if r in args.rows]
    started = time.monotonic()
    results = json.loads(json_path.read_text()) if json_path.exists() else []
    for i, name in enumerate(rows):
        model_key = ROW_MODEL.get(name, "3b")
        model_dir, made = ensure_model(
            model_spec(model_key, args.scale), workdir, args.seed, args.clear_models
        )
        run_dir = runs / name
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"--- {name} ({made['num_params']:,} parameters)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        if name in FULL_ROWS:
            row = row_full(args, model_dir, run_dir, name)
        elif name in TORCHTUNE_ROWS:
            row = row_torchtune(args, model_dir, run_dir, name)
        elif name in QLORA_ROWS:
            row = row_qlora(args, model_dir, run_dir, name)
        elif name == "30b-a3b-peft":
            row = row_peft(args, model_dir, run_dir, name)
        else:
            run_row = {"3b-plain": row_3b_plain, "3b-8bit": row_3b_8bit}[name]
            row = run_row(args, model_dir, run_dir)
        row = measured_row(name, reproduce_command(args, name), args.scale, model_dir, made, row, t0)
        results = store_row(
            json_path, results, row, lambda r: ROWS.index(r["name"]) if r.get("name") in ROWS else len(ROWS)
        )
        if (
            not args.keep
        ):  # tens of GiB at full scale: the row's checkpoint, then the model no later row needs
            shutil.rmtree(run_dir / "output", ignore_errors=True)
            if all(ROW_MODEL.get(later, "3b") != model_key for later in rows[i + 1 :]):
                shutil.rmtree(model_dir, ignore_errors=True)
    text = section(results, args.scale, None if out == "-" else kept_prose(Path(out)))
    print(text)
    if out != "-":
        write_section(Path(out), SECTION, text)
    print(f"results: {json_path} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
