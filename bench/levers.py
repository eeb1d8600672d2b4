"""Speed levers measured and left: what else could put memfit's eager or compiled step ahead of a plain loop on
CPU, each measured side by side.

- **attention**: SDPA's CPU flash kernel (memfit's, and transformers') against the math kernel (a matmul pair and a
  softmax, which keeps the (B, nh, T, T) scores), forward and backward, causal, at the shapes of ``bench/peers.py``'s
  models (4 x 256 tokens) and at 2,048 tokens; GQA heads expanded for the math kernel. Median of ``--rounds``
  rounds, the two kernels alternating.
- **autotune**: memfit's compiled step (``compile=true``, for-loop AdamW, 25.6M at 4 x 256) in two fresh processes
  in lockstep (below), one with Inductor's defaults and one with ``max_autotune`` and its C++ GEMM backend beside
  ATen's: the first step of each (compilation, alone) and the median ratio of their later steps.
- **faults**: minor page faults a step (``ru_minflt``) of memfit's ``train_step`` and of the plain loop
  (:func:`step_profile.plain_side`), each in a fresh process (25.6M, 4 x 256, for-loop AdamW): what the C library
  hands back to the kernel and faults in again.
- **loop**: the training loop around the step. Four processes in lockstep (``bench/lockstep.py``: they take turns
  one step each, each step timed by its process's running time): ``memfit finetune`` and the plain-loop
  script of ``bench/peers.py`` (the "AdamW (for-loop)" row), and each side's bare step in a loop of its own
  (``step_profile``'s sides, for-loop AdamW, one fixed batch). Mean step over the steps after the first 3.

Reproduce (about 8 minutes on 2 CPU cores)::

    .venv/bin/python bench/levers.py

It rewrites the ``levers`` section of ``docs/benchmarks.md`` (``--out -`` prints it); ``--parts`` picks parts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import step_profile
from docs_section import write_section
from lockstep import Stepper, run_lockstep
from peers import (
    Peer,
    cpu_model,
    memfit_stepper,
    peer_stepper,
    prepare_inputs,
    reproduce_command,
)

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("attention", "autotune", "faults", "loop")
ATTENTION_SHAPES = {
    "25.6M, 4 x 256": (4, 8, 4, 256, 64),
    "78.6M, 4 x 256": (4, 12, 4, 256, 64),
    "1 x 2,048": (1, 32, 8, 2048, 64),
}
"""Label -> (B, nh, nkv, T, hd)."""
LOOP_STEPS, LOOP_WARMUP = 20, 3


def _attention_step(kernel, q, k, v, grad) -> None:
    """Causal SDPA forward and backward with one kernel: the flash kernel reads the shared kv heads in place
    (``enable_gqa``), the math kernel gets them expanded to ``nh`` heads.

    Args:
        kernel: a ``torch.nn.attention.SDPBackend``.
        q: (B, nh, T, hd); k, v: (B, nkv, T, hd); grad: (B, nh, T, hd).
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    with sdpa_kernel(kernel):
        if kernel == SDPBackend.FLASH_ATTENTION:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, nh, T, hd)
        else:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, nh, T, hd)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
    out.backward(grad)


def attention(rounds: int) -> str:
    """The attention part's markdown table."""
    import torch
    from torch.nn.attention import SDPBackend

    torch.manual_seed(0)
    lines = [
        "| shape (B x nh/nkv x T x hd) | flash (ms) | math (ms) | math / flash |",
        "|---|---:|---:|---:|",
    ]
    for label, (B, nh, nkv, T, hd) in ATTENTION_SHAPES.items():
        q = torch.randn(B, nh, T, hd, requires_grad=True)
        k = torch.randn(B, nkv, T, hd, requires_grad=True)
        v = torch.randn(B, nkv, T, hd, requires_grad=True)
        grad = torch.randn(B, nh, T, hd)

        kernels = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}
        times: dict[str, list[float]] = {"flash": [], "math": []}
        n = rounds if T <= 256 else max(3, rounds // 3)
        for i in range(n + 2):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                _attention_step(kernel, q, k, v, grad)
                if i >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - start)
        f, m = statistics.median(times["flash"]) * 1e3, statistics.median(times["math"]) * 1e3
        lines.append(f"| {label}: {B} x {nh}/{nkv} x {T} x {hd} | {f:.1f} | {m:.1f} | {m / f:.2f} |")
    return "\n".join(lines)


