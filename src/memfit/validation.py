"""Validation of a run's config: the allowed values of the keys that are not memory switches, and what cuts across
keys (:func:`validate`, which :func:`memfit.config.load_config` runs before anything is built), every refusal a
:class:`~memfit.errors.ConfigError` naming its key. The schema itself, parsing and the dotted overrides are
:mod:`memfit.config`; each memory switch checks itself (:mod:`memfit.memory.switches`).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from memfit import data_formats as formats
from memfit import hub
from memfit.errors import ConfigError, DataError
from memfit.memory import hybrids, switches
from memfit.memory.host import MMAP_THRESHOLD_SETTINGS
from memfit.models import peft
from memfit.models.config import DecoderConfig
from memfit.models.presets import MODEL_PRESETS, model_config
from memfit.objectives import OBJECTIVES, PREFERENCE_OBJECTIVES, REFERENCE_FREE
from memfit.units import parse_bytes

if TYPE_CHECKING:
    from memfit.config import OptimizerConfig, TrainConfig

# ----------------------------------------------------------------------------------------------------------------
# The allowed values of the keys that are not memory switches (those are in memfit.memory.switches; optimizers in
# memfit.memory.optimizers; LoRA's targets in memfit.models.peft; instruction data's in memfit.data_formats;
# mmap_threshold's in memfit.memory.host)
# ----------------------------------------------------------------------------------------------------------------

DEVICES = ("auto", "cpu", "cuda")
NONFINITE_POLICIES = ("stop", "skip")  # on_nonfinite
TOKENIZER_KINDS = ("bpe", "char", "file")
BPE_MIN_IDS = 258
"""The fewest ids a byte-level BPE has (``tokenizer.vocab_size``): its 256 bytes and its two special tokens."""
_CHAR = "tokenizer.kind=char (one id per character of the training text)"  # the fix for a model too small


# ----------------------------------------------------------------------------------------------------------------
# Validation: the schema's values and what cuts across them (each switch checks itself, memfit.memory.switches)
# ----------------------------------------------------------------------------------------------------------------


_require = switches.require
_one_of = switches.one_of


def device_type(device: str) -> str:
    """The device type a ``device`` value resolves to: ``auto`` is ``cuda`` when torch sees one, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def memory_budget_bytes(cfg: TrainConfig) -> int | None:
    """``memory_budget`` in bytes, or ``None`` when it is not set.

    Raises:
        ConfigError: naming ``memory_budget``, when it is not a size with a unit (:func:`memfit.units.parse_bytes`).
    """
    return None if cfg.memory_budget is None else parse_bytes(cfg.memory_budget, "memory_budget")


