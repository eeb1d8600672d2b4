"""The seed table on one GPU: Llama-3-8B (random weights), full fine-tune, batch 2, optimizer in backward.

For AdamW8bit, PagedAdamW8bit and PagedAdamW (bitsandbytes), each with the optimizer step fused into backward,
bf16 weights and activation checkpointing (the seed recipe, configs/llama3_8b_full_single_device.yaml), it records
the CUDA allocator's peaks (active / allocated / reserved), the device-level peak the driver reports (which also
counts paged optimizer state in unified memory, invisible to the allocator; sampled every 5 ms by a thread) and
tokens/s over the timed steps. The model is built once; each optimizer is built, run and freed in turn.

Run on a machine with one GPU of >= 40 GiB (on the lent machine ``bench/gpu_run.sh`` runs it)::

    python bench/gpu_seed_table.py --out docs/gpu_seed_table.md

Options shrink it for smaller GPUs or a quick check (``--model llama3.2-1b``); ``--dry-run`` runs the ``tiny``
model on CPU (the CUDA statistics as zeros, the paged optimizers unpaged) to check the script. The table is
written after each optimizer, so a run stopped at its time limit keeps the rows it finished.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # before memfit's first import

import torch  # noqa: E402

from memfit.units import GIB  # noqa: E402

OPTIMIZERS = ("adamw8bit", "paged_adamw8bit", "paged_adamw")


class DevicePeakSampler:
    """Samples ``torch.cuda.mem_get_info`` in a thread: the driver's view, paged memory included."""

    def __init__(self, interval_s: float = 0.005, enabled: bool = True):
        self.interval_s = interval_s
        self.enabled = enabled
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.interval_s)

    def __enter__(self):
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join()


class _NoCuda:
    """torch.cuda's calls that the table makes, as zeros, for a dry run of the script on CPU."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: (
            "cpu" if name == "get_device_name" else {} if name == "memory_stats" else None
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS))
    parser.add_argument("--out", default="docs/gpu_seed_table.md")
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on CPU, to check the script")
    args = parser.parse_args()
    if args.dry_run:
        args.model, args.seq_len, args.warmup_steps, args.timed_steps = "tiny", 64, 1, 1
    elif not torch.cuda.is_available():
        raise SystemExit("bench/gpu_seed_table.py needs a CUDA device (--dry-run checks the script on CPU)")

    from memfit.config import OptimizerConfig
    from memfit.memory.optim import build_optimizer, optimizer_state_bytes
    from memfit.memory.techniques import apply_activation_checkpointing
    from memfit.models.decoder import build_decoder
    from memfit.models.presets import model_config
    from memfit.step import train_step

    device = torch.device("cpu" if args.dry_run else "cuda")
    cuda = _NoCuda() if args.dry_run else torch.cuda
    cfg = model_config(args.model, **({"vocab_size": 256} if args.dry_run else {}))  # tiny: char-level ids
    t0 = time.perf_counter()
    model = build_decoder(cfg, device=device, dtype=torch.bfloat16, seed=0)
    apply_activation_checkpointing(model, "full")
    build_s = time.perf_counter() - t0
    num_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(0)

    def batch():
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device, generator=g)
        return [(x[:, :-1], x[:, 1:])]

    rows = []
    for name in args.optimizers:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a dry run's paged optimizers run unpaged on CPU, and say so
            optimizer = build_optimizer(
                model, OptimizerConfig(name=name, lr=1e-5, weight_decay=0.0), in_backward=True
            )
        for _ in range(args.warmup_steps):
            train_step(model, optimizer, batch(), max_grad_norm=0.0, dtype="bf16").loss.item()
        cuda.synchronize()
        cuda.reset_peak_memory_stats()
        with DevicePeakSampler(enabled=not args.dry_run) as sampler:
            t0 = time.perf_counter()
            losses = [
                train_step(model, optimizer, batch(), max_grad_norm=0.0, dtype="bf16").loss.item()
                for _ in range(args.timed_steps)
            ]
            cuda.synchronize()
            elapsed = time.perf_counter() - t0
        stats = cuda.memory_stats()
        rows.append(
            {
                "optimizer": name,
                "peak_memory_active_gib": stats.get("active_bytes.all.peak", 0) / GIB,
                "peak_memory_alloc_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
                "peak_memory_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / GIB,
                "peak_memory_device_gib": sampler.peak / GIB,
                "optimizer_state_gib": optimizer_state_bytes(optimizer) / GIB,
                "tokens_per_second_per_gpu": args.timed_steps * args.batch_size * args.seq_len / elapsed,
                "losses": losses,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
        if hasattr(optimizer, "remove_hooks"):
            optimizer.remove_hooks()
        del optimizer
        gc.collect()
        cuda.empty_cache()
        _write_table(
            args, rows, cuda.get_device_name(), num_params, build_s
        )  # after each: a time limit keeps it
    print(Path(args.out).read_text())
    return 0


def _write_table(
    args: argparse.Namespace, rows: list[dict], device_name: str, num_params: int, build_s: float
):
    """The seed table of ``rows`` as markdown, into ``args.out``."""
    lines = [
        f"## Seed table on {device_name}\n",
        f"{args.model} ({num_params:,} parameters, random weights, bf16), batch {args.batch_size} x {args.seq_len} "
        f"tokens, activation checkpointing on every layer, optimizer step in backward; {args.timed_steps} timed "
        f"steps after {args.warmup_steps} warm-up steps; model built in {build_s:.0f} s. GiB = 1024**3 bytes.\n",
        f"Reproduce: `python bench/gpu_seed_table.py --model {args.model} --batch-size {args.batch_size} "
        f"--seq-len {args.seq_len}`\n",
        "| optimizer | peak_memory_active | peak_memory_alloc | peak_memory_reserved | peak_memory_device | "
        "optimizer state | tokens/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['optimizer']} | {r['peak_memory_active_gib']:.2f} | {r['peak_memory_alloc_gib']:.2f} | "
            f"{r['peak_memory_reserved_gib']:.2f} | {r['peak_memory_device_gib']:.2f} | "
            f"{r['optimizer_state_gib']:.2f} | "
            f"{r['tokens_per_second_per_gpu']:,.0f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
