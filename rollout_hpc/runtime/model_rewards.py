"""Reward models in the RL loop (rewards.models with nodes: 0): scored on the generator ranks, normalized on the trainers.

Generator side (`ModelScorer`, called by the reward sender thread after the rule reward): each model scores the
samples of the sources it covers, in batches; the record gets its reward parts (rule, then each model's raw score)
and the raw combination as its reward. Trainer side (`ModelRewardNorm`): the step's rewards are recomputed from the
parts with each model's running normalization (rewards/mixing.py), whose statistics go into the checkpoint.
"""

from __future__ import annotations

import numpy as np

from rollout_hpc.envs.base import dataset_item
from rollout_hpc.rewards.mixing import RewardMix, RunningNorm
from rollout_hpc.rewards.reward_models import load_reward_model
from rollout_hpc.runtime.step_plan import domain_names
from rollout_hpc.trajectory import TrajectoryBatch


def _question(item):
    """What a reward model reads as the question: the prompt's chat messages where it has them, else its text."""
    messages = getattr(item, "messages", None)
    return list(messages) if messages else str(getattr(item, "text", item))


def _answer(item):
    return getattr(item, "answer", None)


class ModelScorer:
    """The reward models of one generator rank, loaded once (on its GPU where it has one)."""

    def __init__(self, cfg, dataset):
        self.mix = RewardMix(cfg.rewards, domain_names(cfg))
        self.models = [load_reward_model(spec) for spec in cfg.rewards.models]
        self.dataset = dataset

    def apply(self, batch: TrajectoryBatch, keys: list, texts: list[str]) -> TrajectoryBatch:
        """Score `batch` (rule rewards already in fixed['reward'], keys ('train', prompt index) per row)."""
        items = {i: dataset_item(self.dataset, i) for i in {int(k[1]) for k in keys}}
        rule = batch.fixed["reward"].astype(np.float64)
        domain = batch.fixed["domain"]
        applies = self.mix.applies(domain)
        scores = np.zeros((len(batch), len(self.models)), np.float64)
        for m, model in enumerate(self.models):
            rows = np.flatnonzero(applies[:, m])
            if len(rows):
                mine = [items[int(keys[r][1])] for r in rows]
                scores[rows, m] = model.score(
                    [_question(x) for x in mine], [texts[r] for r in rows], [_answer(x) for x in mine]
                )
        parts = np.concatenate([rule[:, None], scores], axis=1)
        batch.reward_parts = parts.astype(np.float32).reshape(-1)
        batch.fixed["n_reward_parts"] = self.mix.n_parts
        batch.fixed["reward"] = self.mix.raw_reward(rule, scores, domain)
        return batch


class ModelRewardNorm:
    """The trainers' side: each step's rewards from its records' parts, with running per-model normalization."""

    CHECKPOINT_KEY = "reward_models"

    def __init__(self, cfg):
        self.mix = RewardMix(cfg.rewards, domain_names(cfg))
        self.norm = RunningNorm(self.mix.names)

    def apply(self, batch: TrajectoryBatch) -> dict[str, float]:
        """Set batch.fixed['reward'] (a step's records, in uid order) and return the step's per-model metrics."""
        n = self.mix.n_parts
        bad = batch.fixed["n_reward_parts"] != n
        if bad.any():
            r = batch.record(int(np.flatnonzero(bad)[0]))
            raise ValueError(
                f"record prompt {r['prompt_id']} sample {r['sample_idx']} has {r['n_reward_parts']} reward parts, "
                f"expected {n} (the rule reward and {n - 1} reward models): generators and trainers disagree on "
                "rewards.models"
            )
        parts = batch.reward_parts.reshape(len(batch), n).astype(np.float64)
        domain = batch.fixed["domain"]
        batch.fixed["reward"] = self.mix.reward(parts, domain, self.norm)
        return self.mix.step_metrics(parts, domain)

    def state_dict(self) -> dict:
        return self.norm.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.norm.load_state_dict(state)
