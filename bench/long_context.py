"""Long context on a host: peak memory and speed of one training step against the sequence length T, for memfit
with and without its long-context switches and for a plain transformers + PyTorch loop, on CPU.

- **Model**: the 25.6M-parameter Llama of ``bench/peers.py`` (``MODELS["25.6M"]``: dim 512, 8 layers, 8 query and
  4 key/value heads, SwiGLU 1400, vocab 2,048), random init, fp32, written once with ``save_pretrained`` by
  :func:`peers.build_checkpoint` with ``max_position_embeddings`` 32,768 (so every T here, and the check run, is
  within the model's ``max_seq_len``).
- **Data**: Tiny Shakespeare prepared as ``bench/peers.py`` prepares it (the ``.txt`` is one document: no document
  boundary inside a window) for configurations (a)-(d); for (e) the same text cut into one document per speech
  (split on blank lines, one ``{"text": ...}`` JSON line each, about 7,200 documents of about 55 tokens), prepared
  with ``memfit prepare --tokenizer`` the checkpoint (the same ids).
- **Configurations** (:data:`CONFIGS`; batch 1, AdamW with the for-loop update as ``bench/peers.py``'s, constant
  lr): (a) ``memfit finetune method=full`` without techniques; (b) with ``activation_checkpointing=full``; (c) the
  long-context set ``activation_checkpointing=full tiled_mlp=auto chunked_cross_entropy=auto
  activation_offloading=true`` (on CPU offloading moves nothing: the host is the device); (d) the peer's plain loop
  (``bench/peers.py``) with ``model.gradient_checkpointing_enable()``; (e) (c) on the speeches with
  ``data.cross_document_attention=false`` (attention within each document, in blocks of queries: no (T, T) mask).
- **Measured**, one fresh process per point, every process with ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc returns
  big frees to the kernel, so the resident set follows the live bytes): peak RSS of the whole process
  (``ru_maxrss`` from ``os.wait4``; this script imports neither torch nor matplotlib before its last child has
  run, since a child's ``ru_maxrss`` includes its parent's pages at the fork), tokens/s of the second step (the
  first pays one-off costs; memfit: its step record's ``tokens_per_second_per_gpu`` with ``log_every=1``; the
  peer: its own step time) and the peak of live tensor bytes from memfit's
  :class:`~memfit.memory.tracker.MemoryTracker` (memfit: ``track_memory=true``, the ``memory_breakdown`` of its
  step records; the peer: the tracker around its steps). The tracker slows a step, so by default the live bytes
  come from a second run of each point (``--tracking separate``; ``same`` measures everything in the tracked run:
  at T = 2,048 the tracked run's peak RSS was 2-3 MiB higher, its step times within the busy machine's noise, up
  to 15% slower).
  A memfit process ends with its run's end inside it: one validation batch of T tokens and the final checkpoint
  (``eval_every=0 eval_batches=1 checkpoint_every=0 sample.max_new_tokens=0``); its own ``peak_memory_rss`` (up to
  the last step record, the training steps only) is in the JSON as ``metrics_peak_rss_mib``.
- **Derived** per configuration: bytes per token at long T, the slope of peak RSS (and of live bytes) between the
  two longest T (8K and 16K); the longest T that ``--budget-gib`` (4 GiB) allows on that line (``intercept + slope
  * T <= budget``); then one check run of (c) at that T or 32,768, whichever is smaller (a multiple of 1,024), its
  measured peak next to the line's. And the floor that checkpointing leaves on a host for (c), by hand from the
  model's shape (:func:`floor_bytes`), against which (c)'s bytes per token are compared.

Reproduce (about 3.5 hours on 2 CPU cores, on a quiet machine; an estimate: at T = 2,048 a step of (c) took
12-25 s on a busy machine, its FLOPs grow about 22x to 16K (attention's share with T) and 80x to the 32K check
run, which alone takes about 35 minutes; ``--tracking same`` takes about 2 hours)::

    .venv/bin/python bench/long_context.py

It rewrites the section between the ``long_context`` markers of ``docs/benchmarks.md`` and writes
``docs/long_context_results.json`` and ``docs/long_context.png``. ``--out -`` prints the section instead and
leaves the JSON and the plot in the work directory; ``--quick`` is a smoke test (a tiny model, T 256 and 512, one
step, the check run at most 2,048 tokens: 2-3 minutes); ``--configs``, ``--lengths`` and ``--budget-gib`` choose
the grid, ``--work DIR`` keeps the prepared data, checkpoint and every run's logs (``--reuse`` then skips the points
already measured there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

from docs_section import write_section
from peers import (
    CORPUS,
    MODELS,
    ROOT,
    Peer,
    cell,
    cpu_model,
    failure,
    matmul_ceiling,
    prepare_inputs,
    ratio,
    run_measured,
    run_memfit,
)

MIB, GIB = 1024**2, 1024**3
PEERS_SCRIPT = Path(__file__).resolve().parent / "peers.py"

LONG_CONTEXT = {
    "activation_checkpointing": "full",
    "tiled_mlp": "auto",
    "chunked_cross_entropy": "auto",
    "activation_offloading": True,
}
"""memfit's long-context set: configuration (c)."""


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the grid."""

    label: str
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """memfit's ``key=value`` overrides (besides the ones every memfit point gets: :func:`memfit_point`)."""
    peer: Peer | None = None
    """The peer's plain loop instead of memfit."""
    speeches: bool = False
    """Train on Tiny Shakespeare cut into one document per speech (document boundaries inside every window)."""


