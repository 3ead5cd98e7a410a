"""The objective of one train step, on the tensors runtime/records.py makes: advantages from the step's
(shaped) rewards per the algorithm's table row, the policy loss (KL in the loss or the reward, entropy
bonus), and the optimizer updates (algorithm.mini_batches x epochs, the PPO critic beside the policy).

Pure functions of (tensors, config): the trainer loop calls them, tests and benchmarks can too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_hpc import algos
from rollout_hpc.runtime import step_plan
from rollout_hpc.runtime.records import empty_like, select_rows


def add_advantages(
    cfg, tensors: dict, ref_logprobs: torch.Tensor | None, values: torch.Tensor | None = None, turns=None
) -> dict[str, float]:
    """Put per-token advantages (and the reference log-probs) into `tensors`; returns batch stats.
    With a critic's `values` (PPO), also its targets: tensors['old_values'] and tensors['returns'].
    With algorithm.step_advantage_weight, `turns` (records.turn_table of the same batch) adds GiGPO's step-level
    advantages to each turn's tokens.

    The generators' sampling log-probabilities serve as `logprobs` for KL-in-reward
    algorithms: they are the behaviour policy the tokens came from."""
    a = cfg.algorithm
    spec = algos.get_algorithm(a.name)
    rewards = step_plan.shaped_rewards(cfg, tensors["rewards"], tensors["response_len"])
    params: dict[str, Any] = {}  # keyword arguments of algos.compute_advantages
    if spec.kl_in == "reward" and a.kl_coef > 0:
        params.update(
            logprobs=tensors["old_logprobs"], ref_logprobs=ref_logprobs, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator
        )
    params.update(gamma=a.gamma, lam=a.lam)  # estimators take what they use (algos.compute_advantages)
    if spec.needs_critic:
        params.update(values=values)
    if a.normalize_by_domain and len(step_plan.domain_quotas(cfg)) > 1:
        params.update(domains=tensors["domain"])  # batch-level normalisation within each source
    tensors["advantages"] = algos.compute_advantages(a.name, rewards, a.group_size, tensors["mask"], **params)
    if a.step_advantage_weight:
        if turns is None:
            raise ValueError("algorithm.step_advantage_weight needs the batch's turns (records.turn_table)")
        tensors["advantages"] = tensors["advantages"] + a.step_advantage_weight * step_advantages(
            turns, a.group_size, tensors["mask"]
        )
    if spec.needs_critic:
        tensors["old_values"] = values
        tensors["returns"] = algos.value_targets(rewards, tensors["mask"], **params)
    if ref_logprobs is not None:
        tensors["ref_logprobs"] = ref_logprobs
    stats = {"shaped_reward_mean": float(rewards.mean())}
    if step_plan.uses_dynamic_sampling(cfg):
        ds = algos.dynamic_sampling_filter(rewards, a.group_size)
        # Groups whose rewards are all equal carry no signal: drop them from the loss (trainable_groups skips them).
        tensors["mask"] = tensors["mask"] * ds.keep[:, None].to(tensors["mask"].dtype)
        stats["groups_kept"] = float(ds.kept_groups)
        stats["groups_dropped"] = float(ds.dropped_groups)
    return stats


def step_advantages(turns: dict, group_size: int, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: each turn's anchor-state advantage (algos.anchor_state_advantages) on its trained tokens."""
    per_turn = algos.anchor_state_advantages(turns["row"] // group_size, turns["state"], turns["ret"])
    out = torch.zeros_like(mask, dtype=torch.float32)
    for row, start, end, value in zip(turns["row"].tolist(), turns["start"].tolist(), turns["end"].tolist(), per_turn):
        out[row, start:end] = value
    return out * mask


def make_loss_fn(cfg):
    """loss_fn(logprobs, entropy, batch) for Trainer.train_step: the clipped policy loss, plus the
    KL-to-reference term for algorithms that put KL in the loss, minus the entropy bonus."""
    a = cfg.algorithm
    spec = algos.get_algorithm(a.name)
    clip_high = a.clip_eps_high if a.clip_eps_high is not None else a.clip_eps

    def loss_fn(logp: torch.Tensor, ent: torch.Tensor, b: dict):
        mask = b["mask"]
        loss, stats = algos.policy_loss(
            logp, b["old_logprobs"], b["advantages"], mask, a.clip_eps, clip_high, a.loss_agg
        )
        if "ref_logprobs" in b:
            kl = algos.aggregate(algos.kl_penalty(logp, b["ref_logprobs"], a.kl_estimator), mask, a.loss_agg)
            if spec.kl_in == "loss":
                loss = loss + a.kl_coef * kl
            stats["kl"] = float(kl.detach())
        else:
            stats["kl"] = stats["approx_kl"]  # no reference model: KL(behaviour || current) instead
        entropy = algos.aggregate(ent, mask, a.loss_agg)
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * entropy
        stats["entropy"] = float(entropy.detach())
        return loss, stats

    return loss_fn


def train_updates(cfg, trainer, critic, mine: dict, loss_fn) -> dict[str, float]:
    """algorithm.epochs passes over this rank's share, each split into algorithm.mini_batches contiguous
    mini-batches, one optimizer update each (policy, then the critic on the same rows). The ratio is always
    against the behaviour log-probs (old_logprobs), as in PPO. Returns the updates' metrics: means (times
    summed, the last lr), plus `updates`. Default 1 x 1: one train_step on the whole share, as before.

    Every rank runs the same number of updates (mini-batches of a too-small share are empty, weight 0)."""
    a = cfg.algorithm
    if a.mini_batches == 1 and a.epochs == 1:
        stats = trainer.train_step(mine, loss_fn, agg=a.loss_agg)
        if critic:
            stats.update(critic.train_step(mine))
        return stats
    rows = np.arange(int(mine["input_ids"].shape[0]))
    history: list[dict[str, float]] = []
    for _ in range(a.epochs):
        for part in np.array_split(rows, a.mini_batches):
            mb = select_rows(mine, part) if len(part) else empty_like(mine)
            stats = trainer.train_step(mb, loss_fn, agg=a.loss_agg)
            if critic:
                stats.update(critic.train_step(mb))
            history.append(stats)
    out: dict[str, float] = {}
    for key in history[0]:
        values = [h[key] for h in history if key in h]
        if key.endswith("_time"):
            out[key] = float(sum(values))
        elif key in ("lr", "critic_lr"):
            out[key] = float(values[-1])
        elif key.endswith("_max"):
            out[key] = float(max(values))
        else:
            out[key] = float(np.mean(values))
    out["updates"] = float(len(history))
    return out
