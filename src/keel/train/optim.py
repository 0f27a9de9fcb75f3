"""AdamW with decoupled weight decay on matrices only, and the warmup + decay learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn


def param_groups(modules: Iterable[nn.Module], weight_decay: float) -> list[dict]:
    """Two groups: weight decay on matrices (linears, embeddings, experts); none on norms and biases.

    The rule is by shape (ndim < 2: a norm weight or a bias), as nanoGPT and torchtitan do, so it
    holds for every architecture and for sharded (DTensor) parameters alike.
    """
    decay, no_decay = [], []
    seen: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    modules: Iterable[nn.Module],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW; `fused=None` picks the fused kernel where torch has one for these parameters."""
    groups = param_groups(modules, weight_decay)
    if fused is None:
        # The fused kernel takes every float dtype on CPU and CUDA; DTensor parameters work too.
        fused = True
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    except (RuntimeError, TypeError, ValueError):
        if fused:  # e.g. a device without the fused kernel: the foreach implementation is exact too
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)
        raise


def lr_lambda(warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float):
    """The multiplier of the base lr at optimizer step `step` (0-based): linear warmup from
    1/warmup, then cosine or linear decay to min_lr_ratio at the last step, or constant."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if decay == "constant" or total_steps <= warmup_steps:
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if decay == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, decay: str, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(warmup_steps, total_steps, decay, min_lr_ratio))


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Each parameter group's learning rate set to what the scheduler's lambdas give at its current step.
    After a restore the optimizer holds the rate the checkpoint's schedule set; a resumed run whose
    schedule changed (training.steps, warmup, decay) follows its own from its first step on, and with an
    unchanged schedule this is the same value."""
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
