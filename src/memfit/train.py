"""THE training loop. Pretraining and every fine-tuning method (full, LoRA, adapter) are configurations of
:func:`train`: they differ only in where the weights start (random or ``checkpoint_dir``), which weights train
(``method``) and where batches come from (text windows or instruction samples, :class:`RunData`).

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
import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from memfit import checkpoint as ckpt_io
from memfit import distributed as dist_
from memfit.config import TrainConfig, config_from_dict, config_to_dict
from memfit.data.corpus import TRAIN, VAL, TokenWindows, batch_rng, prepare_corpus
from memfit.errors import CheckpointError, ConfigError, PreflightError
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
from memfit.models.peft import lora_effective_weight
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
    """0-dim: mean cross-entropy per counted token over all micro-batches of the step (of all ranks)."""
    grad_norm: torch.Tensor
    """0-dim: global L2 norm of the gradients before clipping."""
    num_tokens: torch.Tensor
    """0-dim int64: tokens that counted in the loss (of all ranks)."""


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
    doc_ids: torch.Tensor | None = None,
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
        doc_ids: ``(B, T)`` ids of the samples packed into each row, or ``None`` (one sequence per row).

    Returns:
        0-dim fp32 summed loss in nats.
    """
    with autocast_context(dtype, inputs.device.type), activation_offloading(offload_activations):
        if chunked_cross_entropy_chunks > 0:
            hidden = model(
                inputs, doc_ids, return_hidden=True
            )  # (B, T, dim); one call of the whole model (FSDP)
            weight = lora_effective_weight(model.lm_head)  # (V, dim); with LoRA on lm_head: W + scale * B @ A
            return chunked_cross_entropy(hidden, weight, targets, chunked_cross_entropy_chunks)
        logits = model(inputs, doc_ids)  # (B, T, V)
        return loss_sum(logits, targets)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, ...]],
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
        micro_batches: ``[(inputs, targets), ...]`` or ``[(inputs, targets, doc_ids), ...]``, each ``(B, T)``
            int64 on the model's device (``doc_ids``: packed samples, or ``None``).
        max_grad_norm: clip the global gradient norm to this; 0 disables clipping.
        dtype: the dtype policy (``fp32``, ``bf16``, ``bf16_mixed``).
        chunked_cross_entropy_chunks: see :func:`micro_batch_loss`.
        offload_activations: see :func:`micro_batch_loss`.
        tracker: a :class:`~memfit.memory.tracker.MemoryTracker` to tell the phases to, or ``None``.

    Returns:
        A :class:`StepResult` of device tensors (no host sync happened).
    """
    in_backward = isinstance(optimizer, OptimizerInBackward)
    # sharded: the token count of the global batch (all ranks), and FSDP averages gradients over the ranks, so
    # each rank's backward is scaled by world_size to make the average the global batch's gradient
    world = dist_.world_size()
    num_tokens = dist_.all_reduce_sum(
        torch.stack([(mb[1] != IGNORE_INDEX).sum() for mb in micro_batches]).sum()
    )
    denom = num_tokens.clamp(min=1).float()
    total = torch.zeros((), dtype=torch.float32, device=micro_batches[0][0].device)
    for inputs, targets, *rest in micro_batches:
        _phase(tracker, "forward")
        loss = (
            micro_batch_loss(
                model,
                inputs,
                targets,
                dtype=dtype,
                chunked_cross_entropy_chunks=chunked_cross_entropy_chunks,
                offload_activations=offload_activations,
                doc_ids=rest[0] if rest else None,
            )
            / denom
        )
        _phase(tracker, "backward")
        (loss * world if world > 1 else loss).backward()
        total = total + loss.detach()
    _phase(tracker, "optimizer_step")
    if in_backward:
        grad_norm = optimizer.consume_grad_norm()
    else:
        grad_norm = dist_.grad_norm_and_clip(model, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _phase(tracker, "other")
    return StepResult(loss=dist_.all_reduce_sum(total), grad_norm=grad_norm, num_tokens=num_tokens)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    *,
    dtype: str,
    device: torch.device,
    chunked_cross_entropy_chunks: int = 0,
) -> float:
    """Mean cross-entropy per counted token over ``batches`` (the same fixed validation batches at every call).

    Sharded, each rank passes its own part of the batches, and the sums are all-reduced: every rank returns the
    loss over all ranks' batches.

    Args:
        model: the model (put in eval mode for the call).
        batches: ``(inputs, targets, doc_ids)`` on the CPU; ``targets`` ``-100`` does not count.
        dtype: the dtype policy.
        device: where the model is.
        chunked_cross_entropy_chunks: see :func:`micro_batch_loss`.

    Returns:
        Validation loss in nats/token (NaN when no token counted).
    """
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, targets, doc_ids in batches:
        loss = micro_batch_loss(
            model,
            inputs.to(device),
            targets.to(device),
            dtype=dtype,
            chunked_cross_entropy_chunks=chunked_cross_entropy_chunks,
            doc_ids=None if doc_ids is None else doc_ids.to(device),
        )
        total += loss.double()
        count += (targets != IGNORE_INDEX).sum().to(device)
    model.train(was_training)
    total, count = dist_.all_reduce_sum(total), int(dist_.all_reduce_sum(count).item())
    return float(total.item() / count) if count else math.nan


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
    if cfg.checkpoint_dir is not None:
        return {"kind": "checkpoint", "path": str(cfg.checkpoint_dir)}
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
        if dist_.is_main():
            tqdm.write(f"resume=true but '{cfg.output_dir}' holds no checkpoint yet: starting from step 0")
        return None, None
    state = ckpt_io.read_trainer_state(latest)
    return latest, state


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""``(inputs, targets, doc_ids)``: ``(B, T)`` int64 each; ``doc_ids`` is ``None`` unless samples are packed."""


