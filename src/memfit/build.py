"""One builder for every entry point: a validated config becomes the run's pieces.

:func:`build_training` is THE build sequence of a run -- architecture, initial weights (random from the seed, or
``checkpoint_dir``'s), the method (LoRA / adapter), activation checkpointing, sharding, materialisation and the
optimizer -- and both the training loop (:mod:`memfit.train`) and the estimator (:mod:`memfit.planner.estimate`)
reach the model through it: real tensors for a run, fake ones for an estimate. The closed-form bytes model and
the planner build the bare architecture with the method through :func:`build_model` on the meta device.

Loading a run back (generation, export) is :func:`load_for_generation`; a run's architecture without its
weights is :func:`run_model_config`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from memfit import checkpoint as ckpt_io
from memfit import distributed as dist_
from memfit.config import TrainConfig, config_from_dict, device_type
from memfit.convert import (
    detect_format,
    load_pretrained,
    pretrained_parameters,
    read_config,
    weights_fingerprint,
)
from memfit.convert.tensors import Entry
from memfit.data.chat_template import ChatTemplate
from memfit.data.templates import Template, resolve_template
from memfit.errors import CheckpointError, ConfigError
from memfit.memory import optimizers
from memfit.memory.host import release_free_heap
from memfit.memory.offload import apply_activation_offloading
from memfit.memory.optim import build_optimizer
from memfit.memory.techniques import (
    apply_activation_checkpointing,
    apply_compile,
    apply_tied_embedding_gradient,
)
from memfit.memory.tensor_parallel import apply_tensor_parallel
from memfit.memory.tiled import apply_tiled_mlp
from memfit.memory.ulysses import apply_sequence_parallel
from memfit.models import adapter, moe, peft
from memfit.models import nf4 as nf4_format
from memfit.models.config import DecoderConfig
from memfit.models.decoder import Decoder, build_decoder, init_parameter_
from memfit.models.nf4 import NF4Builder
from memfit.models.presets import MODEL_PRESETS, model_config
from memfit.tokenizer import load_tokenizer
from memfit.validation import reference_mode, trains_router

PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_mixed": torch.float32}
"""The parameters' dtype under each dtype policy (see :mod:`memfit.step`)."""


# ----------------------------------------------------------------------------------------------------------------
# The architecture
# ----------------------------------------------------------------------------------------------------------------


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU (:func:`memfit.config.device_type`).

    Raises:
        ConfigError: ``cuda`` was asked for and none is available.
    """
    if name == "auto":
        return torch.device(device_type(name))
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "config key 'device': 'cuda' was asked for but torch sees no CUDA device; use device=cpu"
        )
    return torch.device(name)


def resolve_model_config(cfg: TrainConfig, vocab_size: int) -> DecoderConfig:
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
            f"{vocab_size} ids; set model_args.vocab_size={vocab_size} (or more), or use a smaller tokenizer"
        )
    return mcfg


def checkpoint_model_config(path: str | Path) -> DecoderConfig:
    """The architecture of a Hugging Face, Meta or memfit checkpoint, read without the weights."""
    return read_config(path)[0]


def run_model_config(cfg: TrainConfig) -> DecoderConfig:
    """The architecture a run would build, without reading weights or data: ``checkpoint_dir``'s config, or the
    preset with ``model_args``; when the preset has no ``vocab_size``, the tokenizer's (``tokenizer.vocab_size``
    for BPE, the file's for ``file``, 256 for ``char``, whose real size the corpus decides)."""
    if cfg.checkpoint_dir is not None:
        return checkpoint_model_config(cfg.checkpoint_dir)
    tok = cfg.tokenizer
    if tok.kind == "file":
        vocab_size = load_tokenizer(tok.path).vocab_size
    elif tok.kind == "char":
        vocab_size = 256  # the corpus decides; a preset's own vocabulary wins (see resolve_model_config)
    else:
        vocab_size = tok.vocab_size
    return resolve_model_config(cfg, vocab_size)


# ----------------------------------------------------------------------------------------------------------------
# The model and optimizer of a run
# ----------------------------------------------------------------------------------------------------------------


