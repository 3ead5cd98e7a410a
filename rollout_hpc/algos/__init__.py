"""RL algorithms as pure functions over torch tensors (see docs/algorithms.md)."""

from .advantages import (
    broadcast_to_tokens,
    discounted_returns,
    gae,
    group_normalized,
    last_token_rewards,
    leave_one_out,
    whiten,
)
from .dapo import DynamicSampling, dynamic_sampling_filter, groups_to_refill, overlong_penalty
from .losses import aggregate, entropy_from_logits, kl_penalty, masked_mean, policy_loss, value_loss
from .registry import ALGORITHMS, AlgorithmSpec, compute_advantages, get_algorithm, value_targets

__all__ = [
    "ALGORITHMS", "AlgorithmSpec", "DynamicSampling", "aggregate", "broadcast_to_tokens", "compute_advantages",
    "discounted_returns", "dynamic_sampling_filter", "entropy_from_logits", "gae", "get_algorithm",
    "group_normalized", "groups_to_refill", "kl_penalty", "last_token_rewards", "leave_one_out", "masked_mean",
    "overlong_penalty", "policy_loss", "value_loss", "value_targets", "whiten",
]
