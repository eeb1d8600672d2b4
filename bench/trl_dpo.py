"""The peer of memfit's DPO rows: TRL's ``DPOTrainer`` as its documentation sets it up, on CPU.

- ``full``: ``AutoModelForCausalLM.from_pretrained(DIR, dtype=bfloat16)`` and ``DPOConfig(
  precompute_ref_log_probs=True)`` (TRL then keeps no second model: its reference log-probabilities are computed
  before training), gradient checkpointing, AdamW (``adamw_torch``), batch 1 pair, ``max_length = seq_len + 1``.
- ``qlora``: the base loaded as ``bench/peft_qlora.py`` loads it (bitsandbytes NF4, double quantization, bf16
  compute), ``prepare_model_for_kbit_training`` and a PEFT ``LoraConfig`` of the row's rank and targets given to
  ``DPOTrainer`` (its reference is the base with the adapters off, TRL's way without a second model).

The pairs are ``tests/assets/preference_pairs.jsonl`` as plain strings (TRL appends EOS to each reply). It prints the
markers :mod:`bench.preference` splits phases on: ``trl: loading``, ``trl: loaded``, ``trl: trainer built`` (the
tokenized pairs and, full, the reference pass), ``trl: step N | loss ...`` and ``trl: failed in PHASE: ...``.

Run by ``bench/preference.py`` as ``python bench/trl_dpo.py SPEC_JSON``.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def _text(value) -> str:
    """A record's field as plain text: a string, or the content of its messages."""
    if isinstance(value, str):
        return value
    return "\n".join(m["content"] for m in value)


def main(spec: dict) -> int:
    """Load, build the trainer and train ``spec["steps"]`` steps; exit 0 when every step ran."""
    t0 = time.monotonic()

    def say(text: str) -> None:
        print(f"trl: {text} ({time.monotonic() - t0:.1f} s)", flush=True)

    phase = "import"
    try:
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import DPOConfig, DPOTrainer

        torch.manual_seed(0)
        phase = "load"
        say("loading")
        peft_config = None
        if spec["mode"] == "qlora":
            from peft import LoraConfig, prepare_model_for_kbit_training
            from transformers import BitsAndBytesConfig

            quantization = BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16,
            )
            model = AutoModelForCausalLM.from_pretrained(
                spec["dir"], quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
            )
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
            peft_config = LoraConfig(
                r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0, target_modules=spec["targets"],
                task_type="CAUSAL_LM",
            )  # fmt: skip
        else:
            model = AutoModelForCausalLM.from_pretrained(spec["dir"], dtype=torch.bfloat16)
        say(f"loaded ({sum(p.numel() for p in model.parameters()):,} parameters)")
        tokenizer = AutoTokenizer.from_pretrained(spec["dir"])
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        lines = [json.loads(line) for line in open(spec["data"]) if line.strip()]
        records = [{k: _text(r[k]) for k in ("prompt", "chosen", "rejected")} for r in lines]
        phase = "building the trainer"
        args = DPOConfig(
            output_dir=tempfile.mkdtemp(prefix="trl-dpo-"),
            per_device_train_batch_size=1,
            max_steps=spec["steps"],
            max_length=spec["seq_len"] + 1,
            learning_rate=1e-6,
            beta=0.1,
            precompute_ref_log_probs=spec["mode"] == "full",
            gradient_checkpointing=True,
            bf16=False,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            dataloader_num_workers=0,
            disable_tqdm=True,  # its bars would run into the marker lines
        )

        class Markers(TrainerCallback):
            def on_step_begin(self, _args, state, _control, **_kwargs):
                nonlocal phase
                phase = f"step {state.global_step + 1}"

            def on_log(self, _args, state, _control, logs=None, **_kwargs):
                if logs and "loss" in logs:
                    say(f"step {state.global_step} | loss {logs['loss']:.4f}")

        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(records),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[Markers()],
        )
        say("trainer built")
        phase = "step 1"
        trainer.train()
        say("done")
        return 0
    except (RuntimeError, MemoryError) as exc:
        say(f"failed in {phase}: {type(exc).__name__}: {str(exc)[:300]}")
        return 3 if isinstance(exc, MemoryError) or "alloc" in str(exc).lower() else 1


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