@dataclass
class RunData:
    """Where a run's batches come from: text windows (pretraining) or instruction / chat samples.

    Both are pure functions of the step, so a resumed run sees exactly the batches it would have seen.
    """

    train_batch: Callable[[int, int], Batch]
    """``(step, micro_step) -> Batch`` on the CPU."""
    val_batches: Callable[[], Iterator[Batch]]
    """The fixed validation batches."""
    summary: str
    """One line for the start-of-run banner."""
    longest: int
    """Tokens per row of the widest training batch the data can produce (the worst case for memory)."""


def text_data(cfg: TrainConfig, corpus, seq_len: int) -> RunData:
    """Random ``seq_len`` windows of a tokenized corpus (see :class:`~memfit.data.corpus.TokenWindows`)."""
    train_windows = TokenWindows(corpus.train_path, seq_len)
    val_windows = TokenWindows(corpus.val_path, seq_len)

    B, rank, world = cfg.batch_size, dist_.rank(), dist_.world_size()

    def train_batch(step: int, micro: int) -> Batch:
        # the global batch of world * B windows, drawn alike on every rank, of which this rank takes its B: so N
        # ranks with batch_size B train on exactly what one process with batch_size N * B does
        inputs, targets = train_windows.batch(world * B, batch_rng(cfg.seed, TRAIN, step, micro))
        return inputs[rank * B : (rank + 1) * B], targets[rank * B : (rank + 1) * B], None

    def val_batches() -> Iterator[Batch]:
        for i in range(cfg.eval_batches):
            inputs, targets = val_windows.batch(world * B, batch_rng(cfg.seed, VAL, i))
            yield inputs[rank * B : (rank + 1) * B], targets[rank * B : (rank + 1) * B], None

    return RunData(
        train_batch, val_batches, f"{corpus.train_tokens:,} train / {corpus.val_tokens:,} val tokens", seq_len
    )


def instruct_data(cfg: TrainConfig, tokenizer, seq_len: int) -> RunData:
    """Instruction / chat samples rendered with ``data.template`` (see :mod:`memfit.data.instruct`).

    Training batches walk seeded epoch permutations (see :func:`~memfit.data.instruct.batch_position`);
    validation batches walk the held-out samples once, in order, up to ``eval_batches`` batches.
    """
    from memfit.data.instruct import batch_position, prepare_instruct

    d = cfg.data
    data = prepare_instruct(
        d.path,
        d.format,
        d.template,
        tokenizer,
        max_seq_len=seq_len,
        val_fraction=d.val_fraction,
        seed=cfg.seed,
        train_on_prompt=d.train_on_prompt,
        packing=d.packing,
        skip_malformed=d.skip_malformed,
        column_map=d.column_map or None,
    )

    def train_batch(step: int, micro: int) -> Batch:
        position = batch_position(
            step, micro, cfg.batch_size, cfg.gradient_accumulation_steps, dist_.rank(), dist_.world_size()
        )
        return data.train.batch(cfg.batch_size, position, cfg.seed)

    B, rank, world = cfg.batch_size, dist_.rank(), dist_.world_size()

    def val_batches() -> Iterator[Batch]:
        # global batches of world * B samples, of which this rank takes its B rows (see text_data)
        for batch in itertools.islice(data.val.epoch_batches(world * B), cfg.eval_batches):
            yield tuple(None if t is None else t[rank * B : (rank + 1) * B] for t in batch)

    stats = data.stats
    summary = (
        f"{stats.num_records:,} record{'s' * (stats.num_records != 1)} ({d.format}, template {d.template}): "
        f"{len(data.train):,} train / "
        f"{len(data.val):,} val {'rows' if d.packing else 'samples'}"
        + (f" ({stats.packing_efficiency:.0%} tokens, the rest padding)" if d.packing else "")
        + f", {stats.num_tokens:,} tokens ({stats.num_label_tokens:,} trained), {stats.num_truncated:,} truncated to "
        f"{seq_len + 1} tokens (of which {stats.num_dropped:,} dropped: no reply left), {stats.num_skipped:,} "
        f"malformed skipped"
    )
    longest = seq_len if d.packing else data.train.max_length  # padded to the batch's longest item
    return RunData(train_batch, val_batches, summary, longest)


