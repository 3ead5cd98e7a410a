"""The optimizer and the learning-rate schedule every trainer backend uses (algorithm.lr, lr_schedule,
warmup_steps, min_lr_ratio, adam_betas, adam_eps, weight_decay)."""

from __future__ import annotations

import math

import torch


def make_optimizer(params, algorithm) -> torch.optim.Optimizer:
    """AdamW from algorithm.lr, adam_betas, adam_eps, weight_decay (one parameter group, as verl)."""
    a = algorithm
    return torch.optim.AdamW(params, lr=a.lr, betas=tuple(a.adam_betas), eps=a.adam_eps, weight_decay=a.weight_decay)


def lr_at(algorithm, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warmup over algorithm.warmup_steps from
    lr/warmup_steps, then constant, or linear / cosine decay to lr * min_lr_ratio at the last update
    (algorithm.steps x mini_batches x epochs optimizer steps in the run)."""
    a = algorithm
    if a.warmup_steps and step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if a.lr_schedule == "constant":
        return a.lr
    total = a.steps * a.mini_batches * a.epochs
    span = max(total - a.warmup_steps - 1, 1)
    progress = min(max(step - a.warmup_steps, 0) / span, 1.0)
    floor = a.lr * a.min_lr_ratio
    if a.lr_schedule == "linear":
        return floor + (a.lr - floor) * (1.0 - progress)
    if a.lr_schedule == "cosine":
        return floor + (a.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"algorithm.lr_schedule '{a.lr_schedule}' is not one of constant, linear, cosine")
