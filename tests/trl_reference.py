"""Reference numbers from TRL itself, for memfit's preference-tuning (DPO, IPO, SimPO/CPO, ORPO) parity tests.

Not a test module (pytest collects ``test_*.py`` only): helpers that run TRL's own code paths on a tiny checkpoint
and return what TRL computed, so that a test can run memfit on the same data and compare.

- :func:`tiny_chat_checkpoint` writes a tiny Llama, Qwen2 or Qwen3 checkpoint (fp32, seeded) with a byte-level
  BPE tokenizer trained in-process and the family's real chat template from ``tests/assets/chat_templates``.
- :func:`trl_dpo` builds a ``trl.DPOTrainer`` on preference records and runs one training step (forward and
  backward of ``DPOTrainer.compute_loss``, no optimizer step) on the first batch of the trainer's own dataloader,
  so tokenization, collation, the reference model and the loss are all TRL's.
- :func:`trl_cpo` and :func:`trl_orpo` call ``CPOTrainer.get_batch_loss_metrics`` /
  ``ORPOTrainer.get_batch_loss_metrics`` on an already tokenized batch and backpropagate the loss.

Everything runs in float32 on the CPU, deterministically; nothing is downloaded. Each call leaves the caller's
random-number state (torch, NumPy, ``random``) as it found it, although ``transformers.Trainer`` seeds them.

What TRL 1.13 does that a parity test must mirror:

- DPO tokenizes a conversational record as ``apply_chat_template(prompt, add_generation_prompt=True)`` (the
  prompt) and ``apply_chat_template(prompt + chosen)`` (the whole), and the completion is the whole's ids after the
  prompt's: for ChatML ``reply<|im_end|>\\n``, for Llama 3 ``reply<|eot_id|>`` (the completion mask covers the
  end-of-turn and, for ChatML, the newline after it).
- A plain-string record gets ``eos_token`` appended to ``chosen`` and ``rejected`` as text (unless they end with
  it), and ``prompt`` and ``prompt + chosen`` are tokenized as plain text with the tokenizer's special tokens (a
  Llama 3 tokenizer puts BOS first); the completion is again the ids after the prompt's.
- ``DataCollatorForPreference`` stacks ``[chosen rows; rejected rows]``, right-pads with the pad id, and with
  ``max_length`` cuts each ``prompt + completion`` to its first ``max_length`` ids before padding (examples whose
  prompt alone reaches ``max_length`` are dropped from the dataset).
- DPO's ``logps`` are sums over completion tokens; IPO divides by the completion length, counting ``completion_mask``
  before the shift.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

ASSETS = Path(__file__).resolve().parent / "assets"
TEMPLATES = ASSETS / "chat_templates"
SHAKESPEARE = Path(__file__).resolve().parents[1] / "src" / "memfit" / "assets" / "tinyshakespeare.txt"

FAMILIES = ("llama", "qwen2", "qwen3")
VOCAB_SIZE = 512
"""Ids of every tiny tokenizer (and rows of the model's embedding): the specials, the 256 bytes, then merges."""

# Per family: the chat template (the real checkpoints'), the special tokens in id order, and which are BOS, EOS
# and padding (as the Instruct checkpoints set them: Llama 3.2 ends a turn with <|eot_id|> and pads with
# <|finetune_right_pad_id|>; Qwen2.5 ends with <|im_end|>, pads with <|endoftext|> and has no BOS). Qwen3 gets
# Qwen2.5's template: the assets hold no Qwen3 template, and its thinking blocks do not matter here.
_LLAMA_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|finetune_right_pad_id|>",
)
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TOKENIZERS: dict[str, dict[str, Any]] = {
    "llama": {
        "template": "llama32_instruct.jinja",
        "specials": _LLAMA_SPECIALS,
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|finetune_right_pad_id|>",
    },
    "qwen2": {
        "template": "qwen25_instruct.jinja",
        "specials": _QWEN_SPECIALS,
        "bos": None,
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
    },
}
_TOKENIZERS["qwen3"] = _TOKENIZERS["qwen2"]


# ----------------------------------------------------------------------------------------------------------------
# quiet, deterministic runs


