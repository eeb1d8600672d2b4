"""The GPU check for the lent machine, tested on CPU: bench/gpu_pack.py's carried folder, bench/gpu_run.sh's dry
run (every step on CPU with the tiny model, the carried packages imported from that folder), its step time limits,
and the device tool call its header gives."""

from __future__ import annotations

import gzip
import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024**2
EXPECTED_OUT = {
    "run.log",
    "env.json",
    "metrics.jsonl",
    "memory_timeline.png",
    "loss.png",
    "gpu_estimate.json.gz",
    "gpu_seed_table.md",
}


def _run_script(
    out: Path, carry: Path, python: str = sys.executable, **env: str
) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": python, "OUT": str(out), "GPU_RUN_CARRY": str(carry), **env}
    environ.pop("PYTHONPATH", None)  # the script sets its own: the carried folder, src/, the checkout
    return subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_run.sh")], env=environ, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def carry(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pack") / "carry"
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_pack.py"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return out


def test_pack_carries_bitsandbytes_with_one_cuda_library_and_torchao_without_extensions(carry):
    manifest = json.loads((carry / "MANIFEST.json").read_text())
    for name in ("bitsandbytes", "torchao"):
        assert manifest["packages"][name]["version"] == importlib.metadata.version(name)
    files = [p for p in carry.rglob("*") if p.is_file() and p.name != "MANIFEST.json"]
    assert sum(p.stat().st_size for p in files) == manifest["bytes"]
    assert len(files) == sum(e["files"] for e in manifest["packages"].values())
    libraries = sorted(str(p.relative_to(carry)) for p in files if p.suffix == ".so")
    assert libraries == ["bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so"]
    assert not [p for p in files if "__pycache__" in p.parts or p.suffix in (".pyc", ".cu", ".cpp")]
    assert {p.name for p in carry.iterdir()} == {
        "MANIFEST.json",
        "bitsandbytes",
        "torchao",
        f"bitsandbytes-{importlib.metadata.version('bitsandbytes')}.dist-info",
        f"torchao-{importlib.metadata.version('torchao')}.dist-info",
    }
    # 4.3 + 4.8 MiB of the installed 124 + 18.6 MiB (bitsandbytes 0.50.2, torchao 0.18.0)
    assert 6 * MIB < manifest["bytes"] < 12 * MIB


def test_pack_dry_run_sums_what_the_device_call_sends_under_the_cap():
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_pack.py"), "--dry-run"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    sent = float(re.search(r"it would send ([\d.]+) MiB \(cap 56 MiB, tool limit 64 MiB\)", result.stdout)[1])
    assert sent < 56
    refused = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_pack.py"), "--dry-run", "--cap-mib", "1"],
        capture_output=True,
    )
    assert refused.returncode == 1


def test_the_documented_device_call_fits_the_tool():
    header = (ROOT / "bench" / "gpu_run.sh").read_text()
    call = 'run(command="bash bench/gpu_run.sh", carry=[".gpu_carry"], timeout_s=600)'
    assert call in header and call in (ROOT / "docs" / "benchmarks.md").read_text()
    command, carry, timeout_s = re.fullmatch(
        r'run\(command="(.*)", carry=\[(.*)\], timeout_s=(\d+)\)', call
    ).groups()
    assert len(command) <= 2000 and 0 < int(timeout_s) <= 600
    paths = json.loads(f"[{carry}]")
    assert len(paths) <= 8 and all(len(p) <= 200 for p in paths)
    # a carried path must be one git ignores (else it travels anyway, and counts twice)
    assert subprocess.run(["git", "check-ignore", "-q", ".gpu_carry/x"], cwd=ROOT).returncode == 0
    budgets = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A BUDGET=\((.*)\)", header)[1]))
    total = int(re.search(r'TOTAL="\$\{GPU_RUN_SECONDS:-(\d+)\}"', header)[1])
    assert set(budgets) == {"env", "pretrain", "estimate", "seed"}
    assert sum(map(int, budgets.values())) <= total <= 9 * 60 < int(timeout_s)