CONFIGS: dict[str, Config] = {
    "a": Config("memfit, no techniques"),
    "b": Config("memfit, activation_checkpointing=full", {"activation_checkpointing": "full"}),
    "c": Config("memfit, long-context set", LONG_CONTEXT),
    "d": Config("plain loop + gradient_checkpointing_enable()", peer=Peer(checkpointing=True)),
    "e": Config(
        "memfit, long-context set, packed documents",
        {**LONG_CONTEXT, "data.cross_document_attention": False},
        speeches=True,
    ),
}
"""Configuration key -> what runs (see the module doc)."""

LENGTHS = [2048, 4096, 8192, 16384]
QUICK_LENGTHS = [256, 512]
CHECK_MAX = 32768
"""The check run's longest T (and the checkpoint's ``max_seq_len``)."""
QUICK_CHECK_MAX = 2048
LONG_CONTEXT_KEY, PEER_KEY = "c", "d"
"""The configurations the goals compare."""
GOALS = {"bytes_per_token_vs_peer": 1 / 3, "tokens_per_second_vs_peer": 0.85, "vs_floor": 1.25}
"""Targets reported (not asserted): (c)'s RSS bytes per token over (d)'s at most 1/3, its tokens/s over (d)'s at
the same T at least 0.85, its bytes per token over the floor's at most 1.25."""


# ----------------------------------------------------------------------------------------------------------------
# Inputs: the checkpoint and the two datasets
# ----------------------------------------------------------------------------------------------------------------


def prepare_speeches(work: Path, checkpoint: Path, env: dict[str, str]) -> Path:
    """Tiny Shakespeare as one document per speech, prepared with the checkpoint's tokenizer (reused when the
    work directory has it).

    Args:
        work: the work directory.
        checkpoint: the checkpoint directory (its tokenizer is the one the other dataset was prepared with).
        env: the children's environment.

    Returns:
        The prepared dataset's directory.
    """
    data = work / "speeches_data"
    if (data / "manifest.json").exists():
        return data
    records = work / "speeches.jsonl"
    speeches = [s.strip() for s in CORPUS.read_text().split("\n\n") if s.strip()]  # speaker line + speech
    records.write_text("".join(json.dumps({"text": s}) + "\n" for s in speeches))
    cmd = [sys.executable, "-m", "memfit", "prepare", "--out", str(data), "--tokenizer", str(checkpoint),
           "--source", f"speeches={records}", "--quiet", "val_fraction=0.1"]  # fmt: skip
    made = run_measured(cmd, env, work / "logs" / "prepare_speeches")
    if made[0] != 0:
        raise RuntimeError(f"memfit prepare failed: {failure(work / 'logs' / 'prepare_speeches', made[0])}")
    print(f"speeches: {len(speeches):,} documents prepared into {data}", file=sys.stderr, flush=True)
    return data


# ----------------------------------------------------------------------------------------------------------------
# One point: a configuration at one T, in a fresh process (twice with --tracking separate)
# ----------------------------------------------------------------------------------------------------------------


def memfit_point(
    args: argparse.Namespace,
    env: dict[str, str],
    config: Config,
    seq_len: int,
    inputs: dict[str, Any],
    out: Path,
    track: bool,
) -> dict[str, Any]:
    """One ``memfit finetune`` run (:func:`peers.run_memfit`): its measurements, or ``error``.

    Args:
        args: the command's arguments (``steps``, ``lr``, ``seed``).
        env: the children's environment.
        config: the configuration.
        seq_len: T.
        inputs: ``checkpoint``, ``data``, ``speeches`` (directories) and ``peak_flops``.
        out: the run's directory.
        track: with ``track_memory=true``: adds ``live_peak_bytes`` (the highest sum of a step record's
            ``memory_breakdown``), ``live_breakdown`` and ``live_peak_phase``.
    """
    run_args = argparse.Namespace(
        steps=args.steps, warmup=args.steps - 1, batch_size=1, seq_len=seq_len, seed=args.seed, lr=args.lr
    )
    overrides = {
        "optimizer.implementation": "for_loop",
        "peak_flops": inputs["peak_flops"],
        **({"data.path": inputs["speeches"]} if config.speeches else {}),
        **config.overrides,
        **({"track_memory": True} if track else {}),
    }
    result = run_memfit(run_args, env, overrides, inputs["checkpoint"], inputs["data"], out)
    if "error" in result or not track:
        return result
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    tracked = [r for r in records if "memory_breakdown" in r]
    peak = max(tracked, key=lambda r: sum(r["memory_breakdown"].values()))
    return {
        **result,
        "live_peak_bytes": sum(peak["memory_breakdown"].values()) * GIB,
        "live_breakdown": {k: v * GIB for k, v in peak["memory_breakdown"].items()},
        "live_peak_phase": peak["memory_peak_phase"],
    }