def validate(cfg: TrainConfig, world_size: int = 1, *, needs_weights: bool = True) -> None:
    """Check every value and combination before anything is allocated.

    The memory switches are checked by their entries (:func:`memfit.memory.switches.check`), the optimizer by its
    own (:mod:`memfit.memory.optimizers`); what is checked here is the rest of the schema and what cuts across it.

    Args:
        cfg: the configuration.
        world_size: the number of ranks the run will have (torchrun's ``WORLD_SIZE``, ``nproc``, or the
            estimator's ``world_size``); above 1 the switches that do not work sharded are refused too.
        needs_weights: the config is to be run, so a LoRA / QLoRA / adapter run needs ``checkpoint_dir``; off for a
            prediction (``memfit estimate`` / ``plan``), where the preset's architecture is all it takes.

    Raises:
        ConfigError: naming the first offending key and what to use instead.
        ValueError: ``world_size`` < 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _validate_run(cfg)
    switches.check_values(cfg)
    _validate_tokenizer_and_data(cfg)
    _validate_finetuning(cfg, needs_weights)
    _validate_optimizer(cfg)
    switches.check(cfg, switches.Target(device_type(cfg.device), world_size))
    _validate_sample_and_logging(cfg)
    _validate_model(cfg)
    _validate_moe(cfg)
    _validate_preference(cfg, needs_weights)


REFERENCE_MODES = ("auto", "lora_off", "precomputed", "resident")
"""The values of ``preference.reference``."""


def reference_mode(cfg: TrainConfig) -> str:
    """Where a run's reference log-probabilities come from: ``none`` (next-token, SimPO, ORPO), ``lora_off``,
    ``precomputed`` or ``resident`` (``preference.reference``, ``auto`` resolved)."""
    if cfg.objective not in PREFERENCE_OBJECTIVES or cfg.objective in REFERENCE_FREE:
        return "none"
    if cfg.preference.reference == "auto":
        return "lora_off" if cfg.method in ("lora", "qlora") else "precomputed"
    return cfg.preference.reference


def _validate_preference(cfg: TrainConfig, needs_weights: bool = True) -> None:
    """The objective and its preference settings, and what a preference run cannot combine with."""
    _one_of(cfg.objective, OBJECTIVES, "objective")
    pref = cfg.preference
    _one_of(pref.reference, REFERENCE_MODES, "preference.reference")
    preference = cfg.objective in PREFERENCE_OBJECTIVES
    if cfg.data.format == "preference":
        _require(
            preference,
            "objective",
            f"data.format=preference holds pairs of replies for a preference objective; set objective to one of "
            f"{', '.join(PREFERENCE_OBJECTIVES)}",
        )
    if not preference:
        return
    _require(
        cfg.data.format == "preference",
        "data.format",
        f"objective={cfg.objective} trains on pairs of chosen and rejected replies: set data.format=preference "
        f"(records of prompt, chosen and rejected)",
    )
    _require(pref.beta > 0, "preference.beta", f"must be > 0, got {pref.beta}")
    _require(
        cfg.checkpoint_dir is not None or not needs_weights,
        "checkpoint_dir",
        f"objective={cfg.objective} aligns a trained model with preference pairs: set checkpoint_dir (its weights "
        "are the policy's start and the reference)",
    )
    _require(
        0 <= pref.label_smoothing < 0.5,
        "preference.label_smoothing",
        f"must be in [0, 0.5), got {pref.label_smoothing}",
    )
    _require(
        pref.label_smoothing == 0 or cfg.objective in ("dpo", "simpo"),
        "preference.label_smoothing",
        f"applies to dpo and simpo, not {cfg.objective}",
    )
    _require(pref.cpo_alpha >= 0, "preference.cpo_alpha", f"must be >= 0, got {pref.cpo_alpha}")
    _require(
        pref.cpo_alpha == 0 or cfg.objective == "simpo",
        "preference.cpo_alpha",
        f"weighs SimPO's cross-entropy term; objective={cfg.objective} has none to weigh (ORPO's is fixed at 1)",
    )
    _require(
        pref.reference_batch_size >= 0,
        "preference.reference_batch_size",
        f"must be >= 0 (0: batch_size), got {pref.reference_batch_size}",
    )
    _require(
        pref.reference == "auto" or cfg.objective not in REFERENCE_FREE,
        "preference.reference",
        f"objective={cfg.objective} is reference-free: it compares the policy's own log-probabilities; leave "
        f"preference.reference at auto",
    )
    _require(
        pref.reference != "lora_off" or cfg.method in ("lora", "qlora"),
        "preference.reference",
        f"lora_off takes the reference from the policy with its LoRA switched off, but method={cfg.method} has "
        f"no LoRA; use precomputed (one pass before training, stored on disk) or resident",
    )
    _require(
        not cfg.data.packing,
        "data.packing",
        "packs samples into shared rows; a preference pair's chosen and rejected replies are rows of their own",
    )
    _require(
        not cfg.data.train_on_prompt,
        "data.train_on_prompt",
        "a preference objective compares the replies' log-probabilities; the prompt is never part of them",
    )
    _require(
        cfg.distributed.sequence_parallel == 1,
        "distributed.sequence_parallel",
        "splits each row's tokens over ranks, but a preference objective needs each row's whole log-probability; "
        "shard with FSDP2 alone (distributed.sequence_parallel=1)",
    )
    _require(
        cfg.distributed.tensor_parallel == 1,
        "distributed.tensor_parallel",
        "splits each row's logits over the vocabulary on several ranks, and the preference objectives' sums are "
        "not written for vocabulary-sharded logits; shard with FSDP2 alone (distributed.tensor_parallel=1)",
    )


def trains_router(cfg: TrainConfig) -> bool:
    """Whether a run's routers train (``moe.train_router``, None resolved: pretraining yes, fine-tuning no)."""
    if cfg.moe.train_router is None:
        return cfg.checkpoint_dir is None and cfg.method == "full"
    return cfg.moe.train_router