def autotune(env: dict[str, str], work: Path, steps: int) -> str:
    """The autotune part's markdown table: the two compiled steps in fresh processes, in lockstep (in one process
    the second model's layers would reuse the first one's compiled graphs: TorchDynamo guards on shapes, not on
    Inductor's settings)."""
    kinds = {"default": "compiled", "max_autotune": "compiled_autotune"}
    steppers = {name: bare_stepper(kind, env, work / "autotune", steps) for name, kind in kinds.items()}
    run_lockstep(list(steppers.values()), steps)
    first, later = {}, {}
    for name, s in steppers.items():
        check(name, s, steps)
        first[name] = json.loads(s.ran[3].strip().splitlines()[-1])["first_step_seconds"]
        later[name] = s.later_step_seconds()[1:]  # from the third step
    ratios = [a / b for a, b in zip(later["default"], later["max_autotune"], strict=True)]
    return "\n".join(
        [
            "| Inductor settings | first step (s) | median step (s) |",
            "|---|---:|---:|",
            *(
                f"| {name} | {first[name]:.1f} | {statistics.median(later[name]):.3f} |"
                for name in ("default", "max_autotune")
            ),
            "",
            f"Median of the paired ratios (default / max_autotune step time, steps 3-{steps}): "
            f"{statistics.median(ratios):.3f}.",
        ]
    )


def faults_child(side: str) -> dict:
    """``--_faults SIDE``: median time and minor faults of 8 bare steps after 3, in this (fresh) process."""
    step = bare_step(side)
    for _ in range(3):
        step()
    seconds, faults = [], []
    for _ in range(8):
        before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"seconds": statistics.median(seconds), "faults": statistics.median(faults)}


def faults(env: dict[str, str]) -> str:
    """The faults part's markdown table (a fresh process a side)."""
    lines = [
        "| side | median step (s) | minor faults a step | MiB faulted in a step |",
        "|---|---:|---:|---:|",
    ]
    for side in ("memfit", "plain"):
        done = subprocess.run(
            [sys.executable, __file__, "--_faults", side], env=env, capture_output=True, text=True, check=True
        )
        r = json.loads(done.stdout.strip().splitlines()[-1])
        mib = r["faults"] * os.sysconf("SC_PAGE_SIZE") / 1024**2
        lines.append(f"| {side} | {r['seconds']:.3f} | {r['faults']:,.0f} | {mib:.0f} |")
    return "\n".join(lines)


def bare_step(kind: str):
    """One side's bare step on one fixed 25.6M batch (4 x 256), for-loop AdamW: ``memfit`` and ``plain`` are
    ``step_profile``'s sides; ``compiled`` is memfit's with ``compile=true``, ``compiled_autotune`` the same under
    Inductor's ``max_autotune`` with its C++ GEMM backend beside ATen's."""
    import torch
    import torch._inductor.config as inductor

    size = step_profile.SIZES["25.6M"]
    ids = torch.randint(
        0, 2048, (size["batch_size"], size["seq_len"] + 1), generator=torch.Generator().manual_seed(0)
    )
    batch = [(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())]
    if kind == "compiled_autotune":
        inductor.max_autotune, inductor.max_autotune_gemm_backends = True, "CPP,ATEN"
    model, step = step_profile.memfit_side(size, "for_loop", compile=kind.startswith("compiled"))
    if kind == "plain":
        _, step = step_profile.plain_side(model, size, "for_loop")
        del model
    return lambda: step(batch)


def bare_child(kind: str, progress: str, steps: int) -> None:
    """``--_bare KIND PROGRESS STEPS``: :func:`bare_step` in a loop, a line to ``progress`` after each step; prints
    ``{"first_step_seconds": ...}`` at the end."""
    step = bare_step(kind)
    with open(progress, "a") as out:
        for i in range(steps):
            start = time.perf_counter()
            step()
            if i == 0:
                first = time.perf_counter() - start
            out.write("step\n")
            out.flush()
    print(json.dumps({"first_step_seconds": first}))


def bare_stepper(kind: str, env: dict[str, str], runs: Path, steps: int) -> Stepper:
    """A :class:`lockstep.Stepper` of :func:`bare_child`."""
    progress = runs / f"bare_{kind}.txt"
    cmd = [sys.executable, __file__, "--_bare", kind, str(progress), str(steps)]
    return Stepper(cmd, env, runs / f"bare_{kind}", progress, "step")


