"""Pack the Python packages memfit needs on the lent GPU machine and that machine lacks, into one folder that
travels with the device tool's ``carry`` (``.gpu_carry/``, git-ignored), for ``bench/gpu_run.sh``.

The lent machine (the device tool's KINDS.md, kind ``nvidia-h200``) runs Python 3.12 with torch 2.11 (CUDA 13.0)
and has PyYAML, tqdm, numpy, safetensors, tokenizers, sentencepiece, tiktoken, matplotlib, psutil and pyarrow, but
neither bitsandbytes nor torchao, and nothing can be fetched there. The packages are copied from this
interpreter's installed distributions (the versions ``constraints.txt`` pins), every file checked against the
sha256 its wheel's RECORD gives, and trimmed to what runs there:

- **bitsandbytes**: its Python package, its CPU library and the one CUDA library of the device's CUDA release
  (``libbitsandbytes_cuda130.so``, 3.9 MB of the wheel's 124 MB: the other CUDA, ROCm and XPU builds stay behind).
  bitsandbytes picks the library by ``torch.version.cuda``; the library finds ``libcudart.so.13`` and
  ``libcublas.so.13`` among those torch has loaded.
- **torchao**: its Python package without its C++ extensions (``_C*.so``, CUDA sources): they are built for one
  torch release, torchao runs without them, and memfit uses only its pure-PyTorch parts (the 8-bit / 4-bit
  AdamW, ``CPUOffloadOptimizer``, NF4).

Both are Python source with no compiled bytecode, so the packages of this Python 3.11 run under the device's
3.12. Not carried, because the GPU path does without them: datatrove, multiprocess and loguru (only
``memfit prepare`` over several workers fans out with them; a run's own data of one file is prepared in one
process) and zstandard (only ``.zst`` sources need it).

The folder is importable as it is (``PYTHONPATH=.gpu_carry``: no pip on the device), and ``MANIFEST.json`` in it
lists each package's version and files. The script also sums what the device call sends (the files git tracks or
leaves unignored, ``shared/`` when the checkout has one, and the carried folder) and refuses a tree over
``--cap-mib`` (56 MiB of the tool's 64 MiB limit by default).

Run it in the checkout the session was started in (the device tool sends that one, also from a helper's
worktree)::

    .venv/bin/python bench/gpu_pack.py            # -> .gpu_carry/ (about 10 MiB), then the run of gpu_run.sh
    .venv/bin/python bench/gpu_pack.py --dry-run  # what it would copy, and the sizes
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

MIB = 1024**2
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".gpu_carry"
DEVICE_CUDA = "130"  # torch.version.cuda of the lent machine's torch (2.11.0+cu130), without the dot
TRAVEL_LIMIT_MIB = 64  # the device tool's limit on the working tree that travels
CAP_MIB = 56  # what this script allows, so that a few MiB of new files do not break a call


@dataclass(frozen=True)
class Package:
    """One distribution to carry: its name, and which of its files run on the device machine."""

    name: str
    top_level: str

    def keep(self, relative: str, cuda: str) -> bool:
        """Whether the file ``relative`` (a path in site-packages, as RECORD gives it) travels."""
        if "__pycache__" in relative or relative.endswith(".pyc"):
            return False
        if ".dist-info/" in relative:
            return relative.rsplit("/", 1)[-1] in ("METADATA", "top_level.txt", "LICENSE", "WHEEL")
        if not relative.startswith(f"{self.top_level}/"):
            return False  # console scripts and the like
        if self.name == "bitsandbytes" and Path(relative).suffix == ".so":
            return Path(relative).name in ("libbitsandbytes_cpu.so", f"libbitsandbytes_cuda{cuda}.so")
        if self.name == "torchao":
            return Path(relative).suffix not in (".so", ".cu", ".cpp", ".cuh", ".h")
        return True


PACKAGES = (Package("bitsandbytes", "bitsandbytes"), Package("torchao", "torchao"))


def plan(cuda: str = DEVICE_CUDA) -> dict[str, dict]:
    """What would travel: for each package its version, the files kept (relative path -> (bytes, sha256 from
    RECORD)) and the bytes left behind.

    Args:
        cuda: the device's CUDA release as bitsandbytes names its libraries (``130`` for CUDA 13.0).

    Returns:
        ``{name: {"version", "site", "files": {relative: [bytes, sha256]}, "kept_bytes", "dropped_bytes"}}``.

    Raises:
        SystemExit: a package is not installed here, or not as a wheel with a RECORD.
    """
    out = {}
    for package in PACKAGES:
        try:
            dist = importlib.metadata.distribution(package.name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                f"gpu_pack: {package.name} is not installed in {sys.executable}; install the project's "
                f"constraints (pip install -c constraints.txt -e .) and run again"
            ) from None
        site = Path(dist.locate_file(""))
        record = dist.read_text("RECORD")
        if not record:
            raise SystemExit(f"gpu_pack: {package.name} {dist.version} has no RECORD in {site}: reinstall it")
        files, kept, dropped = {}, 0, 0
        for row in csv.reader(record.splitlines()):
            if not row:
                continue
            relative, digest, size = row[0], row[1], row[2]
            size_bytes = int(size) if size else 0
            if package.keep(relative, cuda):
                files[relative] = [size_bytes, digest]
                kept += size_bytes
            else:
                dropped += size_bytes
        if package.name == "bitsandbytes" and f"bitsandbytes/libbitsandbytes_cuda{cuda}.so" not in files:
            raise SystemExit(
                f"gpu_pack: bitsandbytes {dist.version} ships no libbitsandbytes_cuda{cuda}.so; the device's "
                f"torch needs that CUDA release (--cuda)"
            )
        out[package.name] = {
            "version": dist.version,
            "site": str(site),
            "files": files,
            "kept_bytes": kept,
            "dropped_bytes": dropped,
        }
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def pack(out: Path, cuda: str = DEVICE_CUDA) -> dict:
    """Copy the planned files into ``out`` (emptied first) and write ``out/MANIFEST.json``.

    Returns:
        The manifest: ``{"python_tag", "cuda", "packages": {name: {"version", "files", "bytes"}}, "bytes"}``.

    Raises:
        SystemExit: an installed file differs from its RECORD (a modified install: reinstall it).
    """
    packages = plan(cuda)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest = {"made_by": "bench/gpu_pack.py", "cuda": cuda, "packages": {}, "bytes": 0}
    for name, entry in packages.items():
        site = Path(entry["site"])
        for relative, (_size, digest) in entry["files"].items():
            source, target = site / relative, out / relative
            if digest and _sha256(source) != digest:
                raise SystemExit(f"gpu_pack: {source} differs from {name}'s RECORD: reinstall {name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, target)
        manifest["packages"][name] = {
            "version": entry["version"],
            "files": len(entry["files"]),
            "bytes": entry["kept_bytes"],
        }
        manifest["bytes"] += entry["kept_bytes"]
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def travel_bytes(root: Path, carried: list[Path]) -> int:
    """What a device call sends from the checkout ``root``: the files git tracks or leaves unignored, ``shared/``
    when it is there, and the ``carried`` paths (a folder: every file under it)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    paths = {root / p.decode() for p in listed if p}
    for extra in [root / "shared", *carried]:
        if extra.is_dir():
            paths.update(p for p in extra.rglob("*") if p.is_file() and not p.is_symlink())
        elif extra.is_file():
            paths.add(extra)
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the folder to write (default: .gpu_carry)"
    )
    parser.add_argument(
        "--cuda", default=DEVICE_CUDA, help="the device's CUDA release, bitsandbytes' spelling"
    )
    parser.add_argument("--cap-mib", type=float, default=CAP_MIB, help="refuse a travelling tree over this")
    parser.add_argument("--dry-run", action="store_true", help="print what would be copied; write nothing")
    args = parser.parse_args(argv)
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise SystemExit(
            f"gpu_pack: the libraries carried are Linux x86-64 builds from this machine's installed packages; "
            f"this is {sys.platform} {platform.machine()}"
        )
    if args.dry_run:
        packages = plan(args.cuda)
        for name, entry in packages.items():
            print(
                f"{name} {entry['version']}: {len(entry['files'])} files, {entry['kept_bytes'] / MIB:.1f} MiB "
                f"kept, {entry['dropped_bytes'] / MIB:.1f} MiB left behind"
            )
        carried = sum(e["kept_bytes"] for e in packages.values())
        tree = travel_bytes(ROOT, [])
        print(
            f"carried {carried / MIB:.1f} MiB; with the tree it would send "
            f"{(tree + carried) / MIB:.1f} MiB (cap {args.cap_mib:g} MiB, tool limit {TRAVEL_LIMIT_MIB} MiB)"
        )
        return 0 if (tree + carried) / MIB <= args.cap_mib else 1
    manifest = pack(args.out, args.cuda)
    for name, entry in manifest["packages"].items():
        print(f"{name} {entry['version']}: {entry['files']} files, {entry['bytes'] / MIB:.1f} MiB")
    if args.out.resolve().is_relative_to(ROOT):
        total = travel_bytes(ROOT, [args.out.resolve()])
        print(
            f"wrote {args.out} ({manifest['bytes'] / MIB:.1f} MiB); the device call sends {total / MIB:.1f} MiB "
            f"(cap {args.cap_mib:g} MiB, tool limit {TRAVEL_LIMIT_MIB} MiB)"
        )
        if total / MIB > args.cap_mib:
            print(
                f"gpu_pack: the tree that travels is over {args.cap_mib:g} MiB: ignore or remove large untracked "
                f"files",
                file=sys.stderr,
            )
            return 1
    else:
        print(f"wrote {args.out} ({manifest['bytes'] / MIB:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