def apply_method(model: Decoder, cfg: TrainConfig) -> None:
    """Add and unfreeze the weights ``cfg.method`` trains (LoRA, QLoRA or adapter; ``full`` trains everything).

    The new weights are initialised from ``cfg.seed``, so a run (and its resume) is a function of its config.
    QLoRA stores the decoder linears in NF4 first (those :func:`load_base` quantized while reading are kept).
    A mixture of experts' routers are frozen in a full fine-tune unless ``moe.train_router`` says otherwise.
    """
    if cfg.method == "full":
        if not trains_router(cfg):
            moe.freeze_routers(model)
        return

    if cfg.method in peft.LORA_METHODS:
        apply = peft.apply_qlora if cfg.method == "qlora" else peft.apply_lora
        apply(
            model,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            dropout=cfg.lora.dropout,
            target_modules=tuple(cfg.lora.target_modules),
            seed=cfg.seed,
            target_parameters=tuple(cfg.lora.target_parameters),
        )
    else:
        adapter.apply_adapter(
            model,
            prompt_length=cfg.adapter.prompt_length,
            num_layers=cfg.adapter.num_layers or None,
            seed=cfg.seed,
        )


def build_model(cfg: TrainConfig, mcfg: DecoderConfig, device: torch.device) -> Decoder:
    """The model a run starts from: random init (pretraining) or ``checkpoint_dir``'s weights, with the method
    applied. Weights are materialised tensor by tensor in the dtype policy's parameter dtype.

    On the meta device nothing is read or drawn: a sharded run shards that model first and then fills each rank's
    shards from :func:`initial_parameters`, which yields exactly the values built here.
    """
    dtype = PARAM_DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)  # the global RNG (dropout) starts from the seed in every case
    if device.type == "meta":
        model = build_decoder(mcfg, device="meta", dtype=dtype)
    elif cfg.checkpoint_dir is None:
        model = build_decoder(mcfg, device=device, dtype=dtype, seed=cfg.seed)
    else:
        model = load_base(cfg, device)
    apply_method(model, cfg)
    return model


def load_base(cfg: TrainConfig, device: torch.device | str) -> Decoder:
    """``checkpoint_dir``'s weights in the dtype policy's parameter dtype; for QLoRA each decoder linear is
    quantized to NF4 as it is read (:func:`memfit.models.peft.quantize_for_qlora`), so host memory peaks near the
    4-bit model plus one tensor's quantization, never the full-precision model.

    Raises:
        CheckpointError: as :func:`memfit.convert.load_pretrained`.
    """
    dtype = PARAM_DTYPES[cfg.dtype]
    qlora = cfg.method == "qlora"
    transform = quantize_while_loading if qlora else None
    stack = functools.partial(nf4_stack, dtype=dtype, device=torch.device(device)) if qlora else None
    return load_pretrained(cfg.checkpoint_dir, device=device, dtype=dtype, transform=transform, stack=stack)[
        0
    ]


