"""Where a training step's time goes: one step of the same model and batch through memfit's
:func:`memfit.step.train_step` and through a plain PyTorch loop, profiled with ``torch.profiler`` (CPU), the op
times grouped into categories side by side.

- **Models** (fp32, vocab 2,048, random init): "0.8M" (dim 128, 2 layers, 4/2 heads, SwiGLU 232: 801,408
  parameters) at 12 x 64 tokens, and "25.6M" and "78.6M" of ``bench/peers.py`` (``MODELS``) at 4 x 256.
- **memfit**: the run built as a run builds it (``load_config`` with dotted overrides, :func:`run_model_config`,
  :func:`build_training`: ``optimizer.name=adamw``, foreach, lr 1e-3, weight decay 0.1 on matrices, betas 0.9 /
  0.95), then ``train_step(model, optimizer, [(inputs, targets)], **train_step_options(cfg))`` with clipping at
  1.0, and ``loss.item()``. The training loop's work around the step (drawing the batch, the learning-rate
  schedule, the on-device divergence check, logging every ``log_every`` steps) is not in the profile.
- **Plain**: ``transformers.LlamaForCausalLM`` of the same shape (``use_cache`` off, SDPA attention), loaded with
  memfit's initial weights (the state dicts share their keys), then forward, ``F.cross_entropy``, ``backward``,
  ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` (foreach, the same two groups) ``step``, ``zero_grad``,
  ``loss.item()``, each phase in a ``phase: ...`` range (a few microseconds a step when nothing profiles). Both
  sides train on one fixed random batch, so their losses agree step by step (printed for the profiled step).
- **Measured**: ``--warmup`` (2) steps per side; then ``--timed`` unprofiled steps, alternating sides, whose median wall
  time per step is the table's "wall" row; then ``--steps`` steps per side under
  ``torch.profiler.profile(activities=[CPU])``, one step at a time, alternating sides (so that the machine's drift,
large on shared cores, falls on both). During the profile, forward pre/post hooks on every module open a
  ``module: <class>`` range, so each op's self CPU time can be charged to where it ran: an op is categorised by its
  own name, else by the ranges around it, innermost first (:data:`RULES`); an op of the backward by its own name,
  else by the forward op that made its autograd node (the same ``sequence_nr``). Self time of a module's range is
  the Python of that module (and the profiling hooks): "python in modules". Self times add up to the profiled
  step, so nothing is counted twice. ``key_averages()`` alone could not do this: it groups by op name, and one
  ``aten::mul`` is RoPE, another SwiGLU, another RMSNorm.

Reproduce (about 4 minutes on 2 CPU cores: each size runs 2 + 7 + 5 steps a side, 1.2-1.5 s each at 25.6M and
3.4-4.5 s at 78.6M, profiled ones slower)::

    .venv/bin/python bench/step_profile.py

It rewrites the section between the ``step-profile`` markers of ``docs/benchmarks.md`` and writes
``docs/step_profile_results.json``; ``--out -`` prints the section and puts the JSON in a temporary directory;
``--quick`` is a smoke test (the 0.8M model, 1 warm-up, 1 timed and 1 profiled step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

from docs_section import write_section
from peers import MODELS, cpu_model, reproduce_command

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2048
SIZES: dict[str, dict[str, int]] = {
    "0.8M": {"dim": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 232,
             "batch_size": 12, "seq_len": 64},
    "25.6M": {**MODELS["25.6M"], "batch_size": 4, "seq_len": 256},
    "78.6M": {**MODELS["78.6M"], "batch_size": 4, "seq_len": 256},
}  # fmt: skip
"""Size name -> Llama shape (memfit's ``DecoderConfig`` names) and batch (sequences x tokens)."""
LR, WEIGHT_DECAY, BETAS, MAX_GRAD_NORM = 1e-3, 0.1, (0.9, 0.95), 1.0
ENGINE = "autograd::engine::evaluate_function: "

RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("autograd engine", ("autograd::engine", "AccumulateGrad")),
    ("optimizer", ("Optimizer.", "_foreach_", "linalg_vector_norm", "_fused_adamw")),
    ("loss", ("cross_entropy", "log_softmax", "nll_loss", "LogSoftmax", "NllLoss")),
    ("embedding", ("aten::embedding", "EmbeddingBackward", "module: Embedding")),
    ("attention", ("scaled_dot_product", "flash_attention", "ScaledDotProduct")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "MmBackward",
                "BmmBackward", "module: Linear")),
    ("copies/casts", ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")),
    ("rmsnorm", ("RMSNorm",)),
    ("rope", ("Rotary", "module: Attention", "module: LlamaAttention")),
    ("swiglu", ("MLP", "silu", "SiLU")),
    ("other in the model", ("module: ",)),
    ("step bookkeeping", ("step: ", "phase: ")),
)  # fmt: skip
"""Ordered (category, substrings): an op goes to the first category one of whose substrings is in its own name;
failing that, in the name of the range or op around it, and so on outward. Elementwise ops inside an attention
module (outside SDPA and the projections) are RoPE's; ops outside any module and the optimizer (the token count,
the loss scaling, the backward's seed, the scalar part of clipping: neither side's clipping has a range of its
own) are step bookkeeping."""
CATEGORIES = ["python in modules", *(name for name, _ in RULES), "other"]


