"""The seed table on one GPU: Llama-3-8B (random weights), full fine-tune, batch 2, optimizer in backward.

For AdamW8bit, PagedAdamW8bit and PagedAdamW (bitsandbytes), each with the optimizer step fused into backward,
bf16 weights and activation checkpointing (the seed recipe, configs/llama3_8b_full_single_device.yaml), it records
the CUDA allocator's peaks (active / allocated / reserved), the device-level peak the driver reports (which also
counts paged optimizer state in unified memory, invisible to the allocator; sampled every 5 ms by a thread) and
tokens/s over the timed steps. The model is built once; each optimizer is built, run and freed in turn.

Run on a machine with one GPU of >= 40 GiB (about 4 minutes on one H200)::

    python bench/gpu_seed_table.py --out docs/gpu_seed_table.md

Options shrink it for smaller GPUs or a quick check (``--model llama3.2-1b``).
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time
from pathlib import Path

import torch

from memfit.units import GIB

OPTIMIZERS = ("adamw8bit", "paged_adamw8bit", "paged_adamw")


class DevicePeakSampler:
    """Samples ``torch.cuda.mem_get_info`` in a thread: the driver's view, paged memory included."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    parser.add_argument("--optimizers", nargs="*", default=list(OPTIMIZERS))
    parser.add_argument("--out", default="docs/gpu_seed_table.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_seed_table.py needs a CUDA device")

    from memfit.config import OptimizerConfig
    from memfit.memory.optim import build_optimizer, optimizer_state_bytes
    from memfit.memory.techniques import apply_activation_checkpointing
    from memfit.models.llama import build_llama
    from memfit.models.presets import model_config
    from memfit.step import train_step

    device = torch.device("cuda")
    cfg = model_config(args.model)
    t0 = time.perf_counter()
    model = build_llama(cfg, device=device, dtype=torch.bfloat16, seed=0)
    apply_activation_checkpointing(model, "full")
    build_s = time.perf_counter() - t0
    num_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(0)

    def batch():
        x = torch.randint(0, cfg.vocab_size, (args.batch_size, args.seq_len + 1), device=device, generator=g)
        return [(x[:, :-1], x[:, 1:])]

    rows = []
    for name in args.optimizers:
        optimizer = build_optimizer(
            model, OptimizerConfig(name=name, lr=1e-5, weight_decay=0.0), in_backward=True
        )
        for _ in range(args.warmup_steps):
            train_step(model, optimizer, batch(), max_grad_norm=0.0, dtype="bf16").loss.item()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with DevicePeakSampler() as sampler:
            t0 = time.perf_counter()
            losses = [
                train_step(model, optimizer, batch(), max_grad_norm=0.0, dtype="bf16").loss.item()
                for _ in range(args.timed_steps)
            ]
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
        stats = torch.cuda.memory_stats()
        rows.append(
            {
                "optimizer": name,
                "peak_memory_active_gib": stats["active_bytes.all.peak"] / GIB,
                "peak_memory_alloc_gib": stats["allocated_bytes.all.peak"] / GIB,
                "peak_memory_reserved_gib": stats["reserved_bytes.all.peak"] / GIB,
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
        torch.cuda.empty_cache()

    lines = [
        f"## Seed table on {torch.cuda.get_device_name()}\n",
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
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