def _validate_moe(cfg: TrainConfig) -> None:
    """The mixture-of-experts keys: the routers train in a full fine-tune only, and the load-balancing loss needs
    them to."""
    skew = cfg.estimate.moe_skew
    _require(
        not isinstance(skew, bool) and skew >= 1.0,
        "estimate.moe_skew",
        f"is {skew!r}; it must be at least 1.0 (1.0: every expert exactly its average share)",
    )
    coef = cfg.moe.router_aux_loss_coef
    _require(
        coef is None or (not isinstance(coef, bool) and coef >= 0),
        "moe.router_aux_loss_coef",
        f"is {coef!r}; it must be null (the checkpoint's) or a number >= 0",
    )
    _require(
        cfg.moe.train_router is not True or cfg.method == "full",
        "moe.train_router",
        f"is true with method {cfg.method!r}; the routers train in a full fine-tune only (method=full)",
    )
    _require(
        not coef or trains_router(cfg),
        "moe.router_aux_loss_coef",
        f"is {coef}, but the routers do not train (moe.train_router); the load-balancing loss trains them: set "
        f"moe.train_router=true, or the weight to 0",
    )


def _validate_run(cfg: TrainConfig) -> None:
    """The run's sizes, steps and policies."""
    _require(
        cfg.model in MODEL_PRESETS,
        "model",
        f"unknown preset {cfg.model!r}; known: {', '.join(MODEL_PRESETS)}",
    )
    for key in (
        "max_steps",
        "batch_size",
        "gradient_accumulation_steps",
        "log_every",
        "eval_batches",
        "keep_last_checkpoints",
        "max_nonfinite_steps",
    ):
        _require(getattr(cfg, key) >= 1, key, f"must be >= 1, got {getattr(cfg, key)}")
    for key in ("seq_len", "eval_every", "checkpoint_every"):
        _require(getattr(cfg, key) >= 0, key, f"must be >= 0, got {getattr(cfg, key)}")
    _require(
        cfg.peak_flops >= 0,
        "peak_flops",
        f"must be >= 0 FLOP/s (0: measured or looked up), got {cfg.peak_flops}",
    )
    _require(
        cfg.max_grad_norm >= 0,
        "max_grad_norm",
        f"must be >= 0 (0 disables clipping), got {cfg.max_grad_norm}",
    )
    _one_of(cfg.device, DEVICES, "device")
    _one_of(cfg.on_nonfinite, NONFINITE_POLICIES, "on_nonfinite")
    _one_of(cfg.mmap_threshold, MMAP_THRESHOLD_SETTINGS, "mmap_threshold")
    _require(
        not (cfg.on_nonfinite == "skip" and cfg.optimizer_in_backward),
        "on_nonfinite",
        "skip cannot be combined with optimizer_in_backward: those updates are applied during backward, before "
        "the step's loss and gradient norm are known; use on_nonfinite=stop",
    )
    _require(bool(cfg.output_dir), "output_dir", "must not be empty")
    memory_budget_bytes(cfg)  # a size with a unit, or a ConfigError naming memory_budget