def checkpoint_tokenizer(path: str | Path):
    """The tokenizer stored with a Hugging Face, Meta or memfit checkpoint (read without the weights).

    Raises:
        CheckpointError: the checkpoint has no tokenizer.
    """
    from memfit.convert import detect_format
    from memfit.tokenizer import load_tokenizer

    fmt = detect_format(path)
    where = ckpt_io.resolve_checkpoint(path) / "tokenizer" if fmt == "memfit" else Path(path)
    try:
        return load_tokenizer(where)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint_dir '{path}' has no usable tokenizer ({exc}); fine-tuning needs the tokenizer the model was "
            f"trained with (tokenizer.json or tokenizer.model beside the weights)"
        ) from None


def checkpoint_model_config(path: str | Path) -> LlamaConfig:
    """The architecture of a Hugging Face, Meta or memfit checkpoint, read without the weights."""
    from memfit.convert import read_config

    return read_config(path)[0]


def run_template(cfg: TrainConfig) -> str | None:
    """The prompt template a run's samples were rendered with (``None`` for a text corpus)."""
    return None if cfg.data.format == "text" else cfg.data.template


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``checkpoint_dir`` and ``data.path`` as absolute paths (``~`` expanded), so that what a run records (and
    what generate, export and resume read back) does not depend on the directory it was started from."""

    def absolute(path: str | None) -> str | None:
        return None if path is None else str(Path(path).expanduser().absolute())

    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path))
    return dataclasses.replace(
        cfg,
        checkpoint_dir=absolute(cfg.checkpoint_dir),
        data=data,
        output_dir=str(Path(cfg.output_dir).expanduser()),
    )


def check_resume_matches(cfg: TrainConfig, saved: TrainConfig, output_dir: str) -> None:
    """Refuse to resume a run with settings that change what trains or what it trains on.

    Raises:
        ConfigError: naming the first key that differs from the run's.
    """
    keys = {
        "checkpoint_dir": (cfg.checkpoint_dir, saved.checkpoint_dir),
        "method": (cfg.method, saved.method),
        "data.format": (cfg.data.format, saved.data.format),
        "data.packing": (cfg.data.packing, saved.data.packing),
    }
    if cfg.data.format != "text":
        keys["data.template"] = (cfg.data.template, saved.data.template)
    if cfg.method == "lora":
        keys["lora"] = (dataclasses.asdict(cfg.lora), dataclasses.asdict(saved.lora))
    if cfg.method == "adapter":
        keys["adapter"] = (dataclasses.asdict(cfg.adapter), dataclasses.asdict(saved.adapter))
    for key, (now, then) in keys.items():
        if now != then:
            raise ConfigError(
                f"config key '{key}': the run in '{output_dir}' was trained with {then!r}, the config asks for "
                f"{now!r}; resume with the run's setting, or choose another output_dir for a new run"
            )


def check_base(cfg: TrainConfig, state: dict[str, Any], ckpt: Path) -> None:
    """Check that a LoRA / adapter run's frozen base is still the one it was trained on.

    Raises:
        CheckpointError: the base directory is gone, or its weights differ from those recorded at training.
    """
    from memfit.convert import weights_fingerprint

    base = cfg.checkpoint_dir
    if base is None or not Path(base).exists():
        raise CheckpointError(
            f"'{ckpt}' holds only the {cfg.method} weights of a run trained on the base model '{base}', which "
            f"does not exist (any more); put the base back at that path"
        )
    recorded = state.get("base_fingerprint")
    if recorded is not None and weights_fingerprint(base) != recorded:
        raise CheckpointError(
            f"the base model '{base}' is not the one the {cfg.method} run in '{ckpt}' was trained on (its weight "
            f"files differ); applying the trained weights to other base weights would give a different model"
        )


def apply_method(model: Llama, cfg: TrainConfig) -> None:
    """Add and unfreeze the weights ``cfg.method`` trains (LoRA or adapter; ``full`` trains everything).

    The new weights are initialised from ``cfg.seed``, so a run (and its resume) is a function of its config.
    """
    if cfg.method == "full":
        return
    from memfit.models import peft

    if cfg.method == "lora":
        peft.apply_lora(
            model,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            dropout=cfg.lora.dropout,
            target_modules=tuple(cfg.lora.target_modules),
            seed=cfg.seed,
        )
    else:
        peft.apply_adapter(
            model,
            prompt_length=cfg.adapter.prompt_length,
            num_layers=cfg.adapter.num_layers or None,
            seed=cfg.seed,
        )


def train_step_options(cfg: TrainConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`train_step` that ``cfg`` sets (the loop and the estimator pass the same)."""
    return {
        "max_grad_norm": cfg.max_grad_norm,
        "dtype": cfg.dtype,
        "chunked_cross_entropy_chunks": cfg.chunked_cross_entropy,
        "offload_activations": cfg.activation_offloading,
    }


