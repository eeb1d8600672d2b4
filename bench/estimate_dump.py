"""The estimator's and the planner's answers as one JSON document, to compare two versions of memfit byte for byte.

A refactor that must not change a prediction (the registry's folds, a faster estimator) is checked by dumping with
the code before and after and comparing the two files. The dump holds, without timings:

- ``memfit estimate --json`` of every row of ``bench/estimate_accuracy.py`` (its configurations, estimated only:
  nothing is trained; the LoRA / adapter / fine-tune rows read Hugging Face checkpoints of random weights written
  once, under ``--work``, so both sides read the same files);
- the seed table's runs: Llama-3-8B (``configs/llama3_8b_full_single_device.yaml``, CUDA) and Llama-3-70B on 8
  ranks;
- plans of Llama-3-8B on CUDA: full fine-tunes in 24 and 80 GiB and a QLoRA one in 24 GiB (``memfit plan --json``,
  without their timings), unless ``--no-plans``.

The estimating process's own resident set (``process_baseline_gib``) depends on what that process did before, so
the dump keeps the predicted host peak over it (``host_peak_rss_over_baseline_gib``) instead.

Reproduce, for two checkouts A and B (each row runs in-process with that checkout's ``src`` on ``PYTHONPATH``)::

    PYTHONPATH=A/src .venv/bin/python bench/estimate_dump.py --work /tmp/dump_work --out /tmp/a.json
    PYTHONPATH=B/src .venv/bin/python bench/estimate_dump.py --work /tmp/dump_work --out /tmp/b.json
    .venv/bin/python bench/estimate_dump.py --compare /tmp/a.json /tmp/b.json

``--compare`` prints each entry that differs (key by key) and exits 1 if any does, 0 when the two are identical.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = {"seconds", "estimate_seconds", "wall_seconds", "elapsed_seconds", "plan_seconds", "trace"}
"""Keys dropped from every answer, at any depth: they measure this machine, not the prediction (``trace`` says how
an estimate was obtained: the layers traced or composed)."""

SEED = [
    (
        "seed: Llama-3-8B full, 1 device",
        ["--config", str(ROOT / "configs" / "llama3_8b_full_single_device.yaml")],
    ),
    (
        "seed: Llama-3-70B x 8",
        "world_size=8 model=llama3-70b dtype=bf16 batch_size=1 seq_len=2048 device=cuda optimizer.name=adamw".split(),
    ),
]
PLANS = [  # on CUDA: a CPU plan's budget depends on the planning process's own resident set
    (
        "plan: llama3.1-8b in 24 GiB",
        "budget=24GiB model=llama3.1-8b batch_size=1 seq_len=2048 device=cuda".split(),
    ),
    (
        "plan: llama3.1-8b qlora in 24 GiB",
        "budget=24GiB model=llama3.1-8b method=qlora batch_size=1 seq_len=2048 dtype=bf16 device=cuda".split(),
    ),
    (
        "plan: llama3-8b in 80 GiB",
        "budget=80GiB model=llama3-8b batch_size=1 seq_len=4096 device=cuda".split(),
    ),
]


def _strip(value):
    if isinstance(value, dict):
        out = {k: _strip(v) for k, v in value.items() if k not in TIMINGS}
        # the estimating process's own resident set when the trace began is a measurement of this process (what
        # it imported and allocated before); the prediction is what the run adds to it
        baseline = out.pop("process_baseline_gib", None)
        if out.get("host_peak_rss_gib") is not None and baseline is not None:
            out["host_peak_rss_over_baseline_gib"] = out.pop("host_peak_rss_gib") - baseline
        return out
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _cli_json(argv: list[str]) -> dict:
    """``memfit <argv> --json``, in this process: its one JSON object, or the error it printed."""
    from memfit.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--json"])
    if code != 0:
        return {"exit": code, "stderr": err.getvalue().strip().splitlines()[-1:]}
    return _strip(json.loads(out.getvalue().strip().splitlines()[-1]))


def accuracy_rows(work: Path) -> list[tuple[str, list[str]]]:
    """``(name, memfit estimate argv)`` of each row of ``bench/estimate_accuracy.py``, its checkpoints in ``work``."""
    sys.path.insert(0, str(ROOT / "bench"))
    import estimate_accuracy as acc

    hf, hf127 = work / "hf", work / "hf127"
    if not (hf / "config.json").is_file():
        acc.make_hf_checkpoint(hf)
    if not (hf127 / "config.json").is_file():
        acc.make_hf127_checkpoint(hf127)
    rows = []
    for i, (label, size, ranks, spec) in enumerate(acc.CONFIGS, 1):
        overrides = acc.overrides_of(size, spec, hf, hf127)
        argv = ["estimate", *acc.ADAMW, *acc.as_list(overrides)]
        if ranks > 1:
            argv.append(f"world_size={ranks}")
        rows.append((f"row {i}: {label} ({size}, {ranks} rank{'s' * (ranks > 1)})", argv))
    return rows


def dump(work: Path, plans: bool) -> dict:
    import memfit

    rows = accuracy_rows(work)
    rows += [(name, ["estimate", *argv]) for name, argv in SEED]
    if plans:
        rows += [(name, ["plan", *argv]) for name, argv in PLANS]
    out: dict = {"memfit": str(Path(memfit.__file__).parent), "answers": {}}
    for name, argv in rows:
        t0 = time.perf_counter()
        out["answers"][name] = {"argv": argv[1:], "answer": _cli_json(argv)}
        print(f"{time.perf_counter() - t0:7.1f} s  {name}", file=sys.stderr, flush=True)
    return out


def _walk(a, b, path: str, diffs: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                diffs.append(f"{path}.{k}: only in {'B' if k not in a else 'A'}")
            else:
                _walk(a[k], b[k], f"{path}.{k}", diffs)
    elif a != b:
        diffs.append(f"{path}: {a!r} -> {b!r}")


def compare(a_path: Path, b_path: Path) -> int:
    a, b = (json.loads(Path(p).read_text(encoding="utf-8"))["answers"] for p in (a_path, b_path))
    diffs: list[str] = []
    _walk(a, b, "", diffs)
    for line in diffs:
        print(line)
    same = sum(1 for k in a if k in b and a[k] == b[k])
    print(f"{same} of {len(a)} answers identical; {len(diffs)} differences")
    return 1 if diffs else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/memfit_estimate_dump", help="folder of the rows' checkpoints")
    parser.add_argument("--out", help="write the dump here (default: stdout)")
    parser.add_argument("--no-plans", action="store_true", help="leave the (slower) plans out")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two dumps instead")
    args = parser.parse_args()
    if args.compare:
        return compare(*map(Path, args.compare))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = json.dumps(dump(work, plans=not args.no_plans), indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