def _validate_tokenizer_and_data(cfg: TrainConfig) -> None:
    """``tokenizer.*`` and the text dataset's ``data.*`` keys."""
    tok = cfg.tokenizer
    _one_of(tok.kind, TOKENIZER_KINDS, "tokenizer.kind")
    if tok.kind == "bpe":
        embeddings = model_vocab(cfg)
        if embeddings is not None and embeddings < BPE_MIN_IDS:
            fix = f"the model's {embeddings} embeddings take no byte-level BPE: set {_CHAR}"
        else:
            fix = f"set tokenizer.vocab_size={BPE_MIN_IDS} (or more), or {_CHAR}"
        _require(
            tok.vocab_size >= BPE_MIN_IDS,
            "tokenizer.vocab_size",
            f"a byte-level BPE needs >= {BPE_MIN_IDS} ids (256 bytes and 2 special tokens), got "
            f"{tok.vocab_size}; {fix}",
        )
    if tok.kind == "file":
        _require(tok.path is not None, "tokenizer.path", "is required when tokenizer.kind is 'file'")
    vf = cfg.data.val_fraction
    if cfg.data.format == "text":
        _require(0.0 < vf < 1.0, "data.val_fraction", f"must be in (0, 1), got {vf}")
    else:
        _require(0.0 <= vf < 1.0, "data.val_fraction", f"must be in [0, 1) (0: no validation), got {vf}")
    for name, weight in cfg.data.weights.items():
        _require(
            isinstance(weight, int | float)
            and not isinstance(weight, bool)
            and math.isfinite(weight)
            and weight >= 0,
            f"data.weights.{name}",
            f"must be a finite number >= 0, got {weight!r}",
        )
    if cfg.data.weights:
        _require(cfg.data.format == "text", "data.weights", "weighs the sources of a text dataset")
        _require(
            any(w > 0 for w in cfg.data.weights.values()),
            "data.weights",
            "are all 0: no source would be trained on; give at least one source a weight > 0",
        )
    _require(
        cfg.data.cross_document_attention or cfg.data.format == "text",
        "data.cross_document_attention",
        "applies to text datasets; instruction samples are kept apart by data.packing",
    )


