"""Peak host memory of loading pretrained weights: memfit's ``load_pretrained`` against transformers'
``from_pretrained``, as a multiple of the bytes of the loaded weights.

Creates once, in a temporary directory (or ``--workdir``), a Hugging Face checkpoint of a Llama (by default dim
1024, 12 layers, 16 query and 4 key/value heads, SwiGLU 2816, vocab 32,000: 201M parameters, 0.37 GiB in bf16)
with ``save_pretrained``, and the same weights as a Meta ``consolidated.00.pth``. Each case then runs in a fresh
process that imports torch, transformers and memfit, builds a tiny model on the meta device (loading torch's
meta kernels, ~75 MiB once per process, is part of the baseline), resets the resident-memory high-water mark
(``/proc/self/clear_refs``), records the resident memory as its baseline, loads, and reports
``VmHWM - baseline`` (the peak the load added; file pages mapped by the loader count, as the kernel counts them)
and ``VmRSS - baseline`` after the load, against the bytes of the loaded parameters. Every weight is read once
after the load (as a first forward pass would), so weights a loader leaves as lazily mapped file pages count too.

Reproduce (about 1.5 minutes on 2 CPU cores; needs ~2 GiB of RAM and 0.8 GiB of temporary disk)::

    .venv/bin/python bench/load_memory.py

It rewrites the section between the ``loading`` markers of ``docs/benchmarks.md`` (``--out`` elsewhere,
``--out -`` only prints).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import write_section

from memfit.models import nf4 as nf4_format
from memfit.units import GIB

ROOT = Path(__file__).resolve().parents[1]

CASES: dict[str, dict[str, str]] = {
    "memfit load_pretrained (HF, bf16 -> fp32)": {"loader": "memfit", "format": "hf", "dtype": "float32"},
    "memfit load_pretrained (HF, bf16 -> bf16)": {"loader": "memfit", "format": "hf", "dtype": "bfloat16"},
    "memfit load_pretrained (Meta, bf16 -> fp32)": {"loader": "memfit", "format": "meta", "dtype": "float32"},
    "memfit load_pretrained (Meta, bf16 -> bf16)": {
        "loader": "memfit",
        "format": "meta",
        "dtype": "bfloat16",
    },
    "memfit QLoRA load, decoder linears to NF4 (HF, bf16 -> bf16)": {
        "loader": "memfit",
        "format": "hf",
        "dtype": "bfloat16",
        "quantize": "nf4",
    },
    "memfit QLoRA load, decoder linears to NF4 (HF, bf16 -> fp32)": {
        "loader": "memfit",
        "format": "hf",
        "dtype": "float32",
        "quantize": "nf4",
    },
    "transformers from_pretrained (HF, bf16 -> fp32)": {
        "loader": "transformers",
        "format": "hf",
        "dtype": "float32",
    },
    "transformers from_pretrained (HF, bf16 -> bf16)": {
        "loader": "transformers",
        "format": "hf",
        "dtype": "bfloat16",
    },
}


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def run_case(spec: dict[str, str], workdir: Path) -> dict[str, float]:
    """Load once in this (fresh) process and measure; imports come first so they are in the baseline."""
    import gc

    import torch
    import transformers

    import memfit.convert
    from memfit.build import quantize_while_loading
    from memfit.convert.hf import hf_config_to_decoder
    from memfit.models.decoder import build_decoder

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    dtype = getattr(torch, spec["dtype"])
    # Warm-up, part of the baseline: the first model built on the meta device loads torch's meta kernels (~75 MiB
    # of code and tables, once per process), whichever library builds it.
    tiny = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    with torch.device("meta"):
        transformers.LlamaForCausalLM(tiny)
    build_decoder(hf_config_to_decoder(tiny.to_dict())[0], device="meta")
    torch.ones(8).sum()
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    except OSError:
        pass
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    if spec.get("quantize") == "nf4":
        nf4_format.to_nf4(
            torch.ones(64, 64)
        )  # import torchao outside the measured load (part of the baseline)
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")
        baseline = _status_bytes("VmRSS")
        start = time.perf_counter()
    if spec["loader"] == "memfit":
        transform = quantize_while_loading if spec.get("quantize") == "nf4" else None
        model, _, _ = memfit.convert.load_pretrained(
            workdir / spec["format"], dtype=dtype, transform=transform
        )
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(workdir / "hf", dtype=dtype)
    seconds = time.perf_counter() - start
    params = {id(p): p for p in model.parameters()}.values()
    inner = [  # an NF4 weight's codes and scales, a plain weight itself
        getattr(p, name) if nf4_format.is_nf4(p) else p
        for p in params
        for name in (p.__tensor_flatten__()[0] if nf4_format.is_nf4(p) else [None])
    ]
    with (
        torch.no_grad()
    ):  # read every weight once, as a first forward pass would (pages in lazily mapped files)
        for t in inner:
            t.float().sum()
    peak, after = _status_bytes("VmHWM"), _status_bytes("VmRSS")
    weights = sum(t.untyped_storage().nbytes() for t in inner)
    assert {p.dtype for p in params} == {dtype}
    return {"seconds": seconds, "peak": peak - baseline, "after": after - baseline, "weights": weights}


def make_checkpoints(workdir: Path, dim: int, layers: int, vocab: int) -> int:
    """Write ``workdir/hf`` (save_pretrained, bf16) and ``workdir/meta`` (consolidated.00.pth); return bytes."""
    import torch
    import transformers

    from memfit.convert.meta import hf_to_meta_rows

    heads, kv_heads = dim // 64, max(1, dim // 256)
    intermediate = 256 * ((int(8 * dim / 3) + 255) // 256)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=dim,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(workdir / "hf")

    meta_names = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                  "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                  "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                  "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
                  "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "model.embed_tokens.weight":
            state["tok_embeddings.weight"] = tensor
        elif name == "model.norm.weight":
            state["norm.weight"] = tensor
        elif name == "lm_head.weight":
            state["output.weight"] = tensor
        else:
            _, _, i, rest = name.split(".", 3)  # model.layers.{i}.{module}.weight
            module = rest.rsplit(".", 1)[0]
            meta = f"layers.{i}.{meta_names[module]}.weight"
            if module == "self_attn.q_proj":
                tensor = hf_to_meta_rows(tensor, heads)
            elif module == "self_attn.k_proj":
                tensor = hf_to_meta_rows(tensor, kv_heads)
            state[meta] = tensor
    (workdir / "meta").mkdir()
    torch.save(state, workdir / "meta" / "consolidated.00.pth")
    params = {"dim": dim, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv_heads, "vocab_size": vocab,
              "multiple_of": 256, "norm_eps": 1e-6, "rope_theta": 500000.0}  # fmt: skip
    (workdir / "meta" / "params.json").write_text(json.dumps(params))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", help="where the checkpoints are made (default: a temporary directory)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"), help="'-' prints only")
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._child:
        print(json.dumps(run_case(json.loads(args._child), Path(args.workdir))))
        return 0

    with tempfile.TemporaryDirectory(prefix="memfit-load-") as tmp:
        workdir = Path(args.workdir or tmp)
        if not (workdir / "hf").is_dir():
            make_checkpoints(workdir, args.dim, args.layers, args.vocab)
        from memfit.convert import read_config

        config, _ = read_config(workdir / "hf")
        rows = []
        for name, spec in CASES.items():
            cmd = [sys.executable, __file__, "--workdir", str(workdir), "--_child", json.dumps(spec)]
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
            )
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"case {name!r} failed")
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append((name, result))
            print(f"{name}: {json.dumps(result)}", file=sys.stderr)
        file_bytes = sum(p.stat().st_size for p in (workdir / "hf").glob("*.safetensors"))

    lines = [
        "## Loading pretrained weights",
        "",
        f"A Hugging Face checkpoint written by `save_pretrained` in bf16 ({file_bytes / GIB:.2f} GiB of safetensors; "
        f"Llama with dim {config.dim}, {config.num_layers} layers, {config.num_heads}/{config.num_kv_heads} heads, "
        f"vocab {config.vocab_size:,}, {config.num_params() / 1e6:.0f}M parameters), and the same weights as a "
        "Meta `consolidated.00.pth`. One fresh process per row; the baseline is the "
        "resident memory after importing torch, transformers and memfit and building a tiny model on the meta device "
        "(which loads torch's meta kernels, ~75 MiB, once per process). After the load every weight is read once "
        "(as a first forward pass would: transformers may leave weights as lazily mapped file pages). *Peak* is the "
        "high-water mark of resident memory over the load and that read, minus the baseline (file pages a loader "
        "maps count, as the kernel counts them); *after* is the resident memory at the end; GiB = 1024**3 bytes. "
        "Load time excludes the read.",
        "",
        "Reproduce: `.venv/bin/python bench/load_memory.py`",
        "",
        "| loader (source, stored -> loaded dtype) | weights (GiB) | peak (GiB) | peak / weights | after (GiB) | "
        "load time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(
            f"| {name} | {r['weights'] / GIB:.2f} | {r['peak'] / GIB:.2f} | {r['peak'] / r['weights']:.2f} | "
            f"{r['after'] / GIB:.2f} | {r['seconds']:.1f} |"
        )
    lines += [
        "",
        "memfit reads each tensor into memory it owns (safetensors' `pread` backend; Meta shards are memory-mapped "
        "and each tensor's pages handed back to the kernel once copied) and converts it before reading the next, so "
        "the peak is the weights plus about one tensor. A QLoRA load quantizes each decoder linear to NF4 as it is "
        "read (`memfit.build.quantize_while_loading`), so the full-precision model never exists: its peak is the "
        "4-bit model plus one tensor's quantization (the tensor as read, its converted copy and torchao's "
        "temporaries of the same size). transformers converting bf16 to fp32 peaks higher; loading in "
        "the stored dtype it keeps the parameters as views of the memory-mapped file (counted above as file pages; "
        "the first in-place update copies a page into private memory).",
    ]
    section = "\n".join(lines) + "\n"
    print(section)
    if args.out != "-":
        write_section(Path(args.out), "loading", section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