class _Collect(logging.Handler):
    """Keeps the messages of the records it is given."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _quiet() -> Iterator[list[str]]:
    """Silence transformers', TRL's, accelerate's and datasets' warnings and progress bars for the duration.

    Yields the list that collects TRL's own warnings (its ``trl`` loggers, not printed), e.g. DPO's "Mismatch
    between tokenized prompt and the start of tokenized prompt+chosen".
    """
    import datasets
    import transformers

    # (bitsandbytes, torchao and torch's pytree warn once, on import, of kernels a CPU run does not use)
    names = ("accelerate", "datasets", "peft", "bitsandbytes", "torchao", "torch.utils._pytree")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    trl_logger, collect = logging.getLogger("trl"), _Collect()
    trl_state = trl_logger.level, trl_logger.propagate
    tf_level = transformers.logging.get_verbosity()
    tf_bars = transformers.utils.logging.is_progress_bar_enabled()
    ds_bars = datasets.utils.logging.is_progress_bar_enabled()
    tqdm_env = os.environ.get("TQDM_DISABLE")
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        trl_logger.setLevel(logging.WARNING)
        trl_logger.propagate = False
        trl_logger.addHandler(collect)
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        datasets.utils.logging.disable_progress_bar()
        os.environ["TQDM_DISABLE"] = "1"  # TRL's reference precompute reads it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield collect.messages
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
        trl_logger.removeHandler(collect)
        trl_logger.level, trl_logger.propagate = trl_state
        transformers.logging.set_verbosity(tf_level)
        if tf_bars:
            transformers.utils.logging.enable_progress_bar()
        if ds_bars:
            datasets.utils.logging.enable_progress_bar()
        if tqdm_env is None:
            os.environ.pop("TQDM_DISABLE", None)
        else:
            os.environ["TQDM_DISABLE"] = tqdm_env


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    """Restore torch's, NumPy's and ``random``'s states afterwards (``Trainer`` seeds all three)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


# ----------------------------------------------------------------------------------------------------------------
# the checkpoint