def peer_point(
    args: argparse.Namespace,
    env: dict[str, str],
    config: Config,
    seq_len: int,
    inputs: dict[str, Any],
    out: Path,
    track: bool,
) -> dict[str, Any]:
    """One run of the peer's loop (:func:`peers.peer_loop`, in ``bench/peers.py``'s own process): its
    measurements, or ``error``. Arguments as :func:`memfit_point`'s."""
    spec = {
        "peer": dataclasses.asdict(config.peer),
        "checkpoint": str(inputs["checkpoint"]),
        "data": str(inputs["speeches"] if config.speeches else inputs["data"]),
        "steps": args.steps,
        "batch_size": 1,
        "seq_len": seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "track_memory": track,
    }
    code, rss, wall, stdout = run_measured(
        [sys.executable, str(PEERS_SCRIPT), "--_peer", json.dumps(spec)], env, out
    )
    if code != 0:
        return {"error": failure(out, code), "rss_mib": rss, "wall_seconds": wall}
    result = json.loads(stdout.strip().splitlines()[-1])
    measured = {
        "losses": result["losses"],
        "step_seconds": result["step_seconds"],
        "rss_mib": rss,
        "wall_seconds": wall,
        "tokens_per_second": seq_len / result["step_seconds"][-1],
        "imports_rss_mib": result["imports_rss_mib"],
    }
    if track:
        measured |= {
            "live_peak_bytes": result["tracked_peak_bytes"],
            "live_breakdown": result["tracked_breakdown"],
            "live_peak_phase": result["tracked_peak_phase"],
        }
    return measured


def run_point(
    args: argparse.Namespace, env: dict[str, str], key: str, seq_len: int, inputs: dict[str, Any], where: Path
) -> dict[str, Any]:
    """Measure configuration ``key`` at ``seq_len``: RSS and tokens/s, and the live bytes (from a second, tracked
    run with ``--tracking separate``, from the one run with ``same``; none with ``off``).

    A run that fails (or whose output cannot be read) is reported in the point's ``error``, never raised. With
    ``--reuse``, a point measured before in ``where`` with the same settings, that did not fail, is read back.

    Returns:
        ``config``, ``seq_len``, ``rss_mib``, ``tokens_per_second``, ``losses``, ``wall_seconds``, ... of the
        measuring run; ``live_peak_bytes`` (None when not tracked or failed), ``tracked_run`` (the tracked run's
        measurements, with ``--tracking separate``); ``error`` when the measuring run failed, ``tracked_error``
        when the tracked one did.
    """
    config = CONFIGS[key]
    saved = where / "point.json"
    settings = {k: getattr(args, k) for k in ("model", "steps", "tracking", "lr", "seed")}
    if args.reuse and saved.exists():
        point = json.loads(saved.read_text())
        if point.get("settings") == settings and "error" not in point and "tracked_error" not in point:
            print(f"{key} T={seq_len}: reused {saved}", file=sys.stderr, flush=True)
            return point
    measure = peer_point if config.peer is not None else memfit_point

    def attempt(out: Path, track: bool) -> dict[str, Any]:
        try:
            return measure(args, env, config, seq_len, inputs, out, track)
        except Exception as exc:  # an unreadable output: a failed point, not a failed benchmark
            return {"error": f"{type(exc).__name__}: {exc}"[:160].replace("|", "/")}

    started = time.perf_counter()
    point: dict[str, Any] = {"config": key, "seq_len": seq_len, "settings": settings}
    if args.tracking == "same":
        point |= attempt(where / "tracked", True)
    else:
        point |= attempt(where / "untracked", False)
        if args.tracking == "separate" and "error" not in point:  # (a run that failed untracked would again)
            tracked = attempt(where / "tracked", True)
            point["tracked_run"] = tracked
            point["live_peak_bytes"] = tracked.get("live_peak_bytes")
            point["live_peak_phase"] = tracked.get("live_peak_phase")
            if "error" in tracked:
                point["tracked_error"] = tracked["error"]
    point.setdefault("live_peak_bytes", None)
    point["point_seconds"] = time.perf_counter() - started
    where.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(point, indent=1))
    announce(point)
    return point


def announce(point: dict[str, Any]) -> None:
    """One progress line on stderr about a finished point."""
    head = f"{point['config']} T={point['seq_len']}:"
    if "error" in point:
        print(
            f"{head} FAILED: {point['error']} ({point['point_seconds']:.0f} s)", file=sys.stderr, flush=True
        )
        return
    live = point["live_peak_bytes"]
    live_text = "live —" if live is None else f"live {live / MIB:,.0f} MiB"
    if "tracked_error" in point:
        live_text += f" (tracked run FAILED: {point['tracked_error']})"
    print(
        f"{head} RSS {point['rss_mib']:,.0f} MiB, {live_text}, {point['tokens_per_second']:,.0f} tok/s, step-1 "
        f"loss {point['losses'][0]:.4f}, {point['point_seconds']:.0f} s",
        file=sys.stderr,
        flush=True,
    )


# ----------------------------------------------------------------------------------------------------------------
# Derived numbers: bytes per token, the budget's longest T, the floor
# ----------------------------------------------------------------------------------------------------------------


