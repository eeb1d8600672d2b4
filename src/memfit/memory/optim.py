"""Optimizers, chosen by one name, with the usual parameter groups, the learning-rate schedule, and the
optimizer step inside backward.

Parameter groups: matrices (``ndim == 2``: projections and embeddings; ``ndim == 3``: a mixture of experts'
stacks) get weight decay; 1-D tensors (RMSNorm weights, biases) do not, as in GPT-2/nanoGPT, litgpt and torchtune
practice.

The optimizers behind ``optimizer.name``, their state in closed form and where they run are declared in
:mod:`memfit.memory.optimizers`; this module builds them.

torchao's optimizers compile their update with ``torch.compile``. memfit keeps that on CUDA; on CPU it runs the
same update eagerly (identical math): compiling on CPU needs a C++ toolchain and costs 25-60 s of start-up on
even the tiny test model (one compile per parameter shape), which a CPU run never wins back.

:func:`build_optimizer` records on the optimizer it returns, as ``memfit_unquantized_state_params``, the names of
the parameters whose state is *not* quantized (all of them for ``adamw`` and ``paged_adamw``), and
:func:`optimizer_state_bytes` counts the bytes the state really holds. Both it and
:class:`~memfit.memory.tracker.MemoryTracker` find the state with one walker, :func:`optimizer_state_tensors`
(sub-optimizers of a wrapper included; tensor subclasses are yielded whole, their inner tensors hold the bytes).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memfit.distributed import unwrap
from memfit.memory import bnb_cpu, hybrids, optimizers
from memfit.memory import rounding as rounding_
from memfit.memory.optimizers import check_optimizer_supported
from memfit.quiet import quiet_torchao_import

if TYPE_CHECKING:  # an annotation only: no memory module imports config, which imports the memory registries
    from memfit.config import OptimizerConfig

_ADAMW_IMPLEMENTATIONS = {
    "foreach": {"foreach": True, "fused": False},
    "for_loop": {"foreach": False, "fused": False},
    "fused": {"foreach": False, "fused": True},
}
_GROUP_LABELS = ("params", "param_names", "name")  # group keys that are not hyperparameters


# ----------------------------------------------------------------------------------------------------------------
# Parameter groups and the learning-rate schedule
# ----------------------------------------------------------------------------------------------------------------


def _ndim(p: torch.Tensor) -> int:
    """A parameter's dimensions before FSDP1 flattened it in place (it records them as ``_memfit_ndim``)."""
    return getattr(p, "_memfit_ndim", p.ndim)


