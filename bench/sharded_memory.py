"""Memory per rank over 1, 2 and 4 ranks on CPU: model state (parameters + gradients + optimizer state) falls as 1/N.

One Llama, one global batch, split over N ranks (``torchrun --standalone``, gloo, one thread per rank); each row is
its own launch. Per rank: one untimed step (it creates AdamW's state), timed steps (tokens/s, peak RSS), then one
step under :class:`memfit.memory.tracker.MemoryTracker`, which tells this rank's shards (``parameters``) from what
FSDP gathers (``unsharded_parameters``). Every per-rank number is that of the fullest rank (the maximum over
ranks); tokens/s is the mean over ranks.

Reproduce (about 10 minutes on 2 CPU cores)::

    OMP_NUM_THREADS=1 .venv/bin/python bench/sharded_memory.py --out docs/benchmarks.md

It rewrites the section between the ``sharded-memory`` markers of ``docs/benchmarks.md`` and writes
``docs/sharded_memory_results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from docs_section import write_section

MIB = 1024**2
ROOT = Path(__file__).resolve().parents[1]

# the shakespeare preset's shape at width 512 and 8 layers, with an 8,000-id vocabulary
MODEL_ARGS = {
    "vocab_size": 8000,
    "dim": 512,
    "num_layers": 8,
    "num_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 1408,
    "max_seq_len": 256,
    "tie_word_embeddings": False,
}

# (label, ranks, distributed.* settings); the first row is the one-process baseline
ROWS: list[tuple[str, int, dict]] = [
    ("1 process (not sharded)", 1, {}),
    ("FSDP2", 2, {}),
    ("FSDP2", 4, {}),
    ("FSDP1", 2, {"strategy": "fsdp1"}),
    ("FSDP1", 4, {"strategy": "fsdp1"}),
    ("FSDP2, reshard_after_forward=false", 2, {"reshard_after_forward": False}),
    ("FSDP2, prefetch=0", 2, {"prefetch": 0}),
    ("FSDP2, prefetch=2", 2, {"prefetch": 2}),
]


def run_rank(spec: dict, global_batch: int, seq_len: int, timed_steps: int) -> dict | None:
    """This rank's part of one row (under torchrun); rank 0 returns every rank's measurements, others None."""
    import torch

    from memfit import distributed as dist_
    from memfit.config import DistributedConfig, OptimizerConfig, TrainConfig
    from memfit.memory.optim import build_optimizer
    from memfit.memory.stats import PeakMemory
    from memfit.memory.tracker import MemoryTracker
    from memfit.models.config import DecoderConfig
    from memfit.models.decoder import build_decoder
    from memfit.step import train_step

    device = dist_.init_distributed(torch.device("cpu"))
    world, rank = dist_.world_size(), dist_.rank()
    if global_batch % world:
        raise SystemExit(f"--global-batch {global_batch} does not split over {world} ranks")
    batch = global_batch // world
    cfg = TrainConfig(distributed=DistributedConfig(**spec))
    model = build_decoder(DecoderConfig(**MODEL_ARGS), seed=0)  # every rank the same weights, then its shards
    num_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        model = dist_.shard_model(model, cfg, device)
    optimizer = build_optimizer(model, OptimizerConfig(lr=1e-4, weight_decay=0.1))  # AdamW, foreach
    step_kw = {"max_grad_norm": 1.0, "dtype": "fp32"}

    def micro_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(step)  # the same global batch for every N; this rank takes its rows
        x = torch.randint(0, MODEL_ARGS["vocab_size"], (global_batch, seq_len + 1), generator=g)
        x = x[rank * batch : (rank + 1) * batch]
        return [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]

    losses = [train_step(model, optimizer, micro_batches(0), **step_kw).loss.item()]  # creates AdamW's state
    dist_.barrier()
    peak = PeakMemory(device)  # RSS high-water from here: the sharded steps, not the set-up
    t0 = time.perf_counter()
    for step in range(1, timed_steps + 1):
        losses.append(train_step(model, optimizer, micro_batches(step), **step_kw).loss.item())
    elapsed = time.perf_counter() - t0
    rss = peak.read_and_reset()["peak_memory_rss"]
    tracker = MemoryTracker(model, optimizer)
    with tracker:
        result = train_step(model, optimizer, micro_batches(timed_steps + 1), tracker=tracker, **step_kw)
    losses.append(result.loss.item())
    # the sharded gradients: p.grad when the optimizer step starts (in the backward, unsharded ones come and go)
    grads = next(b["gradients"] for _, phase, b in tracker.timeline if phase == "optimizer_step")
    real_param_bytes = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    mine = {
        "tokens_per_second": timed_steps * batch * seq_len / elapsed,
        "peak_rss_gib": rss,
        "tracked_peak_bytes": tracker.peak_bytes,
        "peak_phase": tracker.peak_phase,
        "breakdown_bytes": tracker.peak_breakdown,
        "category_peak_bytes": tracker.category_peaks,
        "sharded_gradient_bytes": grads,
        "padding_bytes": tracker.peak_breakdown["parameters"] - buffer_bytes - real_param_bytes,
    }
    ranks = dist_.all_gather_objects(mine)
    dist_.destroy_distributed()
    if rank != 0:
        return None
    return {"ranks": world, "num_params": num_params, "losses": losses, "per_rank": ranks}


def _local(p):
    """A parameter's tensor on this rank: an FSDP2 DTensor's local shard, else itself (FSDP1: a view of it)."""
    return p.to_local() if hasattr(p, "to_local") else p


def _launch(spec: dict, ranks: int, args) -> dict:
    """One row: ``torchrun --standalone`` of this script's rank part, with a timeout that kills the whole group."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        __file__,
        "--_rank",
        json.dumps(spec),
    ]
    cmd += ["--global-batch", str(args.global_batch), "--seq-len", str(args.seq_len)]
    cmd += ["--timed-steps", str(args.timed_steps)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        # a fixed mmap threshold turns off glibc's adaptive one, which serves tensors up to 32 MiB from a heap
        # that keeps freed memory: with it RSS follows the live tensors (and allocation costs page faults)
        "MALLOC_MMAP_THRESHOLD_": "131072",
    }
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        reason = (stderr.strip().splitlines() or ["failed"])[-1][:160].replace("|", "/")
        return {"error": reason}
    return json.loads(stdout.strip().splitlines()[-1])


