"""The largest models that fit a 24 GiB host: memfit's predicted peak host memory against the measured one, on
this machine (2 CPU cores, 24 GiB of RAM, no swap, no GPU), one fresh process per row.

Rows (``--rows``, default all, run in this order):

- ``3b-full``: **Llama-3.2-3B full fine-tune** (3,212,749,824 parameters, tied embeddings), fp32, batch 1 x 512
  tokens, 3 steps and the final checkpoint, with the switches that ``memfit plan budget=20GiB device=cpu
  checkpoint_dir=DIR method=full batch_size=1 seq_len=512 dtype=fp32 DATA --out plan.yaml`` writes, run as written:
  ``memfit finetune --config plan.yaml`` plus run-length and output overrides only (``max_steps``, ``output_dir``,
  the checkpoint at the end only, no validation, no sample, no loss plot, ``log_every=1``). When no plan fits, the
  row records ``outcome: "no plan fits"`` and the planner's message; ``--force-config KEY=VAL ...`` runs that
  configuration instead (the row's keys plus these, as overrides; ``preflight=false`` among them starts a run the
  pre-flight check would refuse) and the row says it was forced.
- ``8b-qlora``: **Llama-3.1-8B QLoRA**: the bf16 base quantized to NF4 as it loads, LoRA rank 16 (alpha 32) on all
  seven decoder linears, full activation checkpointing and the chunked loss (without them the saved activations
  alone are 8.4 GiB: 17.9 GiB estimated in all), fp32, batch 1 x 512, 2 steps and the final adapter checkpoint.
- ``3b-plain``: **the 3B fine-tune without memfit**: a plain ``transformers`` loop
  (``LlamaForCausalLM.from_pretrained(DIR, dtype=torch.float32)``, ``torch.optim.AdamW`` at its defaults, which on
  CPU is the for-loop update; forward with ``labels``, ``loss.backward()``, ``step()``; 3 steps of 1 x 512 ids of
  the tokenized Dolly sample) under a hard memory cap (``--cap-gib``, 22 by default: a cgroup's limit on resident
  memory, through ``systemd-run --scope -p MemoryMax`` where systemd runs, else a cgroup v1 memory group of its own;
  ``prlimit --as``, which caps the address space, mapped files included, where neither is allowed), so that it
  fails alone instead of taking the machine. Its need is predicted by ``memfit estimate`` of the equivalent
  run (``method=full optimizer.name=adamw optimizer.implementation=for_loop``, no memory switch, fp32, 1 x 512). The
  row records where it failed (the phase and the error, or the signal), or its peak if it finished.
- ``3b-torchtune``: **the same fine-tune with torchtune's lowest-memory single-device recipe**
  (``full_finetune_single_device`` as its ``llama3_2/3B_full_single_device`` config sets it: bitsandbytes'
  ``PagedAdamW8bit`` stepped in backward, activation checkpointing, ``CEWithChunkedOutputLoss``), with ``device:
  cpu``, ``dtype: fp32``, batch 1, the Dolly sample packed into rows of 512 tokens (``alpaca_dataset`` from the
  JSON file; the tokenizer ``tests/assets/tiktoken_2k.model`` through ``llama3_tokenizer``, since the directories
  carry GPT-2's), 2 steps and its final checkpoint, under the same cap. torchtune 0.6.1 imports only with a torchao
  older than memfit's (``torchao.dtypes.nf4tensor``), so it runs from a virtual environment of its own
  (``--torchtune-venv``, default ``WORKDIR/torchtune-venv``), made with pip when missing (torch as memfit's,
  ``torchtune==0.6.1``, ``torchao==0.10.0``, bitsandbytes as memfit's). Not run at ``--scale small`` (the
  tokenizer's special ids need Llama 3's vocabulary).
- ``3b-8bit``: **memfit with torchtune's switches** (:func:`torchtune_switches`: ``paged_adamw8bit`` in backward,
  full checkpointing, the loss in 8 chunks), 3 steps and the final checkpoint, estimated and run as ``3b-full``.

**Weights.** Each model is written once into ``--workdir`` as a Hugging Face directory of *random* weights
(``config.json`` as Meta's, with BOS/EOS the ids of the tokenizer it carries; ``normal(0, 0.02)``, norms ones, one
seeded generator): bf16 safetensors shards of at most 4 GiB with ``model.safetensors.index.json``, each tensor made,
written and dropped in turn (the safetensors header is written first, from the shapes), so the whole model is never
in memory; in a child process, so that this one never imports torch (a child's ``ru_maxrss`` would include its
parent's high-water mark at the fork). A directory is reused when complete (its ``largest_model.json`` written
last, for the same config). The tokenizer is GPT-2's BPE (``tests/assets/gpt2_encoder.json`` and
``gpt2_vocab.bpe``) as a ``tokenizer.json`` (ids < 50,257, inside Llama 3's 128,256).

**Data.** ``tests/assets/dolly_sample.json`` (``data.format=dolly data.template=alpaca``), packed into rows of
exactly 512 tokens (``data.packing=true``), no validation split.

**Measured**, for each row: the predicted peak RSS (``memfit estimate --config plan.yaml OVERRIDES --json``:
``host_peak_rss_gib``); the peak RSS of the whole run (``/usr/bin/time -v``'s "Maximum resident set size"); the
resident set of the process tree sampled every 0.1 s by a thread of this script, and every line of the child's
stdout timestamped as it arrives (``PYTHONUNBUFFERED=1``), which splits the samples into phases: ``setup``
(imports, tokenizer, data, the pre-flight check: to memfit's ``pre-flight:`` line), ``load`` (the weights and the
optimizer: to its banner, ``memfit finetune (...): model ...``), ``first_step`` (to the ``step 1 | loss ...``
line), ``steady_step`` (to the last step's line), ``save`` (the final checkpoint: to ``final validation loss:``);
the peak of a phase is the largest sample inside it (a phase shorter than the interval takes the first sample
after it; a spike shorter than the interval can fall between samples, so the phase peaks may sit below the
measured peak). Load time (``pre-flight:`` to the banner), each step's seconds (between those lines), tokens/s of the
steps after the first (memfit's own ``tokens_per_second_per_gpu`` records), each step's loss (``metrics.jsonl``),
and the bytes of the final checkpoint. The plain loop prints its own markers (``plain: loaded``, ``plain: step N
...``). GiB = 1024**3 bytes.

Reproduce (the machine to itself: tens of minutes per row; the 8B QLoRA load alone quantizes ~7B weights at
~0.19 us each; 21 GiB of disk for the two random directories, 6.0 and 15.0 GiB, written once, and up to 36 GiB
for the 3B checkpoint: fp32 weights and AdamW state)::

    .venv/bin/python bench/largest_model.py                          # every row
    .venv/bin/python bench/largest_model.py --rows 3b-full --force-config optimizer.name=adamw8bit

It writes ``docs/largest_model.json`` (a row run again replaces its entry; the others are kept) and rewrites the
section between the ``largest-model`` markers of ``docs/benchmarks.md`` (``--out -`` only prints it), keeping the
hand-written prose between its ``largest-model-prose`` markers (a placeholder until written).

``--scale small`` runs the same harness, the same code paths, on tiny Llamas (dim 256, 4 layers, 4/2 heads, SwiGLU
768, vocabulary 50,304 to hold GPT-2's ids: 16.0M parameters tied, 28.9M untied; shards of 8 MiB) in about
1.5 minutes; it writes its JSON under ``--workdir`` (``small/largest_model.json``) and prints the section only, so
it never touches ``docs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from docs_section import write_section

from memfit.units import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets"
ROWS = ("3b-full", "8b-qlora", "3b-plain", "3b-torchtune", "3b-8bit")
SECTION = "largest-model"
PROSE_START, PROSE_END = "<!-- largest-model-prose:start -->", "<!-- largest-model-prose:end -->"
"""The hand-written prose inside the section: kept as it is when the script rewrites the section."""
PLACEHOLDER = (
    "*Placeholder, to be written by hand: what each row needed (which switches the plan chose and why, where "
    "the plain loop failed and why, how each prediction compares with its measurement).*"
)
SAMPLE_SECONDS = 0.1
TIME = Path("/usr/bin/time")
EOT = "<|endoftext|>"
EOT_ID = 50256  # GPT-2's <|endoftext|>: BOS and EOS of the tokenizer the directories carry
SEQ_LEN = 512

# meta-llama/Llama-3.2-3B config.json, but BOS/EOS: the carried tokenizer's (Meta's are 128000 / 128001)
LLAMA_3_2_3B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 24, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}  # fmt: skip
# meta-llama/Llama-3.1-8B config.json, BOS/EOS as above
LLAMA_3_1_8B: dict[str, Any] = {
    **LLAMA_3_2_3B, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
    "rope_scaling": {**LLAMA_3_2_3B["rope_scaling"], "factor": 8.0},
}  # fmt: skip
del LLAMA_3_1_8B["head_dim"]  # Meta's 8B config.json has none (4096 / 32 = 128)
# --scale small: the same configs at a tiny size (vocabulary: GPT-2's 50,257 ids rounded up to 64)
SMALL_HF = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 768, "vocab_size": 50304, "head_dim": 64}  # fmt: skip
SMALL_PRESET_ARGS = {"dim": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 768,
                     "vocab_size": 50304}  # fmt: skip

DATA = [
    f"data.path={ASSETS / 'dolly_sample.json'}",
    "data.format=dolly",
    "data.template=alpaca",
    "data.packing=true",
]
"""The training data, as ``memfit plan`` and ``memfit finetune`` take it."""
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SWITCH_KEYS = (
    "method",
    "lora.rank",
    "lora.target_modules",
    "dtype",
    "optimizer.name",
    "optimizer.implementation",
    "optimizer.cpu_offload",
    "optimizer_in_backward",
    "activation_checkpointing",
    "activation_offloading",
    "chunked_cross_entropy",
    "tiled_mlp",
    "compile",
    "gradient_accumulation_steps",
)
"""The keys of a config that the table shows as its switches (where the config sets them)."""


@dataclass(frozen=True)
class ModelSpec:
    """One random Hugging Face directory to make: its ``config.json``, the memfit preset it must read as, and
    the size of its shards."""

    name: str
    hf_config: dict[str, Any]
    preset: str
    preset_args: dict[str, Any]
    shard_bytes: int


def model_spec(key: str, scale: str) -> ModelSpec:
    """The directory of ``key`` (``3b`` or ``8b``) at ``scale`` (``full`` or ``small``)."""
    base, preset = {"3b": (LLAMA_3_2_3B, "llama3.2-3b"), "8b": (LLAMA_3_1_8B, "llama3.1-8b")}[key]
    if scale == "full":
        name = {"3b": "Llama-3.2-3B-random", "8b": "Llama-3.1-8B-random"}[key]
        return ModelSpec(name, base, preset, {}, 4 * GIB)
    return ModelSpec(f"small-{key}-random", {**base, **SMALL_HF}, preset, SMALL_PRESET_ARGS, 8 * MIB)


# ----------------------------------------------------------------------------------------------------------------
# Child: the random Hugging Face directory, tensor by tensor
# ----------------------------------------------------------------------------------------------------------------


def hf_tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a ``LlamaForCausalLM`` checkpoint of ``cfg`` (a ``config.json``), by name and shape."""
    dim, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or dim // heads
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (dim,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, dim)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, dim)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, dim)),
            (p + "self_attn.o_proj.weight", (dim, heads * head_dim)),
            (p + "post_attention_layernorm.weight", (dim,)),
            (p + "mlp.gate_proj.weight", (inter, dim)),
            (p + "mlp.up_proj.weight", (inter, dim)),
            (p + "mlp.down_proj.weight", (dim, inter)),
        ]
    out.append(("model.norm.weight", (dim,)))
    if not cfg.get("tie_word_embeddings"):
        out.append(("lm_head.weight", (vocab, dim)))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def write_random_shards(directory: Path, cfg: dict[str, Any], shard_bytes: int, seed: int) -> int:
    """Write ``cfg``'s weights as bf16 safetensors shards and their index, one tensor in memory at a time (in
    chunks of rows); returns the bytes of the weights.

    Each shard's header (names, dtypes, shapes, offsets) is known from the shapes, so it is written first and the
    tensors are appended in turn: ``normal(0, 0.02)`` from one generator seeded with ``seed``, norms ones.
    """
    import torch

    tensors = hf_tensors(cfg)
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * _numel(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, 1):
        file = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            nbytes = 2 * _numel(shape)
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        with open(directory / file, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for _name, shape in shard:
                if len(shape) == 1:  # RMSNorm weights
                    f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.int16).numpy())
                    continue
                rows = max(1, (1 << 26) // shape[1])  # at most 64M weights (128 MiB of bf16) at a time
                for start in range(0, shape[0], rows):
                    chunk = torch.empty(min(rows, shape[0] - start), shape[1], dtype=torch.float32)
                    chunk.normal_(0.0, 0.02, generator=generator)
                    f.write(chunk.to(torch.bfloat16).view(torch.int16).numpy())
                    del chunk
        total += offset
        print(f"  wrote {directory.name}/{file} ({offset / GIB:.2f} GiB)", file=sys.stderr, flush=True)
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    return total


def write_tokenizer(directory: Path) -> None:
    """GPT-2's byte-level BPE as a Hugging Face ``tokenizer.json`` with its ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = json.loads((ASSETS / "gpt2_encoder.json").read_text())
    merges = [
        tuple(line.split()) for line in (ASSETS / "gpt2_vocab.bpe").read_text().splitlines()[1:] if line
    ]
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT, special=True, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOT, "eos_token": EOT}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_model(spec: dict[str, Any]) -> None:
    """Child: write the directory ``spec["dir"]`` (a new one beside it, renamed into place when complete) and check
    that memfit reads it as the preset: the same architecture and parameter count."""
    from memfit.convert.hf import read_hf_config
    from memfit.models.presets import model_config
    from memfit.tokenizer import load_tokenizer

    final = Path(spec["dir"])
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    tmp.mkdir(parents=True)
    start = time.perf_counter()
    cfg = spec["hf_config"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": EOT_ID, "eos_token_id": EOT_ID}))
    write_tokenizer(tmp)
    weight_bytes = write_random_shards(tmp, cfg, spec["shard_bytes"], spec["seed"])
    read, preset = read_hf_config(tmp), model_config(spec["preset"], **spec["preset_args"])
    fields = ("dim", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
              "tie_word_embeddings", "rope_theta", "rope_scaling")  # fmt: skip
    differ = [f for f in fields if getattr(read, f) != getattr(preset, f)]
    if differ or read.num_params() != preset.num_params():
        raise SystemExit(f"{tmp}/config.json does not read as preset {spec['preset']}: {differ}")
    tokenizer = load_tokenizer(tmp)
    marker = {**spec, "weight_bytes": weight_bytes, "num_params": read.num_params(),
              "tokenizer_ids": tokenizer.vocab_size, "seconds": time.perf_counter() - start}  # fmt: skip
    (tmp / "largest_model.json").write_text(json.dumps(marker, indent=2))
    tmp.rename(final)
    print(json.dumps(marker))


# ----------------------------------------------------------------------------------------------------------------
# Child: the plain transformers + PyTorch loop
# ----------------------------------------------------------------------------------------------------------------


def plain_loop(spec: dict[str, Any]) -> int:
    """Child: fine-tune ``spec["dir"]`` with a plain loop, printing a marker line after each phase; on an error it
    prints ``plain: failed in PHASE: ...`` and returns 3 when the error is a failed allocation, else 1."""

    def mark(text: str) -> None:
        print(f"plain: {text}", flush=True)

    phase = "imports"
    try:
        import torch
        from tokenizers import Tokenizer
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        records = json.loads((ASSETS / "dolly_sample.json").read_text())
        text = "\n\n".join(f"{r['instruction']}\n{r['context']}\n{r['response']}" for r in records)
        ids = Tokenizer.from_file(str(Path(spec["dir"]) / "tokenizer.json")).encode(text).ids
        ids = (ids * (spec["seq_len"] // len(ids) + 1))[: spec["seq_len"]]
        batch = torch.tensor([ids])  # (1, T)
        phase = "load"
        mark("loading")
        t0 = time.perf_counter()
        model = LlamaForCausalLM.from_pretrained(spec["dir"], dtype=torch.float32)
        model.config.use_cache = False
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"])
        mark(
            f"loaded in {time.perf_counter() - t0:.1f} s ({sum(p.numel() for p in model.parameters()):,} params)"
        )
        for step in range(1, spec["steps"] + 1):
            t0 = time.perf_counter()
            phase = f"step {step} forward"
            mark(phase)  # each phase announced: a process the cap kills says nothing after
            loss = model(input_ids=batch, labels=batch).loss
            phase = f"step {step} backward"
            mark(phase)
            loss.backward()
            phase = f"step {step} optimizer step"
            mark(phase)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            mark(f"step {step} | loss {loss.item():.4f} | seconds {time.perf_counter() - t0:.2f}")
        mark("done")
        return 0
    except Exception as exc:  # reported with its phase: what the row records
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        oom = (
            isinstance(exc, MemoryError)
            or getattr(exc, "errno", None) == errno.ENOMEM
            or "allocate" in message.lower()
        )
        mark(f"failed in {phase}: {type(exc).__name__}: {message[:300]}")
        return 3 if oom else 1


# ----------------------------------------------------------------------------------------------------------------
# The parent: one measured process per row (this process never imports torch)
# ----------------------------------------------------------------------------------------------------------------


def _proc_rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from ``/proc/PID/stat``)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            out[int(entry)] = int(stat[stat.rindex(")") + 2 :].split()[1])
    return out


def process_tree(root: int, include_root: bool) -> tuple[int, list[int]]:
    """The resident bytes and the pids of ``root``'s descendants (and of ``root`` itself with ``include_root``)."""
    children: dict[int, list[int]] = {}
    for pid, parent in _parents().items():
        children.setdefault(parent, []).append(pid)
    pids = [root] if include_root else []
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        pids.append(pid)
        stack += children.get(pid, [])
    return sum(_proc_rss(pid) for pid in pids), pids


@dataclass
class Measured:
    """A child process as this script saw it."""

    returncode: int
    lines: list[tuple[float, str]]
    """Each stdout/stderr line with its arrival, seconds after the start."""
    samples: list[tuple[float, int]]
    """(seconds after the start, resident bytes of the process tree)."""
    wall_seconds: float
    max_rss_bytes: int | None
    """``/usr/bin/time -v``'s Maximum resident set size (None without /usr/bin/time)."""
    signal: int | None
    killed_by_guard: bool = False
    command: list[str] = field(default_factory=list)

    def first(self, pattern: str) -> float | None:
        """The arrival of the first line matching ``pattern`` (a regex, from the line's start)."""
        return next((t for t, line in self.lines if re.match(pattern, line)), None)

    def peak(self, start: float, end: float) -> int | None:
        """The largest sample in [start, end]; the first one after ``end`` when none falls inside."""
        inside = [rss for t, rss in self.samples if start <= t <= end]
        if inside:
            return max(inside)
        return next((rss for t, rss in self.samples if t > end), None)


def run_measured(cmd: list[str], log: Path, guard_bytes: int | None, tag: str) -> Measured:
    """Run ``cmd`` under ``/usr/bin/time -v``, sampling its process tree's RSS every 0.1 s in a thread and
    timestamping each output line (also written to ``log`` and echoed to stderr, prefixed ``[tag]``).

    Args:
        cmd: the command.
        log: its output, each line with its time.
        guard_bytes: kill the measured processes (SIGKILL) when their RSS passes this (None: never), so that a run
            that overshoots fails alone rather than the machine's OOM killer choosing.
        tag: the prefix of the echoed lines.
    """
    timed = TIME.exists()
    time_file = log.with_name(log.name + ".time")
    wrapped = [str(TIME), "-v", "-o", str(time_file), *cmd] if timed else list(cmd)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    proc = subprocess.Popen(
        wrapped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env,
        start_new_session=True, cwd=ROOT,
    )  # fmt: skip
    samples: list[tuple[float, int]] = []
    stop, guard_hit = threading.Event(), threading.Event()

    def sample() -> None:
        while not stop.is_set():
            rss, pids = process_tree(proc.pid, include_root=not timed)  # not /usr/bin/time's own few MiB
            samples.append((time.monotonic() - start, rss))
            if guard_bytes is not None and rss > guard_bytes and not guard_hit.is_set():
                guard_hit.set()
                for pid in pids:  # the measured processes (ours), not /usr/bin/time: it reports the kill
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            stop.wait(SAMPLE_SECONDS)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines: list[tuple[float, str]] = []
    try:
        with open(log, "w") as f:
            for line in proc.stdout:
                t = time.monotonic() - start
                lines.append((t, line.rstrip("\n")))
                f.write(f"{t:9.2f}  {line}")
                f.flush()
                print(f"  [{tag} {t:7.1f}s] {line}", end="", file=sys.stderr, flush=True)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: end the child's group (it is ours: start_new_session)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stop.set()
        sampler.join()
    wall = time.monotonic() - start
    max_rss, sig = None, -code if code < 0 else None
    if timed and time_file.exists():
        text = time_file.read_text()
        if m := re.search(r"Maximum resident set size \(kbytes\): (\d+)", text):
            max_rss = int(m.group(1)) * 1024
        if m := re.search(r"Command terminated by signal (\d+)", text):
            sig = int(m.group(1))
        if m := re.search(r"Exit status: (\d+)", text):
            code = int(m.group(1)) if sig is None else 128 + sig
    return Measured(code, lines, samples, wall, max_rss, sig, guard_hit.is_set(), wrapped)


def split_phases(
    run: Measured, order: list[tuple[str, float | None]]
) -> tuple[dict[str, float | None], dict[str, float], str | None]:
    """The peak RSS (GiB) and seconds of each phase, and the phase the process ended in when it did not reach the
    last marker.

    Args:
        run: the measured process.
        order: ``(phase, the arrival of the line that ends it, or None when never seen)``, in order; a phase whose
            end is missing while a later one's is present is merged into the next.
    """
    peaks: dict[str, float | None] = {}
    seconds: dict[str, float] = {}
    start, ended_in = 0.0, None
    for i, (name, end) in enumerate(order):
        if end is None:
            if any(e is not None for _, e in order[i + 1 :]):
                continue
            end, ended_in = run.wall_seconds, name
        peak = run.peak(start, end)
        peaks[name] = None if peak is None else round(peak / GIB, 3)
        seconds[name] = round(end - start, 2)
        start = end
        if ended_in is not None:
            break
    return peaks, seconds, ended_in


def _gib(value: float | int | None) -> float | None:
    return None if value is None else round(value / GIB, 3)


def _memfit() -> list[str]:
    """The ``memfit`` command of this interpreter's environment."""
    script = Path(sys.executable).parent / "memfit"
    return [str(script)] if script.exists() else [sys.executable, "-m", "memfit"]


def _shown(cmd: list[str]) -> str:
    """A command as the docs show it: paths under the repository relative to it."""
    text = shlex.join(cmd)
    return text.replace(str(ROOT) + "/", "").replace(str(Path(sys.executable).parent) + "/", ".venv/bin/")


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _switches(config: dict[str, Any]) -> dict[str, Any]:
    """The switches ``config`` turns on (a plan's YAML lists every switch, the ones left off too)."""
    flat = _dotted(config)
    if flat.get("lora.target_modules") == LORA_TARGETS:
        flat["lora.target_modules"] = "all 7 decoder linears"
    off = (None, False, 0, "none", "0")
    defaults = {"method": "full", "gradient_accumulation_steps": 1}
    return {
        k: flat[k] for k in SWITCH_KEYS if k in flat and flat[k] not in off and defaults.get(k) != flat[k]
    }


def ensure_model(spec: ModelSpec, workdir: Path, seed: int) -> tuple[Path, dict[str, Any]]:
    """The directory of ``spec`` under ``workdir``, written (in a child process) unless complete already."""
    directory = workdir / "models" / spec.name
    wanted = {"dir": str(directory), "hf_config": spec.hf_config, "preset": spec.preset,
              "preset_args": spec.preset_args, "shard_bytes": spec.shard_bytes, "seed": seed}  # fmt: skip
    marker = directory / "largest_model.json"
    if marker.exists():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in wanted} == wanted:
            print(f"reusing {directory} ({done['num_params']:,} parameters)", file=sys.stderr)
            return directory, done
    if directory.exists():
        shutil.rmtree(directory)  # incomplete or another config: ours to replace
    for stale in directory.parent.glob(f".{spec.name}.partial-*"):
        shutil.rmtree(stale)
    need = 2 * sum(_numel(s) for _, s in hf_tensors(spec.hf_config))
    directory.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory.parent).free
    if need > free:
        raise SystemExit(f"{directory}: needs {need / GIB:.1f} GiB of disk, {free / GIB:.1f} GiB free")
    print(f"writing {directory} ({need / GIB:.2f} GiB of random bf16 weights)", file=sys.stderr, flush=True)
    cmd = [sys.executable, __file__, "--_make", json.dumps(wanted)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"writing {directory} failed (exit {proc.returncode})")
    return directory, json.loads(proc.stdout.strip().splitlines()[-1])


