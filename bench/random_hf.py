"""Random Hugging Face directories for the largest-model bench: the real ``config.json`` of a model, weights drawn
at random and written tensor by tensor as bf16 safetensors shards, GPT-2's tokenizer.

Run as a child (``python bench/random_hf.py --_make SPEC``) by :func:`ensure_model`, so that the parent never imports
torch: a child's ``ru_maxrss`` would include its parent's high-water mark at the fork.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.units import GIB, MIB

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets"
EOT = "<|endoftext|>"
EOT_ID = 50256  # GPT-2's <|endoftext|>: BOS and EOS of the tokenizer the directories carry

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
# Qwen/Qwen3-8B config.json, BOS/EOS as above (Qwen's are 151643 / 151645): q/k RMSNorm per head, an untied
# 151,936-id vocabulary
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
# Qwen/Qwen3-30B-A3B config.json, BOS/EOS as above: Qwen3's attention, 128 experts of 768 in each of 48 layers,
# 8 a token; stored one tensor per expert (mlp.experts.<e>.gate_proj.weight ...), as on the Hub
QWEN3_30B_A3B: dict[str, Any] = {
    **QWEN3_8B, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_hidden_layers": 48,
    "num_key_value_heads": 4, "max_window_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}  # fmt: skip
# allenai/OLMoE-1B-7B-0924 config.json, BOS/EOS as above: q/k norms over the whole projections, 64 experts of
# 1,024 in each of 16 layers, 8 a token
OLMOE_1B_7B: dict[str, Any] = {
    "architectures": ["OlmoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
    "bos_token_id": EOT_ID, "eos_token_id": EOT_ID, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 1024, "max_position_embeddings": 4096, "model_type": "olmoe",
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "num_hidden_layers": 16, "num_key_value_heads": 16, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": None, "rope_theta": 10000.0, "router_aux_loss_coef": 0.01, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 50304,
}  # fmt: skip
# --scale small: the same configs at a tiny size (vocabulary: GPT-2's 50,257 ids rounded up to 64)
SMALL_HF = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 768, "vocab_size": 50304, "head_dim": 64}  # fmt: skip
SMALL_PRESET_ARGS = {"dim": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 768,
                     "vocab_size": 50304, "head_dim": 64}  # fmt: skip
MODELS: dict[str, tuple[dict[str, Any], str, str]] = {
    "3b": (LLAMA_3_2_3B, "llama3.2-3b", "Llama-3.2-3B-random"),
    "8b": (LLAMA_3_1_8B, "llama3.1-8b", "Llama-3.1-8B-random"),
    "qwen3-8b": (QWEN3_8B, "qwen3-8b", "Qwen3-8B-random"),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, "qwen3-30b-a3b", "Qwen3-30B-A3B-random"),
    "olmoe-1b-7b": (OLMOE_1B_7B, "olmoe-1b-7b", "OLMoE-1B-7B-random"),
}
"""Key -> (``config.json``, the memfit preset it reads as, the directory's name at full scale)."""


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
    """The directory of ``key`` (a key of :data:`MODELS`) at ``scale`` (``full`` or ``small``)."""
    base, preset, name = MODELS[key]
    if scale == "full":
        return ModelSpec(name, base, preset, {}, 4 * GIB)
    hf, args = {**base, **SMALL_HF}, dict(SMALL_PRESET_ARGS)
    if "num_experts" in base:  # 8 experts, 2 a token (of 128 wide where the config has its own size)
        moe = {"num_experts": 8, "num_experts_per_tok": 2}
        sized = {"moe_intermediate_size": 128} if "moe_intermediate_size" in base else {}
        hf, args = {**hf, **moe, **sized}, {**args, **moe, **sized}
        if base["model_type"] == "olmoe":
            del hf["head_dim"]  # OLMoE's config.json has none (256 / 4 = 64)
    return ModelSpec(f"small-{key}-random", hf, preset, args, 8 * MIB)


# ----------------------------------------------------------------------------------------------------------------
# Child: the random Hugging Face directory, tensor by tensor
# ----------------------------------------------------------------------------------------------------------------


def hf_tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors of a ``LlamaForCausalLM``, ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` or ``OlmoeForCausalLM``
    checkpoint of ``cfg`` (a ``config.json``), by name and shape; a mixture of experts one tensor per expert, as on
    the Hub."""
    dim, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or dim // heads
    kind = cfg["model_type"]
    norms = {"qwen3": (head_dim, head_dim), "qwen3_moe": (head_dim, head_dim),
             "olmoe": (heads * head_dim, kv_heads * head_dim)}.get(kind)  # fmt: skip
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, dim))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (dim,)),
            (p + "self_attn.q_proj.weight", (heads * head_dim, dim)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, dim)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, dim)),
            (p + "self_attn.o_proj.weight", (dim, heads * head_dim)),
            *(
                [(p + "self_attn.q_norm.weight", (norms[0],)), (p + "self_attn.k_norm.weight", (norms[1],))]
                if norms
                else []
            ),
            (p + "post_attention_layernorm.weight", (dim,)),
        ]
        if "num_experts" in cfg:
            experts, size = cfg["num_experts"], cfg.get("moe_intermediate_size", inter)
            out.append((p + "mlp.gate.weight", (experts, dim)))
            for e in range(experts):
                out += [
                    (p + f"mlp.experts.{e}.gate_proj.weight", (size, dim)),
                    (p + f"mlp.experts.{e}.up_proj.weight", (size, dim)),
                    (p + f"mlp.experts.{e}.down_proj.weight", (dim, size)),
                ]
            continue
        out += [
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
    fields = ("family", "qk_norm", "dim", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
              "tie_word_embeddings", "rope_theta", "rope_scaling", "num_experts", "num_experts_per_tok",
              "moe_intermediate_size", "norm_topk_prob")  # fmt: skip
    differ = [f for f in fields if getattr(read, f) != getattr(preset, f)]
    if differ or read.num_params() != preset.num_params():
        raise SystemExit(f"{tmp}/config.json does not read as preset {spec['preset']}: {differ}")
    tokenizer = load_tokenizer(tmp)
    marker = {**spec, "weight_bytes": weight_bytes, "num_params": read.num_params(),
              "tokenizer_ids": tokenizer.vocab_size, "seconds": time.perf_counter() - start}  # fmt: skip
    (tmp / "largest_model.json").write_text(json.dumps(marker, indent=2))
    tmp.rename(final)
    print(json.dumps(marker))


def ensure_model(
    spec: ModelSpec, workdir: Path, seed: int, clear_others: bool = False
) -> tuple[Path, dict[str, Any]]:
    """The directory of ``spec`` under ``workdir``, written (in a child process) unless complete already; its disk
    is checked first, and with ``clear_others`` the other models under ``workdir/models`` are removed to make room
    when it would not fit."""
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
    if need > free and clear_others:
        for other in sorted(directory.parent.iterdir()):
            if other.is_dir() and other != directory:
                print(f"removing {other} to make room", file=sys.stderr, flush=True)
                shutil.rmtree(other)
        free = shutil.disk_usage(directory.parent).free
    if need > free:
        raise SystemExit(
            f"{directory}: needs {need / GIB:.1f} GiB of disk, {free / GIB:.1f} GiB free (--clear-models removes the "
            f"other random models first)"
        )
    print(f"writing {directory} ({need / GIB:.2f} GiB of random bf16 weights)", file=sys.stderr, flush=True)
    cmd = [sys.executable, __file__, "--_make", json.dumps(wanted)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"writing {directory} failed (exit {proc.returncode})")
    return directory, json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--_make", required=True, help=argparse.SUPPRESS)
    make_model(json.loads(parser.parse_args()._make))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
