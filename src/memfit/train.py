"""THE training loop. Pretraining (and, later, every fine-tuning method) is a configuration of :func:`train`.

Read top to bottom: set-up (validate, data, model, optimizer, resume), then the loop with its "once in a while"
blocks (log, evaluate, checkpoint), then the end (final evaluation, checkpoint, plot, sample). The step itself is
:func:`train_step`, a pure tensor program: no ``.item()``, no host sync, no data-dependent Python branching, so it
runs unchanged under ``FakeTensorMode`` on a meta-built model of any size (the estimator calls the same function).

Dtype policy (``dtype``):

=============  ==============  ==============  =================  =====================================
``dtype``      weights         gradients       AdamW state (m, v)  forward / backward compute
=============  ==============  ==============  =================  =====================================
``fp32``       fp32            fp32            fp32                fp32
``bf16``       bf16            bf16            bf16                bf16 (RoPE tables, RMSNorm and the loss in fp32)
``bf16_mixed`` fp32            fp32            fp32                bf16 autocast (matmuls), fp32 master weights
=============  ==============  ==============  =================  =====================================
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from memfit import checkpoint as ckpt_io
from memfit.config import TrainConfig, config_from_dict, config_to_dict
from memfit.data.corpus import TRAIN, VAL, TokenWindows, batch_rng, prepare_corpus
from memfit.errors import CheckpointError, ConfigError
from memfit.memory.optim import OptimizerInBackward, build_optimizer, lr_at
from memfit.memory.stats import PeakMemory, to_gib
from memfit.memory.techniques import (
    IGNORE_INDEX,
    activation_offloading,
    apply_activation_checkpointing,
    chunked_cross_entropy,
)
from memfit.metrics import MetricsLogger, plot_losses
from memfit.models.llama import Llama, LlamaConfig, build_llama
from memfit.models.presets import MODEL_PRESETS, model_config

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_mixed": torch.float32}


# ----------------------------------------------------------------------------------------------------------------
# The step: runs for real and under FakeTensorMode alike
# ----------------------------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU.

    Raises:
        ConfigError: ``cuda`` was asked for and none is available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "config key 'device': 'cuda' was asked for but torch sees no CUDA device; use device=cpu"
        )
    return torch.device(name)


def autocast_context(dtype: str, device_type: str) -> contextlib.AbstractContextManager:
    """bf16 autocast for ``bf16_mixed``; nothing otherwise."""
    if dtype == "bf16_mixed":
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy, computed in fp32.

    Args:
        logits: ``(B, T, vocab_size)``, any float dtype.
        targets: ``(B, T)`` int64; ``-100`` marks tokens that do not count.

    Returns:
        A 0-dim fp32 tensor: the sum over counted tokens of ``-log p(target)``, in nats.
    """
    return F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )  # (B*T, V) vs (B*T,)


@dataclass
class StepResult:
    """What one optimizer step returns: device tensors, read by the host only at logging boundaries."""

    loss: torch.Tensor
    """0-dim: mean cross-entropy per counted token over all micro-batches of the step."""
    grad_norm: torch.Tensor
    """0-dim: global L2 norm of the gradients before clipping."""
    num_tokens: torch.Tensor
    """0-dim int64: tokens that counted in the loss."""


def _phase(tracker, name: str) -> None:
    if tracker is not None:
        tracker.set_phase(name)