@pytest.mark.slow
def test_dry_run_runs_every_step_on_cpu_with_the_carried_packages(carry, tmp_path):
    out = tmp_path / "out"
    result = _run_script(out, carry, GPU_RUN_DRY="1", GPU_RUN_SECONDS="1200")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "steps: env: ok; pretrain: ok; estimate: ok; seed: ok;" in result.stdout
    # what comes back: at most 8 files, named as the device tool requires
    assert {p.name for p in out.iterdir()} == EXPECTED_OUT
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) for name in EXPECTED_OUT)

    env = json.loads((out / "env.json").read_text())
    assert env["missing"] == []
    assert [name for name, c in env["checks"].items() if c["ok"]] == [
        "import memfit",
        "bitsandbytes library",
        "adamw8bit",
        "paged_adamw8bit",
        "paged_adamw",
        "adamw in backward",
        "qlora",
    ]
    for name in ("bitsandbytes", "torchao"):  # imported from the carried folder, not this machine's
        assert env["packages"][name]["from"] == str(carry.resolve())
    assert env["checks"]["bitsandbytes library"]["path"].endswith("bitsandbytes/libbitsandbytes_cpu.so")

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [2, 4, 6]
    assert all(set(r["memory_breakdown"]) >= {"parameters", "optimizer_state", "activations"} for r in train)

    measured = json.loads(gzip.decompress((out / "gpu_estimate.json.gz").read_bytes()))
    assert list(measured["results"]) == ["tiny (dry run)", "tiny long context (dry run)"]
    assert not any("error" in r for r in measured["results"].values())
    # measured at the length the planner calls the longest for its budget (seq_len=longest:16MiB)
    longest = measured["results"]["tiny long context (dry run)"]["overrides"]
    assert any(o.startswith("seq_len=") and int(o.split("=")[1]) >= 1024 for o in longest)
    table = (out / "gpu_seed_table.md").read_text()
    assert [
        line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ") and "0.00" in line
    ] == [
        "| adamw8bit",
        "| paged_adamw8bit",
        "| paged_adamw",
    ]
    log = (out / "run.log").read_text()
    assert re.search(r"\[\d\d:\d\d:\d\d \+\d+s\] step seed: start \(limit \d+s\)", log)


@pytest.mark.slow
def test_a_step_that_fails_or_overruns_costs_only_itself(tmp_path):
    # a stand-in python that notes its arguments: the env check hangs, every other step fails at once
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(
        f'#!/bin/sh\necho "$*" >>{calls}\ncase "$*" in *gpu_env_check*) sleep 60 ;; *) exit 3 ;; esac\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    # env's limit: 491 s in all less the later steps' 90 + 270 + 120 s = 11 s; they keep their budgets
    result = _run_script(out, tmp_path / "none", str(fake), GPU_RUN_SECONDS="491")
    assert result.returncode == 1
    assert "step env: start (limit 11s)" in result.stdout
    assert (
        "steps: env: TIMED OUT after 11s; pretrain: FAILED (exit 3); estimate: FAILED (exit 3); "
        "seed: FAILED (exit 3);" in result.stdout
    )
    assert "WARNING: no carried packages" in result.stdout
    # the device's commands (not the dry run's): each script exists, and the run's overrides validate
    env, pretrain, estimate, seed = calls.read_text().splitlines()[:4]
    assert env == f"bench/gpu_env_check.py --device cuda --out {out}/env.json"
    assert estimate == f"bench/gpu_estimate_check.py --measure {out}/gpu_estimate.json.gz"
    assert seed == f"bench/gpu_seed_table.py --out {out}/gpu_seed_table.md"
    assert all((ROOT / line.split()[0]).is_file() for line in (env, estimate, seed))
    verb, *overrides = pretrain.split()[2:]
    assert (
        pretrain.startswith("-m memfit pretrain device=cuda track_memory=true output_dir=")
        and verb == "pretrain"
    )
    from memfit.config import load_config

    cfg = load_config(None, overrides)
    assert (cfg.device, cfg.track_memory, cfg.tensorboard, cfg.model) == ("cuda", True, False, "shakespeare")
    skipped = _run_script(out, tmp_path / "none", str(fake), GPU_RUN_STEPS="env seed", GPU_RUN_SECONDS="125")
    assert "steps: env: skipped; seed: FAILED (exit 3);" in skipped.stdout  # 5 s left for env: not started
