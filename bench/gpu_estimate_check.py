"""Predicted vs measured peak memory on a real CUDA device, for the estimator (``memfit estimate``).

Two halves, because the estimate needs no GPU and GPU time is scarce:

- ``--measure OUT.json`` (on the GPU machine): for each configuration, build the run's model, optimizer and switches
  exactly as ``memfit pretrain`` does (random init, ``device=cuda``), run two steps of ``train_step`` on random
  token ids and record the CUDA caching allocator's peak over the second step (``torch.cuda.max_memory_allocated``,
  after ``reset_peak_memory_stats``), its reserved peak, and the device's used memory as the driver reports it.
  It also records the allocator's own event trace over the configuration's whole life
  (``torch.cuda.memory._record_memory_history``, read back with ``torch.cuda.memory._snapshot()``) and replays it
  through memfit's model of the caching allocator (:func:`memfit.memory.allocator.replay`): the replayed reserved
  peak against ``max_memory_reserved`` checks the allocator model alone, apart from the trace of the step.
- ``--compare OUT.json`` (anywhere): estimate each configuration on fake tensors (allocated peak and, replayed
  through the allocator model, reserved peak) and write the table into docs/benchmarks.md (section
  ``gpu-estimate``).

The allocator's history is recorded without stack traces (``context=None``): memfit needs only each block's
address, size and stream, and a trace with C++ stacks takes minutes to symbolise in ``_snapshot()``. The
measurements are written after every configuration (``OUT.json``, or gzip-compressed when it ends in ``.gz``), so
a run stopped at its time limit keeps what it finished; the configurations run cheapest first, the 8B ones last.

Reproduce: on the lent GPU machine, ``bash bench/gpu_run.sh`` (its first lines give the device tool's call), or on
any GPU machine ``python bench/gpu_estimate_check.py --measure gpu.json``; then here
``.venv/bin/python bench/gpu_estimate_check.py --compare gpu.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # before memfit's first import

import torch  # noqa: E402

from memfit.units import GIB  # noqa: E402

# AdamW unless a row names another optimizer (left out, a config trained from scratch gets Muon)
BASE = [
    "dtype=bf16",
    "batch_size=1",
    "seq_len=2048",
    "device=cuda",
    "max_grad_norm=1.0",
    "optimizer.name=adamw",
]
IN_BACKWARD = ["optimizer_in_backward=true", "max_grad_norm=0"]
CONFIGS = {
    "1B AdamW foreach": ["model=llama3.2-1b"],
    "1B AdamW fused": ["model=llama3.2-1b", "optimizer.implementation=fused"],
    "1B bf16_mixed AdamW fused": ["model=llama3.2-1b", "dtype=bf16_mixed", "optimizer.implementation=fused"],
    "1B AC full + chunked CE 8": [
        "model=llama3.2-1b",
        "activation_checkpointing=full",
        "chunked_cross_entropy=8",
    ],
    "1B batch 4, AC full": ["model=llama3.2-1b", "batch_size=4", "activation_checkpointing=full"],
    "1B bnb AdamW8bit": ["model=llama3.2-1b", "optimizer.name=adamw8bit"],
    "1B torchao AdamW8bit": ["model=llama3.2-1b", "optimizer.name=torchao_adamw8bit"],
    "1B optimizer in backward": ["model=llama3.2-1b", *IN_BACKWARD],
    "1B activation offloading": ["model=llama3.2-1b", "activation_offloading=true"],
    "1B long context: offloaded checkpoints, tiled MLP, chunked CE, the planner's longest T for 8 GiB": [
        "model=llama3.2-1b",
        *IN_BACKWARD,
        "activation_checkpointing=full",
        "chunked_cross_entropy=auto",
        "tiled_mlp=auto",
        "activation_offloading=true",
        "seq_len=longest:8GiB",
    ],
    "8B paged AdamW8bit + in backward + AC + chunked CE": [
        "model=llama3-8b",
        "optimizer.name=paged_adamw8bit",
        *IN_BACKWARD,
        "activation_checkpointing=full",
        "chunked_cross_entropy=8",
    ],
    "8B AdamW8bit + in backward + AC + chunked CE": [
        "model=llama3-8b",
        "optimizer.name=adamw8bit",
        *IN_BACKWARD,
        "activation_checkpointing=full",
        "chunked_cross_entropy=8",
    ],
    "8B LoRA, AC + chunked CE, batch 2": [
        "model=llama3.1-8b",
        "method=lora",
        "batch_size=2",
        "activation_checkpointing=full",
        "chunked_cross_entropy=8",
    ],
    "8B QLoRA, AC + chunked CE, batch 2": [
        "model=llama3.1-8b",
        "method=qlora",
        "batch_size=2",
        "activation_checkpointing=full",
        "chunked_cross_entropy=8",
    ],
}


def _config(overrides: list[str]):
    from memfit.config import load_config

    # device=cuda validates on any machine; the run needs CUDA. LoRA / QLoRA start from random weights here
    return load_config(None, [*BASE, *overrides], needs_weights=False)


def resolve_longest(overrides: list[str], dry_run: bool = False) -> list[str]:
    """``seq_len=longest:BUDGET`` -> the longest ``seq_len`` at which the planner predicts the configuration fits
    ``BUDGET`` (:func:`memfit.planner.context.longest_length`, 10% margin), with ``model_args.max_seq_len`` raised to
    it: the configuration is then measured at the length the planner calls the longest. Other overrides pass."""
    from memfit.planner.context import at_length, longest_length
    from memfit.units import parse_bytes

    marker = next((o for o in overrides if o.startswith("seq_len=longest:")), None)
    if marker is None:
        return overrides
    rest = [o for o in overrides if o != marker]
    budget = parse_bytes(marker.split(":", 1)[1], "seq_len")
    cfg = _config([*rest, "seq_len=0"])  # valid at any model's context; the search sets the length
    if dry_run:
        cfg = dataclasses.replace(cfg, device="cpu")
    length = longest_length(cfg, int(budget * 0.9))[0]
    cfg = at_length(cfg, length)
    return [*rest, f"seq_len={length}", f"model_args.max_seq_len={cfg.model_args.get('max_seq_len', length)}"]


def measure(path: Path, dry_run: bool = False) -> None:
    """Measure every configuration (see the module docstring) and write ``path`` after each one.

    Args:
        path: the JSON to write (gzip-compressed when it ends in ``.gz``).
        dry_run: one tiny configuration on CPU, with the CUDA statistics as zeros (checks the script).
    """
    from memfit.build import build_training, run_model_config
    from memfit.memory.allocator import replay
    from memfit.step import train_step, train_step_options

    device = torch.device("cpu" if dry_run else "cuda")
    cuda = torch.cuda if not dry_run else _NoCuda()
    configs = (
        {
            "tiny (dry run)": ["model=tiny", "seq_len=64", "tokenizer.kind=char"],
            "tiny long context (dry run)": [
                "model=tiny",
                "tokenizer.kind=char",
                "activation_checkpointing=full",
                "tiled_mlp=auto",
                "chunked_cross_entropy=auto",
                "seq_len=longest:16MiB",
            ],
        }
        if dry_run
        else CONFIGS
    )
    info = {"device": cuda.get_device_name(), "torch": torch.__version__}
    results: dict[str, dict] = {}
    for name, overrides in configs.items():
        t0 = time.perf_counter()
        cuda.reset_peak_memory_stats()
        if not dry_run:  # block addresses and sizes only: stack traces would take minutes to symbolise
            torch.cuda.memory._record_memory_history(
                "all", context=None, max_entries=2_000_000, clear_history=True
            )
        try:
            overrides = resolve_longest(overrides, dry_run)
            cfg = _config(overrides)
            if dry_run:
                cfg = dataclasses.replace(cfg, device="cpu")
            mcfg = run_model_config(cfg)
            built = build_training(
                cfg, mcfg, device
            )  # the run's build: method, tiling, checkpointing, offloading
            model, optimizer = built.model, built.optimizer
            T = cfg.seq_len
            g = torch.Generator(device=device).manual_seed(0)
            result = None
            batches = [
                (
                    torch.randint(0, mcfg.vocab_size, (cfg.batch_size, T), device=device, generator=g),
                    torch.randint(0, mcfg.vocab_size, (cfg.batch_size, T), device=device, generator=g),
                )
                for _ in range(cfg.gradient_accumulation_steps)
            ]
            for group in optimizer.param_groups:
                group["lr"] = 1e-5
            train_step(model, optimizer, batches, **train_step_options(cfg))
            cuda.synchronize()
            cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            result = train_step(model, optimizer, batches, **train_step_options(cfg))
            loss = result.loss.item()
            cuda.synchronize()
            step_s = time.perf_counter() - start
            free, total = cuda.mem_get_info()
            events = [] if dry_run else _allocator_events(torch.cuda.memory._snapshot())
            results[name] = {
                "overrides": overrides,
                "peak_alloc_bytes": cuda.max_memory_allocated(),
                "peak_reserved_bytes": cuda.max_memory_reserved(),
                "device_used_bytes_after": total - free,
                "step_seconds": step_s,
                "tokens_per_second": cfg.batch_size * T * cfg.gradient_accumulation_steps / step_s,
                "loss": loss,
                "wall_seconds": time.perf_counter() - t0,
                "life_peak_reserved_bytes": cuda.max_memory_reserved(),  # reset at the start: the whole life
                # the recorded events through memfit's allocator model, here (compare re-replays when it can)
                "replayed_peak_reserved_bytes": replay(events).peak_reserved if events else None,
                "allocator_events": events,
            }
        except Exception as exc:  # one failing configuration must not lose the others' numbers
            results[name] = {"overrides": overrides, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            if not dry_run:
                torch.cuda.memory._record_memory_history(enabled=None)
        shown = {k: v for k, v in results[name].items() if k != "allocator_events"}
        print(
            name, json.dumps(shown), f"({len(results[name].get('allocator_events', []))} events)", flush=True
        )
        write_results(path, {"info": info, "results": results})  # after each one: a time limit keeps these
        model = optimizer = batches = result = events = None
        gc.collect()
        cuda.empty_cache()


def write_results(path: Path, data: dict) -> None:
    """Write the measurements to ``path`` (gzip-compressed when it ends in ``.gz``), atomically."""
    text = json.dumps(data, indent=1).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(text, mtime=0) if path.suffix == ".gz" else text)
    tmp.replace(path)


def read_results(path: Path) -> dict:
    """The measurements :func:`measure` wrote (plain or ``.gz`` JSON)."""
    raw = path.read_bytes()
    return json.loads(gzip.decompress(raw) if path.suffix == ".gz" else raw)


def _allocator_events(snapshot: dict) -> list[tuple]:
    """The caching allocator's own block allocations and frees of device 0, in order, as
    :func:`memfit.memory.allocator.replay` events (keyed by address, on their stream)."""
    events: list[tuple] = []
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            events.append(("alloc", e["addr"], e["size"], e.get("stream", 0)))
        elif e["action"] == "free_completed":
            events.append(("free", e["addr"]))
    return events


class _NoCuda:
    """torch.cuda's memory statistics as zeros, for a dry run of the script on CPU."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: (
            (0, 0) if name == "mem_get_info" else "cpu" if name == "get_device_name" else 0
        )