class _NF4Stack:
    """A stack of experts quantized to NF4 expert by expert as the files are read (:class:`NF4Builder`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.builder, self.dtype, self.device = NF4Builder(shape, dtype, device), dtype, device

    def put(self, start: int, part: torch.Tensor) -> None:
        self.builder.put(start, part.to(device=self.device, dtype=self.dtype))

    def finish(self) -> torch.Tensor:
        made = self.builder.finish()
        if self.device.type == "cpu":
            release_free_heap()
        return made


def nf4_stack(entry: Entry, part_numel: int, *, dtype: torch.dtype, device: torch.device) -> _NF4Stack | None:
    """QLoRA's :data:`~memfit.convert.tensors.StackFactory`: each stacked expert weight
    (:func:`memfit.models.peft.is_qlora_quantized`) quantized to NF4 as its experts are read, so a layer's experts
    never exist whole in 16 bits (the codes and block maxima fill in place:
    :class:`memfit.models.nf4.NF4Builder`); None (stacked whole, then quantized) for a float32 run, or parts that
    are not whole NF4 blocks."""
    if not peft.quantized_in_parts(entry.name, dtype, part_numel):
        return None
    return _NF4Stack(entry.shape, dtype, device)


def quantize_while_loading(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """QLoRA's ``transform`` of :func:`memfit.convert.load_pretrained`: NF4 for the decoder linears
    (:func:`memfit.models.peft.quantize_for_qlora`), then, on the host, the freed quantization temporaries (a few
    times the tensor's size) are handed back to the kernel (:func:`memfit.memory.host.release_free_heap`):
    without it glibc keeps them as holes between the small NF4 tensors, and a 201M-parameter load's resident
    memory peaked at 3.4x the 4-bit model instead of near it (``bench/load_memory.py``)."""
    quantized = peft.quantize_for_qlora(name, tensor)
    if quantized is not tensor and tensor.device.type == "cpu":
        release_free_heap()
    return quantized


def _check_nf4_sharding(model: Decoder, world_size: int) -> None:
    try:
        peft.check_nf4_sharding(model, world_size)
    except ValueError as exc:
        raise ConfigError(f"config key 'method': {exc}") from None


def check_sharding(cfg: TrainConfig, world_size: int) -> None:
    """What of a sharded run's validity needs the architecture (read from ``checkpoint_dir``'s config, no weight):
    QLoRA's NF4 weights must split evenly over the ranks. For a launcher to refuse before any rank starts.

    Raises:
        ConfigError: naming ``method`` and the first weight that does not split.
    """
    if world_size > 1 and cfg.method == "qlora":
        shards = dist_.shard_ranks(cfg.distributed.replicate, world_size)
        _check_nf4_sharding(build_model(cfg, run_model_config(cfg), torch.device("meta")), shards)


def initial_parameters(
    cfg: TrainConfig, mcfg: DecoderConfig, model: Decoder, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """The starting value of every parameter of ``model`` (built by ``build_model(..., meta)``), one whole tensor
    at a time: what :func:`build_model` gives a materialised model, for a sharded run to keep its part of.

    Base weights are read from ``checkpoint_dir`` (checked against the model before this returns) or drawn in
    ``named_parameters`` order from a generator seeded with ``cfg.seed`` on ``device``, as ``build_decoder`` draws
    them; LoRA / adapter weights are drawn as :func:`memfit.models.peft.apply_lora` / ``apply_adapter`` draw them.

    Raises:
        CheckpointError: ``checkpoint_dir``'s tensors do not match the model (before anything is read).
    """
    dtype = PARAM_DTYPES[cfg.dtype]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    method = [n for n in shapes if n.rsplit(".", 1)[-1] in peft.METHOD_PARAMETERS]
    if cfg.checkpoint_dir is not None:
        base = pretrained_parameters(cfg.checkpoint_dir)
    else:
        generator = torch.Generator(device=device).manual_seed(cfg.seed)
        base = (
            (
                n,
                init_parameter_(
                    n,
                    torch.empty(shape, device=device, dtype=dtype),
                    mcfg.num_layers,
                    generator,
                    mcfg.norm_plus_one,
                ),
            )
            for n, shape in shapes.items()
            if n not in method
        )

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        yield from base
        for n in method:
            yield (
                n,
                peft.init_method_parameter_(n, torch.empty(shapes[n], device=device, dtype=dtype), cfg.seed),
            )

    return tensors()


@dataclass
class TrainingModel:
    """What :func:`build_training` returns: the run's model and optimizer, with its parameter counts."""

    model: torch.nn.Module
    """The model: a :class:`~memfit.models.decoder.Llama` with the method and activation checkpointing applied;
    sharded, FSDP2's module (parameters are DTensor shards) or FSDP1's wrapper."""
    optimizer: torch.optim.Optimizer
    """Over the trainable parameters (an :class:`~memfit.memory.optim.OptimizerInBackward` with
    ``optimizer_in_backward``)."""
    num_params: int
    """Parameters of the whole (unsharded) model."""
    num_trainable: int
    """Of which trainable (all for ``method: full``)."""
    reference: torch.nn.Module | None = None
    """A preference run's resident reference model (``preference.reference: resident``): the starting weights,
    frozen, in the run's dtype, sharded as the policy is; ``None`` otherwise."""


