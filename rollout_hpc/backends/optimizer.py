"""The optimizer and the learning-rate schedule every trainer backend uses (algorithm.lr, lr_schedule,
warmup_steps, min_lr_ratio, adam_betas, adam_eps, weight_decay)."""

from __future__ import annotations

import math

import torch


def make_optimizer(params, algorithm) -> torch.optim.Optimizer:
    """AdamW from algorithm.lr, adam_betas, adam_eps, weight_decay (one parameter group, as verl) over the
    parameters that train (with model.lora: the adapters only)."""
    a = algorithm
    params = [p for p in params if p.requires_grad]
    return torch.optim.AdamW(params, lr=a.lr, betas=tuple(a.adam_betas), eps=a.adam_eps, weight_decay=a.weight_decay)


def warmup_steps(algorithm) -> int:
    """algorithm.warmup_steps, or warmup_ratio of the run's optimizer steps (steps x mini_batches x epochs)."""
    a = algorithm
    return a.warmup_steps or int(a.warmup_ratio * a.steps * a.mini_batches * a.epochs)


def lr_at(algorithm, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over warmup_steps(algorithm) from
    lr/warmup, then constant, or linear / cosine decay to lr * min_lr_ratio at the last update
    (algorithm.steps x mini_batches x epochs optimizer steps in the run)."""
    a = algorithm
    total = a.steps * a.mini_batches * a.epochs
    warmup = warmup_steps(a)
    if warmup and step < warmup:
        return a.lr * (step + 1) / warmup
    if a.lr_schedule == "constant":
        return a.lr
    span = max(total - warmup - 1, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    floor = a.lr * a.min_lr_ratio
    if a.lr_schedule == "linear":
        return floor + (a.lr - floor) * (1.0 - progress)
    if a.lr_schedule == "cosine":
        return floor + (a.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"algorithm.lr_schedule '{a.lr_schedule}' is not one of constant, linear, cosine")
