"""bitsandbytes' optimizer update on CPU: its op on whole tensors against memfit's chunks of its CPU kernel.

On CPU, bitsandbytes' 8-bit (and 32-bit) optimizer ops run Python kernels (``backends/cpu/ops.py``) that hold fp32
temporaries of the whole tensor: both moments dequantized, the gradient's scaled copy, the square root and the
denominator, 20 bytes per element for 8-bit AdamW. memfit runs the same kernels on chunks of
``memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS`` values (``compose_bnb_cpu_updates``).

For each tensor shape (Llama-3.2-3B's tied embedding, an MLP and an attention projection of it) and each side, one
fresh process: an fp32 parameter and gradient, the optimizer, one step to create its state, then ``--steps`` timed
steps. Measured: the resident memory the timed steps add over what the process held before them (the kernel's
high-water mark, ``VmHWM``, reset after the first step through ``/proc/self/clear_refs``, against the RSS then, so
the state and the tensors are left out: the update's temporaries and what the heap keeps of them), and the median
seconds of an update. Alone on the machine; GiB = 1024**3 bytes.

Reproduce::

    .venv/bin/python bench/bnb_cpu_update.py

It rewrites the section ``bnb-cpu-update`` of ``docs/benchmarks.md`` (``--out -`` prints it instead).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from docs_section import write_section

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
SHAPES = {
    "tok_embeddings (128256, 3072)": (128256, 3072),
    "mlp.up_proj (8192, 3072)": (8192, 3072),
    "attention.wq (3072, 3072)": (3072, 3072),
}
OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged_adamw": "PagedAdamW"}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _hwm_bytes() -> int:
    """The kernel's high-water mark of this process's RSS (``VmHWM``), since the start or the last reset."""
    status = Path("/proc/self/status").read_text()
    return int(next(ln for ln in status.splitlines() if ln.startswith("VmHWM:")).split()[1]) * 1024


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Child: ``spec['steps']`` timed updates of one tensor; its seconds and the resident memory they added."""
    import torch

    from memfit.memory import bnb_cpu
    from memfit.memory.optimizers import _bitsandbytes

    torch.manual_seed(0)
    cls = getattr(_bitsandbytes(), OPTIMIZERS[spec["optimizer"]])
    bnb_cpu.BNB_CPU_UPDATES_COMPOSED = spec["side"] == "chunks"
    p = torch.nn.Parameter(torch.empty(spec["shape"]).normal_(0, 0.02))  # made in place: no temporary
    p.grad = torch.empty_like(p).normal_(0, 1e-3)
    opt = cls([p], lr=1e-4)
    opt.step()  # the state
    before = _rss_bytes()
    Path("/proc/self/clear_refs").write_text(
        "5"
    )  # the kernel's high-water mark (VmHWM) starts again from here
    seconds = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        opt.step()
        seconds.append(time.perf_counter() - t0)
    return {"seconds": seconds, "added_bytes": max(0, _hwm_bytes() - before), "numel": p.numel()}


def run(optimizer: str, name: str, side: str, steps: int) -> dict[str, Any]:
    spec = {"optimizer": optimizer, "shape": SHAPES[name], "side": side, "steps": steps}
    out = subprocess.run(
        [sys.executable, __file__, "--_worker", json.dumps(spec)], capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{optimizer} {name} {side}: {result}", file=sys.stderr, flush=True)
    return {"optimizer": optimizer, "tensor": name, "side": side, **result}


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| optimizer | tensor | whole (op): added GiB | chunks: added GiB | whole: s / update | chunks: s / update "
        "| chunks / whole time |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by = {(r["optimizer"], r["tensor"], r["side"]): r for r in rows}
    for optimizer in OPTIMIZERS:
        for name in SHAPES:
            w, c = by.get((optimizer, name, "whole")), by.get((optimizer, name, "chunks"))
            if not (w and c):
                continue
            ws, cs = statistics.median(w["seconds"]), statistics.median(c["seconds"])
            lines.append(
                f"| `{optimizer}` | `{name}` | {w['added_bytes'] / GIB:.3f} | {c['added_bytes'] / GIB:.3f} "
                f"| {ws:.3f} | {cs:.3f} | {cs / ws:.2f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed updates per process (default: 5)")
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=list(OPTIMIZERS))
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._worker:
        print(json.dumps(worker(json.loads(args._worker))))
        return 0
    rows = [
        run(optimizer, name, side, args.steps)
        for optimizer in args.optimizers
        for name in SHAPES
        for side in ("whole", "chunks")
    ]
    from memfit.memory.hybrids import LOW_BIT_CHUNK_ELEMENTS

    section = "\n".join(
        [
            "## bitsandbytes' optimizer update on CPU: whole tensors against chunks",
            "",
            f"One fresh process per cell: an fp32 parameter of the shape and its gradient, one step to create the "
            f"state, then {args.steps} timed updates. *Added* is the resident memory the timed updates added over "
            "the process's after the first step (`VmHWM`, reset then, minus the RSS then): the update's temporaries "
            f"and what glibc's heap keeps of them. *Chunks*: memfit's, {LOW_BIT_CHUNK_ELEMENTS:,} values each "
            "(`memfit.memory.bnb_cpu.compose_bnb_cpu_updates`); *whole*: bitsandbytes' op on the tensor. Median "
            f"seconds of an update. GiB = 1024**3 bytes. Measured {time.strftime('%Y-%m-%d')}, alone on this "
            "machine (2 CPU cores).",
            "",
            "Reproduce (alone on the machine): `.venv/bin/python bench/bnb_cpu_update.py`",
            "",
            table(rows),
        ]
    )
    if args.out == "-":
        print(section)
    else:
        write_section(Path(args.out), "bnb-cpu-update", section)
        print(f"wrote the bnb-cpu-update section of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
