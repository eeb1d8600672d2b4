"""What the GPU machine runs memfit with, and whether memfit's CUDA paths work there: the first step of
``bench/gpu_run.sh``.

It records the Python, torch and CUDA versions, the device, where each of memfit's dependencies comes from (the
machine's own packages or the carried folder of ``bench/gpu_pack.py``) and its version, and which library
bitsandbytes loaded (its CUDA build, not the CPU one). Then it runs two training steps of the ``tiny`` model
through memfit's own build (``build_model``, ``build_optimizer``, ``train_step``) for each bitsandbytes optimizer
(their CUDA kernels: 8-bit, paged), for the plain AdamW in backward and for QLoRA (torchao's NF4). torchao's
compiled optimizers are left to the estimate check, which runs one at 1B (compiling takes seconds each).

Each check's outcome (``ok`` with its losses, or the error) goes into ``--out`` (JSON); the exit status is 1 when
memfit, bitsandbytes' CUDA library or any step failed, so ``gpu_run.sh`` reports it, and the later steps run
anyway. ``--device cpu`` runs the same on CPU (the dry run of ``gpu_run.sh``; bitsandbytes then loads its CPU
library and the paged optimizers run unpaged).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import re
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# memfit's dependencies (pyproject.toml) that the GPU path imports, distribution -> module
DEPENDENCIES = {
    "torch": "torch",
    "numpy": "numpy",
    "PyYAML": "yaml",
    "tqdm": "tqdm",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "sentencepiece": "sentencepiece",
    "tiktoken": "tiktoken",
    "matplotlib": "matplotlib",
    "psutil": "psutil",
    "bitsandbytes": "bitsandbytes",
    "torchao": "torchao",
    "pyarrow": "pyarrow",
}
# recorded, not needed there: TensorBoard events (optional), a prepare's fan-out over workers, .zst sources
OPTIONAL = {
    "tensorboard": "tensorboard",
    "transformers": "transformers",
    "datatrove": "datatrove",
    "multiprocess": "multiprocess",
    "zstandard": "zstandard",
}
STEPS = {  # check name -> the run's overrides (the tiny model; bf16 on CUDA)
    "adamw8bit": ["optimizer.name=adamw8bit"],
    "paged_adamw8bit": ["optimizer.name=paged_adamw8bit"],
    "paged_adamw": ["optimizer.name=paged_adamw"],
    "adamw in backward": ["optimizer_in_backward=true", "max_grad_norm=0"],
    "qlora": ["method=qlora", "lora.rank=4"],
}


def _versions() -> dict[str, dict]:
    """Each dependency's version and the folder it is imported from (or ``missing``)."""
    out = {}
    for dist, module in {**DEPENDENCIES, **OPTIONAL}.items():
        spec = importlib.util.find_spec(module)
        if spec is None:
            out[dist] = {"version": None, "from": "missing"}
            continue
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        where = Path(spec.origin or next(iter(spec.submodule_search_locations or []), "")).resolve()
        out[dist] = {
            "version": version,
            "from": str(where.parents[1] if where.name == "__init__.py" else where),
        }
    return out


def _nvidia_smi() -> str | None:
    try:
        result = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,memory.used",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() or result.stderr.strip()


def _bitsandbytes(device: str) -> dict:
    """Which native library bitsandbytes loaded: on CUDA it must be the CUDA build (``CudaBNBNativeLibrary``)."""
    import bitsandbytes as bnb
    from bitsandbytes import cextension

    lib = cextension.lib
    path = getattr(getattr(lib, "_lib", None), "_name", None)
    name = type(lib).__name__
    ok = name == "CudaBNBNativeLibrary" if device == "cuda" else name != "ErrorHandlerMockBNBNativeLibrary"
    return {
        "version": bnb.__version__,
        "backend": cextension.BNB_BACKEND,
        "library": name,
        "path": path,
        "ok": ok,
    }


def _train_steps(overrides: list[str], device: str) -> dict:
    """Two ``train_step`` of the tiny model as ``memfit pretrain`` builds it, on ``device``."""
    import torch

    from memfit.build import build_model, run_model_config
    from memfit.config import load_config
    from memfit.memory.optim import build_optimizer
    from memfit.step import train_step, train_step_options

    dtype = "bf16" if device == "cuda" else "fp32"
    base = [
        "model=tiny",
        "tokenizer.kind=char",
        "seq_len=64",
        "batch_size=2",
        f"dtype={dtype}",
        f"device={device}",
        "optimizer.name=adamw",  # unless a row names another (left out, a run from scratch gets Muon)
    ]
    cfg = load_config(None, [*base, *overrides], needs_weights=False)
    mcfg = run_model_config(cfg)
    model = build_model(cfg, mcfg, torch.device(device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged on CPU runs unpaged, and says so
        optimizer = build_optimizer(model, cfg.optimizer, in_backward=cfg.optimizer_in_backward)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, mcfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1), device=device, generator=g)
    losses = []
    for _ in range(2):
        result = train_step(model, optimizer, [(x[:, :-1], x[:, 1:])], **train_step_options(cfg))
        losses.append(round(result.loss.item(), 4))
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()
    return {"ok": all(loss == loss for loss in losses), "losses": losses}  # NaN != NaN


def _check(results: dict, name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn(*args)
    except Exception as exc:  # one failing check must not hide the others
        error = f"{type(exc).__name__}: {exc}"[:2000]
        results[name] = {"ok": False, "error": error, "traceback": traceback.format_exc()}
    results[name]["seconds"] = round(time.perf_counter() - t0, 2)
    status = "ok" if results[name].get("ok") else "FAILED"
    detail = results[name].get("error") or results[name].get("losses") or results[name].get("library") or ""
    print(f"check {name}: {status} ({results[name]['seconds']} s) {detail}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="the JSON of the checks")
    args = parser.parse_args(argv)
    import torch

    info: dict = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "nvidia_smi": _nvidia_smi(),
        "packages": _versions(),
    }
    if args.device == "cuda" and not torch.cuda.is_available():
        info["error"] = "--device cuda, but torch sees no CUDA device"
    print(
        f"python {info['python']} ({info['executable']}), torch {info['torch']} (CUDA {info['torch_cuda']}), "
        f"device {info['device']}; nvidia-smi: {info['nvidia_smi']}",
        flush=True,
    )
    for dist, entry in info["packages"].items():
        print(f"  {dist:14s} {entry['version'] or '-':14s} {entry['from']}", flush=True)
    missing = [d for d in DEPENDENCIES if info["packages"][d]["from"] == "missing"]
    checks: dict = {}
    _check(checks, "import memfit", lambda: importlib.import_module("memfit.cli") and {"ok": True})
    _check(checks, "bitsandbytes library", _bitsandbytes, args.device)
    if "error" not in info:
        for name, overrides in STEPS.items():
            _check(checks, name, _train_steps, overrides, args.device)
    info["checks"] = checks
    info["missing"] = missing
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=2) + "\n")
    failed = [n for n, c in checks.items() if not c.get("ok")]
    summary = f"missing: {', '.join(missing) or 'none'}; failed: {', '.join(failed) or 'none'}"
    print(re.sub(r"\s+", " ", summary), flush=True)
    return 1 if failed or "error" in info else 0


if __name__ == "__main__":
    raise SystemExit(main())