def line_through(points: list[tuple[int, float]]) -> tuple[float, float] | None:
    """``(intercept, slope)`` of the line through the two longest ``(T, value)`` points, or None with fewer."""
    if len(points) < 2:
        return None
    (t1, v1), (t2, v2) = sorted(points)[-2:]
    slope = (v2 - v1) / (t2 - t1)
    return v2 - slope * t2, slope


def longest_within(line: tuple[float, float] | None, budget_bytes: float) -> float | None:
    """The T at which ``intercept + slope * T`` reaches ``budget_bytes`` (inf for a flat line; None without a
    line, or when the intercept alone is over)."""
    if line is None:
        return None
    intercept, slope = line
    if intercept > budget_bytes:
        return None
    return math.inf if slope <= 0 else (budget_bytes - intercept) / slope


def derive(points: list[dict], budget_bytes: float) -> dict[str, dict[str, Any]]:
    """Per configuration: the lines of peak RSS and of live bytes through its two longest T (bytes, bytes per
    token), the longest T within the budget on the RSS line, and its RSS bytes per token and tokens/s relative to
    the peer's (d) (the tokens/s at the longest T both measured).

    Args:
        points: every point (:func:`run_point`).
        budget_bytes: the budget.
    """
    ok = [p for p in points if "error" not in p]
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(p["config"] for p in points):
        mine = [p for p in ok if p["config"] == key]
        rss = line_through([(p["seq_len"], p["rss_mib"] * MIB) for p in mine])
        live = line_through([(p["seq_len"], p["live_peak_bytes"]) for p in mine if p["live_peak_bytes"]])
        out[key] = {
            "rss_line": rss,
            "live_line": live,
            "slope_lengths": sorted(p["seq_len"] for p in mine)[-2:],
            "longest_within_budget": longest_within(rss, budget_bytes),
        }
    peer = out.get(PEER_KEY)
    for key, row in out.items():
        row["rss_slope_vs_peer"] = ratio(
            row["rss_line"] and row["rss_line"][1], peer and peer["rss_line"] and peer["rss_line"][1]
        )
        row["live_slope_vs_peer"] = ratio(
            row["live_line"] and row["live_line"][1], peer and peer["live_line"] and peer["live_line"][1]
        )
        speeds = {p["seq_len"]: p["tokens_per_second"] for p in ok if p["config"] == key}
        theirs = {p["seq_len"]: p["tokens_per_second"] for p in ok if p["config"] == PEER_KEY}
        common = sorted(set(speeds) & set(theirs))
        row["speed_vs_peer"] = {t: speeds[t] / theirs[t] for t in common}
    return out


def floor_bytes(shape: dict[str, int], vocab_size: int, num_params: int, seq_len: int) -> dict[str, float]:
    """The floor that full activation checkpointing leaves on a host for configuration (c) at ``seq_len`` (batch 1,
    fp32): model states + checkpoints + what every layer shares + the larger of two moments' working sets.

    Counted, per token unless said (C = dim, K = num_kv_heads * head_dim, H = num_heads, I = intermediate_size,
    V = vocab_size, 4 bytes an element):

    - ``model_states``: parameters, gradients and AdamW's two moments, 16 bytes per parameter (all gradients
      counted: generous for a peak early in the backward, where few exist yet; a constant, so it moves the
      intercept, not the bytes per token compared).
    - ``checkpoints``: every layer's saved input, ``num_layers * C``.
    - ``shared``: inputs and targets (int64, 2 x 8 bytes) and the RoPE tables ``cos``, ``sin`` (2 x head_dim) that
      every layer keeps.
    - ``layer_backward``, the recomputed layer at its MLP's backward, its saved tensors all alive: the attention
      norm's normalised input and output (2C) and 1/rms (1), q and k after RoPE and v (C + 2K), the attention
      output and its log-sum-exp (C + H), the residual after attention (C, the MLP norm's input), the MLP norm's
      normalised input and output (2C) and 1/rms (1); in flight, the residual's gradient from above (C) and the
      MLP's input gradient being filled (C): 9C + 2K + H + 2. Plus one MLP tile's ``(tile, I)`` tensors, a
      constant: gate, up and silu(gate) and their gradients (6 x tile x I; ``tiled_mlp=auto``'s tile is about C
      tokens).
    - ``loss``, the fused chunked loss's forward at the end of the forward (with the checkpoints): the last layer's
      output (C), the final norm's normalised input and output (2C), 1/rms (1) and ``grad_hidden`` (C): 4C + 1;
      plus one chunk's logits, which become their softmax gradient in place (chunk x V), and its ``grad_hidden``
      rows (chunk x C). ``chunked_cross_entropy=auto`` chunks hold at most 2^25 logits: with V = 2,048 that is
      16,384 tokens, so up to 16K tokens the chunk is the whole sequence (V + C per token), past it a constant.

    Left out: the process itself (interpreter, torch, the model's code: the intercept of a measured line, not its
    slope), the allocator's slack and the kernels' workspaces (the attention kernel's blocks, matmul buffers).

    Args:
        shape: the model's :data:`peers.MODELS` entry.
        vocab_size: V.
        num_params: the model's parameters.
        seq_len: T.

    Returns:
        Bytes: ``model_states``, ``checkpoints``, ``shared``, ``layer_backward``, ``loss``, ``working_set`` (the
        larger of the last two) and ``total``.
    """
    C, L, H = shape["dim"], shape["num_layers"], shape["num_heads"]
    inter = shape["intermediate_size"]  # I
    head_dim = C // H
    K = shape["num_kv_heads"] * head_dim
    T, V, fp32 = seq_len, vocab_size, 4
    chunks = max(1, math.ceil(T * V / 2**25))  # memfit.memory.techniques.loss_chunks(auto)
    chunk = math.ceil(T / chunks)
    tiles = max(1, min(math.ceil(T / C), T))  # memfit.memory.tiled.mlp_tiles(auto)
    tile = math.ceil(T / tiles)
    items = {
        "model_states": 16 * num_params,
        "checkpoints": L * T * C * fp32,
        "shared": T * (2 * 8 + 2 * head_dim * fp32),
        "layer_backward": (T * (9 * C + 2 * K + H + 2) + 6 * tile * inter) * fp32,
        "loss": (T * (4 * C + 1) + chunk * (V + C)) * fp32,
    }
    items["working_set"] = max(items["layer_backward"], items["loss"])
    items["total"] = sum(items[k] for k in ("model_states", "checkpoints", "shared", "working_set"))
    return items