def micro_batch_loss(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    dtype: str,
    chunked_cross_entropy_chunks: int = 0,
    offload_activations: bool = False,
) -> torch.Tensor:
    """Summed cross-entropy of one micro-batch (the forward half of a step).

    Args:
        model: a :class:`~memfit.models.llama.Llama`.
        inputs: ``(B, T)`` int64 ids.
        targets: ``(B, T)`` int64; ``-100`` does not count.
        dtype: the dtype policy (``bf16_mixed`` runs the forward under bf16 autocast).
        chunked_cross_entropy_chunks: > 0 computes the loss chunk by chunk from the hidden states, never
            materialising the ``(B, T, vocab_size)`` logits.
        offload_activations: save tensors for backward in pinned host memory (CUDA).

    Returns:
        0-dim fp32 summed loss in nats.
    """
    with autocast_context(dtype, inputs.device.type), activation_offloading(offload_activations):
        if chunked_cross_entropy_chunks > 0:
            hidden = model.model(inputs)  # (B, T, dim)
            return chunked_cross_entropy(hidden, model.lm_head.weight, targets, chunked_cross_entropy_chunks)
        logits = model(inputs)  # (B, T, V)
        return loss_sum(logits, targets)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    max_grad_norm: float,
    dtype: str,
    chunked_cross_entropy_chunks: int = 0,
    offload_activations: bool = False,
    tracker=None,
) -> StepResult:
    """One optimizer step over ``gradient_accumulation_steps`` micro-batches.

    Each micro-batch's summed loss is divided by the token count of the *whole* step before its backward, so the
    accumulated gradient equals that of one big batch (token-weighted, not micro-batch-averaged), while only one
    micro-batch's activations are alive at a time.

    With an :class:`~memfit.memory.optim.OptimizerInBackward`, the updates run inside ``backward`` (one parameter
    at a time, each gradient freed at once); ``grad_norm`` is then the norm of the gradients as each was consumed.

    Args:
        model: maps ``(B, T)`` int64 ids to ``(B, T, vocab_size)`` logits.
        optimizer: over the model's trainable parameters; its learning rate is already set for this step.
        micro_batches: ``[(inputs, targets), ...]``, each ``(B, T)`` int64 on the model's device.
        max_grad_norm: clip the global gradient norm to this; 0 disables clipping.
        dtype: the dtype policy (``fp32``, ``bf16``, ``bf16_mixed``).
        chunked_cross_entropy_chunks: see :func:`micro_batch_loss`.
        offload_activations: see :func:`micro_batch_loss`.
        tracker: a :class:`~memfit.memory.tracker.MemoryTracker` to tell the phases to, or ``None``.

    Returns:
        A :class:`StepResult` of device tensors (no host sync happened).
    """
    in_backward = isinstance(optimizer, OptimizerInBackward)
    num_tokens = torch.stack([(t != IGNORE_INDEX).sum() for _, t in micro_batches]).sum()
    denom = num_tokens.clamp(min=1).float()
    total = torch.zeros((), dtype=torch.float32, device=micro_batches[0][0].device)
    for inputs, targets in micro_batches:
        _phase(tracker, "forward")
        loss = (
            micro_batch_loss(
                model,
                inputs,
                targets,
                dtype=dtype,
                chunked_cross_entropy_chunks=chunked_cross_entropy_chunks,
                offload_activations=offload_activations,
            )
            / denom
        )
        _phase(tracker, "backward")
        loss.backward()
        total = total + loss.detach()
    _phase(tracker, "optimizer_step")
    if in_backward:
        grad_norm = optimizer.consume_grad_norm()
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        if max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _phase(tracker, "other")
    return StepResult(loss=total, grad_norm=grad_norm, num_tokens=num_tokens)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    windows: TokenWindows,
    *,
    batch_size: int,
    num_batches: int,
    seed: int,
    dtype: str,
    device: torch.device,
    chunked_cross_entropy_chunks: int = 0,
) -> float:
    """Mean cross-entropy per token over ``num_batches`` fixed validation windows (the same at every call).

    Returns:
        Validation loss in nats/token.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for i in range(num_batches):
        inputs, targets = windows.batch(batch_size, batch_rng(seed, VAL, i))
        inputs, targets = inputs.to(device), targets.to(device)
        loss = micro_batch_loss(
            model, inputs, targets, dtype=dtype, chunked_cross_entropy_chunks=chunked_cross_entropy_chunks
        )
        total += loss.double()
        count += targets.numel()
    model.train(was_training)
    return float(total.item() / count)


# ----------------------------------------------------------------------------------------------------------------
# Set-up helpers
# ----------------------------------------------------------------------------------------------------------------


def make_tokenizer(cfg: TrainConfig, train_text: str):
    """Build the tokenizer ``cfg.tokenizer`` asks for, from the training split only."""
    from memfit.tokenizer import CharTokenizer, load_tokenizer, train_bpe

    kind = cfg.tokenizer.kind
    if kind == "bpe":
        return train_bpe([train_text], cfg.tokenizer.vocab_size)
    if kind == "char":
        return CharTokenizer.from_text(train_text)
    return load_tokenizer(cfg.tokenizer.path)


def tokenizer_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The tokenizer settings that matter for ``cfg.tokenizer.kind`` (the cache and resume key)."""
    tok = cfg.tokenizer
    extra = {"bpe": {"vocab_size": tok.vocab_size}, "file": {"path": tok.path}}.get(tok.kind, {})
    return {"kind": tok.kind, **extra}