# ----------------------------------------------------------------------------------------------------------------
# The two sides
# ----------------------------------------------------------------------------------------------------------------


def memfit_side(
    size: dict[str, int], implementation: str = "foreach", compile: bool = False
) -> tuple[object, Callable[[list], float]]:
    """memfit's model and a step function, built through memfit's own config and build path.

    Args:
        size: a :data:`SIZES` entry.
        implementation: AdamW's ``optimizer.implementation`` (``foreach``, ``for_loop``, ``fused``).
        compile: ``compile=true`` (the layers, the loss and, with ``for_loop``, the optimizer's step).

    Returns:
        ``(model, step)``: ``step([(inputs, targets)])`` runs one :func:`memfit.step.train_step` and returns its
        loss (a host sync, as a logged step has).
    """
    import torch

    from memfit.build import build_training, run_model_config
    from memfit.config import load_config
    from memfit.step import train_step, train_step_options

    shape = {k: v for k, v in size.items() if k not in ("batch_size", "seq_len")}
    overrides = [f"model_args.{k}={v}" for k, v in shape.items()] + [
        f"model_args.vocab_size={VOCAB}",
        f"model_args.max_seq_len={size['seq_len']}",
        f"seq_len={size['seq_len']}",
        f"batch_size={size['batch_size']}",
        "device=cpu",
        "dtype=fp32",
        "seed=0",
        f"max_grad_norm={MAX_GRAD_NORM}",
        "optimizer.name=adamw",
        f"optimizer.implementation={implementation}",
        f"compile={str(compile).lower()}",
        f"optimizer.lr={LR}",
        f"optimizer.weight_decay={WEIGHT_DECAY}",
        f"optimizer.betas=[{BETAS[0]},{BETAS[1]}]",
    ]
    cfg = load_config(None, overrides, needs_weights=False)
    built = build_training(cfg, run_model_config(cfg), torch.device("cpu"))
    for group in built.optimizer.param_groups:  # the loop's schedule sets it each step; constant here
        group["lr"] = LR
    options = train_step_options(cfg)
    built.model.train()

    def step(batch: list) -> float:
        return train_step(built.model, built.optimizer, batch, **options).loss.item()

    return built.model, step


def plain_side(
    memfit_model, size: dict[str, int], implementation: str = "foreach"
) -> tuple[object, Callable[[list], float]]:
    """A ``transformers.LlamaForCausalLM`` of the same shape with memfit's weights, and a plain step function.

    Args:
        memfit_model: the memfit side's model, whose state dict (same keys) the plain model loads.
        size: a :data:`SIZES` entry.
        implementation: torch AdamW's ``foreach`` (default), ``for_loop`` or ``fused``.

    Returns:
        ``(model, step)``: ``step([(inputs, targets)])`` runs forward, loss, backward, clipping, AdamW and
        ``zero_grad``, each phase in a ``phase: ...`` range, and returns the loss.
    """
    import torch
    import torch.nn.functional as F
    import transformers
    from torch.profiler import record_function

    from memfit.convert.hf import decoder_to_hf_config

    mcfg = memfit_model.config
    # memfit's own config.json of the architecture (as `memfit export` writes it), without a KV cache, with SDPA
    hf = {**decoder_to_hf_config(mcfg), "max_position_embeddings": size["seq_len"], "use_cache": False}
    config = transformers.LlamaConfig(**hf, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(memfit_model.state_dict())
    model.train()
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim == 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0},
    ]
    flags = {"foreach": implementation == "foreach", "fused": implementation == "fused"}
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=BETAS, **flags)

    def step(batch: list) -> float:
        inputs, targets = batch[0]  # (B, T) each
        with record_function("phase: forward"):
            logits = model(input_ids=inputs).logits  # (B, T, V)
        with record_function("phase: loss"):
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, V) vs (B*T,)
        with record_function("phase: backward"):
            loss.backward()
        with record_function("phase: optimizer"):
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return model, step


