"""Advantage estimators: per-sequence rewards in, per-token advantages out.

Layout convention: `rewards` is [B] with B = n_groups * group_size and the samples
of one prompt contiguous (rows g*G .. g*G+G-1), i.e. a batch sorted by
(prompt_id, sample_idx). `mask` is [B, T] (1 = token the policy chose).
Every function returns [B, T] with zeros where mask is 0.
"""

from __future__ import annotations

import torch

from .losses import KLEstimator, kl_penalty


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one value per sequence, shape [B]; got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of algorithm.group_size={group_size}; "
            "every prompt needs exactly group_size samples"
        )
    return rewards.view(-1, group_size)


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] per-sequence values -> [B, T], zero off the mask."""
    return seq_values[:, None].to(mask.device) * mask.to(seq_values.dtype)


def last_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward on its last valid token: [B] -> [B, T]."""
    m = mask.to(rewards.dtype)
    T = m.shape[-1]
    idx = torch.arange(T, device=m.device).expand_as(m)
    last = torch.where(m > 0, idx, torch.full_like(idx, -1)).max(dim=-1).values
    out = torch.zeros_like(m)
    has = last >= 0
    out[has, last[has]] = rewards[has]
    return out


def group_normalized(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO / DAPO: (r - mean_group) / (std_group + eps), std with Bessel's correction
    (as torch.std, verl and OpenRLHF). scale_by_std=False gives r - mean_group (Dr. GRPO)."""
    g = _groups(rewards, group_size)
    centred = g - g.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (g.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: r_i - mean_{j != i} r_j  ( = G/(G-1) * (r_i - mean_group) )."""
    if group_size < 2:
        raise ValueError("RLOO needs algorithm.group_size >= 2 (the baseline is the other samples of the prompt)")
    g = _groups(rewards, group_size)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def anchor_state_advantages(
    groups: torch.Tensor, states: torch.Tensor, returns: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GiGPO's step-level advantages (Feng et al. 2025, "Group-in-Group Policy Optimization for LLM Agent
    Training"), one value per turn. Within a group (the episodes of one prompt), the turns that acted on the same
    observation (an anchor state: equal `states` ids) are compared by their returns-to-go: (R - mean) / (std + eps),
    std with Bessel's correction as group_normalized; a state that occurs once in its group gets 0 (nothing acted
    on it differently). groups, states (int64) and returns: [N], one entry per turn. Returns [N]."""
    if not groups.shape == states.shape == returns.shape or returns.dim() != 1:
        raise ValueError(
            f"groups, states and returns must be [N] each, one entry per turn; got shapes {tuple(groups.shape)}, "
            f"{tuple(states.shape)}, {tuple(returns.shape)}"
        )
    if not len(returns):
        return returns.clone()
    _, key, counts = torch.unique(torch.stack([groups, states], 1), dim=0, return_inverse=True, return_counts=True)
    n = counts.to(returns.dtype)
    mean = torch.zeros_like(n).index_add_(0, key, returns) / n
    dev = returns - mean[key]
    var = torch.zeros_like(n).index_add_(0, key, dev * dev) / (n - 1).clamp(min=1.0)
    out = dev / (var.sqrt()[key] + eps)
    return torch.where(counts[key] > 1, out, torch.zeros_like(out))


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens; masked tokens are skipped (the
    return flows through environment text unchanged) and get 0."""
    m = mask.to(token_rewards.dtype)
    out = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in range(token_rewards.shape[1] - 1, -1, -1):
        valid = m[:, t]
        running = torch.where(valid > 0, token_rewards[:, t] + gamma * running, running)
        out[:, t] = running * valid
    return out


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens -> (advantages, returns).

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  returns = A + V.
    "t+1" is the next VALID token (environment text in between is skipped); after the last
    valid token V = 0 and A = 0 (the episode ends).
    """
    m = mask.to(values.dtype)
    adv = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    for t in range(values.shape[1] - 1, -1, -1):
        valid = m[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(valid, a, torch.zeros_like(a))
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, a, next_adv)
    returns = (adv + values) * m
    return adv, returns


def whiten(
    values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, domains: torch.Tensor | None = None
) -> torch.Tensor:
    """(x - mean) / (std + eps) over all valid tokens of the batch; zero off the mask. With `domains` ([B], the source
    of each row of a mixed dataset) each source's rows are whitened on their own statistics: a domain whose
    rewards run larger does not set the scale of the others."""
    if domains is not None:
        out = torch.zeros_like(values)
        for d in torch.unique(domains):
            rows = domains.to(values.device) == d
            out[rows] = whiten(values[rows], mask[rows], eps)
        return out
    m = mask.to(values.dtype)
    n = m.sum().clamp(min=1.0)
    mean = (values * m).sum() / n
    var = (((values - mean) * m) ** 2).sum() / (n - 1).clamp(min=1.0)
    return (values - mean) / (var.sqrt() + eps) * m


def token_kl_rewards(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    kl_estimator: KLEstimator,
) -> torch.Tensor:
    """[B, T] reward: sequence reward on the last valid token minus kl_coef * KL_t on every token."""
    token_rewards = last_token_rewards(rewards, mask)
    if kl_coef > 0:
        if logprobs is None or ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs logprobs and ref_logprobs (a reference model) for the KL reward")
        token_rewards = token_rewards - kl_coef * kl_penalty(logprobs, ref_logprobs, kl_estimator) * mask.to(
            rewards.dtype
        )
    return token_rewards