def build_training(
    cfg: TrainConfig,
    mcfg: DecoderConfig,
    device: torch.device,
    *,
    world_size: int = 1,
    fake_mode: Any = None,
) -> TrainingModel:
    """Build a run's model and optimizer: THE build sequence, shared by the training loop and the estimator.

    1. The architecture with the method applied (:func:`build_model`): one process builds it on ``device`` with
       its starting weights; sharded or fake, it is built on the meta device (no rank ever holds the unsharded
       model).
    2. Sharded: the starting tensors (:func:`initial_parameters`), checked against the model before anything is
       allocated.
    3. Sequence parallelism (``distributed.sequence_parallel``: Ulysses attention over this rank's group) or
       tensor parallelism (``distributed.tensor_parallel``: :mod:`memfit.memory.tensor_parallel`), the
       tiled MLP (``tiled_mlp``), a tied embedding's gradient into the chunked loss's (``chunked_cross_entropy``),
       activation checkpointing (``activation_checkpointing``), activation
       offloading around the layers (``activation_offloading``), then ``compile`` (each decoder layer, with its
       checkpointing; the estimator's config has it off: it traces the eager step).
    4. Sharded: FSDP over the process group (:func:`memfit.distributed.shard_model`).
    5. Sharded: each rank fills its shards one whole tensor at a time; fake: every parameter (or shard) gets fake
       storage on the CPU inside ``fake_mode``.
    6. The optimizer (inside ``fake_mode`` when given).

    Args:
        cfg: a validated run config.
        mcfg: the architecture (:func:`run_model_config`, or the one the data's tokenizer decided).
        device: this rank's device (ignored with ``fake_mode``: fake tensors live on the CPU).
        world_size: ranks of the process group the model is sharded over (1: not sharded).
        fake_mode: a ``torch._subclasses.fake_tensor.FakeTensorMode`` to materialise the model and create the
            optimizer in (the estimator's), or ``None`` for real tensors. Steps 1-4 run outside it (FSDP builds
            its device mesh from real data).

    Returns:
        The :class:`TrainingModel`.

    Raises:
        CheckpointError: ``checkpoint_dir``'s tensors do not match the model (before anything is allocated).
    """
    if cfg.compile and mcfg.num_experts is not None:  # before anything is allocated
        raise ConfigError(
            "config key 'compile': a mixture of experts routes by the data (each expert's rows are read on the host "
            "in every layer), which torch.compile cannot trace in one graph; set compile=false"
        )
    on_meta = fake_mode is not None or world_size > 1
    model: torch.nn.Module = build_model(cfg, mcfg, torch.device("meta") if on_meta else device)
    initial = initial_parameters(cfg, mcfg, model, device) if world_size > 1 and fake_mode is None else None
    sp = cfg.distributed.sequence_parallel
    if world_size > 1 and sp > 1:
        apply_sequence_parallel(model, dist_.sequence_group(sp), sp)
    tp = cfg.distributed.tensor_parallel
    if (
        world_size > 1 and tp > 1
    ):  # before checkpointing and FSDP2 (torchtitan's order: TP, AC, compile, FSDP)
        apply_tensor_parallel(model, dist_.tensor_parallel_mesh(cfg.distributed.replicate, tp))
    apply_tiled_mlp(model, cfg.tiled_mlp)
    if cfg.chunked_cross_entropy:
        apply_tied_embedding_gradient(model)
    apply_activation_checkpointing(model, cfg.activation_checkpointing, cfg.activation_checkpointing_interval)
    if cfg.activation_offloading:
        apply_activation_offloading(model)
    if cfg.compile:
        apply_compile(model)
    num_params = sum(p.numel() for p in model.parameters())
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if world_size > 1:
        _check_nf4_sharding(model, dist_.shard_ranks(cfg.distributed.replicate, world_size))
    model = _shard_and_fill(model, cfg, device, world_size, fake_mode, initial)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        optimizer = build_optimizer(
            model,
            cfg.optimizer,
            in_backward=cfg.optimizer_in_backward,
            rounding=optimizers.resolve_rounding(
                cfg.bf16_rounding,
                cfg.optimizer.name,
                device_type(cfg.device),
                cfg.dtype,
                cpu_offload=cfg.optimizer.cpu_offload,
                sharded=world_size > 1,
            ),
        )
    reference = None
    if reference_mode(cfg) == "resident":
        reference = build_reference(cfg, mcfg, device, world_size=world_size, fake_mode=fake_mode)
    return TrainingModel(model, optimizer, num_params, num_trainable, reference)


def build_reference(
    cfg: TrainConfig, mcfg: DecoderConfig, device: torch.device, *, world_size: int = 1, fake_mode: Any = None
) -> torch.nn.Module:
    """A preference run's resident reference: ``checkpoint_dir``'s weights as ``method: full`` loads them (under
    ``method: qlora``, its decoder linears in NF4 as the policy's base: QLoRA's with ``lora_B`` zero, the base's
    own function), frozen and in eval mode, with none of the run's memory switches (it only runs forwards without
    gradients); sharded as the policy is, fake under ``fake_mode``.

    Raises:
        CheckpointError: as :func:`build_model`.
    """
    method = "qlora" if cfg.method == "qlora" else "full"
    ref_cfg = dataclasses.replace(cfg, method=method, moe=dataclasses.replace(cfg.moe, train_router=False))
    on_meta = fake_mode is not None or world_size > 1
    model: torch.nn.Module = build_model(ref_cfg, mcfg, torch.device("meta") if on_meta else device)
    model.requires_grad_(False)
    initial = (
        initial_parameters(ref_cfg, mcfg, model, device) if world_size > 1 and fake_mode is None else None
    )
    return _shard_and_fill(model, ref_cfg, device, world_size, fake_mode, initial).eval()


