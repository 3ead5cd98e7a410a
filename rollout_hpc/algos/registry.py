"""Which algorithm needs what (the rows of algos/table.py), the advantage estimators by name, and one
entry point for advantages."""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import advantages as A
from .table import ALGORITHMS, Algorithm

AlgorithmSpec = Algorithm  # the row type (algos/table.py); the old name stays importable


# Every keyword compute_advantages understands; an algorithm uses the ones it needs, so a
# loop may pass the same set for any algorithm. Anything else is a typo and an error.
ADVANTAGE_PARAMS = {
    "eps",
    "scale_by_std",
    "gamma",
    "lam",
    "values",
    "normalize",
    "logprobs",
    "ref_logprobs",
    "kl_coef",
    "kl_estimator",
    "domains",
}


def get_algorithm(name: str) -> AlgorithmSpec:
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"algorithm '{name}' is unknown; use one of {', '.join(ALGORITHMS)} (algorithm.name)"
        ) from None


def compute_advantages(name: str, rewards: torch.Tensor, group_size: int, mask: torch.Tensor, **params) -> torch.Tensor:
    """Per-token advantages [B, T] for algorithm `name` from per-sequence rewards [B].

    Params (all optional unless noted): eps=1e-6, scale_by_std=True (grpo/dapo);
    gamma=1.0 (ppo, reinforce_pp); lam=0.95, values [B,T] (ppo, required), normalize=True (ppo);
    logprobs, ref_logprobs [B,T], kl_coef=0.0, kl_estimator="k3" (KL in the reward: ppo, rloo, reinforce_pp);
    domains [B] (a mixed dataset's source per row): batch-level whitening (reinforce_pp, ppo) per source.
    """
    spec = get_algorithm(name)
    unknown = set(params) - ADVANTAGE_PARAMS
    if unknown:
        raise TypeError(
            f"compute_advantages got unknown parameters {sorted(unknown)}; known: {sorted(ADVANTAGE_PARAMS)}"
        )
    if group_size < spec.min_group_size:
        raise ValueError(f"algorithm '{name}' needs algorithm.group_size >= {spec.min_group_size}, got {group_size}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32, device=mask.device)
    eps = params.get("eps", 1e-6)
    gamma = params.get("gamma", 1.0)
    kl = dict(
        logprobs=params.get("logprobs"),
        ref_logprobs=params.get("ref_logprobs"),
        kl_coef=params.get("kl_coef", 0.0),
        kl_estimator=params.get("kl_estimator", "k3"),
    )

    return ESTIMATORS[spec.advantage](rewards, group_size, mask, params, kl, eps, gamma)


# Advantage estimators by name (a row's `advantage`): (rewards [B], G, mask, params, kl, eps, gamma) -> [B, T].
def _group_normalized(rewards, group_size, mask, params, kl, eps, gamma):
    return A.broadcast_to_tokens(A.group_normalized(rewards, group_size, eps, params.get("scale_by_std", True)), mask)


def _group_centered(rewards, group_size, mask, params, kl, eps, gamma):
    return A.broadcast_to_tokens(A.group_normalized(rewards, group_size, eps, scale_by_std=False), mask)


def _leave_one_out(rewards, group_size, mask, params, kl, eps, gamma):
    # Sequence-level KL: the per-token KL penalties summed along the response.
    token_r = A.token_kl_rewards(rewards, mask, **kl)
    return A.broadcast_to_tokens(A.leave_one_out(token_r.sum(dim=-1), group_size), mask)


def _reinforce_pp(rewards, group_size, mask, params, kl, eps, gamma):
    returns = A.discounted_returns(A.token_kl_rewards(rewards, mask, **kl), mask, gamma)
    return A.whiten(returns, mask, eps, params.get("domains"))


def _gae(rewards, group_size, mask, params, kl, eps, gamma):
    adv, _ = _ppo_gae(rewards, mask, params, kl)
    return A.whiten(adv, mask, eps, params.get("domains")) if params.get("normalize", True) else adv


ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "group_normalized": _group_normalized,
    "group_centered": _group_centered,
    "leave_one_out": _leave_one_out,
    "reinforce_pp": _reinforce_pp,
    "gae": _gae,
}
assert all(row.advantage in ESTIMATORS for row in ALGORITHMS.values())


def value_targets(rewards: torch.Tensor, mask: torch.Tensor, **params) -> torch.Tensor:
    """PPO critic targets (GAE returns = unnormalised advantages + values), same params as compute_advantages."""
    unknown = set(params) - ADVANTAGE_PARAMS
    if unknown:
        raise TypeError(f"value_targets got unknown parameters {sorted(unknown)}")
    rewards = torch.as_tensor(rewards, dtype=torch.float32, device=mask.device)
    kl = dict(
        logprobs=params.get("logprobs"),
        ref_logprobs=params.get("ref_logprobs"),
        kl_coef=params.get("kl_coef", 0.0),
        kl_estimator=params.get("kl_estimator", "k3"),
    )
    return _ppo_gae(rewards, mask, params, kl)[1]


def _ppo_gae(rewards, mask, params, kl):
    values = params.get("values")
    if values is None:
        raise ValueError("ppo needs values=[B, T] from the critic to compute GAE")
    token_r = A.token_kl_rewards(rewards, mask, **kl)
    return A.gae(token_r, values.detach(), mask, params.get("gamma", 1.0), params.get("lam", 0.95))