def run_overrides(out: Path, steps: int) -> list[str]:
    """The run-length and output overrides of a memfit row: nothing that changes the step's memory."""
    return [
        f"max_steps={steps}", f"output_dir={out}", "checkpoint_every=0", "eval_every=0", "data.val_fraction=0",
        "log_every=1", "sample.max_new_tokens=0", "loss_plot=false", "tensorboard=false",
    ]  # fmt: skip


def estimate(config: list[str], log: Path) -> dict[str, Any]:
    """``memfit estimate CONFIG --json``: its object, the command and its seconds (or the error)."""
    cmd = [*_memfit(), "estimate", *config, "--json"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    log.write_text(proc.stdout + proc.stderr)
    out: dict[str, Any] = {"command": _shown(cmd), "process_seconds": round(time.monotonic() - t0, 1)}
    if proc.returncode != 0:
        return {**out, "error": proc.stderr.strip()[-2000:]}
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = ("host_peak_rss_gib", "peak_memory_gib", "host_gib", "phase", "breakdown", "process_baseline_gib",
            "num_params", "num_trainable_params", "seconds", "phase_peaks_gib", "fixes_mmap_threshold")  # fmt: skip
    return {**out, **{k: found.get(k) for k in keys}, "phase_rss_gib": predicted_phase_rss(found)}


def predicted_phase_rss(found: dict[str, Any]) -> dict[str, float] | None:
    """The predicted peak RSS (GiB) of each phase memfit estimate predicts (load, step, save): the phase's tensors
    plus what the process holds besides them (baseline, runtime, free heap: the whole-run prediction less its
    largest phase's tensors)."""
    phases, rss = found.get("phase_peaks_gib"), found.get("host_peak_rss_gib")
    if not phases or rss is None:
        return None
    besides = rss - max(phases.values())
    return {k: round(v + besides, 3) for k, v in phases.items()}


def predicted_and_measured(predicted: dict[str, Any], run: Measured) -> dict[str, Any]:
    """A row's predicted peaks (``predicted``: :func:`estimate`'s object, its command taken out) beside the measured
    whole-process peak (``/usr/bin/time -v``) and the highest RSS sample, in GiB."""
    return {
        "estimate_command": predicted.pop("command"),
        "predicted_peak_rss_gib": predicted.get("host_peak_rss_gib"),
        "predicted_phase_rss_gib": predicted.get("phase_rss_gib"),
        "measured_peak_rss_gib": _gib(run.max_rss_bytes),
        "sampled_peak_rss_gib": _gib(max((s for _, s in run.samples), default=None)),
    }


def memfit_run(name: str, config: list[str], steps: int, run_dir: Path, guard_bytes: int) -> dict[str, Any]:
    """Estimate, then run ``memfit finetune CONFIG`` with the run overrides, measured; the row's fields."""
    out = run_dir / "output"
    if out.exists():
        shutil.rmtree(out)  # a fresh run (ours: under --workdir)
    overrides = run_overrides(out, steps)
    predicted = estimate([*config, *overrides], run_dir / "estimate.txt")
    cmd = [*_memfit(), "finetune", *config, *overrides]
    run = run_measured(cmd, run_dir / "finetune.log", guard_bytes, name)
    step_times = [run.first(rf"step {n} \| loss ") for n in range(1, steps + 1)]
    loaded = run.first(r"memfit finetune")
    peaks, phase_seconds, ended_in = split_phases(
        run,
        [
            ("setup", run.first(r"pre-flight:")),
            ("load", loaded),
            ("first_step", step_times[0]),
            *([("steady_step", step_times[-1])] if steps > 1 else []),
            ("save", run.first(r"final validation loss")),
        ],
    )
    records = []
    if (out / "metrics.jsonl").exists():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, filter(None, lines)) if r.get("loss") is not None]
    ckpt_line = next((line for _, line in run.lines if line.startswith("checkpoint: ")), None)
    checkpoint = Path(ckpt_line.split(": ", 1)[1]) if ckpt_line else None
    own_rss = next((ln for _, ln in run.lines if ln.startswith("peak_memory_rss: ")), None)
    marks = [loaded, *step_times]
    steady_rates = [r["tokens_per_second_per_gpu"] for r in records[1:]] or [
        r["tokens_per_second_per_gpu"] for r in records
    ]
    if run.returncode == 0 and checkpoint is not None:
        outcome = "ok"
    elif run.killed_by_guard:
        outcome = f"killed by this script's guard ({guard_bytes / GIB:.1f} GiB) during {ended_in}"
    elif run.signal is not None:
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) during {ended_in}"
    else:
        last = next((ln for _, ln in reversed(run.lines) if ln.startswith("memfit")), "")
        outcome = f"failed (exit {run.returncode}) during {ended_in}: {last[:400]}"
    return {
        "command": _shown(cmd),
        **predicted_and_measured(predicted, run),
        "memfit_peak_rss_gib": float(own_rss.split()[1]) if own_rss else None,
        "phase_peaks_gib": peaks,
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load"),
        "step_seconds": [
            round(b - a, 2) for a, b in zip(marks, marks[1:], strict=False) if a is not None and b is not None
        ],
        "tokens_per_second": round(sum(steady_rates) / len(steady_rates), 1) if steady_rates else None,
        "losses": [r["loss"] for r in records],
        "checkpoint_gib": _gib(_tree_bytes(checkpoint)) if checkpoint and checkpoint.exists() else None,
        "checkpoint": str(checkpoint) if checkpoint else None,
        "outcome": outcome,
        "exit_status": run.returncode,
        "wall_seconds": round(run.wall_seconds, 1),
        "estimate": predicted,
        "banner": next((ln for _, ln in run.lines if ln.startswith("memfit finetune")), None),
        "preflight": next((ln for _, ln in run.lines if ln.startswith("pre-flight:")), None),
        "log": str(run_dir / "finetune.log"),
    }