def param_groups(
    model: torch.nn.Module, weight_decay: float, optimizer: str = "adamw", *, adamw_lr_scale: float = 1.0
) -> list[dict]:
    """Split trainable parameters into a decayed group (matrices: ``ndim == 2``, and a mixture of experts' stacked
    matrices, ``ndim == 3``) and an undecayed one (norms,
    LLaMA-Adapter's per-head gates and any other non-matrix tensor); for an optimizer that treats tensors apart
    (Muon, APOLLO, Adam-mini), first by the algorithm :func:`memfit.memory.optimizers.part_of` gives each.

    Args:
        model: the model; parameters with ``requires_grad=False`` are left out, a shared (tied) one appears once.
        weight_decay: decoupled weight decay of the matrices.
        optimizer: ``optimizer.name``.
        adamw_lr_scale: Muon's AdamW group's learning rate over ``optimizer.lr`` (``lr_scale`` of its groups,
            which the training loop multiplies the scheduled learning rate by).

    Returns:
        Groups with ``name`` and ``param_names`` recorded for inspection: ``decay`` / ``no_decay`` for one
        algorithm; with several, each algorithm's (``algorithm`` set in the group) named by it, ``_no_decay``
        appended to the undecayed, ``adamw``'s named ``decay`` / ``no_decay``; in order of first appearance.
    """
    partitioned = optimizers.spec(optimizer).partition is not None
    groups: dict[tuple[str, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = _ndim(p)
        algorithm = optimizers.part_of(optimizer, name, ndim) if partitioned else ""
        decayed = ndim >= 2
        group = groups.get((algorithm, decayed))
        if group is None:
            label = "decay" if decayed else "no_decay"
            if algorithm and algorithm != "adamw":
                label = algorithm if decayed else f"{algorithm}_no_decay"
            group = {"params": [], "weight_decay": weight_decay if decayed else 0.0, "name": label}
            group["param_names"] = []
            if algorithm:
                group["algorithm"] = algorithm
            if algorithm == "adamw" and adamw_lr_scale != 1.0:
                group["lr_scale"] = adamw_lr_scale
            groups[(algorithm, decayed)] = group
        group["params"].append(p)
        group["param_names"].append(name)
    if not partitioned:  # both groups, even empty, as the training loop and checkpoints have always had them
        for decayed in (True, False):
            groups.setdefault(
                ("", decayed),
                {
                    "params": [],
                    "weight_decay": weight_decay if decayed else 0.0,
                    "name": "decay" if decayed else "no_decay",
                    "param_names": [],
                },
            )
        return [groups[("", True)], groups[("", False)]]
    return list(groups.values())


def describe_partition(model: torch.nn.Module, optimizer: str) -> str:
    """The banner's line of which algorithm takes which tensors, e.g. ``muon: 84 matrices (23.1M), adamw: 19
    tensors (2.1M)``; empty for an optimizer that treats every tensor alike.

    Args:
        model: the model (unsharded names and shapes: the sizes are of the whole tensors).
        optimizer: ``optimizer.name``.
    """
    if optimizers.spec(optimizer).partition is None:
        return ""
    counts: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            ndim = _ndim(p)
            entry = counts.setdefault(optimizers.part_of(optimizer, name, ndim), [0, 0, 0])
            entry[0] += 1
            entry[1] += getattr(p, "_memfit_numel", p.numel())
            entry[2] += ndim >= 2
    return ", ".join(
        f"{part}: {n} {'matrices' if matrices == n else 'tensors'} ({numel / 1e6:.1f}M)"
        for part, (n, numel, matrices) in sorted(counts.items(), key=lambda item: -item[1][1])
    )


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Linear warm-up then cosine decay (as in nanoGPT / litgpt).

    Args:
        step: the optimizer step about to be taken, 0-based.
        lr: peak learning rate, reached after ``warmup_steps``.
        min_lr: floor reached at ``max_steps``.
        warmup_steps: steps of linear increase from ``lr / warmup_steps`` to ``lr``.
        max_steps: total steps of the run.

    Returns:
        The learning rate for ``step``.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


# ----------------------------------------------------------------------------------------------------------------
# What runs where
# ----------------------------------------------------------------------------------------------------------------


def unquantized_state_params(model: torch.nn.Module, name: str) -> list[str]:
    """Names of the trainable parameters whose optimizer state ``name`` keeps unquantized.

    bitsandbytes keeps fp32 state for tensors of fewer than
    :data:`~memfit.memory.optimizers.BNB_MIN_8BIT_SIZE` elements; torchao keeps state in the parameter dtype for
    tensors of fewer than :data:`~memfit.memory.optimizers.TORCHAO_MIN_QUANTIZED_SIZE` elements or whose size is
    not a multiple of its block size (:attr:`Optimizer.quantizes <memfit.memory.optimizers.Optimizer.quantizes>`).
    32-bit optimizers quantize nothing.

    Args:
        model: the model.
        name: ``optimizer.name``.

    Returns:
        Parameter names, in ``named_parameters`` order.
    """
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    numel = {n: p.numel() for n, p in model.named_parameters()}
    quantizes = optimizers.spec(name).quantizes
    return names if quantizes is None else [n for n in names if not quantizes(numel[n])]


# ----------------------------------------------------------------------------------------------------------------
# Building one
# ----------------------------------------------------------------------------------------------------------------


def _optimizer_class(
    cfg: OptimizerConfig, model_config: Any = None
) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    """The class ``cfg.name``'s entry builds (:attr:`memfit.memory.optimizers.Optimizer.factory`) and its keyword
    arguments (the entry's ``hyperparameters``, renamed by its ``arguments``, and its ``model_arguments`` read from
    ``model_config``); imports its library when first asked.

    Raises:
        ValueError: an ``implementation`` torch's AdamW does not know, or a class that needs the model's shape
            without ``model_config``.
        KeyError: an unknown name (config validation refuses it first).
    """
    entry = optimizers.spec(cfg.name)
    renamed = dict(entry.arguments)
    kwargs: dict[str, Any] = {
        renamed.get(k, k): tuple(getattr(cfg, k)) if k == "betas" else getattr(cfg, k)
        for k in entry.hyperparameters
        if k != "adamw_lr"  # a group setting (param_groups' lr_scale)
    }
    if entry.model_arguments:
        if model_config is None:
            raise ValueError(
                f"optimizer {cfg.name!r} needs the model's config ({', '.join(entry.model_arguments)})"
            )
        kwargs.update({k: getattr(model_config, k) for k in entry.model_arguments})
    cls = entry.factory()  # imports its library when first asked (bitsandbytes and torchao take seconds each)
    if not entry.implementations:
        return cls, kwargs
    if cfg.implementation not in entry.implementations:
        raise ValueError(
            f"unknown optimizer.implementation {cfg.implementation!r} for {cfg.name}; known: "
            f"{', '.join(entry.implementations)}"
        )
    flags = _ADAMW_IMPLEMENTATIONS[cfg.implementation]
    return cls, {**kwargs, **{k: v for k, v in flags.items() if k != "fused" or "fused" in _accepts(cls)}}


def _accepts(cls: Callable[..., Any]) -> set[str]:
    """Keyword arguments of a class (or a ``functools.partial`` of one)."""
    return set(inspect.signature(cls).parameters)


def _paged_on_cpu_warning(name: str) -> None:
    warnings.warn(
        f"optimizer.name={name!r} runs unpaged on CPU: its state is ordinary host memory, exactly as without "
        f"paging. On CUDA, bitsandbytes puts the state of tensors of >= 100,000 elements in unified (managed) "
        f"memory, which the driver pages out to host RAM when the GPU runs short and back on access (no "
        f"out-of-memory error at a transient peak, at the cost of PCIe traffic; the state is as large)",
        UserWarning,
        stacklevel=3,
    )


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimizerConfig,
    *,
    in_backward: bool = False,
    rounding: str = "nearest",
) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.name`` over ``model``'s trainable parameters.

    Args:
        model: the (materialised, or fake) model.
        cfg: the optimizer section of the run config; ``cpu_offload`` is read when the field exists.
        in_backward: return an :class:`OptimizerInBackward` that updates each parameter inside backward.
        rounding: ``bf16_rounding`` (:mod:`memfit.memory.rounding`): how a bf16 weight takes its update. Other
            than ``nearest``, each parameter gets an optimizer of its own (:class:`PerParameterOptimizer`, or
            :class:`OptimizerInBackward`) whose update is computed on an fp32 copy of the weight, chunk by chunk
            where the update is elementwise, and rounded back.

    Returns:
        A ``torch.optim.Optimizer`` whose ``param_groups`` are ``decay`` / ``no_decay`` (see
        :func:`param_groups`); the training loop sets their ``lr`` before each step. It carries
        ``memfit_unquantized_state_params`` (see :func:`unquantized_state_params`).

    Raises:
        ValueError: unknown name or implementation, or a combination :func:`check_optimizer_supported` rejects
            (config validation catches these first).
    """
    cpu_offload = bool(getattr(cfg, "cpu_offload", False))
    params = [p for p in model.parameters() if p.requires_grad]
    device_type = params[0].device.type if params else "cpu"
    reason = check_optimizer_supported(
        cfg.name, device_type, cpu_offload=cpu_offload, in_backward=in_backward, rounding=rounding
    )
    if reason is not None:
        raise ValueError(reason)
    model_config = getattr(unwrap(model), "config", None)
    cls, kwargs = _optimizer_class(cfg, model_config)
    paged_on_cpu = optimizers.spec(cfg.name).paged and device_type != "cuda"
    if paged_on_cpu:
        _paged_on_cpu_warning(cfg.name)

    shared_qmaps: list[dict] = []
    seeded = "first_seed" in _accepts(cls)
    numbered = 0  # APOLLO's per-parameter seeds, numbered over all per-parameter optimizers as in one

    def make(groups: list[dict]) -> torch.optim.Optimizer:
        nonlocal numbered
        extra = {"first_seed": numbered + 1} if seeded else {}
        numbered += sum(len(g["params"]) for g in groups)
        opt = cls(groups, **kwargs, **extra)
        opt.memfit_bf16_rounding = (
            rounding  # torchao's and bitsandbytes' chunked updates round by it themselves
        )
        if paged_on_cpu:
            opt._cpu_paged_warned = True  # memfit's warning above replaces bitsandbytes' one per optimizer
        # bitsandbytes: one pair of code tables for all per-parameter optimizers, as in a single optimizer
        if hasattr(opt, "name2qmap"):
            if shared_qmaps:
                opt.name2qmap = shared_qmaps[0]
            else:
                shared_qmaps.append(opt.name2qmap)
        return opt

    lr_scale = cfg.adamw_lr / cfg.lr if getattr(cfg, "adamw_lr", 0.0) else 1.0
    groups = param_groups(model, cfg.weight_decay, cfg.name, adamw_lr_scale=lr_scale)
    if in_backward:
        optimizer: torch.optim.Optimizer = OptimizerInBackward(groups, make, rounding=rounding)
    elif rounding != "nearest":
        optimizer = PerParameterOptimizer(groups, make, rounding=rounding)
    elif cpu_offload:
        optimizer = _cpu_offload_optimizer(groups, cls, kwargs)
    else:
        optimizer = make(groups)
    optimizer.memfit_unquantized_state_params = unquantized_state_params(model, cfg.name)
    return optimizer


def _cpu_offload_optimizer(
    groups: list[dict], cls: Callable[..., torch.optim.Optimizer], kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    """torchao's ``CPUOffloadOptimizer`` (CUDA only), with a ``state`` mapping like any optimizer's."""
    with quiet_torchao_import():
        from torchao.optim import CPUOffloadOptimizer  # deferred: seconds to import

    # It gives each large parameter its own host optimizer over a one-tensor group, so group-wide names must go.
    stripped = [{k: v for k, v in g.items() if k != "param_names"} for g in groups]
    # offload_gradients=False keeps device gradients, so train_step can still compute grad_norm from them.
    opt = CPUOffloadOptimizer(stripped, cls, offload_gradients=False, **kwargs)
    entries = {p: (o, opt.param_d2h_map[p]) for p, o in opt.optim_dict.items()}
    for group in opt.d_param_groups:
        entries.update({p: (opt.d_opt, p) for p in group["params"]})
    opt.state = _StateView(entries)
    return opt


# ----------------------------------------------------------------------------------------------------------------
# The optimizer step inside backward
# ----------------------------------------------------------------------------------------------------------------


class _StateView(Mapping):
    """``parameter -> state`` over per-parameter optimizers: what ``optimizer.state`` holds for a plain one.

    Only parameters whose state exists are listed, as in ``torch.optim``.
    """

    def __init__(self, entries: dict[torch.Tensor, tuple[torch.optim.Optimizer, torch.Tensor]]):
        self._entries = entries  # parameter -> (the optimizer that owns its state, the key it uses)

    def __getitem__(self, p: torch.Tensor) -> dict:
        opt, key = self._entries[p]
        return opt.state[key]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (p for p, (opt, key) in self._entries.items() if opt.state.get(key))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def squared_norm(t: torch.Tensor) -> torch.Tensor:
    """``sum(t ** 2)`` as a 0-dim fp32 tensor, a low-precision ``t`` in chunks of
    :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` elements.

    ``torch.linalg.vector_norm(t, dtype=torch.float32)`` of a large bf16 tensor converts all of it to fp32 inside
    the kernel first: 2 GiB for Llama 3's 128,256 x 4,096 gradient, which no tensor op shows (the estimate could
    not see it; the 8B full fine-tune measured 3.9 GiB over its prediction). Here each chunk's fp32 copy is an
    op of its own (4 MiB), so the estimate sees what the run holds. fp32 tensors, and tensors off the CPU (where
    the chunks would cost a few thousand kernel launches a step), keep the one kernel.
    """
    if t.dtype == torch.float32 or t.device.type != "cpu":
        return torch.linalg.vector_norm(t, dtype=torch.float32).square()
    flat = t.reshape(-1)
    total = torch.zeros((), dtype=torch.float32, device=t.device)
    for start in range(0, flat.numel(), hybrids.LOW_BIT_CHUNK_ELEMENTS):
        chunk = flat[start : start + hybrids.LOW_BIT_CHUNK_ELEMENTS].float()
        total += torch.dot(chunk, chunk)
    return total


class _PerParameter(torch.optim.Optimizer):
    """One optimizer per trainable parameter (built by ``make_optimizer`` with the parameter's group hyperparameters)
    behind the ``torch.optim`` contract: ``param_groups`` are this wrapper's groups, and before each update of a
    parameter every hyperparameter its optimizer shares with them (``lr``, ``weight_decay``, ``betas``, ...) is
    copied over, so ``group["lr"] = lr`` set by the training loop is honoured. ``state`` maps each parameter to its
    state, and ``state_dict()`` has the layout of a plain optimizer's (``state`` by parameter index,
    ``param_groups``), so it reads back with ``torch.load(weights_only=True)``.

    With ``rounding`` other than ``nearest``, a bf16 parameter's update is computed on an fp32 copy of it and
    rounded back (:func:`rounded_step`).

    Args:
        params: parameters or parameter groups, as for any ``torch.optim.Optimizer``.
        make_optimizer: builds the optimizer of one parameter from a list of one group, e.g.
            ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``.
        rounding: ``bf16_rounding`` (:mod:`memfit.memory.rounding`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
        *,
        rounding: str = "nearest",
    ):
        self._make_optimizer = make_optimizer
        self._rounding = rounding
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []  # what a subclass registers per parameter
        self._inner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self._device: torch.device | None = None
        super().__init__(params, {})
        self.state = _StateView({p: (opt, p) for p, opt in self._inner.items()})  # type: ignore[assignment]

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; each of its parameters gets its own optimizer.

        Args:
            param_group: ``{"params": [...], <hyperparameters>}``; hyperparameters it leaves out take the values
                the per-parameter optimizer defaults to.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        hyper = {k: v for k, v in group.items() if k not in _GROUP_LABELS}
        for p in group["params"]:
            self._inner[p] = self._make_optimizer([{"params": [p], **hyper}])
            self._added(p)
            self._device = self._device or p.device
        if group["params"]:
            for k, v in self._inner[group["params"][0]].defaults.items():
                group.setdefault(k, v)
                self.defaults.setdefault(k, v)
        self._group_of = {p: g for g in self.param_groups for p in g["params"]}

    def _added(self, p: torch.Tensor) -> None:
        """What a subclass does for each parameter it takes."""

    def _step_one(self, p: torch.Tensor) -> None:
        """Update ``p`` by its own optimizer, with its group's current hyperparameters."""
        inner = self._inner[p]
        inner_group = inner.param_groups[0]
        for k, v in self._group_of[p].items():
            if k in _GROUP_LABELS or k not in inner_group:
                continue
            current = inner_group[k]
            if isinstance(current, torch.Tensor) and not isinstance(v, torch.Tensor):
                current.fill_(v)  # torchao keeps lr as a tensor
            else:
                inner_group[k] = v
        if self._rounding == "nearest" or p.dtype != torch.bfloat16:
            inner.step()
        else:
            rounded_step(inner, p, self._rounding)

    def create_compensation(self) -> None:
        """Create, as zeros, the Kahan compensation (``bf16_rounding: kahan``) of every bf16 parameter whose state
        exists but has none: state laid out by a step that did not round (the zero step of
        :func:`memfit.checkpoint.init_optimizer_state`, which an estimate and a sharded resume take) holds it too."""
        if self._rounding != "kahan":
            return
        for p, inner in self._inner.items():
            if inner.state.get(p):
                rounding_.compensation_of(inner.state[p], p, self._rounding)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient.

        Args:
            set_to_none: accepted for the ``torch.optim`` signature; gradients are always set to ``None``.
        """
        for p in self._inner:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        """The state of every per-parameter optimizer, laid out as a plain optimizer's state dict.

        Returns:
            ``{"state": {index: state}, "param_groups": [{..., "params": [indices]}]}``, indices numbering the
            parameters group by group; tensors, numbers, strings, lists and dicts only.
        """
        state: dict[int, Any] = {}
        groups = []
        index = 0
        for group in self.param_groups:
            indices = []
            for p in group["params"]:
                inner_state = self._inner[p].state_dict()["state"]
                if 0 in inner_state:
                    state[index] = inner_state[0]
                indices.append(index)
                index += 1
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned (of this class, or of a plain optimizer of the same kind).

        Args:
            state_dict: ``{"state": ..., "param_groups": ...}``.

        Raises:
            ValueError: the groups do not match this optimizer's (count, sizes or parameter names).
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} parameter groups, the optimizer "
                f"{len(self.param_groups)}"
            )
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"loaded state dict has a group of {len(saved['params'])} parameters where the "
                    f"optimizer has {len(group['params'])}"
                )
            if (
                "param_names" in group
                and "param_names" in saved
                and group["param_names"] != saved["param_names"]
            ):
                raise ValueError("loaded state dict names other parameters than the optimizer's")
        state = state_dict["state"]
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            for p, saved_index in zip(group["params"], saved["params"], strict=True):
                inner = self._inner[p]
                inner_groups = inner.state_dict()["param_groups"]
                inner.load_state_dict(
                    {
                        "state": {0: state[saved_index]} if saved_index in state else {},
                        "param_groups": inner_groups,
                    }
                )
            group.update({k: v for k, v in saved.items() if k != "params"})


class PerParameterOptimizer(_PerParameter):
    """The optimizer of a run whose bf16 weights round by ``bf16_rounding`` (other than ``nearest``), stepped after
    backward: each parameter with a gradient is updated by its own optimizer, one at a time, its update computed on
    an fp32 copy of the weight and rounded back (:func:`rounded_step`), so the fp32 temporaries are one tensor's
    (one chunk's where the update is elementwise), never the model's."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update every parameter that has a gradient.

        Args:
            closure: called with grad enabled before the updates; its result is returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p)
        return loss


def _sharding_group(t: Any) -> Any:
    """The process group over which a DTensor's local pieces add up to the whole: its one sharded mesh dimension
    (FSDP2's only one; hybrid sharding's ``shard``, its replicas holding the same pieces). ``False`` for a tensor
    replicated everywhere (nothing to sum over).

    Raises:
        ValueError: sharded over several mesh dimensions.
    """
    dims = [i for i, p in enumerate(t.placements) if p.is_shard()]
    if not dims:
        return False
    if len(dims) > 1:
        raise ValueError(
            f"the optimizer in backward sums norms over one sharded mesh dimension, got {t.placements}"
        )
    return t.device_mesh.get_group(dims[0])


class OptimizerInBackward(_PerParameter):
    """Each parameter is updated inside backward, the moment its gradient is complete, and the gradient freed.

    A ``post_accumulate_grad`` hook on every trainable parameter (a) adds the squared L2 norm of its gradient,
    in fp32, into a running 0-dim tensor, (b) steps that parameter's own optimizer (one per parameter, built by
    ``make_optimizer`` with the parameter's group hyperparameters; :class:`_PerParameter`), and (c) sets
    ``p.grad = None``. So at most one parameter's gradient is alive beside those autograd is still accumulating:
    the memory of a full set of gradients is never needed.

    What it cannot do, by construction (config validation rejects these combinations):

    - gradient accumulation over micro-batches (``gradient_accumulation_steps > 1``): the update runs after the
      first micro-batch's backward, before the others' gradients exist;
    - clipping by the global gradient norm (``max_grad_norm > 0``): a parameter is updated before the other
      gradients, hence the global norm, exist. The global norm is still *reported*
      (:meth:`consume_grad_norm`), computed from each gradient just before its update.

    No host sync and no data-dependent Python branching happen in the hooks, so a step runs under
    ``FakeTensorMode`` (with ``adamw``). Its arguments are :class:`_PerParameter`'s.
    """

    _sq_sum: torch.Tensor | None = None
    """The running sum of the squared gradient norms consumed since :meth:`consume_grad_norm`."""
    _sharded_over: Any = None
    """The process group of DTensor (FSDP2) gradients' shards, once one was seen (:func:`_sharding_group`)."""

    def _added(self, p: torch.Tensor) -> None:
        self._hooks.append(p.register_post_accumulate_grad_hook(self._update))

    def _update(self, p: torch.Tensor) -> None:
        """The hook: norm, update, free. Runs in backward, once per parameter and backward."""
        with torch.no_grad():
            grad = p.grad
            replicas = 1
            if hasattr(grad, "to_local"):  # a DTensor shard (FSDP2): this rank's part of the sum of squares
                mesh = grad.device_mesh  # FSDP2's 1-D mesh, or a 2-D or 3-D one of all ranks (HSDP, TP)
                self._sharded_over = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
                # a shard held by several ranks (replicated over a mesh dimension: hybrid sharding's replicas, a
                # tensor-parallel group's norm weights) adds its squares once over them
                replicas = math.prod(
                    mesh.size(i) for i, pl in enumerate(grad.placements) if pl.is_replicate()
                )
                grad = grad.to_local()
            sq = squared_norm(grad) if replicas == 1 else squared_norm(grad) / replicas
            self._sq_sum = sq if self._sq_sum is None else self._sq_sum + sq
            self._step_one(p)
        p.grad = None

    def consume_grad_norm(self) -> torch.Tensor:
        """The global L2 norm of the gradients consumed since the last call, then start again.

        Returns:
            0-dim fp32 tensor on the parameters' device (no host sync): ``sqrt`` of the summed squares, 0 when no
            gradient was consumed.
        """
        sq_sum = self._sq_sum
        self._sq_sum = None
        if sq_sum is None:
            sq_sum = torch.zeros((), dtype=torch.float32, device=self._device)
        if (
            self._sharded_over is not None and self._sharded_over is not False
        ):  # over the ranks holding shards
            dist.all_reduce(sq_sum, op=dist.ReduceOp.SUM, group=self._sharded_over)
        return sq_sum.sqrt()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Nothing to do: every update already ran inside backward.

        Args:
            closure: when given, it is called (with grad enabled) and its result returned; its backward runs
                the updates.

        Returns:
            The closure's result, or ``None``.
        """
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def remove_hooks(self) -> None:
        """Detach the gradient hooks; afterwards backward leaves gradients in ``.grad`` and updates nothing."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


# ----------------------------------------------------------------------------------------------------------------
# bf16 weights updated in fp32, rounded back (bf16_rounding)
# ----------------------------------------------------------------------------------------------------------------


def rounded_step(inner: torch.optim.Optimizer, p: torch.Tensor, rounding: str) -> None:
    """Step ``inner``, the optimizer of the one bf16 parameter ``p``, with the update computed on an fp32 copy of
    ``p`` and rounded back by ``rounding`` (:mod:`memfit.memory.rounding`).

    - torchao's low-bit AdamW and bitsandbytes' CPU updates (``memfit_rounds_natively``) already compute in fp32
      chunk by chunk: they round each chunk themselves.
    - An elementwise update (torch AdamW, Muon's AdamW part) runs on row chunks (of a DTensor's local shard) of
      :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` elements: the parameter, its gradient and every state
      tensor of its shape are given to ``inner`` as the chunk's slices (the state in its own dtype, updated in
      place), the counters restored before each chunk, so each element sees one update. Its state is created
      first where it has none, as torch's first step creates it.
    - Any other update (Muon's orthogonalised matrix, APOLLO's, Adam-mini's; Adafactor rounds natively, in
      chunks) runs on fp32 copies of the whole tensor (a DTensor stays one: the whole-matrix operations gather),
      of its gradient and of its bf16 state tensors, the state written back in its own dtype after; state its
      first step creates in fp32 from those copies is kept in the parameter's dtype, as without rounding (but
      ``step``, a counter torch keeps in fp32).

    A parameter over the fp32 copy stands in for ``p`` while ``inner`` steps (:func:`_swap_step`). Kahan's
    compensation is kept in the state under :data:`memfit.memory.rounding.COMPENSATION`, from the first step on.

    Args:
        inner: the optimizer whose only parameter is ``p``.
        p: a bf16 parameter with a gradient.
        rounding: ``stochastic`` or ``kahan``.
    """
    if getattr(inner, "memfit_rounds_natively", False):
        inner.step()
        return
    state = inner.state[p]
    grad = p.grad
    if _adamw(inner):  # its state made from the bf16 parameter, as torch's first step would (a DTensor's too)
        _create_adamw_state(inner, state, p)
    chunks = _elementwise_chunks(inner, p)
    if chunks is None:
        comp = rounding_.compensation_of(state, p, rounding) if state else None
        before = set(state)
        held = {k: v for k, v in state.items() if k != rounding_.COMPENSATION and _low_precision(v)}
        state.update({k: v.float() for k, v in held.items()})  # the update in fp32 throughout
        data = p.detach()
        p32 = rounding_.to_fp32(data, comp)
        try:
            _swap_step(inner, p, p32, grad.float())
        finally:
            for k, v in held.items():
                v.copy_(state[k])
                state[k] = v
        for k in set(state) - before:  # made by the first step from fp32 copies: the parameter's dtype
            if isinstance(state[k], torch.Tensor) and state[k].dtype == torch.float32 and k != "step":
                state[k] = state[k].to(p.dtype)  # (torch's optimizers keep their step counter in fp32 always)
        rounding_.round_into(data, p32, rounding, rounding_.compensation_of(state, p, rounding))
        return
    comp = hybrids._local(rounding_.compensation_of(state, p, rounding))
    shaped = {k for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == p.shape}
    counters = {
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items() if k not in shaped
    }
    # a DTensor shard is updated on its local tensors (the update is elementwise), as plain slices
    data, local_grad = hybrids._local(p.detach()), hybrids._local(grad)
    local_state = {k: hybrids._local(state[k]) for k in shaped}
    try:
        for a, b in hybrids.traced_chunks(chunks, data):
            sliced = {k: local_state[k][a:b] for k in shaped}
            for k, v in counters.items():  # each chunk takes the step from the same counters
                if isinstance(v, torch.Tensor):
                    state[k].copy_(v)
                else:
                    sliced[k] = v
            inner.state[p] = {**state, **sliced}
            comp_chunk = None if comp is None else comp[a:b]
            p32 = rounding_.to_fp32(data[a:b], comp_chunk)
            _swap_step(inner, p, p32, local_grad[a:b])
            rounding_.round_into(data[a:b], p32, rounding, comp_chunk)
            del p32
            state.update({k: v for k, v in inner.state[p].items() if k not in shaped})
    finally:
        inner.state[p] = state


def _low_precision(value: Any) -> bool:
    """A bf16 or fp16 state tensor (a moment, a factored or projected one, a norm)."""
    return isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16)


def _swap_step(inner: torch.optim.Optimizer, p: torch.Tensor, p32: torch.Tensor, grad: torch.Tensor) -> None:
    """``inner.step()`` on ``p32`` in ``p``'s place: a parameter over ``p32`` (sharing its storage; a ``DTensor``
    stays one) with ``grad`` as its gradient stands in ``p``'s group and holds ``p``'s state for the step. (Not
    ``p.data = p32``: a ``DTensor`` parameter's local tensor does not follow its ``.data``.)"""
    q = torch.nn.Parameter(p32, requires_grad=True)
    if grad.dtype != p32.dtype and hasattr(q, "grad_dtype"):
        q.grad_dtype = None  # torch >= 2.12 holds a gradient to the parameter's dtype unless told not to
    q.grad = grad
    group = inner.param_groups[0]
    params = group["params"]
    group["params"] = [q if x is p else x for x in params]
    inner.state[q] = inner.state.pop(p)
    try:
        inner.step()
    finally:
        inner.state[p] = inner.state.pop(q)
        group["params"] = params


def _elementwise_chunks(inner: torch.optim.Optimizer, p: torch.Tensor) -> list[tuple[int, int]] | None:
    """Row ranges ``[a, b)`` of ``p`` (a ``DTensor``: of its local shard) to update it in, each of at most
    :data:`memfit.memory.hybrids.LOW_BIT_CHUNK_ELEMENTS` elements (one row at the least), where its optimizer's
    update is elementwise (torch AdamW; Muon's AdamW part); ``None``: update it whole."""
    local = hybrids._local(p.detach())
    if not _adamw(inner) or local.dim() < 1 or not local.is_contiguous():
        return None
    rows = local.shape[0]
    per_row = max(1, local.numel() // max(1, rows))
    size = max(1, hybrids.LOW_BIT_CHUNK_ELEMENTS // per_row)
    return [(a, min(rows, a + size)) for a in range(0, rows, size)]


def _adamw(inner: torch.optim.Optimizer) -> bool:
    """Whether ``inner`` updates its one parameter by torch AdamW (itself, or Muon's AdamW part)."""
    return type(inner) is torch.optim.AdamW or (
        isinstance(inner, hybrids.MuonWithAdamW) and inner.param_groups[0].get("algorithm") == "adamw"
    )


def _create_adamw_state(inner: torch.optim.Optimizer, state: dict, p: torch.Tensor) -> None:
    """torch AdamW's state of ``p`` as its first step makes it (``torch.optim.adam._init_group``: a float32 0-dim
    ``step``, the moments as zeros of ``p``'s shape and dtype), where ``p`` has none yet."""
    if "exp_avg" in state:
        return
    group = inner.param_groups[0]
    state["step"] = torch.tensor(0.0, dtype=torch.float32)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


# ----------------------------------------------------------------------------------------------------------------
# Accounting
# ----------------------------------------------------------------------------------------------------------------


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in nested dicts, lists and tuples (the shape of ``optimizer.state`` and of one parameter's state).

    Args:
        obj: a tensor, a mapping, a list or a tuple, nested to any depth; anything else holds no tensor.

    Yields:
        Each tensor as it is held: a tensor subclass (torchao's ``OptimState8bit``, a DTensor) whole, not its inner
        tensors. A tensor held twice is yielded twice.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)


def optimizers_in(optimizer: Any) -> list[Any]:
    """The optimizer and every optimizer held in an attribute of it, directly or in a dict, list or tuple, at any
    depth: :class:`OptimizerInBackward`'s per-parameter optimizers, torchao ``CPUOffloadOptimizer``'s host
    optimizers (``optim_dict``) and device one (``d_opt``).

    Args:
        optimizer: a ``torch.optim.Optimizer``, a wrapper of optimizers, or None.

    Returns:
        The optimizers, each once, ``optimizer`` first; empty for None.
    """
    if optimizer is None:
        return []
    todo, out, seen = [optimizer], [], set()
    while todo:
        opt = todo.pop()
        if id(opt) in seen:
            continue
        seen.add(id(opt))
        out.append(opt)
        for name, value in getattr(opt, "__dict__", {}).items():
            if name not in ("state", "param_groups", "defaults"):
                todo.extend(_held_optimizers(value))
    return out


def create_state(optimizer: Any) -> int:
    """Create now the state that the first step would create, in every optimizer of ``optimizer``
    (:func:`optimizers_in`) that can (a ``create_state`` method: torchao's low-bit AdamW as memfit builds it,
    :func:`memfit.memory.hybrids.low_bit_class`; bitsandbytes' optimizers, through their own ``init_state``:
    :func:`memfit.memory.bnb_cpu.create_bnb_state`); state already there (a resumed run's) is kept.

    On CPU, glibc serves tensors under its mmap threshold from its heaps, which keep the holes between live blocks.
    State made one parameter at a time inside the first backward lands between that backward's temporaries, and
    the holes grow with the layers: the Llama-3.2-3B full fine-tune (4-bit AdamW in backward) held 1.4 GiB of free
    heap at its steps' peaks (``mallinfo2``). Made together before the first step, the state packs densely, and
    the steps' temporaries reuse the same holes step after step.

    Args:
        optimizer: a ``torch.optim.Optimizer``, a wrapper of optimizers, or None.

    Returns:
        How many optimizers created their state.
    """
    made = 0
    for opt in optimizers_in(optimizer):
        create = getattr(opt, "create_state", None)
        if callable(create):
            create()
            made += 1
        elif bnb_cpu.create_bnb_state(opt):
            made += 1
    return made


def _held_optimizers(value: Any) -> list[Any]:
    """Optimizers in an attribute's value: the value itself, or those directly in it when it is a dict, list or
    tuple (as wrappers hold them)."""
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, Mapping):
        return [v for v in value.values() if isinstance(v, torch.optim.Optimizer)]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.optim.Optimizer)]
    return []


def state_tensors(optimizers: Iterable[Any]) -> Iterator[torch.Tensor]:
    """Every tensor in the ``state`` of each of ``optimizers`` (those of :func:`optimizers_in`, say).

    Args:
        optimizers: optimizers; one without a ``state`` attribute (torchao's ``CPUOffloadOptimizer`` not built by
            :func:`build_optimizer`) holds none of its own.

    Yields:
        The tensors of :func:`tensors_in` of each ``state``. A wrapper's ``state`` that views its sub-optimizers'
        (:class:`OptimizerInBackward`, an offload optimizer built here) yields their tensors again.
    """
    for opt in optimizers:
        state = getattr(opt, "state", None)
        if state is not None:
            yield from tensors_in(state)


def optimizer_state_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Every tensor of an optimizer's state, including that of the sub-optimizers a wrapper holds: THE walker of
    optimizer state, on which :func:`optimizer_state_bytes` and the tracker's ``optimizer_state`` category stand.

    Args:
        optimizer: a ``torch.optim.Optimizer``, a wrapper of optimizers, or None.

    Yields:
        Tensors of the state (the ``step`` counters, moments, quantization scales, ...), as
        :func:`state_tensors` of :func:`optimizers_in`: tensor subclasses whole, tensors may repeat.
    """
    yield from state_tensors(optimizers_in(optimizer))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, *, device_type: str | None = None) -> int:
    """Bytes held by the optimizer's state tensors.

    Walks :func:`optimizer_state_tensors` (per-parameter optimizers included: :class:`OptimizerInBackward`,
    torchao's ``CPUOffloadOptimizer``, built here or not). A quantized tensor subclass (torchao's
    ``OptimState8bit`` etc.) counts the inner tensors ``__tensor_flatten__`` names (codes, scales, code table).
    Each storage counts once, so a tensor shared by many parameters' states (bitsandbytes' code tables) counts
    once. Step counters count when they are tensors (``torch.optim.AdamW``, torchao: 4 bytes each), not when
    they are Python numbers (bitsandbytes). Works on fake and meta tensors.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        device_type: count only tensors on this device type (``"cuda"``, ``"cpu"``); ``None`` counts all.

    Returns:
        Bytes.
    """
    seen: set[int] = set()
    total = 0
    for tensor in optimizer_state_tensors(optimizer):
        for plain in _plain_tensors(tensor):
            if device_type is not None and plain.device.type != device_type:
                continue
            storage = plain.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                total += storage.nbytes()
    return total


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``, or the inner tensors of a traceable wrapper subclass (at any depth), which hold its storages."""
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from _plain_tensors(inner)
