"""Typed run configuration: dataclasses are the schema, YAML presets and dotted ``key=value`` overrides fill it.

The defaults of :class:`TrainConfig` *are* the main job: pretraining the ``shakespeare`` Llama on the Tiny
Shakespeare text shipped inside the package, with a byte-level BPE tokenizer trained on the training split.

Loading never allocates anything: :func:`load_config` parses, type-checks and validates (:mod:`memfit.validation`,
whose names this module re-exports), and raises :class:`~memfit.errors.ConfigError` naming the offending key.

Example:
    >>> cfg = load_config(None, ["max_steps=10", "optimizer.lr=3e-4"])
    >>> cfg.optimizer.lr
    0.0003
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from memfit import hub
from memfit.errors import ConfigError
from memfit.memory import switches
from memfit.validation import (  # the checks of the schema below, and the allowed values they take
    BPE_MIN_IDS,
    DEVICES,
    MMAP_THRESHOLD_SETTINGS,
    NONFINITE_POLICIES,
    TOKENIZER_KINDS,
    check_lengths,
    device_type,
    memory_budget_bytes,
    model_vocab,
    validate,
)

_require = switches.require


@dataclass
class TokenizerConfig:
    """How text becomes token ids. A config that sets none of these keys takes :func:`default_tokenizer`: these
    defaults, or where the model's vocabulary is fixed smaller (the tiny presets' 256 embeddings) a tokenizer that
    fits it."""

    kind: str = "bpe"
    """``bpe``: byte-level BPE trained with `tokenizers` on the training split only; ``char``: one id per
    character of the training split; ``file``: load ``path`` (tokenizer.json, SentencePiece or tiktoken
    ``tokenizer.model``, or a directory with GPT-2's encoder.json + vocab.bpe)."""
    vocab_size: int = 2048
    """Target vocabulary size when ``kind`` is ``bpe`` (including its two special tokens)."""
    path: str | None = None
    """Tokenizer file or directory when ``kind`` is ``file``."""


@dataclass
class DataConfig:
    """The training data: a text corpus (pretraining) or instruction / chat records (fine-tuning)."""

    path: str | None = None
    """``format: text``: a prepared token dataset (a ``memfit prepare`` output directory, with ``manifest.json``),
    or raw text that the run prepares into ``output_dir/data`` first (once; later runs reuse it): a file, a
    directory or a glob of ``.txt``, ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` or ``.parquet`` files (one source),
    or a directory of one sub-directory per source (RedPajama's layout). ``None`` is the Tiny Shakespeare text
    shipped inside the package. Other formats: a ``.json`` or ``.jsonl`` file of records. Either may be a Hugging
    Face Hub dataset, ``ORG/NAME`` or ``ORG/NAME@REVISION``, where no local path of that spelling exists
    (:mod:`memfit.hub`; docs/data.md, "Datasets from the Hub")."""
    files: str | None = None
    """Which files of a Hub dataset (or of a ``data.path`` directory) to read: a pattern over their paths as
    huggingface_hub's ``allow_patterns`` reads it (fnmatch: ``*`` also matches ``/``), e.g.
    ``data/train-*.parquet``. ``None``: every file memfit reads (:func:`memfit.hub.select_files`)."""
    split: str | None = None
    """Keep the files whose path names this split as a word (``train`` selects ``train.jsonl``,
    ``data/train-00000-of-00002.parquet``); ``None``: every split."""
    format: str = "text"
    """``text`` (a corpus, cut into random windows), ``alpaca`` (``instruction``, ``input``, ``output``),
    ``dolly`` (``instruction``, ``context``, ``response``), ``sharegpt`` (``conversations`` of ``from``/``value``)
    or ``openai`` (``messages`` of ``role``/``content``)."""
    template: str = "auto"
    """Prompt template of instruction / chat formats: ``auto`` (the checkpoint's own chat template, its
    ``chat_template.jinja`` or the ``chat_template`` of its ``tokenizer_config.json``, rendered with Jinja as
    transformers does; ``alpaca`` where the tokenizer has none), or a built-in one: ``alpaca``, ``llama2-chat``,
    ``llama3-chat`` (needs the Llama 3 special tokens in the tokenizer) or ``chatml``. ``memfit generate`` applies
    the same one."""
    column_map: dict[str, str] = field(default_factory=dict)
    """Rename record fields, e.g. ``{instruction: question, output: answer}``."""
    train_on_prompt: bool = False
    """Also train on prompt tokens (by default only the replies count in the loss)."""
    packing: bool = False
    """Pack several samples into each ``seq_len`` row (no padding waste); attention and positions stay within
    each sample (a block-diagonal causal mask), so a packed row computes what its samples would alone."""
    skip_malformed: bool = False
    """Skip (and count) malformed records instead of stopping with an error that names the file and record."""
    val_fraction: float = 0.1
    """Fraction held out for validation: of raw text prepared by the run (record files: documents chosen by a hash
    of their text, at least 16,384 characters of each source where it can; a ``.txt`` file: its tail, cut at a line
    boundary; the tokenizer is trained on the training part only), or of instruction records (a seeded random
    choice; 0 turns validation off). A prepared dataset keeps the split it was prepared with."""
    weights: dict[str, float] = field(default_factory=dict)
    """Mixture weights of the sources of a text dataset, e.g. ``{web: 0.67, books: 0.045}`` (any scale; a source
    left out or weighted 0 is not trained on). Empty: each source in proportion to its training tokens."""
    cross_document_attention: bool = True
    """``false``: attention and positions stay within each document of a training window (a block-diagonal mask
    from the BOS/EOS separators, as packed samples use), instead of running across document boundaries."""


@dataclass
class LoraConfig:
    """LoRA (Hu et al. 2021): trainable low-rank updates ``(alpha / rank) * B @ A`` beside frozen weights."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    """Probability in [0, 1) of zeroing an input of the low-rank path while training. Its masks come from each
    process's global generator, so N ranks draw other masks than one process: a sharded run equals a one-process
    run only with 0 (docs/distributed.md, "The batch")."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head (empty when
    ``target_parameters`` names something)."""
    target_parameters: list[str] = field(default_factory=list)
    """A mixture of experts' stacked weights to adapt, as PEFT's ``target_parameters``: mlp.experts.gate_up_proj,
    mlp.experts.down_proj (each expert's matrix gets a LoRA of its own; needs ``dropout: 0``)."""


@dataclass
class AdapterConfig:
    """LLaMA-Adapter (Zhang et al. 2023): learned prompt tokens with zero-initialised gating in the top layers."""

    prompt_length: int = 10
    """Learned prompt tokens per adapted layer."""
    num_layers: int = 0
    """Adapt the top ``num_layers`` decoder layers; 0 means all of them."""


@dataclass
class OptimizerConfig:
    """The optimizer and its hyperparameters."""

    name: str = field(
        default="adamw",
        metadata={"shown": "'muon' | 'adamw'", "help": "muon from scratch, adamw from pretrained weights"},
    )
    """An entry of :data:`memfit.memory.optimizers.OPTIMIZERS`: ``adamw`` (torch.optim.AdamW, 8 bytes/parameter of
    state in fp32), bitsandbytes' 8-bit and paged ones, torchao's low-bit ones, and the optimizers that keep less
    state: ``muon``, ``adafactor``, ``apollo``, ``apollo_mini``, ``adam_mini`` (the table in that module and
    docs/memory.md). Left out of a run's config it is :func:`default_optimizer`'s: ``muon`` when training from
    scratch (the main job), ``adamw`` when fine-tuning (``checkpoint_dir``, or ``method`` other than ``full``),
    with ``distributed.strategy: fsdp1`` or with ``optimizer.cpu_offload``."""
    implementation: str = "foreach"
    """``foreach`` (multi-tensor, holds one parameter-sized set of temporaries at the step), ``for_loop`` (one
    tensor at a time; least memory), ``fused`` (one fused kernel)."""
    lr: float = 2e-3
    """Peak learning rate, reached at the end of warm-up."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay (``max_steps``)."""
    warmup_steps: int = 25
    """Steps of linear warm-up from 0 to ``lr``."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms, biases or 1-D tensors)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    cpu_offload: bool = False
    """Keep optimizer state and the update on the CPU (torchao ``CPUOffloadOptimizer``); CUDA only."""
    momentum: float = 0.95
    """``muon``: momentum of the hidden matrices' buffer (torch.optim.Muon's default, Keller Jordan's Muon)."""
    nesterov: bool = True
    """``muon``: Nesterov momentum (torch.optim.Muon's default)."""
    ns_steps: int = 5
    """``muon``: Newton-Schulz iterations that orthogonalise each update (torch.optim.Muon's default)."""
    muon_ns_dtype: str = "auto"
    """``muon``: the dtype of the Newton-Schulz iteration: ``auto`` (bf16 on CUDA and on a CPU with bf16 matrix
    instructions, AMX-BF16 or AVX512-BF16; fp32 on other CPUs, where bf16 matmuls are emulated ~30x slower than
    fp32 ones), ``bf16`` (torch.optim.Muon's, always) or ``fp32`` (the same iteration, closer to the exact
    orthogonalisation; twice the bytes of its temporaries)."""
    adjust_lr_fn: str = "match_rms_adamw"
    """``muon``: the learning-rate rule of an m x n matrix. ``match_rms_adamw`` (Moonlight, Liu et al. 2025:
    ``0.2 * sqrt(max(m, n)) * lr``, so Muon's update has AdamW's RMS and reuses AdamW's ``lr`` and
    ``weight_decay``) or ``original`` (Keller Jordan's ``sqrt(max(1, m / n)) * lr``, with ``lr`` ~0.02)."""
    adamw_lr: float = 0.0
    """``muon``: peak learning rate of the AdamW group (embedding, ``lm_head``, 1-D tensors); 0: ``lr``. It
    follows the same warm-up and decay (its ratio to ``lr`` is kept)."""
    beta2_decay: float = -0.8
    """``adafactor``: the second-moment decay exponent, ``beta2_t = 1 - t ** beta2_decay`` (torch's default)."""
    clipping_threshold: float = 1.0
    """``adafactor``: the update-clipping threshold ``d`` (Shazeer and Stern 2018; torch's default)."""
    apollo_rank: int = 0
    """``apollo``/``apollo_mini``: rank of the gradient projection; 0: a quarter of the model width for ``apollo``
    (GaLore's and APOLLO's pretraining runs) and 1 for ``apollo_mini``. At most each matrix's smaller side."""
    apollo_scale: float = 0.0
    """``apollo``/``apollo_mini``: APOLLO's gradient scale factor alpha (its update is multiplied by
    ``sqrt(alpha)``); 0: the authors' defaults, 1 for ``apollo`` (channel-wise scaling) and 128 for
    ``apollo_mini`` (tensor-wise)."""
    update_proj_gap: int = 200
    """``apollo``/``apollo_mini``: steps between new random projections (the authors' default)."""


@dataclass
class SampleConfig:
    """The text generated at the end of a run."""

    prompt: str = "ROMEO:"
    max_new_tokens: int = 200
    temperature: float = 0.8
    """0 means greedy decoding."""
    top_k: int = 50
    """Sample among the ``top_k`` most likely tokens; 0 means no restriction."""


@dataclass
class MoeConfig:
    """A mixture-of-experts model's training options (:mod:`memfit.models.moe`); a dense model ignores them."""

    train_router: bool | None = None
    """The routers (``mlp.gate.weight``) train; None: when pretraining, and not when fine-tuning (``checkpoint_dir``
    set), as peers fine-tune (unsloth, axolotl: the experts each token reaches stay the checkpoint's). True is for
    ``method: full`` only."""
    router_aux_loss_coef: float | None = None
    """Weight of the load-balancing loss (Switch Transformer) added to the objective; None is the checkpoint's
    ``router_aux_loss_coef`` when the routers train, else 0. A positive weight needs ``train_router``."""


@dataclass
class PreferenceConfig:
    """A preference objective's settings (``objective`` dpo, ipo, simpo or orpo; :mod:`memfit.objectives`), named
    as TRL names them."""

    beta: float = 0.1
    """DPO's and SimPO's inverse temperature, IPO's regularisation (tau), ORPO's odds-ratio weight (lambda)."""
    label_smoothing: float = 0.0
    """dpo and simpo: the probability that a pair's preference is flipped (conservative DPO), in [0, 0.5)."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin (gamma)."""
    cpo_alpha: float = 0.0
    """simpo: weight of the chosen replies' cross-entropy added to the loss (TRL's ``cpo_alpha``)."""
    reference: str = "auto"
    """Where DPO's and IPO's reference log-probabilities come from: ``lora_off`` (the LoRA / QLoRA policy with
    its adapters switched off: no second model), ``precomputed`` (one pass of the starting model over the pairs
    before training, stored on disk and reused: training holds one model), ``resident`` (a frozen copy of the
    starting weights beside the policy, in the run's dtype), or ``auto``: lora_off for LoRA and QLoRA,
    precomputed otherwise. SimPO and ORPO need none."""
    reference_dir: str | None = None
    """Where precomputed reference log-probabilities are stored; ``None``: ``.memfit_reference`` beside
    ``data.path``. Keyed by a hash of the checkpoint, the rendered pairs (data, template, seq_len) and dtype."""
    reference_batch_size: int = 0
    """Pairs per forward of the precompute pass; 0: ``batch_size``."""


@dataclass
class EstimateConfig:
    """What an estimate assumes where memory depends on the data (``memfit estimate``, ``plan`` and the pre-flight
    of a run)."""

    moe_skew: float = 2.0
    """A mixture of experts' routing: balanced top-k, the busiest expert receiving this many times its average
    share of the routed tokens (MindSpeed's threshold, 2.0); at least 1."""
    moe_bound: bool = False
    """Take the bound instead, every token of a micro-batch at the same k experts, as the figure the pre-flight
    holds against the budget (both figures are reported either way)."""


@dataclass
class DistributedConfig:
    """Sharding over the ranks of a ``torchrun`` launch (ignored in a single process). See
    :mod:`memfit.distributed`. Each group of ``sequence_parallel`` ranks trains on its own ``batch_size``
    sequences: a step sees ``batch_size * gradient_accumulation_steps * world_size / sequence_parallel``
    sequences."""

    strategy: str = "fsdp2"
    """``fsdp2`` (``fully_shard`` per decoder layer plus the root; DTensor parameters) or ``fsdp1``
    (``FullyShardedDataParallel``, one unit per decoder layer, ``use_orig_params``)."""
    reshard_after_forward: bool = True
    """Free each layer's gathered weights after its forward and gather them again for backward (ZeRO-3: least
    memory); false keeps them until backward (ZeRO-2-like: one all-gather fewer per layer, more memory)."""
    prefetch: int = 1
    """Layers whose all-gather is issued ahead of use (overlaps communication with compute; each costs one
    layer's unsharded weights). 0 leaves it to FSDP's defaults (fsdp1: no prefetching)."""
    cpu_offload: bool = False
    """Keep parameter shards, gradients and the optimizer step on the host (FSDP2 ``CPUOffloadPolicy`` / FSDP1
    ``CPUOffload``); CUDA only: on CPU everything is already in host memory."""
    limit_all_gathers: bool = True
    """fsdp1 only: rate-limit all-gathers issued ahead so at most two layers' unsharded weights exist at once."""
    sequence_parallel: int = 1
    """N > 1: sequence parallelism (DeepSpeed-Ulysses, :mod:`memfit.memory.ulysses`). The ranks form a 2-D mesh,
    ``world_size / N`` data-parallel groups of N consecutive ranks; a group shares one batch of sequences and each
    rank holds ``seq_len / N`` consecutive tokens of it, exchanging heads for tokens around attention (an
    all-to-all). FSDP2 shards parameters over all ranks. N divides ``world_size``, ``num_heads`` and ``seq_len``."""
    replicate: int = 1
    """R > 1: hybrid sharding (HSDP). The ranks form R replicas of ``world_size / R`` consecutive ranks each; FSDP2
    shards the parameters within a replica (a node's fast links) and all-reduces gradients across the replicas
    (the network), so an all-gather never leaves a node. R divides ``world_size``; ``fsdp2`` only."""
    tensor_parallel: int = 1
    """T > 1: tensor parallelism (Megatron-LM's split, through ``torch.distributed.tensor.parallel``) over groups
    of T consecutive ranks: q/k/v and gate/up column-wise, o and down row-wise, the norms and the residual stream
    sequence-parallel between them, the loss parallel over the vocabulary. A group shares one batch; FSDP2 shards
    over the ``world_size / T`` groups (:mod:`memfit.memory.tensor_parallel`). T divides ``world_size`` and the
    model's heads."""


@dataclass
class PrepareConfig:
    """``memfit prepare``: raw text sources -> a prepared token dataset (see :mod:`memfit.data.prepare`). Field
    names are the command's ``key=value`` options (``--out``, ``--tokenizer`` and ``--workers`` set the first
    three)."""

    out: str = ""
    """The dataset directory to write (new or empty; or one this command prepared, to resume or extend it)."""
    tokenizer: str | None = None
    """A tokenizer file (``tokenizer.json``, ``tokenizer.model``) or a Hugging Face / Meta / memfit checkpoint
    directory. ``None``: a byte-level BPE of ``vocab_size`` ids trained on a sample of the training documents."""
    workers: int = 0
    """Worker processes; 0 is one per CPU core this process may use."""
    vocab_size: int = 2048
    """Ids of the BPE trained when no ``tokenizer`` is given (its two special tokens included)."""
    char_tokenizer: bool = False
    """With no ``tokenizer``: one id per character of the sample instead of a BPE (no BOS/EOS separators)."""
    tokenizer_sample_bytes: int = 64 * 1024**2
    """Characters of training documents the BPE is trained on (the first ones, in source and file order)."""
    val_fraction: float = 0.01
    """Share held out for validation: of the documents of record files, chosen by a hash of each document's text
    (a source held out less than 16,384 characters also holds out its documents of smallest hash until it has
    them, :mod:`memfit.data.split`); of each ``.txt`` file (one document), its tail, cut at a line boundary."""
    text_field: str = "text"
    """The JSON field (``.jsonl``) or column (``.parquet``) that holds each document's text."""
    shard_tokens: int = 2**24
    """Tokens per training shard (16,777,216: 32 MiB of ``uint16``); a shard ends at a document boundary."""
    skip_malformed: bool = False
    """Skip (and count) bad records instead of stopping at the first with its file and line."""
    num_nodes: int = 1
    """Machines preparing disjoint parts of the same corpus into one shared ``out`` (see docs/data.md)."""
    node_rank: int = 0
    """This machine's number, ``0 .. num_nodes - 1``."""


def show_progress(setting: bool | None) -> bool:
    """Whether to show a progress bar: ``setting`` when it is given, else (``None``, auto) when stderr is a
    terminal, so that logs and pipes get no carriage-return lines.

    Args:
        setting: ``progress_bar`` (or ``memfit prepare``'s ``--progress`` / ``--quiet``); ``None`` is auto.
    """
    if setting is not None:
        return setting
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def validate_prepare(cfg: PrepareConfig) -> None:
    """Check :class:`PrepareConfig` before anything is read or written.

    Raises:
        ConfigError: naming the offending key.
    """
    _require(bool(cfg.out), "out", "is required: the directory to write the dataset to (--out DIR)")
    _require(cfg.workers >= 0, "workers", f"must be >= 0 (0: one per core), got {cfg.workers}")
    _require(
        cfg.vocab_size >= 258 or cfg.tokenizer is not None or cfg.char_tokenizer,
        "vocab_size",
        f"a byte-level BPE needs >= 258 ids, got {cfg.vocab_size}",
    )
    _require(cfg.tokenizer_sample_bytes >= 1, "tokenizer_sample_bytes", "must be >= 1")
    _require(0 <= cfg.val_fraction < 1, "val_fraction", f"must be in [0, 1), got {cfg.val_fraction}")
    _require(bool(cfg.text_field), "text_field", "must name a field")
    _require(cfg.shard_tokens >= 1024, "shard_tokens", f"must be >= 1024, got {cfg.shard_tokens}")
    _require(cfg.num_nodes >= 1, "num_nodes", f"must be >= 1, got {cfg.num_nodes}")
    _require(
        0 <= cfg.node_rank < cfg.num_nodes,
        "node_rank",
        f"must be in [0, num_nodes), got {cfg.node_rank} with num_nodes={cfg.num_nodes}",
    )
    _require(
        cfg.tokenizer is None or not cfg.char_tokenizer,
        "char_tokenizer",
        "makes a tokenizer from the text; it cannot be combined with a given tokenizer",
    )


def load_prepare_config(overrides: list[str], **given: Any) -> PrepareConfig:
    """A validated :class:`PrepareConfig` from ``key=value`` overrides and the command's own options.

    Raises:
        ConfigError: an unknown key, a value of the wrong type or an impossible value (named).
    """
    tree = _merge({k: v for k, v in given.items() if v is not None}, parse_overrides(overrides))
    cfg = _from_dict(PrepareConfig, tree)
    if cfg.workers == 0:
        cfg.workers = (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        )
    validate_prepare(cfg)
    return cfg


@dataclass
class TrainConfig:
    """One run: pretraining, or fine-tuning (``checkpoint_dir`` set) with ``method`` full, lora, qlora or adapter.

    Field names are the CLI's dotted override keys (``optimizer.lr=3e-4``). A memory switch's field is declared
    here with its type and default; everything else about it (allowed values, conflicts, how it is applied, what
    the estimator and the planner do with it) is its entry in :data:`memfit.memory.switches.SWITCHES`, found by its
    key (``key="activation_offloading"``)."""

    model: str = "shakespeare"
    """Model preset (see :mod:`memfit.models.presets`)."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """Overrides of the preset's :class:`~memfit.models.decoder.DecoderConfig` fields, e.g.
    ``model_args.num_layers=4``."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(name=default_optimizer(None)))
    sample: SampleConfig = field(default_factory=SampleConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)

    objective: str = "next_token"
    """``next_token`` (cross-entropy: pretraining and supervised fine-tuning) or a preference objective over
    pairs of replies (``data.format: preference``): ``dpo``, ``ipo``, ``simpo`` or ``orpo``
    (:mod:`memfit.objectives`; settings under ``preference``)."""
    method: str = "full"
    """``full`` (every weight trains), ``lora``, ``qlora`` or ``adapter`` (only the small added weights train:
    they alone get gradients and optimizer state; needs ``checkpoint_dir``). ``qlora`` is LoRA (settings under
    ``lora``) over a base whose decoder linears are stored in 4-bit NormalFloat (:mod:`memfit.models.peft`)."""
    checkpoint_dir: str | None = None
    """Start from these weights (fine-tuning): a Hugging Face directory (config.json + safetensors), Meta's
    original format (params.json + consolidated.*.pth) or a memfit run / checkpoint directory; or a Hugging Face
    Hub model, ``ORG/NAME`` or ``ORG/NAME@REVISION``, fetched into huggingface_hub's cache (a local path of that
    spelling wins; :mod:`memfit.hub`, docs/finetuning.md, "Checkpoints from the Hub"). The architecture
    and the tokenizer come from it (``model``, ``model_args`` and ``tokenizer`` are then not used). ``None``:
    random initialisation of ``model`` (pretraining)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)

    output_dir: str = "out/shakespeare"
    """Where checkpoints, tokenized data, ``metrics.jsonl``, TensorBoard events and the loss plot go."""
    max_steps: int = 250
    """Optimizer steps of the run (each of ``batch_size * gradient_accumulation_steps`` sequences)."""
    seed: int = 1337
    """Seeds weight init, batch sampling and generation: a run is a function of its config."""
    batch_size: int = 16
    """Sequences per micro-batch (per forward/backward)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step. The loss is weighted by token count, so it equals the loss of one
    batch of ``batch_size * gradient_accumulation_steps`` sequences; activation memory stays that of one micro-batch."""
    seq_len: int = 0
    """Tokens per training sequence; 0 means the model's ``max_seq_len``."""
    max_grad_norm: float = 1.0
    """Clip the global gradient L2 norm to this value; 0 disables clipping (``grad_norm`` is still logged)."""
    dtype: str = "fp32"
    """``fp32``: everything fp32. ``bf16``: weights, gradients and optimizer state bf16 (loss in fp32).
    ``bf16_mixed``: fp32 weights, gradients and optimizer state, forward/backward under bf16 autocast."""
    bf16_rounding: str = "auto"
    """How a bf16 weight (``dtype: bf16``; ignored otherwise) takes its update (:mod:`memfit.memory.rounding`):
    ``nearest`` (the optimizer writes the bf16 weight, each result rounded to nearest: small updates are lost),
    ``stochastic`` (the update computed on an fp32 copy of each chunk, rounded up or down at random, unbiased;
    seeded by ``seed``, its stream saved in checkpoints), ``kahan`` (computed on the weight plus a bf16
    compensation buffer, rounded to nearest: 2 bytes/parameter more state) or ``auto`` (``stochastic`` where the
    optimizer can round so, else ``nearest``: bitsandbytes on CUDA, ``optimizer.cpu_offload``, a sharded run for
    now). ``auto`` because stochastic rounding matched fp32 AdamW's validation loss where ``nearest`` lost 2.2%
    (docs/benchmarks.md, "bf16 weights that learn")."""
    device: str = "auto"
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda``."""

    # --- memory techniques: one switch each (trade-offs in docs/memory.md) ---
    optimizer_in_backward: bool = False
    """Run each parameter's update inside backward as soon as its gradient is ready, then free the gradient:
    no full set of gradients ever exists. Needs ``gradient_accumulation_steps == 1`` and ``max_grad_norm == 0``
    (``grad_norm`` is still reported, computed before each update)."""
    activation_checkpointing: str = "none"
    """``none``; ``selective`` (every decoder layer keeps its matmul and attention outputs and recomputes only the
    cheap elementwise ops in backward: norms, RoPE, SiLU, products; no matmul is redone); ``full`` (every decoder
    layer recomputes its activations in backward: ~1/3 more compute) or ``every_n`` (every
    ``activation_checkpointing_interval``-th layer, fully)."""
    activation_checkpointing_interval: int = 2
    """``n`` for ``activation_checkpointing: every_n``."""
    activation_offloading: bool = False
    """Move tensors saved for backward outside checkpointed layers to pinned host memory during the forward (a side
    stream, overlapped) and bring them back one ahead in the backward: with ``activation_checkpointing: full`` the
    offloaded checkpoints (every layer's input on the host, one or two on the device). On CPU the host is the
    device: nothing moves."""
    chunked_cross_entropy: int | str = 0
    """Compute the loss in this many chunks of tokens, each chunk's gradients with respect to the hidden states and
    ``lm_head``'s weight computed in the same pass (a fused linear cross-entropy), so the full
    ``(B, T, vocab_size)`` logits never exist and the backward recomputes nothing; 0 is off. ``auto``: chunks of at
    most 2^25 logits and 2,048 tokens each (261 tokens for Llama 3's vocabulary), bounded at any sequence length."""
    tiled_mlp: int | str = 0
    """Run each decoder layer's SwiGLU MLP over the tokens in this many tiles, recomputing each tile in the backward,
    so its ``(B, T, intermediate_size)`` tensors exist for one tile at a time (Arctic Long Sequence Training's
    TiledMLP); 0 is off. ``auto``: tiles of about ``dim`` tokens. Costs one more MLP forward per layer."""
    compile: bool = False
    """``torch.compile`` each decoder layer (with its activation checkpointing, LoRA or adapter) and the loss, as
    torchtitan does: the layers share one compiled graph. The first steps pay the compilation (seconds to minutes;
    cached on disk by TorchInductor for later runs); see docs/memory.md for what it gains and how compiled
    peaks differ from the eager step the estimator traces."""
    preflight: bool = True
    """Before allocating, check that the run fits (free CUDA memory, or available host RAM) and refuse it with the
    predicted breakdown and the planner's cheapest fix when it does not (see
    :func:`memfit.planner.preflight.preflight`)."""
    memory_budget: str | None = field(
        default=None, metadata={"help": "none: the free memory alone; e.g. 40GiB", "size": True}
    )
    """The most memory the run may take on each device, e.g. ``40GiB`` (GiB = 1024**3 bytes; also MiB, TiB) or
    ``40GB`` (GB = 10**9 bytes): on CUDA the device total as the driver shows it, on CPU the process's peak
    resident set; sharded, per rank. The pre-flight refuses a run predicted over it (as over the free memory) with
    the planner's cheapest fix; ``preflight: false`` turns that check off too. ``memfit plan`` takes it as its
    ``budget`` when none is given. ``None``: the free device memory (or available host memory) alone."""
    mmap_threshold: str = "auto"
    """CPU runs on glibc: ``fixed`` holds the C allocator's mmap threshold at 128 KiB from the start of the run, so
    every tensor of at least that size is given back to the kernel when freed (no free heap is kept: the peak RSS is
    what the estimator predicts, at the cost of faulting temporaries in again each step); ``dynamic`` leaves glibc's
    rising threshold (the heaps keep freed memory: faster steps on small models, and holes that grow to gigabytes on
    large ones); ``auto``: ``fixed`` for LoRA, QLoRA and adapter runs of models of ``dim`` >= 2048 (no slower there),
    else ``dynamic`` (a full fine-tune's optimizer faults its few-MiB temporaries in again: 2.2x the step time at
    dim 3,072). A ``MALLOC_*`` setting in the environment wins over all three (docs/memory.md, "Host memory (RSS)
    on CPU")."""
    track_memory: bool = False
    """Track live bytes by category (parameters, gradients, optimizer_state, activations, temporaries; sharded,
    also unsharded_parameters, what FSDP has all-gathered); adds ``memory_breakdown`` (GiB at the interval's
    peak), ``memory_peak_phase`` and ``memory_category_peaks`` (each category's own peak) to step records and
    writes ``memory_timeline.png`` of one step. Sharded, each rank tracks its own memory and the record holds the
    breakdown of the rank with the highest peak (``memory_peak_rank``). Costs speed."""

    on_nonfinite: str = "stop"
    """What a step with a non-finite loss or gradient norm (NaN, inf: the run diverged) does. ``stop``: the run
    stops with an error naming the step, found at the next step record, evaluation or checkpoint (no extra host
    sync in the step). ``skip``: the step's update is not applied, and the run stops after
    ``max_nonfinite_steps`` such steps in a row (one host sync per step; not with ``optimizer_in_backward``,
    whose updates happen during backward). Either way a model with non-finite weights is never saved."""
    max_nonfinite_steps: int = 3
    """``on_nonfinite: skip``: stop after this many consecutive skipped steps."""

    peak_flops: float = 0.0
    """The device's peak FLOP/s for the run's dtype, the denominator of ``mfu`` in the step records; 0: the GPU's
    data-sheet peak (:data:`memfit.flops.CUDA_PEAK_FLOPS`) or, on CPU, the best matmul probe measured on this
    machine (:func:`memfit.flops.cpu_matmul_flops_per_second`)."""

    log_every: int = 10
    """Steps between step records (stdout, metrics.jsonl, TensorBoard). Memory peaks are since the last record."""
    eval_every: int = 50
    """Steps between validation losses; 0 disables periodic validation (the final one always runs)."""
    eval_batches: int = 10
    """Validation micro-batches per evaluation (the same fixed windows every time)."""
    checkpoint_every: int = 100
    """Steps between checkpoints; 0 saves only the final one."""
    keep_last_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    resume: bool = False
    """Continue from the newest complete checkpoint in ``output_dir`` (safe after SIGKILL at any moment)."""
    loss_plot: bool = True
    """Draw the training and validation losses into ``output_dir/loss.png`` at the end of the run (matplotlib)."""
    tensorboard: bool | None = field(
        default=None, metadata={"help": "auto: written when the tensorboard package is installed"}
    )
    """TensorBoard events under ``output_dir/tensorboard``: ``null`` (auto) writes them when the ``tensorboard``
    package is installed and says nothing when it is not (it is an extra); ``true`` asks for them, and a run
    without the package says so once; ``false`` never."""
    wandb: bool = False
    """Also log the step records to Weights & Biases (needs the ``wandb`` package and ``wandb_project``); the run
    lives under ``output_dir/wandb``, and under ``WANDB_MODE=offline`` it stays there until ``wandb sync``."""
    wandb_project: str | None = None
    """The W&B project of the run; required with ``wandb: true``."""
    wandb_run_name: str | None = None
    """The W&B run's display name; ``None``: the name of ``output_dir``."""
    progress_bar: bool | None = field(
        default=None, metadata={"help": "auto: shown when stderr is a terminal"}
    )
    """A tqdm progress bar on stderr: ``null`` (auto) shows it when stderr is a terminal, ``true`` always,
    ``false`` never (see :func:`show_progress`)."""

    @property
    def model_source(self) -> str:
        """Where the run's model comes from, as its lines name it: ``checkpoint_dir`` when set, else the ``model``
        preset."""
        return self.model if self.checkpoint_dir is None else str(self.checkpoint_dir)


# ----------------------------------------------------------------------------------------------------------------
# Parsing: YAML/dicts -> dataclasses, with the key named in every error
# ----------------------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert int -> float where a float is expected. No key
    takes a non-finite number (YAML's ``.inf``, ``.nan``)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}' expects {tp}, got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; give its fields, e.g. '{key}.<field>=...'")
        return _from_dict(tp, value, key + ".")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' expects a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__})")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` of a config dataclass, once per class (the planner builds thousands of configs:
    evaluating the annotations each time was half of ``memfit plan``'s set-up)."""
    return typing.get_type_hints(cls)


def _from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    hints = _type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    names = list(by_name)
    kwargs = {}
    for key, value in data.items():
        if (
            key in by_name
            and by_name[key].metadata.get("size")
            and isinstance(value, int | float)
            and not isinstance(value, bool)
        ):
            value = str(value)  # a size without its unit (40): validation says what to write, naming the key
        if key not in names:
            nested = _nested_match(cls, str(key), prefix)
            close = difflib.get_close_matches(str(key), names, n=1)
            if nested:
                hint = f"; did you mean '{nested}'?"
            elif close:
                hint = f"; did you mean '{prefix}{close[0]}'?"
            else:
                hint = f"; known keys: {', '.join(names)}"
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _coerce(value, hints[key], prefix + key)
    return cls(**kwargs)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``tree[a][b] = value`` for ``dotted`` ``a.b`` (sections made as needed).

    Raises:
        ConfigError: a part of ``dotted`` names a value, not a section.
    """
    parts = dotted.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is not a section")
        node = child
    node[parts[-1]] = value


def describe_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every dotted config key with its default, e.g. ``optimizer.lr = 0.002``, for ``--help`` (and a field's
    ``metadata["help"]`` where a default needs words, e.g. ``None`` meaning auto)."""
    cls = cls or TrainConfig
    lines = []
    for f in dataclasses.fields(cls):
        tp = _type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            lines += describe_keys(tp, prefix + f.name + ".")
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        note = f"  ({f.metadata['help']})" if "help" in f.metadata else ""
        shown = f.metadata.get("shown", repr(default))  # where the default depends on the run
        lines.append(f"{prefix}{f.name} = {shown}{note}")
    return lines


def _nested_match(cls: type, key: str, prefix: str = "") -> str | None:
    """The dotted path of a field named ``key`` in a nested section (``warmup_steps`` -> ``optimizer.warmup_steps``)."""
    for f in dataclasses.fields(cls):
        tp = _type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            if key in {g.name for g in dataclasses.fields(tp)}:
                return f"{prefix}{f.name}.{key}"
    return None


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """Turn ``["optimizer.lr=3e-4", "resume=true"]`` into a nested dict; values are parsed as YAML scalars.

    Raises:
        ConfigError: an override is not of the form ``key=value``.
    """
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. max_steps=100)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        if isinstance(value, dict | list) and not raw.lstrip().startswith(("{", "[")):
            value = raw  # "sample.prompt=ROMEO:" is text, not a YAML mapping
        if isinstance(value, str) and _looks_like_float(value):
            value = float(value)  # YAML 1.1 reads "3e-4" as a string
        set_dotted(tree, key.strip(), value)
    return tree


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return text.strip().lower() not in ("nan", "inf", "-inf", "infinity", "-infinity")


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "model_args":
            out[key] = _merge(out[key], value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    *,
    world_size: int = 1,
    needs_weights: bool = True,
) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from an optional YAML file and dotted overrides.

    Args:
        path: YAML file whose keys are :class:`TrainConfig` fields (nested sections as mappings), or ``None``
            for the defaults (the Tiny Shakespeare main job).
        overrides: ``key=value`` strings applied after the file, e.g. ``["optimizer.lr=3e-4"]``.
        defaults: nested values applied before the file (a verb's own defaults, e.g. ``memfit finetune``'s
            ``output_dir``).
        world_size: the ranks the run will have (see :func:`validate`).
        needs_weights: see :func:`validate` (off for ``memfit estimate`` / ``plan``).

    Returns:
        The configuration, validated.

    Raises:
        ConfigError: the file is missing or not a YAML mapping, a key is unknown, a value has the wrong type or an
            impossible value. The message names the key.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"config file '{path}' does not exist; pass a YAML file such as configs/shakespeare.yaml"
            )
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file '{path}' is not valid YAML: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping of keys to values")
        tree = loaded
    tree = _merge(_merge(defaults or {}, tree), parse_overrides(overrides or []))
    return config_from_dict(tree, world_size=world_size, needs_weights=needs_weights)


def default_optimizer(
    checkpoint_dir: str | None = None,
    method: str = "full",
    *,
    strategy: str = "fsdp2",
    cpu_offload: bool = False,
) -> str:
    """``optimizer.name`` when a config leaves it out: ``muon`` for a model trained from scratch, ``adamw`` where
    the run starts from pretrained weights (``checkpoint_dir``, or a fine-tuning ``method``: ``lora``, ``qlora``,
    ``adapter``, which ``memfit estimate``/``plan`` take with a preset instead of weights) or asks for what Muon
    cannot do (``distributed.strategy: fsdp1``, ``optimizer.cpu_offload``).

    From scratch, Muon reaches the main job's AdamW validation loss in clearly fewer steps, with half AdamW's
    state (docs/benchmarks.md, "Optimizers that keep less state"), as in the public speed runs (modded-nanogpt) and
    Moonlight (Liu et al., 2025, "Muon is Scalable for LLM Training"). Open pretrained weights were almost all
    trained with Adam, and a full fine-tune of them with Muon does worse than with Adam (Qu, Huang and Horvath,
    2026, "Can Muon Fine-tune Adam-Pretrained Models?", arXiv:2605.10468): from pretrained weights memfit keeps
    AdamW, as torchtune and litgpt do.

    Args:
        checkpoint_dir: the config's ``checkpoint_dir`` (``None``: random initialisation).
        method: the config's ``method``.
        strategy: the config's ``distributed.strategy``.
        cpu_offload: the config's ``optimizer.cpu_offload``.

    Returns:
        ``"muon"`` or ``"adamw"``.
    """
    scratch = checkpoint_dir is None and method == "full"
    return "muon" if scratch and strategy != "fsdp1" and not cpu_offload else "adamw"


def config_from_dict(
    tree: dict[str, Any], check: bool = True, *, world_size: int = 1, needs_weights: bool = True
) -> TrainConfig:
    """Build and validate a :class:`TrainConfig` from a nested dict (as saved in a checkpoint).

    Args:
        tree: nested keys and values.
        check: run :func:`validate` (off to read back a finished run's settings on another machine, e.g. one
            trained with ``device: cuda``).
        world_size: the ranks the run will have (see :func:`validate`).
        needs_weights: see :func:`validate`.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    optimizer = tree.get("optimizer")
    if optimizer is None or (isinstance(optimizer, dict) and "name" not in optimizer):
        distributed = tree.get("distributed")
        name = default_optimizer(
            tree.get("checkpoint_dir"),
            tree.get("method", "full"),
            strategy=distributed.get("strategy", "fsdp2") if isinstance(distributed, dict) else "fsdp2",
            cpu_offload=(optimizer or {}).get("cpu_offload") is True,
        )
        tree = {**tree, "optimizer": {**(optimizer or {}), "name": name}}
    cfg = _from_dict(TrainConfig, tree)
    if not tree.get("tokenizer"):
        cfg.tokenizer = default_tokenizer(cfg)
    if check:
        validate(cfg, world_size, needs_weights=needs_weights)
    return cfg


def default_tokenizer(cfg: TrainConfig) -> TokenizerConfig:
    """``tokenizer`` when a config sets none of its keys: a byte-level BPE of ``TokenizerConfig.vocab_size`` (2048)
    ids; where the model's vocabulary is fixed at fewer embeddings (:func:`memfit.validation.model_vocab`: the
    preset's ``vocab_size`` or ``model_args.vocab_size``, such as the tiny presets' 256), a tokenizer that fits
    them: a BPE of that many ids when that is at least 258 (its 256 bytes and 2 special tokens), else one id per
    character of the training text (``char``)."""
    vocab = model_vocab(cfg)
    if vocab is None or vocab >= TokenizerConfig.vocab_size:
        return TokenizerConfig()
    return TokenizerConfig(vocab_size=vocab) if vocab >= BPE_MIN_IDS else TokenizerConfig(kind="char")


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The configuration as plain nested dicts (YAML/JSON serialisable)."""
    return dataclasses.asdict(cfg)


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """``checkpoint_dir`` and ``data.path`` as absolute paths (``~`` expanded), so that what a run records (and
    what generate, export and resume read back) does not depend on the directory it was started from; a Hub id
    (:func:`memfit.hub.hub_id`: no local path of that spelling) is kept as it is."""

    def absolute(path: str | None) -> str | None:
        if path is None or hub.hub_id(path) is not None:
            return path
        return str(Path(path).expanduser().absolute())

    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path))
    return dataclasses.replace(
        cfg,
        checkpoint_dir=absolute(cfg.checkpoint_dir),
        data=data,
        output_dir=str(Path(cfg.output_dir).expanduser()),
    )


__all__ = [
    "DEVICES",
    "MMAP_THRESHOLD_SETTINGS",
    "NONFINITE_POLICIES",
    "TOKENIZER_KINDS",
    "check_lengths",
    "device_type",
    "memory_budget_bytes",
    "validate",
]