def check(name: str, s: Stepper, steps: int) -> None:
    """Raise unless the lockstep child ``s`` ran all its steps and exited cleanly."""
    if not s.complete(steps):
        raise RuntimeError(f"{name} failed: see {s.log_dir / 'stderr.txt'}")


def loop(env: dict[str, str], work: Path) -> str:
    """The loop part's markdown table: four processes in lockstep."""
    ns = argparse.Namespace(
        grid={"25.6M": []}, seq_len=256, seed=0, steps=LOOP_STEPS, batch_size=4, lr=1e-3, warmup=LOOP_WARMUP
    )
    data, _ = prepare_inputs(ns, work, env)
    checkpoint = work / "checkpoint_25.6M"
    runs = work / "loop"
    stepper = {
        "memfit finetune": memfit_stepper(
            ns, env, {"optimizer.implementation": "for_loop"}, checkpoint, data, runs / "finetune"
        ),
        "plain-loop script": peer_stepper(ns, env, Peer(), checkpoint, data, runs / "peer"),
        "memfit bare step": bare_stepper("memfit", env, runs, LOOP_STEPS),
        "plain bare step": bare_stepper("plain", env, runs, LOOP_STEPS),
    }
    run_lockstep(list(stepper.values()), LOOP_STEPS)
    mean = {}
    for name, s in stepper.items():
        check(name, s, LOOP_STEPS)
        mean[name] = statistics.mean(s.later_step_seconds()[LOOP_WARMUP - 1 :])
    return "\n".join(
        [
            "| process | mean step (s) |",
            "|---|---:|",
            *(f"| {name} | {seconds:.3f} |" for name, seconds in mean.items()),
            "",
            f"memfit / plain in time: full runs {mean['memfit finetune'] / mean['plain-loop script']:.3f}, bare steps "
            f"{mean['memfit bare step'] / mean['plain bare step']:.3f}. Each loop over its bare step: memfit "
            f"{mean['memfit finetune'] / mean['memfit bare step']:.3f}, plain "
            f"{mean['plain-loop script'] / mean['plain bare step']:.3f} (the two bare steps start from other weights "
            "than the runs, memfit's random initialisation, on one fixed batch).",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument(
        "--rounds",
        type=int,
        default=9,
        help="measured rounds of the attention part, steps of the autotune part",
    )
    parser.add_argument(
        "--workdir", default=None, help="the loop part's data and checkpoint (bench/peers.py's)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    parser.add_argument("--_faults", help=argparse.SUPPRESS)
    parser.add_argument("--_bare", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._faults:
        print(json.dumps(faults_child(args._faults)))
        return 0
    if args._bare:
        bare_child(args._bare[0], args._bare[1], int(args._bare[2]))
        return 0

    import torch

    torch.set_num_threads(2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="memfit_levers_"))
    titles = {
        "attention": "SDPA's flash kernel against the math kernel (forward and backward, causal, fp32)",
        "autotune": "Compiled step: Inductor's defaults against max_autotune with its C++ GEMM backend (25.6M)",
        "faults": "Minor page faults a step (25.6M, 4 x 256, for-loop AdamW)",
        "loop": "The loop around the step, in lockstep (25.6M, 4 x 256, for-loop AdamW)",
    }
    blocks = []
    for part in args.parts:
        started = time.perf_counter()
        body = {
            "attention": lambda: attention(args.rounds),
            "autotune": lambda: autotune(env, work, args.rounds + 3),
            "faults": lambda: faults(env),
            "loop": lambda: loop(env, work),
        }[part]()
        print(f"{part}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        blocks += [f"**{titles[part]}**", "", body, ""]
    command = reproduce_command(sys.argv[1:], "bench/levers.py")
    text = "\n".join(
        [
            "### Levers measured and left",
            "",
            f"Measured on {cpu_model()} ({os.cpu_count()} cores), torch {torch.__version__}, fp32. Details in the "
            "module docstring.",
            "",
            f"Reproduce: `{command}`.",
            "",
            *blocks,
        ]
    ).rstrip()
    print(text)
    if args.out != "-":
        write_section(Path(args.out), "levers", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