def row_3b_full(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``3b-full``: plan, then run the plan (or the forced configuration)."""
    plan_path = run_dir / "plan.yaml"
    plan_path.unlink(missing_ok=True)
    base = [f"checkpoint_dir={model_dir}", "method=full", "batch_size=1", f"seq_len={SEQ_LEN}", "dtype=fp32"]
    plan_cmd = [
        *_memfit(),
        "plan",
        f"budget={args.budget}",
        "device=cpu",
        *base,
        *DATA,
        "--out",
        str(plan_path),
    ]
    t0 = time.monotonic()
    proc = subprocess.run(plan_cmd, capture_output=True, text=True, cwd=ROOT)
    (run_dir / "plan.txt").write_text(proc.stdout + "\n" + proc.stderr)
    plan = {"command": _shown(plan_cmd), "process_seconds": round(time.monotonic() - t0, 1)}
    if proc.returncode == 0 and plan_path.exists():
        plan["outcome"] = "fits"
        plan["header"] = [ln for ln in plan_path.read_text().splitlines() if ln.startswith("#")]
    else:
        message = proc.stderr.strip().split("memfit: error: ", 1)[-1]
        plan["outcome"] = "no plan fits" if "nothing fits" in message else f"failed (exit {proc.returncode})"
        plan["message"] = message[-3000:]
    row: dict[str, Any] = {"plan": plan, "forced": bool(args.force_config)}
    if args.force_config:
        overrides = [*base, "device=cpu", *DATA, *args.force_config]
        config = [*overrides]
        row["config"] = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in overrides)}
    elif plan["outcome"] == "fits":
        config = ["--config", str(plan_path)]
        row["config"] = yaml.safe_load(plan_path.read_text())
    else:
        return {**row, "outcome": plan["outcome"], "message": plan.get("message")}
    row["switches"] = _switches(row["config"])
    return {**row, **memfit_run("3b-full", config, 3, run_dir, args.guard_bytes)}


def row_8b_qlora(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``8b-qlora``: the QLoRA config written as a YAML file, estimated and run."""
    config = {
        "checkpoint_dir": str(model_dir), "method": "qlora", "dtype": "fp32", "device": "cpu", "batch_size": 1,
        "seq_len": SEQ_LEN, "lora": {"rank": 16, "alpha": 32, "target_modules": LORA_TARGETS},
        # without them the 32 layers' saved activations alone are 8.4 GiB at 512 tokens in fp32 (estimated)
        "activation_checkpointing": "full", "chunked_cross_entropy": 8,
        "data": {"path": str(ASSETS / "dolly_sample.json"), "format": "dolly", "template": "alpaca",
                 "packing": True},
    }  # fmt: skip
    path = run_dir / "qlora.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    row = {"config": config, "switches": _switches(config), "forced": False}
    return {**row, **memfit_run("8b-qlora", ["--config", str(path)], 2, run_dir, args.guard_bytes)}


CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")


@contextlib.contextmanager
def memory_cap(cap_bytes: int, name: str) -> Iterator[tuple[list[str], str]]:
    """The prefix that runs a command under a hard memory cap, and its description, in the first way this machine
    offers:

    1. ``systemd-run --scope`` with ``MemoryMax`` (cgroup v2: resident memory, no swap) where systemd runs;
    2. a cgroup v1 memory cgroup of its own (``memory.limit_in_bytes``: resident memory and page cache, the cache
       reclaimed before the kernel's OOM killer ends a process of the group) where this process may make one,
       removed afterwards;
    3. ``prlimit --as``: the address space, so mapped files and reserved but untouched memory count too, and it
       bites well before the resident memory reaches the cap.

    Raises:
        SystemExit: none of the three is here.
    """
    systemd = ["systemd-run", "--quiet", "--scope", "-p", f"MemoryMax={cap_bytes}", "-p", "MemorySwapMax=0"]
    unified = Path("/sys/fs/cgroup/cgroup.controllers").exists()  # cgroup v2, where MemoryMax applies
    if unified and shutil.which("systemd-run") and Path("/run/systemd/system").is_dir():
        if subprocess.run([*systemd, "true"], capture_output=True, timeout=60).returncode == 0:
            yield (
                [*systemd, "--"],
                f"systemd-run --scope -p MemoryMax={cap_bytes} (cgroup v2: resident memory)",
            )
            return
    group = CGROUP_V1_MEMORY / f"memfit-bench-{name}-{os.getpid()}"
    try:
        group.mkdir()
    except OSError:  # no cgroup v1 memory controller here, or not ours to write
        group = None
    else:
        try:
            (group / "memory.limit_in_bytes").write_text(str(cap_bytes))
        except OSError:
            group.rmdir()
            group = None
    if group is not None:
        try:  # the shell joins the group, then becomes the command
            enter = f'echo $$ > {shlex.quote(str(group / "cgroup.procs"))} && exec "$@"'
            yield ["sh", "-c", enter, "sh"], f"cgroup v1 memory.limit_in_bytes={cap_bytes} (resident memory)"
        finally:
            with contextlib.suppress(OSError):
                group.rmdir()
        return
    if shutil.which("prlimit"):
        yield ["prlimit", f"--as={cap_bytes}", "--"], f"prlimit --as={cap_bytes} (address space)"
        return
    raise SystemExit(f"{name}: no cgroup (v2 through systemd-run, or v1) and no prlimit here for the cap")


def _steady_tokens_per_second(seconds: list[float]) -> float | None:
    """Tokens per second over the steps after the first (each of one 1 x SEQ_LEN batch)."""
    return round(SEQ_LEN * len(seconds[1:]) / sum(seconds[1:]), 1) if seconds[1:] else None


def _capped(
    args: argparse.Namespace, cap_text: str, run: Measured, predicted: dict[str, Any]
) -> dict[str, Any]:
    """The fields of a row run under the cap: the cap, how the process ended and memfit's estimate."""
    return {
        "cap_gib": args.cap_gib,
        "cap_method": cap_text,
        "exit_status": run.returncode,
        "wall_seconds": round(run.wall_seconds, 1),
        "estimate": predicted,
    }


def row_3b_plain(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``3b-plain``: memfit's estimate of the equivalent run, then the plain loop under the cap."""
    config = [
        f"checkpoint_dir={model_dir}", "method=full", "optimizer.name=adamw", "optimizer.implementation=for_loop",
        "optimizer_in_backward=false", "activation_checkpointing=none", "chunked_cross_entropy=0", "tiled_mlp=0",
        "dtype=fp32", "device=cpu", "batch_size=1", f"seq_len={SEQ_LEN}", *DATA,
    ]  # fmt: skip
    predicted = estimate(config, run_dir / "estimate.txt")
    cap_bytes = int(args.cap_gib * GIB)
    spec = {"dir": str(model_dir), "steps": 3, "seq_len": SEQ_LEN, "lr": 2e-5}
    with memory_cap(cap_bytes, "3b-plain") as (prefix, cap_text):
        cmd = [*prefix, sys.executable, __file__, "--_plain", json.dumps(spec)]
        run = run_measured(cmd, run_dir / "plain.log", cap_bytes + GIB, "3b-plain")
    steps = [run.first(rf"plain: step {n} \|") for n in range(1, 4)]
    peaks, phase_seconds, ended_in = split_phases(
        run,
        [
            ("setup", run.first(r"plain: loading")),
            ("load", run.first(r"plain: loaded")),
            ("first_step", steps[0]),
            ("steady_step", steps[-1]),
        ],
    )
    failed = next((ln for _, ln in run.lines if ln.startswith("plain: failed in")), None)
    losses = [
        float(m.group(1)) for _, ln in run.lines if (m := re.search(r"^plain: step \d+ \| loss (\S+)", ln))
    ]
    seconds = [float(m.group(1)) for _, ln in run.lines if (m := re.search(r"\| seconds (\S+)$", ln))]
    if run.returncode == 0:
        outcome = "ok"
    elif failed:
        outcome = failed.removeprefix("plain: ")
    elif run.signal is not None:
        last = next((ln for _, ln in reversed(run.lines) if re.match(r"plain: step \d+ [a-z]", ln)), None)
        where = last.removeprefix("plain: ") if last else ended_in
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) in {where}"
    else:
        outcome = f"failed (exit {run.returncode}) during {ended_in}"
    return {
        "command": _shown(cmd),
        "config": {
            "loop": "LlamaForCausalLM.from_pretrained(dtype=float32), torch.optim.AdamW(lr=2e-5)",
            "batch": f"1 x {SEQ_LEN}",
            "steps": 3,
            "cap": cap_text,
        },  # fmt: skip
        "switches": {
            "optimizer.name": "adamw",
            "optimizer.implementation": "for_loop (torch's default on CPU)",
        },
        "forced": False,
        **predicted_and_measured(predicted, run),
        "phase_peaks_gib": {**peaks, "save": None},
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load") if run.first(r"plain: loaded") is not None else None,
        "step_seconds": seconds,
        "tokens_per_second": _steady_tokens_per_second(seconds),
        "losses": losses,
        "checkpoint_gib": None,
        "outcome": outcome,
        **_capped(args, cap_text, run, predicted),
        "log": str(run_dir / "plain.log"),
    }


TORCHTUNE = ("torchtune==0.6.1", "torchao==0.10.0")
"""What the torchtune row installs beside torch and bitsandbytes at memfit's versions: torchtune 0.6.1 imports
``torchao.dtypes.nf4tensor``, which later torchao releases moved."""


def torchtune_venv(path: Path) -> Path:
    """The ``tune`` command of a virtual environment at ``path`` holding torchtune, made with pip when missing."""
    tune = path / "bin" / "tune"
    if tune.exists():
        return tune
    from importlib.metadata import version

    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pins = [f"torch=={version('torch')}", f"bitsandbytes=={version('bitsandbytes')}", *TORCHTUNE]
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", *pins], check=True)
    return tune


def torchtune_config(model_dir: Path, out: Path, steps: int) -> dict[str, Any]:
    """torchtune's ``llama3_2/3B_full_single_device`` config, on this machine: CPU, fp32, the local directory and
    data, batch 1 x 512 packed, ``steps`` steps; its memory switches as it ships them."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    return {
        "output_dir": str(out),
        "tokenizer": {"_component_": "torchtune.models.llama3.llama3_tokenizer",
                      "path": str(ASSETS / "tiktoken_2k.model"), "max_seq_len": SEQ_LEN},
        "dataset": {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json",
                    "data_files": str(ASSETS / "dolly_sample.json"), "split": "train", "packed": True,
                    "column_map": {"instruction": "instruction", "input": "context", "output": "response"}},
        "seed": 0, "shuffle": False,
        "model": {"_component_": "torchtune.models.llama3_2.llama3_2_3b"},
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer",
                         "checkpoint_dir": str(model_dir),
                         "checkpoint_files": sorted(set(index["weight_map"].values())),
                         "recipe_checkpoint": None, "output_dir": str(out), "model_type": "LLAMA3_2"},
        "resume_from_checkpoint": False, "batch_size": 1, "epochs": 1,
        "optimizer": {"_component_": "bitsandbytes.optim.PagedAdamW8bit", "lr": 2e-5},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "max_steps_per_epoch": steps, "gradient_accumulation_steps": 1, "optimizer_in_bwd": True,
        "clip_grad_norm": None, "compile": False, "device": "cpu", "enable_activation_checkpointing": True,
        "enable_activation_offloading": False, "dtype": "fp32",
        "metric_logger": {"_component_": "torchtune.training.metric_logging.DiskLogger", "log_dir": str(out / "logs")},
        "log_every_n_steps": 1, "log_peak_memory_stats": False,
        "profiler": {"_component_": "torchtune.training.setup_torch_profiler", "enabled": False},
    }  # fmt: skip


def torchtune_switches(model_dir: Path) -> list[str]:
    """memfit's config of torchtune's lowest-memory recipe: 8-bit AdamW (paged on CUDA) in backward, full
    checkpointing, the cross-entropy in 8 chunks as ``CEWithChunkedOutputLoss`` cuts it; fp32, 1 x 512."""
    return [
        f"checkpoint_dir={model_dir}", "method=full", "optimizer.name=paged_adamw8bit", "optimizer_in_backward=true",
        "max_grad_norm=0", "activation_checkpointing=full", "chunked_cross_entropy=8", "tiled_mlp=0", "dtype=fp32",
        "device=cpu", "batch_size=1", f"seq_len={SEQ_LEN}", *DATA,
    ]  # fmt: skip


def row_3b_8bit(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``3b-8bit``: memfit running torchtune's switches (:func:`torchtune_switches`)."""
    config = torchtune_switches(model_dir)
    as_dict = {k: yaml.safe_load(v) for k, v in (o.split("=", 1) for o in config)}
    row = {"config": as_dict, "switches": _switches(as_dict), "forced": False}
    return {**row, **memfit_run("3b-8bit", config, 3, run_dir, args.guard_bytes)}


def row_3b_torchtune(args: argparse.Namespace, model_dir: Path, run_dir: Path) -> dict[str, Any]:
    """``3b-torchtune``: torchtune's lowest-memory single-device recipe under the cap."""
    if args.scale == "small":
        return {
            "outcome": "not run at --scale small",
            "predicted_peak_rss_gib": None,
            "measured_peak_rss_gib": None,
        }
    predicted = estimate(torchtune_switches(model_dir), run_dir / "estimate.txt")
    tune = torchtune_venv(Path(args.torchtune_venv or Path(args.workdir).resolve() / "torchtune-venv"))
    steps = 2
    out = run_dir / "output"
    shutil.rmtree(out, ignore_errors=True)
    config = run_dir / "torchtune.yaml"
    config.write_text(yaml.safe_dump(torchtune_config(model_dir, out, steps), sort_keys=False))
    cap_bytes = int(args.cap_gib * GIB)
    with memory_cap(cap_bytes, "3b-torchtune") as (prefix, cap_text):
        cmd = [*prefix, str(tune), "run", "full_finetune_single_device", "--config", str(config)]
        run = run_measured(cmd, run_dir / "torchtune.log", cap_bytes + GIB, "3b-torchtune")
    # the recipe's lines: the model built from the checkpoint, its tqdm bar ("epoch|step|Loss: ..."), the save
    loaded = run.first(r".*Model is initialized with precision")
    step_ends = [run.first(rf".*\d+\|{n}\|Loss: ") for n in range(1, steps + 1)]
    saved = run.first(r".*Saving final epoch checkpoint")
    peaks, phase_seconds, ended_in = split_phases(
        run, [("load", loaded), ("first_step", step_ends[0]), ("steady_step", step_ends[-1]),
              ("save", run.wall_seconds if saved is not None else None)]
    )  # fmt: skip
    done = [t for t in step_ends if t is not None]
    seconds = [round(b - a, 1) for a, b in zip([loaded or 0.0, *done], done, strict=False)]
    metrics = sorted((out / "logs").glob("*.txt")) if out.exists() else []
    losses = (
        [float(m.group(1)) for m in re.finditer(r"loss:(\S+)", metrics[-1].read_text())] if metrics else []
    )
    errors = [ln for _, ln in run.lines if re.match(r"\w*(Error|Exception)\b", ln)]
    if run.returncode == 0:
        outcome = "ok"
    elif run.signal is not None:
        outcome = f"killed by signal {run.signal} ({signal.Signals(run.signal).name}) during {ended_in}"
    else:
        outcome = f"failed (exit {run.returncode}) during {ended_in}" + (f": {errors[-1]}" if errors else "")
    return {
        "command": _shown(cmd),
        "config": {"recipe": "full_finetune_single_device", "file": str(config), "steps": steps, "cap": cap_text},
        "switches": {"optimizer": "bitsandbytes PagedAdamW8bit (unpaged on CPU)", "optimizer_in_bwd": True,
                     "enable_activation_checkpointing": True, "loss": "CEWithChunkedOutputLoss"},
        "forced": False,
        **predicted_and_measured(predicted, run),
        "phase_peaks_gib": {k: peaks.get(k) for k in ("load", "first_step", "steady_step", "save")},
        "phase_seconds": phase_seconds,
        "load_seconds": phase_seconds.get("load") if loaded is not None else None,
        "step_seconds": seconds,
        "tokens_per_second": _steady_tokens_per_second(seconds),
        "losses": losses,
        "checkpoint_gib": _gib(_tree_bytes(out)) if saved is not None and out.exists() else None,
        "outcome": outcome,
        **_capped(args, cap_text, run, predicted),
        "versions": list(TORCHTUNE),
        "log": str(run_dir / "torchtune.log"),
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The section
# ----------------------------------------------------------------------------------------------------------------


def _cell(value: Any, fmt: str = "{:.2f}") -> str:
    return "—" if value is None else fmt.format(value)


def reproduce_command(args: argparse.Namespace, name: str) -> str:
    """The command that runs row ``name`` as ``args`` ran it (options at their defaults left out)."""
    cmd = [".venv/bin/python", "bench/largest_model.py", "--rows", name]
    if args.scale != "full":
        cmd += ["--scale", args.scale]
    if name == "3b-full" and args.budget != "20GiB":
        cmd += ["--budget", args.budget]
    if name == "3b-full" and args.force_config:
        cmd += ["--force-config", *args.force_config]
    if name in ("3b-plain", "3b-torchtune") and args.cap_gib != 22.0:
        cmd += ["--cap-gib", f"{args.cap_gib:g}"]
    return shlex.join(cmd)


def kept_prose(doc: Path) -> str | None:
    """The prose between the prose markers of ``doc``'s section, to keep when the section is rewritten."""
    text = doc.read_text() if doc.exists() else ""
    if PROSE_START not in text or PROSE_END not in text:
        return None
    prose = text[text.index(PROSE_START) + len(PROSE_START) : text.index(PROSE_END)].strip()
    return prose if prose and prose != PLACEHOLDER else None


def section(rows: list[dict[str, Any]], scale: str, prose: str | None = None) -> str:
    """The markdown section of ``rows`` (the JSON's list), with ``prose`` (default: the placeholder) between the
    prose markers."""
    command = ".venv/bin/python bench/largest_model.py" + (" --scale small" if scale == "small" else "")
    plain = argparse.Namespace(scale=scale, budget="20GiB", force_config=None, cap_gib=22.0)
    default = {r["name"]: reproduce_command(plain, r["name"]) for r in rows}
    special = [
        f"`{r['reproduce']}`" for r in rows if r.get("reproduce", default[r["name"]]) != default[r["name"]]
    ]
    lines = [
        "## The largest model on 24 GiB",
        "",
        "Each row is one fresh process on this machine (2 CPU cores, 24 GiB of RAM, no swap), on a Hugging Face "
        "directory of random bf16 weights with Meta's `config.json` (GPT-2's tokenizer), fp32 compute, batch 1 x "
        "512 tokens of the Dolly sample packed into full rows. *Predicted* is `memfit estimate --json`'s "
        "`host_peak_rss_gib` of the row's config, and *predicted load / step / save* the same per phase (its "
        "`phase_peaks_gib` plus what the process holds besides its tensors); *measured* is the whole process's "
        "peak RSS (`/usr/bin/time -v`); "
        "the phase peaks come from the process's RSS sampled every 0.1 s, split at the lines memfit prints (load: "
        "to its banner, the set-up included; first step; the steady steps; save: the final checkpoint). Step "
        "seconds are between step lines; tok/s is memfit's own over the steps after the first. GiB = 1024**3 "
        "bytes." + (" **Scale small: tiny stand-in models, not the real rows.**" if scale == "small" else ""),
        "",
        f"Reproduce: `{command}` (every row, each in a fresh process; `--rows NAME` runs one and keeps the "
        "others' results)" + (f"; as run here: {', '.join(special)}" if special else ""),
        "",
        "| row | config | predicted (GiB) | measured (GiB) | load / first step / steady / save peak (GiB) "
        "| predicted load / step / save (GiB) | load (s) | step (s) | tok/s | checkpoint (GiB) | outcome |",
        "|---|---|---:|---:|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        p = r.get("phase_peaks_gib") or {}
        load = max((v for k, v in p.items() if k in ("setup", "load") and v is not None), default=None)
        phases = " / ".join(
            _cell(v) for v in (load, p.get("first_step"), p.get("steady_step"), p.get("save"))
        )
        q = r.get("predicted_phase_rss_gib") or {}
        predicted_phases = " / ".join(_cell(q.get(k)) for k in ("load", "step", "save")) if q else "—"
        switches = ", ".join(f"`{k}={v}`" for k, v in (r.get("switches") or {}).items()) or "—"
        if r.get("forced"):
            switches += " (forced)"
        steps = ", ".join(f"{s:.1f}" for s in r.get("step_seconds") or []) or "—"
        outcome = str(r.get("outcome", "")).replace("|", "/")[:200]
        lines.append(
            f"| {r['name']} | {switches} | {_cell(r.get('predicted_peak_rss_gib'))} "
            f"| {_cell(r.get('measured_peak_rss_gib'))} | {phases} | {predicted_phases} "
            f"| {_cell(r.get('load_seconds'), '{:.1f}')} "
            f"| {steps} | {_cell(r.get('tokens_per_second'), '{:,.1f}')} | {_cell(r.get('checkpoint_gib'))} "
            f"| {outcome} |"
        )
    for r in rows:
        if r.get("plan", {}).get("outcome") == "no plan fits":
            lines += ["", f"`{r['name']}`: the planner's message: {r['plan']['message'].strip()}"]
    lines += [
        "",
        PROSE_START,
        prose or PLACEHOLDER,
        PROSE_END,
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rows",
        nargs="*",
        choices=ROWS,
        default=list(ROWS),
        help="rows to run (default: all; none: rewrite the section from the JSON's results)",
    )
    parser.add_argument(
        "--scale", choices=("full", "small"), default="full", help="small: tiny stand-in models"
    )
    parser.add_argument("--workdir", default=str(ROOT / "out" / "largest_model"), help="models and runs")
    parser.add_argument("--budget", default="20GiB", help="memfit plan's budget for 3b-full (default: 20GiB)")
    parser.add_argument(
        "--cap-gib", type=float, default=22.0, help="the plain loop's memory cap (default: 22)"
    )
    parser.add_argument(
        "--guard-gib", type=float, default=23.0, help="kill a memfit row whose RSS passes this (default: 23)"
    )
    parser.add_argument(
        "--torchtune-venv",
        help="3b-torchtune: a virtual environment with torchtune (default: WORKDIR/torchtune-venv)",
    )
    parser.add_argument("--force-config", nargs="+", metavar="KEY=VAL", help="3b-full: run these keys anyway")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    parser.add_argument(
        "--json", help="the results (default: docs/largest_model.json; small: under --workdir)"
    )
    parser.add_argument(
        "--out", help="the markdown to rewrite (default: docs/benchmarks.md; small: '-', print)"
    )
    parser.add_argument("--_make", help=argparse.SUPPRESS)
    parser.add_argument("--_plain", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._make:
        make_model(json.loads(args._make))
        return 0
    if args._plain:
        return plain_loop(json.loads(args._plain))

    workdir = Path(args.workdir).resolve()
    small = args.scale == "small"
    default_json = workdir / "small" / "largest_model.json" if small else ROOT / "docs" / "largest_model.json"
    json_path = Path(args.json or default_json)
    out = args.out or ("-" if small else str(ROOT / "docs" / "benchmarks.md"))
    args.guard_bytes = int(args.guard_gib * GIB)
    runs = workdir / ("small" if small else "full")
    rows = [r for r in ROWS if r in args.rows]
    started = time.monotonic()
    results = json.loads(json_path.read_text()) if json_path.exists() else []
    for name in rows:
        model_dir, made = ensure_model(model_spec(name[:2], args.scale), workdir, args.seed)
        run_dir = runs / name
        run_dir.mkdir(parents=True, exist_ok=True)
        print(f"--- {name} ({made['num_params']:,} parameters)", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        run_row = {
            "3b-full": row_3b_full, "8b-qlora": row_8b_qlora, "3b-plain": row_3b_plain,
            "3b-torchtune": row_3b_torchtune, "3b-8bit": row_3b_8bit,
        }[name]  # fmt: skip
        row = run_row(args, model_dir, run_dir)
        row = {
            "name": name,
            "reproduce": reproduce_command(args, name),
            "scale": args.scale,
            "model": str(model_dir),
            "num_params": made["num_params"],
            "weights_gib": _gib(made["weight_bytes"]),
            **row,
            "row_seconds": round(time.monotonic() - t0, 1),
            "date": time.strftime("%Y-%m-%d"),
        }
        results = [r for r in results if r.get("name") != name] + [row]
        results.sort(key=lambda r: ROWS.index(r["name"]) if r.get("name") in ROWS else len(ROWS))
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=2) + "\n")  # after each row: a crash keeps the others
        print(f"--- {name}: {row.get('outcome')} ({row['row_seconds']} s)", file=sys.stderr, flush=True)
    text = section(results, args.scale, None if out == "-" else kept_prose(Path(out)))
    print(text)
    if out != "-":
        write_section(Path(out), SECTION, text)
    print(f"results: {json_path} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
