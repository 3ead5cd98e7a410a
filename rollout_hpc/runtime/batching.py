"""From a step's trajectory records to the tensors and the loss a trainer step needs.

Pure functions of (records, config): the trainer loop calls them, tests and the
benchmark can too. Records are sorted by uid first, so the arrival order of
batches from different generators never changes what is trained.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout_hpc import algos
from rollout_hpc.runtime import step_plan
from rollout_hpc.trajectory import TrajectoryBatch


class StalenessError(RuntimeError):
    """A record older than exchange.max_staleness reached the trainer (a protocol bug, never user data)."""


def sort_by_uid(batch: TrajectoryBatch, group_size: int) -> TrajectoryBatch:
    order = np.argsort(batch.uids(group_size), kind="stable")
    return batch.select(order)


def check_staleness(batch: TrajectoryBatch, step: int, max_staleness: int) -> int:
    """Largest lag (step - policy_version) in the batch; raises if any record is too old."""
    lag = step - batch.fixed["policy_version"].astype(np.int64)
    worst = int(lag.max()) if len(lag) else 0
    if worst > max_staleness or (len(lag) and int(lag.min()) < 0):
        bad = int(np.argmax(lag)) if worst > max_staleness else int(np.argmin(lag))
        r = batch.record(bad)
        raise StalenessError(
            f"step {step}: record prompt {r['prompt_id']} sample {r['sample_idx']} from generator rank {r['gen_rank']} "
            f"was made by policy version {r['policy_version']} (exchange.max_staleness is {max_staleness})"
        )
    return worst


def check_complete(batch: TrajectoryBatch, step: int, prompts, group_size: int) -> None:
    """Exactly the step's prompts (step_plan.StepPlan.prompts), each with its whole group, each record once."""
    ids = np.asarray(prompts, np.uint64)
    want = (ids[:, None] * np.uint64(group_size) + np.arange(group_size, dtype=np.uint64)[None, :]).reshape(-1)
    got = np.sort(batch.uids(group_size))
    if len(got) != len(want) or not np.array_equal(got, want):
        missing = np.setdiff1d(want, got)[:5]
        extra = np.setdiff1d(got, want)[:5]
        raise StalenessError(
            f"step {step}: the trainer received {len(got)} records, expected the {len(want)} records of prompts "
            f"{step_plan.describe(prompts)} (missing uids {missing.tolist()}, unexpected {extra.tolist()})"
        )


def collate(batch: TrajectoryBatch, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded [B, T] tensors: prompt+response tokens, attention mask, response (loss) mask,
    the generators' sampling log-probabilities at response positions, and per-sequence rewards."""
    f = batch.fixed
    n = len(batch)
    plen = f["prompt_len"].astype(np.int64)
    rlen = f["response_len"].astype(np.int64)
    T = int((plen + rlen).max()) if n else 1
    ids = np.full((n, T), pad_id, np.int64)
    attn = np.zeros((n, T), np.int64)
    mask = np.zeros((n, T), np.float32)
    old_lp = np.zeros((n, T), np.float32)
    poff, roff = batch.offsets("prompt_len"), batch.offsets("response_len")
    for i in range(n):
        p, r = plen[i], rlen[i]
        ids[i, :p] = batch.prompt_ids[poff[i] : poff[i + 1]]
        ids[i, p : p + r] = batch.response_ids[roff[i] : roff[i + 1]]
        attn[i, : p + r] = 1
        mask[i, p : p + r] = batch.loss_mask[roff[i] : roff[i + 1]]
        old_lp[i, p : p + r] = batch.logprobs[roff[i] : roff[i + 1]]
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "mask": torch.from_numpy(mask),
        "old_logprobs": torch.from_numpy(old_lp),
        "rewards": torch.from_numpy(f["reward"].astype(np.float32)),
        "response_len": torch.from_numpy(rlen.astype(np.float32)),
        "domain": torch.from_numpy(f["domain"].astype(np.int64)),
    }


def add_advantages(
    cfg, tensors: dict, ref_logprobs: torch.Tensor | None, values: torch.Tensor | None = None
) -> dict[str, float]:
    """Put per-token advantages (and the reference log-probs) into `tensors`; returns batch stats.
    With a critic's `values` (PPO), also its targets: tensors['old_values'] and tensors['returns'].

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


def empty_like(tensors: dict) -> dict:
    """Row 0 with a zero loss mask: an update that changes nothing but keeps the ranks' collectives in step."""
    out = select_rows(tensors, np.zeros(1, np.int64))
    out["mask"] = torch.zeros_like(out["mask"])
    return out


def trainable_groups(mask: torch.Tensor, group_size: int) -> np.ndarray:
    """Indices of the prompt groups with any loss token (dynamic sampling zeroes the masks of dropped groups)."""
    tokens = mask.reshape(-1, group_size * mask.shape[-1]).sum(dim=1) if mask.numel() else torch.zeros(0)
    return torch.nonzero(tokens > 0).flatten().numpy()


def shard_groups(groups: np.ndarray, group_size: int, group_rank: int, group_size_ranks: int) -> np.ndarray:
    """Record indices this trainer rank trains on: whole prompt groups (from `groups`), contiguous, split evenly."""
    mine = np.array_split(np.asarray(groups, np.int64), group_size_ranks)[group_rank]
    return (mine[:, None] * group_size + np.arange(group_size)[None, :]).reshape(-1)


def select_rows(tensors: dict, rows: np.ndarray) -> dict:
    idx = torch.from_numpy(rows)
    return {k: v.index_select(0, idx) for k, v in tensors.items()}