# ----------------------------------------------------------------------------------------------------------------
# Profiling and categories
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def module_ranges() -> Iterator[None]:
    """Open a ``module: <class name>`` profiler range around every module's forward while inside."""
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

    open_ranges: list = []

    def enter(module, args):
        open_ranges.append(torch.profiler.record_function(f"module: {type(module).__name__}"))
        open_ranges[-1].__enter__()

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def categorise(event, forward_ops: dict[int, object]) -> tuple[str, bool, str]:
    """The category of one profiler event (see :data:`RULES`), whether it ran in the backward, and the innermost
    module it ran in (of its forward op, for the backward; HF's ``Llama`` prefix dropped, so both sides name
    their modules alike).

    Args:
        event: a ``FunctionEvent`` of ``prof.events()``.
        forward_ops: ``sequence_nr`` -> the forward op that made the autograd node of that number.
    """
    names, backward, node = [event.name], event.name.startswith(ENGINE), event.cpu_parent
    while node is not None:
        if node.name.startswith(ENGINE) and node.sequence_nr in forward_ops:  # continue at its forward op
            backward, node = True, forward_ops[node.sequence_nr]
        names.append(node.name)
        node = node.cpu_parent
    module = next((n.removeprefix("module: ") for n in names if n.startswith("module: ")), "")
    module = "Llama" if module == "LlamaForCausalLM" else module.removeprefix("Llama") or module
    if event.name.startswith("module: "):
        return "python in modules", False, module
    for name in names:
        for category, substrings in RULES:
            if any(s in name for s in substrings):
                return category, backward, module
    return "other", backward, module


def op_times(prof, steps: int) -> dict[tuple[str, str], float]:
    """Self CPU milliseconds per step of each (category, op name) of a finished profile; ops of the backward are
    named ``... (backward)``, copies and casts ``... in <module>``.

    Args:
        prof: a finished ``torch.profiler.profile``.
        steps: steps it recorded.
    """
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    # an op records the number its autograd node would get, made or not (a RoPE table's cos shares the number of
    # the next op that makes one): the last forward op of a number is the one that made its node
    forward_ops: dict[int, object] = {}
    for event in events:
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith(ENGINE):
            parent = parent.cpu_parent
        if parent is None and event.sequence_nr >= 0 and not event.name.startswith(ENGINE):
            forward_ops[event.sequence_nr] = event
    times: dict[tuple[str, str], float] = defaultdict(float)
    for event in events:
        category, backward, module = categorise(event, forward_ops)
        name = event.name + (" (backward)" if backward and not event.name.startswith(ENGINE) else "")
        if category == "copies/casts" and module:  # where a copy happens says what it is for
            name += f" in {module}"
        times[(category, name)] += event.self_cpu_time_total / 1000 / steps
    return dict(times)