def compare(path: Path, doc: Path) -> None:
    from bench.docs_section import write_section
    from memfit.memory.allocator import replay
    from memfit.planner.estimate import estimate_run

    data = read_results(path)
    rows = []
    errors = []
    for name, m in data["results"].items():
        if "error" in m:
            rows.append(f"| {name} | - | - | - | - | - | - | - | failed on the GPU: {m['error'][:120]} |")
            continue
        e = estimate_run(_config(m["overrides"]))
        err = (e.peak_bytes - m["peak_alloc_bytes"]) / m["peak_alloc_bytes"]
        errors.append(abs(err))
        reserved = e.peak_reserved_bytes
        replayed = (
            replay(m["allocator_events"]).peak_reserved
            if m.get("allocator_events")
            else m.get("replayed_peak_reserved_bytes")
        )
        life = m.get("life_peak_reserved_bytes")
        rows.append(
            f"| {name} | {e.peak_bytes / GIB:.2f} | {m['peak_alloc_bytes'] / GIB:.2f} | {err:+.1%} | "
            f"{'-' if reserved is None else f'{reserved / GIB:.2f}'} | {m['peak_reserved_bytes'] / GIB:.2f} | "
            f"{'-' if replayed is None or not life else f'{replayed / GIB:.2f} / {life / GIB:.2f}'} | "
            f"{e.device_total_bytes / GIB:.2f} vs {m['device_used_bytes_after'] / GIB:.2f} | {e.phase}, "
            f"{m['tokens_per_second']:,.0f} tok/s |"
        )
        print(rows[-1], flush=True)
    errors.sort()
    summary = (
        f"max |error| {errors[-1]:.1%}, median {errors[len(errors) // 2]:.1%} over {len(errors)} configurations"
        if errors
        else "no configuration measured"
    )
    section = "\n".join(
        [
            "## Estimated vs measured on a GPU",
            "",
            f"Measured on one {data['info']['device']} (torch {data['info']['torch']}): each configuration built as "
            "`memfit pretrain` builds it (random init), two `train_step`s on random ids, batch 1 x 2,048 tokens "
            "unless noted, bf16. *measured* is the CUDA caching allocator's `max_memory_allocated` over the second "
            "step; *estimated* is `memfit estimate` for the same configuration, traced on fake tensors on a CPU "
            "machine (its allocator-visible peak); *reserved* is the allocator's reserved peak, estimated by replaying "
            "the traced allocations through memfit's caching allocator model, and measured; *allocator replay* "
            "replays the allocator's own recorded events of the configuration's whole life through that model, "
            "against the measured reserved peak of that life (a check of the model alone); *device total* is the "
            "estimate of what the driver shows (reserved + CUDA context + paged state) against the device's used "
            "memory after the step. GiB = 1024**3 bytes.",
            "",
            f"Summary: {summary}.",
            "",
            "Reproduce: on the lent GPU machine `bash bench/gpu_run.sh` (it writes `gpu_estimate.json.gz`; "
            "elsewhere `python bench/gpu_estimate_check.py --measure gpu.json`), then "
            "`.venv/bin/python bench/gpu_estimate_check.py --compare gpu_estimate.json.gz`.",
            "",
            "| configuration | estimated (GiB) | measured (GiB) | error | estimated reserved (GiB) "
            "| measured reserved (GiB) | allocator replay / measured, whole life (GiB) "
            "| device total, estimated vs used (GiB) | phase of peak, throughput |",
            "|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    write_section(doc, "gpu-estimate", section)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", type=Path, help="run on the GPU and write measurements here")
    parser.add_argument(
        "--compare", type=Path, help="estimate the configurations and write docs/benchmarks.md"
    )
    parser.add_argument("--dry-run", action="store_true", help="--measure one tiny configuration on CPU")
    parser.add_argument(
        "--doc", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
    )
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, dry_run=args.dry_run)
    if args.compare:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        compare(args.compare, args.doc)


if __name__ == "__main__":
    main()
