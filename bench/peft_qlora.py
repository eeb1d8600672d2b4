"""The peer of memfit's QLoRA rows: transformers + PEFT + bitsandbytes, as their documentation sets QLoRA up.

``AutoModelForCausalLM.from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16), dtype=bfloat16)``,
``prepare_model_for_kbit_training``, ``get_peft_model`` with a ``LoraConfig`` of the row's rank and targets, gradient
checkpointing on, ``torch.optim.AdamW`` over the adapters, ``steps`` steps of one packed 1 x ``seq_len`` batch of
the row's data. It prints the markers :mod:`bench.largest_model` splits phases on (``peft: loading``,
``peft: loaded``, ``peft: step N | loss ...``, ``peft: failed in ...``) and how many weights bitsandbytes
quantized (``peft: quantized ...``): transformers 5 holds a mixture of experts' experts as 3-D parameters, which
bitsandbytes' ``Linear4bit`` replacement does not reach.

Run by ``bench/largest_model.py`` (the ``30b-a3b-peft`` row) as ``python bench/peft_qlora.py SPEC_JSON``.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec: dict) -> int:
    """Load, wrap and train as the module doc says; exit 0 when every step ran."""
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"peft: {text} ({time.monotonic() - t0:.1f} s)", flush=True)

    phase = "import"
    try:
        import torch
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
        from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

        torch.manual_seed(0)
        phase = "load"
        say("loading")
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = AutoModelForCausalLM.from_pretrained(
            spec["dir"], quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
        )
        packed = sum(p.numel() for p in model.parameters() if p.dtype == torch.uint8) * 2
        other = sum(p.numel() for p in model.parameters() if p.dtype != torch.uint8)
        say(f"quantized {packed:,} weights to 4 bits; {other:,} left in {torch.bfloat16}")
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
        config = LoraConfig(
            r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=spec["targets"],
            task_type="CAUSAL_LM",
        )  # fmt: skip
        model = get_peft_model(model, config)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        say(f"loaded, {trainable:,} trainable")
        phase = "the first step"
        tokenizer = AutoTokenizer.from_pretrained(spec["dir"])
        records = json.loads(open(spec["data"]).read())
        text = "\n\n".join(f"{r['instruction']}\n{r.get('context', '')}\n{r['response']}" for r in records)
        ids = tokenizer(text, return_tensors="pt").input_ids[:, : spec["seq_len"]]
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
        model.train()
        for step in range(1, spec["steps"] + 1):
            phase = f"step {step}"
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            say(f"step {step} | loss {loss.item():.4f}")
    except BaseException as exc:  # noqa: BLE001 (the row reports where the peer stopped, whatever stopped it)
        say(f"failed in {phase}: {type(exc).__name__}: {str(exc)[:300]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