def profile_size(name: str, size: dict[str, int], warmup: int, timed: int, steps: int) -> dict:
    """Build both sides for one size, time them unprofiled, then profile them.

    Args:
        name: the size's name (a :data:`SIZES` key).
        size: its shape and batch.
        warmup: unmeasured steps per side first.
        timed: unprofiled steps per side (alternating) for the wall time.
        steps: profiled steps per side.

    Returns:
        The size's results: parameters, wall medians, losses, and ``ops`` per side ((category, op) -> ms/step).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (size["batch_size"], size["seq_len"] + 1), generator=g)  # (B, T + 1)
    batch = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]  # (B, T) inputs and targets
    memfit_model, memfit_step = memfit_side(size)
    plain_model, plain_step = plain_side(memfit_model, size)
    sides = {"memfit": memfit_step, "plain": plain_step}
    result: dict = {"num_params": sum(p.numel() for p in memfit_model.parameters()), **size}
    result["first_loss"] = {side: step(batch) for side, step in sides.items()}
    for _ in range(warmup - 1):
        for step in sides.values():
            step(batch)
    wall: dict[str, list[float]] = {side: [] for side in sides}
    for _ in range(timed):
        for side, step in sides.items():
            t0 = time.perf_counter()
            step(batch)
            wall[side].append(time.perf_counter() - t0)
    result["wall_ms"] = {side: statistics.median(w) * 1000 for side, w in wall.items()}
    ops: dict[str, dict[tuple[str, str], float]] = {side: defaultdict(float) for side in sides}
    profiled: dict[str, float] = {side: 0.0 for side in sides}
    result["profiled_loss"] = {}
    for _ in range(steps):  # one profiled step a side at a time, alternating: drift of the machine hits both
        for side, step in sides.items():
            with module_ranges(), profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                with record_function(f"step: {side}"):
                    result["profiled_loss"][side] = step(batch)
                profiled[side] += (time.perf_counter() - t0) * 1000 / steps
            for key, ms in op_times(prof, steps).items():
                ops[side][key] += ms
    result["ops"] = {side: dict(times) for side, times in ops.items()}
    result["profiled_ms"] = profiled
    print(
        f"{name}: {result['num_params']:,} parameters; wall/step memfit {result['wall_ms']['memfit']:.1f} ms, "
        f"plain {result['wall_ms']['plain']:.1f} ms; profiled-step loss memfit "
        f"{result['profiled_loss']['memfit']:.6f}, plain {result['profiled_loss']['plain']:.6f}",
        file=sys.stderr,
        flush=True,
    )
    del memfit_model, plain_model
    return result


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------


def by_category(ops: dict[tuple[str, str], float]) -> dict[str, float]:
    """Milliseconds per step of each category (every category of :data:`CATEGORIES`, zero when absent)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for (category, _), ms in ops.items():
        totals[category] += ms
    return totals


def gaps(result: dict, top: int = 5) -> list[str]:
    """The three categories with the largest gaps, each with its ``top`` ops by gap (memfit minus plain)."""
    memfit, plain = by_category(result["ops"]["memfit"]), by_category(result["ops"]["plain"])
    lines = []
    for category in sorted(CATEGORIES, key=lambda c: -abs(memfit[c] - plain[c]))[:3]:
        names = {n for c, n in result["ops"]["memfit"] if c == category}
        names |= {n for c, n in result["ops"]["plain"] if c == category}
        diff = {
            n: result["ops"]["memfit"].get((category, n), 0.0)
            - result["ops"]["plain"].get((category, n), 0.0)
            for n in names
        }
        worst = sorted(diff, key=lambda n: -abs(diff[n]))[:top]
        ops = ", ".join(f"`{n}` {diff[n]:+.2f}" for n in worst)
        lines.append(f"- {category} ({memfit[category] - plain[category]:+.2f} ms): {ops}")
    return lines


def table(results: dict[str, dict]) -> str:
    """One markdown table: a row per category, a (memfit, plain, gap) column group per size, in ms per step."""
    names = list(results)
    cats = {n: {s: by_category(r["ops"][s]) for s in ("memfit", "plain")} for n, r in results.items()}
    head = "| category | " + " | ".join(f"{n} memfit | {n} plain | {n} gap" for n in names) + " |"
    rows = [head, "|---" + "|---:" * 3 * len(names) + "|"]

    def row(label: str, values: list[tuple[float, float]], fmt: str = "{:.2f}") -> str:
        cells = [f"{fmt.format(m)} | {fmt.format(p)} | {m - p:+.2f}" for m, p in values]
        return f"| {label} | " + " | ".join(cells) + " |"

    for category in CATEGORIES:
        values = [(cats[n]["memfit"][category], cats[n]["plain"][category]) for n in names]
        if any(m or p for m, p in values):
            rows.append(row(category, values))
    totals = [(sum(cats[n]["memfit"].values()), sum(cats[n]["plain"].values())) for n in names]
    rows.append(row("**all ops and ranges (profiled)**", totals))
    rows.append(row("step under the profiler", [tuple(results[n]["profiled_ms"].values()) for n in names]))
    rows.append(row("**wall, unprofiled (median)**", [tuple(results[n]["wall_ms"].values()) for n in names]))
    ratios = [results[n]["wall_ms"]["memfit"] / results[n]["wall_ms"]["plain"] for n in names]
    rows.append("| wall memfit / plain | " + " | ".join(f"| | {r:.2f}x" for r in ratios) + " |")
    return "\n".join(rows)