def resolve_model_config(cfg: TrainConfig, vocab_size: int) -> LlamaConfig:
    """The preset with ``model_args`` applied; ``vocab_size`` from the tokenizer when the preset has none.

    Raises:
        ConfigError: the tokenizer has more ids than the model's embedding.
    """
    args = dict(cfg.model_args)
    if "vocab_size" not in args and "vocab_size" not in MODEL_PRESETS[cfg.model]:
        args["vocab_size"] = vocab_size
    mcfg = model_config(cfg.model, **args)
    if mcfg.vocab_size < vocab_size:
        raise ConfigError(
            f"config key 'model_args.vocab_size': the model has {mcfg.vocab_size} embeddings but the tokenizer has "
            f"{vocab_size} ids; raise model_args.vocab_size or use a smaller tokenizer"
        )
    return mcfg


def _load_run_state(cfg: TrainConfig) -> tuple[Path | None, dict[str, Any] | None]:
    """Find and pre-check the checkpoint to resume from, or refuse to overwrite an earlier run."""
    ckpt_io.check_writable(cfg.output_dir)
    ckpt_io.remove_stale_temporaries(cfg.output_dir)
    latest = ckpt_io.latest_checkpoint(cfg.output_dir)
    if not cfg.resume:
        if latest is not None:
            raise CheckpointError(
                f"output_dir '{cfg.output_dir}' already holds checkpoints ({latest.name}) from an earlier run; "
                f"pass resume=true to continue it, or choose another output_dir (nothing was changed)"
            )
        return None, None
    if latest is None:
        tqdm.write(f"resume=true but '{cfg.output_dir}' holds no checkpoint yet: starting from step 0")
        return None, None
    state = ckpt_io.read_trainer_state(latest)
    return latest, state


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run pretraining as ``cfg`` describes (the config must come from :func:`memfit.config.load_config`).

    Returns:
        A summary: ``final_val_loss``, ``steps``, ``tokens_per_second_per_gpu`` (mean over the run),
        ``peak_memory_rss`` / ``peak_memory_alloc`` (GiB, whole run), ``checkpoint``, ``sample``, ``num_params``.

    Raises:
        ConfigError, DataError, CheckpointError: bad input, reported before anything is allocated or overwritten.
    """
    # --- set-up: output dir, resume state, data, tokenizer ------------------------------------------------------
    device = resolve_device(cfg.device)
    out = Path(cfg.output_dir)
    resume_dir, resume_state = _load_run_state(cfg)
    from memfit.tokenizer import load_tokenizer

    tokenizer_key = tokenizer_settings(cfg)
    if resume_dir is not None:
        saved_cfg = resume_state.get("config", {})
        saved_key = tokenizer_settings(config_from_dict(saved_cfg)) if saved_cfg else None
        if saved_key is not None and saved_key != tokenizer_key:
            raise ConfigError(
                f"config key 'tokenizer': the run in '{cfg.output_dir}' was trained with tokenizer {saved_key}, "
                f"the config asks for {tokenizer_key}; resume with the same tokenizer settings or choose another "
                f"output_dir"
            )
        saved_tok = load_tokenizer(resume_dir / "tokenizer")
        make, load = (lambda _text: saved_tok), (lambda _d: saved_tok)
    else:
        make, load = (lambda text: make_tokenizer(cfg, text)), load_tokenizer
    tokenizer, corpus = prepare_corpus(
        cfg.data.path, cfg.data.val_fraction, make, out / "data", load, tokenizer_key=tokenizer_key
    )
    mcfg = resolve_model_config(cfg, tokenizer.vocab_size)
    seq_len = cfg.seq_len or mcfg.max_seq_len
    train_windows = TokenWindows(corpus.train_path, seq_len)
    val_windows = TokenWindows(corpus.val_path, seq_len)

    # --- model and optimizer ----------------------------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    model: Llama = build_llama(mcfg, device=device, dtype=PARAM_DTYPES[cfg.dtype], seed=cfg.seed)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_interval)
    optimizer = build_optimizer(model, cfg.optimizer, in_backward=cfg.optimizer_in_backward)
    num_params = sum(p.numel() for p in model.parameters())
    start_step = 0
    if resume_dir is not None:
        if ckpt_io.read_model_config(resume_dir) != mcfg:
            raise CheckpointError(
                f"checkpoint '{resume_dir}' holds a different model than the config asks for; resume with the "
                f"same model and model_args, or choose another output_dir"
            )
        state = ckpt_io.load_checkpoint(resume_dir, model, optimizer)
        start_step = int(state["step"])
    tqdm.write(
        f"memfit pretrain: model {cfg.model} ({num_params:,} parameters), tokenizer {tokenizer.kind} "
        f"({tokenizer.vocab_size:,} ids), {corpus.train_tokens:,} train / {corpus.val_tokens:,} val tokens, "
        f"batch {cfg.batch_size} x {cfg.gradient_accumulation_steps} x {seq_len} tokens, dtype {cfg.dtype}, "
        f"device {device}" + (f", resuming at step {start_step}" if start_step else "")
    )

    logger = MetricsLogger(out, tensorboard=cfg.tensorboard, resume_step=start_step if resume_dir else None)
    memory = PeakMemory(device)
    run_peak: dict[str, float] = {}
    tokens_per_step = cfg.batch_size * cfg.gradient_accumulation_steps * seq_len
    interval_time, interval_tokens, total_time, total_tokens = 0.0, 0, 0.0, 0
    val_loss = math.nan
    trainer_state = {"config": config_to_dict(cfg), "data_position": "step"}
    step_options = {
        "max_grad_norm": cfg.max_grad_norm,
        "dtype": cfg.dtype,
        "chunked_cross_entropy_chunks": cfg.chunked_cross_entropy,
        "offload_activations": cfg.activation_offloading,
    }
    eval_options = {
        "batch_size": cfg.batch_size,
        "num_batches": cfg.eval_batches,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "device": device,
        "chunked_cross_entropy_chunks": cfg.chunked_cross_entropy,
    }
    tracker = None
    if cfg.track_memory:
        from memfit.memory.tracker import MemoryTracker, plot_timeline

        tracker = MemoryTracker(model, optimizer)

    def save(step: int) -> Path:
        return ckpt_io.save_checkpoint(
            out, step, model, mcfg, optimizer, trainer_state, tokenizer, cfg.keep_last_checkpoints
        )

    # --- the loop ---------------------------------------------------------------------------------------------
    model.train()
    bar = tqdm(
        total=cfg.max_steps,
        initial=start_step,
        desc="pretrain",
        unit="step",
        disable=not cfg.progress_bar,
        dynamic_ncols=True,
    )
    last_ckpt = None
    for step in range(start_step, cfg.max_steps):
        t0 = time.perf_counter()
        lr = lr_at(
            step,
            lr=cfg.optimizer.lr,
            min_lr=cfg.optimizer.min_lr,
            warmup_steps=cfg.optimizer.warmup_steps,
            max_steps=cfg.max_steps,
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro_batches = [
            tuple(
                t.to(device, non_blocking=True)
                for t in train_windows.batch(cfg.batch_size, batch_rng(cfg.seed, TRAIN, step, m))
            )
            for m in range(cfg.gradient_accumulation_steps)
        ]
        if tracker is None:
            result = train_step(model, optimizer, micro_batches, **step_options)
        else:
            # draw the run's second step (optimizer state exists by then), or its only step
            plot_this = step == start_step + 1 or step == cfg.max_steps - 1 == start_step
            tracker.record_timeline = plot_this
            if plot_this:
                tracker.clear_timeline()
            with tracker:
                result = train_step(model, optimizer, micro_batches, tracker=tracker, **step_options)
            if plot_this:
                plot_timeline(
                    tracker.timeline,
                    out / "memory_timeline.png",
                    title=f"memory by category, step {step + 1} ({cfg.model})",
                )
        memory.sample()
        done = step + 1
        bar.update(1)

        # once in a while: log (the only host sync of a training step)
        if done % cfg.log_every == 0 or done == cfg.max_steps:
            loss = result.loss.item()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            interval_time += time.perf_counter() - t0
            interval_tokens += tokens_per_step
            record = {
                "step": done,
                "loss": loss,
                "lr": lr,
                "grad_norm": result.grad_norm.item(),
                "tokens_per_second_per_gpu": interval_tokens / max(interval_time, 1e-9),
                **memory.read_and_reset(),
            }
            if tracker is not None:
                record["memory_breakdown"] = {k: to_gib(v) for k, v in tracker.peak_breakdown.items()}
                record["memory_peak_phase"] = tracker.peak_phase
                tracker.reset_peak()
            for k, v in record.items():
                if k.startswith("peak_memory") and v is not None:
                    run_peak[k] = max(run_peak.get(k, 0.0), v)
            logger.log(record)
            bar.set_postfix(loss=f"{loss:.3f}")
            total_time += interval_time
            total_tokens += interval_tokens
            interval_time, interval_tokens = 0.0, 0
        else:
            interval_time += time.perf_counter() - t0
            interval_tokens += tokens_per_step

        # once in a while: evaluate
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
            val_loss = evaluate(model, val_windows, **eval_options)
            logger.log({"step": done, "val_loss": val_loss})

        # once in a while: checkpoint
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done != cfg.max_steps:
            last_ckpt = save(done)
    bar.close()

    # --- the end: final evaluation, checkpoint, plot, sample --------------------------------------------------
    val_loss = evaluate(model, val_windows, **eval_options)
    if start_step < cfg.max_steps:
        logger.log({"step": cfg.max_steps, "val_loss": val_loss})
        last_ckpt = save(cfg.max_steps)
    else:  # resumed a finished run: report, but add nothing to its records or checkpoints
        tqdm.write(f"the run in '{out}' is already complete at step {start_step}; nothing to train")
        last_ckpt = resume_dir
    logger.close()
    plot = plot_losses(out / "metrics.jsonl", out / "loss.png")

    from memfit.generate import generate_text

    sample = ""
    if cfg.sample.max_new_tokens > 0:
        sample = generate_text(
            model,
            tokenizer,
            cfg.sample.prompt,
            max_new_tokens=cfg.sample.max_new_tokens,
            temperature=cfg.sample.temperature,
            top_k=cfg.sample.top_k,
            seed=cfg.seed,
            dtype=cfg.dtype,
        )
    summary = {
        "final_val_loss": val_loss,
        "steps": cfg.max_steps,
        "num_params": num_params,
        "tokens_per_second_per_gpu": total_tokens / total_time if total_time else None,
        **{k: v for k, v in run_peak.items()},
        "checkpoint": str(last_ckpt),
        "loss_plot": str(plot) if plot else None,
        "sample": sample,
    }
    return summary
