"""The planner's throughput cost model: predicted seconds of one training step from a run's switches.

:func:`step_cost` is explicit arithmetic over the model's shapes and a few constants (:data:`COST_CONSTANTS`):
matmul FLOPs at an effective rate, the optimizer update and QLoRA's NF4 dequantization at memory bandwidth, bytes
over the host link and the interconnect. Its sources are in docs/memory.md ("Planner"); ``memfit plan --explain``
prints the constants. It ranks combinations of switches (:mod:`memfit.planner.plan`); it does not predict a GPU's
absolute speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memfit.config import TrainConfig, device_type
from memfit.memory import optimizers, switches
from memfit.memory.switches import layer_weights
from memfit.models.config import DecoderConfig
from memfit.objectives import PREFERENCE_OBJECTIVES, rows_per_micro_batch
from memfit.planner.closed_form import optimizer_update_flops
from memfit.planner.layout import Layout
from memfit.validation import reference_mode

_CUDA_CONSTANTS: dict[str, Any] = {
    # forward + backward: 6 FLOPs per weight and token, + 12 * T * dim per layer and token for attention
    # (Kaplan et al. 2020; PaLM, Chowdhery et al. 2022, appendix B), at this effective rate: ~40% of an H100 SXM's
    # dense peak (989 TFLOP/s bf16; 67 TFLOP/s fp32 without TF32, torch's default for fp32 matmuls)
    "matmul_flops_per_second": {"bf16": 400e12, "bf16_mixed": 400e12, "fp32": 25e12},
    # an AdamW update reads p, g, m, v and writes p, m, v: 7 x bytes(param dtype) per parameter, memory-bound at
    # this rate (~60% of an H100 SXM's 3.35 TB/s HBM3)
    "device_memory_bytes_per_second": 2.0e12,
    # other optimizers' updates, as multiples of AdamW's at the same dtype: each optimizer's entry has its own
    # (memfit.memory.optimizers, update_factor; bitsandbytes 8-bit: 1.4, a whole step's ratio on CPU, docs/memory.md,
    # "optimizer.name"; no GPU measurement yet, the same 1.4 is assumed for torchao's, torch.compile'd on CUDA; on
    # CPU each entry's cpu_update_factor: bitsandbytes 7, torchao 8, measured)
    "optimizer_update_factor": optimizers.update_factors("cuda"),
    # the matmuls some updates add (Muon's Newton-Schulz iteration, APOLLO's projections), at this rate by the
    # dtype they run in (the entry's update_dtype: Muon's optimizer.muon_ns_dtype, bf16 on CUDA unless set; APOLLO
    # the parameters'): the matmul rates above (one matrix at a time, smaller than a layer's batched matmuls: an
    # assumption, not measured)
    "optimizer_matmul_flops_per_second": {"bf16": 400e12, "fp32": 25e12},
    # one optimizer per tensor (optimizer_in_backward, implementation for_loop): kernel launches per tensor update
    # (AdamW's for-loop runs ~10 elementwise kernels per tensor) at this CPU-side cost each
    "kernels_per_tensor_update": 10,
    "kernel_launch_seconds": 5e-6,
    # host <-> device copies of pinned memory (PCIe 4.0 x16: 32 GB/s per direction; ~25 achieved): activation
    # offloading (synchronous here: not overlapped), paged-out optimizer state, offloaded parameters and gradients
    "host_link_bytes_per_second": 25e9,
    # the CPU's AdamW update of offloaded state (optimizer.cpu_offload, distributed.cpu_offload): 7 x bytes(param
    # dtype) per parameter at this host memory rate
    "host_memory_bytes_per_second": 50e9,
    # FSDP all-gathers and reduce-scatters, per rank (an NVLink node; PCIe or Ethernet is 10-20x less); they
    # overlap compute (prefetch), so a step takes the longer of the two. Sequence parallelism's all-to-alls go at
    # this rate too, without overlap (`memfit plan --interconnect-gbps` sets it: 200 GB/s is ~45% of an H100
    # node's NVLink 4 at 450 GB/s per direction; InfiniBand NDR between nodes is 50 GB/s per GPU)
    "interconnect_bytes_per_second": 200e9,
    # a plan over nodes (`memfit plan nodes=N gpus_per_node=G`) prices each collective by where its group lies
    # (memfit.planner.cost.mesh_collectives; ring bytes, (n - 1)/n of the data per rank). Inside a node: NVLink 4
    # of an H100 SXM, 900 GB/s bidirectional = 450 GB/s per direction (NVIDIA H100 Tensor Core GPU datasheet);
    # nccl-tests' bus bandwidth approaches it for large messages, so it is taken as the effective rate (an
    # assumption: no H100 measured here). Between nodes: one 400 Gb/s InfiniBand NDR link per GPU (ConnectX-7, as
    # DGX H100 and torchtitan's Grand Teton hosts have) = 50 GB/s per direction
    "intra_node_bytes_per_second": 450e9,
    "inter_node_bytes_per_second": 50e9,
    # chunked (fused linear) cross-entropy does the plain loss's 3 lm_head matmuls; its softmax and gradient run
    # as separate elementwise kernels per chunk instead of one fused one: charged as this share of an lm_head
    # forward
    "chunked_ce_extra_head_forwards": 0.1,
    # selective checkpointing redoes no matmul, only the layers' elementwise ops (norms, RoPE, SiLU, products):
    # memory-bound work, charged as this share of one forward of the layers (an assumption until measured: it
    # keeps `none` ahead of `selective` when both fit)
    "selective_recompute_layer_forwards": 0.1,
    # QLoRA (method: qlora): every forward and backward of a quantized linear dequantizes its NF4 weight (torchao's
    # eager NF4Tensor.get_original_weight), and a checkpointed layer's recomputed forward does it again: memory-bound
    # elementwise work charged as these bytes per weight element at device_memory_bytes_per_second, keyed by dtype
    # policy (the NF4 tensor dequantizes to the parameter dtype: bf16 under bf16, fp32 otherwise). Counted from
    # torchao 0.18's eager kernels, bytes read + written per weight element in bf16: `>> 4` and `& 15` on the packed
    # codes (1 each), their int64 casts (4.5 each), two gathers from the 16-entry code table (5 each), two
    # materialised block-scale expansions (1 each), two products with them (3 each), the interleaving stack (4):
    # 33 B; 47 B with fp32 outputs; bf16_mixed adds autocast's cast of the fp32 weight to bf16 (6 B). Eager
    # dequantization assumed (compile would fuse it to about 0.5 B read + 2 B written). CUDA: not measured
    "nf4_dequantize_bytes_per_element": {"bf16": 33.0, "bf16_mixed": 53.0, "fp32": 47.0},
    # compile: true (the `compile` switch's cost rule). The fused elementwise work of the compiled layers and loss
    # as a speed-up of the effective matmul rate, and the compiled for-loop AdamW step (one generated kernel a
    # tensor) as a factor of the update's time. CUDA: not measured, so 1.0 (compiling is priced as free and as
    # gaining nothing there)
    "compiled_compute_speedup": 1.0,
    "compiled_update_factor": 1.0,
}

COST_CONSTANTS: dict[str, dict[str, Any]] = {
    "cuda": _CUDA_CONSTANTS,
    # a device=cpu run, calibrated by bench/peers.py (docs/benchmarks.md, 2 cores): memfit's fp32 AdamW steps of
    # the 25.6M and 78.6M models ran 850 and 284 tokens/s of 160 and 491 MFLOP/token -> 136 and 139 GFLOP/s
    # with the update (the cores' matmul ceiling: 183); bf16 and bf16 autocast ~25x slower (no bf16 matrix
    # units); torchao's optimizers step eagerly on CPU (~8x torch's step, docs/memory.md); the fused chunked
    # cross-entropy measured no slower than the plain loss there (its elementwise passes: 0.1 of a head
    # forward, as on CUDA); no kernel launches, no host link
    "cpu": {
        **_CUDA_CONSTANTS,
        "matmul_flops_per_second": {"fp32": 140e9, "bf16": 5.6e9, "bf16_mixed": 5.6e9},
        "device_memory_bytes_per_second": 10e9,
        "optimizer_update_factor": optimizers.update_factors("cpu"),
        # Muon's Newton-Schulz in bf16 (torch's; memfit's on a CPU with AMX-BF16 or AVX512-BF16): on the 78.6M
        # model of bench/optimizers.py, 1,387 GFLOP a step took 3.75 s more than AdamW's step eagerly (370 GFLOP/s:
        # these cores' AMX bf16 matmuls of whole matrices), 5.56 s more in backward (250). In fp32 (memfit's on a
        # CPU without bf16 matrix instructions, or muon_ns_dtype=fp32) at the fp32 matmul rate above: measured
        # 151 GFLOP/s there (bench/optimizers.py --part muon-speed, the 78.6M row under ONEDNN_MAX_CPU_ISA=
        # AVX512_CORE, one thread: 9.2 s a step more than AdamW's). APOLLO's projections are too few FLOPs to time
        # apart (docs/benchmarks.md)
        "optimizer_matmul_flops_per_second": {"bf16": 370e9, "fp32": 140e9},
        "kernel_launch_seconds": 0.0,
        # measured on the 25.6M model of bench/peers.py (fp32, 4 x 256, 2 cores; the same process, steps of each
        # interleaved): compiled layers and loss 1.035x the eager step's speed with the update eager, and the
        # compiled for-loop AdamW step of 50 tensors of 10.5M parameters 18.9 ms against 39.1 eager (0.48)
        "compiled_compute_speedup": 1.035,
        "compiled_update_factor": 0.5,
        # measured on the 2 development cores (torch 2.13 CPU, torchao 0.18; best of 7-9 runs, in 4 sessions;
        # docs/memory.md, "method: qlora"): `.to(dtype)` of a 4096 x 4096 NF4 weight took 82-116 ms in bf16
        # (4.9-6.9 ns per element), 163-203 ms in fp32 (9.7-12.1 ns) and 172-179 ms from an fp32 NF4 to bf16
        # (bf16_mixed: 10.3-10.7 ns), where a 4096^3 fp32 matmul took 742-781 ms (176-185 GFLOP/s): one
        # dequantization costs 0.11-0.15 (bf16) and 0.21-0.22 (fp32) of that matmul. Charged as 6.0, 10.0 and 10.5
        # ns per element: these bytes at the 10 GB/s above
        "nf4_dequantize_bytes_per_element": {"bf16": 60.0, "bf16_mixed": 105.0, "fp32": 100.0},
    },
}
"""Constants of :func:`step_cost` by target device (``cuda``: an H100-class GPU; ``cpu``). Documented with their
sources in docs/memory.md ("Planner"); ``memfit plan --explain`` prints them."""


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
"""The collectives :func:`collective_bytes` prices."""


def collective_bytes(collective: str, nbytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring collective of ``ranks`` ranks (NCCL's ring algorithms; the "bus bandwidth"
    of nccl-tests' ``doc/PERFORMANCE.md``).

    - ``all_gather``: ``nbytes`` is the gathered (whole) tensor; each rank sends ``(n - 1) / n`` of it;
    - ``reduce_scatter``: ``nbytes`` is the whole tensor reduced; each rank sends ``(n - 1) / n`` of it;
    - ``all_reduce``: a reduce-scatter then an all-gather, ``2 (n - 1) / n`` of ``nbytes``;
    - ``all_to_all``: ``nbytes`` is one rank's buffer; it keeps ``1 / n`` and sends the rest, ``(n - 1) / n``.

    Args:
        collective: one of :data:`COLLECTIVES`.
        nbytes: bytes of the tensor, as above.
        ranks: ``n``, the group's ranks (1: nothing is sent).

    Returns:
        Bytes sent by one rank (and received: the ring is symmetric).

    Raises:
        ValueError: an unknown collective, or ``ranks`` < 1.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {collective!r}")
    if ranks < 1:
        raise ValueError(f"a collective needs >= 1 ranks, got {ranks}")
    share = nbytes * (ranks - 1) / ranks
    return 2 * share if collective == "all_reduce" else share


def mesh_collectives(
    cfg: TrainConfig,
    layout: Layout,
    states: dict[str, int],
    constants: dict[str, Any],
    *,
    gathers: int = 2,
    replica_bytes: float = 0.0,
    exchanged_bytes: float = 0.0,
) -> dict[str, float]:
    """Seconds of one rank's collectives in a step on a layout's mesh, each at the rate of where its group lies:
    ``intra_node_bytes_per_second`` when the group is inside a node, else ``inter_node_bytes_per_second``
    (:class:`~memfit.planner.layout.Layout`; ring bytes, :func:`collective_bytes`).

    - ``fsdp``: FSDP2's all-gathers of the parameters over the shard group (``gathers`` a step: 2, or 1 without
      ``reshard_after_forward``) at the compute dtype (bf16 under ``bf16_mixed``: its ``param_dtype``), and the
      reduce-scatter of the trainable parameters' gradients at their dtype; each whole tensor is a rank's shard x
      ``S`` (a tensor-parallel slice: ``1 / T`` of the model). Inter-node when the shard group spans nodes
      (``S x T > G``);
    - ``replicate``: ``replica_bytes``, the all-reduce of a rank's gradient shard across the ``R`` replicas
      (hybrid sharding's entry counts them, :mod:`memfit.memory.switches.sharding`), between nodes;
    - ``exchange``: ``exchanged_bytes``, tensor parallelism's activation all-gathers and reduce-scatters
      (:mod:`memfit.memory.switches.tensor`) or Ulysses's all-to-alls (:mod:`memfit.memory.switches.sequence`;
      the two are not combined), over ``sequence_parallel x T`` consecutive ranks: NVLink while inside a node.

    ``fsdp`` and ``replicate`` overlap compute (prefetch; the all-reduce runs as gradients are reduced);
    ``exchange`` is on the critical path (a layer's matmuls wait for it).

    Args:
        cfg: the run (``dtype``, ``distributed.sequence_parallel``).
        layout: the mesh (``replicate``, ``shard``, ``tensor_parallel``, ``gpus_per_node``).
        states: closed-form bytes of one rank (``parameters``, ``trainable_parameters``).
        constants: the cost model's (``intra_node_bytes_per_second``, ``inter_node_bytes_per_second``).
        gathers: parameter all-gathers a step.
        replica_bytes: bytes a rank sends across replicas a step.
        exchanged_bytes: bytes a rank sends to its tensor- or sequence-parallel group a step.

    Returns:
        ``{"fsdp", "replicate", "exchange"}`` in seconds.
    """
    intra, inter = constants["intra_node_bytes_per_second"], constants["inter_node_bytes_per_second"]
    s, t = layout.shard, layout.tensor_parallel
    out = {"fsdp": 0.0, "replicate": 0.0, "exchange": 0.0}
    if s > 1:
        stored, compute = param_bytes(cfg.dtype), 4 if cfg.dtype == "fp32" else 2
        gathered = states["parameters"] * s * min(1.0, compute / stored)
        moved = gathers * collective_bytes("all_gather", gathered, s)
        moved += collective_bytes("reduce_scatter", states["trainable_parameters"] * s, s)
        out["fsdp"] = moved / (intra if layout.inside_node(layout.shard_span) else inter)
    if replica_bytes:
        out["replicate"] = replica_bytes / (intra if layout.inside_node(layout.world_size) else inter)
    if exchanged_bytes:
        span = cfg.distributed.sequence_parallel * t
        out["exchange"] = exchanged_bytes / (intra if layout.inside_node(span) else inter)
    return out


def param_bytes(dtype: str) -> int:
    """Bytes per element of parameters (and gradients, AdamW state) under a dtype policy."""
    return 2 if dtype == "bf16" else 4


def model_flops_per_token(mcfg: DecoderConfig, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of the decoder layers (weights + attention) and of ``lm_head``.

    Per layer: ``2 * weights`` (q, k, v, o projections and the SwiGLU MLP) ``+ 4 * K * nh * hd`` (scores and
    weighted values over ``K = min(T, sliding_window)`` keys, causal masking not discounted; ``nh * hd`` is
    ``dim`` unless the family sets ``head_dim``). The head: ``2 * dim * V``. A training step costs 3 forwards
    (backward = 2 forwards).

    Returns:
        ``{"layers": ..., "head": ..., "mlp": ...}`` in FLOPs per token (``mlp``: the SwiGLU MLPs' part of
        ``layers``, ``2 * 3 * dim * intermediate_size`` a layer).
    """
    weights = layer_weights(mcfg, active=True)  # a mixture of experts: the experts a token computes with
    return {
        "layers": sum(  # each layer by its own window (Gemma's local and global layers)
            2.0 * weights + 4.0 * keys * mcfg.num_heads * mcfg.head_dim
            for keys in mcfg.layer_attended_keys(seq_len)
        ),
        "head": 2.0 * mcfg.dim * mcfg.vocab_size,
        "mlp": mcfg.num_layers * 2.0 * mcfg.mlp_weights(active=True),
    }


@dataclass(frozen=True)
class CostRequest:
    """What :func:`step_cost` prices: one rank's step of a run."""

    cfg: TrainConfig
    """The run's config (its switches, ``batch_size``, ``gradient_accumulation_steps``, ``device``)."""
    mcfg: DecoderConfig
    """The architecture."""
    world_size: int
    """Ranks."""
    seq_len: int
    """Tokens per sequence."""
    states: dict[str, int]
    """Closed-form model states of one rank (``trainable_parameters``, ``parameters``, ``gradients`` in bytes;
    :func:`memfit.planner.closed_form.model_state_bytes_closed_form`)."""
    offloaded_activation_bytes: int = 0
    """Activations moved to the host in a step (``activation_offloading``)."""
    paged_out_bytes: int = 0
    """Paged optimizer state that does not fit on the device and moves out and back each step."""
    constants: dict[str, Any] | None = None
    """Cost-model constants; ``None``: ``COST_CONSTANTS[target device]``."""
    layout: Layout | None = None
    """The mesh over nodes (``memfit plan nodes=N gpus_per_node=G``): its collectives are priced by where their
    groups lie (:func:`mesh_collectives`); ``None``: one flat FSDP2 group at ``interconnect_bytes_per_second``."""


def step_cost(request: CostRequest) -> dict[str, float]:
    """Predicted seconds of one optimizer step of one rank, by component.

    What each memory switch adds is its entry's rule (:attr:`memfit.memory.switches.Switch.cost`, which adjusts a
    :class:`~memfit.memory.switches.StepTerms`); the components are:

    - ``compute``: ``tokens * (3 * (layers + head) + recompute) / matmul_flops_per_second[dtype]``, with the
      per-token FLOPs of :func:`model_flops_per_token`, ``tokens = batch_size * seq_len *
      gradient_accumulation_steps``; activation checkpointing recomputes the forward of each checkpointed layer
      (``full``: +1/3 of the layers' FLOPs; ``every_n``: that for every n-th layer; ``selective``: the constant
      ``selective_recompute_layer_forwards`` of one forward of the layers); chunked (fused) cross-entropy
      costs ``chunked_ce_extra_head_forwards`` lm_head forwards more than the plain loss, and one more where it
      makes the head's gradient at the end of the backward
      (:func:`memfit.memory.switches.sequence.defers_head_gradient`); a preference objective has two rows per
      pair (``tokens`` doubled), one more forward where its reference is computed in the step (LoRA off, or a
      resident model) and one more lm_head forward with the chunked loss;
    - ``dequantize`` (``method: qlora``): every NF4 weight (:func:`~memfit.memory.switches.layer_weights` per
      layer) dequantized :func:`~memfit.memory.switches.dequantize_passes` times, at
      ``nf4_dequantize_bytes_per_element[dtype]`` bytes per element and ``device_memory_bytes_per_second``; on
      the device's stream with the matmuls, so it adds to ``compute`` (every rank dequantizes the whole gathered
      weight when sharded);
    - ``communication`` (sharded): all-gathers of the parameters (2 per step, 1 without
      ``reshard_after_forward``) and a reduce-scatter of the gradients, ``(N - 1) / N`` of their bytes each, at
      ``interconnect_bytes_per_second``; overlapped with compute, so the step pays ``max(compute,
      communication)``; hybrid sharding (``distributed.replicate`` R) gathers and reduce-scatters within a
      replica of ``N / R`` ranks and adds the all-reduce of each rank's gradient shard across the replicas
      (``2 (R - 1) / R`` of its bytes);
    - ``exchange`` (``distributed.sequence_parallel`` N > 1): each rank computes ``1 / N`` of the tokens' work
      (``tokens`` above divided by N: its tokens' linear work, its heads' attention over whole sequences) and
      sends ``(N - 1) / N`` of its q, k, v and attention-output shards around every attention, in the forward, the
      backward and a recomputed forward (:func:`memfit.memory.switches.all_to_all_elements`), at
      ``interconnect_bytes_per_second``; attention waits for it, so it adds to the step;
    - on a ``layout`` (a mesh over nodes): ``communication`` is :func:`mesh_collectives`' ``fsdp`` and ``replicate``
      (overlapped with compute) and ``exchange`` its ``exchange``: the same bytes, each at the rate of where its
      group lies (NVLink inside a node, InfiniBand between nodes) in place of ``interconnect_bytes_per_second``;
    - ``optimizer``: ``trainable parameters * 7 * bytes(dtype) / device_memory_bytes_per_second *
      optimizer_update_factor[name]`` (on the host at ``host_memory_bytes_per_second`` when offloaded), plus
      ``kernels_per_tensor_update * kernel_launch_seconds`` per trainable tensor when each tensor is updated on
      its own (``optimizer_in_backward``, ``implementation: for_loop``), plus the matmul FLOPs of the update
      (Muon's Newton-Schulz iteration, APOLLO's projections:
      :func:`memfit.planner.closed_form.optimizer_update_flops`) at ``optimizer_matmul_flops_per_second`` of the
      dtype they run in (:attr:`memfit.memory.optimizers.Optimizer.update_dtype`);
    - ``transfers``: bytes over the host link at ``host_link_bytes_per_second``: paged-out optimizer state out and
      back (2x), offloaded parameters in and gradients out (``optimizer.cpu_offload``; ``distributed.cpu_offload``:
      shards, in twice when resharding); offloaded activations out and back (2x) go on a side stream that
      overlaps compute, so the step pays ``max(compute, their transfer)``.

    Args:
        request: the run's config and architecture, its ranks, sequence length, closed-form states, the bytes it
            moves to the host, and the constants (:class:`CostRequest`).

    Returns:
        ``{"compute", "dequantize", "communication", "exchange", "optimizer", "transfers", "total"}`` in
        seconds.
    """
    cfg, mcfg, world_size, seq_len, states = (
        request.cfg,
        request.mcfg,
        request.world_size,
        request.seq_len,
        request.states,
    )
    target = device_type(cfg.device)
    c = request.constants or COST_CONSTANTS[target]
    flops = model_flops_per_token(mcfg, seq_len)
    # a preference objective: each pair is two rows (chosen, rejected); a reference computed in the step (LoRA off,
    # or a resident model) runs one more forward of them, and the chunked loss one more lm_head forward (its first
    # pass sums each row's log-probability before the weighted one: memfit.step.preference_micro_batch_loss)
    extra = 0.0
    if cfg.objective in PREFERENCE_OBJECTIVES:
        if reference_mode(cfg) in ("lora_off", "resident"):
            extra += flops["layers"] + flops["head"]
        if cfg.chunked_cross_entropy:
            extra += flops["head"]
    tokens = rows_per_micro_batch(cfg) * seq_len * cfg.gradient_accumulation_steps
    terms = switches.StepTerms(
        cfg=cfg,
        mcfg=mcfg,
        constants=c,
        flops=flops,
        tokens=tokens,
        states=states,
        world_size=world_size,
        offloaded_activation_bytes=request.offloaded_activation_bytes,
        paged_out_bytes=request.paged_out_bytes,
        per_token=3 * (flops["layers"] + flops["head"]) + extra,
        target=target,
    )
    switches.add_costs(terms)  # each switch's share, by its entry (memfit.memory.switches.Switch.cost)
    compute = terms.tokens * terms.per_token / terms.matmul_flops_per_second
    dequantize = (
        terms.dequantize_bytes / c["device_memory_bytes_per_second"] if terms.dequantize_bytes else 0.0
    )

    communication = 0.0
    exchange = terms.exchanged_bytes / c["interconnect_bytes_per_second"]
    layout = request.layout
    if layout is not None:
        mesh = mesh_collectives(
            cfg,
            layout,
            states,
            c,
            gathers=terms.gathers,
            replica_bytes=terms.replica_reduced_bytes,
            exchanged_bytes=terms.exchanged_bytes,
        )
        communication = mesh["fsdp"] + mesh["replicate"]
        exchange = mesh["exchange"]
    elif world_size > 1:
        shards = terms.shard_ranks or world_size  # hybrid sharding: the ranks of a replica
        full = states["parameters"] * shards  # the unsharded bytes, to within padding
        moved = (terms.gathers + 1) * full * (shards - 1) / shards + terms.replica_reduced_bytes
        communication = moved / c["interconnect_bytes_per_second"]

    trainable = states["trainable_parameters"]
    rate = c["host_memory_bytes_per_second"] if terms.host_update else c["device_memory_bytes_per_second"]
    optimizer = trainable * 7 * terms.update_factor / rate
    update_flops = optimizer_update_flops(cfg, mcfg)
    if update_flops:
        entry = optimizers.spec(cfg.optimizer.name)
        matmul_dtype = entry.update_dtype(cfg.optimizer, target, cfg.dtype)
        optimizer += update_flops / c["optimizer_matmul_flops_per_second"][matmul_dtype]
    if terms.per_tensor:
        tensors = _trainable_tensor_count(cfg, mcfg)
        optimizer += tensors * c["kernels_per_tensor_update"] * c["kernel_launch_seconds"]
    link = c["host_link_bytes_per_second"]
    transfers = terms.moved_bytes / link if target == "cuda" else 0.0
    overlapped = terms.overlapped_bytes / link if target == "cuda" else 0.0

    total = max(compute + dequantize, communication, overlapped) + exchange + optimizer + transfers
    return {
        "compute": compute,
        "dequantize": dequantize,
        "communication": communication,
        "exchange": exchange,
        "optimizer": optimizer,
        "transfers": transfers,
        "total": total,
    }


def _trainable_tensor_count(cfg: TrainConfig, mcfg: DecoderConfig) -> int:
    if cfg.method != "full":
        return 2 * mcfg.num_layers  # a few small tensors per layer: launches are what count, and they are few
    per_layer = 9  # q, k, v, o, gate, up, down, 2 norms
    return mcfg.num_layers * per_layer + 2 + (0 if mcfg.tie_word_embeddings else 1)
