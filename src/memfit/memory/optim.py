"""Optimizers, chosen by one name, with the usual parameter groups, and the learning-rate schedule.

Parameter groups: matrices (``ndim >= 2``: projections and embeddings) get weight decay; 1-D tensors (RMSNorm
weights, biases) do not, as in GPT-2/nanoGPT, litgpt and torchtune practice.
"""

from __future__ import annotations

import math

import torch

from memfit.config import OptimizerConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into a decayed group (``ndim >= 2``) and an undecayed one.

    Returns:
        Two parameter groups with ``name`` ("decay" / "no_decay") and ``param_names`` recorded for inspection.
    """
    decay, no_decay, decay_names, no_decay_names = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim >= 2:
            decay.append(p)
            decay_names.append(name)
        else:
            no_decay.append(p)
            no_decay_names.append(name)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay", "param_names": decay_names},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay", "param_names": no_decay_names},
    ]


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer named by ``cfg.name`` over ``model``'s trainable parameters.

    Args:
        model: the (materialised) model.
        cfg: the optimizer section of the run config.

    Returns:
        A ``torch.optim.Optimizer``; its learning rate is set per step by the training loop.

    Raises:
        ValueError: unknown name or implementation (config validation catches these first).
    """
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        impl = {
            "foreach": {"foreach": True, "fused": False},
            "for_loop": {"foreach": False, "fused": False},
            "fused": {"foreach": False, "fused": True},
        }[cfg.implementation]
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **impl)
    raise ValueError(f"unknown optimizer.name {cfg.name!r}")


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