def build_model(cfg: TrainConfig, mcfg: LlamaConfig, device: torch.device) -> Llama:
    """The model a run starts from: random init (pretraining) or ``checkpoint_dir``'s weights, with the method
    applied. Weights are materialised tensor by tensor in the dtype policy's parameter dtype.

    On the meta device nothing is read or drawn: a sharded run shards that model first and then fills each rank's
    shards from :func:`initial_parameters`, which yields exactly the values built here.
    """
    dtype = PARAM_DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)  # the global RNG (dropout) starts from the seed in every case
    if device.type == "meta":
        model = build_llama(mcfg, device="meta", dtype=dtype)
    elif cfg.checkpoint_dir is None:
        model = build_llama(mcfg, device=device, dtype=dtype, seed=cfg.seed)
    else:
        from memfit.convert import load_pretrained

        model = load_pretrained(cfg.checkpoint_dir, device=device, dtype=dtype)[0]
    apply_method(model, cfg)
    return model


def initial_parameters(
    cfg: TrainConfig, mcfg: LlamaConfig, model: Llama, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The starting value of every parameter of ``model`` (built by ``build_model(..., meta)``), one whole tensor
    at a time: what :func:`build_model` gives a materialised model, for a sharded run to keep its part of.

    Base weights are read from ``checkpoint_dir`` (checked against the model before this returns) or drawn in
    ``named_parameters`` order from a generator seeded with ``cfg.seed`` on ``device``, as ``build_llama`` draws
    them; LoRA / adapter weights are drawn as :func:`memfit.models.peft.apply_lora` / ``apply_adapter`` draw them.

    Raises:
        CheckpointError: ``checkpoint_dir``'s tensors do not match the model (before anything is read).
    """
    from memfit.models.llama import init_parameter_
    from memfit.models.peft import METHOD_PARAMETERS, init_method_parameter_

    dtype = PARAM_DTYPES[cfg.dtype]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    method = [n for n in shapes if n.rsplit(".", 1)[-1] in METHOD_PARAMETERS]
    if cfg.checkpoint_dir is not None:
        from memfit.convert import pretrained_parameters

        base = pretrained_parameters(cfg.checkpoint_dir)
    else:
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        base = (
            (
                n,
                init_parameter_(
                    n, torch.empty(shape, device=device, dtype=dtype), mcfg.num_layers, generator
                ),
            )
            for n, shape in shapes.items()
            if n not in method
        )

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from base
        for n in method:
            yield n, init_method_parameter_(n, torch.empty(shapes[n], device=device, dtype=dtype), cfg.seed)

    return tensors()


def preflight(cfg: TrainConfig, mcfg: LlamaConfig, seq_len: int, device: torch.device) -> str:
    """Check that the run will fit before anything is allocated, and refuse it when it will not.

    A cheap bound comes first: the closed-form model states plus a generous activation bound (34 bytes per token
    and hidden unit per layer in 16 bits, doubled for fp32, after Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", plus three copies of the fp32 logits). When the bound is under
    half of what is available, the run fits and no trace is made. Otherwise the run's own step is traced on fake
    tensors (:func:`memfit.memory.estimate.estimate_run`) at the widest batch the data can produce, and compared
    with free device memory (CUDA: ``torch.cuda.mem_get_info``; the driver's total, paged memory included) or the
    host's available memory (CPU: allocator peak plus host-side bytes). Sharded ranks check the bound only (the
    trace needs a process of its own: ``memfit estimate world_size=N``).

    Args:
        cfg: the run config.
        mcfg: the architecture.
        seq_len: the widest batch's tokens per row.
        device: this rank's device.

    Returns:
        One line for the log saying what was checked.

    Raises:
        PreflightError: the run is predicted not to fit; the message holds the predicted breakdown, what is
            available and the planner's cheapest fix.
    """
    from memfit.memory.estimate import estimate_run, model_state_bytes_closed_form
    from memfit.memory.tracker import GIB

    world = dist_.world_size()
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
        where = f"free on {device}"
    else:
        import psutil

        available = psutil.virtual_memory().available
        where = "available host memory"
    states = model_state_bytes_closed_form(cfg, mcfg, world)
    tokens = cfg.batch_size * seq_len
    act_bytes = 2 if cfg.dtype != "fp32" else 4
    bound = (
        states["parameters"]
        + states["gradients"]
        + states["optimizer_state"]
        + 17 * act_bytes * tokens * mcfg.dim * mcfg.num_layers
        + 3 * 4 * tokens * mcfg.vocab_size
    )
    if bound < available / 2:
        return f"pre-flight: fits (bound {bound / GIB:.2f} GiB, {available / GIB:.1f} GiB {where})"
    if world > 1:
        if bound > available:
            tqdm.write(
                f"note: pre-flight bound {bound / GIB:.2f} GiB per rank exceeds the {available / GIB:.1f} GiB "
                f"{where}; `memfit estimate world_size={world} ...` traces the exact peak"
            )
        return f"pre-flight: bound {bound / GIB:.2f} GiB per rank, {available / GIB:.1f} GiB {where}"
    estimate = estimate_run(cfg, seq_len=seq_len, model_config=mcfg)
    need = estimate.device_total_bytes if device.type == "cuda" else estimate.peak_bytes + estimate.host_bytes
    if need <= available:
        return (
            f"pre-flight: predicted peak {need / GIB:.2f} GiB of {available / GIB:.1f} GiB {where} "
            f"(traced in {estimate.seconds:.1f} s)"
        )
    from memfit.memory.estimate import format_estimate

    fix = _cheapest_fix(cfg, available)
    raise PreflightError(
        f"the run is predicted not to fit: it needs {need / GIB:.2f} GiB at its peak, {available / GIB:.2f} GiB are "
        f"{where}.\n{format_estimate(estimate)}\n{fix}\nSet preflight=false to start anyway."
    )


def _cheapest_fix(cfg: TrainConfig, available: int) -> str:
    """The planner's fix that changes the fewest switches and fits ``available`` bytes, as override text."""
    from memfit.memory.plan import cheapest_fix
    from memfit.memory.tracker import GIB

    fix = cheapest_fix(cfg, available)
    if fix is None:
        return "No combination of memory switches fits; use more ranks (nproc=N), a smaller batch_size or seq_len."
    keys = " ".join(f"{k}={_yaml_scalar(fix.switches[k])}" for k in fix.changes)
    return (
        f"Cheapest fix (memfit plan): {keys} (predicted peak {fix.peak_bytes / GIB:.2f} GiB, relative throughput "
        f"{fix.relative_throughput:.2f})"
    )


def _yaml_scalar(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_lengths(cfg: TrainConfig, mcfg: LlamaConfig, vocab_size: int) -> int:
    """The training sequence length, checked against the model.

    Raises:
        ConfigError: ``seq_len`` exceeds the model's context, chunked cross-entropy has more chunks than tokens,
            or the tokenizer has more ids than the embedding.
    """
    seq_len = cfg.seq_len or mcfg.max_seq_len
    if seq_len > mcfg.max_seq_len:
        raise ConfigError(
            f"config key 'seq_len': {seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}; lower seq_len"
        )
    if cfg.chunked_cross_entropy > cfg.batch_size * seq_len:
        raise ConfigError(
            f"config key 'chunked_cross_entropy': {cfg.chunked_cross_entropy} chunks exceed the "
            f"{cfg.batch_size * seq_len} tokens of a micro-batch; use at most that many (4-16 is typical)"
        )
    if cfg.method == "lora" and "lm_head" in cfg.lora.target_modules and mcfg.tie_word_embeddings:
        raise ConfigError(
            "config key 'lora.target_modules': this model ties lm_head to the input embedding, so a LoRA update "
            "of lm_head would also change the embedding when merged; leave lm_head out"
        )
    if cfg.method == "adapter" and cfg.adapter.num_layers > mcfg.num_layers:
        raise ConfigError(
            f"config key 'adapter.num_layers': {cfg.adapter.num_layers} exceeds the model's {mcfg.num_layers} "
            f"layers; use at most {mcfg.num_layers} (0 adapts all)"
        )
    if vocab_size > mcfg.vocab_size:
        raise ConfigError(
            f"config key 'checkpoint_dir': the tokenizer has {vocab_size} ids but the model only "
            f"{mcfg.vocab_size} embeddings; the tokenizer does not belong to these weights"
        )
    return seq_len


def tracked_memory_fields(tracker) -> dict[str, Any]:
    """The step record's tracked-memory fields since the last record; the tracker then starts a new peak.

    Sharded, every rank tracked itself: the breakdown logged is that of the rank whose tracked peak is highest
    (the ranks' results are gathered here, a host sync, so call it at logging boundaries only), and each
    category's own peak is its maximum over ranks.

    Args:
        tracker: the run's :class:`~memfit.memory.tracker.MemoryTracker` (on every rank).

    Returns:
        ``memory_breakdown`` (GiB by category at the peak), ``memory_peak_phase``, ``memory_category_peaks`` (GiB,
        each category's own maximum, reached at different moments), and, sharded, ``memory_peak_rank``.
        Categories are :attr:`~memfit.memory.tracker.MemoryTracker.categories` (``unsharded_parameters`` only
        for a sharded model).
    """
    mine = (tracker.peak_bytes, tracker.peak_breakdown, tracker.peak_phase, tracker.category_peaks)
    tracker.reset_peak()
    ranks = dist_.all_gather_objects(mine)
    fullest = max(range(len(ranks)), key=lambda r: ranks[r][0])  # the lowest such rank on a tie
    _, breakdown, phase, _ = ranks[fullest]
    fields = {
        "memory_breakdown": {c: to_gib(breakdown[c]) for c in tracker.categories},
        "memory_peak_phase": phase,
        "memory_category_peaks": {c: to_gib(max(r[3][c] for r in ranks)) for c in tracker.categories},
    }
    if len(ranks) > 1:
        fields["memory_peak_rank"] = fullest
    return fields


# ----------------------------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run pretraining or fine-tuning as ``cfg`` describes (the config must come from
    :func:`memfit.config.load_config`).

    Returns:
        A summary: ``final_val_loss``, ``steps``, ``tokens_per_second_per_gpu`` (mean over the run),
        ``peak_memory_rss`` / ``peak_memory_alloc`` (GiB, whole run), ``checkpoint``, ``sample``, ``num_params``.

    Raises:
        ConfigError, DataError, CheckpointError: bad input, reported before anything is allocated or overwritten.
    """
    # --- set-up: output dir, resume state, tokenizer, data (all checked before any weight is allocated) -------
    cfg = with_absolute_paths(cfg)
    device = dist_.init_distributed(resolve_device(cfg.device))  # under torchrun: this rank's device
    main_rank = dist_.is_main()
    out = Path(cfg.output_dir)
    resume_dir, resume_state = _load_run_state(cfg)
    from memfit.tokenizer import load_tokenizer

    tokenizer_key = tokenizer_settings(cfg)
    fixed_tokenizer = None  # None: trained on the corpus (bpe, char)
    if resume_dir is not None:
        saved_cfg = resume_state.get("config", {})
        saved_key = tokenizer_settings(config_from_dict(saved_cfg)) if saved_cfg else None
        if saved_key is not None and saved_key != tokenizer_key:
            raise ConfigError(
                f"config key 'tokenizer': the run in '{cfg.output_dir}' was trained with tokenizer {saved_key}, "
                f"the config asks for {tokenizer_key}; resume with the same tokenizer settings or choose another "
                f"output_dir"
            )
        if saved_cfg:
            check_resume_matches(cfg, config_from_dict(saved_cfg, check=False), cfg.output_dir)
        if cfg.method != "full":
            check_base(cfg, resume_state, resume_dir)
        fixed_tokenizer = load_tokenizer(resume_dir / "tokenizer")
    elif cfg.checkpoint_dir is not None:
        fixed_tokenizer = checkpoint_tokenizer(cfg.checkpoint_dir)
    elif cfg.data.format != "text":
        fixed_tokenizer = load_tokenizer(cfg.tokenizer.path)
    if main_rank and cfg.data.format == "text" and str(cfg.data.path or "").endswith((".json", ".jsonl")):
        tqdm.write(
            f"note: data.format is 'text', so '{cfg.data.path}' is read as plain text; for instruction or chat "
            f"records set data.format (alpaca, dolly, sharegpt, openai)"
        )
    start_config = checkpoint_model_config(cfg.checkpoint_dir) if cfg.checkpoint_dir is not None else None
    if cfg.data.format == "text":
        if fixed_tokenizer is not None:
            make, load = (lambda _text: fixed_tokenizer), (lambda _d: fixed_tokenizer)
        else:
            make, load = (lambda text: make_tokenizer(cfg, text)), load_tokenizer
        if not main_rank:  # rank 0 tokenizes and writes the token files; the others then reuse them
            dist_.barrier()
        tokenizer, corpus = prepare_corpus(
            cfg.data.path, cfg.data.val_fraction, make, out / "data", load, tokenizer_key=tokenizer_key
        )
        if main_rank:
            dist_.barrier()
    else:
        tokenizer = fixed_tokenizer
    mcfg = start_config or resolve_model_config(cfg, tokenizer.vocab_size)
    seq_len = check_lengths(cfg, mcfg, tokenizer.vocab_size)
    data = (
        text_data(cfg, corpus, seq_len)
        if cfg.data.format == "text"
        else instruct_data(cfg, tokenizer, seq_len)
    )
    if cfg.preflight:
        check = preflight(cfg, mcfg, data.longest, device)
        if main_rank:
            tqdm.write(check)
    out.mkdir(parents=True, exist_ok=True)  # only now: bad input above leaves no output_dir behind

    if main_rank and cfg.optimizer.warmup_steps >= cfg.max_steps:
        tqdm.write(
            f"note: optimizer.warmup_steps ({cfg.optimizer.warmup_steps}) >= max_steps ({cfg.max_steps}): the "
            f"learning rate never reaches optimizer.lr ({cfg.optimizer.lr:g})"
        )

    # --- model and optimizer ----------------------------------------------------------------------------------
    world = dist_.world_size()
    # sharded: built on meta, sharded, then each rank fills its shards one whole tensor at a time (no rank ever
    # holds the unsharded model)
    model: Llama = build_model(cfg, mcfg, device if world == 1 else torch.device("meta"))
    initial = initial_parameters(cfg, mcfg, model, device) if world > 1 else None  # checked before allocating
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_interval)
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if world > 1:
        model = dist_.shard_model(model, cfg, device)
        dist_.materialize_sharded(model, initial, device)
    optimizer = build_optimizer(model, cfg.optimizer, in_backward=cfg.optimizer_in_backward)
    start_step = 0
    if resume_dir is not None:
        if ckpt_io.read_model_config(resume_dir) != mcfg:
            raise CheckpointError(
                f"checkpoint '{resume_dir}' holds a different model than the config asks for; resume with the "
                f"same model and model_args, or choose another output_dir"
            )
        state = ckpt_io.load_checkpoint(resume_dir, model, optimizer)
        start_step = int(state["step"])
    verb = "pretrain" if cfg.checkpoint_dir is None else f"finetune ({cfg.method})"
    source = cfg.model if cfg.checkpoint_dir is None else cfg.checkpoint_dir
    trainable = "" if num_trainable == num_params else f", {num_trainable:,} trainable"
    sharded = f" x {world} ranks ({cfg.distributed.strategy})" if world > 1 else ""
    if main_rank:
        tqdm.write(
            f"memfit {verb}: model {source} ({num_params:,} parameters{trainable}), tokenizer {tokenizer.kind} "
            f"({tokenizer.vocab_size:,} ids), {data.summary}, batch {cfg.batch_size} x "
            f"{cfg.gradient_accumulation_steps} x {seq_len} tokens{sharded}, dtype {cfg.dtype}, device {device}"
            + (f", resuming at step {start_step}" if start_step else "")
        )

    logger = MetricsLogger(
        out,
        tensorboard=cfg.tensorboard,
        resume_step=start_step if resume_dir else None,
        enabled=main_rank,
    )
    memory = PeakMemory(device)
    run_peak: dict[str, float] = {}
    interval_time, interval_tokens, total_time, total_tokens = 0.0, 0, 0.0, 0
    val_loss = math.nan
    trainer_state = {"config": config_to_dict(cfg), "data_position": "step"}
    if cfg.method != "full":  # the base stays in checkpoint_dir: remember which weights it held
        from memfit.convert import weights_fingerprint

        trainer_state["base_fingerprint"] = weights_fingerprint(cfg.checkpoint_dir)
    step_options = train_step_options(cfg)
    eval_options = {
        "dtype": cfg.dtype,
        "device": device,
        "chunked_cross_entropy_chunks": cfg.chunked_cross_entropy,
    }
    tracker = None
    if cfg.track_memory:
        from memfit.memory.tracker import MemoryTracker, plot_timeline

        tracker = MemoryTracker(model, optimizer)

    def save(step: int) -> Path:
        if world == 1:
            return ckpt_io.save_checkpoint(
                out,
                step,
                model,
                mcfg,
                optimizer,
                trainer_state,
                tokenizer,
                cfg.keep_last_checkpoints,
                trainable_only=cfg.method != "full",
            )
        if cfg.method != "full":  # the few trainable weights, gathered: the same files as one process writes
            return ckpt_io.save_gathered_trainable_checkpoint(
                out, step, model, mcfg, optimizer, trainer_state, tokenizer, cfg.keep_last_checkpoints
            )
        # sharded: every rank writes its own shards (torch.distributed.checkpoint); generate, export and a resume
        # on any number of ranks (one process included) reshard them on load
        return ckpt_io.save_sharded_checkpoint(
            out, step, model, mcfg, optimizer, trainer_state, tokenizer, cfg.keep_last_checkpoints
        )

    # --- the loop ---------------------------------------------------------------------------------------------
    model.train()
    bar = tqdm(
        total=cfg.max_steps,
        initial=start_step,
        desc=verb.split(" ")[0],
        unit="step",
        disable=not (cfg.progress_bar and main_rank),
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
            tuple(t if t is None else t.to(device, non_blocking=True) for t in data.train_batch(step, m))
            for m in range(cfg.gradient_accumulation_steps)
        ]
        tokens_this_step = sum(mb[0].numel() for mb in micro_batches)
        if tracker is None:
            result = train_step(model, optimizer, micro_batches, **step_options)
        else:
            # draw the run's second step (optimizer state exists by then), or its only step; rank 0 draws its own
            plot_this = main_rank and (step == start_step + 1 or step == cfg.max_steps - 1 == start_step)
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
            interval_tokens += tokens_this_step
            record = {
                "step": done,
                "loss": loss,
                "lr": lr,
                "grad_norm": result.grad_norm.item(),
                "tokens_per_second_per_gpu": interval_tokens / max(interval_time, 1e-9),  # this rank's
                **dist_.max_over_ranks(memory.read_and_reset()),  # the peaks of the fullest rank
            }
            if tracker is not None:  # sharded: the breakdown of the rank with the highest tracked peak
                record.update(tracked_memory_fields(tracker))
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
            interval_tokens += tokens_this_step

        # once in a while: evaluate
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.max_steps:
            val_loss = evaluate(model, data.val_batches(), **eval_options)
            if not math.isnan(val_loss):  # NaN: no validation samples (data.val_fraction=0)
                logger.log({"step": done, "val_loss": val_loss})

        # once in a while: checkpoint
        if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done != cfg.max_steps:
            last_ckpt = save(done)
    bar.close()

    # --- the end: final evaluation, checkpoint, plot, sample --------------------------------------------------
    val_loss = evaluate(model, data.val_batches(), **eval_options)
    if start_step < cfg.max_steps:
        if not math.isnan(val_loss):
            logger.log({"step": cfg.max_steps, "val_loss": val_loss})
        last_ckpt = save(cfg.max_steps)
    else:  # resumed a finished run: report, but add nothing to its records or checkpoints
        if main_rank:
            tqdm.write(f"the run in '{out}' is already complete at step {start_step}; nothing to train")
        last_ckpt = resume_dir
    logger.close()
    plot = plot_losses(out / "metrics.jsonl", out / "loss.png") if main_rank else None

    from memfit.generate import generate_text

    sample = ""
    sample_model = model
    if world > 1 and main_rank and cfg.sample.max_new_tokens > 0:
        from memfit.generate import load_for_generation

        sample_model = load_for_generation(last_ckpt, device=device)[0]  # the whole model, on rank 0 alone
    if cfg.sample.max_new_tokens > 0 and main_rank:
        sample = generate_text(
            sample_model,
            tokenizer,
            cfg.sample.prompt,
            max_new_tokens=cfg.sample.max_new_tokens,
            temperature=cfg.sample.temperature,
            top_k=cfg.sample.top_k,
            seed=cfg.seed,
            dtype=cfg.dtype,
            template=run_template(cfg),
        )
    summary = {
        "final_val_loss": None if math.isnan(val_loss) else val_loss,
        "steps": cfg.max_steps,
        "num_params": num_params,
        "num_trainable_params": num_trainable,
        "tokens_per_second_per_gpu": total_tokens / total_time if total_time else None,
        **{k: v for k, v in run_peak.items()},
        "checkpoint": str(last_ckpt),
        "loss_plot": str(plot) if plot else None,
        "sample": sample,
    }
    return summary
