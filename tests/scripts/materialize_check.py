"""Run under ``torchrun --nproc_per_node 2`` by tests/test_distributed.py: a sharded run's weights, built on meta and
filled shard by shard, equal what one process builds, and no rank holds more than one whole tensor at a time.

argv: checkpoint_dir (a Hugging Face checkpoint) -- the LoRA case starts from it; the pretraining case draws.
Exits non-zero (an AssertionError) on any difference.
"""

from __future__ import annotations

import gc
import sys
import weakref

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from memfit import distributed as dist_
from memfit.build import build_model, initial_parameters
from memfit.config import load_config
from memfit.convert import read_config
from memfit.models.presets import model_config


def watched(tensors, released: list[bool]):
    """Yield ``tensors``, recording before each next one whether the previous one is already gone."""
    previous = None
    for name, tensor in tensors:
        if previous is not None:
            gc.collect()
            released.append(previous() is None)
        previous = weakref.ref(tensor)
        yield name, tensor
        del tensor


def check(overrides: list[str], mcfg, device: torch.device) -> None:
    cfg = load_config(None, overrides)
    reference = build_model(cfg, mcfg, device).state_dict()
    model = build_model(cfg, mcfg, torch.device("meta"))
    initial = initial_parameters(cfg, mcfg, model, device)
    sharded = dist_.shard_model(model, cfg, device)
    released: list[bool] = []
    filled = dist_.materialize_sharded(sharded, watched(initial, released), device)
    assert all(released), f"{overrides}: a whole tensor was still held when the next one was read"
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in sharded.parameters())
    total = sum(t.numel() for n, t in reference.items() if not n.endswith("inv_freq"))
    if mcfg.tie_word_embeddings:
        total -= reference["lm_head.weight"].numel()
    assert local < 0.75 * total, f"{overrides}: rank {dist_.rank()} holds {local} of {total} elements"
    gathered = get_model_state_dict(sharded, options=StateDictOptions(full_state_dict=True))
    for name, tensor in reference.items():
        if name.endswith("inv_freq"):
            assert torch.equal(dist_.unwrap(sharded).model.rotary_emb.inv_freq, tensor)
            continue
        assert torch.equal(gathered[name], tensor), f"{overrides}: {name} differs from one process's"
    print(
        f"rank {dist_.rank()}: {' '.join(overrides)}: {filled} parameters equal, {local}/{total} elements held"
    )


def main() -> None:
    device = dist_.init_distributed(torch.device("cpu"))
    hf = sys.argv[1]
    for strategy in ("fsdp2", "fsdp1"):
        for preset in ("tiny", "tiny-tied"):
            overrides = [f"model={preset}", f"distributed.strategy={strategy}", "tokenizer.kind=char"]
            check(overrides, model_config(preset, vocab_size=300), device)
        lora = [f"checkpoint_dir={hf}", "method=lora", "lora.target_modules=[q_proj,v_proj,lm_head]"]
        check([f"distributed.strategy={strategy}", *lora], read_config(hf)[0], device)
    dist_.destroy_distributed()


if __name__ == "__main__":
    main()
