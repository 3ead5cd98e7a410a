"""Reward models in the RL loop: scored on the generator ranks (nodes: 0) or the reward group (nodes > 0),
normalized on the trainers.

Scoring side (`ModelScorer`): on a generator rank the reward sender thread calls it after the rule reward; on a
reward rank (runtime/reward_group.py) the group's loop calls it on each batch that comes from the generators. Each
of its models scores the samples of the sources it covers, in batches; the record gets its reward parts (rule, then
each model's raw score) and, once every part is there, the raw combination as its reward. A part the reward group
has yet to fill is PENDING (+inf) on its way there. Trainer side (`ModelRewardNorm`): the step's rewards are
recomputed from the parts with each model's running normalization (rewards/mixing.py), whose statistics go into the
checkpoint.
"""

from __future__ import annotations

import numpy as np

from rollout_hpc.envs.base import dataset_item
from rollout_hpc.rewards.mixing import RewardMix, RunningNorm
from rollout_hpc.rewards.reward_models import load_reward_model
from rollout_hpc.runtime.step_plan import domain_names
from rollout_hpc.trajectory import TrajectoryBatch


def question_of(item):
    """What a reward model reads as the question: the prompt's chat messages where it has them, else its text."""
    messages = getattr(item, "messages", None)
    return list(messages) if messages else str(getattr(item, "text", item))


def _answer(item):
    return getattr(item, "answer", None)


PENDING = np.inf  # a reward part the reward group has yet to fill (NaN means a judge reply that did not parse)


class ModelScorer:
    """The reward models of one process, loaded once (on its GPU where it has one): on a generator rank those with
    nodes: 0, on a reward rank (`in_group`) those with nodes > 0."""

    def __init__(self, cfg, dataset, in_group: bool = False):
        self.mix = RewardMix(cfg.rewards, domain_names(cfg))
        specs = cfg.rewards.models
        self.models = {m: load_reward_model(s) for m, s in enumerate(specs) if (s.nodes > 0) == in_group}
        self.pending = [] if in_group else [m for m, s in enumerate(specs) if s.nodes > 0]  # the group's to fill
        self.dataset = dataset

    def apply(self, batch: TrajectoryBatch, keys: list, texts: list[str]) -> TrajectoryBatch:
        """Score `batch` (keys ('train', prompt index) per row). A batch without reward parts has its rule reward in
        fixed['reward'] (the generators'); one with parts gets this process's models' columns filled in."""
        items = {i: dataset_item(self.dataset, i) for i in {int(k[1]) for k in keys}}
        n = self.mix.n_parts
        if len(batch) and (batch.fixed["n_reward_parts"] == n).all():
            parts = batch.reward_parts.reshape(len(batch), n).astype(np.float64)
        else:
            parts = np.zeros((len(batch), n), np.float64)
            parts[:, 0] = batch.fixed["reward"]
            parts[:, [1 + m for m in self.pending]] = PENDING
        domain = batch.fixed["domain"]
        applies = self.mix.applies(domain)
        for m, model in self.models.items():
            rows = np.flatnonzero(applies[:, m])
            parts[:, 1 + m] = 0.0
            if len(rows):
                mine = [items[int(keys[r][1])] for r in rows]
                parts[rows, 1 + m] = model.score(
                    [question_of(x) for x in mine], [texts[r] for r in rows], [_answer(x) for x in mine]
                )
        batch.reward_parts = parts.astype(np.float32).reshape(-1)
        batch.fixed["n_reward_parts"] = n
        if not np.isinf(parts).any():  # the raw combination, once every model has scored
            batch.fixed["reward"] = self.mix.raw_reward(parts[:, 0], parts[:, 1:], domain)
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
        pending = np.isinf(parts[:, 1:])
        if pending.any():
            raise ValueError(
                f"{int(pending.any(axis=1).sum())} record(s) reached the trainers without the score of reward model "
                f"'{self.mix.names[int(np.flatnonzero(pending.any(axis=0))[0])]}', which the reward group gives: the "
                "experience must flow generators -> reward group -> trainers"
            )
        domain = batch.fixed["domain"]
        batch.fixed["reward"] = self.mix.reward(parts, domain, self.norm)
        return self.mix.step_metrics(parts, domain)

    def state_dict(self) -> dict:
        return self.norm.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.norm.load_state_dict(state)
