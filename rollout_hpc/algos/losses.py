"""Token-level losses shared by every algorithm: aggregation, clipped policy loss,
clipped value loss, KL estimators and entropy.

All tensors are [batch, response_tokens]; `mask` is 1 on tokens the policy chose
(response tokens with loss_mask 1) and 0 on padding and environment text.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]
KLEstimator = Literal["k1", "k2", "k3"]

# k3 is exp(x) - x - 1: bounded below by 0 but explodes for large log-ratios; clamp
# the result like verl's "low_var_kl" so one outlier token cannot dominate a step.
_K3_MAX = 10.0


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: Aggregation) -> torch.Tensor:
    """Reduce per-token values to a scalar.

    token_mean: sum over all valid tokens / number of valid tokens (every token weighs the same;
                long responses weigh more; DAPO's choice).
    seq_mean:   mean over the valid tokens of each sequence, then mean over the sequences that
                have any valid token (every sequence weighs the same; GRPO paper's choice).
    """
    mask = mask.to(values.dtype)
    if agg == "token_mean":
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    if agg == "seq_mean":
        tokens = mask.sum(dim=-1)
        per_seq = (values * mask).sum(dim=-1) / tokens.clamp(min=1.0)
        has_tokens = (tokens > 0).to(values.dtype)
        return (per_seq * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)
    raise ValueError(f"loss aggregation '{agg}' is not one of token_mean, seq_mean (algorithm.loss_agg)")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return aggregate(values, mask, "token_mean")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    agg: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, -min(r A, clip(r, 1-clip_eps, 1+clip_eps_high) A), aggregated.

    r = exp(logprobs - old_logprobs). clip_eps_high (DAPO clip-higher) defaults to clip_eps.
    Stats (floats, over valid tokens): clip_frac (the clipped term was the active one),
    clip_frac_low / clip_frac_high (ratio beyond the lower / upper bound with the bound binding),
    approx_kl (mean of old_logprobs - logprobs, the k1 estimate of KL(old || new)),
    ratio_mean, ratio_max.
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high)
    loss_tok = torch.maximum(unclipped, clipped)
    loss = aggregate(loss_tok, mask, agg)

    with torch.no_grad():
        m = mask.to(ratio.dtype)
        binding = (clipped > unclipped).to(ratio.dtype)
        valid = m.bool()
        stats = {
            "clip_frac": masked_mean(binding, m).item(),
            "clip_frac_low": masked_mean(binding * (ratio < 1.0 - clip_eps).to(m.dtype), m).item(),
            "clip_frac_high": masked_mean(binding * (ratio > 1.0 + eps_high).to(m.dtype), m).item(),
            "approx_kl": masked_mean(-log_ratio, m).item(),
            "ratio_mean": masked_mean(ratio, m).item(),
            "ratio_max": ratio[valid].max().item() if valid.any() else 1.0,
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_value: float = 0.2,
    agg: Aggregation = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss with value clipping: 0.5 * max((V - R)^2, (V_clip - R)^2),
    V_clip = old_V + clip(V - old_V, -clip_eps_value, +clip_eps_value)."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * aggregate(torch.maximum(loss_unclipped, loss_clipped), mask, agg)
    with torch.no_grad():
        stats = {
            "vf_clip_frac": masked_mean((loss_clipped > loss_unclipped).to(values.dtype), mask).item(),
            "value_mean": masked_mean(values, mask).item(),
        }
    return loss, stats


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 = log p - log q  (unbiased, high variance, can be negative)
    k2 = 0.5 (log p - log q)^2
    k3 = q/p - log(q/p) - 1  (unbiased, always >= 0; clamped at 10)
    with log p = logprobs, log q = ref_logprobs.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.clamp(torch.exp(-log_ratio) + log_ratio - 1.0, max=_K3_MAX)
    raise ValueError(f"KL estimator '{estimator}' is not one of k1, k2, k3 (algorithm.kl_estimator)")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last axis: logsumexp(l) - sum softmax(l) * l."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