def section(results: dict[str, dict], args: argparse.Namespace) -> str:
    """The markdown section for docs/benchmarks.md."""
    sizes = "; ".join(
        f"{n}: {r['num_params']:,} parameters (dim {r['dim']}, {r['num_layers']} layers, {r['num_heads']}/"
        f"{r['num_kv_heads']} heads, SwiGLU {r['intermediate_size']}) at {r['batch_size']} x {r['seq_len']} "
        "tokens"
        for n, r in results.items()
    )
    lines = [
        "## Where a step's time goes: memfit's step against a plain loop",
        "",
        f"One training step of the same model and batch (fp32, vocab {VOCAB:,}, CPU, 2 threads; {sizes}) through "
        "memfit's `train_step` (built by `build_training` from a config) and through a plain loop over "
        "`transformers.LlamaForCausalLM` (SDPA) with memfit's initial weights; AdamW (foreach, lr 1e-3, weight "
        "decay 0.1) and clipping at 1.0 on both sides. Self CPU time of every op in ms per step, from "
        f"`torch.profiler` ({args.steps} profiled step{'s' * (args.steps != 1)} a side), charged to a category "
        "by the op's name, else the module range around it, else (in the backward) the forward op that made its "
        "autograd node; 'python in modules' is the self time of the module ranges (module code and the "
        "profiler's hooks). The wall row is the median of "
        f"{args.timed} unprofiled step{'s' * (args.timed != 1)} a side, alternating. Details in the module docstring.",
        "",
        f"Reproduce: `{reproduce_command(args.argv, 'bench/step_profile.py')}` (2 CPU cores, fp32).",
        "",
        table(results),
        "",
        "Largest gaps (memfit minus plain, ms per step) and their ops:",
        "",
    ]
    for name, result in results.items():
        lines += [f"{name}:", "", *gaps(result), ""]
    return "\n".join(lines).rstrip("\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), help="default: all three")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first")
    parser.add_argument("--timed", type=int, default=7, help="unprofiled steps per side for the wall time")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per side")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: 0.8M, 1 warm-up, timed, profiled step"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.sizes, args.warmup, args.timed, args.steps = args.sizes or ["0.8M"], 1, 1, 1
    args.sizes = args.sizes or list(SIZES)
    if min(args.warmup, args.timed, args.steps) < 1:
        parser.error("--warmup, --timed and --steps must be at least 1")
    return args


def main() -> int:
    args = parse_args()
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    results = {
        name: profile_size(name, SIZES[name], args.warmup, args.timed, args.steps) for name in args.sizes
    }
    text = section(results, args)
    docs = Path(tempfile.mkdtemp(prefix="memfit_step_profile_")) if args.out == "-" else Path(args.out).parent
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    for result in results.values():  # JSON keys: "category | op"
        result["ops"] = {
            s: {f"{c} | {n}": ms for (c, n), ms in ops.items()} for s, ops in result["ops"].items()
        }
    machine = {"cpu": cpu_model(), "threads": args.threads, "python": platform.python_version()}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    (docs / "step_profile_results.json").write_text(
        json.dumps(
            {"settings": settings, "machine": machine, "versions": versions, "sizes": results,
             "seconds": time.perf_counter() - started},
            indent=1,
        )
    )  # fmt: skip
    print(text)
    if args.out != "-":
        write_section(Path(args.out), "step-profile", text)
    print(
        f"took {time.perf_counter() - started:.0f} s; raw results in {docs / 'step_profile_results.json'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