def _shard_and_fill(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device, world_size: int, fake_mode: Any, initial
) -> torch.nn.Module:
    """:func:`build_training`'s steps 4 and 5 for a model built on meta (one process's, built on ``device``, is
    returned as it is): sharded, FSDP over the process group and each rank's shards filled from ``initial``
    (:func:`initial_parameters`); fake, every parameter (or shard) given fake storage on the CPU inside
    ``fake_mode``."""
    if world_size > 1:
        model = dist_.shard_model(model, cfg, torch.device("cpu") if fake_mode is not None else device)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        if fake_mode is not None:
            model.to_empty(device=torch.device("cpu"))
            peft.empty_nf4_(model, torch.device("cpu"))  # to_empty leaves an NF4 weight's scales on meta
            dist_.unwrap(model).model.reset_rope()
        elif world_size > 1:
            dist_.materialize_sharded(
                model, initial, device, nf4_format.to_nf4 if cfg.method == "qlora" else None
            )
    return model


# ----------------------------------------------------------------------------------------------------------------
# Loading a run back
# ----------------------------------------------------------------------------------------------------------------


def run_template(cfg: TrainConfig, tokenizer: Any) -> Template | None:
    """The prompt template a run's samples are rendered with (``None`` for a text corpus): ``data.template``, or for
    ``auto`` the run's tokenizer's chat template (which a run fine-tuned from a checkpoint with one keeps in its
    saved tokenizer), else ``alpaca`` (:func:`memfit.data.templates.resolve_template`)."""
    return None if cfg.data.format == "text" else resolve_template(cfg.data.template, tokenizer)


def check_base(cfg: TrainConfig, state: dict[str, Any], ckpt: Path) -> None:
    """Check that a LoRA / adapter run's frozen base is still the one it was trained on.

    Raises:
        CheckpointError: the base directory is gone, or its weights differ from those recorded at training.
    """
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


def load_for_generation(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Decoder, object, Template | None]:
    """Load a model, its tokenizer and its prompt template for sampling.

    Args:
        path: a memfit run directory (its newest checkpoint) or checkpoint directory — a LoRA / adapter run's
            checkpoint is its base (``checkpoint_dir``) with the trained weights applied — or a Hugging Face or
            Meta checkpoint directory.
        device: where to put the model.

    Returns:
        ``(model, tokenizer, template)``; ``template`` is the one the run fine-tuned with (``None`` for a text
        corpus), or for a Hugging Face or Meta checkpoint its own chat template
        (:class:`~memfit.data.chat_template.ChatTemplate`) where its tokenizer directory has one, else ``None``.

    Raises:
        CheckpointError: nothing loadable is there, or a file is truncated.
        DataError: the chat template is not valid Jinja (naming its file).
    """
    if detect_format(path) != "memfit":
        model, tokenizer, _ = load_pretrained(path, device=device)
        if tokenizer is None:
            raise CheckpointError(f"checkpoint '{path}' has no tokenizer (tokenizer.json or tokenizer.model)")
        own = ChatTemplate(tokenizer.chat_template) if tokenizer.chat_template is not None else None
        return model.eval(), tokenizer, own
    ckpt = ckpt_io.resolve_checkpoint(path)
    mcfg = ckpt_io.read_model_config(ckpt)
    state = ckpt_io.read_trainer_state(ckpt)
    ckpt_io.check_files(ckpt, state, need_optimizer=False)
    cfg = config_from_dict(state.get("config", {}), check=False)
    dtype = {"bf16": torch.bfloat16}.get(cfg.dtype, torch.float32)
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    if cfg.method == "full":
        model = build_decoder(mcfg, device=device, dtype=dtype, init=False)
    else:  # the frozen base, then the method's weights from the checkpoint
        check_base(cfg, state, ckpt)
        model = load_base(cfg, device)  # the dtype policy's parameter dtype, as `dtype` above
        apply_method(model, cfg)
    ckpt_io.load_weights(ckpt, model)
    model.eval()
    return model, tokenizer, run_template(cfg, tokenizer)