def check_length(derived: dict[str, Any], cap: int) -> int | None:
    """The check run's T: (c)'s longest T within the budget or ``cap``, whichever is smaller, rounded down to a
    multiple of 1,024 (None without a line for (c))."""
    longest = derived.get(LONG_CONTEXT_KEY, {}).get("longest_within_budget")
    if longest is None:
        return None
    return max(1024, int(min(longest, cap)) // 1024 * 1024)


# ----------------------------------------------------------------------------------------------------------------
# The outputs: section, table, plot
# ----------------------------------------------------------------------------------------------------------------


def kib(value: float | None) -> str:
    """Bytes as KiB for a table cell."""
    return cell(None if value is None else value / 1024, ",.1f")


def points_table(points: list[dict]) -> str:
    """Configuration x T: peak RSS, live tensor peak, tokens/s (and relative to (d)), step-1 loss."""
    peer_speed = {
        p["seq_len"]: p["tokens_per_second"] for p in points if p["config"] == PEER_KEY and "error" not in p
    }
    lines = [
        "| configuration | T | peak RSS (MiB) | live tensor peak (MiB) | peak phase | tok/s | tok/s vs (d) "
        "| step-1 loss | wall, all runs (s) |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for p in points:
        name = f"({p['config']}) {CONFIGS[p['config']].label}"
        if "error" in p:
            lines.append(f"| {name} | {p['seq_len']:,} | failed: {p['error']} | | | | | | |")
            continue
        live = p["live_peak_bytes"]
        live_cell = cell(None if live is None else live / MIB, ",.0f")
        if "tracked_error" in p:
            live_cell = f"failed: {p['tracked_error']}"
        lines.append(
            f"| {name} | {p['seq_len']:,} | {p['rss_mib']:,.0f} | {live_cell} | {p.get('live_peak_phase') or '—'} "
            f"| {p['tokens_per_second']:,.0f} "
            f"| {cell(ratio(p['tokens_per_second'], peer_speed.get(p['seq_len'])), '.2f')} "
            f"| {p['losses'][0]:.4f} | {p.get('point_seconds', p.get('wall_seconds', 0)):.0f} |"
        )
    return "\n".join(lines)


def derived_table(derived: dict[str, dict], budget_gib: float) -> str:
    """Per configuration: bytes per token (RSS and live), the budget's longest T, ratios to (d)."""
    lines = [
        f"| configuration | T of the slope | RSS KiB/token | live KiB/token | RSS intercept (MiB) | longest T at "
        f"{budget_gib:g} GiB | RSS KiB/token vs (d) | live KiB/token vs (d) | tok/s vs (d), longest common T |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, row in derived.items():
        rss, live = row["rss_line"], row["live_line"]
        longest = row["longest_within_budget"]
        longest_cell = "—" if longest is None else ("unbounded" if math.isinf(longest) else f"{longest:,.0f}")
        speeds = row["speed_vs_peer"]
        speed_cell = "—" if not speeds else f"{speeds[max(speeds)]:.2f} (T={max(speeds):,})"
        lengths = " → ".join(f"{t:,}" for t in row["slope_lengths"]) if rss else "—"
        lines.append(
            f"| ({key}) {CONFIGS[key].label} | {lengths} | {kib(rss and rss[1])} | {kib(live and live[1])} "
            f"| {cell(rss and rss[0] / MIB, ',.0f')} | {longest_cell} | {cell(row['rss_slope_vs_peer'], '.2f')} "
            f"| {cell(row['live_slope_vs_peer'], '.2f')} | {speed_cell} |"
        )
    return "\n".join(lines)


def floor_lines(floor: dict[str, Any], derived: dict[str, dict]) -> list[str]:
    """The floor paragraph: its parts at the longest T, its bytes per token, (c)'s relative to it."""
    if floor is None:
        return []
    t1, t2 = floor["lengths"]
    at = floor["at"][str(t2)]
    parts = ", ".join(
        f"{name.replace('_', ' ')} {at[name] / MIB:,.0f} MiB"
        for name in ("model_states", "checkpoints", "shared", "layer_backward", "loss")
    )
    mine = derived.get(LONG_CONTEXT_KEY, {})
    rss, live = mine.get("rss_line"), mine.get("live_line")
    return [
        f"**The floor that checkpointing leaves on a host**, for (c) at T = {t2:,} (by hand from the model's shape; "
        f"`floor_bytes` in the script says which tensors count): {parts}; in all {at['total'] / MIB:,.0f} MiB "
        f"of tensors, {floor['slope'] / 1024:,.1f} KiB per token between T = {t1:,} and {t2:,}. (c) measures "
        f"{kib(rss and rss[1])} KiB/token of RSS ({cell(ratio(rss and rss[1], floor['slope']), '.2f')}x the floor) "
        f"and {kib(live and live[1])} KiB/token of live tensors "
        f"({cell(ratio(live and live[1], floor['slope']), '.2f')}x).",
    ]


def goal_lines(derived: dict[str, dict], floor: dict | None) -> list[str]:
    """The three goals, each with its measured value (reported, not asserted)."""
    mine, peer = derived.get(LONG_CONTEXT_KEY), derived.get(PEER_KEY)
    if mine is None:
        return []
    rss = mine["rss_line"]
    vs_floor = ratio(rss and rss[1], floor and floor["slope"])
    speeds = mine["speed_vs_peer"]
    worst_speed = min(speeds.values()) if speeds else None

    def verdict(value: float | None, target: float, at_most: bool) -> str:
        if value is None:
            return "not measured"
        return "met" if (value <= target if at_most else value >= target) else "not met"

    share = mine["rss_slope_vs_peer"]
    return [
        "Goals (reported, not asserted):",
        "",
        f"- (c)'s RSS bytes per token at long T vs (d)'s: {cell(share, '.2f')} (target <= "
        f"{GOALS['bytes_per_token_vs_peer']:.2f}): {verdict(share, GOALS['bytes_per_token_vs_peer'], True)}"
        + ("" if peer is not None else " ((d) not run)"),
        "- (c)'s tokens/s vs (d)'s at equal T: "
        + (", ".join(f"{v:.2f} at {t:,}" for t, v in speeds.items()) or "—")
        + f" (target >= {GOALS['tokens_per_second_vs_peer']:.2f}): "
        f"{verdict(worst_speed, GOALS['tokens_per_second_vs_peer'], False)} (the lowest)",
        f"- (c)'s RSS bytes per token vs the floor's: {cell(vs_floor, '.2f')} (target <= {GOALS['vs_floor']:.2f}): "
        f"{verdict(vs_floor, GOALS['vs_floor'], True)}",
    ]


def check_lines(check: dict | None, budget_gib: float) -> list[str]:
    """The check run's sentence: its T, its measured peak and the line's."""
    if check is None:
        return []
    head = f"**Check run**: (c) at T = {check['seq_len']:,} (the longest T within {budget_gib:g} GiB on its line, "
    head += f"at most {check['cap']:,}, rounded down to a multiple of 1,024): "
    if "error" in check:
        return [head + f"failed: {check['error']}."]
    predicted = check["predicted_rss_mib"]
    return [
        head + f"peak RSS {check['rss_mib']:,.0f} MiB measured, {predicted:,.0f} MiB on the line "
        f"({check['rss_mib'] / predicted - 1:+.1%}), {check['tokens_per_second']:,.0f} tok/s, "
        f"{check['wall_seconds']:.0f} s."
    ]


def reproduce_command(argv: list[str]) -> str:
    """This run's command line, without where it wrote (``--work``, ``--out``) and ``--reuse``."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith(("--work=", "--out=")) or arg == "--reuse":
            skip = False
        elif arg in ("--work", "--out"):
            skip = True
        else:
            kept.append(shlex.quote(arg))
    return " ".join([".venv/bin/python bench/long_context.py", *kept])


def section(results: dict[str, Any], args: argparse.Namespace) -> str:
    """The markdown section for docs/benchmarks.md.

    Args:
        results: what the JSON holds (``points``, ``derived``, ``floor``, ``check``, ``model``, ``machine``).
        args: the command's arguments.
    """
    model, machine = results["model"], results["machine"]
    shape = MODELS[args.model]
    tracking = {
        "separate": "a second, tracked run of each point (`track_memory=true`; the peer: memfit's "
        "`MemoryTracker` around its steps)",
        "same": "the same run, tracked (`track_memory=true`; the peer: memfit's `MemoryTracker` around its steps), "
        "whose tokens/s and RSS include the tracker's cost",
        "off": "no run (`--tracking off`)",
    }[args.tracking]
    return "\n".join(
        [
            "## Long context: memory and speed against the sequence length",
            "",
            f"One step of batch 1 x T tokens on the {args.model} Llama of the peers benchmark ({model['num_params']:,} "
            f"parameters: dim {shape['dim']}, {shape['num_layers']} layers, {shape['num_heads']}/"
            f"{shape['num_kv_heads']} heads, SwiGLU {shape['intermediate_size']}, vocab {model['vocab_size']:,}), "
            f"fp32, AdamW (for-loop update, lr {args.lr:g} constant), {args.steps} step{'s' * (args.steps != 1)} "
            "per point in a fresh process with `MALLOC_MMAP_THRESHOLD_=131072`. Peak RSS is the process's "
            "(`ru_maxrss`; memfit's includes its end: one validation batch of T tokens and the final checkpoint), "
            f"tokens/s that of step {args.steps}, the live tensor peak from {tracking}. (a)-(d) train on Tiny "
            "Shakespeare as one document; (e) on its speeches as ~7,200 documents (BOS/EOS between them, attention "
            "within each). Bytes per token: the slope of a line through the two longest T; the longest T within "
            f"{args.budget_gib:g} GiB on that line. Details in the module docstring of `bench/long_context.py`.",
            "",
            *(
                [
                    "*A smoke test (`--quick`): a tiny model, one step per point (its time includes the first step's "
                    "one-off costs), differences of a few MiB (pages, noise); it checks the plumbing, it measures "
                    "nothing.*",
                    "",
                ]
                if args.quick
                else []
            ),
            f"Reproduce: `{reproduce_command(args.argv)}` ({machine['cpus']} CPU cores: {machine['cpu']}; torch "
            f"{machine['torch']}, transformers {machine['transformers']}; took {results['seconds'] / 60:.0f} min).",
            "",
            "(a) `memfit finetune method=full`; (b) + `activation_checkpointing=full`; (c) + `tiled_mlp=auto "
            "chunked_cross_entropy=auto activation_offloading=true` (on a CPU offloading moves nothing); (d) "
            "`LlamaForCausalLM` + `gradient_checkpointing_enable()`, the plain loop of `bench/peers.py`; (e) (c) + "
            "`data.cross_document_attention=false` on the speeches.",
            "",
            points_table(results["points"]),
            "",
            derived_table(results["derived"], args.budget_gib),
            *paragraph(check_lines(results["check"], args.budget_gib)),
            *paragraph(floor_lines(results["floor"], results["derived"])),
            *paragraph(goal_lines(results["derived"], results["floor"])),
            "",
            "![peak RSS against the sequence length](long_context.png)",
        ]
    )


def paragraph(lines: list[str]) -> list[str]:
    """``lines`` after a blank line, or nothing when there are none."""
    return ["", *lines] if lines else []


def plot(results: dict[str, Any], budget_gib: float, path: Path) -> None:
    """Peak RSS (MiB) against T on log-log axes, one line per configuration, the budget, the lines' extension to
    the check run's T and the check run itself."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=120)
    ok = [p for p in results["points"] if "error" not in p]
    check = results["check"]
    lengths = sorted(
        {p["seq_len"] for p in ok} | ({check["seq_len"]} if check and "error" not in check else set())
    )
    for key in dict.fromkeys(p["config"] for p in results["points"]):
        mine = sorted((p["seq_len"], p["rss_mib"]) for p in ok if p["config"] == key)
        if not mine:
            continue
        label = f"({key}) {CONFIGS[key].label}"
        (drawn,) = ax.plot([t for t, _ in mine], [r for _, r in mine], marker="o", label=label)
        line = results["derived"][key]["rss_line"]
        if line is not None and lengths and lengths[-1] > mine[-1][0]:
            ts = [mine[-1][0], lengths[-1]]
            ax.plot(ts, [(line[0] + line[1] * t) / MIB for t in ts], linestyle=":", color=drawn.get_color())
    if check is not None and "error" not in check:
        ax.scatter([check["seq_len"]], [check["rss_mib"]], marker="*", s=160, color="black", zorder=4,
                   label=f"check run of (c), T={check['seq_len']:,}")  # fmt: skip
    ax.axhline(budget_gib * 1024, color="red", linestyle="--", label=f"{budget_gib:g} GiB budget")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)  # ticks at 256, 512, 1,024, ... MiB
    ax.set_xticks(lengths, [f"{t:,}" for t in lengths])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.set_xlabel("sequence length T (tokens, batch 1)")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("One training step on a host (CPU, fp32): peak RSS against T\n(dotted: the line through the two "
                 "longest T, extended)", fontsize=10)  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument(
        "--lengths", nargs="+", type=int, help=f"T; default {LENGTHS} ({QUICK_LENGTHS} with --quick)"
    )
    parser.add_argument("--budget-gib", type=float, default=4.0, help="the budget of the longest-T column")
    parser.add_argument(
        "--steps", type=int, help="steps per point, tokens/s from the last (default 2; --quick 1)"
    )
    parser.add_argument(
        "--tracking",
        choices=["separate", "same", "off"],
        default="separate",
        help="where the live tensor bytes come from: a second, tracked run per point; the one run, tracked; none",
    )
    parser.add_argument("--check-max", type=int, help=f"the check run's longest T (default {CHECK_MAX:,})")
    parser.add_argument("--no-check", action="store_true", help="skip the check run")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="weight init and batch draws")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: the tiny model, T 256 and 512, one step"
    )
    parser.add_argument("--work", default=None, help="the work directory, kept (default: a temporary one)")
    parser.add_argument(
        "--reuse", action="store_true", help="with --work: skip points already measured there"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    args.model = "tiny" if args.quick else "25.6M"
    args.configs = list(dict.fromkeys(args.configs))
    args.lengths = sorted(set(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)))
    args.steps = args.steps or (1 if args.quick else 2)
    args.check_max = args.check_max or (QUICK_CHECK_MAX if args.quick else CHECK_MAX)
    if args.reuse and not args.work:
        parser.error("--reuse needs --work (the directory whose points it reuses)")
    if min(args.lengths) < 1 or args.steps < 1:
        parser.error("--lengths and --steps must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    work = Path(args.work or tempfile.mkdtemp(prefix="memfit_long_context_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "MALLOC_MMAP_THRESHOLD_": "131072",  # big frees go back to the kernel: RSS follows the live bytes
    }

    # --- inputs: the checkpoint (max_seq_len covers the check run) and the datasets ----------------------------
    max_len = max(*args.lengths, args.check_max)
    data, models = prepare_inputs(
        argparse.Namespace(grid={args.model: []}, seq_len=max_len, seed=args.seed), work, env
    )
    checkpoint = work / f"checkpoint_{args.model}"
    inputs = {"checkpoint": checkpoint, "data": data, "peak_flops": matmul_ceiling(env)}
    if any(CONFIGS[k].speeches for k in args.configs):
        inputs["speeches"] = prepare_speeches(work, checkpoint, env)
    print(f"fp32 matmul ceiling: {inputs['peak_flops'] / 1e9:.1f} GFLOP/s", file=sys.stderr, flush=True)

    # --- the grid, shortest T first (a configuration's failure at one T leaves the others) -------------------------
    points = []
    grid = [(key, seq_len) for seq_len in args.lengths for key in args.configs]
    for i, (key, seq_len) in enumerate(grid, 1):
        print(f"[{i}/{len(grid)}] {key} T={seq_len} ...", file=sys.stderr, flush=True)
        points.append(run_point(args, env, key, seq_len, inputs, work / "runs" / key / str(seq_len)))
    points.sort(key=lambda p: (args.configs.index(p["config"]), p["seq_len"]))
    budget = args.budget_gib * GIB
    derived = derive(points, budget)

    # --- the check run: (c) at the longest T its line allows ---------------------------------------------------
    check = None
    seq_len = (
        None if args.no_check or LONG_CONTEXT_KEY not in derived else check_length(derived, args.check_max)
    )
    if seq_len is not None:
        print(f"check run: {LONG_CONTEXT_KEY} T={seq_len} ...", file=sys.stderr, flush=True)
        check_args = argparse.Namespace(
            **{**vars(args), "tracking": "same" if args.tracking == "same" else "off"}
        )
        check = run_point(
            check_args, env, LONG_CONTEXT_KEY, seq_len, inputs, work / "runs" / "check" / str(seq_len)
        )
        intercept, slope = derived[LONG_CONTEXT_KEY]["rss_line"]
        check |= {"cap": args.check_max, "predicted_rss_mib": (intercept + slope * seq_len) / MIB}

    # --- the floor of (c), by hand -------------------------------------------------------------------------------
    floor = None
    slope_lengths = derived.get(LONG_CONTEXT_KEY, {}).get("slope_lengths") or args.lengths[-2:]
    if len(slope_lengths) == 2:
        info = models[args.model]
        at = {
            str(t): floor_bytes(MODELS[args.model], info["vocab_size"], info["num_params"], t)
            for t in slope_lengths
        }
        t1, t2 = slope_lengths
        floor = {
            "lengths": slope_lengths,
            "at": at,
            "slope": (at[str(t2)]["total"] - at[str(t1)]["total"]) / (t2 - t1),
        }

    # --- outputs -------------------------------------------------------------------------------------------------
    docs = work if args.out == "-" else Path(args.out).parent
    docs.mkdir(parents=True, exist_ok=True)
    results = {
        "settings": vars(args),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "torch": version("torch"),
            "transformers": version("transformers"),
            "fp32_matmul_flops_per_second": inputs["peak_flops"],
        },
        "model": {"name": args.model, "shape": MODELS[args.model], **models[args.model]},
        "points": points,
        "derived": derived,
        "floor": floor,
        "check": check,
        "goals": GOALS,
        "seconds": time.perf_counter() - started,
    }
    text = section(results, args)
    plot(results, args.budget_gib, docs / "long_context.png")  # matplotlib: after the last child
    (docs / "long_context_results.json").write_text(json.dumps(results, indent=1, default=str))
    print(text)
    if args.out != "-":
        write_section(Path(args.out), "long_context", text)
    if args.work is None and args.out != "-":
        shutil.rmtree(work, ignore_errors=True)
    kept = "" if args.work is None and args.out != "-" else f"; work directory {work}"
    print(
        f"took {time.perf_counter() - started:.0f} s; raw results in {docs / 'long_context_results.json'}{kept}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
