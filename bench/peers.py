"""memfit against a *peer*: a plain Hugging Face ``transformers`` + PyTorch training loop, on the same checkpoint
and the same batches, on CPU. Peak RSS and tokens/s of each, one fresh process per run.

- **Models**: two random-init Llamas, fp32: "25.6M" (dim 512, 8 layers, 8 query and 4 key/value heads, SwiGLU
  1400, vocab 2,048: 25,600,512 parameters) and "78.6M" (the loader benchmark's model, ``MODEL_78M`` of
  ``bench/loader.py``: dim 768, 12 layers, 12/4 heads, SwiGLU 2048). ``transformers.LlamaForCausalLM`` is built
  with a fixed seed and written with ``save_pretrained`` (safetensors) beside the tokenizer of the prepared data,
  so both sides start from the same file.
- **Data**: Tiny Shakespeare prepared once (``memfit prepare``, byte-level BPE of 2,048 ids, 10% held out). memfit
  draws its batches with :func:`memfit.data.run.text_data`; the peer calls the same reader for the same seed, so
  step ``n`` of both sees the same tokens (the losses agree to the last digit in the smoke tests).
- **Peer**: ``LlamaForCausalLM.from_pretrained`` (``use_cache`` off), a loop of forward, ``F.cross_entropy``,
  ``loss.backward()``, ``clip_grad_norm_(1.0)``, ``optimizer.step()``, ``zero_grad(set_to_none=True)``;
  ``torch.optim.AdamW`` over the usual two groups (weight decay 0.1 on matrices, none on norms), betas (0.9,
  0.95), constant lr. Its own equivalents of each variant: ``foreach=False`` / ``fused=True``;
  ``model.gradient_checkpointing_enable()``; ``bnb.optim.AdamW8bit`` / ``PagedAdamW8bit``; the optimizer step in
  backward as in PyTorch's tutorial "How to save memory by fusing the optimizer step into the backward pass" (one
  optimizer per parameter, stepped by a ``register_post_accumulate_grad_hook``; no clipping).
- **memfit**: ``memfit finetune checkpoint_dir=DIR method=full`` with the same batch, seed, optimizer and constant
  lr (``optimizer.warmup_steps=0 optimizer.min_lr=LR``), ``log_every=1``, plus the variant's overrides. The end of
  a memfit run (one validation batch, the final checkpoint, the loss plot) is inside its process and its RSS.
- **Measured**: peak RSS of the whole process (``ru_maxrss`` from ``os.wait4``; this script never imports torch,
  whose pages would otherwise count: a child's ``ru_maxrss`` includes its parent's high-water mark at the fork),
  and memfit's own ``peak_memory_rss`` (its ``metrics.jsonl``); tokens/s over the steps after ``--warmup``, from
  the per-step times the peer measures (batch drawn to ``loss.item()``) and from memfit's step records (the same
  span); memfit's ``mfu``; the loss of step 1 and of the last step on both sides. Runs of a variant alternate
  (peer, memfit, peer, memfit, ... with ``--repeats``); the table gives medians over the repeats.
- **--lockstep**: a variant's runs (the peer's, memfit's, and memfit's compiled one where the grid has it) are
  alive together and take turns, one step each, the others stopped (SIGSTOP / SIGCONT to each process group: only
  one runs at any time). Each first runs alone through its start-up and first step; each step is timed by the
  parent as the process's running time between its step records (memfit's ``metrics.jsonl`` lines, a line the
  peer appends), so time spent stopped counts for no step. On shared cores, where another tenant can slow every
  step by a third for tens of seconds, whole runs one after another catch such spells unevenly; steps in turns
  share them. The processes' own step times (which include their stopped time) are kept as
  ``inner_step_seconds``.

Reproduce (about 25 minutes on 2 CPU cores, on a quiet machine: an estimate from the per-step times of the smoke
tests)::

    .venv/bin/python bench/peers.py

It rewrites the section between the ``peers`` markers of ``docs/benchmarks.md`` and writes
``docs/peers_results.json`` and ``docs/peers_frontier.png``. ``--out -`` prints the section instead and leaves the
JSON and the plot in the work directory; ``--quick`` is a smoke test (a tiny model, 4 steps, 2 variants);
``--models`` and ``--variants`` choose the grid.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from docs_section import write_section
from loader import MODEL_78M
from lockstep import Stepper, run_lockstep

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "src" / "memfit" / "assets" / "tinyshakespeare.txt"

MODELS: dict[str, dict[str, int]] = {
    "25.6M": {"dim": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1400},
    "78.6M": {key.split(".")[1]: value for key, value in MODEL_78M.items()},
    "tiny": {"dim": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 176},
    "0.8M": {"dim": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 232},
}
"""Model name -> Llama shape (memfit's ``DecoderConfig`` field names); the vocabulary is the tokenizer's."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """What the peer's plain loop does for one variant."""

    optimizer: str = "AdamW"
    """``AdamW`` (torch) or a ``bitsandbytes.optim`` class name (``AdamW8bit``, ``PagedAdamW8bit``)."""
    implementation: str = "for_loop"
    """torch AdamW's update: ``for_loop`` (``foreach=False``, torch's own default on CPU), ``foreach`` or
    ``fused``."""
    in_backward: bool = False
    """Step one optimizer per parameter from a ``post_accumulate_grad`` hook (no clipping then)."""
    checkpointing: bool = False
    """``model.gradient_checkpointing_enable()``."""
    max_grad_norm: float = 1.0
    """``clip_grad_norm_`` before the step; 0 does not clip."""


LEAST_MEMORY = {
    "optimizer.name": "paged_adamw8bit",
    "optimizer_in_backward": True,
    "max_grad_norm": 0,
    "activation_checkpointing": "full",
    "chunked_cross_entropy": 8,
}

VARIANTS: dict[str, tuple[Peer | str | None, dict[str, Any]]] = {
    "AdamW (for-loop)": (Peer(), {"optimizer.implementation": "for_loop"}),
    "AdamW (for-loop), memfit compiled": (
        "AdamW (for-loop)",
        {"optimizer.implementation": "for_loop", "compile": True},
    ),
    "AdamW fused": (Peer(implementation="fused"), {"optimizer.implementation": "fused"}),
    "optimizer in backward": (
        Peer(in_backward=True, max_grad_norm=0.0),
        {"optimizer.implementation": "for_loop", "optimizer_in_backward": True, "max_grad_norm": 0},
    ),
    "activation checkpointing": (
        Peer(checkpointing=True),
        {"optimizer.implementation": "for_loop", "activation_checkpointing": "full"},
    ),
    "bnb AdamW8bit": (Peer(optimizer="AdamW8bit"), {"optimizer.name": "adamw8bit"}),
    "paged 8-bit + in backward + AC": (
        Peer(optimizer="PagedAdamW8bit", in_backward=True, checkpointing=True, max_grad_norm=0.0),
        {
            "optimizer.name": "paged_adamw8bit",
            "optimizer_in_backward": True,
            "max_grad_norm": 0,
            "activation_checkpointing": "full",
        },
    ),
    "paged 8-bit + in backward + AC, memfit compiled": (
        "paged 8-bit + in backward + AC",
        {
            "optimizer.name": "paged_adamw8bit",
            "optimizer_in_backward": True,
            "max_grad_norm": 0,
            "activation_checkpointing": "full",
            "compile": True,
        },
    ),
    "memfit fastest (compile, fused AdamW)": (None, {"optimizer.implementation": "fused", "compile": True}),
    "memfit least memory": (None, LEAST_MEMORY),
    "memfit least memory, compiled": (None, {**LEAST_MEMORY, "compile": True}),
}
"""Variant -> (the peer's equivalent; or the name of an earlier variant whose peer runs it is compared with; or
``None`` for a memfit-only row) and memfit's ``key=value`` overrides."""

GRID: dict[str, list[str]] = {
    "25.6M": list(VARIANTS),
    "78.6M": [
        "AdamW (for-loop)",
        "AdamW (for-loop), memfit compiled",
        "paged 8-bit + in backward + AC",
        "paged 8-bit + in backward + AC, memfit compiled",
        "memfit fastest (compile, fused AdamW)",
        "memfit least memory",
        "memfit least memory, compiled",
    ],
}
"""The default model x variant grid."""
SPEED_GRID: dict[str, list[str]] = {
    "25.6M": [
        "AdamW (for-loop)",
        "AdamW (for-loop), memfit compiled",
        "activation checkpointing",
        "paged 8-bit + in backward + AC",
        "paged 8-bit + in backward + AC, memfit compiled",
    ],
    "78.6M": [
        "AdamW (for-loop)",
        "AdamW (for-loop), memfit compiled",
        "paged 8-bit + in backward + AC",
        "paged 8-bit + in backward + AC, memfit compiled",
    ],
}
"""``--grid speed``: the rows of the speed goals (eager and compiled memfit against the plain loop at equal
settings), run with ``--repeats 3 --section peers-speed``."""
GRIDS = {"default": GRID, "speed": SPEED_GRID}
QUICK_VARIANTS = ["AdamW (for-loop)", "paged 8-bit + in backward + AC"]

WEIGHT_DECAY, BETAS, EPS = 0.1, (0.9, 0.95), 1e-8  # memfit's defaults, given to the peer too


# ----------------------------------------------------------------------------------------------------------------
# Children: the checkpoint, and the peer's training loop (each in a process of its own)
# ----------------------------------------------------------------------------------------------------------------


def build_checkpoint(spec: dict[str, Any]) -> None:
    """Write a random-init ``LlamaForCausalLM`` of ``spec["shape"]`` with the dataset's tokenizer; print its
    parameter count and vocabulary size.

    Args:
        spec: ``shape`` (:data:`MODELS` entry), ``seq_len``, ``seed``, ``tokenizer`` (the prepared dataset's
            tokenizer directory) and ``out`` (the directory to write).
    """
    import torch
    import transformers

    from memfit.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(spec["tokenizer"])
    shape = spec["shape"]
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=shape["dim"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=spec["seq_len"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
    )
    torch.manual_seed(spec["seed"])
    model = transformers.LlamaForCausalLM(config)
    partial = Path(spec["out"] + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    shutil.copytree(spec["tokenizer"], partial, dirs_exist_ok=True)
    partial.rename(spec["out"])
    print(
        json.dumps(
            {"num_params": sum(p.numel() for p in model.parameters()), "vocab_size": config.vocab_size}
        )
    )


def peer_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """The peer: train ``spec["checkpoint"]`` with a plain transformers + PyTorch loop.

    Args:
        spec: ``peer`` (a :class:`Peer` as a dict), ``checkpoint``, ``data`` (the prepared dataset), ``steps``,
            ``batch_size``, ``seq_len``, ``lr`` and ``seed``; optionally ``track_memory`` (true: the steps run
            inside memfit's :class:`~memfit.memory.tracker.MemoryTracker`, as ``memfit track_memory=true`` runs).

    Returns:
        ``losses`` and ``step_seconds`` per step, ``num_params``, ``imports_rss_mib`` (the process's peak after
        its imports) and the library versions; with ``track_memory``, also ``tracked_peak_bytes`` (the peak of
        live tensor bytes over the steps), ``tracked_breakdown`` (bytes by category at that peak) and
        ``tracked_peak_phase``.
    """
    import resource

    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import LlamaForCausalLM

    from memfit.config import load_config
    from memfit.data.run import text_data
    from memfit.data.tokens import read_manifest

    peer = Peer(**spec["peer"])
    if peer.optimizer != "AdamW":
        import bitsandbytes as bnb
    imports_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    # --- data: memfit's own reader, so step n draws memfit's batch n ---------------------------------------
    overrides = [f"data.path={spec['data']}", *(f"{k}={spec[k]}" for k in ("batch_size", "seq_len", "seed"))]
    overrides.append(f"checkpoint_dir={spec['checkpoint']}")  # seq_len is checked against its max_seq_len
    cfg = load_config(None, overrides)
    data = text_data(cfg, Path(spec["data"]), read_manifest(spec["data"]), spec["seq_len"])

    # --- model and optimizer ---------------------------------------------------------------------------------
    model = LlamaForCausalLM.from_pretrained(spec["checkpoint"], dtype=torch.float32)
    model.config.use_cache = False
    if peer.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()

    def make_optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        groups = [
            {"params": [p for p in params if p.ndim == 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if peer.optimizer == "AdamW":
            impl = {"foreach": peer.implementation == "foreach", "fused": peer.implementation == "fused"}
            return torch.optim.AdamW(groups, lr=spec["lr"], betas=BETAS, eps=EPS, **impl)
        return getattr(bnb.optim, peer.optimizer)(groups, lr=spec["lr"], betas=BETAS, eps=EPS)

    if peer.in_backward:
        optimizers = {p: make_optimizer([p]) for p in model.parameters()}

        def optimizer_hook(p: torch.nn.Parameter) -> None:
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(optimizer_hook)
    else:
        optimizer = make_optimizer(list(model.parameters()))

    tracker = None
    if spec.get("track_memory"):
        # live tensor bytes by category (an in-backward peer's optimizer state counts as temporaries)
        from memfit.memory.tracker import MemoryTracker

        tracker = MemoryTracker(model, None if peer.in_backward else optimizer, record_timeline=False)

    # --- the loop --------------------------------------------------------------------------------------------
    progress = open(spec["progress"], "a") if spec.get("progress") else None  # noqa: SIM115 (the whole loop)
    losses, seconds = [], []
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        with tracker if tracker is not None else contextlib.nullcontext():
            inputs, targets, _ = data.train_batch(step, 0)  # (B, T) each
            logits = model(input_ids=inputs).logits  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V) vs (B*T,)
            loss.backward()
            if not peer.in_backward:
                if peer.max_grad_norm:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), peer.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - t0)
        if progress is not None:  # --lockstep: the parent counts these lines
            progress.write("step\n")
            progress.flush()
    tracked = {}
    if tracker is not None:
        tracked = {
            "tracked_peak_bytes": tracker.peak_bytes,
            "tracked_breakdown": tracker.peak_breakdown,
            "tracked_peak_phase": tracker.peak_phase,
        }
    return {
        **tracked,
        "losses": losses,
        "step_seconds": seconds,
        "num_params": sum(p.numel() for p in model.parameters()),
        "imports_rss_mib": imports_rss_mib,
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            **({"bitsandbytes": bnb.__version__} if peer.optimizer != "AdamW" else {}),
        },
    }


# ----------------------------------------------------------------------------------------------------------------
# The parent: one process per run, measured from outside
# ----------------------------------------------------------------------------------------------------------------


def run_measured(cmd: list[str], env: dict[str, str], log_dir: Path) -> tuple[int, float, float, str]:
    """Run ``cmd`` to its end, its output into ``log_dir`` (``stdout.txt``, ``stderr.txt``).

    Returns:
        ``(exit code, peak RSS in MiB of the process and its waited-for children, wall seconds, stdout)``.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_dir / "stdout.txt", "w") as out, open(log_dir / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here, with its rusage (Popen.wait() would drop it)
    proc.returncode = os.waitstatus_to_exitcode(status)  # so that Popen does not wait for it again
    return (
        proc.returncode,
        usage.ru_maxrss / 1024,
        time.perf_counter() - start,
        (log_dir / "stdout.txt").read_text(),
    )


LOCKSTEP_TEXT = (
    ", the runs of a variant (peer, memfit, memfit compiled) alive together and taking turns one step each, the "
    "others stopped, each step timed by its process's running time (`--lockstep`: the slow spells of shared cores "
    "fall on every side alike)"
)
"""What the section says of ``--lockstep``."""


def failure(log_dir: Path, code: int) -> str:
    """The last line of a failed run's stderr (a table cell: no ``|``)."""
    lines = (log_dir / "stderr.txt").read_text().strip().splitlines() or [f"exit {code}"]
    return lines[-1][:160].replace("|", "/")


def tokens_per_second(step_seconds: list[float], tokens: int, warmup: int) -> float:
    """Tokens per second over the steps after the first ``warmup``."""
    timed = step_seconds[warmup:]
    return tokens * len(timed) / sum(timed)


def peer_command(
    args: argparse.Namespace, peer: Peer, checkpoint: Path, data: Path, progress: Path | None = None
) -> list[str]:
    """The command line of one peer run (``progress``: a file it appends a line to after each step)."""
    spec = {
        "peer": dataclasses.asdict(peer),
        "checkpoint": str(checkpoint),
        "data": str(data),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "progress": None if progress is None else str(progress),
    }
    return [sys.executable, __file__, "--_peer", json.dumps(spec)]


def run_peer(
    args: argparse.Namespace, env: dict[str, str], peer: Peer, checkpoint: Path, data: Path, out: Path
) -> dict:
    """One peer run in a fresh process: its measurements, or ``error``."""
    return run_result("peer", args, out, run_measured(peer_command(args, peer, checkpoint, data), env, out))


def memfit_settings(
    args: argparse.Namespace, overrides: dict, checkpoint: Path, data: Path, out: Path
) -> dict[str, Any]:
    """The ``key=value`` settings of one ``memfit finetune`` run (the variant's ``overrides`` last)."""
    return {
        "checkpoint_dir": checkpoint,
        "data.path": data,
        "method": "full",
        "output_dir": out / "run",
        "max_steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "device": "cpu",
        "optimizer.lr": args.lr,
        "optimizer.min_lr": args.lr,
        "optimizer.warmup_steps": 0,
        "log_every": 1,
        "eval_every": 0,
        "eval_batches": 1,
        "checkpoint_every": 0,
        "sample.max_new_tokens": 0,
        "tensorboard": "false",
        "progress_bar": "false",
        **overrides,
    }


def predict(spec: dict[str, Any]) -> dict[str, float]:
    """``memfit plan``'s predicted tokens/s of each memfit run: ``tokens / step_cost(...)["total"]`` with the CPU
    cost constants (:mod:`memfit.planner.cost`), from the run's own config; a child process, like the peer.

    Args:
        spec: ``{key: settings}`` (:func:`memfit_settings`).

    Returns:
        ``{key: tokens per second}``.
    """
    from memfit.build import run_model_config
    from memfit.config import load_config
    from memfit.planner.closed_form import model_state_bytes_closed_form
    from memfit.planner.cost import CostRequest, step_cost

    predicted = {}
    for key, settings in spec.items():
        cfg = load_config(None, [f"{k}={v}" for k, v in settings.items()], needs_weights=False)
        mcfg = run_model_config(cfg)
        states = model_state_bytes_closed_form(cfg, mcfg)
        cost = step_cost(CostRequest(cfg, mcfg, world_size=1, seq_len=cfg.seq_len, states=states))
        predicted[key] = cfg.batch_size * cfg.seq_len * cfg.gradient_accumulation_steps / cost["total"]
    return predicted


def memfit_command(
    args: argparse.Namespace, overrides: dict, checkpoint: Path, data: Path, out: Path
) -> list[str]:
    """The command line of one ``memfit finetune`` run into ``out / "run"`` (emptied first)."""
    shutil.rmtree(out, ignore_errors=True)
    settings = memfit_settings(args, overrides, checkpoint, data, out)
    return [sys.executable, "-m", "memfit", "finetune", *(f"{k}={v}" for k, v in settings.items())]


def peer_stepper(
    args: argparse.Namespace, env: dict[str, str], peer: Peer, checkpoint: Path, data: Path, out: Path
) -> Stepper:
    """A ``--lockstep`` peer run into ``out`` (its step lines in ``out / "progress.txt"``)."""
    progress = out / "progress.txt"
    return Stepper(peer_command(args, peer, checkpoint, data, progress), env, out, progress, "step")


def memfit_stepper(
    args: argparse.Namespace, env: dict[str, str], overrides: dict, checkpoint: Path, data: Path, out: Path
) -> Stepper:
    """A ``--lockstep`` ``memfit finetune`` run into ``out`` (its step records: ``metrics.jsonl``)."""
    cmd = memfit_command(args, overrides, checkpoint, data, out)
    return Stepper(cmd, env, out, out / "run" / "metrics.jsonl", '"tokens_per_second_per_gpu"')


def run_result(
    side: str,
    args: argparse.Namespace,
    out: Path,
    ran: tuple[int, float, float, str],
    step_seconds: list[float] | None = None,
) -> dict:
    """A finished run's measurements (the peer's from its printed result, memfit's from its ``metrics.jsonl``), or
    ``error``.

    Args:
        side: ``peer`` or ``memfit``.
        out: the run's directory (its logs; memfit's ``run/`` output).
        ran: :func:`run_measured`'s ``(exit code, peak RSS MiB, wall seconds, stdout)``.
        step_seconds: the parent's times of its steps after the first (``--lockstep``); by default the run's own
            (the peer's measured in its loop, memfit's from its step records). The run's own are then kept as
            ``inner_step_seconds``.
    """
    code, rss, wall, stdout = ran
    if code != 0:
        return {"error": failure(out, code), "rss_mib": rss, "wall_seconds": wall}
    if side == "peer":
        result = json.loads(stdout.strip().splitlines()[-1])
    else:
        records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        shutil.rmtree(
            out / "run" / "checkpoints"
        )  # the final checkpoint: weights and optimizer state, unused here
        steps = [r for r in records if "tokens_per_second_per_gpu" in r]
        result = {
            "losses": [r["loss"] for r in steps],
            "step_seconds": [args.batch_size * args.seq_len / r["tokens_per_second_per_gpu"] for r in steps],
            "metrics_peak_rss_mib": max(r["peak_memory_rss"] for r in steps) * 1024,
            # FLOPs per token / peak FLOP/s
            "mfu_per_token_per_second": steps[0]["mfu"] / steps[0]["tokens_per_second_per_gpu"],
        }
    if step_seconds is not None:
        inner = result["step_seconds"]
        result["inner_step_seconds"], result["step_seconds"] = inner, inner[:1] + step_seconds
    seconds = result["step_seconds"]
    rate = tokens_per_second(seconds, args.batch_size * args.seq_len, args.warmup)
    result.update(rss_mib=rss, wall_seconds=wall, tokens_per_second=rate)
    if side == "memfit":
        result["mfu"] = rate * result["mfu_per_token_per_second"]
        # the first step's time over a timed step's: compilation, with compile=true
        result["first_step_extra_seconds"] = seconds[0] - statistics.median(seconds[args.warmup :])
    return result


def run_memfit(
    args: argparse.Namespace, env: dict[str, str], overrides: dict, checkpoint: Path, data: Path, out: Path
) -> dict:
    """One ``memfit finetune`` run in a fresh process: its measurements from outside and from its
    ``metrics.jsonl``, or ``error``."""
    cmd = memfit_command(args, overrides, checkpoint, data, out)
    return run_result("memfit", args, out, run_measured(cmd, env, out))


def announce(where: Path, result: dict, steps: int) -> None:
    """One line on stderr about a finished run."""
    if "error" in result:
        print(f"{where}: FAILED: {result['error']}", file=sys.stderr, flush=True)
        return
    print(
        f"{where}: RSS {result['rss_mib']:,.0f} MiB, {result['tokens_per_second']:,.0f} tok/s, step-1 loss "
        f"{result['losses'][0]:.6f}, step-{steps} loss {result['losses'][-1]:.6f}, {result['wall_seconds']:.0f} s",
        file=sys.stderr,
        flush=True,
    )


def median_of(runs: list[dict], key: str) -> float | None:
    """The median of ``key`` over the runs that did not fail, ``None`` when all did."""
    values = [r[key] for r in runs if "error" not in r]
    return statistics.median(values) if values else None


def summarize(
    model: str,
    variant: str,
    peer_runs: list[dict],
    memfit_runs: list[dict],
    reference: float | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One table row: medians over the repeats, and the largest loss differences between peer and memfit.

    ``reference`` is a peer's step-1 loss on this model (the same for every variant), compared with a memfit-only
    row's. Besides each run's tokens/s over its timed steps, ``*_median_step_tokens_per_second`` divides the
    batch's tokens by the run's median timed step: on shared cores a step now and then takes 1.5x its neighbours
    (another tenant), which moves a 17-step mean by several percent and the median hardly.
    """
    row: dict[str, Any] = {"model": model, "variant": variant}
    tokens = args.batch_size * args.seq_len
    for side, runs in (("peer", peer_runs), ("memfit", memfit_runs)):
        row[f"{side}_rss_mib"] = median_of(runs, "rss_mib")
        row[f"{side}_tokens_per_second"] = median_of(runs, "tokens_per_second")
        rates = [
            tokens / statistics.median(r["step_seconds"][args.warmup :]) for r in runs if "error" not in r
        ]
        row[f"{side}_median_step_tokens_per_second"] = statistics.median(rates) if rates else None
        row[f"{side}_errors"] = [r["error"] for r in runs if "error" in r]
    if args.lockstep:
        row["paired_step_ratio"] = paired_step_ratio(peer_runs, memfit_runs, args.warmup)
    row["memfit_metrics_peak_rss_mib"] = median_of(memfit_runs, "metrics_peak_rss_mib")
    row["memfit_mfu"] = median_of(memfit_runs, "mfu")
    per_rate = median_of(memfit_runs, "mfu_per_token_per_second")  # the same model FLOPs on both sides
    row["peer_mfu"] = ratio(row["peer_tokens_per_second"], None if per_rate is None else 1 / per_rate)
    row["memfit_first_step_extra_seconds"] = median_of(memfit_runs, "first_step_extra_seconds")
    ok_peer = [r for r in peer_runs if "error" not in r]
    ok_memfit = [r for r in memfit_runs if "error" not in r]
    first = [r["losses"][0] for r in ok_peer] or ([reference] if reference is not None else [])
    row["step1_loss_diff"] = max((abs(p - m["losses"][0]) for p in first for m in ok_memfit), default=None)
    row["last_loss_diff"] = max(
        (abs(p["losses"][-1] - m["losses"][-1]) for p in ok_peer for m in ok_memfit), default=None
    )
    return row


def paired_step_ratio(peer_runs: list[dict], memfit_runs: list[dict], warmup: int) -> float | None:
    """``--lockstep``: the median over every timed step ``k`` of every repeat of the peer's step ``k`` time over
    memfit's (the two ran one turn apart, so a slow spell of the machine falls on both), or ``None``.

    A speed ratio (above 1: memfit faster), steadier than the ratio of the runs' tokens/s, which the machine's drift
    over a run still moves by a few percent when it lands on one side's turns more than the other's."""
    peers = {r["repeat"]: r for r in peer_runs if "error" not in r}
    ratios = [
        p / m
        for r in memfit_runs
        if "error" not in r and r["repeat"] in peers
        for p, m in zip(peers[r["repeat"]]["step_seconds"][warmup:], r["step_seconds"][warmup:], strict=True)
    ]
    return statistics.median(ratios) if ratios else None


def cell(value: float | None, fmt: str) -> str:
    """``value`` formatted, or an em dash when there is none."""
    return "—" if value is None else format(value, fmt)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` when either is missing."""
    return None if a is None or b is None else a / b


def table(rows: list[dict], steps: int) -> str:
    """The markdown table of the summarized rows (``--lockstep``: the paired-steps ratio in place of the
    median-step one)."""
    paired = any("paired_step_ratio" in r for r in rows)
    head = (
        "| model | variant | peer RSS (MiB) | memfit RSS (MiB) | memfit/peer RSS | peer tok/s | memfit tok/s "
        f"| memfit/peer tok/s | memfit/peer ({'paired steps' if paired else 'median step'}) | plan tok/s "
        "| plan/memfit tok/s | peer MFU | memfit MFU "
        f"| memfit step 1 extra (s) | step-1 loss abs diff | step-{steps} loss abs diff |"
    )
    lines = [head, "|---|---|" + "---:|" * 14]
    for r in rows:
        errors = r["peer_errors"] + r["memfit_errors"]
        note = f" (failed: {errors[0]})" if errors else ""
        median_step = (
            r.get("paired_step_ratio")
            if paired
            else ratio(
                r.get("memfit_median_step_tokens_per_second"), r.get("peer_median_step_tokens_per_second")
            )
        )
        lines.append(
            f"| {r['model']} | {r['variant']}{note} | {cell(r['peer_rss_mib'], ',.0f')} "
            f"| {cell(r['memfit_rss_mib'], ',.0f')} | {cell(ratio(r['memfit_rss_mib'], r['peer_rss_mib']), '.2f')} "
            f"| {cell(r['peer_tokens_per_second'], ',.0f')} | {cell(r['memfit_tokens_per_second'], ',.0f')} "
            f"| {cell(ratio(r['memfit_tokens_per_second'], r['peer_tokens_per_second']), '.2f')} "
            f"| {cell(median_step, '.2f')} "
            f"| {cell(r.get('plan_tokens_per_second'), ',.0f')} "
            f"| {cell(ratio(r.get('plan_tokens_per_second'), r['memfit_tokens_per_second']), '.2f')} "
            f"| {cell(r['peer_mfu'], '.1%')} | {cell(r['memfit_mfu'], '.1%')} "
            f"| {cell(r['memfit_first_step_extra_seconds'], '.1f')} | {cell(r['step1_loss_diff'], '.1e')} "
            f"| {cell(r['last_loss_diff'], '.1e')} |"
        )
    return "\n".join(lines)


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point dominates (less or equal RSS and greater or equal speed), by RSS.

    Args:
        points: ``(peak RSS MiB, tokens/s)``.
    """
    frontier: list[tuple[float, float]] = []
    for rss, speed in sorted(points, key=lambda p: (p[0], -p[1])):
        if not frontier or speed > frontier[-1][1]:
            frontier.append((rss, speed))
    return frontier


def plot(rows: list[dict], path: Path) -> None:
    """Peak RSS against tokens/s, one panel per model, peer and memfit points and their Pareto frontier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 5.5), dpi=120, squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        points = []
        for side, marker, color in (("peer", "o", "tab:blue"), ("memfit", "s", "tab:orange")):
            mine = [
                (r[f"{side}_rss_mib"], r[f"{side}_tokens_per_second"], r["variant"])
                for r in rows
                if r["model"] == model and r[f"{side}_rss_mib"] is not None
                and r[f"{side}_tokens_per_second"] is not None
                and not (side == "peer" and isinstance(VARIANTS[r["variant"]][0], str))  # drawn with its own
            ]  # fmt: skip
            ax.scatter(
                [p[0] for p in mine], [p[1] for p in mine], marker=marker, color=color, label=side, zorder=3
            )
            for rss, speed, variant in mine:
                label = variant if variant.startswith(side) else f"{side}: {variant}"
                ax.annotate(label, (rss, speed), textcoords="offset points", xytext=(4, 4), fontsize=6)
            points += [(p[0], p[1]) for p in mine]
        frontier = pareto(points)
        if frontier:
            ax.step(
                [p[0] for p in frontier], [p[1] for p in frontier], where="post", color="gray", linestyle="--",
                label="Pareto frontier", zorder=2,
            )  # fmt: skip
        ax.set_title(f"model {model}")
        ax.set_xlabel("peak RSS (MiB)")
        ax.set_ylabel("tokens/s")
        ax.margins(x=0.25, y=0.1)  # room for the labels
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle("memfit vs a plain transformers + PyTorch loop (CPU, fp32): memory against speed")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def reproduce_command(argv: list[str], script: str = "bench/peers.py") -> str:
    """This run's command line (of ``script``), without where it wrote (``--workdir``, ``--out``)."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith(("--workdir=", "--out=")):
            skip = False
        elif arg in ("--workdir", "--out"):
            skip = True
        else:
            kept.append(shlex.quote(arg))
    return " ".join([f".venv/bin/python {script}", *kept])


def section(rows: list[dict], runs: list[dict], args: argparse.Namespace, models: dict[str, dict]) -> str:
    """The markdown section for docs/benchmarks.md.

    Args:
        rows: :func:`summarize`'s rows.
        runs: every run's measurements.
        args: the command's arguments.
        models: model name -> ``num_params`` and ``vocab_size`` of its checkpoint.
    """
    shapes = "; ".join(
        f"{name}: {info['num_params']:,} parameters (dim {MODELS[name]['dim']}, {MODELS[name]['num_layers']} "
        f"layers, {MODELS[name]['num_heads']}/{MODELS[name]['num_kv_heads']} heads, SwiGLU "
        f"{MODELS[name]['intermediate_size']}, vocab {info['vocab_size']:,})"
        for name, info in models.items()
    )
    imports = median_of([r for r in runs if r["side"] == "peer"], "imports_rss_mib")
    baseline = (
        ""
        if imports is None
        else f" A peer process holds {imports:,.0f} MiB after its imports (torch; transformers, which imports "
        "torchao when it is installed, as here; memfit's data reader), before it loads the model."
    )
    return "\n".join(
        [
            "## memfit vs a plain transformers + PyTorch loop"
            + (
                ""
                if args.section == "peers"
                else f" ({', '.join(models)}, {args.batch_size} x {args.seq_len})"
            ),
            "",
            f"The same random-init checkpoint (`save_pretrained`, fp32; {shapes}) trained on the same batches of "
            f"Tiny Shakespeare ({args.batch_size} x {args.seq_len} tokens, AdamW lr {args.lr:g} constant, "
            f"{args.steps} steps) by a plain loop (`LlamaForCausalLM`, `loss.backward()`, `optimizer.step()`, with "
            "the peer's own equivalent of each switch) and by `memfit finetune method=full`. One fresh process per "
            f"run{LOCKSTEP_TEXT if args.lockstep else ''}; RSS is the process's peak (`ru_maxrss`; memfit's "
            "includes the end of its run: one validation "
            f"batch, the final checkpoint, the loss plot).{baseline} Tokens/s over the steps after the first "
            f"{args.warmup}; "
            "loss diffs compare the two sides' losses at the same step (a memfit-only row's step-1 loss is compared "
            f"with the peer's). Medians of {args.repeats} run{'s' * (args.repeats != 1)} of each side. "
            + (
                "The paired-steps ratio is the median over every timed step of every repeat of the peer's step time "
                "over memfit's same step, one turn apart (the steadiest figure here). "
                if args.lockstep
                else "The median-step ratio divides the batch by each run's median timed step instead (robust to the "
                "occasional step that another tenant of shared cores slows by half). "
            )
            + "Plan tok/s: "
            "`memfit plan`'s prediction for memfit's config (`step_cost` with the CPU constants of "
            "`memfit.planner.cost`). Details in the module docstring.",
            "",
            f"Reproduce: `{reproduce_command(args.argv)}` (2 CPU cores, fp32).",
            "",
            table(rows, args.steps),
            "",
            f"![peak RSS against tokens/s]({args.section.replace('-', '_')}_frontier.png)",
        ]
    )


def prepare_inputs(args: argparse.Namespace, work: Path, env: dict[str, str]) -> tuple[Path, dict[str, dict]]:
    """The prepared dataset and one checkpoint per model of the grid (reused when the work directory has them).

    Returns:
        ``(dataset directory, model name -> its checkpoint's ``spec`` (shape, ...), num_params and vocab_size)``.
    """
    data = work / "data"
    if not (data / "manifest.json").exists():
        subprocess.run([sys.executable, "-m", "memfit", "prepare", "--out", str(data), "--source",
                        f"tinyshakespeare={CORPUS}", "--quiet", "val_fraction=0.1"], env=env, check=True)  # fmt: skip
    models = {}
    for model in args.grid:
        checkpoint = work / f"checkpoint_{model}"
        info = checkpoint / "bench_info.json"
        spec = {
            "shape": MODELS[model],
            "seq_len": args.seq_len,
            "seed": args.seed,
            "tokenizer": str(data / "tokenizer"),
            "out": str(checkpoint),
        }
        if not info.exists() or json.loads(info.read_text())["spec"] != spec:
            shutil.rmtree(checkpoint, ignore_errors=True)
            made = subprocess.run(
                [sys.executable, __file__, "--_checkpoint", json.dumps(spec)],
                env=env,
                capture_output=True,
                text=True,
            )
            if made.returncode != 0:
                raise RuntimeError(made.stderr[-3000:])
            info.write_text(json.dumps({"spec": spec, **json.loads(made.stdout.strip().splitlines()[-1])}))
        models[model] = json.loads(info.read_text())
        print(f"model {model}: {models[model]['num_params']:,} parameters", file=sys.stderr, flush=True)
    return data, models


def matmul_ceiling(env: dict[str, str], probes: int = 3) -> float:
    """The fp32 matmul ceiling of this machine's cores in FLOP/s: the best of ``probes`` fresh processes running
    :func:`memfit.flops.cpu_matmul_flops_per_second` (each the best of 5 matmuls). Every memfit run gets it as
    ``peak_flops``, so their ``mfu`` share one denominator however busy the machine was when each started."""
    code = "from memfit.flops import cpu_matmul_flops_per_second as f; print(f())"
    return max(
        float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True).stdout)
        for _ in range(probes)
    )  # fmt: skip


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's word for it."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: 25.6M and 78.6M")
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), help="for every model; default: the grid (see GRID)"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side per variant, interleaved")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="weight init and batch draws")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: the tiny model, 4 steps, 2 variants"
    )
    parser.add_argument("--grid", choices=list(GRIDS), default="default", help="the model x variant grid")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="the runs of a variant (peer, memfit, memfit compiled) alive together, taking turns step by step, "
        "each timed by its running time (robust to the slow spells of shared cores)",
    )
    parser.add_argument("--workdir", default=None, help="reuse its prepared data and checkpoints")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    parser.add_argument(
        "--section",
        default="peers",
        help="the section of --out to rewrite; its results and plot are <section>_results.json and "
        "<section>_frontier.png beside it (a second grid, such as the 0.8M model at another batch, keeps the "
        "default grid's table)",
    )
    parser.add_argument("--_peer", help=argparse.SUPPRESS)
    parser.add_argument("--_checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--_predict", help=argparse.SUPPRESS)
    parser.add_argument(
        "--from-results",
        help="a results JSON of an earlier run (its --workdir kept): summarize its runs again and write the section, "
        "measuring nothing",
    )
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.models, args.steps, args.warmup = args.models or ["tiny"], 4, 1
        args.variants = args.variants or QUICK_VARIANTS
    grid = GRIDS[args.grid]
    models = args.models or list(grid)
    args.grid = {m: args.variants or grid.get(m, QUICK_VARIANTS) for m in models}
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main() -> int:
    args = parse_args()
    if args._checkpoint:
        build_checkpoint(json.loads(args._checkpoint))
        return 0
    if args._peer:
        print(json.dumps(peer_loop(json.loads(args._peer))))
        return 0
    if args._predict:
        print(json.dumps(predict(json.loads(args._predict))))
        return 0

    started = time.perf_counter()
    if args.from_results:
        previous = json.loads(Path(args.from_results).read_text())
        for key, value in previous["settings"].items():
            if key not in ("from_results", "out", "section"):
                setattr(args, key, value)
        work, env = Path(args.workdir), {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        data, models, runs = work / "data", previous["models"], previous["runs"]
        peak_flops = previous["machine"]["fp32_matmul_flops_per_second"]
        started -= previous["seconds"]
    else:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="memfit_peers_bench_"))
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
        data, models = prepare_inputs(args, work, env)
        peak_flops = matmul_ceiling(env)
        print(f"fp32 matmul ceiling: {peak_flops / 1e9:.1f} GFLOP/s", file=sys.stderr, flush=True)
        runs = measure(args, env, work, data, peak_flops)
    rows = summarize_runs(runs, args)

    # the planner's prediction of each memfit row, from the same settings, in a child (this process keeps torch out)
    plans = {
        str(i): {
            k: str(v)
            for k, v in memfit_settings(
                args,
                {**VARIANTS[row["variant"]][1], "peak_flops": peak_flops},
                work / f"checkpoint_{row['model']}",
                data,
                work / "plan",
            ).items()
        }
        for i, row in enumerate(rows)
    }
    code, _, _, stdout = run_measured(
        [sys.executable, __file__, "--_predict", json.dumps(plans)], env, work / "plan"
    )
    if code == 0:
        for i, rate in json.loads(stdout.strip().splitlines()[-1]).items():
            rows[int(i)]["plan_tokens_per_second"] = rate
    else:
        print(f"the planner's predictions failed: {failure(work / 'plan', code)}", file=sys.stderr)

    docs = work if args.out == "-" else Path(args.out).parent
    text = section(rows, runs, args, models)
    stem = args.section.replace("-", "_")
    plot(rows, docs / f"{stem}_frontier.png")
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    results = {
        "settings": settings,
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "fp32_matmul_flops_per_second": peak_flops,
        },
        "models": models,
        "rows": rows,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    (docs / f"{stem}_results.json").write_text(json.dumps(results, indent=1))
    print(text)
    if args.out != "-":
        write_section(Path(args.out), args.section, text)
    print(
        f"took {time.perf_counter() - started:.0f} s; raw results in {docs / f'{stem}_results.json'}",
        file=sys.stderr,
    )
    return 0


def measure(
    args: argparse.Namespace, env: dict[str, str], work: Path, data: Path, peak_flops: float
) -> list[dict]:
    """Every run of the grid, the sides of a variant alternating over the repeats: a result each, with its
    ``model``, ``variant``, ``side`` and ``repeat``."""
    if args.lockstep:
        return measure_lockstep(args, env, work, data, peak_flops)
    runs: list[dict] = []
    for model, variants in args.grid.items():
        checkpoint = work / f"checkpoint_{model}"
        for variant in variants:
            peer, overrides = VARIANTS[variant]
            for repeat in range(args.repeats):  # the sides alternate: peer, memfit, peer, memfit, ...
                out = run_dir(work, model, variant, repeat)
                for side in ("peer", "memfit") if isinstance(peer, Peer) else ("memfit",):
                    if side == "peer":
                        result = run_peer(args, env, peer, checkpoint, data, out / side)
                    else:
                        result = run_memfit(
                            args, env, {**overrides, "peak_flops": peak_flops}, checkpoint, data, out / side
                        )
                    runs.append(
                        {"model": model, "variant": variant, "side": side, "repeat": repeat, **result}
                    )
                    announce(out / side, result, args.steps)
    return runs


def run_dir(work: Path, model: str, variant: str, repeat: int) -> Path:
    """Where a repeat of a model's variant runs (a ``peer`` and a ``memfit`` directory inside)."""
    return work / "runs" / model / variant.replace(" ", "_").replace(",", "") / str(repeat)


def measure_lockstep(
    args: argparse.Namespace, env: dict[str, str], work: Path, data: Path, peak_flops: float
) -> list[dict]:
    """Every run of the grid, ``--lockstep``: a variant's peer run, its memfit run and the memfit runs of the
    variants compared with its peer (its compiled row) are alive together and take turns step by step
    (:func:`lockstep.run_lockstep`); the order of the turns rotates over the repeats. A result each, as
    :func:`measure`'s."""
    runs: list[dict] = []
    for model, variants in args.grid.items():
        checkpoint = work / f"checkpoint_{model}"
        grouped: set[str] = set()
        for variant in variants:
            if variant in grouped:
                continue
            peer = VARIANTS[variant][0]
            group = [variant] + [v for v in variants if isinstance(peer, Peer) and VARIANTS[v][0] == variant]
            grouped.update(group)
            for repeat in range(args.repeats):
                members = [("peer", variant)] if isinstance(peer, Peer) else []
                members += [("memfit", v) for v in group]
                turn = repeat % len(members)
                members = members[turn:] + members[:turn]
                outs = [run_dir(work, model, name, repeat) / side for side, name in members]
                steppers = [
                    peer_stepper(args, env, peer, checkpoint, data, out)
                    if side == "peer"
                    else memfit_stepper(
                        args, env, {**VARIANTS[name][1], "peak_flops": peak_flops}, checkpoint, data, out
                    )
                    for (side, name), out in zip(members, outs, strict=True)
                ]
                run_lockstep(steppers, args.steps)
                for (side, name), stepper, out in zip(members, steppers, outs, strict=True):
                    code, rss, wall, _ = stepper.ran
                    if code == 0 and not stepper.complete(args.steps):  # its own step times include the stops
                        result = {"error": f"saw {len(stepper.marks)} of {args.steps} step records", "rss_mib": rss,
                                  "wall_seconds": wall}  # fmt: skip
                    else:
                        later = stepper.later_step_seconds()
                        result = run_result(side, args, out, stepper.ran, later)
                    runs.append({"model": model, "variant": name, "side": side, "repeat": repeat, **result})
                    announce(out, result, args.steps)
    return runs


def summarize_runs(runs: list[dict], args: argparse.Namespace) -> list[dict]:
    """A row per model and variant of the grid (:func:`summarize`); a variant that names an earlier one is compared
    with that one's peer runs, a memfit-only row's step-1 loss with the model's first peer run's."""
    rows = []
    for model, variants in args.grid.items():
        reference = None
        for variant in variants:
            peer = VARIANTS[variant][0]
            peer_variant = peer if isinstance(peer, str) else variant

            def side_runs(side: str, name: str, model: str = model) -> list[dict]:
                return [r for r in runs if (r["model"], r["variant"], r["side"]) == (model, name, side)]

            peer_runs = side_runs("peer", peer_variant) if peer is not None else []
            ok_peer = [r for r in peer_runs if "error" not in r]
            if reference is None and ok_peer:
                reference = ok_peer[0]["losses"][0]
            rows.append(summarize(model, variant, peer_runs, side_runs("memfit", variant), reference, args))
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
