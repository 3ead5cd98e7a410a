"""DAPO's batch-side pieces: dynamic sampling and overlong reward shaping.
(Clip-higher is `policy_loss(clip_eps_high=...)`; token-level aggregation is `agg="token_mean"`.)"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DynamicSampling:
    keep: torch.Tensor  # [B] bool: samples of groups whose rewards are not all equal
    kept_groups: int
    dropped_groups: int  # groups with no learning signal: generate this many more prompts to refill


def dynamic_sampling_filter(rewards, group_size: int, tol: float = 1e-6) -> DynamicSampling:
    """Drop groups whose rewards are all equal (all right or all wrong: zero advantage,
    no gradient). `rewards` is [B], groups contiguous. Returns which samples to keep and
    how many groups to refill."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.numel() % group_size:
        raise ValueError(f"{r.numel()} rewards do not split into groups of algorithm.group_size={group_size}")
    g = r.view(-1, group_size)
    informative = (g.max(dim=1).values - g.min(dim=1).values) > tol
    keep = informative.repeat_interleave(group_size)
    kept = int(informative.sum())
    return DynamicSampling(keep=keep, kept_groups=kept, dropped_groups=int(g.shape[0]) - kept)


def overlong_penalty(response_lengths, max_new_tokens: int, overlong_buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward of each sequence:

        0                                          if L <= max_new_tokens - overlong_buffer
        -penalty * (L - (max - buffer)) / buffer   if max - buffer < L <= max
        -penalty                                   if L > max
    overlong_buffer = 0 turns it off (all zeros)."""
    lengths = torch.as_tensor(response_lengths, dtype=torch.float32)
    if overlong_buffer <= 0:
        return torch.zeros_like(lengths)
    if overlong_buffer > max_new_tokens:
        raise ValueError(
            f"algorithm.overlong_buffer ({overlong_buffer}) must not exceed algorithm.max_new_tokens ({max_new_tokens})"
        )
    start = max_new_tokens - overlong_buffer
    ramp = -penalty * (lengths - start).clamp(min=0) / overlong_buffer
    return torch.where(lengths > max_new_tokens, torch.full_like(lengths, -penalty), ramp)


def groups_to_refill(target_groups: int, kept_groups: int) -> int:
    """Prompts still to generate (each a full group) to reach a batch of target_groups informative groups."""
    return max(0, target_groups - kept_groups)