def _validate_optimizer(cfg: TrainConfig) -> None:
    """The optimizer's hyperparameters (its name, implementation and offload: their switch entries)."""
    opt = cfg.optimizer
    _require(opt.lr > 0, "optimizer.lr", f"must be > 0, got {opt.lr}")
    _require(0 <= opt.min_lr <= opt.lr, "optimizer.min_lr", f"must be in [0, optimizer.lr], got {opt.min_lr}")
    _require(opt.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0, got {opt.warmup_steps}")
    _require(opt.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {opt.weight_decay}")
    _require(
        len(opt.betas) == 2 and all(0 <= b < 1 for b in opt.betas),
        "optimizer.betas",
        f"must be two numbers in [0, 1), got {opt.betas}",
    )
    _require(opt.eps > 0, "optimizer.eps", f"must be > 0, got {opt.eps}")
    _check_low_state_optimizer(opt)


def _check_low_state_optimizer(opt: OptimizerConfig) -> None:
    """The settings of Muon, Adafactor and APOLLO, before anything is built (the libraries' own checks, said by
    key)."""
    _require(0 <= opt.momentum < 1, "optimizer.momentum", f"must be in [0, 1), got {opt.momentum}")
    _require(1 <= opt.ns_steps < 100, "optimizer.ns_steps", f"must be in [1, 99], got {opt.ns_steps}")
    _require(
        opt.muon_ns_dtype in hybrids.NEWTON_SCHULZ_DTYPES,
        "optimizer.muon_ns_dtype",
        f"must be {' | '.join(hybrids.NEWTON_SCHULZ_DTYPES)}, got {opt.muon_ns_dtype!r}",
    )
    _require(
        opt.adjust_lr_fn in ("match_rms_adamw", "original"),
        "optimizer.adjust_lr_fn",
        f"must be match_rms_adamw or original, got {opt.adjust_lr_fn!r}",
    )
    _require(opt.adamw_lr >= 0, "optimizer.adamw_lr", f"must be >= 0 (0: optimizer.lr), got {opt.adamw_lr}")
    _require(opt.beta2_decay <= 0, "optimizer.beta2_decay", f"must be <= 0, got {opt.beta2_decay}")
    _require(
        opt.clipping_threshold >= 1,
        "optimizer.clipping_threshold",
        f"must be >= 1, got {opt.clipping_threshold}",
    )
    _require(
        opt.apollo_rank >= 0, "optimizer.apollo_rank", f"must be >= 0 (0: the default), got {opt.apollo_rank}"
    )
    _require(
        opt.apollo_scale >= 0,
        "optimizer.apollo_scale",
        f"must be >= 0 (0: the default), got {opt.apollo_scale}",
    )
    _require(
        opt.update_proj_gap >= 1, "optimizer.update_proj_gap", f"must be >= 1, got {opt.update_proj_gap}"
    )


def _validate_sample_and_logging(cfg: TrainConfig) -> None:
    """``sample.*`` and Weights & Biases."""
    smp = cfg.sample
    _require(smp.max_new_tokens >= 0, "sample.max_new_tokens", f"must be >= 0, got {smp.max_new_tokens}")
    _require(smp.temperature >= 0, "sample.temperature", f"must be >= 0, got {smp.temperature}")
    _require(smp.top_k >= 0, "sample.top_k", f"must be >= 0, got {smp.top_k}")
    if cfg.wandb:
        _require(
            bool(cfg.wandb_project),
            "wandb_project",
            "is required with wandb=true: the Weights & Biases project to log the run to",
        )
        _require(
            importlib.util.find_spec("wandb") is not None,
            "wandb",
            "needs the wandb package, which is not installed (pip install wandb, or memfit's `wandb` extra: "
            "pip install -e '.[wandb]'); or set wandb=false",
        )


def _validate_model(cfg: TrainConfig) -> None:
    """The model preset with its overrides must be a valid architecture, and the lengths must fit it."""
    # vocab_size comes from the tokenizer when the preset has none; a placeholder is enough to check the rest
    args = dict(cfg.model_args)
    if "vocab_size" not in args and "vocab_size" not in MODEL_PRESETS[cfg.model]:
        args["vocab_size"] = 256
    try:
        mcfg = model_config(cfg.model, **args)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"config key 'model_args': {exc}") from None
    if cfg.checkpoint_dir is not None:
        return  # the architecture comes from the checkpoint: train() checks seq_len against it before loading
    tok = cfg.tokenizer
    embeddings = model_vocab(cfg)
    if tok.kind == "bpe" and embeddings is not None:
        if embeddings >= BPE_MIN_IDS:
            fix = f"set tokenizer.vocab_size={embeddings} (or fewer, >= {BPE_MIN_IDS})"
        else:
            fix = f"a byte-level BPE needs >= {BPE_MIN_IDS} ids: set {_CHAR}"
        _require(
            tok.vocab_size <= embeddings,
            "tokenizer.vocab_size",
            f"{tok.vocab_size} ids do not fit the model's {embeddings} embeddings; {fix}, or "
            f"model_args.vocab_size={tok.vocab_size}",
        )
    check_lengths(cfg, mcfg, 0)


def model_vocab(cfg: TrainConfig) -> int | None:
    """The embeddings a run's model has whatever its tokenizer: ``model_args.vocab_size``, else the preset's
    ``vocab_size``; ``None`` where the tokenizer or the data decides (a preset without ``vocab_size``, such as
    ``shakespeare``), where ``checkpoint_dir`` brings its own, where ``data.path`` is a prepared dataset (which
    brings its tokenizer), or where the value is not an int (model validation names it)."""
    if cfg.checkpoint_dir is not None or cfg.model not in MODEL_PRESETS:
        return None
    # memfit.data.tokens.MANIFEST, spelled out: validation is below the data layer and may not import it
    if cfg.data.path is not None and (Path(cfg.data.path) / "manifest.json").is_file():
        return None
    vocab = cfg.model_args.get("vocab_size", MODEL_PRESETS[cfg.model].get("vocab_size"))
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def check_lengths(cfg: TrainConfig, mcfg: DecoderConfig, vocab_size: int) -> int:
    """The training sequence length, checked against the model (validation does this for a preset; a run and
    the estimator again once the architecture of ``checkpoint_dir`` or the tokenizer's vocabulary is known), with
    the switches' checks that need the architecture (:func:`memfit.memory.switches.check_model`).

    Args:
        cfg: the run config.
        mcfg: the architecture.
        vocab_size: the tokenizer's ids (0: not known yet).

    Raises:
        ConfigError: ``seq_len`` exceeds the model's context, chunked cross-entropy has more chunks than tokens,
            QLoRA's linears are not whole NF4 blocks, or the tokenizer has more ids than the embedding.
    """
    seq_len = cfg.seq_len or mcfg.max_seq_len
    # a preset's context can be raised with model_args; a checkpoint's is what it was trained with
    fix = "lower seq_len" + (" or set model_args.max_seq_len" if cfg.checkpoint_dir is None else "")
    _require(
        seq_len <= mcfg.max_seq_len,
        "seq_len",
        f"{seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}; {fix}",
    )
    switches.check_model(cfg, mcfg)
    if vocab_size > mcfg.vocab_size:
        raise ConfigError(
            f"config key 'checkpoint_dir': the tokenizer has {vocab_size} ids but the model only "
            f"{mcfg.vocab_size} embeddings; the tokenizer does not belong to these weights"
        )
    return seq_len


def _validate_finetuning(cfg: TrainConfig, needs_weights: bool = True) -> None:
    """The fine-tuning keys: method, checkpoint_dir, instruction data, LoRA and adapter settings."""
    data = cfg.data
    _one_of(data.format, formats.DATA_FORMATS, "data.format")
    _one_of(data.template, formats.TEMPLATE_CHOICES, "data.template")
    _require(
        cfg.method == "full" or cfg.checkpoint_dir is not None or not needs_weights,
        "method",
        f"{cfg.method!r} trains small added weights beside frozen pretrained ones and needs checkpoint_dir "
        f"(a Hugging Face, Meta or memfit checkpoint); use method=full to train from scratch (memfit estimate "
        f"and plan take the preset's architecture without it)",
    )
    if cfg.checkpoint_dir is not None:
        _require(
            not cfg.model_args,
            "model_args",
            "the architecture comes from checkpoint_dir; remove model_args (seq_len sets the training length)",
        )
    for key, value in (("data.files", data.files), ("data.split", data.split)):
        _require(
            value is None
            or (data.path is not None and (hub.hub_id(data.path) is not None or Path(data.path).is_dir())),
            key,
            "selects files of a Hub dataset (data.path=ORG/NAME) or of a data.path directory; data.path is "
            + ("not set" if data.path is None else f"'{data.path}', neither"),
        )
    if data.format != "text":
        _require(data.path is not None, "data.path", f"is required for data.format={data.format!r}")
        _require(
            cfg.checkpoint_dir is not None or cfg.tokenizer.kind == "file" or not needs_weights,
            "data.format",
            f"{data.format!r} records need a fixed tokenizer: set checkpoint_dir (its tokenizer is used) or "
            f"tokenizer.kind=file with tokenizer.path",
        )
    _require(
        not data.packing or data.format != "text",
        "data.packing",
        "applies to instruction / chat records; a text corpus is already cut into full windows",
    )
    _require(
        not data.packing or cfg.seq_len > 0,
        "seq_len",
        "data.packing fills rows of exactly seq_len tokens; set seq_len (e.g. 2048) rather than the model's "
        "whole context",
    )
    for key in data.column_map:
        _require(
            isinstance(data.column_map[key], str),
            f"data.column_map.{key}",
            f"must name a record field (a string), got {data.column_map[key]!r}",
        )
    if data.column_map:
        _require(data.format != "text", "data.column_map", "renames fields of instruction / chat records")
        try:
            formats.format_columns(data.format, data.column_map)
        except DataError as exc:
            raise ConfigError(f"config key 'data.column_map': {exc}") from None
    lora = cfg.lora
    _require(lora.rank >= 1, "lora.rank", f"must be >= 1, got {lora.rank}")
    _require(lora.alpha > 0, "lora.alpha", f"must be > 0, got {lora.alpha}")
    _require(0 <= lora.dropout < 1, "lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    _require(
        bool(lora.target_modules) or bool(lora.target_parameters),
        "lora.target_modules",
        "must name at least one module (or lora.target_parameters a stacked expert weight)",
    )
    for name in lora.target_modules:
        _one_of(name, peft.ALL_LORA_TARGETS, "lora.target_modules")
    for name in lora.target_parameters:
        _one_of(name, peft.EXPERT_LORA_TARGETS, "lora.target_parameters")
    _require(
        len(set(lora.target_parameters)) == len(lora.target_parameters),
        "lora.target_parameters",
        f"names a weight twice: {lora.target_parameters}",
    )
    _require(
        cfg.adapter.prompt_length >= 1,
        "adapter.prompt_length",
        f"must be >= 1, got {cfg.adapter.prompt_length}",
    )
    _require(
        cfg.adapter.num_layers >= 0,
        "adapter.num_layers",
        f"must be >= 0 (0 = all), got {cfg.adapter.num_layers}",
    )