def _train_tokenizer(family: str) -> Any:
    """A byte-level BPE of :data:`VOCAB_SIZE` ids trained on Tiny Shakespeare's first 60,000 characters and the
    Dolly sample's text, with the family's special tokens first; a ``PreTrainedTokenizerFast`` with the chat
    template, BOS/EOS/pad set."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    spec = _TOKENIZERS[family]
    dolly = json.loads((ASSETS / "dolly_sample.json").read_text(encoding="utf-8"))
    texts = [SHAKESPEARE.read_text(encoding="utf-8")[:60_000]]
    texts += [" ".join(str(v) for v in record.values()) for record in dolly]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(spec["specials"]),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if spec["bos"] is not None:  # as Llama 3's tokenizer.json: a text is read with BOS first
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=spec["bos"], eos_token=spec["eos"], pad_token=spec["pad"]
    )
    fast.chat_template = (TEMPLATES / spec["template"]).read_text(encoding="utf-8")
    return fast


def _model_config(family: str, tokenizer: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.1,  # logits of a few units: the replies' log-probabilities differ visibly
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    return Qwen3Config(**common, use_sliding_window=False)


def tiny_chat_checkpoint(directory: Path, family: str, *, seed: int = 0) -> Path:
    """Write a tiny chat checkpoint that transformers, TRL and memfit all read.

    The model (``save_pretrained``, float32 safetensors): hidden 64, 2 layers, 4 query and 2 key/value heads of
    16, MLP 128, untied embeddings, :data:`VOCAB_SIZE` ids; initialised with ``initializer_range`` 0.1, then every
    RMSNorm weight set to ``1 + 0.2 * N(0, 1)`` and every bias (Qwen2's q/k/v) to ``0.1 * N(0, 1)``, from ``seed``.
    The tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``): a byte-level BPE trained
    in-process (the same bytes each time) with the family's special tokens as ids 0.. and its Instruct
    checkpoint's chat template:

    - ``llama``: Llama 3.2 Instruct's template (``llama32_instruct.jinja``; its system header carries today's
      date, ``strftime_now`` in transformers and memfit alike, so renderings on either side of midnight differ);
      BOS ``<|begin_of_text|>`` (id 0, put first by the post-processor), EOS ``<|eot_id|>`` (4), pad
      ``<|finetune_right_pad_id|>`` (5).
    - ``qwen2``, ``qwen3``: Qwen2.5 Instruct's ChatML template (``qwen25_instruct.jinja``, with its default system
      message); no BOS, EOS ``<|im_end|>`` (2), pad ``<|endoftext|>`` (0). Qwen2 has q/k/v biases, Qwen3 q/k norms.

    Args:
        directory: Where to write (created; files in it are overwritten).
        family: ``"llama"``, ``"qwen2"`` or ``"qwen3"``.
        seed: Seeds the weights (the caller's random state is left as it was).

    Returns:
        ``directory``.
    """
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with _quiet(), _kept_rng():
        tokenizer = _train_tokenizer(family)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_model_config(family, tokenizer), dtype=torch.float32)
        generator = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, param in model.named_parameters():
                noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
                if "norm" in name:
                    param.copy_(1.0 + 0.2 * noise)
                elif name.endswith(".bias"):
                    param.copy_(0.1 * noise)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def load_tokenizer(checkpoint: Path) -> Any:
    """The checkpoint's tokenizer as transformers (and so TRL) reads it."""
    from transformers import AutoTokenizer

    with _quiet():
        return AutoTokenizer.from_pretrained(str(checkpoint))


def _load_model(checkpoint: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)


def _grads(model: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------------------------------------------
# DPO (and IPO, and the other losses of DPOTrainer)


def _load_adapter_state(model: torch.nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy ``state`` into a PEFT model's parameters. Names are ``named_parameters()``'s (``...lora_A.default
    .weight``) or an adapter file's (``...lora_A.weight``, as ``adapter_model.safetensors`` has them)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            key = name if name in params else name.replace(".weight", ".default.weight")
            if key not in params:
                lora = sorted(n for n in params if "lora_" in n)
                raise KeyError(
                    f"{name!r} is not a parameter of the PEFT model; its LoRA parameters are {lora}"
                )
            params[key].copy_(value)


def trl_dpo(
    checkpoint: Path,
    records: Sequence[Mapping[str, Any]],
    *,
    loss_type: str | list[str] = "sigmoid",
    beta: float = 0.1,
    max_length: int | None = None,
    precompute_ref: bool = False,
    label_smoothing: float = 0.0,
    ref_checkpoint: Path | None = None,
    peft_config: Any = None,
    adapter_state: Mapping[str, Tensor] | None = None,
    workdir: Path,
) -> dict[str, Any]:
    """One training step of ``trl.DPOTrainer`` on ``records``, all in one batch, and what TRL computed.

    The trainer gets the checkpoint's path, so it loads the policy and (without ``ref_checkpoint``,
    ``peft_config`` and ``precompute_ref``) a separate frozen reference model from it, both float32, with the
    tokenizer ``AutoTokenizer`` reads. Its dataset is ``records`` in order (sequential sampling), its batch size
    ``len(records)``; the first batch of its own dataloader goes through ``Trainer.training_step`` (forward and
    backward of ``DPOTrainer.compute_loss``; gradient accumulation 1, no optimizer step).

    Args:
        checkpoint: A Hugging Face checkpoint directory with a tokenizer (:func:`tiny_chat_checkpoint`).
        records: TRL's preference format: conversational ``{"prompt": [{"role": "user", "content": ...}],
            "chosen": [{"role": "assistant", "content": ...}], "rejected": [...]}`` or plain strings
            ``{"prompt": str, "chosen": str, "rejected": str}`` (or without ``prompt``: TRL extracts it).
        loss_type: ``DPOConfig.loss_type`` (``"sigmoid"``, ``"ipo"``, ``"hinge"``, ... or a list).
        beta: ``DPOConfig.beta``.
        max_length: ``DPOConfig.max_length``; None: no truncation (TRL's own default is 1024).
        precompute_ref: ``DPOConfig.precompute_ref_log_probs``: the reference log-probabilities are computed
            once, from the policy as loaded, before the step (no reference model is kept).
        label_smoothing: ``DPOConfig.label_smoothing`` (the ``robust``, ``exo_pair`` and ``aot`` losses).
        ref_checkpoint: Another checkpoint of the same shapes to pass as ``ref_model`` (float32), so that the
            policy differs from the reference and the rewards are not all zero.
        peft_config: A ``peft.LoraConfig``: the policy is the checkpoint with these adapters, the reference the
            same model with the adapters disabled (no reference model).
        adapter_state: With ``peft_config``: values for the LoRA parameters, loaded after the trainer is built
            and before the step (give ``lora_B`` non-zero so that the policy differs from the reference).
        workdir: A directory for the trainer's output dir.

    Returns:
        A dict:

        - ``input_ids`` (2B, T) long and ``attention_mask``, ``completion_mask`` (2B, T) long: the collated
          batch, chosen rows 0..B-1, rejected rows B..2B-1, right-padded with the pad id.
        - ``loss``: float.
        - ``metrics``: what ``_compute_loss`` logged for the step (``trainer._metrics["train"]``), name -> float:
          ``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``, ``logps/chosen``,
          ``logps/rejected``, ``logits/chosen``, ``logits/rejected``, ``entropy``, ``mean_token_accuracy``,
          ``num_tokens``.
        - ``chosen_logps``, ``rejected_logps`` (B,): the policy's summed completion log-probabilities, from
          ``DPOTrainer.compute_ref_log_probs`` run on the policy (adapters on), before the step.
        - ``ref_chosen_logps``, ``ref_rejected_logps`` (B,): the reference's, from the batch
          (``precompute_ref``) or from ``DPOTrainer.compute_ref_log_probs``.
        - ``grads``: parameter name -> gradient (a copy): Hugging Face names (``model.layers.0.self_attn.q_proj
          .weight``, ``lm_head.weight``) for full fine-tuning; PEFT's names of the LoRA parameters
          (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``) with ``peft_config``.
        - ``trl_warnings``: what TRL warned, e.g. that a record's prompt ids are not a prefix of its prompt +
          completion ids (then its completion is not the reply alone); a parity test should expect it empty.
    """
    if adapter_state is not None and peft_config is None:
        raise ValueError("adapter_state needs peft_config")
    if ref_checkpoint is not None and (peft_config is not None or precompute_ref):
        raise ValueError("ref_checkpoint is the reference model: not with peft_config or precompute_ref")
    with _quiet() as trl_warnings, _kept_rng():
        from datasets import Dataset
        from transformers import set_seed
        from trl import DPOConfig, DPOTrainer

        set_seed(0)  # PEFT initialises lora_A before Trainer seeds anything
        args = DPOConfig(
            output_dir=str(Path(workdir) / "trl_dpo"),
            report_to=[],
            use_cpu=True,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            per_device_train_batch_size=len(records),
            train_sampling_strategy="sequential",
            dataloader_num_workers=0,
            save_strategy="no",
            logging_steps=1,
            max_length=max_length,
            loss_type=loss_type,
            beta=beta,
            label_smoothing=label_smoothing,
            precompute_ref_log_probs=precompute_ref,
            model_init_kwargs={"dtype": "float32"},
            seed=0,
        )
        trainer = DPOTrainer(
            model=str(checkpoint),
            ref_model=None if ref_checkpoint is None else _load_model(ref_checkpoint),
            args=args,
            train_dataset=Dataset.from_list([dict(r) for r in records]),
            processing_class=load_tokenizer(checkpoint),
            peft_config=peft_config,
        )
        if len(trainer.train_dataset) != len(records):
            raise ValueError(
                f"TRL dropped {len(records) - len(trainer.train_dataset)} of the {len(records)} records: their prompt "
                f"alone has max_length ({max_length}) tokens or more (DPOTrainer._prepare_dataset)"
            )
        model = trainer.model
        if adapter_state is not None:
            _load_adapter_state(model, adapter_state)
        batch = next(iter(trainer.get_train_dataloader()))
        inputs = trainer._prepare_inputs(batch)

        if precompute_ref:
            ref_chosen, ref_rejected = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        else:
            reference = model if trainer.ref_model is None else trainer.ref_model  # None: PEFT, adapters off
            ref_chosen, ref_rejected = trainer.compute_ref_log_probs(reference, inputs)
        # the policy's, by the same method: with no ref_model it would disable a PEFT model's adapters
        ref_model, trainer.ref_model = trainer.ref_model, model
        try:
            chosen, rejected = trainer.compute_ref_log_probs(model, inputs)
        finally:
            trainer.ref_model = ref_model

        model.zero_grad(set_to_none=True)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, read by training_step
        loss = trainer.training_step(model, inputs)
        metrics = {k: float(v[-1]) for k, v in trainer._metrics["train"].items()}
        grads = _grads(model)
    return {
        "input_ids": batch["input_ids"].clone(),
        "attention_mask": batch["attention_mask"].clone(),
        "completion_mask": batch["completion_mask"].clone(),
        "loss": float(loss),
        "metrics": metrics,
        "chosen_logps": chosen.detach().clone(),
        "rejected_logps": rejected.detach().clone(),
        "ref_chosen_logps": ref_chosen.detach().clone(),
        "ref_rejected_logps": ref_rejected.detach().clone(),
        "grads": grads,
        "trl_warnings": list(trl_warnings),
    }


# ----------------------------------------------------------------------------------------------------------------
# CPO / SimPO and ORPO, on a tokenized batch


def _dummy_preferences() -> Any:
    from datasets import Dataset

    return Dataset.from_list([{"prompt": "Say yes.", "chosen": " Yes.", "rejected": " No."}])


def _trl_batch(input_ids: Tensor, labels: Tensor, attention_mask: Tensor) -> dict[str, Tensor]:
    """``{chosen,rejected}_{input_ids,attention_mask,labels}`` from a (2B, T) batch, chosen rows first."""
    if input_ids.shape != labels.shape or input_ids.shape != attention_mask.shape or input_ids.shape[0] % 2:
        raise ValueError(
            f"input_ids, labels and attention_mask must be the same (2B, T) shape, got {tuple(input_ids.shape)}, "
            f"{tuple(labels.shape)}, {tuple(attention_mask.shape)}"
        )
    b = input_ids.shape[0] // 2
    batch = {}
    for side, rows in (("chosen", slice(0, b)), ("rejected", slice(b, None))):
        batch[f"{side}_input_ids"] = input_ids[rows].long().clone()
        batch[f"{side}_attention_mask"] = attention_mask[rows].long().clone()
        batch[f"{side}_labels"] = labels[rows].long().clone()
    return batch


def _run_batch_loss(trainer: Any, batch: dict[str, Tensor]) -> dict[str, Any]:
    """``get_batch_loss_metrics`` in train mode, its loss backpropagated."""
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    loss, metrics = trainer.get_batch_loss_metrics(model, batch, train_eval="train")
    loss.backward()
    return {"loss": float(loss), "metrics": {k: float(v) for k, v in metrics.items()}, "grads": _grads(model)}


def _mask(checkpoint: Path, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    if attention_mask is not None:
        return attention_mask
    return (input_ids != load_tokenizer(checkpoint).pad_token_id).long()


def _batch_loss(
    config_class,
    trainer_class,
    name: str,
    checkpoint: Path,
    input_ids: Tensor,
    labels: Tensor,
    attention_mask: Tensor | None,
    workdir: Path,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """A CPO or ORPO trainer of TRL on CPU in fp32 (``settings``: its loss's own), run on one tokenized batch."""
    args = config_class(
        output_dir=str(Path(workdir) / name), report_to=[], use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, remove_unused_columns=False, max_length=input_ids.shape[1], seed=0, **settings,
    )  # fmt: skip
    trainer = trainer_class(
        model=_load_model(checkpoint), args=args, train_dataset=_dummy_preferences(),
        processing_class=load_tokenizer(checkpoint),
    )  # fmt: skip
    batch = _trl_batch(input_ids, labels, _mask(checkpoint, input_ids, attention_mask))
    return _run_batch_loss(trainer, batch)


def trl_cpo(
    checkpoint: Path,
    input_ids: Tensor,
    labels: Tensor,
    *,
    attention_mask: Tensor | None = None,
    loss_type: str = "simpo",
    beta: float = 0.1,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    label_smoothing: float = 0.0,
    workdir: Path,
) -> dict[str, Any]:
    """``trl.experimental.cpo.CPOTrainer.get_batch_loss_metrics`` on a tokenized batch, and its backward.

    SimPO is ``loss_type="simpo"`` (average log-probabilities, the margin ``simpo_gamma``) with ``cpo_alpha=0``;
    CPO is ``loss_type="sigmoid"`` (summed log-probabilities) with ``cpo_alpha`` > 0, which adds ``cpo_alpha``
    times the chosen rows' mean next-token cross-entropy over their ``labels``. Defaults are ``CPOConfig``'s
    (``loss_type`` aside).

    Args:
        checkpoint: A Hugging Face checkpoint directory with a tokenizer; the model is loaded in float32.
        input_ids: (2B, T): rows 0..B-1 chosen, B..2B-1 rejected (each prompt + reply), right-padded.
        labels: (2B, T): ``input_ids`` on the reply tokens, -100 elsewhere (prompt and padding), as TRL's
            ``chosen_labels``; position t is predicted from position t - 1.
        attention_mask: (2B, T), 1 on real tokens; None: where ``input_ids`` is not the tokenizer's pad id.
        loss_type, beta, simpo_gamma, cpo_alpha, label_smoothing: ``CPOConfig``'s.
        workdir: A directory for the trainer's output dir.

    Returns:
        ``{"loss": float, "metrics": {name: float}, "grads": {Hugging Face name: tensor}}``; the metrics are
        ``get_batch_loss_metrics``'s: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``,
        ``rewards/margins``, ``logps/chosen``, ``logps/rejected`` (per-sequence values averaged over the pairs),
        ``logits/chosen``, ``logits/rejected`` (the mean of every logit of those rows, padding and prompt
        included), ``nll_loss``.
    """
    with _quiet(), _kept_rng():
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        settings = {"loss_type": loss_type, "beta": beta, "simpo_gamma": simpo_gamma, "cpo_alpha": cpo_alpha}
        settings["label_smoothing"] = label_smoothing
        return _batch_loss(CPOConfig, CPOTrainer, "trl_cpo", checkpoint, input_ids, labels, attention_mask,
                           workdir, settings)  # fmt: skip


def trl_orpo(
    checkpoint: Path,
    input_ids: Tensor,
    labels: Tensor,
    *,
    attention_mask: Tensor | None = None,
    beta: float = 0.1,
    workdir: Path,
) -> dict[str, Any]:
    """``trl.experimental.orpo.ORPOTrainer.get_batch_loss_metrics`` on a tokenized batch, and its backward.

    TRL's ORPO loss is ``nll - beta * mean(logsigmoid(log_odds))`` where ``log_odds`` compares the chosen and
    rejected rows' *average* reply log-probabilities, and ``nll`` is the chosen rows' mean next-token
    cross-entropy over every position the attention mask keeps: prompt tokens included, not only the reply.

    Args:
        checkpoint, input_ids, labels, attention_mask, workdir: As :func:`trl_cpo`.
        beta: ``ORPOConfig.beta`` (lambda in the paper).

    Returns:
        ``{"loss": float, "metrics": {name: float}, "grads": {Hugging Face name: tensor}}``; the metrics are
        ``get_batch_loss_metrics``'s: ``rewards/*`` and ``logps/*`` as CPO's (``rewards`` = ``beta`` times the
        average log-probabilities), ``logits/chosen``, ``logits/rejected`` (the mean of every logit but the last
        position's), ``nll_loss``, ``log_odds_ratio`` (the mean of ``logsigmoid(log_odds)``) and
        ``log_odds_chosen`` (the mean of ``log_odds``).
    """
    with _quiet(), _kept_rng():
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return _batch_loss(ORPOConfig, ORPOTrainer, "trl_orpo", checkpoint, input_ids, labels, attention_mask,
                           workdir, {"beta": beta})  # fmt: skip
