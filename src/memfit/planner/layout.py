"""The device meshes ``memfit plan nodes=N gpus_per_node=G`` chooses among, and the torchrun line of one.

A layout is the 3-D training mesh of :func:`memfit.distributed.training_mesh` on ``N x G`` ranks: ``R`` replicas
(hybrid sharding, HSDP) x ``S`` shards (FSDP2) x ``T`` tensor-parallel ranks, ``rank = (replica * S + shard) * T +
tp_rank``. torchrun numbers the ranks node by node (node ``k`` holds ranks ``k * G .. k * G + G - 1``), so a group
of consecutive ranks stays inside a node while it has at most ``G`` of them. The layouts kept are those whose fast
collectives stay on a node's fast links (torchtitan's recipe, ``docs/distributed.md``, "How the planner picks the
mesh"):

- ``R`` divides ``N``: each replica is ``N / R`` whole nodes, and only HSDP's gradient all-reduce crosses between
  replicas;
- ``T`` divides ``G``: a tensor-parallel group (an all-gather or reduce-scatter of activations in every layer) is
  inside one node; ``T`` also divides the model's query and key/value heads (each rank computes whole heads).

Sequence parallelism (Ulysses) is one of the memory switches the plan searches within each layout
(:mod:`memfit.memory.switches.sequence`).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from memfit.errors import ConfigError
from memfit.models.config import DecoderConfig

RDZV_PORT = 29500
"""The c10d rendezvous port of the torchrun line (torchrun's ``--master_port`` default)."""


@dataclass(frozen=True)
class Layout:
    """One mesh of ``nodes x gpus_per_node`` ranks: ``replicate x shard x tensor_parallel``."""

    nodes: int
    """N, machines."""
    gpus_per_node: int
    """G, ranks (GPUs) per machine."""
    replicate: int = 1
    """R, HSDP replicas (``distributed.replicate``)."""
    tensor_parallel: int = 1
    """T, ranks of a tensor-parallel group (``distributed.tensor_parallel``)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def shard(self) -> int:
        """S, the FSDP2 shard group's ranks: ``world_size / (R * T)``."""
        return self.world_size // (self.replicate * self.tensor_parallel)

    def inside_node(self, span: int) -> bool:
        """Whether a group whose ranks lie within ``span`` consecutive ranks (aligned to a multiple of ``span``) is
        inside one node: ``span <= G`` (spans here divide or are multiples of ``G``)."""
        return span <= self.gpus_per_node

    @property
    def shard_span(self) -> int:
        """Consecutive ranks a shard group lies in: its ``S`` ranks are ``T`` apart."""
        return self.shard * self.tensor_parallel

    def label(self) -> str:
        """``R x S x T`` with names: ``replicate 2 x shard 4 x tp 2``."""
        return f"replicate {self.replicate} x shard {self.shard} x tp {self.tensor_parallel}"

    def overrides(self) -> dict[str, int]:
        """The config keys of this mesh."""
        return {"distributed.replicate": self.replicate, "distributed.tensor_parallel": self.tensor_parallel}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_nodes(nodes: int, gpus_per_node: int) -> None:
    """Refuse a machine count or a per-machine rank count below 1.

    Raises:
        ConfigError: naming ``nodes`` or ``gpus_per_node``.
    """
    for key, value in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if value < 1:
            raise ConfigError(
                f"config key '{key}': must be an integer >= 1, got {value}; e.g. nodes=2 gpus_per_node=8"
            )


def layouts(nodes: int, gpus_per_node: int, mcfg: DecoderConfig) -> list[Layout]:
    """Every layout of ``nodes x gpus_per_node`` ranks the planner considers for a model.

    ``R`` over the divisors of ``N`` and ``T`` over the divisors of ``G`` that also divide ``num_heads`` and
    ``num_kv_heads`` (module doc). Example: 2 nodes x 8 GPUs, Llama 3 8B (32 heads, 8 key/value heads): R in
    {1, 2}, T in {1, 2, 4, 8}, 8 layouts.

    Args:
        nodes: N, machines.
        gpus_per_node: G, ranks per machine.
        mcfg: the architecture (its heads).

    Returns:
        Layouts, flat FSDP2 first, then by R, then by T.

    Raises:
        ConfigError: ``nodes`` or ``gpus_per_node`` below 1.
    """
    check_nodes(nodes, gpus_per_node)
    tps = [t for t in _divisors(gpus_per_node) if mcfg.num_heads % t == 0 and mcfg.num_kv_heads % t == 0]
    return [Layout(nodes, gpus_per_node, r, t) for r in _divisors(nodes) for t in tps]


def torchrun_line(layout: Layout, verb: str, config: str, host: str = "HOST") -> str:
    """The command to run on every node for a layout's run of ``memfit <verb> --config <config>``.

    torchrun's c10d rendezvous (``docs/distributed.md``, "On several machines"): ``HOST`` is one node's address,
    reachable from all; torchrun gives the nodes their ranks as they join. One node: ``--standalone`` (a private
    rendezvous on this machine).

    Returns:
        ``torchrun --nnodes N --nproc_per_node G --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m memfit <verb>
        --config <config>``.
    """
    if layout.nodes == 1:
        launch = ["--standalone"]
    else:
        launch = ["--nnodes", str(layout.nodes)]
    launch += ["--nproc_per_node", str(layout.gpus_per_node)]
    if layout.nodes > 1:
        launch += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{host}:{RDZV_PORT}"]
    return shlex.join(["torchrun", *launch, "-m", "memfit", verb, "--config", config])
