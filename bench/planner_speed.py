"""How long the estimator takes, the old code and the new side by side in the same run (issue 39).

Each measurement runs in a fresh process. ``work`` is ``estimate_run``'s own time (its ``seconds``) with the
optimizer's library (bitsandbytes, torchao) imported before the clock starts, so imports are excluded on both
sides alike; ``wall`` is the whole ``memfit estimate`` command. The two checkouts alternate, so that the load of the
machine (2 shared cores here) falls on both; the ratios are what to compare.

Reproduce::

    .venv/bin/python bench/planner_speed.py --old /path/to/old/checkout --new . [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    ("8B seed config, 1 device", ["--config", "configs/llama3_8b_full_single_device.yaml"]),
    (
        "8B, cuda, bf16 AdamW",
        "model=llama3-8b device=cuda dtype=bf16 batch_size=1 seq_len=2048 optimizer.name=adamw".split(),
    ),
    (
        "8B, cuda, bf16 paged AdamW8bit in_bwd ac=full",
        "model=llama3-8b device=cuda dtype=bf16 optimizer.name=paged_adamw8bit optimizer_in_backward=true "
        "max_grad_norm=0 activation_checkpointing=full batch_size=1 seq_len=2048".split(),
    ),
    (
        "70B x 8 ranks, cuda",
        "world_size=8 model=llama3-70b dtype=bf16 batch_size=1 seq_len=2048 device=cuda optimizer.name=adamw".split(),
    ),
]
"""``memfit estimate`` cases: (name, arguments)."""
PLANS = [
    ("plan budget=24GiB model=llama3.1-8b", ["budget=24GiB", "model=llama3.1-8b"]),
    (
        "plan budget=80GiB 8B full, cuda, seq_len=2048",
        "budget=80GiB model=llama3.1-8b method=full batch_size=1 dtype=bf16 device=cuda seq_len=2048".split(),
    ),
    (
        "plan budget=80GiB 8B full AdamW, cuda, seq_len=max",
        "budget=80GiB model=llama3.1-8b method=full batch_size=1 dtype=bf16 device=cuda seq_len=max "
        "optimizer.name=adamw".split(),
    ),
]
"""``memfit plan`` cases: (name, arguments); timed whole, their tables and choices compared."""
NEW_ONLY_PLANS = [
    (
        "plan budget=80GiB 8B full AdamW x 8 ranks, cuda, seq_len=max (sequence parallelism)",
        "budget=80GiB world_size=8 model=llama3.1-8b method=full batch_size=1 dtype=bf16 device=cuda seq_len=max "
        "optimizer.name=adamw".split(),
    ),
]
"""Plans timed on the new side only (the old code took 29 minutes for this one when issue 39 was filed)."""

PREFLIGHT = """
import sys, time, tempfile
import torch._dynamo  # the run's model build imports it either way (its first meta-device op): not the pre-flight's
from memfit import train as t
spent = {}
def timed(name, fn):
    def run(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
    return run
t.preflight = timed("preflight", t.preflight)
t.check_checkpoint_disk = timed("disk", t.check_checkpoint_disk)
from memfit.cli import main
with tempfile.TemporaryDirectory() as out:
    main(["pretrain", "max_steps=1", f"output_dir={out}", *sys.argv[1:]])
print(spent.get("preflight", 0.0) + spent.get("disk", 0.0))
"""
"""The main job (Tiny Shakespeare pretraining, its embedded default) for one step: the seconds its pre-flight (the
memory check and the checkpoints' disk check) takes, torch._dynamo imported before (whichever of the pre-flight and
the model's build runs first on the meta device imports it, ~0.7 s; the run pays it with or without a pre-flight)."""

WORK = """
import json, sys, contextlib
with contextlib.suppress(ImportError):
    import bitsandbytes  # imports excluded from the work
from memfit.cli import main
import io
out = io.StringIO()
with contextlib.redirect_stdout(out):
    main(["estimate", *sys.argv[1:], "--json"])
print(json.dumps(json.loads(out.getvalue().strip().splitlines()[-1])))
"""


def _work(src: Path, root: Path, argv: list[str]) -> dict:
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", WORK, *argv], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _wall(src: Path, root: Path, argv: list[str], verb: str = "estimate") -> tuple[float, str]:
    """The whole command's seconds in a fresh process, and what it printed on stdout (a plan's table: the answer;
    its progress goes to stderr)."""
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "memfit", verb, *argv, *(["--json"] if verb == "estimate" else [])],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    return time.perf_counter() - t0, out.stdout


def _without_times(text: str) -> str:
    """A plan's table and choice less its timings and its count of estimates, what both sides must agree on."""
    text = re.sub(r" \(\d+ s\)$", "", text, flags=re.M)
    return re.sub(r"\d+ (estimates|estimated) in \d+ s\b", r"_ \1 in _ s", text)


def _gib(answer: dict, key: str) -> str:
    value = answer.get(key)
    return "-" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="checkout of the old code")
    parser.add_argument("--new", default=".", help="checkout of the new code")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    old, new = Path(args.old).resolve(), Path(args.new).resolve()
    print(
        "| estimate | work old s | work new s | ratio | wall old s | wall new s | ratio | peak GiB old / new "
        "| reserved GiB old / new | how (new) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for name, argv in CASES:
        runs: dict[str, list] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for side, root in (("old", old), ("new", new)):
                answer = _work(root / "src", new, argv)
                runs[side].append((answer["seconds"], _wall(root / "src", new, argv)[0], answer))
        w_old = min(r[0] for r in runs["old"])
        w_new = min(r[0] for r in runs["new"])
        c_old = min(r[1] for r in runs["old"])
        c_new = min(r[1] for r in runs["new"])
        a_old, a_new = runs["old"][0][2], runs["new"][0][2]
        how = a_new.get("trace", {})
        what = "composed" if how.get("composed") else f"full ({how.get('why_not_composed')})"
        print(
            f"| {name} | {w_old:.2f} | {w_new:.2f} | {w_new / w_old:.2f}x | {c_old:.2f} | {c_new:.2f} | "
            f"{c_new / c_old:.2f}x | {_gib(a_old, 'peak_memory_gib')} / {_gib(a_new, 'peak_memory_gib')} | "
            f"{_gib(a_old, 'peak_memory_reserved_gib')} / {_gib(a_new, 'peak_memory_reserved_gib')} | {what} |",
            flush=True,
        )
    print()
    print("| plan | wall old s | wall new s | ratio | the same table | the same choice | choice (new) |")
    print("|---|---:|---:|---:|---|---|---|")
    for name, argv in PLANS:
        walls: dict[str, list] = {"old": [], "new": []}
        for _ in range(args.repeats):
            for side, root in (("old", old), ("new", new)):
                walls[side].append(_wall(root / "src", new, argv, "plan"))
        p_old = min(w for w, _ in walls["old"])
        p_new = min(w for w, _ in walls["new"])
        same = _without_times(walls["old"][0][1]) == _without_times(walls["new"][0][1])
        choice = _choice(walls["old"][0][1]) == _choice(walls["new"][0][1])
        print(
            f"| {name} | {p_old:.2f} | {p_new:.2f} | {p_new / p_old:.2f}x | {same} | {choice} "
            f"| {_choice(walls['new'][0][1])} |",
            flush=True,
        )
    for name, argv in NEW_ONLY_PLANS:
        wall, text = min(_wall(new / "src", new, argv, "plan") for _ in range(args.repeats))
        print(f"| {name} | - | {wall:.2f} | - | - | - | {_choice(text)} |", flush=True)
    print()
    env = {"PYTHONPATH": str(new / "src"), "PATH": "/usr/bin:/bin"}
    spent = []
    for _ in range(max(2, args.repeats)):
        out = subprocess.run(
            [sys.executable, "-c", PREFLIGHT], cwd=new, env=env, capture_output=True, text=True, check=True
        )
        spent.append(float(out.stdout.strip().splitlines()[-1]))
    print(
        f"the main job's pre-flight (memory and disk checks): {min(spent):.3f} s (new; fastest of {len(spent)})"
    )
    return 0


def _choice(text: str) -> str:
    """A plan's choice: its best row's switches, and the longest context of a ``seq_len=max`` plan."""
    best = re.search(r"^best: (.*)$", text, flags=re.M)
    longest = re.search(r"^longest context: seq_len ([\d,]+)", text, flags=re.M)
    return (best.group(1) if best else "none") + (f" at seq_len {longest.group(1)}" if longest else "")


if __name__ == "__main__":
    raise SystemExit(main())