def _row_numbers(r: dict) -> dict:
    """Per-rank numbers of a row: the maximum over ranks (the fullest rank), tokens/s the mean."""
    per = r["per_rank"]

    def top(key: str, cat: str | None = None) -> float:
        return max(p[key][cat] if cat else p[key] for p in per)

    model_state = max(
        p["breakdown_bytes"]["parameters"]
        + p["sharded_gradient_bytes"]
        + p["breakdown_bytes"]["optimizer_state"]
        for p in per
    )
    return {
        "parameters": top("breakdown_bytes", "parameters"),
        "unsharded": top("category_peak_bytes", "unsharded_parameters"),
        "gradients": top("sharded_gradient_bytes"),
        "optimizer_state": top("breakdown_bytes", "optimizer_state"),
        "model_state": model_state,
        "padding": top("padding_bytes"),
        "activations": top("category_peak_bytes", "activations"),
        "peak": top("tracked_peak_bytes"),
        "rss": top("peak_rss_gib"),
        "tokens_per_second": sum(p["tokens_per_second"] for p in per) / len(per),
    }


def _table(results: list[tuple[str, int, dict]]) -> str:
    base = _row_numbers(results[0][2])
    head = (
        "| configuration | ranks | parameters (shard) | unsharded peak | gradients | optimizer_state | "
        "model state | vs 1 process | ideal 1/N | above 1/N | padding | activations peak | tracked peak | "
        "peak RSS (GiB) | tokens/s per rank | loss after the last step |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, ranks, r in results:
        if "error" in r:
            lines.append(f"| {label} | {ranks} | {r['error']} |" + " — |" * 13)
            continue
        n = _row_numbers(r)
        above = n["model_state"] - base["model_state"] / ranks
        lines.append(
            f"| {label} | {ranks} | {n['parameters'] / MIB:,.2f} | {n['unsharded'] / MIB:,.2f} "
            f"| {n['gradients'] / MIB:,.2f} | {n['optimizer_state'] / MIB:,.2f} | {n['model_state'] / MIB:,.2f} "
            f"| {n['model_state'] / base['model_state']:.5f} | {1 / ranks:.5f} | {above:+,.0f} B "
            f"| {n['padding']:,} B | {n['activations'] / MIB:,.2f} | {n['peak'] / MIB:,.2f} | {n['rss']:.2f} "
            f"| {n['tokens_per_second']:,.0f} | {r['losses'][-1]:.6f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step over all ranks")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--timed-steps", type=int, default=2)
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds per row before its launch is killed"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    parser.add_argument(
        "--rows", type=int, nargs="*", help="run only these rows (indices into ROWS; 0 first)"
    )
    parser.add_argument("--_rank", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._rank is not None:
        out = run_rank(json.loads(args._rank), args.global_batch, args.seq_len, args.timed_steps)
        if out is not None:
            print(json.dumps(out))
        return 0

    results = []
    for i, (label, ranks, spec) in enumerate(ROWS):
        if args.rows is not None and i not in args.rows:
            continue
        t0 = time.perf_counter()
        r = _launch(spec, ranks, args)
        results.append((label, ranks, r))
        print(f"{label} x {ranks}: {r.get('error') or 'ok'} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)  # fmt: skip
    docs = Path(args.out).parent
    (docs / "sharded_memory_results.json").write_text(json.dumps(results, indent=1))
    section = _section(results, args)
    write_section(Path(args.out), "sharded-memory", section)
    print(section)
    return 0


def _section(results: list[tuple[str, int, dict]], args) -> str:
    num_params = next((r["num_params"] for _, _, r in results if "num_params" in r), 0)
    m = MODEL_ARGS
    return (
        "## Memory per rank over 1, 2 and 4 ranks (FSDP on CPU)\n\n"
        f"A {num_params / 1e6:.1f}M-parameter Llama (dim {m['dim']}, {m['num_layers']} layers, "
        f"{m['num_heads']}/{m['num_kv_heads']} heads, SwiGLU {m['intermediate_size']}, vocabulary "
        f"{m['vocab_size']:,}, untied embeddings), fp32, AdamW (foreach), the same global batch of "
        f"{args.global_batch} x {args.seq_len} tokens split over the ranks; `torchrun --standalone`, gloo, one "
        "thread per rank, `distributed.prefetch=1` and `reshard_after_forward=true` unless the row says "
        "otherwise. Memory columns are MiB (1024**2 bytes) unless marked, for the fullest rank (the maximum over "
        "ranks), from memfit's tracker over one step: `parameters` is this rank's shards (its padded part of "
        "every parameter) and the RoPE buffer; `unsharded peak` is the most that FSDP held all-gathered at once "
        "(`unsharded_parameters`); `gradients` is the sharded gradients as the optimizer step starts; "
        "`model state` = parameters + gradients + optimizer_state; `vs 1 process` is its ratio to the unsharded "
        "run and `ideal 1/N` the ratio of a perfect split; `above 1/N` is how many bytes this rank holds beyond "
        "(1-process model state) / N, and `padding` the padding in its parameter shards. `activations peak` is "
        "that category's own peak, `tracked peak` all categories at the step's peak. Peak RSS is the largest "
        "process high-water over the timed steps, after sharding (the set-up, "
        "which builds on the meta device and fills the shards one tensor at a time, is not in it), with the "
        "Python/torch runtime (~0.3 GiB per rank), under "
        "`MALLOC_MMAP_THRESHOLD_=131072` so that freed tensors go back to the OS; tokens/s per rank is the mean "
        "over ranks over the timed steps, untracked, with N processes sharing 2 cores. The loss of the last step "
        "is the same for every N: one global batch, one computation.\n\n"
        f"Reproduce: `OMP_NUM_THREADS=1 .venv/bin/python bench/sharded_memory.py --global-batch {args.global_batch} "
        f"--seq-len {args.seq_len} --timed-steps {args.timed_steps}`\n\n" + _table(results) + "\n\n" + _NOTES
    )


_NOTES = """\
**Why a rank holds slightly more than 1/N.** FSDP2 cuts every parameter on dim 0 into N chunks of
`ceil(rows / N)` rows (as `torch.chunk` does) and pads each rank's chunk to that size, so that the all-gather moves
equal pieces: a rank stores `ceil(rows / N) * row_bytes` of each parameter, the first ranks more real rows than
`rows / N`, a last rank with a short chunk padding (the `padding` column). Every dim 0 of this model (8,000, 512,
256, 1,408) divides by 2 and 4, so there is no padding here; GPT-2's 50,257-row embedding at N = 4 would give
every rank 12,565 rows, the last one 3 of them padding (6 KiB at width 512). FSDP1 flattens each unit's parameters
into one vector (each parameter starting at a multiple of 16 bytes), pads it to a multiple of N elements and
gives each rank one N-th. What is left above 1/N here is not sharded at all: the RoPE `inv_freq` buffer, on every
rank, and AdamW's `step` counters, one 4-byte tensor per parameter tensor on every rank (FSDP1: per parameter with
at least one element in the rank's slice). Sharded gradients have the shards' layout (FSDP2: padded views of the
reduce-scatter output); AdamW's moments that of the real, unpadded local shard. `tests/test_distributed_memory.py`
asserts these counts byte for byte on 2 ranks with a 259-row (padded) embedding.

**What does not fall as 1/N.** Activations follow each rank's share of the batch (global batch / N), not the
sharding. The gathered parameters are a few units at full size whatever N: FSDP2 all-gathers a unit into one flat
buffer and copies it out into per-parameter storages, and the flat buffer lives until the next unit's copy-out
has finished, so at the start of the forward the root unit (embedding, final norm and `lm_head` here, kept
gathered from the forward to the backward) is held twice, next to the first layer's buffer and storages: 2 x 31.3
+ 2 x 11.25 MiB = 85.0 MiB for FSDP2 here, more than any later moment, so `prefetch` 0, 1 and 2 (each step
gathers one more layer ahead) show the same peak; FSDP1 has no such buffer (its peak, 31.3 + 3 x 11.25 MiB, is the
root and three layers). `reshard_after_forward=false` keeps every layer gathered from its forward to
its backward: all 8 at the end of the forward. In the backward each rank also computes a unit's full unsharded gradients
before they are reduce-scattered (they count as `gradients` then; the column shows the sharded ones). Peak RSS
adds the runtime and the allocator's slack to the tracked bytes, and tokens/s per rank on 2 shared cores says
more about the machine than about FSDP."""


if __name__ == "__main__":
    raise SystemExit(main())
